"""`loom ckpt export-hf` / `import-hf` of GPT-2-shaped models (the gpt-125m preset's shape) against transformers'
GPT2LMHeadModel: models it writes (tied, as the original gpt2 files name their tensors, with the causal-mask
buffers beside them; untied) import with the logits transformers computes, and export back to a model transformers
loads with the same logits; what loom cannot compute alike is refused in one line."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from training_runs import loom_here, loom_logits, one_line_error, tiny_train_args

from loom.engine.checkpoint.format import CheckpointError, find_loadable
from loom.engine.checkpoint.load import PieceReader
from loom.tools.hf import export_hf, import_hf

transformers = pytest.importorskip("transformers", reason="needs loom[reference]")

VOCAB, POSITIONS = 100, 32


def _gpt2(folder: Path, tied: bool, **settings) -> Path:
    """A GPT2LMHeadModel with weights away from their initial values (norms at 1 and biases at 0 would hide a
    swap), saved by transformers; tied: as the original gpt2 files hold it (GPT2Model's names, no lm_head, the
    attention's causal-mask buffers)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4, n_inner=80,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=7, eos_token_id=7,
        **settings,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    if tied:
        stored = load_file(folder / "model.safetensors")
        bare = {k.removeprefix("transformer."): v for k, v in stored.items() if k != "lm_head.weight"}
        mask = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool)).view(1, 1, POSITIONS, POSITIONS)
        bare |= {f"h.{i}.attn.bias": mask.clone() for i in range(2)}
        save_file(bare, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [True, False], ids=["tied-as-the-gpt2-files", "untied"])
def test_gpt2_imports_with_transformers_logits_and_exports_back_to_the_same_model(tied, tmp_path, capfd):
    hf = _gpt2(tmp_path / "hf", tied)
    expected = _logits(hf, TOKENS)
    import_hf(hf, tmp_path / "loom")
    ours = loom_logits(tmp_path / "loom", TOKENS)
    assert (ours[..., :VOCAB] - expected).abs().max().item() < 1e-5
    (_, metadata) = find_loadable(tmp_path / "loom")
    shape = {k: metadata.config["model"][k] for k in ("norm", "activation", "position_embedding", "bias")}
    assert shape == {"norm": "layernorm", "activation": "gelu", "position_embedding": "learned", "bias": True}
    assert metadata.config["model"]["tie_embeddings"] is tied

    exported = loom_here(
        capfd, "ckpt", "export-hf", "--checkpoint", str(tmp_path / "loom"), "--output", str(tmp_path / "back")
    )
    assert exported.returncode == 0, exported.stderr
    assert "transformers.GPT2LMHeadModel.from_pretrained loads it" in exported.stdout
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["n_inner"], config["activation_function"]) == ("gpt2", 80, "gelu_new")
    assert (config["bos_token_id"], config["eos_token_id"], config["tie_word_embeddings"]) == (7, 7, tied)
    assert (_logits(tmp_path / "back", TOKENS) - expected).abs().max().item() < 1e-6
    import_hf(tmp_path / "back", tmp_path / "again")  # and back in: the same tensors
    (first, first_meta), (second, second_meta) = find_loadable(tmp_path / "loom"), find_loadable(tmp_path / "again")
    ours, theirs = PieceReader(first, first_meta), PieceReader(second, second_meta)
    for name in first_meta.specs:
        assert torch.equal(ours.model(name), theirs.model(name)), name


