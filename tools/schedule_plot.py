"""`loom schedule`: print a pipeline schedule per rank, its bubble and memory, and draw it as a Gantt chart.

The op lists come from engine.pipeline.schedules (the ones the executor runs); the timeline from
the simulator with backward = 2 x forward, or from per-op timings a run recorded (--from-run).
"""

from __future__ import annotations

import json
from pathlib import Path

from loom.engine.config import ConfigError
from loom.engine.pipeline.schedules import Compute, build_all
from loom.engine.pipeline.simulate import Timeline, peak_in_flight, simulate
from loom.engine.run_dir import TIMELINE


def describe(pp: int, vp: int, microbatches: int) -> tuple[str, Timeline]:
    """A text rendering of the schedule and its figures."""
    schedules = build_all(pp, vp, microbatches)
    timeline = simulate(schedules, forward_cost=1.0 / vp, backward_cost=2.0 / vp)
    lines = [
        f"pipeline schedule: pp={pp} vp={vp} microbatches={microbatches} "
        f"({'interleaved 1F1B' if vp > 1 else '1F1B' if pp > 1 else 'gradient accumulation'})"
    ]
    for rank, ops in enumerate(schedules):
        names = [
            f"{op.kind}{op.microbatch}" + (f".{op.chunk}" if vp > 1 else "") for op in ops if isinstance(op, Compute)
        ]
        lines.append(f"rank {rank}: {' '.join(names)}")
    bubble = timeline.bubble_fraction  # idle over ideal compute (Narayanan et al.), above 1 when M < P - 1
    lines.append(
        f"bubble: {bubble:.4f} of the ideal compute time (theory (P-1)/(V*M) = {(pp - 1) / (vp * microbatches):.4f}); "
        f"{bubble / (1 + bubble):.1%} of the step is idle"
    )
    peaks = [peak_in_flight(ops) for ops in schedules]
    lines.append(
        "peak activations held per rank (micro-batches of one stage): " + ", ".join(f"{p / vp:g}" for p in peaks)
    )
    return "\n".join(lines), timeline


def _draw(ax, spans, title: str) -> None:
    colors = {"F": ["#4c72b0", "#8fb0d8", "#2a4a7a", "#b7cbe8"], "B": ["#dd8452", "#f0b48f", "#a0552a", "#f6d2ba"]}
    for rank, rank_spans in enumerate(spans):
        for op, start, end in rank_spans:
            ax.barh(rank, end - start, left=start, color=colors[op.kind][op.chunk % 4], edgecolor="white")
            ax.text((start + end) / 2, rank, str(op.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(spans)), [f"rank {r}" for r in range(len(spans))])
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel("time (forward of one stage = 1)" if "ideal" in title else "seconds")


def draw(pp: int, vp: int, microbatches: int, output: Path, measured: list | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loom.tools.charts import save_chart

    _, timeline = describe(pp, vp, microbatches)
    rows = 2 if measured else 1
    fig, axes = plt.subplots(rows, 1, figsize=(max(8, microbatches * vp * 0.6), 1.2 + pp * 0.5 * rows), squeeze=False)
    _draw(
        axes[0][0],
        timeline.spans,
        f"ideal: pp={pp} vp={vp} M={microbatches}, bubble {timeline.bubble_fraction:.1%} of compute\n"
        "(blue forward, orange backward; shade = chunk)",  # two lines: one was cut at 8 inches wide
    )
    if measured:
        _draw(axes[1][0], measured, "measured in the run")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    save_chart(fig, output, "schedule")
    plt.close(fig)


def load_measured(run_dir: Path) -> tuple[dict, list]:
    """The layout and per-rank op timings a run recorded in pipeline_timeline.json."""
    path = run_dir / TIMELINE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; train with --train.record_pipeline_timeline true")
    try:
        data = json.loads(path.read_text())
        layout = {key: int(data["layout"][key]) for key in ("pp", "vp", "microbatches")}
        spans = [
            [(Compute(kind, mb, chunk), start, end) for kind, mb, chunk, start, end in rank] for rank in data["ranks"]
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"{path} is not a pipeline timeline loom wrote ({type(error).__name__}: {error}); train again with "
            "--train.record_pipeline_timeline true"
        ) from None
    return layout, spans
