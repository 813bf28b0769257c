"""int8 matrix products against float32 at the shapes of mt's decoding: the main
job's model (d_model 128, FFN 256) and the decoding benchmark's (d_model 256,
FFN 1024), an output vocabulary of 8,000; 64 rows = a greedy batch, 320 = a
beam-5 batch. Float32 is mt's fast path (``mt.decode.fastpath.linear``, oneDNN with a
packed weight where it applies); int8 is PyTorch's dynamic int8 linear
(per-row int8 weights, inputs quantized per call) under its x86 engine (fbgemm)
and its oneDNN engine, and its weight-only int8 product. What int8 can give
mt's decoding on the machine at hand, and which engine ``mt.decode.int8`` should use.

    python experiments/int8_products.py
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from mt.decode.fastpath import PackedWeight, linear
from mt.decode.int8 import REDUCE_RANGE, quantize_rows
from mt.hardware import VNNI, cpuinfo

SHAPES = {  # (out, in): the stacked Q/K/V, W_O, FFN in, FFN out, the output projection
    128: ((384, 128), (128, 128), (256, 128), (128, 256), (8000, 128)),
    256: ((768, 256), (256, 256), (1024, 256), (256, 1024), (8000, 256)),
}


def microseconds(f: Callable[[], object], n: int = 200) -> float:
    for _ in range(10):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


def prepack(w: Tensor, b: Tensor, engine: str):
    int8, scales = quantize_rows(w)
    q = torch._make_per_channel_quantized_tensor(int8, scales.double(), torch.zeros(w.size(0), dtype=torch.long), 0)
    torch.backends.quantized.engine = engine
    return torch.ops.quantized.linear_prepack(q, b)


def main() -> None:
    warnings.filterwarnings("ignore")  # quantized tensors are deprecated in PyTorch
    torch.manual_seed(0)
    simd = " ".join(sorted(f for f in cpuinfo("flags").split() if f.startswith(("avx", "amx"))))
    print(f"CPU: {cpuinfo('model name')}, VNNI: {VNNI}; {simd}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; reduce_range={REDUCE_RANGE}")
    print("| d_model | rows | weight | fp32 µs | x86 int8 µs | × | oneDNN int8 µs | × | weight-only int8 µs | × |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d, shapes in SHAPES.items():
        for rows in (64, 320):
            for out_f, in_f in shapes:
                w, b, x = torch.randn(out_f, in_f) * 0.05, torch.randn(out_f), torch.randn(rows, in_f)
                packed = PackedWeight()
                fp32 = microseconds(lambda: linear(x, w, b, packed=packed))  # noqa: B023 - timed at once
                times = []
                for engine in ("x86", "onednn"):
                    p = prepack(w, b, engine)
                    times.append(microseconds(lambda: torch.ops.quantized.linear_dynamic(x, p, REDUCE_RANGE)))  # noqa: B023
                int8, scales = quantize_rows(w)
                times.append(microseconds(lambda: torch._weight_int8pack_mm(x, int8, scales), n=10))  # noqa: B023
                cells = " | ".join(f"{t:.1f} | {fp32 / t:.2f}" for t in times)
                print(f"| {d} | {rows} | {out_f}×{in_f} | {fp32:.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
