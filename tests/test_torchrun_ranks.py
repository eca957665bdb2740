"""`loom train` as one rank of a torchrun or srun launch (RANK, WORLD_SIZE and MASTER_* in the environment), each
rank a process with its own command line and working directory, as on separate nodes: what a multi-node sweep on
one machine found."""

import os
import signal
import socket
import subprocess
import sys

import pytest
from training_runs import HANG_S, loom_here, read_metrics, tiny_train_args, wait_for

from loom.engine.parallel.rendezvous import free_port

LOOM = [sys.executable, "-m", "loom.launch.cli"]


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(200)


def _ranks(commands: list[tuple[list[str], str]], port: int) -> list[subprocess.CompletedProcess]:
    """Start one `loom train` per (flags, working directory) as ranks 0..N-1 of one launch; their results."""
    return _results(_start_ranks(commands, port))


def _start_ranks(commands: list[tuple[list[str], str]], port: int) -> list[subprocess.Popen]:
    world = len(commands)
    processes = []
    for rank, (flags, cwd) in enumerate(commands):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        processes.append(
            subprocess.Popen(
                [*LOOM, "train", *flags], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )  # fmt: skip
        )
    return processes


def _results(processes: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    results = []
    for process in processes:
        out, err = process.communicate(timeout=HANG_S)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def _refused_on_every_rank(results: list[subprocess.CompletedProcess], *fragments: str) -> None:
    for result in results:
        assert result.returncode == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and all(fragment in last for fragment in fragments), result.stderr


def test_ranks_given_other_settings_or_a_run_directory_they_do_not_share_are_refused_at_once(dataset, tmp_path):
    """Nodes started with another train.steps trained on two learning-rate schedules side by side, said nowhere,
    until they hung at the first save; another tp hung at once (the same check, any setting: not repeated here); a
    node with a run directory of its own (no shared filesystem) failed the first save, after all the training before
    it. Each is one line on every rank now, before the first step (a hang would fail this test on its timeout). So
    is a data.cache_dir not shared."""
    host = socket.gethostname()
    args = [*tiny_train_args(dataset, "runs/r", "--train.steps", "4"), "--parallel.timeout_minutes", "0.5"]
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    node0, node1 = str(tmp_path / "node0"), str(tmp_path / "node1")
    results = _ranks([(args, node0), ([*args, "--train.steps", "12"], node0)], free_port())
    _refused_on_every_rank(
        results, f"rank 1 on {host} was given other settings than rank 0 on {host} (train.steps: 4 on rank 0, 12 on "
        "rank 1); start every rank with the same command"
    )  # fmt: skip
    results = _ranks([(args, node0), (args, node1)], free_port())  # the same relative runs/r, on other disks
    _refused_on_every_rank(results, "run directory runs/r is not shared: rank 1 on", "on a filesystem every node")
    assert not (tmp_path / "node1" / "runs" / "r" / "checkpoints").exists()
    assert not (tmp_path / "node0" / "runs" / "r" / ".loom-shared-check").exists()
    # a shared run directory, but the sample-index caches on each node's own disk: rank 0 waited out the timeout
    unshared_cache = [*tiny_train_args(dataset, tmp_path / "shared"), "--data.cache_dir", "cache", *args[-2:]]
    results = _ranks([(unshared_cache, node0), (unshared_cache, node1)], free_port())
    _refused_on_every_rank(results, f"rank 1 on {host}: GPTDataset index cache", "every rank shares")
    results = _ranks([(args, node0), (args, node0)], free_port())  # the same, on one shared folder: trains
    assert [result.returncode for result in results] == [0, 0], results[1].stderr
    assert [row["step"] for row in read_metrics(tmp_path / "node0" / "runs" / "r") if "loss" in row] == list(
        range(1, 5)
    )
    assert "tp=1 pp=1 dp=2, run directory runs/r" in results[0].stdout  # the layout, as --nproc says it
    assert not (tmp_path / "node0" / "runs" / "r" / ".loom-shared-check").exists()


def test_a_rank_stopped_before_the_last_step_exits_as_stopped_not_as_done(dataset, tmp_path):
    """Under torchrun a SIGTERM saved a checkpoint and the rank exited 0: torchrun (and a script) saw a finished
    run, and on two nodes the other node's torchrun waited at its exit barrier for an agent already gone."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    args = tiny_train_args(dataset, tmp_path, "--train.steps", "100000", "--train.log_interval", "1")
    rank = subprocess.Popen([*LOOM, "train", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(read_metrics(tmp_path)) >= 1, "a first step", rank)
        rank.send_signal(signal.SIGTERM)
        out, err = rank.communicate(timeout=HANG_S)
    finally:
        rank.kill()
    assert rank.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint of step" in out + err and (tmp_path / "checkpoints" / "latest").is_file()


def test_a_rank_killed_mid_run_is_named_on_the_others_with_the_checkpoint_to_resume(dataset, tmp_path):
    """kill -9 of one rank under torchrun left the others with gloo's traceback ("Connection closed by peer ...
    GLHF!"), naming no checkpoint; they now say what --nproc's launcher would, and where the run stands."""
    args = tiny_train_args(dataset, tmp_path, "--train.steps", "100000", "--checkpoint.interval", "2")
    ranks = _start_ranks([(args, str(tmp_path)), (args, str(tmp_path))], free_port())
    try:
        wait_for(lambda: (tmp_path / "checkpoints" / "latest").is_file(), "a first checkpoint", ranks[0])
        ranks[1].kill()
        survivor = _results(ranks)[0]
    finally:
        for rank in ranks:
            rank.kill()
    last = survivor.stderr.strip().splitlines()[-1]
    assert survivor.returncode == 1, survivor.stderr
    assert last.startswith(f"error: rank 0 on {socket.gethostname()} failed: a peer rank ended mid-collective"), last
    assert "start the same command on every node to continue" in last  # gloo says closed, reset or broken pipe
    assert "Traceback" not in survivor.stderr


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_are_not_ranks_of_a_launch(command, dataset, tmp_path, capfd, monkeypatch):
    """Under torchrun each process ran the whole evaluation (or generation): every node printed the same result."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = ["--data.paths", dataset] if command == "eval" else []
    result = loom_here(capfd, command, "--checkpoint", str(tmp_path), *data)
    assert result.returncode == 2
    assert f"error: loom {command} starts its own ranks (--nproc N), but RANK=1, WORLD_SIZE=2" in result.stderr
