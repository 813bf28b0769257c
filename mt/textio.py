"""Line-oriented text I/O for the command line: strict UTF-8 input that names
the failing line, and output files that appear only once complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from mt.errors import DataError


def utf8_lines(stream: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode byte lines one by one, a leading byte-order mark dropped; invalid UTF-8
    raises DataError naming ``name:line``."""
    for n, raw in enumerate(stream, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name}:{n}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
        if n == 1:  # a byte-order mark (files saved on Windows) is no part of the first line
            text = text.removeprefix("\ufeff")
        yield text.rstrip("\n").rstrip("\r")


def _file_in_the_way(path: Path) -> Path:
    """The outermost ancestor of ``path`` that exists and is not a directory."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path.parent


def new_file_mode() -> int:
    """The permissions ``open(path, "w")`` gives a new file: 0o666 less the umask.
    Temporary files are created 0o600, and a rename keeps that."""
    try:  # Linux reports it; setting it to read it back would briefly change it for every thread
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def publish(tmp: str | Path, path: str | Path) -> None:
    """Rename the finished ``tmp`` to ``path``, with the permissions a file
    written in place would have (those of the file it replaces, if any)."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_output(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """Write ``path`` (UTF-8 text, or bytes with ``binary``) so that it appears only
    once complete: into a temporary file beside it, renamed over it when the block
    finishes; on any error or Ctrl-C the partial file is removed.

    A symbolic link is written through: the file it points to is replaced (the
    same way), the link stays. A FIFO or a character device (a pipe,
    ``/dev/stdout``) is written directly, since nothing can be renamed over it.
    Anything else that stands at ``path`` (a directory, a socket, a block device),
    and a directory that does not exist, is a ``DataError`` naming the path."""
    path = Path(path)
    try:
        kind = os.stat(path).st_mode  # through symbolic links
    except FileNotFoundError:
        kind = None
    except NotADirectoryError:
        raise DataError(f"{path}: cannot write, {_file_in_the_way(path)} is not a directory") from None
    except OSError as e:
        raise DataError(f"{path}: cannot write ({e.strerror})") from None
    if kind is not None and (stat.S_ISFIFO(kind) or stat.S_ISCHR(kind)):
        with _direct(path, binary) as f:
            yield f
        return
    if kind is not None and stat.S_ISDIR(kind):
        raise DataError(f"{path}: is a directory, not an output file")
    if kind is not None and not stat.S_ISREG(kind):
        raise DataError(f"{path}: is not a regular file, a pipe or a character device; give an output file")
    target = Path(os.path.realpath(path))  # the file itself, where path is a symbolic link to it
    if not target.parent.is_dir():
        missing = "does not exist" if not target.parent.exists() else "is not a directory"
        raise DataError(f"{path}: cannot write, {target.parent} {missing}")
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    except OSError as e:
        raise DataError(f"{path}: cannot write ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _direct(path: Path, binary: bool) -> Iterator[IO]:
    """A pipe or a character device, written in place (there is no file to rename)."""
    try:
        f = open(path, "wb") if binary else open(path, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise DataError(f"{path}: cannot write ({e.strerror})") from None
    with f:
        yield f


PARTIAL_MARK = ".mt-partial"  # in a directory mt is writing: it may remove it


def begin_directory(out: Path, marker: str, how: str) -> Path:
    """Start writing the directory ``out`` anew: returns ``out.partial``, made empty with
    ``PARTIAL_MARK`` in it, to fill and then ``finish_directory``. mt replaces only what
    it wrote: ``out`` may be absent, empty, or hold ``marker`` (the file the writer
    leaves in every directory it writes); ``out.partial`` may be absent, empty, or hold
    ``PARTIAL_MARK`` or ``marker`` (an interrupted earlier run). Anything else is a ``DataError`` that
    names it; ``how`` says what to do instead (another name, --force...)."""
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    if out.exists() and not _ours(out, marker):
        raise DataError(f"{out}: exists and was not written by mt (no {marker} in it); it is left as it is: {how}")
    if partial.exists() and not (_ours(partial, PARTIAL_MARK) or _ours(partial, marker)):
        raise DataError(f"{partial}: exists and was not left by mt (no {PARTIAL_MARK} in it); it is left as it is: "
                        f"remove it or {how}")  # fmt: skip
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / PARTIAL_MARK).write_text("a directory mt is writing; it replaces this one when complete\n")
    return partial


def finish_directory(partial: Path, out: Path) -> None:
    """Put the complete ``partial`` in the place of ``out`` (checked by ``begin_directory``)."""
    (partial / PARTIAL_MARK).unlink()
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def abandon_directory(partial: Path) -> None:
    """Remove an unfinished ``partial`` (an error, Ctrl-C): nothing half-made is left behind."""
    if (partial / PARTIAL_MARK).exists():
        shutil.rmtree(partial, ignore_errors=True)


def _ours(path: Path, marker: str) -> bool:
    """A directory that is empty or holds ``marker``: mt may replace it."""
    return path.is_dir() and not path.is_symlink() and ((path / marker).is_file() or not any(path.iterdir()))
