"""Configs: presets load and validate, overrides are typed, mistakes are one clear line."""

import copy
import dataclasses
import itertools
import re

import pytest

from loom.engine.config import ConfigError
from loom.engine.config_io import config_to_toml, load_config, parse_overrides

PRESETS = {
    "tiny": 1,
    "gpt-125m": 8,
    "llama-1b": 8,
    "llama-8b": 16,
    "olmo2-1b": 8,
    "gemma-2b": 8,
    "gemma3-1b": 8,
    "gemma2-2b": 8,
    "mixtral-8x7b": 64,
    "olmoe-1b-7b": 8,
    "minimax-m2": 256,
}


@pytest.mark.parametrize("name, world", PRESETS.items())
def test_presets_load_and_resolve(name, world):
    config = load_config(name)
    config.resolve_world(world)
    assert config.parallel.dp * config.parallel.tp * config.parallel.pp == world


def test_llama_70b_preset_has_real_hyperparameters():
    config = load_config("llama-70b")
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (80, 8192, 64, 8, 28672)


def test_overrides_are_typed():
    config = load_config(
        None,
        [
            "--train.steps",
            "7",
            "--optim.lr",
            "2e-4",
            "--parallel.sequence_parallel",
            "true",
            "--data.paths",
            "a",
            "b",
            "--data.weights",
            "1",
            "3",
            "--model.num_kv_heads",
            "none",
        ],
    )
    assert config.train.steps == 7 and config.optim.lr == 2e-4 and config.parallel.sequence_parallel is True
    assert config.data.paths == ["a", "b"] and config.data.weights == [1.0, 3.0]
    assert config.model.num_kv_heads == config.model.num_heads


def test_derived_defaults():
    config = load_config(None, {"model": {"hidden_size": 4096, "activation": "swiglu"}})
    assert config.model.ffn_hidden_size == 11008  # Llama-2-7B's width: 8/3 * 4096 rounded up to 256
    assert config.train.run_dir == "runs/loom"


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config("tiny", ["--parallel.tp", "2", "--data.weights", "1"])
    config.resolve_world(4)
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config
    assert "# decay_steps = (not set)" in path.read_text()  # an unset field is listed (TOML has no null)
    config.train.wandb_run_name = 'a "run"\nnamed\x01\\ réseau'  # control characters wrote TOML no reader took back
    path.write_text(config_to_toml(config))
    assert load_config(path) == config
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a BOM, as Windows editors write
    assert load_config(path) == config


