"""The word cache behind `loom data build` gives exactly SentencePiece's tokens for BPE models on text built
to break it, under both of its word rules, with special tokens and with hash collisions forced; models where
word-by-word encoding could differ (unigram, SentencePiece's default normaliser, no byte fallback) are detected
and not cached."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from loom.data_tools import word_cache
from loom.data_tools.tokenizer import train_tokenizer
from loom.data_tools.word_cache import WordCache, WordSplit, word_split

REPO = Path(__file__).resolve().parents[1]
TRICKY = [
    "",
    " ",
    "\n",
    "\n\n\n",
    "   leading and trailing   ",
    "a  b   c    d\n    e\n\tf\t\tg",
    "def f(x):\n    return x  # é 中 ☃ 🙂\n\n\tpass 1234567 3.14159\n",
    "tab\tinside  words\t \t end \n",
    "\u00a0non-breaking\u00a0space \u2003em space\u3000ideographic",
    "unknown \U0001f9ec\U0001f9ec chars ∮∯∰",
    "x" * 3000,
    " ".join(["repeat"] * 200),
    "\r\nwindows\r\nlines\r\n",
    "‰‱ punctuation!!!???... ---",
    # SentencePiece reads a literal ▁ (U+2581) as a space.
    "x\u2581 y \u2581\u2581  z\u2581\n\u2581   return\u2581",
    "self.assertEqual(x_1.foo(), [0x1F, 'a\u2019s'])  # mixed runs: letters, digits, punctuation",
    'caf\u00e9.na\u00efve_\u00e9t\u00e9+=1 \u201cquoted\u201d "\u2019\u00e9x',
]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcdefghij  \n\t0123456789.,(){}_é中’\u2581") + ["    ", "\n    ", "  \n", "self.", "()"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(count)]


def loom_tokenizer(root: Path, model_type: str) -> sentencepiece.SentencePieceProcessor:
    corpus = root / f"{model_type}.jsonl"
    texts = TRICKY + random_texts(1, 300) + [Path(__file__).read_text(encoding="utf-8")]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    train_tokenizer([corpus], root / model_type, vocab_size=400, model_type=model_type)
    return sentencepiece.SentencePieceProcessor(model_file=str(root / f"{model_type}.model"))


def identity_bpe(lines: Path, prefix: Path, vocab_size: int, **options) -> sentencepiece.SentencePieceProcessor:
    """A BPE model trained by SentencePiece itself on a text file, text kept as it is (as loom's), with `options`."""
    sentencepiece.SentencePieceTrainer.train(
        input=str(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        byte_fallback=True,
        minloglevel=2,
        **options,
    )
    return sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return loom_tokenizer(tmp_path_factory.mktemp("bpe"), "bpe")


def assert_cache_equals_sentencepiece(
    model: sentencepiece.SentencePieceProcessor, texts: list[str], cache: WordCache, batch: int = 37
) -> None:
    reference = model.encode(texts)
    for start in range(0, len(texts), batch):
        tokens, lengths = cache.encode(texts[start : start + batch])
        assert lengths.tolist() == [len(ids) for ids in reference[start : start + batch]]
        assert tokens.tolist() == [i for ids in reference[start : start + batch] for i in ids]


def test_word_cache_equals_sentencepiece(model):
    assert word_split(model) == WordSplit(fine=True)  # loom's tokenizers take the fine rule
    texts = TRICKY + random_texts(2, 400)
    for max_tokens in (1 << 23, 64):  # the second forces the cache to start over many times
        cache = WordCache(model, max_tokens=max_tokens)
        assert_cache_equals_sentencepiece(model, texts, cache)
        assert cache.collisions == 0
    assert cache.encode([])[0].size == 0
    assert cache.encode(["", ""])[1].tolist() == [0, 0]


def test_long_texts_are_cut_at_word_boundaries(model, monkeypatch):
    """A batch's arrays take tens of bytes a character, so a long text is encoded in parts cut at boundaries (a
    newline, else a space after a non-space, else the part grows): the same tokens."""
    monkeypatch.setattr(word_cache, "_MAX_BATCH_POINTS", 40)
    texts = TRICKY + random_texts(9, 100) + ["x" * 200 + " " * 50 + "y" * 100, "a b" * 100, "\n" * 90]
    cache = WordCache(model)
    assert_cache_equals_sentencepiece(model, texts, cache, batch=5)
    # A part with no boundary (a minified file, say) goes to SentencePiece alone, outside the cache.
    words_before = len(cache.index)
    assert_cache_equals_sentencepiece(model, ["ab" * 500 + " tail"], cache, batch=1)
    assert len(cache.index) == words_before + 1  # " tail"
    assert list(word_cache._parts("ab cd\nef  gh", 4)) == ["ab", " cd", "\nef", "  gh"]


def test_the_coarse_rule_serves_a_model_with_pieces_across_character_runs(tmp_path):
    """Trained without split_by_unicode_script, a model has pieces such as "self." that the fine rule would cut:
    the cache cuts at spaces and newlines only, and still gives SentencePiece's tokens."""
    corpus = tmp_path / "lines.txt"
    corpus.write_text("\n".join(TRICKY + random_texts(4, 300)), encoding="utf-8")
    mixed = identity_bpe(corpus, tmp_path / "mixed", 400, split_by_unicode_script=False, split_by_number=False)
    assert word_split(mixed) == WordSplit(fine=False)
    assert_cache_equals_sentencepiece(mixed, TRICKY + random_texts(5, 300), WordCache(mixed))


def test_special_tokens_are_never_cut(tmp_path, monkeypatch):
    """A user-defined piece such as <|im_start|> is matched before any merge and spans letters and punctuation:
    a text that holds one is cut by the coarse rule only. SentencePiece looks for them after turning spaces into
    ▁, so "▁<|im_end|>" is in " <|im_end|>" (a helper's fuzzing found the cache missing that)."""
    corpus = tmp_path / "chat.jsonl"
    texts = TRICKY + random_texts(6, 200)
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    specials = ["<|im_start|>", "\u2581<|im_end|>", "\u2581x."]
    train_tokenizer([corpus], tmp_path / "chat", vocab_size=400, user_defined_symbols=specials)
    chat = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "chat.model"))
    split = word_split(chat)
    assert split.fine and all(split.special.fullmatch(token) for token in specials)
    rng = random.Random(7)
    parts = ["<|im_start|>", "<|im_end|>", "user", "\n", " ", ".", "x1", "<|im_", "end|>", "x.", "\u2581", "a"]
    chats = ["".join(rng.choice(parts) for _ in range(30)) for _ in range(200)]
    chats += ["x <|im_end|>", "a x.", "a  x.y", "\u2581x.", "x. <|im_start|>"]
    assert_cache_equals_sentencepiece(chat, chats + texts, WordCache(chat))
    assert_cache_equals_sentencepiece(chat, chats, WordCache(chat), batch=1)
    monkeypatch.setattr(word_cache, "_MAX_BATCH_POINTS", 25)  # long texts cut into parts near the specials
    assert_cache_equals_sentencepiece(chat, chats, WordCache(chat), batch=3)


