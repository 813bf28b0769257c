"""`mt prepare` and `mt train` at scale: wall time and memory against corpus size.

Generates synthetic parallel corpora of the given sizes (gzip'd, as real
corpora come), runs `mt prepare` on each and `mt train` for a few updates on
the smallest and the largest, each as a child process, and prints:

- prepare: wall time, its time per 1,000 pairs, the peak resident memory of
  its largest process (the child's rusage) and the peak of the whole process
  tree (proportional set size, sampled, so pages shared by the encoding
  workers are counted once);
- train: peak resident memory (rusage: the largest process) and the share
  of the training steps' time spent waiting for data (as `mt train` reports
  it); and the same on the largest corpus with two DDP ranks on the CPU,
  where the rusage covers both ranks (the largest of them).

A synthetic pair: a source length drawn from a log-normal distribution
(median 18 words, a tail past 100, like news text), a target length near it,
and words drawn from Multi30k's own word frequencies on each side. The text
means nothing, but sentencepiece, the filters and the batches see realistic
lengths and a realistic vocabulary.

    python scripts/bench_prepare.py [--sizes 50000 500000 5000000] [--train-steps 200] [--no-ddp]

Corpora, prepared data and runs go under --work (default data/bench/), and a
corpus once generated is reused. A benchmark, not a test: results in
docs/results/README.md ("Corpora of millions of pairs").
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

from mt.data.corpus import iter_lines

ROOT = Path(__file__).resolve().parent.parent
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k" / "raw"
SRC, TGT = "en", "de"
VALID_PAIRS = 1000


def vocabulary(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Words of a Multi30k file and their relative frequencies."""
    counts = Counter(word for line in iter_lines(path) for word in line.split())
    words, n = zip(*counts.most_common())
    return np.array(words, dtype=object), np.array(n, dtype=np.float64) / sum(n)


def sentences(rng: np.random.Generator, lengths: np.ndarray, vocab: tuple[np.ndarray, np.ndarray]) -> list[str]:
    words = rng.choice(vocab[0], size=int(lengths.sum()), p=vocab[1])
    ends = np.cumsum(lengths)
    return [" ".join(words[e - n : e]) for e, n in zip(ends.tolist(), lengths.tolist())]


def write_split(directory: Path, split: str, n: int, seed: int, vocabs: dict) -> None:
    rng = np.random.default_rng(seed)
    parts = [directory / f"{split}.{lang}.gz.part" for lang in (SRC, TGT)]
    # compresslevel 1: quick to write; reading a .gz costs about the same at any level
    with (
        gzip.open(parts[0], "wt", encoding="utf-8", compresslevel=1) as src_file,
        gzip.open(parts[1], "wt", encoding="utf-8", compresslevel=1) as tgt_file,
    ):
        for start in range(0, n, 100_000):
            k = min(100_000, n - start)
            src_len = np.clip(np.rint(rng.lognormal(np.log(18), 0.55, k)), 1, 250).astype(np.int64)
            tgt_len = np.clip(np.rint(src_len * rng.normal(1.05, 0.15, k)), 1, 250).astype(np.int64)
            src_file.write("\n".join(sentences(rng, src_len, vocabs[SRC])) + "\n")
            tgt_file.write("\n".join(sentences(rng, tgt_len, vocabs[TGT])) + "\n")
    for part in parts:
        part.rename(part.with_suffix(""))


def corpus(work: Path, n: int, vocabs: dict) -> Path:
    directory = work / f"synthetic-{n}"
    if not all((directory / f"{s}.{lang}.gz").exists() for s in ("train", "val") for lang in (SRC, TGT)):
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        write_split(directory, "train", n, seed=n, vocabs=vocabs)
        write_split(directory, "val", VALID_PAIRS, seed=n + 1, vocabs=vocabs)
        print(f"generated {n:,} pairs in {time.perf_counter() - start:.0f} s: {directory}", flush=True)
    return directory


