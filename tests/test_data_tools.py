"""The offline data path end to end: stdlib corpus -> tokenizer -> .bin/.idx, checked against SentencePiece."""

from __future__ import annotations

import base64
import gzip
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from loom.data_tools.build import bad_lines_path, build_indexed_dataset
from loom.data_tools.clean import clean_corpus
from loom.data_tools.corpus import build_stdlib_corpus, stdlib_root
from loom.data_tools.dedup import deduplicate
from loom.data_tools.jsonl import InputError, JsonlStats, iter_jsonl, write_jsonl_atomic
from loom.data_tools.tokenizer import decode_ids, train_tokenizer
from loom.engine.data.indexed import IndexedDataset


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A 30-document corpus, a 512-piece BPE tokenizer trained on it, and an empty and a 'bad' document."""
    root = tmp_path_factory.mktemp("pipeline")
    corpus = root / "corpus.jsonl"
    counts = build_stdlib_corpus(corpus, max_docs=30, progress=False)
    tokenizer = train_tokenizer([corpus], root / "tok", vocab_size=512, model_type="bpe")
    extra = root / "extra.jsonl.gz"
    with gzip.open(extra, "wb") as f:
        f.write(
            b'{"text": ""}\n{"text": "  indented\\n\\tline \\u00e9\\u4e2d 12345"}\nnot json\n'
            b'{"id": "no text"}\n{"text": 7}\n\xff\xfe bad bytes\n\n{"text": "\\ud800"}\n'
        )
    return {"root": root, "corpus": corpus, "counts": counts, "model": Path(tokenizer["model"]), "extra": extra}


def test_corpus_is_the_sorted_stdlib(pipeline):
    records = [json.loads(line) for line in pipeline["corpus"].read_text(encoding="utf-8").splitlines()]
    assert pipeline["counts"]["documents"] == len(records) == 30
    counts = pipeline["counts"]  # files read, not every file of the embedded corpus (it said ~1,800 for 30)
    assert counts["files"] == 30 + counts["undecodable"] and counts["files_available"] > 1000
    ids = [r["id"] for r in records]
    assert ids == sorted(ids) and all(i.startswith("stdlib/") for i in ids)
    assert {r["source"] for r in records} == {"python-stdlib"}
    assert not any("site-packages" in i or "__pycache__" in i for i in ids)
    for record in records[:5]:
        path = stdlib_root() / record["id"].removeprefix("stdlib/")
        assert record["text"] == path.read_bytes().decode("utf-8")
    assert not list(pipeline["root"].glob(".*.tmp"))


def test_tokenizer_keeps_code_exactly(pipeline):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(pipeline["model"]))
    assert processor.vocab_size() == 512
    assert (processor.unk_id(), processor.bos_id(), processor.eos_id(), processor.pad_id()) == (0, 1, 2, 3)
    text = "def f(x):\n        return x  # é 中 ☃\n\n\tpass 1234\n"
    assert processor.decode(processor.encode(text)) == text
    assert "1234" not in processor.encode(text, out_type=str)


def test_ids_beyond_the_tokenizer_are_one_line_not_sentencepieces_error(pipeline):
    """`data inspect/preview --tokenizer T` on a dataset built with a larger tokenizer: sentencepiece raised
    IndexError (a traceback); the ids are checked against T's vocabulary first."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(pipeline["model"]))
    assert decode_ids(processor, [100, 511], "tok.model") == processor.decode([100, 511])
    with pytest.raises(InputError, match="token id 512 is beyond tokenizer tok.model's 512 pieces"):
        decode_ids(processor, [100, 512], "tok.model")


