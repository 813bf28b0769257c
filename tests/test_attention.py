import copy
import math

import numpy as np
import pytest
import torch

from mt.decode.fastpath import softmax as fast_softmax
from mt.decode.fastpath import speed_up
from mt.inspect.capture import attention_stats
from mt.model.attention import KV, MultiHeadAttention, scaled_dot_product_attention
from mt.model.masks import causal_mask, lengths_mask, padding_mask
from mt.train.speed import TrainingAttention, for_training


def numpy_attention(q, k, v, mask, temperature=1.0):
    """The chapter's formula from scratch, float64."""
    d_k = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / (math.sqrt(d_k) * temperature)
    mask = np.broadcast_to(mask, scores.shape)
    scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(scores - row_max), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return weights @ v, weights


def random_case(gen, b, h, t_q, t_k, d, causal):
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for t in (t_q, t_k, t_k))
    lengths = torch.randint(1, t_k + 1, (b,), generator=gen)
    mask = lengths_mask(lengths, t_k)  # (B, 1, 1, T_k)
    if causal:
        mask = mask & causal_mask(t_q, t_k)
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_explicit_matches_numpy_reference(seed, causal):
    gen = torch.Generator().manual_seed(seed)
    b, h, t_q, d = (int(x) for x in torch.randint(1, 7, (4,), generator=gen))
    t_k = t_q if causal else int(torch.randint(1, 9, (1,), generator=gen))
    q, k, v, mask = random_case(gen, b, h, t_q, t_k, d, causal)
    for temperature in (1.0, 0.5, 3.0):
        out, w = scaled_dot_product_attention(q, k, v, mask, temperature)
        ref_out, ref_w = numpy_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), temperature)
        np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-12, atol=1e-12)


def test_masked_keys_get_exactly_zero_and_rows_sum_to_one():
    gen = torch.Generator().manual_seed(0)
    q, k, v, mask = random_case(gen, 3, 2, 5, 5, 8, causal=True)
    _, w = scaled_dot_product_attention(q, k, v, mask)
    full = mask.expand_as(w)
    assert torch.all(w[~full] == 0)
    sums = w.sum(-1)
    live = full.any(-1)
    torch.testing.assert_close(sums[live], torch.ones_like(sums[live]))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    mask[0, :, 1] = False  # query row with nothing to attend to
    mask[1] = False  # a whole sequence of them
    out, w = scaled_dot_product_attention(q, k, v, mask)
    assert torch.all(w[0, :, 1] == 0) and torch.all(out[0, :, 1] == 0)
    assert torch.all(w[1] == 0) and torch.all(out[1] == 0)
    assert not torch.isnan(out).any()
    (out.sum() + w.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[1] == 0)


def test_temperature_direction():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 6, 16, generator=gen) for _ in range(3))
    entropy = {}
    for t in (0.25, 1.0, 4.0):
        _, w = scaled_dot_product_attention(q, k, v, temperature=t)
        entropy[t] = -(w * w.log()).sum(-1).mean().item()
    # A larger temperature (larger denominator) flattens: entropy rises.
    assert entropy[0.25] < entropy[1.0] < entropy[4.0]


def test_gradcheck_explicit_attention():
    gen = torch.Generator().manual_seed(2)
    q, k, v, mask = random_case(gen, 2, 2, 3, 4, 5, causal=False)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, c: scaled_dot_product_attention(a, b, c, mask), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_fused_equals_explicit(causal):
    torch.manual_seed(3)
    mha = MultiHeadAttention(32, 4, impl="explicit").eval()
    fused = MultiHeadAttention(32, 4, impl="fused").eval()
    fused.load_state_dict(mha.state_dict())
    x = torch.randn(3, 7, 32)
    mask = padding_mask(torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 7]), pad_id=0)
    if causal:
        mask = mask & causal_mask(7)
    a = mha(x, x, mask)
    b = fused(x, x, mask)
    assert b.weights is None
    torch.testing.assert_close(a.output, b.output, rtol=1e-5, atol=1e-5)
    assert torch.all(a.output[2] == mha.w_o.bias)  # fully masked rows: zero before W_O
    # any request for weights takes the explicit path, also on a fused module
    c = fused(x, x, mask, need_weights=True)
    assert c.weights is not None
    torch.testing.assert_close(c.output, a.output)


