"""`loom plan`: which layout fits a model on a cluster and how fast it will run, before anything runs.

For a layout (tp, pp, vp, dp, micro-batch size, recompute, ZeRO stage, offload) the planner works out:

Memory per GPU, on the pipeline rank that holds the most (the first or the last stage):
- parameters, gradients and optimizer state from the parameters that rank holds, exactly as loom lays them out:
  its TP shard of each of its chunks' weights (vocabulary padded to 128 x tp), replicated norms whole, the
  gradient buffer's buckets padded to multiples of dp (engine/optim/grad_buffer.plan_buckets), and the ZeRO
  formulas of Rajbhandari et al. 2020: bf16 Adam keeps 2 B of weight, 4 B of fp32 gradient and 12 B of fp32
  master and moments per parameter; ZeRO 1 divides the 12 by dp, ZeRO 2 the gradient too, ZeRO 3 the weight
  too (6 + 12/d, 2 + 16/d, 18/d); optimizer offload moves the 12 to the host, beside a gradient copy.
- activations: what one micro-batch of one layer saves for backward (Korthikanti et al. 2022, section 4, term by
  term for loom's layers: grouped-query attention and SwiGLU change the 34 + 5as/h of the paper; sequence
  parallelism divides the norm inputs by tp; selective recompute keeps the attention's inputs and output but not
  its internals; full recompute only each layer's input), times the micro-batches in flight on the rank
  (loom's schedule's warm-up: 1F1B min(pp - rank, m) ...), plus on the last rank the output layer's input and
  logits; memory is that of the first or the last pipeline rank, whichever holds more.

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

import collections
import dataclasses
import functools
import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig, ModelConfig
from loom.engine.flops import PEAK_TFLOPS, model_flops_per_token
from loom.engine.model import naming
from loom.engine.optim.buckets import plan_buckets
from loom.engine.parallel.vocab import padded_vocab_size
from loom.engine.pipeline.schedules import warmup_forwards

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


def tp_collectives_per_layer(lay: Layout, engine: Engine = LOOM) -> dict[str, int]:
    """Tensor-parallel collectives of s x b x h activations one layer runs per micro-batch: 2 forward (after the
    attention projection and FC2) and their 2 gradients backward (Shoeybi et al. 2019), each an all-reduce or,
    under sequence parallelism, an all-gather and a reduce-scatter; full recompute runs the forward's again (loom:
    both all-gathers but only the first reduce-scatter or all-reduce, as the ledger records)."""
    again = lay.recompute == "full"
    if lay.sp:
        return {"all_gather": 4 + 2 * again, "reduce_scatter": 4 + (1 if engine.recompute_stops_early else 2) * again}
    return {"all_reduce": 4 + (1 if engine.recompute_stops_early else 2) * again}


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


# ---------------------------------------------------------------- parameters, as loom lays them out


@dataclass(frozen=True)
class _Param:
    """A stand-in parameter for plan_buckets: its local element count."""

    size: int
    deferred: bool = False
    unit: int | str = ""
    """ZeRO-3's gather unit (naming.gather_unit): the block's index, or before / after the blocks."""

    def numel(self) -> int:
        return self.size


def _block_parameters(m: ModelConfig, tp: int, sequence_parallel: bool) -> list[_Param]:
    """One transformer block's parameters on one TP rank, in loom's construction order (transformer.py)."""
    h, hd = m.hidden_size, m.head_dim
    q, kv, f = m.num_heads * hd, m.num_kv_heads * hd, m.ffn_hidden_size
    fc1 = 2 * f if m.activation == "swiglu" else f
    norm = [_Param(h, sequence_parallel)] + ([_Param(h, sequence_parallel)] if m.norm == "layernorm" else [])
    out = [*norm, _Param(h * (q + 2 * kv) // tp)]
    out += [_Param((q + 2 * kv) // tp)] if m.bias else []
    out += [_Param(q * h // tp)] + ([_Param(h, sequence_parallel)] if m.bias else [])
    out += [*norm, _Param(h * fc1 // tp)] + ([_Param(fc1 // tp)] if m.bias else [])
    out += [_Param(f * h // tp)] + ([_Param(h, sequence_parallel)] if m.bias else [])
    return out


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
            params.append(_Param(vocab * m.hidden_size, tied_across, before))
            if m.position_embedding == "learned":
                params.append(_Param(m.max_position_embeddings * m.hidden_size, sp, before))
        for layer in range(stage * per_chunk, (stage + 1) * per_chunk):
            params += [dataclasses.replace(q, unit=layer) for q in _block_parameters(m, lay.tp, sp)]
        if stage == stages - 1:
            params += [_Param(m.hidden_size, sp, after)] * (2 if m.norm == "layernorm" else 1)
            if not (m.tie_embeddings and stages == 1):
                params.append(_Param(vocab * m.hidden_size, tied_across, after))
    return params


def _buffer(params: list[_Param], dp: int, bucket_bytes: int, grad_bytes: int, zero: int) -> tuple[int, int]:
    """(elements of the padded gradient buffer, of which the deferred range) as GradBuffer plans them."""
    ordered = list(reversed(params))
    regular = [p for p in ordered if not p.deferred]
    deferred = [p for p in ordered if p.deferred]
    numel = max(1, bucket_bytes // grad_bytes)
    unit_of = (lambda q: q.unit) if zero == 3 else None
    end = plan_buckets(regular, numel, dp, unit_of=unit_of)[2] if regular else 0
    total = plan_buckets(deferred, numel, dp, end)[2] if deferred else end
    return total, total - end


@functools.lru_cache(maxsize=4096)
def _rank_buffer(
    model: tuple, lay: Layout, pp_rank: int, bucket_bytes: int, grad_bytes: int = 4
) -> tuple[int, int, int]:
    """(parameters, padded buffer elements, deferred elements) of one rank: cached, a search asks often."""
    m = ModelConfig(**dict(zip(_MODEL_FIELDS, model, strict=True)))
    params = rank_parameters(m, lay, pp_rank)
    return (sum(p.size for p in params), *_buffer(params, lay.replicas, bucket_bytes, grad_bytes, lay.zero))


def zero3_gathered_elements(m: ModelConfig, lay: Layout, pp_rank: int, bucket_numel: int) -> int:
    """Weights ZeRO-3 holds gathered at its peak on pipeline rank `pp_rank` (engine/optim/param_shards.py): the
    two largest blocks (the one computing and the one prefetched) and the weights before and after the blocks,
    as padded buckets; deferred parameters are whole anyway."""
    params = rank_parameters(m, dataclasses.replace(lay, micro_batch_size=1), pp_rank)
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
    one rank of pipeline rank `pp_rank`: equal to what loom allocates (tests/test_plan.py). A bf16 gradient
    buffer's shard is also copied to fp32 for the optimizer's step, after backward: not at the peak counted."""
    layout = dataclasses.replace(lay, micro_batch_size=1, recompute="none")  # what the parameters depend on
    count, total, deferred = _rank_buffer(_model_key(m), layout, pp_rank, bucket_bytes, grad_bytes)
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
    moments = {"adamw": 2, "lamb": 2, "sgd": 1, "adafactor": 2}[optimizer]
    # fp32 weights are their own master, unless the optimizer holds a shard of them or holds them on the host
    master = 0 if precision == "fp32" and lay.zero == 0 and lay.offload == "none" else 1
    sharded = total // replicas if lay.zero >= 1 else count
    state = 4 * (master + moments) * sharded
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

    loom's native block, term by term (measured equal on CPU, tests/test_plan.py), per token: each of the two
    norms keeps its fp32 input, normalised input and 1/rms (8h + 4 bytes; sequence-sharded under sequence
    parallelism); the QKV and FC1 GEMMs keep their input (h, all-gathered under sequence parallelism); attention
    keeps the QKV output, rotated q and k, its output and a log-sum-exp per head (fp32); the SwiGLU MLP keeps
    FC1's output, silu(gate) and FC2's input (4 x ffn; GELU: 2 x ffn); all split by tp. Selective recompute drops
    what the attention core alone keeps (the log-sum-exp: loom's kernels never keep the s x s scores), full
    recompute keeps only the block's input. Under `fp8` the four GEMMs keep FP8 copies of their inputs (1 byte):
    the attention projection's beside the attention output, which the attention kernel keeps unless selective
    recompute reruns it. `engine` MEGATRON uses Korthikanti et al. 2022's published s b h (34 / t) with sequence
    parallelism (their 5 a s / h score term is gone with flash attention); under FP8 its GEMM inputs (2 + 2 + 2 +
    8 of the 34) take half.

    `compiled` (model.compile, the CUDA default): what inductor's partitioner keeps of the same block (measured
    equal on CPU): the residual stream in the compute dtype before and after attention and each norm's
    statistics (sequence-sharded under sequence parallelism), not the norms' fp32 input and output, which
    backward recomputes from them; the two normed GEMM inputs (under FP8 not at all, they are recomputed and
    quantised again, except the all-gathered FP8 copies under sequence parallelism); attention as eager; the MLP
    keeps FC1's output and FC2's input (FP8: FC1's output only). Full recompute keeps the block's input either way."""
    h, hd = m.hidden_size, m.head_dim
    q, kv, f, heads = m.num_heads * hd, m.num_kv_heads * hd, m.ffn_hidden_size, m.num_heads
    tokens = seq * mbs
    sequence_share = 1 / tp if sp else 1
    if recompute == "full":
        return tokens * h * sequence_share * element
    if not engine.gathered_inputs_saved:  # Megatron-LM: Korthikanti's count
        per_token = h * (34 / tp if sp else 10 + 24 / tp) * element / 2
        return tokens * per_token * ((34 - 7) / 34 if fp8 else 1)
    fc1_output = 2 * f if m.activation == "swiglu" else f
    if compiled:
        residual = 2 * (h * element + _norm_statistics_bytes(m)) * sequence_share
        gemm_inputs = (2 * h if sp else 0) if fp8 else 2 * h * element
        attention = ((q + 2 * kv) + (q + kv)) * element + (q * element + heads * 4 if recompute == "none" else 0)
        mlp = fc1_output * element + (0 if fp8 else f * element)
        return tokens * (residual + gemm_inputs + (attention + mlp) / tp)
    gemm_input = 1 if fp8 else element
    norms = 2 * (8 * h + 4) * sequence_share
    gemm_inputs = 2 * h * gemm_input
    attention_output = q * element if not (fp8 and recompute == "selective") else 0
    attention = ((q + 2 * kv) + q + kv) * element + attention_output + (q if fp8 else 0)
    attention = attention / tp + (heads * 4 / tp if recompute == "none" else 0)
    mlp = ((fc1_output + f if m.activation == "swiglu" else f) * element + f * gemm_input) / tp
    return tokens * (norms + gemm_inputs + attention + mlp)


def _norm_statistics_bytes(m: ModelConfig) -> int:
    """Per token, what a compiled norm keeps besides its input: 1/rms (RMSNorm) or the mean and 1/std, in fp32."""
    return 4 if m.norm == "rmsnorm" else 8


def blocks_compiled(config: LoomConfig, engine: Engine = LOOM) -> bool:
    """Whether the planned run's blocks are torch.compile'd: model.compile on a GPU over loom's native kernels
    (with Transformer Engine they run eagerly; the planner assumes native unless model.kernels = te)."""
    m, native = config.model, config.model.kernels != "te" and config.train.fp8 != "delayed"
    return engine.gathered_inputs_saved and native and m.compiles_on(cuda=True)


FP8_WEIGHT_COPIES = {"current": 2, "delayed": 1}
"""FP8 copies of each GEMM weight kept through a step, by train.fp8: loom's own FP8 linears (current scaling,
engine/model/fp8.py's WeightCast) keep a row- and a column-major one; Transformer Engine's (delayed) one, as
the NeMo FP8 runs the planner is checked against are counted."""


def fp8_weight_bytes(m: ModelConfig, tp: int) -> int:
    """Bytes of one FP8 copy of one layer's GEMM weights, cast once per step and kept for every micro-batch's
    forward and backward (FP8_WEIGHT_COPIES says how many copies)."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
    return (h * (q + 2 * kv) + q * h + h * fc1 + m.ffn_hidden_size * h) // tp


def fp8_quantised_elements(m: ModelConfig, tp: int) -> int:
    """Elements of GEMM operands one rank quantises per token and layer and micro-batch (loom's FP8 linears,
    weights aside: they are cast once per step): the four GEMMs' inputs in forward (QKV's and FC1's whole, as
    gathered under sequence parallelism; the projection's and FC2's 1/tp shard) and their output gradients in
    backward (the projection's and FC2's whole)."""
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.ffn_hidden_size
    fc1 = 2 * f if m.activation == "swiglu" else f
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
    fp32 input, normalised input and 1/rms (compiled: its input in the compute dtype and its statistics;
    sequence-sharded under sequence parallelism), the output GEMM's gathered input (1 byte under
    train.fp8_output_layer) and the logits of this rank's vocabulary slice (measured on CPU, tests/test_plan.py).
    The schedule runs the last chunk's backward right after its forward, so one micro-batch of them is alive."""
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, tp) // tp
    norm = m.hidden_size * element + _norm_statistics_bytes(m) if compiled else 8 * m.hidden_size + 4
    norm /= tp if sp else 1
    return seq * mbs * (norm + m.hidden_size * (1 if fp8_output else element) + vocab * element)


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