def test_a_saved_config_given_a_new_name_is_a_new_run(tmp_path):
    """A run's config.toml holds the runs/<name> its name gave: fed back with --train.name NEW, the new run went into
    the old one's folder (it resumed it, and rewrote its config.toml)."""
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(load_config("tiny", ["--train.name", "old"])))
    assert load_config(path, ["--train.name", "new"]).train.run_dir == "runs/new"
    assert load_config(path, ["--train.steps", "9"]).train.run_dir == "runs/old"
    assert load_config(path, ["--train.name", "new", "--train.run_dir", "x"]).train.run_dir == "x"
    path.write_text(config_to_toml(load_config("tiny", ["--train.run_dir", "elsewhere"])))  # a folder chosen stays
    assert load_config(path, ["--train.name", "new", "--train.run_dir", "x"]).train.run_dir == "x"
    with pytest.raises(ConfigError, match="sets train.run_dir = elsewhere .* --train.name new would train in that"):
        load_config(path, ["--train.name", "new"])  # it resumed and rewrote the run there
    submitted = load_config("tiny", ["--train.name", "old", "--train.run_dir", str(tmp_path / "runs" / "old")])
    path.write_text(config_to_toml(submitted))  # `loom submit` saves it absolute
    assert load_config(path, ["--train.name", "new"]).train.run_dir == str(tmp_path / "runs" / "new")
    for name in ("a/b", "", "..", "a\tb"):  # a tab or newline made a folder no shell lists plainly
        with pytest.raises(ConfigError, match="must be a plain name"):
            load_config(path, ["--train.name", name])
    nested = load_config("tiny", ["--train.name", "old", "--train.run_dir", "experiments/runs/old"])
    path.write_text(config_to_toml(nested))
    assert load_config(path, ["--train.name", "new"]).train.run_dir == "experiments/runs/new"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--model.hidden_size", "100", "--model.num_heads", "8"],
            "model.num_heads = 8 must divide model.hidden_size = 100",
        ),
        (["--model.norm", "batchnorm"], "model.norm = 'batchnorm' is not one of rmsnorm, layernorm"),
        (["--train.precision", "fp64"], "train.precision = 'fp64' is not one of fp32, bf16, fp16"),
        (["--parallel.sequence_parallel", "maybe"], "parallel.sequence_parallel expects true or false, got 'maybe'"),
        (["--optim.lr", "fast"], "optim.lr expects a number, got 'fast'"),
        (["--modle.hidden_size", "8"], "unknown config section 'modle'"),
        (["--train.steps", "1", "2"], "--train.steps takes one value, got 1 2"),
        (["--data.split", "90,10"], "data.split = '90,10' must be three non-negative weights, not all zero, like"),
        (["--data.split", "0,0,0"], "data.split = '0,0,0' must be three non-negative weights, not all zero"),
        (["--data.paths", "a", "--data.weights", "1", "2"], "data.weights has 2 entries for 1 data.paths"),
        (["--parallel.vp", "2"], "parallel.vp > 1 needs parallel.pp > 1"),
        (["--train.steps", "0"], "train.steps must be positive, got 0"),
        (
            ["--optim.name", "adafactor", "--optim.zero1", "true"],
            "optim.name = adafactor does not support optim.zero = 1",
        ),
        (["--optim.zero", "4"], "optim.zero = 4 is not a ZeRO stage loom has; use 0, 1, 2 or 3"),
        (["--optim.zero", "-1"], "optim.zero = -1 is not a ZeRO stage loom has; use 0, 1, 2 or 3"),
        (
            ["--optim.zero", "3", "--train.precision", "bf16", "--train.fp8", "delayed"],
            "optim.zero = 3 with train.fp8 = delayed: delayed scaling is Transformer Engine's",
        ),
        (["--optim.offload", "nvme"], "optim.offload = 'nvme' is not one of none, cpu"),
        (  # the rate stayed at its peak for the whole run, exit 0
            ["--optim.warmup_steps", "3", "--optim.decay_steps", "3"],
            "optim.decay_steps = 3 must exceed optim.warmup_steps = 3 (it counts from step 0, warmup included)",
        ),
        (
            ["--optim.name", "adafactor", "--optim.offload", "cpu"],
            "optim.name = adafactor does not support optim.offload = cpu",
        ),
        # each was a traceback on every rank (ZeroDivisionError, timedelta's OverflowError, torch's ValueError) ...
        (["--model.make_vocab_divisible_by", "0"], "model.make_vocab_divisible_by must be positive, got 0"),
        (["--parallel.timeout_minutes", "1e300"], "parallel.timeout_minutes = 1e+300 exceeds 525,600 (a year)"),
        (["--parallel.timeout_minutes", "1e-9"], "parallel.timeout_minutes = 1e-09 is below 0.01 (0.6 s)"),
        (["--optim.beta1", "-1"], "optim.beta1 must lie in [0, 1), got -1.0"),
        (["--optim.beta2", "1"], "optim.beta2 must lie in [0, 1), got 1.0"),
        (["--optim.momentum", "1.5"], "optim.momentum must lie in [0, 1), got 1.5"),
        (["--optim.eps", "-1"], "optim.eps must be >= 0, got -1.0"),
        # ... or trained garbage, nothing, or into the current directory with exit 0
        (["--model.init_std", "-1"], "model.init_std must be positive, got -1.0"),
        (["--model.norm_eps", "-1"], "model.norm_eps must be positive, got -1.0"),
        (["--train.exit_after", "-1"], "train.eval_interval, train.early_stop_patience and train.exit_after must"),
        (["--train.run_dir", ""], "train.run_dir is empty; give a folder, or drop it for runs/<train.name>"),
        (["--optim.initial_loss_scale", "1e300"], "optim.initial_loss_scale = 1e+300 must lie in [optim.min_loss"),
        (
            ["--optim.min_loss_scale", "1024", "--optim.initial_loss_scale", "512"],
            "optim.initial_loss_scale = 512 must lie in [optim.min_loss_scale = 1024, 2**32]",
        ),
    ],
)
def test_bad_values_are_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_zero1_is_the_older_spelling_of_zero_1(tmp_path):
    migrated = load_config("tiny", ["--optim.zero1", "true"])
    assert (migrated.optim.zero, migrated.optim.zero1) == (1, False)
    assert load_config("tiny", ["--optim.zero1", "true", "--optim.zero", "2"]).optim.zero == 2
    path = tmp_path / "config.toml"  # a resolved config says zero = 1, so overriding it back to 0 is obeyed
    path.write_text(config_to_toml(migrated))
    assert load_config(path, ["--optim.zero", "0"]).optim.zero == 0


