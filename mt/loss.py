"""Label-smoothed cross-entropy fused with the output projection.

On a CPU the vocabulary projection and its softmax dominate a small
Transformer's training step: (tokens x vocab) logits are too large for the
caches, and every pass over them (log-softmax, smoothing, their backward)
costs memory bandwidth. ``linear_cross_entropy`` never materialises all the
logits: it walks over chunks of rows, and for each chunk computes the logits,
the loss and, when training, the gradients with respect to the hidden states
and the projection weight at once, while the chunk is still in cache.
The loss equals ``F.cross_entropy(h @ Wᵀ, y, ignore_index, label_smoothing,
reduction="sum")``; the tests check it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index: int, smoothing: float, chunk: int):
        # hidden: (N, D), weight: (V, D), target: (N,)
        n, vocab = hidden.size(0), weight.size(0)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=loss.dtype) if need_grad else None
        for start in range(0, n, chunk):
            h, y = hidden[start : start + chunk], target[start : start + chunk]
            logits = (h @ weight.t()).to(loss.dtype)  # (n_c, V), at least float32
            lse = torch.logsumexp(logits, dim=-1)  # (n_c,)
            valid = (y != ignore_index).float()
            nll = lse - logits.gather(1, y[:, None])[:, 0]
            smooth = lse - logits.mean(dim=-1)  # mean over classes of -log p
            loss += (((1.0 - smoothing) * nll + smoothing * smooth) * valid).sum()
            if need_grad:
                # d loss / d logits = softmax - (1 - eps) onehot(y) - eps / V, zero for ignored rows
                grad = logits.sub_(lse[:, None]).exp_().sub_(smoothing / vocab)
                grad.scatter_add_(1, y[:, None], torch.full_like(lse[:, None], smoothing - 1.0))
                grad.mul_(valid[:, None])
                grad = grad.to(weight.dtype)
                grad_hidden[start : start + chunk] = grad @ weight
                grad_weight += grad.t() @ h.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, label_smoothing: float = 0.0, chunk: int = 512
) -> Tensor:
    """Summed label-smoothed cross-entropy of ``hidden @ weight.T`` against ``target``.

    hidden: (..., D), weight: (V, D), target: (...) -> scalar (float32, or float64 for float64 inputs).
    Rows whose target is ``ignore_index`` add nothing.
    """
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), ignore_index, label_smoothing, chunk
    )
