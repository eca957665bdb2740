"""loom plan's bytes against loom itself: what its ranks allocate for weights, gradients and optimizer state, save
for backward (per block, per rank at its peak) and send, measured on CPU (tools/plan_bytes.py; the time model's
checks against published runs are in test_plan.py)."""

import dataclasses

import pytest
import torch
from dist_utils import run_ranks
from training_runs import tiny_config

from loom.engine.comm_ledger import read_ledger
from loom.engine.config_io import load_config
from loom.engine.model.kernels import PARAM_DTYPES, choose_kernels
from loom.engine.parallel.random import RNGStreams
from loom.engine.parallel.sharding import initialize_parameters
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.stages import build_chunks
from loom.engine.train import Trainer
from loom.tools.bench.saved_memory import SavedForBackward
from loom.tools.plan import estimate, load_hardware
from loom.tools.plan_activations import layer_activation_bytes, output_activation_bytes, rank_activation_bytes
from loom.tools.plan_bytes import (
    GRAD_BYTES,
    MEGATRON,
    Layout,
    fp8_weight_bytes,
    layout_of,
    model_state_bytes,
)
from loom.tools.plan_traffic import step_traffic

# experts, top 2 of 4, and a gated shared expert (Qwen2-MoE's)
SHARED_MOE = {
    **{"num_experts": 4, "moe_top_k": 2, "moe_shared_ffn_hidden_size": 192, "moe_shared_expert_gate": True},
    "moe_z_loss_coeff": 0.001,
}

# a dense first block (384 wide) before experts 128 wide: a pipeline's stages hold different blocks
DENSE_FIRST_MOE = {"num_experts": 4, "moe_dense_layers": 1, "moe_ffn_hidden_size": 128}

STATE_LAYOUTS = {
    2: [
        ({}, {}, {"zero": 0}, "fp32"),
        ({}, {}, {"zero": 1}, "bf16"),
        ({}, {}, {"zero": 2}, "bf16"),
        ({}, {}, {"zero": 1, "offload": "cpu"}, "bf16"),
        ({}, {}, {"zero": 1}, "fp32"),
        ({}, {}, {"zero": 0, "offload": "cpu"}, "fp32"),
        ({}, {}, {"zero": 2, "name": "sgd"}, "fp16"),
        ({"tp": 2}, {}, {"zero": 0}, "fp32"),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 1}, "bf16"),
        ({"pp": 2}, {}, {"zero": 0}, "bf16"),
        ({"pp": 2, "vp": 2}, {}, {"zero": 0}, "fp32"),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 1}, "bf16"),
        ({}, {}, {"zero": 2, "grad_dtype": "bf16"}, "bf16"),
        ({}, {}, {"zero": 3}, "bf16"),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 3}, "bf16"),
        ({"cp": 2}, {}, {"zero": 1}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 0, "name": "adafactor"}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {"norm_placement": "both", "qk_norm": True}, {"zero": 1}, "bf16"),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 0, "name": "adafactor"}, "fp32"),
        ({"tp": 2, "sequence_parallel": True}, {"num_experts": 4}, {"zero": 1}, "bf16"),
        ({"pp": 2}, DENSE_FIRST_MOE, {"zero": 1}, "bf16"),
        ({"tp": 2}, SHARED_MOE, {"zero": 0, "name": "adafactor"}, "fp32"),
        ({}, {"num_experts": 4}, {"zero": 3}, "bf16"),
    ],
    4: [
        ({}, {}, {"zero": 1, "name": "lamb"}, "bf16"),
        ({}, {}, {"zero": 2}, "bf16"),
        ({"tp": 2}, {}, {"zero": 1}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 2}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {"tie_embeddings": True}, {"zero": 0}, "fp16"),
        ({"pp": 2}, {}, {"zero": 2}, "bf16"),
        ({"pp": 2, "vp": 2}, {}, {"zero": 1}, "fp16"),
        ({"tp": 2, "pp": 2}, {}, {"zero": 0}, "bf16"),
        ({"tp": 2, "pp": 2, "sequence_parallel": True}, {"tie_embeddings": True}, {"zero": 0}, "fp32"),
        ({"pp": 4}, {}, {"zero": 0}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 1, "grad_dtype": "bf16"}, "bf16"),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 3, "offload": "cpu"}, "bf16"),
        ({"pp": 2, "vp": 2}, {}, {"zero": 3}, "fp32"),
        ({"cp": 2}, {}, {"zero": 3}, "bf16"),
        ({"cp": 2, "pp": 2}, {}, {"zero": 2}, "fp32"),
        # expert parallelism: each rank two of the four experts, their gradients over the two ranks holding them
        ({"ep": 2}, {"num_experts": 4}, {"zero": 2}, "bf16"),
    ],
}


