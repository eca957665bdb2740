"""The time half of `loom plan`: how long one step of a layout takes on a GPU kind, term by term.

From the model FLOPs of engine/flops.py (the one FLOP count) and the bytes of tools/plan_bytes.py:
- compute: GEMM FLOPs at a GEMM efficiency that falls off for small matrices, attention products at the fused
  attention kernel's efficiency, recompute adding its forward work (hardware FLOPs), and the memory-bound
  kernels (norms, activations, the loss, FP8 casts) at HBM bandwidth;
- tensor parallelism: 4 all-reduce-volumes of s x b x h per layer and micro-batch (2 forward, 2 backward; an
  all-gather plus a reduce-scatter under sequence parallelism, same volume), over NVLink inside a node;
- context parallelism: each layer's keys and values around the ring, partly behind the attention;
- expert parallelism: each expert block's all-to-alls of its tokens' rows (to the experts and back, forward and
  backward), the load balanced, not overlapped;
- data parallelism: the gradient reduce-scatter (all-reduce without ZeRO) and the parameter all-gather, hidden
  only behind the last micro-batch's backward and the first one's forward (Megatron reduces after the last);
- the pipeline bubble (pp - 1) / (vp x m) of the compute (Narayanan et al. 2021), and the p2p transfers;
- an offloaded optimizer's PCIe transfers and host step.
Efficiency and overlap constants are few and physical (tools/gpus.toml). This module only computes: the search
and the output are tools/plan.py's.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.flops import PEAK_TFLOPS, model_flops_per_token
from loom.engine.parallel.vocab import padded_vocab_size
from loom.tools.plan_bytes import (
    GRAD_BYTES,
    Engine,
    Layout,
    fp8_quantised_elements,
    fp8_weight_bytes,
    native_blocks,
    norm_reductions_per_layer,
    rank_buffers,
    rank_layers,
    tp_collectives_per_layer,
)
from loom.tools.plan_traffic import cp_ring_transfers, expert_dispatch_bytes

GPUS_FILE = Path(__file__).with_name("gpus.toml")
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU kind of tools/gpus.toml and the calibrated efficiency constants."""

    name: str
    peak_tflops: dict[str, float]
    memory_gb: float
    memory_usable_gb: float
    hbm_tb_s: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    latency_us: float
    pcie_gb_s: float
    host_memory_gb_s: float
    gpus_per_node: int
    efficiency: dict[str, float]


def gpu_names() -> list[str]:
    return list(tomllib.loads(GPUS_FILE.read_text())["gpu"])


def load_hardware(name: str, gpus_per_node: int | None = None, **efficiency: float) -> Hardware:
    """The GPU `name` of tools/gpus.toml; `efficiency` overrides calibrated constants (tests, calibration)."""
    data = tomllib.loads(GPUS_FILE.read_text())
    if name not in data["gpu"]:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(data['gpu'])}")
    gpu = dict(data["gpu"][name])
    datasheet = gpu.pop("datasheet")
    if gpus_per_node:
        gpu["gpus_per_node"] = gpus_per_node
    return Hardware(name, PEAK_TFLOPS[datasheet], **gpu, efficiency={**data["efficiency"], **efficiency})


@dataclass(frozen=True)
class StepShape:
    """What a layout makes of the run's batch on one rank: the sizes every term of the step uses."""

    local: int
    """The tokens of each sequence this rank holds (seq_length / cp)."""
    microbatches: int
    element: int
    """Bytes of a weight or activation element in the training precision."""
    vocab: int
    """This rank's share of the padded vocabulary."""
    bucket_bytes: int
    grad_bytes: int
    """Bytes of a gradient element (optim.grad_dtype)."""
    tokens_per_replica: float
    """The step's tokens one DP x CP replica (all its TP and PP ranks) processes."""
    last_stage_tokens: float
    """The tokens one GPU of the last pipeline stage multiplies: its replica's, split over TP."""

    @classmethod
    def of(cls, config: LoomConfig, lay: Layout) -> StepShape:
        m, t = config.model, config.train
        return cls(
            local=t.seq_length // lay.cp,
            microbatches=t.global_batch_size // (lay.micro_batch_size * lay.dp),
            element=4 if t.precision == "fp32" else 2,
            vocab=padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, lay.tp) // lay.tp,
            bucket_bytes=int(config.parallel.grad_bucket_mb * 2**20),
            grad_bytes=GRAD_BYTES[config.optim.grad_dtype],
            tokens_per_replica=t.global_batch_size * t.seq_length / lay.replicas,
            last_stage_tokens=t.global_batch_size * t.seq_length / (lay.replicas * lay.tp),
        )


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per token of a training step (forward and backward), split the way their speeds differ."""

    model: float
    """engine/flops.py's count: what MFU divides by."""
    attention: float
    """The attention products (score and context), on the fused attention kernel."""
    gemm: float
    """Every GEMM: the blocks' and the output layer's."""
    output_layer: float
    gemm_extra: float
    """The blocks' GEMMs that full recompute runs again."""
    attention_extra: float
    """The attention that (selective or full) recompute runs again."""

    @classmethod
    def of(cls, config: LoomConfig, lay: Layout) -> TokenFlops:
        m, seq = config.model, config.train.seq_length
        model = model_flops_per_token(m, seq)
        attention = 12.0 * m.num_layers * m.num_heads * m.head_dim * seq
        gemm = model - attention
        output_layer = 6.0 * m.hidden_size * m.vocab_size
        gemm_extra = (gemm - output_layer) / 3 if lay.recompute == "full" else 0.0
        attention_extra = attention / 3 if lay.recompute != "none" else 0.0
        return cls(model, attention, gemm, output_layer, gemm_extra, attention_extra)

    @property
    def hardware(self) -> float:
        """What the GPUs compute, recompute included (HFU's numerator)."""
        return self.model + self.gemm_extra + self.attention_extra