@pytest.mark.parametrize("workers", [1, 2])
def test_built_tokens_equal_sentencepiece_plus_eod(pipeline, workers):
    prefix = pipeline["root"] / f"data_w{workers}"
    result = build_indexed_dataset(
        [pipeline["corpus"], pipeline["extra"]], pipeline["model"], prefix, workers=workers, progress=False
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(pipeline["model"]))
    texts = [json.loads(line)["text"] for line in pipeline["corpus"].read_text(encoding="utf-8").splitlines()]
    texts += ["  indented\n\tline \u00e9\u4e2d 12345"]  # the empty text before it is skipped and counted
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.uint16
    assert dataset.num_documents == len(dataset) == len(texts) == result["documents"]
    assert result["empty_documents"] == 1
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == processor.encode(text) + [processor.eos_id()], f"document {i}"
    assert result["tokens"] == dataset.num_tokens
    # "\xff\xfe bad bytes" decodes with the Windows-1252 fallback, then is not JSON.
    assert result["bad_lines"] == 5 and result["input"]["invalid_json"] == 2
    assert result["input"]["missing_text"] == 1 and result["input"]["text_not_a_string"] == 1
    assert result["input"]["invalid_utf8"] == 1 and result["input"]["blank_lines"] == 1


def test_workers_do_not_change_the_output_and_eod_is_optional(pipeline):
    root = pipeline["root"]
    build_indexed_dataset([pipeline["corpus"]], pipeline["model"], root / "one", workers=1, progress=False)
    build_indexed_dataset([pipeline["corpus"]], pipeline["model"], root / "two", workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (root / f"one{suffix}").read_bytes() == (root / f"two{suffix}").read_bytes()
    build_indexed_dataset([pipeline["extra"]], pipeline["model"], root / "plain", append_eod=False, progress=False)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(pipeline["model"]))
    plain = IndexedDataset(root / "plain")
    assert len(plain) == 1 and plain[0].tolist() == processor.encode("  indented\n\tline \u00e9\u4e2d 12345")


def test_jsonl_reader_counts_bad_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "a"}\n[1, 2]\n{"text": "b", "id": 3}\r\n{"body": "c"}\n\xc3\x28\n{"text": null}\n')
    stats = JsonlStats()
    records = list(iter_jsonl(path, stats=stats))
    assert [r["text"] for r in records] == ["a", "b"] and records[1]["id"] == 3
    counts = (stats.lines, stats.documents, stats.invalid_json, stats.not_an_object, stats.missing_text)
    assert counts == (6, 2, 1, 1, 1) and stats.text_not_a_string == 1 and stats.invalid_utf8 == 0
    assert [r["body"] for r in iter_jsonl(path, text_key="body")] == ["c"]
    # a file saved with a byte-order mark lost its first document as invalid JSON; one inside a line is kept
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "\xef\xbb\xbfb"}\n')
    assert [r["text"] for r in iter_jsonl(path)] == ["a", "\ufeffb"]


# Every kind of line a real corpus holds: (raw bytes, what it is). The last line has no newline.
MIXED_LINES = [
    (b'{"text": "The first good document, long enough to read."}', "document"),
    (b"not json", "invalid_json"),
    (b"[1, 2]", "not_an_object"),
    (b'{"id": "no text"}', "missing_text"),
    (b'{"text": 7}', "text_not_a_string"),
    (b"", "blank"),
    (b'{"id": "latin", "text": "caf\xe9 au lait, served in a cup, every morning"}', "document"),
    (b"\xff\xfe{ not UTF-8 and not JSON", "invalid_json"),
    (b'{"text": "lone \\ud800 surrogate"}', "invalid_utf8"),
    (b" \t ", "blank"),
    (b'{"text": "The second good document, also long enough."}', "document"),
]


def write_mixed_lines(path: Path) -> Path:
    path.write_bytes(b"\n".join(line for line, _ in MIXED_LINES))
    return path


