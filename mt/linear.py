"""Linear layers that run inference through oneDNN on x86 CPUs.

On CPU, ``F.linear`` in float32 goes to the BLAS PyTorch ships with (MKL). On
the AMD EPYC machines with AVX-512 we develop on, oneDNN's float32 matrix
products were 1.3-2.3x faster at decoding shapes (64-960 rows, 256-8000
columns; see docs/results.md, Decoding speed) and somewhat faster in bfloat16 too. PyTorch
only exposes that path as a private operator without a backward, so it serves
inference only: no gradient needed, no autocast, a CPU tensor in float32 or
bfloat16. Everything else (training, CUDA, other CPUs) takes ``F.linear``, and
so do small weights on AVX2-only CPUs (``SMALL_WEIGHT``). Results agree with
``F.linear`` to float rounding (tests).
"""

from __future__ import annotations

import platform
import threading
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ONEDNN = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)
use_onednn = _ONEDNN  #: set to False to measure or rule out the oneDNN path
# oneDNN's bfloat16 products need AVX-512 (or newer); on an AVX2-only CPU it
# cannot build them at all ("could not create a primitive descriptor")
_ONEDNN_BF16 = (
    _ONEDNN and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


#: Weights of at most this many entries take ``F.linear`` even where oneDNN
#: applies. On an AVX2-only AMD EPYC, oneDNN's fixed cost per call (~27 us
#: against ~5 us for ``F.linear``) outweighed its faster kernel for small
#: weights: with the 128 x 128 to 256 x 128 products of the multi30k_cpu.yaml
#: model on ``F.linear`` (its 128 x 8000 output projection still on oneDNN)
#: that model decoded 1.16-1.23x as fast greedy and 1.05-1.11x with beam 5, the
#: same output; the benchmark's d_model 256 model (256 x 256) neither gained
#: nor lost (docs/results.md, Decoding speed). On AVX-512 CPUs, where oneDNN was
#: measured 1.3-2.3x faster at 256 columns and more, every product stays on it.
SMALL_WEIGHT = 65536 if _ONEDNN and torch.backends.cpu.get_cpu_capability() == "AVX2" else 0


def _onednn_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _ONEDNN_BF16)


def _onednn_applies(x: Tensor, weight: Tensor) -> bool:
    return (
        use_onednn
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and _onednn_dtype(x.dtype)
        and weight.numel() > SMALL_WEIGHT
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")
    )


def _version_key(tensors: list[Tensor]) -> tuple | None:
    """What tells whether tensors changed since a cache was made from them:
    storage, in-place version, dtype and shape. None for inference tensors,
    which keep no version counter: nothing made from them may be cached."""
    key = []
    for t in tensors:  # a plain loop: this runs before every product of a decoding step
        if t.is_inference():
            return None
        key.append((t.data_ptr(), t._version, t.dtype, t.shape))
    return tuple(key)


# Remaking a packed or stacked weight happens under this lock: decoding
# threads (mt.inference.Translator's workers) share one model, and its first
# batches would otherwise race to make them. Once made, reads take no lock.
_REMAKE = threading.Lock()


class PackedWeight:
    """A weight reordered once into oneDNN's blocked layout (10-25% faster
    products than handing oneDNN the plain weight at every call), remade
    whenever the weight changes (new storage, dtype or an in-place update).
    Not part of any state dict; copies and pickles start empty."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tensor: Tensor | None = None

    def get(self, weight: Tensor, rows: int) -> Tensor:
        key = _version_key([weight])
        if key is None:
            return weight
        if key != self.key:
            with _REMAKE:
                if key != self.key:
                    self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
                    self.key = key  # after the tensor: a reader that sees the key finds its tensor
        return self.tensor

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"key": None, "tensor": None}


class StackedWeight:
    """The weights and biases of several linear maps of the same input,
    stacked into one (sum of D_out, D_in) matrix so that inference runs one
    product in place of several (self-attention's queries, keys and values).
    Remade whenever a part changes, like ``PackedWeight``, and packed for
    oneDNN alongside. Not part of any state dict; copies and pickles start empty."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self.packed = PackedWeight()

    def __call__(self, x: Tensor, parts: list[nn.Linear]) -> Tensor:
        """x: (..., D_in) -> (..., sum of the parts' D_out), the parts' outputs side by side."""
        key = _version_key([t for p in parts for t in (p.weight, p.bias) if t is not None])
        if key is None:  # inference tensors: restacked at every call, nothing kept
            weight, bias = _stack(parts)
            return linear(x, weight, bias)
        if key != self.key:
            with _REMAKE:
                if key != self.key:
                    self.weight, self.bias = _stack(parts)
                    self.key = key
        return linear(x, self.weight, self.bias, packed=self.packed)

    def __deepcopy__(self, memo) -> StackedWeight:
        return StackedWeight()

    def __getstate__(self) -> dict:
        return StackedWeight().__dict__


def _stack(parts: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The parts' weights one above the other, and their biases (zeros for a
    part without one; None if none has one)."""
    # an ordinary tensor even under torch.inference_mode (as search runs),
    # so that a packed copy can be keyed on its version counter
    with torch.inference_mode(False):
        weight = torch.cat([p.weight.detach() for p in parts])
        biases = [p.weight.new_zeros(p.out_features) if p.bias is None else p.bias.detach() for p in parts]
        return weight, torch.cat(biases) if any(p.bias is not None for p in parts) else None


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False, packed: PackedWeight | None = None
) -> Tensor:
    """``F.linear(x, weight, bias)``, followed by ReLU if ``relu``. x: (..., D_in) -> (..., D_out).
    ``packed`` keeps the weight in oneDNN's layout between calls."""
    if _onednn_applies(x, weight):
        w = packed.get(weight, max(1, x.numel() // x.size(-1))) if packed is not None else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "relu" if relu else "none", [], "")
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``mt.linear.linear``, with its packed
    weight: same parameters and state dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        return linear(x, self.weight, self.bias, relu, self.packed)


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5, onednn: bool = True) -> float:
    """FLOP/s of an n x n matrix product in ``dtype`` on this CPU: the faster
    of PyTorch's BLAS (``torch.mm``) and the oneDNN path, best of ``reps``.
    The benchmarks' peak for MFU and speed ceilings; ``onednn=False``:
    ``torch.mm`` alone, the path that training's products take."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    products = [lambda: a @ b]
    if _ONEDNN and onednn and _onednn_dtype(dtype):
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


BF16_USABLE = 0.25  #: below this bf16_speedup, no fast bfloat16 path: benchmarks leave bf16 out, translate warns


def bf16_speedup(n: int = 2048, reps: int = 3) -> float:
    """How many times as fast an n x n matrix product runs in bfloat16 as in
    float32 on this CPU (``torch.mm``, the products that training runs in each
    precision). A CPU with no fast bfloat16 path gives itself away on a
    256 x 256 product first: on an AVX2-only EPYC, bfloat16 ran at 0.3 GFLOP/s
    against 130 in float32, and the n x n measurement would take minutes.
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
