"""Hugging Face interchange, checked against transformers: it loads loom's export and computes the same
logits; models written by the installed transformers (GQA, rope_theta 500000 in `rope_parameters`, Llama 3.1's
llama3 rope scaling, tied embeddings) import into loom with the same logits and the same `loom eval` loss and
export back unchanged; settings loom cannot represent are refused with one line naming them. loom's GPT-2-shaped
model (not exported) computes GPT2LMHeadModel's logits."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from training_runs import (
    assert_trains_as_torch_loop,
    loom_here,
    loom_logits,
    one_line_error,
    tiny_config,
    tiny_train_args,
)

from loom.engine.checkpoint.format import CheckpointError, find_loadable
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.data.indexed import IndexedDatasetWriter
from loom.engine.model.gpt import GPTModel
from loom.engine.parallel.sharding import initialize_parameters
from loom.launch.local import launch_local
from loom.tools.ckpt import inspect
from loom.tools.hf import export_hf, export_peft_adapter, import_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def trained(request, markov_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    config = tiny_config(
        markov_dataset(100),
        tmp / "run",
        model={"tie_embeddings": request.param},
        parallel={"tp": 2},
        checkpoint={"interval": 3},
        train={"steps": 3},
    )
    config.resolve_world(2)
    launch_local(config, 2)
    return tmp / "run" / "checkpoints"


def test_transformers_computes_the_same_logits(trained, tmp_path):
    out = export_hf(trained, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    umask = os.umask(0o022)
    os.umask(umask)  # safetensors wrote 0600: a shared cluster's other users could not read the model or checkpoint
    for written in (out / "model.safetensors", next(find_loadable(trained)[0].glob("*.safetensors"))):
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, written
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = loom_logits(trained, tokens)
    assert (theirs - ours).abs().max().item() < 1e-4


def test_export_in_another_dtype_rounds_loom_s_weights(trained, tmp_path, capfd):
    full = load_file(export_hf(trained, tmp_path / "fp32") / "model.safetensors")
    exported = loom_here(
        capfd,
        "ckpt",
        "export-hf",
        "--checkpoint",
        str(trained),
        "--output",
        str(tmp_path / "bf16"),
        "--dtype",
        "bfloat16",
    )
    assert exported.returncode == 0 and "model.safetensors (bfloat16)" in exported.stdout, exported.stderr
    half = load_file(tmp_path / "bf16/model.safetensors")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].bfloat16()) for k in full)
    assert json.loads((tmp_path / "bf16/config.json").read_text())["torch_dtype"] == "bfloat16"


def test_import_then_export_is_identical(trained, tmp_path):
    first = export_hf(trained, tmp_path / "first")
    import_hf(first, tmp_path / "imported")
    second = export_hf(tmp_path / "imported", tmp_path / "second")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


VOCAB = 256

# transformers' own configs, each a model loom must import exactly: rope_theta and the scaling land in
# rope_parameters in transformers >= 5. original_max_position_embeddings 64 puts head_dim 16's wavelengths in
# all three llama3 bands (kept, blended, stretched).
WRITTEN_BY_TRANSFORMERS = {
    "gqa-theta500k": dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3-scaling": dict(
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "tied-mha": dict(tie_word_embeddings=True),
}


def llama_config(**settings):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    return transformers.LlamaConfig(**{**base, **settings})


def llama_fields(**settings) -> dict:
    """llama_config(**settings) as the keyword arguments of another architecture's config (Mistral's, Qwen's):
    without what names Llama or its file, and without Llama's bias flags."""
    fields = llama_config(**settings).to_dict()
    for name in ("architectures", "transformers_version", "model_type", "_name_or_path", "attention_bias", "mlp_bias"):
        fields.pop(name, None)
    return fields


