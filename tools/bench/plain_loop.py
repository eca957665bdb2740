"""The baseline of `loom bench mfu`: the same Llama-style model as a plain PyTorch training loop.

One nn.Module on one device, torch.nn layers, SDPA attention, AdamW (fused on CUDA), bf16 autocast
over fp32 weights, optionally torch.compile'd: what a careful user writes without a framework.
It has no parallelism, no gradient buffers, no pipeline executor, so loom's overhead shows as
the ratio of the two in the same run.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.model.rotary import apply_rotary, rotary_tables


class PlainBlock(torch.nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attn_norm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp_norm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.qkv = torch.nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.proj = torch.nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.fc1 = torch.nn.Linear(c.hidden_size, 2 * c.ffn_hidden_size, bias=False)
        self.fc2 = torch.nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        q, k, v = self.qkv(self.attn_norm(x)).split(widths, dim=-1)
        # apply_rotary works on [s, b, heads, head_dim]
        q = apply_rotary(q.view(b, s, self.heads, self.head_dim).transpose(0, 1), cos, sin).permute(1, 2, 0, 3)
        k = apply_rotary(k.view(b, s, self.kv_heads, self.head_dim).transpose(0, 1), cos, sin).permute(1, 2, 0, 3)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class PlainGPT(torch.nn.Module):
    def __init__(self, c: ModelConfig, seq_length: int):
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = torch.nn.ModuleList(PlainBlock(c) for _ in range(c.num_layers))
        self.norm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.out = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.out.weight = self.embed.weight
        cos, sin = rotary_tables(seq_length, c, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=c.init_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.out(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


class TransformersLlama(torch.nn.Module):
    """transformers' LlamaForCausalLM of the same shape (its SDPA attention, eager), behind the plain model's
    forward(tokens, labels) -> loss: the baseline most users would otherwise train. The loss is computed
    here, as for the plain model, on labels already shifted."""

    def __init__(self, c: ModelConfig, seq_length: int):
        super().__init__()
        import transformers

        from loom.engine.config import LoomConfig
        from loom.engine.config_io import config_to_dict
        from loom.tools.hf import hf_config

        model = config_to_dict(LoomConfig(model=c))["model"]
        settings = {**hf_config(model), "max_position_embeddings": max(seq_length, c.max_position_embeddings)}
        settings.pop("torch_dtype", None)
        config = transformers.LlamaConfig(**settings)
        config._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def transformers_reason() -> str | None:
    """Why the transformers baseline cannot run here, or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install loom[hf])"
    return None


def unsupported_reason(c: ModelConfig) -> str | None:
    """Why the plain loop cannot model this config (it writes only the Llama shape), or None."""
    if (c.norm, c.activation, c.position_embedding, c.bias) != ("rmsnorm", "swiglu", "rope", False):
        return "the plain loop models Llama-style configs only (rmsnorm, swiglu, rope, no bias)"
    if c.windowed or c.attention_softcap is not None or c.logits_softcap is not None or c.norm_placement != "input":
        return "the plain loop attends to every earlier position, uncapped, with pre-norm blocks (a Llama's)"
    return None


def run_plain_loop(
    c: ModelConfig,
    seq_length: int,
    micro_batch: int,
    microbatches: int,
    steps: int,
    warmup: int,
    device: torch.device,
    precision: str,
    compile_model: bool,
    lr: float = 1e-4,
    model_class: type[torch.nn.Module] = PlainGPT,
) -> list[float]:
    """Train `model_class(c, seq_length)` (the plain model, or TransformersLlama) on random tokens; returns tokens/s
    of every step after the warmup, each timed from the end of the step before (a device sync) to its own end: its
    batches' making and copy to the device included, as loom's Trainer's steps include loading theirs."""
    torch.manual_seed(0)
    model = model_class(c, seq_length).to(device)
    step_model = torch.compile(model) if compile_model else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    generator = torch.Generator().manual_seed(1)
    rates = []
    _sync(device)
    start = time.perf_counter()
    for step in range(warmup + steps):
        batches = [
            torch.randint(0, c.vocab_size, (micro_batch, seq_length + 1), generator=generator).to(device)
            for _ in range(microbatches)
        ]
        for batch in batches:
            with autocast():
                loss = step_model(batch[:, :-1], batch[:, 1:]) / microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        end = time.perf_counter()
        if step >= warmup:
            rates.append(microbatches * micro_batch * seq_length / (end - start))
        start = end
    return rates


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
