"""The run directory's layout, the user contract of docs/architecture.md and DESIGN: what a training run writes
where. Every reader and writer of a run's files names them from here.

    RUN/config.toml          the fully resolved config
    RUN/metrics.jsonl        one JSON object per logged step, appended, surviving resume
    RUN/tensorboard/         event files for the same scalars
    RUN/checkpoints/         latest (the newest complete iteration) and iter_NNNNNNN/ (format.py)
    RUN/pipeline_timeline.json, RUN/pipeline_schedule.png   a pipeline's measured last step, and its chart
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
TIMELINE = "pipeline_timeline.json"
"""The last step's per-op times of pipeline 0 (train.record_pipeline_timeline; `loom schedule --from-run`)."""
SCHEDULE_CHART = "pipeline_schedule.png"
"""Where `loom schedule --from-run` (and the demo) draw that timeline beside the ideal schedule."""


def checkpoints_of(run_dir: str | Path) -> Path:
    """RUN/checkpoints: where a run keeps its checkpoints and resumes from."""
    return Path(run_dir) / CHECKPOINTS


def metrics_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN/metrics.jsonl ([] before the first); a row still being written is left out."""
    path = metrics_of(run_dir)
    if not path.exists():
        return []
    *complete, _unterminated = path.read_text().split("\n")
    return [json.loads(line) for line in complete]
