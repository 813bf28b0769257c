"""``mt export``: a trained model written in another toolkit's format.

``ct2``: a CTranslate2 model directory, exact, checked against ``mt`` when
written (decoding an export is ``mt.decode.ct2``'s).

May import: ``mt.evaluate``, ``mt.decode``, ``mt.data``, ``mt.model`` and
the foundation modules.
"""
