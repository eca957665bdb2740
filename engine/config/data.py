"""[data]: the training datasets, their mixing weights, split and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.engine.config.fields import ConfigError, check_choices


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Prefixes of .bin/.idx datasets (without the extension)."""
    weights: list[float] | None = None
    """Mixing weights, one per path; None means equal weights."""
    tokenizer: str | None = None
    """Tokenizer the data was built with, a SentencePiece .model or a Hugging Face tokenizer.json (used to check
    the vocabulary and decode)."""
    split: str = "98,1,1"
    """Train/valid/test split of each dataset's documents, as relative weights."""
    cache_dir: str | None = None
    """Where index caches go; None means beside each dataset."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        self._refuse_megatron_pairs()
        if self.weights is not None and len(self.weights) != len(self.paths):
            raise ConfigError(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
        if self.weights is not None and any(w <= 0 for w in self.weights):
            raise ConfigError("data.weights must all be positive")
        parts = self.split.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
            raise ConfigError(
                f"data.split = {self.split!r} must be three non-negative weights, not all zero, like '98,1,1'"
            )

    def _refuse_megatron_pairs(self) -> None:
        """Megatron-LM's --data-path takes weight-prefix pairs (0.3 A 0.7 B); given to data.paths they read as
        datasets named 0.3 and 0.7, a missing-file error that does not say why."""
        weights, prefixes = self.paths[0::2], self.paths[1::2]
        if (
            not self.paths
            or len(weights) != len(prefixes)
            or not all(_is_number(w) and not _is_number(p) for w, p in zip(weights, prefixes))
        ):
            return
        raise ConfigError(
            f"data.paths = {' '.join(self.paths)} reads as Megatron-LM's weight-prefix pairs; loom takes the "
            f"prefixes and weights apart: --data.paths {' '.join(prefixes)} --data.weights {' '.join(weights)}"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
