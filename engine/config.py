"""Run configuration: one dataclass per section, a docstring per field, validation on construction.

A config is data: TOML files in configs/ and `--section.field value` overrides become a
`LoomConfig` (parsing lives in config_io.py). Everything that can be checked without a process
group is checked here, so bad input fails with one line before any rank starts. This module must
not import torch or touch the file system.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
import unicodedata
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from loom.errors import LoomError


class ConfigError(LoomError):
    """A user-facing configuration problem; the message is one line saying what to change."""


def is_plain_name(name: str) -> bool:
    """Whether a run name can be a folder's own name (runs/<name>): not empty, `.` or `..`, no path separator and no
    control character (a tab or newline made a folder no shell lists plainly)."""
    return name not in ("", ".", "..") and not any(c in "/\\" or unicodedata.category(c) == "Cc" for c in name)


MAX_TIMEOUT_MINUTES = 525_600
"""parallel.timeout_minutes's ceiling, a year: far above any real wait, far below timedelta's overflow."""
MIN_TIMEOUT_MINUTES = 0.01
"""Its floor, 0.6 s: below it even one rank's own store timed out (a C++ stack that blamed a peer)."""


def field_default(spec: dataclasses.Field) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


@functools.cache
def _literal_fields(cls: type) -> dict[str, tuple]:
    """{field: its allowed values} for the fields of config dataclass `cls` typed as a Literal."""
    hints = typing.get_type_hints(cls)
    return {
        spec.name: typing.get_args(hints[spec.name])
        for spec in dataclasses.fields(cls)
        if typing.get_origin(hints[spec.name]) is Literal
    }


def field_choices(cls: type, name: str) -> tuple:
    """The values a Literal-typed config field allows (its type annotation is the one list of them)."""
    return _literal_fields(cls)[name]


def _check_choices(config: Any, section: str) -> None:
    """Every Literal-typed field of a config section holds one of its values."""
    for name, choices in _literal_fields(type(config)).items():
        value = getattr(config, name)
        if value not in choices:
            raise ConfigError(f"{section}.{name} = {value!r} is not one of {', '.join(map(str, choices))}")


