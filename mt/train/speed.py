"""The speed tricks training applies to the textbook model, and only these.

``for_training(model)`` swaps, in place, the classes of two kinds of module
for subclasses that compute the same thing faster on a CPU (parameters and
state dict unchanged, as ``mt.decode.fastpath.speed_up`` does for decoding):

* dropout draws its mask with ``torch.rand`` (inverted dropout, as
  ``nn.Dropout``), faster on a CPU than the Bernoulli sampler
  that ``F.dropout`` uses;
* attention's softmax over rows of fewer than 16 keys runs over the
  transposed scores (``mt.decode.fastpath.softmax``), where PyTorch's CPU
  kernel is faster; the values are the same to float rounding.

The textbook modules (``mt.model``) know nothing of either.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.decode.fastpath import softmax
from mt.model.attention import MultiHeadAttention, keyless_rows_see_all


class RandDropout(nn.Dropout):
    """Inverted dropout: zero each element with probability p, scale the rest by 1 / (1 - p)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape, device=x.device) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


class TrainingAttention(MultiHeadAttention):
    """Multi-head attention whose explicit path takes the short-row softmax."""

    def attend(self, q, k, v, mask, need_weights, temperature):
        if need_weights or q.size(0) != k.size(0) or self.use_fused(q.device):
            return super().attend(q, k, v, mask, need_weights, temperature)
        dropout = self.dropout if self.training else 0.0
        # mt.model.attention.scaled_dot_product_attention, step for step, with the faster softmax
        scores = q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) * temperature)  # (B, H, T_q, T_k)
        if mask is None:
            weights = softmax(scores)
        else:
            mask, has_key = keyless_rows_see_all(mask)
            weights = softmax(scores.masked_fill(~mask, float("-inf"))) * has_key
        return (F.dropout(weights, dropout) if dropout else weights) @ v, None


def for_training(model: nn.Module) -> nn.Module:
    """``model`` with training's speed tricks, in place; returns it."""
    for module in model.modules():
        if type(module) is nn.Dropout:
            module.__class__ = RandDropout
        elif type(module) is MultiHeadAttention:
            module.__class__ = TrainingAttention
    return model
