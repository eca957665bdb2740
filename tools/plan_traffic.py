"""The bytes a step of a layout sends, by process group, operation and dtype, exactly as loom's communication
ledger records them (engine/comm_ledger.py).

tools/plan_time.py times each kind of traffic from its own closed form (a ring's volume per layer, the ZeRO
stage's collectives); `step_traffic` spells out every transfer of a step instead, so that
tests/test_plan_bytes.py can check the planner's picture of a step against the ledger of real multi-rank steps on
CPU. The context-parallel ring's count (`cp_ring_transfers`) is shared by both.
"""

from __future__ import annotations

import collections
import dataclasses

from loom.engine.config import LoomConfig, ModelConfig
from loom.engine.parallel.vocab import padded_vocab_size
from loom.tools.plan_bytes import (
    GRAD_BYTES,
    Layout,
    norm_reductions_per_layer,
    rank_buffers,
    rank_layers,
    rank_parameters,
    tp_collectives_per_layer,
)


def cp_ring_transfers(m: ModelConfig, lay: Layout, local: int) -> tuple[int, int, int]:
    """(sends of keys and values in the compute dtype, sends of their gradients in fp32, elements each) of one
    layer's ring for one micro-batch on one CP rank (engine/parallel/context.py): the keys and values of this TP
    rank's KV heads go round cp - 1 times in forward, again in backward and again when recompute reruns the
    attention; their gradients cp times (the last hop takes them home). Each send has its receive."""
    kv = 2 * local * lay.micro_batch_size * m.num_kv_heads * m.head_dim // lay.tp
    passes = 2 + (lay.recompute != "none")
    return passes * (lay.cp - 1), lay.cp, kv


_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def expert_dispatch_bytes(m: ModelConfig, lay: Layout, seq_length: int, element: int, dtype: str) -> dict[str, int]:
    """Bytes one rank sends through its EP group's all-to-alls for one expert block and micro-batch, by dtype
    (`dtype`: the compute dtype's name, `element` bytes), the load balanced (each rank computing as many rows as it
    sends; engine/model/moe.MoEMLP._experts_across_ranks): the counts per expert (int64), its rows of hidden states
    (one per token and choice, every token of the micro-batch's sequences, gathered under sequence parallelism: TP
    ranks send alike) to their experts, the experts' outputs back, and both rows' gradients in backward; full
    recompute sends the forward's again."""
    rows = seq_length // lay.cp * lay.micro_batch_size * m.moe_top_k * m.hidden_size * element
    forward = 1 + (lay.recompute == "full")
    return {"int64": 8 * m.num_experts * forward, dtype: rows * (2 * forward + 2)}


