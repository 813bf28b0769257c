"""Decoding's fast path: the model's own computations, rearranged for speed.

``speed_up(model)`` turns a plain ``Transformer`` (or an ensemble of them)
into one that decodes faster and gives the same results to float rounding;
its parameters and state dict stay as they are. ``mt.decode.inference.load``
applies it to every model it loads, and training to the copy it validates
with. It is for decoding only: its modules run without gradients (every
search runs under ``torch.inference_mode``), while training runs the
textbook modules (``mt.train.speed`` has the two tricks training uses).

* Linear layers and the output projection run through oneDNN on x86 CPUs
  (faster than MKL's at decoding shapes) with their weights packed once into
  oneDNN's blocked layout, and with ReLU fused into the feed-forward
  product. Everything else (CUDA, other CPUs, bfloat16 where oneDNN has
  none, small weights) takes ``F.linear``.
* Self-attention projects Q, K and V in one product of stacked weights.
* Attention adds each mask as a bias of 0 and -inf to its scores, made once
  per mask for all the layers that share it, where the textbook path
  derives a fill from the mask again in every layer (same values). Its
  softmax over rows shorter than a vector register (16 floats) runs over
  the transposed scores, where PyTorch's CPU kernel is faster.
* Beams that share a source attend to one copy of its keys and values, their
  query rows side by side, where the textbook path repeats the keys for each.
* The decoder's key/value cache grows in place (room for more positions)
  instead of being copied at every step, and beam search's reordering of it
  is carried out by the next step's append, in one copy instead of two.
* A decoder layer's step (one new position against cached keys and values)
  runs on a (B, D) matrix, calling its submodules' ``forward`` directly and
  adding residuals in place: the layer's own operations, bit for bit, in
  fewer calls (it trims a step's fixed cost: small batches gain most).
* Search ranks a row's best entries by blocks (``top_k``, ``arg_max``):
  PyTorch's CPU ``topk`` and ``max`` scan a row element by element.

What each of these gains, measured: docs/performance.md.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.hardware import ONEDNN, ONEDNN_BF16
from mt.model.attention import KV, MultiHeadAttention, fused_attention, keyless_rows_see_all
from mt.model.layers import DecoderLayer, DecoderLayerOutput, FeedForward, LayerCache, Sublayer
from mt.model.transformer import Transformer

use_onednn = ONEDNN  #: set to False to measure or rule out the oneDNN path
lean_decoder_step = True  #: set to False to measure or rule out ``FastDecoderLayer``'s step

#: Weights of at most this many entries take ``F.linear`` even where oneDNN
#: applies: oneDNN's fixed cost per call outweighs its faster kernel for small
#: weights. The threshold is the largest weight that ``F.linear`` multiplies as
#: fast as oneDNN at decoding's row counts, per kind of CPU (docs/performance.md).
SMALL_WEIGHT = (65536 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 49152) if ONEDNN else 0


def _onednn_applies(x: Tensor, weight: Tensor) -> bool:
    return (
        use_onednn
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and ONEDNN_BF16))
        and weight.numel() > SMALL_WEIGHT
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


# Remaking a packed, stacked or int8 weight happens under this lock: decoding
# threads (mt.decode.translator.Translator's workers) share one model, and its
# first batches would otherwise race to make them. Once made, reads take no lock.
_REMAKE = threading.Lock()


class MadeFrom:
    """A value made from some tensors (a packed, stacked or int8 copy of weights),
    kept until they change: new storage, dtype, shape or an in-place update. Not
    part of any state dict; copies and pickles start empty."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value = None

    def get(self, tensors: list[Tensor], make):
        """The value made from ``tensors``: the kept one while they are unchanged, else
        ``make()``'s, kept. None where nothing may be kept: inference tensors keep no
        version counter, so a change to them could not be seen."""
        key = _version_key(tensors)
        if key is None:
            return None
        if key != self.key:
            with _REMAKE:
                if key != self.key:
                    self.value = make()
                    self.key = key  # after the value: a reader that sees the key finds its value
        return self.value

    def __deepcopy__(self, memo) -> MadeFrom:
        return MadeFrom()

    def __getstate__(self) -> dict:
        return {"key": None, "value": None}


class PackedWeight:
    """A weight reordered once into oneDNN's blocked layout (``MadeFrom`` it)."""

    def __init__(self) -> None:
        self.made = MadeFrom()

    def get(self, weight: Tensor, rows: int) -> Tensor:
        packed = self.made.get([weight], lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows))
        return weight if packed is None else packed


