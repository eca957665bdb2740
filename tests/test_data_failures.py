"""Data commands under failure, run as a user runs them (`python -m loom.launch.cli data ...` in a subprocess):
a killed worker, a full disk (a 5 MB tmpfs), a read-only output. Each must end within a bounded time with
exit 2, one `error:` line and nothing left that looks like a finished output. Also: the parallel map keeps
order and re-raises a worker's error, long steps show progress, and every data option has help."""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from training_runs import mount_tmpfs, unmount

from loom.data_tools import build, clean, corpus, dedup, tokenizer
from loom.data_tools.build import build_indexed_dataset
from loom.data_tools.clean import clean_corpus
from loom.data_tools.corpus import build_stdlib_corpus
from loom.data_tools.dedup import deduplicate
from loom.data_tools.failures import OutputError
from loom.data_tools.jsonl import InputError
from loom.data_tools.parallel import KILL_TASK_VARIABLE, WorkerDied, imap_ordered
from loom.data_tools.tokenizer import train_tokenizer
from loom.launch.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
# Generous: each command takes about a second; a hang (the bug this guards against) never ends at all.
COMMAND_TIMEOUT_SECONDS = 120
TMPFS_BYTES = 5 << 20
# The tmpfs is filled to leave this much, so that a ~1 MB input overflows it part way through every stage.
FREE_BYTES = 300_000
DOCUMENTS = 1200  # several tasks per command: clean chunks of 256, build batches and minhash chunks of 512


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """About 1.1 MB of JSONL (random words, so no two documents are near duplicates) and a tokenizer for it."""
    root = tmp_path_factory.mktemp("failure-inputs")
    rng = random.Random(0)
    corpus = root / "docs.jsonl"
    with open(corpus, "w", encoding="utf-8") as out:
        for i in range(DOCUMENTS):
            out.write(json.dumps({"id": f"d{i}", "text": _words(rng, 150)}) + "\n")
    tokenizer = train_tokenizer([corpus], root / "tok", vocab_size=300, progress=False)
    return {"corpus": corpus, "tokenizer": Path(tokenizer["model"])}


@pytest.fixture
def full_disk(tmp_path):
    """A 5 MB tmpfs with FREE_BYTES left; yields the mount point, unmounts afterwards."""
    mount = tmp_path / "tmpfs"
    mount_tmpfs(mount, f"size={TMPFS_BYTES}")
    try:
        filler = mount / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(mount).free - FREE_BYTES))
        yield mount
    finally:
        unmount(mount)


@pytest.fixture
def read_only(tmp_path):
    """A read-only tmpfs (chmod would not stop root); yields the mount point, unmounts afterwards."""
    mount = tmp_path / "readonly"
    mount_tmpfs(mount, "ro,size=1m")
    try:
        yield mount
    finally:
        unmount(mount)


