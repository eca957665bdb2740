"""Cross entropy over vocabulary-parallel logits, in chunks of tokens, without fp32 copies of the whole logits.

Each TP rank holds the logits of its slice of the padded vocabulary. The row max, the sum of exponentials
and the target logit are combined across the TP group (Megatron's recipe). Padded vocabulary entries are
masked to -inf, so they take no part in the softmax and get zero gradient.

The logits come out of the output GEMM in the compute dtype ([tokens, V/tp], the largest activation of a
Llama step). Upcasting them whole and saving the fp32 softmax for backward, as the textbook recipe does,
adds 4 + 4 bytes per logit; here each chunk of tokens is upcast, reduced to three numbers per token (local
max, sum of exponentials, target logit) and dropped, and backward recomputes the softmax chunk by chunk from
the saved logits and those per-token statistics. Extra memory is one fp32 chunk instead of two fp32 copies.
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
    sum_exp = (chunk - row_max[:, None]).exp().sum(dim=-1)
    return row_max, sum_exp, chunk.gather(-1, target[:, None]).squeeze(-1)


def chunk_gradient(
    chunk: torch.Tensor,
    target: torch.Tensor,
    inside: torch.Tensor,
    log_normaliser: torch.Tensor,
    grad_loss: torch.Tensor,
    padded_from: int,
) -> torch.Tensor:
    """d loss / d logits of a chunk: (softmax - one-hot of the target where this rank holds it) * grad_loss."""
    softmax = (_masked(chunk, padded_from) - log_normaliser[:, None]).exp()
    softmax = softmax.scatter_add(-1, target[:, None], -inside[:, None])
    return (softmax * grad_loss[:, None]).to(chunk.dtype)


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
        flat, flat_target = logits.reshape(-1, local_vocab), target.reshape(-1)
        padded_from = vocab_size - vocab_start
        local_target = flat_target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        tokens = flat.shape[0]
        row_max = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        target_logit = torch.empty_like(row_max)
        statistics = _kernel(chunk_statistics, compiled)
        for rows in _chunks(tokens, local_vocab, chunk_elements):
            row_max[rows], sum_exp[rows], target_logit[rows] = statistics(flat[rows], local_target[rows], padded_from)
        # Each rank summed exp(x - its own max); rescale to the global max before adding the ranks' sums.
        global_max = row_max.clone()
        _all_reduce(global_max, group, op=dist.ReduceOp.MAX)
        sum_exp.mul_((row_max - global_max).exp_())
        target_logit = target_logit.masked_fill_(outside, 0.0)
        _all_reduce(sum_exp, group)
        _all_reduce(target_logit, group)
        log_normaliser = global_max + sum_exp.log()
        ctx.save_for_backward(logits, local_target, outside, log_normaliser)
        ctx.padded_from, ctx.chunk_elements, ctx.compiled = padded_from, chunk_elements, compiled
        return (log_normaliser - target_logit).view_as(target)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, outside, log_normaliser = ctx.saved_tensors
        local_vocab = logits.shape[-1]
        flat, flat_grad_loss = logits.reshape(-1, local_vocab), grad_loss.reshape(-1)
        grad = torch.empty_like(flat)
        inside = (~outside).float()
        gradient = _kernel(chunk_gradient, ctx.compiled)
        for rows in _chunks(flat.shape[0], local_vocab, ctx.chunk_elements):
            grad[rows] = gradient(
                flat[rows],
                local_target[rows],
                inside[rows],
                log_normaliser[rows],
                flat_grad_loss[rows],
                ctx.padded_from,
            )
        return grad.view_as(logits), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp_group,
    chunk_elements: int = CHUNK_ELEMENTS,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-token loss (fp32, shape of target) from this rank's logits slice [..., V/tp].

    `vocab_start` is the global id of this rank's first logit; ids >= vocab_size are padding. With one rank
    the all-reduces are skipped (a group of one); the chunking is the same. `compiled` runs each chunk's
    element-wise work as torch.compile'd kernels (model.compile).
    """
    group = tp_group if mappings.group_size(tp_group) > 1 else None
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, chunk_elements, compiled)
