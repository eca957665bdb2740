"""User errors and bugs are told apart: a LoomError is one line, anything else keeps its traceback, rank and host."""

import contextlib
import errno
import os
import socket
import subprocess
from types import SimpleNamespace

import pytest
from training_runs import loom_here, mount_tmpfs, tiny_train_args, unmount

from loom.data_tools.jsonl import InputError
from loom.engine.checkpoint.format import CheckpointError
from loom.engine.config import ConfigError
from loom.engine.data.indexed import DatasetError, IndexFormatError
from loom.engine.faults import FaultPlan, InjectedFault
from loom.engine.pipeline.schedules import ScheduleError
from loom.errors import LoomError, TrainingDiverged, is_user_error
from loom.launch.local import describe_rank_error
from loom.tools.slurm_cluster import ClusterError

DOMAIN_ERRORS = [
    ConfigError,
    ScheduleError,
    IndexFormatError,
    DatasetError,
    CheckpointError,
    InputError,
    ClusterError,
    TrainingDiverged,
]


@pytest.mark.parametrize("error_type", DOMAIN_ERRORS)
def test_domain_errors_are_loom_errors_and_not_value_errors(error_type):
    assert issubclass(error_type, LoomError)
    assert not issubclass(error_type, ValueError)  # a bug's ValueError must not pass for the user's mistake
    assert is_user_error(error_type("x"))


def test_a_rank_error_is_one_line_for_the_user_and_typed_for_a_bug():
    assert describe_rank_error(ConfigError("set --model.vocab_size 512"), 10) == ("set --model.vocab_size 512", True)
    assert describe_rank_error(ValueError("shape mismatch\nmore"), 10) == ("ValueError: shape mismatch", False)
    message, user_error = describe_rank_error(RuntimeError("[gloo] Connection timed out"), 0.5)
    assert user_error and message.startswith("a collective timed out after 0.5 min")
    gloo = "[/pytorch/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1. This is typically caused"
    assert describe_rank_error(RuntimeError(gloo), 0.5) == (
        "a peer rank ended mid-collective (it crashed or was killed: its own output says why) "
        "[Connection closed by peer [10.0.0.2]:1]",
        True,
    )
    # a bug whose message mentions a timeout further down, another library's timeout, or the user's own line that
    # names a connection: each is what it says, not a lost peer
    bug = RuntimeError("shape mismatch in layer 3\nwhile the store timed out")
    assert describe_rank_error(bug, 0.5) == ("RuntimeError: shape mismatch in layer 3", False)
    # a failure the ranks agreed on names the rank that found it: "rank 0 on vm failed: rank 0 on vm: ..." said it
    # twice where that rank is the one reported
    from loom.launch.local import RankFailed, rank_failure

    found = "rank 0 on vm: cannot write the GPTDataset index cache in /data (Read-only file system)"
    assert str(RankFailed(0, found, "", host="vm")).startswith("rank 0 on vm failed: cannot write the GPTDataset")
    assert str(RankFailed(1, found, "", host="vm")) == f"rank 1 on vm failed: {found}"
    assert rank_failure(0, "vm", found) == str(RankFailed(0, found, "", host="vm"))  # what loom submit says too
    expired = subprocess.TimeoutExpired("nvcc", 5)
    assert describe_rank_error(expired, 0.5)[0].startswith("TimeoutExpired: Command 'nvcc' timed out")
    own = ConfigError("cannot reach the W&B server (Connection reset by peer); set --train.wandb false")
    assert describe_rank_error(own, 0.5) == (str(own), True)


def test_fault_plan_reads_each_switch_for_its_rank():
    environ = {"LOOM_INJECT_FAULT": "1:3", "LOOM_INJECT_HANG": "0:5", "LOOM_INJECT_NAN": "4,6"}
    assert FaultPlan.from_environment(1, environ) == FaultPlan(raise_before_step=3, nan_loss_at_steps=(4, 6))
    assert FaultPlan.from_environment(0, environ) == FaultPlan(hang_before_step=5, nan_loss_at_steps=(4, 6))
    assert FaultPlan.from_environment(0, {}) == FaultPlan()
    with pytest.raises(InjectedFault, match="at step 3"):
        FaultPlan(raise_before_step=3).before_step(3)
    FaultPlan(raise_before_step=3).before_step(2)


