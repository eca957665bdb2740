"""LoRA: adapters under every layout against the single-rank LoRA run, a frozen base that stays bit-identical,
checkpoints of adapters only that resume under another layout, the merged model and the PEFT adapter against
the adapter model's own logits (peft and transformers are the outside references), and a LoRA run on a model
that transformers wrote.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from training_runs import assert_trains_as_torch_loop, loom_here, one_line_error, tiny_config

from loom.engine.checkpoint.format import find_loadable
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model.gpt import GPTModel
from loom.engine.model.lora import add_adapters
from loom.engine.optim.model_parallel_grads import local_grad
from loom.engine.parallel.param_info import param_info
from loom.engine.train import Trainer
from loom.tools.ckpt import reshard

STEPS = 4
RANK = 4


def _train_base(rank, world, dataset, run_dir):
    trainer = Trainer(tiny_config(dataset, run_dir, train={"steps": 3}, checkpoint={"interval": 3}))
    trainer.run()
    trainer.close()


@pytest.fixture(scope="module")
def base(dataset, tmp_path_factory) -> str:
    """A tiny model trained 3 steps: the frozen base of every LoRA run here."""
    run_dir = tmp_path_factory.mktemp("lora-base")
    run_ranks(_train_base, 1, dataset, str(run_dir))
    return str(run_dir / "checkpoints")


def _lora_config(dataset, run_dir, base, parallel=None, **sections):
    train = {"steps": STEPS, "micro_batch_size": 2, **sections.pop("train", {})}
    return tiny_config(
        dataset,
        run_dir,
        parallel={"grad_bucket_mb": 0.25, **(parallel or {})},
        train=train,
        lora={"rank": RANK, "alpha": 8.0, "base": base, **sections.pop("lora", {})},
        **sections,
    )


def _frozen_equal_base(trainer: Trainer, base: str) -> bool:
    directory, metadata = find_loadable(Path(base))
    reader = PieceReader(directory, metadata)
    state = trainer.state
    sharded = trainer.optimizer.sharded_params  # ZeRO-3: gathered a bucket at a time, on every DP rank
    weights = sharded.whole_weights() if sharded else ((q, q) for chunk in trainer.chunks for q in chunk.parameters())
    equal = True
    for param, weight in weights:
        if param.requires_grad:
            continue
        info = param_info(param)
        saved = info.shard_spec.shard(reader.model(info.name), state.tp_rank, state.tp_size)
        equal &= param.grad is None and torch.equal(weight.detach().cpu(), saved.to(param.dtype))
    return equal


def _run(dataset, run_dir, base, parallel=None, steps=STEPS, **sections) -> tuple[list[float], Trainer]:
    trainer = Trainer(_lora_config(dataset, run_dir, base, parallel, **sections))
    losses = []
    while trainer.step < steps:
        losses.append(trainer.train_step()["loss"])
        if trainer.step in (2, steps):
            trainer.save()
    return losses, trainer


def _single_rank(rank, world, dataset, run_dir, base):
    losses, trainer = _run(dataset, f"{run_dir}/single", base)
    trainable = sum(p.numel() for p in trainer.params)
    held = {
        "trainable": trainable,
        "grads": sum(
            local_grad(q).numel() for chunk in trainer.chunks for q in chunk.parameters() if local_grad(q) is not None
        ),
        "state": trainer.optimizer.state_bytes(),
        "frozen_equal": _frozen_equal_base(trainer, base),
    }
    trainer.close()
    return losses, held


LAYOUTS = {
    "tp2-sp-recompute": ({"tp": 2, "sequence_parallel": True}, {"model": {"recompute": "full"}}),
    "pp2-vp2": ({"pp": 2, "vp": 2}, {}),
    "dp2-zero1": ({}, {"optim": {"zero": 1}}),
    "dp2-zero3": ({}, {"optim": {"zero": 3}}),  # the frozen base sharded too
}


def _two_ranks(rank, world, dataset, run_dir, base):
    results = {}
    for name, (parallel, sections) in LAYOUTS.items():
        losses, trainer = _run(dataset, f"{run_dir}/{name}", base, parallel, **sections)
        results[name] = losses, _frozen_equal_base(trainer, base)
        trainer.close()
    # The tp2 run's adapter checkpoint of step 2, resumed as pp2.
    resumed = Trainer(
        _lora_config(
            dataset,
            f"{run_dir}/resumed",
            base,
            {"pp": 2},
            checkpoint={"load": f"{run_dir}/tp2-sp-recompute/checkpoints/iter_0000002"},
        )
    )
    results["tp2->pp2 resume"] = [resumed.train_step()["loss"] for _ in range(STEPS - 2)], True
    resumed.close()
    bf16, trainer = _run(dataset, f"{run_dir}/bf16", base, {"pp": 2}, train={"precision": "bf16"})
    results["pp2-bf16"] = bf16, _frozen_equal_base(trainer, base)
    trainer.close()
    return results


def _expected_trainable(model) -> int:
    """r x (in + out) per adapted layer, worked out from the model's shapes."""
    q, kv = model.hidden_size, model.num_kv_heads * model.hidden_size // model.num_heads
    h, f = model.hidden_size, model.ffn_hidden_size
    per_layer = (h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h)
    return RANK * per_layer * model.num_layers


