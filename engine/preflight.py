"""Checks that need no process group: the layout, data, tokenizer, checkpoint and run directory.

Every launcher (local, torchrun, Slurm, `loom eval`, the demo) runs them before any rank starts, so
a user's mistake is one line instead of N failing ranks.
"""

from __future__ import annotations

from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig


def preflight(config: LoomConfig, world_size: int) -> None:
    """Everything that can be checked before a process group starts."""
    from loom.engine.data.indexed import IndexedDataset
    from loom.engine.data.token_range import check_token_ids

    config.resolve_world(world_size)
    if config.model.kernels == "te" or config.train.fp8 != "off":
        import torch

        if not torch.cuda.is_available():  # where CUDA exists, each rank checks its own device
            from loom.engine.model.kernels import choose_kernels

            choose_kernels(config, torch.device("cpu"))
    if not config.data.paths:
        raise ConfigError(
            "data.paths is empty; build a dataset with `loom data build` (or run `loom demo`) "
            "and pass --data.paths PREFIX"
        )
    for prefix in config.data.paths:
        dataset = IndexedDataset(prefix)
        if dataset.num_tokens == 0:
            raise ConfigError(f"dataset {prefix} holds no tokens")
    check_token_ids(config.data.paths, config.model.vocab_size, config.data.cache_dir)
    if config.data.tokenizer:
        import sentencepiece

        tokenizer = Path(config.data.tokenizer)
        if not tokenizer.is_file():
            what = "is a directory; give its .model file" if tokenizer.is_dir() else "does not exist"
            raise ConfigError(f"data.tokenizer {tokenizer} {what}")
        vocab = sentencepiece.SentencePieceProcessor(model_file=config.data.tokenizer).vocab_size()
        if vocab > config.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab} pieces but model.vocab_size = {config.model.vocab_size}; "
                f"set --model.vocab_size {vocab}"
            )
    if config.checkpoint.load and not Path(config.checkpoint.load).exists():
        raise ConfigError(f"checkpoint.load = {config.checkpoint.load} does not exist")
    run_dir = Path(config.train.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"run directory {run_dir} is not writable: {error.strerror}") from None
