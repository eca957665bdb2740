"""Context parallelism's attention: causal attention over a sequence split across a CP group, keys and values
passed around a ring.

The layout balances the causal mask's work (Megatron's): the sequence is cut into 2N chunks for a group of N,
and CP rank r holds chunks r and 2N-1-r, one after the other (`local_positions`). Every rank then has the same
share of the triangle to compute. Attention runs in N steps: at step i rank r holds the keys and values of rank
j = r - i (mod N) and computes its queries against them, while the next block travels (one send to rank r + 1,
one receive from r - 1, started before the computation). Which parts of the two blocks meet is fixed by the
chunk order:
- i = 0 (its own block): causal attention over its 2 chunks in their order;
- j < r: both query chunks see all of j's first chunk (earlier than both) and none of its second (later);
- j > r: only the second query chunk sees anything, all of both of j's chunks.
Each step yields a partial output and its log-sum-exp per query; partials merge exactly (the online softmax).
The backward runs the same ring: each step's block gradient comes from the final output and log-sum-exp (as
flash attention's backward does), and the keys' and values' gradients travel with their block, arriving back
at their owner after the last step. Grouped-query attention sends only the KV heads.

The block products are torch's flash attention kernels that return the log-sum-exp (`block_attention`: the CPU
kernel in fp32 and bf16, CUDA's in bf16 and fp16), no scores materialised; elsewhere (fp32 on CUDA) exact fp32
matrix products. The CPU tests compare the ring with full attention; tests/test_gpu.py the CUDA kernels' calls
with SDPA.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def local_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens CP rank `cp_rank` holds: chunks r and 2N-1-r of 2N."""
    if seq_length % (2 * cp):
        raise ValueError(f"a sequence of {seq_length} tokens does not split into 2 x cp = {2 * cp} chunks")
    chunk = seq_length // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor along `dim` (its two chunks, in order)."""
    index = local_positions(x.shape[dim], cp, cp_rank).to(x.device)
    return x.index_select(dim, index)


def _ring_peers(group) -> tuple[int, int]:
    """Global ranks of the next and the previous member of the ring."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def _exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank and receiving the previous rank's tensor of the same shape."""
    following, preceding = _ring_peers(group)
    received = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, following, group), dist.P2POp(dist.irecv, received, preceding, group)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _blocks(step_source: int, cp_rank: int, local: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of step whose keys came from CP rank `step_source` (module docstring)."""
    half = local // 2
    if step_source == cp_rank:
        return slice(0, local), slice(0, local), True
    if step_source < cp_rank:
        return slice(0, local), slice(0, half), False
    return slice(half, local), slice(0, local), False


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, heads, s, d]: each KV head serves `groups` query heads."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _flash_kernels(q: torch.Tensor) -> str:
    """Which block products run: torch's flash attention ops that return the log-sum-exp (on CPU in fp32 and
    bf16; on CUDA in bf16 and fp16, which its flash kernel takes), else exact fp32 matrix products."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
        return "cuda"
    return "matmul"


def block_attention(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in fp32, log-sum-exp in fp32) of q [b, h, sq, d] against k, v [b, h, sk, d] (causal: square)."""
    kind = _flash_kernels(q)
    q, k, v = (t.contiguous() for t in (q, k, v))
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse
    if kind == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out.float(), lse
    scores = _scores(q.float(), k.float(), scale, causal)
    lse = scores.logsumexp(-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()), lse


def block_attention_backward(dout, q, k, v, out, lse, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 of one block, from the *whole* attention's output and log-sum-exp at these queries:
    then the block's softmax is exp(scores - lse) and D = rowsum(dout * out), as flash attention's backward
    computes them, and the blocks' gradients add up to the whole's."""
    kind = _flash_kernels(q)
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout.to(q.dtype), q, k, v, out, lse))
    if kind == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return tuple(g.float() for g in grads)
    if kind == "cuda":
        b, h, sq, _ = q.shape
        seed = offset = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout
        # No cumulative lengths (None, as the forward returns them): a defined one, even empty, selects the
        # variable-length kernel ("batch size must be positive", seen on an H200).
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, k.shape[2], 0.0, causal, seed, offset, scale=scale
        )
        return tuple(g.float() for g in grads)
    qf, kf, vf, doutf = q.float(), k.float(), v.float(), dout.float()
    probabilities = torch.exp(_scores(qf, kf, scale, causal) - lse[..., None])
    delta = (doutf * out.float()).sum(-1)
    d_scores = probabilities * (torch.matmul(doutf, vf.transpose(-1, -2)) - delta[..., None])
    return (
        torch.matmul(d_scores, kf) * scale,
        torch.matmul(d_scores.transpose(-1, -2), qf) * scale,
        torch.matmul(probabilities.transpose(-1, -2), doutf),
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        """q [b, h, s, d], k and v [b, h_kv, s, d] (this rank's two chunks): the causal attention output
        [b, h, s, d] in q's dtype."""
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        local = q.shape[2]
        # q's strides (the model's [s, b, heads, d] order): the output then reshapes back without a copy
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            pending = _exchange(kv, group) if step < cp - 1 else None
            rows, cols, causal = _blocks((cp_rank - step) % cp, cp_rank, local)
            keys, values = (_expand(t[:, :, cols], groups) for t in kv)
            block_out, block_lse = block_attention(q[:, :, rows], keys, values, scale, causal)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (
                out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                + block_out * torch.exp(block_lse - merged)[..., None]
            )
            lse[:, :, rows] = merged
            if pending is not None:
                kv, requests = pending
                _wait(requests)
        result = out.to(q.dtype)
        # the output as returned (in the compute dtype, as flash attention keeps it) and the log-sum-exp in fp32
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.scale = group, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        local = q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp):
            pending = _exchange(kv, group) if step < cp - 1 else None
            rows, cols, causal = _blocks((cp_rank - step) % cp, cp_rank, local)
            keys, values = (_expand(t[:, :, cols], groups) for t in kv)
            d_queries, d_keys, d_values = block_attention_backward(
                grad_out[:, :, rows], q[:, :, rows], keys, values, out[:, :, rows], lse[:, :, rows], scale, causal
            )
            dq[:, :, rows] += d_queries
            for index, grad in ((0, d_keys), (1, d_values)):
                if groups > 1:
                    b, _, s, d = grad.shape
                    grad = grad.view(b, -1, groups, s, d).sum(2)
                dkv[index][:, :, cols] += grad
            # The block's gradient travels on with it; after the last step it goes home (one more hop).
            dkv, dkv_requests = _exchange(dkv, group) if cp > 1 else (dkv, [])
            _wait(dkv_requests)
            if pending is not None:
                kv, requests = pending
                _wait(requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


@torch.compiler.disable  # a compiled block runs the ring eagerly between its two graphs: its point-to-point
# sends inside an autograd.Function are not something dynamo traces, so the break is made here, on purpose
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (module docstring). q [b, h, s, d],
    k and v [b, h_kv, s, d], s this rank's two chunks; `scale` on the scores, 1 / sqrt(d) by default."""
    return _RingAttention.apply(q, k, v, group, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
