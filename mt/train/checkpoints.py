"""A run's checkpoints: checked before they are read, averaged, and exported
as the run's inference model (``model.safetensors`` + ``model.json``).

Checkpoints are Lightning's (``checkpoints/step=N.ckpt``, ``best.ckpt``,
``last.ckpt``); only their ``state_dict`` is read, and no code is unpickled.
"""

from __future__ import annotations

import pickle
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mt.config import Config
from mt.decode.fastpath import speed_up
from mt.decode.inference import export_model
from mt.errors import MTError
from mt.model.transformer import Transformer
from mt.train.ema import ema_state_dict
from mt.train.loss import token_loss

if TYPE_CHECKING:
    from mt.data.batches import Batch


def check_checkpoint(path: Path) -> None:
    """Raise ``MTError`` naming ``path`` unless it is a complete checkpoint:
    torch's zip format, every member's CRC intact (a truncated or damaged
    file fails here rather than deep inside ``torch.load``)."""
    try:
        with zipfile.ZipFile(path) as z:
            damaged = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise MTError(f"{path}: not a complete checkpoint ({e})") from None
    if damaged is not None:
        raise MTError(f"{path}: damaged checkpoint ({damaged} fails its CRC check)")


def load_checkpoint(path: Path, map_location=None) -> dict:
    """A checkpoint's contents, read as plain data only: every checkpoint ``mt``
    reads (resuming, averaging, exporting) comes through here. ``weights_only=True``
    is passed explicitly, so that no environment variable can turn it off, and a
    file that holds anything else (code that unpickling would run) is refused
    with an ``MTError`` naming it."""
    check_checkpoint(path)
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        detail = next((line for line in lines if "GLOBAL" in line), lines[-1])
        raise MTError(
            f"{path}: refused: it holds more than tensors and plain data, and loading it could run code ({detail})"
        ) from None


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a Lightning checkpoint (no code is unpickled)."""
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise MTError(f"{path}: not a Lightning checkpoint of mt (no state_dict)")
    return checkpoint["state_dict"]


def running_averages(paths: list[Path]) -> Iterator[dict[str, torch.Tensor]]:
    """Element-wise means of the model weights in the newest 1, 2, ...
    len(paths) of these Lightning checkpoints (oldest first), each checkpoint read once."""
    total: dict[str, torch.Tensor] = {}
    for k, p in enumerate(reversed(paths), 1):
        for name, v in load_state_dict(p).items():
            total[name] = total.get(name, 0) + v.double()
        yield {name: (v / k).float() for name, v in total.items()}


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the model weights in Lightning checkpoints (at least one)."""
    *_, mean = running_averages(paths)
    return mean


def step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The step checkpoints in ``ckpt_dir`` (a run's ``checkpoints/``), oldest first."""
    found = ckpt_dir.glob("step=*.ckpt")
    return sorted(found, key=lambda p: int(p.stem.split("=")[1]))


def validation_loss(model: Transformer, batches: list[Batch]) -> float:
    """Mean cross-entropy per target token (no label smoothing) of ``model``, in eval mode."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            nll, n_tokens = token_loss(model, b, 0.0)
            total, count = total + float(nll), count + float(n_tokens)
    return total / count


def choose_average(
    cfg: Config, paths: list[Path], batches: list[Batch]
) -> tuple[dict[str, torch.Tensor], int, list[float]]:
    """Of the averages of the newest 1, 2, ... len(paths) checkpoints (oldest
    first), the one of lowest validation loss over ``batches``: its weights,
    how many checkpoints it averages, and the losses of all of them.

    Averaging pays near convergence; a run stopped while it still improves
    quickly (a time budget on a slow machine) is better with fewer or none."""
    model = speed_up(Transformer(cfg.model))  # evaluated as mt translate runs it
    best, k, losses = {}, 0, []
    for i, state in enumerate(running_averages(paths), 1):
        model.load_state_dict({n.removeprefix("model."): v for n, v in state.items()})
        losses.append(validation_loss(model, batches))
        if k == 0 or losses[-1] < losses[k - 1]:  # ties keep the fewer checkpoints
            best, k = state, i
    return best, k, losses


def export_from_checkpoints(
    cfg: Config, run_dir: Path, average_last: int, val_batches: list[Batch] | None = None, ema: bool = False
) -> str:
    """Write the inference model: the best checkpoint, or the mean of the last
    N; with ``val_batches``, the mean of the last k <= N that ``choose_average``
    picks; with ``ema``, the moving average of the weights that the newest step
    checkpoint holds (``train.ema_decay``), its validation loss reported."""
    if ema:
        state, source = _moving_average(cfg, run_dir, val_batches)
    elif average_last > 0:
        state, source = _checkpoint_average(cfg, run_dir, average_last, val_batches)
    else:
        best = run_dir / "checkpoints" / "best.ckpt"
        if not best.exists():
            best = run_dir / "checkpoints" / "last.ckpt"
        if not best.exists():
            raise MTError(f"{run_dir / 'checkpoints'}: neither best.ckpt nor last.ckpt to export")
        state = load_state_dict(best)
        source = best.name
    model = Transformer(cfg.model)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    export_model(model, run_dir, run_dir, {"source": source})
    return source


def _checkpoint_average(
    cfg: Config, run_dir: Path, average_last: int, val_batches: list[Batch] | None
) -> tuple[dict[str, torch.Tensor], str]:
    paths = step_checkpoints(run_dir / "checkpoints")[-average_last:]
    if not paths:
        raise MTError(f"{run_dir / 'checkpoints'}: no step checkpoints (step=N.ckpt) to average")
    if len(paths) < average_last:
        print(
            f"mt: warning: {run_dir / 'checkpoints'}: {average_last} checkpoints asked for, "
            f"{len(paths)} kept; averaging those",
            file=sys.stderr,
        )
    chosen = ""
    if val_batches is None:
        state = average_checkpoints(paths)
    else:
        state, k, losses = choose_average(cfg, paths, val_batches)
        shown = " ".join(f"{x:.4f}" for x in losses)
        chosen = f" (the lowest validation loss of the last 1-{len(paths)}: {shown})"
        paths = paths[-k:]
    noun = "checkpoint" if len(paths) == 1 else "checkpoints"
    return state, f"average of {len(paths)} {noun}{chosen}: " + ", ".join(p.name for p in paths)


def _moving_average(cfg: Config, run_dir: Path, val_batches: list[Batch] | None) -> tuple[dict[str, torch.Tensor], str]:
    ckpt_dir = run_dir / "checkpoints"
    newest_first = [*reversed(step_checkpoints(ckpt_dir)), ckpt_dir / "last.ckpt"]
    path = next((p for p in newest_first if p.is_file()), None)
    if path is None:
        raise MTError(f"{ckpt_dir}: no checkpoint to read the moving average from")
    state, decay, updates = ema_state_dict(load_checkpoint(path), path)
    source = f"moving average of the weights (decay {decay:g}, {updates} updates) in {path.name}"
    if val_batches is not None:
        model = speed_up(Transformer(cfg.model))  # evaluated as mt translate runs it
        model.load_state_dict({n.removeprefix("model."): v for n, v in state.items()})
        source += f" (validation loss {validation_loss(model, val_batches):.4f})"
    return state, source
