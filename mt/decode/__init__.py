"""Translating with a trained model: ``mt translate`` and what every other
command that decodes shares.

``inference`` (the run directory's inference model: save, load, and
``open_translator``, the one loading policy: CTranslate2 export or not,
ensemble, int8, dtype, device) → ``translator`` (``Translator``: lines in,
translations out, in batches) → ``search`` (batched greedy and beam search
over ``Transformer.encode / decode``, one ``beam_step`` shared with
``continuous``, the beam search that sentences join and leave between
steps). ``ensemble`` averages several models' log-probabilities.
``sentences`` cuts a paragraph into sentences and a sentence too long for the
model into parts, and joins their translations with the source's spacing;
``subtitles`` reads and writes SubRip files.

The speed work lives here, applied at load time and proven equal to the
textbook model by the tests: ``fastpath`` (oneDNN products, stacked
projections, a growing key/value cache, masks as biases), ``int8``,
``allocator``, and ``ct2`` (decoding a CTranslate2 export).

May import: ``mt.model``, ``mt.data``, and ``mt.config`` / ``errors`` /
``textio`` / ``hardware``.
"""