def test_toml_type_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nsteps = 1.5\n")
    with pytest.raises(ConfigError, match="train.steps expects an integer, got 1.5"):
        load_config(path)
    path.write_text("[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)
    path.write_text("train = 5\n")  # with a flag for that section it was an AttributeError
    for overrides in ([], ["--train.steps", "3"]):
        with pytest.raises(ConfigError, match=r"\[train\] must be a table of fields"):
            load_config(path, overrides)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="overrides look like --train.steps 50"):
        parse_overrides(["steps", "5"])
    with pytest.raises(ConfigError, match="--train.steps needs a value"):
        parse_overrides(["--train.steps"])
    assert parse_overrides(["--train.steps=5"]) == {"train": {"steps": "5"}}


@pytest.mark.parametrize(
    "world, layout, message",
    [
        (
            2,
            {"pp": 2, "vp": 2, "micro": 16},
            "the interleaved schedule needs microbatches divisible by pp = 2, got 1; valid: 2, 4, 6, 8",
        ),
        (
            2,
            {"pp": 2, "vp": 3},
            "model.num_layers = 4 does not split into pp*vp = 2*3 equal chunks; valid with 2 ranks: pp=2 vp=2, "
            "pp=2 vp=1, pp=1 vp=1",
        ),
        (
            3,
            {"pp": 3},
            "model.num_layers = 4 does not split into pp*vp = 3*1 equal chunks; no pp/vp fits 3 ranks with the rest "
            "of this config; change the rank count, the batch or the layers",
        ),
        (8, {"pp": 8}, "parallel.pp = 8 exceeds model.num_layers = 4"),
        (3, {"tp": 2}, "world size 3 is not divisible by tp*pp = 2*1"),
        (
            4,
            {"tp": 2, "dp": 1},
            "world size 4 != tp*pp*dp = 2*1*1; change the number of ranks or the layout "
            "(parallel.dp = 1 is set: --parallel.dp none derives it from the ranks)",
        ),  # fmt: skip
        (8, {"tp": 8}, "parallel.tp = 8 must divide model.num_kv_heads = 4"),
        (3, {"cp": 2}, "world size 3 is not divisible by tp*cp*pp = 1*2*1"),
        (4, {"cp": 2, "dp": 1}, "world size 4 != tp*cp*pp*dp = 1*2*1*1"),
        (
            6,
            {"cp": 3},
            "parallel.cp = 3 cuts each sequence into 2*cp = 6 chunks; train.seq_length = 128 does not divide into them",
        ),
        (4, {"cp": 2, "model": {"position_embedding": "learned"}}, "parallel.cp > 1 needs model.position_embedding"),
        (4, {"cp": 2, "model": {"dropout": 0.1}}, "parallel.cp > 1 needs model.dropout = 0"),
        (
            8,
            {"cp": 2, "tp": 4, "sequence_parallel": True, "train": {"seq_length": 12}},
            "sequence parallel needs train.seq_length = 12 / cp = 2 divisible by tp = 4",
        ),
    ],
)
def test_layout_errors(world, layout, message):
    micro = layout.pop("micro", 2)
    sections = {"model": layout.pop("model", {}), "train": {"micro_batch_size": micro, **layout.pop("train", {})}}
    config = load_config("tiny", {"parallel": layout, **sections})
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.resolve_world(world)


