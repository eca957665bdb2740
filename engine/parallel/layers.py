"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Activations are [sequence, batch, hidden]. Without sequence parallelism the input of a TP region
is replicated on every TP rank; with it, the input is split along the sequence and the layers
all-gather on entry and reduce-scatter on exit (same volume as the all-reduce it replaces).
Parameters are created uninitialised with a ShardSpec; `sharding.initialize_parameters` fills them.
Both linear layers take an optional low-rank `adapter` (engine/model/lora.py) whose output joins the
layer's own before any collective, so it rides on the layer's reduction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.engine.parallel import grad_fusion, mappings
from loom.engine.parallel.sharding import ShardSpec, make_parameter


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W split by output rows; `out_blocks` lists fused outputs (e.g. Q, K, V).

    Each block is split evenly across TP ranks, so rank r holds rows r of every block. The output
    stays split (feeds a row-parallel layer or a vocab-parallel loss) unless gather_output.
    """

    fuses_weight_grad = True
    """Its backward can add the weight's gradient into main_grad (engine/parallel/grad_fusion.py)."""

    def __init__(
        self,
        in_features: int,
        out_blocks: tuple[int, ...],
        tp_group,
        *,
        bias: bool,
        init_std: float,
        sequence_parallel: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.gather_output = tp_group, sequence_parallel, gather_output
        tp = mappings.group_size(tp_group)
        out_features = sum(out_blocks)
        self.weight = make_parameter(
            ShardSpec((out_features, in_features), 0, tuple(out_blocks)), tp, ("normal", init_std)
        )
        self.bias = make_parameter(ShardSpec((out_features,), 0, tuple(out_blocks)), tp, ("zeros",)) if bias else None
        self.adapter: torch.nn.Module | None = None

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return grad_fusion.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_region(x, self.tp_group)
        y = self._linear(x, self.bias)
        if self.adapter is not None:
            y = y + self.adapter(x)
        return mappings.gather_from_tensor_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """y = x W^T + b with W split by input columns; the input arrives split (from a column layer)."""

    fuses_weight_grad = True
    """Its backward can add the weight's gradient into main_grad (engine/parallel/grad_fusion.py)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group,
        *,
        bias: bool,
        init_std: float,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        tp = mappings.group_size(tp_group)
        self.weight = make_parameter(ShardSpec((out_features, in_features), 1), tp, ("normal", init_std))
        self.bias = (
            make_parameter(ShardSpec((out_features,)), tp, ("zeros",), tp_partial_grad=sequence_parallel)
            if bias
            else None
        )
        self.adapter: torch.nn.Module | None = None

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return grad_fusion.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, None)
        if self.adapter is not None:  # a partial sum on each rank, like y: the reduction below completes both
            y = y + self.adapter(x)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding with the (padded) vocabulary split across TP ranks; ids [b, s] -> [s, b, h]."""

    def __init__(
        self,
        vocab_size: int,
        padded_size: int,
        hidden_size: int,
        tp_group,
        *,
        init_std: float,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        tp, rank = mappings.group_size(tp_group), mappings.group_rank(tp_group)
        self.vocab_size = vocab_size
        self.weight = make_parameter(
            ShardSpec((vocab_size, hidden_size), 0, padded_size=padded_size), tp, ("normal", init_std)
        )
        self.vocab_start = rank * (padded_size // tp)
        self.vocab_end = self.vocab_start + padded_size // tp

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        token_ids = token_ids.t()
        if mappings.group_size(self.tp_group) == 1:
            out = F.embedding(token_ids, self.weight)
        else:
            outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
            local_ids = (token_ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_region(out, self.tp_group)
        return mappings.reduce_from_tensor_region(out, self.tp_group)
