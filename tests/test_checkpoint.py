"""Checkpoints: exact resume, resume under other layouts (ZeRO-1 state resharded), crash safety."""

import os
import pickle
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from training_runs import read_metrics, tiny_config

from loom.engine.checkpoint import format as checkpoint_format
from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointLayout,
    CheckpointMetadata,
    FileRecord,
    commit,
    find_loadable,
    iteration_dir,
    make_staging_dir,
    read_metadata,
    write_rank_file,
)
from loom.engine.checkpoint.load import PieceReader
from loom.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from loom.engine.parallel.sharding import ShardSpec
from loom.engine.train import Trainer
from loom.launch.local import RankFailed, launch_local
from loom.tools.ckpt import reshard

STEPS, HALF = 6, 3


def run(dataset, run_dir, nproc, parallel=None, **train):
    optim = {"zero1": train.pop("zero1", False)}
    checkpoint = train.pop("checkpoint", {})
    config = tiny_config(
        dataset,
        run_dir,
        parallel=parallel or {},
        optim=optim,
        checkpoint=checkpoint,
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, **train},
    )
    config.resolve_world(nproc)
    launch_local(config, nproc)
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
    return run(dataset, tmp_path_factory.mktemp("straight"), 1)


@pytest.mark.parametrize(
    "nproc, parallel, asynchronous",
    [(4, {"tp": 2, "pp": 2}, False), (2, {"pp": 2}, True)],
    ids=["tp2-pp2", "pp2-async-save"],
)
def test_exact_resume_at_the_same_layout(dataset, tmp_path, nproc, parallel, asynchronous, capfd):
    saving = {"interval": HALF, "async_save": asynchronous}
    both = run(dataset, tmp_path / "ref", nproc, parallel)
    capfd.readouterr()
    first = run(dataset, tmp_path / "run", nproc, parallel, exit_after=HALF, checkpoint=saving)
    assert sorted(first) == list(range(1, HALF + 1))
    saved = tmp_path / f"run/checkpoints/iter_{HALF:07d}"
    size = sum(path.stat().st_size for path in saved.glob("rank*.safetensors")) / 1e6
    background = ", in the background" if asynchronous else ""
    said = f"checkpoint: step {HALF} saved to {saved} ({size:.1f} MB in "  # a save said nothing, a background one
    assert said in (out := capfd.readouterr().out) and f" s{background})" in out.split(said)[1].splitlines()[0]
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == f"iter_{HALF:07d}"
    resumed = run(dataset, tmp_path / "run", nproc, parallel, checkpoint=saving)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # metrics.jsonl: no step lost or repeated
    for step in range(1, STEPS + 1):
        assert abs(resumed[step] - both[step]) / both[step] <= 1e-6


@pytest.fixture(scope="module")
def saved_at_tp2_pp2_dp2(dataset, tmp_path_factory):
    saved = tmp_path_factory.mktemp("saved")
    run(dataset, saved, 8, {"tp": 2, "pp": 2}, zero1=True, exit_after=HALF, checkpoint={"interval": HALF})
    return saved / "checkpoints"


@pytest.mark.parametrize(
    "nproc, parallel",
    [
        (1, {}),
        (8, {"tp": 4, "pp": 1}),
        (4, {"tp": 1, "pp": 2, "vp": 2}),
        (8, {"tp": 2, "pp": 1}),
    ],
    ids=["1-1-1", "tp4-dp2", "pp2-vp2-dp2", "tp2-dp4"],
)
def test_resume_under_another_layout(dataset, straight, saved_at_tp2_pp2_dp2, tmp_path, nproc, parallel):
    resumed = run(
        dataset, tmp_path / "resumed", nproc, parallel, zero1=nproc > 1, checkpoint={"load": str(saved_at_tp2_pp2_dp2)}
    )
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    for step in resumed:
        assert abs(resumed[step] - straight[step]) / straight[step] < 1e-4


