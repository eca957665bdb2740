"""A user coming from Megatron-LM or torchtitan types their names for loom's settings: loom answers with its own.

The tables (engine/names_elsewhere.py) are checked both ways: every loom name in them is a real setting or option,
and the Megatron-LM flags are spelled as megatron-core itself generates them from its config dataclasses.
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings

import pytest

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import config_to_toml, load_config
from loom.engine.names_elsewhere import (
    DATA_BUILD_NAMES,
    MEGATRON,
    SUBMIT_LAUNCH_NAMES,
    TRAIN_LAUNCH_NAMES,
    TRAINING_NAMES,
    name_key,
)
from loom.launch.cli import build_parser, main


def _subparser(*path: str):
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if a.dest and a.choices and name in a.choices)
        parser = action.choices[name]
    return parser


def test_every_loom_name_in_the_tables_is_a_loom_setting_and_takes_the_value_given():
    for entry in TRAINING_NAMES:
        if not entry.loom or entry.loom == "--config":
            continue
        flag, *value = entry.loom.split()
        section, _, field = flag[2:].partition(".")
        hints = typing.get_type_hints(typing.get_type_hints(LoomConfig)[section])
        assert field in hints, f"{entry.name}: {entry.loom} is no loom setting"
        if value:
            needs = ["--checkpoint.load", "runs/base"] if flag == "--checkpoint.finetune" else []
            needs += ["--model.num_experts", "8"] if flag.startswith("--model.moe_") else []
            needs += ["--model.moe_shared_ffn_hidden_size", "64"] if flag == "--model.moe_shared_expert_gate" else []
            load_config(None, [flag, *value, *needs])  # a value the setting does not take raises here
    for names, command in (
        (DATA_BUILD_NAMES, ("data", "build")),
        (TRAIN_LAUNCH_NAMES, ("train",)),
        (SUBMIT_LAUNCH_NAMES, ("submit",)),
    ):
        options = _subparser(*command)._option_string_actions
        assert all(entry.loom in options for entry in names if entry.loom), command


def test_no_name_is_in_a_table_twice_nor_a_loom_setting():
    """A loom setting in the table would be answered as another engine's name when it is the user's mistake in
    another flag of the same command line."""
    loom = {
        f"{section.name}.{spec.name}"
        for section in dataclasses.fields(LoomConfig)
        for spec in dataclasses.fields(section.default_factory)
    }
    for names in (TRAINING_NAMES + TRAIN_LAUNCH_NAMES, TRAINING_NAMES + SUBMIT_LAUNCH_NAMES, DATA_BUILD_NAMES):
        keys = [name_key(entry.name) for entry in names]
        assert len(keys) == len(set(keys))
        assert not loom & set(keys)


def test_megatron_flags_are_spelled_as_megatron_core_generates_them():
    """megatron-core's config dataclasses are where Megatron-LM's model, parallelism and optimizer flags come from
    (a field's name with dashes, or its argparse_meta arg_names); the training script's own (--train-iters, --save,
    --data-path) live in Megatron-LM's arguments.py, which the pip package does not ship."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = pytest.importorskip("megatron.core.transformer", reason="megatron-core is not installed")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
    flags = set()
    for config in (transformer.TransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        for spec in dataclasses.fields(config):
            meta = spec.metadata.get("argparse_meta", {})
            flags.update(meta.get("arg_names", ["--" + spec.name.replace("_", "-")]))
    ours = {entry.name for entry in TRAINING_NAMES if entry.engine == MEGATRON}
    from_core = {
        *("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size"),
        *("--context-parallel-size", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce"),
        *("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups"),
        *("--normalization", "--norm-epsilon", "--disable-bias-linear", "--init-method-std", "--hidden-dropout"),
        *("--attention-dropout", "--recompute-granularity", "--recompute-method", "--recompute-num-layers"),
        *("--transformer-impl", "--attention-backend", "--fp8-format", "--fp8-recipe", "--optimizer", "--lr"),
        *("--min-lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum"),
        *("--clip-grad", "--bf16", "--fp16", "--initial-loss-scale", "--loss-scale-window", "--hysteresis"),
        "--min-loss-scale",
    }
    assert from_core <= ours
    assert from_core <= flags, sorted(from_core - flags)


def _refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_other_engines_flags_are_answered_with_loom_s(capsys):
    err = _refusal(capsys, ["train", "--config", "tiny", "--tensor-model-parallel-size", "2", "--bf16", "--steps", "3"])
    head, *lines = err.splitlines()  # a pasted script: a line each
    assert head == (
        "error: loom train: unrecognized arguments: --tensor-model-parallel-size --bf16 --steps; config overrides "
        "look like --train.steps 50 (see loom train --help); loom's names for them:"
    )
    assert lines == [
        "  --tensor-model-parallel-size (Megatron-LM): --parallel.tp 2",  # ready to paste
        "  --bf16 (Megatron-LM): --train.precision bf16 (Megatron's default is fp32, loom's bf16)",
        "  --steps: --train.steps 3",  # a loom field without its section
        "  (where Megatron-LM's defaults differ from loom's: docs/config.md, its end)",
    ]
    # loom's own overrides beside them are this command's: not restated (they were, as torchtitan's or blank)
    given = ["--train.steps", "2", "--data.tokenizer", "", "--num-experts", "4"]
    err = _refusal(capsys, ["train", "--config", "tiny", *given])
    assert err.count("\n") == 1 and "; --num-experts (Megatron-LM) is --model.num_experts 4 in loom;" in err
    # one or two are said in the line
    err = _refusal(capsys, ["train", "--config", "tiny", "--tensor-model-parallel-size", "2"])
    assert err.count("\n") == 1 and "; --tensor-model-parallel-size (Megatron-LM) is --parallel.tp 2 in loom;" in err
    # a name with loom's section but another engine's field, or loom's field in another section
    for flag, said in (
        ("--model.num_attention_heads", "--model.num_attention_heads (Megatron-LM) is --model.num_heads 4 in loom"),
        ("--parallel.tensor_parallel_degree", "--parallel.tensor_parallel_degree (torchtitan) is --parallel.tp 4"),
        ("--model.lr", "--model.lr (Megatron-LM) is --optim.lr 4 in loom"),
    ):
        assert said in _refusal(capsys, ["train", "--config", "tiny", flag, "4"])
    # a value in other units or choices is not carried over: the note says how it converts
    err = _refusal(capsys, ["train", "--config", "tiny", "--ddp-bucket-size=40000000", "--normalization", "RMSNorm"])
    assert "--ddp-bucket-size (Megatron-LM) is --parallel.grad_bucket_mb in loom (MiB of fp32 gradients" in err
    assert "--normalization (Megatron-LM) is --model.norm in loom (rmsnorm or layernorm;" in err
    # argparse refuses a missing --config before it looks at the rest: the names are answered there too
    err = _refusal(capsys, ["train", "--micro-batch-size", "4", "--nproc-per-node", "8"])
    assert "the following arguments are required: --config" in err
    assert "--micro-batch-size (Megatron-LM) is --train.micro_batch_size 4 in loom (its global batch defaults" in err
    assert "--nproc-per-node (torchrun) is --nproc 8 in loom" in err
    err = _refusal(capsys, ["submit", "--config", "tiny", "--nnodes", "2"])
    assert "--nnodes (torchrun) is --nodes 2 in loom" in err
    err = _refusal(capsys, ["data", "build", "--input", "a.jsonl", "--tokenizer-model", "t.model", "--json-keys", "t"])
    assert "--tokenizer-model (Megatron-LM's preprocess_data.py) is --tokenizer t.model in loom" in err
    assert "--json-keys (Megatron-LM's preprocess_data.py) is --text-key in loom (one key)" in err
    # GPT-2's vocabulary files: how to make the tokenizer.json loom reads, said once for the two
    err = _refusal(capsys, ["data", "build", "--input", "a.jsonl", "--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert (
        err.count("GPT2TokenizerFast") == 1 and "--merge-file (Megatron-LM's preprocess_data.py) is --tokenizer" in err
    )
    # torchtitan's flags are dotted, as loom's: the config reader answers them, in tyro's dashed spelling too
    for flag in ("--parallelism.tensor_parallel_degree", "--parallelism.tensor-parallel-degree"):
        err = _refusal(capsys, ["train", "--config", "tiny", flag, "2"])
        assert f"unknown config section 'parallelism': {flag} (torchtitan) is --parallel.tp 2 in loom" in err
    # a key under one of the table's sections is that section's
    err = _refusal(capsys, ["train", "--config", "tiny", "--quantize.linear.float8.recipe_name", "rowwise"])
    assert "--quantize.linear.float8.recipe_name (torchtitan) is --train.fp8 current in loom" in err
    err = _refusal(capsys, ["train", "--config", "tiny", "--checkpoint.folder", "x"])
    assert "unknown field in [checkpoint] 'folder': --checkpoint.folder (torchtitan) is --train.run_dir" in err
    # names no engine uses keep their "did you mean" and the generic hint
    assert "did you mean 'steps'?" in _refusal(capsys, ["train", "--config", "tiny", "--train.step", "3"])
    err = _refusal(capsys, ["train", "--config", "tiny", "--bogus-opt", "1"])
    assert "unrecognized arguments: --bogus-opt; config overrides look like --train.steps 50" in err


TORCHTITAN_TOML = """\
[job]
dump_folder = "./outputs"
[profiling]
enable_profiling = true
[model]
name = "llama3"
flavor = "8B"
num_layers = 2
[optimizer]
lr = 3e-4
[training]
local_batch_size = 1
steps = 1000
[parallelism]
tensor_parallel_degree = 2
[checkpoint]
interval = 500
keep_latest_k = 2
async_mode = "disabled"
[train]
step = 3
"""


def test_a_torchtitan_config_file_is_answered_setting_by_setting(tmp_path):
    """All at once, a line each, instead of one refusal per run; loom's own settings in it (checkpoint.interval,
    model.num_layers) pass; a typo of a loom name still gets its "did you mean"."""
    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN_TOML)
    with pytest.raises(ConfigError) as refused:
        load_config(str(path))
    head, *lines = str(refused.value).splitlines()
    assert head.startswith(f"11 settings in {path} are not loom's")
    llama3 = (
        "a preset of configs/, or a TOML file with a dense model's [model] fields; torchtitan's llama3 scales RoPE as "
        "Llama 3.1, loom with --model.rope_scaling llama3, and initialises its own way"
    )
    assert lines == [
        "  job.dump_folder (torchtitan): --train.run_dir ./outputs (a run's checkpoints, logs and metrics all go"
        " there)",
        "  profiling.enable_profiling (torchtitan): no loom setting (loom bench profile --config C traces a few steps)",
        f"  model.name (torchtitan): --config ({llama3})",
        "  model.flavor (torchtitan): --config (llama3's 1B, 8B and 70B are the presets llama-1b, llama-8b and "
        "llama-70b; debugmodel has none, tiny is smaller; torchtitan's llama3 scales RoPE as Llama 3.1, loom with "
        "--model.rope_scaling llama3)",
        "  optimizer.lr (torchtitan): --optim.lr 0.0003",
        "  training.local_batch_size (torchtitan): --train.micro_batch_size 1 (its global batch defaults to this x dp,"
        " no accumulation; loom's to 256: set --train.global_batch_size)",
        "  training.steps (torchtitan): --train.steps 1000",
        "  parallelism.tensor_parallel_degree (torchtitan): --parallel.tp 2",
        "  checkpoint.keep_latest_k (torchtitan): --checkpoint.keep (0 keeps all there; loom keeps at least 1)",
        "  checkpoint.async_mode (torchtitan): --checkpoint.async_save (true for async, false for disabled)",
        "  train.step: no loom setting; did you mean train.steps?",
    ]


def test_megatron_weight_prefix_pairs_are_taken_apart_for_the_user():
    """`--data.paths 0.3 A 0.7 B`, Megatron's --data-path written loom's way, said "0.3.idx does not exist"."""
    with pytest.raises(ConfigError, match="--data.paths runs/a runs/b --data.weights 0.3 0.7$"):
        load_config(None, ["--data.paths", "0.3", "runs/a", "0.7", "runs/b"])
    for paths in (["runs/a", "runs/b"], ["runs/a", "0.7"], ["0.3"]):  # no pairs: no such refusal
        assert load_config(None, ["--data.paths", *paths]).data.paths == paths


def test_loom_settings_written_outside_their_section_are_told_it(tmp_path):
    (tmp_path / "flat.toml").write_text("steps = 3\nlr = 0.1\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(tmp_path / "flat.toml"))
    assert str(refused.value).splitlines()[1:] == ["  steps: --train.steps 3", "  lr: --optim.lr 0.1"]
    (tmp_path / "one.toml").write_text("steps = 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown key outside a \[section\] 'steps': steps is --train.steps 3 in loom$"
    ):
        load_config(str(tmp_path / "one.toml"))


def test_megatron_s_save_and_load_of_one_folder_is_the_run_resuming_itself(tmp_path):
    """`--save D --load D`, Megatron's way to resume, written loom's way: the first run said "checkpoint.load = D
    does not exist". A run resumes from its own directory by itself, so that load is no other start."""
    run = tmp_path / "run"
    for load in (run, run / "checkpoints", tmp_path / "run" / "." / "checkpoints"):
        config = load_config(None, ["--train.run_dir", str(run), "--checkpoint.load", str(load)])
        assert config.checkpoint.load is None
    other = tmp_path / "base"
    assert load_config(None, ["--train.run_dir", str(run), "--checkpoint.load", str(other)]).checkpoint.load == str(
        other
    )


def test_a_vocabulary_larger_than_the_tokenizer_s_is_warned_of(tmp_path, markov_dataset, capsys):
    """Megatron takes the vocabulary from the tokenizer, so a ported script names none and the preset's stays: a
    tokenizer of 300 pieces under tiny's 4096 trained ids that never occur (loss ln 4096 at the start)."""
    from loom.data_tools.tokenizer import train_tokenizer
    from loom.engine.preflight import preflight

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(f'{{"text": "document {i} says def f(x): return x + {i}"}}\n' for i in range(200)))
    tokenizer = train_tokenizer([jsonl], tmp_path / "tok", vocab_size=300, progress=False)["model"]
    data = ["--data.paths", markov_dataset(64, vocab_size=300), "--data.tokenizer", str(tokenizer)]
    data += ["--train.eval_interval", "0"]
    for vocab, warned in ((4096, True), (300, False)):
        run = ["--train.run_dir", str(tmp_path / f"run{vocab}"), "--model.vocab_size", str(vocab)]
        preflight(load_config("tiny", [*data, *run]), world_size=1)
        said = capsys.readouterr().out
        assert ("warning: model.vocab_size = 4096 but the tokenizer has 300 pieces" in said) is warned, said
        assert ("set --model.vocab_size 300" in said) is warned


def test_a_dataset_named_the_other_engine_s_way_is_pointed_to(tmp_path, markov_dataset):
    """Megatron's preprocess_data.py names its output PREFIX_text_document, loom data build PREFIX: a user who
    gives one name where the files have the other is told the prefix that exists."""
    import argparse
    import shutil

    from loom.engine.data.indexed import IndexedDataset, IndexFormatError
    from loom.launch.arguments import dataset_prefix

    source = markov_dataset(64)
    for written, typed in (("corpus_text_document", "corpus"), ("plain", "plain_text_document")):
        for suffix in (".bin", ".idx"):
            shutil.copy(source + suffix, tmp_path / (written + suffix))
        said = f"{tmp_path / typed}.idx does not exist, but {tmp_path / written}.idx does: that is its prefix"
        with pytest.raises(IndexFormatError, match=re.escape(said)):
            IndexedDataset(tmp_path / typed)
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(said)):
            dataset_prefix(str(tmp_path / typed))
    with pytest.raises(IndexFormatError, match="build the dataset with `loom data build`"):
        IndexedDataset(tmp_path / "neither")


def test_a_width_or_head_count_given_by_flag_is_told_what_the_file_kept_for_its_own(tmp_path):
    """Megatron derives the FFN width from --hidden-size and uses multi-head attention unless told: flags pasted
    over a preset kept its ffn_hidden_size and num_kv_heads silently (tiny's 384 and 4)."""
    said = load_config("tiny", ["--model.hidden_size", "64", "--model.num_heads", "8"]).file_fields_a_flag_outdates()
    assert said == [
        "--model.hidden_size 64 keeps the config file's model.ffn_hidden_size = 384, chosen for its own width: give "
        "--model.ffn_hidden_size too (none: loom's 8h/3 rounded up to 256)",
        "--model.num_heads 8 keeps the config file's model.num_kv_heads = 4: grouped-query attention, 2 query heads "
        "per key/value head (--model.num_kv_heads 8 gives each its own)",
    ]
    flags = ["--model.hidden_size", "64", "--model.ffn_hidden_size", "none", "--model.num_heads", "8"]
    assert load_config("tiny", [*flags, "--model.num_kv_heads", "8"]).file_fields_a_flag_outdates() == []
    assert load_config("tiny", ["--model.num_layers", "2"]).file_fields_a_flag_outdates() == []
    # a run's config.toml holds its widths resolved: its head width too, which a wider --model.hidden_size keeps
    saved = tmp_path / "config.toml"
    saved.write_text(config_to_toml(load_config("tiny")))
    said = load_config(saved, ["--model.hidden_size", "256", "--model.ffn_hidden_size", "768"])
    assert said.file_fields_a_flag_outdates() == [
        "--model.hidden_size 256 keeps the config file's model.head_dim = 16: attention 8 x 16 = 128 wide, not "
        "model.hidden_size = 256; give --model.head_dim too (none: hidden_size / num_heads)"
    ]
    more_heads = load_config(saved, ["--model.num_heads", "16", "--model.num_kv_heads", "16"])
    assert more_heads.file_fields_a_flag_outdates() == [
        "--model.num_heads 16 keeps the config file's model.head_dim = 16: attention 16 x 16 = 256 wide, not "
        "model.hidden_size = 128; give --model.head_dim too (none: hidden_size / num_heads)"
    ]
    fitted = load_config(
        saved, ["--model.hidden_size", "256", "--model.ffn_hidden_size", "768", "--model.head_dim", "none"]
    )
    assert fitted.model.head_dim == 32 and fitted.file_fields_a_flag_outdates() == []
