"""What loom knows about each parameter, as one typed record attached to the parameter.

A parameter gets its `ParamInfo` in two steps: the layer that creates it records how it is sliced,
initialised and reduced (`sharding.make_parameter`, or te.py for Transformer Engine's own parameters), then
the model that owns it adds what follows from its place in the model: its layout-independent name,
layer, weight-decay class and tied-embedding role (GPTModel, through engine/model/naming.py).
Initialisation, gradient sums, the optimizer and checkpoints read it through `param_info`, which
fails loudly for a parameter that was never described instead of guessing a default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # sharding.py builds parameters with a ParamInfo, so it imports this module
    from loom.engine.parallel.sharding import ShardSpec

# A private attribute name so that nothing else on the tensor can collide with it.
_ATTRIBUTE = "loom_param_info"


@dataclass(frozen=True)
class ParamInfo:
    shard_spec: ShardSpec
    """How the full (layout-independent) tensor maps to this TP rank's shard."""
    init_method: tuple
    """How the full tensor is initialised: ("normal", std), ("uniform", bound), ("ones",) or ("zeros",)
    (sharding.init_shard)."""
    tp_partial_grad: bool = False
    """A replicated parameter whose gradient is partial on each TP rank, so the gradient is summed over the
    TP group: norms and biases under sequence parallelism (each rank sees a slice of the sequence) and a LoRA
    adapter's replicated factor (each rank sees a slice of the other factor)."""
    name: str | None = None
    """The layout-independent global name (`layers.3.attention.qkv.weight`): the initialisation seed,
    the checkpoint key and the Hugging Face mapping all use it. None until the owning model names it."""
    layer: int | None = None
    """Global index of the transformer block holding the parameter; None outside the blocks."""
    no_decay: bool = False
    """Excluded from weight decay (biases and norm parameters)."""
    tied_embedding: bool = False
    """One of the two copies of a tied input/output embedding; under pipelining the first and the last
    stage each hold one, and their gradients are summed so the copies stay equal."""
    tied_copy: bool = False
    """The last stage's copy of a tied embedding: it takes the embedding's name, and is neither saved
    nor counted in global sums (the first stage's copy is)."""
    expert_range: tuple[int, int] | None = None
    """Expert parallelism (parallel.ep > 1): the experts [start, end) of the TP shard's first dimension this rank
    holds, a contiguous range of the shard flattened; its gradients are summed over the expert_grad group. None:
    the whole TP shard (every parameter without expert parallelism)."""


class MissingParamInfoError(LookupError):
    """A parameter without a ParamInfo: it was not created by make_parameter or tagged with set_param_info."""


def set_param_info(param: torch.Tensor, info: ParamInfo) -> None:
    """Attach (or replace) the parameter's record."""
    setattr(param, _ATTRIBUTE, info)


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record; raises MissingParamInfoError when it has none."""
    info = getattr(param, _ATTRIBUTE, None)
    if info is None:
        raise MissingParamInfoError(
            f"a parameter of shape {tuple(param.shape)} has no ParamInfo: create it with "
            "sharding.make_parameter or describe it with param_info.set_param_info"
        )
    return info


def update_param_info(param: torch.Tensor, **changes) -> ParamInfo:
    """Replace some fields of the parameter's record; returns the new record."""
    info = replace(param_info(param), **changes)
    set_param_info(param, info)
    return info
