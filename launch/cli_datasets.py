"""`loom data build|merge|inspect|preview|index`: the indexed-dataset stages, thin wrappers over data_tools/build.py
and engine.data (the .bin/.idx format, the sample order training reads). The document stages are
launch/cli_data.py's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loom.engine.config import DataConfig, TrainConfig
from loom.engine.names_elsewhere import DATA_BUILD_NAMES
from loom.launch.arguments import (
    OLDER,
    dataset_prefix,
    existing_file,
    int_in,
    non_negative_int,
    output_file,
    output_prefix,
    seed,
)
from loom.launch.cli_data import (
    DEFAULT,
    WORKERS,
    add_jsonl_input,
    add_overwrite,
    add_text_key,
    claim_outputs,
    writing_outputs,
)

if TYPE_CHECKING:
    from loom.engine.config import LoomConfig
    from loom.engine.data.indexed import IndexedDataset

MAX_PREVIEW_SAMPLES = 100_000
"""More samples than anyone reads on a terminal; its index cache and output stay a few MB."""


def _build(args: argparse.Namespace) -> None:
    from loom.data_tools.build import bad_lines_path, build_indexed_dataset
    from loom.data_tools.manifest import manifest_path
    from loom.engine.data.indexed import index_paths

    # P.rejected/ too: --overwrite deleted the earlier build's bad lines where it moved the rest aside
    rejected = bad_lines_path(args.output_prefix).parent
    outputs = [*index_paths(args.output_prefix), rejected, manifest_path(args.output_prefix, False)]
    inputs = [*args.input, args.tokenizer]
    with writing_outputs(args, f"--output-prefix {args.output_prefix}", outputs, inputs):
        counts = build_indexed_dataset(
            args.input,
            args.tokenizer,
            args.output_prefix,
            workers=args.workers,
            text_key=args.text_key,
            append_eod=args.append_eod,
        )
    print(json.dumps(counts))


def _merge(args: argparse.Namespace) -> None:
    from loom.data_tools.jsonl import InputError
    from loom.data_tools.manifest import manifest_path
    from loom.engine.data.indexed import index_paths

    seen: dict[Path, str] = {}
    for prefix in args.inputs:
        key = index_paths(prefix)[0].resolve()  # the .bin itself: a symlinked copy is the same data
        if key in seen:
            earlier = seen[key]
            named = prefix if earlier == prefix else f"{earlier} and {prefix}"
            raise InputError(
                f"--inputs gives {named} twice (its documents would be in the merged dataset twice); give each "
                "once, and to train on one dataset more often, list it in data.paths with a larger data.weights"
            )
        seen[key] = prefix
    if index_paths(args.output_prefix)[0].resolve() in seen:
        raise InputError(f"--output-prefix {args.output_prefix} is one of the inputs; merge into a new prefix")
    inputs = [str(path) for prefix in args.inputs for path in index_paths(prefix)]
    outputs = [*index_paths(args.output_prefix), manifest_path(args.output_prefix, is_folder=False)]
    with writing_outputs(args, f"--output-prefix {args.output_prefix}", outputs, inputs):
        documents, tokens = _write_merge(args, inputs)
    inputs_said = f"{len(args.inputs)} dataset{'s' if len(args.inputs) > 1 else ''}"
    print(f"merged {inputs_said} into {args.output_prefix}: {documents:,} documents, {tokens:,} tokens")


def _write_merge(args: argparse.Namespace, inputs: list[str]) -> tuple[int, int]:
    """Check the inputs agree (tokenizer, end-of-document ids), write the merged .bin/.idx and its manifest;
    the merged dataset's documents and tokens."""
    import time

    from tqdm import tqdm

    from loom.data_tools.failures import reported_failures
    from loom.data_tools.jsonl import InputError
    from loom.data_tools.manifest import (
        built_with_eod,
        built_with_tokenizer,
        check_same_tokenizer,
        common_end_of_document,
        remove_dataset,
    )
    from loom.data_tools.progress import Elapsed
    from loom.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, index_paths

    tokenizer = check_same_tokenizer(args.inputs)
    unrecorded = [prefix for prefix in args.inputs if built_with_tokenizer(prefix) is None]
    if unrecorded and len(unrecorded) < len(args.inputs):
        print(
            f"warning: {', '.join(unrecorded)} record(s) no tokenizer (no manifest: built by Megatron-LM, or copied "
            "without it), so the merge cannot check they share the other inputs' tokenizer, and records none; "
            "training with --data.tokenizer still checks their token ids fit it",
            file=sys.stderr,
        )
    ends = {prefix: built_with_eod(prefix) for prefix in args.inputs}
    if True in ends.values() and False in ends.values():
        without = [prefix for prefix, value in ends.items() if value is False]
        raise InputError(
            f"{', '.join(without)} was built with --no-append-eod and the other inputs with --append-eod: merged, "
            "some documents would run into the next with no end-of-document id between; rebuild them alike"
        )
    append_eod = next(iter(ends.values())) if len(set(ends.values())) == 1 else None
    eod_id = common_end_of_document(args.inputs)
    started = time.time()
    first = IndexedDataset(args.inputs[0])
    needed = sum(path.stat().st_size for prefix in args.inputs for path in index_paths(prefix) if path.is_file())
    bins = sum(index_paths(prefix)[0].stat().st_size for prefix in args.inputs)
    copying = tqdm(total=bins, desc="merge: copying", unit="B", unit_scale=True, file=sys.stderr, mininterval=1.0)
    with reported_failures(index_paths(args.output_prefix)[0], needed):
        with copying, IndexedDatasetWriter(args.output_prefix, first.dtype) as writer:
            for prefix in args.inputs:
                writer.add_index(prefix, copying.update)
        try:  # the manifest last, as build writes it: a merge without one would look finished
            merged = IndexedDataset(args.output_prefix)
            with Elapsed("merge: sha256 of the inputs' indexes and the output, for its manifest"):
                _write_merge_manifest(args, inputs, tokenizer, append_eod, eod_id, merged, started)
        except BaseException:
            remove_dataset(args.output_prefix)
            raise
    return len(merged.document_indices) - 1, int(merged.num_tokens)


