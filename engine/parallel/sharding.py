"""How a full (layout-independent) tensor maps to the shard one tensor-parallel rank holds.

Every parameter's ParamInfo (param_info.py) carries a `ShardSpec`; initialisation, checkpoints and
resharding all go through it, so there is one truth about slicing. A fused weight (QKV, SwiGLU
gate+up) is a stack of blocks along the split dim, each block split evenly across TP ranks, so a
rank's shard holds its slice of every block. Padding (the vocabulary) is zeros appended before
splitting.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from loom.engine.parallel.param_info import MissingParamInfoError, ParamInfo, param_info, set_param_info


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    """Logical shape of the whole parameter, without padding."""
    dim: int | None = None
    """Dimension split across TP ranks; None means every rank holds the whole (replicated) tensor."""
    blocks: tuple[int, ...] = ()
    """Sizes of the stacked blocks along `dim` (after padding); empty means one block."""
    padded_size: int | None = None
    """Size of `dim` after zero padding (the vocabulary), or None for no padding."""

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    def _blocks(self) -> tuple[int, ...]:
        assert self.dim is not None
        size = self.padded_size or self.full_shape[self.dim]
        return self.blocks or (size,)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        blocks = self._blocks()
        for block in blocks:
            if block % tp_size:
                raise ValueError(f"a block of {block} rows does not split across {tp_size} ranks")
        shape = list(self.full_shape)
        shape[self.dim] = sum(blocks) // tp_size
        return tuple(shape)

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's slice of a full tensor."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full
        if self.padded_size is not None:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_size - full.shape[self.dim]
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        pieces = [
            block.chunk(tp_size, dim=self.dim)[tp_rank] for block in full.split(list(self._blocks()), dim=self.dim)
        ]
        return torch.cat(pieces, dim=self.dim).contiguous()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every TP rank's shard, in rank order (padding removed)."""
        if self.dim is None:
            return shards[0]
        tp_size = len(shards)
        per_rank = [b // tp_size for b in self._blocks()]
        split_shards = [s.split(per_rank, dim=self.dim) for s in shards]
        blocks = [torch.cat([parts[i] for parts in split_shards], dim=self.dim) for i in range(len(per_rank))]
        full = torch.cat(blocks, dim=self.dim)
        return full.narrow(self.dim, 0, self.full_shape[self.dim])


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's layout-independent name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def full_init(init: tuple, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Materialise a full parameter on the CPU: ("normal", std), ("ones",) or ("zeros",)."""
    kind = init[0]
    if kind == "normal":
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32) * init[1]
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    raise ValueError(f"unknown initialisation {init!r}")


def make_parameter(
    spec: ShardSpec, tp_size: int, init: tuple, device: torch.device | None = None, sequence_parallel_grad: bool = False
) -> torch.nn.Parameter:
    """An uninitialised local parameter whose ParamInfo knows its full shape, its slicing and its init.

    `sequence_parallel_grad` marks replicated parameters whose gradient is partial on each TP
    rank (they see only a slice of the sequence) and must be summed over the TP group.
    """
    param = torch.nn.Parameter(torch.empty(spec.local_shape(tp_size), device=device))
    set_param_info(param, ParamInfo(spec, init, sequence_parallel_grad))
    return param


@torch.no_grad()
def initialize_parameters(module: torch.nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """Initialise every parameter from its full shape with a seed derived from its global name, then slice."""
    for module_name, param in module.named_parameters():
        info = param_info(param)
        if info.name is None:
            raise MissingParamInfoError(f"parameter {module_name} has no global name: its model did not name it")
        full = full_init(info.init_method, info.shard_spec.full_shape, name_seed(seed, info.name))
        param.copy_(info.shard_spec.shard(full, tp_rank, tp_size).to(param.device, param.dtype))
