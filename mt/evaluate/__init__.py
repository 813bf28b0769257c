"""``mt evaluate``: translate a test set and score it.

``metrics`` (sacreBLEU BLEU and chrF, and Multi30k papers' tokenized BLEU),
``scoring`` (the command: a split or a pair of files, translated and scored,
the scores written beside the run) and ``alpha`` (``mt choose-alpha``: the
length penalty of highest BLEU on validation, written into the run).

May import: ``mt.decode``, ``mt.data``, ``mt.model`` and the foundation
modules (``mt.config``, ``errors``, ``textio``, ``hardware``).
"""
