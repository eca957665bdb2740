"""A Hugging Face `tokenizer.json` as the tokenizer of loom's data commands, training checks and generation (in the
engine, which checks data.tokenizer; data_tools loads it through its load_tokenizer).

A model imported from Hugging Face brings its tokenizer as tokenizer.json (Llama 3 ships no SentencePiece model);
its data must be tokenized by that tokenizer. `HuggingFaceTokenizer` runs it with the `tokenizers` library (the one
transformers' fast tokenizers use) behind the few SentencePieceProcessor methods loom calls, and encodes as
`AutoTokenizer.from_pretrained(folder, split_special_tokens=True).encode(text, add_special_tokens=False)` does: no bos
or eos added (as `loom data build` adds none to SentencePiece's ids; `--append-eod` appends the eos), and a special
token written in a text read as text. Which tokens are bos and eos is said by the tokenizer_config.json beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loom.errors import LoomError

if TYPE_CHECKING:
    import sentencepiece


class TokenizerError(LoomError):
    """A tokenizer file that cannot be read as one, or the library to read it missing."""


def is_tokenizer_json(path: str | Path) -> bool:
    """Whether `path` names a Hugging Face tokenizer file (by its suffix: SentencePiece models are binary)."""
    return Path(path).suffix == ".json"


def settings_of(path: str | Path) -> Path | None:
    """The tokenizer_config.json that says which tokens of tokenizer.json `path` are bos and eos (it may be missing);
    None for a SentencePiece model, which carries its own."""
    return Path(path).with_name("tokenizer_config.json") if is_tokenizer_json(path) else None


def open_tokenizer(path: str | Path) -> sentencepiece.SentencePieceProcessor | HuggingFaceTokenizer:
    """The tokenizer in file `path`: a HuggingFaceTokenizer for a tokenizer.json, else a SentencePiece model (the
    one place that tells them apart, for the engine's check of data.tokenizer and data_tools' load_tokenizer)."""
    if is_tokenizer_json(path):
        return HuggingFaceTokenizer(path)
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):
        empty = Path(path).is_file() and Path(path).stat().st_size == 0
        raise TokenizerError(
            f"tokenizer {path} is empty (0 bytes): copy it again from where it was trained"
            if empty
            else f"tokenizer {path} is not a SentencePiece model (truncated? a .model file whole; a Hugging Face "
            "tokenizer is its tokenizer.json)"
        ) from None


class HuggingFaceTokenizer:
    """tokenizer.json behind SentencePieceProcessor's encode, decode, get_piece_size, vocab_size, bos_id, eos_id."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                f"tokenizer {path} is a Hugging Face tokenizer.json, which needs the tokenizers library: "
                "pip install tokenizers (or loom[hf])"
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
            # A special token spelled out in a document is text, as SentencePiece's `</s>` is in loom's data: a
            # scraped "<|end_of_text|>" would otherwise end a document mid-way (AutoTokenizer's split_special_tokens)
            self._tokenizer.encode_special_tokens = True
        except Exception as error:  # noqa: BLE001 - the library raises plain Exception for a malformed file
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise TokenizerError(f"tokenizer {path} is not a Hugging Face tokenizer.json ({reason})") from None
        self._ids = max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._bos, self._eos = (self._special_id(Path(path), role) for role in ("bos_token", "eos_token"))

    def _special_id(self, path: Path, role: str) -> int:
        """The id of tokenizer_config.json's `role` token beside `path`; -1 (SentencePiece's "none") without one."""
        config_path = settings_of(path)
        try:
            token = json.loads(config_path.read_text()).get(role) if config_path.is_file() else None
        except (OSError, ValueError, AttributeError):
            raise TokenizerError(
                f"{config_path} (beside tokenizer {path}) is not a JSON object; fix it, or remove it (then the "
                "tokenizer has no bos or eos)"
            ) from None
        if isinstance(token, dict):  # transformers' AddedToken form
            token = token.get("content")
        if token is None:
            return -1
        token_id = self._tokenizer.token_to_id(str(token))
        if token_id is None:
            raise TokenizerError(
                f"{config_path}'s {role} {token!r} is not a token of {path}; give the tokenizer.json it belongs with"
            )
        return token_id

    def encode(self, texts: str | list[str], out_type: object = int, num_threads: int = 1):
        """Token ids of one text, or of each of several (as numpy int32 arrays with out_type="numpy"); the
        library encodes a batch on threads of its own."""
        if isinstance(texts, str):
            return self._tokenizer.encode(texts, add_special_tokens=False).ids
        if num_threads <= 1:  # encode_batch runs on every core: a build's workers would each take them all
            encoded = [self._tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        else:
            encoded = [item.ids for item in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
        if out_type == "numpy":
            return [np.asarray(ids, dtype=np.int32) for ids in encoded]
        return encoded

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=True
        )  # as SentencePiece decodes its control pieces: to nothing

    def get_piece_size(self) -> int:
        """One more than the largest id the tokenizer can produce, added (special) tokens included."""
        return self._ids

    def vocab_size(self) -> int:
        return self.get_piece_size()

    def bos_id(self) -> int:
        return self._bos

    def eos_id(self) -> int:
        return self._eos
