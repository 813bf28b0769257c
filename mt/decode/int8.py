"""``--dtype int8`` on a CPU: linear products through int8 weights.

Each weight is quantized per output row (one scale per row, its largest
magnitude mapped to 127) from the float32 weight the first time it is used,
and again if it changes: nothing is stored, no second model file. Each call's
inputs are quantized on the fly (one scale per call) by PyTorch's dynamic
int8 linear. Which products go int8 depends on the CPU, where each is
faster than float32 (docs/performance.md, "int8 on a CPU"):

* with VNNI (an int8 multiply-add in one instruction: AVX512-VNNI or
  AVX-VNNI), every product with a weight: the linear layers, the fast
  path's stacked Q/K/V product and the output projection;
* without VNNI, the output projection alone: the layers' products gain
  little there and lose at greedy batch sizes.

The attention core (Q·Kᵀ, softmax, weights·V), the norms and the search
stay float32. One scale per call for the inputs means that a sentence's
translation can depend on the other sentences of its batch (their largest
activation sets the scale): ``mt serve --dtype int8`` need not answer as
``mt translate --dtype int8`` does (docs/performance.md).
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.decode.fastpath import FastTransformer, MadeFrom, StackedWeight
from mt.hardware import VNNI
from mt.model.transformer import Transformer

# PyTorch's x86 engine takes fbgemm's kernels, the faster at the layers' shapes;
# oneDNN's are the faster for the output projection on a VNNI CPU, where
# fbgemm's is no faster than float32 (docs/performance.md).
LAYER_ENGINE = "x86"
OUTPUT_ENGINE = "onednn" if VNNI else "x86"
# Without VNNI, products of int8 pairs are summed in 16 bits first: activations
# keep 7 bits so that the sums cannot overflow
REDUCE_RANGE = not VNNI

# Prepacking sets the process-wide quantized engine for a moment; decoding
# threads (mt.decode.translator.Translator's workers) share one model.
_PACKING = threading.Lock()


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(V, D) float weight -> int8 weight (V, D) and the float scale of each row."""
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def _prepack(weights: list[Tensor], biases: list[Tensor | None], engine: str):
    weight = torch.cat([w.detach().float() for w in weights])
    bias = None
    if any(b is not None for b in biases):
        parts = [w.new_zeros(w.size(0)) if b is None else b.detach() for w, b in zip(weights, biases)]
        bias = torch.cat(parts).float()
    int8, scales = quantize_rows(weight)
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch, still supported
        warnings.simplefilter("ignore")
        zero = torch.zeros(int8.size(0), dtype=torch.long)
        q = torch._make_per_channel_quantized_tensor(int8, scales.double(), zero, 0)
        with _PACKING:
            previous = torch.backends.quantized.engine
            torch.backends.quantized.engine = engine  # the packed weight keeps its engine's kernels
            try:
                return torch.ops.quantized.linear_prepack(q, bias)
            finally:
                torch.backends.quantized.engine = previous


class Int8Product:
    """x (..., D_in) -> x Wᵀ + b (..., D_out), W and b the weights and biases it is
    called with, one above the other, W in int8: a copy ``MadeFrom`` them (made on
    the first call and again whenever they change; mt serve's decoding processes
    make their own)."""

    def __init__(self, engine: str):
        self.engine = engine
        self.made = MadeFrom()

    def __call__(self, x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
        tensors = [t for t in (*weights, *biases) if t is not None]
        packed = self.made.get(tensors, lambda: _prepack(weights, biases, self.engine))
        if packed is None:  # inference tensors: made at every call, nothing kept
            packed = _prepack(weights, biases, self.engine)
        flat = x.reshape(-1, x.size(-1)).float().contiguous()
        y = torch.ops.quantized.linear_dynamic(flat, packed, REDUCE_RANGE)
        return y.view(*x.shape[:-1], y.size(-1))


class Int8Linear(nn.Linear):
    """``nn.Linear`` in int8; ``relu=True`` applies ReLU to its output (the fast
    path's feed-forward block asks for it)."""

    int8: Int8Product

    def adopt(self) -> None:
        self.int8 = Int8Product(LAYER_ENGINE)

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        y = self.int8(x, [self.weight], [self.bias])
        return F.relu(y, inplace=True) if relu else y


class Int8StackedProduct:
    """The fast path's stacked Q/K/V product (``mt.decode.fastpath.StackedWeight``) in int8."""

    def __init__(self) -> None:
        self.int8 = Int8Product(LAYER_ENGINE)

    def __call__(self, x: Tensor, parts: list[nn.Linear]) -> Tensor:
        return self.int8(x, [p.weight for p in parts], [p.bias for p in parts])


class Int8Transformer(FastTransformer):
    """The Transformer with its output projection, states (..., D) -> logits (..., V),
    through an int8 copy of its weight."""

    int8_output: Int8Product

    def adopt(self) -> None:
        self.int8_output = Int8Product(OUTPUT_ENGINE)

    def project(self, states: Tensor) -> Tensor:
        return self.int8_output(states, [self.output_weight], [None])


def quantize(model: nn.Module, layers: bool | None = None) -> nn.Module:
    """``model`` (an ensemble too) decoding in int8, in place: its output projections,
    and with ``layers`` (default: where the CPU has VNNI) its linear layers and
    stacked Q/K/V products as well. Parameters and the state dict stay as they are."""
    layers = VNNI if layers is None else layers
    for module in model.modules():
        if isinstance(module, Transformer):
            module.__class__ = Int8Transformer
            module.adopt()
        elif layers and isinstance(module, nn.Linear):
            module.__class__ = Int8Linear
            module.adopt()
        if layers and isinstance(getattr(module, "w_qkv", None), StackedWeight):
            module.w_qkv = Int8StackedProduct()
    model.int8 = "layers and output" if layers else "output"
    return model
