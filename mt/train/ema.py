"""An exponential moving average (EMA) of the weights while training
(``train.ema_decay``), kept beside the weights the optimizer updates.

After each optimizer update, ``ema = d * ema + (1 - d) * weights``, with
``d = min(train.ema_decay, (1 + n) / (10 + n))`` at update ``n``: the usual
warm start, so that the random initial weights are soon forgotten. Like
checkpoint averaging it smooths the noise of the last updates away, but over
every update rather than a few checkpoints. The average never feeds back into
training; it travels in every checkpoint (``checkpoint["mt_ema"]``), so that a
resumed run continues it exactly, and the run's inference model is read from it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from mt.errors import MTError

KEY = "mt_ema"  #: where a checkpoint holds the average: {"decay", "updates", "state_dict"}


def ema_rate(decay: float, updates: int) -> float:
    """The decay after ``updates`` optimizer updates: ``decay``, or less early on."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightEMA(Callback):
    """Keeps the moving average of the LightningModule's floating-point
    weights, under the names of its ``state_dict`` (as a checkpoint's)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.updates = 0
        self.state_dict_: dict[str, torch.Tensor] | None = None
        self._pairs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def on_train_start(self, trainer, module) -> None:
        live = {n: t for n, t in module.state_dict().items() if t.is_floating_point()}
        if self.state_dict_ is None:  # a new run (a resumed one brought its average)
            self.state_dict_ = {n: t.detach().float().clone() for n, t in live.items()}
            self.updates = trainer.global_step
        # the state dict's tensors share storage with the parameters: the optimizer's updates show through
        self._pairs = ([self.state_dict_[n] for n in live], list(live.values()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.updates:  # accumulating gradients: no update yet
            return
        self.updates = trainer.global_step
        averaged, live = self._pairs
        live = [t if t.dtype == torch.float32 else t.float() for t in live]  # bf16-true weights
        with torch.no_grad():
            torch._foreach_lerp_(averaged, live, 1.0 - ema_rate(self.decay, self.updates))

    def on_save_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        if self.state_dict_ is not None:
            checkpoint[KEY] = {"decay": self.decay, "updates": self.updates, "state_dict": self.state_dict_}

    def on_load_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        saved = checkpoint.get(KEY)
        if saved is not None:  # else the run had no average so far: it starts from the weights resumed
            self.state_dict_ = {n: t.float() for n, t in saved["state_dict"].items()}
            self.updates = int(saved["updates"])


def ema_state_dict(checkpoint: dict, path: Path) -> tuple[dict[str, torch.Tensor], float, int]:
    """The moving average a checkpoint holds (read from ``path``): weights, decay, updates."""
    saved = checkpoint.get(KEY)
    if not isinstance(saved, dict) or not isinstance(saved.get("state_dict"), dict):
        raise MTError(f"{path}: holds no moving average of the weights (train with train.ema_decay > 0)")
    return saved["state_dict"], float(saved["decay"]), int(saved["updates"])
