"""``mt prepare``: from raw parallel text to tokenized splits on disk.

Trains sentencepiece on the training split, encodes every split with
Hugging Face ``datasets``, drops unusable training pairs, and writes::

    <data.prepared_dir>/
        spm.model | spm.src.model + spm.tgt.model   the tokenizer
        <split>/                                    datasets.save_to_disk: src_ids, tgt_ids, src_text, tgt_text
        prepare.json                                fingerprint of inputs and config, and the summary

A second run with the same inputs and config reuses what is there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from mt.config import DataConfig
from mt.corpus import load_corpus
from mt.data import TokenBatchSampler, padding_waste
from mt.errors import DataError
from mt.tokenizer import JOINT, SRC, TGT, TextNormalizer, Tokenizer, train_sentencepiece, write_text_config

PREPARE_FORMAT = 3  # 2: source ids end with EOS; 3: the summary reports padding
FINGERPRINT_FIELDS = (
    "src_lang", "tgt_lang", "train_split", "text", "vocab_size", "joint_vocab", "spm_model_type", "max_len",
    "max_ratio",
)  # fmt: skip


def _fingerprint(cfg: DataConfig, corpus_fp: str) -> str:
    fields = {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}
    blob = json.dumps({"format": PREPARE_FORMAT, "corpus": corpus_fp, "config": fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _train_tokenizer(cfg: DataConfig, src: list[str], tgt: list[str], out: Path) -> Tokenizer:
    src = [s for s in TextNormalizer(cfg.text, cfg.src_lang).normalize(src) if s.strip()]
    tgt = [t for t in TextNormalizer(cfg.text, cfg.tgt_lang).normalize(tgt) if t.strip()]
    if not src or not tgt:
        side = cfg.src_lang if not src else cfg.tgt_lang
        raise DataError(
            f"training split {cfg.train_split!r}: every {side} line is empty ({cfg.train_split}.{side}); "
            "no usable training pair is left"
        )
    if cfg.joint_vocab:
        train_sentencepiece(src + tgt, out / JOINT.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
    else:
        train_sentencepiece(src, out / SRC.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
        train_sentencepiece(tgt, out / TGT.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
    write_text_config(out, cfg.text, cfg.src_lang, cfg.tgt_lang)
    return Tokenizer.load(out)


def _drop_reason(n_src: int, n_tgt: int, cfg: DataConfig) -> str | None:
    """n_src, n_tgt: subword tokens, without the source's EOS."""
    if n_src == 0 or n_tgt == 0:
        return "empty"
    if max(n_src, n_tgt) > cfg.max_len:
        return "too long"
    if max(n_src, n_tgt) / min(n_src, n_tgt) > cfg.max_ratio:
        return "length ratio"
    return None


def prepare(cfg: DataConfig, verbose: bool = True) -> dict:
    """Tokenize the corpus into ``cfg.prepared_path()``; reuse it when nothing changed.

    Returns the summary (also stored in prepare.json). Writes into a
    ``.partial`` directory and swaps it in at the end, so an interrupted run
    never leaves a prepared directory that looks complete.
    """
    import datasets

    datasets.disable_progress_bars()
    out = cfg.prepared_path()
    splits, corpus_fp = load_corpus(cfg, Path("data/raw") / cfg.corpus)
    fingerprint = _fingerprint(cfg, corpus_fp)
    meta_path = out / "prepare.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint and all((out / s).is_dir() for s in meta["summary"]["splits"]):
            summary = meta["summary"]
            if summary.get("train_batches", {}).get("max_tokens") != cfg.max_tokens:
                # batching is not part of the fingerprint: the stored figures may be for another max_tokens
                summary = {**summary, "train_batches": _train_batches(out / cfg.train_split, cfg.max_tokens)}
            if verbose:
                print(f"{out}: up to date (same inputs and config, fingerprint {fingerprint[:12]}); reusing it")
                print(format_summary(summary))
            return summary

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        summary = _prepare_into(tmp, cfg, splits, fingerprint)
    except BaseException:  # an error or Ctrl-C: nothing half-made is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    if verbose:
        print(f"prepared {cfg.pair} into {out}")
        print(format_summary(summary))
    return summary


