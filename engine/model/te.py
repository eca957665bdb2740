"""Transformer Engine versions of loom's layers, used on CUDA when transformer_engine imports.

Only kernels.py decides to build these; importing this module never imports transformer_engine
(every function imports it when called), so loom imports on CPU machines without it.

Two rules keep TE layers interchangeable with loom's own:
- TP collectives: every TE module gets loom's TP group and size and the matching parallel mode,
  so TE performs the collectives loom's ColumnParallelLinear / RowParallelLinear would (column:
  all-gather the sequence-parallel input, or all-reduce the input gradient; row: reduce-scatter
  or all-reduce the output). Under sequence parallelism norm weights get partial gradients on each
  TP rank; TE only marks them, and loom sums them (engine/optim/model_parallel_grads.py) because
  their ParamInfo says `tp_partial_grad` like the native Norm's.
- Parameters: TE creates its own `weight`/`bias`; they get a ParamInfo with loom's ShardSpec and init
  (TE's own init is skipped), so initialisation, checkpoints, resharding and HF export see the same
  names, shapes and slicing as with the native layers.

The calls follow TE's PyTorch API (docs.nvidia.com/deeplearning/transformer-engine, "PyTorch"):
Linear(in_features, out_features, bias, init_method, sequence_parallel, tp_group, tp_size,
parallel_mode="column"|"row", params_dtype, device); RMSNorm / LayerNorm(hidden size, eps,
sequence_parallel, params_dtype, device); DotProductAttention(num_attention_heads, kv_channels,
num_gqa_groups, attention_dropout, qkv_format, attn_mask_type, sequence_parallel, tp_size, tp_group);
recipes DelayedScaling / Float8CurrentScaling(fp8_format=Format.HYBRID) from
transformer_engine.common.recipe; autocast(enabled, recipe, amax_reduction_group) from TE 2.8 on,
fp8_autocast(enabled, fp8_recipe, fp8_group) before.
"""

from __future__ import annotations

import contextlib

import torch

from loom.engine.config import ModelConfig
from loom.engine.parallel import mappings
from loom.engine.parallel.param_info import ParamInfo, set_param_info
from loom.engine.parallel.sharding import ShardSpec


def _te():
    import transformer_engine.pytorch as te

    return te


def _skip_init(weight: torch.Tensor) -> None:
    """TE's init_method hook: loom initialises every parameter itself (sharding.initialize_parameters)."""


def _tag(param: torch.nn.Parameter, spec: ShardSpec, init: tuple, tp_partial_grad: bool = False) -> None:
    set_param_info(param, ParamInfo(spec, init, tp_partial_grad))


def column_parallel_linear(
    in_features: int,
    out_blocks: tuple[int, ...],
    tp_group,
    *,
    bias: bool,
    init_std: float,
    sequence_parallel: bool,
    params_dtype: torch.dtype,
) -> torch.nn.Module:
    """te.Linear in column mode; its local weight holds this rank's rows of every block, like loom's."""
    tp, out_features = mappings.group_size(tp_group), sum(out_blocks)
    layer = _te().Linear(
        in_features,
        out_features,
        bias=bias,
        init_method=_skip_init,
        sequence_parallel=sequence_parallel,
        tp_group=tp_group,
        tp_size=tp,
        parallel_mode="column",
        params_dtype=params_dtype,
        device="cuda",
    )
    _tag(layer.weight, ShardSpec((out_features, in_features), 0, tuple(out_blocks)), ("normal", init_std))
    if bias:
        _tag(layer.bias, ShardSpec((out_features,), 0, tuple(out_blocks)), ("zeros",))
    return layer


def row_parallel_linear(
    in_features: int,
    out_features: int,
    tp_group,
    *,
    bias: bool,
    init_std: float,
    sequence_parallel: bool,
    params_dtype: torch.dtype,
) -> torch.nn.Module:
    """te.Linear in row mode (TE adds the bias after the reduction, as loom's RowParallelLinear does)."""
    layer = _te().Linear(
        in_features,
        out_features,
        bias=bias,
        init_method=_skip_init,
        sequence_parallel=sequence_parallel,
        tp_group=tp_group,
        tp_size=mappings.group_size(tp_group),
        parallel_mode="row",
        params_dtype=params_dtype,
        device="cuda",
    )
    _tag(layer.weight, ShardSpec((out_features, in_features), 1), ("normal", init_std))
    if bias:
        _tag(layer.bias, ShardSpec((out_features,)), ("zeros",), tp_partial_grad=sequence_parallel)
    return layer


def norm(config: ModelConfig, sequence_parallel: bool, params_dtype: torch.dtype) -> torch.nn.Module:
    """te.RMSNorm or te.LayerNorm (fused kernels), parameters named and tagged like loom's Norm."""
    te = _te()
    cls = te.RMSNorm if config.norm == "rmsnorm" else te.LayerNorm
    module = cls(
        config.hidden_size,
        eps=config.norm_eps,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        device="cuda",
    )
    spec = ShardSpec((config.hidden_size,))
    _tag(module.weight, spec, ("ones",), tp_partial_grad=sequence_parallel)
    if config.norm == "layernorm":
        _tag(module.bias, spec, ("zeros",), tp_partial_grad=sequence_parallel)
    return module


def dot_product_attention(config: ModelConfig, tp_group, sequence_parallel: bool) -> torch.nn.Module:
    """te.DotProductAttention on [s, b, heads, head_dim] (sbhd) inputs, causal; returns [s, b, heads*head_dim].

    Head counts are the global ones: TE divides them by tp_size itself. Dropout stays 0 here
    (kernels.py keeps SDPA when model.dropout > 0, so dropout draws from loom's RNG streams)."""
    return _te().DotProductAttention(
        config.num_heads,
        config.head_dim,
        num_gqa_groups=config.num_kv_heads,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal",
        sequence_parallel=sequence_parallel,
        tp_size=mappings.group_size(tp_group),
        tp_group=tp_group,
        softmax_scale=config.softmax_scale,
    )


def fp8_recipe(mode: str):
    """TE's FP8 recipe for train.fp8: delayed (amax history) or current (per-tensor, this step's amax)."""
    from transformer_engine.common import recipe

    if mode == "delayed":
        return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
    return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)


def has_current_scaling() -> bool:
    from transformer_engine.common import recipe

    return hasattr(recipe, "Float8CurrentScaling")


def fp8_autocast(recipe, amax_group) -> contextlib.AbstractContextManager:
    """Enter TE's FP8 region. Amaxes are reduced over `amax_group` (loom passes the TP group: Megatron's
    tp-only amax reduction), never the world group, whose pipeline stages do not run in step."""
    te = _te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
