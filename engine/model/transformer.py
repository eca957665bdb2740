"""One transformer block: norm -> attention -> residual, norm -> MLP -> residual (or, under model.norm_placement =
output, attention -> norm -> residual, MLP -> norm -> residual; under both, norm -> attention -> norm -> residual,
norm -> MLP -> norm -> residual).

Activations are [sequence, batch, hidden], split along the sequence across TP ranks when
sequence parallelism is on. Attention heads and MLP columns are split across TP ranks. This
module knows nothing about pipelines or optimizers.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.model.kernels import Kernels, layer_norm, rms_norm
from loom.engine.model.moe import MoEMLP
from loom.engine.model.rotary import apply_rotary
from loom.engine.parallel import mappings
from loom.engine.parallel.context import ring_attention
from loom.engine.parallel.random import RNGStreams, checkpointed, hidden_state_stream
from loom.engine.parallel.sharding import ShardSpec, make_parameter


class Norm(torch.nn.Module):
    """RMSNorm or LayerNorm with replicated parameters (partial grads under sequence parallel).

    `function(x, weight, bias, eps)` is the kernel (kernels.py: torch, torch.compile'd or apex)."""

    def __init__(
        self, config: ModelConfig, tp_size: int, sequence_parallel: bool, function=None, width: int | None = None
    ):
        """`width`: what is normalised (default hidden_size; a head's head_dim for model.qk_norm)."""
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.function = function or (rms_norm if config.norm == "rmsnorm" else layer_norm)
        shape = ShardSpec((width or config.hidden_size,))
        self.weight = make_parameter(shape, tp_size, ("ones",), tp_partial_grad=sequence_parallel)
        self.bias = (
            make_parameter(shape, tp_size, ("zeros",), tp_partial_grad=sequence_parallel)
            if config.norm == "layernorm"
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_compute_dtype(self.function(x, self.weight, self.bias, self.eps))


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in autocast's dtype where autocast is on. CUDA autocast runs norms in fp32 and returns fp32; what follows
    a norm is a GEMM in the compute dtype, often after a sequence-parallel all-gather that would otherwise move
    fp32."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class ProjectionNorm(torch.nn.Module):
    """RMSNorm over a whole query or key projection, all of its heads together, a weight per channel (OLMo 2's
    q_norm / k_norm; model.qk_norm_per_head = false). The weight is split across TP ranks with the heads; each
    rank's sum of squares is summed over the TP group, which every rank's output depends on, so its gradient is
    summed back (f then g: an all-reduce both ways)."""

    def __init__(self, config: ModelConfig, heads: int, tp_group):
        super().__init__()
        self.width, self.eps, self.tp_group = heads * config.head_dim, config.norm_eps, tp_group
        self.weight = make_parameter(ShardSpec((self.width,), dim=0), mappings.group_size(tp_group), ("ones",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2).float()  # [s, b, local heads x head_dim]
        squares = flat.square().sum(-1, keepdim=True)
        if mappings.group_size(self.tp_group) > 1:
            squares = mappings.copy_to_tensor_region(squares, self.tp_group)
            squares = mappings.reduce_from_tensor_region(squares, self.tp_group)
        out = flat * torch.rsqrt(squares / self.width + self.eps) * self.weight  # a 16-bit weight promoted, not copied
        return in_compute_dtype(out.to(x.dtype)).view_as(x)


def build_norm(config: ModelConfig, tp_size: int, sequence_parallel: bool, kernels: Kernels) -> torch.nn.Module:
    """The norm the kernels chose: TE's fused module, or loom's Norm around a norm function."""
    if kernels.uses_te_norm:
        return kernels.te_norm(config, sequence_parallel)
    return Norm(config, tp_size, sequence_parallel, kernels.norm_function(config.norm))


def window_mask(seq_length: int, window: int, device) -> torch.Tensor:
    """SDPA's boolean mask [s, s] of causal attention within a sliding window: query i attends to keys
    i - window + 1 .. i."""
    distance = torch.arange(seq_length, device=device)[:, None] - torch.arange(seq_length, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cap: float,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention with soft-capped scores, cap x tanh(q k^T x scale / cap), as Gemma 2 computes it: q [b, heads, s,
    d], k and v [b, kv heads, t, d] (each KV head serving heads / kv heads query heads), `mask` [s, t] True where a
    query attends (None: causal, the queries being the last s of the t positions); the scores in the compute dtype,
    their softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        s, t = q.shape[-2], k.shape[-2]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    probabilities = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        probabilities = F.dropout(probabilities, dropout)
    return torch.matmul(probabilities, v)


class Attention(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_group,
        sequence_parallel: bool,
        output_std: float,
        streams: RNGStreams | None,
        kernels: Kernels,
        cp_group=None,
        window: int | None = None,
    ):
        """`cp_group`: the ranks the sequence is split over (ring attention, engine/parallel/context.py); `window`:
        the sliding window (model.sliding_window) where this layer has one."""
        super().__init__()
        tp = mappings.group_size(tp_group)
        self.window = window
        self.cp_group = cp_group if mappings.group_size(cp_group) > 1 else None
        self.head_dim = config.head_dim
        self.local_heads = config.num_heads // tp
        self.local_kv_heads = config.num_kv_heads // tp
        # torch's cuDNN and memory-efficient kernels take no grouped-query heads (enable_gqa is flash's and math's
        # alone): for them each KV head is repeated for its query heads first, as transformers' eager attention does.
        grouped = self.local_kv_heads != self.local_heads
        self.repeat_kv = grouped and config.attention_backend in ("cudnn", "efficient")
        self.dropout, self.streams = config.dropout, streams
        self.selective_recompute = config.recompute == "selective"
        q_size, kv_size = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
        self.qkv = kernels.column_linear(
            config.hidden_size,
            (q_size, kv_size, kv_size),
            tp_group,
            bias=config.biased_qkv,
            init_std=config.init_std,
            sequence_parallel=sequence_parallel,
        )
        self.proj = kernels.row_linear(
            q_size,
            config.hidden_size,
            tp_group,
            bias=config.bias,
            init_std=output_std,
            sequence_parallel=sequence_parallel,
        )
        self.fused_attention = kernels.core_attention(config, tp_group, sequence_parallel)
        self.softmax_scale, self.softcap = config.softmax_scale, config.attention_softcap
        self.q_norm = self.k_norm = None
        if config.qk_norm and not config.qk_norm_per_head:
            self.q_norm = ProjectionNorm(config, config.num_heads, tp_group)
            self.k_norm = ProjectionNorm(config, config.num_kv_heads, tp_group)
        elif config.qk_norm:
            # Each TP rank normalises its own heads with the shared weights: their gradient is a sum over the TP
            # group, as a sequence-parallel norm's is over the sequence.
            function = kernels.norm_function(config.norm)
            self.q_norm = Norm(config, tp, tp > 1, function, width=config.head_dim)
            self.k_norm = Norm(config, tp, tp > 1, function, width=config.head_dim)

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask`: window_mask's, in a sliding-window layer."""
        s, b = q.shape[:2]
        if self.cp_group is not None:  # this rank's two chunks of the sequence, the rest around the ring
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = ring_attention(q, k, v, self.cp_group, self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        if self.fused_attention is not None:  # TE: takes and returns the [s, b, ...] layout directly
            return self.fused_attention(q, k, v)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        # CUDA's kernels that take a mask take no grouped-query heads (flash takes none): repeated as for them, on
        # every device so that a CPU run keeps what a GPU run keeps (the planner's bytes are measured on CPU)
        masked_sdpa = self.softcap is None and mask is not None
        if self.repeat_kv or (masked_sdpa and self.local_kv_heads != self.local_heads):
            k, v = (t.repeat_interleave(self.local_heads // self.local_kv_heads, dim=1) for t in (k, v))
        with self.streams.fork("tensor") if (dropout and self.streams) else contextlib.nullcontext():
            if self.softcap is not None:
                out = capped_attention(q, k, v, self.softmax_scale, self.softcap, mask, dropout)
            else:
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    is_causal=mask is None,
                    dropout_p=dropout,
                    enable_gqa=k.shape[1] != self.local_heads,
                    scale=self.softmax_scale,
                )
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        cache: LayerCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`mask`: window_mask's, in a sliding-window layer (decoding makes its own)."""
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        q_width, kv_width = self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = q.view(s, b, self.local_heads, self.head_dim)
        k = k.view(s, b, self.local_kv_heads, self.head_dim)
        v = v.view(s, b, self.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            return self.proj(self._cached_attention(q, k, v, cache))
        if self.selective_recompute and self.training:
            # Without dropout nothing random is replayed: a plain checkpoint, which torch.compile keeps in the
            # block's one graph (the replay's bookkeeping is a side effect that would break it in four).
            out = checkpointed(self.core_attention, self.streams if self.dropout else None, q, k, v, mask)
        else:
            out = self.core_attention(q, k, v, mask)
        return self.proj(out)

    def _cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """Decoding: the new positions attend to every cached one (within the window, in a sliding-window layer)
        and causally among themselves."""
        k, v = cache.append(k, v)
        s, b, total = q.shape[0], q.shape[1], k.shape[0]
        new_positions = torch.arange(total - s, total, device=q.device)
        distance = new_positions[:, None] - torch.arange(total, device=q.device)[None, :]
        mask = (distance >= 0) & (distance < (self.window or total))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.softcap is not None:
            out = capped_attention(q, k, v, self.softmax_scale, self.softcap, mask)
        else:
            grouped = self.local_kv_heads != self.local_heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)


class LayerCache:
    """One layer's keys and values of the positions decoded so far, [positions, batch, kv_heads, head_dim]."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys]), torch.cat([self.values, values])
        self.keys, self.values = keys, values
        return keys, values


class MLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, tp_group, sequence_parallel: bool, output_std: float, kernels: Kernels):
        super().__init__()
        self.gated = config.gated_mlp
        self.activation = kernels.activation_function(config.activation)
        ffn = config.ffn_hidden_size
        blocks = (ffn, ffn) if self.gated else (ffn,)
        self.fc1 = kernels.column_linear(
            config.hidden_size,
            blocks,
            tp_group,
            bias=config.bias,
            init_std=config.init_std,
            sequence_parallel=sequence_parallel,
        )
        self.fc2 = kernels.row_linear(
            ffn,
            config.hidden_size,
            tp_group,
            bias=config.bias,
            init_std=output_std,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated:
            h = self.activation(*h.chunk(2, dim=-1))
        else:
            h = self.activation(h)
        return self.fc2(h)


class TransformerBlock(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_group,
        sequence_parallel: bool,
        streams: RNGStreams | None,
        kernels: Kernels | None = None,
        cp_group=None,
        window: int | None = None,
        ep_group=None,
    ):
        """`window`: this layer's sliding window (ModelConfig.attention_window), None for full attention; `ep_group`:
        the ranks its experts are divided among (expert parallelism; None: none)."""
        super().__init__()
        kernels = kernels or Kernels.native()
        tp = mappings.group_size(tp_group)
        output_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.input_norm = build_norm(config, tp, sequence_parallel, kernels)
        self.attention = Attention(config, tp_group, sequence_parallel, output_std, streams, kernels, cp_group, window)
        if config.norm_placement == "both":  # Gemma's sandwich: these normalise what attention and the MLP return
            self.attention_output_norm = build_norm(config, tp, sequence_parallel, kernels)
        self.mlp_norm = build_norm(config, tp, sequence_parallel, kernels)
        if config.norm_placement == "both":
            self.mlp_output_norm = build_norm(config, tp, sequence_parallel, kernels)
        if config.moe:
            activation = kernels.activation_function(config.activation)
            self.mlp = MoEMLP(config, tp_group, sequence_parallel, output_std, activation, ep_group)
        else:
            self.mlp = MLP(config, tp_group, sequence_parallel, output_std, kernels)
        self.kernels, self.tp_group = kernels, tp_group
        self.dropout, self.streams = config.dropout, streams
        self.residual_stream = hidden_state_stream(sequence_parallel)
        self.residual_multiplier = config.residual_multiplier
        self.norm_placement = config.norm_placement

    @property
    def window(self) -> int | None:
        """This layer's sliding window (its attention's), None for full attention."""
        return self.attention.window

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        if not (self.dropout and self.training):
            return x
        with self.streams.fork(self.residual_stream):
            return F.dropout(x, self.dropout)

    def forward(
        self, x: torch.Tensor, rotary, cache: LayerCache | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask`: window_mask's, in a sliding-window layer."""
        # Per block (as Megatron does), so a recomputed block runs in the same FP8 region.
        with self.kernels.fp8_autocast(self.tp_group):
            if self.norm_placement == "output":
                attended = self.attention(in_compute_dtype(x), rotary, cache, mask)
                x = x + self._residual_dropout(self.input_norm(attended))
                return x + self._residual_dropout(self.mlp_norm(self.mlp(in_compute_dtype(x))))
            attended = self.attention(self.input_norm(x), rotary, cache, mask)
            if self.norm_placement == "both":
                x = x + self._residual_dropout(self.attention_output_norm(attended))
                return x + self._residual_dropout(self.mlp_output_norm(self.mlp(self.mlp_norm(x))))
            x = x + self._residual_dropout(attended)
            return x + self._residual_dropout(self.mlp(self.mlp_norm(x)))