def run_data(*arguments: str, environment: dict | None = None) -> subprocess.CompletedProcess:
    """`loom data ARGUMENTS` in a subprocess; a hang fails the test through the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", "data", *map(str, arguments)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(environment or {})},
        timeout=COMMAND_TIMEOUT_SECONDS,
    )


def stderr_lines(done: subprocess.CompletedProcess) -> list[str]:
    """stderr split on newlines and on the carriage returns progress bars redraw with."""
    return [line.strip() for line in re.split(r"[\r\n]", done.stderr) if line.strip()]


def the_error_line(done: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a failed command; fails on a traceback or a second error line."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in stderr_lines(done) if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def command(name: str, inputs: dict[str, Path], output: Path, workers: int | None = None) -> list:
    """The arguments of one data command writing to `output` (a folder, file or prefix as the command takes)."""
    corpus, worker_flags = inputs["corpus"], ([] if workers is None else ["--workers", workers])
    return {
        "clean": ["clean", "--input", corpus, "--output", output, "--pipeline", "minimal", *worker_flags],
        "dedup": ["dedup", "--method", "minhash", "--input", corpus, "--output", output, *worker_flags],
        "build": ["build", "--input", corpus, "--tokenizer", inputs["tokenizer"], "--output-prefix", output]
        + worker_flags,
        "corpus": ["corpus", "--output", output, "--max-docs", "200"],
    }[name]


OUTPUTS = {"clean": "cleaned", "dedup": "deduplicated", "build": "dataset", "corpus": "corpus.jsonl"}


@pytest.mark.parametrize("name", ["clean", "dedup", "build"])
def test_a_killed_worker_fails_the_command_in_one_line(inputs, tmp_path, name):
    output = tmp_path / OUTPUTS[name]
    done = run_data(*command(name, inputs, output, workers=2), environment={KILL_TASK_VARIABLE: "1"})
    line = the_error_line(done)
    assert re.fullmatch(
        rf"error: data worker \d+ died \(killed by signal 9, SIGKILL: out of memory\?\); nothing was written to "
        rf"{re.escape(str(output))}(\.bin)?",
        line,
    ), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, workers",
    [(name, workers) for name in ("clean", "dedup", "build") for workers in (1, 2)] + [("corpus", None)],
)
def test_a_full_disk_is_one_line_and_leaves_nothing(inputs, full_disk, name, workers):
    done = run_data(*command(name, inputs, full_disk / OUTPUTS[name], workers))
    line = the_error_line(done)
    assert [line] == [text for text in stderr_lines(done) if "space" in text]
    assert line.startswith(f"error: no space left on {full_disk} for {full_disk / OUTPUTS[name]}"), line
    assert re.search(r"about [\d.]+ MB needed, [\d.]+ MB free; nothing was written", line), line
    # No staging folder, temporary file, partial output or manifest: only what was there before.
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_compressed_output_is_estimated_compressed():
    """`loom data corpus --output c.jsonl.gz` on a full disk said about 4.3 MB were needed where 0.9 MB did."""
    from loom.data_tools.jsonl import COMPRESSION_RATIO, estimated_output_bytes

    assert estimated_output_bytes(Path("c.jsonl"), 4_000_000) == 4_000_000
    for name in ("c.jsonl.gz", "c.jsonl.zst"):
        assert estimated_output_bytes(Path(name), 4_000_000) == 4_000_000 // COMPRESSION_RATIO


@pytest.mark.parametrize("name", ["clean", "dedup", "build", "corpus"])
def test_a_read_only_output_is_one_line(inputs, read_only, name):
    output = read_only / OUTPUTS[name]
    done = run_data(*command(name, inputs, output, None if name == "corpus" else 2))
    line = the_error_line(done)
    shown = f"{output}.bin" if name == "build" else str(output)
    assert line == f"error: {shown} is read-only ({read_only} is mounted read-only); write the output elsewhere"


def test_an_atomic_write_on_a_read_only_mount_names_the_file_asked_for(read_only):
    """The temporary file's removal (EROFS even for a missing file there) replaced the write's own error, so
    `loom data preview --output` named its .p.jsonl.HOST-PID.tmp."""
    from loom.engine.atomic import write_text_atomically

    with pytest.raises(OSError) as raised:
        write_text_atomically(read_only / "p.jsonl", "{}\n")
    assert raised.value.errno == errno.EROFS and raised.value.filename == str(read_only / "p.jsonl")


def _run_in_process(name: str, inputs: dict[str, Path], output: Path) -> None:
    if name == "clean":
        clean_corpus([inputs["corpus"]], output, pipeline="minimal", workers=1, progress=False)
    elif name == "dedup":
        deduplicate([inputs["corpus"]], output, "minhash", workers=1, progress=False)
    elif name == "build":
        build_indexed_dataset([inputs["corpus"]], inputs["tokenizer"], output, workers=1, progress=False)
    else:
        build_stdlib_corpus(output, max_docs=5, progress=False)


@pytest.mark.parametrize("name", ["clean", "dedup", "build", "corpus"])
def test_a_full_disk_at_the_manifest_removes_the_output_it_replaced(inputs, tmp_path, monkeypatch, name):
    """The last write is the manifest: if it fails, outputs already moved into place must go too."""
    module = {"clean": clean, "dedup": dedup, "build": build, "corpus": corpus}[name]
    output = tmp_path / "out" / OUTPUTS[name]
    _run_in_process(name, inputs, output)  # a finished earlier run, which the failed one replaces
    assert list(output.parent.iterdir())

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(output))

    monkeypatch.setattr(module, "write_manifest", full_disk)
    with pytest.raises(OutputError, match=r"^no space left on .* nothing was written"):
        _run_in_process(name, inputs, output)
    left = sorted(str(p.relative_to(output.parent)) for p in output.parent.rglob("*"))
    assert left == ([OUTPUTS[name]] if name in ("clean", "dedup") else [])  # at most the emptied folder


@pytest.mark.parametrize("name", ["clean", "build"])
def test_an_overwrite_that_fails_puts_back_what_it_replaced(inputs, tmp_path, monkeypatch, capfd, name):
    """--overwrite moved the old output into replaced/<time>/ before writing; a full disk then left the output
    empty, the old files aside and "nothing was written". The failed command now changes nothing."""
    from training_runs import loom_here

    module = {"clean": clean, "build": build}[name]
    output = tmp_path / OUTPUTS[name]
    _run_in_process(name, inputs, output)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def full_disk(output_path, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(output_path))

    monkeypatch.setattr(module, "write_manifest", full_disk)
    failed = loom_here(capfd, "data", *map(str, command(name, inputs, output, workers=1)), "--overwrite")
    assert failed.returncode == 2 and "holds what it held before" in failed.stdout, failed.stderr
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and not list(tmp_path.rglob("replaced"))


def test_a_merge_that_cannot_write_its_manifest_leaves_nothing(inputs, tmp_path, monkeypatch, capfd):
    """`loom data merge` wrote its manifest after the merged .bin/.idx were in place: a full disk there left a
    complete-looking dataset without the manifest that carries its tokenizer, and the rerun was refused."""
    from training_runs import loom_here

    from loom.data_tools import manifest

    for name in ("a", "b"):
        build_indexed_dataset([inputs["corpus"]], inputs["tokenizer"], tmp_path / name, workers=1, progress=False)
    merge = ["data", "merge", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix"]
    real = manifest.write_manifest

    def full_disk(output, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(output) + ".manifest.json")

    monkeypatch.setattr(manifest, "write_manifest", full_disk)
    (tmp_path / "out").mkdir()
    failed = loom_here(capfd, *merge, str(tmp_path / "out" / "m"))
    assert failed.returncode == 2 and re.search(r"no space left on .* nothing was written", failed.stderr)
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.setattr(manifest, "write_manifest", real)
    again = loom_here(capfd, *merge, str(tmp_path / "out" / "m"))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.bin", "m.idx", "m.manifest.json"]


def test_parallel_map_keeps_order_and_reraises_a_workers_error(monkeypatch):
    tasks = [(base, 2) for base in range(40)]
    assert list(imap_ordered(pow, tasks, workers=2, in_flight_per_worker=2)) == [b * b for b, _ in tasks]
    with pytest.raises(InputError, match="bad value"):
        list(imap_ordered(_fail_on_seven, [(i,) for i in range(12)], workers=2))
    monkeypatch.setenv(KILL_TASK_VARIABLE, "3")
    with pytest.raises(WorkerDied, match=r"data worker \d+ died \(killed by signal 9"):
        list(imap_ordered(pow, tasks, workers=2))


def _fail_on_seven(value: int) -> int:
    if value == 7:
        raise InputError("bad value 7")
    return value


def test_workers_exit_when_the_data_command_is_killed_outright(tmp_path):
    """SIGKILL (the OOM killer) gives a data command no chance to stop its pool: its workers slept on forever,
    holding its files open. Each worker now exits once its parent is gone."""
    from training_runs import wait_for

    script = (
        "import time\n"
        "from loom.data_tools.parallel import imap_ordered\n"
        "for _ in imap_ordered(time.sleep, [(100_000,)] * 4, workers=2):\n"
        "    pass\n"
    )
    command = subprocess.Popen([sys.executable, "-c", script])

    def workers() -> list[int]:
        try:
            children = Path(f"/proc/{command.pid}/task/{command.pid}/children").read_text().split()
        except OSError:
            return []
        return [int(pid) for pid in children if b"spawn_main" in _cmdline(int(pid))]

    wait_for(lambda: len(workers()) == 2, "two workers", command)
    pids = workers()
    command.kill()
    command.wait()
    wait_for(lambda: not any(_cmdline(pid) for pid in pids), "the workers gone")


def _cmdline(pid: int) -> bytes:
    """A live process's command line (b"" once it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_clean_and_tokenizer_training_show_progress(inputs, tmp_path, capsys):
    clean_corpus([inputs["corpus"]], tmp_path / "clean", pipeline="minimal", workers=1)
    shown = capsys.readouterr().err
    assert "100%|" in shown and f"{DOCUMENTS}/{DOCUMENTS}" in shown  # a total, so a percentage and time left
    train_tokenizer([inputs["corpus"]], tmp_path / "tok", vocab_size=300)
    shown = capsys.readouterr().err
    assert "tokenizer: reading" in shown and "tokenizer: training 300 bpe pieces on" in shown


