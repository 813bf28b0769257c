import pytest
import torch
import torch.nn.functional as F

from mt.train.loss import linear_cross_entropy, linear_rdrop_cross_entropy


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


def _rdrop_reference(ha, hb, w, y, smoothing, alpha):
    """R-Drop's loss as its paper's code computes it, from full logits."""
    za, zb = (ha @ w.T).flatten(0, 1), (hb @ w.T).flatten(0, 1)
    ce = sum(
        F.cross_entropy(z, y.flatten(), ignore_index=0, label_smoothing=smoothing, reduction="sum") for z in (za, zb)
    )
    la, lb = za.log_softmax(-1), zb.log_softmax(-1)
    pad = (y.flatten() == 0)[:, None]
    kl_ab = F.kl_div(lb, la, log_target=True, reduction="none").masked_fill(pad, 0.0).sum()  # KL(p_a || p_b)
    kl_ba = F.kl_div(la, lb, log_target=True, reduction="none").masked_fill(pad, 0.0).sum()
    kl = (kl_ab + kl_ba) / 2
    return ce + alpha * kl, kl


@pytest.mark.parametrize("smoothing,alpha", [(0.0, 0.0), (0.1, 5.0)])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_rdrop_equals_full_logits_reference(smoothing, alpha, chunk):
    torch.manual_seed(0)
    ha = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    hb = (ha.detach() + 0.3 * torch.randn_like(ha)).requires_grad_()  # a second, different dropout pass
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(1, 11, (2, 5))
    y[1, 3:] = 0  # padding, ignored
    loss, kl = linear_rdrop_cross_entropy(ha, hb, w, y, 0, smoothing, alpha, chunk=chunk)
    (1.5 * loss).backward()
    copies = [t.detach().clone().requires_grad_() for t in (ha, hb, w)]
    ref, ref_kl = _rdrop_reference(*copies, y, smoothing, alpha)
    (1.5 * ref).backward()
    assert ref_kl > 0.1  # the passes differ, so the KL term is exercised
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(kl, ref_kl)
    for mine, theirs in zip((ha, hb, w), copies):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_rdrop_of_identical_passes_is_twice_the_cross_entropy():
    torch.manual_seed(1)
    h, w, y = torch.randn(7, 6), torch.randn(9, 6), torch.randint(0, 9, (7,))
    loss, kl = linear_rdrop_cross_entropy(h, h.clone(), w, y, 0, 0.1, alpha=5.0)
    assert kl.abs() < 1e-5
    torch.testing.assert_close(loss, 2 * linear_cross_entropy(h, w, y, 0, 0.1))
