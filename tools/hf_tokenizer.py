"""The tokenizer that goes beside an export-hf model, so that `AutoTokenizer.from_pretrained(DIR)` encodes text
as the model was trained on it.

A model trained here on a `loom data tokenizer` BPE model gets that SentencePiece model as `tokenizer.model` with a
LlamaTokenizer config that keeps its settings (no bos/eos added, no dummy-prefix space: `loom data build`
adds neither); one trained on a Hugging Face tokenizer.json gets that file and the settings beside it; an imported
model gets the tokenizer files of the Hugging Face folder it came from. transformers' LlamaTokenizer encodes a
unigram SentencePiece model differently from SentencePiece, so none is written for one.
"""

from __future__ import annotations

import json
from pathlib import Path

from loom.data_tools.jsonl import InputError
from loom.data_tools.tokenizer import load_tokenizer
from loom.engine.atomic import copy_atomically, write_text_atomically
from loom.engine.checkpoint.format import CheckpointError, CheckpointMetadata, sha256_of
from loom.engine.data.tokenizer_json import is_tokenizer_json, settings_of
from loom.tools.outputs import HF_TOKENIZER_FILES


def check_moved_tokenizer(recorded: dict | None, moved_to: Path, vocab_size: int) -> None:
    """Refuse `moved_to` (export-hf --tokenizer) unless it is the tokenizer the model was trained with (`recorded`,
    CheckpointMetadata.tokenizer; a record without sha256, format.unrecorded_tokenizer, cannot tell)."""
    if recorded is None:
        raise CheckpointError(
            f"--tokenizer {moved_to}: the checkpoint records no tokenizer to check it against (it trained on token "
            "ids, or was imported: its tokenizer is its Hugging Face folder's); drop --tokenizer"
        )
    if recorded["sha256"] is None:  # nothing to compare it with: at least a SentencePiece model that fits
        reason = unfit_tokenizer(moved_to, vocab_size)
        if reason:
            raise CheckpointError(f"--tokenizer {moved_to}: {reason}")
    elif sha256_of(moved_to) != recorded["sha256"]:
        raise CheckpointError(
            f"--tokenizer {moved_to} is not the tokenizer this model was trained with ({recorded['path']}, sha256 "
            f"{recorded['sha256'][:12]})"
        )


def unfit_tokenizer(path: Path, vocab_size: int) -> str | None:
    """Why `path` cannot be an unchecked model's tokenizer (not SentencePiece, or more pieces than the model has
    ids), else None."""
    try:
        pieces = load_tokenizer(path).get_piece_size()
    except InputError as error:
        return str(error)
    if pieces > vocab_size:
        return f"its {pieces} pieces exceed the model's vocab_size {vocab_size}: not the tokenizer it trained with"
    return None


def export_tokenizer(
    output: Path,
    recorded: dict | None,
    model: CheckpointMetadata,
    max_positions: int,
    vocab_size: int,
    moved_to: Path | None = None,
) -> str | None:
    """Write the tokenizer of the model exported into `output` (`recorded`: the tokenizer it trained with,
    CheckpointMetadata.tokenizer; `model`: the metadata whose Hugging Face origin it carries, the base's for a
    LoRA checkpoint; `max_positions`: the model's longest sequence; `vocab_size`: its ids, which an unchecked
    tokenizer must fit; `moved_to`: where the trained-with tokenizer is now, checked by check_moved_tokenizer);
    returns why none was written where the model had one, else None."""
    if recorded is not None:
        path = moved_to or Path(recorded["path"])
        if not path.is_file() or recorded["sha256"] not in (None, sha256_of(path)):
            relative = "" if path.is_absolute() else "; a relative path is relative to where training ran"
            return (
                f"no tokenizer written: {path}, which the model was trained with, is gone or has changed (moved? "
                f"give its new place with --tokenizer{relative})"
            )
        reason = unfit_tokenizer(path, vocab_size) if recorded["sha256"] is None else None
        if reason:
            return f"no tokenizer written: {path}: {reason}"
        if is_tokenizer_json(path):
            return _copy_tokenizer_json(path, output)
        return _write_sentencepiece(path, output, max_positions)
    if model.hf_source is not None:
        return _copy_imported(Path(model.hf_source), model.hf_tokenizer, output)
    return None  # the model trained on token ids without a tokenizer


def _copy_imported(source: Path, recorded: dict | None, output: Path) -> str | None:
    """Copy the tokenizer files of the folder a model was imported from, if they are those it held then (their
    sha256, recorded at import; an import from before that record copies what is there)."""
    if not source.is_dir():
        return f"no tokenizer written: {source}, which the model was imported from, is gone"
    files = [source / name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    if recorded is not None:
        now = {file.name: sha256_of(file) for file in files}
        if now != recorded:
            return (
                f"no tokenizer written: the tokenizer files of {source}, which the model was imported from, have "
                "changed since the import"
            )
    if not files:
        return f"no tokenizer written: {source}, which the model was imported from, holds no tokenizer files"
    for file in files:
        copy_atomically(file, output / file.name)
    return None


def _copy_tokenizer_json(path: Path, output: Path) -> str | None:
    """A Hugging Face tokenizer.json the model trained with, and the settings files beside it (which tokens are
    bos and eos, the tokenizer's class), as transformers' AutoTokenizer loads them."""
    copy_atomically(path, output / "tokenizer.json")
    if (path.parent / "special_tokens_map.json").is_file():
        copy_atomically(path.parent / "special_tokens_map.json", output / "special_tokens_map.json")
    settings_path = settings_of(path)
    try:
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    except (OSError, ValueError):
        settings = None
    if not isinstance(settings, dict):
        return (
            f"tokenizer written without its settings: {settings_path} cannot be read as a JSON object (fix it and "
            "export again)"
        )
    # a special token spelled out in a text is text, as the model's data was encoded (engine/data/tokenizer_json.py)
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    settings["split_special_tokens"] = True
    write_text_atomically(output / "tokenizer_config.json", json.dumps(settings, indent=2))
    return None


def _write_sentencepiece(path: Path, output: Path, max_positions: int) -> str | None:
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        return (
            f"no tokenizer written: {path} is a unigram model, which transformers' LlamaTokenizer encodes "
            "differently; give users the .model file for SentencePiece"
        )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def piece(token_id: int) -> str | None:
        return processor.id_to_piece(token_id) if token_id >= 0 else None

    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(processor.bos_id()),
        "eos_token": piece(processor.eos_id()),
        "unk_token": piece(processor.unk_id()),
        "pad_token": piece(processor.pad_id()),
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": proto.normalizer_spec.add_dummy_prefix,
        "legacy": False,
        "split_special_tokens": True,  # "<s>" in text is text, as `loom data build` encoded it, not the bos id
        "model_max_length": max_positions,
    }
    copy_atomically(path, output / "tokenizer.model")
    write_text_atomically(output / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))
    return None
