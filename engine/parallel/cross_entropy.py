"""Cross entropy over vocabulary-parallel logits, in chunks of tokens, without fp32 copies of the whole logits.

Each TP rank holds the logits of its slice of the padded vocabulary. The row max, the sum of exponentials
and the target logit are combined across the TP group (Megatron's recipe). Padded vocabulary entries are
masked to -inf, so they take no part in the softmax and get zero gradient.

The logits come out of the output GEMM in the compute dtype ([tokens, V/tp], the largest activation of a
Llama step). Upcasting them whole and saving the fp32 softmax for backward, as the textbook recipe does,
adds 4 + 4 bytes per logit. Here each pass reads a chunk of tokens at a time, and there is one pass each
way. The forward reads a chunk once: the local max m, the exponentials exp(x - m), which it writes over the
logits (they are consumed), their sum and the target logit. Once those are reduced over TP, each token's
softmax is exp(x - m) * exp(m - M) / S, so the backward reads the chunk once more and writes the gradient in
place: the exponentials times g exp(m - M) / S, and at the target g (p - 1), taken in fp32 from the reduced
statistics rather than from the rounded exponential (p near 1 would cancel). No tensor of the logits' size
is added; per-chunk statistics are joined by one concatenation; under model.compile each pass is one kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.engine.parallel import mappings

# Logits per chunk, eager: each pass upcasts its chunk, and 2**24 fp32 values are 64 MiB, small beside a step's
# activations and large enough that the per-chunk kernel launches do not show on CPU (128 tokens of a 128k
# vocabulary). Compiled, each pass is one streaming kernel that keeps no fp32 copy of its chunk (the backward
# writes in place, the forward keeps per-token statistics only), so chunks are 8x larger: the H200 profile of
# llama-1b (2026-11-26) spent 27 ms per step in 500 small loss kernels, 3x their bytes' time, plus their launch
# gaps. Not larger: a compiler failure runs the same chunks eagerly (model.compile's fallback).
CHUNK_ELEMENTS = 1 << 24
COMPILED_CHUNK_ELEMENTS = 1 << 27


def _chunks(tokens: int, local_vocab: int, chunk_elements: int) -> list[slice]:
    step = max(1, chunk_elements // max(local_vocab, 1))
    return [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:  # None: one rank holds the whole vocabulary
        dist.all_reduce(tensor, op=op, group=group)


def _masked(chunk: torch.Tensor, padded_from: int) -> torch.Tensor:
    """fp32 logits with this rank's padded vocabulary entries at -inf."""
    chunk = chunk.float()
    if padded_from < chunk.shape[-1]:
        chunk[:, max(padded_from, 0) :] = float("-inf")
    return chunk


def exponentiate_chunk(
    chunk: torch.Tensor, target: torch.Tensor, padded_from: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Overwrite a chunk of logits [tokens, V/tp] with exp(x - m) (padding 0); per token, the local max m, the sum
    of the exponentials and the logit at the (local) target."""
    logits = _masked(chunk, padded_from)
    target_logit = logits.gather(-1, target[:, None]).squeeze(-1)
    # finite even where this rank holds only padding (all -inf), so that exp(x - max) is 0, not NaN
    row_max = logits.max(dim=-1).values.clamp_min(torch.finfo(torch.float32).min)
    exponentials = (logits - row_max[:, None]).exp_()
    chunk.copy_(exponentials)
    return row_max, exponentials.sum(dim=-1), target_logit


def chunk_gradient(
    chunk: torch.Tensor,
    target: torch.Tensor,
    row_scale: torch.Tensor,
    target_gradient: torch.Tensor,
    outside: torch.Tensor,
) -> None:
    """Overwrite a chunk of exponentials with d loss / d logits: each row times its scale, and at the target
    (where this rank holds it) the exact target gradient. One element-wise expression (a column index compared
    with the target, not a scatter), so that compiled it is one streaming kernel with no fp32 copy of the chunk."""
    columns = torch.arange(chunk.shape[-1], device=chunk.device)
    at_target = (columns[None, :] == target[:, None]) & ~outside[:, None]
    chunk.copy_(torch.where(at_target, target_gradient[:, None], chunk.float() * row_scale[:, None]))


_COMPILED: dict[str, object] = {}


def _kernel(function, compiled: bool):
    """`function`, or its torch.compile'd form (model.compile): the chunk's element-wise work in one kernel.
    dynamic: the last chunk of a micro-batch is shorter."""
    if not compiled:
        return function
    if function.__name__ not in _COMPILED:
        _COMPILED[function.__name__] = torch.compile(function, dynamic=True)
    return _COMPILED[function.__name__]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, chunk_elements, compiled):
        local_vocab = logits.shape[-1]
        # The logits' own storage (a copy only if they were not contiguous): it receives the exponentials.
        flat = logits.detach().reshape(-1, local_vocab)
        padded_from = vocab_size - vocab_start
        local_target = target.reshape(-1) - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        chunks = _chunks(flat.shape[0], local_vocab, chunk_elements)
        exponentiate = _kernel(exponentiate_chunk, compiled)
        parts = [exponentiate(flat[rows], local_target[rows], padded_from) for rows in chunks]
        row_max, sum_exp, target_logit = (torch.cat(part) for part in zip(*parts, strict=True))
        # Each rank summed exp(x - its own max); rescale to the global max before adding the ranks' sums.
        global_max = row_max.clone()
        _all_reduce(global_max, group, op=dist.ReduceOp.MAX)
        local_to_global = (row_max - global_max).exp_()
        sum_exp = sum_exp * local_to_global
        target_logit = target_logit.masked_fill_(outside, 0.0)
        _all_reduce(sum_exp, group)
        _all_reduce(target_logit, group)
        log_normaliser = global_max + sum_exp.log()
        loss = log_normaliser - target_logit
        ctx.save_for_backward(flat, local_target, outside, local_to_global / sum_exp, loss)
        ctx.shape, ctx.chunks, ctx.compiled = logits.shape, chunks, compiled
        return loss.view_as(target)

    @staticmethod
    def backward(ctx, grad_loss):
        flat, local_target, outside, softmax_scale, loss = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1).float()
        # softmax_t - 1 = exp(-loss) - 1, in fp32 and without cancellation (expm1), where this rank holds the target
        target_gradient = grad_loss * torch.expm1(-loss)
        row_scale = grad_loss * softmax_scale
        gradient = _kernel(chunk_gradient, ctx.compiled)
        for rows in ctx.chunks:
            gradient(flat[rows], local_target[rows], row_scale[rows], target_gradient[rows], outside[rows])
        return flat.view(ctx.shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp_group,
    chunk_elements: int | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-token loss (fp32, shape of target) from this rank's logits slice [..., V/tp]. The logits are consumed:
    their storage holds the exponentials after the forward and the gradient after the backward (module docstring).

    `vocab_start` is the global id of this rank's first logit; ids >= vocab_size are padding. With one rank
    the all-reduces are skipped (a group of one); the chunking is the same. `compiled` runs each chunk's
    element-wise work as torch.compile'd kernels (model.compile); `chunk_elements` defaults by that choice.
    """
    group = tp_group if mappings.group_size(tp_group) > 1 else None
    chunk_elements = chunk_elements or (COMPILED_CHUNK_ELEMENTS if compiled else CHUNK_ELEMENTS)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, chunk_elements, compiled)