def _write_merge_manifest(
    args: argparse.Namespace,
    inputs: list[str],
    tokenizer: tuple[str, str] | None,
    append_eod: bool | None,
    eod_id: int | None,
    merged: IndexedDataset,
    started: float,
) -> None:
    from loom.data_tools.manifest import write_manifest
    from loom.engine.data.indexed import index_paths

    write_manifest(
        args.output_prefix,
        command="loom data merge",
        inputs=[path for path in inputs if path.endswith(".idx")],  # the .bin files are hashed in their manifests
        outputs=index_paths(args.output_prefix),
        parameters={
            "inputs": args.inputs,
            **(dict(zip(("tokenizer", "tokenizer_sha256"), tokenizer)) if tokenizer else {}),
            **({"append_eod": append_eod} if append_eod is not None else {}),
            **({"eod_id": eod_id} if eod_id is not None else {}),
        },
        counts={"documents": len(merged.document_indices) - 1, "tokens": int(merged.num_tokens)},
        started=started,
        is_folder=False,
    )


def _inspect(args: argparse.Namespace) -> None:
    import numpy as np

    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.data.indexed import IndexedDataset, default_cache_dir

    dataset = IndexedDataset(args.prefix)
    if args.tokenizer:
        check_same_tokenizer([args.prefix], args.tokenizer)
    lengths = dataset.sequence_lengths
    print(
        f"{args.prefix}: {len(dataset)} sequences, {len(dataset.document_indices) - 1} documents, "
        f"{dataset.num_tokens:,} tokens, dtype {np.dtype(dataset.dtype).name}"
    )
    if len(lengths):
        print(f"sequence length: mean {lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}")
    cache = default_cache_dir(args.prefix)
    if cache.is_dir():  # one set per seq_length, seed, split and epoch count, never removed by loom
        files = [entry for entry in cache.iterdir() if entry.is_file()]
        size = sum(entry.stat().st_size for entry in files)
        print(
            f"caches: {size / 1e6:,.1f} MB in {len(files)} files in {cache} (sample indices, token ids checked); "
            "safe to delete while no run builds them: training rebuilds what it needs"
        )
    processor = None
    if args.tokenizer:
        from loom.data_tools.tokenizer import decode_ids, load_tokenizer

        processor = load_tokenizer(args.tokenizer)
    for i in range(min(args.samples, len(dataset))):
        tokens = dataset[i][: args.max_tokens or None].tolist()
        shown = repr(decode_ids(processor, tokens, args.tokenizer)) if processor else str(tokens)
        print(f"[{i}] {shown}")


