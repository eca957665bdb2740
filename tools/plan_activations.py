"""What a layout keeps for backward, exactly as loom's blocks keep it: the activation half of `loom plan`'s memory
(tools/plan_bytes.py has the layout, the engine and the weights, gradients and optimizer state). Each term is
measured equal on CPU with saved-tensor hooks (tests/test_plan_bytes.py, docs/planner.md)."""

from __future__ import annotations

from loom.engine.config import LoomConfig, ModelConfig
from loom.engine.parallel.vocab import padded_vocab_size
from loom.engine.pipeline.schedules import warmup_forwards
from loom.tools.plan_bytes import LOOM, Engine, Layout, blocks_compiled, rank_layers


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
        mlp = (fc1_output * element + (0 if fp8 else f * element)) / tp
        if m.moe:
            mlp = _expert_bytes_per_token(m, seq, mbs, tp, element, compiled=True)
        qk_norms = _qk_norm_bytes(m, element, True, tp)
        return tokens * (residual + gemm_inputs + attention / tp + mlp + qk_norms + windows)
    gemm_input = 1 if fp8 else element
    norms = block_norms * _eager_norm_bytes(m, element) * sequence_share + _qk_norm_bytes(m, element, False, tp)
    gemm_inputs = 2 * h * gemm_input
    attention_output = q * element if not (fp8 and recompute == "selective") else 0
    attention = ((q + 2 * kv) + q + kv) * element + attention_output + (q if fp8 else 0)
    attention = attention / tp + (heads * 4 / tp if recompute == "none" else 0)
    mlp = ((fc1_output + f if m.gated_mlp else f) * element + f * gemm_input) / tp
    if m.moe:
        mlp = _expert_bytes_per_token(m, seq, mbs, tp, element)
    return tokens * (norms + gemm_inputs + attention + mlp + windows)


def _expert_bytes_per_token(m: ModelConfig, seq: int, mbs: int, tp: int, element: int, compiled: bool = False) -> float:
    """Per token (of the whole sequence, gathered under sequence parallelism), what a mixture of experts keeps
    besides the router's input (counted as FC1's): the router's fp32 probabilities, the top-k indices, the weights
    (fp32 and their compute-dtype copy; renormalised: the top-k values and their sum too), the two int64 orders
    between tokens and sorted choices, and per choice (top_k of them) its gathered input, the expert MLP's
    activations as a dense MLP's (split by tp) and the expert's output; per micro-batch each expert's end row
    (int32), the load-balancing loss's counts per sequence (fp32) and the router losses' gradient; with the z-loss the
    fp32 logits and their logsumexp; a shared expert's MLP as a dense one's, and under its gate the shared output and
    the sigmoid (measured on CPU). Compiled, backward recomputes the weights and the logits, and the MLPs keep what a
    compiled dense one does."""
    h, f, k, experts = m.hidden_size, m.ffn_hidden_size, m.moe_top_k, m.num_experts
    weights = 0 if compiled else k * element + (4 * k + 4 if m.moe_norm_top_k else 0)
    routing = 4 * experts + 8 * k + weights + 16 * k

    def mlp_kept(width: int) -> int:  # what an MLP of this width keeps besides its input (a dense one's)
        first = 2 * width if m.gated_mlp else width
        return first + width if compiled or not m.gated_mlp else first + 2 * width

    per_choice = 2 * h * element + mlp_kept(f) * element / tp
    shared = 0.0
    if m.moe_shared_ffn_hidden_size is not None:  # every token's: its MLP; gated, its output and the gate's sigmoid
        shared = mlp_kept(m.moe_shared_ffn_hidden_size) * element / tp
        shared += (h + 1) * element if m.moe_shared_expert_gate else 0
    # the load-balancing loss's counts per sequence, and (eager) the router losses' fp32 gradient, kept until backward
    per_microbatch = 4 * experts + (4 * experts * mbs if m.moe_aux_loss_coeff else 0)
    # sigmoid scores' sum per token, which the load-balancing loss divides them by
    routing += 4 if m.moe_aux_loss_coeff and m.moe_router_score == "sigmoid" else 0
    per_microbatch += 4 if (m.moe_z_loss_coeff if compiled else m.router_losses) else 0  # (compiled: the z-loss's)
    if m.moe_router_fp32 and element < 4 and not compiled:  # an fp32 router keeps its input in fp32 (the compute
        # dtype's then kept only by a shared expert) and its weight's fp32 copy; compiled, backward recasts them
        routing += 4 * h - (0 if m.moe_shared_ffn_hidden_size is not None else element * h)
        per_microbatch += 4 * experts * h
    z_loss = 0.0
    if m.moe_z_loss_coeff:  # the fp32 logits (eager) and their logsumexp per token
        z_loss = 4 if compiled else 4 * experts + 4
    return routing + k * per_choice + shared + z_loss + per_microbatch / (seq * mbs)


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
    dense, experts = (
        layer_activation_bytes(
            block,
            seq,
            lay.micro_batch_size,
            lay.tp,
            lay.sp,
            lay.recompute,
            element,
            engine,
            t.fp8 != "off",
            compiled,
        )
        for block in m.block_configs()  # a dense block and an expert one (model.moe_dense_layers; alike without)
    )
    held = sum(experts if m.has_experts(layer) else dense for layer in rank_layers(m.num_layers, lay, pp_rank))
    layers = held * in_flight_microbatches(lay.pp, lay.vp, microbatches, pp_rank)
    if pp_rank < lay.pp - 1:
        return layers
    output = output_activation_bytes(
        m, seq, lay.micro_batch_size, lay.tp, lay.sp, element, compiled, t.fp8_output_layer
    )
    return layers + output
