"""Errors that ``mt`` reports as one clear line instead of a traceback."""

from __future__ import annotations


class MTError(Exception):
    """Base class: an expected failure with a message that names the cause."""


class DataError(MTError):
    """A corpus file is missing, misaligned, undecodable or fails its checksum."""


class ModelDirError(MTError):
    """A run/model directory is missing, incomplete or inconsistent."""
