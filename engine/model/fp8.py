"""FP8 linear layers on torch._scaled_mm with per-tensor current scaling, for GPUs without Transformer Engine.

All three GEMMs of a linear layer take FP8 operands: activations and weights in E4M3 (more
mantissa), output gradients in E5M2 (more range) -- the "hybrid" format of Micikevicius et al.
2022 ("FP8 Formats for Deep Learning") and of Transformer Engine's Format.HYBRID. Each operand is
scaled by its own absolute maximum just before the cast ("current scaling"), so there is no amax
history and no state: a recomputed forward gives the same result. Weights stay in their training
dtype (bf16, fp32 masters in the optimizer); only the GEMM inputs are quantised, and the forward
keeps the FP8 copies of x and W for the backward (half the bytes of bf16).

A weight changes only when the optimizer steps, so each layer quantises it once per step (`WeightCast`,
refreshed by the trainer outside any compiled graph) into a row-major and a column-major copy, and every
micro-batch, recomputed forward and backward of that step reads them: no per-micro-batch amax, cast or
transpose of a weight, and no graph break in a compiled block. Under ZeRO-3 a weight is whole only while its block
computes, so there each forward and backward quantises the gathered weight itself.

torch._scaled_mm wants the second operand column-major and every size divisible by 16; kernels.py
checks the sizes before choosing this path. It runs on CUDA devices of compute capability >= 8.9,
and (slowly) on CPU, which is how the tests check the arithmetic. Only kernels.py decides to use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loom.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 multiplier that maps `amax` onto the largest finite value of `dtype` (1 when amax is 0)."""
    amax = amax.float()
    return torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones_like(amax))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x in FP8 with a per-tensor current scale; returns (fp8 values, fp32 inverse scale)."""
    scale = fp8_scale(x.detach().abs().amax(), dtype)
    limit = torch.finfo(dtype).max
    # Clamp first: the cast does not saturate, and rounding x*scale can step past the limit.
    quantized = (x.detach().float() * scale).clamp(-limit, limit).to(dtype)
    return quantized, scale.reciprocal()


def dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (quantized.float() * scale_inv).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in E4M3 with its per-tensor scale: (values row-major, fp32 inverse scale). Every quantisation of a
    weight goes through here (the tests count them)."""
    return quantize(weight, E4M3)