def _held(rank, world, dataset, run_dir):
    """Per layout: this rank's (planned, allocated) bytes of weights, gradients and optimizer state."""
    out = []
    for i, (parallel, model, optim, precision) in enumerate(STATE_LAYOUTS[world]):
        config = tiny_config(
            dataset,
            f"{run_dir}/{i}",
            parallel={**parallel, "grad_bucket_mb": 0.25},
            model=model,
            optim=optim,
            train={"steps": 1, "micro_batch_size": 1, "global_batch_size": 8, "seq_length": 32, "precision": precision},
        )
        trainer = Trainer(config)
        trainer.train_step()
        params = [q for chunk in trainer.chunks for q in chunk.parameters()]
        grads = sum(  # the weights' buffer, and the experts' under expert parallelism
            buffer.stored_bytes() if buffer.enabled else sum(4 * q.numel() for q in buffer.params)
            for buffer in trainer.grad_buffers
        )
        sharded = trainer.optimizer.sharded_params
        allocated = {
            "params": sharded.stored_bytes() if sharded else sum(q.numel() * q.element_size() for q in params),
            "grads": grads,
            "optimizer": trainer.optimizer.device_state_bytes(),
            "host": trainer.optimizer.state_bytes()
            - trainer.optimizer.device_state_bytes()
            + trainer.optimizer.host_gradient_bytes(),
        }
        p, o = config.parallel, config.optim
        layout = Layout(p.tp, p.pp, p.vp, p.dp, 1, "none", o.zero, o.offload, p.sequence_parallel, p.cp, p.ep)
        planned = model_state_bytes(
            config.model, layout, trainer.state.pp_rank, precision, 2**18, o.name, GRAD_BYTES[o.grad_dtype]
        )
        out.append((f"{parallel} {model} {optim} {precision}", planned, allocated))
        trainer.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_weights_gradients_and_optimizer_state_equal_what_loom_allocates(markov_dataset, tmp_path, world):
    for rank in run_ranks(_held, world, markov_dataset(50), str(tmp_path)):
        for name, planned, allocated in rank:
            assert planned == allocated, name


