import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from mt import linear as lin
from mt.linear import Linear, PackedWeight, StackedWeight, linear


@pytest.fixture(autouse=True)
def every_product_on_onednn(monkeypatch):
    """These tests' small weights would take F.linear on AVX2-only CPUs
    (``SMALL_WEIGHT``): send them to oneDNN, the path under test, everywhere."""
    monkeypatch.setattr(lin, "SMALL_WEIGHT", 0)


def test_small_weights_take_f_linear_where_so_configured(monkeypatch):
    monkeypatch.setattr(lin, "SMALL_WEIGHT", 16 * 8)
    torch.manual_seed(6)
    small, large, x = Linear(16, 8).eval(), Linear(16, 9).eval(), torch.randn(4, 16)
    with torch.no_grad():
        for layer in (small, large):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert small.packed.tensor is None  # never packed for oneDNN
    assert (large.packed.tensor is not None) == lin._ONEDNN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("relu", [False, True])
def test_linear_matches_f_linear(dtype, relu):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 32, dtype=dtype), torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
    expected = F.linear(x.float(), w.float(), b.float())
    expected = F.relu(expected) if relu else expected
    tol = 1e-4 if dtype == torch.float32 else 0.1
    packed = PackedWeight()
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the packed weight
            torch.testing.assert_close(linear(x, w, b, relu, packed).float(), expected, rtol=tol, atol=tol)
        strided = linear(x.transpose(0, 1), w, b, relu).float()
        torch.testing.assert_close(strided, expected.transpose(0, 1), rtol=tol, atol=tol)
        no_bias = F.linear(x.float(), w.float())
        torch.testing.assert_close(linear(x, w).float(), no_bias, rtol=tol, atol=tol)


def test_packed_weight_follows_weight_changes():
    torch.manual_seed(1)
    layer = Linear(16, 8).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2.0)  # in place: same storage, new version
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(layer(x), first)
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        half = layer.to(torch.bfloat16)
        torch.testing.assert_close(half(x.bfloat16()).float(), F.linear(x, layer.weight.float()), rtol=0.1, atol=0.1)
    clone = copy.deepcopy(layer)  # copies and pickles start with an empty pack
    assert clone.packed.tensor is None
    assert pickle.loads(pickle.dumps(layer)).packed.tensor is None


def test_stacked_weight_equals_its_parts_and_follows_them():
    torch.manual_seed(4)
    parts = [Linear(16, 8), Linear(16, 4, bias=False), Linear(16, 8)]
    stacked, x = StackedWeight(), torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(2):
            expected = torch.cat([p(x) for p in parts], dim=-1)
            torch.testing.assert_close(stacked(x, parts), expected, rtol=1e-5, atol=1e-5)
            parts[1].weight.add_(1.0)  # in place: the next call must restack
        assert not torch.allclose(stacked(x, parts)[:, 8:12], expected[:, 8:12])
        torch.testing.assert_close(stacked(x, parts)[:, 8:12], parts[1](x), rtol=1e-5, atol=1e-5)
    assert copy.deepcopy(stacked).weight is None
    assert pickle.loads(pickle.dumps(stacked)).weight is None


def test_weights_made_under_inference_mode_are_never_cached_stale():
    """Inference tensors carry no version counter: packing and stacking must
    not key a cache on one (search runs under torch.inference_mode)."""
    torch.manual_seed(5)
    with torch.inference_mode():
        parts = [Linear(16, 8).eval(), Linear(16, 8).eval()]
        stacked, x = StackedWeight(), torch.randn(3, 16)
        for _ in range(2):
            expected = torch.cat([F.linear(x, p.weight, p.bias) for p in parts], dim=-1)
            torch.testing.assert_close(stacked(x, parts), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(parts[0](x), expected[:, :8], rtol=1e-5, atol=1e-5)
            parts[0].weight.mul_(-1.0)  # in place, untracked


def test_training_path_has_gradients():
    torch.manual_seed(2)
    layer = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x, relu=True).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    assert layer.packed.tensor is None  # training never packs


def test_onednn_switch_gives_the_same_result(monkeypatch):
    torch.manual_seed(3)
    layer = Linear(32, 32).eval()
    x = torch.randn(10, 32)
    with torch.no_grad():
        fast = layer(x)
        monkeypatch.setattr(lin, "use_onednn", False)
        torch.testing.assert_close(layer(x), fast, rtol=1e-5, atol=1e-5)


def test_bfloat16_takes_f_linear_where_onednn_has_no_bfloat16(monkeypatch):
    """AVX2-only CPUs: oneDNN cannot build bfloat16 products at all, so they go to F.linear."""
    monkeypatch.setattr(lin, "_ONEDNN_BF16", False)
    torch.manual_seed(2)
    x, layer = torch.randn(4, 16, dtype=torch.bfloat16), Linear(16, 8).to(torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.packed.tensor is None  # nothing was packed for oneDNN
    assert lin.matmul_peak(torch.bfloat16, n=64, reps=1) > 0


@pytest.mark.parametrize(
    "bf16_flops, n, sizes",
    [(1e9, 2048, [256, 256]), (200e9, 2048, [256, 256, 2048, 2048]), (200e9, 256, [256, 256])],
)
def test_bf16_speedup_measures_large_products_only_where_bfloat16_is_fast(monkeypatch, bf16_flops, n, sizes):
    seen = []

    def peak(dtype, n, reps, onednn=True):
        seen.append(n)
        return bf16_flops if dtype == torch.bfloat16 else 100e9

    monkeypatch.setattr(lin, "matmul_peak", peak)
    assert lin.bf16_speedup(n) == bf16_flops / 100e9
    assert seen == sizes  # the quick 256 x 256 check (bfloat16 and float32) is never repeated
    assert lin.fast_bf16() == (bf16_flops / 100e9 >= lin.BF16_USABLE)
