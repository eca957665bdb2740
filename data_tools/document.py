"""What a cleaning step sees and says: the Document, the Rejected verdict, the Step protocol and threshold checks.

Filters import this module and nothing of the pipeline registry (pipeline.py imports the filters),
so a new filter cannot create an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


@dataclass
class Document:
    """The text being cleaned and the fields a step adds to the output record (e.g. language)."""

    text: str
    metadata: dict = field(default_factory=dict)


class Rejected(NamedTuple):
    """Why a step removed a document: a short stable rule (counted in stats.json) and the measurement."""

    rule: str
    detail: str


class Step(Protocol):
    def __call__(self, doc: Document) -> Rejected | None: ...


def above(rule: str, value: float, limit: float) -> Rejected | None:
    """Rejected when value > limit (a maximum threshold), with both numbers in the detail."""
    return Rejected(rule, f"{rule} {value:.4g} > {limit:g}") if value > limit else None


def below(rule: str, value: float, limit: float) -> Rejected | None:
    """Rejected when value < limit (a minimum threshold), with both numbers in the detail."""
    return Rejected(rule, f"{rule} {value:.4g} < {limit:g}") if value < limit else None


def first_rejection(*checks: Rejected | None) -> Rejected | None:
    return next((check for check in checks if check is not None), None)