@pytest.fixture(scope="module", params=list(WRITTEN_BY_TRANSFORMERS))
def hf_model(request, tmp_path_factory):
    """A randomly initialised Llama saved by transformers' save_pretrained, and the model itself."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(**WRITTEN_BY_TRANSFORMERS[request.param])).eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(directory))
    return directory, model


def test_transformers_written_models_import_with_the_same_logits(hf_model, tmp_path):
    directory, model = hf_model
    import_hf(directory, tmp_path / "loom")
    tokens = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loom_logits(tmp_path / "loom", tokens) - theirs).abs().max().item() < 1e-5


def test_imported_models_export_back_to_the_same_model(hf_model, tmp_path):
    directory, model = hf_model
    import_hf(directory, tmp_path / "loom")
    exported = export_hf(tmp_path / "loom", tmp_path / "hf")
    again = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert again.config.rope_parameters == model.config.rope_parameters
    tokens = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (again(tokens).logits - model(tokens).logits).abs().max().item() < 1e-5


def test_an_output_that_is_refused_is_refused_before_the_model_is_read(hf_model, tmp_path, monkeypatch):
    """import-hf and export-hf read the whole model (at 1B, seconds and GBs) before refusing their --output; now
    they read no weight before (import-hf reads the files' headers)."""
    from loom.tools import hf, lora

    directory, _ = hf_model
    import_hf(directory, tmp_path / "loom")
    export_hf(tmp_path / "loom", tmp_path / "hf")

    def unread(*args):
        raise AssertionError("the model was read before the output was refused")

    monkeypatch.setattr(hf._SafetensorsFolder, "__getitem__", unread)
    with pytest.raises(CheckpointError, match="holds checkpoints"):
        import_hf(directory, tmp_path / "loom")
    monkeypatch.setattr(lora.ModelWeights, "__getitem__", unread)
    with pytest.raises(CheckpointError, match="already holds a model"):
        export_hf(tmp_path / "loom", tmp_path / "hf")


def test_import_and_export_hold_one_weight_at_a_time(hf_model, tmp_path, live_tensors):
    """import-hf read every tensor, made loom's fused ones beside them and wrote them all at once (an 8B model held
    2-3.5x its size); export-hf held the whole model in its export dtype. Each now reads, makes and writes one
    weight at a time (a fused QKV reads its three parts): the round trip is unchanged."""
    from loom.tools import hf, lora

    directory, model = hf_model
    read = live_tensors(hf._SafetensorsFolder, "__getitem__")
    import_hf(directory, tmp_path / "loom")
    assert read.made >= 2 * 9 and read.most <= 3, (read.made, read.most)
    made = live_tensors(lora.ModelWeights, "__getitem__")
    exported = export_hf(tmp_path / "loom", tmp_path / "hf")  # in float32, as transformers saved it
    assert made.made >= 2 * 7 and made.most <= 2, (made.made, made.most)
    theirs, ours = load_file(directory / "model.safetensors"), load_file(exported / "model.safetensors")
    assert theirs.keys() - {"lm_head.weight"} == ours.keys() - {"lm_head.weight"}
    assert all(torch.equal(ours[key], theirs[key]) for key in ours), "the round trip changed a weight"


def test_weights_that_disagree_with_the_config_are_refused_before_anything_is_written(hf_model, tmp_path):
    """The shapes come from the files' headers now, so a mismatch is still found before the first weight is read."""
    from safetensors.torch import save_file

    directory, _ = hf_model
    tensors = load_file(directory / "model.safetensors")
    shutil.copytree(directory, tmp_path / "hf")
    for key, narrower, message in (
        ("model.layers.1.self_attn.k_proj.weight", (slice(None), slice(0, 10)), r"do not stack into loom's layers.1"),
        ("model.norm.weight", (0,), r"final_norm.weight: shape \(\) in the Hugging Face model, the config says"),
    ):
        save_file({**tensors, key: tensors[key][narrower].clone()}, tmp_path / "hf/model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            import_hf(tmp_path / "hf", tmp_path / "loom")
        assert not (tmp_path / "loom").exists()


def test_a_sharded_model_imports_the_files_its_index_lists_and_not_an_adapter_beside_it(tmp_path, capfd):
    """Every *.safetensors was read: a stale shard or a PEFT adapter saved beside the model was "tensors its
    config.json does not describe (num_hidden_layers?)". The shard index is what transformers reads; without one,
    an adapter_model.safetensors is left out and said."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="100KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    save_file({"stale": torch.zeros(3)}, tmp_path / "hf" / "model-old.safetensors")
    import_hf(tmp_path / "hf", tmp_path / "sharded")
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loom_logits(tmp_path / "sharded", tokens) - theirs).abs().max().item() < 1e-5
    [listed] = sorted((tmp_path / "hf").glob("model-0000*-of-*.safetensors"))[:1]
    listed.rename(listed.with_suffix(".moved"))
    with pytest.raises(CheckpointError, match=f"lists {listed.name}, which .* does not hold"):
        import_hf(tmp_path / "hf", tmp_path / "missing")

    model.save_pretrained(str(tmp_path / "single"))
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "single" / "adapter_model.safetensors")
    import_hf(tmp_path / "single", tmp_path / "beside")
    assert "adapter_model.safetensors (a PEFT adapter) is not imported" in capfd.readouterr().err
    assert (loom_logits(tmp_path / "beside", tokens) - theirs).abs().max().item() < 1e-5


def test_a_tied_config_with_its_own_head_and_special_tokens_imports_as_transformers_loads_it(tmp_path, capfd):
    """config.json says tie_word_embeddings but lm_head.weight differs from the embedding: transformers keeps the
    file's head (import had dropped it: other logits, exit 0); the config's bos/eos/pad ids come back out of
    export-hf (it had written Llama 2's 1 and 2 for any model, so generate would stop at an ordinary token), and
    so does the bf16 it was stored in (export wrote float32: the same model in a file twice the size)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf/config.json").read_text())
    ids = {"bos_token_id": 5, "eos_token_id": [809, 810], "pad_token_id": 7}
    (tmp_path / "hf/config.json").write_text(json.dumps({**written, "tie_word_embeddings": True, **ids}))
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    import_hf(tmp_path / "hf", tmp_path / "loom")
    assert "imported untied, as transformers loads it" in capfd.readouterr().err
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loom_logits(tmp_path / "loom", tokens) - model(tokens).logits).abs().max().item() < 1e-5
    exported = json.loads((export_hf(tmp_path / "loom", tmp_path / "out") / "config.json").read_text())
    assert {field: exported.get(field) for field in ids} == ids and exported["tie_word_embeddings"] is False
    assert exported["torch_dtype"] == "bfloat16"
    said = inspect(tmp_path / "loom")
    assert f"from the Hugging Face model {(tmp_path / 'hf').resolve()} (stored as bfloat16; special tokens" in said
    original, back = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    # a run that fine-tunes the import carries them into its own checkpoints, and its export keeps them
    with IndexedDatasetWriter(tmp_path / "docs", np.dtype(np.uint16)) as writer:
        writer.add_document(np.random.default_rng(4).integers(0, VOCAB, 400))
    raw = find_loadable(tmp_path / "loom")[1].config
    raw["data"].update(paths=[str(tmp_path / "docs")], tokenizer=None, split="100,0,0")
    raw["train"].update(run_dir=str(tmp_path / "tuned"), steps=1, seq_length=32, precision="fp32", tensorboard=False)
    raw["train"].update(global_batch_size=1, micro_batch_size=1, eval_interval=0)
    raw["checkpoint"].update(load=str(tmp_path / "loom"), interval=1)
    config = config_from_dict(raw)
    config.resolve_world(1)
    launch_local(config, 1)
    tuned = json.loads((export_hf(tmp_path / "tuned", tmp_path / "out-tuned") / "config.json").read_text())
    assert {field: tuned.get(field) for field in ids} == ids and tuned["torch_dtype"] == "bfloat16"


def test_loom_eval_equals_transformers_loss(hf_model, tmp_path, capfd):
    """The user story: import a transformers model, evaluate it with `loom eval`. One document of
    seq_length + 1 tokens is the only sample, so every batch holds it."""
    directory, model = hf_model
    import_hf(directory, tmp_path / "loom")
    seq_length = 64
    document = np.random.default_rng(3).integers(0, VOCAB, seq_length + 1)
    with IndexedDatasetWriter(tmp_path / "one", np.dtype(np.uint16)) as writer:
        writer.add_document(document)
    result = loom_here(
        capfd,
        *["eval", "--checkpoint", str(tmp_path / "loom")],
        *["--data", str(tmp_path / "one"), "--iters", "1", "--train.seq_length", str(seq_length)],
        *["--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.precision", "fp32"],
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "validation loss" in x)
    ours = float(line.split("validation loss ")[1].split(",")[0])
    tokens = torch.from_numpy(document).long()[None]
    with torch.no_grad():
        theirs = model(tokens, labels=tokens.clone()).loss.item()  # transformers shifts labels itself
        shifted = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits[0], tokens[0, 1:]).item()
    assert math.isclose(theirs, shifted, rel_tol=1e-6)
    assert abs(ours - theirs) < 2e-6, (ours, theirs)


@pytest.mark.parametrize("window", [None, 64])
def test_a_mistral_imports_with_the_logits_transformers_computes_past_its_window(window, tmp_path, capfd):
    """Mistral is Llama with a sliding window: with none (v0.2, v0.3) the same model, exported back as a Llama;
    with one shorter than its positions (v0.1: 4096 of 32768) the window is model.sliding_window (it used to cut
    max_position_embeddings to the window's length): transformers' logits over all 256 positions, four windows, and
    back as a MistralForCausalLM with the same."""
    base = {**llama_fields(), "sliding_window": window}
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**base)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    result = loom_here(capfd, "ckpt", "import-hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "loom"))
    assert result.returncode == 0, result.stderr
    imported = find_loadable(tmp_path / "loom")[1].config["model"]
    assert (imported["max_position_embeddings"], imported["sliding_window"]) == (256, window)
    tokens = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loom_logits(tmp_path / "loom", tokens) - theirs).abs().max().item() < 1e-5
    exported = export_hf(tmp_path / "loom", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert type(again) is (transformers.LlamaForCausalLM if window is None else transformers.MistralForCausalLM)
    with torch.no_grad():
        assert (again(tokens).logits - theirs).abs().max().item() < 1e-5
    if window is not None:  # past the window a Llama differs: the window is not moot
        as_llama = transformers.LlamaForCausalLM(llama_config()).eval()
        as_llama.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (as_llama(tokens).logits - theirs).abs().max().item() > 1e-3


def test_a_mistral_sliding_window_that_is_not_a_length_is_refused(tmp_path, capfd):
    (tmp_path / "hf").mkdir()
    config = {**llama_config().to_dict(), "model_type": "mistral", "sliding_window": "4096"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = loom_here(capfd, "ckpt", "import-hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "loom"))
    assert result.returncode == 2
    assert "sliding_window '4096' is neither null nor a number of tokens" in result.stderr


def _assert_loom_eval_under_tp2_gives_transformers_loss(model, tmp_path: Path, capfd) -> None:
    """`loom eval` of the import in tmp_path/loom over two tensor-parallel ranks, on one document of 65 tokens,
    gives the loss transformers' `model` computes on it."""
    document = np.random.default_rng(3).integers(0, VOCAB, 65)
    with IndexedDatasetWriter(tmp_path / "one", np.dtype(np.uint16)) as writer:
        writer.add_document(document)
    result = loom_here(
        capfd,
        *["eval", "--checkpoint", str(tmp_path / "loom"), "--data", str(tmp_path / "one"), "--iters", "1"],
        *["--train.seq_length", "64", "--train.global_batch_size", "1", "--train.precision", "fp32"],
        *["--nproc", "2", "--parallel.tp", "2"],
    )
    assert result.returncode == 0, result.stderr
    ours = float(next(x for x in result.stdout.splitlines() if "validation loss" in x).split("loss ")[1].split(",")[0])
    sequence = torch.from_numpy(document).long()[None]
    with torch.no_grad():
        assert abs(ours - model(sequence, labels=sequence.clone()).loss.item()) < 2e-6


def _assert_greedy_generate_equals_transformers(model, checkpoint: Path, new_tokens: int) -> None:
    """loom's KV-cached greedy decoding of `checkpoint` continues a 12-token prompt as transformers' `model` does,
    and the cached attention's logits of the whole text are transformers' (1e-5: greedy tokens can hide a wrong
    score factor)."""
    from loom.engine.model.gpt import DecodingCache
    from loom.tools.generate import generate, load_model

    loom_model = load_model(checkpoint)[0]
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
        text = torch.tensor([prompt + theirs])
        cached = loom_model.decode(text, DecodingCache()).transpose(0, 1)[..., :VOCAB]
        assert (cached - model(text).logits).abs().max().item() < 1e-5
    assert generate(loom_model, prompt, new_tokens) == theirs


def _round_trip_computes_as_transformers(model, tmp_path: Path, capfd) -> tuple[dict, object]:
    """The transformers `model` saved in tmp_path/hf imports with its logits (1e-5), `loom eval` of the import over
    two tensor-parallel ranks gives its loss, and the export loads back through AutoModelForCausalLM with its logits
    (1e-5). Returns the import's [model] and the model loaded back."""
    import_hf(tmp_path / "hf", tmp_path / "loom")
    tokens = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loom_logits(tmp_path / "loom", tokens) - theirs).abs().max().item() < 1e-5
    _assert_loom_eval_under_tp2_gives_transformers_loss(model, tmp_path, capfd)
    exported = export_hf(tmp_path / "loom", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(tokens).logits - theirs).abs().max().item() < 1e-5
    return find_loadable(tmp_path / "loom")[1].config["model"], again


def test_a_qwen2_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Qwen2 (and Qwen2.5) is Llama with biases on q, k and v alone, and was refused (model_type qwen2): it imports
    as model.qkv_bias with transformers' logits, `loom eval` over two tensor-parallel ranks (the biases split by head
    with their rows) gives transformers' loss, and it exports back to a Qwen2ForCausalLM with the same logits."""
    settings = llama_fields(num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-6)
    settings["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**settings)).eval()
    with torch.no_grad():  # transformers initialises biases to zero, which would hide a misplaced one
        for name, tensor in model.named_parameters():
            if name.endswith("_proj.bias"):
                tensor.normal_(0.0, 0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert (imported["qkv_bias"], imported["bias"], imported["rope_theta"]) == (True, False, 1000000.0)
    assert again.config.architectures == ["Qwen2ForCausalLM"] and type(again) is transformers.Qwen2ForCausalLM


def test_heads_narrower_than_hidden_size_over_their_count_import_and_export_as_transformers_computes_them(
    tmp_path, capfd
):
    """A head_dim other than hidden_size / num_attention_heads (Mistral-Nemo's 128 where 5120 / 32 is 160; Qwen3's)
    was refused; it is model.head_dim now. Here a Mistral-Nemo in small (a Mistral without a sliding window, 4 heads
    of 24 over a hidden size of 64: query width 96) imports with transformers' logits, evaluates over two
    tensor-parallel ranks with its loss, and exports back (as the Llama it equals)."""
    nemo = {**llama_fields(head_dim=24, num_key_value_heads=2), "sliding_window": None}
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**nemo)).eval()
    assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert imported["head_dim"] == 24
    assert type(again) is transformers.LlamaForCausalLM and again.config.head_dim == 24


def test_a_phi3_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Phi-3 (and Phi-4) is a Llama whose files keep QKV and SwiGLU's gate+up fused (qkv_proj, gate_up_proj) and
    was refused (model_type phi3); so were Phi-3.5's and Phi-4-mini's rotary settings: longrope (frequencies
    divided by one set of factors up to the original context, another past it, cos and sin scaled) over part of
    each head (partial_rotary_factor). This one has both (model.rope_scaling longrope, model.rotary_percent 0.5),
    and a sliding window shorter than its positions (Phi-3-mini's 2047 of 4096, here 128 of 256): it imports with
    that window as model.sliding_window and transformers' logits on 128 tokens (the long factors: past the original
    100),
    `loom eval` of 64-token sequences over two tensor-parallel ranks (the short factors; the fused rows split per
    head and per half) gives its loss, and it exports back as a Phi3ForCausalLM (transformers' Llama turns whole
    heads) with the same logits. A partial rotary factor in a Llama's config is refused (transformers' Llama cannot
    compute it)."""
    phi3 = {**llama_fields(num_key_value_heads=2), "sliding_window": 128, "original_max_position_embeddings": 100}
    phi3["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                               "short_factor": [1.0, 1.5, 3.0, 5.0], "long_factor": [1.0, 4.0, 16.0, 64.0]}  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**phi3)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert (imported["sliding_window"], imported["num_kv_heads"], imported["rotary_percent"]) == (128, 2, 0.5)
    assert imported["rope_attention_factor"] == math.sqrt(1 + math.log(256 / 100) / math.log(100))  # of 256 positions
    assert type(again) is transformers.Phi3ForCausalLM
    # decoding past the original 100 positions: the long factors from there on, as transformers switches to them
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 100)
    with torch.no_grad():  # longrope is not moot: without it the logits differ, in the short regime too
        unscaled = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        other = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**phi3, "rope_parameters": unscaled}))
        other.load_state_dict(model.state_dict())
        tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
        assert (other.eval()(tokens).logits - model(tokens).logits).abs().max().item() > 1e-3
    llama_config(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}).save_pretrained(
        str(tmp_path / "llama")
    )
    capfd.readouterr()
    result = loom_here(capfd, "ckpt", "import-hf", "--input", str(tmp_path / "llama"), "--output", str(tmp_path / "no"))
    one_line_error(result, "partial_rotary_factor 0.5 for model_type 'llama'")
    assert not (tmp_path / "no").exists()


def test_a_granite_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Granite (IBM's 3.x dense models) is a Llama with four scalars, and was refused (model_type granite): the
    embeddings times embedding_multiplier, each block's attention and MLP outputs times residual_multiplier, the
    scores times attention_multiplier (not 1 / sqrt(head_dim)), the logits over logits_scaling. With Granite
    3.0-2B's values it imports with transformers' logits, `loom eval` over two tensor-parallel ranks gives its
    loss, and it exports back to a GraniteForCausalLM with the same logits."""
    multipliers = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625)
    # weights 10x training's init: the scores then move the softmax, and greedy decoding sees the score factor
    settings = llama_fields(num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2)
    settings = {**settings, **multipliers, "logits_scaling": 8.0}
    torch.manual_seed(0)
    model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**settings)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert [imported[name] for name in ("embedding_multiplier", "residual_multiplier", "attention_scale")] == list(
        multipliers.values()
    )
    assert imported["logits_divisor"] == 8.0 and type(again) is transformers.GraniteForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 32)  # the score factor in the KV cache


