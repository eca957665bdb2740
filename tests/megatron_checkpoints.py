"""Writes Megatron-LM checkpoints the way Megatron-LM's training loop does, with megatron-core on CPU, for
tests/test_megatron_checkpoint.py: `python megatron_checkpoints.py OUT PORT` makes OUT/<variant>/ (a --save folder:
latest_checkpointed_iteration.txt and iter_0000007 in torch_dist) and OUT/<variant>.pt (the tokens and the logits
megatron-core's GPTModel computes for them). `python megatron_checkpoints.py OUT PORT WORLD JOB ...` runs each JOB
on WORLD processes (gloo; those beyond a job's layout are data-parallel replicas): `read:TP:NAME=SAVE` loads SAVE
(loom's export) into variant NAME's model split over TP tensor-parallel ranks with megatron-core's loader and writes
its logits to OUT/NAME.loaded_tp<TP>.pt; `torch:TP:PP:VP:NAME` re-saves variant NAME in Megatron-LM's older torch
format at that layout (write_torch_format). One start for all jobs: megatron-core takes seconds to import.

Megatron-LM's save (megatron/training/checkpointing.py, generate_state_dict) hands dist_checkpointing.save the
state dict {"args": its argparse Namespace, "checkpoint_version": 3.0, "iteration": N, "model": the model's
sharded_state_dict(), ...}; the tensors go to the .distcp files under their global keys, the rest to common.pt. That
is what is done here, with the arguments a Megatron-LM run of each variant holds (an AttnBackend enum among them, as
there). megatron-core reaches for CUDA in two places on a forward and one on a save; those are pointed at the CPU.
It runs in a process of its own: the patches and megatron's process groups stay out of pytest's.
"""

import argparse
import contextlib
import functools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

torch.cuda.current_device = lambda: "cpu"  # rotary_pos_embedding moves its frequencies to "the" CUDA device
torch.cuda.synchronize = lambda *args, **kwargs: None  # the async writer's preload synchronizes first

VOCAB, PADDED_VOCAB, SEQ = 250, 256, 24


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's own --squared-relu activation (imported when first called: megatron-core takes seconds)."""
    from megatron.core.activations import squared_relu as megatron_squared_relu

    return megatron_squared_relu(x)


# Each variant: megatron-core's TransformerConfig fields and GPTModel arguments, the Megatron-LM arguments that
# produce them, and how it is saved.
VARIANTS = {
    # Llama-shaped, megatron-core's default stacked layers, with norms on queries and keys (Qwen3's), another
    # score factor than 1 / sqrt(head size) (--softmax-scale) and linearly interpolated rotary positions
    # (--rotary-seq-len-interpolation-factor)
    "llama": dict(
        config=dict(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            num_query_groups=2,
            qk_layernorm=True,
            softmax_scale=0.2,
        ),
        model=dict(
            position_embedding_type="rope",
            rotary_base=500000,
            seq_len_interpolation_factor=4.0,
            share_embeddings_and_output_weights=False,
        ),
        args=dict(
            rotary_seq_len_interpolation_factor=4.0,
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=True,
            softmax_scale=0.2,
            group_query_attention=True,
            num_query_groups=2,
            position_embedding_type="rope",
            rotary_base=500000,
            untie_embeddings_and_output_weights=True,
            bias_gelu_fusion=False,
        ),
        per_layer_keys=False,
        bf16=False,
    ),
    # GPT-3-shaped (Megatron-LM's defaults: LayerNorm, biases, learned positions, tied, fused bias-GELU, whose
    # kernel is the tanh form), one key per layer (non_homogeneous_layers)
    "gpt": dict(
        config=dict(
            normalization="LayerNorm",
            activation_func=functools.partial(F.gelu, approximate="tanh"),
            add_bias_linear=True,
        ),
        model=dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True),
        args=dict(
            normalization="LayerNorm",
            swiglu=False,
            add_bias_linear=True,
            add_qkv_bias=True,
            group_query_attention=False,
            num_query_groups=1,
            position_embedding_type="learned_absolute",
            add_position_embedding=True,
            untie_embeddings_and_output_weights=False,
            bias_gelu_fusion=True,
        ),
        per_layer_keys=True,
        bf16=False,
    ),
    # multi-query attention, interleaved rotary pairs with Llama 3's scaling over half of each head (the rows past
    # them unrotated), tied, zero-centred norm weights (stored minus one, as Transformer Engine's
    # --apply-layernorm-1p norms hold them), biases on QKV alone (Qwen's --add-qkv-bias), norms on queries and
    # keys (whose weights follow the interleaved rows) and a squared-ReLU MLP (Nemotron-4's --squared-relu), saved
    # in bf16
    "interleaved": dict(
        config=dict(
            normalization="RMSNorm",
            gated_linear_unit=False,
            activation_func=squared_relu,
            add_bias_linear=False,
            add_qkv_bias=True,
            qk_layernorm=True,
            num_query_groups=1,
            rotary_interleaved=True,
        ),
        model=dict(
            position_embedding_type="rope",
            rotary_base=10000,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            rotary_percent=0.5,
            share_embeddings_and_output_weights=True,
        ),
        args=dict(
            normalization="RMSNorm",
            add_bias_linear=False,
            add_qkv_bias=True,
            qk_layernorm=True,
            group_query_attention=True,
            num_query_groups=1,
            position_embedding_type="rope",
            rotary_base=10000,
            rotary_interleaved=True,
            rotary_percent=0.5,
            use_rope_scaling=True,
            rope_scaling_factor=8.0,
            untie_embeddings_and_output_weights=False,
            layernorm_zero_centered_gamma=True,
            bias_gelu_fusion=False,
            swiglu=False,
            squared_relu=True,
        ),
        per_layer_keys=False,
        bf16=True,
        zero_centred=True,
    ),
}
SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)


