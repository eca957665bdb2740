"""A training step reads the device once: the loss, the gradient norm and the agreed stop code travel together
(a GPU waits for the host at every read; Megatron-style engines keep it to one per step). Counted on CPU by
wrapping every Tensor method that hands a value to Python."""

import traceback

import pytest
import torch
from dist_utils import run_ranks
from training_runs import tiny_config

from loom.engine.train import Trainer

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class Stop:
    code = 0


def _reads_per_step(rank, world, dataset, run_dir, parallel, optim, precision):
    train = {"precision": precision, "steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32}
    config = tiny_config(dataset, run_dir, parallel=parallel, optim=optim, train=train)
    trainer = Trainer(config)
    stop = Stop()
    trainer.train_step(stop)  # the first step may set things up
    counts = {}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            # torch's non-fused optimizers keep their step counters on the host by design and read them there
            # (on CUDA loom runs the fused AdamW, whose counters stay on the device): not a device read.
            if "torch/optim/" not in traceback.extract_stack(limit=2)[0].filename:
                counts[name] = counts.get(name, 0) + 1
            return originals[name](self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        trainer.train_step(stop)
        trainer.train_step(stop)
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        trainer.close()
    return counts


@pytest.mark.parametrize(
    "parallel, optim, precision",
    [
        ({"tp": 2}, {}, "fp16"),
        ({"pp": 2, "vp": 2}, {}, "bf16"),
        ({"dp": 2}, {"zero1": True}, "fp32"),
        ({"tp": 2}, {"name": "adafactor"}, "fp32"),  # loom's own optimizers, whose reads the filter below counts
        ({"tp": 2}, {"name": "lamb"}, "fp32"),  # its trust ratios were read per parameter (a branch on the norms)
    ],
    ids=["tp2-fp16", "pp2-vp2-bf16", "dp2-zero1", "tp2-adafactor", "tp2-lamb"],
)
def test_one_device_read_per_step(parallel, optim, precision, markov_dataset, tmp_path):
    results = run_ranks(_reads_per_step, 2, markov_dataset(50), str(tmp_path), parallel, optim, precision)
    for rank, counts in enumerate(results):
        assert counts == {"tolist": 2}, f"rank {rank}: {counts} in two steps"
