"""int8 matrix products against float32 at the shapes of mt's decoding (d_model 128,
FFN 256, an output vocabulary of 8,000; 64 rows = a greedy batch, 320 = a beam-5
batch): PyTorch's dynamic int8 linear (per-channel int8 weights, activations
quantized per call) and its weight-only int8 product, each against ``F.linear``.
What int8 can give mt's decoding on the machine at hand.

    python experiments/int8_products.py
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((384, 128), (256, 128), (128, 256), (128, 128), (8000, 128))  # (out, in): QKV, FFN in/out, W_O, vocab


def microseconds(f: Callable[[], object], n: int = 200) -> float:
    for _ in range(10):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    warnings.filterwarnings("ignore")  # torch.quantize_per_channel warns that it is deprecated
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, quantized engine {torch.backends.quantized.engine}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print("| rows | weight | fp32 µs | dynamic int8 µs | × | weight-only int8 µs | × |\n|---|---|---|---|---|---|---|")
    for rows in (64, 320):
        for out_f, in_f in SHAPES:
            w, b, x = torch.randn(out_f, in_f) * 0.05, torch.randn(out_f), torch.randn(rows, in_f)
            scales = w.abs().amax(1) / 127
            zero = torch.zeros(out_f, dtype=torch.long)
            packed = torch.ops.quantized.linear_prepack(
                torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8), b
            )
            w_int8 = (w / scales[:, None]).round().to(torch.int8)
            fp32 = microseconds(lambda: F.linear(x, w, b))  # noqa: B023 - timed at once
            dynamic = microseconds(lambda: torch.ops.quantized.linear_dynamic(x, packed, True))  # noqa: B023
            weight_only = microseconds(lambda: torch._weight_int8pack_mm(x, w_int8, scales), n=20)  # noqa: B023
            print(f"| {rows} | {out_f}×{in_f} | {fp32:.1f} | {dynamic:.1f} | {fp32 / dynamic:.2f} | "
                  f"{weight_only:.1f} | {fp32 / weight_only:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
