"""`loom ckpt import-megatron`, checked against megatron-core: checkpoints written as Megatron-LM's training loop
writes them (tests/megatron_checkpoints.py: megatron-core's GPTModel on CPU, its sharded state dict, its
dist_checkpointing.save in torch_dist) import into loom with the logits megatron-core computed, for a Llama-shaped
model (GQA, stacked layers, norms on queries and keys, --softmax-scale), a GPT-3-shaped one (LayerNorm, biases,
learned positions, tied, one key per layer) and one with multi-query attention, interleaved rotary pairs over half
of each head (--rotary-percent 0.5), Llama 3 rope scaling, zero-centred norms, biases on QKV alone (--add-qkv-bias),
query/key norms, a squared-ReLU MLP (--squared-relu) and bf16 weights. The user stories: `loom eval` of the import
equals the loss of Megatron's logits, and a fine-tune from it starts from that loss; Megatron is not needed to
import. The older torch format (a file per rank), written from megatron-core's own resharding over tensor 2 x
pipeline 2 x virtual 2 ranks, imports as the torch_dist save. What loom cannot compute the same way is refused
naming Megatron's flag; Megatron folders given where loom's checkpoints go are answered with the command."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from training_runs import loom_here, loom_logits, one_line_error, tiny_train_args

from loom.engine.checkpoint.format import CheckpointError, find_loadable
from loom.engine.data.indexed import IndexedDatasetWriter
from loom.engine.parallel.rendezvous import free_port
from loom.tools.megatron_checkpoint import (
    COMMON,
    ignored_settings,
    import_megatron,
    model_from_megatron_arguments,
    read_megatron_arguments,
)
from loom.tools.megatron_export import export_megatron

pytest.importorskip("megatron.core.dist_checkpointing", reason="needs loom[reference]")

VARIANTS = ("llama", "gpt", "interleaved")
ITERATION = "iter_0000007"
LAYERS = 4
"""The variants' layers (tests/megatron_checkpoints.py's SHAPE): enough for pipeline 2 x virtual 2 stages."""


def _as_megatron(out: Path, world: int = 1, *jobs: str) -> None:
    """tests/megatron_checkpoints.py in a process of its own: writes the variants into `out`, or runs `jobs` on
    `world` ranks (read:TP:NAME=SAVE loads loom's export with megatron-core; torch:TP:PP:VP:NAME re-saves a variant in
    the older torch format)."""
    script = Path(__file__).with_name("megatron_checkpoints.py")
    command = [sys.executable, str(script), str(out), str(free_port()), *([str(world), *jobs] if jobs else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> Path:
    """The three Megatron-LM --save folders, and beside each its tokens and megatron-core's logits."""
    out = tmp_path_factory.mktemp("megatron")
    _as_megatron(out)
    return out


