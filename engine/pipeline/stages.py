"""Cutting the model into pipeline chunks: P x V virtual stages of equal numbers of layers.

Virtual stage s = c*P + r is chunk c of pipeline rank r. The first stage holds the embedding,
the last the final norm, output layer and loss. With tied embeddings and P > 1, the last stage
holds a copy of the embedding (initialised from the same name, so identical) whose gradient is
summed with the first stage's over the embedding group (engine/optim/model_parallel_grads.py).
"""

from __future__ import annotations

from loom.engine.config import LoomConfig
from loom.engine.model.gpt import GPTModel
from loom.engine.model.kernels import Kernels
from loom.engine.model.lora import add_adapters
from loom.engine.parallel.random import RNGStreams
from loom.engine.parallel.state import ParallelState


def stage_layers(num_layers: int, pp: int, vp: int, stage: int) -> range:
    per_stage = num_layers // (pp * vp)
    return range(stage * per_stage, (stage + 1) * per_stage)


def build_chunks(
    config: LoomConfig, state: ParallelState, streams: RNGStreams | None, kernels: Kernels | None = None
) -> list[GPTModel]:
    """This rank's model chunks, in chunk order, built with `kernels` (None: the native reference path)."""
    pp, vp = state.pp_size, state.vp_size
    chunks = []
    for chunk in range(vp):
        stage = chunk * pp + state.pp_rank
        chunks.append(
            GPTModel(
                config.model,
                state.tp_group,
                sequence_parallel=config.parallel.sequence_parallel,
                layer_ids=stage_layers(config.model.num_layers, pp, vp, stage),
                pre_process=stage == 0,
                post_process=stage == pp * vp - 1,
                streams=streams,
                kernels=kernels,
                cp_group=state.cp_group,
                ep_group=state.ep_group,
            )
        )
        if config.lora.enabled:
            add_adapters(chunks[-1], config.lora, streams)
    return chunks