class StackedWeight:
    """The weights and biases of several linear maps of the same input,
    stacked into one (sum of D_out, D_in) matrix so that one product does the
    work of several (self-attention's queries, keys and values); ``MadeFrom``
    the parts, and packed alongside."""

    def __init__(self) -> None:
        self.made = MadeFrom()
        self.packed = PackedWeight()

    def __call__(self, x: Tensor, parts: list[nn.Linear]) -> Tensor:
        """x: (..., D_in) -> (..., sum of the parts' D_out), the parts' outputs side by side."""
        stacked = self.made.get([t for p in parts for t in (p.weight, p.bias) if t is not None], lambda: _stack(parts))
        if stacked is None:  # inference tensors: restacked at every call, nothing kept
            return linear(x, *_stack(parts))
        return linear(x, *stacked, packed=self.packed)


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
    ``packed`` keeps the weight in oneDNN's layout between calls. Every product of the
    fast path goes through here (``scripts/bench_decode.py`` counts them by replacing it)."""
    if _onednn_applies(x, weight):
        w = packed.get(weight, max(1, x.numel() // x.size(-1))) if packed is not None else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "relu" if relu else "none", [], "")
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


class PackedLinear(nn.Linear):
    """``nn.Linear`` through ``linear``, with its packed weight; ``relu=True`` fuses the activation."""

    packed: PackedWeight

    def adopt(self) -> None:
        self.packed = PackedWeight()

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        return linear(x, self.weight, self.bias, relu, self.packed)


class FastFeedForward(FeedForward):
    """The feed-forward block with ReLU fused into its first product."""

    def adopt(self) -> None:
        pass

    def forward(self, x: Tensor) -> Tensor:
        if self.activation is not F.relu:
            return super().forward(x)
        return self.w_2(self.dropout(self.w_1(x, relu=True)))  # (B, T, D)


class FastTransformer(Transformer):
    """The Transformer with its (V, D) output projection packed."""

    packed: PackedWeight

    def adopt(self) -> None:
        self.packed = PackedWeight()

    def project(self, states: Tensor) -> Tensor:
        return linear(states, self.output_weight, packed=self.packed)


class KVStore:
    """Key and value buffers (B, H, capacity, D_h) with room to grow: a
    cache's ``k`` and ``v`` are views of their first positions, so that the
    next decoding step writes its position in place instead of copying the
    whole cache as it appends. ``length`` is how many positions are claimed:
    a second step from the same, shorter cache must not overwrite what the
    first wrote, so it copies instead."""

    __slots__ = ("k", "v", "length")

    def __init__(self, k: Tensor, v: Tensor, length: int):
        self.k, self.v, self.length = k, v, length


class GrowingKV(NamedTuple):
    """A self-attention cache, (B, H, T_k, D_h) keys and values, as ``KV`` but:

    ``rows`` (R,), when set, is a reordering not yet carried out: the cache
    stands for ``k[rows]`` and ``v[rows]``; the next step carries it out while
    appending its position, in one copy of the cache instead of two (beam
    search reorders the whole cache at every step). ``store``, when set,
    holds ``k`` and ``v`` with room for more positions (``KVStore``).
    """

    k: Tensor
    v: Tensor
    rows: Tensor | None = None
    store: KVStore | None = None

    def select(self, rows: Tensor) -> GrowingKV:
        """The cache of batch rows ``rows`` (in that order), picked lazily."""
        return GrowingKV(self.k, self.v, rows if self.rows is None else self.rows[rows])

    def resolved(self) -> KV | GrowingKV:
        """The same cache with any pending reordering carried out."""
        if self.rows is None:
            return self
        return KV(self.k.index_select(0, self.rows), self.v.index_select(0, self.rows))

    def copied(self, capacity: int, rows: int = 0, drop: int = 0) -> KVStore:
        """The cache's positions from ``drop`` on, with any pending reordering carried
        out, copied into a new store with room for ``capacity`` positions, and ``rows``
        more batch rows of zeros after the cache's own."""
        k, v = self.k[:, :, drop:], self.v[:, :, drop:]
        b, h, t, _ = k.shape if self.rows is None else (self.rows.numel(), *k.shape[1:])
        store = KVStore(k.new_empty(b + rows, h, capacity, k.size(3)), v.new_empty(b + rows, h, capacity, v.size(3)), t)
        for old, buf in ((k, store.k), (v, store.v)):
            if self.rows is None:
                buf[:b, :, :t] = old
            else:
                torch.index_select(old, 0, self.rows, out=buf[:b, :, :t])
            if rows:
                buf[b:, :, :t] = 0
        return store

    def with_rows(self, rows: int, drop: int = 0) -> GrowingKV:
        """As ``KV.with_rows`` (rows of sentences that join a search under way), with
        any pending reordering carried out on the way: one copy of the cache, into
        a store with room for the next step's position."""
        store = self.copied(self.k.size(2) - drop + 1, rows, drop)
        return GrowingKV(store.k[:, :, : store.length], store.v[:, :, : store.length], None, store)

    def append(self, k: Tensor, v: Tensor) -> GrowingKV:
        """``torch.cat([self.k[self.rows], k], dim=2)``, and the same for v:
        (B_past, H, T, D_h), (B, H, T_new, D_h) -> (B, H, T + T_new, D_h).

        The result lies in a ``KVStore`` with room to grow: the new positions are
        written in place where this cache has room and nothing was appended to it
        yet; otherwise it is copied once into a new store: of twice the length, or
        of just the length when ``rows`` reorders it on the way."""
        t, n = self.k.size(2), k.size(2)
        store = self.store
        if self.rows is not None or store is None or store.length != t or t + n > store.k.size(2):
            # room only where the cache is not being reordered: beam search reorders
            # (copies) it at every step anyway, and its attention runs faster on a
            # cache without gaps
            store = self.copied(t + n if self.rows is not None else 2 * (t + n))
        store.k[:, :, t : t + n] = k
        store.v[:, :, t : t + n] = v
        store.length = t + n
        return GrowingKV(store.k[:, :, : t + n], store.v[:, :, : t + n], None, store)