def test_the_three_dropout_rates_are_loom_s_one(tmp_path):
    """GPT-2's embd_pdrop, resid_pdrop and attn_pdrop are where loom drops at model.dropout (embedding output,
    residual branches, attention probabilities): transformers defaults them to 0.1 where absent."""
    import_hf(_gpt2(tmp_path / "hf", True), tmp_path / "loom")
    from loom.tools.hf_gpt2 import gpt2_config

    (_, metadata) = find_loadable(tmp_path / "loom")
    config = gpt2_config({**metadata.config["model"], "dropout": 0.2}, {}, "float32")
    assert (config["embd_pdrop"], config["resid_pdrop"], config["attn_pdrop"]) == (0.2, 0.2, 0.2)


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"activation_function": "gelu"}, "activation_function is 'gelu'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx: True"),
        ({"scale_attn_weights": False}, "scale_attn_weights: False"),
    ],
)
def test_gpt2_settings_loom_computes_otherwise_are_refused_in_one_line(settings, fragment, tmp_path, capfd):
    hf = _gpt2(tmp_path / "hf", True, **settings)
    capfd.readouterr()  # transformers' progress bar
    refused = loom_here(capfd, "ckpt", "import-hf", "--input", str(hf), "--output", str(tmp_path / "out"))
    one_line_error(refused, fragment)
    assert not (tmp_path / "out").exists()


def test_a_model_of_neither_form_is_refused_naming_both(tmp_path):
    import_hf(_gpt2(tmp_path / "hf", True), tmp_path / "loom")
    directory, metadata = find_loadable(tmp_path / "loom")
    # GPT2LMHeadModel has no q/k norm, attends to every earlier position and scales no embedding (they exported
    # as a GPT-2 without them)
    for changes in (
        {"norm": "rmsnorm"},
        {"num_kv_heads": 2},
        {"qk_norm": True},
        {"sliding_window": 16},
        {"embedding_multiplier": 2.0},
        {"logits_softcap": 30.0},
    ):
        metadata.config["model"].update(changes)
        (directory / "metadata.json").write_text(metadata.to_json())
        with pytest.raises(CheckpointError, match="GPT-2-shaped ones .* export to Hugging Face; this one has") as error:
            export_hf(tmp_path / "loom", tmp_path / "out")
        assert "qk_norm" in str(error.value) or "qk_norm" not in changes
        restored = {"norm": "layernorm", "num_kv_heads": 4, "qk_norm": False, "sliding_window": None}
        metadata.config["model"].update({**restored, "embedding_multiplier": 1.0, "logits_softcap": None})


def test_a_lora_run_on_gpt2_exports_a_peft_adapter_with_its_logits(markov_dataset, tmp_path, capfd):
    """Import a GPT-2, fine-tune adapters on every linear layer, export base and adapter: PEFT's model (Conv1D
    layers, fan_in_fan_out) computes the LoRA run's logits."""
    peft = pytest.importorskip("peft", reason="needs loom[reference]")
    from loom.tools.generate import load_model

    config = transformers.GPT2Config(vocab_size=4096, n_positions=128, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "base")
    flags = ["--lora.rank", "4", "--lora.base", str(tmp_path / "base")]  # adapters on all four linear layers
    flags += [
        "--train.steps",
        "2",
        "--optim.lr",
        "0.01",
        "--optim.warmup_steps",
        "0",
        "--checkpoint.save_at_end",
        "true",
    ]
    capfd.readouterr()  # transformers' progress bar
    trained = loom_here(capfd, "train", *tiny_train_args(markov_dataset(50), tmp_path / "run"), *flags)
    assert trained.returncode == 0, trained.stderr
    exported = loom_here(capfd, "ckpt", "export-hf", "--checkpoint", str(tmp_path / "run"), "--adapter-only",
                         "--output", str(tmp_path / "adapter"))  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["fan_in_fan_out"] and "transformer.h.1.mlp.c_proj" in adapter["target_modules"]
    export_hf(tmp_path / "base", tmp_path / "hf-base")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf-base").eval()
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = hf(tokens).logits  # before PEFT injects the adapters into hf's layers
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(tokens).logits
        ours = load_model(find_loadable(tmp_path / "run" / "checkpoints")[0])[0](tokens).transpose(0, 1)
    assert (ours[..., :4096] - theirs).abs().max().item() < 1e-5
    assert (theirs - base).abs().max().item() > 1e-4  # the adapters moved
