"""Gradient-accumulation fusion (Megatron's): a linear layer's weight-gradient GEMM adds straight into the weight's
fp32 (or bf16) `main_grad` instead of writing a gradient that a hook then adds in, one pass per parameter per
micro-batch (optim.grad_accumulation_fusion).

The GradBuffer decides which weights fuse (those it keeps a `main_grad` view for, among `fusable_weights`) and marks
them with FUSED; a marked layer's backward calls `accumulate_weight_grad`, and autograd's gradient for the weight is
a placeholder (uninitialised, never read) so that its post-accumulate hook still fires and counts the parameter for
the bucket's reduction. The GEMM is a custom op that mutates `main_grad`, so torch.compile keeps a block that uses
it in one graph and calls it in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FUSED = "accumulates_into_main_grad"
"""The Parameter attribute (True) that says its layer's backward adds its gradient into `main_grad` itself."""

# addmm with out_dtype (bf16 operands, fp32 result and accumulator) exists for CUDA only (torch 2.13), and not in
# every torch loom installs beside: the first refusal turns it off for the process (tests/test_gpu.py checks it runs).
_MIXED_ADDMM = {"usable": hasattr(torch.ops.aten.addmm, "dtype_out")}


def _mixed_addmm(main_grad: torch.Tensor, grad_2d: torch.Tensor, x_2d: torch.Tensor) -> bool:
    """main_grad += grad_2d x_2d in one GEMM accumulating in main_grad's dtype; False if this torch cannot."""
    if not _MIXED_ADDMM["usable"]:
        return False
    try:
        torch.addmm(main_grad, grad_2d, x_2d, out_dtype=main_grad.dtype, out=main_grad)
    except (RuntimeError, NotImplementedError, TypeError):
        _MIXED_ADDMM["usable"] = False
        return False
    return True


@torch.library.custom_op("loom::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad += grad_out^T x over every token: grad_out [..., out], x [..., in], main_grad [out, in]."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).t()
    x_2d = x.reshape(-1, x.shape[-1])
    if main_grad.dtype == x.dtype:
        main_grad.addmm_(grad_2d, x_2d)
    elif not (main_grad.is_cuda and _mixed_addmm(main_grad, grad_2d, x_2d)):
        main_grad.add_(torch.mm(grad_2d, x_2d))  # what the unfused path adds: the product rounded to bf16


@accumulate_weight_grad.register_fake
def _(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x W^T + b whose backward adds dW into `main_grad` and hands autograd a placeholder for W's gradient."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, main_grad: torch.Tensor
    ) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the input as autocast hands it to the GEMM, kept for the weight's
            x = x.to(torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, weight)
        # Not saved: saved tensors are version-checked, and another micro-batch's backward (pipeline schedules keep
        # several in flight) may have added into main_grad before this one's runs.
        ctx.main_grad = main_grad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        accumulate_weight_grad(ctx.main_grad, grad_out, x)
        # Autograd takes this tensor as the weight's .grad without copying it; the GradBuffer's hook drops it.
        return grad_x, torch.empty_like(weight), grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with the weight's gradient added into `weight.main_grad` in backward when the weight is FUSED."""
    if getattr(weight, FUSED, False):
        return _LinearIntoMainGrad.apply(x, weight, bias, weight.main_grad)
    return F.linear(x, weight, bias)


def fusable_weights(modules: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The trainable weights of `modules`' layers whose forward goes through `linear` (loom's own column- and
    row-parallel linears; their FP8 versions compute the weight gradient in FP8 instead)."""
    return [
        m.weight
        for module in modules
        for m in module.modules()
        if getattr(type(m), "fuses_weight_grad", False) and m.weight.requires_grad
    ]
