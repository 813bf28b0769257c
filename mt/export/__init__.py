"""``mt export``: a trained model written in another toolkit's format, exactly
(an option the format cannot hold is refused by name), checked against ``mt``
when written.

``ct2``: a CTranslate2 model directory (decoding one is ``mt.decode.ct2``'s).
``argos``: an Argos Translate package (LibreTranslate's format): the ct2 export,
the sentencepiece model and an offline sentence splitter.
``hf``: a Hugging Face transformers model directory (Blenderbot or Marian).

May import: ``mt.evaluate``, ``mt.decode``, ``mt.data``, ``mt.model`` and
the foundation modules.
"""
