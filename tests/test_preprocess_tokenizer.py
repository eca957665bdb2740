"""`loom data tokenizer` is reproducible (same inputs and seed: byte-identical model; the same
pieces whatever the thread count)
and measures itself on held-out documents: fertility and byte-fallback rate, recomputed here by hand."""

from __future__ import annotations

import json

import sentencepiece

from loom.data_tools.tokenizer import train_tokenizer


def write_corpus(path):
    rng_words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    docs = [
        " ".join(rng_words[(i * 7 + j * 3) % 10] + str(j % 4) for j in range(60))
        + "\n    return x\n"
        + "\n".join(f"line {i} {k} {rng_words[(i + k) % 10]}" for k in range(55))
        for i in range(40)
    ]
    docs[19] += "ünïcödé ☃ 中文"  # a held-out document (every 20th) with characters training never sees
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return docs


def test_same_inputs_give_the_same_model_bytes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    for name, threads in (("a", 2), ("b", 2), ("c", 1)):
        (tmp_path / name).mkdir()
        # input_sentence_size below the ~2,200 training lines: the sample is drawn, and must be the same each time.
        train_tokenizer(
            [corpus],
            tmp_path / name / "tok",
            vocab_size=300,
            num_threads=threads,
            seed=3,
            input_sentence_size=1000,
            held_out_every=20,
        )
    for suffix in (".model", ".vocab"):
        assert (tmp_path / f"a/tok{suffix}").read_bytes() == (tmp_path / f"b/tok{suffix}").read_bytes()
        # Nor do the bytes depend on the thread count (SentencePiece records it: a dataset built with one was
        # refused with the other, "their sha256 differ")
        assert (tmp_path / f"a/tok{suffix}").read_bytes() == (tmp_path / f"c/tok{suffix}").read_bytes()


def test_held_out_fertility_and_byte_fallback(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = write_corpus(corpus)
    result = train_tokenizer([corpus], tmp_path / "tok", vocab_size=300, held_out_every=20)
    held_out = [docs[19], docs[39]]
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tok.model"))
    encoded = [processor.encode(d, out_type=str) for d in held_out]
    tokens = sum(map(len, encoded))
    byte_pieces = sum(
        piece.startswith("<0x") and piece.endswith(">") and piece != "<0x0A>"  # newline: by design
        for pieces in encoded
        for piece in pieces
    )
    assert result["held_out_documents"] == 2 and result["documents"] == 40
    assert result["held_out_words"] == sum(len(d.split()) for d in held_out)
    assert abs(result["fertility"] - tokens / result["held_out_words"]) < 1e-4
    assert byte_pieces > 0 and abs(result["byte_fallback_rate"] - byte_pieces / tokens) < 1e-6
    manifest = json.loads((tmp_path / "tok.manifest.json").read_text())
    assert manifest["counts"]["fertility"] == result["fertility"]


def test_a_line_longer_than_sentencepiece_takes_is_cut_not_skipped(tmp_path):
    """SentencePiece's trainer skips a sentence over 64 KiB without a word: a one-line document of lorem words
    trained a vocabulary that had none of them (exit 0, `bad_lines: 0`)."""
    import random

    from loom.data_tools.tokenizer import MAX_SENTENCE_BYTES, _cut_at_spaces

    words = ["lorem", "ipsum", "dolor", "sit", "amet", "elit"]
    rng = random.Random(0)
    line = " ".join(rng.choice(words) for _ in range(30_000))  # ~170 KB
    pieces = list(_cut_at_spaces(line, MAX_SENTENCE_BYTES))
    assert "".join(pieces) == line and len(pieces) > 2
    assert all(len(p.encode()) <= MAX_SENTENCE_BYTES for p in pieces) and all(p[0] == " " for p in pieces[1:])
    wide = "☃" * (MAX_SENTENCE_BYTES // 2)  # no spaces, 3 bytes a character: cut anywhere, still within bytes
    assert all(len(p.encode()) <= MAX_SENTENCE_BYTES for p in _cut_at_spaces(wide, MAX_SENTENCE_BYTES))

    corpus = tmp_path / "long.jsonl"
    corpus.write_text(json.dumps({"text": line}) + "\n" + json.dumps({"text": "a small note on zebras"}) + "\n")
    result = train_tokenizer([corpus], tmp_path / "tok", vocab_size=300, held_out_every=0, progress=False)
    assert result["long_lines_cut"] == 1
    pieces = {p.lstrip("▁") for p in (tmp_path / "tok.vocab").read_text().split("\n") for p in [p.split("\t")[0]]}
    assert {"lorem", "ipsum", "dolor"} <= pieces