def _prepare_into(tmp: Path, cfg: DataConfig, splits: dict, fingerprint: str) -> dict:
    """Tokenizer, encoded splits and prepare.json into ``tmp``; returns the summary."""
    import datasets

    train_src, train_tgt = splits[cfg.train_split]
    tok = _train_tokenizer(cfg, train_src, train_tgt, tmp)

    def encode(batch: dict) -> dict:
        return {"src_ids": tok.encode_src(batch["src_text"]), "tgt_ids": tok.encode_tgt(batch["tgt_text"])}

    summary = {"pair": cfg.pair, "vocab": {"src": len(tok.src), "tgt": len(tok.tgt), "joint": tok.joint}, "splits": {}}
    for name, (src, tgt) in splits.items():
        ds = datasets.Dataset.from_dict({"src_text": src, "tgt_text": tgt})
        ds = ds.map(encode, batched=True, batch_size=1000)
        dropped = {}
        if name == cfg.train_split:  # validation and test keep every line, aligned with references
            keep = []
            columns = ds.select_columns(["src_ids", "tgt_ids"]).to_dict()
            for i, (s, t) in enumerate(zip(columns["src_ids"], columns["tgt_ids"])):
                reason = _drop_reason(max(len(s) - 1, 0), len(t), cfg)
                if reason is None:
                    keep.append(i)
                else:
                    dropped[reason] = dropped.get(reason, 0) + 1
            if not keep:
                reasons = ", ".join(f"{k}: {v}" for k, v in dropped.items())
                raise DataError(f"training split {name!r}: no usable training pair is left ({reasons})")
            if len(keep) < len(ds):
                ds = ds.select(keep)
        ds.save_to_disk(str(tmp / name))
        summary["splits"][name] = _split_stats(ds, tok.unk_id, dropped)

    summary["train_batches"] = _train_batches(tmp / cfg.train_split, cfg.max_tokens)
    (tmp / "prepare.json").write_text(json.dumps({"fingerprint": fingerprint, "summary": summary}, indent=2))
    return summary


def _train_batches(split_dir: Path, max_tokens: int) -> dict:
    """How many training batches ``max_tokens`` makes of a prepared split, and their padding."""
    import datasets

    train = datasets.load_from_disk(str(split_dir)).select_columns(["src_ids", "tgt_ids"]).to_dict()
    src_lens, tgt_lens = [len(x) for x in train["src_ids"]], [len(x) for x in train["tgt_ids"]]
    batches = TokenBatchSampler(src_lens, tgt_lens, max_tokens).all_batches()
    return {
        "max_tokens": max_tokens,
        "batches": len(batches),
        "padding_waste": round(padding_waste(batches, src_lens, tgt_lens), 4),
    }


def _split_stats(ds, unk_id: int, dropped: dict[str, int]) -> dict:
    stats = {"kept": len(ds), "dropped": sum(dropped.values()), "dropped_by_reason": dropped}
    for side in ("src", "tgt"):
        ids = ds.select_columns([f"{side}_ids"]).to_dict()[f"{side}_ids"]
        n_tokens = sum(len(x) for x in ids) - (len(ids) if side == "src" else 0)  # without the source EOS
        stats[f"{side}_tokens_per_sentence"] = round(n_tokens / max(len(ids), 1), 2)
        stats[f"{side}_unk_share"] = sum(x.count(unk_id) for x in ids) / max(n_tokens, 1)
    return stats


def format_summary(summary: dict) -> str:
    src, tgt = summary["pair"].split("-")
    vocab = summary["vocab"]
    lines = [
        f"vocabulary: {vocab['src']} (joint)" if vocab["joint"] else f"vocabulary: {vocab['src']} / {vocab['tgt']}",
        f"{'split':<20}{'kept':>8}{'dropped':>9}{'tok/sent ' + src:>14}{'tok/sent ' + tgt:>14}"
        f"{'unk ' + src:>10}{'unk ' + tgt:>10}",
    ]
    for name, s in summary["splits"].items():
        reasons = ", ".join(f"{k}: {v}" for k, v in s["dropped_by_reason"].items())
        lines.append(
            f"{name:<20}{s['kept']:>8}{s['dropped']:>9}{s['src_tokens_per_sentence']:>14}"
            f"{s['tgt_tokens_per_sentence']:>14}{s['src_unk_share']:>10.2%}{s['tgt_unk_share']:>10.2%}"
            + (f"   ({reasons})" if reasons else "")
        )
    if "train_batches" in summary:
        b = summary["train_batches"]
        lines.append(
            f"training batches at max_tokens={b['max_tokens']}: {b['batches']} per epoch, "
            f"{b['padding_waste']:.1%} of their tokens are padding"
        )
    return "\n".join(lines)