class _MaskBiases(threading.local):
    """Per thread, the masks seen last and their biases: the layers of one
    forward pass share a self-attention and a cross-attention mask."""

    def __init__(self) -> None:
        self.recent: list[tuple[Tensor, torch.dtype, Tensor, Tensor | None]] = []


_BIASES = _MaskBiases()


def mask_bias(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """A boolean mask as a bias to add to the scores: 0 where a query may attend,
    -inf elsewhere, and 0 across a row with no key at all (the textbook rule:
    it sees every key and is zeroed after). Returns the bias and, if some row has
    no key, ``has_key`` (..., 1) to zero those rows with; None if every row has one.
    Kept for the last few masks (held, so that identity means the same mask; a
    mask changed in place after its first use would keep its old bias, and mt
    never changes one)."""
    for seen, seen_dtype, bias, has_key in _BIASES.recent:
        if seen is mask and seen_dtype == dtype:
            return bias, has_key
    allowed, has_key = keyless_rows_see_all(mask)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))
    found = (mask, dtype, bias, None if bool(has_key.all()) else has_key)
    _BIASES.recent = [found, *_BIASES.recent[:3]]
    return found[2:]


class FastMultiHeadAttention(MultiHeadAttention):
    """Multi-head attention with self-attention's three projections in one
    product, a ``GrowingKV`` cache, masks added as biases and the beams of a
    source attending to one copy of it; the textbook path wherever weights are
    asked for or in training mode (dropout)."""

    w_qkv: StackedWeight

    def adopt(self) -> None:
        self.w_qkv = StackedWeight()

    def project(self, query: Tensor, key_value: Tensor | None, past: KV | GrowingKV | None):
        if key_value is None:  # cross-attention: the source's keys and values, projected at the first step
            return self.split_heads(self.w_q(query)), past
        if key_value is query:  # self-attention
            b, t, _ = query.shape
            qkv = self.w_qkv(query, [self.w_q, self.w_k, self.w_v]).view(b, t, 3, self.n_heads, self.d_head)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D_h) each
            if past is None:
                return q, GrowingKV(k.contiguous(), v.contiguous())
        else:
            q = self.split_heads(self.w_q(query))
            k = self.split_heads(self.w_k(key_value)).contiguous()  # (B, H, T_new, D_h)
            v = self.split_heads(self.w_v(key_value)).contiguous()
            if past is None:  # cross-attention's first step: a cache that never grows
                return q, KV(k, v)
        if not isinstance(past, GrowingKV):
            past = GrowingKV(past.k, past.v)
        return q, past.append(k, v)

    def attend(self, q, k, v, mask, need_weights, temperature):
        if need_weights or self.training:
            return super().attend(q, k, v, mask, need_weights, temperature)
        groups = q.size(0) // k.size(0)  # G query rows per key row (beams sharing their source)
        if groups * k.size(0) != q.size(0):
            raise ValueError(f"{q.size(0)} query rows cannot share {k.size(0)} key/value rows evenly")
        if groups > 1:
            if mask is not None and (mask.size(-2) != 1 or mask.size(0) not in (1, k.size(0))):
                raise ValueError("grouped queries need a mask per key row without a query dimension")
            q = _group(q, groups)  # (B, H, G*T_q, D_h)
        if self.use_fused(q.device):
            out = fused_attention(q, k, v, mask, temperature)
        else:
            out = _attend(q, k, v, mask, math.sqrt(self.d_head) * temperature)
        return (_ungroup(out, groups) if groups > 1 else out), None  # (B*G, H, T_q, D_h)


