"""GPTDataset, document splits and BlendedDataset against naive references written here."""

from __future__ import annotations

import numpy as np
import pytest

import loom.engine.data.blended as blended
import loom.engine.data.gpt_dataset as gpt_dataset
from loom.engine.data.blended import BlendedDataset, blend_indices
from loom.engine.data.gpt_dataset import GPTDataset, build_sample_indices, split_document_ranges
from loom.engine.data.indexed import DatasetError, IndexedDataset, IndexedDatasetWriter


def write_documents(prefix, documents) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def random_documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 25, size=count) * (rng.random(count) > 0.3)
    return [rng.integers(0, 1000, size=n) for n in lengths]


def reference_samples(documents, document_ids, num_samples, seq_length, seed) -> list[np.ndarray]:
    """Each epoch on its own: shuffle the documents, concatenate, cut (tokens - 1) // seq_length windows of
    seq_length + 1 tokens overlapping by one, serve them in a shuffled order; the epoch's draws come from
    RandomState(seed) for epoch 0 and RandomState([seed, epoch]) after it (GPTDataset's documented protocol)."""
    served: list[np.ndarray] = []
    for epoch in range(num_samples):
        rng = np.random.RandomState(seed if epoch == 0 else [seed, epoch])
        stream = np.concatenate([documents[d] for d in rng.permutation(np.asarray(document_ids))])
        count = (len(stream) - 1) // seq_length
        windows = [stream[k * seq_length : k * seq_length + seq_length + 1] for k in range(count)]
        served += [windows[k] for k in rng.permutation(count)]
        if len(served) >= num_samples:
            return served[:num_samples]
    raise AssertionError("unreachable: every epoch yields at least one sample")