def test_multi_head_equals_independent_single_heads():
    torch.manual_seed(4)
    d, h = 24, 3
    dh = d // h
    mha = MultiHeadAttention(d, h).eval()
    xq, xkv = torch.randn(2, 5, d), torch.randn(2, 6, d)
    mask = padding_mask(torch.tensor([[1] * 6, [1] * 3 + [0] * 3]), 0)
    res = mha(xq, xkv, mask, need_weights=True)
    heads, head_weights = [], []
    for i in range(h):
        rows = slice(i * dh, (i + 1) * dh)
        q = xq @ mha.w_q.weight[rows].T + mha.w_q.bias[rows]
        k = xkv @ mha.w_k.weight[rows].T + mha.w_k.bias[rows]
        v = xkv @ mha.w_v.weight[rows].T + mha.w_v.bias[rows]
        out, w = scaled_dot_product_attention(q, k, v, mask[:, 0])
        heads.append(out)
        head_weights.append(w)
    expected = torch.cat(heads, dim=-1) @ mha.w_o.weight.T + mha.w_o.bias
    torch.testing.assert_close(res.output, expected)
    torch.testing.assert_close(res.weights, torch.stack(head_weights, dim=1))
    assert res.weights.shape == (2, h, 5, 6)


def test_projections_are_xavier_uniform_not_zero():
    d = 64
    mha = MultiHeadAttention(d, 4)
    bound = math.sqrt(6 / (d + d))
    for lin in (mha.w_q, mha.w_k, mha.w_v, mha.w_o):
        w = lin.weight
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
        assert w.std() > 0.5 * bound / math.sqrt(3)


def test_fast_path_projects_self_attention_in_one_product():
    """Without gradients, on the fast path, self-attention stacks W_q, W_k, W_v into
    one product: same outputs and keys/values as the three separate products training uses."""
    torch.manual_seed(8)
    plain = MultiHeadAttention(16, 2).eval()
    mha = speed_up(copy.deepcopy(plain))
    x = torch.randn(2, 4, 16)
    mask = padding_mask(torch.tensor([[1] * 4, [1] * 3 + [0]]), 0) & causal_mask(4)
    separate = plain(x, x, mask)  # the textbook module: three products
    with torch.no_grad():
        stacked = mha(x, x, mask)
        step = mha(x[:, -1:], x[:, -1:], None, past=KV(separate.kv.k[:, :, :3], separate.kv.v[:, :, :3]))
        assert mha.w_qkv.made.value is not None and mha.w_qkv.made.value[0].shape == (48, 16)
        torch.testing.assert_close(stacked.output, separate.output, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stacked.kv.k, separate.kv.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stacked.kv.v, separate.kv.v, rtol=1e-5, atol=1e-5)
        full = mha(x[1:], x[1:], causal_mask(4)).output  # row 2's last position, all 4 keys allowed
        torch.testing.assert_close(step.output[1:], full[:, -1:], rtol=1e-5, atol=1e-5)
        mha.w_v.weight.mul_(-1.0)  # a changed part is restacked
        torch.testing.assert_close(mha(x, x, mask).kv.v, -separate.kv.v, rtol=1e-5, atol=1e-5)


def test_cached_kv_appends_and_reuses():
    torch.manual_seed(5)
    mha = MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 4, 16)
    full = mha(x, x, causal_mask(4)).output
    past = None
    steps = []
    for t in range(4):
        res = mha(x[:, t : t + 1], x[:, t : t + 1], None, past=past)
        past = res.kv
        steps.append(res.output)
    torch.testing.assert_close(torch.cat(steps, 1), full)
    # key_value=None attends to the given past as it is (cross-attention cache)
    again = mha(x, None, causal_mask(4), past=past).output
    torch.testing.assert_close(again, full)


