"""[model]'s mixture-of-experts settings (model.num_experts and the moe_ fields): the checks ModelConfig runs on
them, kept apart from the shape's and the kernels'."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING

from loom.engine.config.fields import ConfigError, check_positive, field_default

if TYPE_CHECKING:  # model.py calls check_experts from ModelConfig.__post_init__
    from loom.engine.config.model import ModelConfig


def check_experts(m: ModelConfig) -> None:
    """What a mixture of experts' settings (model.num_experts and the moe_ fields) must satisfy, each refused in one
    line; none of them without experts."""
    check_positive(
        "model",
        num_experts=m.num_experts,
        moe_top_k=m.moe_top_k,
        moe_shared_ffn_hidden_size=m.moe_shared_ffn_hidden_size,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_groups=m.moe_router_groups,
        moe_router_group_top_k=m.moe_router_group_top_k,
    )
    if m.num_experts is not None and not 0 <= m.moe_dense_layers < m.num_layers:
        raise ConfigError(
            f"model.moe_dense_layers = {m.moe_dense_layers} must be from 0 to model.num_layers - 1 = "
            f"{m.num_layers - 1} (the blocks after them have experts)"
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_bias_rate"):
        if not 0.0 <= getattr(m, name) < math.inf:  # NaN fails too
            raise ConfigError(f"model.{name} must be a number >= 0, got {getattr(m, name)}")
    if not 0.0 < m.moe_router_scale < math.inf:
        raise ConfigError(f"model.moe_router_scale must be a number > 0, got {m.moe_router_scale}")
    if m.num_experts is None:
        given = [f.name for f in fields(m) if f.name.startswith("moe_") and getattr(m, f.name) != field_default(f)]
        if given:
            raise ConfigError(
                f"model.{given[0]} is set but model.num_experts is not (a dense MLP): give --model.num_experts "
                "N for a mixture of experts, or drop the moe settings (a LoRA run takes its base's experts and "
                "freezes its router)"
            )
        return
    if m.moe_top_k > m.num_experts:
        raise ConfigError(
            f"model.moe_top_k = {m.moe_top_k} sends each token to more experts than model.num_experts = {m.num_experts}"
        )
    if m.bias:
        raise ConfigError("model.num_experts with model.bias = true: loom's experts have no biases")
    if m.moe_shared_expert_gate and m.moe_shared_ffn_hidden_size is None:
        raise ConfigError(
            "model.moe_shared_expert_gate gates a shared expert, and model.moe_shared_ffn_hidden_size is not set: "
            "give the shared expert's width, or drop the gate"
        )
    if m.moe_expert_bias and m.moe_router_score != "sigmoid":
        raise ConfigError(
            "model.moe_expert_bias biases sigmoid scores (as DeepSeek-V3 and Megatron do; loom's softmax router "
            "takes none): add --model.moe_router_score sigmoid"
        )
    _check_router_groups(m)
    if m.moe_top_k == 1 and m.moe_norm_top_k:
        raise ConfigError(
            "model.moe_top_k = 1 with model.moe_norm_top_k = true weighs each token's one expert by exactly 1: "
            "the router would learn nothing from the loss; add --model.moe_norm_top_k false (Switch "
            "Transformer's: the expert's probability)"
        )


def _check_router_groups(m: ModelConfig) -> None:
    groups, chosen, experts = m.moe_router_groups, m.moe_router_group_top_k, m.num_experts
    if groups == 1:
        if chosen is not None:
            raise ConfigError(
                f"model.moe_router_group_top_k = {chosen} chooses among groups of experts, and "
                "model.moe_router_groups is 1: give the number of groups too (DeepSeek-V3: 8 and 4)"
            )
        return
    if experts % groups:
        raise ConfigError(
            f"model.moe_router_groups = {groups} does not divide model.num_experts = {experts} into equal groups"
        )
    if chosen is None:
        raise ConfigError(
            f"model.moe_router_groups = {groups} needs model.moe_router_group_top_k, how many groups each token's "
            "experts come from (DeepSeek-V3: 8 groups, 4 of them)"
        )
    if not chosen <= min(groups, m.moe_top_k):
        raise ConfigError(
            f"model.moe_router_group_top_k = {chosen} must be at most model.moe_router_groups = {groups} and "
            f"model.moe_top_k = {m.moe_top_k} (a group is scored by its top moe_top_k / group_top_k experts)"
        )
    if m.moe_top_k > chosen * (experts // groups):
        raise ConfigError(
            f"model.moe_top_k = {m.moe_top_k} experts do not fit in model.moe_router_group_top_k = {chosen} "
            f"groups of {experts // groups}"
        )
