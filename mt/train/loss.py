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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mt.data.batches import Batch
    from mt.model.transformer import Transformer


def _smoothed_nll(logits: Tensor, y: Tensor, valid: Tensor, smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy of the valid rows of ``logits`` (n, V), and their logsumexp."""
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, y[:, None])[:, 0]
    smooth = lse - logits.mean(dim=-1)  # mean over classes of -log p
    return (((1.0 - smoothing) * nll + smoothing * smooth) * valid).sum(), lse


def _smoothed_nll_grad_(grad: Tensor, y: Tensor, valid: Tensor, smoothing: float) -> Tensor:
    """In place: ``grad`` (softmax plus any other term) minus the smoothed one-hot target,
    ``(1 - eps) onehot(y) + eps / V``, zero for ignored rows: the gradient with respect to the logits."""
    grad.sub_(smoothing / grad.size(-1))
    grad.scatter_add_(1, y[:, None], torch.full_like(valid[:, None], smoothing - 1.0, dtype=grad.dtype))
    return grad.mul_(valid[:, None])


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index: int, smoothing: float, chunk: int):
        # hidden: (N, D), weight: (V, D), target: (N,)
        n = hidden.size(0)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=loss.dtype) if need_grad else None
        for start in range(0, n, chunk):
            h, y = hidden[start : start + chunk], target[start : start + chunk]
            logits = (h @ weight.t()).to(loss.dtype)  # (n_c, V), at least float32
            valid = (y != ignore_index).float()
            chunk_loss, lse = _smoothed_nll(logits, y, valid, smoothing)
            loss += chunk_loss
            if need_grad:
                grad = _smoothed_nll_grad_(logits.sub_(lse[:, None]).exp_(), y, valid, smoothing).to(weight.dtype)
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


class _LinearRDropCrossEntropy(torch.autograd.Function):
    """Two dropout passes over the same targets: both cross-entropies plus
    ``alpha`` times their symmetric KL, chunk by chunk like the class above."""

    @staticmethod
    def forward(ctx, hidden_a, hidden_b, weight, target, ignore_index: int, smoothing: float, alpha: float, chunk: int):
        n = hidden_a.size(0)
        dtype = torch.promote_types(hidden_a.dtype, torch.float32)
        ce = torch.zeros((), dtype=dtype, device=hidden_a.device)
        kl = torch.zeros_like(ce)
        grad_a, grad_b = torch.empty_like(hidden_a), torch.empty_like(hidden_b)
        grad_weight = torch.zeros_like(weight, dtype=dtype)
        for start in range(0, n, chunk):
            ha, hb, y = hidden_a[start : start + chunk], hidden_b[start : start + chunk], target[start : start + chunk]
            valid = (y != ignore_index).to(dtype)
            logp = []
            for h in (ha, hb):
                logits = (h @ weight.t()).to(dtype)
                chunk_loss, lse = _smoothed_nll(logits, y, valid, smoothing)
                ce += chunk_loss
                logp.append(logits.sub_(lse[:, None]))  # log-probabilities, in place
            log_ratio = logp[0] - logp[1]  # log p_a - log p_b
            p_a, p_b = logp[0].exp_(), logp[1].exp_()  # the log-probabilities are not needed any more
            kl_ab = (p_a * log_ratio).sum(-1)  # KL(p_a || p_b) per row
            kl_ba = -(p_b * log_ratio).sum(-1)
            kl += (0.5 * (kl_ab + kl_ba) * valid).sum()
            # d/dz_a of KL(a||b) + KL(b||a) = p_a * (log_ratio - KL(a||b)) + p_a - p_b; the same for b
            # with log_ratio, KL and the difference negated
            diff = p_a - p_b
            ga = p_a * (log_ratio - kl_ab[:, None]) + diff
            gb = p_b * (-log_ratio - kl_ba[:, None]) - diff
            for g, p, h, out in ((ga, p_a, ha, grad_a), (gb, p_b, hb, grad_b)):
                g = _smoothed_nll_grad_(g.mul_(0.5 * alpha).add_(p), y, valid, smoothing).to(weight.dtype)
                out[start : start + chunk] = g @ weight
                grad_weight += g.t() @ h.to(weight.dtype)
        ctx.save_for_backward(grad_a, grad_b, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(kl)
        return ce + alpha * kl, kl

    @staticmethod
    def backward(ctx, grad_loss, grad_kl):
        grad_a, grad_b, grad_weight = ctx.saved_tensors
        return (
            grad_a * grad_loss,
            grad_b * grad_loss,
            (grad_weight * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_rdrop_cross_entropy(
    hidden_a: Tensor,
    hidden_b: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float = 0.0,
    alpha: float = 1.0,
    chunk: int = 512,
) -> tuple[Tensor, Tensor]:
    """R-Drop (Liang et al. 2021): the loss of two passes of one batch with different dropout.

    ``hidden_a`` and ``hidden_b``: (..., D), the decoder states of the two passes for the same ``target``.
    Returns the summed label-smoothed cross-entropy of both passes plus ``alpha`` times the summed
    symmetric KL, ``sum(KL(p_a||p_b) + KL(p_b||p_a)) / 2`` over non-ignored rows, and that KL alone
    (not differentiable; for logging). Gradients flow into both passes, as in the paper's code.
    """
    d = hidden_a.size(-1)
    return _LinearRDropCrossEntropy.apply(
        hidden_a.reshape(-1, d),
        hidden_b.reshape(-1, d),
        weight,
        target.reshape(-1),
        ignore_index,
        label_smoothing,
        alpha,
        chunk,
    )


def token_loss(model: Transformer, batch: Batch, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed token cross-entropy of ``model`` on ``batch`` (teacher forcing) over
    non-pad targets, and the token count."""
    states = model.hidden(batch.src, batch.tgt_in)  # (B, T_t, D)
    loss = linear_cross_entropy(states, model.output_weight, batch.tgt_out, model.cfg.pad_id, label_smoothing)
    return loss, batch.tgt_mask.sum()
