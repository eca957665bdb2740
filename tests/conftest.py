"""Fixtures shared by the test modules: the synthetic corpora the training tests read, and a count of the tensors
a tool holds at once."""

import os
import weakref
from collections.abc import Callable

# Compiled blocks on CPU stand in for the GPU's (graphs, graph breaks, what backward saves, numerics against
# eager): inductor's SIMD kernels add nothing to those checks, and scalar C++ compiles in about half the time
# with no probe programs to pick an instruction set (set before anything imports inductor's config).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest

from loom.tools.synthetic_data import write_markov_dataset


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    # Compiled blocks through inductor's decompositions and partitioner, the same graphs and saves, run by eager
    # kernels: inductor's C++ ones (not what a GPU runs) cost most of a CPU compile (engine/model/compiling.py).
    # The compiled loss and the norm and activation kernels still compile with inductor.
    os.environ.setdefault("LOOM_COMPILE_BACKEND", "aot_eager_decomp_partition")
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu runs these where there is one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With LOOM_FAILURES_FILE set (scripts/gpu_session.sh), each failure is written there as it happens: a lease's
    time limit ends pytest before its summary, which would have held them."""
    path = os.environ.get("LOOM_FAILURES_FILE")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as failures:
            failures.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def markov_dataset(tmp_path_factory) -> Callable[..., str]:
    """markov_dataset(num_documents, vocab_size=4096, seed=0) gives the .bin/.idx prefix of that synthetic
    corpus. Each corpus is written once per session and shared: tests only read it (the index cache that
    training writes beside it is keyed by what it indexes)."""
    written: dict[tuple[int, int, int], str] = {}

    def corpus(num_documents: int, vocab_size: int = 4096, seed: int = 0) -> str:
        key = (num_documents, vocab_size, seed)
        if key not in written:
            folder = tmp_path_factory.mktemp(f"markov-{num_documents}-{vocab_size}-{seed}")
            written[key] = write_markov_dataset(
                folder / "markov", vocab_size=vocab_size, num_documents=num_documents, seed=seed
            )
        return written[key]

    return corpus


@pytest.fixture(scope="session")
def dataset(markov_dataset) -> str:
    """The corpus a training test reads unless its module overrides `dataset` with another size."""
    return markov_dataset(300)


class LiveTensors:
    """How many of the tensors a method returned are alive at once, at most: what a streaming tool holds."""

    def __init__(self):
        self.alive = self.most = self.made = 0

    def watch(self, cls: type, method: str, monkeypatch) -> None:
        original = getattr(cls, method)

        def counted(*args, **kwargs):
            tensor = original(*args, **kwargs)
            self.alive, self.made = self.alive + 1, self.made + 1
            self.most = max(self.most, self.alive)
            weakref.finalize(tensor, self._dropped)
            return tensor

        monkeypatch.setattr(cls, method, counted)

    def _dropped(self) -> None:
        self.alive -= 1


@pytest.fixture
def live_tensors(monkeypatch) -> Callable[[type, str], LiveTensors]:
    """live_tensors(cls, method): counts, from then on, the tensors cls.method returns that are alive at once."""

    def watch(cls: type, method: str) -> LiveTensors:
        counter = LiveTensors()
        counter.watch(cls, method, monkeypatch)
        return counter

    return watch