def _group(x: Tensor, g: int) -> Tensor:
    """(B*G, H, T, X) -> (B, H, G*T, X): a key row's G query rows side by side."""
    bg, h, t, d = x.shape
    return x.view(bg // g, g, h, t, d).transpose(1, 2).reshape(bg // g, h, g * t, d)


def _ungroup(x: Tensor, g: int) -> Tensor:
    """(B, H, G*T, X) -> (B*G, H, T, X), the inverse of ``_group``."""
    b, h, gt, d = x.shape
    return x.view(b, h, g, gt // g, d).transpose(1, 2).reshape(b * g, h, gt // g, d)


def softmax(scores: Tensor) -> Tensor:
    """``torch.softmax(scores, dim=-1)``, the same values to float rounding. PyTorch's CPU
    kernel takes a slow path for rows shorter than a vector register (16 floats); such
    rows go through the transpose, a softmax over another dimension."""
    if scores.device.type == "cpu" and scores.size(-1) < 16:
        return torch.softmax(scores.transpose(-1, -2), dim=-2).transpose(-1, -2)
    return torch.softmax(scores, dim=-1)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q kᵀ / scale) v with ``mask`` added as a bias, zeroed in rows without a key: (..., T_q, D_h)."""
    scores = torch.matmul(q, k.transpose(-2, -1)).div_(scale)  # (..., T_q, T_k)
    if mask is None:
        return softmax(scores) @ v
    bias, has_key = mask_bias(mask, scores.dtype)
    out = softmax(scores.add_(bias)) @ v
    return out if has_key is None else out * has_key


_BLOCK = 64


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=1)`` (values and indices, best first) for long rows.

    On CPU, ``topk`` and ``max`` with indices scan a row element by element,
    while ``amax`` is vectorised. The k best entries of a row lie in the k blocks of 64
    with the largest maxima (a block outside them has k blocks above it, each
    holding an entry larger than any of its own), so only those k * 64
    entries are ranked. Ties may pick different (equal) entries than topk.
    """
    n, m = x.shape
    blocks = m // _BLOCK
    if x.device.type != "cpu" or blocks < 4 * k:
        return x.topk(k, dim=1)
    best = x[:, : blocks * _BLOCK].view(n, blocks, _BLOCK).amax(-1).topk(k, dim=1).indices  # (n, k)
    index = (best[:, :, None] * _BLOCK + torch.arange(_BLOCK, device=x.device)).view(n, k * _BLOCK)
    if blocks * _BLOCK < m:  # the short last block is always a candidate
        index = torch.cat([index, torch.arange(blocks * _BLOCK, m, device=x.device).expand(n, -1)], dim=1)
    values, pos = x.gather(1, index).topk(k, dim=1)
    return values, index.gather(1, pos)


def arg_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(dim=1)`` (values, first index of the maximum) by blocks, as ``top_k``."""
    n, m = x.shape
    blocks = m // _BLOCK
    if x.device.type != "cpu" or blocks < 4 or blocks * _BLOCK != m:
        return x.max(dim=1)
    grid = x.view(n, blocks, _BLOCK)
    block = grid.amax(-1).argmax(-1)  # (n,) the first block holding the maximum
    values, inner = grid[torch.arange(n, device=x.device), block].max(-1)
    return values, block * _BLOCK + inner


class FastDecoderLayer(DecoderLayer):
    """The decoder layer for what decoding runs at every step, one new position
    against cached keys and values, in fewer operations: the rows as a (B, D)
    matrix throughout, heads as views of it, each mask's bias made once for all
    layers, residuals added in place, and the submodules' ``forward`` called
    directly (no dropout, no hooks). The same operations on the same values as
    the layer's own forward, bit for bit; anything else (several positions, no
    source cache, weights asked for, training mode, the fused attention
    kernel) takes that forward."""

    def adopt(self) -> None:
        pass

    def forward(self, x, memory, self_mask, cross_mask, cache=None, need_weights=False, temperature=1.0):
        if (
            not lean_decoder_step
            or x.size(1) != 1
            or cache is None
            or cache.cross_kv is None
            or need_weights
            or self.training
            or self.self_attn.use_fused(x.device)
        ):
            return super().forward(x, memory, self_mask, cross_mask, cache, need_weights, temperature)
        b, _, d = x.shape
        sa, ca, ffn = self.self_attn, self.cross_attn, self.ffn
        h, d_h = sa.n_heads, sa.d_head
        scale = math.sqrt(d_h) * temperature
        x = x.reshape(b, d)

        qkv = sa.w_qkv(_pre(self.self_sub, x), [sa.w_q, sa.w_k, sa.w_v]).view(b, 3, h, 1, d_h)
        past = cache.self_kv
        if past is None:  # the first step after the source's cache (continuous batching's joins)
            kv = GrowingKV(qkv[:, 1].contiguous(), qkv[:, 2].contiguous())
        else:
            kv = (past if isinstance(past, GrowingKV) else GrowingKV(past.k, past.v)).append(qkv[:, 1], qkv[:, 2])
        out = _attend(qkv[:, 0], kv.k, kv.v, self_mask, scale)  # (B, H, 1, D_h)
        x = _residual(self.self_sub, sa.w_o.forward(out.reshape(b, d)), x)

        source = cache.cross_kv  # (N, H, T_s, D_h): the G = B / N beams of a source grouped against it
        n = source.k.size(0)
        q = ca.w_q.forward(_pre(self.cross_sub, x)).view(n, b // n, h, d_h).transpose(1, 2)  # (N, H, G, D_h)
        out = _attend(q, source.k, source.v, cross_mask, scale)
        x = _residual(self.cross_sub, ca.w_o.forward(out.transpose(1, 2).reshape(b, d)), x)

        y = _pre(self.ffn_sub, x)
        y = ffn.w_1.forward(y, relu=True) if ffn.activation is F.relu else ffn.activation(ffn.w_1.forward(y))
        x = _residual(self.ffn_sub, ffn.w_2.forward(y), x)
        return DecoderLayerOutput(x.view(b, 1, d), LayerCache(kv, source), None, None)


def _pre(sub: Sublayer, x: Tensor) -> Tensor:
    """``sub.pre(x)``: its layer norm, called directly, in a pre-norm layer."""
    if not sub.norm_first:
        return x
    return F.layer_norm(x, sub.norm.normalized_shape, sub.norm.weight, sub.norm.bias, sub.norm.eps)


def _residual(sub: Sublayer, out: Tensor, residual: Tensor) -> Tensor:
    """``sub.post(out, residual)`` without dropout, into ``out``'s own storage."""
    out = out.add_(residual)
    if sub.norm_first:
        return out
    return F.layer_norm(out, sub.norm.normalized_shape, sub.norm.weight, sub.norm.bias, sub.norm.eps)


_FAST = {
    DecoderLayer: FastDecoderLayer,
    nn.Linear: PackedLinear,
    FeedForward: FastFeedForward,
    MultiHeadAttention: FastMultiHeadAttention,
    Transformer: FastTransformer,
}
FAST_CLASSES = tuple(_FAST.values())  #: the classes ``speed_up`` gives modules
M = TypeVar("M", bound=nn.Module)


def speed_up(model: M) -> M:
    """Give every module of ``model`` that has one its fast-path version, in place,
    and return the model. Each fast class subclasses the module's own class and adds
    only caches, so parameters, buffers and the state dict stay as they are (the
    class of each module is swapped, as ``torch.nn.utils.parametrize`` does). A subclass
    of a textbook class (``mt.train.speed``'s) becomes the fast version of that class.
    For decoding: the modules then run without gradients."""
    for module in model.modules():
        if isinstance(module, FAST_CLASSES):
            continue
        # the first textbook class of the module's own (training's subclasses take the fast one too)
        fast = next((_FAST[c] for c in type(module).__mro__ if c in _FAST), None)
        if fast is not None:
            module.__class__ = fast
            module.adopt()
    return model
