"""`loom generate`: text from a checkpoint, decoded with a key/value cache.

The model is rebuilt from the checkpoint's config on one process (any saved layout loads; the pieces are
joined through their ShardSpecs) and decodes one token at a time after a prefill of the prompt:
greedy (temperature 0) or sampled with temperature and nucleus (top-p) filtering from a seeded generator.
Greedy output equals transformers' greedy `generate` on the exported model (tests/test_generate.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.engine.config import LoomConfig
from loom.engine.config_io import config_from_dict
from loom.engine.model.gpt import DecodingCache, GPTModel
from loom.engine.parallel.param_info import param_info
from loom.tools.ckpt import open_checkpoint
from loom.tools.lora import merged_weights


def load_model(checkpoint: Path) -> tuple[GPTModel, LoomConfig]:
    """The checkpoint's model on one process, in fp32 and eval mode."""
    directory, metadata = open_checkpoint(checkpoint)
    config = config_from_dict(metadata.config)
    model = GPTModel(config.model, None)
    weights = merged_weights(directory, metadata)  # a LoRA checkpoint's adapters folded into its base
    with torch.no_grad():
        for _, param in model.named_parameters():
            info = param_info(param)
            param.copy_(info.shard_spec.shard(weights[info.name], 0, 1))
    return model.eval(), config


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw from the smallest set of tokens whose probability reaches top_p."""
    if temperature == 0:
        return int(logits.argmax())
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = probabilities.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p  # a token stays if the ones before it fall short of top_p
    ordered = ordered * keep
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=generator)])


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """The prompt's continuation (new token ids only); stops early at a token in stop_ids."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token")
    vocab = model.config.vocab_size
    limit = model.config.max_position_embeddings
    generator = torch.Generator().manual_seed(seed)
    cache = DecodingCache()
    logits = model.decode(torch.tensor([prompt]), cache)
    produced: list[int] = []
    while len(produced) < max_new_tokens and cache.length < limit:
        token = next_token(logits[-1, 0, :vocab], temperature, top_p, generator)
        produced.append(token)
        if token in stop_ids:
            break
        logits = model.decode(torch.tensor([[token]]), cache)
    return produced
