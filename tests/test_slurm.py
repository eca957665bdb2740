"""`loom submit` against a real Slurm cluster on this machine (tools/slurm_cluster.py), on CPU with gloo.

The cluster is started once per session (installing Debian's Slurm and munge when missing) unless
SLURM_CONF already names one; without root or apt the tests skip and say why.
"""

import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from training_runs import HANG_S, loom_here, one_line_error, read_metrics, read_output_until, tiny_train_args, wait_for

from loom.engine.config import ConfigError
from loom.engine.config_io import load_config
from loom.launch.local import SIGNAL_CAUSES
from loom.launch.slurm import (
    SlurmOptions,
    executor_parameters,
    parse_sbatch_options,
    parse_time_minutes,
)
from loom.launch.slurm_jobs import check_no_job_queued

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
TASKS = "2"  # tp 1 x pp 2: every rank imports torch itself under srun, the slow part of a job on 2 cores


def _free_port_pair() -> int:
    for _ in range(100):
        port = random.randrange(20000, 30000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.environ.get("SLURM_CONF"):
        yield dict(os.environ)
        return
    from loom.tools import slurm_cluster

    # Not under pytest's tmp_path: munged wants every folder above its socket world-executable.
    folder = Path(tempfile.mkdtemp(prefix="loom-slurm-"))
    try:
        env = slurm_cluster.up(folder, nodes=1, cpus=8, port=_free_port_pair())
    except slurm_cluster.ClusterError as error:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no local Slurm cluster: {error}")
    try:
        yield {**os.environ, **env}
    finally:
        slurm_cluster.down(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(200)


def loom(*args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=timeout,
    )


def training_args(dataset: str, run_dir: Path, *extra: str) -> list[str]:
    return tiny_train_args(dataset, run_dir, "--parallel.pp", "2", "--train.steps", str(STEPS), *extra)


def job_count(env: dict) -> int:
    """Jobs slurmctld knows, less the records it keeps of submissions sbatch refused (never run)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %r"], capture_output=True, text=True, env=env).stdout
    return sum(not line.endswith("BadConstraints") for line in out.splitlines())


def submit_in_background(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loom.launch.cli", "submit", *args],
        cwd=REPO,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def job_processes(run_dir: Path) -> list[str]:
    out = subprocess.run(
        ["pgrep", "-af", f"submitit.core._submit {run_dir / 'slurm'}"], capture_output=True, text=True
    ).stdout
    return out.splitlines()


@pytest.fixture(scope="module")
def local_reference(dataset, tmp_path_factory):
    from loom.launch.cli import main

    run_dir = tmp_path_factory.mktemp("local")
    main(["train", "--nproc", TASKS, *training_args(dataset, run_dir)])
    return read_metrics(run_dir)


def assert_same_curve(rows: list[dict], reference: list[dict], rel: float, steps: int = STEPS) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["step"] for r in reference] == list(range(1, steps + 1))
    for row, want in zip(rows, reference):
        assert math.isclose(row["loss"], want["loss"], rel_tol=rel), (row, want)


def test_a_preempted_job_checkpoints_requeues_and_gives_the_local_curve(slurm, dataset, local_reference, tmp_path):
    """One job on 1 x 2 tasks (pp 2), preempted (SIGUSR2) at step 3: it checkpoints step 4, requeues itself, resumes and
    completes, and its curve is the one `loom train --nproc 2` gives (equal before the stop, 1e-6 after)."""
    # The ranks wait before step 3 until the signal reaches them, so the job cannot finish before it however
    # slow the machine; the requeued job resumes past step 3 and does not wait again.
    proc = submit_in_background(
        {**slurm, "LOOM_INJECT_PAUSE": "3"},
        "--tasks-per-node",
        TASKS,
        "--time",
        "10",
        "--wait",
        *training_args(dataset, tmp_path),
    )
    before_signal = read_output_until(proc, "paused before step 3")
    job_id = (tmp_path / "slurm" / "jobs.jsonl").read_text().split('"job_id": "')[1].split('"')[0]
    subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm, check=True)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    stdout = before_signal + stdout
    assert proc.returncode == 0, stdout + stderr
    assert "submitted job" in stdout and "COMPLETED" in stdout
    assert f"step {STEPS:>6}/{STEPS} | loss" in stdout  # --wait followed rank 0's log, past the requeue
    assert "stop requested: checkpoint of step 4" in stdout
    assert f"job {job_id} requeued" in stdout
    assert "(requeued: it resumes from its last checkpoint when it starts again)" in stdout  # --wait says why PENDING
    resumed_at = int(stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert resumed_at == 4
    # Every rank ended on the requeue's SIGTERM: none sat out KillWait until srun killed it, holding the nodes.
    log = (tmp_path / "slurm" / f"{job_id}_0_log.out").read_text()
    assert "Terminated" in log and "Killed" not in log, log
    rows = read_metrics(tmp_path)
    assert_same_curve(rows[:4], local_reference[:4], rel=0.0, steps=4)
    assert_same_curve(rows, local_reference, rel=1e-6)


def test_a_sigterm_without_a_cancel_ends_wait_with_an_error_and_leaves_no_process(slurm, dataset, tmp_path):
    """SIGTERM (an admin's, a drain script's) checkpoints and ends the ranks; Slurm then calls the job COMPLETED,
    and `--wait` exited 0 with the training unfinished. (scancel's CANCELLED and a rank's FAILED take the
    not-COMPLETED path that the failing-rank test checks.)"""
    proc = submit_in_background(
        slurm,
        "--tasks-per-node",
        "2",
        "--time",
        "10",
        "--wait",
        *training_args(dataset, tmp_path, "--parallel.pp", "1", "--train.steps", "100000"),
    )
    wait_for(lambda: len(read_metrics(tmp_path)) >= 1, "the first step logged", proc)
    job_id = (tmp_path / "slurm" / "jobs.jsonl").read_text().split('"job_id": "')[1].split('"')[0]
    subprocess.run(["scancel", "--signal=TERM", job_id], env=slurm, check=True)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1, stderr
    assert f"error: job {job_id} ended COMPLETED, but a stop signal (SIGTERM without a requeue) ended" in stderr
    assert (tmp_path / "checkpoints" / "latest").is_file()
    wait_for(lambda: not job_processes(tmp_path), "the job's processes gone")


def failed_job(slurm: dict, dataset: str, run_dir: Path, **fault: str) -> tuple[str, str]:
    """`loom submit --wait` of a job whose rank 1 fails as `fault` (LOOM_INJECT_* variables) at step 2: (its
    `error: job ...` line, its whole stderr), after checking it exits 1 and leaves no process."""
    result = loom(
        "submit",
        "--tasks-per-node",
        TASKS,
        "--time",
        "10",
        "--wait",
        *training_args(dataset, run_dir),
        env={**slurm, **fault},
    )
    assert result.returncode == 1, result.stderr
    wait_for(lambda: not job_processes(run_dir), "the job's processes gone")
    return next((line for line in result.stderr.splitlines() if line.startswith("error: job ")), ""), result.stderr


def test_failing_rank_ends_the_job_with_its_message(slurm, dataset, tmp_path):
    error, stderr = failed_job(slurm, dataset, tmp_path, LOOM_INJECT_FAULT="1:2")
    assert " ended FAILED: rank 1 on " in error, stderr
    assert error.endswith("failed: InjectedFault: fault injected by LOOM_INJECT_FAULT at step 2"), error
    assert "Traceback (most recent call last)" in stderr.split(error)[1], stderr  # a bug's, after it


def test_a_queued_job_keeps_other_launches_out_of_its_run_directory(slurm, dataset, tmp_path, capfd, monkeypatch):
    """A job held in the queue does not hold the run lock yet (its ranks take it): a second `loom submit` or a
    local `loom train` into its run directory is refused until it ends, then allowed."""
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    args, before = training_args(dataset, tmp_path), job_count(slurm)
    held = loom_here(capfd, "submit", "--tasks-per-node", TASKS, "--time", "10", "--sbatch", "hold=true", *args)
    assert held.returncode == 0, held.stderr
    job_id = (tmp_path / "slurm" / "jobs.jsonl").read_text().split('"job_id": "')[1].split('"')[0]
    try:
        for command in (["submit", "--tasks-per-node", TASKS, "--time", "10"], ["train", "--nproc", TASKS]):
            refused = loom_here(capfd, *command, *args)
            one_line_error(refused, f"belongs to Slurm job {job_id}, which is PENDING", f"scancel {job_id}")
        assert job_count(slurm) == before + 1
        # where squeue cannot reach the controller the job may still be queued: refused too
        unreachable = tmp_path.parent / f"{tmp_path.name}-bin"
        unreachable.mkdir()
        (unreachable / "squeue").write_text(
            "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n"
        )
        (unreachable / "squeue").chmod(0o755)
        monkeypatch.setenv("PATH", f"{unreachable}:{slurm['PATH']}")
        refused = loom_here(capfd, "train", "--nproc", TASKS, *args)
        one_line_error(refused, f"records Slurm job {job_id}, and squeue cannot say whether it is still queued")
        monkeypatch.setenv("PATH", slurm["PATH"])
    finally:
        subprocess.run(["scancel", job_id], env=slurm, check=True)

    def allowed() -> bool:
        try:
            check_no_job_queued(tmp_path)
        except ConfigError:
            return False
        return True

    wait_for(allowed, "the cancelled job no longer keeping launches out")


def test_two_submissions_racing_into_one_run_directory_cannot_both_pass(slurm, dataset, tmp_path, capfd, monkeypatch):
    """Each submission checks the queue and then submits: a rival that recorded its job in between, or is
    submitting right now (it holds the run lock until its job is recorded), refuses the other."""
    import loom.engine.preflight
    from loom.engine.run_lock import RunLock

    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    args, before = [*training_args(dataset, tmp_path), "--tasks-per-node", TASKS], job_count(slurm)
    rival = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--wrap", "sleep 1"], capture_output=True, text=True, env=slurm, check=True
    ).stdout.strip()
    real_preflight = loom.engine.preflight.preflight

    def rival_records_its_job_after_the_first_check(*a, **k):
        real_preflight(*a, **k)
        (tmp_path / "slurm").mkdir(parents=True, exist_ok=True)
        (tmp_path / "slurm" / "jobs.jsonl").write_text(f'{{"job_id": "{rival}"}}\n')

    try:
        monkeypatch.setattr(loom.engine.preflight, "preflight", rival_records_its_job_after_the_first_check)
        one_line_error(loom_here(capfd, "submit", *args), f"belongs to Slurm job {rival}, which is PENDING")
        monkeypatch.setattr(loom.engine.preflight, "preflight", real_preflight)
        (tmp_path / "slurm" / "jobs.jsonl").unlink()
        submitting = RunLock(tmp_path, command="submit")
        try:
            refused = loom_here(capfd, "submit", *args)
        finally:
            submitting.close()
        one_line_error(refused, f"is in use by `loom submit` submitting a job (pid {os.getpid()} on ")
        assert job_count(slurm) == before + 1  # the rival alone
    finally:
        subprocess.run(["scancel", rival], env=slurm, check=True)


def test_a_complete_run_is_not_submitted_again(slurm, dataset, tmp_path, capfd, monkeypatch):
    """Resubmitting a finished run took an allocation (and its wait in the queue) to say "nothing to train"."""
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    args = [*training_args(dataset, tmp_path, "--parallel.pp", "1"), "--train.steps", "1"]
    trained = loom_here(capfd, "train", *args, "--checkpoint.save_at_end", "true")
    assert trained.returncode == 0, trained.stderr
    before = job_count(slurm)
    refused = loom_here(capfd, "submit", "--tasks-per-node", "1", *args)
    one_line_error(refused, "nothing to train: the run in", "is complete at step 1 of train.steps = 1")
    assert job_count(slurm) == before and not (tmp_path / "slurm").exists()


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_it_broke(slurm, dataset, tmp_path):
    """The OOM killer's SIGKILL leaves no report from the dead rank; `--wait` blamed rank 0's broken connection
    (a gloo 'Connection reset by peer'). srun's own line names the task."""
    error, _ = failed_job(slurm, dataset, tmp_path, LOOM_INJECT_KILL="1:2")
    assert " ended FAILED: rank 1 on " in error and error.endswith("was killed by SIGKILL" + SIGNAL_CAUSES["SIGKILL"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--partition", "nosuch"], "error: partition 'nosuch' does not exist; sinfo lists: debug"),
        (
            ["--tasks-per-node", "3"],
            "error: the allocation has 1 node(s) x 3 task(s) = 3 ranks, but world size 3 != tp*pp*dp = 2*2*2",
        ),
        (
            ["--train.run_dir", "/etc/hostname/run"],
            "error: run directory /etc/hostname/run is not writable: Not a directory",
        ),
        (["--time", "0:05"], "error: --time gives 1 min (Slurm counts whole minutes), which leaves no room before"),
        (["--sbatch", "comment=a\nb"], "error: --sbatch comment: the value contains a control character"),
        (["--job-name", "a\nb"], "error: --job-name: the value contains a control character"),  # sbatch's fatal
        (
            ["--mem-gb", "100000"],
            "error: sbatch refused the job: Memory specification can not be satisfied; "
            "Batch job submission failed: Requested node configuration is not available",
        ),
    ],
)
def test_bad_submission_is_one_line_and_submits_nothing(slurm, dataset, tmp_path, args, message, capfd, monkeypatch):
    before = job_count(slurm)
    for name, value in slurm.items():  # in this process: no second start-up of torch per refusal
        monkeypatch.setenv(name, value)
    result = loom_here(
        capfd,
        "submit",
        "--tasks-per-node",
        "8",
        *training_args(dataset, tmp_path, "--parallel.tp", "2", "--parallel.dp", "2"),
        *args,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert job_count(slurm) == before
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # sbatch's refusal left submitit's files there


# Options to sbatch text, without a cluster: GPU clusters cannot be faked on this machine.


def test_gpu_options_reach_the_batch_script():
    from submitit.slurm.slurm import _make_sbatch_string

    config = load_config(REPO / "configs/tiny.toml", {"train": {"device": "auto"}})
    options = SlurmOptions(
        nodes=2,
        tasks_per_node=4,
        time_minutes=90,
        partition="gpu",
        account="proj",
        exclusive=True,
        mem_gb=200,
        sbatch=parse_sbatch_options(["mail-type=END"]),
    )
    parameters = executor_parameters(options, config, gpus_on_partition=8)
    script = _make_sbatch_string(command="python -m x", folder="/tmp/f", **parameters)
    for line in (
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --time=90",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --exclusive",
        "#SBATCH --mem=204800MB",
        "#SBATCH --mail-type=END",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
    ):
        assert line in script.splitlines(), line
    assert "--kill-on-bad-exit=1" in script
    cpu = executor_parameters(options, config, gpus_on_partition=0)
    assert "gpus_per_node" not in cpu


def test_time_and_sbatch_parsing():
    assert [parse_time_minutes(t) for t in ("30", "1:30:00", "10:30", "2-00:00:00", "1-12")] == [30, 90, 11, 2880, 2160]
    assert parse_sbatch_options(["--mail-user=a@b.c", "hint=nomultithread", "overcommit=true"]) == {
        "mail-user": "a@b.c",
        "hint": "nomultithread",
        "overcommit": True,
    }
    for bad in (["output=/tmp/x"], ["novalue"], ["Bad Key=1"]):
        with pytest.raises(Exception) as error:
            parse_sbatch_options(bad)
        assert "--sbatch" in str(error.value)
    # each was taken: job-name and no-requeue then lost to loom's own later line, time slipped under the checkpoint
    # signal's refusal, export=NONE failed the job in submitit
    for pair, instead in (
        ("job-name=foo", "use loom submit's --job-name"),
        ("time=1", "use loom submit's --time"),
        ("no-requeue=true", "a job needs loom's value"),
        ("export=NONE", "a job needs loom's value"),
        ("mem=4G", "use loom submit's --mem-gb"),
        ("ntasks-per-node=1", "use loom submit's --tasks-per-node"),  # it named a --ntasks-per-node loom lacks
    ):
        with pytest.raises(
            ConfigError, match=f"--sbatch {pair.split('=')[0]}: loom sets this option itself; {instead}"
        ):
            parse_sbatch_options([pair])


def test_options_that_change_sbatch_s_reply_and_a_time_past_a_year_are_refused():
    """--sbatch parsable queued the job and then failed with submitit's traceback (it could not read the job's id),
    the job recorded nowhere; --time 99999999999 was submitted as a 2,981,813-day limit."""
    for key in ("parsable", "test-only", "wait"):
        with pytest.raises(ConfigError, match=f"--sbatch {key}: it changes what sbatch replies"):
            parse_sbatch_options([f"{key}=true"])
    assert parse_time_minutes("366-00:00:00") == 366 * 1440
    for huge in ("366-00:00:01", "99999999999"):
        with pytest.raises(ConfigError, match=f"--time '{huge}' is .* days; give at most 366-00:00:00"):
            parse_time_minutes(huge)


def test_a_reply_of_sbatch_without_a_job_id_is_one_line_naming_it(tmp_path, monkeypatch):
    """A wrapped sbatch (or --parsable) replies without "Submitted batch job N": submitit's traceback, the job queued
    and recorded nowhere; the one line names the reply (not submitit's closing advice) and leaves no files."""
    import submitit

    from loom.launch.slurm import _submit_and_record

    def replies_bare_id(self, *args, **kwargs):
        raise submitit.core.utils.FailedSubmissionError(
            'Could not make sense of sbatch output "4"\nJob instance will not be able to fetch status\n'
            "(you may however set the job job_id manually if needed)"
        )

    monkeypatch.setattr(submitit.SlurmExecutor, "submit", replies_bare_id)
    config = load_config("tiny", ["--train.run_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=r"^sbatch's reply '4' names no job; if a job was queued \(squeue --me\)"):
        _submit_and_record(config, SlurmOptions(), {})
    assert not (tmp_path / "run" / "slurm").exists()


def test_wait_says_where_the_run_stands_when_its_job_ends_before_it(dataset, tmp_path, capfd, monkeypatch):
    """`--wait` exited 0 for a job that train.exit_after ended at step 2 of 6; a scancel whose save outlasted KillWait
    was reported as "killed by SIGKILL (the kernel's OOM killer ...)"; a task killed in an earlier attempt of a
    requeued job was named as the cause of a later one's failure. (Slurm's side is faked: the job and its states.)"""
    from loom.launch import cli_submit

    args = [*tiny_train_args(dataset, tmp_path, "--parallel.pp", "1"), "--train.steps", "6", "--train.exit_after", "2"]
    assert loom_here(capfd, "train", *args).returncode == 0

    class Job:
        job_id = "7"

        def results(self):
            return [{"stopped": False}]

    states = iter(["COMPLETED", "CANCELLED", "FAILED"])
    monkeypatch.setattr(cli_submit, "submit", lambda config, options: Job())
    monkeypatch.setattr(cli_submit, "follow", lambda job_id, run_dir: next(states))
    completed = loom_here(capfd, "submit", "--wait", *args)
    assert completed.returncode == 1 and completed.stderr.strip() == (
        "job 7 ended COMPLETED at step 2 of train.steps = 6: train.exit_after = 2 ends each job after that many "
        "steps; its checkpoint is saved: submit the same command to continue"
    )
    log = tmp_path / "slurm" / "7_0_log.out"
    log.parent.mkdir()
    start = "submitit INFO (2026-11-28 02:27:02,862) - Starting with JobEnvironment(job_id=7, hostname=vm)\n"
    log.write_text(f"{start}step 3\nsrun: error: vm: task 0: Killed\n")
    continue_from = "; the run's newest checkpoint is step 2 of 6: submit the same command to continue from it"
    cancelled = loom_here(capfd, "submit", "--wait", *args)
    assert cancelled.stderr.strip() == f"error: job 7 ended CANCELLED (scancel, or an administrator){continue_from}"
    log.write_text(f"{start}srun: error: vm: task 1: Killed\n{start}step 3\n")
    failed = loom_here(capfd, "submit", "--wait", *args)
    assert failed.returncode == 1 and failed.stderr.strip() == f"error: job 7 ended FAILED; see {log}{continue_from}"


def test_wait_says_why_a_job_is_pending_and_how_a_held_one_starts(tmp_path, monkeypatch):
    """`--sbatch hold=true --wait` waited without a word on why (squeue's stand-in here: pending twice, then done)."""
    import io

    from loom.launch.slurm_jobs import follow

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        '#!/bin/sh\ncase "$*" in *%r*) echo JobHeldUser; exit 0;; esac\n'
        f"echo x >> {calls}\n[ $(wc -l < {calls}) -le 2 ] && echo PENDING || echo COMPLETED\n"
    )
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = io.StringIO()
    assert follow("7", tmp_path / "run", poll_s=0.01, out=out) == "COMPLETED"
    assert out.getvalue().splitlines() == [
        "[loom submit] job 7: PENDING (JobHeldUser; `scontrol release 7` starts it)",
        "[loom submit] job 7: COMPLETED",
    ]


def test_submit_says_what_the_job_will_change_about_the_run_it_resumes(dataset, tmp_path, capfd):
    """A resubmission with another learning rate (or rope_theta) was said only in the job's log, which no one who
    submitted without --wait reads; submit says it too."""
    from loom.launch.slurm import _warn_what_the_job_changes

    args = [*tiny_train_args(dataset, tmp_path, "--parallel.pp", "1"), "--train.steps", "4", "--train.exit_after", "2"]
    assert loom_here(capfd, "train", *args).returncode == 0
    _warn_what_the_job_changes(load_config("tiny", args[2:] + ["--optim.lr", "5e-4", "--model.rope_theta", "5e5"]))
    warnings = capfd.readouterr().err.splitlines()
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("warning: the learning-rate schedule is not the one this run trained with (optim.lr")
    assert warnings[1].startswith(f"warning: this run computes a different model than {tmp_path}/checkpoints/iter_")


def test_submit_where_no_cluster_answers_says_so_and_leaves_no_run_folder(dataset, tmp_path, capfd, monkeypatch):
    """On a machine whose sinfo has no slurm.conf, submit printed sinfo's "Could not establish a configuration
    source" and left an empty run folder."""
    from training_runs import loom_here, one_line_error

    fake = tmp_path / "bin"
    fake.mkdir()
    for command in ("sinfo", "sbatch"):
        (fake / command).write_text(
            "#!/bin/sh\necho 'sinfo: fatal: Could not establish a configuration source' >&2\nexit 1\n"
        )
        (fake / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    result = loom_here(capfd, "submit", *tiny_train_args(dataset, tmp_path / "run"))
    one_line_error(result, "no Slurm cluster answers here", "loom train --nproc N")
    assert not (tmp_path / "run").exists()
    # the submission's own mistakes are said first: a user without a cluster at hand learned of them only there
    result = loom_here(capfd, "submit", *tiny_train_args(dataset, tmp_path / "run"), "--time", "2")
    one_line_error(result, "--time gives 2 min (Slurm counts whole minutes), which leaves no room")
