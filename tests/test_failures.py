"""Failures that must end a run cleanly: stop signals, hung peers, NaN losses, a killed launcher."""

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from training_runs import HANG_S, loom_here, read_metrics, read_output_until, tiny_train_args, wait_for, wait_for_step

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(200)


def train_command(dataset: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loom.launch.cli",
        "train",
        *tiny_train_args(
            dataset,
            run_dir,
            "--nproc",
            "2",
            "--parallel.tp",
            "2",
            "--model.num_layers",
            "2",
            "--train.global_batch_size",
            "8",
            *extra,
        ),
    ]


@pytest.fixture
def run_here(capfd, monkeypatch):
    """run() for the stories whose command only needs to fail as it would (not to be signalled itself): `loom
    train` through its entry point in this process, its ranks forked from the warm fork server with `env` added
    to the environment they get from the launcher."""

    def run_in_this_process(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        return loom_here(capfd, *command[3:])  # without `python -m loom.launch.cli`

    return run_in_this_process


def run(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HANG_S,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


@contextlib.contextmanager
def in_its_own_process_group(command: list[str], stderr_path: Path, **env: str) -> Iterator[subprocess.Popen]:
    """`command` started as a terminal starts it (a process group of its own, which a test can signal whole), its
    stdout a pipe, its stderr a file; whatever is left of the group is killed when the block ends, pass or fail."""
    with open(stderr_path, "w") as stderr_file:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def signal_once_seen(command: list[str], line: str, stderr_path: Path, **env: str) -> tuple[subprocess.Popen, str]:
    """Start `command`, send SIGTERM to it alone once its stdout shows `line`, wait; the process and its stderr."""
    with in_its_own_process_group(command, stderr_path, **env) as proc:
        read_output_until(proc, line)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
    return proc, stderr_path.read_text()


def test_sigterm_checkpoints_and_the_same_command_resumes_the_same_curve(dataset, tmp_path, run_here):
    from loom.launch.cli import main

    steps = ["--train.steps", "6"]
    main(train_command(dataset, tmp_path / "reference", *steps)[3:])  # the uninterrupted run, in this process

    command = train_command(dataset, tmp_path / "stopped", *steps)
    # The ranks wait before step 2 until the signal reaches them, so the run cannot finish before it
    # however slow the machine.
    proc, stderr = signal_once_seen(command, "paused before step 2", tmp_path / "stopped.stderr", LOOM_INJECT_PAUSE="2")
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    latest = (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("iter_"))
    assert stopped_at == 3  # the step begun when the signal came, then the checkpoint
    assert f"stopped by SIGTERM: checkpoint {tmp_path / 'stopped' / 'checkpoints' / latest} saved" in stderr
    assert [r["step"] for r in read_metrics(tmp_path / "stopped")] == list(range(1, stopped_at + 1))

    resumed = run_here(command)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'stopped' / 'checkpoints' / latest} at step {stopped_at}" in resumed.stdout
    rows, expected = read_metrics(tmp_path / "stopped"), read_metrics(tmp_path / "reference")
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row, want in zip(rows, expected):
        assert math.isclose(row["loss"], want["loss"], rel_tol=1e-6), (row, want)


def test_a_stop_to_the_whole_process_group_says_what_was_saved(dataset, tmp_path):
    """Ctrl-C in a terminal, systemd, `docker stop` and `kill -- -PGID` signal the launcher, its ranks and the server
    they fork from at once. The server died of it, the launcher then read 255 for each rank, and said "nothing to
    resume" of a run that had saved its checkpoint (a user could believe it and start over)."""
    command = train_command(dataset, tmp_path / "run", "--train.steps", "6")
    with in_its_own_process_group(command, tmp_path / "stderr", LOOM_INJECT_PAUSE="2") as proc:
        read_output_until(proc, "paused before step 2")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=HANG_S)
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    latest = tmp_path / "run" / "checkpoints" / "latest"
    assert f"stopped by SIGTERM: checkpoint {latest.parent / latest.read_text().strip()} saved" in stderr


def test_a_stop_sent_to_one_rank_is_not_reported_as_a_finished_run(dataset, tmp_path, run_here):
    """SIGTERM to a rank alone: the ranks agree, save and stop, as for the launcher's; the launcher exited 0, so
    `loom train ... && loom ckpt export-hf ...` went on with an unfinished model."""
    result = run_here(train_command(dataset, tmp_path, "--train.steps", "50"), env={"LOOM_INJECT_KILL": "1:2:TERM"})
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    latest = tmp_path / "checkpoints" / "latest"
    saved = latest.parent / latest.read_text().strip()
    line = result.stderr.strip().splitlines()[-1]
    assert line == f"stopped by SIGTERM (sent to rank 1): checkpoint {saved} saved; run the same command to resume " \
        "from it"  # fmt: skip
    assert read_metrics(tmp_path)[-1]["step"] < 50


