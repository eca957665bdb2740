"""`loom plan`: which layout fits a model on a cluster and how fast it will run, before anything runs.

For a layout (tp, pp, vp, dp, micro-batch size, recompute, ZeRO stage, offload) the planner works out:

Memory per GPU, on the pipeline rank that holds the most (the first or the last stage): weights, gradients,
optimizer state and activations as loom lays them out (tools/plan_bytes.py, checked against loom on CPU).

Time per step, from the model FLOPs of engine/flops.py (the one FLOP count):
- compute: GEMM FLOPs at a GEMM efficiency that falls off for small matrices, attention products at the fused
  attention kernel's efficiency, recompute adding its forward work (hardware FLOPs);
- tensor parallelism: 4 all-reduce-volumes of s x b x h per layer and micro-batch (2 forward, 2 backward; an
  all-gather plus a reduce-scatter under sequence parallelism, same volume), over NVLink inside a node;
- data parallelism: the gradient reduce-scatter (all-reduce without ZeRO) and the parameter all-gather, hidden
  only behind the last micro-batch's backward and the first one's forward (Megatron reduces after the last);
- the pipeline bubble (pp - 1) / (vp x m) of the compute (Narayanan et al. 2021), and the p2p transfers.
Efficiency and overlap constants are few and physical (tools/gpus.toml), calibrated on Megatron-LM's published
H100 weak-scaling table (tests/test_plan.py). docs/planner.md has the equations and their blind spots.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.flops import PEAK_TFLOPS, model_flops_per_token
from loom.engine.parallel.vocab import padded_vocab_size
from loom.tools.plan_bytes import (
    FP8_WEIGHT_COPIES,
    GRAD_BYTES,
    LOOM,
    Engine,
    Layout,
    blocks_compiled,
    cp_ring_transfers,
    fp8_quantised_elements,
    fp8_weight_bytes,
    layer_activation_bytes,
    layout_of,
    model_state_bytes,
    native_blocks,
    rank_activation_bytes,
    rank_buffer,
    tp_collectives_per_layer,
    zero3_gathered_elements,
)

GPUS_FILE = Path(__file__).with_name("gpus.toml")
GB = 1e9
RECOMPUTE = ("none", "selective", "full")


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


@dataclass
class Estimate:
    layout: Layout
    fits: bool
    reason: str
    """Why it does not fit or divide ("" when it fits)."""
    memory: dict[str, float]
    """Bytes per GPU: params, grads, optimizer, activations, other, total."""
    host_bytes: float
    seconds: dict[str, float]
    """Per step: compute, tp (exposed), dp (exposed), bubble, p2p, other."""
    step_seconds: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float

    def as_json(self) -> dict:
        lay = self.layout
        return {
            "tp": lay.tp,
            "pp": lay.pp,
            "vp": lay.vp,
            "dp": lay.dp,
            "cp": lay.cp,
            "micro_batch_size": lay.micro_batch_size,
            "recompute": lay.recompute,
            "zero": lay.zero,
            "offload": lay.offload,
            "fits": self.fits,
            "reason": self.reason,
            "memory_gb": {k: round(v / GB, 3) for k, v in self.memory.items()},
            "host_memory_gb": round(self.host_bytes / GB, 3),
            "time_s": {k: round(v, 4) for k, v in self.seconds.items()},
            "step_seconds": round(self.step_seconds, 4),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "model_tflops_per_gpu": round(self.model_tflops_per_gpu, 1),
            "hardware_tflops_per_gpu": round(self.hardware_tflops_per_gpu, 1),
            "mfu": round(self.mfu, 4),
            "hfu": round(self.hfu, 4),
        }


# ---------------------------------------------------------------- the estimate


def _ring_seconds(bytes_: float, ranks: int, bandwidth_gb_s: float, latency_us: float) -> float:
    """One ring all-gather or reduce-scatter of `bytes_` (the full tensor) over `ranks` GPUs."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / (bandwidth_gb_s * GB) + (ranks - 1) * latency_us * 1e-6


def _gemm_efficiency(hw: Hardware, smallest_dimension: float) -> float:
    e = hw.efficiency
    return e["gemm"] * smallest_dimension / (smallest_dimension + e["gemm_half_size"])


