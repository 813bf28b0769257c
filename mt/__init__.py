"""mt: a minimal, trainable Transformer translation toolkit."""

__version__ = "0.1.0"
