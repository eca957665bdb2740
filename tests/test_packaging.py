"""The wheel as a user gets it: one `loom` namespace, presets inside, runnable away from the checkout.

The wheel is built from a copy of the checkout's files (what a clean clone holds, plus uncommitted
work), installed without dependencies into a fresh virtual environment in another directory, and
its `loom` command trains the `tiny` preset and prints a schedule there. The new environment reuses
this one's installed dependencies through a path entry, so nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from loom.tools.synthetic_data import write_markov_dataset

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGE_ROOTS = ("engine", "data_tools", "launch", "tools")


def _declared_packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_folder_with_an_init_is_a_declared_package():
    on_disk = ["loom"] + sorted(
        "loom." + ".".join(init.parent.relative_to(REPO).parts)
        for root in SUBPACKAGE_ROOTS
        for init in (REPO / root).rglob("__init__.py")
    )
    assert sorted(_declared_packages()) == sorted(on_disk)


# The first torch release with each call the code makes that older releases lack (torch's release notes).
FIRST_TORCH_WITH = {
    "enable_gqa=": (2, 5),  # F.scaled_dot_product_attention's grouped-query keyword
    "F.rms_norm(": (2, 4),
    "sdpa_kernel(": (2, 3),  # torch.nn.attention's backend selector
}


def test_declared_torch_floor_has_every_call_the_code_makes():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [d for d in dependencies if re.match(r"torch\b", d)]
    floor = tuple(int(part) for part in re.fullmatch(r"torch>=(\d+)\.(\d+)", requirement).groups())
    sources = {
        path.relative_to(REPO): path.read_text()
        for root in (*SUBPACKAGE_ROOTS, "tests")
        for path in (REPO / root).rglob("*.py")
        if path.name != "test_packaging.py"
    }
    for call, first_release in FIRST_TORCH_WITH.items():
        users = sorted(str(path) for path, text in sources.items() if call in text)
        needed = ".".join(map(str, first_release))
        assert not users or floor >= first_release, (
            f"{requirement} in pyproject.toml, but {', '.join(users)} call {call} (torch >= {needed})"
        )


def _checkout_copy(destination: Path) -> Path:
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the wheel is built from the checkout's tracked files")
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _run(command: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_wheel_installs_one_namespace_with_presets_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    source = _checkout_copy(tmp_path / "clone")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            tmp_path / "dist",
            source,
        ],
        cwd=tmp_path,
        env=env,
    )
    (wheel,) = (tmp_path / "dist").glob("loom-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"loom", wheel.name.split("-py")[0] + ".dist-info"}
    assert "loom/configs/tiny.toml" in names and "loom/data_tools/pipelines/default.toml" in names
    assert "loom/launch/cli.py" in names and not any(name.startswith("loom/tests/") for name in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=env)
    site_packages = next((venv / "lib").glob("python*/site-packages"))
    before = set(os.listdir(site_packages))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv / "bin" / "python",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            wheel,
        ],
        cwd=tmp_path,
        env=env,
    )
    added = set(os.listdir(site_packages)) - before
    assert {name for name in added if not name.endswith(".dist-info")} == {"loom"}, added
    # Dependencies (torch, numpy, ...) come from this environment; a plain path entry, so its
    # editable-install hook for the checkout is not run there.
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    located = _run([venv / "bin" / "python", "-c", "import loom; print(loom.__file__)"], cwd=elsewhere, env=env)
    assert Path(located.stdout.strip()).is_relative_to(site_packages)
    prefix = write_markov_dataset(elsewhere / "markov", vocab_size=4096, num_documents=40)
    trained = _run(
        [
            venv / "bin" / "loom",
            "train",
            "--config",
            "tiny",
            "--data.paths",
            prefix,
            "--data.tokenizer",
            "none",
            "--train.steps",
            "2",
            "--train.run_dir",
            "run",
            "--train.tensorboard",
            "false",
        ],
        cwd=elsewhere,
        env=env,
    )
    assert (elsewhere / "run" / "metrics.jsonl").is_file(), trained.stdout
    schedule = _run([venv / "bin" / "loom", "schedule", "--pp", "2", "--microbatches", "4"], cwd=elsewhere, env=env)
    assert "bubble" in schedule.stdout