def estimate(config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine = LOOM) -> Estimate:
    """Memory and step time of `config` under `lay` on `hw` GPUs (config.train: batch, sequence, precision)."""
    m, t = config.model, config.train
    seq, mbs = t.seq_length, lay.micro_batch_size
    local = seq // lay.cp  # the tokens of each sequence this rank holds (context parallelism)
    gpus = lay.tp * lay.cp * lay.pp * lay.dp
    microbatches = t.global_batch_size // (mbs * lay.dp)
    precision = t.precision
    element = 4 if precision == "fp32" else 2
    bucket_bytes = int(config.parallel.grad_bucket_mb * 2**20)
    grad_bytes = GRAD_BYTES[config.optim.grad_dtype]

    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, lay.tp) // lay.tp
    # Memory: on the first pipeline rank (embedding, the most micro-batches in flight) or the last (output layer,
    # logits), whichever holds more; the middle ranks hold less than the first.
    memory = {}
    for pp_rank in sorted({0, lay.pp - 1}):
        state = model_state_bytes(m, lay, pp_rank, precision, bucket_bytes, config.optim.name, grad_bytes)
        transient = 2 * bucket_bytes if lay.zero >= 2 else 0  # ZeRO-2's (and 3's) buckets being reduced
        if lay.recompute == "full":  # the layer being recomputed holds its activations during its backward
            transient += layer_activation_bytes(
                m, local, mbs, lay.tp, lay.sp, "none", element, engine, t.fp8 != "off", blocks_compiled(config, engine)
            )
        # The FP8 copies of this rank's weights, cast once per step; under ZeRO-3 each call casts the gathered
        # weight, so only the computing block's two copies (and the output layer's) are alive at once.
        if t.fp8 != "off":  # (ZeRO-3 runs loom's own FP8 linears: LoomConfig.zero_refusal)
            fp8_layers = 1 if lay.zero == 3 else m.num_layers // lay.pp
            transient += FP8_WEIGHT_COPIES[t.fp8] * fp8_weight_bytes(m, lay.tp) * fp8_layers
        if t.fp8_output_layer and pp_rank == lay.pp - 1:  # and of the output weight (loom's own FP8 linear)
            transient += FP8_WEIGHT_COPIES["current"] * vocab * m.hidden_size
        if lay.zero == 3 and lay.replicas > 1:  # gathered whole: the block computing, the one prefetched, and the
            # weights outside the blocks (gathered for the chunk's whole forward and backward)
            transient += zero3_gathered_elements(m, lay, pp_rank, max(1, bucket_bytes // grad_bytes)) * element
        rank_memory = {
            "params": state["params"],
            "grads": state["grads"],
            "optimizer": state["optimizer"],
            "activations": rank_activation_bytes(config, lay, pp_rank, engine),
            "other": transient,
        }
        if sum(rank_memory.values()) > sum(memory.values()):
            memory, host_bytes = rank_memory, state["host"]
    memory["total"] = sum(memory.values())
    fits = memory["total"] <= hw.memory_usable_gb * GB
    reason = "" if fits else f"needs {memory['total'] / GB:.1f} GB of {hw.memory_usable_gb:g} GB usable"

    # Compute: every GPU does 1/gpus of the step's FLOPs; recompute adds forward work (hardware FLOPs).
    e = hw.efficiency
    model_per_token = model_flops_per_token(m, seq)
    attention_per_token = 12.0 * m.num_layers * m.num_heads * m.head_dim * seq
    gemm_per_token = model_per_token - attention_per_token
    output_layer_per_token = 6.0 * m.hidden_size * m.vocab_size
    gemm_extra = (gemm_per_token - output_layer_per_token) / 3 if lay.recompute == "full" else 0.0
    attention_extra = attention_per_token / 3 if lay.recompute != "none" else 0.0
    peak = hw.peak_tflops[precision] * 1e12  # MFU's denominator, as loom train's: the training precision's
    # FP8 runs (train.fp8) do their block GEMMs in FP8; the output layer too with train.fp8_output_layer; attention
    # stays in bf16.
    gemm_peak = hw.peak_tflops["fp8"] * 1e12 if t.fp8 != "off" and "fp8" in hw.peak_tflops else peak
    output_peak = gemm_peak if t.fp8_output_layer else peak
    smallest = min(m.hidden_size / lay.tp, m.ffn_hidden_size / lay.tp, local * mbs)
    # The pipeline goes at the pace of its last stage: its share of the blocks plus the output layer.
    blocks_per_token = (gemm_per_token - output_layer_per_token + gemm_extra) / lay.pp + output_layer_per_token
    last_stage_tokens = t.global_batch_size * seq / (lay.replicas * lay.tp)
    compute = last_stage_tokens * (
        (blocks_per_token - output_layer_per_token) / (gemm_peak * _gemm_efficiency(hw, smallest))
        + output_layer_per_token / (output_peak * _gemm_efficiency(hw, smallest))
        + (attention_per_token + attention_extra) / lay.pp / (peak * e["attention"])
    )
    # Memory-bound kernels: activation bytes (sharded by sequence parallelism) and the logits, over HBM bandwidth.
    # Fused (compiled blocks, Transformer Engine's kernels, Megatron's) as calibrated; loom's native blocks run
    # eagerly (model.compile = false) launch each norm, rotary, activation and residual operation on its own.
    eager = native_blocks(config, engine) and not m.compiles_on(cuda=True)
    elementwise_passes = e["eager_elementwise_passes"] if eager else e["elementwise_passes"]
    activation_share = 1 / lay.tp if lay.sp else 1
    tokens_per_replica = t.global_batch_size * seq / lay.replicas
    streamed = tokens_per_replica * (
        elementwise_passes * m.hidden_size * activation_share * m.num_layers / lay.pp
        + e["loss_passes"] * vocab  # on the last stage, which sets the pace
    )
    compute += streamed * element / (hw.hbm_tb_s * 1e12)
    # Current scaling (train.fp8 = current): each quantised operand is read for its amax before a second pass can
    # cast it, and the weight-gradient GEMM wants both of its operands transposed; delayed scaling (Transformer
    # Engine) casts with the last steps' amax inside the kernel that produces the operand.
    if t.fp8 == "current":
        quantised = fp8_quantised_elements(m, lay.tp) * m.num_layers / lay.pp
        if t.fp8_output_layer:  # the hidden states in, the logits' gradient (vocab / tp) back
            quantised += m.hidden_size + vocab
        compute += tokens_per_replica * quantised * e["fp8_cast_bytes"] / (hw.hbm_tb_s * 1e12)
        if lay.zero == 3:  # and every forward and backward (and recompute) casts its gathered weights again
            calls = microbatches * (2 + (lay.recompute == "full"))
            weights = fp8_weight_bytes(m, lay.tp) * m.num_layers / lay.pp + (
                vocab * m.hidden_size if t.fp8_output_layer else 0
            )
            compute += calls * weights * e["fp8_cast_bytes"] / (hw.hbm_tb_s * 1e12)
    micro_compute = compute / microbatches

    # Tensor parallel, inside a node over NVLink: a ring all-reduce is two passes, an all-gather or reduce-scatter one.
    tp_bandwidth = hw.intra_node_gb_s if lay.tp <= hw.gpus_per_node else hw.inter_node_gb_s
    ring = _ring_seconds(local * mbs * m.hidden_size * element, lay.tp, tp_bandwidth, hw.latency_us)
    passes = sum(
        count * (2 if op == "all_reduce" else 1) for op, count in tp_collectives_per_layer(lay, engine).items()
    )
    tp_time = passes * ring * (m.num_layers / lay.pp) * microbatches * (1 - e["tp_overlap"])

    # Context parallel: each layer's keys and values go around the ring, beside the attention of the block at
    # hand (cp_overlap of it hidden); CP ranks are next to the TP ranks, so the ring stays in a node while tp x cp
    # fits.
    cp_time = 0.0
    if lay.cp > 1:
        cp_bandwidth = hw.intra_node_gb_s if lay.tp * lay.cp <= hw.gpus_per_node else hw.inter_node_gb_s
        kv_sends, grad_sends, elements = cp_ring_transfers(m, lay, local)
        ring_bytes = (kv_sends * element + grad_sends * 4) * elements
        ring_seconds = ring_bytes / (cp_bandwidth * GB) * (m.num_layers / lay.pp) * microbatches
        attention_seconds = (
            last_stage_tokens * (attention_per_token + attention_extra) / lay.pp / (peak * e["attention"])
        )
        cp_time = max(0.0, ring_seconds - e["cp_overlap"] * attention_seconds)

    # Data parallel: DP x CP ranks are tp apart (engine/parallel/state.py), so a group stays in a node while
    # tp x dp x cp fits.
    dp_bandwidth = hw.intra_node_gb_s if lay.tp * lay.replicas <= hw.gpus_per_node else hw.inter_node_gb_s
    stage_params = max(rank_buffer(m, lay, r, bucket_bytes)[0] for r in {0, lay.pp - 1})
    scatter = _ring_seconds(
        stage_params * (engine.grad_reduce_bytes or grad_bytes), lay.replicas, dp_bandwidth, hw.latency_us
    )
    gather = _ring_seconds(stage_params * element, lay.replicas, dp_bandwidth, hw.latency_us) if lay.zero else 0.0
    backward_window = e["dp_overlap"] * micro_compute * 2 / 3  # dp_overlap micro-batches' backward
    if lay.zero == 2:  # a reduce-scatter per micro-batch, each behind its own backward
        reduce_exposed = microbatches * max(0.0, scatter - backward_window)
    else:  # once, after the last micro-batch's backward started (an all-reduce is two ring passes)
        reduce_exposed = max(0.0, scatter * (2 if lay.zero == 0 else 1) - backward_window)
    if lay.zero == 3:  # weights gathered for every micro-batch's forward and again for its backward
        gather_exposed = microbatches * (
            max(0.0, gather - micro_compute / 3) + max(0.0, gather - micro_compute * 2 / 3)
        )
    else:
        gather_exposed = max(0.0, gather - e["dp_overlap"] * micro_compute / 3)
    dp_time = reduce_exposed + gather_exposed

    bubble = compute * (lay.pp - 1) / (lay.vp * microbatches)
    p2p_bandwidth = hw.inter_node_gb_s if lay.tp * lay.replicas >= hw.gpus_per_node else hw.intra_node_gb_s
    p2p_bytes = local * mbs * m.hidden_size * element / (lay.tp if lay.sp else 1)
    p2p = 2 * microbatches * lay.vp * p2p_bytes / (p2p_bandwidth * GB) * (1 - e["p2p_overlap"]) if lay.pp > 1 else 0.0
    # Offloaded optimizer (not overlapped: the next forward needs the weights it writes): the reduced gradients
    # go down and the fp32 master weights come up over PCIe, and the host steps at its memory bandwidth.
    offload = 0.0
    if lay.offload == "cpu":
        shard = max(
            (total // lay.replicas if lay.zero >= 1 else count)
            for count, total, _ in (rank_buffer(m, lay, r, bucket_bytes, grad_bytes) for r in {0, lay.pp - 1})
        )
        offload = shard * (8 / (hw.pcie_gb_s * GB) + e["host_adam_bytes"] / (hw.host_memory_gb_s * GB))
    seconds = {
        "compute": compute,
        "tp": tp_time,
        "dp": dp_time,
        "bubble": bubble,
        "p2p": p2p,
        "cp": cp_time,
        "other": e["step_overhead_s"] + offload,
    }
    step = sum(seconds.values())
    tokens_per_s_per_gpu = t.global_batch_size * seq / step / gpus
    model_tflops = model_per_token * tokens_per_s_per_gpu / 1e12
    hardware_tflops = (model_per_token + gemm_extra + attention_extra) * tokens_per_s_per_gpu / 1e12
    return Estimate(
        lay,
        fits,
        reason,
        memory,
        host_bytes,
        seconds,
        step,
        tokens_per_s_per_gpu,
        model_tflops,
        hardware_tflops,
        model_tflops * 1e12 / peak,
        hardware_tflops * 1e12 / peak,
    )


# ---------------------------------------------------------------- the search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_layout(text: str) -> dict:
    """`tp=8,cp=2,pp=4,vp=2,dp=2,mbs=1,recompute=selective,zero=1` -> fields of Layout (any subset)."""
    names = {"mbs": "micro_batch_size", "micro_batch_size": "micro_batch_size"}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key = names.get(key.strip(), key.strip())
        if key not in ("tp", "cp", "pp", "vp", "dp", "micro_batch_size", "recompute", "zero", "offload") or not value:
            raise ConfigError(f"--layout item {item!r} is not tp|cp|pp|vp|dp|mbs|recompute|zero|offload=VALUE")
        if key in fields:
            raise ConfigError(f"--layout gives {item.partition('=')[0].strip()} twice; give each key once")
        value = value.strip()
        if key in ("recompute", "offload"):
            if value not in (RECOMPUTE if key == "recompute" else ("none", "cpu")):
                raise ConfigError(
                    f"--layout {key}={value}: expected one of {RECOMPUTE if key == 'recompute' else 'none, cpu'}"
                )
            fields[key] = value
        else:
            if key == "zero" and value not in ("0", "1", "2", "3"):
                raise ConfigError(f"--layout zero={value}: ZeRO stages are 0, 1, 2 and 3")
            if not value.isdigit() or int(value) < 1 and key != "zero":
                raise ConfigError(f"--layout {key}={value}: expected a positive integer")
            fields[key] = int(value)
    return fields


def candidates(config: LoomConfig, gpus: int, hw: Hardware, fixed: dict | None = None) -> list[Layout]:
    """Every layout of `gpus` GPUs that divides the model and the batch and that loom's schedules accept; the
    keys in `fixed` are held."""
    m, t, fixed = config.model, config.train, fixed or {}

    def choices(key: str, values) -> list:
        return [fixed[key]] if key in fixed else list(values)

    tps = [tp for tp in choices("tp", _divisors(hw.gpus_per_node)) if m.num_heads % tp == 0]
    tps = [tp for tp in tps if m.num_kv_heads % tp == 0 and m.ffn_hidden_size % tp == 0 and gpus % tp == 0]
    # context parallelism where loom runs it (rotary positions, no dropout, 2 x cp chunks per sequence)
    cps = [cp for cp in choices("cp", (1, 2, 4, 8)) if m.context_parallel_refusal(cp, t.seq_length) is None]
    zeros = [zero for zero in choices("zero", (0, 1, 2, 3)) if config.zero_refusal(zero) is None]
    found = []
    for tp, cp in itertools.product(tps, cps):
        if tp > 1 and (t.seq_length // cp) % tp:  # sequence parallelism splits this rank's share over TP
            continue
        for pp in choices("pp", _divisors(m.num_layers)):
            if gpus % (tp * cp * pp) or m.num_layers % pp:
                continue
            dp = gpus // (tp * cp * pp)
            if fixed.get("dp", dp) != dp:
                continue
            for vp in choices("vp", _divisors(m.num_layers // pp) if pp > 1 else [1]):
                if m.num_layers % (pp * vp) or (vp > 1 and pp == 1):
                    continue
                for mbs in choices("micro_batch_size", (1, 2, 4, 8)):
                    if t.global_batch_size % (mbs * dp):
                        continue
                    microbatches = t.global_batch_size // (mbs * dp)
                    if vp > 1 and microbatches % pp:
                        continue
                    for recompute, zero, offload in itertools.product(
                        choices("recompute", RECOMPUTE), zeros, choices("offload", ("none",))
                    ):
                        found.append(Layout(tp, pp, vp, dp, mbs, recompute, zero, offload, cp=cp))
    return found


def plan(
    config: LoomConfig, gpus: int, hw: Hardware, fixed: dict | None = None, engine: Engine = LOOM
) -> list[Estimate]:
    """Every candidate layout's estimate, the fitting ones first, fastest first."""
    estimates = [estimate(config, layout, hw, engine) for layout in candidates(config, gpus, hw, fixed)]
    # Fitting layouts fastest first; then the others nearest to fitting first (they say why not).
    return sorted(
        estimates,
        key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu if e.fits else e.memory["total"], e.memory["total"]),
    )


# ---------------------------------------------------------------- output


def gpu_kind(device_name: str) -> str | None:
    """The tools/gpus.toml kind of a CUDA device name (torch.cuda.get_device_name()), or None if unknown."""
    name = device_name.upper()
    for needle, kind in (("H100 PCIE", "h100-pcie"), ("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100")):
        if needle in name:
            return kind if kind != "a100" else ("a100-80gb" if "80G" in name else "a100-40gb")
    return None


def predicted_line(config: LoomConfig, gpu: str | None) -> tuple[str, Estimate]:
    """What `loom train` and `loom submit` say before starting: memory per GPU, and on a known GPU the speed."""
    e = estimate(config, layout_of(config), load_hardware(gpu or "h100-sxm"))
    m = {k: v / GB for k, v in e.memory.items()}
    if config.lora.enabled:  # the base's weights only: no gradients or optimizer state outside the adapters
        m["total"] -= m["grads"] + m["optimizer"]
        m["grads"] = m["optimizer"] = 0.0
    line = (
        f"plan: {m['total']:.2f} GB per GPU predicted (weights {m['params']:.2f}, gradients {m['grads']:.2f}, "
        f"optimizer {m['optimizer']:.2f}, activations {m['activations']:.2f}, other {m['other']:.2f})"
    )
    if gpu:
        line += f"; on {gpu}: {e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {e.mfu:.0%}" + (
            "" if e.fits else f"; does not fit: {e.reason} (loom plan suggests layouts that do)"
        )
    return line, e


def table(estimates: list[Estimate], gpu: str) -> str:
    """The estimates as a table a person reads at a glance (memory in GB per GPU, time in s per step)."""
    width = max(len(e.layout.describe()) for e in estimates)
    host = any(e.host_bytes for e in estimates)  # an offloaded optimizer's state, in the node's memory
    head = (
        f"{'layout':<{width}} {'fits':>4} | {'GB/GPU':>6} = {'param':>5} {'grad':>5} {'optim':>5} {'activ':>5} "
        f"{'other':>5} |{' host GB |' if host else ''} {'step s':>8} = {'comp':>8} {'tp':>5} {'dp':>5} "
        f"{'bubbl':>5} {'p2p':>5} {'other':>6} | {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5} {'HFU':>5}"
    )
    lines = [head, "-" * len(head)]
    for e in estimates:
        mem, sec = {k: v / GB for k, v in e.memory.items()}, e.seconds
        lines.append(
            f"{e.layout.describe():<{width}} {'yes' if e.fits else 'no':>4} | {mem['total']:6.1f} = "
            f"{mem['params']:5.1f} {mem['grads']:5.1f} {mem['optimizer']:5.1f} {mem['activations']:5.1f} "
            f"{mem['other']:5.1f} |{f' {e.host_bytes / GB:7.1f} |' if host else ''} {e.step_seconds:8.3f} = "
            f"{sec['compute']:8.3f} {sec['tp']:5.3f} {sec['dp']:5.3f} {sec['bubble']:5.3f} "
            f"{sec['p2p'] + sec['cp']:5.3f} {sec['other']:6.3f} | "
            f"{e.tokens_per_s_per_gpu:9,.0f} {e.model_tflops_per_gpu:7.1f} {e.mfu:5.1%} {e.hfu:5.1%}"
        )
    lines.append(
        f"{gpu}: MFU and HFU against the dense datasheet peak; HFU counts recompute; p2p includes context "
        "parallelism's ring; other: the step's fixed overhead and an offloaded optimizer's transfers (docs/planner.md)."
    )
    return "\n".join(lines)


def plot(estimates: list[Estimate], path: Path) -> None:
    """Stacked bars of the memory and the step-time breakdown of `estimates`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loom.tools.charts import save_chart

    labels = [e.layout.describe().replace(" recompute=", "\nrecompute=") for e in estimates]
    figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(14, 1.2 + 0.7 * len(estimates)))
    for axis, parts, scale, unit in (
        (memory_axis, ("params", "grads", "optimizer", "activations", "other"), 1 / GB, "GB per GPU"),
        (time_axis, ("compute", "tp", "dp", "bubble", "p2p", "other"), 1.0, "seconds per step"),
    ):
        left = [0.0] * len(estimates)
        for part in parts:
            values = [(e.memory if axis is memory_axis else e.seconds)[part] * scale for e in estimates]
            axis.barh(range(len(estimates)), values, left=left, label=part)
            left = [a + b for a, b in zip(left, values, strict=True)]
        axis.set_yticks(range(len(estimates)), labels if axis is memory_axis else [""] * len(estimates), fontsize=7)
        axis.invert_yaxis()
        axis.set_xlabel(unit)
        axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as `loom schedule --output` does
    save_chart(figure, Path(path), "plan")
    plt.close(figure)
