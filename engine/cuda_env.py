"""A CUDA rank's process: whether it computes on a GPU, the environment it needs before its first CUDA call, and
the pinned allocator's rounding for offloaded optimizer state; shared by training ranks and benchmarks."""

from __future__ import annotations

import os

import torch

from loom.engine.config import LoomConfig

# Set for CUDA ranks unless the user's environment already sets them (docs/gpu.md says why):
# expandable segments cut allocator fragmentation from varying activation sizes; NCCL collectives
# on side streams free their buffers when they finish instead of record_stream-ing them.
CUDA_ENV_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


def computes_on_cuda(device: str) -> bool:
    """Whether a rank with train.device = `device` computes on a GPU (auto: when this machine shows one)."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def cuda_env_defaults(config: LoomConfig | None = None) -> dict[str, str]:
    """CUDA_ENV_DEFAULTS, plus CUDA_DEVICE_MAX_CONNECTIONS=1 where Transformer Engine may run tensor-parallel
    layers: TE overlaps their all-gathers/reduce-scatters with GEMMs, and only a single hardware queue makes
    the GPU launch the communication kernel first (Megatron requires the same setting)."""
    defaults = dict(CUDA_ENV_DEFAULTS)
    if config is not None and config.parallel.tp > 1 and config.model.kernels != "native":
        defaults["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return defaults


def set_cuda_env_defaults(config: LoomConfig | None = None) -> None:
    """Apply cuda_env_defaults(config); must run before the first CUDA call of the process (the allocator and
    the driver read them once)."""
    for name, value in cuda_env_defaults(config).items():
        os.environ.setdefault(name, value)


PINNED_ROUND_THRESHOLD = "pinned_max_round_threshold_mb:1"
"""torch's pinned-memory allocator rounds every block up to a power of two, so an offloaded fp32 master of 1.1 GB
took 2 GB of host memory; above this threshold it keeps the size asked for (512-byte aligned). Small pinned blocks
(the micro-batches on their way to the GPU) stay rounded and cached."""


def exact_size_pinned_blocks() -> bool:
    """Ask torch's pinned allocator to stop rounding blocks of 1 MB and more up to a power of two (optim.offload's
    host copies, allocated once and kept); a threshold the user set stays. False where this torch cannot (its
    allocator settings have no `pinned_max_round_threshold_mb`: torch 2.11 has none, 2.13 has it)."""
    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if get_settings is None or set_settings is None:
        return False
    current = get_settings()
    if "pinned_max_round_threshold_mb" in current:
        return True
    try:
        set_settings(f"{current},{PINNED_ROUND_THRESHOLD}" if current else PINNED_ROUND_THRESHOLD)
    except (ValueError, RuntimeError):
        return False
    return True
