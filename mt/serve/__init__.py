"""``mt serve``: translation and attention over HTTP, and a page to use them.

``app`` (the FastAPI application, its limits and errors) → ``batcher`` (the
decoding processes, each running ``mt.decode.continuous``'s search), with
the page in ``web/``.

May import: ``mt.inspect``, ``mt.decode``, ``mt.data``, ``mt.model`` and
the foundation modules. Never ``mt.cli``.
"""
