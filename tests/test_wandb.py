"""W&B logging, offline (no network): what loom wrote is read back from the run's .wandb file and equals
metrics.jsonl; a restart resumes the same W&B run; a missing wandb package is one line before any rank."""

import json
import struct
import sys
from pathlib import Path

import pytest
from training_runs import loom_here, read_metrics, tiny_train_args

wandb_proto = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) framed records


def wandb_records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:
            position += left
            continue
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:  # whole
            yield _parse(payload)
        elif kind == 2:  # first
            pending = payload
        elif kind == 3:  # middle
            pending += payload
        else:  # last
            yield _parse(pending + payload)


def _parse(payload: bytes):
    record = wandb_proto.Record()
    record.ParseFromString(payload)
    return record


def logged(run_dir: Path) -> list[tuple[str, dict, dict]]:
    """(run id, config, {step: scalars}) of each W&B run directory loom wrote, oldest first."""
    runs = []
    for file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, config, history = None, {}, {}
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history[record.history.step.num if record.history.HasField("step") else row["_step"]] = row
        runs.append((run_id, config, history))
    return runs


def test_offline_wandb_gets_the_metrics_and_a_restart_resumes_the_run(dataset, tmp_path, capfd):
    wandb = ["--train.wandb_project", "loom-test", "--train.wandb_mode", "offline", "--checkpoint.interval", "3"]
    first = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "3", *wandb))
    assert first.returncode == 0, first.stderr
    resumed = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "5", *wandb))
    assert resumed.returncode == 0, resumed.stderr
    runs = logged(tmp_path)
    assert len(runs) == 2 and runs[0][0] == runs[1][0]  # one W&B run, resumed
    model = runs[0][1]["model"]
    assert model.get("value", model)["hidden_size"] == 128  # the resolved config
    history = {**runs[0][2], **runs[1][2]}
    rows = read_metrics(tmp_path)
    assert sorted(history) == [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert history[row["step"]]["train/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert history[row["step"]]["train/lr"] == pytest.approx(row["lr"], rel=1e-12)


def test_a_missing_wandb_package_is_one_line_before_any_rank(dataset, tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.wandb_project", "p"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: train.wandb_project is set but the wandb package is not installed: pip install wandb "
        "(or leave train.wandb_project unset)"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()