def test_a_checkpoint_from_before_zero_stages_resumes(dataset, straight, saved_at_tp2_pp2_dp2, tmp_path):
    """Checkpoints written before ZeRO-2 record `zero1: true/false` and no cp: their migration kept the old key,
    so every such checkpoint was "corrupt (unexpected keyword argument 'zero1')" and a run could not resume."""
    import json
    import shutil

    old = tmp_path / "old" / "checkpoints"
    shutil.copytree(saved_at_tp2_pp2_dp2, old)
    for metadata_file in old.glob("iter_*/metadata.json"):
        metadata = json.loads(metadata_file.read_text())
        layout = metadata["layout"]
        layout["zero1"] = bool(layout.pop("zero"))
        del layout["cp"]
        metadata_file.write_text(json.dumps(metadata))
    _, metadata = find_loadable(old)
    assert metadata.layout.zero == 1 and metadata.layout.cp == 1
    resumed = run(dataset, tmp_path / "resumed", 2, {"tp": 2}, zero1=True, checkpoint={"load": str(old)})
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    for step in resumed:
        assert abs(resumed[step] - straight[step]) / straight[step] < 1e-4


def test_killed_during_save_keeps_the_previous_checkpoint(dataset, straight, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run(dataset, run_dir, 2, {"tp": 2}, exit_after=2, checkpoint={"interval": 2})
    monkeypatch.setenv("LOOM_KILL_DURING_SAVE", "1:4")
    with pytest.raises(RankFailed):
        run(dataset, run_dir, 2, {"tp": 2}, checkpoint={"interval": 2})
    monkeypatch.delenv("LOOM_KILL_DURING_SAVE")
    assert (run_dir / "checkpoints/latest").read_text().strip() == "iter_0000002"
    assert (run_dir / "checkpoints/iter_0000004.tmp").exists() and not (run_dir / "checkpoints/iter_0000004").exists()
    resumed = run(dataset, run_dir, 2, {"tp": 2}, checkpoint={"interval": 3})  # never saves step 4 again
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert abs(resumed[step] - straight[step]) / straight[step] < 1e-4
    assert not (run_dir / "checkpoints/iter_0000004.tmp").exists()  # a whole checkpoint's size, kept forever


def test_corrupt_checkpoint_falls_back_with_a_warning_and_none_intact_is_refused(dataset, tmp_path, capfd):
    run_dir = tmp_path / "run"
    run(dataset, run_dir, 1, exit_after=4, checkpoint={"interval": 2})
    newest = run_dir / "checkpoints/iter_0000004/rank00000.safetensors"
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = run(dataset, run_dir, 1, exit_after=1)
    assert "does not match its sha256" in capfd.readouterr().out
    assert max(resumed) == 3  # resumed from step 2, trained one step
    # None intact: starting afresh would write over the run's metrics and config, so it is refused
    for rank_file in run_dir.glob("checkpoints/iter_*/rank00000.safetensors"):
        rank_file.write_bytes(rank_file.read_bytes()[:-1] + b"?")
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.toml")}
    with pytest.raises(RankFailed, match=r"holds checkpoints but none is intact \(the newest: .*iter_0000003.*sha256"):
        run(dataset, run_dir, 1, exit_after=1)
    assert before == {name: (run_dir / name).read_bytes() for name in before}


def test_a_checkpoint_s_files_are_hashed_side_by_side(saved_at_tp2_pp2_dp2, monkeypatch):
    """Checking a checkpoint hashed its files one after another on one core (~1.75 GB/s: an 8B training checkpoint's
    resume or eval waited a minute); they are hashed on threads, and a corrupt one is still named."""
    import threading

    directory = find_loadable(Path(saved_at_tp2_pp2_dp2))[0]
    hash_file = checkpoint_format.sha256_of
    both_hashing = threading.Barrier(2, timeout=10)  # broken unless two hashes run at once

    def hashed_beside_another(path):
        both_hashing.wait()
        return hash_file(path)

    monkeypatch.setattr(checkpoint_format.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(checkpoint_format, "sha256_of", hashed_beside_another)
    assert read_metadata(directory).step > 0
    monkeypatch.setattr(
        checkpoint_format,
        "sha256_of",
        lambda path: "0" * 64 if path.name.endswith("2.safetensors") else hash_file(path),
    )
    with pytest.raises(CheckpointError, match=r"rank00002.safetensors does not match its sha256 \(corrupt\)"):
        read_metadata(directory)


def test_inspect_lists_tensors_in_the_model_s_order():
    """A ZeRO-3 pp 2 checkpoint listed layers 1, 0, the embedding, the final norm, 3, 2: the order its ranks wrote."""
    from loom.tools.ckpt import _model_order

    written = ["layers.1.mlp.fc1.weight", "final_norm.weight", "layers.10.mlp.fc1.weight", "embedding.weight"]
    written += ["output_weight", "layers.2.attention.qkv.weight", "layers.0.input_norm.weight"]
    assert sorted(written, key=_model_order) == [
        "embedding.weight",
        "layers.0.input_norm.weight",
        "layers.1.mlp.fc1.weight",
        "layers.2.attention.qkv.weight",
        "layers.10.mlp.fc1.weight",
        "final_norm.weight",
        "output_weight",
    ]


def test_reshard_then_resume(dataset, straight, saved_at_tp2_pp2_dp2, tmp_path, live_tensors):
    """A resharded checkpoint resumes the run; reshard rebuilds one logical tensor at a time (it held a target
    rank's whole share: at tp 1, an 8B training checkpoint's 112 GB)."""
    from loom.engine.config import ConfigError
    from loom.tools.ckpt import inspect, reshard

    resharded = tmp_path / "resharded"
    with pytest.raises(ConfigError, match=r"parallel.vp > 1 needs parallel.pp > 1"):  # written, then refused by train
        reshard(saved_at_tp2_pp2_dp2, resharded, tp=1, pp=1, vp=2)
    assert not resharded.exists()
    rebuilt = [live_tensors(PieceReader, "model"), live_tensors(PieceReader, "optim")]
    reshard(saved_at_tp2_pp2_dp2, resharded, tp=1, pp=2)
    assert [(watch.made >= 20, watch.most) for watch in rebuilt] == [(True, 1), (True, 1)]
    assert "layout tp=1 pp=2 vp=1 dp=1 world=2 zero=0" in inspect(resharded)
    resumed = run(dataset, tmp_path / "resumed", 2, {"pp": 2}, checkpoint={"load": str(resharded)})
    for step in resumed:
        assert abs(resumed[step] - straight[step]) / straight[step] < 1e-4


def _loom(*args):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo))
    return subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", *args], capture_output=True, text=True, env=env, cwd=repo, timeout=300
    )