def test_a_pause_lasts_until_a_stop_is_requested():
    assert FaultPlan.from_environment(1, {"LOOM_INJECT_PAUSE": "2"}) == FaultPlan(pause_before_step=2)
    pause = FaultPlan(pause_before_step=2)
    pause.before_step(2)  # without a stop request to wait for (a trainer driven directly) there is no pause
    pause.before_step(1, SimpleNamespace(code=0))
    pause.before_step(2, SimpleNamespace(code=1))


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(60)


def _train(capfd, dataset, run_dir, *overrides):
    return loom_here(
        capfd, "train", *tiny_train_args(dataset, run_dir, "--nproc", "1", "--train.steps", "3", *overrides)
    )


def test_a_bug_in_a_rank_is_reported_with_its_traceback_rank_and_host(dataset, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("LOOM_INJECT_FAULT", "0:1")
    done = _train(capfd, dataset, tmp_path, "--train.eval_interval", "0")
    assert done.returncode == 1, done.stderr
    host = socket.gethostname()
    assert (
        f"error: rank 0 on {host} failed: InjectedFault: fault injected by LOOM_INJECT_FAULT at step 1" in done.stderr
    )
    assert f"traceback of rank 0 on {host}:" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr and "before_step" in done.stderr


def test_a_user_error_found_inside_a_rank_is_one_line(dataset, tmp_path, capfd):
    # Only a rank writes the dataset's index cache, so a cache folder that cannot be made is found there.
    (tmp_path / "a-file").write_text("")
    done = _train(capfd, dataset, tmp_path / "run", "--data.cache_dir", str(tmp_path / "a-file" / "cache"))
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: rank 0 on ") and "cannot write the GPTDataset index cache" in lines[-1], lines
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # failed before writing anything: no empty run folder left


def test_a_full_disk_under_the_metrics_names_the_file_in_one_line(tmp_path, capfd):
    """metrics.jsonl and TensorBoard's event file write to files opened earlier, whose OSError names no file: a
    run on a full disk ended in "[Errno 28] No space left on device" (nothing said where), TensorBoard's after
    a traceback from its writer thread."""
    from loom.engine.metrics import MetricsWriter
    from loom.errors import naming, user_message

    with pytest.raises(OSError) as raised, naming(tmp_path / "named"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (
        user_message(raised.value)
        == f"{tmp_path / 'named'}: No space left on device; free some space, or write elsewhere"
    )
    row = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "mem_gb": 0.1}
    for tensorboard, full in ((False, "metrics.jsonl"), (True, "tensorboard")):
        mount = tmp_path / f"tmpfs-{tensorboard}"
        mount_tmpfs(mount, "size=12k")
        writer = None
        try:
            writer = MetricsWriter(mount / "run", tensorboard=tensorboard)
            if tensorboard:  # its event file fills first
                (mount / "run" / "metrics.jsonl").unlink()
                writer.jsonl = open(os.devnull, "a")  # noqa: SIM115 - closed by the writer
            with pytest.raises(OSError) as raised:
                for step in range(1, 10_000):
                    writer.write({**row, "step": step, "note": "x" * 200})
            assert user_message(raised.value).startswith(f"{mount / 'run' / full}: No space left on device; free")
            assert "Traceback" not in capfd.readouterr().err
        finally:
            if writer is not None:
                with contextlib.suppress(OSError):  # its files open would keep the mount busy
                    writer.close()
            unmount(mount)
    # the run's lock, on a disk already full: named, and its empty file not left behind
    from loom.engine.run_lock import LOCK_FILE, RunLock

    mount = tmp_path / "tmpfs-lock"
    mount_tmpfs(mount, "size=8k")
    try:
        (mount / "run").mkdir()
        filler = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        with pytest.raises(OSError) as raised:
            RunLock(mount / "run")
        assert user_message(raised.value).startswith(f"{mount / 'run' / LOCK_FILE}: No space left on device")
        assert list((mount / "run").iterdir()) == []
    finally:
        unmount(mount)


def test_an_emptied_or_cut_tokenizer_is_said_as_such(tmp_path):
    from loom.engine.data.tokenizer_json import TokenizerError, open_tokenizer

    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match=r"empty\.model is empty \(0 bytes\): copy it again"):
        open_tokenizer(tmp_path / "empty.model")
    (tmp_path / "cut.model").write_bytes(b"\x0a\x0b\x0a\x05hello")
    with pytest.raises(TokenizerError, match=r"cut\.model is not a SentencePiece model \(truncated\?"):
        open_tokenizer(tmp_path / "cut.model")
