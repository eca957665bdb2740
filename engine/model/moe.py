"""A mixture-of-experts MLP (model.num_experts): a router picks model.moe_top_k experts for each token, each expert is
an MLP of model.activation's kind, and a token's output is its experts' outputs weighted by their router
probabilities (Mixtral; Shazeer et al. 2017, Fedus et al. 2021).

Tensor parallelism splits every expert as a dense MLP is split (Megatron's expert tensor parallelism without expert
parallelism): each TP rank holds its slice of every expert's FC1 columns and FC2 rows, sees every token (gathered
from the sequence shards under sequence parallelism) and routes them all identically, and adds its partial outputs
into one [tokens, hidden] sum that is reduced once, as a dense MLP's output is. Everything inside that region is a
partial sum on each rank, the router's gradient too (a shared expert's gate's as well): it is summed over the TP
group (ParamInfo.tp_partial_grad), and the router's losses (load balancing, z-loss), the same on every rank, are
back-propagated at 1 / tp of their weight on each (router_loss_gradient), through the block's output
(_RouterLossGradient).

Expert parallelism (parallel.ep) divides the experts among ep DP ranks (each TP rank still holding its slice of
its own): the token choices, sorted by expert, go to the ranks holding their experts and the outputs come back
through two all-to-alls (_experts_across_ranks), each rank computing its experts on every rank's rows for them.

Routing follows Megatron's router: softmax or sigmoid scores, DeepSeek-V3's biases per expert (which choose experts
but do not weigh them) and its group-limited choice (a token's experts from its best groups of experts), the GEMM
and scores in fp32 where model.moe_router_fp32 says (as GLM-4.5's and DeepSeek-V3's classes compute them).

The experts' GEMMs are grouped: the token choices are sorted by expert and each expert multiplies its contiguous
rows (torch._grouped_mm, one kernel for all experts on a Hopper GPU, and static shapes, so a compiled block stays
one graph), with a GEMM per expert where that kernel cannot run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.model import naming
from loom.engine.parallel import mappings
from loom.engine.parallel.sharding import ShardSpec, make_parameter

# torch._grouped_mm: before torch 2.9 it has no CPU kernel (or does not exist); its bf16 kernel takes fewer than
# 1024 groups, and runs on compute capability 9.0 (Hopper) alone: 10.0's gave experts without tokens non-zero weight
# gradients (pytorch#172439), older GPUs have none.
_GROUPED_MM = hasattr(torch, "_grouped_mm") and torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
_GROUPS_AT_MOST = 1023


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[e-1]..ends[e] of `x` [n, in] times `weight[e]` [in, out] for each expert e: [n, out]. `ends` is
    int32, cumulative."""
    if _grouped_mm_takes(x, weight):
        return torch._grouped_mm(x, weight, offs=ends)
    starts = [0, *ends.tolist()]
    pieces = [x[starts[e] : starts[e + 1]] @ weight[e] for e in range(weight.shape[0])]
    return torch.cat(pieces)


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes these operands: 16-byte-aligned rows (and, eagerly, addresses), bf16 on
    a GPU and in a compiled graph (its meta function's rule), a Hopper GPU (_GROUPED_MM's note)."""
    if not _GROUPED_MM or weight.shape[0] > _GROUPS_AT_MOST or x.shape[0] == 0:  # (no rows: expert parallelism's
        return False  # rank whose experts no token chose; untried by the kernel)
    if not all(size * x.element_size() % 16 == 0 for size in (weight.shape[-2], weight.shape[-1])):
        return False
    compiling = torch.compiler.is_compiling()
    if not compiling and (x.data_ptr() % 16 or weight.data_ptr() % 16):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9
    return x.dtype == torch.bfloat16 or not compiling


def _counts(indices: torch.Tensor, bins: int) -> torch.Tensor:
    """How often each of 0..bins-1 occurs in `indices` (int64), a static shape (bincount's depends on the values,
    which a compiled graph cannot take), without a one-hot tensor of every index x every bin."""
    flat = indices.flatten()
    return torch.zeros(bins, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probabilities: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, per sequence (DeepSeek's sequence-wise balance loss, Megatron's
    seq_aux_loss), as Megatron weighs it: num_experts / top_k x sum over experts of (its share of the sequence's
    token choices) x (its mean router probability over the sequence), 1 when every expert gets as many tokens and
    as much probability; the mean over the micro-batch's sequences. Per sequence, so that how a batch is cut into
    micro-batches does not change it. `probabilities` [s, b, experts] (fp32), `chosen` [s, b, top_k]."""
    s, b, top_k = chosen.shape
    sequence = torch.arange(b, device=chosen.device).view(1, b, 1)
    choices = _counts(sequence * num_experts + chosen, b * num_experts).view(b, num_experts)  # no gradient: counts
    choices = choices.to(probabilities.dtype)
    per_sequence = num_experts / (s * top_k) * (choices * probabilities.mean(0)).sum(-1)
    return per_sequence.mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022): the mean over tokens of logsumexp(logits)^2, `logits` [tokens,
    experts] in fp32; per token, so micro-batching does not change it."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class _RouterLossGradient(torch.autograd.Function):
    """Identity on a block's MLP output whose backward also gives the block's router losses (their weighted sum) a
    gradient, `weight` (router_loss_gradient's, filled in before each step): they train the router from whichever
    pipeline stage holds the block, recomputed or not, and nothing keeps them past the block's backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, router_loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad, weight.clone(), None


def router_loss_gradient(share: float, loss_scale: float, tp: int) -> float:
    """The gradient a micro-batch's router losses (each block's, weighted by its coefficients) are back-propagated
    with: the training loss is the mean over the global batch's tokens, so each micro-batch's losses count by its
    `share` of them; x the fp16 loss scale as the rest of the loss; / tp since every TP rank computes the same loss
    and their gradients are summed (module docstring)."""
    return share * loss_scale / tp


class MoEMLP(torch.nn.Module):
    """The experts and their router, in place of a block's MLP. After a training forward, `router_losses` holds the
    micro-batch's load-balancing loss and z-loss by metric name (their values, for the metrics; those whose
    coefficient is not 0); the gradient of their weighted sum is `router_loss_weight`, which the pipeline executor
    fills in before each step."""

    def __init__(
        self, config: ModelConfig, tp_group, sequence_parallel: bool, output_std: float, activation, ep_group=None
    ):
        """`ep_group`: the ranks this block's experts are divided among (parallel.ep; None: this rank holds all)."""
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.ep_group, self.ep_size = ep_group, mappings.group_size(ep_group)
        self.num_experts, self.top_k, self.norm_top_k = config.num_experts, config.moe_top_k, config.moe_norm_top_k
        self.aux_loss_coeff, self.z_loss_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.score, self.scale = config.moe_router_score, config.moe_router_scale
        self.groups, self.group_top_k = config.moe_router_groups, config.moe_router_group_top_k
        self.router_fp32 = config.moe_router_fp32
        self.gated, self.activation = config.gated_mlp, activation
        tp = mappings.group_size(tp_group)
        h, f, e = config.hidden_size, config.ffn_hidden_size, config.num_experts
        blocks = (f, f) if self.gated else (f,)
        self.router = torch.nn.Module()
        self.router.weight = make_parameter(ShardSpec((e, h)), tp, ("normal", config.init_std), tp_partial_grad=tp > 1)
        self.has_expert_bias = config.moe_expert_bias
        if self.has_expert_bias:  # model state, not trained by the optimizer: saved with checkpoints by name
            self.router.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        self.expert_load: torch.Tensor | None = None
        held = None
        if self.ep_size > 1:
            # eager under torch.compile: how many rows each rank receives is known only once counted (no static
            # shape); wrapped here, not by a decorator, since that imports torch._dynamo into every process (~1 s)
            self._dispatched = torch.compiler.disable(self._experts_across_ranks)
            local = e // self.ep_size
            held = (mappings.group_rank(ep_group) * local, (mappings.group_rank(ep_group) + 1) * local)
        self.experts = torch.nn.Module()
        self.experts.fc1 = torch.nn.Module()
        self.experts.fc1.weight = make_parameter(
            ShardSpec((e, sum(blocks), h), 1, blocks), tp, ("normal", config.init_std), expert_range=held
        )
        self.experts.fc2 = torch.nn.Module()
        self.experts.fc2.weight = make_parameter(ShardSpec((e, h, f), 2), tp, ("normal", output_std), expert_range=held)
        self.shared_expert = self.shared_expert_gate = None
        if config.moe_shared_ffn_hidden_size is not None:  # split over TP as a dense MLP; its partial sum joins theirs
            width = config.moe_shared_ffn_hidden_size
            shared_blocks = (width, width) if self.gated else (width,)
            self.shared_expert = torch.nn.Module()
            self.shared_expert.fc1 = torch.nn.Module()
            self.shared_expert.fc1.weight = make_parameter(
                ShardSpec((sum(shared_blocks), h), 0, shared_blocks), tp, ("normal", config.init_std)
            )
            self.shared_expert.fc2 = torch.nn.Module()
            self.shared_expert.fc2.weight = make_parameter(ShardSpec((h, width), 1), tp, ("normal", output_std))
        if config.moe_shared_expert_gate:  # scales each rank's partial sum: its gradient is partial too
            self.shared_expert_gate = torch.nn.Module()
            self.shared_expert_gate.weight = make_parameter(
                ShardSpec((1, h)), tp, ("normal", config.init_std), tp_partial_grad=tp > 1
            )
        self.router_losses: dict[str, torch.Tensor] = {}
        # a buffer: an input of a compiled block's graph, not a constant baked into it
        self.register_buffer("router_loss_weight", torch.zeros((), dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """As torch's, but the gradient of the (fp32) router losses and the experts' biases stay fp32 (and their
        values exact) when the model is cast."""
        biases = self.router.expert_bias if self.has_expert_bias else None
        super()._apply(fn, recurse)
        self.router_loss_weight = self.router_loss_weight.float()
        if biases is not None:
            self.router.expert_bias = biases.to(self.router.expert_bias.device)
        return self

    def _shared_expert(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's partial sum of the shared expert's output for every token, gated where it has a gate."""
        h = F.linear(tokens, self.shared_expert.fc1.weight.to(dtype))
        h = self.activation(*h.chunk(2, dim=-1)) if self.gated else self.activation(h)
        out = F.linear(h, self.shared_expert.fc2.weight.to(dtype))
        if self.shared_expert_gate is None:
            return out
        return torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight.to(dtype))) * out

    def _router_loss(
        self, shape: torch.Size, logits: torch.Tensor, probabilities: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor | None:
        """The weighted sum of the router's losses for this micro-batch (`shape`: its [s, b]), their values kept in
        router_losses; None where both coefficients are 0."""
        self.router_losses = {}
        total = None
        if self.aux_loss_coeff:
            s, b = shape
            if self.score == "sigmoid":  # Megatron's: the scores as shares of their sum
                probabilities = probabilities / probabilities.sum(-1, keepdim=True)
            if self.has_expert_bias or self.groups > 1:  # Megatron's: the top k of the scores, unbiased, ungrouped
                chosen = probabilities.detach().topk(self.top_k, dim=-1).indices
            balance = load_balancing_loss(probabilities.view(s, b, -1), chosen.view(s, b, -1), self.num_experts)
            self.router_losses["moe_aux_loss"] = balance.detach()
            total = self.aux_loss_coeff * balance
        if self.z_loss_coeff:
            z = router_z_loss(logits)
            self.router_losses["moe_z_loss"] = z.detach()
            total = self.z_loss_coeff * z if total is None else total + self.z_loss_coeff * z
        return total

    def _experts(self, rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts on `rows`, sorted by expert, expert e's ending at ends[e]."""
        h = grouped_matmul(rows, self.experts.fc1.weight.to(dtype).transpose(1, 2), ends)
        h = self.activation(*h.chunk(2, dim=-1)) if self.gated else self.activation(h)
        return grouped_matmul(h, self.experts.fc2.weight.to(dtype).transpose(1, 2), ends)

    def _experts_across_ranks(self, rows: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert parallelism: `rows` (sorted by expert, counts[e] of expert e) sent to the ranks holding their
        experts, computed there beside the other ranks' rows for the same experts, and their outputs sent back, in
        `rows`' order. Each rank first learns how many rows of each of its experts every rank will send."""
        ep, local = self.ep_size, self.num_experts // self.ep_size
        from_each = torch.empty_like(counts)
        dist.all_to_all_single(from_each, counts, group=self.ep_group)
        from_each = from_each.view(ep, local)  # [source rank, my expert]
        send, receive = counts.view(ep, local).sum(1).tolist(), from_each.sum(1).tolist()
        arrived = mappings.all_to_all_rows(rows, send, receive, self.ep_group)
        # arrived by source rank, then by expert: the GEMMs take each expert's rows together (by expert, then source)
        run = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), from_each.flatten())
        by_expert = ((run % local) * ep + run // local).argsort(stable=True)
        out = self._experts(arrived[by_expert], from_each.sum(0).cumsum(0).to(torch.int32), dtype)
        return mappings.all_to_all_rows(out[by_expert.argsort()], receive, send, self.ep_group)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each token's experts [tokens, top_k]: the top k of its `scores` plus the experts' biases, within its
        model.moe_router_group_top_k groups whose top top_k / group_top_k of those sum highest (Megatron's
        group_limited_topk)."""
        if self.has_expert_bias:
            scores = scores + self.router.expert_bias
        if self.groups > 1:
            by_group = scores.view(scores.shape[0], self.groups, -1)
            group_scores = by_group.topk(self.top_k // self.group_top_k, dim=-1).values.sum(-1)
            kept = group_scores.topk(self.group_top_k, dim=-1).indices
            in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            scores = by_group.masked_fill(~in_kept.unsqueeze(-1), float("-inf")).view_as(scores)
        return scores.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_region(x, self.tp_group)
        tokens = x.reshape(-1, x.shape[-1])
        device = tokens.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype
        tokens = tokens.to(dtype)
        if self.router_fp32:
            with torch.autocast(device, enabled=False):
                logits = F.linear(tokens.float(), self.router.weight.float())
        else:
            logits = F.linear(tokens, self.router.weight.to(dtype)).float()
        probabilities = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if self.has_expert_bias or self.groups > 1:
            # Megatron's: softmax scores renormalised over the top k choose by the logits (the same top k, but
            # groups scored otherwise), the others by the scores
            scores = logits if self.score == "softmax" and self.norm_top_k else probabilities
            chosen = self._choose(scores.detach())
            weights = probabilities.gather(-1, chosen)
        else:
            weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        router_loss = self._router_loss(x.shape[:2], logits, probabilities, chosen) if self.training else None
        counts = _counts(chosen, self.num_experts)
        if self.training and self.has_expert_bias:  # the step's load, which the executor sums (update_expert_biases)
            self.expert_load = counts
        # the token choices sorted by expert, each expert's rows contiguous
        order = chosen.flatten().argsort(stable=True)
        ends = counts.cumsum(0).to(torch.int32)
        # each token copied for its k choices, then permuted: backward writes each row once and sums over k in a
        # fixed order (indexing by order // k would accumulate a token's k rows atomically on a GPU)
        chosen_tokens = tokens.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, tokens.shape[-1])[order]
        if self.ep_size > 1:
            out = self._dispatched(chosen_tokens, counts, dtype)
        else:
            out = self._experts(chosen_tokens, ends, dtype)
        # back in token order, each token's k outputs summed by weight: no scatter-add (atomic, in no fixed order
        # on a GPU), and nothing of the sum kept for backward
        by_token = out[order.argsort()].view(-1, self.top_k, out.shape[-1])
        combined = (by_token * weights.to(dtype).unsqueeze(-1)).sum(1)
        if self.shared_expert is not None:
            combined = combined + self._shared_expert(tokens, dtype)
        combined = combined.view_as(x)
        if self.sequence_parallel:
            combined = mappings.reduce_scatter_to_sequence_region(combined, self.tp_group)
        else:
            combined = mappings.reduce_from_tensor_region(combined, self.tp_group)
        if router_loss is None or not torch.is_grad_enabled():
            return combined
        return _RouterLossGradient.apply(combined, router_loss, self.router_loss_weight)


def _biased_blocks(chunks: list[torch.nn.Module]) -> dict[str, MoEMLP]:
    return {
        name: module
        for chunk in chunks
        for name, module in chunk.named_modules()
        if isinstance(module, MoEMLP) and module.has_expert_bias
    }


def expert_biases(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's experts' biases (model.moe_expert_bias) by layout-independent name
    (`layers.3.mlp.router.expert_bias`): the same on every TP and DP rank of a stage, saved once per stage."""
    return {
        f"{name.removesuffix('.mlp')}.{naming.EXPERT_BIAS}": block.router.expert_bias
        for name, block in _biased_blocks(chunks).items()
    }


def update_expert_biases(chunks: list[torch.nn.Module], loads: dict[str, torch.Tensor], rate: float, group) -> None:
    """Auxiliary-loss-free balancing's step, after an applied update: each block's token choices per expert over the
    global batch (`loads`: this rank's micro-batches', by block name, summed over `group`, the DP x CP ranks; the TP
    ranks of a block route alike) and each expert's bias moved by `rate` towards the mean, by sign(mean - load),
    compared in integers so that every layout moves it alike. One all-reduce for all of the rank's blocks."""
    blocks = _biased_blocks(chunks)
    if not blocks or not rate:
        return
    names = sorted(blocks)
    load = torch.stack([loads[name] for name in names])
    if mappings.group_size(group) > 1:
        dist.all_reduce(load, group=group)
    direction = torch.sign(load.sum(-1, keepdim=True) - load.shape[-1] * load).float()
    for name, step in zip(names, direction, strict=True):
        blocks[name].router.expert_bias.add_(step, alpha=rate)
