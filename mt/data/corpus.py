"""Raw parallel text: read it from a local directory, download it, or load it
from a Hugging Face dataset, and check it on the way in.

Every source yields ``{split: SplitSource}``: a split read in batches of
(source lines, target lines), so a corpus of millions of pairs is never held
in memory whole. Nothing is dropped here: filtering belongs to ``mt.data.prepare``
and touches the training split only.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mt.config import DataConfig
from mt.errors import DataError
from mt.textio import utf8_lines

ENV_DATA_DIR = "MT_DATA_DIR"

Batches = Iterator[tuple[list[str], list[str]]]


@dataclass
class SplitSource:
    """One split of a parallel corpus. ``batches(n)`` reads it from the start,
    ``n`` aligned (source, target) lines at a time; a file's defects (invalid
    UTF-8, a damaged .gz, a line count that differs between the two sides) are
    ``DataError``s naming the file and line, raised when the reading gets there."""

    name: str
    batches: Callable[[int], Batches]

    def lines(self) -> tuple[list[str], list[str]]:
        """The whole split as two lists (for evaluation-sized splits)."""
        src: list[str] = []
        tgt: list[str] = []
        for s, t in self.batches(10_000):
            src += s
            tgt += t
        return src, tgt


def from_lists(name: str, src: list[str], tgt: list[str]) -> SplitSource:
    def batches(n: int) -> Batches:
        for i in range(0, len(src), n):
            yield src[i : i + n], tgt[i : i + n]

    return SplitSource(name, batches)


def iter_lines(path: Path) -> Iterator[str]:
    """Lines of a UTF-8 text file (plain or .gz), without line endings, read
    as they are needed."""
    try:
        f = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    with f:
        try:
            yield from utf8_lines(f, str(path))
        except (OSError, EOFError, zlib.error) as e:  # zlib.error: a .gz damaged inside
            raise DataError(f"{path}: cannot read: {e}") from None


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (plain or .gz), without line endings."""
    return list(iter_lines(path))


def read_pairs(name: str, src_path: Path, tgt_path: Path, n: int) -> Batches:
    """The aligned lines of two files, ``n`` pairs at a time."""
    src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
    src: list[str] = []
    tgt: list[str] = []
    for count, (s, t) in enumerate(itertools.zip_longest(src_lines, tgt_lines)):
        if s is None or t is None:  # one file has ended: count what is left of the other
            longer = src_lines if t is None else tgt_lines
            total = count + 1 + sum(1 for _ in longer)
            n_src, n_tgt = (total, count) if t is None else (count, total)
            raise DataError(f"split {name!r} is misaligned: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}")
        src.append(s)
        tgt.append(t)
        if len(src) == n:
            yield src, tgt
            src, tgt = [], []
    if src:
        yield src, tgt


def find_split_files(directory: Path, lang: str) -> dict[str, Path]:
    """{split: path} for files named <split>.<lang> or <split>.<lang>.gz."""
    pattern = re.compile(rf"^(?P<split>.+)\.{re.escape(lang)}(\.gz)?$")
    found = {}
    for path in sorted(directory.iterdir()):
        m = pattern.match(path.name)
        if m and path.is_file():
            found[m["split"]] = path
    return found


def read_local(directory: Path, src_lang: str, tgt_lang: str) -> tuple[dict[str, SplitSource], dict[str, list[Path]]]:
    """Every split that has both a source and a target file in ``directory``,
    and those files. Nothing is read yet."""
    if not directory.is_dir():
        raise DataError(f"{directory}: corpus directory does not exist")
    src_files = find_split_files(directory, src_lang)
    tgt_files = find_split_files(directory, tgt_lang)
    names = sorted(set(src_files) & set(tgt_files))
    if not names:
        raise DataError(f"{directory}: no <split>.{src_lang}[.gz] / <split>.{tgt_lang}[.gz] file pairs")
    splits, files = {}, {}
    for name in names:
        src, tgt = src_files[name], tgt_files[name]
        splits[name] = SplitSource(name, lambda n, name=name, src=src, tgt=tgt: read_pairs(name, src, tgt, n))
        files[name] = [src, tgt]
    return splits, files


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def known_checksums(cfg: DataConfig) -> dict[str, str]:
    """{file name: sha256} from ``data.checksums`` or the file shipped for the corpus."""
    if cfg.checksums:
        text = Path(cfg.checksums).read_text(encoding="utf-8")
    else:
        shipped = resources.files("mt.data") / "checksums" / f"{cfg.corpus}.sha256"
        if not shipped.is_file():
            return {}
        text = shipped.read_text(encoding="utf-8")
    sums = {}
    for line in text.splitlines():
        if line.strip():
            digest, name = line.split()
            sums[Path(name).name] = digest
    return sums


