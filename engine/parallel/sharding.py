"""How a full (layout-independent) tensor maps to the shard one tensor-parallel rank holds.

Every parameter's ParamInfo (param_info.py) carries a `ShardSpec`; initialisation, checkpoints and
resharding all go through it, so there is one truth about slicing. A fused weight (QKV, SwiGLU
gate+up) is a stack of blocks along the split dim, each block split evenly across TP ranks, so a
rank's shard holds its slice of every block. Padding (the vocabulary) is zeros appended before
splitting.
"""

from __future__ import annotations

import hashlib
import math
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

    def local_ranges(self, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
        """The [start, end) ranges along `dim` of the padded full tensor that this rank's shard holds, in order
        (one per block); the whole of dim 0 for a replicated tensor."""
        if self.dim is None:
            return [(0, self.full_shape[0])]
        self.local_shape(tp_size)  # refuses blocks that do not split
        ranges, start = [], 0
        for block in self._blocks():
            per_rank = block // tp_size
            ranges.append((start + tp_rank * per_rank, start + (tp_rank + 1) * per_rank))
            start += block
        return ranges

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


# Random initial values are drawn in slabs: runs of whole rows (or columns, for a tensor split along dim 1)
# of about this many elements, each from a generator seeded by the parameter's name and the slab's index.
# A TP rank then draws only the slabs its shard overlaps, one at a time, instead of the full tensor (minutes
# and the full size in memory for a 70B model's embedding or MLP weights); slabs are cut from the full shape
# alone, so every layout draws the same values. 2**18 fp32 elements (1 MiB) make a seed and a call per slab
# negligible next to the drawing.
SLAB_ELEMENTS = 1 << 18


def slab_dim(spec: ShardSpec) -> int:
    """The dimension slabs run along: the split one, so a shard is a union of (parts of) slabs."""
    return spec.dim if spec.dim is not None else 0


def slab_size(spec: ShardSpec) -> int:
    """Indices along slab_dim per slab: whole rows/columns of about SLAB_ELEMENTS elements, at least one."""
    shape, dim = spec.full_shape, slab_dim(spec)
    per_index = math.prod(shape) // shape[dim] if shape[dim] else 1
    return max(1, SLAB_ELEMENTS // max(1, per_index))


def slab_values(spec: ShardSpec, std: float, seed: int, name: str, slab: int, uniform: bool = False) -> torch.Tensor:
    """The normal(0, std) values (uniform(-std, std) with `uniform`) of one slab of the full (unpadded) tensor,
    on the CPU in fp32."""
    dim, size = slab_dim(spec), slab_size(spec)
    start = slab * size
    shape = list(spec.full_shape)
    shape[dim] = min(size, spec.full_shape[dim] - start)
    generator = torch.Generator().manual_seed(name_seed(seed, f"{name}#slab{slab}"))
    if uniform:
        return torch.rand(shape, generator=generator, dtype=torch.float32).mul_(2 * std).sub_(std)
    return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)


def fill_random_shard(
    local: torch.Tensor,
    spec: ShardSpec,
    std: float,
    seed: int,
    name: str,
    tp_rank: int,
    tp_size: int,
    uniform: bool = False,
) -> None:
    """Write this rank's shard of the full normal(0, std) (or uniform(-std, std)) tensor into `local`, drawing
    only the slabs it overlaps (padding rows are zeros). Peak extra memory: one slab."""
    dim, size, length = slab_dim(spec), slab_size(spec), spec.full_shape[slab_dim(spec)]
    offset = 0  # where the current range starts in `local`
    for start, end in spec.local_ranges(tp_rank, tp_size):
        for slab in range(start // size, math.ceil(min(end, length) / size)):
            lo, hi = max(start, slab * size), min(end, length, (slab + 1) * size)
            values = slab_values(spec, std, seed, name, slab, uniform)
            local.narrow(dim, offset + lo - start, hi - lo).copy_(values.narrow(dim, lo - slab * size, hi - lo))
        if end > length:
            padding_start = max(start, length)
            local.narrow(dim, offset + padding_start - start, end - padding_start).zero_()
        offset += end - start


def full_init(init: tuple, spec: ShardSpec, seed: int, name: str) -> torch.Tensor:
    """The whole logical tensor a parameter is initialised from (its ParamInfo.init_method), on the CPU: what
    every layout's shards are slices of (tests check against it; training fills shards directly)."""
    full = torch.empty(spec.full_shape)
    init_shard(full, init, ShardSpec(spec.full_shape, slab_dim(spec)), seed, name, 0, 1)
    return full


def init_shard(
    local: torch.Tensor, init: tuple, spec: ShardSpec, seed: int, name: str, tp_rank: int, tp_size: int
) -> None:
    """Fill `local`, this rank's shard of a parameter, with its slice of the full initial tensor."""
    kind = init[0]
    if kind in ("normal", "uniform"):
        fill_random_shard(local, spec, init[1], seed, name, tp_rank, tp_size, uniform=kind == "uniform")
    elif kind == "ones":
        local.fill_(1.0)
    elif kind == "zeros":
        local.zero_()
    else:
        raise ValueError(f"unknown initialisation {init!r}")


def make_parameter(
    spec: ShardSpec,
    tp_size: int,
    init: tuple,
    device: torch.device | None = None,
    tp_partial_grad: bool = False,
    expert_range: tuple[int, int] | None = None,
) -> torch.nn.Parameter:
    """An uninitialised local parameter whose ParamInfo knows its full shape, its slicing and its init.

    `tp_partial_grad` marks replicated parameters whose gradient is partial on each TP
    rank and must be summed over the TP group (ParamInfo.tp_partial_grad); `expert_range` the experts this rank
    holds of its TP shard (ParamInfo.expert_range).
    """
    shape = spec.local_shape(tp_size)
    if expert_range is not None:
        shape = (expert_range[1] - expert_range[0], *shape[1:])
    param = torch.nn.Parameter(torch.empty(shape, device=device))
    set_param_info(param, ParamInfo(spec, init, tp_partial_grad, expert_range=expert_range))
    return param


def held_part(info: ParamInfo, shard: torch.Tensor) -> torch.Tensor:
    """What this rank holds of its TP shard `shard` of the parameter `info` describes: the experts of its
    expert_range (a view), or the whole shard."""
    if info.expert_range is None:
        return shard
    start, end = info.expert_range
    return shard[start:end]


def rank_part(info: ParamInfo, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """What this rank holds of the full (logical) tensor `full` of the parameter `info` describes: its TP shard, or
    under expert parallelism that shard's experts it holds."""
    return held_part(info, info.shard_spec.shard(full, tp_rank, tp_size))


def held_offset(info: ParamInfo, shard_shape: tuple[int, ...]) -> int:
    """Where held_part starts in the TP shard flattened (checkpoints' flat ranges are the shard's)."""
    if info.expert_range is None:
        return 0
    return info.expert_range[0] * math.prod(shard_shape[1:])


@torch.no_grad()
def initialize_parameters(module: torch.nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """Initialise every parameter with its shard of the full tensor its global name and the seed define,
    without building the full tensor (see SLAB_ELEMENTS)."""
    for module_name, param in module.named_parameters():
        info = param_info(param)
        if info.name is None:
            raise MissingParamInfoError(f"parameter {module_name} has no global name: its model did not name it")
        if param.device.type == "cpu" and param.dtype == torch.float32 and info.expert_range is None:
            init_shard(param, info.init_method, info.shard_spec, seed, info.name, tp_rank, tp_size)
            continue
        # drawn in fp32 on the CPU, like every layout's values (the whole TP shard where this rank holds some experts)
        local = torch.empty(info.shard_spec.local_shape(tp_size))
        init_shard(local, info.init_method, info.shard_spec, seed, info.name, tp_rank, tp_size)
        param.copy_(held_part(info, local))