@pytest.fixture(scope="module")
def imported(megatron, tmp_path_factory) -> Path:
    """Each variant imported; the Llama-shaped one by a process in which `import megatron` fails."""
    out = tmp_path_factory.mktemp("imported")
    blocked = (
        "import sys; sys.modules['megatron'] = None; from pathlib import Path; "
        "from loom.tools.megatron_checkpoint import import_megatron; "
        f"import_megatron(Path({str(megatron / 'llama')!r}), Path({str(out / 'llama')!r}))"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in VARIANTS[1:]:
        import_megatron(megatron / name, out / name)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_imported_megatron_checkpoint_computes_megatron_core_s_logits(megatron, imported, variant):
    reference = torch.load(megatron / f"{variant}.pt")
    ours = loom_logits(imported / variant, reference["tokens"])
    assert ours.shape == reference["logits"].shape  # Megatron's padded vocabulary (256 rows for 250 tokens) kept
    assert (ours - reference["logits"]).abs().max().item() < 5e-5


def test_the_import_reads_one_layer_of_a_stacked_tensor_at_a_time(megatron, tmp_path, live_tensors, monkeypatch):
    """An 8B model's stacked QKV is 32 layers of it: read whole per layer it would be read 32 times, read once it
    would be held whole. Each read is one layer's slice, and one or two are alive at once."""
    from loom.tools.megatron_checkpoint import DistributedCheckpoint

    alive = live_tensors(DistributedCheckpoint, "read")
    slices = []
    monkeypatch.setattr(DistributedCheckpoint, "read", _recording(DistributedCheckpoint.read, slices))
    import_megatron(megatron / "llama", tmp_path / "out")
    stacked = [(key, index) for key, index in slices if key.startswith("decoder.layers.")]
    tensors_per_layer = 8  # two norms, QKV, proj, q_norm, k_norm, fc1, fc2
    assert len(stacked) == LAYERS * tensors_per_layer and all(index is not None for _, index in stacked), slices
    assert alive.made == len(slices) and alive.most <= 2, (alive.made, alive.most)


def _recording(read, calls: list):
    def recorded(self, key, index=None):
        calls.append((key, index))
        return read(self, key, index)

    return recorded


def _one_document(megatron: Path, variant: str, prefix: Path) -> tuple[dict, torch.Tensor]:
    """The variant's reference (tokens, megatron-core's logits) and its first row of tokens, written as the one
    document of the dataset `prefix`."""
    reference = torch.load(megatron / f"{variant}.pt")
    tokens = reference["tokens"][:1]
    with IndexedDatasetWriter(prefix, np.dtype(np.uint16)) as writer:
        writer.add_document(tokens[0].numpy())
    return reference, tokens


def _fine_tuning(checkpoint: Path, tmp_path: Path, tokens: torch.Tensor, steps: int) -> list[str]:
    """`loom train` flags fine-tuning `checkpoint` (fp32) for `steps` steps of the one-document dataset
    tmp_path/one, a sample per step, into tmp_path/run."""
    flags = tiny_train_args(str(tmp_path / "one"), tmp_path / "run")
    flags += ["--checkpoint.load", str(checkpoint), "--checkpoint.finetune", "true", "--data.split", "1,0,0"]
    flags += ["--train.seq_length", str(tokens.shape[1] - 1), "--train.global_batch_size", "1"]
    return flags + ["--train.micro_batch_size", "1", "--train.steps", str(steps), "--train.precision", "fp32"]


def _loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_loom_eval_of_the_import_equals_the_loss_of_megatron_s_logits(megatron, imported, variant, tmp_path, capfd):
    """One document of the reference tokens is the only sample, so every batch holds it."""
    reference, tokens = _one_document(megatron, variant, tmp_path / "one")
    seq_length = tokens.shape[1] - 1
    result = loom_here(
        capfd,
        *["eval", "--checkpoint", str(imported / variant), "--data", str(tmp_path / "one"), "--iters", "1"],
        *["--train.seq_length", str(seq_length), "--train.global_batch_size", "1", "--train.precision", "fp32"],
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "validation loss" in x)
    ours = float(line.split("validation loss ")[1].split(",")[0])
    assert abs(ours - _loss_of(reference["logits"][:1], tokens)) < 2e-5


def test_a_fine_tune_from_the_import_starts_at_megatron_s_loss(megatron, imported, tmp_path, capfd):
    """Megatron's --finetune continued in loom: the first step's loss (before its update) is the loss of the
    logits megatron-core computed, and the steps after it train."""
    reference, tokens = _one_document(megatron, "gpt", tmp_path / "one")
    result = loom_here(
        capfd, "train", *_fine_tuning(imported / "gpt", tmp_path, tokens, 3), "--optim.warmup_steps", "0"
    )
    assert result.returncode == 0, result.stderr
    assert "the model is that of" in result.stdout + result.stderr  # the tiny preset's shape gave way
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert abs(losses[0] - _loss_of(reference["logits"][:1], tokens)) < 2e-5
    assert losses[-1] < losses[0]


@pytest.fixture(scope="module")
def exported(megatron, imported, tmp_path_factory) -> Path:
    """Each import exported back (loom ckpt export-megatron), and megatron-core's logits of each export, on one
    rank and (where the heads split: not multi-query) over two tensor-parallel ranks; the torch-format saves of
    the `torch_format` fixture are written by the same start."""
    out = tmp_path_factory.mktemp("exported")
    for name in VARIANTS:
        export_megatron(imported / name, out / name)
    reads = [f"read:1:{name}={out / name}" for name in VARIANTS]
    reads += [f"read:2:{name}={out / name}" for name in SPLIT_OVER_TWO_RANKS]
    # one start of four ranks for these and the torch-format saves (megatron-core takes seconds to import)
    _as_megatron(megatron, 4, *reads, *(f"torch:2:2:2:{name}" for name in TORCH_FORMAT))
    return out


SPLIT_OVER_TWO_RANKS = ("llama", "gpt")
"""The variants megatron-core splits over two tensor-parallel ranks (its query groups divide by them)."""

TORCH_FORMAT = ("llama", "gpt")
"""The variants re-saved in Megatron-LM's older torch format at tensor 2 x pipeline 2 x virtual 2 (the GPT-shaped
one tied: its last stage holds a copy of the embedding)."""


@pytest.mark.parametrize("variant, tp", [(name, 1) for name in VARIANTS] + [(name, 2) for name in SPLIT_OVER_TWO_RANKS])
def test_megatron_core_loads_loom_s_export_with_the_logits_it_saved_with(megatron, exported, variant, tp):
    """The way back: megatron-core's own loader reads loom's export into the variant's model (rotate-half pairs and
    plain norm weights, as loom writes them), on one rank or resharded over two tensor-parallel ones (grouped QKV,
    SwiGLU's gate and up halves, vocabulary rows split as Megatron splits them), and computes the logits of the
    model Megatron first saved."""
    loaded = torch.load(megatron / f"{variant}.loaded_tp{tp}.pt")
    assert loaded["iteration"] == 0  # a weights-only step 0: Megatron's "release"
    assert (exported / variant / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (loaded["logits"] - torch.load(megatron / f"{variant}.pt")["logits"]).abs().max().item() < 5e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_export_imports_back_to_the_same_model(imported, exported, variant, tmp_path):
    """Weights and arguments: import-megatron of export-megatron is the model exported, tensor for tensor."""
    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.checkpoint.load import PieceReader

    again = tmp_path / "again"
    import_megatron(exported / variant, again)
    (first, first_meta), (second, second_meta) = find_loadable(imported / variant), find_loadable(again)
    assert first_meta.config["model"] == second_meta.config["model"]
    ours, theirs = PieceReader(first, first_meta), PieceReader(second, second_meta)
    for name in first_meta.specs:
        assert torch.equal(ours.model(name), theirs.model(name)), name


def test_a_fine_tune_exports_at_its_step_for_megatron_to_continue(megatron, imported, tmp_path, capfd):
    """Megatron -> loom -> Megatron: a run fine-tuned 2 steps in loom goes back as iter_0000002 with its samples
    consumed, and loads into megatron-core with the logits loom computes."""
    reference, tokens = _one_document(megatron, "llama", tmp_path / "one")
    flags = _fine_tuning(imported / "llama", tmp_path, tokens, 2)
    assert loom_here(capfd, "train", *flags, "--checkpoint.save_at_end", "true").returncode == 0
    result = loom_here(
        capfd, "ckpt", "export-megatron", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "back")
    )
    assert result.returncode == 0, result.stderr
    assert f"--load {tmp_path / 'back'} --finetune --num-layers {LAYERS} --hidden-size 64" in result.stdout
    assert "--no-load-optim --no-load-rng to go on at iteration 2 with its samples consumed" in result.stdout
    assert (tmp_path / "back/latest_checkpointed_iteration.txt").read_text() == "2"
    args = read_megatron_arguments(tmp_path / "back" / "iter_0000002")
    assert (args["iteration"], args["consumed_train_samples"]) == (2, 2)
    # Megatron-LM's load_checkpoint reads these of its runs' arguments: no RNG state to ask for, and a tokenizer_type
    # (check_checkpoint_args reads it without a default under --vocab-file)
    assert args["no_save_optim"] and args["no_save_rng"] and "tokenizer_type" in args
    shutil.copy(megatron / "llama.pt", tmp_path / "llama.pt")  # the tokens; the module's other tests read megatron/
    _as_megatron(tmp_path, 1, f"read:1:llama={tmp_path / 'back'}")
    theirs = torch.load(tmp_path / "llama.loaded_tp1.pt")["logits"]
    assert (theirs - loom_logits(tmp_path / "run", reference["tokens"])).abs().max().item() < 5e-5
    assert (theirs - reference["logits"]).abs().max().item() > 1e-3  # the fine-tune changed the model


def test_an_export_claims_its_folder_as_other_writers_do(imported, exported, tmp_path, capfd):
    def export(output: Path, *extra: str):
        return loom_here(
            capfd, "ckpt", "export-megatron", "--checkpoint", str(imported / "gpt"), "--output", str(output), *extra
        )

    one_line_error(export(imported / "gpt"), "holds loom checkpoints")
    one_line_error(export(exported / "gpt"), "already holds a Megatron-LM checkpoint", "--overwrite")
    (tmp_path / "file").write_text("x")
    one_line_error(export(tmp_path / "file"), "is a file")
    again = shutil.copytree(exported / "gpt", tmp_path / "again")
    replaced = export(again, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "were moved to" in replaced.stdout and len(list((again / "replaced").iterdir())) == 1
    assert (again / "release").is_dir() and (again / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_llama3_scaling_megatron_cannot_express_is_refused():
    from loom.engine.config_io import config_from_dict, config_to_dict
    from loom.tools.megatron_export import megatron_arguments, megatron_flags

    model = model_from_megatron_arguments({**LLAMA_ARGUMENTS, "use_rope_scaling": True}, SHAPES)
    full = config_to_dict(config_from_dict({"model": model}))["model"]  # every field, defaults for the rest
    args = megatron_arguments(full, {"seq_length": 32}, 0, 0, "float32")
    assert model_from_megatron_arguments(vars(args), SHAPES) == model  # the arguments describe the model
    # Megatron pads the vocabulary to its own divisor (x TP) and, under --vocab-file, compares it with the saved one
    assert "--make-vocab-size-divisible-by" not in megatron_flags(args)
    other = megatron_arguments({**full, "make_vocab_divisible_by": 64}, {"seq_length": 32}, 0, 0, "float32")
    assert "--make-vocab-size-divisible-by 64" in megatron_flags(other)
    with pytest.raises(CheckpointError, match="rope_original_max_positions"):
        megatron_arguments({**full, "rope_original_max_positions": 4096}, {"seq_length": 32}, 0, 0, "float32")
    with pytest.raises(CheckpointError, match="rope_scaling_factor"):  # Llama 3.2's 32: Megatron's model uses 8
        megatron_arguments({**full, "rope_scaling_factor": 32.0}, {"seq_length": 32}, 0, 0, "float32")


def test_the_import_says_what_it_read_and_leaves_megatron_s_folder_alone(megatron, tmp_path, capfd):
    result = loom_here(
        capfd, "ckpt", "import-megatron", "--input", str(megatron / "interleaved"), "--output", str(tmp_path / "a")
    )
    assert result.returncode == 0, result.stderr
    assert "iteration 7 (112 samples trained), 4 layers x 64" in result.stdout
    assert "stored in bfloat16" in result.stdout and "--checkpoint.load" in result.stdout
    assert find_loadable(tmp_path / "a")[1].config["model"]["qkv_bias"]  # --add-qkv-bias alone
    before = sorted(p.name for p in (megatron / "gpt").rglob("*"))
    for output in (megatron / "gpt", megatron / "gpt" / ITERATION / "x"):
        refused = loom_here(
            capfd, "ckpt", "import-megatron", "--input", str(megatron / "gpt"), "--output", str(output), "--overwrite"
        )
        one_line_error(refused, f"--output {output}")
    assert sorted(p.name for p in (megatron / "gpt").rglob("*")) == before


@pytest.fixture(scope="module")
def torch_format(megatron, exported) -> dict[str, Path]:
    """Each variant of TORCH_FORMAT as a --save folder in the older torch format (written beside the exports'
    loads): megatron-core loads the torch_dist save into each rank's two chunks and writes their
    state_dict_for_save_checkpoint as Megatron-LM did."""
    return {name: megatron / f"{name}.torch_tp2_pp2_vp2" for name in TORCH_FORMAT}


@pytest.mark.parametrize("variant", TORCH_FORMAT)
def test_the_older_torch_format_imports_as_its_torch_dist_save(megatron, imported, torch_format, variant, tmp_path):
    """mp_rank_TT_PPP files of model0/model1 chunks, each numbering its layers from 0, with optimizer and random
    states (numpy's) beside them: joined, the import computes megatron-core's logits and is the torch_dist import,
    tensor for tensor (grouped QKV, SwiGLU's gate and up halves, row-parallel columns, vocabulary rows)."""
    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.checkpoint.load import PieceReader

    import_megatron(torch_format[variant], tmp_path / "out")
    reference = torch.load(megatron / f"{variant}.pt")
    logits = loom_logits(tmp_path / "out", reference["tokens"])
    assert (logits - reference["logits"]).abs().max().item() < 5e-5
    (ours, ours_meta), (theirs, theirs_meta) = find_loadable(tmp_path / "out"), find_loadable(imported / variant)
    assert ours_meta.config["model"] == theirs_meta.config["model"]
    joined, dist = PieceReader(ours, ours_meta), PieceReader(theirs, theirs_meta)
    for name in theirs_meta.specs:
        assert torch.equal(joined.model(name), dist.model(name)), name


def test_a_torch_format_folder_that_is_not_whole_is_one_line(torch_format, tmp_path, capfd):
    def refused(folder: Path, *fragments: str) -> None:
        one_line_error(
            loom_here(capfd, "ckpt", "import-megatron", "--input", str(folder), "--output", str(tmp_path / "out")),
            *fragments,
        )
        assert not (tmp_path / "out").exists()

    save = torch_format["llama"]
    refused(save / ITERATION / "mp_rank_01_000", "one rank's part", "give the iteration folder that holds every rank's")
    missing = shutil.copytree(save, tmp_path / "missing")
    shutil.rmtree(missing / ITERATION / "mp_rank_01_001")
    refused(missing, "tensor 2 x pipeline 2: 4 mp_rank folders", "no mp_rank_01_001/model_optim_rng.pt")
    truncated = shutil.copytree(save, tmp_path / "truncated")
    rank_file = truncated / ITERATION / "mp_rank_01_000" / "model_optim_rng.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:2000])
    refused(truncated, f"{rank_file} cannot be read")
    torch.save(torch.load(save / ITERATION / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=False), rank_file,
               _use_new_zipfile_serialization=False)  # fmt: skip
    refused(truncated, "saved by PyTorch before 1.6", "re-save it")
    no_chunk = shutil.copytree(save, tmp_path / "no-chunk")
    for rank_file in (no_chunk / ITERATION).glob("mp_rank_*/model_optim_rng.pt"):
        saved = torch.load(rank_file, weights_only=False)
        del saved["model0"]
        torch.save(saved, rank_file)
    refused(no_chunk, "holds no 'model0' model state, which its arguments say it has (2 virtual pipeline stage(s))")


def test_megatron_folders_given_for_loom_checkpoints_are_answered_with_the_import(megatron, capfd):
    for folder in (megatron / "llama", megatron / "llama" / ITERATION):
        one_line_error(
            loom_here(capfd, "ckpt", "inspect", str(folder)),
            "it is a Megatron-LM checkpoint",
            f"loom ckpt import-megatron --input {folder}",
        )


def _copy_with_arguments(save: Path, to: Path, **changes) -> Path:
    """A copy of the --save folder `save` whose common.pt holds its arguments with `changes` (only plain values:
    the placeholders of Megatron's enums are left out)."""
    shutil.copytree(save, to)
    args = {
        k: v
        for k, v in read_megatron_arguments(save / ITERATION).items()
        if isinstance(v, (int, float, str, bool, type(None), torch.dtype))
    }
    args.update(changes)
    iteration = args.pop("iteration")
    torch.save(
        {"args": argparse.Namespace(**args), "iteration": iteration, "checkpoint_version": 3.0}, to / ITERATION / COMMON
    )
    return to


def test_an_exact_gelu_is_warned_and_imported(megatron, tmp_path, capfd):
    """Megatron's GELU is the tanh form only through its fused bias-GELU kernel; without it, erf."""
    save = _copy_with_arguments(megatron / "gpt", tmp_path / "gpt", bias_gelu_fusion=False)
    result = loom_here(capfd, "ckpt", "import-megatron", "--input", str(save), "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "GELU exactly" in result.stderr


LLAMA_ARGUMENTS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=96,
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=False,
    position_embedding_type="rope",
    max_position_embeddings=64,
    untie_embeddings_and_output_weights=True,
)
SHAPES = {"embedding.word_embeddings.weight": (256, 64)}


def test_megatron_arguments_become_loom_s_model():
    model = model_from_megatron_arguments({**LLAMA_ARGUMENTS, "rotary_base": 500000, "norm_epsilon": 1e-6}, SHAPES)
    assert model == dict(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=96,
        vocab_size=256,
        max_position_embeddings=64,
        position_embedding="rope",
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="swiglu",
        bias=False,
        qkv_bias=False,
        qk_norm=False,
        attention_scale=None,
        tie_embeddings=False,
        rope_theta=500000.0,
        rotary_percent=1.0,
    )


def test_biases_on_qkv_alone_and_another_head_size_import_and_export_as_megatron_s_flags():
    """Qwen-shaped runs (--add-qkv-bias --disable-bias-linear) were refused; loom has model.qkv_bias now (the
    interleaved variant is one: its import computes megatron-core's logits, biases included). So were heads of
    another width than hidden_size / heads (--kv-channels), model.head_dim now."""
    from loom.engine.config import LoomConfig
    from loom.engine.config_io import config_to_dict
    from loom.tools.megatron_export import megatron_arguments, megatron_flags

    assert model_from_megatron_arguments({**LLAMA_ARGUMENTS, "kv_channels": 24}, SHAPES)["head_dim"] == 24
    qwen = {**LLAMA_ARGUMENTS, "add_qkv_bias": True}
    imported = model_from_megatron_arguments(qwen, SHAPES)
    assert (imported["qkv_bias"], imported["bias"]) == (True, False)
    assert not model_from_megatron_arguments(LLAMA_ARGUMENTS, SHAPES)["qkv_bias"]
    config = config_to_dict(LoomConfig())
    config["model"]["qkv_bias"] = True
    args = megatron_arguments(config["model"], config["train"], 0, 0, "float32")
    assert (args.add_qkv_bias, args.add_bias_linear) == (True, False)
    assert "--disable-bias-linear --add-qkv-bias" in megatron_flags(args)
    config["model"]["head_dim"] = 24
    args = megatron_arguments(config["model"], config["train"], 0, 0, "float32")
    assert args.kv_channels == 24 and "--kv-channels 24" in megatron_flags(args)
    assert "--rotary-percent" not in megatron_flags(args)
    config["model"]["rotary_percent"] = 0.25  # and --rotary-percent, model.rotary_percent (the interleaved variant)
    args = megatron_arguments(config["model"], config["train"], 0, 0, "float32")
    assert args.rotary_percent == 0.25 and "--rotary-percent 0.25" in megatron_flags(args)
    config["model"]["attention_scale"] = 0.2  # --softmax-scale (the llama variant has one)
    args = megatron_arguments(config["model"], config["train"], 0, 0, "float32")
    assert args.softmax_scale == 0.2 and "--softmax-scale 0.2" in megatron_flags(args)
    with pytest.raises(CheckpointError, match="scales its embeddings, residual branches or logits"):
        megatron_arguments({**config["model"], "residual_multiplier": 0.5}, config["train"], 0, 0, "float32")
    longrope = dict(rope_scaling="longrope", rope_short_factors=[1.0] * 8, rope_long_factors=[2.0] * 8)
    with pytest.raises(CheckpointError, match="longrope-scaled .* loom exports Megatron-LM's Llama 3.1 scaling"):
        megatron_arguments({**config["model"], **longrope}, config["train"], 0, 0, "float32")
    with pytest.raises(CheckpointError, match="yarn-scaled"):
        megatron_arguments({**config["model"], "rope_scaling": "yarn"}, config["train"], 0, 0, "float32")
    # a squared ReLU with biases: Megatron's default bias-GELU fusion would make its config refuse the model
    relu2 = megatron_arguments(
        {**config["model"], "activation": "squared_relu", "bias": True}, config["train"], 0, 0, "float32"
    )
    assert (relu2.squared_relu, relu2.bias_gelu_fusion) == (True, False)
    assert "--squared-relu --no-bias-gelu-fusion" in megatron_flags(relu2)
    # Megatron's legacy MLP took --openai-gelu and --onnx-safe before --squared-relu
    legacy = {**LLAMA_ARGUMENTS, "swiglu": False, "squared_relu": True, "openai_gelu": True}
    assert model_from_megatron_arguments(legacy, SHAPES, legacy_model=True)["activation"] == "gelu"
    assert model_from_megatron_arguments(legacy, SHAPES)["activation"] == "squared_relu"
    with pytest.raises(CheckpointError, match="model.norm_placement = output, OLMo 2's or Gemma's order"):
        megatron_arguments({**config["model"], "norm_placement": "output"}, config["train"], 0, 0, "float32")
    across = {"qk_norm": True, "qk_norm_per_head": False}
    with pytest.raises(CheckpointError, match="across all heads .* --qk-layernorm normalises each head"):
        megatron_arguments({**config["model"], **across}, config["train"], 0, 0, "float32")
    with pytest.raises(CheckpointError, match="model.norm_placement = both, OLMo 2's or Gemma's order"):
        megatron_arguments({**config["model"], "norm_placement": "both"}, config["train"], 0, 0, "float32")
    with pytest.raises(CheckpointError, match="sliding window .model.sliding_window = 16.; loom exports"):
        megatron_arguments({**config["model"], "sliding_window": 16}, config["train"], 0, 0, "float32")
    interpolated = megatron_arguments(
        {**config["model"], "rope_scaling": "linear", "rope_scaling_factor": 4.0}, config["train"], 0, 0, "float32"
    )
    assert "--rotary-seq-len-interpolation-factor 4" in megatron_flags(interpolated)  # Megatron-LM's type=int
    with pytest.raises(CheckpointError, match="factor is 2.5; Megatron-LM's --rotary-seq-len-interpolation-factor"):
        megatron_arguments(
            {**config["model"], "rope_scaling": "linear", "rope_scaling_factor": 2.5}, config["train"], 0, 0, "float32"
        )
    with pytest.raises(CheckpointError, match="soft-caps its attention scores or logits"):
        megatron_arguments({**config["model"], "logits_softcap": 30.0}, config["train"], 0, 0, "float32")
    with pytest.raises(CheckpointError, match="gated GELU .* gate SiLU alone"):
        megatron_arguments({**config["model"], "activation": "geglu"}, config["train"], 0, 0, "float32")


def test_what_older_megatron_saved_or_never_used_imports_as_megatron_computed():
    """Before megatron-core 0.10 a run with biases saved add_qkv_bias False and biased its QKV all the same; the
    model builders never passed --rope-scaling-factor on (megatron-core's GPTModel scaled by 8)."""
    gpt = {**LLAMA_ARGUMENTS, "add_bias_linear": True, "add_qkv_bias": False}
    assert model_from_megatron_arguments(gpt, SHAPES)["bias"] is True
    assert model_from_megatron_arguments(gpt, SHAPES)["qkv_bias"] is False  # model.bias biases QKV too
    scaled = {**LLAMA_ARGUMENTS, "use_rope_scaling": True, "rope_scaling_factor": 32.0}
    assert model_from_megatron_arguments(scaled, SHAPES)["rope_scaling_factor"] == 8.0
    assert "--rope-scaling-factor 32.0" in ignored_settings(scaled)[0]
    assert not ignored_settings({**scaled, "rope_scaling_factor": 8.0})


def test_singleton_local_shards_and_chained_optimizer_keys_import(megatron, tmp_path):
    """Megatron-LM of Sep-Oct 2025 saved with singleton_local_shards: one key per layer and a SwiGLU fc1 in two
    halves (weight_w the gate, weight_v the up projection); a ChainedOptimizer's state sits under chained_N.
    The same model imports with the same logits."""
    import torch.distributed.checkpoint as dcp

    from loom.tools.megatron_checkpoint import DistributedCheckpoint

    source = megatron / "llama" / ITERATION
    stored = DistributedCheckpoint(source)
    state = {}
    for key, shape in stored.shapes.items():
        if not key.startswith("decoder.layers."):
            state[key] = stored.read(key)
            continue
        for layer in range(shape[0]):
            tensor, own = stored.read(key, layer), key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
            if key.endswith("linear_fc1.weight"):
                state[f"{own}_w"], state[f"{own}_v"] = tensor.chunk(2)
            else:
                state[own] = tensor
    state["chained_0.optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(3)
    rewritten = tmp_path / "save" / ITERATION
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(rewritten)), no_dist=True)
    for name in (COMMON, "metadata.json"):
        shutil.copy(source / name, rewritten / name)
    import_megatron(rewritten, tmp_path / "out")
    reference = torch.load(megatron / "llama.pt")
    assert (loom_logits(tmp_path / "out", reference["tokens"]) - reference["logits"]).abs().max().item() < 5e-5


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"num_experts": 8}, "--num-experts 8"),
        ({"multi_latent_attention": True}, "--multi-latent-attention"),
        ({"position_embedding_type": "mrope"}, "--position-embedding-type"),
        ({"apply_residual_connection_post_layernorm": True}, "--apply-residual-connection-post-layernorm"),
        ({"no_rope_freq": 4}, "--no-rope-freq"),
        ({"softmax_type": "off-by-one"}, "--softmax-type"),
        ({"use_mup": True}, "--use-mup"),
        ({"glu_linear_offset": 1.0}, "--glu-linear-offset"),
        ({"activation_func_clamp_value": 7.0}, "--activation-func-clamp-value"),
    ],
)
def test_what_loom_cannot_compute_alike_is_refused_with_megatron_s_flag(changes, flag):
    with pytest.raises(CheckpointError, match=flag.replace("-", r"\-")):
        model_from_megatron_arguments({**LLAMA_ARGUMENTS, **changes}, SHAPES)