def download_file(url: str, dest: Path, sha256: str | None) -> None:
    """Fetch ``url`` to ``dest`` through a temporary name; rename only once verified."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            while block := response.read(1 << 20):
                out.write(block)
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        raise DataError(
            f"download of {url} failed ({e}). Offline? Point mt at a local copy of the corpus: "
            f"`mt prepare --data-dir DIR`, data.local_dir in the config, or {ENV_DATA_DIR}=DIR"
        ) from None
    if sha256 is not None:
        actual = sha256_of(part)
        if actual != sha256:
            part.unlink()
            raise DataError(f"{url}: checksum mismatch (expected sha256 {sha256}, got {actual}); file discarded")
    os.replace(part, dest)


def _fetch(url: str, directory: Path, sums: dict[str, str], required: bool) -> None:
    """Download ``url`` into ``directory`` unless a file with its known sha256 is there.
    A file whose sha256 is unknown is an error if ``required``, else skipped."""
    dest = directory / Path(urllib.parse.urlparse(url).path).name
    expected = sums.get(dest.name)
    if expected is None:
        if required:
            raise DataError(f"no sha256 known for {dest.name}; add it to a checksum file and set data.checksums")
        return
    if dest.exists() and sha256_of(dest) == expected:
        return
    print(f"downloading {url}")
    download_file(url, dest, expected)


def download(cfg: DataConfig, raw_dir: Path) -> tuple[dict[str, SplitSource], dict[str, list[Path]]]:
    """Download ``data.download_splits`` for both languages into ``raw_dir``, verified.
    Also the target side's tokenized references of ``data.paper_ref_splits``, where
    their sha256 is known, into ``raw_dir/tok/`` (``mt evaluate --paper`` looks there);
    those are optional, so a failure to fetch one is a warning."""
    sums = known_checksums(cfg)
    for split in cfg.download_splits:
        for lang in (cfg.src_lang, cfg.tgt_lang):
            _fetch(cfg.url.format(split=split, lang=lang), raw_dir, sums, required=True)
    for split in cfg.paper_ref_splits if cfg.paper_ref_url else []:
        try:
            _fetch(cfg.paper_ref_url.format(split=split, lang=cfg.tgt_lang), raw_dir / "tok", sums, required=False)
        except DataError as e:
            print(f"mt: warning: no paper-style BLEU for {split}: {e}", file=sys.stderr)
    splits, files = read_local(raw_dir, cfg.src_lang, cfg.tgt_lang)
    return {k: v for k, v in splits.items() if k in cfg.download_splits}, files


def load_hf(cfg: DataConfig) -> tuple[dict[str, SplitSource], str]:
    """A Hugging Face dataset with a ``translation`` column ({lang: text}, as
    ``wmt14``, ``wmt16`` and ``iwslt2017`` have) or one column per language,
    and a fingerprint of it. ``data.hf_name`` may name a hub dataset (with
    ``data.hf_config``, e.g. ``wmt/wmt14`` and ``de-en``), a local folder laid
    out as one, or a directory written by ``Dataset(Dict).save_to_disk``.
    Either way the data is Arrow on disk, memory-mapped, and read a batch at
    a time."""
    import datasets

    name = cfg.hf_name
    saved = Path(name) / "dataset_dict.json", Path(name) / "state.json"
    if any(p.is_file() for p in saved):  # written by save_to_disk
        ds = datasets.load_from_disk(name)
    else:  # a hub name, or a local folder laid out as a hub dataset (data files, configs in its README)
        try:
            ds = datasets.load_dataset(name, cfg.hf_config, revision=cfg.hf_revision)
        except Exception as e:  # network, missing dataset, bad config name: all reported the same way
            subset = f", subset {cfg.hf_config!r}" if cfg.hf_config else ""
            subset += f", revision {cfg.hf_revision!r}" if cfg.hf_revision else ""
            raise DataError(f"data.hf_name: cannot load Hugging Face dataset {name!r}{subset}: {e}") from None
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({cfg.train_split: ds})
    splits = {split: _hf_split(f"{name}/{split}", split, table, cfg) for split, table in ds.items()}
    return splits, "".join(f"{split}:{table._fingerprint};" for split, table in sorted(ds.items()))


def _hf_split(where: str, split: str, table, cfg: DataConfig) -> SplitSource:
    langs = cfg.src_lang, cfg.tgt_lang
    if "translation" in table.column_names:
        columns = ["translation"]
        if len(table):
            missing = [lang for lang in langs if lang not in (table[0]["translation"] or {})]
            if missing:
                raise DataError(f"{where}: translation column has no language {missing[0]!r}")
    elif all(lang in table.column_names for lang in langs):
        columns = list(langs)
    else:
        raise DataError(
            f"{where}: needs a 'translation' column or columns {cfg.src_lang!r} and {cfg.tgt_lang!r}, "
            f"has {table.column_names}"
        )

    def batches(n: int) -> Batches:
        for batch in table.select_columns(columns).iter(batch_size=n):
            if columns == ["translation"]:
                sides = [[(p or {}).get(lang) for p in batch["translation"]] for lang in langs]
            else:
                sides = [batch[lang] for lang in langs]
            yield tuple([x or "" for x in side] for side in sides)  # a missing text is an empty line

    return SplitSource(split, batches)


def load_corpus(cfg: DataConfig, raw_dir: Path) -> tuple[dict[str, SplitSource], str]:
    """The corpus as configured, and a fingerprint of its contents. Splits are
    read later, as they are needed."""
    source = cfg.source
    local_dir = cfg.local_dir or os.environ.get(ENV_DATA_DIR)
    if source == "auto":
        source = "local" if local_dir else "hf" if cfg.hf_name else "download"
    h = hashlib.sha256()
    if source == "local":
        if not local_dir:
            raise DataError(
                f"data.source is local but no directory is given (--data-dir, data.local_dir or {ENV_DATA_DIR})"
            )
        splits, files = read_local(Path(local_dir), cfg.src_lang, cfg.tgt_lang)
    elif source == "download":
        splits, files = download(cfg, raw_dir)
    elif source == "toy":
        from mt.data.toy import toy_corpus

        lists = toy_corpus(cfg.toy_sizes)
        splits, files = {name: from_lists(name, *sides) for name, sides in lists.items()}, {}
        for name, sides in sorted(lists.items()):
            h.update(name.encode() + "\n".join(sides[0] + sides[1]).encode())
    else:
        if not cfg.hf_name:
            raise DataError("data.source is hf but data.hf_name is not set")
        splits, fingerprint = load_hf(cfg)
        files = {}
        h.update(fingerprint.encode())
    for option, split in (("data.train_split", cfg.train_split), ("data.valid_split", cfg.valid_split)):
        if split not in splits:
            where = f" in {local_dir}" if source == "local" else ""
            raise DataError(
                f"no {split!r} split{where} ({option}): expected {split}.{cfg.src_lang} and {split}.{cfg.tgt_lang} "
                f"(or .gz); found {', '.join(sorted(splits)) or 'none'}"
            )
    for name in sorted(set(splits) & set(files)):
        h.update(name.encode())
        for path in files[name]:
            h.update(sha256_of(path).encode())
    return splits, h.hexdigest()
