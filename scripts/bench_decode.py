"""Decoding speed: mt against Hugging Face transformers ``generate`` on a
MarianMT model of identical dimensions (random weights), and against
CTranslate2 on that Marian model converted with CTranslate2's own converter.
Greedy and beam 5, every output exactly 20 tokens long so the work is equal,
batch 64, in one run whose rounds give each engine a turn. The Marian model follows Marian's
conventions (pad is an extra last vocabulary entry, which CTranslate2's
converter drops), so it has 8,001 embeddings to mt's 8,000. Needs the
prepared Multi30k data (its sentencepiece model serves as Marian's
tokenizer, which the converter loads, and its test set gives the lengths).

    pip install transformers ctranslate2     # benchmark-only dependencies
    python scripts/bench_decode.py [--sentences 1000] [--batch 64] [--rounds 3] [--keep-freed-memory] [--workers 1]

``--workers N`` decodes N batches at once, each in its own thread with 1/N
of the CPU threads, every engine alike: mt and HF through
``mt.decode.translator.map_in_threads`` (what ``mt translate --workers`` runs),
CTranslate2 with N ``inter_threads`` (its own workers) fed the same way.

The "mt fp32 products alone" row replays the matrix products that mt's
search made (every call of ``mt.decode.fastpath.linear``, recorded once) with
nothing in between: what mt would decode if its products were all it did.
Where that row is below twice HF's rate, no trimming of the rest of mt's
search reaches 2x HF on the machine at hand.

By default the C allocator keeps its defaults, as in any Python program.
``--keep-freed-memory`` applies what ``mt translate`` and ``mt evaluate`` set
(``mt.decode.allocator``) to the whole process, for every engine alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import mt.decode.fastpath
from mt.config import ModelConfig
from mt.decode.allocator import keep_freed_memory
from mt.decode.fastpath import speed_up
from mt.decode.int8 import quantize
from mt.decode.search import SearchSettings, beam_search, greedy_search
from mt.decode.translator import map_in_threads
from mt.hardware import BF16_USABLE, VNNI, bf16_speedup, cpuinfo, matmul_peak
from mt.model.transformer import Transformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
V, OUT_LEN = 8000, 20


def sources(n: int, prepared: Path) -> list[list[int]]:
    """Multi30k test-set lengths (with EOS) when prepared data exists, random ids."""
    g = torch.Generator().manual_seed(0)
    if (prepared / "test_2016_flickr").is_dir():
        from mt.data.batches import Split

        lengths = [len(x) for x in Split(prepared / "test_2016_flickr").src]
    else:
        lengths = [max(4, int(15 + 5 * torch.randn(1, generator=g))) for _ in range(n)]
    lengths = (lengths * (n // len(lengths) + 1))[:n]
    return sorted(([*torch.randint(4, V, (n_i - 1,), generator=g).tolist(), EOS] for n_i in lengths), key=len)


def padded(batch: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(batch), max(map(len, batch))), PAD)
    for i, s in enumerate(batch):
        out[i, : len(s)] = torch.tensor(s)
    return out


def timed(fn, data: list[list[int]], batch: int, workers: int = 1) -> float:
    """Sentences per second of ``fn`` over ``data`` in batches, ``workers``
    batches at a time (after a warm-up batch per worker)."""
    batches = [data[i : i + batch] for i in range(0, len(data), batch)]
    map_in_threads(fn, batches[:workers], workers)
    start = time.perf_counter()
    map_in_threads(fn, batches, workers)
    return len(data) / (time.perf_counter() - start)


class FixedLength(torch.nn.Module):
    """``model`` whose EOS cannot come before the ``OUT_LEN``-th token, so that every
    output is ``OUT_LEN`` tokens long (with ``max_len_b=OUT_LEN``): the same work for
    every engine, as HF's ``min_new_tokens`` and CTranslate2's ``min_decoding_length``."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def encode(self, src):
        return self.model.encode(src)

    def decode(self, tgt, enc, cache):
        out = self.model.decode(tgt, enc, cache)
        if cache.length + tgt.size(1) < OUT_LEN:  # the token this step picks is not the last
            out.logits[..., EOS] = float("-inf")
        return out


