"""[optim]: the optimizer, its learning-rate schedule, ZeRO stage, offload and gradient precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loom.engine.config.fields import ConfigError, check_choices, check_positive


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
        check_choices(self, "optim")
        check_positive("optim", lr=self.lr, decay_steps=self.decay_steps)
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
        check_positive(
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
