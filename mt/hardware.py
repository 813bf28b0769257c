"""What this machine's CPU can do: oneDNN's paths and measured matrix-product speeds.

``train.precision: auto`` asks ``bf16_speedup`` whether bfloat16 pays here,
``mt translate`` asks ``fast_bf16`` before it decodes in bfloat16 on a CPU,
and the benchmarks take their peaks from ``matmul_peak``.
"""

from __future__ import annotations

import platform
import time

import torch

#: PyTorch exposes oneDNN's linear layers (with prepacked weights) on x86 CPUs
ONEDNN = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)
#: oneDNN's bfloat16 products need AVX-512 (or newer); on an AVX2-only CPU it
#: cannot build them at all ("could not create a primitive descriptor")
ONEDNN_BF16 = (
    ONEDNN and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)

BF16_USABLE = 0.25  #: below this bf16_speedup, no fast bfloat16 path: benchmarks leave bf16 out, translate warns


def cpuinfo(field: str) -> str:
    """A field of the first CPU in /proc/cpuinfo ("model name", "flags"); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


#: The CPU multiplies and adds int8 in one instruction (AVX512-VNNI or AVX-VNNI):
#: there every linear layer decodes faster in int8 (mt/decode/int8.py)
VNNI = bool(set(cpuinfo("flags").split()) & {"avx512_vnni", "avx_vnni"})


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5, onednn: bool = True) -> float:
    """FLOP/s of an n x n matrix product in ``dtype`` on this CPU: the faster
    of PyTorch's BLAS (``torch.mm``) and the oneDNN path, best of ``reps``.
    The benchmarks' peak for speed ceilings; ``onednn=False``: ``torch.mm``
    alone, the path that training's products take."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    products = [lambda: a @ b]
    if ONEDNN and onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and ONEDNN_BF16)):
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def bf16_speedup(n: int = 2048, reps: int = 3) -> float:
    """How many times as fast an n x n matrix product runs in bfloat16 as in
    float32 on this CPU (``torch.mm``, the products that training runs in each
    precision). A CPU with no fast bfloat16 path gives itself away on a
    256 x 256 product first (there the n x n measurement would take minutes).
    Leaves the RNG as it was."""

    def ratio(size: int, repeats: int) -> float:
        return matmul_peak(torch.bfloat16, size, repeats, onednn=False) / matmul_peak(
            torch.float32, size, repeats, onednn=False
        )

    with torch.random.fork_rng():
        quick = ratio(256, 2)
        return quick if quick < BF16_USABLE or n <= 256 else ratio(n, reps)


def fast_bf16() -> bool:
    """Whether this CPU has a fast bfloat16 path (``bf16_speedup`` on a
    256 x 256 product, a fraction of a second): where it has none, bfloat16
    runs hundreds of times slower than float32."""
    return bf16_speedup(n=256) >= BF16_USABLE