ACTIVATION_CASES = (
    [
        (tp, sp, recompute, precision, micro, "false")
        for tp, sp in ((1, False), (2, False), (2, True))
        for recompute in ("none", "selective", "full")
        for precision, micro in (("fp32", 2), ("bf16", 1))
        if not (tp == 1 and precision == "bf16" and recompute == "selective")
    ]
    + [
        (tp, sp, recompute, "fp8", 1, "false")
        for tp, sp in ((1, False), (2, True))
        for recompute in ("none", "selective")
    ]
    + [
        (2, True, "none", "bf16", 1, "qk_norm"),
        (1, False, "none", "fp32", 2, "gpt"),
        (2, True, "selective", "bf16", 1, "gpt_qk_norm"),
        (2, True, "none", "bf16", 1, "nemotron"),
        (2, True, "none", "bf16", 1, "compiled nemotron_olmo2"),
        (2, True, "none", "bf16", 1, "olmo2"),
        (1, False, "none", "fp32", 2, "olmo2"),
        (2, True, "selective", "bf16", 1, "gemma"),
        (1, False, "none", "fp32", 2, "gemma3"),
        (2, True, "none", "bf16", 1, "mistral"),
        (1, False, "none", "fp32", 2, "capped"),
        (2, True, "none", "bf16", 1, "gemma2"),
        (2, True, "none", "bf16", 1, "gemma3"),
        (1, False, "none", "bf16", 1, "compiled qk_norm_moe"),
        (2, True, "selective", "fp8", 1, "compiled gpt"),
        (1, False, "none", "fp32", 2, "moe"),
        (2, True, "none", "bf16", 1, "shared_moe"),
        (1, False, "none", "fp32", 2, "biased_moe"),
        (2, True, "none", "bf16", 1, "grouped_moe"),
    ]
)
"""precision fp8: bf16 with loom's FP8 linears (torch._scaled_mm, which runs on CPU; the GPU check is bypassed).
The last field is the model: "false" the tiny preset's, eager; "compiled ..." with the block compiled whole (as on a
GPU by default), "... gpt" with LayerNorm and GELU, "... qk_norm" with query/key norms ("gpt_qk_norm": LayerNorm
and GELU with LayerNorm query/key norms), "... nemotron" with LayerNorm and squared ReLU, "... olmo2" with OLMo 2's
norms (on attention's and the MLP's outputs, on queries and keys across heads: one statistic per rank and token),
"... gemma" with Gemma's gated GELU and scaled, tied embeddings, "... gemma3" with Gemma 3's sandwich norms, query/key
norms and every layer windowed (its mask kept as an additive bias by each eager layer, K and V repeated for the
grouped heads), "... mistral" a Llama windowed in every layer, "... capped" with soft-capped scores (loom's own
attention), "... gemma2" with them, windows and sandwich norms, "... moe" a mixture of experts with a z-loss,
"... shared_moe" with a gated shared expert too ("qk_norm_moe": and query/key norms; "nemotron_olmo2": OLMo 2's
norms, squared ReLU and half the rotary dimensions). Three compiled cases between them reach every term of the
compiled count (each costs seconds of compiling)."""

MODEL_VARIANTS = {
    "gpt": {"norm": "layernorm", "activation": "gelu"},
    "qk_norm": {"qk_norm": True},
    "qk_norm_moe": {"qk_norm": True, **SHARED_MOE, "moe_router_fp32": True},  # one compile for all three
    "gpt_qk_norm": {"norm": "layernorm", "activation": "gelu", "qk_norm": True},
    "nemotron": {"norm": "layernorm", "activation": "squared_relu", "rotary_percent": 0.5},
    # OLMo 2's norms with Nemotron's squared ReLU and partial rotary: one compile for both (LayerNorm's is gpt's)
    "nemotron_olmo2": {
        **{"activation": "squared_relu", "rotary_percent": 0.5},
        **{"norm_placement": "output", "qk_norm": True, "qk_norm_per_head": False},
    },
    "olmo2": {"norm_placement": "output", "qk_norm": True, "qk_norm_per_head": False},
    "gemma": {"activation": "geglu", "embedding_multiplier": 16.0, "tie_embeddings": True},
    "mistral": {"sliding_window": 16},
    "gemma2": {"activation": "geglu", "norm_placement": "both", "sliding_window": 16, "attention_softcap": 50.0},
    "capped": {"attention_softcap": 50.0},
    "moe": {"num_experts": 4, "moe_top_k": 2, "moe_z_loss_coeff": 0.001},
    "shared_moe": SHARED_MOE,
    # DeepSeek-V3's routing: sigmoid scores, experts' biases, a scale
    "biased_moe": {**SHARED_MOE, "moe_router_score": "sigmoid", "moe_expert_bias": True, "moe_router_scale": 2.5},
    # DeepSeek-V3's group-limited routing, in fp32 (as GLM-4.5's): the router's input kept in fp32
    "grouped_moe": {
        **{"num_experts": 4, "moe_top_k": 2, "moe_router_groups": 2, "moe_router_group_top_k": 1},
        "moe_router_fp32": True,
    },
    "gemma3": {
        "activation": "geglu",
        "norm_placement": "both",
        "qk_norm": True,
        "sliding_window": 16,
        "rope_local_theta": 100.0,
    },
}