def test_batch_size_ramp_up_like_megatron():
    config = load_config(
        "tiny", {"train": {"global_batch_size": 32, "micro_batch_size": 2, "rampup_batch_size": [8, 8, 96]}}
    )
    config.resolve_world(2)
    # three increments over 96 samples: +8 every 32 samples consumed, then constant
    assert [config.train.global_batch_size_at(c) for c in (0, 31, 32, 64, 95, 96, 10_000)] == [8, 8, 16, 24, 24, 32, 32]
    assert config.train.batch_sizes() == [8, 16, 24, 32]
    bad = load_config(
        "tiny", {"train": {"global_batch_size": 32, "micro_batch_size": 4, "rampup_batch_size": [4, 4, 96]}}
    )
    with pytest.raises(ConfigError, match=r"a ramp-up batch size = 4 must be divisible by micro_batch_size\*dp = 4\*2"):
        bad.resolve_world(2)
    with pytest.raises(ConfigError, match="must be a non-negative multiple of the increment 5"):
        load_config(None, {"train": {"global_batch_size": 32, "rampup_batch_size": [8, 5, 96]}})


def _layout_suggestions(message: str) -> list[tuple[int, int]]:
    return [(int(pp), int(vp)) for pp, vp in re.findall(r"pp=(\d+) vp=(\d+)", message.split("valid", 1)[-1])]


def _with_layout(base, pp: int, vp: int):
    config = copy.deepcopy(base)
    config.parallel = dataclasses.replace(base.parallel, pp=pp, vp=vp)
    return config


def test_every_suggested_pipeline_layout_validates():
    suggested = 0
    for layers, tp, global_batch in itertools.product((4, 6, 12), (1, 2), (8, 12)):
        base = load_config(
            "tiny",
            {
                "model": {"num_layers": layers},
                "parallel": {"tp": tp},
                "train": {"global_batch_size": global_batch, "micro_batch_size": 1},
            },
        )
        for world, pp, vp in itertools.product(range(1, 9), range(2, layers + 1), (1, 2, 3)):
            if layers % (pp * vp) == 0:
                continue
            try:
                _with_layout(base, pp, vp).resolve_world(world)
            except ConfigError as error:
                if "does not split" not in str(error):
                    continue
                message = str(error)
            else:
                raise AssertionError(f"num_layers {layers} with pp*vp = {pp}*{vp} was accepted")
            for suggested_pp, suggested_vp in _layout_suggestions(message):
                try:
                    _with_layout(base, suggested_pp, suggested_vp).resolve_world(world)
                except ConfigError as error:
                    raise AssertionError(f"{message!r} suggests pp={suggested_pp} vp={suggested_vp}: {error}") from None
                suggested += 1
    assert suggested > 250


def test_settings_a_config_never_reads_are_named():
    """SGD's momentum given to AdamW, early stopping with evaluation off, a W&B entity without a project: each was
    accepted and ignored without a word. The presets set none."""
    config = load_config(
        "tiny",
        ["--optim.momentum", "0.5", "--train.early_stop_patience", "3", "--train.eval_interval", "0"]
        + ["--model.rope_scaling_factor", "4", "--model.rope_low_freq_factor", "2", "--train.wandb_entity", "me"]
        + ["--optim.initial_loss_scale", "1024"],
    )
    assert config.settings_without_effect() == [
        "model.rope_scaling_factor = 4.0, model.rope_low_freq_factor = 2.0 have no effect with model.rope_scaling = "
        "none",
        "optim.momentum = 0.5 has no effect with optim.name = adamw (it is SGD's)",
        "optim.initial_loss_scale = 1024.0 has no effect with train.precision = fp32 (loss scaling is fp16's)",
        "train.early_stop_patience = 3 has no effect with train.eval_interval = 0 (no evaluation to compare)",
        "train.wandb_entity = me has no effect with train.wandb_project unset",
    ]
    read = load_config(
        "tiny",
        ["--optim.name", "sgd", "--optim.momentum", "0.5", "--train.precision", "fp16"]
        + ["--optim.initial_loss_scale", "1024", "--model.rope_scaling", "llama3", "--model.rope_scaling_factor", "4"],
    )
    assert read.settings_without_effect() == []
    assert load_config("tiny", ["--optim.name", "adafactor", "--optim.beta1", "0.8"]).settings_without_effect() == [
        "optim.beta1 = 0.8 has no effect with optim.name = adafactor"
    ]
    router = ["--model.num_experts", "4", "--model.moe_router_fp32", "true"]
    assert load_config("tiny", router).settings_without_effect() == [
        "model.moe_router_fp32 = True has no effect with train.precision = fp32 (the router is fp32 already)"
    ]
    assert load_config("tiny", [*router, "--train.precision", "bf16"]).settings_without_effect() == []
    yarn = ["--model.rope_scaling", "yarn", "--model.rope_scaling_factor", "4", "--model.rope_yarn_beta_fast", "16"]
    assert load_config("tiny", [*yarn, "--model.rope_low_freq_factor", "2"]).settings_without_effect() == [
        "model.rope_low_freq_factor = 2.0 has no effect with model.rope_scaling = yarn"
    ]
    assert load_config("tiny", [*yarn[2:], "--model.rope_scaling", "llama3"]).settings_without_effect() == [
        "model.rope_yarn_beta_fast = 16.0 has no effect with model.rope_scaling = llama3"
    ]
    assert load_config("tiny", ["--model.qk_norm_per_head", "false"]).settings_without_effect() == [
        "model.qk_norm_per_head = False has no effect with model.qk_norm = false (no query/key norms)"
    ]
    assert load_config("tiny", ["--model.full_attention_interval", "2"]).settings_without_effect() == [
        "model.full_attention_interval = 2 has no effect with no sliding-window layer (model.sliding_window unset, or "
        "model.full_attention_interval = 1)"
    ]
    every_layer_full = ["--model.sliding_window", "8", "--model.full_attention_interval", "1"]
    assert load_config("tiny", [*every_layer_full, "--model.rope_local_theta", "100"]).settings_without_effect() == [
        "model.full_attention_interval = 1, model.rope_local_theta = 100.0 have no effect with no sliding-window "
        "layer (model.sliding_window unset, or model.full_attention_interval = 1)"
    ]
    for preset in (
        "tiny",
        "gpt-125m",
        "llama-1b",
        "llama-8b",
        "llama-70b",
        "olmo2-1b",
        "gemma-2b",
        "gemma3-1b",
        "gemma2-2b",
        "mixtral-8x7b",
        "olmoe-1b-7b",
        "minimax-m2",
    ):
        assert load_config(preset).settings_without_effect() == [], preset


