"""``mt prepare`` and the data that training reads: raw text to batches.

``corpus`` (reading a corpus: local files, a download, a Hugging Face
dataset, the toy task of ``toy``) → ``tokenizer`` (sentencepiece, the one
vocabulary) → ``prepare`` (the prepared directory: tokenizer, encoded
splits) → ``batches`` (the prepared splits as token-bucketed batches, the
Lightning DataModule).

May import: ``mt.config``, ``mt.errors``, ``mt.textio``. Not the model.
"""
