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

import datetime
import os
import queue
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loom.engine.checkpoint.format import CheckpointMetadata, read_metadata, sha256_of
from loom.engine.config import ConfigError, LoomConfig, ParallelConfig
from loom.engine.config_io import config_from_dict
from loom.engine.faults import FaultPlan
from loom.engine.model.gpt import DecodingCache, GPTModel
from loom.engine.model.moe import expert_biases
from loom.engine.parallel import mappings
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.rendezvous import end_ranks, host_rendezvous, rank_context
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.stages import stage_layers
from loom.errors import is_user_error
from loom.tools.ckpt import open_checkpoint
from loom.tools.lora import ModelWeights


def load_model(
    checkpoint: Path,
    parallel: ParallelState | None = None,
    base: Path | None = None,
    opened: tuple[Path, CheckpointMetadata] | None = None,
    verify_hashes: bool = True,
) -> tuple[GPTModel, LoomConfig]:
    """The checkpoint's model in fp32 and eval mode: whole on one process, or this rank's shard of its pipeline
    stage under `parallel`. `base`: a LoRA checkpoint's base where it is now; `opened`: the checkpoint's
    (directory, metadata) when the caller has read them already; `verify_hashes`: check the files of a LoRA
    checkpoint's base (False where the caller has)."""
    directory, metadata = opened or open_checkpoint(checkpoint)
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
    weights = ModelWeights(directory, metadata, base, verify_hashes)  # a LoRA checkpoint's adapters folded in
    with torch.no_grad():
        for _, param in model.named_parameters():
            info = param_info(param)
            param.copy_(info.shard_spec.shard(weights[info.name], tp_rank, tp_size))
        for name, bias in expert_biases([model]).items():  # where the checkpoint has them (else zero: none yet)
            if name in weights.buffers:
                bias.copy_(weights[name])
    return model.eval(), config


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw from the smallest set of tokens whose probability reaches top_p."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or so small that fp32 divides the logits by 0
        return int(logits.argmax())
    logits = logits.float()
    # the largest logit made 0 first: a tiny temperature then sends the others to -inf, not the largest to inf
    probabilities = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    # A token stays if the more probable ones fall short of top_p, i.e. if it and the less probable ones hold more
    # than 1 - top_p: summed from the least probable up (as transformers' TopPLogitsWarper), so the sum reaches 1
    # only at the top and top_p = 1 keeps every token (summed from the top, it reached 1.0 early in fp32 and
    # dropped the tail).
    ordered, order = probabilities.sort()
    keep = ordered.cumsum(0) > 1 - top_p
    keep[-1] = True
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
    vocab_size: int | None = None,
    faults: FaultPlan | None = None,
) -> list[int]:
    """The prompt's continuation (new token ids only); stops early at a token in stop_ids. `vocab_size`: draw only
    ids below it (the tokenizer's pieces, where the model's vocabulary is larger). Under `parallel` every rank of
    the layout calls this together (its model: load_model(..., parallel)) and gets the tokens. `faults`: the
    failures a test injects (engine/faults.py; a "step" is a token)."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token")
    vocab = min(model.config.vocab_size, vocab_size or model.config.vocab_size)
    limit = model.config.max_position_embeddings
    generator = torch.Generator().manual_seed(seed)
    cache = DecodingCache()
    tokens = torch.tensor([prompt])
    produced: list[int] = []
    while len(produced) < max_new_tokens and cache.length + tokens.shape[1] <= limit:
        if faults is not None:
            faults.before_step(len(produced))
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
    """The token the last stage drew, on every rank of this pipeline (each TP rank's pipeline is its own group:
    on the world group the pipelines' broadcasts from different sources waited on each other forever)."""
    value = torch.tensor([token])
    dist.broadcast(value, parallel.pp_ranks[-1], group=parallel.pp_group)
    return int(value)


def _generate_on_a_rank(
    rank: int,
    world: int,
    rendezvous: dict[str, str],
    tp: int,
    pp: int,
    checkpoint: str,
    base: Path | None,
    job: dict,
    results,
    where,
) -> None:
    # A stop ends a rank at once, quietly (nothing to save); the launcher says how it stopped. A KeyboardInterrupt
    # here printed each rank's traceback and its peers' broken connections.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    environ, cwd = where  # the launcher's, not the fork server's (started earlier, maybe elsewhere)
    os.environ.clear()
    os.environ.update(environ, **rendezvous)
    os.chdir(cwd)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(minutes=ParallelConfig.timeout_minutes)  # a lost peer fails, not hangs
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        parallel = ParallelState.create(tp=tp, dp=1, pp=pp, timeout=timeout)
        directory = Path(checkpoint)  # checked by the launcher (open_checkpoint): each rank checking it took as long
        opened = (directory, read_metadata(directory, verify_hashes=False))
        model, _ = load_model(directory, parallel, base, opened=opened, verify_hashes=False)  # and its base there
        produced = generate(model, parallel=parallel, faults=FaultPlan.from_environment(rank), **job)
        if rank == 0:
            results.put(produced)
    except BaseException as error:  # noqa: BLE001 - reported by the launcher
        results.put(error)
        if not is_user_error(error):
            raise  # a bug: its traceback, from the rank it happened on (a user's mistake is one line, there)
    finally:
        dist.destroy_process_group()


class RankDied(Exception):
    """A rank of generate_parallel ended without a word: killed by a signal (the OOM killer's SIGKILL, say)."""

    def __init__(self, rank: int, exitcode: int):
        self.rank, self.exitcode = rank, exitcode
        super().__init__(f"rank {rank} was killed (exit code {exitcode})")


def _killed(ranks: list) -> RankDied | None:
    for rank, process in enumerate(ranks):
        if process.exitcode is not None and process.exitcode < 0:
            return RankDied(rank, process.exitcode)
    return None


def _wait_for_outcome(results, ranks: list) -> list[int] | BaseException:
    """Rank 0's tokens, or the first error a rank reported. A rank killed by a signal reports nothing (waiting
    for it hung), so it is looked for too, and named over the errors its death causes its peers ("connection
    closed by peer")."""
    outcome = None
    while outcome is None and (died := _killed(ranks)) is None:
        try:
            outcome = results.get(timeout=0.2)
        except queue.Empty:
            pass
    if isinstance(outcome, list):
        return outcome
    give_up = time.monotonic() + 2.0  # a peer's error may arrive before the killed rank's end is seen
    while (died := _killed(ranks)) is None and time.monotonic() < give_up and any(p.is_alive() for p in ranks):
        time.sleep(0.05)
    return died or outcome


def check_layout(config: LoomConfig, tp: int, pp: int) -> None:
    """Refuse a generation layout the model does not split into, before any rank starts."""
    m = config.model
    m.check_tensor_parallel(tp)
    if m.num_layers % pp:
        raise ConfigError(f"--parallel.pp {pp} must divide model.num_layers = {m.num_layers}")


def generate_parallel(
    opened: tuple[Path, CheckpointMetadata], tp: int, pp: int, base: Path | None = None, **job
) -> list[int]:
    """generate() on tp x pp local ranks (gloo), the model split as training splits it; rank 0's tokens.
    `opened`: open_checkpoint's (directory, metadata), whose hashes the ranks do not check again."""
    directory, metadata = opened
    check_layout(config_from_dict(metadata.config), tp, pp)
    ModelWeights(directory, metadata, base)  # a LoRA checkpoint's base checked here once, not on every rank
    store, rendezvous = host_rendezvous()
    context = rank_context()  # ranks fork from a server that has imported torch once, as training's do
    results = context.Queue()
    world = tp * pp
    ranks = [
        context.Process(
            target=_generate_on_a_rank,
            args=(r, world, rendezvous, tp, pp, str(directory), base, job, results, (dict(os.environ), os.getcwd())),
        )
        for r in range(world)
    ]
    outcome: list[int] | BaseException | None = None
    try:
        for process in ranks:
            process.start()
        outcome = _wait_for_outcome(results, ranks)
    finally:  # a failed rank's peers (or every rank, when this command is stopped) would wait for it in vain
        started = [process for process in ranks if process.pid is not None]
        if isinstance(outcome, list):
            for process in started:
                process.join()
        else:
            end_ranks(started, grace_s=5.0)
        del store  # hosted until every rank has ended
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def parse_prompt_ids(text: str) -> list[int]:
    """--prompt-ids: token ids separated by spaces or commas."""
    parts = [part for part in re.split(r"[\s,]+", text.strip()) if part]
    if not parts:
        raise ConfigError("--prompt-ids is empty; give at least one token id, e.g. '1 2 3'")
    try:
        return [int(part) for part in parts]
    except ValueError:
        bad = next(part for part in parts if not part.lstrip("-").isdigit())
        raise ConfigError(f"--prompt-ids: {bad!r} is not a token id; give integers, e.g. '1 2 3' or '1,2,3'") from None


def check_trained_tokenizer(
    path: str, metadata: CheckpointMetadata, trained_with: str | None, explicit: bool, advice: str
) -> None:
    """Refuse tokenizer `path` if the model was not trained with it: by the sha256 its checkpoint records, else
    (a path given explicitly) by the run's tokenizer file `trained_with`; `advice` says what to do instead."""
    expected = (metadata.tokenizer or {}).get("sha256")
    if expected is None and explicit and trained_with and Path(trained_with).is_file():
        expected = sha256_of(Path(trained_with))
    if expected and sha256_of(Path(path)) != expected:
        what = "is not the one" if explicit else "has changed since it was the one"
        raise ConfigError(
            f"tokenizer {path} {what} this model was trained with ({trained_with}, sha256 {expected[:12]}); {advice}"
        )


def open_tokenizer(metadata: CheckpointMetadata, config: LoomConfig, explicit: str | None, needed: bool):
    """The tokenizer (SentencePiece, or a tokenizer.json) to encode the prompt and decode the output with:
    `explicit` (--tokenizer), else the one the run trained with (its path then). Refuses one the model was not
    trained with (by the sha256 its checkpoint records, or the run's tokenizer file) or with more pieces than the
    model has ids, whose output would be noise. None when there is none and it is not `needed` (--prompt-ids: the
    output stays ids)."""
    from loom.data_tools.tokenizer import load_tokenizer

    recorded = metadata.tokenizer or {}
    trained_with = recorded.get("path") or config.data.tokenizer
    path = explicit or trained_with
    if path is None or not Path(path).is_file():
        if not needed:
            return None
        where = f"the one it trained with, {path}, is not there; " if path else ""
        raise ConfigError(f"no tokenizer: {where}pass --tokenizer T.model, or the prompt as --prompt-ids '1 2 3'")
    check_trained_tokenizer(
        path, metadata, trained_with, bool(explicit), "its text would be noise: pass that tokenizer (or --prompt-ids)"
    )
    processor = load_tokenizer(path)
    if processor.vocab_size() > config.model.vocab_size:
        raise ConfigError(
            f"tokenizer {path} has {processor.vocab_size()} pieces but the model {config.model.vocab_size} ids: "
            "not its tokenizer"
        )
    return processor


def stop_reason(produced: list[int], max_new_tokens: int, stop_ids: tuple[int, ...], positions: int) -> str:
    """Why generate() returned: the end-of-text token, --max-new-tokens, or the model's positions."""
    if produced and produced[-1] in stop_ids:
        return "at the end-of-text token"
    if len(produced) == max_new_tokens:
        return "at --max-new-tokens"
    return f"at the model's {positions} positions (model.max_position_embeddings)"