def test_sliding_windows_are_refused_where_loom_cannot_compute_them():
    """Ring attention attends to every earlier position, and torch's flash kernel takes no mask: a sliding window
    with either is refused in one line rather than computed as full attention; ring attention caps no score."""
    windowed = ["--model.sliding_window", "16"]
    with pytest.raises(ConfigError, match="parallel.cp > 1 with model.sliding_window = 16: ring attention"):
        load_config("tiny", [*windowed, "--parallel.cp", "2", "--train.seq_length", "64"]).resolve_world(2)
    with pytest.raises(ConfigError, match="attention_backend = flash takes no mask"):
        load_config("tiny", [*windowed, "--model.attention_backend", "flash", "--train.precision", "bf16"])
    # every layer full (an interval of 1) is no window at all: flash and ring attention compute it
    full = load_config("tiny", [*windowed, "--model.full_attention_interval", "1", "--parallel.cp", "2"])
    full.resolve_world(2)
    assert [full.model.attention_window(layer) for layer in range(4)] == [None] * 4
    capped = ["--model.attention_softcap", "50", "--train.seq_length", "64"]
    with pytest.raises(ConfigError, match="parallel.cp > 1 with model.attention_softcap = 50.0: ring attention has"):
        load_config("tiny", [*capped, "--parallel.cp", "2"]).resolve_world(2)
    gemma3 = load_config("tiny", [*windowed, "--model.full_attention_interval", "3"]).model
    assert [gemma3.attention_window(layer) for layer in range(4)] == [16, 16, None, 16]


def test_the_config_reference_page_is_current_and_documents_every_field():
    """docs/config.md is written from the field docstrings in engine/config/: a field added without one, or a changed
    default not written into the page, fails here (write it again: python -m loom.tools.config_reference)."""
    from pathlib import Path

    from loom.engine.config import LoomConfig
    from loom.tools.config_reference import reference

    page = reference()
    assert (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text() == page, (
        "docs/config.md is stale: python -m loom.tools.config_reference > docs/config.md"
    )
    for section in dataclasses.fields(LoomConfig):
        for spec in dataclasses.fields(section.default_factory):
            assert f"| `{section.name}.{spec.name}` |" in page
    assert '| `train.precision` | fp32 \\| bf16 \\| fp16 | `"bf16"` | Compute precision;' in page
