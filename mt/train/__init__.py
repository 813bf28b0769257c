"""``mt train`` and ``mt average``: training driven by Lightning.

``lit`` (the thin LightningModule around the model: loss, optimiser,
schedule, validation BLEU) with ``loss`` (label-smoothed cross-entropy, R-Drop),
``speed`` (the two speed tricks training applies to the textbook model),
``checkpoints`` (saving, checking, averaging), ``ema`` (the moving average
of the weights) and ``run`` (the training run:
Trainer, callbacks, time budget, resume, the inference model at the end).

May import: ``mt.evaluate``, ``mt.decode``, ``mt.data``, ``mt.model`` and
the foundation modules.
"""