def test_folders_that_are_not_a_torch_dist_checkpoint_are_one_line(megatron, tmp_path, capfd):
    def refused(folder: Path, *fragments: str) -> None:
        one_line_error(
            loom_here(capfd, "ckpt", "import-megatron", "--input", str(folder), "--output", str(tmp_path / "out")),
            *fragments,
        )
        assert not (tmp_path / "out").exists()

    (tmp_path / "legacy/iter_0000005/mp_rank_00").mkdir(parents=True)
    (tmp_path / "legacy/latest_checkpointed_iteration.txt").write_text("5")
    refused(tmp_path / "legacy", "is incomplete: no mp_rank_00/model_optim_rng.pt")
    (tmp_path / "legacy/latest_checkpointed_iteration.txt").write_text("9")
    refused(tmp_path / "legacy", "names iter_0000009, which")
    (tmp_path / "legacy/latest_checkpointed_iteration.txt").write_text("<html>")
    refused(tmp_path / "legacy", "not an iteration number")
    refused(tmp_path, "is not a Megatron-LM checkpoint")
    zarr = tmp_path / "zarr"
    zarr.mkdir()
    (zarr / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    refused(zarr, "in the zarr format")
    dcp_only = tmp_path / "dcp"
    dcp_only.mkdir()
    (dcp_only / ".metadata").write_bytes(b"")
    refused(dcp_only, "without megatron-core's metadata.json", "torch_dcp")
    truncated = shutil.copytree(megatron / "llama", tmp_path / "truncated")
    common = truncated / ITERATION / COMMON
    common.write_bytes(common.read_bytes()[:100])
    refused(truncated, f"{common} cannot be read")
    no_arguments = shutil.copytree(megatron / "llama", tmp_path / "no-arguments")
    torch.save({"iteration": 7}, no_arguments / ITERATION / COMMON)
    refused(no_arguments, "holds no Megatron-LM arguments")