def step_seconds(config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine) -> dict[str, float]:
    """Seconds per step of `config` under `lay` on `hw`: compute, tp, dp, bubble, p2p, cp, other (exposed)."""
    shape, flops = StepShape.of(config, lay), TokenFlops.of(config, lay)
    compute = _compute_seconds(config, lay, hw, flops, shape) + _memory_bound_seconds(config, lay, hw, engine, shape)
    micro_compute = compute / shape.microbatches
    return {
        "compute": compute,
        "tp": _tp_seconds(config, lay, hw, engine, shape),
        "dp": _dp_seconds(config, lay, hw, engine, shape, micro_compute),
        "bubble": compute * (lay.pp - 1) / (lay.vp * shape.microbatches),
        "p2p": _p2p_seconds(config, lay, hw, shape),
        "cp": _cp_seconds(config, lay, hw, flops, shape),
        "ep": _ep_seconds(config, lay, hw, shape),
        "other": hw.efficiency["step_overhead_s"] + _offload_seconds(config, lay, hw, shape),
    }


def _ring_seconds(bytes_: float, ranks: int, bandwidth_gb_s: float, latency_us: float) -> float:
    """One ring all-gather or reduce-scatter of `bytes_` (the full tensor) over `ranks` GPUs."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / (bandwidth_gb_s * GB) + (ranks - 1) * latency_us * 1e-6


def _gemm_efficiency(hw: Hardware, smallest_dimension: float, fp8: bool = False) -> float:
    e = hw.efficiency
    return e["fp8_gemm" if fp8 else "gemm"] * smallest_dimension / (smallest_dimension + e["gemm_half_size"])


def _compute_seconds(config: LoomConfig, lay: Layout, hw: Hardware, flops: TokenFlops, shape: StepShape) -> float:
    """The FLOPs of the last pipeline stage, which sets the pipeline's pace: its share of the blocks plus the
    output layer. Every GPU does 1/gpus of the step's FLOPs; recompute adds forward work (hardware FLOPs)."""
    m, t = config.model, config.train
    peak = hw.peak_tflops[t.precision] * 1e12  # MFU's denominator, as loom train's: the training precision's
    # FP8 runs (train.fp8) do their block GEMMs in FP8; the output layer too with train.fp8_output_layer; attention
    # stays in bf16.
    fp8 = t.fp8 != "off" and "fp8" in hw.peak_tflops
    gemm_peak = hw.peak_tflops["fp8"] * 1e12 if fp8 else peak
    output_fp8 = fp8 and t.fp8_output_layer
    output_peak = gemm_peak if output_fp8 else peak
    width = min(block.ffn_hidden_size for block in m.block_configs())  # experts' too
    smallest = min(m.hidden_size / lay.tp, width / lay.tp, shape.local * lay.micro_batch_size)
    output = flops.output_layer
    blocks_per_token = (flops.gemm - output + flops.gemm_extra) / lay.pp + output
    return shape.last_stage_tokens * (
        (blocks_per_token - output) / (gemm_peak * _gemm_efficiency(hw, smallest, fp8))
        + output / (output_peak * _gemm_efficiency(hw, smallest, output_fp8))
        + (flops.attention + flops.attention_extra) / lay.pp / (peak * hw.efficiency["attention"])
    )


