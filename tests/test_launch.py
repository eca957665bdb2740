"""The local launcher and the CLI as a user meets them: failures end every rank, bad input is one line."""

import multiprocessing
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from training_runs import HANG_S, fails_if_hung, loom_here, read_metrics, tiny_config

from loom.engine.config import ConfigError
from loom.launch.local import RankFailed, launch_local

LOOM = [sys.executable, "-m", "loom.launch.cli"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(200)


def test_failing_rank_stops_all_ranks_with_its_message(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_INJECT_FAULT", "5:3")
    config = tiny_config(dataset, tmp_path, train={"steps": 1000})
    config.resolve_world(8)
    children_before = set(multiprocessing.active_children())
    with fails_if_hung(), pytest.raises(RankFailed) as failure:
        launch_local(config, 8)
    assert failure.value.rank == 5
    assert "fault injected by LOOM_INJECT_FAULT at step 3" in str(failure.value)
    assert set(multiprocessing.active_children()) == children_before, "ranks outlived the failure"


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*LOOM, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=HANG_S)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parallel.tp", "3", "--nproc", "3"], "parallel.tp = 3 must divide model.num_heads = 8"),
        (["--nproc", "3"], "train.global_batch_size = 16 must be divisible by micro_batch_size*dp = 2*3"),
        (["--parallel.tp", "2", "--parallel.dp", "2", "--nproc", "2"], "world size 2 != tp*pp*dp = 2*1*2"),
        (["--train.stepz", "5"], "unknown field in [train] 'stepz'; did you mean 'steps'?"),
        (["--train.steps", "five"], "train.steps expects an integer, got 'five'"),
        (["--model.num_kv_heads", "3"], "model.num_kv_heads = 3 must divide model.num_heads = 8"),
        (["--data.paths", "/nonexistent/data"], "/nonexistent/data.idx does not exist"),
        (
            ["--train.fp8", "current", "--train.precision", "bf16"],
            "train.fp8 = current is unavailable: fp8: no CUDA device; use --train.fp8 off",
        ),
        (["--model.kernels", "te"], "model.kernels = te needs Transformer Engine on a CUDA device"),
    ],
)
def test_bad_training_input_is_one_line(args, message, capfd):
    result = loom_here(capfd, "train", "--config", str(REPO / "configs/tiny.toml"), *args)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {message}" or result.stderr.strip().startswith(f"error: {message}")
    assert len(result.stderr.strip().splitlines()) == 1


def test_corrupt_index_is_named(dataset, tmp_path, capfd):
    idx = Path(dataset + ".idx").read_bytes()
    broken = tmp_path / "broken"
    (tmp_path / "broken.idx").write_bytes(b"NOTMMIDX\x00" + idx[9:])
    (tmp_path / "broken.bin").write_bytes(Path(dataset + ".bin").read_bytes())
    config = str(REPO / "configs/tiny.toml")
    result = loom_here(capfd, "train", "--config", config, "--data.paths", str(broken), "--data.tokenizer", "none")
    assert result.returncode == 2
    assert f"corrupt dataset {broken}.idx: bad magic" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_train_command_writes_the_run_directory(dataset, tmp_path):
    result = run_cli(
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
        "--train.steps",
        "4",
        "--train.log_interval",
        "2",
        "--train.eval_interval",
        "4",
        "--train.run_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 4, 4]
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "mem_gb"):
        assert key in rows[0]
    assert rows[1]["tokens"] == 4 * 16 * 128
    assert "val_loss" in rows[2] and abs(rows[2]["val_ppl"] - 2.718281828 ** rows[2]["val_loss"]) < 1e-3
    assert (tmp_path / "config.toml").read_text().count("tp = 2") == 1
    assert list((tmp_path / "tensorboard").iterdir())
    assert "loss" in result.stdout and "tok/s" in result.stdout
    # the planner's GB per GPU beside "mem 0.49 GB" on each step line read as a 12x misprediction
    assert "GB per GPU predicted" in result.stdout and "on CPU the step lines' mem is each process's peak RSS" in (
        result.stdout
    )