def test_settings_no_hugging_face_class_computes_are_refused_on_export():
    """Only transformers' Phi-3 turns part of each head, and its config takes default and longrope RoPE alone, with
    longrope's factors counted from hidden_size / num_heads: a half-head model with llama3 scaling, or with longrope
    over heads of their own width, has no Hugging Face form (transformers refused the config loom wrote). Only its
    OLMo 2 normalises the blocks' outputs or queries and keys across heads, always both, without QKV biases."""
    from loom.tools.hf_forms import check_llama_form

    half = {"hidden_size": 64, "num_heads": 4, "rotary_percent": 0.5}
    llama3 = {**half, "rope_scaling": "llama3"}
    longrope = {**half, "head_dim": 32, "rope_scaling": "longrope", "rope_short_factors": [1.0] * 8}
    for model, said in ((llama3, "llama3 rope scaling"), ({**longrope, "rope_long_factors": [2.0] * 8}, "head_dim")):
        with pytest.raises(CheckpointError, match=f"rotary_percent .*{said}"):
            check_llama_form(config_to_dict(config_from_dict({"model": model}))["model"], gpt2_too=True)
    check_llama_form(config_to_dict(config_from_dict({"model": half}))["model"], gpt2_too=True)  # a Phi-3
    nemotron = {"norm": "layernorm", "activation": "squared_relu"}
    check_llama_form(config_to_dict(config_from_dict({"model": nemotron}))["model"])
    half_yarn = {
        **nemotron,
        "rotary_percent": 0.5,
        "rope_scaling": "yarn",
    }  # Nemotron's class, unlike Phi-3's, takes it
    check_llama_form(config_to_dict(config_from_dict({"model": half_yarn}))["model"])
    with pytest.raises(CheckpointError, match="LayerNorm and squared ReLU .Nemotron's. with qk_norm"):
        check_llama_form(config_to_dict(config_from_dict({"model": {**nemotron, "qk_norm": True}}))["model"], True)
    olmo2 = {"norm_placement": "output", "qk_norm": True, "qk_norm_per_head": False}
    check_llama_form(config_to_dict(config_from_dict({"model": olmo2}))["model"])
    for changed, said in (
        ({"qk_norm": False}, "norm_placement output without query/key norms across all heads"),
        ({"norm_placement": "input"}, r"across all heads \(qk_norm, qk_norm_per_head false\) without norm_placement"),
        ({"rotary_percent": 0.5}, "norm_placement output with rotary_percent < 1"),
    ):
        with pytest.raises(CheckpointError, match=said):  # only transformers' OLMo 2 has either, and no Phi-3 rotary
            check_llama_form(config_to_dict(config_from_dict({"model": {**olmo2, **changed}}))["model"], True)
    # sliding windows: in every layer a Mistral's (or a Phi-3's), in all but every N-th layer a Gemma 2's or 3's
    gemma3 = {"activation": "geglu", "norm_placement": "both", "qk_norm": True, "embedding_multiplier": 8.0}
    for model, said in (
        ({"sliding_window": 8, "qk_norm": True}, "a sliding window with qk_norm"),
        ({"sliding_window": 8, "full_attention_interval": 2}, "a full_attention_interval without geglu"),
        ({"norm_placement": "both"}, "norm_placement both without geglu"),
        ({"activation": "geglu", "sliding_window": 8}, "a sliding window .Gemma 2 and 3's need sandwich norms."),
        ({"activation": "geglu", "embedding_multiplier": 8.0, "qk_norm": True}, "query/key norms .Gemma 3's need"),
        ({"activation": "geglu"}, r"embedding_multiplier other than sqrt\(hidden_size\)"),
        (
            {**gemma3, "sliding_window": 8, "rope_scaling": "linear"},
            "rope scaling in sliding-window layers .set rope_local_theta.",
        ),
    ):
        with pytest.raises(CheckpointError, match=said):
            check_llama_form(config_to_dict(config_from_dict({"model": model}))["model"])
    check_llama_form(config_to_dict(config_from_dict({"model": {"sliding_window": 8}}))["model"])  # a Mistral


