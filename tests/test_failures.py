"""Failures that must end a run cleanly and in bounded time: stop signals, hung peers, NaN losses."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from loom.tools.synthetic_data import write_markov_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_markov_dataset(tmp_path_factory.mktemp("data") / "markov", vocab_size=4096, num_documents=200)


def train_command(dataset: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loom.launch.cli",
        "train",
        "--config",
        "configs/tiny.toml",
        "--nproc",
        "2",
        "--parallel.tp",
        "2",
        "--data.paths",
        dataset,
        "--data.tokenizer",
        "none",
        "--model.num_layers",
        "2",
        "--train.eval_interval",
        "0",
        "--train.log_interval",
        "1",
        "--train.tensorboard",
        "false",
        "--train.run_dir",
        str(run_dir),
        *extra,
    ]


def run(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout_s} s")


def test_sigterm_checkpoints_and_the_same_command_resumes_the_same_curve(dataset, tmp_path):
    steps = ["--train.steps", "24"]  # room between seeing step 2 and the signal's step boundary
    reference = run(train_command(dataset, tmp_path / "reference", *steps))
    assert reference.returncode == 0, reference.stderr

    command = train_command(dataset, tmp_path / "stopped", *steps)
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(tmp_path / "stopped", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    latest = (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("iter_"))
    assert 2 <= stopped_at < 24
    assert f"stopped by SIGTERM: checkpoint {tmp_path / 'stopped' / 'checkpoints' / latest} saved" in stderr
    assert [r["step"] for r in metrics(tmp_path / "stopped")] == list(range(1, stopped_at + 1))

    resumed = run(command)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'stopped' / 'checkpoints' / latest} at step {stopped_at}" in resumed.stdout
    rows, expected = metrics(tmp_path / "stopped"), metrics(tmp_path / "reference")
    assert [r["step"] for r in rows] == list(range(1, 25))
    for row, want in zip(rows, expected):
        assert math.isclose(row["loss"], want["loss"], rel_tol=1e-6), (row, want)


def test_hung_rank_becomes_a_timeout_error(dataset, tmp_path):
    start = time.monotonic()
    result = run(
        train_command(dataset, tmp_path, "--train.steps", "50", "--parallel.timeout_minutes", "0.1"),
        env={"LOOM_INJECT_HANG": "1:2"},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: rank 0 failed: a collective timed out after 0.1 min: a peer rank stopped answering"
    ), result.stderr
    assert elapsed < 60


def test_nan_loss_stops_and_leaves_the_last_good_checkpoint_newest(dataset, tmp_path):
    result = run(
        train_command(dataset, tmp_path, "--train.steps", "8", "--checkpoint.interval", "2"),
        env={"LOOM_INJECT_NAN": "5"},
    )
    assert result.returncode == 1
    assert "loss nan / gradient norm" in result.stderr and "at step 5 (train.nan_policy = stop)" in result.stderr
    assert f"the newest checkpoint is {tmp_path / 'checkpoints'} (step 4)" in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]


def model_tensors(checkpoint: Path) -> dict:
    tensors = {}
    for piece in sorted(checkpoint.glob("*.safetensors")):
        tensors.update({(piece.name, k): v for k, v in load_file(piece).items() if k.startswith("model")})
    return tensors


def test_nan_loss_under_skip_policy_drops_only_that_update(dataset, tmp_path):
    result = run(
        train_command(
            dataset,
            tmp_path,
            "--train.steps",
            "4",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep",
            "4",
            "--train.nan_policy",
            "skip",
        ),
        env={"LOOM_INJECT_NAN": "3"},
    )
    assert result.returncode == 0, result.stderr
    assert "update skipped (train.nan_policy = skip)" in result.stdout
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert math.isnan(rows[2]["loss"]) and rows[2]["nonfinite_skipped"] == 1
    assert math.isfinite(rows[3]["loss"]) and "nonfinite_skipped" not in rows[3]
    before, skipped, after = (model_tensors(tmp_path / "checkpoints" / f"iter_{s:07d}") for s in (2, 3, 4))
    assert before and before.keys() == skipped.keys()
    for key, value in before.items():
        assert (skipped[key] == value).all(), key
    assert any((after[key] != value).any() for key, value in before.items())


def test_ranks_die_with_a_killed_launcher(dataset, tmp_path):
    proc = subprocess.Popen(
        train_command(dataset, tmp_path, "--train.steps", "100000"),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(tmp_path, 1, proc)
    ranks = [
        int(pid)
        for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ]
    assert ranks
    proc.kill()  # SIGKILL: the launcher gets no chance to stop its ranks itself
    proc.wait()

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in ranks)