def megatron_arguments(variant: dict, attention_backend) -> argparse.Namespace:
    arguments = dict(
        **SHAPE,
        kv_channels=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
        layernorm_epsilon=1e-5,
        max_position_embeddings=64,
        seq_length=SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED_VOCAB,
        make_vocab_size_divisible_by=128,
        rotary_percent=1.0,
        rotary_interleaved=False,
        layernorm_zero_centered_gamma=False,
        num_experts=None,
        multi_latent_attention=False,
        qk_layernorm=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        params_dtype=torch.bfloat16 if variant["bf16"] else torch.float32,
        bf16=variant["bf16"],
        attention_backend=attention_backend,
        ckpt_format="torch_dist",
        consumed_train_samples=7 * 16,
        tokenizer_type="GPT2BPETokenizer",
    )
    return argparse.Namespace(**{**arguments, **variant["args"]})


def build(name: str, variant: dict, stage: dict | None = None, **config_changes):
    """The variant's megatron-core GPTModel (its weights drawn from a seed of its own); `stage`: GPTModel's
    pre_process, post_process and vp_stage for a pipeline chunk."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **SHAPE,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        attention_backend=AttnBackend.local,
        init_method_std=0.2,  # larger than training's 0.02, so the logits depend on every weight visibly
        **{**variant["config"], **config_changes},
    )
    torch.manual_seed(len(name))
    spec = get_gpt_layer_local_spec(
        normalization=variant["config"]["normalization"], qk_layernorm=variant["config"].get("qk_layernorm", False)
    )
    return GPTModel(
        config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=64, **variant["model"], **(stage or {})
    ).eval()


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    causal = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(tokens, positions, causal).float()


def write(out: Path, name: str, variant: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.enums import AttnBackend

    model = build(name, variant)
    with torch.no_grad():
        for param in model.parameters():  # norms start at ones and biases at zeros: give them values to carry
            param.add_(torch.randn_like(param) * 0.1)
            if variant["bf16"]:
                param.copy_(param.bfloat16().float())  # the logits of the weights as saved
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits = logits_of(model, tokens)
    if variant["bf16"]:
        model = model.bfloat16()
    state = model.sharded_state_dict(metadata={"non_homogeneous_layers": variant["per_layer_keys"]})
    if variant.get("zero_centred"):
        with torch.no_grad():
            for sharded in state.values():
                # TE's norms (the fused input norms, q/k_layernorm, final_layernorm) all hold gamma minus one
                if "layer_norm_weight" in sharded.key or sharded.key.endswith("layernorm.weight"):
                    sharded.data.sub_(1)
    save = out / name
    iteration = save / "iter_0000007"
    iteration.mkdir(parents=True)
    arguments = megatron_arguments(variant, AttnBackend.auto)
    dist_checkpointing.save(
        {"args": arguments, "checkpoint_version": 3.0, "iteration": 7, "model": state}, str(iteration)
    )
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    torch.save({"tokens": tokens, "logits": logits}, out / f"{name}.pt")


def read(out: Path, name: str, save: Path, tp: int) -> None:
    """megatron-core's load of the --save folder `save` (loom's export of the variant: rotate-half rotary pairs
    and plain norm weights, the way loom computes them) into the variant's model split over `tp` tensor-parallel
    ranks (its loader reshards); its logits on the variant's tokens (the vocabulary shards gathered) go to
    OUT/<name>.loaded_tp<tp>.pt."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = build(name, VARIANTS[name], rotary_interleaved=False, tensor_model_parallel_size=tp)
    tracker = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    folder = save / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    metadata = {"non_homogeneous_layers": False}
    state = model.sharded_state_dict(metadata=metadata)
    # With Transformer Engine installed (Megatron-LM's default), the final norm is TE's whatever the layer spec, and
    # its extra state is asked for too (megatron-core's sharded_state_dict_default of a module without its own)
    final_norm = "decoder.final_layernorm._extra_state"
    rank = parallel_state.get_tensor_model_parallel_rank()
    replica = (0, rank, parallel_state.get_data_parallel_rank())
    state[final_norm] = ShardedObject(final_norm, None, (1,), (0,), replica_id=replica)
    loaded = dist_checkpointing.load({"model": state}, str(folder))
    assert loaded["model"].pop(final_norm) is None  # what TE's set_extra_state takes as "nothing saved"
    model.load_state_dict(loaded["model"])
    tokens = torch.load(out / f"{name}.pt")["tokens"]
    logits = logits_of(model, tokens)
    shards = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(shards, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        result = {"logits": torch.cat(shards, dim=-1), "iteration": loaded.get("iteration")}
        torch.save(result, out / f"{name}.loaded_tp{tp}.pt")


def write_torch_format(out: Path, name: str, tp: int, pp: int, vp: int) -> None:
    """The variant saved as Megatron-LM's older torch format holds it after training at tensor `tp` x pipeline `pp`
    (x `vp` virtual stages): megatron-core loads its torch_dist save into this rank's chunks (its own resharding),
    and each chunk's state_dict_for_save_checkpoint goes to OUT/<name>.torch_tp<tp>_pp<pp>_vp<vp>/iter_0000007/
    mp_rank_TT[_PPP]/model_optim_rng.pt beside what Megatron saves with it (generate_state_dict: the arguments,
    iteration, optimizer state and random-number states, numpy's among them)."""
    import random

    import numpy as np
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.transformer.enums import AttnBackend

    variant = VARIANTS[name]
    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    changes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    if vp > 1:
        changes["virtual_pipeline_model_parallel_size"] = vp
    names = ["model"] if vp == 1 else [f"model{v}" for v in range(vp)]
    chunks = {}
    for v, key in enumerate(names):
        stage = dict(pre_process=pp_rank == 0 and v == 0, post_process=pp_rank == pp - 1 and v == vp - 1)
        chunks[key] = build(name, variant, {**stage, **({"vp_stage": v} if vp > 1 else {})}, **changes)
    metadata = {"non_homogeneous_layers": variant["per_layer_keys"]}
    states = {key: model.sharded_state_dict(metadata=metadata) for key, model in chunks.items()}
    loaded = dist_checkpointing.load(states, str(out / name / "iter_0000007"))
    saved = {"checkpoint_version": 3.0, "iteration": 7}
    for key, model in chunks.items():
        model.load_state_dict(loaded[key])
        saved[key] = (model.bfloat16() if variant["bf16"] else model).state_dict_for_save_checkpoint()
    chunk = saved[names[-1]]
    arguments = megatron_arguments(variant, AttnBackend.auto)
    arguments.tensor_model_parallel_size, arguments.pipeline_model_parallel_size = tp, pp
    arguments.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    arguments.ckpt_format = "torch"
    moments = {
        i: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
        for i, t in enumerate(v for v in chunk.values() if isinstance(v, torch.Tensor))
    }
    rng = dict(
        random_rng_state=random.getstate(),
        np_rng_state=np.random.get_state(),
        torch_rng_state=torch.get_rng_state(),
        rng_tracker_states={},
    )
    saved.update(args=arguments, optimizer={"optimizer": {"state": moments}}, rng_state=[rng])
    save = out / f"{name}.torch_tp{tp}_pp{pp}_vp{vp}"
    folder = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" if pp > 1 else f"mp_rank_{tp_rank:02d}"
    if parallel_state.get_data_parallel_rank() == 0:
        (save / "iter_0000007" / folder).mkdir(parents=True, exist_ok=True)
        torch.save(saved, save / "iter_0000007" / folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (save / "latest_checkpointed_iteration.txt").write_text("7")


def _rank(rank: int, world: int, port: str, out: Path, jobs: list[str]) -> None:
    """One rank of megatron-core's process group: writes the variants (no jobs) or runs the jobs, each under its
    tensor x pipeline (x virtual) layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # megatron-core's dropout RNG tracker is CUDA's; with dropout 0 it only has to be enterable
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    # the last pipeline stage's copy of a tied embedding is all-reduced "on CUDA" at construction
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    if not jobs:
        parallel_state.initialize_model_parallel(1, 1)
        for name, variant in VARIANTS.items():
            write(out, name, variant)
    for job in jobs:
        kind, *layout, what = job.split(":", 4 if job.startswith("torch:") else 2)
        tp, pp, vp = (*map(int, layout), 1, 1)[:3]
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
        if kind == "read":
            name, save = what.split("=", 1)
            read(out, name, Path(save), tp)
        else:
            write_torch_format(out, what, tp, pp, vp)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    """OUT PORT [WORLD JOB ...]"""
    out, port, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    world, jobs = (int(rest[0]), rest[1:]) if rest else (1, [])
    if world == 1:
        _rank(0, 1, port, out, jobs)
    else:
        torch.multiprocessing.spawn(_rank, args=(world, port, out, jobs), nprocs=world)


if __name__ == "__main__":
    main()