def test_phi3_s_first_names_for_longrope_import_as_longrope_and_a_phi3_with_yarn_exports_as_a_llama():
    """Phi3Config reads its first files' rope_type "su" and "yarn" as longrope (their short and long factors): they
    import as longrope, not as YaRN with the factor lists dropped. A Phi-3 import given YaRN (or Llama 3.1's
    scaling) exports as the Llama it equals: Phi3Config refused the config.json loom wrote."""
    from loom.tools.hf_forms import model_from_hf_config, phi3_form

    phi3 = {**llama_fields(), "model_type": "phi3", "original_max_position_embeddings": 64}
    for name in ("su", "yarn"):
        rope = {"type": name, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        fields = model_from_hf_config({**phi3, "rope_scaling": rope})
        assert (fields["rope_scaling"], fields["rope_long_factors"]) == ("longrope", [2.0] * 8)
    model = config_to_dict(config_from_dict({"model": {"rope_scaling": "yarn"}}))["model"]
    assert not phi3_form(model, "phi3") and phi3_form({**model, "rope_scaling": "none"}, "phi3")


def test_a_nemotron_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Nemotron-4 and Minitron (NVIDIA's Megatron-trained models) were refused (model_type nemotron): LayerNorm
    with biases whose weights the files store minus one (LayerNorm1P scales by 1 + weight), a squared-ReLU MLP
    (up_proj alone), half of each head rotated (NemotronConfig's default where a file gives none). It imports with
    transformers' logits, `loom eval` over two tensor-parallel ranks gives its loss, it exports back to a
    NemotronForCausalLM with the same logits (weights minus one again), and greedy decoding is transformers'."""
    from loom.tools.hf_forms import model_from_hf_config

    settings = {**llama_fields(num_key_value_heads=2), "hidden_act": "relu2", "norm_eps": 1e-5}
    settings.pop("rms_norm_eps")
    torch.manual_seed(0)
    model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**settings)).eval()
    with torch.no_grad():  # zero-centred weights and zero biases would hide a missing 1 or a dropped bias
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(-0.5, 0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    shape = (imported["norm"], imported["activation"], imported["rotary_percent"], imported["bias"])
    assert shape == ("layernorm", "squared_relu", 0.5, False) and type(again) is transformers.NemotronForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("partial_rotary_factor", None)
    config["rope_parameters"].pop("partial_rotary_factor", None)
    assert model_from_hf_config(config)["rotary_percent"] == 0.5  # NemotronConfig's default


def test_a_gemma_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Gemma (Google's first open models) was refused (model_type gemma): a gated tanh GELU MLP (model.activation
    geglu), RMSNorm weights the files store minus one (its norm scales by 1 + weight), embeddings scaled by
    sqrt(hidden_size) (model.embedding_multiplier), heads of their own width, a tied output layer. It imports with
    transformers' logits, `loom eval` over two tensor-parallel ranks gives its loss, it exports back to a
    GemmaForCausalLM with the same logits, and greedy decoding is transformers'."""
    from loom.tools.hf_forms import model_from_hf_config

    settings = llama_fields(num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)
    settings["hidden_act"] = "gelu"  # Gemma's first files' name for the tanh GELU
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**settings)).eval()
    with torch.no_grad():  # GemmaRMSNorm's zeros (a scale of one) would hide a missing 1
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(-0.5, 0.5)
            if "gate_proj" in name:  # gates of a few units, where the tanh GELU and the exact one part
                tensor.mul_(30)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    shape = (imported["activation"], imported["embedding_multiplier"], imported["head_dim"], imported["tie_embeddings"])
    assert shape == ("geglu", 8.0, 32, True) and type(again) is transformers.GemmaForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    # in bf16 the embeddings are scaled by sqrt(hidden_size) rounded to bf16 (sqrt 72 = 8.485: 8.5), as transformers'
    # (and Google's) code does
    wide = {**settings, "hidden_size": 72, "num_hidden_layers": 1}
    embedding_of = transformers.GemmaForCausalLM(transformers.GemmaConfig(**wide)).model.embed_tokens.to(torch.bfloat16)
    ours = GPTModel(config_from_dict({"model": model_from_hf_config({**wide, "model_type": "gemma"})}).model, None)
    ours.embedding.weight.data[:VOCAB] = embedding_of.weight.data
    tokens = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours.to(torch.bfloat16).embed(tokens).transpose(0, 1), embedding_of(tokens))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("head_dim", "tie_word_embeddings"):  # GemmaConfig's defaults: 256 wide heads, tied
        config.pop(key)
    fields = model_from_hf_config({**config, "hidden_act": "gelu_pytorch_tanh"})
    assert (fields["head_dim"], fields["tie_embeddings"]) == (256, True)
    with pytest.raises(CheckpointError, match="hidden_activation is 'relu'.*gelu_pytorch_tanh"):
        model_from_hf_config({**config, "hidden_activation": "relu"})


def test_a_gemma3_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Gemma 3's text model (Gemma3ForCausalLM, model_type gemma3_text) was refused: Gemma's gated GELU and
    norms stored minus one, with sandwich norms (model.norm_placement both), per-head query/key norms, a score factor
    of query_pre_attn_scalar^-1/2, sliding-window attention in all but every N-th layer (model.sliding_window,
    model.full_attention_interval) and a rotary base of their own in those layers (model.rope_local_theta), the
    full-attention layers' RoPE linearly scaled in its larger models (model.rope_scaling linear). A model
    whose window (8) is shorter than its text imports with transformers' logits, `loom eval` over two
    tensor-parallel ranks gives its loss, it exports back to a Gemma3ForCausalLM with the same logits, and KV-cached
    greedy decoding past the window is transformers'."""
    settings = llama_fields(num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)
    settings.update(
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},  # the 4B's and larger
        },
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**settings)).eval()
    with torch.no_grad():  # zeros (a scale of one) would hide a missing 1 or two norms swapped
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(-0.5, 0.5)
            if "gate_proj" in name:
                tensor.mul_(30)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    shape = {key: imported[key] for key in ("norm_placement", "qk_norm", "sliding_window", "full_attention_interval")}
    assert shape == {"norm_placement": "both", "qk_norm": True, "sliding_window": 8, "full_attention_interval": 3}
    assert (imported["rope_theta"], imported["rope_local_theta"], imported["attention_scale"]) == (1e6, 100.0, 24**-0.5)
    assert (imported["rope_scaling"], imported["rope_scaling_factor"]) == ("linear", 8.0)
    assert type(again) is transformers.Gemma3ForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    # a fine-tune from a config without windows (the tiny preset) trains the import's windowed model
    flags = ["--checkpoint.load", str(tmp_path / "loom"), "--print-config"]
    printed = loom_here(capfd, "train", *tiny_train_args(str(tmp_path / "one"), tmp_path / "tuned", *flags))
    assert printed.returncode == 0, printed.stderr
    for setting in ("sliding_window = 8", "full_attention_interval = 3", "rope_local_theta = 100.0"):
        assert f"\n{setting}\n" in printed.stdout, setting


def test_an_image_text_gemma3_imports_its_text_model_with_transformers_logits_on_text(markov_dataset, tmp_path, capfd):
    """Gemma 3 4B, 12B and 27B are image-text models (Gemma3ForConditionalGeneration, model_type gemma3): their text
    model (text_config; tensors under language_model.model.) imports, said, its vision tower and projector left
    out; on text alone it computes the whole model's logits, and it exports as the Gemma3ForCausalLM it is. A LoRA
    run's adapters do not name the image-text folder as their base (PEFT found no module of theirs there): they
    name the export given as --base-model."""
    text = llama_fields(num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
    text.update(num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(text_config=text, vision_config={**vision, "patch_size": 14})
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and "language" in name:
                tensor.uniform_(-0.5, 0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    result = loom_here(capfd, "ckpt", "import-hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "loom"))
    assert result.returncode == 0, result.stderr
    assert "image-text Gemma 3: its text model is imported (28 tensors), its vision tower" in result.stderr
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    assert (loom_logits(tmp_path / "loom", tokens) - theirs).abs().max().item() < 1e-5
    again = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(tmp_path / "loom", tmp_path / "back")))
    assert type(again) is transformers.Gemma3ForCausalLM
    with torch.no_grad():
        assert (again.eval()(tokens).logits - theirs).abs().max().item() < 1e-5
    # transformers 5's own names for the same tensors
    from loom.tools.hf_gemma import text_model_names

    names = ["model.language_model.layers.0.mlp.up_proj.weight", "model.vision_tower.x.weight", "lm_head.weight"]
    kept = {"model.layers.0.mlp.up_proj.weight": names[0], "lm_head.weight": "lm_head.weight"}
    assert text_model_names(names) == (kept, ["model.vision_tower.x.weight"])
    flags = ["--lora.rank", "2", "--lora.base", str(tmp_path / "loom"), "--train.steps", "1"]
    flags += ["--checkpoint.save_at_end", "true"]
    trained = loom_here(capfd, "train", *tiny_train_args(markov_dataset(50, VOCAB), tmp_path / "run"), *flags)
    assert trained.returncode == 0, trained.stderr
    with pytest.raises(
        CheckpointError, match="imported from an image-text Gemma 3 .* give that folder as --base-model"
    ):
        export_peft_adapter(tmp_path / "run", tmp_path / "adapter")
    export_peft_adapter(tmp_path / "run", tmp_path / "adapter", base_model=str(tmp_path / "back"))


def test_a_gemma2_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Gemma 2 (Gemma2ForCausalLM) was refused: Gemma 3 without query/key norms or a RoPE base of its windowed layers'
    own, and with tanh soft-capping of its attention scores and its logits (model.attention_softcap,
    model.logits_softcap: attn_logit_softcapping, final_logit_softcapping). With caps low enough to bend this small
    model's scores and logits (2 and 1.5; Gemma 2's are 50 and 30) and every other layer windowed, it imports with
    transformers' logits, `loom eval` over two tensor-parallel ranks gives its loss, it exports back to a
    Gemma2ForCausalLM with the same logits, and KV-cached greedy decoding is transformers'."""
    settings = llama_fields(num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)
    settings.update(
        num_hidden_layers=3,
        sliding_window=8,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=1.5,
        initializer_range=0.1,  # scores and logits of a few units, where the caps bend them
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**settings)).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(-0.5, 0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    caps = (imported["attention_softcap"], imported["logits_softcap"], imported["qk_norm"])
    assert caps == (2.0, 1.5, False) and (imported["sliding_window"], imported["full_attention_interval"]) == (8, 2)
    assert type(again) is transformers.Gemma2ForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    with torch.no_grad():  # the caps are not moot here
        uncapped = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**{**settings, "attn_logit_softcapping": None, "final_logit_softcapping": None})
        )
        uncapped.load_state_dict(model.state_dict())
        tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(2))
        assert (uncapped.eval()(tokens).logits - model(tokens).logits).abs().max().item() > 1e-2


