"""Cross entropy over vocabulary-parallel logits, without ever materialising the full logits.

Each TP rank holds the logits of its slice of the padded vocabulary. The row max, the sum of
exponentials and the target logit are combined across the TP group (Megatron's recipe). Padded
vocabulary entries are masked to -inf, so they take no part in the softmax and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.engine.parallel import mappings


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        padded_from = vocab_size - vocab_start
        if padded_from < local_vocab:
            logits = logits.clone()
            logits[..., max(padded_from, 0) :] = float("-inf")
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(target_logit, group=group)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int, tp_group
) -> torch.Tensor:
    """Per-token loss (fp32, shape of target) from this rank's logits slice [..., V/tp].

    `vocab_start` is the global id of this rank's first logit; ids >= vocab_size are padding.
    """
    if mappings.group_size(tp_group) == 1:
        # One rank holds the whole vocabulary: PyTorch's fused kernel is faster and equal.
        real = logits[..., :vocab_size].float()
        return F.cross_entropy(real.reshape(-1, vocab_size), target.reshape(-1), reduction="none").view_as(target)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, tp_group)