def test_a_hash_collision_cannot_change_a_token(model, monkeypatch):
    """Words are compared character by character with the word their hash names; a batch holding two words of
    one hash is encoded whole, whether they meet in the batch or one is in the cache."""
    texts = TRICKY + random_texts(8, 200)
    monkeypatch.setattr(word_cache, "_HASH_POWERS", np.zeros_like(word_cache._HASH_POWERS))
    cache = WordCache(model)  # every word hashes to its length
    assert_cache_equals_sentencepiece(model, texts, cache)
    assert cache.collisions == len(range(0, len(texts), 37))
    # One word per batch: no collision inside a batch, only with the cached word of the same length.
    cache = WordCache(model)
    assert_cache_equals_sentencepiece(model, ["abc", "xyz", "abc", "12", "34", "12 "], cache, batch=1)
    assert cache.collisions == 2


def test_no_byte_fallback_is_not_cached(tmp_path):
    """Without byte fallback SentencePiece joins neighbouring unknown characters into one unknown token, across
    any word boundary ("é\nz" would get two): such a model is encoded whole."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello world\n  foo bar"] * 50))
    train_tokenizer([corpus], tmp_path / "m", vocab_size=40, byte_fallback=False, progress=False)
    model = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    assert model.encode("é\nz").count(model.unk_id()) == 1
    assert word_split(model) is None


def test_context_dependent_models_are_not_cached(tmp_path):
    unigram = loom_tokenizer(tmp_path, "unigram")
    assert word_split(unigram) is None
    corpus = tmp_path / "lines.txt"
    corpus.write_text("\n".join(TRICKY + random_texts(3, 200)), encoding="utf-8")
    # SentencePiece's defaults: NFKC normalisation, a dummy prefix and whitespace folding.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "default"), vocab_size=200, minloglevel=2
    )
    default = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "default.model"))
    assert word_split(default) is None
    # Pieces across spaces ("▁of▁the"): no word rule holds.
    across = identity_bpe(corpus, tmp_path / "across", 600, split_by_whitespace=False)
    assert any("\u2581" in piece[1:] for piece in map(across.id_to_piece, range(across.vocab_size())))
    assert word_split(across) is None


def run_bench_small(script: str) -> str:
    """A bench script's output on a small corpus and vocabulary."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools/bench" / script), "--max-docs", "40", "--vocab-size", "600"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_bench_runs_small():
    out = run_bench_small("preprocess.py")
    assert "ratio loom / Megatron-style" in out and "M tokens/s" in out


def test_tokenizer_bench_gives_sentencepieces_own_model():
    """tools/bench/tokenizer.py: loom's trainer (JSONL, held-out documents, sampled lines) ends in the model
    SentencePiece's own trainer makes from those lines in a text file."""
    out = run_bench_small("tokenizer.py")
    assert "same pieces: yes" in out and "overhead over the library's own time" in out
