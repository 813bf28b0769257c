"""Errors that ``mt`` reports as one clear line instead of a traceback."""

from __future__ import annotations


class MTError(Exception):
    """Base class: an expected failure with a message that names the cause."""


class DataError(MTError):
    """A corpus file is missing, misaligned, undecodable or fails its checksum."""


class ModelDirError(MTError):
    """A run/model directory is missing, incomplete or inconsistent."""


class Stopped(Exception):
    """A command stopped by a signal, after saying what it saved; ``status`` is the exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
