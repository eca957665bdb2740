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
  plus on the last rank the output layer's input and logits.
The bytes a step sends are tools/plan_traffic.py's.

Each is checked against what loom allocates, saves and sends on CPU (tests/test_plan_bytes.py, docs/planner.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass

from loom.engine.config import LoomConfig, ModelConfig
from loom.engine.model import naming
from loom.engine.optim.buckets import plan_buckets, plan_buffer
from loom.engine.parallel.vocab import padded_vocab_size
from loom.engine.pipeline.schedules import warmup_forwards

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

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def replicas(self) -> int:
        """The ranks holding the same weights, over which gradients are summed and ZeRO shards: DP x CP."""
        return self.dp * self.cp

    def describe(self) -> str:
        offload = " offload" if self.offload != "none" else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (
            f"tp={self.tp}{cp} pp={self.pp} vp={self.vp} dp={self.dp} mbs={self.micro_batch_size} "
            f"recompute={self.recompute} zero={self.zero}{offload}"
        )


@dataclass(frozen=True)
class Engine:
    """Implementation choices that change the numbers: loom's by default; Megatron-LM's for its published runs."""

    grad_reduce_bytes: int | None = None
    """Bytes per gradient element on the wire: None reduces the config's optim.grad_dtype, as loom does (fp32 by
    default); Megatron r0.8 reduces bf16."""
    gathered_inputs_saved: bool = True
    """Activations as loom's native block keeps them (layer_activation_bytes); False: Korthikanti's count for
    Megatron-LM, whose GEMMs keep the sequence shard of their input and gather it again in backward."""
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
        p.sequence_parallel, p.cp,
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

    def numel(self) -> int:
        return self.size


def _block_parameters(m: ModelConfig, tp: int, sequence_parallel: bool) -> list[_Param]:
    """One transformer block's parameters on one TP rank, in loom's construction order (transformer.py)."""
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
    out += [*sandwich, *norm, *sandwich, _matrix(fc1 // tp, h)] + ([_Param(fc1 // tp)] if m.bias else [])
    out += [_matrix(h, f // tp)] + ([_Param(h, sequence_parallel)] if m.bias else [])
    return out


def _matrix(rows: int, cols: int, deferred: bool = False, unit: int | str = "") -> _Param:
    return _Param(rows * cols, deferred, unit, (rows, cols))


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
        block = _block_parameters(m, lay.tp, sp)
        for layer in range(stage * per_chunk, (stage + 1) * per_chunk):
            params += [_Param(q.size, q.deferred, layer, q.shape) for q in block]
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


@functools.lru_cache(maxsize=4096)
def _rank_buffer(
    model: tuple, lay: Layout, pp_rank: int, bucket_bytes: int, grad_bytes: int = 4
) -> tuple[int, int, int]:
    """(parameters, padded buffer elements, deferred elements) of one rank: cached, a search asks often."""
    m = ModelConfig(**dict(zip(_MODEL_FIELDS, model, strict=True)))
    params = rank_parameters(m, lay, pp_rank)
    return (sum(p.size for p in params), *_buffer(params, lay.replicas, bucket_bytes, grad_bytes, lay.zero))


def rank_buffer(
    m: ModelConfig, lay: Layout, pp_rank: int, bucket_bytes: int, grad_bytes: int = 4
) -> tuple[int, int, int]:
    """(parameters, padded gradient-buffer elements, of which deferred) of one rank of pipeline rank `pp_rank`."""
    layout = dataclasses.replace(lay, micro_batch_size=1, recompute="none")  # what the parameters depend on
    return _rank_buffer(_model_key(m), layout, pp_rank, bucket_bytes, grad_bytes)


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
    count, total, deferred = rank_buffer(m, lay, pp_rank, bucket_bytes, grad_bytes)
    weight_bytes = 4 if precision == "fp32" else 2
    replicas = lay.replicas
    buffered = replicas > 1 or lay.zero >= 1 or precision != "fp32"
    if not buffered:
        total, deferred = count, 0
    if not buffered:
        grads = 4 * count  # autograd's param.grad
    elif lay.zero >= 2:
        grads = grad_bytes * (deferred + total // replicas)
    else:
        grads = grad_bytes * total
    # fp32 weights are their own master, unless the optimizer holds a shard of them or holds them on the host
    master = 0 if precision == "fp32" and lay.zero == 0 and lay.offload == "none" else 1
    sharded = total // replicas if lay.zero >= 1 else count
    if optimizer == "adafactor":  # no first moment; a matrix's second moment as its row and column means (no ZeRO)
        moments = sum(sum(q.shape) if q.shape else q.size for q in rank_parameters(m, lay, pp_rank))
        state = 4 * (master * sharded + moments)
    else:
        state = 4 * (master + {"adamw": 2, "lamb": 2, "sgd": 1}[optimizer]) * sharded
    # ZeRO-3: a shard of every bucket, except the deferred ones (summed over a model-parallel group), kept whole
    weights = weight_bytes * ((total - deferred) // replicas + deferred if lay.zero == 3 else count)
    if lay.offload != "cpu":
        return {"params": weights, "grads": grads, "optimizer": state, "host": 0}
    # on the host: the optimizer state and an fp32 copy of the reduced gradients it steps with
    return {"params": weights, "grads": grads, "optimizer": 0, "host": state + 4 * sharded}


# ---------------------------------------------------------------- activations


def layer_activation_bytes(
    m: ModelConfig,
    seq: int,
    mbs: int,
    tp: int,
    sp: bool,
    recompute: str,
    element: int,
    engine: Engine = LOOM,
    fp8: bool = False,
    compiled: bool = False,
) -> float:
    """Bytes one transformer block saves for backward for one micro-batch of `seq` x `mbs` tokens.

    loom's native block, term by term (measured equal on CPU, tests/test_plan_bytes.py), per token: each of the two
    norms keeps what _eager_norm_bytes says (sequence-sharded under sequence parallelism; the same under
    model.norm_placement = output, whose norms take the sublayers' outputs; four norms under both); a sliding-window
    layer's attention keeps its mask as an s x s additive bias in the compute dtype (eager, without recompute; a
    share of the layers: _windowed_share); the QKV and FC1 GEMMs keep their input
    (h, all-gathered under sequence parallelism); attention keeps the QKV output, rotated q and k, its output and a
    log-sum-exp per head (fp32); the SwiGLU MLP keeps FC1's output, silu(gate) and FC2's input (4 x ffn; GELU,
    squared ReLU: 2 x ffn); all split by tp. Selective recompute drops what the attention core alone keeps (the
    log-sum-exp: loom's kernels never keep the s x s scores), full recompute keeps only the block's input. Under `fp8`
    the four GEMMs keep FP8 copies of their inputs (1 byte): the attention projection's beside the attention output,
    which the attention kernel keeps unless selective recompute reruns it; model.qk_norm's norms keep their own
    (_qk_norm_bytes). `engine` MEGATRON counts Megatron-LM's layer as Korthikanti et al. 2022 do
    (`_korthikanti_bytes_per_token`).

    `compiled` (model.compile, the CUDA default): what inductor's partitioner keeps of the same block (measured
    equal on CPU): the residual stream in the compute dtype before and after attention and each norm's statistics
    (sequence-sharded under sequence parallelism), not the norms' fp32 input and output, which backward recomputes
    from them; the two normed GEMM inputs (under FP8 not at all, they are recomputed and quantised again, except the
    all-gathered FP8 copies under sequence parallelism); attention as eager; the MLP keeps FC1's output and FC2's
    input (FP8: FC1's output only). Full recompute keeps the block's input either way."""
    h, hd = m.hidden_size, m.head_dim
    q, kv, f, heads = m.num_heads * hd, m.num_kv_heads * hd, m.ffn_hidden_size, m.num_heads
    tokens = seq * mbs
    sequence_share = 1 / tp if sp else 1
    if recompute == "full":
        return tokens * h * sequence_share * element
    if not engine.gathered_inputs_saved:
        return tokens * _korthikanti_bytes_per_token(m, tp, sp, fp8) * element / 2
    fc1_output = 2 * f if m.gated_mlp else f
    block_norms = 4 if m.norm_placement == "both" else 2
    windows = _window_bytes_per_token(m, seq, mbs, tp, recompute, element, compiled)
    if compiled:
        residual = block_norms * (h * element + _norm_statistics_bytes(m)) * sequence_share
        gemm_inputs = (2 * h if sp else 0) if fp8 else 2 * h * element
        attention = ((q + 2 * kv) + (q + kv)) * element + (q * element + heads * 4 if recompute == "none" else 0)
        mlp = fc1_output * element + (0 if fp8 else f * element)
        qk_norms = _qk_norm_bytes(m, element, True, tp)
        return tokens * (residual + gemm_inputs + (attention + mlp) / tp + qk_norms + windows)
    gemm_input = 1 if fp8 else element
    norms = block_norms * _eager_norm_bytes(m, element) * sequence_share + _qk_norm_bytes(m, element, False, tp)
    gemm_inputs = 2 * h * gemm_input
    attention_output = q * element if not (fp8 and recompute == "selective") else 0
    attention = ((q + 2 * kv) + q + kv) * element + attention_output + (q if fp8 else 0)
    attention = attention / tp + (heads * 4 / tp if recompute == "none" else 0)
    mlp = ((fc1_output + f if m.gated_mlp else f) * element + f * gemm_input) / tp
    return tokens * (norms + gemm_inputs + attention + mlp + windows)


def _window_bytes_per_token(
    m: ModelConfig, seq: int, mbs: int, tp: int, recompute: str, element: int, compiled: bool
) -> float:
    """Per token, what a sliding-window or soft-capped layer's attention keeps besides an SDPA one's over every
    earlier position, times the share of such layers (measured on CPU). Where K and V have fewer heads than Q, both
    repeat K and V for each query head (masked kernels take no grouped heads) and keep them instead of the rotated K
    and the QKV output, which the eager block then keeps only through fp32 query/key norms' views of it (compiled:
    the repeated K and V, and K and V unrepeated or, with query/key norms, the QKV output). A windowed SDPA keeps its
    mask as an additive s x s bias in the compute dtype (eager). Soft-capped attention (loom's own, every layer)
    keeps its capped scores (compute dtype), their fp32 softmax and its 16-bit copy, and the s x s boolean mask it
    inverts, but no log-sum-exp (compiled: the fp32 softmax, within 1% with causal layers, 6% over with windows).
    Selective recompute reruns the attention core and keeps none of it."""
    capped = m.attention_softcap is not None
    share = 1.0 if capped else _windowed_share(m, seq)
    if not share or recompute != "none":
        return 0.0
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    repeated = 0
    if m.num_kv_heads != m.num_heads:
        qkv_output_kept = m.qk_norm and (compiled or element == 4)
        repeated = (2 * q - kv if qkv_output_kept else (q - kv if compiled else q - 3 * kv)) * element / tp
    if capped:
        heads = m.num_heads / tp
        if compiled:
            return heads * seq * 4 - heads * 4 + repeated
        scores = heads * seq * (element + 4 + (element if element != 4 else 0))
        return scores + seq / mbs - heads * 4 + repeated
    mask = 0 if compiled else seq * element / mbs
    return share * (mask + repeated)


def _windowed_share(m: ModelConfig, seq: int) -> float:
    """The share of the model's layers whose sliding window is shorter than `seq` (the others attend unmasked)."""
    windows = [m.attention_window(layer) for layer in range(m.num_layers)]
    return sum(window is not None and window < seq for window in windows) / m.num_layers


def _qk_norm_bytes(m: ModelConfig, element: int, compiled: bool, tp: int) -> float:
    """Per token, what model.qk_norm's two norms keep on one TP rank: each local head's 1/rms (fp32; under
    model.qk_norm_per_head = false one for q's and one for k's local heads, on every rank), and eagerly their
    normalised fp32 values and fp32 input unless the heads are fp32 already (a view of the QKV output, kept
    anyway); compiled, backward recomputes them from the statistics, except the fp32 input of norms across heads
    at tp > 1, which inductor keeps across their all-reduce (measured)."""
    if not m.qk_norm:
        return 0
    width = (m.num_heads + m.num_kv_heads) * m.head_dim
    statistics = _norm_statistics_bytes(m) * ((m.num_heads + m.num_kv_heads) / tp if m.qk_norm_per_head else 2)
    if not compiled and m.norm == "layernorm":  # its input is a view of the QKV output; mean and 1/std per head
        return 2 * element * (m.num_heads + m.num_kv_heads) / tp
    if not compiled:
        return statistics + (4 if element == 4 else 8) * width / tp
    kept_across_reduction = tp > 1 and not m.qk_norm_per_head and element != 4
    return statistics + (4 * width / tp if kept_across_reduction else 0)


def _korthikanti_bytes_per_token(m: ModelConfig, tp: int, sp: bool, fp8: bool) -> float:
    """Megatron-LM's layer in 16-bit (Korthikanti et al. 2022, Table 2, without the s x s scores flash attention
    never keeps), term by term so that other widths count right: 34 h / t for GPT's attention and 4h GELU MLP,
    which Megatron-LM's `theoretical_memory_usage` writes 18 + 4 ffn / h (and 10 + 24 / t without sequence
    parallelism, where the norms' and the two first GEMMs' inputs and the dropout masks are whole on every rank).
    Grouped-query attention keeps smaller K and V, SwiGLU FC1's two halves. FP8 GEMMs keep their inputs in 1 byte."""
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.ffn_hidden_size
    whole = 2 * 2 * h + (2 * h + h) * 2  # the norms' inputs; QKV's and FC1's inputs and the two dropout masks
    sharded = 2 * q + 2 * kv + 2 * kv + 2 * q  # Q and K (the score GEMM), V, the attention projection's input
    fc1_output = 2 * f if m.gated_mlp else f
    sharded += 2 * fc1_output + 2 * f  # the activation's input, FC2's input
    if fp8:
        whole -= (2 * h + 2 * h) / 2
        sharded -= (2 * q + 2 * f) / 2
    return (whole if not sp else whole / tp) + sharded / tp


def _eager_norm_bytes(m: ModelConfig, element: int) -> int:
    """Per token, what one eager norm over the hidden size keeps: RMSNorm (torch's composite of element-wise
    operations) its fp32 input, normalised fp32 input and 1/rms, 8h + 4 bytes; LayerNorm (one kernel) its input
    and its mean and 1/std in the compute dtype, h + 2 elements (on CPU, where this is measured; CUDA's autocast
    runs LayerNorm in fp32: 4h + 8 bytes in 16-bit training)."""
    h = m.hidden_size
    return h * element + 2 * element if m.norm == "layernorm" else 8 * h + 4


def _norm_statistics_bytes(m: ModelConfig) -> int:
    """Per token, what a compiled norm keeps besides its input: 1/rms (RMSNorm) or the mean and 1/std, in fp32."""
    return 4 if m.norm == "rmsnorm" else 8


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


def in_flight_microbatches(pp: int, vp: int, microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches of one chunk's layers alive at once on pipeline rank `pp_rank`: the forwards loom's schedule
    runs before its first backward, plus the one that backward follows (1F1B: min(pp - rank, m); interleaved:
    Megatron's warm-up (pp - rank - 1) * 2 + (vp - 1) * pp plus one, capped at m * vp), over vp chunks."""
    if pp == 1:
        return 1
    return min(warmup_forwards(pp_rank, pp, vp, microbatches) + 1, microbatches * vp) / vp


def output_activation_bytes(
    m: ModelConfig,
    seq: int,
    mbs: int,
    tp: int,
    sp: bool,
    element: int,
    compiled: bool = False,
    fp8_output: bool = False,
) -> float:
    """Bytes the last stage's final norm, output layer and loss save for backward for one micro-batch: the norm's
    (eager: _eager_norm_bytes; compiled: its input in the compute dtype and its statistics; sequence-sharded under
    sequence parallelism), the output GEMM's gathered input (1 byte under
    train.fp8_output_layer) and the logits of this rank's vocabulary slice, twice under model.logits_softcap (their
    tanh too) (measured on CPU, tests/test_plan_bytes.py).
    The schedule runs the last chunk's backward right after its forward, so one micro-batch of them is alive."""
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, tp) // tp
    norm = m.hidden_size * element + _norm_statistics_bytes(m) if compiled else _eager_norm_bytes(m, element)
    norm /= tp if sp else 1
    logits = vocab * element * (2 if m.logits_softcap is not None else 1)  # and their tanh, which the cap keeps
    return seq * mbs * (norm + m.hidden_size * (1 if fp8_output else element) + logits)


def rank_activation_bytes(
    config: LoomConfig, lay: Layout, pp_rank: int, engine: Engine = LOOM, compiled: bool | None = None
) -> float:
    """Bytes pipeline rank `pp_rank` keeps for backward at its peak: its layers times the micro-batches in flight,
    and on the last rank the output layer's. `compiled` None: as on a GPU (blocks_compiled); a CPU run says."""
    m, t = config.model, config.train
    element = 4 if t.precision == "fp32" else 2
    microbatches = t.global_batch_size // (lay.micro_batch_size * lay.dp)
    seq = t.seq_length // lay.cp  # what this rank holds of each sequence
    compiled = blocks_compiled(config, engine) if compiled is None else compiled
    layer = layer_activation_bytes(
        m, seq, lay.micro_batch_size, lay.tp, lay.sp, lay.recompute, element, engine, t.fp8 != "off", compiled
    )
    layers = layer * (m.num_layers // lay.pp) * in_flight_microbatches(lay.pp, lay.vp, microbatches, pp_rank)
    if pp_rank < lay.pp - 1:
        return layers
    output = output_activation_bytes(
        m, seq, lay.micro_batch_size, lay.tp, lay.sp, element, compiled, t.fp8_output_layer
    )
    return layers + output