def _index(args: argparse.Namespace, overrides: list[str]) -> None:
    import copy

    from loom.engine.config_io import load_config

    config = load_config(args.config, overrides)
    p = config.parallel
    # what training would refuse, now (the fewest ranks its layout takes: dp a multiple of ep)
    copy.deepcopy(config).resolve_world(p.model_parallel_size * (p.dp or p.ep))
    print(build_sample_indices(config))


def build_sample_indices(config: LoomConfig) -> str:
    """Build (or find) the sample-index caches training with `config` reads; one line saying what was done."""
    import time

    from loom.engine.data.loader import build_datasets

    start = time.perf_counter()
    train, valid = build_datasets(config, True, is_builder=True, agree=None)
    parts = [p for dataset in (train, valid) if dataset is not None for p in getattr(dataset, "datasets", [dataset])]
    folders = sorted({str(p.cache_dir) for p in parts})
    built = sum(p.built for p in parts)
    return (
        f"{len(parts)} sample indices ({built} built, {len(parts) - built} found) for {config.train.steps} steps "
        f"x {config.train.global_batch_size} samples in {', '.join(folders)} "
        f"({time.perf_counter() - start:.1f} s); training with this config finds and checks them"
    )


def _preview(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.atomic import write_text_atomically
    from loom.engine.config_io import load_config, parse_overrides
    from loom.engine.data.loader import build_dataset

    sections = parse_overrides(overrides)
    data, train = sections.setdefault("data", {}), sections.setdefault("train", {})
    for section, key, value in (
        (data, "paths", args.data),
        (data, "split", args.split),
        (train, "seq_length", args.seq_length),
        (train, "seed", args.seed),
    ):
        if value is not None:
            section[key] = value
    config = load_config(args.config, sections)
    if not config.data.paths:
        raise FileNotFoundError("give --data.paths PREFIX (or a --config whose data.paths is set)")
    tokenizer_path = args.tokenizer or config.data.tokenizer
    processor = None
    if tokenizer_path:
        from loom.data_tools.tokenizer import decode_ids, load_tokenizer

        processor = load_tokenizer(tokenizer_path)
        check_same_tokenizer(config.data.paths, tokenizer_path)
    if args.output:
        from loom.engine.data.indexed import index_paths

        inputs = [str(path) for prefix in config.data.paths for path in index_paths(prefix)]
        claim_outputs(args.overwrite, f"--output {args.output}", [Path(args.output)], inputs)
    dataset = build_dataset(config, 0, args.samples, is_builder=True, agree=None)
    print(
        f"the first {args.samples} training samples of {', '.join(config.data.paths)} in the order training "
        f"reads them (seq_length {config.train.seq_length} + 1 label token, seed {config.train.seed}, "
        f"split {config.data.split})"
    )
    records = []
    for i in range(args.samples):
        tokens = dataset[i].tolist()
        record = {"sample": i, "tokens": tokens}
        if processor is not None:
            record["text"] = decode_ids(processor, tokens, tokenizer_path)
        records.append(record)
        shown = tokens if args.max_tokens == 0 else tokens[: args.max_tokens]
        more = "" if len(shown) == len(tokens) else f" ... ({len(tokens)} tokens)"
        print(f"[{i}] {shown}{more}")
        if "text" in record:
            print(f"    {record['text']!r}")
    if args.output:
        write_text_atomically(Path(args.output), "".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {args.output}")


EPILOG_PREVIEW = """\
The samples are cut and ordered exactly as `loom train` reads them (global order: the first
global batch is samples 0..global_batch_size-1), so this shows what the model will see.
  loom data preview --data.paths demo/data/stdlib_text_document --tokenizer demo/data/tokenizer.model --samples 4
  loom data preview --config configs/tiny.toml --samples 16 --output first16.jsonl
Other config fields (e.g. --data.weights, --data.cache_dir) can be overridden as --section.field value."""


def add_build(sub) -> None:
    p = sub.add_parser("build", help="tokenize JSONL into a memory-mapped P.bin + P.idx (Megatron format)")
    add_jsonl_input(p)
    p.add_argument(
        "--tokenizer",
        type=existing_file,
        required=True,
        help="SentencePiece .model (from `loom data tokenizer`), or a Hugging Face tokenizer.json (an imported "
        "model's)",
    )
    p.add_argument(
        "--output-prefix",
        type=output_prefix,
        required=True,
        help="writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json",
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=2,
        help="processes that encode; 1 encodes in this process with all of SentencePiece's threads" + DEFAULT,
    )
    add_text_key(p)
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the tokenizer's end-of-document id" + DEFAULT,
    )
    add_overwrite(p)
    p.set_defaults(handler=_build, names_elsewhere=DATA_BUILD_NAMES)


def add_merge(sub) -> None:
    p = sub.add_parser("merge", help="concatenate indexed datasets")
    p.add_argument(
        "--inputs", nargs="+", type=dataset_prefix, required=True, help="prefixes to merge, in order; all of one dtype"
    )
    p.add_argument(
        "--output-prefix",
        type=output_prefix,
        required=True,
        help="writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json",
    )
    add_overwrite(p)
    p.set_defaults(handler=_merge)


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="summary and decoded samples of an indexed dataset")
    p.add_argument("prefix", type=dataset_prefix, help="the dataset prefix P of P.bin/P.idx")
    p.add_argument(
        "--tokenizer",
        type=existing_file,
        help="SentencePiece .model or tokenizer.json to decode samples with (default: show token ids)",
    )
    p.add_argument(
        "--samples", type=int_in(0, MAX_PREVIEW_SAMPLES), default=3, help="sequences to show from the start" + DEFAULT
    )
    p.add_argument(
        "--max-tokens",
        type=non_negative_int,
        default=64,
        help="tokens shown per sequence (0: all, as in preview)" + DEFAULT,
    )
    p.set_defaults(handler=_inspect)


