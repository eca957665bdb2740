"""loom's training samples against megatron-core's own GPTDataset on the same .bin/.idx.

Within one epoch the two must serve the same samples in the same order, for every split (same
seed, split string and sequence length). Past the first epoch loom shuffles each epoch on its own
(megatron-core reshuffles all epochs together), so only the first epoch is compared.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from loom.engine.config_io import load_config
from loom.engine.data.loader import build_dataset

megatron_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core is not installed")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizerBase  # noqa: E402


class _IdsOnlyTokenizer(MegatronTokenizerBase):
    """megatron-core's config asks for a tokenizer; its GPTDataset reads only the vocabulary size and eod/pad."""

    def __init__(self) -> None:
        super().__init__(None, {})
        self.unique_identifiers = {"class": type(self).__name__}

    def tokenize(self, text):
        raise NotImplementedError

    def detokenize(self, ids):
        raise NotImplementedError

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError

    @property
    def vocab(self):
        return {}

    @property
    def inv_vocab(self):
        return {}

    @property
    def vocab_size(self):
        return 4096

    @property
    def eod(self):
        return 0

    @property
    def pad(self):
        return -1


def megatron_splits(prefix: str, seed: int, split: str, seq_length: int, sizes: list[int], cache) -> list:
    config = megatron_gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        tokenizer=_IdsOnlyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(cache),
    )
    return BlendedMegatronDatasetBuilder(megatron_gpt.GPTDataset, sizes, lambda: True, config).build()


def megatron_sample(dataset, i: int) -> np.ndarray:
    return dataset._query_document_sample_shuffle_indices(i)[0]


def loom_split(prefix: str, seed: int, split: str, seq_length: int, split_index: int, num_samples: int, cache):
    config = load_config(
        "tiny",
        {
            "data": {"paths": [prefix], "tokenizer": None, "split": split, "cache_dir": str(cache)},
            "train": {"seed": seed, "seq_length": seq_length},
        },
    )
    return build_dataset(config, split_index, num_samples, is_builder=True, agree=None)


@pytest.fixture(scope="module")
def corpus(markov_dataset):
    return markov_dataset(120)


@pytest.mark.parametrize(
    "seed, split, seq_length", [(1234, "98,1,1", 64), (7, "90,5,5", 33), (2**31 + 5, "80,10,10", 128)]
)
def test_every_split_serves_megatron_cores_samples_within_an_epoch(corpus, tmp_path, seed, split, seq_length):
    splits = megatron_splits(corpus, seed, split, seq_length, [1, 1, 1], tmp_path / "megatron")
    compared = []
    for split_index, reference in enumerate(splits):
        if reference is None:
            continue
        # megatron-core builds the whole first epoch whatever it is asked for; loom is asked for all of it.
        count = len(reference)
        ours = loom_split(corpus, seed, split, seq_length, split_index, count, tmp_path / "loom")
        if ours.epoch.passes > 1:  # fewer tokens than one sample: megatron-core grows epochs to fit the request
            assert split_index > 0, "the training split must be compared"
            continue
        compared.append(split_index)
        for i in range(count):
            np.testing.assert_array_equal(ours[i], megatron_sample(reference, i), err_msg=f"split {split_index} #{i}")
    # With 120 documents, "98,1,1" leaves one document to the valid and test splits: too short for a sample.
    assert compared == ([0] if split == "98,1,1" else [0, 1, 2]), compared


def test_a_two_epoch_run_begins_with_the_one_epoch_run(corpus, tmp_path):
    per_epoch = len(loom_split(corpus, 3, "100,0,0", 64, 0, 1, tmp_path).shuffle_index)
    one_epoch = loom_split(corpus, 3, "100,0,0", 64, 0, per_epoch, tmp_path)
    two_epochs = loom_split(corpus, 3, "100,0,0", 64, 0, 2 * per_epoch, tmp_path)
    assert (one_epoch.num_epochs, two_epochs.num_epochs) == (1, 2)
    first = [two_epochs[i].tolist() for i in range(per_epoch)]
    second = [two_epochs[i].tolist() for i in range(per_epoch, 2 * per_epoch)]
    assert first == [one_epoch[i].tolist() for i in range(per_epoch)]
    # The second epoch cuts its own shuffled stream: as many samples, different ones, in another order.
    assert len(second) == per_epoch and second != first


def test_loom_data_preview_prints_megatron_cores_first_samples(corpus, tmp_path):
    output = tmp_path / "preview.jsonl"
    command = [sys.executable, "-m", "loom.launch.cli", "data", "preview", "--data", corpus, "--seq-length", "33"]
    command += ["--samples", "12", "--split", "90,5,5", "--seed", "7", "--output", str(output)]
    command += ["--data.cache_dir", str(tmp_path / "cache")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n[") == 12 and done.stdout.splitlines()[1].startswith("[0] [")
    train = megatron_splits(corpus, 7, "90,5,5", 33, [12, 1, 1], tmp_path / "megatron")[0]
    previewed = [json.loads(line)["tokens"] for line in output.read_text().splitlines()]
    assert previewed == [megatron_sample(train, i).tolist() for i in range(12)]


def test_a_blend_of_two_datasets_serves_megatron_cores_samples(markov_dataset, tmp_path):
    """Two datasets blended 3:7 (train split of "90,5,5"): megatron-core's BlendedMegatronDatasetBuilder and loom's
    data.paths/data.weights give the same sample at every position of the first 400, each from the same dataset
    (the blend's own index is compared with megatron's C++ helper in test_gpt_dataset.py; this is the whole path:
    weights, each part's size and split, seed and sample numbering)."""
    weights, seq_length, seed, count = [0.3, 0.7], 48, 5, 400
    # copies for megatron-core: without a cache path it writes P/cache/ beside P.bin, where a folder P hides P
    originals = [markov_dataset(150, seed=11), markov_dataset(90, seed=12)]
    (tmp_path / "megatron").mkdir()
    prefixes = [str(tmp_path / "megatron" / name) for name in ("a", "b")]
    for source, prefix in zip(originals, prefixes):
        for suffix in (".bin", ".idx"):
            shutil.copy(source + suffix, prefix + suffix)
    config = megatron_gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split="90,5,5",
        tokenizer=_IdsOnlyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,  # its blend caches only under an initialised process group
    )
    reference = BlendedMegatronDatasetBuilder(megatron_gpt.GPTDataset, [count, 0, 0], lambda: True, config).build()[0]
    ours = build_dataset(_blend_config(originals, weights, seed, seq_length, tmp_path / "loom"), 0, count, True, None)
    assert len(ours) == len(reference) == count
    np.testing.assert_array_equal(ours.dataset_index, reference.dataset_index)
    for i in range(count):
        part, j = int(reference.dataset_index[i]), int(reference.dataset_sample_index[i])
        np.testing.assert_array_equal(ours[i], megatron_sample(reference.datasets[part], j), err_msg=f"#{i}")


def _blend_config(prefixes, weights, seed, seq_length, cache):
    return load_config(
        "tiny",
        {
            "data": {
                "paths": prefixes,
                "weights": weights,
                "tokenizer": None,
                "split": "90,5,5",
                "cache_dir": str(cache),
            },
            "train": {"seed": seed, "seq_length": seq_length},
        },
    )
