"""[parallel]: the layout (tp, pp, vp, dp, cp), sequence parallelism and the process groups' timeout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loom.engine.config.fields import ConfigError, check_choices, check_positive

MAX_TIMEOUT_MINUTES = 525_600
"""parallel.timeout_minutes's ceiling, a year: far above any real wait, far below timedelta's overflow."""
MIN_TIMEOUT_MINUTES = 0.01
"""Its floor, 0.6 s: below it even one rank's own store timed out (a C++ stack that blamed a peer)."""


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
    ep: int = 1
    """Expert-parallel size (model.num_experts; Megatron's --expert-model-parallel-size): each expert block's experts
    are divided among this many consecutive DP ranks, which send each token to the rank holding its expert and
    back (two all-to-alls per block and direction); each still splits its experts over TP. Divides parallel.dp and
    model.num_experts. The experts' gradients are summed, and ZeRO shards them, over the dp / ep x cp ranks that
    hold the same experts."""
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

    def check_ep_divides_dp(self) -> None:
        """Expert parallelism divides the DP ranks (once dp is known: given, or derived from the world size)."""
        if self.dp % self.ep:
            raise ConfigError(
                f"parallel.ep = {self.ep} must divide parallel.dp = {self.dp}: experts are divided among DP ranks"
            )

    def __post_init__(self) -> None:
        check_choices(self, "parallel")
        check_positive(
            "parallel",
            tp=self.tp,
            pp=self.pp,
            vp=self.vp,
            cp=self.cp,
            dp=self.dp,
            ep=self.ep,
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
        if self.dp is not None:
            self.check_ep_divides_dp()
        if self.vp > 1 and self.pp == 1:
            raise ConfigError("parallel.vp > 1 needs parallel.pp > 1 (virtual stages interleave a pipeline)")
