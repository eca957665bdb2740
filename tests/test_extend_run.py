"""User story: a run is extended. A shorter run is the prefix of a longer one with the same LR schedule,
and a finished run resumed with more steps continues exactly as if it had been asked for them at once."""

from pathlib import Path

import pytest
from training_runs import read_metrics, tiny_config

from loom.launch.local import launch_local

SMALL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128}


def losses(dataset: str, run_dir: Path, steps: int, interval: int = 0) -> dict[int, float]:
    config = tiny_config(
        dataset,
        run_dir,
        model=SMALL_MODEL,
        # The schedule is fixed by decay_steps, not by train.steps, so runs of any length share it.
        optim={"decay_steps": 6, "warmup_steps": 1},
        checkpoint={"interval": interval},
        # The preset's eval_interval: each run also evaluates at its last step, which must not disturb the resume.
        train={"steps": steps, "eval_interval": 25},
    )
    config.resolve_world(1)
    launch_local(config, 1)
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def test_a_shorter_run_is_the_prefix_of_a_longer_one_and_resuming_with_more_steps_continues_it(dataset, tmp_path):
    straight = losses(dataset, tmp_path / "six", steps=6)
    short = losses(dataset, tmp_path / "extended", steps=3, interval=3)
    assert sorted(short) == [1, 2, 3]
    for step, loss in short.items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    extended = losses(dataset, tmp_path / "extended", steps=6, interval=3)  # resumes from its step-3 checkpoint
    assert sorted(extended) == [1, 2, 3, 4, 5, 6]
    for step, loss in extended.items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
