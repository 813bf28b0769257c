"""One attention head, step by step, on a trained model's real weights.

The textbook computation, written out in NumPy, for one kind of attention
(encoder self-, decoder self- or cross-attention), one layer and one head:

    x_q, x_kv   what the layer feeds its attention (after the pre-layer norm)   (T_q, D), (T_k, D)
    Q = x_q·W_Q + b_Q,  K = x_kv·W_K + b_K,  V = x_kv·W_V + b_V                  (T_q, d_k), (T_k, d_k)
                (this head's d_k columns of the full projections)
    scores  = Q·Kᵀ                                                              (T_q, T_k)
    scaled  = scores / (√d_k · T)           T: the temperature
    masked  = scaled where the mask allows, −inf elsewhere
    weights = softmax(masked) row by row    each row sums to 1; a row with no allowed key is zeros
    output  = weights·V                                                         (T_q, d_k)
    sublayer = [output of head 0 | ... | head H-1]·W_O + b_O                     (T_q, D)

Each step is then compared with the value the model's own forward pass
produced, captured from its modules while it ran (``capture``): the inputs
and projections by module hooks, the scores by watching the attention core's
tensor operations. The lesson's arithmetic is NumPy in float64, the model's
is PyTorch in float32: what differs is the model's rounding.

A larger T divides the scores by more, pulling them together: the weights
flatten. A smaller T sharpens them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from mt.data.tokenizer import Tokenizer
from mt.inspect.capture import KIND_NAMES
from mt.model.attention import MultiHeadAttention
from mt.model.transformer import Transformer
from mt.textio import atomic_output

# Largest |lesson - model| allowed at a step, times the step's scale (its largest |value|, at least 1):
# 1e-5 absolute for values within ±1. float32 holds about 7 significant digits, so a raw score
# of 17 cannot agree with its exact value to better than ~1e-6, and a 64-term sum accumulates more.
TOLERANCE = 1e-5

# The steps compared with the model, in the order they happen, and what each is called when printed.
CHECKED = {
    "q": "Q = x_q·W_Q + b_Q",
    "k": "K = x_kv·W_K + b_K",
    "v": "V = x_kv·W_V + b_V",
    "scores": "scores = Q·Kᵀ",
    "scaled": "scaled = scores / (√d_k·T)",
    "masked": "masked scores",
    "weights": "weights = softmax",
    "output": "head output = weights·V",
    "heads": "all heads concatenated",
    "sublayer": "sub-layer output = heads·W_O + b_O",
}


@dataclass
class Captured:
    """What one attention module computed in the model's forward pass, batch row 0, every head."""

    x_q: Tensor  # (T_q, D) the query input
    x_kv: Tensor  # (T_k, D) the key/value input
    mask: Tensor  # (T_q, T_k) bool, True = may attend
    q: Tensor  # (T_q, D) the full projections, before the split into heads
    k: Tensor  # (T_k, D)
    v: Tensor  # (T_k, D)
    scores: Tensor  # (H, T_q, T_k) Q·Kᵀ
    scaled: Tensor  # (H, T_q, T_k)
    masked: Tensor  # (H, T_q, T_k)
    weights: Tensor  # (H, T_q, T_k)
    output: Tensor  # (H, T_q, d_k) weights·V
    heads: Tensor  # (T_q, D) the heads' outputs side by side, W_O's input
    sublayer: Tensor  # (T_q, D) the attention sub-layer's output


