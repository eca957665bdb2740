"""scripts/gpu_session.sh's own handling of its arguments, with stand-ins for python3 and nvidia-smi: a lease is
minutes long, and a script that stumbles on its OUT folder loses them."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.sh"


@pytest.fixture
def checkout(tmp_path):
    """A copy of the script in a checkout-shaped folder, and a PATH whose python3 and nvidia-smi only say they ran."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "gpu_session.sh")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in ("python3", "nvidia-smi"):
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*"\n')
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return root, {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "MEASURE_SECONDS": "60"}


def run(checkout, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    root, env = checkout
    return subprocess.run(
        ["bash", str(root / "scripts" / "gpu_session.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_bad_arguments_are_one_line_before_anything_runs(checkout, tmp_path):
    root, _ = checkout
    unknown = run(checkout, "mesure", "out", cwd=tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown part 'mesure'; the parts are")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    refused = run(checkout, "tests", str(a_file), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr == f"error: OUT {a_file} is a file; give a folder\n"
    no_wheels = run(checkout, "measure", "out", cwd=tmp_path)
    assert (
        no_wheels.returncode == 2
        and "no wheels in" in no_wheels.stderr
        and "gpu_session.sh wheels first" in (no_wheels.stderr)
    )
    assert not (tmp_path / "out").exists() and not no_wheels.stdout


def test_out_is_where_it_is_named_and_an_earlier_sessions_files_are_kept(checkout, tmp_path):
    """A relative OUT was made in the caller's folder and written in the checkout's; a second session into the same
    OUT truncated the first's files and appended to its status."""
    root, _ = checkout
    (root / ".whl").mkdir()
    (root / ".whl" / "loom-0-py3-none-any.whl").write_text("")
    caller = tmp_path / "caller"
    caller.mkdir()
    first = run(checkout, "tests", "relative/out", cwd=caller)
    assert first.returncode == 0, first.stderr
    status = caller / "relative" / "out" / "status_tests.txt"
    assert "nvidia-smi --query-gpu" in status.read_text() and "pytest -m gpu: exit 0" in status.read_text()
    assert not (root / "relative").exists()
    kept = status.read_text()
    again = run(checkout, "tests", "relative/out", cwd=caller)
    assert again.returncode == 2 and again.stderr.startswith(f"error: {status} exists (from an earlier tests)")
    assert status.read_text() == kept
    other_part = run(checkout, "profile", "relative/out", cwd=caller)  # another part's files beside them: fine
    assert other_part.returncode == 0, other_part.stderr
    assert (caller / "relative" / "out" / "status_profile.txt").exists() and status.read_text() == kept


def test_every_name_the_gpu_checks_import_from_loom_exists():
    """tests/test_gpu.py runs only on a lent GPU, and imports most of loom inside its checks: a name moved on CPU
    (tools/bench/mfu.py's write_random_tokens went to harness.py) would fail them there, minutes into a lease."""
    import ast
    import importlib

    source = SCRIPT.parents[1] / "tests" / "test_gpu.py"
    imports = [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loom")
        for alias in node.names
    ]
    assert len(imports) > 10
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
