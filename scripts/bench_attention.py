"""Explicit attention (mt's core) against torch's fused
``F.scaled_dot_product_attention``, forward + backward, at Multi30k lengths:
the measurement behind ``attention_impl: auto`` (explicit on CPU, fused on CUDA).

    python scripts/bench_attention.py [--batch 128] [--length 20] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from mt.hardware import fast_bf16
from mt.model.attention import MultiHeadAttention
from mt.model.masks import causal_mask, lengths_mask


def bench(impl: str, dtype: torch.dtype, args, reps: int = 50) -> float:
    torch.manual_seed(0)
    d = args.heads * args.head_dim
    mha = MultiHeadAttention(d, args.heads, impl=impl).to(args.device)
    x = torch.randn(args.batch, args.length, d, device=args.device, requires_grad=True)
    lengths = torch.randint(args.length // 2, args.length + 1, (args.batch,), device=args.device)
    mask = lengths_mask(lengths, args.length) & causal_mask(args.length, device=args.device)
    autocast = torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            out = mha(x, x, mask).output
        out.float().sum().backward()

    for _ in range(5):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--length", type=int, default=20)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print(
        f"self-attention fwd+bwd, batch {args.batch}, length {args.length}, {args.heads} heads of {args.head_dim}, "
        f"padding + causal mask, {args.device}, torch {torch.__version__}"
    )
    print(f"{'dtype':<6}{'explicit ms':>13}{'fused ms':>10}{'fused/explicit':>16}")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if dtype == torch.bfloat16 and args.device == "cpu" and not fast_bf16():
            print("bf16 left out: this CPU has no fast bfloat16 path (AVX2 only)")
            continue
        explicit, fused = bench("explicit", dtype, args), bench("fused", dtype, args)
        print(f"{name:<6}{explicit:>13.2f}{fused:>10.2f}{fused / explicit:>15.2f}x")


if __name__ == "__main__":
    main()
