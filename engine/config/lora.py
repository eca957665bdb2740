"""[lora]: the low-rank adapters trained on a frozen base model."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from loom.engine.config.fields import ConfigError, check_choices, field_default

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""loom's linear layers an adapter can sit on; in Hugging Face/PEFT names qkv is q_proj, k_proj and v_proj (one
shared A, B stacked), proj is o_proj, fc1 is gate_proj and up_proj (SwiGLU) or the MLP's first layer, fc2 down_proj."""


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on a frozen base model: W x + (alpha / rank) B A x."""

    rank: int = 0
    """Rank r of each adapter; 0 trains the whole model (no adapters)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Layers that get an adapter, any of qkv, proj, fc1, fc2 (see LORA_TARGETS for the PEFT names)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialisation, B starting at zero (so training starts from the base model): kaiming is PEFT's
    default, uniform(-1/sqrt(in), 1/sqrt(in)); gaussian is normal(0, 1/rank) (PEFT's init_lora_weights="gaussian")."""
    base: str | None = None
    """The frozen base model: a loom checkpoint of any layout (an iter_N directory or a checkpoints/ folder),
    e.g. one written by `loom ckpt import-hf`. Required when rank > 0."""

    def __post_init__(self) -> None:
        check_choices(self, "lora")
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError("lora.rank must be >= 0, lora.alpha > 0 and 0 <= lora.dropout < 1")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            spaced = (
                " (a flag takes them space-separated: --lora.targets qkv proj)"
                if any("," in t for t in unknown)
                else ""
            )
            raise ConfigError(
                f"lora.targets = {self.targets} must be a non-empty subset of {', '.join(LORA_TARGETS)}{spaced}"
            )
        if self.rank and not self.base:
            raise ConfigError(
                "lora.rank > 0 needs the base model: --lora.base DIR (a loom checkpoint, e.g. from import-hf)"
            )
        if not self.rank:
            # Without a rank no adapter exists: a base or an adapter setting would be ignored and the run would
            # train a freshly initialised model, so it is refused instead.
            given = [f.name for f in fields(self) if f.name != "rank" and getattr(self, f.name) != field_default(f)]
            if given:
                raise ConfigError(
                    f"lora.{given[0]} is set but lora.rank is 0 (no adapters): add --lora.rank R (e.g. 8) to "
                    "fine-tune with LoRA, or drop the lora settings to train the whole model"
                )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