def record_products(fn, batches: list) -> list[list[tuple]]:
    """Runs ``fn`` over ``batches`` once and returns, per batch, every matrix
    product it ran through ``mt.decode.fastpath.linear`` (weight, bias, input shape,
    ReLU, packed weight), in order."""
    calls: list[tuple] = []
    original = mt.decode.fastpath.linear

    def recording(x, weight, bias=None, relu=False, packed=None):
        calls.append((weight, bias, tuple(x.shape), x.dtype, relu, packed))
        return original(x, weight, bias, relu, packed)

    per_batch = []
    mt.decode.fastpath.linear = recording  # every caller looks the name up at call time
    try:
        for batch in batches:
            fn(batch)
            per_batch.append(calls[:])
            calls.clear()
    finally:
        mt.decode.fastpath.linear = original
    return per_batch


def replay_products(per_batch: list[list[tuple]], workers: int = 1) -> float:
    """Seconds to run the recorded products again with nothing in between
    (on random inputs of the recorded shapes, one per shape): the time mt's
    search would take if its matrix products were all it did."""
    shapes = {(shape, dtype) for calls in per_batch for _, _, shape, dtype, _, _ in calls}
    inputs = {(shape, dtype): torch.randn(shape, dtype=dtype) for shape, dtype in shapes}

    @torch.inference_mode()  # as the search runs
    def replay(calls):
        for weight, bias, shape, dtype, relu, packed in calls:
            mt.decode.fastpath.linear(inputs[shape, dtype], weight, bias, relu, packed)

    map_in_threads(replay, per_batch[:workers], workers)  # warm-up
    start = time.perf_counter()
    map_in_threads(replay, per_batch, workers)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="engines take turns this many times; best round counts")
    p.add_argument("--prepared", type=Path, default=Path("data/prepared/multi30k.en-de"))
    p.add_argument(
        "--keep-freed-memory", action="store_true", help="mt's decoding commands' allocator setting, all engines"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="batches decoded at once, every engine alike, each in its own thread with an equal share of the "
        "CPU threads (mt's --workers; CTranslate2 gets as many inter_threads); default 1",
    )
    args = p.parse_args()
    if args.workers < 1:
        raise SystemExit(f"--workers must be at least 1, got {args.workers}")
    if args.keep_freed_memory and not keep_freed_memory():
        raise SystemExit("--keep-freed-memory: not available here (glibc only; unset MALLOC_*_THRESHOLD_)")
    import ctranslate2
    import transformers
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    data = sources(args.sentences, args.prepared)
    spm_model = args.prepared / "spm.model"
    if not spm_model.exists():
        raise SystemExit(f"{spm_model} missing: run `mt prepare --config configs/multi30k_cpu.yaml` first")
    marian_pad = V  # Marian's pad: one more entry after the vocabulary
    hf_cfg = MarianConfig(
        vocab_size=V + 1, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, activation_function="relu",
        max_position_embeddings=256, pad_token_id=marian_pad, eos_token_id=EOS, bos_token_id=BOS,
        decoder_start_token_id=marian_pad, forced_eos_token_id=None, scale_embedding=True, dropout=0.0,
    )  # fmt: skip
    hf = MarianMTModel(hf_cfg).eval()
    ours = Transformer(
        ModelConfig(
            d_model=256,
            n_heads=4,
            enc_layers=3,
            dec_layers=3,
            d_ff=1024,
            dropout=0.0,
            norm_first=False,
            src_vocab_size=V,
            tgt_vocab_size=V,
            pad_id=PAD,
        )  # fmt: skip
    )
    ours = speed_up(ours).eval()  # as mt translate loads a model
    ours_bf16 = speed_up(Transformer(ours.cfg)).eval().to(torch.bfloat16)
    ours_bf16.load_state_dict(ours.state_dict())
    ours_int8 = speed_up(Transformer(ours.cfg)).eval()  # as --dtype int8 (mt/decode/int8.py)
    ours_int8.load_state_dict(ours.state_dict())
    quantize(ours_int8)
    # bf16 rows only where bfloat16 has a fast path (not on AVX2-only CPUs, where it is ~400x slower)
    bf16_ratio = bf16_speedup(n=256)
    with_bf16 = bf16_ratio >= BF16_USABLE
    peaks = {"fp32": matmul_peak(torch.float32)} | ({"bf16": matmul_peak(torch.bfloat16)} if with_bf16 else {})
    threads = torch.get_num_threads()

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ct2_dir = Path(tmp) / "marian", Path(tmp) / "ct2"
        hf.save_pretrained(hf_dir)
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(spm_model))
        pieces = [sp.id_to_piece(i) for i in range(V)]
        pieces[PAD] = "<unused0>"  # our pad id is an ordinary (never generated) entry for Marian
        vocab = {p: i for i, p in enumerate(pieces)} | {"<pad>": marian_pad}
        (hf_dir / "vocab.json").write_text(json.dumps(vocab))
        for name in ("source.spm", "target.spm"):
            (hf_dir / name).write_bytes(spm_model.read_bytes())
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), force=True)
        names = dict(enumerate(pieces))
        s = SearchSettings(BOS, EOS, PAD, max_len_a=0.0, max_len_b=OUT_LEN)

        def run_mt(model):
            model = FixedLength(model)

            def go(batch, beam):
                src = padded(batch)
                return greedy_search(model, src, s) if beam == 1 else beam_search(model, src, s, beam=beam)

            return go

        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)

        def run_hf(model):
            @torch.inference_mode()  # as mt's search runs (generate's own no_grad alone is ~3% slower)
            def go(batch, beam):
                src = padded(batch)
                mask = src != PAD
                return model.generate(
                    input_ids=src.masked_fill(~mask, marian_pad), attention_mask=mask, num_beams=beam, do_sample=False,
                    max_new_tokens=OUT_LEN, min_new_tokens=OUT_LEN, early_stopping=False,
                )  # fmt: skip

            return go

        def run_ct2(compute_type):
            # A live CTranslate2 translator that has run slows PyTorch down by ~20% on this
            # machine (its thread pool), so each turn loads its own and drops it afterwards.
            translator = ctranslate2.Translator(
                str(ct2_dir), device="cpu", compute_type=compute_type, inter_threads=args.workers,
                intra_threads=max(1, threads // args.workers),
            )  # fmt: skip
            # its intra_threads also set PyTorch's thread count in this process (measured): undo that
            torch.set_num_threads(threads)

            def go(batch, beam):
                tokens = [[names[i] for i in x] for x in batch]
                return translator.translate_batch(
                    tokens, beam_size=beam, max_decoding_length=OUT_LEN, min_decoding_length=OUT_LEN,
                    max_batch_size=args.batch,
                )  # fmt: skip

            return go

        engines = {  # name -> a function that sets the engine up and returns its batch translator
            "mt fp32": lambda: run_mt(ours),
            "mt bf16": lambda: run_mt(ours_bf16),
            "mt int8": lambda: run_mt(ours_int8),
            "HF fp32": lambda: run_hf(hf),
            "HF bf16": lambda: run_hf(hf_bf16),
            "CT2 fp32": lambda: run_ct2("float32"),
            "CT2 int8": lambda: run_ct2("int8"),
        }
        if not with_bf16:
            del engines["mt bf16"], engines["HF bf16"]
        batches = [data[i : i + args.batch] for i in range(0, len(data), args.batch)]
        go_mt = run_mt(ours)
        recorded = {beam: record_products(lambda batch, beam=beam: go_mt(batch, beam), batches) for beam in (1, 5)}
        best: dict[tuple[int, str], float] = {}
        for r in range(args.rounds):  # engines take turns; each keeps its best round
            for beam in (1, 5):
                for name, setup in engines.items():
                    fn = setup()
                    rate = timed(lambda batch, fn=fn, beam=beam: fn(batch, beam), data, args.batch, args.workers)
                    best[beam, name] = max(best.get((beam, name), 0.0), rate)
                    del fn
                rate = len(data) / replay_products(recorded[beam], args.workers)
                best[beam, "mt products"] = max(best.get((beam, "mt products"), 0.0), rate)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    src_tokens = sum(map(len, data)) / len(data)
    searches = {1: "greedy", 5: "beam 5"}
    print(
        f"{args.sentences} sentences, batch {args.batch}, {args.workers} batch(es) at a time, {OUT_LEN} output "
        "tokens each; sentences/s, best of "
        f"{args.rounds} rounds (transformers {transformers.__version__}, ctranslate2 {ctranslate2.__version__}, "
        f"torch {torch.__version__}; allocator: {'freed memory kept' if args.keep_freed_memory else 'defaults'})"
    )
    simd = sorted(f for f in cpuinfo("flags").split() if f.startswith(("avx", "amx", "fma")))
    print(f"CPU: {cpuinfo('model name') or 'unknown'}, {torch.get_num_threads()} threads; {' '.join(simd)}")
    print(f"{'':<22}" + "".join(f"{searches[beam]:>9}" for beam in searches))
    for name in engines:
        print(f"{name:<22}" + "".join(f"{best[beam, name]:>9.0f}" for beam in searches))
    print(f"{'mt fp32 products alone':<22}" + "".join(f"{best[beam, 'mt products']:>9.0f}" for beam in searches))
    for precision, peak in peaks.items():
        ceilings = (peak / flops_per_sentence(src_tokens, beam) for beam in searches)
        print(f"{precision + ' ceiling':<22}" + "".join(f"{c:>9.0f}" for c in ceilings))
    print("ratios")
    for a, b in (("mt fp32", "HF fp32"), ("mt fp32", "CT2 fp32"), ("mt bf16", "HF fp32"), ("mt bf16", "HF bf16"),
                 ("mt bf16", "CT2 fp32"), ("mt int8", "mt fp32"), ("mt int8", "CT2 int8"),
                 ("CT2 int8", "CT2 fp32")):  # fmt: skip
        if a not in engines or b not in engines:
            continue
        print(f"{a + ' / ' + b:<22}" + "".join(f"{best[beam, a] / best[beam, b]:>8.2f}x" for beam in searches))
    print(
        f"{'/'.join(peaks)} ceiling: sentences/s if every matrix product ran at the matmul peak measured here "
        f"({' / '.join(f'{peak / 1e9:.0f}' for peak in peaks.values())} GFLOP/s) and nothing else took time. "
        "mt bf16 keeps search scores in float32; mt int8 computes "
        + ("every linear layer and the output projection" if VNNI else "the output projection (no VNNI here)")
        + " in int8 and attention in float32; CT2 int8 computes in int8."
    )
    print(
        "mt fp32 products alone: sentences/s if mt fp32's matrix products (the calls its search made, recorded "
        "and replayed with nothing in between) were all it did; 2x HF fp32 would need "
        + " / ".join(f"{2 * best[beam, 'HF fp32']:.0f}" for beam in searches)
        + "."
    )
    if not with_bf16:
        print(
            f"bf16 rows left out: bfloat16 products run at {bf16_ratio:.2g}x float32's speed on this CPU "
            "(no fast bfloat16 path: AVX2 only)"
        )


def flops_per_sentence(src_tokens: float, beam: int) -> float:
    """Matrix-product FLOPs to translate one sentence: encoder, the source's
    cross-attention keys/values, and 20 decoder steps for each beam
    (the first step with one beam) including the output projection."""
    d, ff, layers = 256, 1024, 3
    encoder = src_tokens * layers * (4 * d * d + 2 * d * ff + 2 * d * d)
    step = layers * (6 * d * d + 2 * d * ff) + d * V
    return 2 * (encoder + step * (1 + beam * (OUT_LEN - 1)))


if __name__ == "__main__":
    main()