class _Watch(TorchFunctionMode):
    """Records the results of the tensor operations the attention core is made of."""

    OPS = {"matmul": "matmul", "__matmul__": "matmul", "div": "div", "__truediv__": "div", "masked_fill": "masked_fill"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = self.OPS.get(getattr(func, "__name__", ""))
        if op and isinstance(out, Tensor):
            self.seen.append((op, out.detach()))
        return out


def _attention_modules(model: Transformer) -> dict[tuple[str, int], MultiHeadAttention]:
    modules = {("encoder", i): layer.self_attn for i, layer in enumerate(model.encoder)}
    for i, layer in enumerate(model.decoder):
        modules["decoder", i] = layer.self_attn
        modules["cross", i] = layer.cross_attn
    return modules


@torch.no_grad()
def capture(
    model: Transformer, tok: Tokenizer, src_ids: list[int], tgt_ids: list[int], temperature: float = 1.0
) -> dict[tuple[str, int], Captured]:
    """Teacher-force ``src_ids`` -> ``tgt_ids`` (source with its </s>, target without
    <s>/</s>) through the textbook model and keep what every attention module
    computed, keyed by (kind, layer)."""
    for module in model.modules():
        if type(module).__name__.startswith(("Fast", "Packed")):
            raise TypeError(
                "capture() needs the textbook model: load it with mt.decode.inference.load(..., fast=False)"
            )
    found: dict[tuple[str, int], dict] = {}
    watch = _Watch()
    handles = []

    def hook(key, module: MultiHeadAttention):
        record = found.setdefault(key, {})

        def before(_, args, kwargs):
            query, key_value, mask = (list(args) + [kwargs.get("key_value"), kwargs.get("mask")])[:3]
            record.update(x_q=query[0], x_kv=key_value[0], mask=mask, first=len(watch.seen))

        def after(_, args, kwargs, out):
            record.update(weights=out.weights[0], sublayer=out.output[0], ops=watch.seen[record.pop("first") :])

        def keep(name):
            return lambda _, __, out: record.__setitem__(name, out[0])

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
        for name in ("q", "k", "v"):
            handles.append(getattr(module, f"w_{name}").register_forward_hook(keep(name)))
        handles.append(module.w_o.register_forward_pre_hook(lambda _, args: record.__setitem__("heads", args[0][0])))

    for key, module in _attention_modules(model).items():
        hook(key, module)
    try:
        with watch:
            enc = model.encode(torch.tensor([src_ids]), need_weights=True, temperature=temperature)
            tgt_in = torch.tensor([[tok.bos_id, *tgt_ids]])
            model.decode(tgt_in, enc, need_weights=True, temperature=temperature)
    finally:
        for handle in handles:
            handle.remove()
    return {key: _captured(record) for key, record in found.items()}


def _captured(record: dict) -> Captured:
    """The attention core's products, in the order ``scaled_dot_product_attention`` makes them:
    Q·Kᵀ (a matmul), its division by √d_k·T, the masking, and weights·V (the second matmul)."""
    seen = record["ops"]
    matmuls = [t for op, t in seen if op == "matmul"]
    divs = [t for op, t in seen if op == "div"]
    fills = [t for op, t in seen if op == "masked_fill"]
    if len(matmuls) != 2 or not divs:
        raise RuntimeError(f"the attention core made {len(matmuls)} products and {len(divs)} divisions, not 2 and 1")
    weights, x_q, x_kv = record["weights"], record["x_q"], record["x_kv"]
    t_q, t_k = weights.shape[-2:]
    mask = record["mask"]
    mask = torch.ones(t_q, t_k, dtype=torch.bool) if mask is None else mask[0, 0].expand(t_q, t_k)
    return Captured(
        x_q=x_q, x_kv=x_kv, mask=mask, q=record["q"], k=record["k"], v=record["v"],
        scores=matmuls[0][0], scaled=divs[0][0], masked=fills[0][0] if fills else divs[0][0],
        weights=weights, output=matmuls[1][0], heads=record["heads"], sublayer=record["sublayer"],
    )  # fmt: skip


def textbook_head(x_q, x_kv, w_q, b_q, w_k, b_k, w_v, b_v, mask, temperature: float = 1.0) -> dict[str, np.ndarray]:
    """One head in NumPy (float64): W_* are (D, d_k), b_* (d_k,), mask (T_q, T_k) bool."""
    q, k, v = x_q @ w_q + b_q, x_kv @ w_k + b_k, x_kv @ w_v + b_v
    scores = q @ k.T
    scaled = scores / (math.sqrt(q.shape[-1]) * temperature)
    masked = np.where(mask, scaled, -np.inf)
    # The stable softmax: subtract each row's largest score, so exp() never overflows.
    row_max = np.where(mask.any(axis=-1, keepdims=True), masked.max(axis=-1, keepdims=True), 0.0)
    e = np.exp(masked - row_max)  # exp(-inf) = 0
    total = e.sum(axis=-1, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)  # a row with no allowed key: zeros
    return dict(q=q, k=k, v=v, scores=scores, scaled=scaled, masked=masked, weights=weights, output=weights @ v)


@dataclass
class HeadSteps:
    """The lesson for one head: the textbook steps (NumPy, float64), the
    model's values for the same steps, and their largest differences."""

    kind: str
    layer: int
    head: int
    n_heads: int
    temperature: float
    rows: list[str]  # query tokens
    cols: list[str]  # key tokens
    params: dict[str, np.ndarray]  # this head's w_q, b_q, w_k, b_k, w_v, b_v (W as (D, d_k)); w_o (D, D), b_o (D,)
    x_q: np.ndarray  # (T_q, D)
    x_kv: np.ndarray  # (T_k, D)
    mask: np.ndarray  # (T_q, T_k) bool
    steps: dict[str, np.ndarray]  # q ... output of this head; heads (T_q, D) and sublayer (T_q, D) of all heads
    model: dict[str, np.ndarray] = field(repr=False)  # the same keys, as the model computed them
    diffs: dict[str, float] = field(default_factory=dict)  # step -> max |lesson - model|
    scales: dict[str, float] = field(default_factory=dict)  # step -> max(1, largest |model value|)

    @property
    def d_k(self) -> int:
        return self.steps["q"].shape[-1]

    def allowed(self, step: str, tolerance: float = TOLERANCE) -> float:
        return tolerance * self.scales[step]

    def failures(self, tolerance: float = TOLERANCE) -> list[str]:
        """The steps whose difference from the model is above the tolerance (NaN fails too)."""
        return [step for step, d in self.diffs.items() if not d <= self.allowed(step, tolerance)]


def _head_params(module: MultiHeadAttention, head: int) -> dict[str, np.ndarray]:
    cols = slice(head * module.d_head, (head + 1) * module.d_head)
    params = {}
    for name in ("q", "k", "v"):
        linear = getattr(module, f"w_{name}")
        params[f"w_{name}"] = linear.weight[cols].T.detach().double().numpy()  # (D, d_k): x·W convention
        params[f"b_{name}"] = linear.bias[cols].detach().double().numpy()
    params["w_o"] = module.w_o.weight.T.detach().double().numpy()  # (D, D)
    params["b_o"] = module.w_o.bias.detach().double().numpy()
    return params


def _max_diff(lesson: np.ndarray, model: np.ndarray) -> float:
    """max |lesson - model|; −inf entries must sit at the same places (else: inf)."""
    lesson_inf, model_inf = np.isneginf(lesson), np.isneginf(model)
    if (lesson_inf != model_inf).any():
        return math.inf
    finite = ~lesson_inf
    return float(np.abs(lesson[finite] - model[finite]).max(initial=0.0))


def head_steps(
    model: Transformer, captured: dict[tuple[str, int], Captured], kind: str, layer: int, head: int,
    rows: list[str], cols: list[str], temperature: float = 1.0,
) -> HeadSteps:  # fmt: skip
    """The textbook steps of one head, on the inputs the model's attention saw, checked against ``captured``."""
    module = _attention_modules(model)[kind, layer]
    c = captured[kind, layer]
    d_k = module.d_head
    x_q, x_kv, mask = c.x_q.double().numpy(), c.x_kv.double().numpy(), c.mask.numpy()
    all_params = [_head_params(module, h) for h in range(module.n_heads)]
    params = all_params[head]
    every = [textbook_head(x_q, x_kv, *(p[n] for n in _QKV), mask, temperature) for p in all_params]
    steps = dict(every[head])
    steps["heads"] = np.concatenate([s["output"] for s in every], axis=-1)  # (T_q, D)
    steps["sublayer"] = steps["heads"] @ params["w_o"] + params["b_o"]

    cols_h = slice(head * d_k, (head + 1) * d_k)
    mine = {
        "q": c.q[:, cols_h], "k": c.k[:, cols_h], "v": c.v[:, cols_h],
        "scores": c.scores[head], "scaled": c.scaled[head], "masked": c.masked[head],
        "weights": c.weights[head], "output": c.output[head], "heads": c.heads, "sublayer": c.sublayer,
    }  # fmt: skip
    model_values = {name: t.double().numpy() for name, t in mine.items()}
    # The core lets a row with no allowed key see every key (then zeroes it): only allowed entries compare.
    live = mask.any(axis=-1)
    diffs, scales = {}, {}
    for name in CHECKED:
        a, b = steps[name], model_values[name]
        if name in ("scores", "scaled", "masked", "weights", "output"):
            a, b = a[live], b[live]
        diffs[name] = _max_diff(a, b)
        scales[name] = float(np.abs(b[np.isfinite(b)]).max(initial=1.0))
    return HeadSteps(
        kind, layer, head, module.n_heads, temperature, rows, cols, params, x_q, x_kv, mask,
        steps, model_values, diffs, scales,
    )  # fmt: skip


_QKV = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v")


def entropy(weights: np.ndarray) -> float:
    """Entropy of one row of weights, in nats (0 for one-hot, log n for uniform over n keys)."""
    w = weights[weights > 0]
    return max(0.0, float(-(w * np.log(w)).sum()))


def save_npz(lesson: HeadSteps, path: str | Path) -> None:
    """The head's inputs and parameters, for the textbook's NumPy, and the model's
    weights and output to compare with; float32, as the model holds them."""
    arrays = {
        "x_q": lesson.x_q, "x_kv": lesson.x_kv, **{n: lesson.params[n] for n in _QKV},
        "d_k": np.array(lesson.d_k), "temperature": np.array(lesson.temperature), "mask": lesson.mask,
        "weights": lesson.model["weights"], "output": lesson.model["output"],
        "rows": np.array(lesson.rows), "cols": np.array(lesson.cols),
    }  # fmt: skip
    arrays = {k: a.astype(np.float32) if a.dtype == np.float64 else a for k, a in arrays.items()}
    with atomic_output(path, binary=True) as f:
        np.savez(f, **arrays)


def _array(a: np.ndarray, indent: str = "   ") -> str:
    """An array as NumPy prints it: 4 decimals, long dimensions elided in the middle."""
    text = np.array2string(a, precision=4, suppress_small=True, threshold=64, edgeitems=3, max_line_width=110)
    return "\n".join(indent + line for line in text.splitlines())


def _row(labels: list[str], values: np.ndarray, width: int = 9) -> str:
    cells = [f"{label[:width]:>{width}}" for label in labels], [f"{v:>{width}.4f}" for v in values]
    return "   " + " ".join(cells[0]) + "\n   " + " ".join(cells[1])


def format_lesson(lesson: HeadSteps, query: int, source: list[str], target: list[str] | None) -> str:
    """The printout of ``mt attention --explain``: every step with its shape and values."""
    s, p, d_k, t = lesson.steps, lesson.params, lesson.d_k, lesson.temperature
    h, n = lesson.head, lesson.n_heads
    t_q, t_k = lesson.mask.shape
    denominator = math.sqrt(d_k) * t
    out = [
        "1. tokens",
        f"   source ({len(source)}): {' '.join(source)}",
        *([f"   target ({len(target)}): {' '.join(target)}"] if target is not None else []),
        f"   {KIND_NAMES[lesson.kind]}, layer {lesson.layer}, head {h} of {n} (heads 0..{n - 1}), "
        f"query {query} ({lesson.rows[query]!r}"
        + (f", the decoder position that predicts {target[query]!r})" if target is not None else ")"),
        f"   queries ({t_q}): {' '.join(lesson.rows)}",
        f"   keys    ({t_k}): {' '.join(lesson.cols)}",
        "",
        "2. x: what the layer feeds its attention (after its pre-layer norm), one row per token",
        f"   x_q {lesson.x_q.shape}",
        _array(lesson.x_q),
    ]
    if lesson.kind == "cross":
        out += [f"   x_kv {lesson.x_kv.shape}: the encoder's output, one row per source token", _array(lesson.x_kv)]
    else:
        out += ["   x_kv = x_q (self-attention: the same tokens ask and answer)"]
    cols = f"columns {h * d_k}..{(h + 1) * d_k - 1} of the {n * d_k}"
    out += [
        "",
        f"3. this head's projections: {cols} of W_Q, W_K, W_V (d_k = {d_k})",
        f"   W_Q {p['w_q'].shape}, b_Q {p['b_q'].shape}",
        f"   Q = x_q·W_Q + b_Q {s['q'].shape}",
        _array(s["q"]),
        f"   K = x_kv·W_K + b_K {s['k'].shape}",
        _array(s["k"]),
        f"   V = x_kv·W_V + b_V {s['v'].shape}",
        _array(s["v"]),
        "",
        f"4. scores = Q·Kᵀ {s['scores'].shape}: row i, column j = how well query i matches key j",
        _array(s["scores"]),
        f"   scaled = scores / (√d_k · T) = scores / (√{d_k} · {t:g}) = scores / {denominator:g}",
        _array(s["scaled"]),
        f"   mask {lesson.mask.shape}: 1 = may attend ({_mask_kind(lesson)})",
        _array(lesson.mask.astype(int)),
        "   masked = scaled where the mask is 1, -inf where it is 0",
        _array(s["masked"]),
        "",
        f"5. weights = softmax(masked), row by row {s['weights'].shape}: each row sums to 1",
        _array(s["weights"]),
        f"   query {query}'s row (sum {s['weights'][query].sum():.4f}, "
        f"entropy {entropy(s['weights'][query]):.4f} nats):",
        _row(lesson.cols, s["weights"][query]),
        "",
        f"6. head output = weights·V {s['output'].shape}: each query's weighted average of the values",
        _array(s["output"]),
        "",
        f"7. all {n} heads side by side {s['heads'].shape}, projected by W_O {p['w_o'].shape} + b_O:",
        f"   sub-layer output = [head 0 | ... | head {n - 1}]·W_O + b_O {s['sublayer'].shape}",
        _array(s["sublayer"]),
        f"   the model's attention output differs from it by at most {lesson.diffs['sublayer']:.1e}",
        "",
        "8. every step against the model's own forward pass (float32): max |lesson - model|",
    ]
    for step, name in CHECKED.items():
        verdict = "ok" if step not in lesson.failures() else "ABOVE THE TOLERANCE"
        out.append(f"   {name:<36} {lesson.diffs[step]:9.1e}  (allowed {lesson.allowed(step):.0e})  {verdict}")
    return "\n".join(out)


def _mask_kind(lesson: HeadSteps) -> str:
    if lesson.kind == "decoder":
        return "causal: a target position sees itself and the positions before it"
    if lesson.mask.all():
        return "no padding in one sentence: every key allowed"
    return "padding keys masked"


def format_temperatures(lessons: list[HeadSteps], query: int) -> str:
    """The query's row of weights under each temperature, with its entropy: a larger T flattens."""
    width = 9
    head = "   " + f"{'T':>6} {'entropy':>8}  " + " ".join(f"{c[:width]:>{width}}" for c in lessons[0].cols)
    lines = [f"query {query} ({lessons[0].rows[query]!r}) under each temperature: weights and entropy (nats)", head]
    for lesson in lessons:
        w = lesson.steps["weights"][query]
        lines.append(f"   {lesson.temperature:>6g} {entropy(w):>8.4f}  " + " ".join(f"{v:>{width}.4f}" for v in w))
    lines.append("   a larger T divides the scores by more and pulls them together: flatter weights, higher entropy")
    return "\n".join(lines)
