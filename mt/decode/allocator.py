"""The C allocator's settings for decoding on CPU.

Decoding allocates and frees the same large tensors at every step: logits
(rows x vocabulary), the grown key/value caches, beam search's reordered
copies of them. glibc's malloc hands blocks this large back to the operating
system when they are freed (``munmap``, or trimming the top of the heap),
so the next step gets fresh pages and pays a page fault for each 4 KiB of
them. Keeping freed memory for reuse (``mallopt``, as the environment
variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would)
removes those faults (what that gains: docs/performance.md). The process then holds
on to its peak memory until it exits, which suits a command that decodes and
ends (``mt translate``, ``mt evaluate``); ``MT_KEEP_FREED_MEMORY=0`` leaves
the allocator as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_LIMIT = 1 << 30  # blocks up to 1 GiB come from the heap, and up to 1 GiB of free heap is kept


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks (up to 1 GiB) for reuse instead of
    returning them to the system. Process-wide. Returns whether it did: not
    off Linux/glibc, not with ``MT_KEEP_FREED_MEMORY=0``, and not where the
    user set glibc's own variables for these two settings."""
    if os.environ.get("MT_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # no mallopt (musl, for one)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
