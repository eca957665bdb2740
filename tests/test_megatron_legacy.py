"""`loom ckpt import-megatron` of checkpoints Megatron-LM's legacy GPT model wrote (megatron/legacy, before
megatron-core; Megatron-LM removed it in 2026, so its own tools no longer read them): tests/fixtures/megatron_legacy
holds two, saved by Megatron's save_checkpoint from two tensor-parallel ranks in the torch format, with the logits
Megatron's model computed (generate.py there says how they were made). The import computes those logits: GPT-2's
shape (LayerNorm, biases, learned positions, tied) and Llama's (RMSNorm, SwiGLU, rotary, grouped queries, untied), and
the GPT files labelled with the checkpoint versions before 2020 (their QKV rows in other orders) give the model
Megatron's own load made of them. Megatron is not needed."""

import argparse
import re
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from training_runs import loom_here, loom_logits, one_line_error

from loom.engine.checkpoint.format import CheckpointError
from loom.tools.megatron_checkpoint import (
    EMBEDDING,
    POSITIONS,
    gelu_is_exact,
    ignored_settings,
    import_megatron,
    model_from_megatron_arguments,
    read_megatron_arguments,
)
from loom.tools.megatron_torch_format import TorchFormatCheckpoint, load_pickled

FIXTURES = Path(__file__).with_name("fixtures") / "megatron_legacy"


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_a_legacy_megatron_checkpoint_imports_with_megatron_s_logits(variant, tmp_path):
    import_megatron(FIXTURES / variant, tmp_path / "out")
    reference = torch.load(FIXTURES / f"{variant}.pt")
    logits = loom_logits(tmp_path / "out", reference["tokens"])
    assert logits.shape == reference["logits"].shape  # Megatron's padded vocabulary: 128 rows for 120 tokens
    assert (logits - reference["logits"]).abs().max().item() < 5e-5


def _labelled(save: Path, version: float) -> Path:
    """`save`'s rank files with checkpoint_version `version`: the float's 8 bytes in the pickle and the zip's CRCs of
    the pickle rewritten in place (the files hold Megatron's classes, which only Megatron unpickles to save again)."""
    for rank_file in save.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        with zipfile.ZipFile(rank_file) as archive:
            record = next(info for info in archive.infolist() if info.filename.endswith("/data.pkl"))
        data = bytearray(rank_file.read_bytes())
        local = record.header_offset
        name_length, extra_length = struct.unpack("<HH", data[local + 26 : local + 30])
        start = local + 30 + name_length + extra_length
        pickled = data[start : start + record.file_size]
        at = re.search(rb"checkpoint_version.{0,8}?G", pickled, re.DOTALL).end()  # G: an 8-byte float follows
        pickled[at : at + 8] = struct.pack(">d", version)
        data[start : start + record.file_size] = pickled
        crc = struct.pack("<I", zlib.crc32(pickled))
        central = data.rindex(record.filename.encode()) - 46
        data[local + 14 : local + 18] = data[central + 16 : central + 20] = crc
        rank_file.write_bytes(bytes(data))
    return save


@pytest.mark.parametrize("version", [0, 1])
def test_the_first_checkpoint_versions_import_as_megatron_s_load_reordered_them(version, tmp_path):
    save = _labelled(shutil.copytree(FIXTURES / "gpt", tmp_path / "save"), float(version))
    import_megatron(save, tmp_path / "out")
    reference = torch.load(FIXTURES / f"v{version}.pt")
    assert (loom_logits(tmp_path / "out", reference["tokens"]) - reference["logits"]).abs().max().item() < 5e-5


def test_a_legacy_tensor_loom_does_not_know_is_refused(tmp_path, capfd):
    """A BERT's pooler among a legacy model's tensors: named, not dropped."""
    iteration = FIXTURES / "gpt" / "iter_0000005"
    plain = (int, float, str, bool, type(None), torch.dtype)  # Megatron's enums are left out: only it unpickles them
    args = {k: v for k, v in read_megatron_arguments(iteration).items() if isinstance(v, plain)}
    save = tmp_path / "save"
    for rank in ("mp_rank_00", "mp_rank_01"):
        model = load_pickled(iteration / rank / "model_optim_rng.pt")["model"]
        model["language_model"]["pooler"] = {"dense.weight": torch.zeros(32, 32)}
        (save / "iter_0000005" / rank).mkdir(parents=True)
        saved = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": 5, "model": model}
        torch.save(saved, save / "iter_0000005" / rank / "model_optim_rng.pt")
    (save / "latest_checkpointed_iteration.txt").write_text("5")
    refused = loom_here(capfd, "ckpt", "import-megatron", "--input", str(save), "--output", str(tmp_path / "out"))
    one_line_error(refused, "language_model.pooler.dense.weight, which loom does not know")
    assert not (tmp_path / "out").exists()


