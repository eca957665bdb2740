"""Hugging Face interchange: transformers loads loom's export and computes the same logits;
import followed by export gives back the same tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file
from training_runs import tiny_config

from loom.engine.checkpoint.format import find_loadable
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config_io import config_from_dict
from loom.engine.model.gpt import GPTModel
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import initialize_parameters
from loom.launch.local import launch_local
from loom.tools.hf import export_hf, import_hf

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


def loom_logits(checkpoints, tokens):
    directory, metadata = find_loadable(checkpoints)
    config = config_from_dict(metadata.config)
    model = GPTModel(config.model, None)
    initialize_parameters(model, 0, 0, 1)
    reader = PieceReader(directory, metadata)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(param_info(param).shard_spec.shard(reader.model(name), 0, 1))
        return model.eval()(tokens)[..., : config.model.vocab_size].transpose(0, 1)


def test_transformers_computes_the_same_logits(trained, tmp_path):
    out = export_hf(trained, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = loom_logits(trained, tokens)
    assert (theirs - ours).abs().max().item() < 1e-4


def test_import_then_export_is_identical(trained, tmp_path):
    first = export_hf(trained, tmp_path / "first")
    import_hf(first, tmp_path / "imported")
    second = export_hf(tmp_path / "imported", tmp_path / "second")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
