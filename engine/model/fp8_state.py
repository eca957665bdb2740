"""FP8 delayed-scaling state, saved with checkpoints so that a resumed run keeps its scales.

Under `train.fp8 = delayed` every Transformer Engine module keeps an amax history and the scales derived
from it (its `get_extra_state()`: a uint8 tensor of TE's pickled state, empty when the module holds none).
A fresh module starts from scale 1 and an empty history, so without this a resume would quantise its
first steps with scales that ignore everything the run has seen. (`train.fp8 = current` and loom's own
torch._scaled_mm path take each scale from the tensor at hand and have no state.)

The state is kept by module name, which is the same in every layout (pipeline chunks hold blocks by global
index: `layers.<i>.attention.qkv`), so a resume under another pp or vp finds each layer's state wherever
that layer now lives. Amaxes are reduced over the TP group (kernels.Kernels.fp8_autocast), so every TP rank
holds the same history: the amax of the whole logical tensor, which is the max over its shards. TP rank 0's
copy therefore serves any TP size, and that max stays correct for the new, differently cut shards. Amaxes are
not reduced over DP: each replica's history comes from its own micro-batches, and a resume gives every
replica DP rank 0's, which its own then replaces over the next amax_history_len steps.
"""

from __future__ import annotations

import torch


def has_extra_state(module: torch.nn.Module) -> bool:
    """Whether the module keeps state outside its parameters and buffers (nn.Module's extra-state hooks)."""
    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


class Fp8ScalingState:
    """The FP8 scaling state of a rank's model chunks, by layout-independent module name (see the module
    docstring); saved and restored through state_dict()/load_state_dict() like the loop's other state."""

    def __init__(self, model_chunks: list[torch.nn.Module]):
        self.modules = {
            name: module for chunk in model_chunks for name, module in chunk.named_modules() if has_extra_state(module)
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each module's extra state as a CPU tensor; modules that hold none (not yet run in FP8) are left out."""
        state = {}
        for name, module in self.modules.items():
            extra = module.get_extra_state()
            if not isinstance(extra, torch.Tensor):
                kind = type(extra).__name__
                raise TypeError(f"{name}: extra state of type {kind}; loom saves tensors (Transformer Engine >= 1.11)")
            if extra.numel():
                state[name] = extra.detach().cpu().contiguous()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Give each module its saved state; modules without an entry (a checkpoint saved without FP8) keep theirs."""
        for name, module in self.modules.items():
            if name in state:
                module.set_extra_state(state[name])