ITERATION = "iter_0000005"


def _arguments(variant: str, **changes) -> dict:
    return {**read_megatron_arguments(FIXTURES / variant / ITERATION), **changes}


def test_the_distributed_optimizer_s_own_folders_of_2022_to_2023_are_passed_over(tmp_path):
    """Megatron-LM 22.04 to 23.04 with --use-distributed-optimizer: each rank's model in model_rng.pt and the
    optimizer in mp_rank_TT_DDD/optim.pt, which at pipeline 1 looks like a pipeline stage's folder."""
    save = shutil.copytree(FIXTURES / "gpt", tmp_path / "save")
    for rank in ("mp_rank_00", "mp_rank_01"):
        (save / ITERATION / rank / "model_optim_rng.pt").rename(save / ITERATION / rank / "model_rng.pt")
        (save / ITERATION / f"{rank}_000").mkdir()
        torch.save({"optimizer": {}}, save / ITERATION / f"{rank}_000" / "optim.pt")
    import_megatron(save, tmp_path / "out")
    reference = torch.load(FIXTURES / "gpt.pt")
    assert (loom_logits(tmp_path / "out", reference["tokens"]) - reference["logits"]).abs().max().item() < 5e-5


def test_arguments_under_their_older_names_are_read_as_megatron_read_them():
    """Before 2020-10 the tensor-parallel size was model_parallel_size; Megatron-LM 23.04 and 23.06 said rotary
    positions with --use-rotary-position-embeddings, and kept learned ones beside them unless told not to."""
    older = _arguments("gpt", model_parallel_size=2)
    del older["tensor_model_parallel_size"]
    assert TorchFormatCheckpoint(FIXTURES / "gpt" / ITERATION, older).shapes[EMBEDDING] == (128, 32)
    rotary = _arguments("llama", use_rotary_position_embeddings=True)
    del rotary["position_embedding_type"]
    shapes = TorchFormatCheckpoint(FIXTURES / "llama" / ITERATION, rotary).shapes
    assert model_from_megatron_arguments(rotary, shapes, legacy_model=True)["position_embedding"] == "rope"
    with pytest.raises(CheckpointError, match="adds learned positions and rotates"):
        model_from_megatron_arguments(rotary, {**shapes, POSITIONS: (32, 32)}, legacy_model=True)


def test_the_legacy_model_s_rotary_base_is_10000_whatever_the_arguments_say():
    """Its RotaryEmbedding took neither --rotary-base nor --use-rope-scaling: the import computes what it did and
    says so."""
    args = _arguments("llama", rotary_base=500000, use_rope_scaling=True)
    shapes = TorchFormatCheckpoint(FIXTURES / "llama" / ITERATION, args).shapes
    model = model_from_megatron_arguments(args, shapes, legacy_model=True)
    assert model["rope_theta"] == 10000.0 and "rope_scaling" not in model
    notes = ignored_settings(args, legacy_model=True)
    assert len(notes) == 2 and "--rotary-base 500000" in notes[0] and "--use-rope-scaling" in notes[1]
    assert model_from_megatron_arguments(args, shapes)["rope_theta"] == 500000.0  # megatron-core's model read it


@pytest.mark.parametrize(
    "args, exact",
    [
        ({}, False),  # before 2020-04: the tanh form
        ({"openai_gelu": False}, True),  # 2020-04 to 2020-09: F.gelu, exact
        ({"openai_gelu": True}, False),
        ({"openai_gelu": False, "bias_gelu_fusion": True}, False),  # from 2020-09: the fused kernel, tanh
        ({"openai_gelu": False, "onnx_safe": True, "bias_gelu_fusion": True}, True),  # erf
    ],
)
def test_the_legacy_model_s_gelu_is_the_one_its_megatron_computed(args, exact):
    assert gelu_is_exact(args, legacy_model=True) is exact


def test_the_legacy_model_of_transformer_engine_s_layers_is_refused_naming_megatron_s_converter():
    with pytest.raises(CheckpointError, match="--loader-transformer-impl transformer_engine --saver core"):
        TorchFormatCheckpoint(FIXTURES / "gpt" / ITERATION, _arguments("gpt", transformer_impl="transformer_engine"))