@pytest.mark.parametrize(
    "seed, count, seq_length, num_samples",
    [(0, 30, 8, 40), (1, 5, 50, 12), (2, 60, 1, 200), (3, 1, 4, 9), (4, 40, 16, 3)],
)
def test_samples_equal_the_naive_reference(tmp_path, seed, count, seq_length, num_samples):
    documents = random_documents(seed, count)
    documents[0] = np.arange(7)
    indexed = write_documents(tmp_path / "data", documents)
    ids = np.arange(count) if count < 10 else np.random.default_rng(seed).choice(count, count // 2, replace=False)
    ids = np.sort(np.append(ids, 0)) if 0 not in ids else ids
    dataset = GPTDataset(indexed, ids, num_samples, seq_length, seed=seed + 100)
    expected = reference_samples(documents, ids, num_samples, seq_length, seed + 100)
    assert len(dataset) == num_samples
    for i in range(num_samples):
        sample = dataset[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(sample, expected[i])
    with pytest.raises(IndexError):
        dataset[num_samples]


def test_every_epoch_is_a_permutation_of_the_documents_and_of_its_samples():
    lengths = np.array([3, 0, 5, 2, 7, 1], dtype=np.int32)
    ids = np.array([0, 1, 2, 4, 5])
    document_index, sample_index, shuffle_index = build_sample_indices(lengths, ids, 20, 4, seed=3)
    per_epoch = (16 - 1) // 4  # the 16 tokens of one epoch hold 3 samples of 5 tokens overlapping by one
    epochs = 7  # ceil(20 / 3): whole epochs are built
    assert document_index.shape == (epochs * len(ids),) and sample_index.shape == (epochs * (per_epoch + 1), 2)
    for epoch, documents in enumerate(document_index.reshape(epochs, len(ids))):
        assert sorted(documents.tolist()) == ids.tolist()
        rows = shuffle_index[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert sorted(rows.tolist()) == list(range(epoch * (per_epoch + 1), epoch * (per_epoch + 1) + per_epoch))


def test_the_order_never_depends_on_how_many_samples_are_asked_for():
    lengths = np.random.default_rng(0).integers(1, 30, size=40).astype(np.int32)
    ids = np.arange(40)
    short = build_sample_indices(lengths, ids, 5, 8, seed=7)
    long = build_sample_indices(lengths, ids, 500, 8, seed=7)
    for short_array, long_array in zip(short, long):
        np.testing.assert_array_equal(short_array, long_array[: len(short_array)])


def megatron_walk(lengths, document_index, num_samples, seq_length) -> np.ndarray:
    """Sample boundaries found by walking the documents token budget by token budget (megatron-core's way, written
    out: it checks the boundaries where megatron-core, the reference extra, is not installed)."""
    rows = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            available = int(lengths[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.parametrize("seed", range(20))
def test_sample_index_is_megatron_cores(seed):
    """Each epoch's sample boundaries equal megatron-core's own builder (datasets/helpers.build_sample_idx, its C++)
    where the reference extra is installed, and the walk written out above everywhere, on documents of random
    lengths, empty ones included, over several epochs."""
    try:
        from megatron.core.datasets import helpers
    except ImportError:
        helpers = None
    rng = np.random.default_rng(seed)
    lengths = (rng.integers(0, 40, size=50) * (rng.random(50) > 0.2)).astype(np.int32)
    ids = np.arange(50)
    seq_length = int(rng.integers(1, 60))
    num_samples = int(lengths.sum()) * 2 // seq_length
    document_index, sample_index, _ = build_sample_indices(lengths, ids, num_samples, seq_length, seed)
    per_epoch = (int(lengths.sum()) - 1) // seq_length
    epochs = len(document_index) // len(ids)
    assert epochs >= 2
    for epoch in range(epochs):
        documents = document_index[epoch * len(ids) : (epoch + 1) * len(ids)].astype(np.int32)
        rows = sample_index[epoch * (per_epoch + 1) : (epoch + 1) * (per_epoch + 1)] - (epoch * len(ids), 0)
        np.testing.assert_array_equal(rows, megatron_walk(lengths, documents, per_epoch, seq_length))
        if helpers is not None:
            theirs = helpers.build_sample_idx(lengths, documents, seq_length, 1, int(lengths.sum()), True, 1)
            np.testing.assert_array_equal(rows, theirs)


def test_index_cache_is_reused_and_keyed(tmp_path, monkeypatch, capsys):
    indexed = write_documents(tmp_path / "data", random_documents(5, 20))
    first = GPTDataset(indexed, np.arange(20), 30, 8, seed=1)
    assert first.built and first.cache_dir == tmp_path / "data_cache"
    epoch = first.epoch.samples  # whole epochs are built: a build that takes seconds is said, a load is not
    monkeypatch.setattr(gpt_dataset, "SLOW_BUILD_SAMPLES", epoch - 1)
    said = GPTDataset(indexed, np.arange(20), 1, 8, seed=2)
    assert capsys.readouterr().out == (
        f"building the sample index of {indexed.prefix} ({epoch:,} samples of 8 tokens) once; cached in "
        f"{said.cache_dir} (`loom data index` builds it ahead)\n"
    )
    assert all(path.parent == first.cache_dir for path in first.cache_paths.values())
    mtimes = {path: path.stat().st_mtime_ns for path in first.cache_paths.values()}

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cached indices should have been loaded")

    monkeypatch.setattr(gpt_dataset, "build_sample_indices", must_not_build)
    second = GPTDataset(indexed, np.arange(20), 30, 8, seed=1)
    assert not second.built and second.cache_paths == first.cache_paths
    assert {path: path.stat().st_mtime_ns for path in second.cache_paths.values()} == mtimes
    for i in range(30):
        np.testing.assert_array_equal(first[i], second[i])
    assert capsys.readouterr().out == ""
    monkeypatch.undo()
    # Whole epochs are cached: more samples within the same epochs reuse the cache, a further epoch does not.
    assert not GPTDataset(indexed, np.arange(20), 31, 8, seed=1).built
    for changed in ({"seed": 2}, {"num_samples": 30 * 40}, {"seq_length": 9}, {"document_ids": np.arange(19)}):
        arguments = {"document_ids": np.arange(20), "num_samples": 30, "seq_length": 8, "seed": 1, **changed}
        other = GPTDataset(indexed, **arguments)
        assert other.built and set(other.cache_paths.values()).isdisjoint(first.cache_paths.values())
    assert not list(first.cache_dir.glob("*.tmp"))


def test_a_full_disk_under_the_index_cache_is_said_and_leaves_no_part_of_it(tmp_path, monkeypatch):
    """np.save's short write on a full disk is an OSError without errno ("645624 requested and 263136 written"):
    it was reported as "(None); point data.cache_dir at a writable directory", beside the files already written."""
    indexed = write_documents(tmp_path / "data", random_documents(7, 20))
    saves = []

    def short_write(file, array):
        saves.append(array)
        if len(saves) == 2:  # the description and the first index are written, the second runs out of room
            raise OSError(f"{array.nbytes} requested and 8 written")
        np.lib.format.write_array(file, array)

    monkeypatch.setattr(gpt_dataset.np, "save", short_write)
    with pytest.raises(DatasetError, match=r"\(No space left on device\); free some space, or point data.cache_dir"):
        GPTDataset(indexed, np.arange(20), 30, 8, seed=1)
    assert list((tmp_path / "data_cache").iterdir()) == []


def test_non_builders_wait_for_the_builder_and_every_rank_hears_of_a_failure(tmp_path):
    indexed = write_documents(tmp_path / "data", random_documents(6, 10))
    cache = tmp_path / "shared_cache"
    heard = []

    def builder_finishes(failure):
        if not heard:
            GPTDataset(indexed, np.arange(10), 12, 4, seed=0, cache_dir=cache, is_builder=True)
        heard.append(failure)

    follower = GPTDataset(
        indexed, np.arange(10), 12, 4, seed=0, cache_dir=cache, is_builder=False, agree=builder_finishes
    )
    assert heard == [None, None] and not follower.built  # after the builder's turn, then after reading the cache

    heard.clear()
    with pytest.raises(
        DatasetError, match="missing after rank 0 built it: data.cache_dir must be on a filesystem every rank shares"
    ):
        GPTDataset(indexed, np.arange(10), 12, 4, seed=1, cache_dir=cache, is_builder=False, agree=heard.append)
    assert heard[0] is None and "missing after rank 0 built it" in str(heard[1])  # told to the other ranks first


def test_empty_split_and_tokenless_split_are_one_line_errors(tmp_path):
    indexed = write_documents(tmp_path / "data", [np.array([], np.int64), np.array([], np.int64), np.arange(5)])
    with pytest.raises(DatasetError, match="selects no documents") as raised:
        GPTDataset(indexed, np.array([], np.int64), 4, 2, seed=0)
    assert "\n" not in str(raised.value)
    with pytest.raises(DatasetError, match="hold no tokens"):
        GPTDataset(indexed, np.array([0, 1]), 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"document ids must lie in \[0, 3\)"):
        GPTDataset(indexed, np.array([0, 3]), 4, 2, seed=0)
    with pytest.raises(ValueError, match="num_samples >= 1"):
        GPTDataset(indexed, np.array([2]), 0, 2, seed=0)


@pytest.mark.parametrize(
    "count, split, expected",
    [
        (100, "98,1,1", [(0, 98), (98, 99), (99, 100)]),
        (1000, "99,1,0", [(0, 990), (990, 1000), (1000, 1000)]),
        (10, "1,1,1", [(0, 3), (3, 7), (7, 10)]),
        (7, "1", [(0, 7), (7, 7), (7, 7)]),
        (3, "0,1,1", [(0, 0), (0, 2), (2, 3)]),
        (0, "98,1,1", [(0, 0), (0, 0), (0, 0)]),
    ],
)
def test_split_document_ranges(count, split, expected):
    assert split_document_ranges(count, split) == expected


@pytest.mark.parametrize("count", [1, 2, 9, 101, 12345])
@pytest.mark.parametrize("split", ["98,1,1", "1,1,1", "3,0,2", "0.5,0.25"])
def test_split_ranges_tile_the_documents(count, split):
    ranges = split_document_ranges(count, split)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    weights = [float(w) for w in split.split(",")] + [0.0] * (3 - len(split.split(",")))
    for (start, end), weight in zip(ranges, weights):
        assert abs((end - start) - weight / sum(weights) * count) <= 1


@pytest.mark.parametrize("split", ["a,b", "-1,1,1", "0,0,0", "1,2,3,4", ""])
def test_bad_split_is_a_one_line_error(split):
    with pytest.raises(DatasetError, match="like '98,1,1'"):
        split_document_ranges(10, split)


def simple_blend(weights, size) -> tuple[list[int], list[int]]:
    """megatron-core's blending rule, one sample at a time."""
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    normalised = [float(w) / total for w in np.array(weights, dtype=np.float64)]
    drawn = [0] * len(weights)
    datasets, samples = [], []
    for i in range(size):
        errors = [w * max(float(i), 1.0) - drawn[d] for d, w in enumerate(normalised)]
        chosen = max(range(len(errors)), key=lambda d: (errors[d], -d))
        datasets.append(chosen)
        samples.append(drawn[chosen])
        drawn[chosen] += 1
    return datasets, samples


BLENDS = [
    [1.0],
    [0.3, 0.7],
    [1, 2, 3],
    [0.5, 0.25, 0.25],
    [3.7, 1.1, 0.01, 5.3],
    [1] * 6,
    list(np.random.default_rng(7).random(12)),
    [1e-4, 1.0, 0.5],
]


@pytest.mark.parametrize("weights", BLENDS)
@pytest.mark.parametrize("size", [0, 1, 2, 513, 8193, 30_000])
def test_blend_equals_the_simple_loop(weights, size):
    datasets, samples = blend_indices(weights, size)
    expected_datasets, expected_samples = simple_blend(weights, size)
    assert datasets.dtype == np.int16 and samples.dtype == np.int64
    assert datasets.tolist() == expected_datasets
    assert samples.tolist() == expected_samples


@pytest.mark.parametrize("passes, falls_back", [(0, True), (100, False)])
def test_blend_repairs_segments_that_start_from_a_wrong_guess(monkeypatch, passes, falls_back):
    calls = []
    original = blended._greedy_loop
    monkeypatch.setattr(blended, "_WARMUP", 0)
    monkeypatch.setattr(blended, "_MAX_PASSES", passes)
    monkeypatch.setattr(blended, "_PASS_FROM", 1)
    monkeypatch.setattr(blended, "_greedy_loop", lambda *a: calls.append(a) or original(*a))
    weights = [3.7, 1.1, 0.01, 5.3]
    datasets, samples = blend_indices(weights, 20_000)
    assert bool(calls) == falls_back
    assert (datasets.tolist(), samples.tolist()) == simple_blend(weights, 20_000)


def test_blend_in_small_segment_groups_equals_the_simple_loop(monkeypatch):
    # Groups of 5 segments (loom runs 16,384 at once) make group edges fall everywhere, and the estimate
    # without warm-up steps leaves wrong starts at many of them.
    monkeypatch.setattr(blended, "_ROWS", 5)
    monkeypatch.setattr(blended, "_WARMUP", 0)
    for weights in ([3.7, 1.1, 0.01, 5.3], [1, 1, 1]):
        datasets, samples = blend_indices(weights, 20_011)
        assert (datasets.tolist(), samples.tolist()) == simple_blend(weights, 20_011)


# Exact ties (equal weights, weights whose products round to the same double), a zero weight (which
# megatron-core still draws from on a tie at error 0), a tiny weight (drawn once in thousands of
# samples, the case that leaves runs of wrong segment estimates), many datasets (16: several groups of
# errors per call; 40: the sorted estimate; 300: two-byte picks) and token-count-like weights.
MEGATRON_BLENDS = [
    [0.5, 0.3, 0.15, 0.05],
    [1, 1, 1],
    [1, 1, 2, 4],
    [0, 1, 1],
    [1, 0, 1, 0],
    [1e-5, 0.3, 0.2, 0.1, 0.4, 0.05, 0.03],
    list(np.random.default_rng(3).random(40) ** 3),
    list(np.random.default_rng(4).random(16) + 0.2),
    list(np.random.default_rng(5).random(300)),
    list(np.random.default_rng(6).lognormal(0, 3, 16)),
]


def megatron_blend(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="megatron-core's C++ helpers")
    normalised = np.asarray(weights, dtype=np.float64) / np.sum(np.asarray(weights, dtype=np.float64))
    datasets, samples = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers_cpp.build_blending_indices(datasets, samples, normalised, len(weights), size, False)
    return datasets, samples


@pytest.mark.parametrize("weights", MEGATRON_BLENDS)
def test_blend_equals_megatron_cores_cpp_helper(weights):
    for size in (1, 2047, 2049, 200_003):
        datasets, samples = blend_indices(weights, size)
        expected_datasets, expected_samples = megatron_blend(weights, size)
        np.testing.assert_array_equal(datasets, expected_datasets, err_msg=f"{size} samples")
        np.testing.assert_array_equal(samples, expected_samples, err_msg=f"{size} samples")


def test_blend_with_a_zero_weight_equals_the_simple_loop():
    for weights in ([0, 1, 1], [1, 0, 1, 0]):
        datasets, samples = blend_indices(weights, 30_000)
        assert (datasets.tolist(), samples.tolist()) == simple_blend(weights, 30_000)
    # Sample 2 ties at error 0 between all three datasets, and the lowest index wins: the zero-weight one.
    assert blend_indices([0, 1, 1], 3)[0].tolist() == [1, 2, 0]


class Numbered:
    def __init__(self, name: str, size: int):
        self.name, self.size = name, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[str, int]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.name, i


def test_blended_dataset_serves_the_chosen_samples():
    blend = BlendedDataset([Numbered("a", 40), Numbered("b", 70)], [0.3, 0.7], 100)
    datasets, samples = simple_blend([0.3, 0.7], 100)
    assert len(blend) == 100
    assert [blend[i] for i in range(100)] == [("ab"[d], s) for d, s in zip(datasets, samples)]


@pytest.mark.parametrize(
    "weights, message",
    [
        ([1.0], "1 blending weights for 2 datasets"),
        ([1.0, -1.0], "positive"),
        ([1.0, 0.0], "positive"),
        ([1.0, float("nan")], "positive"),
    ],
)
def test_bad_blend_weights_are_one_line_errors(weights, message):
    with pytest.raises(DatasetError, match=message):
        BlendedDataset([Numbered("a", 10), Numbered("b", 10)], weights, 10)


def test_blend_larger_than_a_dataset_is_refused():
    with pytest.raises(DatasetError, match="draws 70 samples from dataset 1 but it has 10"):
        BlendedDataset([Numbered("a", 100), Numbered("b", 10)], [0.3, 0.7], 100)


def test_the_index_built_offline_is_what_training_finds_and_a_damaged_one_is_named(markov_dataset, tmp_path):
    """`loom data index` builds, in the preprocessing job, the caches rank 0 would build behind a barrier."""
    import subprocess
    import sys

    from training_runs import tiny_config

    from loom.engine.data.loader import build_datasets

    dataset = markov_dataset(60, seed=7)
    data = {"cache_dir": str(tmp_path / "cache"), "split": "90,10,0"}
    flags = ["--data.paths", dataset, "--data.tokenizer", "none", "--data.split", data["split"]]
    flags += ["--data.cache_dir", data["cache_dir"], "--train.eval_interval", "10"]
    flags += ["--train.steps", "30", "--train.run_dir", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", "data", "index", "--config", "tiny", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "2 sample indices (2 built, 0 found)" in result.stdout

    config = tiny_config(dataset, tmp_path / "run", data=data, train={"steps": 30, "eval_interval": 10})
    train, valid = build_datasets(config, True, is_builder=False, agree=None)  # a rank that never builds
    assert not train.built and not valid.built and len(train) == 30 * config.train.global_batch_size

    damaged, path = np.array(train.shuffle_index[:-1]), train.cache_paths["shuffle_index"]
    np.save(tmp_path / "damaged.npy", damaged)
    (tmp_path / "damaged.npy").replace(path)  # a new file: the old one stays mapped by `train` intact
    with pytest.raises(DatasetError, match="shuffle_index.npy holds .* entries where .* needs"):
        build_datasets(config, True, is_builder=False, agree=None)