def _saved_per_layer(rank, world, cases):
    """Bytes one block saves for backward (parameters excluded): the difference between 2 layers and 1."""
    out = []
    for tp, sp, recompute, precision, micro, variant in cases:
        if tp != world:
            continue
        state = ParallelState.create(tp=tp, dp=1)
        saved = []
        model = {"compile": "true" if variant.startswith("compiled") else "false"}
        model.update(MODEL_VARIANTS.get(variant.split()[-1], {}))
        for layers in (1, 2):
            fp8 = {"precision": "bf16", "fp8": "current"} if precision == "fp8" else {}
            config = load_config(
                "tiny",
                {
                    # compile set either way: the pretend CUDA device of the fp8 cases would compile under auto
                    "model": {"num_layers": layers, "recompute": recompute, **model},
                    "parallel": {"tp": tp},
                    "train": fp8,
                },
            )
            config.parallel.sequence_parallel = sp
            pretend = {"device": torch.device("cuda"), "capability": (9, 0)} if fp8 else {"device": torch.device("cpu")}
            kernels = choose_kernels(config, **pretend)
            (chunk,) = build_chunks(config, state, RNGStreams(0, state.tp_rank, torch.device("cpu")), kernels)
            initialize_parameters(chunk, 0, state.tp_rank, tp)
            chunk.to(PARAM_DTYPES["bf16" if fp8 else precision]).train()
            kernels.weights_updated([chunk])  # FP8: the per-step weight copies, as the trainer makes them
            weights = {q.untyped_storage().data_ptr() for q in chunk.parameters()}
            storages = {}

            def pack(tensor, storages=storages, weights=weights):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in weights:
                    storages[storage.data_ptr()] = storage.nbytes()
                return tensor

            tokens = torch.randint(0, 4096, (micro, 64), generator=torch.Generator().manual_seed(0))
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
            if model["compile"] == "true":  # compile first: the saved-tensor hooks then see the compiled graph's saves
                with autocast:
                    chunk(tokens, tokens).sum().backward()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
                chunk(tokens, tokens)
            saved.append(sum(storages.values()))
        element = 4 if precision == "fp32" else 2
        planned = layer_activation_bytes(
            config.model,
            64,
            micro,
            tp,
            sp,
            recompute,
            element,
            fp8=precision == "fp8",
            compiled=model["compile"] == "true",
        )
        planned += fp8_weight_bytes(config.model, tp) if precision == "fp8" else 0  # cast once, kept per layer
        out.append(((tp, sp, recompute, precision, micro, variant), planned, saved[1] - saved[0]))
    return out


def test_activation_bytes_equal_what_loom_saves_for_backward():
    """Every tp x sequence-parallel x recompute x precision case: eager to the byte but FP8's scales (0.1%: a
    forgotten term, query/key norms' 7%, would fail), compiled within 5% (inductor's choices)."""
    results = run_ranks(_saved_per_layer, 1, ACTIVATION_CASES)[0] + run_ranks(_saved_per_layer, 2, ACTIVATION_CASES)[0]
    assert len(results) == len(ACTIVATION_CASES)
    for case, planned, saved in results:
        assert abs(planned / saved - 1) <= (0.05 if case[-1].startswith("compiled") else 0.001), (case, planned, saved)


