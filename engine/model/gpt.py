"""The decoder-only language model: embedding, a range of transformer blocks, head and loss.

A `GPTModel` is one pipeline chunk: it holds blocks `layer_ids` (global indices, so parameter
names do not depend on the layout), the embedding if it is the first chunk and the final norm,
output layer and loss if it is the last. With one chunk it is the whole model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.model import naming
from loom.engine.model.compiling import block_backend
from loom.engine.model.fp8 import Fp8OutputLayer
from loom.engine.model.kernels import Kernels
from loom.engine.model.rotary import rotary_tables, uses_local_rotary
from loom.engine.model.transformer import LayerCache, TransformerBlock, build_norm, window_mask
from loom.engine.parallel import mappings
from loom.engine.parallel.context import local_positions
from loom.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from loom.engine.parallel.layers import VocabParallelEmbedding
from loom.engine.parallel.param_info import param_info, update_param_info
from loom.engine.parallel.random import RNGStreams, checkpointed, hidden_state_stream
from loom.engine.parallel.sharding import ShardSpec, make_parameter
from loom.engine.parallel.vocab import padded_vocab_size


class DecodingCache:
    """Keys and values of every layer for the positions decoded so far (engine/model/transformer.LayerCache)."""

    def __init__(self) -> None:
        self.length = 0
        self._layers: dict[str, LayerCache] = {}

    def layer(self, index: str) -> LayerCache:
        return self._layers.setdefault(index, LayerCache())


class GPTModel(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_group,
        *,
        sequence_parallel: bool = False,
        layer_ids: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        streams: RNGStreams | None = None,
        kernels: Kernels | None = None,
        cp_group=None,
        ep_group=None,
    ):
        """`cp_group`: the ranks this chunk's sequence is split over (context parallelism; None: not split);
        `ep_group`: the ranks each expert block's experts are divided among (expert parallelism; None: none)."""
        super().__init__()
        self.config, self.tp_group, self.streams = config, tp_group, streams
        self.cp_group = cp_group
        self.param_gather = None
        """ZeRO-3 (engine/optim/param_shards.ShardedParameters): gathers each unit's weights around its forward."""
        kernels = kernels or Kernels.native()
        self.sequence_parallel = sequence_parallel and mappings.group_size(tp_group) > 1
        self.pre_process, self.post_process = pre_process, post_process
        tp = mappings.group_size(tp_group)
        self.padded_vocab = padded_vocab_size(config.vocab_size, config.make_vocab_divisible_by, tp)
        self.vocab_start = mappings.group_rank(tp_group) * (self.padded_vocab // tp)
        layer_ids = range(config.num_layers) if layer_ids is None else layer_ids
        self._rotary_cache: dict = {}

        if pre_process:
            self.embedding = VocabParallelEmbedding(
                config.vocab_size,
                self.padded_vocab,
                config.hidden_size,
                tp_group,
                init_std=config.init_std,
                sequence_parallel=self.sequence_parallel,
            )
            update_param_info(self.embedding.weight, tied_embedding=config.tie_embeddings)
            if config.position_embedding == "learned":
                self.position_embedding = make_parameter(
                    ShardSpec((config.max_position_embeddings, config.hidden_size)),
                    tp,
                    ("normal", config.init_std),
                    tp_partial_grad=self.sequence_parallel,
                )
        self.layers = torch.nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    config.layer_config(i),
                    tp_group,
                    self.sequence_parallel,
                    streams,
                    kernels,
                    cp_group,
                    config.attention_window(i),
                    ep_group,
                )
                for i in layer_ids
            }
        )
        self.compiled_loss = kernels is not None and kernels.compiles_blocks
        if self.compiled_loss:
            backend = block_backend()
            for block in self.layers.values():
                block.compile(backend=backend)  # one graph serves every block: parameters are graph inputs
        if post_process:
            self.final_norm = build_norm(config, tp, self.sequence_parallel, kernels)
            if not (config.tie_embeddings and pre_process):
                self.output_weight = make_parameter(
                    ShardSpec((config.vocab_size, config.hidden_size), 0, padded_size=self.padded_vocab),
                    tp,
                    ("normal", config.init_std),
                )
                if config.tie_embeddings:
                    # The last pipeline stage's copy of the tied embedding: same name (so same init), grads summed.
                    update_param_info(self.output_weight, tied_embedding=True, tied_copy=True)
            self.fp8_output = (
                Fp8OutputLayer(self.logits_weight) if kernels is not None and kernels.fp8_output_layer else None
            )
        self.name_parameters()

    def name_parameters(self) -> None:
        """Complete every parameter's ParamInfo with what its global name says (again after adapters are added)."""
        for module_name, param in self.named_parameters():
            name = naming.global_name(module_name, param_info(param).tied_copy)
            update_param_info(param, name=name, layer=naming.layer_index(name), no_decay=naming.no_decay(name))

    def _rotary(self, seq_length: int, device, local: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of the positions this rank holds: 0..seq_length-1, or under context parallelism its
        two chunks of a sequence cp times as long (`local`: a sliding-window layer's, rotary_tables)."""
        if self.config.position_embedding != "rope":
            return None
        key = (seq_length, str(device), local)
        if key not in self._rotary_cache:
            cp = mappings.group_size(self.cp_group)
            tables = rotary_tables(seq_length * cp, self.config, device, local=local)
            if cp > 1:
                index = local_positions(seq_length * cp, cp, mappings.group_rank(self.cp_group)).to(device)
                tables = tuple(table[index] for table in tables)
            self._rotary_cache[key] = tables
        return self._rotary_cache[key]

    def embed(self, tokens: torch.Tensor, first_position: int = 0) -> torch.Tensor:
        """Token ids [b, s] -> hidden [s/tp if sequence parallel else s, b, h]."""
        hidden = self.embedding(tokens)
        if self.config.embedding_multiplier != 1.0:  # in the embeddings' dtype, as Gemma's (and Google's) code
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        if self.config.position_embedding == "learned":
            s_local = hidden.shape[0]
            start = first_position + (mappings.group_rank(self.tp_group) * s_local if self.sequence_parallel else 0)
            hidden = hidden + self.position_embedding[start : start + s_local].unsqueeze(1)
        return hidden

    def logits_weight(self) -> torch.Tensor:
        """This rank's slice of the output weight: the tied embedding's on a stage that holds the embedding."""
        return self.embedding.weight if self.config.tie_embeddings and self.pre_process else self.output_weight

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden -> this rank's slice of the vocabulary logits [s, b, V/tp]."""
        weight = self.logits_weight()
        hidden = self.final_norm(hidden)
        if self.config.logits_divisor != 1.0:  # on the h-wide input rather than the V-wide logits: the same product
            hidden = hidden / self.config.logits_divisor
        if self.sequence_parallel:
            hidden = mappings.gather_from_sequence_region(hidden, self.tp_group)
        else:
            hidden = mappings.copy_to_tensor_region(hidden, self.tp_group)
        logits = F.linear(hidden, weight) if self.fp8_output is None else self.fp8_output(hidden, weight)
        cap = self.config.logits_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: DecodingCache, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [s, b, V/tp] of `tokens` [b, s] that follow the cache's positions; the cache grows by s.
        A later pipeline chunk takes the previous one's `hidden` instead and, unless it is the last, returns
        its own. Without sequence parallelism: generation, not training."""
        s = tokens.shape[1]
        start = cache.length
        if self.pre_process:
            hidden = self.embed(tokens, first_position=start)
        # the new positions' rows alone: a table per decoded length, kept, grew with the square of the text
        rope = self.config.position_embedding == "rope"
        tables = {}  # by uses_local_rotary: at most a sliding-window layers' and a full-attention layers'
        for index, block in self.layers.items():
            local = uses_local_rotary(self.config, block.window)
            if rope and local not in tables:
                tables[local] = rotary_tables(start + s, self.config, hidden.device, start, local)
            hidden = block(hidden, tables.get(local), cache.layer(index))
        cache.length += s
        return self.output_logits(hidden) if self.post_process else hidden

    def forward(
        self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """First chunk takes tokens [b, s], later ones the previous chunk's hidden.

        Returns the per-token loss [b, s] (fp32) when this is the last chunk and labels are
        given, the local vocabulary logits [s, b, V/tp] without labels, else the hidden states.
        """
        gather = self.param_gather
        outer = [u for u in (naming.BEFORE_BLOCKS, naming.AFTER_BLOCKS) if gather is not None and gather.has(u)]
        units = [int(index) for index in self.layers]
        for unit in outer:
            gather.before_forward(unit, prefetch=units[0] if units else None, input=hidden)
        output = self._forward_inside(tokens, labels, hidden, units)
        for unit in outer:
            gather.after_forward(unit, output, previous=units[-1] if units else None)
        return output

    def take_router_losses(self) -> dict[str, torch.Tensor]:
        """This chunk's router losses (model.num_experts: moe_aux_loss, moe_z_loss) of its last training forward,
        each summed over the blocks, which then let go of them; empty without any."""
        sums: dict[str, torch.Tensor] = {}
        for block in self.layers.values():
            for name, value in getattr(block.mlp, "router_losses", {}).items():
                sums[name] = sums[name] + value if name in sums else value
            block.mlp.router_losses = {}
        return sums

    def take_expert_loads(self) -> dict[str, torch.Tensor]:
        """Each biased MoE block's token choices per expert (int64) in its last training forward, by block name
        (`layers.3.mlp`), which it then lets go of (engine/model/moe.update_expert_biases)."""
        loads = {}
        for index, block in self.layers.items():
            if getattr(block.mlp, "expert_load", None) is not None:
                loads[f"layers.{index}.mlp"], block.mlp.expert_load = block.mlp.expert_load, None
        return loads

    def set_router_loss_weight(self, weight: float) -> None:
        """The gradient each block's router losses back-propagate with (engine/model/moe.router_loss_gradient)."""
        for block in self.layers.values():
            if hasattr(block.mlp, "router_loss_weight"):
                block.mlp.router_loss_weight.fill_(weight)

    def _embedding_dropout(self, hidden: torch.Tensor) -> torch.Tensor:
        # Megatron drops the embedding's output at --hidden-dropout, as GPT-2 does (embd_pdrop)
        if not (self.config.dropout and self.training and self.streams is not None):
            return hidden
        with self.streams.fork(hidden_state_stream(self.sequence_parallel)):
            return F.dropout(hidden, self.config.dropout)

    def _forward_inside(self, tokens, labels, hidden, units: list[int]) -> torch.Tensor:
        if self.pre_process:
            hidden = self._embedding_dropout(self.embed(tokens))
        seq_length = hidden.shape[0] * (mappings.group_size(self.tp_group) if self.sequence_parallel else 1)
        full_recompute = self.config.recompute == "full" and self.training
        gather = self.param_gather
        masks = {}  # one per window size, shared by its layers (so saved once for backward)
        for i, block in enumerate(self.layers.values()):
            if gather is not None:
                gather.before_forward(units[i], prefetch=units[i + 1] if i + 1 < len(units) else None, input=hidden)
            rotary = self._rotary(seq_length, hidden.device, uses_local_rotary(self.config, block.window))
            mask = None
            if block.window is not None and block.window < seq_length:  # a window as long as the text masks nothing
                if block.window not in masks:
                    masks[block.window] = window_mask(seq_length, block.window, hidden.device)
                mask = masks[block.window]
            if full_recompute:
                hidden = checkpointed(block, self.streams, hidden, rotary, None, mask)
            else:
                hidden = block(hidden, rotary, None, mask)
            if gather is not None:
                gather.after_forward(units[i], hidden, previous=units[i - 1] if i > 0 else None)
        if not self.post_process:
            return hidden
        logits = self.output_logits(hidden)
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), self.vocab_start, self.config.vocab_size, self.tp_group, compiled=self.compiled_loss
        )
        return loss.t()