def test_print_config_shows_the_resolved_config_and_starts_nothing(tmp_path):
    result = subprocess.run(
        [*LOOM, "train", "--config", "tiny", "--nproc", "4", "--parallel.tp", "2", "--print-config"]
        + ["--train.run_dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["parallel"]["tp"] == 2 and printed["parallel"]["dp"] == 2  # derived from --nproc
    assert printed["model"]["ffn_hidden_size"] == 384 and printed["train"]["steps"] == 50
    assert not (tmp_path / "run").exists()
    preset = subprocess.run([*LOOM, "train", "--config", "llama-8b", "--print-config"], capture_output=True, text=True)
    assert preset.returncode == 2 and preset.stderr.strip().endswith(  # it said only that world size 1 does not divide
        "the resolved config depends on the world size: add --nproc N"
    )


@pytest.mark.parametrize("command", [[], ["train"], ["data", "clean"], ["eval"], ["ckpt", "reshard"], ["submit"]])
def test_help_does_not_import_torch(command):
    """`loom ... --help` answers at once: torch (seconds to import) loads only when work starts."""
    probe = (
        "import sys\nfrom loom.launch.cli import main\n"
        f"try:\n    main({command + ['--help']!r})\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_S)
    assert "usage: loom" in result.stdout
    assert result.stderr.strip().endswith("torch not imported"), result.stderr


def test_the_rank_server_never_asks_cuda():
    """Ranks fork from a server that imported RANK_PRELOAD; had those imports asked torch.cuda anything (even
    is_available), CUDA refuses to start in every forked rank: on the first GPU run of 2026-11-27 inductor's import
    did, and every `loom train` on CUDA failed. The probe counts the calls (a CPU build answers them harmlessly)."""
    probe = (
        "import importlib, torch\n"
        "calls = []\n"
        "for name in ('is_available', 'device_count', '_lazy_init'):\n"
        "    setattr(torch.cuda, name, lambda name=name, f=getattr(torch.cuda, name): calls.append(name) or f())\n"
        "from loom.engine.parallel.rendezvous import RANK_PRELOAD\n"
        "for name in RANK_PRELOAD:\n    importlib.import_module(name)\n"
        "import sys\n"
        "asker = 'torch._inductor.runtime.benchmarking' in sys.modules\n"
        "print('CUDA asked' if calls else 'CUDA untouched', calls, asker)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_S)
    # and, whatever this torch asks at import, not the module that asked under 2.11 (CI runs 2.13, which does not)
    assert result.stdout.startswith("CUDA untouched [] False"), result.stdout + result.stderr[-2000:]
    # the probe sees such a call (torch 2.11's inductor makes it at import; 2.13's does not)
    control = probe.replace("for name in RANK_PRELOAD:\n    importlib.import_module(name)", "torch.cuda.is_available()")
    asked = subprocess.run([sys.executable, "-c", control], capture_output=True, text=True, timeout=HANG_S)
    assert asked.stdout.startswith("CUDA asked"), asked.stdout + asked.stderr[-2000:]


def test_a_bf16_pipeline_run_warns_of_nothing(dataset, tmp_path):
    """Each rank used to print torch's `Mismatch dtype between input and weight` from rms_norm: stages
    received fp32 activations for bf16 weights."""
    result = subprocess.run(
        [*LOOM, "train", "--config", "tiny", "--data.paths", dataset, "--data.tokenizer", "none"]
        + ["--train.run_dir", str(tmp_path), "--train.steps", "2", "--train.precision", "bf16", "--nproc", "2"]
        + ["--parallel.pp", "2", "--train.eval_interval", "0"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "Mismatch dtype" not in result.stderr, result.stderr


def test_cuda_environment_for_transformer_engine_tensor_parallel():
    from loom.engine.config_io import load_config
    from loom.engine.cuda_env import cuda_env_defaults

    tp2 = load_config("tiny", {"parallel": {"tp": 2}})
    assert cuda_env_defaults(tp2)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    native = load_config("tiny", {"parallel": {"tp": 2}, "model": {"kernels": "native"}})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in cuda_env_defaults(native)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in cuda_env_defaults(load_config("tiny"))


def test_a_cuda_rank_gets_the_cuda_environment_whatever_its_backend(monkeypatch):
    """The allocator's expandable segments and the rest were set only for NCCL ranks: a CUDA rank on gloo
    (--parallel.backend gloo) went without them. A CPU rank still gets none."""
    import torch.distributed as dist

    from loom.engine.config_io import load_config
    from loom.engine.cuda_env import CUDA_ENV_DEFAULTS
    from loom.engine.parallel.rendezvous import free_port
    from loom.launch.env import init_distributed

    rendezvous = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for device, expected in (("cpu", False), ("cuda", True)):
        for name in CUDA_ENV_DEFAULTS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(os, "environ", {**os.environ, **rendezvous, "MASTER_PORT": str(free_port())})
        config = load_config("tiny", {"parallel": {"backend": "gloo"}, "train": {"device": device}})
        init_distributed(config)
        dist.destroy_process_group()
        assert all((name in os.environ) == expected for name in CUDA_ENV_DEFAULTS), device


def test_more_nccl_ranks_than_gpus_is_refused_before_any_starts(dataset, tmp_path, monkeypatch):
    """Two NCCL ranks on a one-GPU machine shared cuda:0 and would fail at the first collective with NCCL's own
    error; the launcher refuses them in one line, naming what to do (the GPU count is pretended: this CPU has none)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = tiny_config(dataset, tmp_path / "run", parallel={"backend": "nccl"})
    config.resolve_world(2)
    children_before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match=r"^--nproc 2 NCCL ranks on a machine that shows 1 GPU\(s\): .* --nproc 1"):
        launch_local(config, 2)
    assert set(multiprocessing.active_children()) == children_before and not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_ranks_on_a_machine_without_gpus_say_so(dataset, tmp_path):
    """With no GPU the launcher said "use --nproc 0 or fewer", which no run can do."""
    config = tiny_config(dataset, tmp_path / "run", train={"device": "cuda"})
    config.resolve_world(1)
    with pytest.raises(ConfigError, match=r"^train.device = cuda asks for NCCL ranks, but no CUDA device is visible"):
        launch_local(config, 1)
    config = tiny_config(dataset, tmp_path / "run", parallel={"backend": "nccl"})
    config.resolve_world(1)
    with pytest.raises(ConfigError, match=r"^parallel.backend = nccl asks .* use --parallel.backend auto"):
        launch_local(config, 1)
    assert not (tmp_path / "run").exists()


def test_a_stop_while_the_command_line_is_read_ends_in_one_line(monkeypatch, capfd):
    """SIGTERM or Ctrl-C in a command's first fraction of a second, while its parser is built, printed a screen of
    traceback: the handling of stops began after parsing."""
    from loom.launch import cli

    def stopped_while_building():
        os.kill(os.getpid(), signal.SIGTERM)  # main's handler turns it into a stop
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(cli, "build_parser", stopped_while_building)
    result = loom_here(capfd, "data", "inspect", "x")
    assert (result.returncode, result.stderr) == (128 + signal.SIGTERM, "stopped by SIGTERM\n")

    def interrupted_while_building():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted_while_building)
    result = loom_here(capfd, "data", "inspect", "x")
    assert (result.returncode, result.stderr) == (130, "interrupted\n")


def test_torch_is_imported_with_stop_signals_held(tmp_path):
    """A Ctrl-C inside torch's native initialisation aborted the launcher ("terminate called after throwing an
    instance of 'pybind11::error_already_set'", exit 134). A stand-in torch interrupts itself halfway through its
    import: the import finishes, and the stop is then taken as usual."""
    fake = tmp_path / "stand-in" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "open(os.environ['IMPORTED'], 'w').close()\n"
    )
    probe = "from loom.launch.cli import main\nmain(['bench', 'mfu', '--config', 'tiny'])"
    env = {**os.environ, "PYTHONPATH": str(fake.parent), "IMPORTED": str(tmp_path / "imported")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert (result.returncode, result.stderr) == (130, "interrupted\n"), result.stderr[-2000:]
    assert (tmp_path / "imported").exists()


def test_ranks_forked_after_a_stop_are_told(dataset, tmp_path, monkeypatch):
    """A stop that reaches the launcher before a rank exists (the rank server still importing torch, seconds on a
    GPU node) was forwarded to the ranks alive then, none: they trained every step, and the run then said it was
    stopped. Sending the signal to each rank as it started was not enough either: a signal that reaches a process
    before Python's fork handling has run in it is dropped (the full suite on 2 busy cores lost it now and then).
    Here the launcher gets SIGTERM just before it starts rank 0, and every SIGTERM it sends a rank is lost."""
    from loom.launch import local

    process_class = local.rank_context().Process
    start, sent = process_class.start, []

    def start_after_a_stop(process):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        start(process)

    real_kill, launcher = os.kill, os.getpid()

    def lost_on_the_way_to_ranks(pid: int, signum: int) -> None:
        if pid == launcher or signum != signal.SIGTERM:
            real_kill(pid, signum)

    monkeypatch.setattr(process_class, "start", start_after_a_stop)
    monkeypatch.setattr(os, "kill", lost_on_the_way_to_ranks)
    config = tiny_config(dataset, tmp_path, train={"steps": 50}, parallel={"tp": 2})
    config.resolve_world(2)
    with pytest.raises(local.Stopped, match="^stopped by SIGTERM: checkpoint .* saved"):
        launch_local(config, 2)
    assert read_metrics(tmp_path) == []  # agreed before the first step, so saved before it


def test_the_rendezvous_port_cannot_be_taken_before_rank_0_listens(dataset, tmp_path, monkeypatch):
    """The launcher picked a free port and rank 0 bound it seconds later (after its imports): any process binding
    it in between failed the launch with EADDRINUSE. Here another process tries to listen on the ranks' port just
    before rank 0 starts; the launcher holds it already."""
    import socket

    from loom.launch import local

    process_class = local.rank_context().Process
    start, thief = process_class.start, socket.socket()

    def start_after_a_thief_tried(process):
        if thief.getsockname()[1] == 0:
            given = process._args[2]
            port = int(given["MASTER_PORT"]) if isinstance(given, dict) else given
            try:
                thief.bind(("127.0.0.1", port))
                thief.listen()
            except OSError:  # taken: by the launcher's store
                pass
        start(process)

    monkeypatch.setattr(process_class, "start", start_after_a_thief_tried)
    config = tiny_config(dataset, tmp_path, train={"steps": 2}, parallel={"tp": 2})
    config.resolve_world(2)
    with thief:
        launch_local(config, 2)
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
