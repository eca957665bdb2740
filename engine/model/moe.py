"""A mixture-of-experts MLP (model.num_experts): a router picks model.moe_top_k experts for each token, each expert is
an MLP of model.activation's kind, and a token's output is its experts' outputs weighted by their router
probabilities (Mixtral; Shazeer et al. 2017, Fedus et al. 2021).

Tensor parallelism splits every expert as a dense MLP is split (Megatron's expert tensor parallelism without expert
parallelism): each TP rank holds its slice of every expert's FC1 columns and FC2 rows, sees every token (gathered
from the sequence shards under sequence parallelism) and routes them all identically, and adds its partial outputs
into one [tokens, hidden] sum that is reduced once, as a dense MLP's output is. Everything inside that region is a
partial sum on each rank, the router's gradient too: it is summed over the TP group (ParamInfo.tp_partial_grad),
and the load-balancing loss, the same on every rank, is back-propagated at 1 / tp of its weight on each
(aux_loss_gradient).

The experts' GEMMs are grouped: the token choices are sorted by expert and each expert multiplies its contiguous
rows (torch._grouped_mm, one kernel for all experts on a Hopper GPU, and static shapes, so a compiled block stays
one graph), with a GEMM per expert where that kernel cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.parallel import mappings
from loom.engine.parallel.sharding import ShardSpec, make_parameter


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[e-1]..ends[e] of `x` [n, in] times `weight[e]` [in, out] for each expert e: [n, out]. `ends` is
    int32, cumulative."""
    # _grouped_mm wants 16-byte-aligned rows, and bf16 on a GPU (Hopper or later) and in a compiled graph
    aligned = all(size * x.element_size() % 16 == 0 for size in (weight.shape[-2], weight.shape[-1]))
    if x.is_cuda:
        usable = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        usable = x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    if aligned and usable:
        return torch._grouped_mm(x, weight, offs=ends)
    starts = [0, *ends.tolist()]
    pieces = [x[starts[e] : starts[e + 1]] @ weight[e] for e in range(weight.shape[0])]
    return torch.cat(pieces)


def load_balancing_loss(probabilities: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, per sequence (DeepSeek's sequence-wise balance loss, Megatron's
    seq_aux_loss), as Megatron weighs it: num_experts / top_k x sum over experts of (its share of the sequence's
    token choices) x (its mean router probability over the sequence), 1 when every expert gets as many tokens and
    as much probability; the mean over the micro-batch's sequences. Per sequence, so that how a batch is cut into
    micro-batches does not change it. `probabilities` [s, b, experts] (fp32), `chosen` [s, b, top_k]."""
    s, b, top_k = chosen.shape
    choices = F.one_hot(chosen, num_experts).sum((0, 2)).to(probabilities.dtype)  # [b, experts], no gradient: counts
    per_sequence = num_experts / (s * top_k) * (choices * probabilities.mean(0)).sum(-1)
    return per_sequence.mean()


def aux_loss_gradient(coeff: float, share: float, loss_scale: float, tp: int) -> float:
    """The gradient a micro-batch's load-balancing losses (summed over its blocks) are back-propagated with: the
    training loss is the mean over the global batch's tokens, so each micro-batch's losses count by its `share`
    of them; x the fp16 loss scale as the rest of the loss; / tp since every TP rank computes the same loss and
    their gradients are summed (module docstring)."""
    return coeff * share * loss_scale / tp


class MoEMLP(torch.nn.Module):
    """The experts and their router, in place of a block's MLP. After a training forward, `aux_loss` holds the
    micro-batch's load-balancing loss (with its graph; None when model.moe_aux_loss_coeff is 0)."""

    def __init__(self, config: ModelConfig, tp_group, sequence_parallel: bool, output_std: float, activation):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_experts, self.top_k, self.norm_top_k = config.num_experts, config.moe_top_k, config.moe_norm_top_k
        self.uses_aux_loss = config.moe_aux_loss_coeff > 0
        self.gated, self.activation = config.gated_mlp, activation
        tp = mappings.group_size(tp_group)
        h, f, e = config.hidden_size, config.ffn_hidden_size, config.num_experts
        blocks = (f, f) if self.gated else (f,)
        self.router = torch.nn.Module()
        self.router.weight = make_parameter(ShardSpec((e, h)), tp, ("normal", config.init_std), tp_partial_grad=tp > 1)
        self.experts = torch.nn.Module()
        self.experts.fc1 = torch.nn.Module()
        self.experts.fc1.weight = make_parameter(
            ShardSpec((e, sum(blocks), h), 1, blocks), tp, ("normal", config.init_std)
        )
        self.experts.fc2 = torch.nn.Module()
        self.experts.fc2.weight = make_parameter(ShardSpec((e, h, f), 2), tp, ("normal", output_std))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_region(x, self.tp_group)
        tokens = x.reshape(-1, x.shape[-1])
        device = tokens.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype
        tokens = tokens.to(dtype)
        probabilities = F.linear(tokens, self.router.weight.to(dtype)).float().softmax(-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        self.aux_loss = None
        if self.training and self.uses_aux_loss:
            s, b = x.shape[:2]
            self.aux_loss = load_balancing_loss(probabilities.view(s, b, -1), chosen.view(s, b, -1), self.num_experts)
        # the token choices sorted by expert, each expert's rows contiguous
        order = chosen.flatten().argsort(stable=True)
        per_expert = F.one_hot(chosen.flatten(), self.num_experts).sum(0)
        ends = per_expert.cumsum(0).to(torch.int32)
        h = grouped_matmul(tokens[order // self.top_k], self.experts.fc1.weight.to(dtype).transpose(1, 2), ends)
        h = self.activation(*h.chunk(2, dim=-1)) if self.gated else self.activation(h)
        out = grouped_matmul(h, self.experts.fc2.weight.to(dtype).transpose(1, 2), ends)
        # back in token order, each token's k outputs summed by weight: no scatter-add (atomic, in no fixed order
        # on a GPU), and nothing of the sum kept for backward
        by_token = out[order.argsort()].view(-1, self.top_k, out.shape[-1])
        combined = (by_token * weights.to(dtype).unsqueeze(-1)).sum(1).view_as(x)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_region(combined, self.tp_group)
        return mappings.reduce_from_tensor_region(combined, self.tp_group)