def _memory_bound_seconds(config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine, shape: StepShape) -> float:
    """Memory-bound kernels: activation bytes (sharded by sequence parallelism) and the logits, over HBM bandwidth.
    Fused (compiled blocks, Transformer Engine's kernels, Megatron's) as calibrated; loom's native blocks run
    eagerly (model.compile = false) launch each norm, rotary, activation and residual operation on its own."""
    m, t, e = config.model, config.train, hw.efficiency
    eager = native_blocks(config, engine) and not m.compiles_on(cuda=True)
    elementwise_passes = e["eager_elementwise_passes"] if eager else e["elementwise_passes"]
    activation_share = 1 / lay.tp if lay.sp else 1
    streamed = shape.tokens_per_replica * (
        elementwise_passes * m.hidden_size * activation_share * m.num_layers / lay.pp
        + e["loss_passes"] * shape.vocab  # on the last stage, which sets the pace
    )
    seconds = streamed * shape.element / (hw.hbm_tb_s * 1e12)
    # Current scaling (train.fp8 = current): each quantised operand is read for its amax before a second pass can
    # cast it, and the weight-gradient GEMM wants both of its operands transposed; delayed scaling (Transformer
    # Engine) casts with the last steps' amax inside the kernel that produces the operand.
    if t.fp8 == "current":
        quantised = fp8_quantised_elements(m, lay.tp) * m.num_layers / lay.pp
        if t.fp8_output_layer:  # the hidden states in, the logits' gradient (vocab / tp) back
            quantised += m.hidden_size + shape.vocab
        seconds += shape.tokens_per_replica * quantised * e["fp8_cast_bytes"] / (hw.hbm_tb_s * 1e12)
        if lay.zero == 3:  # and every forward and backward (and recompute) casts its gathered weights again
            calls = shape.microbatches * (2 + (lay.recompute == "full"))
            weights = fp8_weight_bytes(m, lay.tp) * m.num_layers / lay.pp + (
                shape.vocab * m.hidden_size if t.fp8_output_layer else 0
            )
            seconds += calls * weights * e["fp8_cast_bytes"] / (hw.hbm_tb_s * 1e12)
    return seconds


def _tp_seconds(config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine, shape: StepShape) -> float:
    """Tensor parallel, inside a node over NVLink: a ring all-reduce is two passes, an all-gather or reduce-scatter
    one."""
    m = config.model
    tp_bandwidth = hw.intra_node_gb_s if lay.tp <= hw.gpus_per_node else hw.inter_node_gb_s
    ring = _ring_seconds(
        shape.local * lay.micro_batch_size * m.hidden_size * shape.element, lay.tp, tp_bandwidth, hw.latency_us
    )
    passes = sum(
        count * (2 if op == "all_reduce" else 1) for op, count in tp_collectives_per_layer(m, lay, engine).items()
    )
    tokens = shape.local * lay.micro_batch_size  # query/key norms across heads: an fp32 sum of squares per token
    norms = 2 * norm_reductions_per_layer(m, lay) * _ring_seconds(tokens * 4, lay.tp, tp_bandwidth, hw.latency_us)
    layer_seconds = passes * ring + norms
    return layer_seconds * (m.num_layers / lay.pp) * shape.microbatches * (1 - hw.efficiency["tp_overlap"])


def _cp_seconds(config: LoomConfig, lay: Layout, hw: Hardware, flops: TokenFlops, shape: StepShape) -> float:
    """Context parallel: each layer's keys and values go around the ring, beside the attention of the block at
    hand (cp_overlap of it hidden); CP ranks are next to the TP ranks, so the ring stays in a node while tp x cp
    fits."""
    if lay.cp == 1:
        return 0.0
    m = config.model
    cp_bandwidth = hw.intra_node_gb_s if lay.tp * lay.cp <= hw.gpus_per_node else hw.inter_node_gb_s
    kv_sends, grad_sends, elements = cp_ring_transfers(m, lay, shape.local)
    ring_bytes = (kv_sends * shape.element + grad_sends * 4) * elements
    ring_seconds = ring_bytes / (cp_bandwidth * GB) * (m.num_layers / lay.pp) * shape.microbatches
    peak = hw.peak_tflops[config.train.precision] * 1e12
    attention_seconds = (
        shape.last_stage_tokens
        * (flops.attention + flops.attention_extra)
        / lay.pp
        / (peak * hw.efficiency["attention"])
    )
    return max(0.0, ring_seconds - hw.efficiency["cp_overlap"] * attention_seconds)


