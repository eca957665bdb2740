"""What a layout holds, exactly as loom lays it out: the memory half of `loom plan` (tools/plan_time.py turns
bytes and FLOPs into time; tools/plan.py assembles both and searches layouts).

- parameters, gradients and optimizer state from the parameters each rank holds: its TP shard of each of its
  chunks' weights (vocabulary padded to model.make_vocab_divisible_by x tp), replicated norms whole, the gradient
  buffer's buckets padded to multiples of dp (engine/optim/buckets.plan_buckets), and the ZeRO formulas of
  Rajbhandari et al. 2020: bf16 Adam keeps 2 B of weight, 4 B of fp32 gradient and 12 B of fp32 master and
  moments per parameter; ZeRO 1 divides the 12 by dp, ZeRO 2 the gradient too, ZeRO 3 the weight too (6 + 12/d,
  2 + 16/d, 18/d); optimizer offload moves the 12 to the host, beside a gradient copy.
- activations: what one micro-batch of one layer saves for backward (Korthikanti et al. 2022, section 4, term by
  term for loom's layers: grouped-query attention and SwiGLU change the 34 + 5as/h of the paper; sequence
  parallelism divides the norm inputs by tp; selective recompute keeps the attention's inputs and output but not
  its internals; full recompute only each layer's input; compiled blocks keep what inductor's partitioner
  keeps), times the micro-batches in flight on the rank (loom's schedule's warm-up: 1F1B min(pp - rank, m) ...),
  plus on the last rank the output layer's input and logits: tools/plan_activations.py.
The bytes a step sends are tools/plan_traffic.py's.

Each is checked against what loom allocates, saves and sends on CPU (tests/test_plan_bytes.py, docs/planner.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from dataclasses import dataclass

from loom.engine.config import LoomConfig, ModelConfig
from loom.engine.model import naming
from loom.engine.optim.buckets import plan_buckets, plan_buffer
from loom.engine.parallel.vocab import padded_vocab_size

# ---------------------------------------------------------------- the layout and the engine


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch_size: int
    recompute: str
    zero: int
    offload: str = "none"
    sequence_parallel: bool = True
    """With tp > 1 (Megatron's and loom's recommendation, so the search keeps it on)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (engine/parallel/context.py)."""
    ep: int = 1
    """Expert parallelism: each expert block's experts divided among ep DP ranks (parallel.ep)."""

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def replicas(self) -> int:
        """The ranks holding the same weights, over which gradients are summed and ZeRO shards: DP x CP."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """The ranks holding the same experts (the expert_grad group): DP / EP x CP."""
        return self.dp // self.ep * self.cp

    def describe(self) -> str:
        offload = " offload" if self.offload != "none" else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"tp={self.tp}{cp} pp={self.pp} vp={self.vp} dp={self.dp}{ep} mbs={self.micro_batch_size} "
            f"recompute={self.recompute} zero={self.zero}{offload}"
        )


@dataclass(frozen=True)
class Engine:
    """Implementation choices that change the numbers: loom's by default; Megatron-LM's for its published runs."""

    grad_reduce_bytes: int | None = None
    """Bytes per gradient element on the wire: None reduces the config's optim.grad_dtype, as loom does (fp32 by
    default); Megatron r0.8 reduces bf16."""
    gathered_inputs_saved: bool = True
    """Activations as loom's native block keeps them (tools/plan_activations.layer_activation_bytes); False:
    Korthikanti's count for Megatron-LM, whose GEMMs keep the sequence shard of their input and gather it again in
    backward."""
    recompute_stops_early: bool = True
    """Full recompute re-runs a layer's forward only up to the last tensor its backward needs (torch's
    non-reentrant checkpoint, loom), so the layer's closing reduction is not redone; False: all of it (Megatron)."""


LOOM = Engine()
MEGATRON = Engine(grad_reduce_bytes=2, gathered_inputs_saved=False, recompute_stops_early=False)


