"""`loom plan`: which layout fits a model on a cluster and how fast it will run, before anything runs.

For a layout (tp, cp, pp, vp, dp, micro-batch size, recompute, ZeRO stage, offload) the planner works out the
memory per GPU, on the pipeline rank that holds the most (the first or the last stage): weights, gradients,
optimizer state and activations as loom lays them out (tools/plan_bytes.py, checked against loom on CPU); and
the time per step, term by term (tools/plan_time.py: compute, TP, CP, DP, bubble, p2p, offload). This module
assembles the two into an Estimate, searches the layouts of a cluster and prints them. The constants are
calibrated on Megatron-LM's published H100 weak-scaling table (tests/test_plan.py); docs/planner.md has the
equations and their blind spots.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig, ModelConfig, OptimConfig, field_choices
from loom.tools.plan_activations import layer_activation_bytes, rank_activation_bytes
from loom.tools.plan_bytes import (
    FP8_WEIGHT_COPIES,
    LOOM,
    Engine,
    Layout,
    blocks_compiled,
    fp8_weight_bytes,
    layout_of,
    model_state_bytes,
    zero3_gathered_elements,
)
from loom.tools.plan_time import GB, Hardware, StepShape, TokenFlops, load_hardware, step_seconds

RECOMPUTE = field_choices(ModelConfig, "recompute")
OFFLOAD = field_choices(OptimConfig, "offload")


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
            "ep": lay.ep,
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


def estimate(config: LoomConfig, lay: Layout, hw: Hardware, engine: Engine = LOOM) -> Estimate:
    """Memory and step time of `config` under `lay` on `hw` GPUs (config.train: batch, sequence, precision)."""
    memory, host_bytes = _memory_per_gpu(config, lay, engine)
    fits = memory["total"] <= hw.memory_usable_gb * GB
    reason = "" if fits else f"needs {memory['total'] / GB:.1f} GB of {hw.memory_usable_gb:g} GB usable"
    seconds = step_seconds(config, lay, hw, engine)
    step = sum(seconds.values())
    t = config.train
    tokens_per_s_per_gpu = t.global_batch_size * t.seq_length / step / (lay.tp * lay.cp * lay.pp * lay.dp)
    flops = TokenFlops.of(config, lay)
    model_tflops = flops.model * tokens_per_s_per_gpu / 1e12
    hardware_tflops = flops.hardware * tokens_per_s_per_gpu / 1e12
    peak = hw.peak_tflops[t.precision] * 1e12  # MFU's denominator, as loom train's: the training precision's
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


def _memory_per_gpu(config: LoomConfig, lay: Layout, engine: Engine) -> tuple[dict[str, float], float]:
    """Bytes per GPU by kind (and the host's, for an offloaded optimizer) on the first pipeline rank (embedding,
    the most micro-batches in flight) or the last (output layer, logits), whichever holds more; the middle ranks
    hold less than the first."""
    m, t = config.model, config.train
    shape = StepShape.of(config, lay)
    memory: dict[str, float] = {}
    for pp_rank in sorted({0, lay.pp - 1}):
        state = model_state_bytes(m, lay, pp_rank, t.precision, shape.bucket_bytes, config.optim.name, shape.grad_bytes)
        rank_memory = {
            "params": state["params"],
            "grads": state["grads"],
            "optimizer": state["optimizer"],
            "activations": rank_activation_bytes(config, lay, pp_rank, engine),
            "other": _transient_bytes(config, lay, pp_rank, engine, shape),
        }
        if sum(rank_memory.values()) > sum(memory.values()):
            memory, host_bytes = rank_memory, state["host"]
    memory["total"] = sum(memory.values())
    return memory, host_bytes


def _transient_bytes(config: LoomConfig, lay: Layout, pp_rank: int, engine: Engine, shape: StepShape) -> float:
    """What is alive only during part of the step: buckets being reduced, a recomputed layer's activations, FP8
    weight copies and ZeRO-3's gathered weights."""
    m, t = config.model, config.train
    transient = 2 * shape.bucket_bytes if lay.zero >= 2 else 0  # ZeRO-2's (and 3's) buckets being reduced
    if lay.recompute == "full":  # the layer being recomputed holds its activations during its backward
        transient += max(
            layer_activation_bytes(
                block,  # a dense block's or an expert one's, the larger (model.moe_dense_layers)
                shape.local,
                lay.micro_batch_size,
                lay.tp,
                lay.sp,
                "none",
                shape.element,
                engine,
                t.fp8 != "off",
                blocks_compiled(config, engine),
            )
            for block in m.block_configs()
        )
    # The FP8 copies of this rank's weights, cast once per step; under ZeRO-3 each call casts the gathered
    # weight, so only the computing block's two copies (and the output layer's) are alive at once.
    if t.fp8 != "off":  # (ZeRO-3 runs loom's own FP8 linears: LoomConfig.zero_refusal)
        fp8_layers = 1 if lay.zero == 3 else m.num_layers // lay.pp
        transient += FP8_WEIGHT_COPIES[t.fp8] * fp8_weight_bytes(m, lay.tp) * fp8_layers
    if t.fp8_output_layer and pp_rank == lay.pp - 1:  # and of the output weight (loom's own FP8 linear)
        transient += FP8_WEIGHT_COPIES["current"] * shape.vocab * m.hidden_size
    if lay.zero == 3 and lay.replicas > 1:  # gathered whole: the block computing, the one prefetched, and the
        # weights outside the blocks (gathered for the chunk's whole forward and backward)
        transient += (
            zero3_gathered_elements(m, lay, pp_rank, max(1, shape.bucket_bytes // shape.grad_bytes)) * shape.element
        )
    return transient


# ---------------------------------------------------------------- the search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_layout(text: str) -> dict:
    """`tp=8,cp=2,pp=4,vp=2,dp=2,ep=2,mbs=1,recompute=selective,zero=1` -> fields of Layout (any subset)."""
    names = {"mbs": "micro_batch_size", "micro_batch_size": "micro_batch_size"}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key = names.get(key.strip(), key.strip())
        if (
            key not in ("tp", "cp", "pp", "vp", "dp", "ep", "micro_batch_size", "recompute", "zero", "offload")
            or not value
        ):
            raise ConfigError(f"--layout item {item!r} is not tp|cp|pp|vp|dp|ep|mbs|recompute|zero|offload=VALUE")
        if key in fields:
            raise ConfigError(f"--layout gives {item.partition('=')[0].strip()} twice; give each key once")
        value = value.strip()
        if key in ("recompute", "offload"):
            allowed = RECOMPUTE if key == "recompute" else OFFLOAD
            if value not in allowed:
                raise ConfigError(f"--layout {key}={value}: expected one of {', '.join(allowed)}")
            fields[key] = value
        else:
            if key == "zero" and value not in ("0", "1", "2", "3"):
                raise ConfigError(f"--layout zero={value}: ZeRO stages are 0, 1, 2 and 3")
            if not value.isdigit() or int(value) < 1 and key != "zero":
                raise ConfigError(f"--layout {key}={value}: expected a positive integer")
            fields[key] = int(value)
    return fields


def candidates(config: LoomConfig, gpus: int, hw: Hardware, fixed: dict | None = None) -> list[Layout]:
    """Every layout of `gpus` GPUs that divides the model and the batch and that loom's schedules accept (expert
    parallelism over the DP ranks that divide the experts); the keys in `fixed` are held."""
    m, t, fixed = config.model, config.train, fixed or {}

    def choices(key: str, values) -> list:
        return [fixed[key]] if key in fixed else list(values)

    tps = [tp for tp in choices("tp", _divisors(hw.gpus_per_node)) if m.num_heads % tp == 0]
    widths = (m.ffn_hidden_size, m.moe_ffn_hidden_size or m.ffn_hidden_size)
    tps = [tp for tp in tps if m.num_kv_heads % tp == 0 and all(w % tp == 0 for w in widths) and gpus % tp == 0]
    # context parallelism where loom runs it (rotary positions, no dropout, 2 x cp chunks per sequence)
    cps = [cp for cp in choices("cp", (1, 2, 4, 8)) if m.context_parallel_refusal(cp, t.seq_length) is None]
    zeros = [zero for zero in choices("zero", (0, 1, 2, 3)) if config.zero_refusal(zero, ep=1) is None]

    def expert_parallel(dp: int) -> list[int]:
        return [
            ep for ep in choices("ep", _divisors(dp)) if dp % ep == 0 and config.expert_parallel_refusal(ep) is None
        ]

    offloads = [offload for offload in choices("offload", ("none",)) if config.optim.offload_refusal(offload) is None]
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
                    settings = itertools.product(choices("recompute", RECOMPUTE), zeros, offloads, expert_parallel(dp))
                    for recompute, zero, offload, ep in settings:
                        if config.zero_refusal(zero, ep) is None:  # (ZeRO-3 takes no expert parallelism)
                            found.append(Layout(tp, pp, vp, dp, mbs, recompute, zero, offload, cp=cp, ep=ep))
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
    """The tools/gpus.toml kind of a CUDA device name (torch.cuda.get_device_name()), or None if unknown (a GH200:
    its memory is 96 or 144 GB, which the name does not say)."""
    name = device_name.upper()
    kinds = (
        ("H100 PCIE", "h100-pcie"),
        ("H100 NVL", "h100-nvl"),
        ("H200 NVL", "h200-nvl"),
        ("GH200", None),
        ("H200", "h200"),
        ("H100", "h100-sxm"),
        ("A100", "a100"),
    )
    for needle, kind in kinds:
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
            f"{sec['p2p'] + sec['cp'] + sec['ep']:5.3f} {sec['other']:6.3f} | "
            f"{e.tokens_per_s_per_gpu:9,.0f} {e.model_tflops_per_gpu:7.1f} {e.mfu:5.1%} {e.hfu:5.1%}"
        )
    lines.append(
        f"{gpu}: MFU and HFU against the dense datasheet peak; HFU counts recompute; p2p includes context "
        "parallelism's ring and expert parallelism's all-to-alls; other: the step's fixed overhead and an offloaded "
        "optimizer's transfers (docs/planner.md)."
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