def _ep_seconds(config: LoomConfig, lay: Layout, hw: Hardware, shape: StepShape) -> float:
    """Expert parallel: EP ranks are DP ranks tp x cp apart, so an all-to-all stays in a node while tp x cp x ep
    fits; (ep - 1) / ep of what a rank sends leaves it, at the link's bandwidth and one latency per peer."""
    if lay.ep == 1:
        return 0.0
    m = config.model
    bandwidth = hw.intra_node_gb_s if lay.tp * lay.cp * lay.ep <= hw.gpus_per_node else hw.inter_node_gb_s
    sent = sum(expert_dispatch_bytes(m, lay, config.train.seq_length, shape.element, "rows").values())
    calls = 3 + 2 + 3 * (lay.recompute == "full")  # counts, rows and outputs forward; two gradients backward
    one_block = (lay.ep - 1) / lay.ep * sent / (bandwidth * GB) + calls * (lay.ep - 1) * hw.latency_us * 1e-6
    blocks = max(sum(m.has_experts(layer) for layer in rank_layers(m.num_layers, lay, r)) for r in range(lay.pp))
    return one_block * blocks * shape.microbatches


def _dp_seconds(
    config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine, shape: StepShape, micro_compute: float
) -> float:
    """Data parallel: DP x CP ranks are tp apart (engine/parallel/state.py), so a group stays in a node while
    tp x dp x cp fits; under expert parallelism the experts' gradients over their own ranks (dp / ep x cp)."""
    e = hw.efficiency
    dp_bandwidth = hw.intra_node_gb_s if lay.tp * lay.replicas <= hw.gpus_per_node else hw.inter_node_gb_s
    largest: dict[str, tuple[int, int]] = {}  # each buffer's (elements, ranks) on the first or last stage, the larger
    for r in {0, lay.pp - 1}:
        for buffer in rank_buffers(config.model, lay, r, shape.bucket_bytes):
            largest[buffer.group] = max(largest.get(buffer.group, (0, 0)), (buffer.count, buffer.replicas))
    scatter = gather = 0.0
    for count, replicas in largest.values():
        scatter += _ring_seconds(
            count * (engine.grad_reduce_bytes or shape.grad_bytes), replicas, dp_bandwidth, hw.latency_us
        )
        gather += _ring_seconds(count * shape.element, replicas, dp_bandwidth, hw.latency_us) if lay.zero else 0.0
    backward_window = e["dp_overlap"] * micro_compute * 2 / 3  # dp_overlap micro-batches' backward
    if lay.zero == 2:  # a reduce-scatter per micro-batch, each behind its own backward
        reduce_exposed = shape.microbatches * max(0.0, scatter - backward_window)
    else:  # once, after the last micro-batch's backward started (an all-reduce is two ring passes)
        reduce_exposed = max(0.0, scatter * (2 if lay.zero == 0 else 1) - backward_window)
    if lay.zero == 3:  # weights gathered for every micro-batch's forward and again for its backward
        gather_exposed = shape.microbatches * (
            max(0.0, gather - micro_compute / 3) + max(0.0, gather - micro_compute * 2 / 3)
        )
    else:
        gather_exposed = max(0.0, gather - e["dp_overlap"] * micro_compute / 3)
    return reduce_exposed + gather_exposed


def _p2p_seconds(config: LoomConfig, lay: Layout, hw: Hardware, shape: StepShape) -> float:
    """The pipeline's activation and gradient sends between stages, mostly behind compute (p2p_overlap)."""
    if lay.pp == 1:
        return 0.0
    p2p_bandwidth = hw.inter_node_gb_s if lay.tp * lay.replicas >= hw.gpus_per_node else hw.intra_node_gb_s
    p2p_bytes = (
        shape.local * lay.micro_batch_size * config.model.hidden_size * shape.element / (lay.tp if lay.sp else 1)
    )
    return 2 * shape.microbatches * lay.vp * p2p_bytes / (p2p_bandwidth * GB) * (1 - hw.efficiency["p2p_overlap"])


def _offload_seconds(config: LoomConfig, lay: Layout, hw: Hardware, shape: StepShape) -> float:
    """An offloaded optimizer (not overlapped: the next forward needs the weights it writes): the reduced gradients
    go down and the fp32 master weights come up over PCIe, and the host steps at its memory bandwidth."""
    if lay.offload != "cpu":
        return 0.0
    shard = max(
        sum(buffer.total // buffer.replicas if lay.zero >= 1 else buffer.count for buffer in buffers)
        for buffers in (
            rank_buffers(config.model, lay, r, shape.bucket_bytes, shape.grad_bytes) for r in {0, lay.pp - 1}
        )
    )
    return shard * (8 / (hw.pcie_gb_s * GB) + hw.efficiency["host_adam_bytes"] / (hw.host_memory_gb_s * GB))
