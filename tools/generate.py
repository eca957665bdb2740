"""`loom generate`: text from a checkpoint, decoded with a key/value cache.

The model is rebuilt from the checkpoint's config (any saved layout loads; the pieces are joined through their
ShardSpecs; a LoRA checkpoint's adapters are folded into its base) and decodes one token at a time after a
prefill of the prompt: greedy (temperature 0) or sampled with temperature and nucleus (top-p) filtering from a
seeded generator. On one process by default; with tp x pp ranks (`generate_parallel`) each rank holds its
shard of its stage, the last stage's TP ranks gather the vocabulary slices and every rank learns the token,
so every layout writes the same tokens. Pipelining decodes one stage after another: correct, not fast.
Greedy output equals transformers' greedy `generate` on the exported model (tests/test_hf.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from loom.engine.config import LoomConfig
from loom.engine.config_io import config_from_dict
from loom.engine.model.gpt import DecodingCache, GPTModel
from loom.engine.parallel import mappings
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.stages import stage_layers
from loom.tools.ckpt import open_checkpoint
from loom.tools.lora import ModelWeights


def load_model(checkpoint: Path, parallel: ParallelState | None = None) -> tuple[GPTModel, LoomConfig]:
    """The checkpoint's model in fp32 and eval mode: whole on one process, or this rank's shard of its pipeline
    stage under `parallel`."""
    directory, metadata = open_checkpoint(checkpoint)
    config = config_from_dict(metadata.config)
    if parallel is None:
        model, tp_rank, tp_size = GPTModel(config.model, None), 0, 1
    else:
        pp, stage = parallel.pp_size, parallel.pp_rank
        model = GPTModel(
            config.model,
            parallel.tp_group,
            layer_ids=stage_layers(config.model.num_layers, pp, 1, stage),
            pre_process=stage == 0,
            post_process=stage == pp - 1,
        )
        tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    weights = ModelWeights(directory, metadata)  # a LoRA checkpoint's adapters folded into its base
    with torch.no_grad():
        for _, param in model.named_parameters():
            info = param_info(param)
            param.copy_(info.shard_spec.shard(weights[info.name], tp_rank, tp_size))
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
    parallel: ParallelState | None = None,
) -> list[int]:
    """The prompt's continuation (new token ids only); stops early at a token in stop_ids. Under `parallel`
    every rank of the layout calls this together (its model: load_model(..., parallel)) and gets the tokens."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token")
    vocab = model.config.vocab_size
    limit = model.config.max_position_embeddings
    generator = torch.Generator().manual_seed(seed)
    cache = DecodingCache()
    tokens = torch.tensor([prompt])
    produced: list[int] = []
    while len(produced) < max_new_tokens and cache.length + tokens.shape[1] <= limit:
        logits = _decode(model, tokens, cache, parallel)
        token = next_token(logits[-1, 0, :vocab], temperature, top_p, generator) if logits is not None else 0
        if parallel is not None and parallel.pp_size > 1:
            token = _from_last_stage(token, parallel)
        produced.append(token)
        if token in stop_ids:
            break
        tokens = torch.tensor([[token]])
    return produced


def _decode(
    model: GPTModel, tokens: torch.Tensor, cache: DecodingCache, parallel: ParallelState | None
) -> torch.Tensor | None:
    """Full-vocabulary logits of the new positions on the last stage's ranks (None on the others)."""
    if parallel is None:
        return model.decode(tokens, cache)
    hidden = None
    if not model.pre_process:
        hidden = torch.empty(tokens.shape[1], 1, model.config.hidden_size)
        dist.recv(hidden, parallel.pp_ranks[parallel.pp_rank - 1])
    out = model.decode(tokens, cache, hidden)
    if not model.post_process:
        dist.send(out.contiguous(), parallel.pp_ranks[parallel.pp_rank + 1])
        return None
    return mappings.gather_from_tensor_region(out, parallel.tp_group)


def _from_last_stage(token: int, parallel: ParallelState) -> int:
    value = torch.tensor([token])
    dist.broadcast(value, parallel.pp_ranks[-1])
    return int(value)


def _generate_on_a_rank(
    rank: int, world: int, port: int, tp: int, pp: int, checkpoint: str, job: dict, results
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel = ParallelState.create(tp=tp, dp=1, pp=pp)
        model, _ = load_model(Path(checkpoint), parallel)
        produced = generate(model, parallel=parallel, **job)
        if rank == 0:
            results.put(produced)
    except BaseException as error:  # noqa: BLE001 - reported by the launcher in one line
        results.put(error)
        raise
    finally:
        dist.destroy_process_group()


def generate_parallel(checkpoint: Path, tp: int, pp: int, **job) -> list[int]:
    """generate() on tp x pp local ranks (gloo), the model split as training splits it; rank 0's tokens."""
    config = config_from_dict(open_checkpoint(checkpoint)[1].config)
    m = config.model
    for name, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads or m.num_heads)):
        if value % tp:
            raise ValueError(f"--parallel.tp {tp} must divide model.{name} = {value}")
    if m.num_layers % pp:
        raise ValueError(f"--parallel.pp {pp} must divide model.num_layers = {m.num_layers}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    world = tp * pp
    ranks = [
        context.Process(target=_generate_on_a_rank, args=(r, world, port, tp, pp, str(checkpoint), job, results))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    outcome = results.get()
    for process in ranks:
        process.join()
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