def test_megatron_activation_bytes_are_megatron_lms_own_formula_and_count_other_widths():
    """For GPT's 4h GELU MLP, Megatron-LM's `theoretical_memory_usage`: s b h (18 + 4 ffn / h) / t with sequence
    parallelism, s b h (10 + 24 / t) without (the planner's published Megatron runs are these shapes). Its formula
    keeps 4 ffn / h for any MLP: SwiGLU's FC1 output is two halves (6 ffn, counted by Korthikanti's terms), and
    grouped-query attention keeps K and V per KV head."""
    from loom.engine.config import ModelConfig

    seq, mbs, h = 2048, 2, 1024
    gpt = ModelConfig(hidden_size=h, num_heads=16, num_kv_heads=16, ffn_hidden_size=4 * h, activation="gelu")
    for tp in (1, 2, 4, 8):
        with_sp = layer_activation_bytes(gpt, seq, mbs, tp, True, "selective", 2, MEGATRON)
        without_sp = layer_activation_bytes(gpt, seq, mbs, tp, False, "selective", 2, MEGATRON)
        assert with_sp == seq * mbs * h * (18 + 4 * gpt.ffn_hidden_size / h) / tp
        assert without_sp == seq * mbs * h * (10 + 24 / tp)
    f = 2816
    llama = dataclasses.replace(gpt, ffn_hidden_size=f, activation="swiglu")
    assert layer_activation_bytes(llama, seq, mbs, 2, True, "selective", 2, MEGATRON) == seq * mbs * (
        (18 * h + 6 * f) / 2
    )
    grouped = dataclasses.replace(gpt, num_kv_heads=4)  # K and V (2 bytes each) as wide as 4 heads, not 16
    assert layer_activation_bytes(grouped, seq, mbs, 1, True, "selective", 2, MEGATRON) == seq * mbs * (
        34 * h - 4 * (h - h // 4)
    )
    # FP8 GEMMs keep their inputs (QKV's and FC1's whole, the projection's and FC2's sharded) in 1 byte
    fp8 = layer_activation_bytes(gpt, seq, mbs, 4, False, "selective", 2, MEGATRON, fp8=True)
    assert fp8 == seq * mbs * h * ((10 - 2) + (24 - 5) / 4)


def test_fp8_output_layer_keeps_what_the_plan_says():
    """train.fp8_output_layer: the output GEMM keeps its input in 1 byte instead of 2 and reads the weight's FP8
    copy: measured with saved-tensor hooks on CPU against the same model with a bf16 output layer, equal to the
    planner's difference; and `loom plan` counts the two FP8 copies of the output weight and runs its GEMMs at the
    FP8 peak (llama-8b, by hand)."""
    from loom.engine.model.gpt import GPTModel
    from loom.engine.model.kernels import Choice, Kernels

    config = load_config("tiny", {"train": {"precision": "bf16", "fp8": "current"}, "model": {"compile": "false"}})
    native = Kernels.native()
    saved = {}
    for output_layer in (False, True):
        pieces = (
            native.attention,
            native.norm,
            native.activation,
            Choice("torch._scaled_mm", "test"),
            native.optimizer,
        )
        kernels = Kernels(*pieces, fp8="current", fp8_output_layer=output_layer)
        model = GPTModel(config.model, None, kernels=kernels).to(torch.bfloat16)
        initialize_parameters(model, 0, 0, 1)
        kernels.weights_updated([model])
        held = SavedForBackward({q.untyped_storage().data_ptr() for q in model.parameters()})
        tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda saved: saved.tensor), autocast:
            loss = model(tokens, tokens)
        saved[output_layer] = held.now  # the whole forward's, while its graph lives
        del loss
    m = config.model
    planned = [output_activation_bytes(m, 64, 2, 1, False, 2, fp8_output=on) for on in (False, True)]
    weight_copy = 4096 * m.hidden_size  # the column-major copy the input-gradient GEMM reads, kept per step
    scales = 2 * 4  # the input's and the weight's fp32 inverse scales
    assert saved[True] - saved[False] == planned[1] - planned[0] + weight_copy + scales

    rows = {}
    for on in (False, True):
        config = load_config("llama-8b", {"train": {"precision": "bf16", "fp8": "current", "fp8_output_layer": on}})
        lay = Layout(tp=1, pp=1, vp=1, dp=8, micro_batch_size=1, recompute="none", zero=1)
        rows[on] = estimate(config, lay, load_hardware("h100-sxm"))
    m, seq = config.model, config.train.seq_length
    assert rows[True].memory["activations"] - rows[False].memory["activations"] == -seq * m.hidden_size
    assert rows[True].memory["other"] - rows[False].memory["other"] == 2 * m.vocab_size * m.hidden_size
    assert rows[True].step_seconds < rows[False].step_seconds


