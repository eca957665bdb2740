"""Process environment a CUDA rank needs before its first CUDA call; shared by training ranks and benchmarks."""

from __future__ import annotations

import os

# Set for CUDA ranks unless the user's environment already sets them (docs/gpu.md says why):
# expandable segments cut allocator fragmentation from varying activation sizes; NCCL collectives
# on side streams free their buffers when they finish instead of record_stream-ing them.
CUDA_ENV_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


def set_cuda_env_defaults() -> None:
    """Apply CUDA_ENV_DEFAULTS; must run before the first CUDA call of the process (the allocator reads them once)."""
    for name, value in CUDA_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
