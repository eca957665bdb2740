"""The one place that chooses compute kernels: attention, norm, MLP activation, linear (BF16/FP8), optimizer.

`choose_kernels(config, device)` decides once per run, from model.kernels / model.compile /
train.fp8, from what imports and from what the device can do, and records why for each piece
(`Kernels.as_dict()`, printed at start-up and stored in metrics.jsonl). The model asks the result
for its pieces; the optimizer for its AdamW. Preference order:

  attention  Transformer Engine DotProductAttention > torch SDPA (flash / cuDNN / mem-efficient on CUDA, torch's
             choice unless model.attention_backend names one)
  norm       TE RMSNorm/LayerNorm > apex fused norm > torch native (torch.compile'd with model.compile)
  activation torch SwiGLU / GeGLU / GELU / squared ReLU (torch.compile'd with model.compile)
  linear     TE Linear (BF16, or FP8 under TE's autocast) > FP8 on torch._scaled_mm (train.fp8 = current,
             no TE) > torch F.linear
  optimizer  apex FusedAdam > torch AdamW fused=True (CUDA) > torch AdamW foreach (CPU)

model.kernels = native pins every piece to the PyTorch reference path (what CPU runs anyway);
te requires TE. Asking for what is unavailable (te, FP8) raises ConfigError with one line; auto
falls back and says why. transformer_engine and apex are imported here only inside functions, and
never on a machine without CUDA, so importing loom never imports them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from loom.engine.config import ConfigError, LoomConfig, ModelConfig
from loom.engine.model.compiling import BACKEND_VARIABLE, block_backend
from loom.engine.parallel.vocab import padded_vocab_size

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Choice:
    impl: str
    """What runs, e.g. "torch.sdpa", "te.Linear+fp8(delayed)", "apex.FusedAdam"."""
    why: str
    """Why it was chosen (and why the faster options were not)."""


def probe_import(module: str) -> tuple[object | None, str]:
    """Import `module`, or say in one phrase why it cannot be: missing, or installed but broken
    (a wrong CUDA or torch build raises ImportError, OSError or RuntimeError from inside)."""
    try:
        return importlib.import_module(module), f"{module}: imported"
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is None or error.name == top or module.startswith(error.name + "."):
            return None, f"{top}: not installed (ModuleNotFoundError)"
        return None, f"{top}: import failed (ModuleNotFoundError: {error})"
    except Exception as error:  # noqa: BLE001 -- any failure inside an optional package means "not usable"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{module.split('.')[0]}: import failed ({type(error).__name__}: {first_line})"


def _installed(module: str) -> bool:
    """Whether a top-level package is installed, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fp8_device_support(device: torch.device, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether FP8 GEMMs can run on `device` (capability: its CUDA compute capability)."""
    if device.type != "cuda" or capability is None:
        return False, "fp8: no CUDA device"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return False, f"fp8: needs compute capability >= 8.9, got {capability[0]}.{capability[1]}"
    return True, f"fp8: compute capability {capability[0]}.{capability[1]}"


def _package(name: str, probe_module: str, mode: str, cuda: bool) -> tuple[bool, str]:
    """Whether an optional CUDA package may be used under model.kernels = mode, and why (not)."""
    if mode == "native":
        return False, f"{name}: off (model.kernels = native)"
    if not cuda:
        return False, (
            f"{name}: installed, but no CUDA device"
            if _installed(name)
            else f"{name}: not installed (ModuleNotFoundError)"
        )
    module, why = probe_import(probe_module)
    return module is not None, why


# -- the native functions (the reference path: exactly the ops of the original model) ----------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    return F.relu(h).square()


ACTIVATIONS = {"swiglu": swiglu, "geglu": geglu, "gelu": gelu, "squared_relu": squared_relu}
"""model.activation's functions: swiglu and geglu take the gate and up halves of FC1's output, the others FC1's
output."""


def _apex_norm(kind: str) -> Callable:
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    if kind == "rmsnorm":
        return lambda x, weight, bias, eps: fused_rms_norm_affine(x, weight, x.shape[-1:], eps)
    return lambda x, weight, bias, eps: fused_layer_norm_affine(x, weight, bias, x.shape[-1:], eps)


def build_adamw(
    param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float, impl: str
) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, per-group weight_decay) in the chosen implementation."""
    if impl == "apex.FusedAdam":
        from apex.optimizers import FusedAdam

        return FusedAdam(param_groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    if impl == "torch.AdamW(fused)":
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=True)
    # foreach gives bit-identical updates to torch's for-loop AdamW on CPU (tests/test_kernels.py)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, foreach=True)


def default_adamw(device: torch.device) -> str:
    return "torch.AdamW(fused)" if device.type == "cuda" else "torch.AdamW(foreach)"


class Kernels:
    """The implementations chosen for a run, why, and the factories the model builds its pieces with."""

    def __init__(
        self,
        attention: Choice,
        norm: Choice,
        activation: Choice,
        linear: Choice,
        optimizer: Choice,
        fp8: str = "off",
        params_dtype: torch.dtype = torch.float32,
        fp8_output_layer: bool = False,
        fp8_weight_copies: bool = True,
    ):
        self.attention, self.norm, self.activation = attention, norm, activation
        self.linear, self.optimizer, self.fp8 = linear, optimizer, fp8
        self.params_dtype = params_dtype
        self.fp8_output_layer = fp8_output_layer
        """The output layer's GEMMs on torch._scaled_mm too (train.fp8_output_layer), whatever runs the blocks'."""
        self.fp8_weight_copies = fp8_weight_copies
        """Whether the torch._scaled_mm layers keep FP8 copies of their weights from one step to the next (not under
        ZeRO-3, whose weights are whole only while their block computes: each call quantises the gathered one)."""
        self._fp8_recipe = None

    @classmethod
    def native(cls) -> Kernels:
        """The PyTorch reference path, for models built without a choice (tests, tools)."""
        why = "reference path"
        return cls(
            Choice("torch.sdpa", why),
            Choice("torch.norm", why),
            Choice("torch.activation", why),
            Choice("torch.linear", why),
            Choice("torch.AdamW(foreach)", why),
        )

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {name: {"impl": c.impl, "why": c.why} for name, c in self.choices().items()}

    def choices(self) -> dict[str, Choice]:
        return {
            "attention": self.attention,
            "norm": self.norm,
            "activation": self.activation,
            "linear": self.linear,
            "optimizer": self.optimizer,
        }

    def summary(self) -> str:
        """One line: what runs, then the reasons that are not repeated."""
        picked = ", ".join(f"{name}={c.impl}" for name, c in self.choices().items())
        reasons = list(dict.fromkeys(part.strip() for c in self.choices().values() for part in c.why.split(";")))
        return f"kernels: {picked} ({'; '.join(reasons)})"

    # -- factories used by engine/model/transformer.py and gpt.py ------------------------------------
    @property
    def compiles_blocks(self) -> bool:
        """model.compile over native PyTorch kernels: each transformer block is compiled whole (norms, rotary,
        attention, SwiGLU, residuals and the TP collectives between them), not only its element-wise pieces.
        Transformer Engine and apex modules stay outside torch.compile."""
        native = not any(
            c.impl.startswith(("te.", "apex.")) for c in self.choices().values() if c is not self.optimizer
        )
        return native and self.norm.impl.startswith("torch.compile")

    @property
    def uses_te_norm(self) -> bool:
        return self.norm.impl.startswith("te.")

    def norm_function(self, kind: str) -> Callable:
        """f(x, weight, bias, eps) for loom's Norm module (not used when TE provides the norm)."""
        if self.norm.impl.startswith("apex."):
            return _apex_norm(kind)
        function = rms_norm if kind == "rmsnorm" else layer_norm
        return torch.compile(function) if self.norm.impl.startswith("torch.compile") else function

    def activation_function(self, activation: str) -> Callable:
        function = ACTIVATIONS[activation]
        return torch.compile(function) if self.activation.impl.startswith("torch.compile") else function

    def column_linear(
        self,
        in_features: int,
        out_blocks: tuple[int, ...],
        tp_group,
        *,
        bias: bool,
        init_std: float,
        sequence_parallel: bool,
    ) -> torch.nn.Module:
        if self.linear.impl.startswith("te."):
            from loom.engine.model import te

            return te.column_parallel_linear(
                in_features,
                out_blocks,
                tp_group,
                bias=bias,
                init_std=init_std,
                sequence_parallel=sequence_parallel,
                params_dtype=self.params_dtype,
            )
        from loom.engine.model.fp8 import Fp8ColumnParallelLinear
        from loom.engine.parallel.layers import ColumnParallelLinear

        cls = Fp8ColumnParallelLinear if self.uses_scaled_mm else ColumnParallelLinear
        return cls(in_features, out_blocks, tp_group, bias=bias, init_std=init_std, sequence_parallel=sequence_parallel)

    def row_linear(
        self, in_features: int, out_features: int, tp_group, *, bias: bool, init_std: float, sequence_parallel: bool
    ) -> torch.nn.Module:
        if self.linear.impl.startswith("te."):
            from loom.engine.model import te

            return te.row_parallel_linear(
                in_features,
                out_features,
                tp_group,
                bias=bias,
                init_std=init_std,
                sequence_parallel=sequence_parallel,
                params_dtype=self.params_dtype,
            )
        from loom.engine.model.fp8 import Fp8RowParallelLinear
        from loom.engine.parallel.layers import RowParallelLinear

        cls = Fp8RowParallelLinear if self.uses_scaled_mm else RowParallelLinear
        return cls(
            in_features, out_features, tp_group, bias=bias, init_std=init_std, sequence_parallel=sequence_parallel
        )

    def te_norm(self, config: ModelConfig, sequence_parallel: bool) -> torch.nn.Module:
        from loom.engine.model import te

        return te.norm(config, sequence_parallel, self.params_dtype)

    def core_attention(self, config: ModelConfig, tp_group, sequence_parallel: bool) -> torch.nn.Module | None:
        """TE's fused attention module, or None: the block then calls SDPA itself."""
        if not self.attention.impl.startswith("te."):
            return None
        from loom.engine.model import te

        return te.dot_product_attention(config, tp_group, sequence_parallel)

    @property
    def uses_scaled_mm(self) -> bool:
        return self.linear.impl.startswith("torch._scaled_mm")

    def weights_updated(self, model_chunks: list[torch.nn.Module]) -> None:
        """The weights were initialised, loaded or stepped: remake what is derived from them, once (the FP8
        layers' weight copies, engine/model/fp8.py)."""
        if not (self.uses_scaled_mm or self.fp8_output_layer) or not self.fp8_weight_copies:
            return
        from loom.engine.model.fp8 import refresh_weight_casts

        refresh_weight_casts(model_chunks)

    def fp8_autocast(self, amax_group) -> contextlib.AbstractContextManager:
        """TE's FP8 region around one block's forward (entered again by a recomputed forward);
        a no-op for the torch._scaled_mm path, which quantises inside each layer."""
        if not (self.fp8 != "off" and self.linear.impl.startswith("te.")):
            return contextlib.nullcontext()
        from loom.engine.model import te

        if self._fp8_recipe is None:  # one recipe object per run: delayed scaling keys its history on it
            self._fp8_recipe = te.fp8_recipe(self.fp8)
        return te.fp8_autocast(self._fp8_recipe, amax_group)


class Fp8Unavailable(ConfigError):
    """train.fp8 cannot run with this config or device. `reason` is the message without its advice to the user of
    `loom train` (--train.fp8 off, ...), for the benches, which skip their FP8 rows and set train.fp8 themselves."""

    def __init__(self, reason: str, advice: str) -> None:
        super().__init__(f"{reason}; {advice}")
        self.reason = reason


def check_fp8_shapes(config: LoomConfig) -> None:
    """FP8 GEMMs (TE's and torch._scaled_mm) need every matrix dimension divisible by 16."""
    m, t, tp, cp = config.model, config.train, config.parallel.tp, config.parallel.cp
    tokens = "tokens per micro-batch (seq_length * micro_batch_size)"
    if cp > 1:  # each CP rank's GEMMs see its share of the sequence
        tokens = "tokens per micro-batch on a CP rank (seq_length / cp * micro_batch_size)"
    sizes = {
        "model.hidden_size": m.hidden_size,
        "query width per TP rank": m.num_heads * m.head_dim // tp,
        "key/value width per TP rank": m.num_kv_heads * m.head_dim // tp,
        "model.ffn_hidden_size per TP rank": m.ffn_hidden_size // tp,
        tokens: t.seq_length // cp * t.micro_batch_size,
    }
    if t.fp8_output_layer:
        padded = padded_vocab_size(m.vocab_size, m.make_vocab_divisible_by, tp)
        sizes["the padded vocabulary per TP rank"] = padded // tp
    for what, size in sizes.items():
        if size % 16:
            raise Fp8Unavailable(
                f"train.fp8 needs sizes divisible by 16, but {what} = {size}", "change it or use --train.fp8 off"
            )


def _choose_linear(config: LoomConfig, device: torch.device, capability, te_ok: bool, te_why: str) -> Choice:
    mode = config.train.fp8
    if mode == "off":
        return Choice(
            "te.Linear" if te_ok else "torch.linear", f"{te_why}; train.fp8 = off" if te_ok else "train.fp8 = off"
        )
    ok, device_why = fp8_device_support(device, capability)
    if not ok:
        raise Fp8Unavailable(f"train.fp8 = {mode} is unavailable: {device_why}", "use --train.fp8 off")
    check_fp8_shapes(config)
    if te_ok and config.optim.zero == 3:  # TE casts the weights it holds; ZeRO-3 frees them between blocks
        te_why += "; optim.zero = 3: loom's FP8 linears quantise the gathered weights"
    elif te_ok:
        from loom.engine.model import te

        if mode == "delayed" and config.model.recompute != "none":
            raise Fp8Unavailable(
                "train.fp8 = delayed with model.recompute would record amaxes twice per step",
                "use --train.fp8 current or --model.recompute none",
            )
        if mode == "delayed" or te.has_current_scaling():
            output = "; the output layer on torch._scaled_mm" if config.train.fp8_output_layer else ""
            return Choice(f"te.Linear+fp8({mode})", f"{te_why}; {device_why}{output}")
        te_why = "transformer_engine: this version has no Float8CurrentScaling"
    if mode == "delayed":
        raise Fp8Unavailable(
            f"train.fp8 = delayed needs Transformer Engine ({te_why})",
            "use --train.fp8 current (torch._scaled_mm with per-tensor current scaling) or --train.fp8 off",
        )
    output = "; the output layer too (train.fp8_output_layer)" if config.train.fp8_output_layer else ""
    return Choice("torch._scaled_mm(fp8 current scaling)", f"{te_why}; {device_why}{output}")


def _choose_optimizer(config: LoomConfig, device: torch.device, mode: str) -> Choice:
    name = config.optim.name
    if name != "adamw":
        impl = {"sgd": "torch.SGD", "lamb": "loom.Lamb", "adafactor": "loom.Adafactor"}[name]
        return Choice(impl, f"optim.name = {name}")
    if device.type != "cuda":
        return Choice("torch.AdamW(foreach)", "CPU: foreach AdamW (same numbers as the for-loop one)")
    apex_ok, apex_why = _package("apex", "apex.optimizers", mode, cuda=True)
    if apex_ok:
        return Choice("apex.FusedAdam", apex_why)
    return Choice("torch.AdamW(fused)", apex_why)


def _torch_impl(function: str, compiled: bool) -> str:
    return f"torch.compile({function})" if compiled else f"torch.{function}"


SDPA_BACKENDS = {"flash": "flash", "cudnn": "cudnn", "efficient": "mem_efficient", "math": "math"}


def enable_only_sdpa_backend(choice: str) -> None:
    """torch SDPA's CUDA kernels for this process: `choice` alone (flash, cudnn, efficient: no math fallback), or
    every one for auto (torch's defaults; a process that measures several configs must get them back)."""
    for name, flag in SDPA_BACKENDS.items():
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(choice == "auto" or name == choice)


def choose_kernels(config: LoomConfig, device: torch.device, capability: tuple[int, int] | None = None) -> Kernels:
    """Decide every kernel for this run. `capability` defaults to the CUDA device's (tests pass one)."""
    m, mode = config.model, config.model.kernels
    cuda = device.type == "cuda"
    if cuda and capability is None:
        capability = torch.cuda.get_device_capability(device)
    te_ok, te_why = _package("transformer_engine", "transformer_engine.pytorch", mode, cuda)
    if mode == "te" and not te_ok:
        raise ConfigError(
            f"model.kernels = te needs Transformer Engine on a CUDA device ({te_why}); use --model.kernels auto"
        )
    linear = _choose_linear(config, device, capability, te_ok, te_why)

    backend = m.attention_backend  # its device-independent refusals are LoomConfig's
    if backend != "auto" and not cuda:
        raise ConfigError(
            f"model.attention_backend = {backend} picks a CUDA kernel of torch SDPA, but on CPU SDPA has one kernel; "
            "use --model.attention_backend auto"
        )
    if cuda:
        enable_only_sdpa_backend(backend)
    if config.parallel.cp > 1:
        attention = Choice(
            "loom.ring_attention", f"parallel.cp = {config.parallel.cp}: keys and values around the CP ring"
        )
    elif backend != "auto":
        attention = Choice(f"torch.sdpa({backend})", f"model.attention_backend = {backend}")
    elif m.attention_softcap is not None:
        attention = Choice("loom.capped_attention", f"model.attention_softcap = {m.attention_softcap}: scores capped")
    elif te_ok and m.windowed:
        attention = Choice("torch.sdpa", f"model.sliding_window = {m.sliding_window}: SDPA with loom's window mask")
    elif te_ok and m.dropout == 0:
        attention = Choice("te.DotProductAttention", te_why)
    elif te_ok:
        attention = Choice("torch.sdpa", "model.dropout > 0: SDPA keeps dropout on loom's RNG streams")
    else:
        backends = "flash / cuDNN / memory-efficient backends" if cuda else "CPU kernel"
        attention = Choice("torch.sdpa", f"{te_why}; SDPA {backends}")

    norm_name = "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"
    compiles = m.compiles_on(cuda)
    compiled = f"model.compile = {m.compile}" + (
        f" ({'compiled' if compiles else 'eager'} on {device.type})" if m.compile == "auto" else ""
    )
    if os.environ.get(BACKEND_VARIABLE) and compiles:  # a name torch.compile does not know: refused in one line
        compiled += f" (blocks by {block_backend()}: {BACKEND_VARIABLE})"
    elif os.environ.get(BACKEND_VARIABLE):  # (not checked: torch._dynamo's import costs an eager rank 1.5 s)
        compiled += f" ({BACKEND_VARIABLE} unused)"
    if te_ok:
        norm = Choice(f"te.{norm_name}", te_why)
    else:
        apex_ok, apex_why = _package("apex", "apex.normalization", mode, cuda)
        if apex_ok:
            norm = Choice(f"apex.Fused{norm_name}", f"{te_why}; {apex_why}")
        else:
            norm = Choice(_torch_impl(m.norm.replace("norm", "_norm"), compiles), f"{te_why}; {apex_why}; {compiled}")
    activation = Choice(_torch_impl(m.activation, compiles), compiled)
    return Kernels(
        attention,
        norm,
        activation,
        linear,
        _choose_optimizer(config, device, mode),
        fp8=config.train.fp8,
        fp8_output_layer=config.train.fp8_output_layer,
        params_dtype=PARAM_DTYPES[config.train.precision],
        fp8_weight_copies=config.optim.zero != 3,
    )
