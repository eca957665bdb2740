"""`loom demo`'s data steps (1-5): the embedded corpus collected, cleaned, deduplicated, tokenized and built
into a .bin/.idx dataset in WORKDIR/data, as a user runs `loom data ...` on their own corpus.

Each step reuses its output from an earlier demo in the workdir unless a step before it ran again (which one
is the demo's to decide: launch/demo.py claims the workdir first).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from loom.engine.config import LoomConfig


def step(title: str) -> float:
    """Print a demo step's heading; its start time."""
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def prepare_data(data_dir: Path, max_docs: int | None, summary: dict) -> tuple[str, str]:
    """Steps 1-5 into `data_dir`, their counts into `summary`: (the dataset's prefix, the tokenizer model)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus, rebuilt = _corpus(data_dir / "corpus.jsonl", max_docs, summary)
    corpus, rebuilt = _clean(data_dir / "clean", corpus, rebuilt, summary)
    corpus, rebuilt = _dedup(data_dir, corpus, rebuilt, summary)
    return _tokens(data_dir, corpus, rebuilt, summary)


def _corpus(corpus: Path, max_docs: int | None, summary: dict) -> tuple[Path, bool]:
    from loom.data_tools.corpus import build_stdlib_corpus

    start = step("1/11 corpus: the Python standard library, one document per source file")
    rebuilt = not corpus.exists() or _corpus_max_docs(corpus) != max_docs  # a rerun's --max-docs was ignored
    if rebuilt:
        summary["corpus"] = build_stdlib_corpus(corpus, max_docs=max_docs)
    summary["corpus_mb"] = round(corpus.stat().st_size / 1e6, 1)
    made = summary.get("corpus")
    counted = (
        f"{made['documents']:,} documents of {made['files']:,} files ({made['undecodable']:,} not UTF-8, skipped), "
        if made
        else "reused, "
    )
    print(f"{corpus}: {counted}{summary['corpus_mb']} MB in {time.perf_counter() - start:.1f} s")
    return corpus, rebuilt


def _corpus_max_docs(corpus: Path) -> int | None | str:
    """The --max-docs an earlier demo built `corpus` with ("unknown" without its manifest)."""
    from loom.data_tools.manifest import manifest_path

    try:
        return json.loads(manifest_path(corpus, is_folder=False).read_text())["parameters"]["max_docs"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def _clean(cleaned: Path, corpus: Path, rebuilt: bool, summary: dict) -> tuple[Path, bool]:
    from loom.data_tools.clean import clean_corpus

    start = step(
        "2/11 clean: the `code` pipeline: ftfy repair, control characters (no NFC: it would change string "
        "literals), then code's file filters (the web pipeline's Gopher/C4/FineWeb rules reject source files); "
        "rejects kept with reasons"
    )
    if rebuilt or not (cleaned / "stats.json").exists():
        rebuilt = True
        shutil.rmtree(cleaned, ignore_errors=True)
        clean_corpus([corpus], cleaned, pipeline="code", workers=2)
    summary["clean"] = json.loads((cleaned / "stats.json").read_text())
    print(
        f"kept {summary['clean']['kept']:,}, rejected {summary['clean']['rejected']:,} "
        f"(reasons in {cleaned / 'rejected'}) in {time.perf_counter() - start:.1f} s"
    )
    return cleaned / "kept.jsonl", rebuilt


def _dedup(data_dir: Path, corpus: Path, rebuilt: bool, summary: dict) -> tuple[Path, bool]:
    from loom.data_tools.dedup import deduplicate

    start = step(
        "3/11 dedup: exact duplicates (normalised-text hash), then near duplicates (MinHash LSH, word 5-grams, "
        "Jaccard >= 0.8 checked exactly); each removed document names the one it duplicates"
    )
    for method, folder in (("exact", "dedup"), ("minhash", "near_dedup")):
        deduped = data_dir / folder
        if rebuilt or not (deduped / "stats.json").exists():
            rebuilt = True
            shutil.rmtree(deduped, ignore_errors=True)
            deduplicate([corpus], deduped, method=method)
        summary[folder] = json.loads((deduped / "stats.json").read_text())
        corpus = deduped / "kept.jsonl"
    near = summary["near_dedup"]
    print(
        f"exact: removed {summary['dedup']['removed']:,} in {summary['dedup']['clusters']:,} clusters; near: "
        f"{near['bands']} bands x {near['rows']} rows, {near['candidate_pairs']:,} candidate pairs, "
        f"{near['verified_pairs']:,} verified, removed {near['removed']:,}; kept {near['kept']:,} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return corpus, rebuilt


def _tokens(data_dir: Path, corpus: Path, rebuilt: bool, summary: dict) -> tuple[str, str]:
    from loom.data_tools.build import build_indexed_dataset
    from loom.data_tools.tokenizer import train_tokenizer
    from loom.engine.data.indexed import IndexedDataset

    tokenizer, prefix = data_dir / "tokenizer", data_dir / "stdlib_text_document"
    start = step("4/11 tokenizer: SentencePiece BPE, 4096 pieces, byte fallback")
    if rebuilt or not Path(f"{tokenizer}.model").exists():
        rebuilt = True
        train_tokenizer([corpus], tokenizer, vocab_size=4096, model_type="bpe", input_sentence_size=300_000)
    print(f"{tokenizer}.model in {time.perf_counter() - start:.1f} s")

    start = step("5/11 build: tokenize into a memory-mapped indexed dataset (Megatron .bin/.idx)")
    if rebuilt or not Path(f"{prefix}.idx").exists():
        build_indexed_dataset([corpus], f"{tokenizer}.model", prefix, workers=2, append_eod=True)
    dataset = IndexedDataset(prefix)
    summary["documents"], summary["tokens"] = len(dataset.document_indices) - 1, int(dataset.num_tokens)
    print(
        f"{prefix}.bin/.idx: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return str(prefix), f"{tokenizer}.model"


def preview_first_sample(config: LoomConfig, tokenizer_model: str) -> None:
    """What the model sees first: the first training sample, cut and ordered as training reads it."""
    import sentencepiece

    from loom.engine.data.loader import build_dataset

    sample = build_dataset(config, 0, 1, is_builder=True, agree=None)[0].tolist()
    text = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model).decode(sample)
    print(
        f"first training sample ({len(sample)} tokens; `loom data preview` shows more): "
        f"{sample[:12]} ... = {text[:160]!r}"
    )
