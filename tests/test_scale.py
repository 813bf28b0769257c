"""mt prepare streams and mt train reads memory-mapped: memory flat in the
corpus size, the same result in one encoding process or several, defects
found deep in a large file named by line, and the hub loading path tested
offline on a folder laid out as a hub dataset. The 5-million-pair figures
are scripts/bench_prepare.py's."""

import gzip
import os
import random
import subprocess

import pytest
from conftest import mt_cmd, train_args, write_corpus

from mt.cli.main import main
from mt.config import DataConfig
from mt.data.batches import Split, TranslationDataModule
from mt.data.prepare import prepare
from mt.data.tokenizer import Tokenizer
from mt.data.toy import TRANSLATION, WORDS
from mt.errors import DataError


def long_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    src = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 100))) for _ in range(n)]
    return src, [" ".join(TRANSLATION[w] for w in reversed(s.split())) for s in src]


def config_yaml(path, raw, prepared, **extra) -> str:
    fields = {
        "corpus": "big", "source": "local", "local_dir": str(raw), "prepared_dir": str(prepared), "vocab_size": 60,
        "max_len": 400, "max_tokens": 4096, "spm_sample": 2000, **extra,
    }  # fmt: skip
    path.write_text("data:\n" + "".join(f"  {k}: {v}\n" for k, v in fields.items()))
    return str(path)


def test_prepare_memory_does_not_grow_with_a_ten_times_larger_corpus(tmp_path, children):
    """Peak RSS of `mt prepare` (the child's rusage, all its processes) on
    3,000 and 30,000 pairs of 60-100 words. A prepare that holds the corpus
    in Python lists peaks 517 MiB higher on the larger one; streaming, the
    two peaks are within noise of each other."""
    peaks = {}
    for n in (3_000, 30_000):
        src, tgt = long_pairs(n, seed=n)
        raw = write_corpus(tmp_path / f"raw{n}", {"train": (src, tgt), "val": (src[:50], tgt[:50])}, gz=True)
        cfg = config_yaml(tmp_path / f"c{n}.yaml", raw, tmp_path / f"prepared{n}")
        proc = children(mt_cmd("prepare", "--config", cfg), stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0
        peaks[n] = usage.ru_maxrss / 1024  # MiB
    assert peaks[30_000] - peaks[3_000] < 100, peaks


def test_encoding_in_several_processes_gives_the_same_data(tmp_path, monkeypatch, corpus_splits):
    """num_proc=2 splits the encoding across processes (the tokenizer, Moses
    normalisers included, travels to them); the prepared splits are equal."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "raw", corpus_splits)
    splits = {}
    for n in (1, 2):
        cfg = DataConfig(
            corpus="synth", source="local", local_dir=str(tmp_path / "raw"), prepared_dir=str(tmp_path / f"p{n}"),
            vocab_size=60, max_tokens=512, max_len=60, text="paper", num_proc=n,
        )  # fmt: skip
        summary = prepare(cfg, verbose=False)
        splits[n] = {name: Split(tmp_path / f"p{n}" / name) for name in summary["splits"]}
    for name, split in splits[1].items():
        other = splits[2][name]
        assert (split.src, split.tgt, split.src_text) == (other.src, other.tgt, other.src_text)
    assert not list(tmp_path.glob("p*/work"))  # the Arrow files in between are gone


def test_sentencepiece_sample_is_bounded_and_reproducible(tmp_path, monkeypatch, corpus_splits):
    """With fewer sample lines than the corpus has, sentencepiece trains on a
    seeded random sample: the same tokenizer twice, another one than on all lines."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "raw", corpus_splits)
    models = {}
    for name, sample in (("a", 150), ("b", 150), ("all", 1_000_000)):
        cfg = DataConfig(
            corpus="synth", source="local", local_dir=str(tmp_path / "raw"), prepared_dir=str(tmp_path / name),
            vocab_size=60, max_tokens=512, max_len=60, spm_sample=sample,
        )  # fmt: skip
        prepare(cfg, verbose=False)
        proc = Tokenizer.load(tmp_path / name).src
        models[name] = [(proc.id_to_piece(i), proc.get_score(i)) for i in range(proc.get_piece_size())]
    assert models["a"] == models["b"]
    assert models["a"] != models["all"]


def test_a_defect_deep_in_a_large_file_is_named_by_its_line(data_cfg, tmp_path):
    """Line numbers stay right across the reading batches (10,000 lines each)."""
    src, tgt = ["cat dog"] * 25_000, ["ogod otac"] * 25_000
    write_corpus(tmp_path / "raw", {"train": (src, tgt)}, gz=True)
    (tmp_path / "raw" / "train.en").unlink(missing_ok=True)
    (tmp_path / "raw" / "train.de").unlink(missing_ok=True)
    bad = b"".join(b"ogod otac\n" if i != 21_234 else b"bad \xff byte\n" for i in range(1, 25_001))
    (tmp_path / "raw" / "train.de.gz").write_bytes(gzip.compress(bad))
    with pytest.raises(DataError, match=r"train\.de\.gz:21234: invalid UTF-8"):
        prepare(data_cfg, verbose=False)
    (tmp_path / "raw" / "train.de.gz").write_bytes(gzip.compress(b"ogod otac\n" * 24_999))
    with pytest.raises(DataError, match=r"train\.en\.gz has 25000 lines, .*train\.de\.gz has 24999"):
        prepare(data_cfg, verbose=False)
    (tmp_path / "raw" / "train.de.gz").write_bytes(gzip.compress(b"ogod otac\n" * 25_003))
    with pytest.raises(DataError, match=r"train\.en\.gz has 25000 lines, .*train\.de\.gz has 25003"):
        prepare(data_cfg, verbose=False)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "prepared.partial").exists()


