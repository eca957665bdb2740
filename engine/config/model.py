"""[model]: the network's shape and kernels."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Literal

from loom.engine.config.experts import check_experts
from loom.engine.config.fields import ConfigError, check_choices, check_positive, field_default


@dataclass
class ModelConfig:
    num_layers: int = 24
    """Number of transformer blocks."""
    hidden_size: int = 2048
    """Width of the residual stream."""
    num_heads: int = 16
    """Attention (query) heads; must divide hidden_size unless model.head_dim is set, and be divisible by
    parallel.tp."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (multi-head attention)."""
    head_dim: int | None = None
    """Width of each attention head (Hugging Face's head_dim, Megatron's --kv-channels); None means hidden_size /
    num_heads. Set otherwise (Mistral-Nemo's 128 with 5120 / 32 = 160), the query and output projections are
    num_heads x head_dim wide, not hidden_size."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4*hidden (gelu, squared_relu) or 8/3*hidden rounded up to a multiple of 256 (swiglu,
    geglu)."""
    vocab_size: int = 32000
    """Tokenizer vocabulary size; the embedding is padded beyond it, padded ids never reach the loss."""
    make_vocab_divisible_by: int = 128
    """The embedding is padded to a multiple of this times parallel.tp, for fast GEMMs."""
    max_position_embeddings: int = 4096
    """Longest sequence the model accepts (the size of the learned position table)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """Rotary position embedding (Llama) or a learned absolute table (GPT-2)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (of the full-attention layers, where model.rope_local_theta sets the
    sliding-window layers' apart)."""
    rope_local_theta: float | None = None
    """Base of the rotary frequencies in the sliding-window layers (Gemma 3's rope_local_base_freq: 10k there, 1M
    in its full-attention layers); None means model.rope_theta. Long-context scaling (model.rope_scaling) turns
    the full-attention layers' alone when this is set."""
    rotary_percent: float = 1.0
    """Fraction of each head's width the rotary embedding turns (Megatron's --rotary-percent, Hugging Face's
    partial_rotary_factor; GPT-NeoX and Phi-4-mini rotate part of it): its first int(head_dim x this) channels,
    an even number, the rest pass unrotated."""
    rope_scaling: Literal["none", "linear", "llama3", "longrope", "yarn"] = "none"
    """Long-context rescaling of the rotary frequencies: none; linear (position interpolation, Chen et al. 2023;
    Hugging Face's rope_type "linear", Gemma 3's larger models', Megatron's --rotary-seq-len-interpolation-factor):
    every frequency divided by rope_scaling_factor; llama3 (Llama 3.1 and later; Hugging Face's
    rope_type "llama3"): wavelengths longer than rope_original_max_positions / rope_low_freq_factor are
    stretched by rope_scaling_factor, those shorter than rope_original_max_positions / rope_high_freq_factor
    are kept, and the ones between are interpolated; longrope (Phi-3.5, Phi-4-mini; Hugging Face's rope_type
    "longrope"): each frequency divided by its entry of rope_short_factors in sequences up to
    rope_original_max_positions tokens long and of rope_long_factors in longer ones, cos and sin scaled by
    rope_attention_factor; or yarn (YaRN, Peng et al. 2023; Qwen's long-context setting; Hugging Face's rope_type
    "yarn"): frequencies turning fewer than rope_yarn_beta_slow times over rope_original_max_positions tokens are
    divided by rope_scaling_factor, those turning more than rope_yarn_beta_fast times kept, a linear ramp over
    the channels between, cos and sin scaled by rope_attention_factor."""
    rope_scaling_factor: float = 8.0
    """linear scaling: the divisor of every frequency; llama3: how much the low frequencies are stretched; yarn: how
    much the context is extended."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: rope_original_max_positions / this is the wavelength above which frequencies stretch."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: rope_original_max_positions / this is the wavelength below which frequencies are kept."""
    rope_original_max_positions: int = 8192
    """llama3, longrope and yarn scaling: the context length the model was pretrained at before scaling."""
    rope_short_factors: list[float] | None = None
    """longrope scaling: a divisor for each rotary frequency (rotary_dim / 2 of them) in sequences up to
    rope_original_max_positions tokens long."""
    rope_long_factors: list[float] | None = None
    """longrope scaling: the divisors in longer sequences."""
    rope_yarn_beta_fast: float = 32.0
    """yarn scaling: frequencies turning more than this many times over rope_original_max_positions tokens are
    kept (Hugging Face's beta_fast)."""
    rope_yarn_beta_slow: float = 1.0
    """yarn scaling: frequencies turning fewer than this many times are divided by rope_scaling_factor (Hugging
    Face's beta_slow)."""
    rope_attention_factor: float | None = None
    """longrope and yarn scaling: the factor on the rotary cos and sin; None derives it as Hugging Face does, once
    (a run's config.toml and checkpoints keep the value, which a longer max_position_embeddings later does not
    change): for longrope sqrt(1 + ln(s) / ln(rope_original_max_positions)) with s = max_position_embeddings /
    rope_original_max_positions, for yarn 1 + 0.1 ln(rope_scaling_factor); 1 where s or the factor is <= 1."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """The kind of normalisation in each block (before attention and the MLP, or after them: model.norm_placement)
    and at the end."""
    norm_eps: float = 1e-5
    """Epsilon inside the normalisation."""
    norm_placement: Literal["input", "output", "both"] = "input"
    """Where each block's norms sit: input (pre-norm; GPT-2, Llama, Megatron) normalises what enters attention
    and the MLP; output (OLMo 2's reordered norm) normalises what attention and the MLP return, before it joins the
    residual stream (x + norm(attention(x))), and the stream enters them unnormalised; both (Gemma 2's and 3's
    sandwich) does the two, four norms a block: x + norm(attention(norm(x))). The final norm is there in all."""
    activation: Literal["swiglu", "geglu", "gelu", "squared_relu"] = "swiglu"
    """MLP non-linearity: gated SiLU (SwiGLU: Llama), gated GELU (GeGLU, the tanh approximation: Gemma's
    gelu_pytorch_tanh), GELU (tanh approximation: GPT) or squared ReLU, relu(x)^2 (Nemotron-4, Minitron; Megatron's
    --squared-relu). The gated two take FC1's output as a gate half and an up half (model.gated_mlp)."""
    bias: bool = False
    """Biases in the linear layers (GPT-2 style)."""
    num_experts: int | None = None
    """Mixture of experts: each block's MLP (but the first model.moe_dense_layers blocks') becomes this many expert
    MLPs (each model.moe_ffn_hidden_size wide, by default model.ffn_hidden_size; model.activation's kind) and a router
    that sends every token to model.moe_top_k of them (Mixtral's num_local_experts, Qwen3-MoE's num_experts,
    Megatron's --num-experts); None means one dense MLP. The experts are split across TP ranks as a dense MLP is
    (each rank holds its slice of every expert it holds: all of them, or 1/parallel.ep under expert
    parallelism)."""
    moe_ffn_hidden_size: int | None = None
    """With model.num_experts: each expert's width (Megatron's --moe-ffn-hidden-size, Hugging Face's
    moe_intermediate_size); None: model.ffn_hidden_size, which is otherwise the width of the dense blocks'
    MLPs (model.moe_dense_layers)."""
    moe_dense_layers: int = 0
    """With model.num_experts: the first N blocks keep a dense MLP, model.ffn_hidden_size wide (DeepSeek-V3's and
    GLM-4.5's first_k_dense_replace, 3 and 1; Megatron's --moe-layer-freq '([0]*N+[1]*rest)')."""
    moe_top_k: int = 2
    """With model.num_experts: the experts each token goes to (Mixtral's num_experts_per_tok, Megatron's
    --moe-router-topk)."""
    moe_norm_top_k: bool = True
    """With model.num_experts: true weights a token's experts by their router probabilities renormalised over its
    top k (Mixtral; Qwen3-MoE's norm_topk_prob = true; Megatron's default, a softmax over the top k logits); false
    by the probabilities of the softmax over every expert (OLMoE, Qwen2-MoE; Megatron's --moe-router-pre-softmax)."""
    moe_shared_ffn_hidden_size: int | None = None
    """With model.num_experts: the width of a shared expert, an MLP every token passes through beside its routed
    experts (Qwen2-MoE's shared_expert_intermediate_size, Megatron's --moe-shared-expert-intermediate-size); None:
    none."""
    moe_shared_expert_gate: bool = False
    """With model.moe_shared_ffn_hidden_size: the shared expert's output scaled by sigmoid(x . w) per token (Qwen2-
    MoE's shared_expert_gate, Megatron's --moe-shared-expert-gate)."""
    moe_aux_loss_coeff: float = 0.01
    """With model.num_experts: the weight of each block's load-balancing loss in the training loss (Switch
    Transformer's, Fedus et al. 2021, alpha = 0.01 there; Megatron's --moe-aux-loss-coeff): num_experts / top_k x
    sum over experts of (the fraction of a sequence's token choices it got) x (its mean router probability over the
    sequence), 1 when the load is even, averaged over the sequences (per sequence as DeepSeek's sequence-wise loss
    and Megatron's seq_aux_loss, so that micro-batching and the parallel layout do not change it; transformers'
    classes take the whole batch and all layers together, about top_k when even: import-hf converts their
    router_aux_loss_coef x top_k / layers). Logged as moe_aux_loss (summed over blocks, before this weight); 0
    trains without it. A LoRA run trains none (its router is frozen)."""
    moe_z_loss_coeff: float = 0.0
    """With model.num_experts: the weight of each block's router z-loss (ST-MoE's, Zoph et al. 2022: the mean over
    tokens of logsumexp(router logits)^2, which keeps the logits small; Megatron's --moe-z-loss-coeff, OLMoE trained
    with 0.001). Logged as moe_z_loss (summed over blocks, before this weight); 0 trains without it."""
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"
    """With model.num_experts: how the router scores the experts from its logits: a softmax over all of them
    (Mixtral, Qwen-MoE, OLMoE) or a sigmoid of each on its own (DeepSeek-V3, GLM-4.5, dots.llm1; Megatron's
    --moe-router-score-function). A token goes to its top model.moe_top_k scores (plus model.moe_expert_bias's
    bias, for the choice alone), weighted by those scores (renormalised under model.moe_norm_top_k) times
    model.moe_router_scale. The load-balancing loss takes sigmoid scores divided by their sum, as Megatron does."""
    moe_router_scale: float = 1.0
    """With model.num_experts: a factor on every token's expert weights (DeepSeek-V3's routed_scaling_factor, 2.5;
    Megatron's --moe-router-topk-scaling-factor)."""
    moe_expert_bias: bool = False
    """With model.moe_router_score = sigmoid: auxiliary-loss-free load balancing (Wang et al. 2024, DeepSeek-V3;
    Megatron's --moe-router-enable-expert-bias): each block keeps a bias per expert (fp32; Hugging Face's
    e_score_correction_bias), added to the scores when a token's experts are chosen but not to their weights, and
    moved by model.moe_expert_bias_rate after each applied update: up for an expert that got fewer of the global
    batch's token choices than the mean, down for one that got more. Saved with checkpoints; usually with
    model.moe_aux_loss_coeff small or 0 (DeepSeek-V3: 0.0001, sequence-wise)."""
    moe_expert_bias_rate: float = 0.001
    """With model.moe_expert_bias: how far each expert's bias moves per step (DeepSeek-V3's gamma, 0.001; Megatron's
    --moe-router-bias-update-rate); 0 keeps the biases as they are (a fine-tune of a model that has them)."""
    moe_router_groups: int = 1
    """With model.num_experts: group-limited routing (DeepSeek-V2's device-limited and DeepSeek-V3's node-limited
    routing, 8 groups there; Megatron's --moe-router-num-groups, Hugging Face's n_group): the experts fall into this
    many equal groups of consecutive numbers, and each token's experts are chosen within its
    model.moe_router_group_top_k groups of highest score, a group's score the sum of its top model.moe_top_k /
    model.moe_router_group_top_k scores (with model.moe_expert_bias's biases; softmax scores renormalised over the
    top k, model.moe_norm_top_k, score groups by their logits, as Megatron does); 1 chooses among all experts."""
    moe_router_group_top_k: int | None = None
    """With model.moe_router_groups > 1, which needs it: how many groups each token's experts come from
    (DeepSeek-V3's topk_group, 4; Megatron's --moe-router-group-topk)."""
    moe_router_fp32: bool = False
    """With model.num_experts: the router's GEMM and scores in fp32 whatever train.precision is (Megatron's
    --moe-router-dtype fp32; GLM-4.5's and DeepSeek-V3's classes route so): bf16 logits round enough to send some
    tokens to other experts than fp32 ones. Its weight is kept as the others are (bf16 under bf16 training, as
    Megatron's); an fp32 copy of each expert block's input is kept for backward."""
    sliding_window: int | None = None
    """Sliding-window attention: in the layers model.full_attention_interval leaves windowed, each position attends
    to itself and the sliding_window - 1 positions before it (Hugging Face's sliding_window; Mistral's 4096,
    Gemma 3's 512); None means every layer attends to every earlier position. Computed with an explicit mask
    (torch SDPA): no context parallelism, not model.attention_backend = flash, not Transformer Engine's
    attention."""
    full_attention_interval: int | None = None
    """With model.sliding_window: every this-many-th layer (counting from 1: layers N, 2N, ...) attends to every
    earlier position, the others within the window (Gemma 3's 6, Gemma 2's 2; Megatron's --window-attn-skip-freq);
    None means every layer slides (Mistral)."""
    qk_norm: bool = False
    """Normalise the queries and keys (model.norm's kind) before the rotary embedding: each head over head_dim,
    one weight shared by all heads (Qwen3's q_norm / k_norm, Megatron's --qk-layernorm), or all heads at once
    under model.qk_norm_per_head = false (OLMo 2's)."""
    qk_norm_per_head: bool = True
    """With model.qk_norm: true normalises each head over head_dim, one weight shared by all heads (Qwen3,
    Megatron); false normalises the whole query projection over num_heads x head_dim and the whole key projection
    over num_kv_heads x head_dim, a weight per channel (OLMo 2; OLMo-core's use_head_qk_norm = false). false takes
    model.norm = rmsnorm."""
    qkv_bias: bool = False
    """Biases on the QKV projection alone (Qwen2; Megatron's --add-qkv-bias with --disable-bias-linear). model.bias
    puts them on every linear layer, QKV's included."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    embedding_multiplier: float = 1.0
    """The token embeddings are multiplied by this on their way into the first block (Granite's
    embedding_multiplier, Gemma's sqrt(hidden_size)), rounded to the embeddings' dtype first as Gemma's code does
    (bf16 training: sqrt(1152) = 33.94 multiplies as 34.0; Granite's 12.0 is exact in every dtype)."""
    residual_multiplier: float = 1.0
    """Each block's attention and MLP outputs are multiplied by this before they join the residual stream
    (Granite's residual_multiplier)."""
    attention_scale: float | None = None
    """The factor on the query-key scores before the softmax; None means 1 / sqrt(head_dim) (Granite's
    attention_multiplier, Megatron's --softmax-scale)."""
    logits_divisor: float = 1.0
    """The output logits are divided by this (Granite's logits_scaling)."""
    attention_softcap: float | None = None
    """Soft-capping of the attention scores: cap x tanh(scores / cap) after the score factor, before the mask and
    softmax (Gemma 2's attn_logit_softcapping, 50); None leaves them uncapped. Computed by loom's own attention (the
    scores are materialised: no flash kernel, no context parallelism, not Transformer Engine's attention)."""
    logits_softcap: float | None = None
    """Soft-capping of the output logits: cap x tanh(logits / cap) (Gemma 2's final_logit_softcapping, 30); None
    leaves them uncapped."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections are scaled by 1/sqrt(2*layers)."""
    dropout: float = 0.0
    """Dropout on the embedding output, attention probabilities and residual branches (Megatron's --hidden-dropout
    and --attention-dropout in one). Layout invariance holds at 0."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: none, selective (core attention only) or full (each block)."""
    kernels: Literal["auto", "native", "te"] = "auto"
    """Kernel implementations (engine/model/kernels.py): auto uses Transformer Engine on CUDA when it
    imports, else apex fused norms / FusedAdam when apex imports, else native PyTorch (SDPA, torch norms,
    fused AdamW); native always runs the PyTorch reference path; te requires Transformer Engine. What was
    chosen, and why, is printed at start-up and recorded in the first metrics.jsonl row."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient"] = "auto"
    """Which of torch SDPA's CUDA kernels computes attention: auto lets torch choose (flash attention on an H100/
    H200); flash, cudnn (cuDNN's fused attention, Megatron's "fused") or efficient (memory-efficient) run that one
    alone, and a shape it cannot take is an error, never a silent fall back to unfused math (cudnn and efficient
    take no grouped-query heads: each KV head is repeated for its query heads). CUDA only; an explicit choice
    replaces Transformer Engine's attention, and parallel.cp > 1 (ring attention, flash kernels of its own) needs
    auto. For measuring which is fastest on a GPU: `loom bench mfu --model.attention_backend cudnn`."""
    compile: Literal["auto", "true", "false"] = "auto"
    """torch.compile each transformer block whole (norms, rotary, attention, SwiGLU, residuals and the TP
    collectives between them: one graph for all blocks) when the kernels are native PyTorch; with Transformer
    Engine or apex only the element-wise pieces left to PyTorch are compiled. auto compiles on CUDA (30% more
    tokens/s on an H200 for llama-1b, docs/gpu.md) and not on CPU (inductor's CPU compile costs more than a
    CPU run gains); true/false force it. The first step pays the compile, printed by rank 0."""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        s = "model"
        check_positive(
            s,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            ffn_hidden_size=self.ffn_hidden_size,
            make_vocab_divisible_by=self.make_vocab_divisible_by,
            norm_eps=self.norm_eps,  # a negative one makes the first norm NaN; 0 that of an all-zero input
            init_std=self.init_std,  # a negative one trained a model from |N(0, std)| weights (loss 41 at step 1)
        )
        check_positive(
            s,
            embedding_multiplier=self.embedding_multiplier,
            residual_multiplier=self.residual_multiplier,
            attention_scale=self.attention_scale,
            logits_divisor=self.logits_divisor,
            attention_softcap=self.attention_softcap,
            logits_softcap=self.logits_softcap,
        )
        check_positive(
            s,
            rope_theta=self.rope_theta,
            rope_scaling_factor=self.rope_scaling_factor,
            rope_low_freq_factor=self.rope_low_freq_factor,
            rope_original_max_positions=self.rope_original_max_positions,
        )
        check_positive(s, rope_attention_factor=self.rope_attention_factor)
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor = {self.rope_low_freq_factor}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model.num_heads = {self.num_heads} must divide model.hidden_size = {self.hidden_size}, or "
                    "set model.head_dim"
                )
            self.head_dim = self.hidden_size // self.num_heads
        check_positive(s, head_dim=self.head_dim)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads = {self.num_kv_heads} must divide model.num_heads = {self.num_heads}"
            )
        if self.ffn_hidden_size is None:
            if self.gated_mlp:
                self.ffn_hidden_size = -(-(8 * self.hidden_size // 3) // 256) * 256
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if not 0.0 < self.rotary_percent <= 1.0:  # NaN fails too
            raise ConfigError(f"model.rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding == "rope" and (self.rotary_dim % 2 or not self.rotary_dim):
            turned = "" if self.rotary_percent == 1.0 else f" (model.rotary_percent {self.rotary_percent} of it)"
            raise ConfigError(
                f"rotary embeddings turn pairs of channels: the head dim {self.head_dim}{turned} gives "
                f"{self.rotary_dim} rotated channels, which is not an even number above 0"
            )
        if self.position_embedding == "rope" and self.rope_scaling == "longrope":
            self._check_longrope_factors()
            if self.rope_attention_factor is None:  # resolved once, as Hugging Face derives it: the trained model's
                extension = self.max_position_embeddings / self.rope_original_max_positions
                logarithm = math.log(extension) / math.log(self.rope_original_max_positions)
                self.rope_attention_factor = 1.0 if extension <= 1 else math.sqrt(1 + logarithm)
        if self.position_embedding == "rope" and self.rope_scaling == "yarn":
            check_positive(
                s, rope_yarn_beta_fast=self.rope_yarn_beta_fast, rope_yarn_beta_slow=self.rope_yarn_beta_slow
            )
            if self.rope_scaling_factor < 1 or self.rope_theta <= 1:
                raise ConfigError(
                    f"model.rope_scaling = yarn extends the context: it takes model.rope_scaling_factor >= 1 (got "
                    f"{self.rope_scaling_factor}) and model.rope_theta > 1 (got {self.rope_theta})"
                )
            if not self.rope_yarn_beta_fast > self.rope_yarn_beta_slow:
                raise ConfigError(
                    f"model.rope_yarn_beta_fast = {self.rope_yarn_beta_fast} must exceed model.rope_yarn_beta_slow = "
                    f"{self.rope_yarn_beta_slow}: frequencies turning more often than the first are kept, those "
                    "turning less often than the second interpolated"
                )
            if self.rope_attention_factor is None:
                factor = self.rope_scaling_factor
                self.rope_attention_factor = 1.0 if factor <= 1 else 1 + 0.1 * math.log(factor)
        if self.qk_norm and not self.qk_norm_per_head and self.norm != "rmsnorm":
            raise ConfigError(
                f"model.qk_norm_per_head = false (one norm over all heads) takes model.norm = rmsnorm, got {self.norm}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        check_positive(
            s,
            sliding_window=self.sliding_window,
            full_attention_interval=self.full_attention_interval,
            rope_local_theta=self.rope_local_theta,
        )
        check_experts(self)

    def _check_longrope_factors(self) -> None:
        if self.rope_original_max_positions < 2:  # its logarithm divides the attention factor's
            raise ConfigError(
                f"model.rope_original_max_positions = {self.rope_original_max_positions}: longrope scaling needs "
                "the pretraining context, 2 tokens or more"
            )
        wanted = self.rotary_dim // 2
        for name in ("rope_short_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if factors is None or len(factors) != wanted:
                given = "none" if factors is None else len(factors)
                raise ConfigError(
                    f"model.rope_scaling = longrope needs model.{name}: one divisor per rotary frequency, {wanted} "
                    f"(rotary_dim {self.rotary_dim} / 2), got {given}"
                )
            check_positive("model", **{f"{name}[{i}]": factor for i, factor in enumerate(factors)})

    @property
    def softmax_scale(self) -> float:
        """The factor on the query-key scores: model.attention_scale, else 1 / sqrt(head_dim)."""
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the rotary embedding turns (the first ones), as Megatron and Hugging Face count
        them."""
        return int(self.head_dim * self.rotary_percent)

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of block `layer` (0-based), or None where it attends to every earlier position."""
        if self.sliding_window is None:
            return None
        interval = self.full_attention_interval
        return None if interval is not None and (layer + 1) % interval == 0 else self.sliding_window

    @property
    def windowed(self) -> bool:
        """Whether some layer attends within a sliding window."""
        return any(self.attention_window(layer) is not None for layer in range(self.num_layers))

    @property
    def gated_mlp(self) -> bool:
        """Whether FC1 computes a gate and an up projection (swiglu, geglu), twice model.ffn_hidden_size wide."""
        return self.activation in ("swiglu", "geglu")

    @property
    def moe(self) -> bool:
        """Whether each block's MLP is a mixture of experts (model.num_experts)."""
        return self.num_experts is not None

    def has_experts(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is a mixture of experts (not one of model.moe_dense_layers)."""
        return self.moe and layer >= self.moe_dense_layers

    def layer_config(self, layer: int) -> ModelConfig:
        """The config block `layer` computes with, as a model of uniform blocks: a dense block's (no experts, its
        MLP model.ffn_hidden_size wide) or an expert block's (its experts model.moe_ffn_hidden_size wide), so that
        code about one block (the block itself, the planner's and the FLOP counts) reads one MLP width."""
        if not self.moe or (self.moe_dense_layers == 0 and self.moe_ffn_hidden_size is None):
            return self
        if not self.has_experts(layer):
            dense = {f.name: field_default(f) for f in fields(self) if f.name.startswith("moe_")}
            return dataclasses.replace(self, num_experts=None, **dense)
        experts_width = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return dataclasses.replace(self, ffn_hidden_size=experts_width, moe_ffn_hidden_size=None, moe_dense_layers=0)

    def block_configs(self) -> tuple[ModelConfig, ModelConfig]:
        """The first block's config and the last's: a dense block's and an expert one's under model.moe_dense_layers
        (the same config twice where every block is alike), the two kinds of block per-block counts sum over."""
        return self.layer_config(0), self.layer_config(self.num_layers - 1)

    @property
    def moves_expert_biases(self) -> bool:
        """Whether training moves the experts' biases after each update (model.moe_expert_bias with a rate)."""
        return self.moe and self.moe_expert_bias and self.moe_expert_bias_rate > 0

    @property
    def router_loss_metrics(self) -> list[str]:
        """The router losses (load balancing, z-loss) training adds to a mixture of experts' loss, by their metrics'
        names, in the order every rank sums them."""
        if not self.moe:
            return []
        weights = (("moe_aux_loss", self.moe_aux_loss_coeff), ("moe_z_loss", self.moe_z_loss_coeff))
        return [name for name, weight in weights if weight]

    @property
    def router_losses(self) -> bool:
        """Whether training adds a router loss to the loss (router_loss_metrics)."""
        return bool(self.router_loss_metrics)

    @property
    def biased_qkv(self) -> bool:
        """Whether the QKV projection has a bias (model.bias or model.qkv_bias)."""
        return self.bias or self.qkv_bias

    def compiles_on(self, cuda: bool) -> bool:
        """Whether model.compile compiles the blocks on a CUDA (`cuda`) or CPU rank, when the kernels are native
        PyTorch (engine/model/kernels.py; the planner asks for a GPU)."""
        return self.compile == "true" or (self.compile == "auto" and cuda)

    def context_parallel_refusal(self, cp: int, seq_length: int) -> str | None:
        """Why sequences of `seq_length` tokens of this model cannot be split over `cp` ranks (training and the
        planner's search), or None."""
        if cp == 1:
            return None
        if seq_length % (2 * cp):
            fitting = (seq_length // (2 * cp) + 1) * 2 * cp
            return (
                f"parallel.cp = {cp} cuts each sequence into 2*cp = {2 * cp} chunks; train.seq_length = "
                f"{seq_length} does not divide into them: use a multiple of {2 * cp} (e.g. {fitting}) or another cp"
            )
        if self.position_embedding != "rope":
            return "parallel.cp > 1 needs model.position_embedding = rope (learned positions are not split)"
        if self.dropout:
            return f"parallel.cp > 1 needs model.dropout = 0 (got {self.dropout}): ring attention has none"
        if self.windowed:
            return (
                f"parallel.cp > 1 with model.sliding_window = {self.sliding_window}: ring attention attends to "
                "every earlier position"
            )
        if self.attention_softcap is not None:
            return f"parallel.cp > 1 with model.attention_softcap = {self.attention_softcap}: ring attention has none"
        if self.moe:
            return (
                f"parallel.cp > 1 with model.num_experts = {self.num_experts}: the load-balancing loss is computed "
                "over whole sequences, which context parallelism splits"
            )
        return None

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP size the model's heads, KV heads or MLP do not split into (training, resharding, generation)."""
        for name in (
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "moe_shared_ffn_hidden_size",
            "moe_ffn_hidden_size",
        ):
            value = getattr(self, name)
            if value is not None and value % tp:
                raise ConfigError(f"parallel.tp = {tp} must divide model.{name} = {value}")