def test_eval_gives_the_same_loss_under_any_layout(dataset, saved_at_tp2_pp2_dp2, capfd):
    from loom.launch.cli import main

    losses = []
    for layout in ([], ["--nproc", "2", "--parallel.tp", "2"], ["--nproc", "2", "--parallel.pp", "2"]):
        main(["eval", "--checkpoint", str(saved_at_tp2_pp2_dp2), "--data", dataset, *layout])  # `loom eval ...`
        line = [x for x in capfd.readouterr().out.splitlines() if "validation loss" in x][0]
        assert line.startswith(f"step {HALF}: validation loss")
        losses.append(float(line.split("validation loss ")[1].split(",")[0]))
    assert max(losses) - min(losses) < 1e-3


def test_checkpoint_of_another_model_names_the_first_mismatch(dataset, saved_at_tp2_pp2_dp2, tmp_path):
    result = _loom(
        "train",
        "--config",
        "tiny",
        "--data.paths",
        dataset,
        "--data.tokenizer",
        "none",
        "--model.ffn_hidden_size",
        "256",
        "--checkpoint.load",
        str(saved_at_tp2_pp2_dp2),
        "--train.run_dir",
        str(tmp_path),
    )
    assert result.returncode == 2, result.stderr  # refused before any rank starts
    assert "is of another model: model.ffn_hidden_size = 384 there, 256 here" in result.stderr


def test_a_setting_a_checkpoint_predates_counts_as_its_default(tmp_path):
    """A checkpoint whose config predates model.norm_placement computed pre-norm blocks: loaded with norm_placement =
    output it is another model with the same tensors, and was loaded; it is refused now. A field resolved from
    others (head_dim) is not compared where the saved config lacks it."""
    from loom.engine.checkpoint.saved_settings import check_same_model
    from loom.engine.config_io import config_to_dict, load_config

    saved = config_to_dict(load_config("tiny"))
    for name in ("norm_placement", "qk_norm_per_head", "head_dim"):
        del saved["model"][name]
    check_same_model(tmp_path, saved, load_config("tiny"))
    with pytest.raises(CheckpointError, match="model.norm_placement = input there, output here"):
        check_same_model(tmp_path, saved, load_config("tiny", ["--model.norm_placement", "output"]))


