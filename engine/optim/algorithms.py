"""Optimizers torch does not ship in the form a sharded model needs: LAMB and Adafactor.

Both need statistics of *whole* parameters (LAMB: the norms of the weights and of the update;
Adafactor: row and column means of squared gradients, the update's RMS), while a rank may hold
only a TP shard (and, for LAMB with optim.zero >= 1, a DP x CP piece). Partial sums are therefore combined
by a callback over the right groups; with no sharding the callbacks are identities and both
reduce to the published single-device algorithms (You et al. 2019; Shazeer & Stern 2018).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from loom.engine.parallel.sharding import ShardSpec


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020) with Adam bias correction and decoupled weight decay inside the trust ratio, which
    applies only to the parameters that weight decay does, as in apex's FusedLAMB with its default use_nvlamb=False
    (what Megatron's `--optimizer lamb` runs) and in the paper's BERT code (norms and biases excluded from layer
    adaptation): those take Adam's step."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        param_ids: dict[int, int],
        num_params: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.param_ids, self.num_params, self.reduce = param_ids, num_params, reduce

    @torch.no_grad()
    def step(self, closure=None):
        updates, device = [], None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                device = p.device
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                updates.append((group, p, update))
        if not updates:
            return None
        sums = torch.zeros(self.num_params, 2, dtype=torch.float32, device=device)
        for group, p, update in updates:
            if group["weight_decay"]:
                row = self.param_ids[id(p)]
                sums[row, 0] += p.float().pow(2).sum()
                sums[row, 1] += update.float().pow(2).sum()
        norms = self.reduce(sums).sqrt()
        for group, p, update in updates:
            if not group["weight_decay"]:
                p.add_(update, alpha=-group["lr"])
                continue
            weight_norm, update_norm = norms[self.param_ids[id(p)]]
            # on the device: a Python branch on the norms read them back, two or three host syncs per parameter
            trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
            p.add_(update * trust.to(update.dtype), alpha=-group["lr"])
        return None


class Adafactor(torch.optim.Optimizer):
    """Adafactor with an external learning rate: factored second moments for matrices, update
    clipping at RMS 1, decay rate t^-0.8, no first moment. TP shards see whole-parameter
    statistics through all-reduces over the TP group; padded vocabulary rows are left out."""

    def __init__(
        self,
        params,
        lr: float,
        tp_group=None,
        tp_rank: int = 0,
        tp_size: int = 1,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        shard_specs: dict[int, ShardSpec] | None = None,
    ):
        """`shard_specs` maps id(tensor) to the ShardSpec of the parameter it steps; None: whole tensors, no TP."""
        super().__init__(params, {"lr": lr, "weight_decay": 0.0})
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.shard_specs = shard_specs
        self.eps, self.clip_threshold, self.decay_rate = eps, clip_threshold, decay_rate

    def _sum(self, x: torch.Tensor, sharded: bool) -> torch.Tensor:
        if sharded and self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                beta2 = 1.0 - state["step"] ** self.decay_rate
                update = self._update(p, p.grad.float(), state, beta2)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        return None

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, beta2: float) -> torch.Tensor:
        spec = self.shard_specs[id(p)] if self.shard_specs is not None else ShardSpec(tuple(p.shape))
        split = spec.dim if self.tp_size > 1 else None
        full_shape = spec.full_shape
        valid_rows = _valid_rows(p, spec, self.tp_rank)
        squared = grad.pow(2) + self.eps
        if p.dim() >= 2:  # factored over the last two dimensions, each matrix of a stack (experts) on its own
            rows_split, cols_split = split == p.dim() - 2, split == p.dim() - 1
            if "row" not in state:
                state["row"] = squared.new_zeros(p.shape[:-1])
                state["col"] = squared.new_zeros(p.shape[:-2] + p.shape[-1:])
            rows, cols = full_shape[-2], full_shape[-1]
            row_mean = self._sum(squared.sum(dim=-1), cols_split) / cols
            col_mean = self._sum(squared[:valid_rows].sum(dim=-2), rows_split) / rows
            state["row"].mul_(beta2).add_(row_mean, alpha=1 - beta2)
            state["col"].mul_(beta2).add_(col_mean, alpha=1 - beta2)
            row_average = self._sum(state["row"][:valid_rows].sum(-1, keepdim=True), rows_split) / rows
            row_factor = (state["row"] / row_average).rsqrt().unsqueeze(-1)
            update = grad * (row_factor * state["col"].rsqrt().unsqueeze(-2))
            update[valid_rows:] = 0
        else:
            if "sq" not in state:
                state["sq"] = torch.zeros_like(squared)
            state["sq"].mul_(beta2).add_(squared, alpha=1 - beta2)
            update = grad * state["sq"].rsqrt()
        numel = 1
        for size in full_shape:
            numel *= size
        rms = (self._sum(update.pow(2).sum().reshape(1), split is not None) / numel).sqrt()
        return update / torch.clamp(rms / self.clip_threshold, min=1.0)


def _valid_rows(p: torch.Tensor, spec: ShardSpec, tp_rank: int) -> int:
    """Rows of this shard that are real (not vocabulary padding, which sits at the end)."""
    if spec.padded_size is None or spec.dim != 0:
        return p.shape[0]
    first = p.shape[0] * tp_rank
    return max(0, min(p.shape[0], spec.full_shape[0] - first))