def tp_collectives_per_layer(m: ModelConfig, lay: Layout, engine: Engine = LOOM) -> dict[str, int]:
    """Tensor-parallel collectives of s x b x h activations one layer runs per micro-batch: 2 forward (after the
    attention projection and FC2) and their 2 gradients backward (Shoeybi et al. 2019), each an all-reduce or,
    under sequence parallelism, an all-gather and a reduce-scatter; full recompute runs the forward's again (loom:
    both all-gathers but only the first reduce-scatter or all-reduce, as the ledger records, unless FC2's output
    feeds a norm, model.norm_placement = output, whose backward needs it)."""
    again = lay.recompute == "full"
    closing = 0 if engine.recompute_stops_early and m.norm_placement == "input" else 1
    if lay.sp:
        return {"all_gather": 4 + 2 * again, "reduce_scatter": 4 + (1 + closing) * again}
    return {"all_reduce": 4 + (1 + closing) * again}


def norm_reductions_per_layer(m: ModelConfig, lay: Layout) -> int:
    """The fp32 all-reduces of one value per token a layer adds per micro-batch at tp > 1 under
    model.qk_norm_per_head = false: the query's and the key's sums of squares forward, their gradients backward,
    and the forward's again under full recompute."""
    if lay.tp == 1 or not m.qk_norm or m.qk_norm_per_head:
        return 0
    return 4 + 2 * (lay.recompute == "full")


def layout_of(config: LoomConfig) -> Layout:
    """The Layout a resolved config trains with."""
    p, o = config.parallel, config.optim
    return Layout(
        p.tp, p.pp, p.vp, p.dp, config.train.micro_batch_size, config.model.recompute, o.zero, o.offload,
        p.sequence_parallel, p.cp, p.ep,
    )  # fmt: skip


# ---------------------------------------------------------------- parameters, as loom lays them out


@dataclass(frozen=True)
class _Param:
    """A stand-in parameter for plan_buckets: its local element count."""

    size: int
    deferred: bool = False
    unit: int | str = ""
    """ZeRO-3's gather unit (naming.gather_unit): the block's index, or before / after the blocks."""
    shape: tuple[int, ...] = ()
    """The local shape (what Adafactor's factored statistics follow); () for a vector of `size`."""
    expert: bool = False
    """An expert weight under expert parallelism: in the experts' own gradient buffer, over the expert_grad group."""

    def numel(self) -> int:
        return self.size


