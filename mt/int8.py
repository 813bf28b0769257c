"""``--dtype int8`` on a CPU: the output projection in int8.

The (V, D) output projection is the largest product of a decoding step. Its
weight is quantized once, per output row (one scale per vocabulary entry,
the largest magnitude mapped to 127), and each step's states are quantized
on the fly (one scale per call) by PyTorch's dynamic int8 linear on the x86
engine (fbgemm/oneDNN). The layers' own products stay float32: at the
model's widths int8 gains them at most 1.25× and loses up to 1.8× at
greedy batch sizes (``experiments/int8_products.py``; docs/results.md,
"Export to CTranslate2"), while the output projection gains 1.6-1.8×. The
attention core and the search are unchanged, and nothing is stored: the
quantized weight is made from the float32 one when the model is loaded.
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch import Tensor, nn

from mt.model import OutputProjection


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(V, D) float weight -> int8 weight (V, D) and the float scale of each row."""
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


class Int8OutputProjection(OutputProjection):
    """States (..., D) -> logits (..., V) through the int8 copy of the weight it is
    given, made on the first call (and again if that weight changes)."""

    def adopt(self) -> None:
        self._lock = threading.Lock()  # decoding workers share the model
        self._packed, self._source = None, None

    def _packed_for(self, weight: Tensor):
        source = (weight.data_ptr(), weight._version)
        with self._lock:
            if self._source != source:
                int8, scales = quantize_rows(weight.detach().float())
                with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch, still supported
                    warnings.simplefilter("ignore")
                    zero = torch.zeros(int8.size(0), dtype=torch.long)
                    q = torch._make_per_channel_quantized_tensor(int8, scales.double(), zero, 0)
                    self._packed = torch.ops.quantized.linear_prepack(q, None)
                self._source = source
            return self._packed

    def __getstate__(self) -> dict:  # a copy (mt serve's decoding processes) makes its own int8 weight
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_packed", "_source")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.adopt()

    def forward(self, states: Tensor, weight: Tensor) -> Tensor:
        packed = self._packed_for(weight)
        flat = states.reshape(-1, states.size(-1)).float().contiguous()
        logits = torch.ops.quantized.linear_dynamic(flat, packed, True)  # reduce_range: no overflow without VNNI
        return logits.view(*states.shape[:-1], logits.size(-1))


def quantize(model: nn.Module) -> nn.Module:
    """Every output projection of ``model`` (an ensemble's too) in int8, in place."""
    for module in model.modules():
        if isinstance(module, OutputProjection):
            module.__class__ = Int8OutputProjection
            module.adopt()
    model.int8 = True
    return model