def weight_copies(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 values row-major, the same values column-major, fp32 inverse scale) of a weight."""
    values, scale_inv = quantize_weight(weight)
    return values, _column_major(values), scale_inv


class WeightCast:
    """One layer's FP8 copies of its weight, made once per optimizer step and read by every forward and backward of
    that step: E4M3 values row-major (W^T of the forward GEMM is then column-major, as _scaled_mm wants its second
    operand) and column-major (W of the input-gradient GEMM), and the fp32 inverse scale.

    The trainer refreshes them after every change to the weights (Kernels.weights_updated: the optimizer's step,
    a checkpoint's load), outside any compiled graph; a torch.compile'd block reads them as inputs like any
    buffer, with no Python state to guard on and no graph break. Without copies (a model built outside the
    trainer; ZeRO-3, whose weights are whole only while their block computes; `enabled` False, the reference the
    tests compare against) the layer quantises the weight in each forward and again in its backward.
    """

    def __init__(self) -> None:
        self.enabled = True
        """False quantises on every call (the reference the cached path is tested against)."""
        self.copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def refresh(self, weight: torch.Tensor) -> None:
        """Quantise `weight` into the copies (in place after the first time, so a compiled graph keeps them)."""
        if not self.enabled:
            self.copies = None
            return
        with torch.no_grad():
            fresh = weight_copies(weight)
            if self.copies is None or self.copies[0].shape != fresh[0].shape:
                self.copies = fresh
            else:
                for kept, new in zip(self.copies, fresh, strict=True):
                    kept.copy_(new)

    def get(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This step's copies, or None: the layer then quantises the weight itself."""
        return self.copies if self.enabled else None


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T with x [M, in] and W [out, in]; forward, dgrad and wgrad GEMMs all in FP8. The weight comes
    quantised (w_q row-major, w_q_col the same column-major, w_inv: WeightCast's) or, all three None, is quantised
    here in forward and again in backward: the weight itself is kept for backward, not a copy of it (under ZeRO-3
    it is gathered again for backward anyway). Its gradient flows to `weight`."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        w_q: torch.Tensor | None,
        w_q_col: torch.Tensor | None,
        w_inv: torch.Tensor | None,
    ) -> torch.Tensor:
        x_q, x_inv = quantize(x, E4M3)
        ctx.cached = w_q is not None
        if ctx.cached:
            ctx.save_for_backward(x_q, x_inv, w_q_col, w_inv)
        else:
            w_q, w_inv = quantize_weight(weight)
            ctx.save_for_backward(x_q, x_inv, weight)
        ctx.dtypes = (x.dtype, weight.dtype)
        # Fast accumulation keeps the tensor cores' partial sums in their own narrower accumulator instead of
        # promoting them to fp32 every few blocks of K: faster, and the forward tolerates it. The backward GEMMs
        # do not use it (as in Transformer Engine, split accumulator for dgrad/wgrad, and Megatron): E5M2
        # gradients are coarser, and wgrad sums over every token of the micro-batch, where the error grows.
        # W^T of a row-major W is already column-major.
        return torch._scaled_mm(x_q, w_q.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x_dtype, w_dtype = ctx.dtypes
        g_q, g_inv = quantize(grad_out.contiguous(), E5M2)
        grad_x = grad_w = None
        # Only the gradients asked for: a frozen weight (a LoRA base) needs no weight-gradient GEMM.
        if ctx.needs_input_grad[0]:
            if ctx.cached:
                w_q_col, w_inv = ctx.saved_tensors[2:]
            else:
                w_q, w_inv = quantize_weight(ctx.saved_tensors[2])
                w_q_col = _column_major(w_q)
            grad_x = torch._scaled_mm(g_q, w_q_col, scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            x_q, x_inv = ctx.saved_tensors[:2]
            grad_w = torch._scaled_mm(
                g_q.t().contiguous(), _column_major(x_q), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype
            )
        return grad_x, grad_w, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """F.linear with FP8 GEMMs; x [..., in] (cast to the weight's dtype), weight [out, in]. `weight_fp8` is the
    weight already quantised (WeightCast.get), else it is quantised here, forward and backward."""
    leading = x.shape[:-1]
    w_q, w_q_col, w_inv = weight_fp8 if weight_fp8 is not None else (None, None, None)
    y = _Fp8Matmul.apply(x.to(weight.dtype).reshape(-1, x.shape[-1]), weight, w_q, w_q_col, w_inv)
    y = y.reshape(*leading, weight.shape[0])
    return y if bias is None else y + bias


class _Fp8Linear:
    """What both FP8 layers add to their parallel layer: the weight's per-step FP8 copy."""

    weight: torch.nn.Parameter
    fuses_weight_grad = False  # its weight gradient comes from an FP8 GEMM, which cannot accumulate into fp32

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_cast = WeightCast()

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, self.weight, bias, self.weight_cast.get())

    def cast_weight(self) -> torch.Tensor:
        """The weight its WeightCast quantises."""
        return self.weight


class Fp8OutputLayer(torch.nn.Module):
    """The output layer's GEMMs in FP8 (train.fp8_output_layer): logits = x W^T for the vocabulary-parallel weight
    the model owns (its own output weight, or the tied embedding's), whose per-step copies live here.
    `weight_of` returns that weight (GPTModel.logits_weight): a function, so the parameter stays registered where
    it is."""

    def __init__(self, weight_of: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.weight_cast = WeightCast()
        self.weight_of = weight_of

    def cast_weight(self) -> torch.Tensor:
        return self.weight_of()

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, weight, None, self.weight_cast.get())


def _fp8_layers(modules: list[torch.nn.Module]) -> list[_Fp8Linear | Fp8OutputLayer]:
    return [m for module in modules for m in module.modules() if isinstance(m, (_Fp8Linear, Fp8OutputLayer))]


def weight_casts(modules: list[torch.nn.Module]) -> list[WeightCast]:
    """The WeightCast of every FP8 layer in `modules` (model chunks)."""
    return [layer.weight_cast for layer in _fp8_layers(modules)]


def refresh_weight_casts(modules: list[torch.nn.Module]) -> None:
    """Quantise every FP8 layer's weight of `modules` (model chunks) into its copies: after each change."""
    for layer in _fp8_layers(modules):
        layer.weight_cast.refresh(layer.cast_weight())


class Fp8ColumnParallelLinear(_Fp8Linear, ColumnParallelLinear):
    """ColumnParallelLinear (same parameters, same collectives) whose GEMMs run in FP8."""


class Fp8RowParallelLinear(_Fp8Linear, RowParallelLinear):
    """RowParallelLinear (same parameters, same collectives) whose GEMMs run in FP8."""