def metadata_of(step: int, files: dict[str, FileRecord], index: dict[str, str]) -> CheckpointMetadata:
    return CheckpointMetadata(
        step=step,
        consumed_samples=8 * step,
        tokens=8 * step * 64,
        layout=CheckpointLayout(tp=1, pp=1, vp=1, dp=1, world=1, zero=0, optimizer="adamw", precision="fp32"),
        optimizer_step=step,
        loss_scaler=None,
        config={},
        specs={"w": ShardSpec((4,))},
        files=files,
        index=index,
    )


def test_truncated_or_missing_shard_is_reported_not_loaded(tmp_path):
    directory = tmp_path / "checkpoints" / "iter_0000002"
    directory.mkdir(parents=True)
    shard = directory / "rank00000.safetensors"
    shard.write_bytes(b"x" * 100)
    (directory / "metadata.json").write_text(metadata_of(2, {shard.name: FileRecord.of(shard)}, {}).to_json())
    assert read_metadata(directory).files
    shard.write_bytes(b"x" * 60)
    with pytest.raises(
        CheckpointError, match=r"rank00000.safetensors has 60 bytes, expected 100 \(truncated\? copy it again"
    ):
        read_metadata(directory)
    shard.unlink()
    with pytest.raises(CheckpointError, match="incomplete: rank00000.safetensors is missing"):
        read_metadata(directory)
    warnings = []
    assert find_loadable(tmp_path / "checkpoints", warn=warnings.append) is None
    assert "falling back" in warnings[0]


def test_a_file_written_one_tensor_at_a_time_reads_as_save_file_s(tmp_path):
    """stream_tensors_atomically (merge-lora, import-hf, export-hf) writes the safetensors format itself: what
    safetensors reads back is what save_file's file gives, for every dtype loom writes, a scalar and an empty
    tensor; a tensor made otherwise than declared leaves no file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from loom.engine.atomic import stream_tensors_atomically

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 5, generator=generator),
        "bf16": torch.randn(7, generator=generator).bfloat16(),
        "fp16": torch.randn(2, 2, 2, generator=generator).half(),
        "scale": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "steps": torch.arange(5),
        "fp8": torch.randn(4, generator=generator).to(torch.float8_e4m3fn),
    }
    declared = {key: (tensor.dtype, tuple(tensor.shape)) for key, tensor in tensors.items()}
    stream_tensors_atomically(declared, tensors.__getitem__, tmp_path / "streamed.safetensors", {"format": "pt"})
    save_file(tensors, tmp_path / "saved.safetensors", metadata={"format": "pt"})
    streamed, saved = load_file(tmp_path / "streamed.safetensors"), load_file(tmp_path / "saved.safetensors")
    assert streamed.keys() == saved.keys() == tensors.keys()
    for key, tensor in saved.items():
        assert streamed[key].dtype == tensor.dtype and streamed[key].shape == tensor.shape, key
        assert torch.equal(streamed[key].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), key
    with safe_open(str(tmp_path / "streamed.safetensors"), "pt") as file:
        assert file.metadata() == {"format": "pt"}

    misshapen = {**declared, "w": (torch.float32, (5, 3))}
    with pytest.raises(ValueError, match=r"w: made torch.float32 \(3, 5\), declared torch.float32 \(5, 3\)"):
        stream_tensors_atomically(misshapen, tensors.__getitem__, tmp_path / "bad.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.safetensors", "streamed.safetensors"]


def staged(checkpoints: Path, step: int) -> tuple[Path, Path, CheckpointMetadata]:
    """A fully written, not yet committed checkpoint of one tensor: commit()'s arguments."""
    final = iteration_dir(checkpoints, step)
    staging = make_staging_dir(final)
    name, record = write_rank_file(staging, 0, {"model/w/tp0": torch.full((4,), float(step))})
    return staging, final, metadata_of(step, {name: record}, {"model/w/tp0": name})