def step_traffic(config: LoomConfig, lay: Layout, pp_rank: int = 0) -> dict[tuple[str, str, str], int]:
    """Bytes one rank of pipeline rank `pp_rank` sends per step, by (group, op, dtype), counted as loom's
    communication ledger counts them (engine/comm_ledger.py: an all-gather's output, a reduce-scatter's input,
    else the tensor), all of it for AdamW and SGD: the data-parallel gradient and weight collectives of its ZeRO
    stage, tensor parallelism's all-reduces (sequence parallelism's all-gathers and reduce-scatters) and the
    vocabulary-parallel loss's statistics, the sequence-parallel and tied-embedding gradient sums, the pipeline's
    sends and receives, the loss and gradient-norm sums, and the experts' loads (model.moe_expert_bias)."""
    m, t = config.model, config.train
    element, dtype = (4 if t.precision == "fp32" else 2), _DTYPE_NAMES[t.precision]
    grad_bytes, grad_dtype = GRAD_BYTES[config.optim.grad_dtype], _DTYPE_NAMES[config.optim.grad_dtype]
    microbatches = t.global_batch_size // (lay.micro_batch_size * lay.dp)
    bucket_bytes = int(config.parallel.grad_bucket_mb * 2**20)
    stages = lay.pp * lay.vp
    chunks = [c * lay.pp + pp_rank for c in range(lay.vp)]
    traffic: dict[tuple[str, str, str], int] = collections.Counter()
    grad_group = "grad" if lay.cp > 1 else "dp"  # DP x CP (ParallelState.grad_group)
    for buffer in rank_buffers(m, lay, pp_rank, bucket_bytes, grad_bytes):  # the weights', the experts' (ep > 1)
        if buffer.replicas == 1:
            continue
        total, deferred, group = buffer.total, buffer.deferred, buffer.group
        if lay.zero == 0:
            traffic[(group, "all_reduce", grad_dtype)] += grad_bytes * total
        else:
            per_step = grad_bytes * ((total - deferred) * (microbatches if lay.zero >= 2 else 1) + deferred)
            traffic[(group, "reduce_scatter", grad_dtype)] += per_step
            # ZeRO-3 gathers the sharded buckets for every micro-batch's forward and again for its backward,
            # and the whole (deferred) ones once after the step as ZeRO 1 and 2 gather everything
            gathered = 2 * microbatches * (total - deferred) + deferred if lay.zero == 3 else total
            traffic[(group, "all_gather", dtype)] += element * gathered
    if lay.ep > 1:  # each expert block's rows to their experts' ranks and back
        blocks = sum(m.has_experts(layer) for layer in rank_layers(m.num_layers, lay, pp_rank))
        for sent_dtype, sent in expert_dispatch_bytes(m, lay, t.seq_length, element, dtype).items():
            traffic[("ep", "all_to_all", sent_dtype)] += microbatches * blocks * sent
    if lay.replicas > 1:
        traffic[(grad_group, "all_reduce", "float32")] += 4 * (1 + len(m.router_loss_metrics))  # the loss sums
        if m.moves_expert_biases:  # each block's loads per expert, once a step (moe.update_expert_biases)
            biased = sum(m.has_experts(layer) for layer in rank_layers(m.num_layers, lay, pp_rank))
            traffic[(grad_group, "all_reduce", "int64")] += 8 * m.num_experts * biased
    local = t.seq_length // lay.cp
    tokens = local * lay.micro_batch_size
    if lay.cp > 1:
        layers = m.num_layers // stages * lay.vp
        kv_sends, grad_sends, elements = cp_ring_transfers(m, lay, local)
        for op in ("send", "recv"):
            traffic[("cp", op, dtype)] += microbatches * layers * kv_sends * elements * element
            traffic[("cp", op, "float32")] += microbatches * layers * grad_sends * elements * 4
    activation = tokens * m.hidden_size * element
    if lay.tp > 1:
        layers = m.num_layers // stages * lay.vp
        # per micro-batch: the layers', and one each way at the embedding and the output layer
        ends = sum((stage == 0) + (stage == stages - 1) for stage in chunks)
        for op, count in tp_collectives_per_layer(m, lay).items():
            traffic[("tp", op, dtype)] += microbatches * (count * layers + ends) * activation
        if stages - 1 in chunks:  # the loss's max, sum of exponentials and target logit per token, in fp32
            traffic[("tp", "all_reduce", "float32")] += microbatches * 3 * tokens * 4
        if reductions := norm_reductions_per_layer(m, lay):  # query/key norms across heads: sums of squares
            traffic[("tp", "all_reduce", "float32")] += microbatches * reductions * layers * tokens * 4
        # the partial gradients, summed over TP once per step: sequence parallelism's norms (and biases), and
        # per-head query/key norms, whose weights every rank's heads share
        params = rank_parameters(m, dataclasses.replace(lay, micro_batch_size=1), pp_rank)
        if partial := sum(q.size for q in params if q.deferred) - _tied_embedding_elements(m, lay, chunks):
            traffic[("tp", "all_reduce", grad_dtype)] += grad_bytes * partial
    if lay.pp > 1:
        hidden = activation // (lay.tp if lay.sp else 1)
        # per micro-batch each chunk receives its input and sends its output forward, and receives the output's
        # gradient and sends the input's back: one send and one receive per neighbouring stage
        transfers = sum((stage > 0) + (stage < stages - 1) for stage in chunks)
        for op in ("send", "recv"):
            traffic[("pp", op, dtype)] += microbatches * transfers * hidden
        traffic[("pp", "all_reduce", "float32")] += 4 * (1 + len(m.router_loss_metrics))  # the loss sums
        if tied := _tied_embedding_elements(m, lay, chunks):
            traffic[("embedding", "all_reduce", grad_dtype)] += grad_bytes * tied
    if lay.tp * lay.pp * lay.replicas > 1:
        traffic[("world", "all_reduce", "float32")] += 4  # the squared gradient norm
    return dict(traffic)


def _tied_embedding_elements(m: ModelConfig, lay: Layout, chunks: list[int]) -> int:
    """Elements of the tied embedding copies these chunks hold (summed over the pipeline's ends each step)."""
    if not m.tie_embeddings or lay.pp * lay.vp == 1:
        return 0
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, lay.tp) // lay.tp
    return vocab * m.hidden_size * sum(stage in (0, lay.pp * lay.vp - 1) for stage in chunks)