# ---------------------------------------------------------------- the estimate


def _ring_seconds(bytes_: float, ranks: int, bandwidth_gb_s: float, latency_us: float) -> float:
    """One ring all-gather or reduce-scatter of `bytes_` (the full tensor) over `ranks` GPUs."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / (bandwidth_gb_s * GB) + (ranks - 1) * latency_us * 1e-6


def _gemm_efficiency(hw: Hardware, smallest_dimension: float) -> float:
    e = hw.efficiency
    return e["gemm"] * smallest_dimension / (smallest_dimension + e["gemm_half_size"])


def cp_ring_transfers(m: ModelConfig, lay: Layout, local: int) -> tuple[int, int, int]:
    """(sends of keys and values in the compute dtype, sends of their gradients in fp32, elements each) of one
    layer's ring for one micro-batch on one CP rank (engine/parallel/context.py): the keys and values of this TP
    rank's KV heads go round cp - 1 times in forward, again in backward and again when recompute reruns the
    attention; their gradients cp times (the last hop takes them home). Each send has its receive."""
    kv = 2 * local * lay.micro_batch_size * m.num_kv_heads * m.head_dim // lay.tp
    passes = 2 + (lay.recompute != "none")
    return passes * (lay.cp - 1), lay.cp, kv


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
        if t.fp8 != "off":  # the FP8 copies of this rank's weights, cast once per step
            transient += FP8_WEIGHT_COPIES[t.fp8] * fp8_weight_bytes(m, lay.tp) * (m.num_layers // lay.pp)
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
    activation_share = 1 / lay.tp if lay.sp else 1
    tokens_per_replica = t.global_batch_size * seq / lay.replicas
    streamed = tokens_per_replica * (
        e["elementwise_passes"] * m.hidden_size * activation_share * m.num_layers / lay.pp
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
    stage_params = max(
        _rank_buffer(_model_key(m), dataclasses.replace(lay, micro_batch_size=1, recompute="none"), r, bucket_bytes)[0]
        for r in {0, lay.pp - 1}
    )
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
            for count, total, _ in (
                _rank_buffer(
                    _model_key(m),
                    dataclasses.replace(lay, micro_batch_size=1, recompute="none"),
                    r,
                    bucket_bytes,
                    grad_bytes,
                )
                for r in {0, lay.pp - 1}
            )
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
                        choices("recompute", RECOMPUTE), choices("zero", (0, 1, 2, 3)), choices("offload", ("none",))
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


def layout_of(config: LoomConfig) -> Layout:
    """The Layout a resolved config trains with."""
    p, o = config.parallel, config.optim
    return Layout(
        p.tp, p.pp, p.vp, p.dp, config.train.micro_batch_size, config.model.recompute, o.zero, o.offload,
        p.sequence_parallel, p.cp,
    )  # fmt: skip


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
    head = (
        f"{'layout':<{width}} {'fits':>4} | {'GB/GPU':>6} = {'param':>5} {'grad':>5} {'optim':>5} {'activ':>5} "
        f"{'other':>5} | {'step s':>7} = {'comp':>6} {'tp':>5} {'dp':>5} {'bubbl':>5} {'p2p':>5} | "
        f"{'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5} {'HFU':>5}"
    )
    lines = [head, "-" * len(head)]
    for e in estimates:
        mem, sec = {k: v / GB for k, v in e.memory.items()}, e.seconds
        lines.append(
            f"{e.layout.describe():<{width}} {'yes' if e.fits else 'no':>4} | {mem['total']:6.1f} = "
            f"{mem['params']:5.1f} {mem['grads']:5.1f} {mem['optimizer']:5.1f} {mem['activations']:5.1f} "
            f"{mem['other']:5.1f} | {e.step_seconds:7.3f} = {sec['compute']:6.3f} {sec['tp']:5.3f} {sec['dp']:5.3f} "
            f"{sec['bubble']:5.3f} {sec['p2p'] + sec['cp']:5.3f} | "
            f"{e.tokens_per_s_per_gpu:9,.0f} {e.model_tflops_per_gpu:7.1f} "
            f"{e.mfu:5.1%} {e.hfu:5.1%}"
        )
    lines.append(f"{gpu}: MFU and HFU against the dense datasheet peak; HFU counts recompute (docs/planner.md).")
    return "\n".join(lines)


def plot(estimates: list[Estimate], path: Path) -> None:
    """Stacked bars of the memory and the step-time breakdown of `estimates`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------- traffic, as loom's communication ledger counts it

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def step_traffic(config: LoomConfig, lay: Layout, pp_rank: int = 0) -> dict[tuple[str, str, str], int]:
    """Bytes one rank of pipeline rank `pp_rank` sends per step, by (group, op, dtype), counted as loom's
    communication ledger counts them (engine/comm_ledger.py: an all-gather's output, a reduce-scatter's input,
    else the tensor), all of it for AdamW and SGD: the data-parallel gradient and weight collectives of its ZeRO
    stage, tensor parallelism's all-reduces (sequence parallelism's all-gathers and reduce-scatters) and the
    vocabulary-parallel loss's statistics, the sequence-parallel and tied-embedding gradient sums, the pipeline's
    sends and receives, and the loss and gradient-norm sums."""
    m, t = config.model, config.train
    element, dtype = (4 if t.precision == "fp32" else 2), _DTYPE_NAMES[t.precision]
    grad_bytes, grad_dtype = GRAD_BYTES[config.optim.grad_dtype], _DTYPE_NAMES[config.optim.grad_dtype]
    microbatches = t.global_batch_size // (lay.micro_batch_size * lay.dp)
    bucket_bytes = int(config.parallel.grad_bucket_mb * 2**20)
    stages = lay.pp * lay.vp
    chunks = [c * lay.pp + pp_rank for c in range(lay.vp)]
    traffic: dict[tuple[str, str, str], int] = collections.Counter()
    grad_group = "grad" if lay.cp > 1 else "dp"  # DP x CP (ParallelState.grad_group)
    if lay.replicas > 1:
        _, total, deferred = _rank_buffer(
            _model_key(m), dataclasses.replace(lay, micro_batch_size=1), pp_rank, bucket_bytes, grad_bytes
        )
        if lay.zero == 0:
            traffic[(grad_group, "all_reduce", grad_dtype)] += grad_bytes * total
        else:
            per_step = grad_bytes * ((total - deferred) * (microbatches if lay.zero >= 2 else 1) + deferred)
            traffic[(grad_group, "reduce_scatter", grad_dtype)] += per_step
            # ZeRO-3 gathers the sharded buckets for every micro-batch's forward and again for its backward,
            # and the whole (deferred) ones once after the step as ZeRO 1 and 2 gather everything
            gathered = 2 * microbatches * (total - deferred) + deferred if lay.zero == 3 else total
            traffic[(grad_group, "all_gather", dtype)] += element * gathered
        traffic[(grad_group, "all_reduce", "float32")] += 4  # the loss sum
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
        for op, count in tp_collectives_per_layer(lay).items():
            traffic[("tp", op, dtype)] += microbatches * (count * layers + ends) * activation
        if stages - 1 in chunks:  # the loss's max, sum of exponentials and target logit per token, in fp32
            traffic[("tp", "all_reduce", "float32")] += microbatches * 3 * tokens * 4
        if lay.sp:  # the norms' (and biases') partial gradients, summed over TP once per step
            params = rank_parameters(m, dataclasses.replace(lay, micro_batch_size=1), pp_rank)
            tied = _tied_embedding_elements(m, lay, chunks)
            traffic[("tp", "all_reduce", grad_dtype)] += grad_bytes * (sum(q.size for q in params if q.deferred) - tied)
    if lay.pp > 1:
        hidden = activation // (lay.tp if lay.sp else 1)
        # per micro-batch each chunk receives its input and sends its output forward, and receives the output's
        # gradient and sends the input's back: one send and one receive per neighbouring stage
        transfers = sum((stage > 0) + (stage < stages - 1) for stage in chunks)
        for op in ("send", "recv"):
            traffic[("pp", op, dtype)] += microbatches * transfers * hidden
        traffic[("pp", "all_reduce", "float32")] += 4  # the loss sum
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