def test_an_evaluation_stops_at_once_on_ctrl_c(dataset, tmp_path, run_here):
    """loom eval kept evaluating to its last batch after Ctrl-C (its ranks deferred the stop to a step boundary
    that an evaluation never reaches), then printed a training run's message and the resource tracker's warning."""
    trained = run_here(
        train_command(dataset, tmp_path / "run", "--train.steps", "1", "--checkpoint.save_at_end", "true")
    )
    assert trained.returncode == 0, trained.stderr
    command = [sys.executable, "-m", "loom.launch.cli", "eval", "--checkpoint", str(tmp_path / "run")]
    command += ["--data", dataset, "--iters", "100000", "--nproc", "2", "--parallel.tp", "2"]
    with in_its_own_process_group(command, tmp_path / "stderr") as proc:
        wait_for(lambda: "batch/s" in (tmp_path / "stderr").read_text(), "the evaluation under way", proc)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=HANG_S)
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, stderr
    *_, bar, message = stderr.splitlines()  # the bar's last update on a line of its own, then the stop
    assert message == "stopped by SIGINT before the evaluation finished" and bar.endswith("]"), stderr[-2000:]
    assert stderr.endswith(f"{bar}\n{message}\n")
    assert "validation loss" not in stdout and "checkpoint" not in stderr and "leaked" not in stderr


def test_a_stop_during_start_up_is_honoured_or_says_nothing_was_saved(dataset, tmp_path):
    """The ranks are still importing torch when the signal comes, or not forked yet (the rank server is still
    importing): they keep it and checkpoint at the first step boundary, or (killed before they could catch it) the
    launcher says that nothing was saved. Ranks forked after the stop were never told and trained all 50 steps."""
    command = train_command(dataset, tmp_path / "run", "--train.steps", "50")
    proc, stderr = signal_once_seen(command, "loom train:", tmp_path / "stderr")
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    latest = tmp_path / "run" / "checkpoints" / "latest"
    if latest.exists():
        assert f"checkpoint {latest.parent / latest.read_text().strip()} saved" in stderr
        assert read_metrics(tmp_path / "run")[-1]["step"] < 50  # (test_launch.py forces the not-forked case)
    else:
        assert "stopped by SIGTERM before a checkpoint was written; nothing to resume" in stderr


def test_a_second_stop_signal_stops_at_once(dataset, tmp_path):
    """A stop waits for a step boundary; when a hung rank never reaches one, a second signal ends the run.
    Rank 0 hangs right after logging step 1, before the next step's transfer could carry the stop: had it
    hung one step later, a signal landing during step 2 was agreed there and the run stopped cleanly."""
    command = train_command(dataset, tmp_path / "run", "--train.steps", "50", "--parallel.timeout_minutes", "30")
    with open(tmp_path / "stderr", "w") as stderr_file:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "LOOM_INJECT_HANG": "0:1"},
            stdout=subprocess.DEVNULL,
            stderr=stderr_file,
        )
        wait_for_step(tmp_path / "run", 1, proc)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "send it again to stop at once" in (tmp_path / "stderr").read_text(), "first stop told", proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped at once by a second SIGTERM: the ranks were killed without saving" in stderr


def test_hung_rank_becomes_a_timeout_error(dataset, tmp_path, run_here):
    result = run_here(
        train_command(dataset, tmp_path, "--train.steps", "50", "--parallel.timeout_minutes", "0.1"),
        env={"LOOM_INJECT_HANG": "1:2"},
    )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: rank 0 on {socket.gethostname()} failed: "
        "a collective timed out after 0.1 min: a peer rank stopped answering"
    ), result.stderr


