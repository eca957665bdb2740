"""What a checkpoint's saved settings say about a run that loads it: whether it is the same model
(check_same_model refuses another shape), and what a resume changes (resume_warnings: the data order, the
learning-rate schedule, the optimizer step's settings, fp16's loss scale, what the model computes), each said with
the flags that keep the saved values. Compares configs only; engine/checkpoint/load.py reads the tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import operator
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from loom.engine.checkpoint.format import CheckpointError, CheckpointMetadata
from loom.engine.config import ConfigError, LoomConfig, ModelConfig, field_default
from loom.engine.data.indexed import dataset_record
from loom.engine.optim.lr_schedule import learning_rate

# Model settings that change what the weights compute without changing any shape: a checkpoint loaded under
# other values runs, but as another model. Some changes are deliberate (a larger rope_theta to extend the
# context), so they are reported rather than refused.
FUNCTIONAL_MODEL_FIELDS = (
    "rope_theta",
    "rotary_percent",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "rope_short_factors",
    "rope_long_factors",
    "rope_yarn_beta_fast",
    "rope_yarn_beta_slow",
    "rope_attention_factor",
    "norm_eps",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_scale",
    "logits_divisor",
    "rope_local_theta",
    "sliding_window",
    "full_attention_interval",
    "attention_softcap",
    "logits_softcap",
    "moe_top_k",
    "moe_norm_top_k",
    "moe_aux_loss_coeff",  # no computation, but an imported model's (its router_aux_loss_coef) stays with it
    "moe_z_loss_coeff",
    "moe_router_score",
    "moe_router_scale",
    "moe_router_groups",
    "moe_router_group_top_k",
    "moe_router_fp32",
    "moe_expert_bias",  # its biases are saved beside the weights; a checkpoint without them gives zeros
)

# Model settings that decide which tensors a checkpoint holds, their shapes or what the block computes with them.
# A checkpoint loaded under other values is another model: a smaller one would silently drop tensors (a 4-layer
# checkpoint into 3 layers), so they are refused before anything loads.
ARCHITECTURE_MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "vocab_size",
    "position_embedding",
    "norm",
    "norm_placement",
    "activation",
    "bias",
    "qkv_bias",
    "qk_norm",
    "qk_norm_per_head",
    "tie_embeddings",
    "num_experts",
    "moe_shared_ffn_hidden_size",
    "moe_shared_expert_gate",
    "moe_ffn_hidden_size",
    "moe_dense_layers",
)


NONE_IS_A_MODEL = ("num_experts", "moe_shared_ffn_hidden_size", "moe_ffn_hidden_size")
"""Architecture fields whose default None is a model of its own (dense), not a value resolved from others."""


# What a LoRA checkpoint's adapters are: other targets leave trained adapters unloaded, another alpha scales them.
ADAPTER_FIELDS = ("rank", "alpha", "targets")


def check_same_model(directory: Path, saved_config: dict, current: LoomConfig) -> None:
    """Refuse to load checkpoint `directory` (whose run's config is `saved_config`) into another architecture or,
    for a LoRA checkpoint, other adapters, naming every setting that differs and the flags that keep them (one at a
    time, a fine-tune from an import under another preset took a try per field)."""
    fields = [("model", name) for name in ARCHITECTURE_MODEL_FIELDS]
    if current.model.position_embedding == "learned":  # the learned table's length is a shape; RoPE's is not
        fields.append(("model", "max_position_embeddings"))
    if saved_config.get("lora", {}).get("rank") and current.lora.enabled:
        fields += [("lora", name) for name in ADAPTER_FIELDS]
    differences = list(_differences(saved_config, current, fields))
    if differences:
        shown = ", ".join(f"{section}.{name} = {value} there, {now} here" for section, name, value, now in differences)
        flags = _flags_keeping((f"{section}.{name}", value) for section, name, value, _ in differences)
        raise CheckpointError(
            f"checkpoint {directory} is of another model: {shown}; pass {flags} to load it (a new model needs its "
            "own run directory: another --train.name or --train.run_dir, no --checkpoint.load)"
        )


def _differences(saved_config: dict, current: LoomConfig, fields: Iterable[tuple[str, str]]) -> Iterator[tuple]:
    """(section, name, saved value, current value) for each of `fields` the saved config records otherwise. A [model]
    field an older loom did not write counts as its default, the computation that loom had (a model setting is
    added with the default that keeps it): a checkpoint from before model.norm_placement, loaded with it set to
    output, is another model. A default resolved from other fields (None: head_dim, num_kv_heads) is skipped."""
    model_defaults = {f.name: field_default(f) for f in dataclasses.fields(ModelConfig)}
    for section, name in fields:
        saved, now = saved_config.get(section, {}), getattr(getattr(current, section), name)
        if name in saved:
            value = saved[name]
        elif section == "model" and (model_defaults.get(name) is not None or name in NONE_IS_A_MODEL):
            value = model_defaults[name]
        else:
            continue
        if value != now:
            yield section, name, value, now


# Settings that decide which samples a run reads in which order: changed on a resume, the samples from the saved
# position on are another sequence (some read twice, some never), which a user may intend (new data) or not.
DATA_ORDER_FIELDS = (
    ("train", "seed"),
    ("train", "seq_length"),
    ("data", "paths"),
    ("data", "weights"),
    ("data", "split"),
)


def changed_data_order(saved_config: dict, current: LoomConfig, saved_datasets: list | None = None) -> list[str]:
    """`section.name: saved -> current` for each of DATA_ORDER_FIELDS this run changes. With the datasets the
    checkpoint records (`saved_datasets`), data.paths are compared by the files they name, not by their spelling: a
    relative path from another working directory may name the same data, or other data under the same name."""
    fields = tuple(field for field in DATA_ORDER_FIELDS if field != ("data", "weights"))
    changes = []
    saved_data = saved_config.get("data", {})
    saved_weights = saved_data.get("weights")  # none is not written to config.toml (TOML has no null)
    if len(saved_data.get("paths", current.data.paths)) == len(current.data.paths):
        differs = _shares(saved_weights) != _shares(current.data.weights)  # [1, 1], [2, 2] and none: one blend
    else:  # the paths' change is said; weights given on either side differ too
        differs = saved_weights != current.data.weights
    if differs:
        changes.append(f"data.weights: {saved_weights} -> {current.data.weights}")
    if saved_datasets is not None:
        fields = tuple(field for field in fields if field != ("data", "paths"))
        now = [dataset_record(prefix) for prefix in current.data.paths]
        if len(saved_datasets) != len(now) or not all(map(_same_files, saved_datasets, now)):
            changes.append(f"data.paths: {_described(saved_datasets)} -> {_described(now)}")
    changes += [
        f"{section}.{name}: {saved} -> {now}"
        for section, name, saved, now in _differences(saved_config, current, fields)
    ]
    return changes


def _shares(weights: list | None) -> list[float] | None:
    """Each dataset's share of the blend (data.weights are relative, and positive), rounded past float noise; None
    (equal shares) for none or equal weights."""
    if not weights or len(set(weights)) == 1:
        return None
    return [round(weight / sum(weights), 12) for weight in weights]


def _same_files(saved: dict | None, now: dict | None) -> bool:
    """Whether two dataset_records are of the same data: the same sizes, and the same write time or (a copy) the
    same sampled bytes; a checkpoint from before loom sampled them compares the write time alone."""
    if saved is None or now is None:
        return saved is now
    if (saved["bin_bytes"], saved["idx_bytes"]) != (now["bin_bytes"], now["idx_bytes"]):
        return False
    return (
        saved.get("idx_written_ns") == now["idx_written_ns"] or saved.get("sampled_sha256", "") == now["sampled_sha256"]
    )


def _described(records: list) -> str:
    return ", ".join(
        f"{r['path']} ({r['bin_bytes']:,} bytes, written {_when(r.get('idx_written_ns'))})" if r else "(missing)"
        for r in records
    )


def _when(nanoseconds: int | None) -> str:
    if nanoseconds is None:
        return "?"
    return datetime.datetime.fromtimestamp(nanoseconds / 1e9).isoformat(sep=" ", timespec="seconds")


# Settings of the optimizer step, the loss and the batch that a resume may change on purpose (less weight decay for
# a last phase) or through a flag its rerun lost: either way the run trains otherwise from the checkpoint on.
# fp16's loss scaler reads these on a resume (its scale and counters come from the checkpoint, its rules from the
# config); optim.initial_loss_scale it does not read (resume_warnings says so).
FP16_SCALER_FIELDS = (("optim", "loss_scale_window"), ("optim", "loss_scale_hysteresis"), ("optim", "min_loss_scale"))


TRAINING_FIELDS = (
    ("optim", "weight_decay"),
    ("optim", "beta1"),
    ("optim", "beta2"),
    ("optim", "eps"),
    ("optim", "momentum"),
    ("optim", "clip_grad"),
    ("optim", "layer_lr_decay"),
    ("optim", "grad_dtype"),
    ("train", "precision"),
    ("train", "fp8"),
    ("train", "global_batch_size"),
    ("model", "dropout"),
    ("model", "moe_expert_bias_rate"),
    ("lora", "dropout"),
    *FP16_SCALER_FIELDS,
)


def changed_training_settings(saved_config: dict, current: LoomConfig) -> list[tuple[str, Any, Any]]:
    """(section.name, saved, current) for each of TRAINING_FIELDS this run changes and reads (SGD's momentum is not
    read by AdamW, Adam's betas not by SGD or Adafactor)."""
    unread = {("optim", "momentum")} if current.optim.name != "sgd" else set()
    if current.optim.name in ("sgd", "adafactor"):
        unread |= {("optim", "beta1"), ("optim", "beta2"), ("optim", "eps")}
    if not current.lora.enabled:
        unread.add(("lora", "dropout"))
    if not current.model.moves_expert_biases:
        unread.add(("model", "moe_expert_bias_rate"))
    if (current.train.precision, saved_config.get("train", {}).get("precision")) != ("fp16", "fp16"):
        unread |= set(FP16_SCALER_FIELDS)  # no scaler resumed (a change of precision is said as such)
    fields = [field for field in TRAINING_FIELDS if field not in unread]
    return [
        (f"{section}.{name}", saved, now) for section, name, saved, now in _differences(saved_config, current, fields)
    ]


def flag_value(value: Any) -> str:
    """A config value as its --section.name flag takes it."""
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flags_keeping(saved: Iterable[tuple[str, Any]]) -> str:
    """The flags that give a run the saved values back, from (section.name, saved value) pairs."""
    return " ".join(f"--{field} {flag_value(value)}" for field, value in saved)


SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "decay")
"""The optim fields of the learning-rate schedule besides its decay's length (optim.decay_steps, else train.steps)."""


def changed_schedule(
    step: int, saved_config: dict, current: LoomConfig, position: float | None = None, consumed_samples: int = 0
) -> str | None:
    """How the learning rate of the steps from `step` (0-based: the first one this run trains, after
    `consumed_samples`) on differs from what the saved run's schedule gives them (past its end: min_lr), or None
    where it does not. The schedule stands at `position` (CheckpointMetadata.schedule_position; default `step`)."""
    saved_optim, saved_train = saved_config.get("optim", {}), saved_config.get("train", {})
    fields = (*SCHEDULE_FIELDS, "decay_steps")
    try:
        saved = dataclasses.replace(current.optim, **{k: saved_optim[k] for k in fields if k in saved_optim})
        saved_run = dataclasses.replace(
            current.train,
            **{k: saved_train[k] for k in ("steps", "global_batch_size", "rampup_batch_size") if k in saved_train},
        )
    except ConfigError:  # values an older loom accepted: nothing to compare with
        return None
    saved_total, total = saved_run.schedule_length(), current.train.schedule_length()
    shares = current.train.ramp_shares(consumed_samples)
    positions = list(itertools.accumulate(shares, initial=float(step) if position is None else position))

    def rates(k: int) -> tuple[float, float]:
        """The two schedules' rates of the k-th step this run trains."""
        at, share = (positions[k], shares[k]) if k < len(shares) else (positions[-1] + k - len(shares), 1.0)
        return learning_rate(at, current.optim, total, share), learning_rate(at, saved, saved_total, share)

    remaining = current.train.steps - step
    probes = range(0, remaining, max(1, remaining // 1000))
    differs = next((k for k in probes if operator.ne(*rates(k))), None)
    if differs is None:
        return None
    changed = [k for k in SCHEDULE_FIELDS if getattr(saved, k) != getattr(current.optim, k)]
    changes = [f"optim.{k}: {getattr(saved, k)} -> {getattr(current.optim, k)}" for k in changed]
    keep = [f"--optim.{k} {getattr(saved, k)}" for k in changed]
    saved_length, length = saved.decay_steps or saved_total, current.optim.decay_steps or total
    if saved_length != length and "constant" not in (saved.decay, current.optim.decay):
        changes.append(
            f"the decay's length: {_in_steps(saved_length)} -> {_in_steps(length)} steps (optim.decay_steps, else "
            "train.steps)"
        )
        # a batch ramp-up leaves the default length fractional, which an int decay_steps can only round
        rounded = "" if saved_length == round(saved_length) else f" (the saved {_in_steps(saved_length)} rounded)"
        keep.append(f"--optim.decay_steps {round(saved_length)}{rounded}")
    now, then = _told_apart(*rates(differs))
    return (
        f"the learning-rate schedule is not the one this run trained with ({'; '.join(changes)}): step "
        f"{step + differs + 1} takes lr {now} where the saved schedule gives {then}; pass {', '.join(keep)} to keep "
        "it, unless the change is intended"
    )


def _in_steps(length: float) -> str:
    """A schedule length: 20, or 19.25 where a batch ramp-up's small steps leave a fraction."""
    return str(round(length)) if length == round(length) else f"{length:.2f}"


def _told_apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with 3 significant digits, or as many more as show them different (lr 0.001 against 0.001)."""
    for digits in range(3, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return repr(a), repr(b)


def _changed_model_fields(saved_model: dict, current: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(field, saved, current) for each functional setting of the checkpoint that this run changes. Fields a
    checkpoint predates count as their defaults."""
    defaults = ModelConfig()
    changed = []
    for field in FUNCTIONAL_MODEL_FIELDS:
        saved, now = saved_model.get(field, getattr(defaults, field)), getattr(current, field)
        if saved != now:
            changed.append((field, saved, now))
    return changed


def changed_model_settings(saved_model: dict, current: ModelConfig) -> list[str]:
    """`model.F: saved -> current` for each functional setting of the checkpoint that this run changes."""
    return [f"model.{field}: {saved} -> {now}" for field, saved, now in _changed_model_fields(saved_model, current)]


def _saved_model_flags(saved_model: dict, current: ModelConfig) -> str:
    """The flags that give this run the checkpoint's settings back (the warning named rope_theta whatever changed)."""
    return _flags_keeping((f"model.{field}", saved) for field, saved, _ in _changed_model_fields(saved_model, current))


def resume_warnings(
    directory: Path, metadata: CheckpointMetadata, config: LoomConfig, continues_run: bool
) -> list[str]:
    """What a run under `config` changes about the checkpoint it resumes from `directory`: another optimizer (its
    state starts fresh), data order, learning-rate schedule or optimizer, loss and batch settings (when it trains on
    from the checkpoint's step, `continues_run`: its own, or checkpoint.load's without checkpoint.finetune), another
    model (always)."""
    warnings = []
    saved_optimizer = metadata.layout.optimizer
    if continues_run and saved_optimizer not in (None, config.optim.name):
        warnings.append(
            f"{directory} was trained with {saved_optimizer}; its optimizer state does not carry over "
            f"to {config.optim.name}, which starts from fresh state (the weights are resumed)"
        )
    reordered = changed_data_order(metadata.config, config, metadata.datasets)
    if reordered and continues_run:
        warnings.append(
            f"from step {metadata.step} on this run reads its data in another order than it did "
            f"({'; '.join(reordered)}): some samples may be read twice and others not at all"
        )
    schedule = (
        changed_schedule(metadata.step, metadata.config, config, metadata.schedule_position, metadata.consumed_samples)
        if continues_run
        else None
    )
    if schedule:
        warnings.append(schedule)
    trains_otherwise = changed_training_settings(metadata.config, config) if continues_run else []
    if trains_otherwise:
        changes = "; ".join(f"{field}: {saved} -> {now}" for field, saved, now in trains_otherwise)
        flags = _flags_keeping((field, saved) for field, saved, _ in trains_otherwise)
        warnings.append(
            f"this run trains on from step {metadata.step} with other settings than {directory} was saved with "
            f"({changes}); pass {flags} to keep them, unless the change is intended"
        )
    saved_scale = metadata.config.get("optim", {}).get("initial_loss_scale", config.optim.initial_loss_scale)
    scaled = continues_run and metadata.loss_scaler and config.train.precision == "fp16"
    if scaled and saved_scale != config.optim.initial_loss_scale:
        warnings.append(
            f"optim.initial_loss_scale = {config.optim.initial_loss_scale} is not used: this run continues the loss "
            f"scale {metadata.loss_scaler['scale']:g} that {directory} reached (fp16's scaler state resumes with the "
            "run, as in Megatron-LM); the initial scale is a run's first step's, or a fine-tune's from this "
            "checkpoint (--checkpoint.load with --checkpoint.finetune true, in a run directory of its own)"
        )
    changes = changed_model_settings(metadata.config["model"], config.model)
    if changes:
        flags = _saved_model_flags(metadata.config["model"], config.model)
        warnings.append(
            f"this run computes a different model than {directory} was saved with "
            f"({'; '.join(changes)}); pass the saved values ({flags}) unless that is intended"
        )
    return warnings