@pytest.fixture(scope="module")
def single_rank(dataset, base, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-single")
    losses, held = run_ranks(_single_rank, 1, dataset, str(run_dir), base)[0]
    return losses, held, run_dir / "single"


def test_lora_trains_only_the_adapters(dataset, single_rank):
    losses, held, run_dir = single_rank
    model = tiny_config(dataset, "unused").model
    assert held["trainable"] == _expected_trainable(model)
    assert held["grads"] == held["trainable"], "only adapters have gradient space"
    assert held["state"] == 8 * held["trainable"], "fp32 AdamW: two moments per adapter parameter, nothing else"
    assert held["frozen_equal"], "the base weights must be bit-identical after training and get no gradient"
    assert len(set(losses)) == STEPS and all(math.isfinite(x) for x in losses)
    _, metadata = find_loadable(run_dir / "checkpoints")
    assert metadata.lora_base is not None and len(metadata.lora_base["metadata_sha256"]) == 64
    assert all(".adapter.lora_" in name for name in metadata.specs), "a LoRA checkpoint holds only adapters"
    resharded = reshard(run_dir / "checkpoints", run_dir.parent / "resharded", tp=2, pp=2)
    assert find_loadable(resharded)[1].lora_base == metadata.lora_base
    assert _max_adapter_difference(run_dir, run_dir.parent / "resharded") == 0.0


def test_lora_under_every_layout_gives_the_single_rank_losses(dataset, base, single_rank, tmp_path):
    reference = single_rank[0]
    results = run_ranks(_two_ranks, 2, dataset, str(tmp_path), base)[-1]
    for name in LAYOUTS:
        losses, frozen_equal = results[name]
        assert frozen_equal, name
        for a, b in zip(reference, losses, strict=True):
            assert abs(a - b) / a < 1e-5, name
        # AdamW moves each element by up to lr (1e-3) a step whatever its gradient's size, so an element of A
        # whose gradient is at rounding level (B is ~1e-3 after one step) moves by a rounding-sized share of lr:
        # measured 2.8e-5 at tp2 with SP and recompute on one 2-core machine (others stayed under 1e-5). A wrong
        # reduction of A's gradient (a TP partial not summed) turns elements by ~lr.
        assert _max_adapter_difference(single_rank[2], tmp_path / name) < 1e-4, name
    for a, b in zip(reference[2:], results["tp2->pp2 resume"][0], strict=True):
        assert abs(a - b) / a < 1e-5, "resuming the tp2 adapters at pp2"
    bf16, frozen_equal = results["pp2-bf16"]
    assert frozen_equal
    for a, b in zip(reference, bf16, strict=True):
        assert abs(a - b) / a < 2e-2, "bf16 follows fp32 to bf16's precision"


def _adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    directory, metadata = find_loadable(run_dir)
    reader = PieceReader(directory, metadata)
    return {name: reader.model(name) for name in metadata.specs}


def _max_adapter_difference(run_a: Path, run_b: Path) -> float:
    """The largest difference between two runs' final adapter weights, joined from their layouts' pieces: the
    losses of a few steps hardly see a wrong reduction of A's gradient while B is still near zero; A does."""
    a, b = _adapters(run_a), _adapters(run_b)
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _adapter_model(lora_checkpoint) -> GPTModel:
    """The LoRA model as training computes it (adapters beside frozen weights, nothing folded), on one process."""
    directory, metadata = find_loadable(lora_checkpoint)
    config = config_from_dict(metadata.config)
    model = GPTModel(config.model, None)
    add_adapters(model, config.lora, None)
    adapters = PieceReader(directory, metadata)
    base_dir, base_metadata = find_loadable(Path(metadata.lora_base["path"]))
    base = PieceReader(base_dir, base_metadata)
    with torch.no_grad():
        for _, param in model.named_parameters():
            name = param_info(param).name
            param.copy_((adapters if name in metadata.specs else base).model(name))
    return model.eval()


# The Hugging Face modules of each loom LoRA target, in the order of the rows of its B (one A serves them all)
PEFT_MODULES = {
    "attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "attention.proj": ["self_attn.o_proj"],
    "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.fc2": ["mlp.down_proj"],
}


def _peft_names(name: str) -> list[str]:
    """The parameters of peft's model that loom's adapter matrix `name` (layers.L.attention.qkv.lora_a) stands for."""
    layer, target = name.split(".")[1], ".".join(name.split(".")[2:4])
    modules = [f"base_model.model.model.layers.{layer}.{module}" for module in PEFT_MODULES[target]]
    return [f"{module}.lora_{name[-1].upper()}.default.weight" for module in modules]


def test_merged_model_and_peft_adapter_give_the_lora_logits(single_rank, base, tmp_path, live_tensors):
    """The merged model and the PEFT adapter on the exported base give the LoRA run's logits; merge-lora folds and
    writes one weight at a time (it held the whole merged model: at 8B, 32 GB)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from loom.tools.generate import load_model
    from loom.tools.hf import export_hf, export_peft_adapter
    from loom.tools.lora import ModelWeights, merge_lora

    run_dir = single_rank[2]
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    adapter_model = _adapter_model(run_dir / "checkpoints")
    expected = adapter_model(tokens)  # [s, b, V]
    base_logits = load_model(find_loadable(Path(base))[0])[0](tokens)
    assert (expected - base_logits).abs().max() > 1e-3, "the adapters must have moved away from zero"

    folded = live_tensors(ModelWeights, "__getitem__")
    merge_lora(run_dir, tmp_path / "merged")
    assert folded.made >= 10 and folded.most <= 2, (folded.made, folded.most)
    merged, merged_config = load_model(tmp_path / "merged")
    assert not merged_config.lora.enabled
    torch.testing.assert_close(merged(tokens), expected, rtol=1e-5, atol=1e-5)

    export_hf(Path(base), tmp_path / "hf-base")
    export_peft_adapter(run_dir, tmp_path / "adapter")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-base", torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).eval()
    hf_logits = with_adapter(tokens[:, :-1]).logits
    torch.testing.assert_close(hf_logits.detach().transpose(0, 1), expected[:-1].detach(), rtol=1e-5, atol=1e-5)

    # the adapters' gradients of the loss equal peft's: one A's is the sum over the modules it serves, B's rows theirs
    vocab = hf_logits.shape[-1]
    torch.nn.functional.cross_entropy(hf_logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    adapter_model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
    theirs = {name: p.grad for name, p in with_adapter.named_parameters() if p.requires_grad}
    compared = set()
    for name, param in adapter_model.named_parameters():
        if not param.requires_grad:
            continue
        peft_names = _peft_names(name)
        if name.endswith("lora_a"):
            expected_grad = sum(theirs[peft_name] for peft_name in peft_names)
        else:
            expected_grad = torch.cat([theirs[peft_name] for peft_name in peft_names])
        torch.testing.assert_close(param.grad, expected_grad, rtol=1e-4, atol=1e-7, msg=name)
        compared.update(peft_names)
    assert compared == set(theirs)  # every adapter of peft's model compared


def test_readme_lora_recipe_on_a_model_transformers_wrote(dataset, tmp_path, monkeypatch, capfd):
    """The README's LoRA recipe as a user runs it: import a Llama that transformers saved, fine-tune adapters at
    tp 2, merge, export (merged and adapter-only) and generate; transformers' greedy decoding of the exported
    merged model gives loom's tokens, on one process and split over tp 2, pp 2 or both."""
    transformers = pytest.importorskip("transformers")
    from loom.launch.cli import main

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=7,
        eos_token_id=9,
    )
    transformers.LlamaForCausalLM(hf_config).save_pretrained(str(tmp_path / "hf-llama"))
    monkeypatch.chdir(tmp_path)  # the README's relative paths

    def _loom(*args: str) -> str:
        """`loom ARGS` through the console script's entry point, in this process; its stdout."""
        main(list(args))
        return capfd.readouterr().out

    _loom("ckpt", "import-hf", "--input", "hf-llama", "--output", "runs/base/checkpoints")
    out = _loom(
        "train", "--config", "tiny", "--data.paths", dataset, "--data.tokenizer", "none", "--train.name", "lora",
        "--train.steps", "4", "--train.eval_interval", "0", "--checkpoint.interval", "4", "--nproc", "2",
        "--parallel.tp", "2", "--lora.rank", "8", "--lora.base", "runs/base",
    )  # fmt: skip
    assert "trainable parameters of" in out and "hidden_size: 128 -> 64" in out
    # the base's context, not the preset's default (training's 128 tokens fit it), said with the rest; a longer
    # training context keeps the run's (the ranks, which rebuild the config, decide alike)
    assert "max_position_embeddings: 4096 -> 256" in out
    from loom.engine.config_io import config_from_dict, config_to_dict, load_config
    from loom.engine.model.lora import adopt_base_model

    longer = load_config("tiny", {"lora": {"rank": 8, "base": "runs/base"}, "train": {"seq_length": 512}})
    in_a_rank = config_from_dict(config_to_dict(longer))
    for config in (longer, in_a_rank):
        adopt_base_model(config)
        assert config.model.max_position_embeddings == 4096
    _loom("ckpt", "merge-lora", "--checkpoint", "runs/lora", "--output", "runs/lora-merged/checkpoints")
    _loom("ckpt", "export-hf", "--checkpoint", "runs/lora-merged", "--output", "hf-merged")
    exported = json.loads((tmp_path / "hf-merged" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (7, 9)  # the imported model's, through the merge
    _loom("ckpt", "export-hf", "--checkpoint", "runs/lora", "--adapter-only", "--output", "lora-adapter")
    assert (tmp_path / "lora-adapter" / "adapter_model.safetensors").is_file()
    adapter_config = json.loads((tmp_path / "lora-adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "hf-llama").resolve())  # what was imported
    prompt = [5, 17, 300, 42, 7]
    tokens = _loom(
        "generate", "--checkpoint", "runs/lora", "--prompt-ids", " ".join(map(str, prompt)),
        "--max-new-tokens", "8",
    ).split()  # fmt: skip
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf-merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0].tolist()
    assert tokens == [str(t) for t in theirs]
    layouts = (
        ("2", ["--parallel.tp", "2"]),
        ("2", ["--parallel.pp", "2"]),
        ("4", ["--parallel.tp", "2", "--parallel.pp", "2"]),  # hung: each pipeline's broadcast on the world group
    )
    for nproc, layout in layouts:
        split = _loom(
            "generate", "--checkpoint", "runs/lora", "--prompt-ids", " ".join(map(str, prompt)),
            "--max-new-tokens", "8", "--nproc", nproc, *layout,
        ).split()  # fmt: skip
        assert split == tokens, layout


def test_a_lora_run_resumed_on_another_base_or_without_adapters_is_refused_before_its_ranks(
    dataset, base, single_rank, tmp_path
):
    """Each was rank 0's error (exit 1) after the ranks had started; the launcher's checks now say it in one line."""
    import shutil

    from loom.engine.checkpoint.format import CheckpointError
    from loom.engine.preflight import preflight

    run, other = single_rank[2], tmp_path / "other-base"
    shutil.copytree(base, other)
    for metadata in other.glob("iter_*/metadata.json"):  # the same tensors, but not the same metadata.json's sha256
        metadata.write_text(json.dumps(json.loads(metadata.read_text()), indent=2))
    with pytest.raises(CheckpointError, match="adapters were trained on .* but lora.base is .*: another model"):
        preflight(_lora_config(dataset, run, str(other), train={"steps": STEPS + 2}), 1)
    with pytest.raises(CheckpointError, match="is a LoRA checkpoint .* merge-lora --checkpoint"):
        preflight(tiny_config(dataset, run, train={"steps": STEPS + 2}), 1)
    shutil.rmtree(other)  # a base that moved: named as such, not as "holds no intact checkpoint"
    with pytest.raises(CheckpointError, match=f"lora.base = {other} does not exist .moved. give its new place"):
        preflight(_lora_config(dataset, run, str(other), train={"steps": STEPS + 2}), 1)


def test_lora_refusals_are_one_line(tmp_path, base, single_rank, capfd):
    from loom.engine.checkpoint.format import CheckpointError
    from loom.engine.config import ConfigError
    from loom.engine.model.lora import check_same_base, open_base

    with pytest.raises(ConfigError, match="needs the base model"):
        config_from_dict({"lora": {"rank": 8}})
    with pytest.raises(ConfigError, match="subset of qkv, proj, fc1, fc2"):
        config_from_dict({"lora": {"rank": 8, "base": base, "targets": ["q_proj"]}})
    lora_run = single_rank[2]
    with pytest.raises(CheckpointError, match="is itself a LoRA checkpoint"):
        open_base(str(lora_run))
    pointer = open_base(base)[2]
    other = {**pointer, "metadata_sha256": "0" * 64}
    with pytest.raises(
        CheckpointError, match=re.escape(f"another model; pass --lora.base {other['path']} to continue")
    ):
        check_same_base(lora_run, other, pointer)
    with pytest.raises(CheckpointError, match="merge-lora"):
        check_same_base(lora_run, pointer, None)
    with pytest.raises(CheckpointError, match="not --checkpoint.load, and trains in a run directory of its own"):
        check_same_base(Path(base), None, pointer)
    check_same_base(lora_run, pointer, pointer)
    adapters_in_bf16 = loom_here(
        capfd, "ckpt", "export-hf", "--checkpoint", str(lora_run), "--adapter-only", "--dtype", "bfloat16",
        "--output", str(tmp_path / "adapter"),
    )  # fmt: skip
    one_line_error(
        adapters_in_bf16, "--dtype is for the whole model's export; --adapter-only writes the adapters alone"
    )
    assert not (tmp_path / "adapter").exists()


def _lora_loop(rank, world, raw_config):
    """The loom side of the loop test: the adapters as initialised, then each step's (loss, grad norm, lr)."""
    trainer = Trainer(config_from_dict(raw_config))
    initial = {param_info(p).name: p.detach().clone() for chunk in trainer.chunks for p in chunk.parameters()}
    initial = {name: value for name, value in initial.items() if ".lora_" in name}
    rows = [trainer.train_step() for _ in range(raw_config["train"]["steps"])]
    trainer.close()
    return initial, [(row["loss"], row["grad_norm"], row["lr"]) for row in rows]


def test_a_lora_run_trains_as_peft_with_torch_adamw(dataset, base, tmp_path):
    """The LoRA training loop against an outside one: adapters on the attention projection and FC2 (modules peft
    adapts one to one; loom's qkv and fc1 share one A among q/k/v or gate/up, which the gradient test above
    covers) trained 4 steps by loom with 2 micro-batches per step, warm-up then cosine, clipping and decay, and by
    peft on the exported base with torch's AdamW and clip_grad_norm_ from the same initial adapters on the same
    samples. Checks what only a loop sees: the trainable set, the decay groups, the clipped norm over adapters
    alone, alpha / r, the micro-batch average."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from loom.engine.data.loader import build_dataset
    from loom.tools.hf import export_hf

    steps, global_batch, micro_batch, seq = 4, 4, 2, 32
    config = _lora_config(
        dataset,
        tmp_path / "run",
        base,
        data={"split": "100,0,0", "cache_dir": str(tmp_path / "cache")},
        train={"steps": steps, "global_batch_size": global_batch, "micro_batch_size": micro_batch, "seq_length": seq},
        optim={
            "lr": 1e-2,
            "min_lr": 1e-3,
            "warmup_steps": 2,
            "decay": "cosine",
            "weight_decay": 0.1,
            "clip_grad": 0.05,
        },
        lora={"targets": ["proj", "fc2"]},
    )
    initial, loom_rows = run_ranks(_lora_loop, 1, config_to_dict(config))[0]

    export_hf(Path(base), tmp_path / "hf-base")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-base", dtype=torch.float32)
    lora = config.lora
    settings = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=["o_proj", "down_proj"]
    )
    model = peft.get_peft_model(hf, settings)
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial.items():
            [peft_name] = _peft_names(name)  # proj and fc2: one peft module each
            theirs[peft_name].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(v.numel() for v in initial.values())
    o = config.optim
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    config.resolve_world(1)
    samples = build_dataset(config, 0, global_batch * steps, is_builder=True, agree=None)
    clipped = assert_trains_as_torch_loop(model, optimizer, trainable, samples, config, loom_rows)
    assert clipped >= 2  # clipping took part
