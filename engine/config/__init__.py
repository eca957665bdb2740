"""Run configuration: one dataclass per section (a module each here), a docstring per field, validation on
construction; LoomConfig joins the sections and checks what spans them.

A config is data: TOML files in configs/ and `--section.field value` overrides become a
`LoomConfig` (parsing lives in config_io.py). Everything that can be checked without a process
group is checked here, so bad input fails with one line before any rank starts. This package must
not import torch or touch the file system.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from loom.engine.config.data import DataConfig
from loom.engine.config.fields import (
    ConfigError,
    check_choices,
    check_positive,
    field_choices,
    field_default,
    is_plain_name,
)
from loom.engine.config.lora import LORA_TARGETS, LoraConfig
from loom.engine.config.model import ModelConfig
from loom.engine.config.optim import OptimConfig
from loom.engine.config.parallel import MAX_TIMEOUT_MINUTES, MIN_TIMEOUT_MINUTES, ParallelConfig
from loom.engine.config.train import CheckpointConfig, TrainConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LORA_TARGETS",
    "LoomConfig",
    "LoraConfig",
    "MAX_TIMEOUT_MINUTES",
    "MIN_TIMEOUT_MINUTES",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_choices",
    "check_positive",
    "field_choices",
    "field_default",
    "is_plain_name",
]


@dataclass
class LoomConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    model_fields_given: typing.ClassVar[frozenset[str] | None] = None
    """Not a setting (no field: never saved): the [model] fields its file or flags gave, set on the instance by
    load_config, so that a run resuming a checkpoint takes the saved shapes, RoPE and norm settings it does not
    give (preflight.adopt_saved_model_settings). None where unknown, which adopts nothing: a config made by
    config_from_dict, or copied by dataclasses.replace."""
    model_fields_flagged: typing.ClassVar[frozenset[str]] = frozenset()
    """Not a setting either: the [model] fields of model_fields_given that flags gave (over the file's). A run
    started from checkpoint.load takes that checkpoint's model over the config file's, not over a flag's."""

    def __post_init__(self) -> None:
        if self.checkpoint.load and not self.checkpoint.finetune and self._loads_its_own_run_dir():
            self.checkpoint.load = None  # Megatron's --save D --load D: a run resumes from its own checkpoints anyway
        if self.checkpoint.finetune and self.lora.enabled:
            raise ConfigError(
                "checkpoint.finetune with lora.rank > 0: a LoRA run starts from the weights of lora.base already "
                "(its adapters from zero); drop --checkpoint.finetune and --checkpoint.load"
            )
        if self.checkpoint.finetune and not self.checkpoint.load:
            raise ConfigError(
                "checkpoint.finetune starts from the weights of checkpoint.load, which is unset: add "
                "--checkpoint.load DIR (a run directory, its checkpoints/ or an iter_N folder)"
            )
        if self.optim.grad_dtype == "bf16" and self.train.precision != "bf16":
            raise ConfigError(
                f"optim.grad_dtype = bf16 needs train.precision = bf16 (got {self.train.precision}); add "
                "--train.precision bf16 or keep --optim.grad_dtype fp32"
            )
        if refusal := self.zero_refusal(self.optim.zero):
            raise ConfigError(refusal)
        self.check_experts()
        backend = self.model.attention_backend
        if backend != "auto" and self.parallel.cp > 1:
            raise ConfigError(
                f"model.attention_backend = {backend} with parallel.cp = {self.parallel.cp}: ring attention runs "
                "flash kernels of its own; use --model.attention_backend auto"
            )
        if backend != "auto" and self.model.attention_softcap is not None:
            raise ConfigError(
                f"model.attention_backend = {backend} picks an SDPA kernel, and model.attention_softcap = "
                f"{self.model.attention_softcap} needs loom's own attention (SDPA cannot cap scores); use "
                "--model.attention_backend auto"
            )
        if backend == "flash" and self.model.windowed:
            raise ConfigError(
                f"model.attention_backend = flash takes no mask, and model.sliding_window = "
                f"{self.model.sliding_window} needs one; use --model.attention_backend auto (or efficient)"
            )
        if backend in ("flash", "cudnn") and self.train.precision == "fp32":
            raise ConfigError(
                f"model.attention_backend = {backend} is a CUDA kernel for bf16 or fp16, not train.precision = fp32; "
                "use --model.attention_backend efficient (or auto), or --train.precision bf16 on a GPU"
            )

    def check_experts(self) -> None:
        """What a mixture of experts (model.num_experts) does not compose with (again once a LoRA run has taken its
        base's model)."""
        if refusal := self.expert_parallel_refusal(self.parallel.ep):
            raise ConfigError(refusal)
        if not self.model.moe:
            return
        experts = f"model.num_experts = {self.model.num_experts}"
        if self.train.fp8 != "off":
            raise ConfigError(
                f"train.fp8 = {self.train.fp8} with {experts}: loom's experts run grouped bf16 GEMMs, not FP8; use "
                "--train.fp8 off"
            )
        on_experts = [target for target in self.lora.targets if target in ("fc1", "fc2")]
        chosen = self.lora.targets != list(LORA_TARGETS)  # the default narrows to attention's (adopt_lora_base)
        if self.lora.enabled and on_experts and chosen:
            raise ConfigError(
                f"lora.targets {' '.join(on_experts)} with {experts}: adapters sit on dense linear layers, not on "
                "experts; use --lora.targets qkv proj"
            )

    def expert_parallel_refusal(self, ep: int) -> str | None:
        """Why this run cannot divide its experts among `ep` ranks (training and the planner's search), or None."""
        if ep == 1:
            return None
        if not self.model.moe:
            return (
                f"parallel.ep = {ep} divides experts among ranks, and model.num_experts is not set (a dense model): "
                "use --parallel.ep 1"
            )
        if self.model.num_experts % ep:
            return f"parallel.ep = {ep} does not divide model.num_experts = {self.model.num_experts} into equal shares"
        if self.optim.name == "adafactor":
            return (
                f"parallel.ep = {ep} with optim.name = adafactor: its factored moments are kept per TP rank, not per "
                "rank's experts; use --optim.name adamw (or sgd, lamb) with expert parallelism"
            )
        return None

    def _loads_its_own_run_dir(self) -> bool:
        """checkpoint.load names this run's own directory (or its checkpoints/), where it resumes from by itself."""
        own = Path(self.train.run_dir).resolve()
        return Path(self.checkpoint.load).resolve() in (own, own / "checkpoints")

    def file_fields_a_flag_outdates(self) -> list[str]:
        """[model] fields the config file chose for a width or head count that a flag then changed (a preset's FFN
        width under --model.hidden_size, as a ported Megatron script's flags give), each as a phrase saying what to
        pass: they are kept as written, where Megatron would derive them from the flag."""
        if self.model_fields_given is None or self.checkpoint.load or self.lora.enabled:
            return []
        from_file, flagged, m = (
            self.model_fields_given - self.model_fields_flagged,
            self.model_fields_flagged,
            self.model,
        )
        said = []
        if "hidden_size" in flagged and "ffn_hidden_size" in from_file:
            derived = "8h/3 rounded up to 256" if m.gated_mlp else "4h"  # gelu, squared_relu
            said.append(
                f"--model.hidden_size {m.hidden_size} keeps the config file's model.ffn_hidden_size = "
                f"{m.ffn_hidden_size}, chosen for its own width: give --model.ffn_hidden_size too (none: loom's "
                f"{derived})"
            )
        if (
            {"hidden_size", "num_heads"} & flagged
            and "head_dim" in from_file
            and m.head_dim * m.num_heads != m.hidden_size
        ):
            # a run's config.toml holds its head width resolved, as it holds its FFN width
            changed = " ".join(
                f"--model.{name} {getattr(m, name)}" for name in ("hidden_size", "num_heads") if name in flagged
            )
            said.append(
                f"{changed} keeps the config file's model.head_dim = {m.head_dim}: attention {m.num_heads} x "
                f"{m.head_dim} = {m.num_heads * m.head_dim} wide, not model.hidden_size = {m.hidden_size}; give "
                f"--model.head_dim too (none: hidden_size / num_heads)"
            )
        if "num_heads" in flagged and "num_kv_heads" in from_file and m.num_kv_heads not in (None, m.num_heads):
            said.append(
                f"--model.num_heads {m.num_heads} keeps the config file's model.num_kv_heads = {m.num_kv_heads}: "
                f"grouped-query attention, {m.num_heads // m.num_kv_heads} query heads per key/value head "
                f"(--model.num_kv_heads {m.num_heads} gives each its own)"
            )
        return said

    def settings_without_effect(self) -> list[str]:
        """Fields set away from their defaults that this config never reads, each as a phrase saying why (a user
        who sets SGD's momentum for AdamW, or early stopping with evaluation off, is told instead of ignored)."""
        m, o, t, p = self.model, self.optim, self.train, self.parallel
        readers = {  # the scaling fields, by the rope_scaling kinds that read them
            "rope_scaling_factor": ("linear", "llama3", "yarn"),
            "rope_original_max_positions": ("llama3", "longrope", "yarn"),
            "rope_low_freq_factor": ("llama3",),
            "rope_high_freq_factor": ("llama3",),
            "rope_short_factors": ("longrope",),
            "rope_long_factors": ("longrope",),
            "rope_yarn_beta_fast": ("yarn",),
            "rope_yarn_beta_slow": ("yarn",),
            "rope_attention_factor": ("longrope", "yarn"),
        }
        scaled = m.position_embedding == "rope" and m.rope_scaling != "none"
        unread = [
            (
                m,
                (
                    "rope_theta",
                    "rope_local_theta",
                    "rope_scaling",
                    "rotary_percent",
                    *readers,
                ),
                m.position_embedding != "rope",
                "model.position_embedding = learned",
            ),
            (
                m,
                tuple(readers),
                m.position_embedding == "rope" and not scaled,
                "model.rope_scaling = none",
            ),
            (
                m,
                tuple(name for name, kinds in readers.items() if m.rope_scaling not in kinds),
                scaled,
                f"model.rope_scaling = {m.rope_scaling}",
            ),
            (m, ("qk_norm_per_head",), not m.qk_norm, "model.qk_norm = false (no query/key norms)"),
            (m, ("moe_expert_bias_rate",), not m.moe_expert_bias, "model.moe_expert_bias = false (no biases to move)"),
            (m, ("moe_router_fp32",), t.precision == "fp32", "train.precision = fp32 (the router is fp32 already)"),
            (
                m,
                ("full_attention_interval", "rope_local_theta"),
                not m.windowed,
                "no sliding-window layer (model.sliding_window unset, or model.full_attention_interval = 1)",
            ),
            (o, ("momentum",), o.name != "sgd", f"optim.name = {o.name} (it is SGD's)"),
            (o, ("beta1", "beta2", "eps"), o.name in ("sgd", "adafactor"), f"optim.name = {o.name}"),
            (
                o,
                ("initial_loss_scale", "loss_scale_window", "loss_scale_hysteresis", "min_loss_scale"),
                t.precision != "fp16",
                f"train.precision = {t.precision} (loss scaling is fp16's)",
            ),
            (t, ("early_stop_patience",), not t.eval_interval, "train.eval_interval = 0 (no evaluation to compare)"),
            (t, ("wandb_entity", "wandb_run_name"), not t.wandb_project, "train.wandb_project unset"),
            (p, ("sequence_parallel",), p.tp == 1, "parallel.tp = 1 (it shards what TP would replicate)"),
        ]
        said = []
        for section, names, unused, because in unread:
            defaults = {f.name: field_default(f) for f in dataclasses.fields(section)}
            changed = [name for name in names if getattr(section, name) != defaults[name]]
            if unused and changed:
                where = type(section).__name__.removesuffix("Config").lower()
                fields = ", ".join(f"{where}.{name} = {getattr(section, name)}" for name in changed)
                said.append(f"{fields} {'has' if len(changed) == 1 else 'have'} no effect with {because}")
        return said

    def zero_refusal(self, zero: int, ep: int | None = None) -> str | None:
        """Why this run cannot use ZeRO stage `zero` (training and the planner's search, which says which `ep` it
        asks about; None: parallel.ep), or None."""
        ep = self.parallel.ep if ep is None else ep
        if refusal := self.optim.zero_refusal(zero):
            return refusal
        if zero == 3 and self.train.fp8 == "delayed":
            return (
                "optim.zero = 3 with train.fp8 = delayed: delayed scaling is Transformer Engine's, whose layers "
                "hold whole weights; use --train.fp8 current (loom's FP8 linears quantise the gathered weights) "
                "or --optim.zero 2"
            )
        if zero == 3 and ep > 1:
            return (
                f"optim.zero = 3 with parallel.ep = {ep}: loom's ZeRO-3 gathers whole blocks over "
                "DP, experts included; use --optim.zero 2 (or 1) with expert parallelism, or --parallel.ep 1"
            )
        return None

    def resolve_world(self, world_size: int) -> None:
        """Fix parallel.dp from the world size and check everything that depends on the layout."""
        p, m, t = self.parallel, self.model, self.train
        requested_dp = p.dp
        model_parallel = p.model_parallel_size
        if p.dp is None:
            if world_size % model_parallel:
                what = f"tp*cp*pp = {p.tp}*{p.cp}*{p.pp}" if p.cp > 1 else f"tp*pp = {p.tp}*{p.pp}"
                raise ConfigError(
                    f"world size {world_size} is not divisible by {what}; run a multiple of {model_parallel} ranks "
                    "or choose a layout that divides it"
                )
            p.dp = world_size // model_parallel
        if model_parallel * p.dp != world_size:
            what = f"tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*{p.dp}" if p.cp > 1 else f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp}"
            raise ConfigError(  # dp was set: a run's saved config.toml (and --print-config) holds the dp it ran with
                f"world size {world_size} != {what}; change the number of ranks or the layout (parallel.dp = "
                f"{requested_dp} is set: --parallel.dp none derives it from the ranks)"
            )
        p.check_ep_divides_dp()
        m.check_tensor_parallel(p.tp)
        if refusal := m.context_parallel_refusal(p.cp, t.seq_length):
            raise ConfigError(refusal)
        if p.sequence_parallel and (t.seq_length // p.cp) % p.tp:
            raise ConfigError(
                f"sequence parallel needs train.seq_length = {t.seq_length}"
                + (f" / cp = {p.cp}" if p.cp > 1 else "")
                + f" divisible by tp = {p.tp}"
            )
        for batch in self.train.batch_sizes():
            if batch % (t.micro_batch_size * p.dp):
                what = "train.global_batch_size" if batch == t.global_batch_size else "a ramp-up batch size"
                raise ConfigError(
                    f"{what} = {batch} must be divisible by micro_batch_size*dp = {t.micro_batch_size}*{p.dp}"
                )
        if t.seq_length > m.max_position_embeddings:
            raise ConfigError(
                f"train.seq_length = {t.seq_length} exceeds model.max_position_embeddings = "
                f"{m.max_position_embeddings}; lower --train.seq_length or raise --model.max_position_embeddings"
            )
        self._check_pipeline(world_size, requested_dp)

    def _check_pipeline(self, world_size: int, requested_dp: int | None) -> None:
        from loom.engine.pipeline.schedules import ScheduleError, check_schedule

        p, layers = self.parallel, self.model.num_layers
        stages = p.pp * p.vp
        if p.pp > layers:
            raise ConfigError(f"parallel.pp = {p.pp} exceeds model.num_layers = {layers}")
        if layers % stages:
            valid = [f"pp={pp} vp={vp}" for pp, vp in self._pipeline_layouts_that_fit(world_size, requested_dp)[:8]]
            advice = (
                f"valid with {world_size} ranks: {', '.join(valid)}"
                if valid
                else f"no pp/vp fits {world_size} ranks with the rest of this config; "
                "change the rank count, the batch or the layers"
            )
            raise ConfigError(
                f"model.num_layers = {layers} does not split into pp*vp = {p.pp}*{p.vp} equal chunks; {advice}"
            )
        try:
            for batch in self.train.batch_sizes():
                check_schedule(p.pp, p.vp, self.microbatches_for(batch))
        except ScheduleError as error:
            raise ConfigError(str(error)) from None

    def _pipeline_layouts_that_fit(self, world_size: int, requested_dp: int | None) -> list[tuple[int, int]]:
        """(pp, vp) pairs that split the layers and pass every other check of this config on
        `world_size` ranks, nearest the requested layout first. Each is validated by resolving a copy,
        so a suggestion can never be one the config then refuses."""
        p, layers = self.parallel, self.model.num_layers
        splits = [(pp, vp) for pp in range(1, layers + 1) for vp in range(1, 5) if layers % (pp * vp) == 0]
        fitting = []
        for pp, vp in sorted(splits, key=lambda layout: (abs(layout[0] - p.pp), layout[0], abs(layout[1] - p.vp))):
            candidate = copy.deepcopy(self)
            try:
                candidate.parallel = dataclasses.replace(p, pp=pp, vp=vp, dp=requested_dp)
                candidate.resolve_world(world_size)
            except ConfigError:
                continue
            fitting.append((pp, vp))
        return fitting

    def microbatches_for(self, global_batch: int) -> int:
        """Micro-batches each data-parallel rank runs for a step of `global_batch` sequences."""
        assert self.parallel.dp is not None, "call resolve_world first"
        return global_batch // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank at the full global batch size."""
        return self.microbatches_for(self.train.global_batch_size)