def _check_positive(section: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{section}.{name} must be positive, got {value}")


@dataclass
class ModelConfig:
    num_layers: int = 24
    """Number of transformer blocks."""
    hidden_size: int = 2048
    """Width of the residual stream."""
    num_heads: int = 16
    """Attention (query) heads; must divide hidden_size and be divisible by parallel.tp."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (multi-head attention)."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4*hidden (gelu) or 8/3*hidden rounded up to a multiple of 256 (swiglu)."""
    vocab_size: int = 32000
    """Tokenizer vocabulary size; the embedding is padded beyond it, padded ids never reach the loss."""
    make_vocab_divisible_by: int = 128
    """The embedding is padded to a multiple of this times parallel.tp, for fast GEMMs."""
    max_position_embeddings: int = 4096
    """Longest sequence the model accepts (the size of the learned position table)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """Rotary position embedding (Llama) or a learned absolute table (GPT-2)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """Long-context rescaling of the rotary frequencies: none, or llama3 (Llama 3.1 and later; Hugging Face's
    rope_type "llama3"): wavelengths longer than rope_original_max_positions / rope_low_freq_factor are
    stretched by rope_scaling_factor, those shorter than rope_original_max_positions / rope_high_freq_factor
    are kept, and the ones between are interpolated."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: how much the low frequencies are stretched."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: rope_original_max_positions / this is the wavelength above which frequencies stretch."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: rope_original_max_positions / this is the wavelength below which frequencies are kept."""
    rope_original_max_positions: int = 8192
    """llama3 scaling: the context length the model was pretrained at before scaling."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation before attention, before the MLP and at the end."""
    norm_eps: float = 1e-5
    """Epsilon inside the normalisation."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP non-linearity: gated SiLU (Llama) or GELU (GPT)."""
    bias: bool = False
    """Biases in the linear layers (GPT-2 style)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections are scaled by 1/sqrt(2*layers)."""
    dropout: float = 0.0
    """Dropout on the embedding output, attention probabilities and residual branches (Megatron's --hidden-dropout
    and --attention-dropout in one). Layout invariance holds at 0."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: none, selective (core attention only) or full (each block)."""
    kernels: Literal["auto", "native", "te"] = "auto"
    """Kernel implementations (engine/model/kernels.py): auto uses Transformer Engine on CUDA when it
    imports, else apex fused norms / FusedAdam when apex imports, else native PyTorch (SDPA, torch norms,
    fused AdamW); native always runs the PyTorch reference path; te requires Transformer Engine. What was
    chosen, and why, is printed at start-up and recorded in the first metrics.jsonl row."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient"] = "auto"
    """Which of torch SDPA's CUDA kernels computes attention: auto lets torch choose (flash attention on an H100/
    H200); flash, cudnn (cuDNN's fused attention, Megatron's "fused") or efficient (memory-efficient) run that one
    alone, and a shape it cannot take is an error, never a silent fall back to unfused math (cudnn and efficient
    take no grouped-query heads: each KV head is repeated for its query heads). CUDA only; an explicit choice
    replaces Transformer Engine's attention, and parallel.cp > 1 (ring attention, flash kernels of its own) needs
    auto. For measuring which is fastest on a GPU: `loom bench mfu --model.attention_backend cudnn`."""
    compile: Literal["auto", "true", "false"] = "auto"
    """torch.compile each transformer block whole (norms, rotary, attention, SwiGLU, residuals and the TP
    collectives between them: one graph for all blocks) when the kernels are native PyTorch; with Transformer
    Engine or apex only the element-wise pieces left to PyTorch are compiled. auto compiles on CUDA (30% more
    tokens/s on an H200 for llama-1b, docs/gpu.md) and not on CPU (inductor's CPU compile costs more than a
    CPU run gains); true/false force it. The first step pays the compile, printed by rank 0."""

    def __post_init__(self) -> None:
        _check_choices(self, "model")
        s = "model"
        _check_positive(
            s,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            ffn_hidden_size=self.ffn_hidden_size,
            make_vocab_divisible_by=self.make_vocab_divisible_by,
            norm_eps=self.norm_eps,  # a negative one makes the first norm NaN; 0 that of an all-zero input
            init_std=self.init_std,  # a negative one trained a model from |N(0, std)| weights (loss 41 at step 1)
        )
        _check_positive(
            s,
            rope_theta=self.rope_theta,
            rope_scaling_factor=self.rope_scaling_factor,
            rope_low_freq_factor=self.rope_low_freq_factor,
            rope_original_max_positions=self.rope_original_max_positions,
        )
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor = {self.rope_low_freq_factor}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.num_heads = {self.num_heads} must divide model.hidden_size = {self.hidden_size}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads = {self.num_kv_heads} must divide model.num_heads = {self.num_heads}"
            )
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":
                self.ffn_hidden_size = -(-(8 * self.hidden_size // 3) // 256) * 256
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def compiles_on(self, cuda: bool) -> bool:
        """Whether model.compile compiles the blocks on a CUDA (`cuda`) or CPU rank, when the kernels are native
        PyTorch (engine/model/kernels.py; the planner asks for a GPU)."""
        return self.compile == "true" or (self.compile == "auto" and cuda)

    def context_parallel_refusal(self, cp: int, seq_length: int) -> str | None:
        """Why sequences of `seq_length` tokens of this model cannot be split over `cp` ranks (training and the
        planner's search), or None."""
        if cp == 1:
            return None
        if seq_length % (2 * cp):
            fitting = (seq_length // (2 * cp) + 1) * 2 * cp
            return (
                f"parallel.cp = {cp} cuts each sequence into 2*cp = {2 * cp} chunks; train.seq_length = "
                f"{seq_length} does not divide into them: use a multiple of {2 * cp} (e.g. {fitting}) or another cp"
            )
        if self.position_embedding != "rope":
            return "parallel.cp > 1 needs model.position_embedding = rope (learned positions are not split)"
        if self.dropout:
            return f"parallel.cp > 1 needs model.dropout = 0 (got {self.dropout}): ring attention has none"
        return None

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP size the model's heads, KV heads or MLP do not split into (training, resharding, generation)."""
        for name in ("num_heads", "num_kv_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            if value % tp:
                raise ConfigError(f"parallel.tp = {tp} must divide model.{name} = {value}")


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: each layer's matrices are split across this many ranks (keep it inside a node)."""
    pp: int = 1
    """Pipeline-parallel size: the layers are cut into this many stages."""
    vp: int = 1
    """Virtual pipeline chunks per stage (interleaved 1F1B); 1 means plain 1F1B."""
    cp: int = 1
    """Context-parallel size: each micro-batch's sequence is split over this many ranks in 2 x cp chunks (rank r
    holds chunks r and 2cp-1-r, which balances the causal mask's work), attention passing keys and values around
    a ring (engine/parallel/context.py). Gradients are summed, and ZeRO shards, over DP x CP. For sequences whose
    activations do not fit one rank: needs rotary positions and no dropout."""
    dp: int | None = None
    """Data-parallel size; None means world_size / (tp * cp * pp)."""
    sequence_parallel: bool = False
    """Split norm/dropout activations along the sequence across the TP group (needs tp > 1 to matter)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend; auto means NCCL on CUDA, gloo on CPU."""
    grad_bucket_mb: float = 25.0
    """Size of a data-parallel gradient bucket; each bucket's all-reduce starts as soon as its grads are final."""
    overlap_grad_reduce: bool = True
    """Overlap the data-parallel gradient reduction with the backward pass."""
    timeout_minutes: float = 10.0
    """A collective that waits this long for a peer (crashed, hung, preempted) fails on every rank
    instead of hanging the job (Megatron's --distributed-timeout-minutes)."""

    @property
    def model_parallel_size(self) -> int:
        """The ranks of one model replica: tp x cp x pp (the world is this times dp)."""
        return self.tp * self.cp * self.pp

    def __post_init__(self) -> None:
        _check_choices(self, "parallel")
        _check_positive(
            "parallel",
            tp=self.tp,
            pp=self.pp,
            vp=self.vp,
            cp=self.cp,
            dp=self.dp,
            grad_bucket_mb=self.grad_bucket_mb,
            timeout_minutes=self.timeout_minutes,
        )
        if self.timeout_minutes > MAX_TIMEOUT_MINUTES:  # the process group's timedelta overflows on every rank
            raise ConfigError(
                f"parallel.timeout_minutes = {self.timeout_minutes:g} exceeds {MAX_TIMEOUT_MINUTES:,} (a year)"
            )
        if self.timeout_minutes < MIN_TIMEOUT_MINUTES:
            raise ConfigError(
                f"parallel.timeout_minutes = {self.timeout_minutes:g} is below {MIN_TIMEOUT_MINUTES:g} (0.6 s), too "
                "short for ranks to meet; the default is 10"
            )
        if self.vp > 1 and self.pp == 1:
            raise ConfigError("parallel.vp > 1 needs parallel.pp > 1 (virtual stages interleave a pipeline)")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "lamb", "adafactor"] = "adamw"
    """Optimizer. lamb is apex's FusedLAMB as Megatron's `--optimizer lamb` runs it (Adam moments with bias
    correction, decoupled weight decay, and the trust ratio |w| / |update| only where weight decay applies: norms
    and biases take Adam's step, and so does every parameter when weight_decay is 0). FusedLAMB also clips the global
    gradient norm at 1.0 itself (its max_grad_norm): loom leaves clipping to optim.clip_grad, so the two step alike
    with clip_grad in (0, 1], Megatron's default 1.0 included."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms and biases."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over every rank's shard) to this; 0 turns clipping off."""
    warmup_steps: int = 0
    """Linear warmup to lr over this many steps: step s (from 0) takes lr * (s + 1) / warmup_steps, so the first
    step already learns (Megatron-LM's first runs at lr 0; from the end of warmup on, the two are equal). Steps
    count applied updates: a skipped one (an fp16 overflow, train.nan_policy = skip) holds the schedule, warmup
    and decay alike, as in Megatron-LM. Under a batch ramp-up steps count full global batches: the schedule counts
    samples (train.rampup_batch_size)."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay from lr to min_lr after warmup."""
    decay_steps: int | None = None
    """Steps over which lr decays (counted from step 0, warmup included); None means train.steps (under a batch
    ramp-up, full global batches: the run's samples over global_batch_size)."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks. 0: every DP rank holds the whole optimizer. 1: master
    weights and optimizer state are split DP ways (adamw, sgd, lamb). 2: gradients too: each bucket is
    reduce-scattered into the rank's shard as backward completes it, every micro-batch. 3: the weights too:
    each rank keeps 1/DP of them, and a block's are all-gathered just before its forward and again before its
    backward (the next block's gather prefetched) and freed after each; under train.fp8 = current loom's FP8
    linears then quantise the gathered weights in each forward and backward instead of once per step."""
    zero1: bool = False
    """Older spelling of zero = 1, kept so configs that set it still run; resolved into `zero`."""
    offload: Literal["none", "cpu"] = "none"
    """Where fp32 master weights and optimizer state live and the optimizer steps. cpu: host memory
    (pinned where there is a GPU), the update runs there with torch's CPU AdamW; with zero >= 1 only
    the rank's shard is held. The device keeps the low-precision parameters and gradients."""
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """The gradient buffer's dtype: micro-batches accumulate and DP reduces in it. bf16 (Megatron's
    --grad-reduce-in-bf16; fp32 is its default under --bf16, as loom's) holds 2 B per parameter instead of 4 and
    halves the DP traffic, at bf16's rounding of the sums; the optimizer still steps fp32 masters. Needs train.precision
    = bf16."""
    grad_accumulation_fusion: bool = True
    """Megatron's gradient-accumulation fusion: the weight-gradient GEMM of each of loom's own linear layers adds
    straight into the gradient buffer (fp32 accumulation in the GEMM on CUDA) instead of writing a gradient that
    is then added in, a pass per parameter per micro-batch. Applies wherever the buffer holds the parameter's
    gradient (ZeRO 0 and 1); not to FP8 or Transformer Engine linears, nor to embeddings. false: the plain adds."""
    layer_lr_decay: float = 1.0
    """Layer-wise LR decay: block i gets lr * decay^(num_layers - i), embeddings decay^(num_layers + 1)."""
    initial_loss_scale: float = 65536.0
    """fp16: starting loss scale, by which each rank multiplies the mean loss of its own tokens before backward (as
    Megatron-LM does: the same scale keeps the same gradients in fp16's range at any dp x cp)."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the loss scale doubles."""
    loss_scale_hysteresis: int = 2
    """fp16: overflows (since the last growth) before the loss scale first halves; each further one halves it."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never goes below this."""

    def __post_init__(self) -> None:
        _check_choices(self, "optim")
        _check_positive("optim", lr=self.lr, decay_steps=self.decay_steps)
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr = {self.min_lr} must lie in [0, optim.lr = {self.lr}]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("optim.warmup_steps, optim.weight_decay and optim.clip_grad must be >= 0")
        if self.decay != "constant" and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(  # the rate would stay at its peak for good: no steps are left to decay over
                f"optim.decay_steps = {self.decay_steps} must exceed optim.warmup_steps = {self.warmup_steps} (it "
                "counts from step 0, warmup included); raise it, or set optim.decay = constant"
            )
        for name in ("beta1", "beta2", "momentum"):  # torch's optimizers refuse them on every rank otherwise
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.eps < 0:
            raise ConfigError(f"optim.eps must be >= 0, got {self.eps}")
        if not 0 < self.layer_lr_decay <= 1:
            raise ConfigError(f"optim.layer_lr_decay must lie in (0, 1], got {self.layer_lr_decay}")
        _check_positive(
            "optim",
            initial_loss_scale=self.initial_loss_scale,
            loss_scale_window=self.loss_scale_window,
            loss_scale_hysteresis=self.loss_scale_hysteresis,
            min_loss_scale=self.min_loss_scale,
        )
        if not self.min_loss_scale <= self.initial_loss_scale <= 2**32:
            raise ConfigError(  # a larger start only skips the first updates halving it (1e300: ~1,000 of them)
                f"optim.initial_loss_scale = {self.initial_loss_scale:g} must lie in [optim.min_loss_scale = "
                f"{self.min_loss_scale:g}, 2**32]"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"optim.zero = {self.zero} is not a ZeRO stage loom has; use 0, 1, 2 or 3")
        if self.zero1:  # migrated, so a resolved config.toml says zero = 1 and a later --optim.zero 0 is obeyed
            self.zero, self.zero1 = max(self.zero, 1), False
        if refusal := self.zero_refusal(self.zero) or self.offload_refusal(self.offload):
            raise ConfigError(refusal)

    def zero_refusal(self, zero: int) -> str | None:
        """Why this optimizer cannot run under ZeRO stage `zero` (training, and the planner's search), or None."""
        if zero and self.name == "adafactor":
            return (
                f"optim.name = adafactor does not support optim.zero = {zero} (its factored moments need whole "
                "matrices); use adamw, sgd or lamb with ZeRO, or optim.zero = 0"
            )
        return None

    def offload_refusal(self, offload: str) -> str | None:
        """Why this optimizer cannot run with optim.offload = `offload` (training, and the planner), or None."""
        if offload != "none" and self.name == "adafactor":
            return (
                f"optim.name = adafactor does not support optim.offload = {offload} (its step talks to the TP "
                "group); use adamw, sgd or lamb with offload"
            )
        return None


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Prefixes of .bin/.idx datasets (without the extension)."""
    weights: list[float] | None = None
    """Mixing weights, one per path; None means equal weights."""
    tokenizer: str | None = None
    """Tokenizer the data was built with, a SentencePiece .model or a Hugging Face tokenizer.json (used to check
    the vocabulary and decode)."""
    split: str = "98,1,1"
    """Train/valid/test split of each dataset's documents, as relative weights."""
    cache_dir: str | None = None
    """Where index caches go; None means beside each dataset."""

    def __post_init__(self) -> None:
        _check_choices(self, "data")
        self._refuse_megatron_pairs()
        if self.weights is not None and len(self.weights) != len(self.paths):
            raise ConfigError(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
        if self.weights is not None and any(w <= 0 for w in self.weights):
            raise ConfigError("data.weights must all be positive")
        parts = self.split.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
            raise ConfigError(
                f"data.split = {self.split!r} must be three non-negative weights, not all zero, like '98,1,1'"
            )

    def _refuse_megatron_pairs(self) -> None:
        """Megatron-LM's --data-path takes weight-prefix pairs (0.3 A 0.7 B); given to data.paths they read as
        datasets named 0.3 and 0.7, a missing-file error that does not say why."""
        weights, prefixes = self.paths[0::2], self.paths[1::2]
        if (
            not self.paths
            or len(weights) != len(prefixes)
            or not all(_is_number(w) and not _is_number(p) for w, p in zip(weights, prefixes))
        ):
            return
        raise ConfigError(
            f"data.paths = {' '.join(self.paths)} reads as Megatron-LM's weight-prefix pairs; loom takes the "
            f"prefixes and weights apart: --data.paths {' '.join(prefixes)} --data.weights {' '.join(weights)}"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to run."""
    global_batch_size: int = 256
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    rampup_batch_size: list[int] | None = None
    """[start, increment, ramp_samples]: the global batch grows from start by increment until
    global_batch_size over the first ramp_samples samples (Megatron's --rampup-batch-size). The learning-rate
    schedule counts samples, as Megatron's does: a ramp step of batch b moves it b / global_batch_size of a step,
    so optim.warmup_steps and optim.decay_steps count full global batches, and the decay's default length is the
    run's samples over global_batch_size."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank."""
    seq_length: int = 2048
    """Tokens per sequence."""
    seed: int = 1234
    """Seeds initialisation (per parameter name) and the data order."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute precision; master weights and optimizer state stay fp32."""
    name: str = "loom"
    """Run name; the run directory defaults to runs/<name>."""
    run_dir: str | None = None
    """Where config.toml, metrics.jsonl, tensorboard/ and checkpoints/ go."""
    overwrite: bool = False
    """Start afresh in a run directory that holds another run (a different config.toml and no checkpoint to
    resume from); that run's files are moved to RUN_DIR/replaced/<time>/, not deleted. Without it such a
    directory is refused, so one run never truncates another's metrics."""
    log_interval: int = 1
    """Write a metrics row and a console line every this many steps: that step's loss, lr and grad_norm (not means
    over the interval), with tokens_per_s and mfu measured over the steps since the previous row."""
    eval_interval: int = 0
    """Validation every this many steps (and at the end); 0 turns validation off."""
    eval_iters: int = 4
    """Global batches per validation."""
    exit_after: int = 0
    """Stop this job after this many steps (checkpointing first, whatever checkpoint.save_at_end says), to chain
    jobs; 0 runs to train.steps."""
    early_stop_patience: int = 0
    """Stop when validation loss has not improved for this many evaluations; 0 never stops early."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where ranks compute; auto means CUDA when available."""
    peak_tflops: float | None = None
    """Peak dense FLOP/s per device for MFU; None looks the device up (known GPUs only)."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    wandb_project: str | None = None
    """Also log metrics.jsonl's scalars and the resolved config to this Weights & Biases project (rank 0;
    needs `pip install wandb`). A restart resumes the same W&B run (its id is kept in the run directory)."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the logged-in default."""
    wandb_run_name: str | None = None
    """W&B run name; None: train.name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """online streams to the W&B server; offline writes RUN_DIR/wandb/ for a later `wandb sync`; disabled logs
    nothing to W&B (wandb's own switch, e.g. for a debug run of a config that names a project)."""
    record_pipeline_timeline: bool = False
    """Record per-op times of the last training step in pipeline_timeline.json (`loom schedule --from-run`)."""
    comm_ledger: bool = False
    """Debug: record every collective and p2p transfer of each step (group, op, dtype, count, bytes) in
    RUN_DIR/comm_ledger/rank_NNNNN.jsonl, one line per step (engine/comm_ledger.py). Slows steps down."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """What a NaN/Inf loss or gradient norm does: stop (fail the run; the last checkpoint, saved before
    the bad step, stays the newest) or skip (drop that step's update and go on). Under fp16 a gradient overflow
    with a finite loss is the loss scaler's to handle (it skips the step and lowers the scale), not this
    policy's; a non-finite loss is this policy's at any precision."""
    max_skipped_steps: int = 10
    """Under nan_policy = skip, fail after this many non-finite steps in a row (counted across resumes: a
    checkpoint keeps the count)."""
    fp8: Literal["off", "delayed", "current"] = "off"
    """FP8 matmuls in the transformer blocks (needs precision = bf16 and a GPU of compute capability >= 8.9):
    delayed = Transformer Engine's DelayedScaling (scales from an amax history), current = per-tensor
    scales from each tensor itself (TE's Float8CurrentScaling, or torch._scaled_mm without TE).
    Unavailable FP8 is an error, never a silent fallback."""
    fp8_output_layer: bool = False
    """With fp8 = current, the output layer's three GEMMs in FP8 too (hidden states and weight E4M3, the logits'
    gradient E5M2): the largest GEMM of a small model (a fifth of llama-1b's GEMM time in bf16, a third once its
    blocks run in FP8: 64 of 202 ms on an H200). Off by default, as in Transformer Engine, torchao and
    DeepSeek-V3's recipe, which keep the output layer in bf16; on CPU a 4-layer model trained 200 steps to within
    0.004 of bf16's loss with it (docs/gpu.md)."""

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` (ramp-up, then constant)."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        increments = (self.global_batch_size - start) // increment
        if increments == 0 or consumed_samples >= ramp_samples:
            return self.global_batch_size
        return start + int(consumed_samples / (ramp_samples / increments)) * increment

    def batch_sizes(self) -> list[int]:
        """Every global batch size the run will use."""
        if self.rampup_batch_size is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup_batch_size
        return list(range(start, self.global_batch_size + 1, increment))

    def ramp_shares(self, consumed_samples: int = 0) -> list[float]:
        """The batch of each step still inside the batch ramp-up, from the one that starts after
        `consumed_samples`, as its share of global_batch_size: what the step moves the learning-rate schedule
        (lr_schedule.learning_rate; a full-batch step moves it 1). [] without a ramp or past its end."""
        shares = []
        while (batch := self.global_batch_size_at(consumed_samples)) != self.global_batch_size:
            consumed_samples += batch
            shares.append(batch / self.global_batch_size)
        return shares

    def schedule_length(self) -> float:
        """The schedule's position after the run's last step, the decay's default length: train.steps, each ramp
        step counted as its share (the run's samples over global_batch_size, as Megatron-LM counts samples)."""
        shares = self.ramp_shares()
        position = 0.0
        for share in shares[: self.steps]:  # added one by one as the trainer adds them (sum() may compensate)
            position += share
        return position + max(0, self.steps - len(shares))

    def __post_init__(self) -> None:
        _check_choices(self, "train")
        _check_positive(
            "train",
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            seq_length=self.seq_length,
            log_interval=self.log_interval,
            eval_iters=self.eval_iters,
            peak_tflops=self.peak_tflops,
        )
        _check_positive("train", max_skipped_steps=self.max_skipped_steps)
        if self.fp8 != "off" and self.precision != "bf16":
            raise ConfigError(
                f"train.fp8 = {self.fp8} needs train.precision = bf16 (got {self.precision}); "
                f"add --train.precision bf16"
            )
        if self.fp8_output_layer and self.fp8 != "current":
            raise ConfigError(
                f"train.fp8_output_layer needs train.fp8 = current (loom's own FP8 linears), got {self.fp8}; "
                f"add --train.fp8 current or drop --train.fp8_output_layer"
            )
        if self.rampup_batch_size is not None:
            if len(self.rampup_batch_size) != 3 or min(self.rampup_batch_size) <= 0:
                raise ConfigError("train.rampup_batch_size takes three positive numbers: start increment samples")
            start, increment, _ = self.rampup_batch_size
            if start > self.global_batch_size or (self.global_batch_size - start) % increment:
                raise ConfigError(
                    f"train.rampup_batch_size: global_batch_size {self.global_batch_size} - start "
                    f"{start} must be a non-negative multiple of the increment {increment}"
                )
        if self.eval_interval < 0 or self.early_stop_patience < 0 or self.exit_after < 0:
            raise ConfigError("train.eval_interval, train.early_stop_patience and train.exit_after must be >= 0")
        if self.run_dir is not None and not self.run_dir.strip():  # Path("") is the current directory
            raise ConfigError("train.run_dir is empty; give a folder, or drop it for runs/<train.name>")
        if self.run_dir is None:
            if not is_plain_name(self.name):
                raise ConfigError(
                    f"train.name = {self.name!r} must be a plain name (it becomes runs/<name>); give a path as "
                    "--train.run_dir instead"
                )
            self.run_dir = str(Path("runs") / self.name)


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps; 0: no periodic saves (the last step is still saved, see save_at_end)."""
    save_at_end: bool = True
    """Save the run's last step (train.steps, or an early stop) so a finished run can be evaluated, exported or
    extended. false matters only to a run without periodic saves (checkpoint.interval 0): it then keeps no
    checkpoint. A run with an interval saves its last step too (a rerun would train the steps after the last save
    again), and a job that train.exit_after ends always saves, for the next job."""
    keep: int = 3
    """Keep the newest this many checkpoints."""
    load: str | None = None
    """Checkpoint a new run starts from (a run directory, its checkpoints/ or an iter_N folder, any layout; the run's
    own directory, as Megatron's --save D --load D, is no other start). Once the run has checkpoints of its own, it
    resumes from its newest instead: rerunning the command, extending the
    run or a requeued job continue it rather than going back here. Its weights are the model: its shapes, RoPE
    and norm settings and context length are the checkpoint's, over the config file's, on this run and its reruns
    (said at start; a flag giving another shape is refused; dropout, recompute, kernels stay the run's)."""
    finetune: bool = False
    """With checkpoint.load: start from its weights alone (Megatron's --finetune, torchtitan's
    initial_load_model_only): step 1 of this run's schedule, fresh optimizer state and loss scale, its data from the
    start. false: train on from the loaded step, its optimizer state and data position. A run with checkpoints of
    its own resumes from them either way."""
    verify: bool = True
    """Check every file's sha256 before resuming (a damaged checkpoint falls back to an older one)."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues."""

    def __post_init__(self) -> None:
        _check_choices(self, "checkpoint")
        if self.interval < 0 or self.keep < 1:
            raise ConfigError("checkpoint.interval must be >= 0 and checkpoint.keep >= 1")


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""loom's linear layers an adapter can sit on; in Hugging Face/PEFT names qkv is q_proj, k_proj and v_proj (one
shared A, B stacked), proj is o_proj, fc1 is gate_proj and up_proj (SwiGLU) or the MLP's first layer, fc2 down_proj."""


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on a frozen base model: W x + (alpha / rank) B A x."""

    rank: int = 0
    """Rank r of each adapter; 0 trains the whole model (no adapters)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Layers that get an adapter, any of qkv, proj, fc1, fc2 (see LORA_TARGETS for the PEFT names)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialisation, B starting at zero (so training starts from the base model): kaiming is PEFT's
    default, uniform(-1/sqrt(in), 1/sqrt(in)); gaussian is normal(0, 1/rank) (PEFT's init_lora_weights="gaussian")."""
    base: str | None = None
    """The frozen base model: a loom checkpoint of any layout (an iter_N directory or a checkpoints/ folder),
    e.g. one written by `loom ckpt import-hf`. Required when rank > 0."""

    def __post_init__(self) -> None:
        _check_choices(self, "lora")
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError("lora.rank must be >= 0, lora.alpha > 0 and 0 <= lora.dropout < 1")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            spaced = (
                " (a flag takes them space-separated: --lora.targets qkv proj)"
                if any("," in t for t in unknown)
                else ""
            )
            raise ConfigError(
                f"lora.targets = {self.targets} must be a non-empty subset of {', '.join(LORA_TARGETS)}{spaced}"
            )
        if self.rank and not self.base:
            raise ConfigError(
                "lora.rank > 0 needs the base model: --lora.base DIR (a loom checkpoint, e.g. from import-hf)"
            )
        if not self.rank:
            # Without a rank no adapter exists: a base or an adapter setting would be ignored and the run would
            # train a freshly initialised model, so it is refused instead.
            given = [f.name for f in fields(self) if f.name != "rank" and getattr(self, f.name) != field_default(f)]
            if given:
                raise ConfigError(
                    f"lora.{given[0]} is set but lora.rank is 0 (no adapters): add --lora.rank R (e.g. 8) to "
                    "fine-tune with LoRA, or drop the lora settings to train the whole model"
                )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
        backend = self.model.attention_backend
        if backend != "auto" and self.parallel.cp > 1:
            raise ConfigError(
                f"model.attention_backend = {backend} with parallel.cp = {self.parallel.cp}: ring attention runs "
                "flash kernels of its own; use --model.attention_backend auto"
            )
        if backend in ("flash", "cudnn") and self.train.precision == "fp32":
            raise ConfigError(
                f"model.attention_backend = {backend} is a CUDA kernel for bf16 or fp16, not train.precision = fp32; "
                "use --model.attention_backend efficient (or auto), or --train.precision bf16 on a GPU"
            )

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
            derived = "8h/3 rounded up to 256" if m.activation == "swiglu" else "4h"
            said.append(
                f"--model.hidden_size {m.hidden_size} keeps the config file's model.ffn_hidden_size = "
                f"{m.ffn_hidden_size}, chosen for its own width: give --model.ffn_hidden_size too (none: loom's "
                f"{derived})"
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
        llama3 = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions")
        unread = [
            (
                m,
                ("rope_theta", "rope_scaling", *llama3),
                m.position_embedding != "rope",
                "model.position_embedding = learned",
            ),
            (m, llama3, m.position_embedding == "rope" and m.rope_scaling == "none", "model.rope_scaling = none"),
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

    def zero_refusal(self, zero: int) -> str | None:
        """Why this run cannot use ZeRO stage `zero` (training and the planner's search), or None."""
        if refusal := self.optim.zero_refusal(zero):
            return refusal
        if zero == 3 and self.train.fp8 == "delayed":
            return (
                "optim.zero = 3 with train.fp8 = delayed: delayed scaling is Transformer Engine's, whose layers "
                "hold whole weights; use --train.fp8 current (loom's FP8 linears quantise the gathered weights) "
                "or --optim.zero 2"
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