# (parallel, model, train) on 2 ranks: each pipeline rank's peak, the first with the most micro-batches in flight
# (1F1B and interleaved), the last with the output layer and the logits.
RANK_ACTIVATION_LAYOUTS = [
    ({"pp": 2}, {}, {"micro_batch_size": 1}),
    ({"pp": 2, "vp": 2}, {"num_layers": 8}, {}),
    ({"pp": 2}, {"recompute": "selective"}, {"precision": "bf16"}),
    ({"pp": 2}, {"recompute": "full"}, {}),
    ({}, {}, {"precision": "bf16"}),
    ({"tp": 2, "sequence_parallel": True}, {}, {"precision": "bf16"}),
    ({"tp": 2}, {"recompute": "selective"}, {}),
    ({"cp": 2}, {}, {}),
    ({"cp": 2}, {"recompute": "selective"}, {"precision": "bf16"}),
    ({"cp": 2}, {"compile": "true"}, {"precision": "bf16", "steps": 2}),  # ring attention breaks the graph
    ({"pp": 2}, DENSE_FIRST_MOE, {}),
    ({"tp": 2, "sequence_parallel": True}, {**MODEL_VARIANTS["gemma2"], "logits_softcap": 30.0}, {"precision": "bf16"}),
]


def _peak_saved(rank, world, dataset, run_dir):
    out = []
    for i, (parallel, model, train) in enumerate(RANK_ACTIVATION_LAYOUTS):
        train = {"steps": 1, "global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, **train}
        config = tiny_config(dataset, f"{run_dir}/{i}", parallel=parallel, model=model, train=train)
        trainer = Trainer(config)
        compiled = trainer.kernels.compiles_blocks
        if compiled:  # compiling first: the hooks then see the compiled graphs' saves
            trainer.train_step()
        saved = SavedForBackward({q.untyped_storage().data_ptr() for c in trainer.chunks for q in c.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda held: held.tensor):
            trainer.train_step()
        planned = rank_activation_bytes(config, layout_of(config), trainer.state.pp_rank, compiled=compiled)
        out.append((f"{parallel} {model} {train} pp rank {trainer.state.pp_rank}", planned, saved.peak))
        trainer.close()
    return out


def test_activation_bytes_per_rank_equal_what_loom_keeps_at_its_peak(markov_dataset, tmp_path):
    """Within 10% (the planner is within 1% here) of the most bytes a rank's training step holds for backward
    at once, measured with saved-tensor hooks across loom's pipeline schedule."""
    for rank in run_ranks(_peak_saved, 2, markov_dataset(50), str(tmp_path)):
        for name, planned, peak in rank:
            assert abs(planned / peak - 1) <= 0.10, (name, planned, peak)


# (parallel, model, zero) per world size: every group loom has (dp, tp with and without SP, pp, the tied
# embedding's, world), every ZeRO stage, both pipeline schedules, full recompute's repeated TP collectives, the
# query/key norms' (per head: their gradients summed over TP; OLMo 2's across heads: sums of squares all-reduced),
# Gemma 3's four norms a block (their sequence-parallel gradients; the closing reduce-scatter full recompute repeats).
BF16_GRADS = {"grad_dtype": "bf16"}
TRAFFIC_LAYOUTS = {
    2: [
        ({}, {}, {"zero": 0}),
        ({}, {}, {"zero": 1}),
        ({}, {}, {"zero": 2}),
        ({}, {}, {"zero": 2, **BF16_GRADS}),
        ({}, {}, {"zero": 3}),
        ({"cp": 2}, {}, {"zero": 0}),
        ({"tp": 2}, {"qk_norm": True}, {"zero": 0}),  # the per-head norms' shared weights: gradients summed over TP
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 0}),
        ({"tp": 2, "sequence_parallel": True}, {"recompute": "full", **MODEL_VARIANTS["olmo2"]}, {"zero": 0}),
        ({"tp": 2, "sequence_parallel": True}, {"recompute": "full", **MODEL_VARIANTS["gemma3"]}, {"zero": 1}),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 0}),
        ({"pp": 2, "vp": 2}, {}, {"zero": 0}),
    ],
    4: [
        ({"tp": 2}, {"recompute": "full"}, {"zero": 1}),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 2}),
        ({"tp": 2, "pp": 2, "vp": 2, "sequence_parallel": True}, {"tie_embeddings": True}, {"zero": 0}),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 1, **BF16_GRADS}),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 0, **BF16_GRADS}),
        ({"tp": 2, "sequence_parallel": True}, {}, {"zero": 3}),
        # the router's and the shared expert's gate's gradients summed over TP; the router losses ride on the loss's
        # sum over DP
        # (and the experts' loads summed over DP once a step)
        ({"tp": 2, "sequence_parallel": True}, {**MODEL_VARIANTS["biased_moe"], **DENSE_FIRST_MOE}, {"zero": 1}),
        ({"pp": 2}, {"tie_embeddings": True}, {"zero": 3}),
        ({"cp": 2, "tp": 2, "sequence_parallel": True}, {"recompute": "full"}, {"zero": 1}),
        ({"cp": 2, "pp": 2}, {}, {"zero": 2}),
        ({"cp": 2}, {"recompute": "selective"}, {"zero": 3}),
        ({"cp": 4}, {}, {"zero": 0}),
        # expert parallelism: the experts' gradients over their own ranks, each block's all-to-alls (recomputed)
        ({"ep": 2}, {"num_experts": 4, "recompute": "full"}, {"zero": 1}),
    ],
}