def test_fast_path_cache_grows_in_place_and_a_second_continuation_copies():
    """On the fast path, decoding steps write their keys/values into the room the
    cache left (no copy of the whole cache per step); a second step from the same
    past must not overwrite the first one's position."""
    torch.manual_seed(9)
    mha = speed_up(MultiHeadAttention(16, 2)).eval()
    x, other = torch.randn(2, 6, 16), torch.randn(2, 1, 16)
    full = mha(x, x, causal_mask(6)).output

    def step(new, past):  # decoder self-attention: the new position is both query and key/value
        return mha(new, new, None, past=past)

    with torch.no_grad():
        past, stores = None, []
        for t in range(6):
            res = step(x[:, t : t + 1], past)
            torch.testing.assert_close(res.output, full[:, t : t + 1], rtol=1e-5, atol=1e-5)
            past = res.kv
            stores.append(past.store)
        assert stores[2] is not None and stores[3] is stores[2]  # position 3 went into position 2's room
        assert past.k.data_ptr() == past.store.k.data_ptr() and past.k.size(2) == 6
        past = None
        for t in range(3):  # a cache of 3 positions (with room), then two different 4th positions from it
            past = step(x[:, t : t + 1], past).kv
        assert past.store.k.size(2) > 3
        a = step(x[:, 3:4], past)
        b = step(other, past)
        assert a.kv.store is past.store and b.kv.store is not past.store  # b copied
        torch.testing.assert_close(a.kv.k[:, :, 3], mha(x, x, causal_mask(6)).kv.k[:, :, 3], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(a.kv.k[:, :, 3], b.kv.k[:, :, 3])
        again = step(x[:, 4:5], a.kv)  # a's cache is intact
        torch.testing.assert_close(again.output, full[:, 4:5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_grouped_queries_equal_repeated_keys(impl, fast):
    """B*G query rows against B key rows == each key row repeated G times."""
    torch.manual_seed(6)
    mha = MultiHeadAttention(16, 2, impl=impl).eval()
    mha = speed_up(mha) if fast else mha
    g, memory = 3, torch.randn(2, 5, 16)
    mask = padding_mask(torch.tensor([[1] * 5, [1] * 2 + [0] * 3]), 0)  # (2, 1, 1, 5)
    queries = torch.randn(2 * g, 4, 16)
    grouped = mha(queries, memory, mask, need_weights=True)
    repeat = torch.arange(2).repeat_interleave(g)
    expected = mha(queries, memory[repeat], mask[repeat], need_weights=True)
    torch.testing.assert_close(grouped.output, expected.output)
    torch.testing.assert_close(grouped.weights, expected.weights)
    assert grouped.kv.k.size(0) == 2  # the keys were projected for 2 rows, not 6
    # with cached source keys (key_value=None), as in decoding
    again = mha(queries[:, :1], None, mask, past=grouped.kv)
    torch.testing.assert_close(again.output, expected.output[:, :1])
    if impl == "fused":
        torch.testing.assert_close(mha(queries, memory, mask).output, expected.output)
    with pytest.raises(ValueError, match="evenly"):
        mha(torch.randn(5, 1, 16), memory, mask)
    if fast:  # one copy of the keys for G query rows: a mask per key row only
        with pytest.raises(ValueError, match="per key row"):
            mha(queries, memory, mask & causal_mask(4, 5))


def test_masks_shapes():
    tokens = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask(tokens, 0).shape == (2, 1, 1, 3)
    assert torch.equal(padding_mask(tokens, 0), lengths_mask(torch.tensor([2, 1]), 3))
    m = causal_mask(2, 4)
    assert m.shape == (1, 1, 2, 4)
    assert m[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_attention_stats():
    scores = torch.tensor([[[[0.0, 0.0], [5.0, -5.0], [1.0, 2.0]]]])  # (1, 1, 3, 2)
    mask = torch.tensor([[[[True, True], [True, True], [False, False]]]])
    weights = torch.softmax(scores, -1).masked_fill(~mask, 0.0)
    stats = attention_stats(weights, mask, scores)
    assert stats["zero_rows"].tolist() == [1]
    assert stats["nan_rows"].tolist() == [0]
    assert stats["score_max"].item() == 5.0 and stats["score_min"].item() == -5.0
    expected_entropy = (math.log(2) + 0.0) / 2  # uniform row and (almost) one-hot row
    assert stats["entropy"].item() == pytest.approx(expected_entropy, abs=1e-3)
    assert stats["norm_entropy"].item() == pytest.approx(0.5, abs=1e-3)
    assert stats["weight_max"].item() == pytest.approx((0.5 + 1.0) / 2, abs=1e-3)
    assert "score_min" not in attention_stats(weights, mask)


@pytest.mark.parametrize("t_q,t_k", [(1, 5), (7, 15), (3, 16), (2, 40)])
def test_short_rows_softmax_equals_torch(t_q, t_k):
    """Rows shorter than 16 keys take a transposed route (a faster CPU kernel) on the fast
    path and in training (``mt.train.speed``): the textbook weights and outputs."""
    torch.manual_seed(t_k)
    q, k, v = torch.randn(2, 3, t_q, 8), torch.randn(2, 3, t_k, 8), torch.randn(2, 3, t_k, 8)
    mask = torch.rand(2, 1, t_q, t_k) > 0.3
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, expected @ v, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast_softmax(scores).nan_to_num(0.0), expected, rtol=0, atol=1e-6)
    mha = MultiHeadAttention(24, 3)
    trained = for_training(copy.deepcopy(mha))
    assert type(trained) is TrainingAttention
    torch.testing.assert_close(trained.attend(q, k, v, mask, False, 1.0)[0], mha.attend(q, k, v, mask, False, 1.0)[0],
                               rtol=0, atol=1e-5)  # fmt: skip