def add_preview(sub) -> None:
    p = sub.add_parser(
        "preview",
        help="the first training samples, in the order training reads them, as token ids and text",
        epilog=EPILOG_PREVIEW,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="training config to take data, split, seed and seq_length from (default: none)")
    p.add_argument(
        "--data.paths", "--data", dest="data", nargs="+", type=dataset_prefix, help=".bin/.idx prefix(es)" + OLDER
    )
    p.add_argument(
        "--train.seq_length",
        "--seq-length",
        dest="seq_length",
        type=int_in(1, 1 << 20),
        help=f"tokens per sample (default: the config's, {TrainConfig.seq_length} without one)" + OLDER,
    )
    p.add_argument(
        "--samples",
        type=int_in(1, MAX_PREVIEW_SAMPLES),
        default=8,
        help="how many samples to show" + DEFAULT,
    )
    p.add_argument(
        "--data.split",
        "--split",
        dest="split",
        help=f"train,valid,test weights (default {DataConfig.split}); the train part is shown" + OLDER,
    )
    p.add_argument("--train.seed", "--seed", dest="seed", type=seed, help=f"default {TrainConfig.seed}" + OLDER)
    p.add_argument(
        "--tokenizer",
        type=existing_file,
        help="SentencePiece .model or tokenizer.json to decode with (default: data.tokenizer)",
    )
    p.add_argument(
        "--max-tokens", type=non_negative_int, default=24, help="token ids printed per sample (0: all)" + DEFAULT
    )
    p.add_argument(
        "--output", type=output_file, help="also write every sample, in full, as JSONL (sample, tokens, text)"
    )
    add_overwrite(p)
    p.set_defaults(handler=_preview, takes_overrides=True)


def add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="build a training config's sample-index caches offline (in the preprocessing job)",
        description="Builds what rank 0 would build at start-up while the other ranks wait "
        "(under NCCL with parallel.timeout_minutes, which a large corpus can trip). Training with the same "
        "data, split, seed, seq_length and steps finds the caches and checks their shape.",
        epilog="Overrides as for loom train: --train.steps 1000 --data.cache_dir /shared/cache ...",
    )
    p.add_argument("--config", required=True, help="the training config (a TOML file or a preset name)")
    p.set_defaults(handler=_index, takes_overrides=True)