def _traffic(rank, world, dataset, run_dir):
    out = []
    for i, (parallel, model, optim) in enumerate(TRAFFIC_LAYOUTS[world]):
        train = {"precision": "bf16", "steps": 2, "global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32}
        config = tiny_config(
            dataset,
            f"{run_dir}/{i}",
            parallel={**parallel, "grad_bucket_mb": 0.25},
            model=model,
            optim=optim,
            train={**train, "comm_ledger": True},
        )
        trainer = Trainer(config)
        trainer.train_step()
        trainer.train_step()
        trainer.close()
        ledger = {
            (c["group"], c["op"], c["dtype"]): c["bytes"] for c in read_ledger(config.train.run_dir, rank)[1]["calls"]
        }
        name = f"{parallel} {model} {optim} rank {rank}"
        out.append((name, step_traffic(config, layout_of(config), trainer.state.pp_rank), ledger))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_communication_bytes_equal_the_ledger(markov_dataset, tmp_path, world):
    """Every (group, collective, dtype) loom's ledger records in a step, and its bytes, and nothing more."""
    ranks = run_ranks(_traffic, world, markov_dataset(50), str(tmp_path))
    for layout, results in enumerate(zip(*ranks, strict=True)):
        # what an expert-parallel rank sends back (its experts' outputs, their inputs' gradients) is what it
        # received, which routing decides: the planner's balanced load holds summed over the ranks
        routed = {key for _, planned, _ in results for key in planned if key[:2] == ("ep", "all_to_all")}
        for key in routed - {("ep", "all_to_all", "int64")}:
            assert sum(p.pop(key) for _, p, _ in results) == sum(ledger.pop(key) for *_, ledger in results), layout
        for name, planned, ledger in results:
            assert planned == ledger, name