def _block_parameters(m: ModelConfig, tp: int, sequence_parallel: bool, ep: int = 1) -> list[_Param]:
    """One transformer block's parameters on one TP rank (holding 1/ep of the experts), in loom's construction
    order (transformer.py)."""
    h, hd = m.hidden_size, m.head_dim
    q, kv, f = m.num_heads * hd, m.num_kv_heads * hd, m.ffn_hidden_size
    fc1 = 2 * f if m.gated_mlp else f
    norm = [_Param(h, sequence_parallel)] + ([_Param(h, sequence_parallel)] if m.norm == "layernorm" else [])
    out = [*norm, _matrix((q + 2 * kv) // tp, h)]
    out += [_Param((q + 2 * kv) // tp)] if m.biased_qkv else []
    out += [_matrix(h, q // tp)] + ([_Param(h, sequence_parallel)] if m.bias else [])
    if m.qk_norm and m.qk_norm_per_head:  # q_norm's, k_norm's
        out += [_Param(hd, tp > 1) for _ in range(2 * len(norm))]
    elif m.qk_norm:  # split with the heads (rmsnorm only)
        out += [_Param(q // tp), _Param(kv // tp)]
    sandwich = norm if m.norm_placement == "both" else []  # attention_output_norm's, then mlp_output_norm's
    out += [*sandwich, *norm, *sandwich]
    if m.moe:  # the router (its gradient summed over TP), its experts' FC1 and FC2, a shared expert and its gate
        out += [_matrix(m.num_experts, h, tp > 1)]
        experts = m.num_experts // ep
        out += [_Param(experts * fc1 // tp * h, shape=(experts, fc1 // tp, h), expert=ep > 1)]
        out += [_Param(experts * h * f // tp, shape=(experts, h, f // tp), expert=ep > 1)]
        if m.moe_shared_ffn_hidden_size is not None:  # the shared expert: a dense MLP's two matrices
            shared = m.moe_shared_ffn_hidden_size
            out += [_matrix((2 * shared if m.gated_mlp else shared) // tp, h), _matrix(h, shared // tp)]
        return out + ([_matrix(1, h, tp > 1)] if m.moe_shared_expert_gate else [])
    out += [_matrix(fc1 // tp, h)] + ([_Param(fc1 // tp)] if m.bias else [])
    out += [_matrix(h, f // tp)] + ([_Param(h, sequence_parallel)] if m.bias else [])
    return out


def _factored_moments(shape: tuple[int, ...]) -> int:
    """Adafactor's second-moment elements of a matrix (a row and a column statistic), or of each in a stack."""
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


def _matrix(rows: int, cols: int, deferred: bool = False, unit: int | str = "") -> _Param:
    return _Param(rows * cols, deferred, unit, (rows, cols))


def rank_layers(num_layers: int, lay: Layout, pp_rank: int) -> list[int]:
    """The blocks pipeline rank `pp_rank` holds: its vp chunks' layers (engine/pipeline/stages.stage_layers')."""
    per_chunk = num_layers // (lay.pp * lay.vp)
    stages = [chunk * lay.pp + pp_rank for chunk in range(lay.vp)]
    return [layer for stage in stages for layer in range(stage * per_chunk, (stage + 1) * per_chunk)]


def rank_parameters(m: ModelConfig, lay: Layout, pp_rank: int) -> list[_Param]:
    """The parameters of pipeline rank `pp_rank` (its vp chunks) on one TP rank, in loom's order."""
    sp = lay.sp
    stages, per_chunk = lay.pp * lay.vp, m.num_layers // (lay.pp * lay.vp)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, lay.tp) // lay.tp
    tied_across = m.tie_embeddings and stages > 1
    params = []
    before, after = naming.BEFORE_BLOCKS, naming.AFTER_BLOCKS
    for chunk in range(lay.vp):
        stage = chunk * lay.pp + pp_rank
        if stage == 0:
            params.append(_matrix(vocab, m.hidden_size, tied_across, before))
            if m.position_embedding == "learned":
                params.append(_matrix(m.max_position_embeddings, m.hidden_size, sp, before))
        dense, experts = (_block_parameters(block, lay.tp, sp, lay.ep) for block in m.block_configs())
        for layer in range(stage * per_chunk, (stage + 1) * per_chunk):
            block = experts if m.has_experts(layer) else dense
            params += [dataclasses.replace(q, unit=layer) for q in block]
        if stage == stages - 1:
            params += [_Param(m.hidden_size, sp, after)] * (2 if m.norm == "layernorm" else 1)
            if not (m.tie_embeddings and stages == 1):
                params.append(_matrix(vocab, m.hidden_size, tied_across, after))
    return params


def _buffer(params: list[_Param], dp: int, bucket_bytes: int, grad_bytes: int, zero: int) -> tuple[int, int]:
    """(elements of the padded gradient buffer, of which the deferred range) as GradBuffer plans them."""
    unit_of = (lambda q: q.unit) if zero == 3 else None
    layout = plan_buffer(params, lambda q: q.deferred, max(1, bucket_bytes // grad_bytes), dp, unit_of)
    return layout.total, layout.total - layout.regular_end


@dataclass(frozen=True)
class BufferPlan:
    """One gradient buffer of a rank (engine/optim/grad_buffer.GradBuffer): its parameters' elements, its padded
    elements, of which deferred, and the ranks it is summed (and ZeRO-sharded) over."""

    count: int
    total: int
    deferred: int
    replicas: int
    group: str
    """The ledger's name of that group: dp (grad with cp > 1) for the weights, expert_grad for the experts'."""


@functools.lru_cache(maxsize=4096)
def _rank_buffers(model: tuple, lay: Layout, pp_rank: int, bucket_bytes: int, grad_bytes: int) -> tuple:
    m = ModelConfig(**dict(zip(_MODEL_FIELDS, model, strict=True)))
    params = rank_parameters(m, lay, pp_rank)
    buffers = []
    for expert, replicas, group in ((False, lay.replicas, "grad" if lay.cp > 1 else "dp"),
                                    (True, lay.expert_replicas, "expert_grad")):  # fmt: skip
        members = [q for q in params if q.expert == expert]
        if members:
            total, deferred = _buffer(members, replicas, bucket_bytes, grad_bytes, lay.zero)
            buffers.append(BufferPlan(sum(q.size for q in members), total, deferred, replicas, group))
    return tuple(buffers)


def rank_buffers(
    m: ModelConfig, lay: Layout, pp_rank: int, bucket_bytes: int, grad_bytes: int = 4
) -> tuple[BufferPlan, ...]:
    """The gradient buffers of one rank of pipeline rank `pp_rank`: its weights', and under expert parallelism its
    experts' (cached: a search asks often)."""
    layout = dataclasses.replace(lay, micro_batch_size=1, recompute="none")  # what the parameters depend on
    return _rank_buffers(_model_key(m), layout, pp_rank, bucket_bytes, grad_bytes)


def zero3_gathered_elements(m: ModelConfig, lay: Layout, pp_rank: int, bucket_numel: int) -> int:
    """Weights ZeRO-3 holds gathered at its peak on pipeline rank `pp_rank` (engine/optim/param_shards.py): the
    two largest blocks (the one computing and the one prefetched) and the weights before and after the blocks,
    as padded buckets; deferred parameters are whole anyway."""
    layout = dataclasses.replace(lay, micro_batch_size=1, recompute="none")  # what the parameters depend on
    return _zero3_gathered(_model_key(m), layout, pp_rank, bucket_numel)


@functools.lru_cache(maxsize=4096)
def _zero3_gathered(model: tuple, lay: Layout, pp_rank: int, bucket_numel: int) -> int:
    m = ModelConfig(**dict(zip(_MODEL_FIELDS, model, strict=True)))
    params = rank_parameters(m, lay, pp_rank)
    units: dict = collections.defaultdict(list)
    for q in reversed(params):
        if not q.deferred:
            units[q.unit].append(q)
    padded = {unit: plan_buckets(members, bucket_numel, lay.replicas)[2] for unit, members in units.items()}
    blocks = sorted((n for unit, n in padded.items() if isinstance(unit, int)), reverse=True)
    return sum(blocks[:2]) + sum(n for unit, n in padded.items() if not isinstance(unit, int))


GRAD_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of a gradient buffer element, by optim.grad_dtype."""


_MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]


def _model_key(m: ModelConfig) -> tuple:
    return tuple(getattr(m, name) for name in _MODEL_FIELDS)


def model_state_bytes(
    m: ModelConfig,
    lay: Layout,
    pp_rank: int,
    precision: str,
    bucket_bytes: int,
    optimizer: str = "adamw",
    grad_bytes: int = 4,
) -> dict[str, int]:
    """Bytes of weights, gradients (`grad_bytes` an element: GRAD_BYTES) and optimizer state (device, host) of
    one rank of pipeline rank `pp_rank`: equal to what loom allocates (tests/test_plan_bytes.py). A bf16 gradient
    buffer's shard is also copied to fp32 for the optimizer's step, after backward: not at the peak counted."""
    weight_bytes = 4 if precision == "fp32" else 2
    grads = state = weights = sharded = 0
    for buffer in rank_buffers(m, lay, pp_rank, bucket_bytes, grad_bytes):
        count, total, deferred, replicas = buffer.count, buffer.total, buffer.deferred, buffer.replicas
        buffered = replicas > 1 or lay.zero >= 1 or precision != "fp32"
        if not buffered:
            total, deferred = count, 0
        if not buffered:
            grads += 4 * count  # autograd's param.grad
        elif lay.zero >= 2:
            grads += grad_bytes * (deferred + total // replicas)
        else:
            grads += grad_bytes * total
        sharded += total // replicas if lay.zero >= 1 else count
        # ZeRO-3: a shard of every bucket, except the deferred ones (summed over a model-parallel group), kept whole
        weights += weight_bytes * ((total - deferred) // replicas + deferred if lay.zero == 3 else count)
    # fp32 weights are their own master, unless the optimizer holds a shard of them or holds them on the host
    master = 0 if precision == "fp32" and lay.zero == 0 and lay.offload == "none" else 1
    if optimizer == "adafactor":  # no first moment; a matrix's second moment as its row and column means (no ZeRO)
        moments = sum(_factored_moments(q.shape) if q.shape else q.size for q in rank_parameters(m, lay, pp_rank))
        state = 4 * (master * sharded + moments)
    else:
        state = 4 * (master + {"adamw": 2, "lamb": 2, "sgd": 1}[optimizer]) * sharded
    if lay.offload != "cpu":
        return {"params": weights, "grads": grads, "optimizer": state, "host": 0}
    # on the host: the optimizer state and an fp32 copy of the reduced gradients it steps with
    return {"params": weights, "grads": grads, "optimizer": 0, "host": state + 4 * sharded}


def native_blocks(config: LoomConfig, engine: Engine = LOOM) -> bool:
    """Whether the planned run's blocks are loom's native ones: not Megatron-LM's, and not Transformer Engine's
    (the planner assumes native unless model.kernels = te or train.fp8 = delayed, which needs TE)."""
    return engine.gathered_inputs_saved and config.model.kernels != "te" and config.train.fp8 != "delayed"


def blocks_compiled(config: LoomConfig, engine: Engine = LOOM) -> bool:
    """Whether the planned run's blocks are torch.compile'd: model.compile on a GPU over loom's native kernels
    (Transformer Engine's run eagerly)."""
    return native_blocks(config, engine) and config.model.compiles_on(cuda=True)


FP8_WEIGHT_COPIES = {"current": 2, "delayed": 1}
"""FP8 copies of each GEMM weight kept through a step, by train.fp8: loom's own FP8 linears (current scaling,
engine/model/fp8.py's WeightCast) keep a row- and a column-major one; Transformer Engine's (delayed) one, as
the NeMo FP8 runs the planner is checked against are counted."""


def fp8_weight_bytes(m: ModelConfig, tp: int) -> int:
    """Bytes of one FP8 copy of one layer's GEMM weights, cast once per step and kept for every micro-batch's
    forward and backward (FP8_WEIGHT_COPIES says how many copies)."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    fc1 = 2 * m.ffn_hidden_size if m.gated_mlp else m.ffn_hidden_size
    return (h * (q + 2 * kv) + q * h + h * fc1 + m.ffn_hidden_size * h) // tp


def fp8_quantised_elements(m: ModelConfig, tp: int) -> int:
    """Elements of GEMM operands one rank quantises per token and layer and micro-batch (loom's FP8 linears,
    weights aside: they are cast once per step): the four GEMMs' inputs in forward (QKV's and FC1's whole, as
    gathered under sequence parallelism; the projection's and FC2's 1/tp shard) and their output gradients in
    backward (the projection's and FC2's whole)."""
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.ffn_hidden_size
    fc1 = 2 * f if m.gated_mlp else f
    return 2 * h + (q + f) // tp + 2 * h + (q + 2 * kv + fc1) // tp
