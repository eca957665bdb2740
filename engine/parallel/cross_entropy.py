"""Cross entropy over vocabulary-parallel logits, in chunks of tokens, without fp32 copies of the whole logits.

Each TP rank holds the logits of its slice of the padded vocabulary. The row max, the sum of exponentials
and the target logit are combined across the TP group (Megatron's recipe). Padded vocabulary entries are
masked to -inf, so they take no part in the softmax and get zero gradient.

The logits come out of the output GEMM in the compute dtype ([tokens, V/tp], the largest activation of a
Llama step). Upcasting them whole and saving the fp32 softmax for backward, as the textbook recipe does,
adds 4 + 4 bytes per logit. Here the forward reads them twice, a chunk of tokens at a time: once for three
numbers per token (local max, sum of exponentials, target logit), then, once those are reduced over TP, to
write softmax - one-hot into the logits' own storage; backward only scales that in place by each token's
loss gradient. So the logits are consumed (they hold their gradient after the forward, which is also what
makes the backward one multiply), no tensor of their size is added, and the per-chunk results are joined by
one concatenation instead of a copy per chunk. Under model.compile each chunk's work is one kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.engine.parallel import mappings

# Logits per chunk: 2**24 fp32 values are 64 MiB, small beside a step's activations and large enough that the
# per-chunk kernel launches do not show (a 128k-vocabulary slice gives 128 tokens per chunk).
CHUNK_ELEMENTS = 1 << 24


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


def chunk_statistics(
    chunk: torch.Tensor, target: torch.Tensor, padded_from: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of a chunk [tokens, V/tp]: local max, sum of exp(x - max), logit at the (local) target."""
    chunk = _masked(chunk, padded_from)
    # finite even where this rank holds only padding (all -inf), so that exp(x - max) is 0, not NaN
    row_max = chunk.max(dim=-1).values.clamp_min(torch.finfo(torch.float32).min)
    sum_exp = (chunk - row_max[:, None]).exp_().sum(dim=-1)
    return row_max, sum_exp, chunk.gather(-1, target[:, None]).squeeze(-1)


def write_chunk_gradient(
    chunk: torch.Tensor, target: torch.Tensor, inside: torch.Tensor, log_normaliser: torch.Tensor, padded_from: int
) -> None:
    """Overwrite a chunk of logits with d loss / d logits for a loss gradient of 1: softmax - one-hot of the target
    where this rank holds it (padding gets exactly 0)."""
    softmax = _masked(chunk, padded_from).sub_(log_normaliser[:, None]).exp_()  # in place: the chunk is consumed
    chunk.copy_(softmax.scatter_add_(-1, target[:, None], -inside[:, None]))


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
        # The logits' own storage (a copy only if they were not contiguous): it receives their gradient below.
        flat = logits.detach().reshape(-1, local_vocab)
        padded_from = vocab_size - vocab_start
        local_target = target.reshape(-1) - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        chunks = _chunks(flat.shape[0], local_vocab, chunk_elements)
        statistics = _kernel(chunk_statistics, compiled)
        parts = [statistics(flat[rows], local_target[rows], padded_from) for rows in chunks]
        row_max, sum_exp, target_logit = (torch.cat(part) for part in zip(*parts, strict=True))
        # Each rank summed exp(x - its own max); rescale to the global max before adding the ranks' sums.
        global_max = row_max.clone()
        _all_reduce(global_max, group, op=dist.ReduceOp.MAX)
        sum_exp.mul_((row_max - global_max).exp_())
        target_logit = target_logit.masked_fill_(outside, 0.0)
        _all_reduce(sum_exp, group)
        _all_reduce(target_logit, group)
        log_normaliser = global_max + sum_exp.log()
        if ctx.needs_input_grad[0]:
            gradient = _kernel(write_chunk_gradient, compiled)
            inside = (~outside).float()
            for rows in chunks:
                gradient(flat[rows], local_target[rows], inside[rows], log_normaliser[rows], padded_from)
            ctx.save_for_backward(flat)
            ctx.shape, ctx.chunks = logits.shape, chunks
        return (log_normaliser - target_logit).view_as(target)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        scale = grad_loss.reshape(-1, 1)
        for rows in ctx.chunks:  # each token's softmax - one-hot times its loss gradient, rounded once
            grad[rows] = grad[rows].float().mul_(scale[rows])
        return grad.view(ctx.shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp_group,
    chunk_elements: int = CHUNK_ELEMENTS,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-token loss (fp32, shape of target) from this rank's logits slice [..., V/tp]. Where a gradient is needed
    the logits are consumed: their storage holds the gradient after the forward (module docstring).

    `vocab_start` is the global id of this rank's first logit; ids >= vocab_size are padding. With one rank
    the all-reduces are skipped (a group of one); the chunking is the same. `compiled` runs each chunk's
    element-wise work as torch.compile'd kernels (model.compile).
    """
    group = tp_group if mappings.group_size(tp_group) > 1 else None
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, chunk_elements, compiled)
