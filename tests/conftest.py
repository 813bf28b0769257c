import gzip
from pathlib import Path

import pytest

from mt.config import DataConfig
from mt.toy import toy_corpus


def write_corpus(directory: Path, splits: dict, langs=("en", "de"), gz=False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, sides in splits.items():
        for lang, lines in zip(langs, sides):
            data = "".join(line + "\n" for line in lines).encode()
            if gz:
                (directory / f"{name}.{lang}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / f"{name}.{lang}").write_bytes(data)
    return directory


@pytest.fixture
def corpus_splits():
    return toy_corpus({"train": 300, "val": 40, "test_2016_flickr": 30}, seed=3)


@pytest.fixture
def data_cfg(tmp_path, monkeypatch, corpus_splits):
    """A small local corpus (plain text) and a config pointing at it."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "raw", corpus_splits)
    return DataConfig(
        corpus="synth", source="local", local_dir=str(tmp_path / "raw"), prepared_dir=str(tmp_path / "prepared"),
        vocab_size=60, max_tokens=512, max_len=60,
    )  # fmt: skip