def test_commit_interrupted_before_the_rename_keeps_the_previous_latest(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    commit(*staged(checkpoints, 2))
    staging, final, metadata = staged(checkpoints, 4)
    rename = os.replace

    def killed_at_the_rename(source, target):
        if Path(source) == staging:
            raise KeyboardInterrupt("killed before the rename")
        rename(source, target)

    monkeypatch.setattr(checkpoint_format.os, "replace", killed_at_the_rename)
    with pytest.raises(KeyboardInterrupt):
        commit(staging, final, metadata, keep=1)
    monkeypatch.undo()
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    assert (staging / "metadata.json").is_file() and not final.exists()
    assert find_loadable(checkpoints)[0] == iteration_dir(checkpoints, 2)

    commit(staging, final, metadata, keep=1)
    assert (checkpoints / "latest").read_text().strip() == "iter_0000004"
    assert read_metadata(final) == metadata  # to_json/from_json round-trip every field
    assert not iteration_dir(checkpoints, 2).exists()  # keep=1


def test_commit_refuses_metadata_naming_an_unwritten_file(tmp_path):
    staging, final, metadata = staged(tmp_path / "checkpoints", 2)
    metadata.files["rank00001.safetensors"] = metadata.files["rank00000.safetensors"]
    with pytest.raises(CheckpointError, match="rank00001.safetensors not written"):
        commit(staging, final, metadata)
    assert not (tmp_path / "checkpoints" / "latest").exists()


def _save_then_resume(rank, world, dataset, run_dir):
    """Train two steps and save; a new Trainer on the same run directory resumes. What it restored, and
    what the first trainer had, including the data position it hands over to BatchIterator.load_state_dict."""
    from loom.engine.data.loader import BatchIterator

    def trainer() -> Trainer:
        return Trainer(tiny_config(dataset, run_dir, train={"steps": 4, "micro_batch_size": 1, "eval_interval": 2}))

    first = trainer()
    first.train_step()
    first.train_step()
    first.save()
    saved = {"position": first.train_batches.state_dict(), "streams": first.streams.snapshot()}
    saved["validation_loss"] = first.evaluate()
    saved["next_batch"] = first.train_batches.next_step(first.device)[0][0]
    first.close()

    loaded = []
    load_state_dict = BatchIterator.load_state_dict

    def recording(self, state):
        loaded.append(dict(state))
        load_state_dict(self, state)

    BatchIterator.load_state_dict = recording
    second = trainer()
    restored = {
        "step": second.step,
        "loaded": loaded,
        "position": second.train_batches.state_dict(),
        "streams": second.streams.snapshot(),
        "next_batch": second.train_batches.next_step(second.device)[0][0],
    }
    second.close()
    BatchIterator.load_state_dict = load_state_dict
    config = tiny_config(dataset, run_dir, train={"steps": 4, "micro_batch_size": 1, "eval_interval": 2})
    evaluation = Trainer(config, evaluation_only=True)
    restored["evaluation_holds"] = (evaluation.optimizer, evaluation.grads)  # the weights alone
    restored["validation_loss"] = evaluation.evaluate()
    evaluation.close()
    return saved, restored


def test_data_position_and_rng_round_trip_through_load_state_dict(dataset, tmp_path):
    [(saved, restored)] = run_ranks(_save_then_resume, 1, dataset, str(tmp_path / "run"))
    assert restored["step"] == 2
    assert restored["loaded"] == [saved["position"]]
    assert restored["position"] == saved["position"]
    assert torch.equal(restored["next_batch"], saved["next_batch"])
    for stream, state in saved["streams"].items():
        assert torch.equal(restored["streams"][stream], state)
    assert restored["evaluation_holds"] == (None, None)  # no fp32 masters, no gradient buffer: 12 of a 1B's 17.7 GB
    assert restored["validation_loss"] == saved["validation_loss"]


class _DelayedScaling:
    """Stands in for a Transformer Engine Linear under delayed scaling, which needs a GPU: an amax history of
    its input and weight, max-reduced over the TP group as TE reduces it, and the scales taken from it, kept as
    extra state in TE's form (a uint8 tensor of a pickled dict)."""

    HISTORY = 3

    def __init__(self, *args, params_dtype=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.amax_history = torch.zeros(self.HISTORY, 2)
        self.scale = torch.ones(2)

    def forward(self, x):
        if self.training:
            amax = torch.stack([x.detach().abs().amax(), self.weight.detach().abs().amax()]).float()
            if torch.distributed.get_world_size(self.tp_group) > 1:
                torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=self.tp_group)
            self.amax_history = torch.cat([amax[None], self.amax_history[:-1]])
            self.scale = 448.0 / self.amax_history.amax(dim=0)
        return super().forward(x)

    def get_extra_state(self) -> torch.Tensor:
        state = pickle.dumps({"amax_history": self.amax_history, "scale": self.scale})
        return torch.frombuffer(bytearray(state), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        saved = pickle.loads(state.numpy().tobytes())
        self.amax_history, self.scale = saved["amax_history"], saved["scale"]


class _DelayedColumn(_DelayedScaling, ColumnParallelLinear):
    pass


class _DelayedRow(_DelayedScaling, RowParallelLinear):
    pass


def _fp8_scaling_state(rank, world, dataset, run_dir, parallel, train_steps):
    """Train `train_steps` steps with stand-in TE delayed-scaling layers and save, or (0 steps) resume only;
    returns this rank's amax histories and scales by module name."""
    import contextlib

    from loom.engine import train
    from loom.engine.model import te
    from loom.engine.model.kernels import Choice, Kernels

    native = Kernels.native()
    linear = Choice("te.Linear+fp8(delayed)", "test: a stand-in for TE")
    kernels = Kernels(native.attention, native.norm, native.activation, linear, native.optimizer, fp8="delayed")
    train.choose_kernels = lambda config, device: kernels
    te.column_parallel_linear, te.row_parallel_linear = _DelayedColumn, _DelayedRow
    te.fp8_recipe, te.fp8_autocast = lambda mode: None, lambda recipe, group: contextlib.nullcontext()

    config = tiny_config(dataset, run_dir, parallel=parallel, train={"steps": 4, "seq_length": 64})
    trainer = train.Trainer(config)
    for _ in range(train_steps):
        trainer.train_step()
    if train_steps:
        trainer.save()
    layers = {
        name: m for chunk in trainer.chunks for name, m in chunk.named_modules() if isinstance(m, _DelayedScaling)
    }
    state = {name: (m.amax_history, m.scale) for name, m in layers.items()}
    trainer.close()
    return state


def test_fp8_scaling_state_resumes_under_another_layout(dataset, tmp_path):
    run_dir = str(tmp_path / "run")
    saved = run_ranks(_fp8_scaling_state, 2, dataset, run_dir, {"tp": 2}, 2)
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) == 4 * 4  # qkv, proj, fc1, fc2 of 4 blocks
    for name, (history, scale) in saved[0].items():
        assert torch.equal(history, saved[1][name][0])  # TP ranks agree (amaxes reduced over TP), so one copy serves
        assert history.gt(0).all() and scale.ne(1).all()  # what a fresh layer has not seen
    # `loom ckpt reshard` carries them: one copy in the file of the stage that holds the layer.
    resharded = reshard(Path(run_dir) / "checkpoints", tmp_path / "resharded", tp=2, pp=2)
    metadata = read_metadata(resharded)
    for name, (history, _) in saved[0].items():
        stage = int(name.split(".")[1]) // 2
        assert metadata.index[f"fp8/{name}"] == f"rank{stage * 2:05d}.safetensors"  # TP rank 0 of the stage
        extra = PieceReader(resharded, metadata).tensor(f"fp8/{name}")
        assert torch.equal(pickle.loads(extra.numpy().tobytes())["amax_history"], history)
    # tp 2 -> pp 2: each stage restores its own layers' histories, found by module name.
    resumed = run_ranks(_fp8_scaling_state, 2, dataset, run_dir, {"pp": 2}, 0)
    assert sorted(resumed[0]) == sorted(n for n in saved[0] if int(n.split(".")[1]) < 2)
    assert sorted(resumed[1]) == sorted(n for n in saved[0] if int(n.split(".")[1]) >= 2)
    for stage in resumed:
        for name, (history, scale) in stage.items():
            assert torch.equal(history, saved[0][name][0]) and torch.equal(scale, saved[0][name][1])


def test_a_resumed_step_sits_where_the_optimizer_kernel_takes_it():
    """torch's fused (and capturable) AdamW takes its step on the parameters' device, the others on the host, as
    torch's own load_state_dict places it; a host step failed CUDA's fused AdamW at the first resumed step (the
    device here is "meta", standing for a GPU the CPU cannot have)."""
    from loom.engine.checkpoint.load import step_value

    param = torch.nn.Parameter(torch.zeros(4))
    master_on_a_device = torch.empty(4, device="meta")
    fused, foreach = (torch.optim.AdamW([param], **kind) for kind in ({"fused": True}, {"foreach": True}))
    on_device, on_host = step_value(fused, 3, master_on_a_device), step_value(foreach, 3, master_on_a_device)
    assert (on_device.device.type, on_host.device.type) == ("meta", "cpu")
    assert on_host.dtype == on_device.dtype == torch.float32 and on_host.item() == 3.0


def test_random_streams_resume_only_onto_generators_of_their_kind():
    from loom.engine.checkpoint.load import same_generators

    cpu = {"torch": torch.get_rng_state(), "tensor": torch.Generator().manual_seed(1).get_state()}
    cuda_like = {"torch": torch.get_rng_state(), "tensor": torch.zeros(16, dtype=torch.uint8)}  # a CUDA state's size
    assert same_generators(cpu, cpu) and not same_generators(cpu, cuda_like) and not same_generators(cuda_like, cpu)


def test_checking_a_large_checkpoints_hashes_is_said_first(saved_at_tp2_pp2_dp2, monkeypatch, capsys):
    """Every command that reads a checkpoint checks its sha256 first: 3-4 s of silence for a 1B training
    checkpoint, a minute for an 8B one."""
    from loom.engine.checkpoint.format import candidates, read_metadata

    newest = candidates(saved_at_tp2_pp2_dp2)[0]
    read_metadata(newest)
    assert capsys.readouterr().out == ""  # small: quick, and quiet
    monkeypatch.setattr(checkpoint_format, "SLOW_HASH_BYTES", 0)
    metadata = read_metadata(newest)
    size = sum(record.size for record in metadata.files.values()) / 1e9
    assert capsys.readouterr().out == f"checking the sha256 of {newest}'s {size:,.1f} GB\n"
    read_metadata(newest, verify_hashes=False)
    assert capsys.readouterr().out == ""


def _training_past_a_failed_background_save(rank, world, dataset, run_dir):
    """Train 8 steps saving every 2 in the background, the save of step 4 failing (a full disk); the error and the
    steps logged before it."""
    import errno
    import threading

    from loom.engine.checkpoint import save

    write, failed = save.write_rank_file, threading.Event()

    def full_disk_at_step_4(staging, rank, pieces):
        if staging.name.startswith("iter_0000004"):
            failed.set()
            raise OSError(errno.ENOSPC, "No space left on device", str(staging / "rank00000.safetensors"))
        return write(staging, rank, pieces)

    save.write_rank_file = full_disk_at_step_4
    config = tiny_config(dataset, run_dir, train={"steps": 8}, checkpoint={"interval": 2, "async_save": True})
    trainer = Trainer(config)
    writer = trainer.checkpoint_writer
    asks = writer.raise_if_failed

    def once_the_save_has_failed():  # its thread has ended by the boundary after step 4: timing made certain
        if trainer.step == 4 and failed.wait(60):
            writer._thread.join()
        asks()

    writer.raise_if_failed = once_the_save_has_failed
    try:
        trainer.run()
    except CheckpointError as error:
        return str(error), [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    finally:
        trainer.close()
    return None, []


def test_a_failed_background_save_stops_the_run_at_the_next_step(dataset, tmp_path):
    """A background save (checkpoint.async_save) that failed, a full disk, was said at the next save: training
    went on for an interval first (steps 5 and 6 here), their work then lost. The loop asks at each step."""
    [(error, steps)] = run_ranks(_training_past_a_failed_background_save, 1, dataset, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert error == (
        f"no space left to save step 4 in {checkpoints} ({checkpoints}/iter_0000004.tmp/rank00000.safetensors: No "
        "space left on device); free some space (iter_0000004.tmp/, this unfinished save, can go) and rerun: it "
        "resumes from the newest complete checkpoint, if any"
    )
    assert steps == [1, 2, 3, 4], steps
