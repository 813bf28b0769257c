"""Training throughput: mt's model against torch.nn.Transformer of identical
dimensions, on identical Multi30k-shaped batches, same loss (label-smoothed
cross-entropy) and optimiser (AdamW), fp32 and bf16 autocast, side by side in
one run. Prints target tokens/s, the ratio, FLOPs per step and MFU against a
matmul peak measured in the same run (the faster of torch.mm and oneDNN, see
mt.hardware.matmul_peak).

    python scripts/bench_train.py [--steps 10] [--tokens 4096] [--prepared data/prepared/multi30k.en-de]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mt.config import ModelConfig
from mt.hardware import BF16_USABLE, bf16_speedup, matmul_peak
from mt.model.layers import sinusoidal_table
from mt.model.transformer import Transformer
from mt.train.loss import linear_cross_entropy
from mt.train.speed import for_training

PAD, BOS, EOS = 0, 2, 3


class TorchTransformer(nn.Module):
    """The same architecture on torch.nn.Transformer: shared embeddings scaled
    by sqrt(D), sinusoidal positions, pre-LN, tied output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=PAD)
        self.register_buffer("pos", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.core = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.enc_layers, cfg.dec_layers, cfg.d_ff, cfg.dropout,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.scale = math.sqrt(cfg.d_model)

    def forward(self, src, tgt_in):
        def emb(x):
            return self.embed(x) * self.scale + self.pos[: x.size(1)]

        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), dtype=torch.bool)
        h = self.core(
            emb(src), emb(tgt_in), tgt_mask=causal, src_key_padding_mask=src == PAD,
            memory_key_padding_mask=src == PAD, tgt_is_causal=True,
        )  # fmt: skip
        return h @ self.embed.weight.t()


def batches(n: int, max_tokens: int, prepared: Path | None, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Length-bucketed batches of ~max_tokens: real Multi30k lengths when prepared data exists."""
    g = torch.Generator().manual_seed(seed)
    if prepared is not None and (prepared / "train").is_dir():
        from mt.data.batches import Split

        s = Split(prepared / "train")
        pairs = [(len(a), len(b) + 1) for a, b in zip(s.src, s.tgt)]
    else:  # Multi30k-like: 15 +- 5 tokens
        pairs = [(max(3, int(15 + 5 * torch.randn(1, generator=g))),) * 2 for _ in range(30000)]
    out = []
    for _ in range(n):
        length = pairs[int(torch.randint(len(pairs), (1,), generator=g))][1]
        rows = max_tokens // length
        src = torch.randint(4, 8000, (rows, length), generator=g)
        tgt = torch.randint(4, 8000, (rows, length), generator=g)
        out.append((src, tgt))
    return out


def model_flops(cfg: ModelConfig, src: torch.Tensor, tgt: torch.Tensor) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward)."""
    d, ff, v = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    b, ts = src.shape
    tt = tgt.size(1)
    enc = cfg.enc_layers * (2 * b * ts * (4 * d * d + 2 * d * ff) + 4 * b * ts * ts * d)
    dec = cfg.dec_layers * (
        2 * b * tt * (4 * d * d + 2 * d * ff) + 2 * b * (tt + ts) * 2 * d * d + 4 * b * tt * (tt + ts) * d
    )
    out = 2 * b * tt * d * v
    return 3.0 * (enc + dec + out)


def run(kind: str, cfg: ModelConfig, data, bf16: bool) -> float:
    torch.manual_seed(0)
    model = for_training(Transformer(cfg)) if kind == "mt" else TorchTransformer(cfg)  # mt: as mt train builds it
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(src, tgt):
        tgt_in = torch.cat([torch.full((tgt.size(0), 1), BOS), tgt[:, :-1]], 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if kind == "mt":
                loss = linear_cross_entropy(model.hidden(src, tgt_in), model.output_weight, tgt, PAD, 0.1)
                loss = loss / tgt.numel()
            else:
                logits = model(src, tgt_in)
                loss = F.cross_entropy(
                    logits.flatten(0, 1).float(), tgt.flatten(), ignore_index=PAD, label_smoothing=0.1
                )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for src, tgt in data[:2]:  # warm-up
        step(src, tgt)
    tokens = 0
    start = time.perf_counter()
    for src, tgt in data[2:]:
        step(src, tgt)
        tokens += tgt.numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tokens", type=int, default=4096, help="target tokens per batch")
    p.add_argument("--prepared", type=Path, default=Path("data/prepared/multi30k.en-de"))
    p.add_argument("--rounds", type=int, default=2, help="alternate the two models this many times")
    args = p.parse_args()
    cfg = ModelConfig(
        d_model=256, n_heads=4, enc_layers=3, dec_layers=3, d_ff=1024, dropout=0.1,
        src_vocab_size=8000, tgt_vocab_size=8000, pad_id=PAD,
    )  # fmt: skip
    data = batches(args.steps + 2, args.tokens, args.prepared)
    flops = sum(model_flops(cfg, s, t) for s, t in data[2:]) / args.steps
    tokens_per_step = sum(t.numel() for _, t in data[2:]) / args.steps
    print(f"3+3 layers, d_model 256, FFN 1024, 4 heads, vocab 8000; {tokens_per_step:.0f} target tokens/step")
    print(
        f"model FLOPs per training step: {flops / 1e9:.1f} GFLOP; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'precision':<10}{'peak GFLOP/s':>14}{'nn.Transformer tok/s':>22}{'mt tok/s':>10}"
        f"{'mt / nn':>9}{'MFU nn':>8}{'MFU mt':>8}"
    )
    bf16_ratio = bf16_speedup(n=256)
    for name, bf16 in (("fp32", False), ("bf16", True)):
        if bf16 and bf16_ratio < BF16_USABLE:  # an AVX2-only CPU: bfloat16 ~400x slower, a round would take hours
            print(f"bf16 left out: bfloat16 products run at {bf16_ratio:.2g}x float32's speed on this CPU")
            continue
        peak = matmul_peak(torch.bfloat16 if bf16 else torch.float32)
        results = {"nn": [], "mt": []}
        for _ in range(args.rounds):  # interleaved, so that machine noise hits both
            for kind in ("nn", "mt"):
                results[kind].append(run(kind, cfg, data, bf16))
        nn_tps, mt_tps = max(results["nn"]), max(results["mt"])
        mfu = {k: v * flops / tokens_per_step / peak for k, v in (("nn", nn_tps), ("mt", mt_tps))}
        print(
            f"{name:<10}{peak / 1e9:>14.0f}{nn_tps:>22.0f}{mt_tps:>10.0f}{mt_tps / nn_tps:>8.2f}x"
            f"{mfu['nn']:>8.0%}{mfu['mt']:>8.0%}"
        )


if __name__ == "__main__":
    main()