def check_bad_lines(path: Path, source: Path) -> None:
    """bad_lines.jsonl holds exactly the bad lines, in order, with their numbers, reasons and bytes."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    expected = [(n, kind) for n, (_, kind) in enumerate(MIXED_LINES, 1) if kind not in ("document", "blank")]
    assert [(r["line"], r["reason"]) for r in records] == expected
    for record in records:
        raw = record["raw"].encode() if "raw" in record else base64.b64decode(record["raw_base64"])
        assert record["file"] == str(source) and record["detail"]
        assert raw == MIXED_LINES[record["line"] - 1][0]


def count_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0


def test_every_command_keeps_each_bad_line_and_accounts_for_every_input_line(pipeline, tmp_path, capfd):
    source = write_mixed_lines(tmp_path / "mixed.jsonl")
    documents, blank = (sum(kind == k for _, kind in MIXED_LINES) for k in ("document", "blank"))
    bad = len(MIXED_LINES) - documents - blank

    cleaned = clean_corpus([source], tmp_path / "clean", progress=False)
    rejected = sum(count_lines(p) for p in (tmp_path / "clean/rejected").glob("*.jsonl") if p.name != "bad_lines.jsonl")
    assert (cleaned["lines"], cleaned["documents"], cleaned["bad_lines"]) == (len(MIXED_LINES), documents, bad)
    assert count_lines(tmp_path / "clean/kept.jsonl") + rejected == cleaned["documents"]
    assert cleaned["documents"] + cleaned["bad_lines"] + cleaned["blank_lines"] == len(MIXED_LINES)
    assert cleaned["repaired_utf8"] == 1
    check_bad_lines(tmp_path / "clean/rejected/bad_lines.jsonl", source)

    deduped = deduplicate([source], tmp_path / "dedup", progress=False)
    kept = [json.loads(line) for line in (tmp_path / "dedup/kept.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(kept) == documents and deduped["input"]["lines"] == len(MIXED_LINES)
    assert deduped["input"]["bad_lines"] == bad and deduped["input"]["blank_lines"] == blank
    assert [r for r in kept if r.get("id") == "latin"][0]["text"].startswith("café au lait")
    check_bad_lines(tmp_path / "dedup/rejected/bad_lines.jsonl", source)

    prefix = tmp_path / "built"
    built = build_indexed_dataset([source], pipeline["model"], prefix, progress=False)
    assert IndexedDataset(prefix).num_documents == built["documents"] == documents
    assert built["input"]["lines"] == documents + built["bad_lines"] + built["input"]["blank_lines"] == len(MIXED_LINES)
    assert built["bad_lines_file"] == str(bad_lines_path(prefix)) == str(tmp_path / "built.rejected/bad_lines.jsonl")
    check_bad_lines(bad_lines_path(prefix), source)
    manifest = json.loads((tmp_path / "built.manifest.json").read_text())
    assert manifest["counts"]["bad_lines"] == bad

    build_indexed_dataset([pipeline["corpus"]], pipeline["model"], prefix, progress=False)
    assert not bad_lines_path(prefix).exists()  # a clean input leaves no stale bad lines behind
    # --overwrite moves an earlier build's bad lines aside with its dataset (it deleted them)
    from training_runs import loom_here

    build_indexed_dataset([source], pipeline["model"], prefix, progress=False)
    again = ["data", "build", "--input", str(pipeline["corpus"]), "--tokenizer", str(pipeline["model"])]
    assert loom_here(capfd, *again, "--output-prefix", str(prefix), "--overwrite").returncode == 0
    (moved,) = (tmp_path / "replaced").glob("*/built.rejected/bad_lines.jsonl")
    check_bad_lines(moved, source)
    assert not bad_lines_path(prefix).exists()


def test_jsonl_round_trip_and_atomic_write(tmp_path):
    records = [{"id": i, "text": f"doc {i} é"} for i in range(5)]
    for name in ("out.jsonl", "out.jsonl.gz"):
        assert write_jsonl_atomic(tmp_path / name, records) == 5
        assert list(iter_jsonl(tmp_path / name)) == records

    def failing():
        yield records[0]
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(tmp_path / "partial.jsonl", failing())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.gz"]


def test_zstd_input_and_output(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl.zst"
    zstandard = pytest.importorskip("zstandard")  # loom[zstd]; in loom[dev]
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "z"}\n{"text": "y"}\n'))
    assert [r["text"] for r in iter_jsonl(path)] == ["z", "y"]
    assert write_jsonl_atomic(tmp_path / "out.jsonl.zst", iter_jsonl(path)) == 2
    assert [r["text"] for r in iter_jsonl(tmp_path / "out.jsonl.zst")] == ["z", "y"]
    monkeypatch.setitem(sys.modules, "zstandard", None)  # not installed: what to do, reading and writing
    with pytest.raises(InputError, match=r"in.jsonl.zst is zstd-compressed; reading it needs .* 'loom\[zstd\]'"):
        list(iter_jsonl(path))
    with pytest.raises(InputError, match=r"writing .*new.jsonl.zst zstd-compressed needs .*, or name it .jsonl.gz"):
        write_jsonl_atomic(tmp_path / "new.jsonl.zst", [{"text": "x"}])
    assert not (tmp_path / "new.jsonl.zst").exists()


def test_missing_inputs_and_empty_results_are_one_line_errors(pipeline, tmp_path):
    with pytest.raises(FileNotFoundError, match="input .*nope.jsonl does not exist"):
        build_indexed_dataset([tmp_path / "nope.jsonl"], pipeline["model"], tmp_path / "x", progress=False)
    with pytest.raises(FileNotFoundError, match="tokenizer .* does not exist; train one"):
        build_indexed_dataset([pipeline["corpus"]], tmp_path / "no.model", tmp_path / "x", progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"body": 1}\n')
    with pytest.raises(InputError, match="no documents with a string 'text' field"):
        build_indexed_dataset([empty], pipeline["model"], tmp_path / "x", progress=False)
    with pytest.raises(InputError, match="no documents with a string 'text' field"):
        train_tokenizer([empty], tmp_path / "tok", vocab_size=300)
    with pytest.raises(InputError, match=r"'meta.body' field \(a top-level key: nested fields are not read\)"):
        build_indexed_dataset([empty], pipeline["model"], tmp_path / "x", text_key="meta.body", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]
    # the same file twice (once by another spelling) trained or tokenized its documents twice
    twice = [pipeline["corpus"], Path(pipeline["corpus"]).parent / ".." / Path(pipeline["corpus"]).parent.name]
    twice[1] = twice[1] / Path(pipeline["corpus"]).name
    with pytest.raises(InputError, match=r"input .* and .* is given twice \(its documents would be read twice\)"):
        build_indexed_dataset(twice, pipeline["model"], tmp_path / "x", progress=False)
    with pytest.raises(InputError, match=r"is given twice"):
        train_tokenizer([empty, empty], tmp_path / "tok", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_a_vocabulary_too_small_and_a_step_without_type_say_what_to_change(pipeline, tmp_path):
    """SentencePiece's own message named its --character_coverage option, which loom has not; a [[step]] without
    `type` was "step type None is unknown"."""
    from loom.data_tools.pipeline import build_step

    with pytest.raises(
        InputError,
        match=r"--vocab-size 10 is smaller than the \d+ pieces the text's characters and the special pieces need",
    ):
        train_tokenizer([pipeline["corpus"]], tmp_path / "t", vocab_size=10, progress=False)
    with pytest.raises(InputError, match=r"a pipeline step has no type \(its keys: min_chars\)"):
        build_step({"min_chars": 5})
    with pytest.raises(InputError, match=r"step 'length': min_chars = -5 must be >= 0"):
        build_step({"type": "length", "min_chars": -5})


@pytest.mark.parametrize(
    "tokens, message",
    [
        (["<s>"], "that is the tokenizer's own <s> piece (id 1)"),  # trained, and text "<s>" encoded as bos
        (["a b"], "holds whitespace, where text is split: it would never match"),  # trained, never matched
        (["x", "x"], "gives x more than once"),  # was SentencePiece's INTERNAL error
    ],
)
def test_special_tokens_sentencepiece_would_get_wrong_are_refused(pipeline, tmp_path, tokens, message):
    with pytest.raises(InputError, match=re.escape(message)):
        train_tokenizer([pipeline["corpus"]], tmp_path / "t", vocab_size=300, user_defined_symbols=tokens)
    assert not any(tmp_path.iterdir())