def test_a_model_too_big_for_the_rank_s_memory_is_one_line_not_the_allocator_s_traceback(dataset, tmp_path, run_here):
    """A width (or an expert count) far beyond the machine: the first weight cannot be allocated (4 TB per rank at
    tp 2, which no overcommit grants), and the rank says so in one line."""
    command = train_command(dataset, tmp_path, "--model.hidden_size", "1000000", "--model.num_heads", "8")
    result = run_here(command)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "failed: the model's weights do not fit in this rank's memory (3,725 GiB for one tensor)" in line, line


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_it_broke(dataset, tmp_path, run_here):
    """The OOM killer's SIGKILL leaves no report from the dead rank; rank 0's broken connection reaches the
    launcher as a Python error. The message blames the killed rank."""
    result = run_here(train_command(dataset, tmp_path, "--train.steps", "50"), env={"LOOM_INJECT_KILL": "1:2"})
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1 failed: killed by SIGKILL (the kernel's OOM killer"), result.stderr
    assert "; the last step logged was 2;" in line


def test_a_rank_aborted_like_by_the_nccl_watchdog_is_named_with_the_likely_cause(dataset, tmp_path, run_here):
    """Under NCCL a timed-out collective aborts the rank (SIGABRT) before Python can report it."""
    result = run_here(train_command(dataset, tmp_path, "--train.steps", "50"), env={"LOOM_INJECT_KILL": "0:3:ABRT"})
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 0 failed: killed by SIGABRT (under NCCL, the watchdog aborts"), result.stderr
    assert "the last step logged was 3" in line


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nan_loss_stops_and_leaves_the_last_good_checkpoint_newest(dataset, tmp_path, run_here, precision):
    """Under fp16 a NaN loss (its gradients NaN too) was taken for a loss-scale overflow: the run trained on, saved
    checkpoints of a model whose loss is NaN and rotated the good ones away, then ended 0."""
    result = run_here(
        train_command(
            dataset, tmp_path, "--train.steps", "8", "--checkpoint.interval", "2", "--train.precision", precision
        ),  # fmt: skip
        env={"LOOM_INJECT_NAN": "5"},
    )
    assert result.returncode == 1
    assert "loss nan / gradient norm" in result.stderr and "at step 5 (train.nan_policy = stop)" in result.stderr
    assert f"the newest checkpoint is {tmp_path / 'checkpoints'} (step 4)" in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def model_tensors(checkpoint: Path) -> dict:
    tensors = {}
    for piece in sorted(checkpoint.glob("*.safetensors")):
        tensors.update({(piece.name, k): v for k, v in load_file(piece).items() if k.startswith("model")})
    return tensors


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nan_loss_under_skip_policy_drops_only_that_update(dataset, tmp_path, run_here, precision):
    """Under fp16 the loss scaler took the NaN loss's step for an overflow too: it lowered the scale and counted it.
    The skipped update holds the learning rate, in this job and in the next (the count is in the checkpoint)."""
    command = train_command(
        dataset, tmp_path, "--train.steps", "4", "--checkpoint.interval", "1", "--checkpoint.keep", "4",
        "--train.nan_policy", "skip", "--train.precision", precision, "--optim.lr", "6e-3", "--optim.warmup_steps", "6",
    )  # fmt: skip
    result = run_here(command, env={"LOOM_INJECT_NAN": "3"})
    assert result.returncode == 0, result.stderr
    assert "update skipped (train.nan_policy = skip)" in result.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] is None and rows[2]["grad_norm"] is None and rows[2]["nonfinite_skipped"] == 1
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2], parse_constant=pytest.fail)  # no NaN
    assert math.isfinite(rows[3]["loss"]) and "nonfinite_skipped" not in rows[3]
    if precision == "fp16":
        assert [(r["loss_scale"], r["skipped_steps"]) for r in rows] == [(rows[0]["loss_scale"], 0)] * 4
        assert "overflowed" not in result.stdout
    before, skipped, after = (model_tensors(tmp_path / "checkpoints" / f"iter_{s:07d}") for s in (2, 3, 4))
    assert before and before.keys() == skipped.keys()
    for key, value in before.items():
        assert (skipped[key] == value).all(), key
    assert any((after[key] != value).any() for key, value in before.items())
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])  # warmup: 6e-3 * (s + 1) / 6
    if precision == "fp32":
        resumed = run_here([*command, "--train.steps", "5"])
        assert resumed.returncode == 0, resumed.stderr
        assert read_metrics(tmp_path)[-1]["lr"] == pytest.approx(4e-3)


def test_non_finite_steps_in_a_row_are_counted_across_jobs(dataset, tmp_path, run_here):
    """train.max_skipped_steps counted from 0 in each job: a run chained by train.exit_after (or requeued) skipped
    non-finite steps forever."""
    command = train_command(
        dataset, tmp_path, "--train.steps", "6", "--checkpoint.interval", "1", "--train.nan_policy", "skip",
        "--train.max_skipped_steps", "1", "--train.exit_after", "3",
    )  # fmt: skip
    env = {"LOOM_INJECT_NAN": "3,4"}
    first = run_here(command, env=env)
    assert first.returncode == 0 and "at step 3: update skipped" in first.stdout, first.stderr
    second = run_here(command, env=env)
    assert second.returncode == 1
    assert "at step 4: 2 non-finite steps in a row (train.max_skipped_steps = 1)" in second.stderr, second.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000003"


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

    wait_for(lambda: not any(alive(pid) for pid in ranks), "the ranks gone with their launcher")