@pytest.mark.parametrize("step", ["clean", "tokenizer", "build", "merge", "inspect", "dedup", "corpus"])
def test_every_data_option_has_help_and_shows_its_default(step):
    data = _subcommands(build_parser())["data"]
    parser = _subcommands(data)[step]
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"loom data {step} {action.option_strings or action.dest} has no help"
        is_switch = isinstance(action, argparse._StoreTrueAction)  # off unless given: nothing to show
        if action.default is not None and not action.required and not is_switch:
            assert "default" in action.help, f"loom data {step} {action.option_strings} hides its default"
    if step in ("clean", "build"):
        assert "(default: 2)" in " ".join(parser.format_help().split())  # --workers, as printed


def _subcommands(parser) -> dict:
    return next(a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")


# loom data STEP's options that pass a library parameter of the same name; --workers is left out on purpose (the
# command runs 2 by default, the library 1: a library caller asks for processes).
_LIBRARY_OF = {
    "clean": clean_corpus,
    "dedup": deduplicate,
    "tokenizer": train_tokenizer,
    "build": build_indexed_dataset,
}


@pytest.mark.parametrize("step", sorted(_LIBRARY_OF))
def test_a_data_commands_defaults_are_its_librarys(step):
    """The CLI states each default again (argparse prints it in --help without importing the data libraries,
    which would slow every `loom` command): this keeps the two statements equal."""
    import inspect

    parameters = inspect.signature(_LIBRARY_OF[step]).parameters
    parser = _subcommands(_subcommands(build_parser())["data"])[step]
    compared = 0
    for action in parser._actions:
        parameter = parameters.get(action.dest)
        if parameter is None or action.dest == "workers" or parameter.default is inspect.Parameter.empty:
            continue
        assert action.default == parameter.default, f"loom data {step} --{action.dest}"
        assert action.choices is None or set(action.choices) <= set(_choices(step, action.dest)), action.dest
        compared += 1
    assert compared >= {"clean": 2, "dedup": 4, "tokenizer": 5, "build": 2}[step]
    if step == "dedup":
        threshold_help = next(a.help for a in parser._actions if a.dest == "threshold")
        for method, value in dedup.DEFAULT_THRESHOLDS.items():
            assert f"{method}: " in threshold_help and f"(default {value})" in threshold_help


def _choices(step: str, dest: str) -> tuple:
    return {("dedup", "method"): dedup.METHODS, ("tokenizer", "model_type"): tokenizer.MODEL_TYPES}.get(
        (step, dest), ()
    )


def test_an_overwrite_that_cannot_move_a_file_moves_nothing(tmp_path, monkeypatch):
    """An immutable old output (chattr +i) stopped --overwrite half-way: the files moved before it stayed in a
    replaced/<time>/ beside the rest (or an empty one was left). Now what moved comes back, and nothing is made."""
    from loom.engine.atomic import move_aside

    files = [tmp_path / name for name in ("ds.bin", "ds.idx", "ds.manifest.json")]
    for path in files:
        path.write_text(path.name)
    rename = Path.rename

    def immutable_manifest(self, target):
        if self.name == "ds.manifest.json":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", immutable_manifest)
    with pytest.raises(PermissionError):
        move_aside(tmp_path, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "ds.manifest.json"]
    assert all(path.read_text() == path.name for path in files)


def test_an_output_name_near_the_file_systems_limit_is_written(tmp_path):
    """A legal name of 227-255 bytes failed as 'File name too long' naming loom's temporary file (the name plus the
    writer's host and pid), after the command's whole work; its stale temporaries are still found and removed."""
    import subprocess

    from loom.engine.atomic import remove_stale_temporaries, temporary_sibling, write_text_atomically

    for name in ("m" * 255, "é" * 127 + "x"):  # bytes, not characters, count
        path = tmp_path / name
        write_text_atomically(path, "done")
        assert path.read_text() == "done" and sorted(p.name for p in tmp_path.iterdir()) == [name]
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        stale = temporary_sibling(path).with_name(temporary_sibling(path).name.replace(str(os.getpid()), str(gone.pid)))
        stale.write_text("half")  # a writer killed outright
        remove_stale_temporaries(path)
        assert not stale.exists()
        path.unlink()
    with pytest.raises(OSError, match="File name too long") as refused:
        write_text_atomically(tmp_path / ("n" * 256), "x")
    assert refused.value.filename == str(tmp_path / ("n" * 256))  # the name the user gave, not loom's temporary one
    # a tokenizer's prefix takes .model and .vocab after loom's temporary name: a legal 241-byte prefix failed;
    # one too long for its manifest is refused before the training
    from loom.data_tools.tokenizer import train_tokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "line {i}: def f(x): return x * {i}"}}\n' for i in range(200)))
    tokenizer = tmp_path / ("t" * 241)
    killed = temporary_sibling(tokenizer, reserve=len(".model"))  # a killed training's, which its rerun left
    killed = killed.with_name(killed.name.replace(str(os.getpid()), str(gone.pid)))
    for suffix in (".model", ".vocab"):
        Path(f"{killed}{suffix}").write_text("half")
    train_tokenizer([docs], tokenizer, vocab_size=400, progress=False)
    assert (tmp_path / ("t" * 241 + ".model")).is_file()
    assert not any(Path(f"{killed}{suffix}").exists() for suffix in (".model", ".vocab"))
    with pytest.raises(OSError, match="File name too long") as refused:
        train_tokenizer([docs], tmp_path / ("t" * 242), vocab_size=400, progress=False)
    assert refused.value.filename == str(tmp_path / ("t" * 242 + ".manifest.json"))
