"""FP8 linear layers on torch._scaled_mm with per-tensor current scaling, for GPUs without Transformer Engine.

All three GEMMs of a linear layer take FP8 operands: activations and weights in E4M3 (more
mantissa), output gradients in E5M2 (more range) -- the "hybrid" format of Micikevicius et al.
2022 ("FP8 Formats for Deep Learning") and of Transformer Engine's Format.HYBRID. Each operand is
scaled by its own absolute maximum just before the cast ("current scaling"), so there is no amax
history and no state: a recomputed forward gives the same result. Weights stay in their training
dtype (bf16, fp32 masters in the optimizer); only the GEMM inputs are quantised, and the forward
keeps the FP8 copies of x and W for the backward (half the bytes of bf16).

torch._scaled_mm wants the second operand column-major and every size divisible by 16; kernels.py
checks the sizes before choosing this path. It runs on CUDA devices of compute capability >= 8.9,
and (slowly) on CPU, which is how the tests check the arithmetic. Only kernels.py decides to use it.
"""

from __future__ import annotations

import torch

from loom.engine.parallel import mappings
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


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T with x [M, in] and W [out, in]; forward, dgrad and wgrad GEMMs all in FP8."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x_q, x_inv = quantize(x, E4M3)
        w_q, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(x_q, x_inv, w_q, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype)
        # W^T of a row-major W is already column-major.
        return torch._scaled_mm(x_q, w_q.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_q, g_inv = quantize(grad_out.contiguous(), E5M2)
        grad_x = torch._scaled_mm(g_q, _column_major(w_q), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        grad_w = torch._scaled_mm(
            g_q.t().contiguous(), _column_major(x_q), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype
        )
        return grad_x, grad_w


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with FP8 GEMMs; x [..., in] (cast to the weight's dtype), weight [out, in]."""
    leading = x.shape[:-1]
    y = _Fp8Matmul.apply(x.to(weight.dtype).reshape(-1, x.shape[-1]), weight)
    y = y.reshape(*leading, weight.shape[0])
    return y if bias is None else y + bias


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear (same parameters, same collectives) whose GEMMs run in FP8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_region(x, self.tp_group)
        y = fp8_linear(x, self.weight, self.bias)
        return mappings.gather_from_tensor_region(y, self.tp_group) if self.gather_output else y


class Fp8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear (same parameters, same collectives) whose GEMMs run in FP8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias
