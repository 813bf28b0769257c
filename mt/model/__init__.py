"""The textbook model: what a learner reads, in this order.

``masks`` (the one mask convention) → ``attention`` (scaled dot-product and
multi-head attention) → ``layers`` (positions, feed-forward, encoder and
decoder layers) → ``transformer`` (``Transformer.encode / decode / forward``
and its key/value cache).

Plain PyTorch that reads like the math; no speed tricks for one kind of
hardware (``mt.decode.fastpath`` applies those when a model is loaded for
decoding, and ``mt.train.speed`` the few that training uses).

May import: ``mt.config``, ``mt.errors``. Nothing else of ``mt``, and never
Lightning or the data code.
"""