def test_gemma_files_read_as_their_classes_read_them():
    """Gemma 2 and 3 compute hidden_activation as named ("gelu" is the exact GELU there: refused; Gemma's first
    class rewrote it to the tanh one), Gemma computes bidirectional attention when told (refused), a Gemma 2 or 3
    file without sliding_window has their classes' 4096, one without layer_types their every-2nd (Gemma 2, which
    ignores sliding_window_pattern) or every-sliding_window_pattern-th full layer (Gemma 3), and a pattern that is
    no number of layers is one line, not a ZeroDivisionError. Gemma 2's soft-capping is Gemma2Config's 50 and 30
    where a file leaves it out."""
    from loom.tools.hf_forms import hf_config, model_from_hf_config

    shape = {key: value for key, value in llama_fields().items() if key not in ("hidden_act", "sliding_window")}
    gemma2, gemma3 = {**shape, "model_type": "gemma2"}, {**shape, "model_type": "gemma3_text"}
    for refused, said in (
        ({**gemma2, "hidden_activation": "gelu"}, "hidden_activation is 'gelu'"),
        ({**gemma3, "hidden_activation": "gelu"}, "hidden_activation is 'gelu'"),
        ({**shape, "model_type": "gemma", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**gemma3, "sliding_window_pattern": 0}, "sliding_window_pattern 0 is not a number of layers"),
    ):
        with pytest.raises(CheckpointError, match=said):
            model_from_hf_config(refused)
    assert model_from_hf_config({**shape, "model_type": "gemma", "hidden_act": "gelu"})["activation"] == "geglu"
    uncapped = {"final_logit_softcapping": None, "attn_logit_softcapping": None, "sliding_window_pattern": 3}
    fields = model_from_hf_config({**gemma2, **uncapped})
    assert (fields["sliding_window"], fields["full_attention_interval"]) == (4096, 2)
    capped = model_from_hf_config(gemma2)  # Gemma2Config's caps where a file gives none
    assert (capped["attention_softcap"], capped["logits_softcap"]) == (50.0, 30.0)
    fields = model_from_hf_config({**gemma3, "sliding_window_pattern": 1})  # every layer full: no window
    assert (fields["sliding_window"], fields["rope_local_theta"]) == (None, None)
    # which transformers then runs: its masks read sliding_window even where no layer slides
    exported = hf_config(config_to_dict(config_from_dict({"model": fields}))["model"])
    assert exported["sliding_window"] == 256 and set(exported["layer_types"]) == {"full_attention"}
    with torch.no_grad():
        transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**exported))(torch.zeros(1, 4, dtype=torch.long))
    # an image-text Gemma 3's text_config as transformers 4 wrote it: Gemma3TextConfig's defaults where it is silent,
    # the whole model's special tokens (google/gemma-3-4b-pt's shape)
    from loom.tools.hf_gemma import gemma3_text_config

    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024}
    sparse["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    text = gemma3_text_config({"model_type": "gemma3", "text_config": sparse, "eos_token_id": [1, 106]})
    fields = model_from_hf_config(text)
    assert (fields["num_heads"], fields["num_kv_heads"], fields["vocab_size"], fields["head_dim"]) == (
        8,
        4,
        262208,
        256,
    )
    assert (fields["rope_scaling"], fields["rope_local_theta"], fields["full_attention_interval"]) == ("linear", 1e4, 6)
    assert (text["eos_token_id"], text["bos_token_id"], text["max_position_embeddings"]) == ([1, 106], 2, 131072)
    # MistralConfig's window where a file has none (Phi3Config's: none)
    longer = {**shape, "max_position_embeddings": 8192}
    assert model_from_hf_config({**longer, "model_type": "mistral"})["sliding_window"] == 4096
    assert model_from_hf_config({**longer, "model_type": "phi3"}).get("sliding_window") is None


def _small_qwen3(folder: Path):
    """A Qwen3ForCausalLM (tied, 2 KV heads, heads of 24 over a hidden size of 64, random q/k norm weights: at one
    they would hide a misplaced one) saved in `folder`, and returned."""
    settings = llama_fields(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**settings)).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return model


