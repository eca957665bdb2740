"""The word cache behind `loom data build` gives exactly SentencePiece's tokens for BPE models on text built
to break it; models where word-by-word encoding could differ (unigram, SentencePiece's default normaliser)
are detected and not cached."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece

from loom.data_tools.tokenizer import train_tokenizer
from loom.data_tools.word_cache import WordCache, word_splittable

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
]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcdefghij  \n\t0123456789.,(){}_é中") + ["    ", "\n    ", "  \n"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(count)]


def loom_tokenizer(root: Path, model_type: str) -> sentencepiece.SentencePieceProcessor:
    corpus = root / f"{model_type}.jsonl"
    texts = TRICKY + random_texts(1, 300) + [Path(__file__).read_text(encoding="utf-8")]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    train_tokenizer([corpus], root / model_type, vocab_size=400, model_type=model_type)
    return sentencepiece.SentencePieceProcessor(model_file=str(root / f"{model_type}.model"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return loom_tokenizer(tmp_path_factory.mktemp("bpe"), "bpe")


def test_word_cache_equals_sentencepiece(model):
    assert word_splittable(model)
    texts = TRICKY + random_texts(2, 400)
    reference = model.encode(texts)
    for max_tokens in (1 << 25, 64):  # the second forces the cache to start over many times
        cache = WordCache(model, max_tokens=max_tokens)
        for start in range(0, len(texts), 37):
            batch = texts[start : start + 37]
            tokens, lengths = cache.encode(batch)
            assert lengths.tolist() == [len(ids) for ids in reference[start : start + 37]]
            assert tokens.tolist() == [i for ids in reference[start : start + 37] for i in ids]
    assert cache.encode([])[0].size == 0


def test_context_dependent_models_are_not_cached(tmp_path):
    unigram = loom_tokenizer(tmp_path, "unigram")
    assert not word_splittable(unigram)
    corpus = tmp_path / "lines.txt"
    corpus.write_text("\n".join(TRICKY + random_texts(3, 200)), encoding="utf-8")
    # SentencePiece's defaults: NFKC normalisation, a dummy prefix and whitespace folding.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "default"), vocab_size=200, minloglevel=2
    )
    default = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "default.model"))
    assert not word_splittable(default)


def test_bench_runs_small():
    done = subprocess.run(
        [sys.executable, str(REPO / "tools/bench/preprocess.py"), "--max-docs", "40", "--vocab-size", "600"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ratio loom / Megatron-style" in done.stdout and "M tokens/s" in done.stdout
