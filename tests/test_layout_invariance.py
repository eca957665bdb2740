"""The loss curve does not depend on the parallel layout (DESIGN.md, "Determinism and layout invariance").

configs/tiny.toml runs on the synthetic corpus for a few steps as a single rank (the reference)
and under a representative subset of (tp, dp, sequence parallel, recompute) layouts through the
real local launcher; every step's loss must match within 1e-4 relative. The full 50-step grid is
tools/check_layout_invariance.py.
"""

import json

import pytest

from loom.engine.config_io import load_config
from loom.engine.preflight import preflight
from loom.launch.local import launch_local
from loom.tools.synthetic_data import write_markov_dataset

STEPS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_markov_dataset(tmp_path_factory.mktemp("data") / "markov", vocab_size=4096, num_documents=400)


def run_layout(dataset, run_dir, nproc, **fields) -> list[float]:
    overrides = {
        "data": {"paths": [dataset], "tokenizer": None},
        "train": {"steps": STEPS, "run_dir": str(run_dir), "log_interval": 1, "eval_interval": 4, "tensorboard": False},
    }
    for key, value in fields.items():
        section, name = key.split("__")
        overrides.setdefault(section, {})[name] = value
    config = load_config("configs/tiny.toml", overrides)
    preflight(config, nproc)
    launch_local(config, nproc)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """Single-rank curves, one per model variant (layout fields excluded), computed once."""
    cache = {}

    def curve(model_fields: dict) -> list[float]:
        key = tuple(sorted(model_fields.items()))
        if key not in cache:
            cache[key] = run_layout(dataset, tmp_path_factory.mktemp("ref"), 1, **model_fields)
        return cache[key]

    return curve


LAYOUTS = {
    "tp2": (2, dict(parallel__tp=2)),
    "dp2-recompute-full": (2, dict(model__recompute="full")),
    "tp2-dp2-sp-selective": (4, dict(parallel__tp=2, parallel__sequence_parallel=True, model__recompute="selective")),
    "tp4-sp": (4, dict(parallel__tp=4, parallel__sequence_parallel=True)),
    "pp2": (2, dict(parallel__pp=2)),
    "pp2-vp2": (2, dict(parallel__pp=2, parallel__vp=2)),
    "pp2-vp2-tp2-dp2-sp": (
        8,
        dict(
            parallel__pp=2, parallel__vp=2, parallel__tp=2, parallel__sequence_parallel=True, train__micro_batch_size=1
        ),
    ),
    "pp4-tied": (4, dict(parallel__pp=4, model__tie_embeddings=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_curve_matches_single_rank(layout, dataset, reference, tmp_path):
    nproc, fields = LAYOUTS[layout]
    losses = run_layout(dataset, tmp_path, nproc, **fields)
    reference = reference({k: v for k, v in fields.items() if k == "model__tie_embeddings"})
    assert len(losses) == len(reference) == STEPS + 2
    assert reference[0] > reference[STEPS - 1], "the reference run should learn something"
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) / abs(want) < 1e-4, f"step {step}: {got} vs {want}"
