"""Process environment a CUDA rank needs before its first CUDA call; shared by training ranks and benchmarks."""

from __future__ import annotations

import os

from loom.engine.config import LoomConfig

# Set for CUDA ranks unless the user's environment already sets them (docs/gpu.md says why):
# expandable segments cut allocator fragmentation from varying activation sizes; NCCL collectives
# on side streams free their buffers when they finish instead of record_stream-ing them.
CUDA_ENV_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


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
