"""User story: a run is extended. A shorter run is the prefix of a longer one with the same LR schedule,
and a finished run resumed with more steps continues exactly as if it had been asked for them at once."""

import json
from pathlib import Path

import pytest

from loom.engine.config_io import load_config
from loom.launch.local import launch_local
from loom.tools.synthetic_data import write_markov_dataset

SMALL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_markov_dataset(tmp_path_factory.mktemp("data") / "markov", vocab_size=4096, num_documents=300)


def losses(dataset: str, run_dir: Path, steps: int, interval: int = 0) -> dict[int, float]:
    config = load_config(
        "tiny",
        {
            "data": {"paths": [dataset], "tokenizer": None},
            "model": SMALL_MODEL,
            # The schedule is fixed by decay_steps, not by train.steps, so runs of any length share it.
            "optim": {"decay_steps": 6, "warmup_steps": 1},
            "checkpoint": {"interval": interval},
            "train": {"steps": steps, "run_dir": str(run_dir), "log_interval": 1, "tensorboard": False},
        },
    )
    config.resolve_world(1)
    launch_local(config, 1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


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
