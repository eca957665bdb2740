"""Engine overhead: loom's Trainer at TP1/DP1 against a minimal plain-PyTorch loop of the same model.

Both train the same Llama-style model (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU,
untied output) with AdamW on the same random tokens, in this process, alternating A/B rounds.
Prints tokens/s of each, their ratio (goal: loom >= 0.95x) and each against the fp32 matmul peak
measured in the same run. No asserts: figures move with machine load, compare within a run.

    python tools/bench/engine_overhead.py [--layers 4 --hidden 256 --seq 256 --vocab 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.config_io import load_config
from loom.engine.data.indexed import IndexedDatasetWriter
from loom.engine.flops import model_flops_per_token
from loom.engine.model.rotary import apply_rotary, rotary_tables
from loom.engine.train import Trainer
from loom.tools.bench.harness import single_process_group


class PlainBlock(torch.nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(h, eps=1e-5), torch.nn.RMSNorm(h, eps=1e-5)
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.proj = torch.nn.Linear(heads * self.hd, h, bias=False)
        self.fc1 = torch.nn.Linear(h, 2 * ffn, bias=False)
        self.fc2 = torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1
        )
        q = apply_rotary(q.view(b, s, self.heads, self.hd).transpose(0, 1), cos, sin).permute(1, 2, 0, 3)
        k = apply_rotary(k.view(b, s, self.kv_heads, self.hd).transpose(0, 1), cos, sin).permute(1, 2, 0, 3)
        v = v.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class PlainGPT(torch.nn.Module):
    def __init__(self, layers: int, h: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(PlainBlock(h, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(h, eps=1e-5)
        self.out = torch.nn.Linear(h, vocab, bias=False)
        self.cos, self.sin = rotary_tables(seq, ModelConfig(hidden_size=h, num_heads=heads), "cpu")

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def plain_tokens_per_s(args, data: np.ndarray, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = PlainGPT(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rates = []
    for step in range(steps):
        batch = torch.from_numpy(data[step % len(data)])
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(batch[:, :-1], batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        rates.append(args.batch * args.seq / (time.perf_counter() - start))
    return rates


def model_section(args) -> dict:
    """The [model] overrides both sides of the comparison share."""
    return dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
    )


def loom_tokens_per_s(args, prefix: str, run_dir: str, steps: int) -> list[float]:
    overrides = {
        "model": model_section(args),
        "train": dict(
            steps=steps,
            global_batch_size=args.batch,
            micro_batch_size=args.batch,
            seq_length=args.seq,
            precision="fp32",
            device="cpu",
            run_dir=run_dir,
            tensorboard=False,
            log_interval=1,
        ),
        "optim": dict(lr=1e-4, min_lr=1e-5, decay="constant"),
        "data": dict(paths=[prefix], split="100,0,0"),
    }
    trainer = Trainer(load_config(None, overrides))
    rows = trainer.run()
    trainer.close()
    return [r["tokens_per_s"] for r in rows]


def matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 4),
        ("hidden", 256),
        ("heads", 8),
        ("kv_heads", 4),
        ("ffn", 688),
        ("seq", 256),
        ("vocab", 8192),
        ("batch", 4),
        ("steps", 8),
        ("warmup", 2),
        ("rounds", 2),
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    steps = args.warmup + args.steps
    with single_process_group(torch.device("cpu")), tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        prefix = str(Path(tmp) / "random")
        with IndexedDatasetWriter(prefix, np.dtype(np.uint16)) as writer:
            for _ in range(steps * args.batch * 2):
                writer.add_document(rng.integers(0, args.vocab, args.seq + 1))
        data = rng.integers(0, args.vocab, (steps, args.batch, args.seq + 1))
        plain, loom = [], []
        for round_ in range(args.rounds):
            plain += plain_tokens_per_s(args, data, steps)[args.warmup :]
            loom += loom_tokens_per_s(args, prefix, str(Path(tmp) / f"run{round_}"), steps)[args.warmup :]
    peak = matmul_gflops()
    flops = model_flops_per_token(
        load_config(None, {"model": model_section(args)}).model,
        args.seq,
    )
    p, m = statistics.median(plain), statistics.median(loom)
    print(
        f"model: {args.layers} layers, d {args.hidden}, seq {args.seq}, vocab {args.vocab}, batch {args.batch}, "
        f"fp32, {torch.get_num_threads()} threads"
    )
    print(f"fp32 matmul peak measured now: {peak:.1f} GFLOP/s")
    print(f"plain PyTorch loop: {p:8.0f} tokens/s  ({100 * p * flops / 1e9 / peak:.0f}% of matmul peak, model FLOPs)")
    print(f"loom Trainer:       {m:8.0f} tokens/s  ({100 * m * flops / 1e9 / peak:.0f}% of matmul peak, model FLOPs)")
    print(f"ratio loom / plain: {m / p:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