def tree_pss(pid: int) -> int:
    """Proportional set size of ``pid`` and its descendants, in bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue  # it ended meanwhile
    return total


def run(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` as a child, its output into ``log``; wall time and memory."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_pss(child.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, status, usage = os.wait4(child.pid, 0)
    except BaseException:
        os.killpg(child.pid, 9)
        raise
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed; its output is in {log}")
    return {"seconds": seconds, "rss": usage.ru_maxrss * 1024, "tree_pss": peak[0], "log": log.read_text()}


def config(work: Path, n: int, steps: int) -> Path:
    """configs/multi30k_cpu.yaml's model and batches, on the synthetic corpus."""
    cfg = yaml.safe_load((ROOT / "configs" / "multi30k_cpu.yaml").read_text())
    cfg["data"].update(
        corpus=f"synthetic-{n}", source="local", local_dir=str(work / f"synthetic-{n}"),
        prepared_dir=str(work / "prepared" / f"synthetic-{n}"),
    )  # fmt: skip
    cfg["train"].update(
        max_steps=steps, max_minutes=None, val_every_steps=0, val_bleu=False, average_last=1, average_choose=False,
        run_dir=str(work / "runs" / f"synthetic-{n}"),
    )  # fmt: skip
    path = work / f"synthetic-{n}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[50_000, 500_000, 5_000_000], help="training pairs")
    p.add_argument("--train-steps", type=int, default=200, help="updates of mt train on the smallest and largest")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the 2-rank DDP run on the largest")
    p.add_argument("--work", type=Path, default=ROOT / "data" / "bench")
    p.add_argument("--multi30k", type=Path, default=MULTI30K, help="Multi30k's raw/ directory (word frequencies)")
    args = p.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    vocabs = {lang: vocabulary(args.multi30k / f"train.{lang}.gz") for lang in (SRC, TGT)}
    mt = [sys.executable, "-m", "mt"]
    for n in sorted(args.sizes):
        cfg = config(args.work, n, args.train_steps)
        corpus(args.work, n, vocabs)
        subprocess.run(["rm", "-rf", str(args.work / "prepared" / f"synthetic-{n}")], check=True)
        r = run([*mt, "prepare", "--config", str(cfg)], args.work / f"prepare-{n}.log")
        print(
            f"prepare {n:>9,} pairs: {r['seconds']:7.1f} s ({1000 * r['seconds'] / n:.2f} s per 1k pairs), "
            f"largest process {gib(r['rss'])}, process tree {gib(r['tree_pss'])}",
            flush=True,
        )
    for n in sorted({min(args.sizes), max(args.sizes)}):
        subprocess.run(["rm", "-rf", str(args.work / "runs" / f"synthetic-{n}")], check=True)
        r = run([*mt, "train", "--config", str(args.work / f"synthetic-{n}.yaml")], args.work / f"train-{n}.log")
        report(f"train   {n:>9,} pairs", args.train_steps, r)
    if args.ddp:  # two ranks on the CPU, the largest corpus: each memory-maps the same files
        n = max(args.sizes)
        subprocess.run(["rm", "-rf", str(args.work / "runs" / f"synthetic-{n}")], check=True)
        ddp = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp"]
        r = run([*mt, "train", "--config", str(args.work / f"synthetic-{n}.yaml"), *ddp], args.work / f"ddp-{n}.log")
        report(f"train   {n:>9,} pairs, 2 ranks", args.train_steps, r)


def report(what: str, steps: int, r: dict) -> None:
    wait = re.search(r"waiting for data: ([\d.]+)%", r["log"])
    print(
        f"{what}, {steps} updates: {r['seconds']:6.1f} s, largest process {gib(r['rss'])}, "
        f"process tree {gib(r['tree_pss'])}, waiting for data {wait[1] if wait else '?'}%",
        flush=True,
    )


if __name__ == "__main__":
    main()
