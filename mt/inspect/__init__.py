"""``mt attention``: looking inside a trained model.

``capture`` (every layer's and head's attention weights for a sentence,
with its tokens) → ``lesson`` (one head carried out step by step on the real
weights, each step checked against the model) → ``plotting`` (heatmaps and
pages, pure functions of weights and tokens, with the page parts in
``web/``) → ``command`` (what ``mt attention`` runs).

May import: ``mt.decode``, ``mt.data``, ``mt.model`` and the foundation modules.
"""
