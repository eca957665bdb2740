"""The loss curve does not depend on the parallel layout (DESIGN.md, "Determinism and layout invariance").

configs/tiny.toml runs on the synthetic corpus for a few steps as a single rank (the reference)
and under a representative subset of (tp, dp, sequence parallel, recompute) layouts through the
real local launcher; every step's loss and gradient norm must match within 1e-4 relative. The full 50-step grid is
tools/check_layout_invariance.py.
"""

import pytest
from training_runs import read_metrics, tiny_config

from loom.engine.flops import model_flops_per_token
from loom.engine.preflight import preflight
from loom.launch.local import launch_local

STEPS = 6
PEAK_TFLOPS = 0.5  # a made-up peak per rank, so that the rows carry an MFU
EVAL_INTERVAL = 4  # a validation at step 4 and at the end: the curves of the validation loss too


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(400)


def run_layout(dataset, run_dir, nproc, steps, **fields) -> list[float]:
    sections = {"train": {"steps": steps, "eval_interval": EVAL_INTERVAL, "seq_length": 64, "peak_tflops": PEAK_TFLOPS}}
    for key, value in fields.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    config = tiny_config(dataset, run_dir, **sections)
    preflight(config, nproc)
    launch_local(config, nproc)
    rows = read_metrics(run_dir)
    # MFU: the model's FLOPs per token (Megatron's formula, test_flops.py) at the whole run's tokens/s, over the
    # peak of every rank
    flops = model_flops_per_token(config.model, config.train.seq_length)
    for row in (r for r in rows if "tokens_per_s" in r):
        assert row["mfu"] == pytest.approx(flops * row["tokens_per_s"] / (PEAK_TFLOPS * 1e12 * nproc), rel=1e-9)
    # the clipped gradient norm too: summed over stages, TP shards and a tied embedding's two copies, a norm can
    # be wrong where the loss, under Adam's scale invariance, barely shows it
    return [r[key] for key in ("loss", "grad_norm", "val_loss") for r in rows if key in r]


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """Single-rank curves, one per model variant (layout fields excluded), computed once."""
    cache = {}

    def curve(steps: int, model_fields: dict) -> list[float]:
        key = (steps, *sorted(model_fields.items()))
        if key not in cache:
            cache[key] = run_layout(dataset, tmp_path_factory.mktemp("ref"), 1, steps, **model_fields)
        return cache[key]

    return curve


LAYOUTS = {
    "tp2": (2, dict(parallel__tp=2)),
    "dp2-recompute-full": (2, dict(model__recompute="full")),
    "tp2-dp2-sp-selective": (4, dict(parallel__tp=2, parallel__sequence_parallel=True, model__recompute="selective")),
    # (tp 4 with sequence parallelism: test_tensor_parallel's llama-sp-4 forward and backward against dense)
    "pp2-vp2-tp2-dp2-sp": (
        8,
        dict(
            parallel__pp=2, parallel__vp=2, parallel__tp=2, parallel__sequence_parallel=True, train__micro_batch_size=1
        ),
    ),
    # (plain 1F1B at pp 2 is covered by test_zero's pp2-dp2-lamb and test_checkpoint's resumes)
    "pp4-tied": (4, dict(parallel__pp=4, model__tie_embeddings=True)),
    # bf16 against the bf16 single rank: stages exchange bf16 activations and gradients (the compute dtype).
    # (fp32 interleaving is covered by pp2-vp2-tp2-dp2-sp.)
    "pp2-vp2-bf16": (2, dict(parallel__pp=2, parallel__vp=2, train__precision="bf16")),
    # A mixture of experts: partial expert sums reduced once over TP (the router's gradient summed over TP), the
    # per-sequence load-balancing loss back-propagated on every pipeline stage by its micro-batch's share, and
    # recomputed with its block (one micro-batch per rank: the loss does not depend on how a batch is cut).
    "moe-pp2-tp2-dp2-sp-full": (
        8,
        dict(
            model__num_experts=4,
            model__moe_shared_ffn_hidden_size=128,  # and a gated shared expert, whose partial sum joins theirs
            model__moe_shared_expert_gate=True,
            model__moe_z_loss_coeff=0.01,  # and the router's z-loss, at 1 / tp on each TP rank as well
            # sigmoid scores, scaled, and experts' biases moved after each step by the loads summed over DP (a rate
            # large enough that they change the next steps' choices)
            model__moe_router_score="sigmoid",
            model__moe_router_scale=2.0,
            model__moe_expert_bias=True,
            model__moe_expert_bias_rate=0.05,
            model__moe_router_groups=2,  # each token's experts the two of its better group (group-limited routing)
            model__moe_router_group_top_k=1,
            # a dense first block (its MLP 384 wide) before three with experts 128 wide: the pipeline's first stage
            # holds one of each
            model__moe_dense_layers=1,
            model__moe_ffn_hidden_size=128,
            parallel__pp=2,
            parallel__tp=2,
            parallel__ep=2,  # each DP rank holds two of the four experts, tokens sent to them and back
            parallel__sequence_parallel=True,
            model__recompute="full",
            train__micro_batch_size=1,
        ),
    ),
}
# Cutting the model into stages changes no arithmetic when stages exchange the compute dtype: the bf16
# pipeline equals the bf16 single rank (sending fp32 would carry an fp32 residual stream into later stages).
TOLERANCE = {"pp2-vp2-bf16": 1e-6}
# bf16 matmuls are slow on CPU: four steps (and one validation) show the same thing.
LAYOUT_STEPS = {"pp2-vp2-bf16": 4, "moe-pp2-tp2-dp2-sp-full": 4}
# Fields that change the single-rank reference itself rather than the layout.
MODEL_FIELDS = (
    "model__tie_embeddings",
    "train__precision",
    "model__num_experts",
    "model__moe_shared_ffn_hidden_size",
    "model__moe_shared_expert_gate",
    "model__moe_z_loss_coeff",
    "model__moe_router_score",
    "model__moe_router_scale",
    "model__moe_expert_bias",
    "model__moe_expert_bias_rate",
    "model__moe_router_groups",
    "model__moe_router_group_top_k",
    "model__moe_dense_layers",
    "model__moe_ffn_hidden_size",
)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_curve_matches_single_rank(layout, dataset, reference, tmp_path):
    nproc, fields = LAYOUTS[layout]
    steps = LAYOUT_STEPS.get(layout, STEPS)
    losses = run_layout(dataset, tmp_path, nproc, steps, **fields)
    reference = reference(steps, {k: v for k, v in fields.items() if k in MODEL_FIELDS})
    validations = steps // EVAL_INTERVAL + (steps % EVAL_INTERVAL != 0)
    assert len(losses) == len(reference) == 2 * steps + validations  # losses, gradient norms, validations
    assert reference[0] > reference[steps - 1], "the reference run should learn something"
    for i, (got, want) in enumerate(zip(losses, reference)):
        what = ("loss", "grad_norm", "val_loss")[min(i // steps, 2)]
        assert abs(got - want) / abs(want) < TOLERANCE.get(layout, 1e-4), f"{what} {i % steps}: {got} vs {want}"