def test_yarn_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """YaRN (Qwen2.5's and Qwen3's long-context setting; rope_type yarn) was refused. A Qwen3 extending its 1024
    original positions 4x imports as model.rope_scaling yarn (its ramp over channel pairs 2 to 7 of 12) with
    transformers' logits, `loom eval` over two tensor-parallel ranks gives its loss, it exports back with the same
    logits, and KV-cached greedy decoding continues a prompt as transformers does; without YaRN the logits differ.
    DeepSeek's files leave out the factor (max_position_embeddings / original) and give the cos/sin factor as
    mscale / mscale_all_dim: imported with transformers' frequencies and factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from loom.engine.model.rotary import rotary_frequencies
    from loom.tools.hf_forms import model_from_hf_config

    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024}
    settings = {**llama_fields(num_key_value_heads=2, head_dim=24), "max_position_embeddings": 4096}
    settings.pop("rope_parameters")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**settings, rope_parameters=yarn)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert (imported["rope_scaling"], imported["rope_scaling_factor"], imported["rope_yarn_beta_fast"]) == (
        "yarn",
        4,
        32,
    )
    assert imported["rope_attention_factor"] == 1 + 0.1 * math.log(4) and type(again) is transformers.Qwen3ForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    with torch.no_grad():
        plain = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**settings, rope_parameters={"rope_theta": 1e4}))
        plain.load_state_dict(model.state_dict())
        tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
        assert (plain.eval()(tokens).logits - model(tokens).logits).abs().max().item() > 1e-3
    deepseek = {**yarn, "factor": None, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16}
    config = transformers.LlamaConfig(**{**settings, "max_position_embeddings": 8192, "rope_parameters": deepseek})
    frequencies, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    fields = model_from_hf_config({**config.to_dict(), "rope_scaling": None})
    assert fields["rope_scaling_factor"] == 8 and fields["rope_attention_factor"] == pytest.approx(attention, rel=1e-12)
    ours = rotary_frequencies(config_from_dict({"model": fields}).model, 64)
    torch.testing.assert_close(ours, frequencies, rtol=1e-6, atol=0)


def test_a_qwen3_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """Qwen3 is Llama with a norm on each query and key head (model.qk_norm) and its own head width: it imports with
    transformers' logits, `loom eval` over two tensor-parallel ranks gives transformers' loss, and it exports back
    to a Qwen3ForCausalLM with the same logits."""
    model = _small_qwen3(tmp_path / "hf")
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert (imported["qk_norm"], imported["qkv_bias"], imported["head_dim"]) == (True, False, 24)
    assert type(again) is transformers.Qwen3ForCausalLM


def test_an_olmo2_imports_evaluates_under_tensor_parallelism_and_exports_as_transformers_computes_it(tmp_path, capfd):
    """OLMo 2 (AI2's open models) normalises what attention and the MLP return before it joins the residual stream,
    not what enters them (model.norm_placement output), and the whole query and key projections over all their
    heads at once (model.qk_norm_per_head false), and was refused (model_type olmo2). It imports with transformers'
    logits, `loom eval` over two tensor-parallel ranks (the q/k norm weights split with the heads, their sums of
    squares summed across the ranks) gives transformers' loss, it exports back to an Olmo2ForCausalLM with the same
    logits, and KV-cached greedy decoding continues a prompt as transformers does."""
    settings = llama_fields(num_key_value_heads=2, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**settings)).eval()
    with (
        torch.no_grad()
    ):  # norm weights at one would hide a misplaced one (Llama's post_attention_layernorm is its MLP's)
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    assert (imported["norm_placement"], imported["qk_norm"], imported["qk_norm_per_head"]) == ("output", True, False)
    assert type(again) is transformers.Olmo2ForCausalLM
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 16)
    # a config.json that promises a layer the weights lack: one line naming the tensor, nothing written
    shutil.copytree(tmp_path / "hf", tmp_path / "deeper")
    config = json.loads((tmp_path / "deeper" / "config.json").read_text())
    (tmp_path / "deeper" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    capfd.readouterr()
    result = loom_here(
        capfd, "ckpt", "import-hf", "--input", str(tmp_path / "deeper"), "--output", str(tmp_path / "no")
    )
    one_line_error(result, "has no tensor 'model.layers.2.", "(model_type 'olmo2') implies")
    assert not (tmp_path / "no").exists()


def _small_phi3(folder: Path):
    """A Phi3ForCausalLM rotating whole heads (Phi-3-mini's form: fused qkv_proj and gate_up_proj) saved in
    `folder`, and returned."""
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**llama_fields(num_key_value_heads=2))).eval()
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("architecture", ["qwen3", "phi3"])
def test_a_lora_run_on_an_import_exports_a_peft_adapter_with_its_logits(architecture, markov_dataset, tmp_path, capfd):
    """The user story on Qwen3 and Phi-3: import it, fine-tune LoRA adapters on every linear layer, export the base
    and the adapter: PEFT's model on the exported base computes the LoRA run's logits. A Phi-3 exports back as a
    Phi-3 with the source's logits, and its adapter sits on its fused modules, so PEFT loads it onto the folder it
    names (the source: the adapters named Llama's q_proj ... did not load there)."""
    peft = pytest.importorskip("peft", reason="needs loom[reference]")
    from loom.tools.generate import load_model

    source = (_small_qwen3 if architecture == "qwen3" else _small_phi3)(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "base")
    flags = ["--lora.rank", "4", "--lora.base", str(tmp_path / "base"), "--train.steps", "2", "--optim.lr", "0.01"]
    flags += ["--optim.warmup_steps", "0", "--checkpoint.save_at_end", "true"]
    capfd.readouterr()
    trained = loom_here(capfd, "train", *tiny_train_args(markov_dataset(50, VOCAB), tmp_path / "run"), *flags)
    assert trained.returncode == 0, trained.stderr
    export_peft_adapter(tmp_path / "run", tmp_path / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "base", tmp_path / "hf-base")).eval()
    assert type(hf) is type(source)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = hf(tokens).logits  # before PEFT injects the adapters into hf's layers
        assert (base - source(tokens).logits).abs().max().item() < 1e-5
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(tokens).logits
        ours = load_model(find_loadable(tmp_path / "run" / "checkpoints")[0])[0](tokens).transpose(0, 1)
    assert (ours[..., :VOCAB] - theirs).abs().max().item() < 1e-5
    assert (theirs - base).abs().max().item() > 1e-4  # the adapters moved
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    if architecture == "phi3":
        assert set(named["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


UNREPRESENTABLE = {
    "attention_bias": dict(attention_bias=True),
    "mlp_bias": dict(mlp_bias=True),
    "rope_type": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    "hidden_act": dict(hidden_act="gelu"),
}


@pytest.mark.parametrize("field", list(UNREPRESENTABLE))
def test_unrepresentable_settings_are_refused_in_one_line(field, tmp_path, capfd):
    llama_config(**UNREPRESENTABLE[field]).save_pretrained(str(tmp_path / "hf"))
    result = loom_here(capfd, "ckpt", "import-hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "loom"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], result.stderr
    assert not (tmp_path / "loom").exists()


def test_a_run_that_changes_the_checkpoints_rope_is_told(hf_model, tmp_path):
    """A run that sets other rope settings than its checkpoint's computes another model: the run says which
    settings changed (deliberate changes, e.g. a larger rope_theta for longer context, stay possible)."""
    from loom.engine.checkpoint.saved_settings import _saved_model_flags, changed_model_settings

    directory, _ = hf_model
    final = import_hf(directory, tmp_path / "loom")
    saved = json.loads((final / "metadata.json").read_text())["config"]["model"]
    assert changed_model_settings(saved, config_from_dict({"model": saved}).model) == []
    other = config_from_dict({"model": {**saved, "rope_theta": 2 * saved["rope_theta"], "norm_eps": 1e-6}}).model
    changes = changed_model_settings(saved, other)
    assert changes == [
        f"model.rope_theta: {saved['rope_theta']} -> {2 * saved['rope_theta']}",
        "model.norm_eps: 1e-05 -> 1e-06",
    ]
    # the warning's advice names the flags that give the saved model back (it said "e.g. --model.rope_theta")
    assert _saved_model_flags(saved, other) == f"--model.rope_theta {saved['rope_theta']} --model.norm_eps 1e-05"
    rescaled = "none" if saved["rope_scaling"] == "llama3" else "llama3"
    scaled = config_from_dict({"model": {**saved, "rope_scaling": rescaled}}).model
    assert _saved_model_flags(saved, scaled) == f"--model.rope_scaling {saved['rope_scaling']}"


def defaults_of_tiny_context() -> int:
    from loom.engine.config_io import load_config

    return load_config("tiny").model.max_position_embeddings


def test_a_fine_tune_from_a_config_without_the_import_s_rope_takes_the_saved_settings(hf_model, tmp_path, capfd):
    """A full fine-tune of an imported Llama 3 (checkpoint.load) from a config that left its RoPE out trained at
    rope_theta 10000 and norm_eps 1e-5, said only in a warning: the export's logits were off by 1.2. The settings
    the config does not give are the checkpoint's; one a flag gives stays (a longer context may be meant), warned.
    The shapes the config file gives (the tiny preset's) are the checkpoint's too, said (they were refused a field
    at a time); a flag giving another shape is refused."""
    from loom.engine.checkpoint.saved_settings import ARCHITECTURE_MODEL_FIELDS, FUNCTIONAL_MODEL_FIELDS, flag_value
    from loom.engine.config_io import load_config

    directory, _ = hf_model
    import_hf(directory, tmp_path / "loom")
    loaded, metadata = find_loadable(tmp_path / "loom")
    saved = metadata.config["model"]
    with IndexedDatasetWriter(tmp_path / "docs", np.dtype(np.uint16)) as writer:
        writer.add_document(np.random.default_rng(4).integers(0, VOCAB, 400))
    flags = ["--checkpoint.load", str(tmp_path / "loom"), "--train.steps", "1", "--data.split", "100,0,0"]
    saving = ["--checkpoint.save_at_end", "true"]
    tuned = loom_here(capfd, "train", *tiny_train_args(str(tmp_path / "docs"), tmp_path / "tuned", *flags, *saving))
    assert tuned.returncode == 0, tuned.stderr
    model = load_config(tmp_path / "tuned" / "config.toml").model
    assert {field: getattr(model, field) for field in ARCHITECTURE_MODEL_FIELDS} == {
        field: saved[field] for field in ARCHITECTURE_MODEL_FIELDS
    }
    preset = load_config("tiny").model
    replaced = [
        f"model.{field} = {flag_value(saved[field])} (not {flag_value(getattr(preset, field))})"
        for field in ARCHITECTURE_MODEL_FIELDS
        if saved[field] != getattr(preset, field)
    ]
    said = next((line for line in tuned.stdout.splitlines() if line.startswith("the model is that of")), "")
    assert said.startswith(f"the model is that of {loaded}, whose weights this run starts from"), tuned.stdout
    assert replaced and all(setting in said for setting in replaced), said
    # the same command again resumes the run's own checkpoint, still that model (the preset's was refused)
    extended = [*flags[:-4], "--train.steps", "2", *flags[-2:], *saving]
    again = loom_here(capfd, "train", *tiny_train_args(str(tmp_path / "docs"), tmp_path / "tuned", *extended))
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr
    assert {field: getattr(model, field) for field in FUNCTIONAL_MODEL_FIELDS} == {
        field: saved[field] for field in FUNCTIONAL_MODEL_FIELDS
    }
    # the context it was imported with, not the preset's (the export claimed the preset's 4096)
    assert model.max_position_embeddings == saved["max_position_embeddings"] != defaults_of_tiny_context()
    defaults = config_from_dict({}).model
    differ = [
        f"model.{field} = {saved[field]}"
        for field in FUNCTIONAL_MODEL_FIELDS
        if saved[field] != getattr(defaults, field)
    ] + [f"model.max_position_embeddings = {saved['max_position_embeddings']}"]
    said = next((line for line in tuned.stdout.splitlines() if "(the config does not set them)" in line), "")
    assert all(setting in said for setting in differ) and bool(said) is bool(differ), tuned.stdout
    assert "warning: this run computes a different model" not in tuned.stdout
    printed = loom_here(
        capfd, "train", *tiny_train_args(str(tmp_path / "docs"), tmp_path / "p", *flags), "--print-config"
    )
    assert f"rope_theta = {saved['rope_theta']}\n" in printed.stdout  # what the run would train
    given = loom_here(capfd, "train", *tiny_train_args(str(tmp_path / "docs"), tmp_path / "given", *flags),
                      "--model.rope_theta", "1e6")  # fmt: skip
    assert given.returncode == 0 and load_config(tmp_path / "given" / "config.toml").model.rope_theta == 1e6
    assert (
        "warning: this run computes a different model" in given.stdout
        and f"model.rope_theta: {saved['rope_theta']} -> 1000000.0" in given.stdout
    )
    narrower = tiny_train_args(str(tmp_path / "docs"), tmp_path / "n", *flags, "--model.hidden_size", "16")
    refused = loom_here(capfd, "train", *narrower)
    assert refused.returncode == 2 and f"model.hidden_size = {saved['hidden_size']} there, 16 here" in refused.stderr


def test_loom_generate_equals_transformers_greedy_generate(hf_model, tmp_path, capfd):
    """KV-cached greedy decoding of an imported model continues a prompt as transformers' generate does."""
    directory, model = hf_model
    import_hf(directory, tmp_path / "loom")
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 32)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
    prompt_ids = " ".join(map(str, prompt))
    generating = ["generate", "--checkpoint", str(tmp_path / "loom"), "--prompt-ids", prompt_ids]
    result = loom_here(capfd, *generating, "--max-new-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(t) for t in prompt + theirs]


def test_sampling_draws_from_transformers_temperature_and_top_p_distribution(monkeypatch):
    """What `loom generate --temperature T --top-p P` draws from is what transformers' TemperatureLogitsWarper and
    TopPLogitsWarper leave, softmaxed: the same tokens kept, the same probabilities (random logits, no ties)."""
    from loom.tools import generate

    drawn = {}

    def multinomial(probabilities, count, generator):  # "draws" the entry the test asks for
        drawn["probabilities"] = probabilities.clone()
        return torch.full((count,), drawn["entry"], dtype=torch.long)

    monkeypatch.setattr(generate.torch, "multinomial", multinomial)
    generator = torch.Generator().manual_seed(0)
    for case in range(100):
        logits = torch.randn(64, generator=generator) * (0.5 + 3 * torch.rand(1, generator=generator))
        temperature = float(torch.empty(1).uniform_(0.3, 2.0, generator=generator))
        top_p = float(torch.empty(1).uniform_(0.05, 1.0, generator=generator)) if case % 4 else 1.0
        ours = torch.zeros(64)
        for entry in range(64):  # which token each entry of the distribution stands for
            drawn["entry"] = entry
            token = generate.next_token(logits, temperature, top_p, generator)
            ours[token] = drawn["probabilities"][entry]
        warped = transformers.TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        theirs = transformers.TopPLogitsWarper(top_p)(None, warped).softmax(-1)[0]
        assert torch.equal(ours > 0, theirs > 0), (case, temperature, top_p)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("trained", [False], indirect=True, ids=["untied"])  # no matter which
def test_the_exported_tokenizer_encodes_as_loom_s_and_an_import_s_comes_back(trained, tmp_path, capfd):
    """AutoTokenizer on an export encodes and decodes as the SentencePiece model the run trained with (no bos, no
    dummy-prefix space: what `loom data build` wrote); a unigram model, which LlamaTokenizer encodes otherwise, is
    not written, and the export says so; an imported model's tokenizer files come back out of its export."""
    import dataclasses

    import sentencepiece

    from loom.data_tools.tokenizer import train_tokenizer
    from loom.engine.checkpoint.format import tokenizer_record
    from loom.tools.hf_tokenizer import export_tokenizer

    docs = tmp_path / "docs.jsonl"
    lines = [f"  def f{i}(x):\n\treturn x * {i} + 1  # ünïcödé ☃ 中文 {i % 7}" for i in range(300)]
    docs.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    metadata = find_loadable(trained)[1]
    for kind in ("bpe", "unigram"):
        train_tokenizer([docs], tmp_path / kind, vocab_size=300, model_type=kind, progress=False)
        out = tmp_path / f"out-{kind}"
        out.mkdir()
        with_tokenizer = dataclasses.replace(metadata, tokenizer=tokenizer_record(str(tmp_path / f"{kind}.model")))
        said = export_tokenizer(out, with_tokenizer.tokenizer, with_tokenizer, max_positions=64, vocab_size=300)
        if kind == "unigram":
            assert "is a unigram model" in said and not any(out.iterdir())
            continue
        assert said is None
        processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "bpe.model"))
        theirs = transformers.AutoTokenizer.from_pretrained(str(out))
        for text in [*lines[:20], "Hello  world", " leading", "x  \n  y", "unseen: ξ ψ ω 🙂", "a <s> b </s> <unk>"]:
            ids = processor.encode(text)
            assert theirs.encode(text, add_special_tokens=False) == ids, text
            assert theirs.decode(ids) == processor.decode(ids), text
        assert (theirs.bos_token_id, theirs.eos_token_id) == (processor.bos_id(), processor.eos_id()) == (1, 2)
    # an import of that export, exported again: the same tokenizer files
    export_hf(trained, tmp_path / "hf")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((tmp_path / "out-bpe" / name).read_bytes())
    import_hf(tmp_path / "hf", tmp_path / "imported")
    again = export_hf(tmp_path / "imported", tmp_path / "again")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    capfd.readouterr()
    # the folder then holds another model's tokenizer (it was copied, exit 0): those are not the import's files
    (tmp_path / "hf" / "tokenizer.model").write_bytes((tmp_path / "unigram.model").read_bytes())
    without = export_hf(tmp_path / "imported", tmp_path / "without")
    assert "have changed since the import" in capfd.readouterr().err and not (without / "tokenizer.model").exists()
    shutil.rmtree(tmp_path / "hf")
    export_hf(tmp_path / "imported", tmp_path / "gone")
    assert "which the model was imported from, is gone" in capfd.readouterr().err
    (tmp_path / "mine").mkdir()  # a folder holding a tokenizer of the user's: not written over without --overwrite
    (tmp_path / "mine" / "tokenizer.model").write_bytes(b"my own")
    with pytest.raises(CheckpointError, match=r"already holds a model \(tokenizer.model\)"):
        export_hf(trained, tmp_path / "mine")
    assert (tmp_path / "mine" / "tokenizer.model").read_bytes() == b"my own"


def test_the_gpt2_shaped_model_computes_transformers_gpt2_logits_and_loss():
    """LayerNorm with biases, tanh GELU, learned positions, tied embeddings, multi-head attention: loom's
    GPT-2-shaped model equals GPT2LMHeadModel given the same weights (tests/test_hf_gpt2.py: export-hf and
    import-hf of it)."""
    hidden, heads, ffn, vocab, seq, layers = 32, 4, 64, 100, 16, 2
    config = config_from_dict(
        {
            "model": {
                "num_layers": layers,
                "hidden_size": hidden,
                "num_heads": heads,
                "num_kv_heads": heads,
                "ffn_hidden_size": ffn,
                "vocab_size": vocab,
                "make_vocab_divisible_by": 8,
                "norm": "layernorm",
                "activation": "gelu",
                "position_embedding": "learned",
                "bias": True,
                "tie_embeddings": True,
                "max_position_embeddings": 64,
                "norm_eps": 1e-5,
            }
        }
    ).model
    ours = GPTModel(config, None)
    initialize_parameters(ours, seed=5, tp_rank=0, tp_size=1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases start at 0 and norm weights at 1, where a swapped one would not show
        for name, p in ours.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    theirs = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=64,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=ffn,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            tie_word_embeddings=True,
        )
    ).eval()
    p = dict(ours.named_parameters())
    weights = {
        "transformer.wte.weight": p["embedding.weight"][:vocab],
        "transformer.wpe.weight": p["position_embedding"],
        "transformer.ln_f.weight": p["final_norm.weight"],
        "transformer.ln_f.bias": p["final_norm.bias"],
    }
    # GPT-2's Conv1D keeps (in, out) matrices: loom's Linear weights transposed
    gpt2_names = {
        "ln_1": "input_norm",
        "ln_2": "mlp_norm",
        "attn.c_attn": "attention.qkv",
        "attn.c_proj": "attention.proj",
        "mlp.c_fc": "mlp.fc1",
        "mlp.c_proj": "mlp.fc2",
    }
    for i in range(layers):
        for gpt2, loom in gpt2_names.items():
            weight = p[f"layers.{i}.{loom}.weight"]
            weights[f"transformer.h.{i}.{gpt2}.weight"] = weight if "ln" in gpt2 else weight.T
            weights[f"transformer.h.{i}.{gpt2}.bias"] = p[f"layers.{i}.{loom}.bias"]
    missing, unexpected = theirs.load_state_dict({k: v.detach().clone() for k, v in weights.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing), missing
    theirs.tie_weights()

    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens[:, :-1]).logits
        logits = ours.eval()(tokens[:, :-1])[..., :vocab].transpose(0, 1)
        losses = ours(tokens[:, :-1], tokens[:, 1:])
    assert (logits - expected).abs().max().item() < 1e-5
    reference = torch.nn.functional.cross_entropy(
        expected.reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
    )
    assert torch.allclose(losses.reshape(-1).float(), reference, atol=1e-5)

    # and the gradients: LayerNorm biases, learned positions, the tied embedding (its input and output uses summed)
    ours(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
    logits = theirs(tokens[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    theirs_by_name = dict(theirs.named_parameters())
    loom_of = {"transformer.wte.weight": "embedding.weight", "transformer.wpe.weight": "position_embedding"}
    loom_of |= {"transformer.ln_f.weight": "final_norm.weight", "transformer.ln_f.bias": "final_norm.bias"}
    for i in range(layers):
        for gpt2, loom in gpt2_names.items():
            loom_of |= {f"transformer.h.{i}.{gpt2}.{kind}": f"layers.{i}.{loom}.{kind}" for kind in ("weight", "bias")}
    assert set(loom_of) == {name for name in theirs_by_name if name != "lm_head.weight"}
    for name, loom in loom_of.items():
        mine = p[loom].grad[:vocab] if loom == "embedding.weight" else p[loom].grad
        transposed = loom.endswith(".weight") and "norm" not in loom and loom.startswith("layers.")
        expected = theirs_by_name[name].grad
        assert torch.allclose(mine.T if transposed else mine, expected, atol=1e-6, rtol=1e-4), name


def _loom_steps(rank, world, raw_config, steps, save=False):
    """(loss, grad norm, lr) of each of a Trainer's first `steps` steps; with `save`, a checkpoint of the last."""
    from loom.engine.train import Trainer

    config = config_from_dict(raw_config)
    trainer = Trainer(config)
    rows = [trainer.train_step() for _ in range(steps)]
    if save:
        trainer.save()
    trainer.close()
    return [(row["loss"], row["grad_norm"], row["lr"]) for row in rows]


def _imported_llama_run(tmp_path: Path, data_seed: int) -> dict:
    """A Llama that transformers wrote (tmp_path/hf), imported (tmp_path/imported), and the raw config of a run from
    it on 40 random documents: fp32, seq 32, AdamW with warm-up and cosine decay, no evaluation or TensorBoard."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(num_key_value_heads=2)).save_pretrained(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "imported")
    generator = np.random.default_rng(data_seed)
    with IndexedDatasetWriter(tmp_path / "docs", np.dtype(np.uint16)) as writer:
        for _ in range(40):
            writer.add_document(generator.integers(0, VOCAB, int(generator.integers(20, 90))))
    raw = find_loadable(tmp_path / "imported")[1].config
    raw["data"].update(paths=[str(tmp_path / "docs")], tokenizer=None, split="100,0,0", cache_dir=str(tmp_path / "c"))
    raw["train"].update(seq_length=32, precision="fp32", eval_interval=0, log_interval=1, tensorboard=False)
    raw["optim"].update(name="adamw", lr=1e-2, min_lr=1e-3, decay="cosine", weight_decay=0.1)
    raw["checkpoint"].update(load=str(tmp_path / "imported"), interval=0, save_at_end=False)
    return raw


def _assert_transformers_trains_alike(hf_model: Path, raw: dict, world: int, loom_rows: list) -> None:
    """transformers' LlamaForCausalLM from `hf_model`, trained with torch's AdamW (decay on matrices only, as loom's
    groups) on the samples the run of `raw` read, step for step as its `loom_rows` say."""
    from loom.engine.data.loader import build_dataset

    config = config_from_dict(raw)
    config.resolve_world(world)
    samples = build_dataset(config, 0, config.train.global_batch_size * len(loom_rows), is_builder=True, agree=None)
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_model), dtype=torch.float32)
    o = config.optim
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": o.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    assert_trains_as_torch_loop(model, optimizer, list(model.parameters()), samples, config, loom_rows)


def test_a_fine_tuning_run_starts_from_the_weights_alone_as_a_fresh_transformers_loop(tmp_path):
    """checkpoint.finetune (Megatron's --finetune): a run trained 3 steps (Adam moments, a data position, a decayed
    learning rate) is loaded for its weights alone; the fine-tuning run trains as transformers' LlamaForCausalLM
    loaded from that checkpoint's export, with a fresh AdamW, from step 1 of its own schedule and the start of its
    data. Without it, the run would train on from step 3 (its moments, its samples 12 on, its lr)."""
    from dist_utils import run_ranks

    from loom.engine.config import ConfigError

    raw = _imported_llama_run(tmp_path, data_seed=5)
    raw["train"].update(run_dir=str(tmp_path / "pretrained"), steps=3, global_batch_size=4, micro_batch_size=2)
    raw["optim"].update(warmup_steps=1, clip_grad=1.0, zero=0)
    run_ranks(_loom_steps, 1, raw, 3, True)
    export_hf(tmp_path / "pretrained", tmp_path / "hf-pretrained")

    raw["train"].update(run_dir=str(tmp_path / "finetuned"))
    raw["optim"].update(lr=5e-3, min_lr=5e-4, warmup_steps=2)
    raw["checkpoint"].update(load=str(tmp_path / "pretrained"), finetune=True)
    loom_rows = run_ranks(_loom_steps, 1, raw, 3)[0]
    _assert_transformers_trains_alike(tmp_path / "hf-pretrained", raw, 1, loom_rows)

    with pytest.raises(ConfigError, match="checkpoint.finetune starts from the weights of checkpoint.load, which is"):
        config_from_dict({**raw, "checkpoint": {**raw["checkpoint"], "load": None}})
    lora = {"rank": 4, "base": str(tmp_path / "imported")}
    with pytest.raises(ConfigError, match="a LoRA run starts from the weights of lora.base already"):
        config_from_dict({**raw, "lora": lora})
    with pytest.raises(ConfigError, match="a LoRA run starts from the weights of lora.base already"):  # not "add load"
        config_from_dict({**raw, "lora": lora, "checkpoint": {**raw["checkpoint"], "load": None}})


def test_loom_trains_an_imported_llama_as_a_plain_transformers_loop(tmp_path):
    """The training step against an outside loop: a Llama written by transformers, imported, trained 4 steps by
    loom at data parallel 2 with ZeRO-1 (2 micro-batches per rank, warm-up then cosine, clipping, decay on
    matrices only), and by transformers' LlamaForCausalLM with torch's AdamW and clip_grad_norm_ on the same
    samples, the loss summed over the global batch's tokens. Layout tests compare loom with loom; this checks what
    they share: how micro-batches and DP ranks are averaged, the clipped norm, the optimizer and its groups."""
    from dist_utils import run_ranks

    raw = _imported_llama_run(tmp_path, data_seed=4)
    raw["train"].update(run_dir=str(tmp_path / "run"), steps=4, global_batch_size=4, micro_batch_size=1)
    raw["optim"].update(warmup_steps=2, clip_grad=0.5, beta1=0.9, beta2=0.95, eps=1e-8, zero=1)
    loom_rows = run_ranks(_loom_steps, 2, raw, 4)[0]
    _assert_transformers_trains_alike(tmp_path / "hf", raw, 2, loom_rows)


def _byte_level_tokenizer_json(folder, texts):
    """A Llama 3 shaped Hugging Face tokenizer (byte-level BPE, special tokens, no SentencePiece model) in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": special[0], "eos_token": special[1], "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder / "tokenizer.json"


def test_a_hugging_face_tokenizer_json_builds_trains_generates_and_exports_as_transformers_encodes(
    tmp_path, capfd, monkeypatch
):
    """A model imported from Hugging Face may bring only a tokenizer.json (Llama 3): its data is built with it, as
    transformers' AutoTokenizer encodes (no bos added; --append-eod appends its eos; a special token spelled out in
    a text is text, as for SentencePiece); a run trained on that data generates with it (bos first, as AutoTokenizer
    adds it) and exports it beside the model, where AutoTokenizer encodes the same."""
    from loom.data_tools.jsonl import InputError
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.data.indexed import IndexedDataset

    texts = [f"def f{i}(x):\n    return x * {i} + 1  # ünïcödé ☃ 中文 {i % 7}" for i in range(200)]
    texts += ["a literal <|end_of_text|> in a document", "emoji 🙂 and ξ ψ ω"]
    tokenizer = _byte_level_tokenizer_json(tmp_path / "tok", texts)
    # a special token spelled out in a document is text, not a document's end: split_special_tokens
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), split_special_tokens=True)
    spelled = theirs.encode("a literal <|end_of_text|> in a document", add_special_tokens=False)
    assert theirs.eos_token_id not in spelled
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    prefix = str(tmp_path / "data")
    built = loom_here(capfd, "data", "build", "--input", str(docs), "--tokenizer", str(tokenizer),
                      "--output-prefix", prefix, "--append-eod", "--workers", "2")  # fmt: skip
    assert built.returncode == 0, built.stderr
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        assert dataset.get(i).tolist() == theirs.encode(text, add_special_tokens=False) + [theirs.eos_token_id], text
    shown = loom_here(capfd, "data", "preview", "--data.paths", prefix, "--tokenizer", str(tokenizer),
                      "--train.seq_length", "32", "--samples", "2", "--data.split", "1,0,0")  # fmt: skip
    assert shown.returncode == 0 and "return x *" in shown.stdout, shown.stderr
    run = tmp_path / "run"
    args = tiny_train_args(prefix, run, "--train.steps", "1", "--data.tokenizer", str(tokenizer))
    args += ["--checkpoint.save_at_end", "true"]
    trained = loom_here(capfd, "train", *args, "--model.vocab_size", str(len(theirs)), "--data.split", "9,1,0")
    assert trained.returncode == 0, trained.stderr
    generated = loom_here(capfd, "generate", "--checkpoint", str(run), "--prompt", "def f", "--max-new-tokens", "4")
    assert generated.returncode == 0 and generated.stdout.startswith("def f"), generated.stderr
    exported = export_hf(run, tmp_path / "hf")
    assert (exported / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    again = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert [again.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    assert (again.bos_token_id, again.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)

    # the settings beside tokenizer.json say which id ends each document of the dataset: another eos is refused,
    # an edit that leaves the eos (a chat template) is not
    settings = tmp_path / "tok" / "tokenizer_config.json"
    original = json.loads(settings.read_text())
    settings.write_text(json.dumps({**original, "eos_token": "<|begin_of_text|>"}))
    refused = loom_here(capfd, "train", *args, "--model.vocab_size", str(len(theirs)), "--train.steps", "2")
    said = f"error: dataset {prefix} ends each document with token 1, the eos of {tokenizer} when it was built, but "
    assert refused.returncode == 2 and said + f"{settings} now names token 0 as eos" in refused.stderr, refused.stderr
    with monkeypatch.context() as rank:  # a torchrun rank checks the same (it did not check the tokenizer at all)
        rank.setenv("RANK", "0")
        rank.setenv("WORLD_SIZE", "1")
        rank.setenv("MASTER_ADDR", "127.0.0.1")
        rank.setenv("MASTER_PORT", "1")  # refused before it meets anyone
        as_a_rank = loom_here(capfd, "train", *args, "--model.vocab_size", str(len(theirs)), "--train.steps", "2")
    assert as_a_rank.returncode == 2 and said in as_a_rank.stderr, as_a_rank.stderr
    # a dataset built now ends its documents with token 0: merged with the first, it is refused (it was merged, and
    # the merge recorded no eos, so the change went unchecked)
    bos_ended = str(tmp_path / "bos-ended")
    build = ["data", "build", "--input", str(docs), "--tokenizer", str(tokenizer), "--append-eod", "--workers", "1"]
    assert loom_here(capfd, *build, "--output-prefix", bos_ended).returncode == 0
    merge = ["data", "merge", "--output-prefix", str(tmp_path / "merged")]
    mixed = loom_here(capfd, *merge, "--inputs", prefix, bos_ended)
    assert mixed.returncode == 2 and f"{prefix} ends each document with token 1 and {bos_ended} with token 0" in (
        mixed.stderr
    ), mixed.stderr
    settings.write_text(json.dumps({**original, "chat_template": "{{ messages }}"}))
    again_built = str(tmp_path / "again")
    assert loom_here(capfd, *build, "--output-prefix", again_built).returncode == 0
    assert loom_here(capfd, *merge, "--inputs", prefix, again_built).returncode == 0
    merged = json.loads((tmp_path / "merged.manifest.json").read_text())["parameters"]
    assert merged["eod_id"] == 1
    settings.write_text(json.dumps({**original, "eos_token": "<|begin_of_text|>"}))
    with pytest.raises(InputError, match="merged ends each document with token 1"):
        check_same_tokenizer([str(tmp_path / "merged")], tokenizer)
    settings.write_text(json.dumps({**original, "chat_template": "{{ messages }}"}))
    again = loom_here(capfd, "train", *args, "--model.vocab_size", str(len(theirs)), "--train.steps", "2")
    assert again.returncode == 0, again.stderr
    settings.write_text("{damaged")  # after training: the export says so in one line (it raised json's error)
    damaged = loom_here(capfd, "ckpt", "export-hf", "--checkpoint", str(run), "--output", str(tmp_path / "hf2"))
    assert damaged.returncode == 0 and "Traceback" not in damaged.stderr, damaged.stderr
    assert f"warning: tokenizer written without its settings: {settings} cannot be read as a JSON" in damaged.stderr


def test_a_tokenizer_json_that_is_not_one_is_one_line(tmp_path, capfd):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "docs.jsonl").write_text('{"text": "x"}\n')
    result = loom_here(capfd, "data", "build", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                       str(tmp_path / "tokenizer.json"), "--output-prefix", str(tmp_path / "p"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: tokenizer {tmp_path / 'tokenizer.json'} is not a Hugging Face tokenizer")
    assert len(result.stderr.strip().splitlines()) == 1
