import pytest
import torch
import torch.nn.functional as F

from mt.loss import linear_cross_entropy


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_equals_projection_then_cross_entropy(smoothing, chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    y[1, 3:] = 0  # padding, ignored
    loss = linear_cross_entropy(h, w, y, ignore_index=0, label_smoothing=smoothing, chunk=chunk)
    (2.5 * loss).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(
        (h2 @ w2.T).flatten(0, 1), y.flatten(), ignore_index=0, label_smoothing=smoothing, reduction="sum"
    )
    (2.5 * ref).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_without_grad():
    h, w, y = torch.randn(4, 3), torch.randn(6, 3), torch.tensor([1, 2, 0, 5])
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, ignore_index=0)
    ref = F.cross_entropy(h @ w.T, y, ignore_index=0, reduction="sum")
    torch.testing.assert_close(loss, ref)