def test_training_reads_the_split_memory_mapped(data_cfg):
    """An epoch of training batches never reads a whole column into lists."""
    prepare(data_cfg, verbose=False)
    dm = TranslationDataModule(data_cfg, seed=1)
    dm.setup()
    train = dm.split("train")
    assert train.ds.cache_files and all(f["filename"].endswith(".arrow") for f in train.ds.cache_files)
    rows = [i for batch in dm.train_dataloader() for i in batch.index.tolist()]
    assert sorted(rows) == list(range(len(train)))
    assert not {"src", "tgt", "src_text", "tgt_text"} & set(vars(train))  # no column was read whole


def test_loader_workers_train_the_same_model(toy_data, tmp_path):
    """data.num_workers=2 reads the batches in two processes: the same batches
    in the same order, so the same weights; mt train says how long it waited."""
    weights = {}
    for workers in (0, 2):
        run = tmp_path / f"w{workers}"
        args = train_args(toy_data, run, "train.max_steps=12", "train.val_every_steps=0", f"data.num_workers={workers}")
        assert main(args + ["train.average_last=1", "train.average_choose=false", "train.val_bleu=false"]) == 0
        weights[workers] = (run / "model.safetensors").read_bytes()
    assert weights[0] == weights[2]


def hub_layout(root, splits: dict) -> None:
    """A folder as the hub serves wmt/wmt14: parquet files per config, the
    configs declared in the README's front matter."""
    import datasets

    (root / "de-en").mkdir(parents=True)
    entries = []
    for name, (src, tgt) in splits.items():
        table = datasets.Dataset.from_dict({"translation": [{"de": t, "en": s} for s, t in zip(src, tgt)]})
        table.to_parquet(str(root / "de-en" / f"{name}-00000-of-00001.parquet"))
        entries.append(f"  - split: {name}\n    path: de-en/{name}-*\n")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: de-en\n  data_files:\n" + "".join(entries) + "---\n")


def test_hub_dataset_path_offline(tmp_path, monkeypatch, corpus_splits, capsys):
    """data.hf_name + data.hf_config go through datasets.load_dataset, as for
    wmt14, wmt16 or iwslt2017, here on a local folder in the hub's layout."""
    monkeypatch.chdir(tmp_path)
    train, val = corpus_splits["train"], corpus_splits["val"]
    hub_layout(tmp_path / "wmt-like", {"train": train, "validation": val})
    cfg = config_yaml(
        tmp_path / "c.yaml", "null", tmp_path / "prepared", source="hf", hf_name=str(tmp_path / "wmt-like"),
        hf_config="de-en", valid_split="validation", max_len=60, spm_sample=1000000,
    )  # fmt: skip
    assert main(["prepare", "--config", cfg]) == 0
    assert "validation" in capsys.readouterr().out
    assert Split(tmp_path / "prepared" / "validation").tgt_text == val[1]
    assert main(["prepare", "--config", cfg, "data.hf_config=fr-en"]) == 1
    assert "cannot load Hugging Face dataset" in capsys.readouterr().err
