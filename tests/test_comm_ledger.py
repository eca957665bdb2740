"""train.comm_ledger records what a step sends, per group, op and dtype: checked against the traffic worked out
by hand from the config (the model's shapes, the micro-batch count, the ZeRO stage's collectives)."""

import torch.distributed as dist
from dist_utils import run_ranks
from training_runs import tiny_config

from loom.engine.comm_ledger import ledger_path, read_ledger
from loom.engine.train import Trainer

SEQ, MICRO, GLOBAL = 32, 2, 8
LAYOUTS = {
    "dp2-zero0": ({}, 0),
    "dp2-zero1": ({}, 1),
    "dp2-zero2": ({}, 2),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, 0),
    "pp2": ({"pp": 2}, 0),
}


def _ledgers(rank, world, dataset, run_dir):
    """{layout: (the ledger of step 2, gradient buffer elements, hidden size, layers)} on this rank."""
    result = {}
    for name, (parallel, zero) in LAYOUTS.items():
        train = {"precision": "bf16", "steps": 2, "global_batch_size": GLOBAL, "micro_batch_size": MICRO}
        config = tiny_config(
            dataset,
            f"{run_dir}/{name}",
            parallel=parallel,
            optim={"zero": zero},
            train={**train, "seq_length": SEQ, "comm_ledger": True},
        )
        trainer = Trainer(config)
        trainer.train_step()
        trainer.train_step()
        trainer.close()
        calls = {
            (c["group"], c["op"], c["dtype"]): (c["count"], c["bytes"])
            for c in read_ledger(config.train.run_dir, rank)[1]["calls"]
        }
        result[name] = calls, trainer.grads.total, config.model.hidden_size, config.model.num_layers
    # Trained again from step 1 (no checkpoint), after a layout of more ranks: its rows replace the old ones, as
    # metrics.jsonl's do (the ledger held steps 1-2 twice), and the ranks this layout lacks leave no file
    dist.barrier()
    if rank == 0:
        (ledger_path(config.train.run_dir, 5)).write_text('{"step": 1, "calls": []}\n')
    dist.barrier()
    again = Trainer(config)
    again.train_step()
    again.close()
    result["rerun"] = [row["step"] for row in read_ledger(config.train.run_dir, rank)]
    result["stale"] = ledger_path(config.train.run_dir, 5).exists()
    return result


def test_the_ledger_equals_the_traffic_worked_out_by_hand(markov_dataset, tmp_path):
    ranks = run_ranks(_ledgers, 2, markov_dataset(50), str(tmp_path))
    for rank, ledgers in enumerate(ranks):
        assert ledgers.pop("rerun") == [1] and not ledgers.pop("stale")
        for name, (calls, buffer, hidden, layers) in ledgers.items():
            microbatches = GLOBAL // MICRO // (2 if name.startswith("dp2") else 1)
            activation = SEQ * MICRO * hidden * 2  # one micro-batch's hidden states in bf16
            gradients, weights = 4 * buffer, 2 * buffer  # fp32 gradients, bf16 parameters
            if name == "dp2-zero0":
                assert calls[("dp", "all_reduce", "float32")][1] == gradients + 4  # + the loss sum
                assert ("dp", "all_gather", "bfloat16") not in calls
            if name == "dp2-zero1":
                assert calls[("dp", "reduce_scatter", "float32")][1] == gradients
                assert calls[("dp", "all_gather", "bfloat16")][1] == weights
            if name == "dp2-zero2":  # a reduce-scatter per micro-batch, accumulated in the shard
                assert calls[("dp", "reduce_scatter", "float32")][1] == microbatches * gradients
                assert calls[("dp", "all_gather", "bfloat16")][1] == weights
            if name == "tp2-sp":
                # per layer and micro-batch: gathers before attention and MLP, scatters after, and the same in
                # backward; plus the embedding's scatter and the output layer's gather (and their backward)
                per_step = microbatches * (4 * layers + 2)
                for op in ("all_gather", "reduce_scatter"):
                    assert calls[("tp", op, "bfloat16")] == (per_step, per_step * activation)
                assert not any(group == "dp" for group, _, _ in calls)
            if name == "pp2":  # activations forward from stage 0, their gradients back from stage 1
                for op in ("send", "recv"):
                    assert calls[("pp", op, "bfloat16")] == (microbatches, microbatches * activation), rank
                assert not any(dtype == "bfloat16" for group, _, dtype in calls if group != "pp")
