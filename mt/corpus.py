"""Raw parallel text: read it from a local directory, download it, or load it
from a Hugging Face dataset, and check it on the way in.

Every source yields ``{split: (source_lines, target_lines)}``. Nothing is
dropped here: filtering belongs to ``mt.prepare`` and touches the training split
only.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from importlib import resources
from pathlib import Path

from mt.config import DataConfig
from mt.errors import DataError

Splits = dict[str, tuple[list[str], list[str]]]

ENV_DATA_DIR = "MT_DATA_DIR"


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (plain or .gz), without line endings."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a .gz damaged inside
        raise DataError(f"{path}: cannot read: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def find_split_files(directory: Path, lang: str) -> dict[str, Path]:
    """{split: path} for files named <split>.<lang> or <split>.<lang>.gz."""
    pattern = re.compile(rf"^(?P<split>.+)\.{re.escape(lang)}(\.gz)?$")
    found = {}
    for path in sorted(directory.iterdir()):
        m = pattern.match(path.name)
        if m and path.is_file():
            found[m["split"]] = path
    return found


def read_local(directory: Path, src_lang: str, tgt_lang: str) -> tuple[Splits, dict[str, list[Path]]]:
    """Every split that has both a source and a target file in ``directory``."""
    if not directory.is_dir():
        raise DataError(f"{directory}: corpus directory does not exist")
    src_files = find_split_files(directory, src_lang)
    tgt_files = find_split_files(directory, tgt_lang)
    names = sorted(set(src_files) & set(tgt_files))
    if not names:
        raise DataError(f"{directory}: no <split>.{src_lang}[.gz] / <split>.{tgt_lang}[.gz] file pairs")
    splits, files = {}, {}
    for name in names:
        src, tgt = read_lines(src_files[name]), read_lines(tgt_files[name])
        if len(src) != len(tgt):
            raise DataError(
                f"split {name!r} is misaligned: {src_files[name]} has {len(src)} lines, "
                f"{tgt_files[name]} has {len(tgt)}"
            )
        splits[name] = (src, tgt)
        files[name] = [src_files[name], tgt_files[name]]
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
        shipped = resources.files("mt") / "checksums" / f"{cfg.corpus}.sha256"
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


def download(cfg: DataConfig, raw_dir: Path) -> tuple[Splits, dict[str, list[Path]]]:
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


def load_hf(cfg: DataConfig) -> Splits:
    """A Hugging Face dataset with a ``translation`` column ({lang: text}) or one
    column per language. ``data.hf_name`` may name a hub dataset or a directory
    written by ``Dataset(Dict).save_to_disk``."""
    import datasets

    name = cfg.hf_name
    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
    else:
        try:
            ds = datasets.load_dataset(name, cfg.hf_config)
        except Exception as e:  # network, missing dataset, bad config name: all reported the same way
            subset = f", subset {cfg.hf_config!r}" if cfg.hf_config else ""
            raise DataError(f"data.hf_name: cannot load Hugging Face dataset {name!r}{subset}: {e}") from None
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({cfg.train_split: ds})
    splits = {}
    for split, table in ds.items():
        if "translation" in table.column_names:
            pairs = table["translation"]
            try:
                splits[split] = ([p[cfg.src_lang] for p in pairs], [p[cfg.tgt_lang] for p in pairs])
            except KeyError as e:
                raise DataError(f"{name}/{split}: translation column has no language {e}") from None
        elif cfg.src_lang in table.column_names and cfg.tgt_lang in table.column_names:
            splits[split] = (list(table[cfg.src_lang]), list(table[cfg.tgt_lang]))
        else:
            raise DataError(
                f"{name}/{split}: needs a 'translation' column or columns {cfg.src_lang!r} and {cfg.tgt_lang!r}, "
                f"has {table.column_names}"
            )
    return splits


def load_corpus(cfg: DataConfig, raw_dir: Path) -> tuple[Splits, str]:
    """The corpus as configured, and a fingerprint of its contents."""
    source = cfg.source
    local_dir = cfg.local_dir or os.environ.get(ENV_DATA_DIR)
    if source == "auto":
        source = "local" if local_dir else "hf" if cfg.hf_name else "download"
    if source == "local":
        if not local_dir:
            raise DataError(
                f"data.source is local but no directory is given (--data-dir, data.local_dir or {ENV_DATA_DIR})"
            )
        splits, files = read_local(Path(local_dir), cfg.src_lang, cfg.tgt_lang)
    elif source == "download":
        splits, files = download(cfg, raw_dir)
    elif source == "toy":
        from mt.toy import toy_corpus

        splits, files = toy_corpus(cfg.toy_sizes), {}
    else:
        if not cfg.hf_name:
            raise DataError("data.source is hf but data.hf_name is not set")
        splits, files = load_hf(cfg), {}
    for option, split in (("data.train_split", cfg.train_split), ("data.valid_split", cfg.valid_split)):
        if split not in splits:
            where = f" in {local_dir}" if source == "local" else ""
            raise DataError(
                f"no {split!r} split{where} ({option}): expected {split}.{cfg.src_lang} and {split}.{cfg.tgt_lang} "
                f"(or .gz); found {', '.join(sorted(splits)) or 'none'}"
            )
    h = hashlib.sha256()
    for name in sorted(splits):
        h.update(name.encode())
        if name in files:
            for path in files[name]:
                h.update(sha256_of(path).encode())
        else:
            for side in splits[name]:
                h.update("\n".join(side).encode())
    return splits, h.hexdigest()
