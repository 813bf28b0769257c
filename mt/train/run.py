"""``mt train``: a Lightning run that leaves a self-describing run directory.

<run_dir>/config.yaml           the resolved config (vocabulary sizes included)
<run_dir>/spm*.model            the tokenizer
<run_dir>/checkpoints/          best.ckpt, last.ckpt and the last N step checkpoints
<run_dir>/logs/metrics.csv      training and validation metrics
<run_dir>/tb/version_N/         the same as TensorBoard events, where tensorboard is installed
<run_dir>/model.safetensors     the inference model (best, or the average of the last N)
<run_dir>/model.json            its config and the tokenizer's special ids
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Windows: no run directory lock there
    fcntl = None

import lightning as L
import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mt.config import DECODING, Config, ConfigError
from mt.data.batches import TranslationDataModule
from mt.errors import MTError, Stopped
from mt.evaluate.alpha import choose_alpha
from mt.hardware import bf16_speedup
from mt.train.checkpoints import check_checkpoint, export_from_checkpoints, load_checkpoint, step_checkpoints
from mt.train.ema import WeightEMA
from mt.train.lit import TranslationModule

# Noise a user cannot act on: Lightning's advertisement for its cloud logger, and
# its own use of an API that torch has deprecated.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "💡 Tip" not in r.getMessage())
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def loggers(run_dir: Path) -> list:
    """The CSV log (``logs/version_N/metrics.csv``, a new N for each (resumed) run) and,
    where ``tensorboard`` is installed, the same metrics as TensorBoard events
    (``tb/version_N``), so that ``tensorboard --logdir runs/`` shows every run."""
    found = [CSVLogger(run_dir, name="logs")]
    if importlib.util.find_spec("tensorboard") is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        found.append(TensorBoardLogger(run_dir, name="tb", default_hp_metric=False))
    return found


class SafeCheckpointIO(TorchCheckpointIO):
    """Checkpoints are written to a temporary file of their own (``.NAME.*.partial``),
    synced, then renamed: a kill at any moment leaves either the old file or the new
    one. They are read as plain data only (``mt.train.checkpoints.load_checkpoint``)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return load_checkpoint(Path(path), map_location)


class LinePrinter(Callback):
    """One line per validation (and every N steps) where no terminal shows a progress bar."""

    def __init__(self, every: int):
        self.every, self.start = every, time.perf_counter()

    def line(self, trainer, what: str) -> None:
        shown = ("train_loss", "tok_per_s", "val_loss", "val_bleu")
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k in shown}
        parts = [f"{k}={v:.4g}" for k, v in m.items()]
        minutes = (time.perf_counter() - self.start) / 60
        print(
            f"[{minutes:6.1f} min] {what} epoch {trainer.current_epoch} step {trainer.global_step}: " + " ".join(parts)
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step % self.every == 0 and trainer.global_step:
            self.line(trainer, "train")

    def on_validation_end(self, trainer, module) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self.line(trainer, "valid")


class DataWait(Callback):
    """How much of training is spent waiting for the next batch: the time from
    one training step's end to the next one's start (reading and padding the
    batch, or waiting for a loader worker to hand it over), against the
    steps' time. A share above a few percent says to raise data.num_workers.
    Pauses for validation and between epochs are not counted."""

    def __init__(self) -> None:
        self.waiting = self.stepping = 0.0
        self._end: float | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._start = time.perf_counter()
        if self._end is not None:
            self.waiting += self._start - self._end

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._end = time.perf_counter()
        self.stepping += self._end - self._start

    def _pause(self, *args) -> None:
        self._end = None

    on_validation_start = on_train_epoch_end = _pause

    @property
    def share(self) -> float:
        return self.waiting / max(self.waiting + self.stepping, 1e-9)


class LastStepCheckpoints(ModelCheckpoint):
    """Keeps ``step=N.ckpt`` files of the last ``save_top_k`` validations.

    Lightning forgets which files it saved when a run directory has been
    copied or moved (its record holds absolute paths), and would then keep
    the old directory's step checkpoints beside the new ones for good; this
    removes every step checkpoint older than the newest ``save_top_k``.
    """

    def on_validation_end(self, trainer, module) -> None:
        super().on_validation_end(trainer, module)
        self._prune(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        super().on_train_epoch_end(trainer, module)
        self._prune(trainer)

    def _prune(self, trainer) -> None:
        if trainer.is_global_zero and self.dirpath is not None:
            for stale in step_checkpoints(Path(self.dirpath))[: -self.save_top_k]:
                stale.unlink(missing_ok=True)


def check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise MTError(f"train.run_dir {run_dir}: is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise MTError(f"run directory {run_dir} is not writable ({e.strerror}); set train.run_dir") from None


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[bool]:
    """Hold ``run_dir/.lock`` while training: a second ``mt train`` of the same run
    directory stops at once, naming the process that holds it. The lock is the
    operating system's (``flock``): it dies with its holder, so a crashed or killed
    run never blocks the next. Only the first process of a distributed run takes it."""
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) != 0:
        yield False  # another process of this run holds it
        return
    if fcntl is None:
        yield True
        return
    path = run_dir / ".lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise MTError(
                f"run directory {run_dir} is in use by another mt train (process {holder}); "
                "wait for it to finish or set another train.run_dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resume_point(run_dir: Path) -> Path | None:
    """The checkpoint a rerun of the same command resumes from: ``last.ckpt``, else the
    newest ``step=N.ckpt`` (an interrupt can land between the two), else ``best.ckpt``."""
    ckpt_dir = run_dir / "checkpoints"
    candidates = [ckpt_dir / "last.ckpt", *reversed(step_checkpoints(ckpt_dir)), ckpt_dir / "best.ckpt"]
    return next((p for p in candidates if p.is_file()), None)


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Temporary checkpoint files a killed run left behind (under the run's lock, none is in use)."""
    for partial in [*(run_dir / "checkpoints").glob(".*.partial"), *(run_dir / "checkpoints").glob("*.ckpt.tmp")]:
        partial.unlink(missing_ok=True)


class _InterruptOnce:
    """The SIGINT handler while training: the first SIGINT stops the run as Ctrl-C
    does (KeyboardInterrupt); the ones after it are ignored while the run winds down,
    also where Lightning's teardown puts this handler back in place."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


BF16_MIN_SPEEDUP = 1.25  #: how much faster bfloat16 products must run for ``auto`` to pick bf16-mixed on a CPU


def resolve_precision(cfg: Config) -> str:
    """``train.precision``, with ``auto`` decided for this machine.

    On a CUDA GPU: bf16-mixed where the GPU supports it, else 16-mixed; on
    Apple's MPS, 32-true. On a CPU the answer depends on the chip (training
    steps follow the speed of its matrix products: docs/performance.md), so it
    is measured: bf16-mixed where bfloat16 matrix products run
    ``BF16_MIN_SPEEDUP`` times as fast as float32 or faster (``bf16_speedup``,
    about a second), 32-true otherwise. A CPU run of several processes takes
    32-true without measuring, so that all its ranks agree. The choice is
    printed and kept in the run's config.yaml; name the precision in the
    config to make a run independent of the machine.
    """
    if cfg.train.precision != "auto":
        return cfg.train.precision
    tr = cfg.trainer
    if tr.accelerator != "cpu" and torch.cuda.is_available():
        bf16 = torch.cuda.is_bf16_supported()
        chosen, why = ("bf16-mixed", "a CUDA GPU") if bf16 else ("16-mixed", "a CUDA GPU without bfloat16")
    elif tr.accelerator != "cpu" and torch.backends.mps.is_available():  # where Lightning's auto trains
        chosen, why = "32-true", "Apple MPS"
    elif tr.num_nodes > 1 or str(tr.devices) not in ("1", "auto") or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        chosen, why = "32-true", "a CPU run of several processes"
    else:
        speedup = bf16_speedup()
        chosen = "bf16-mixed" if speedup >= BF16_MIN_SPEEDUP else "32-true"
        why = f"bfloat16 products run at {speedup:.2g}x float32's speed on this CPU"
    print(f"train.precision=auto: {chosen} ({why})")
    return chosen


def train(cfg: Config) -> Path:
    """Train ``cfg`` into its run directory (holding the directory's lock) and
    write the inference model. Resumes from the run's checkpoints, if any.

    Ctrl-C (SIGINT) stops the run gracefully, with a hint on how to resume; a
    second one while it winds down is ignored. A process started with SIGINT
    ignored (``nohup``, a background job of a non-interactive shell) keeps it
    ignored, as POSIX programs do: stop such a run with SIGTERM or SIGKILL."""
    run_dir = Path(cfg.train.run_dir)
    # everything the run needs is checked before the run directory is touched
    dm = TranslationDataModule(cfg.data, seed=cfg.train.seed)  # fails clearly if not prepared
    dm.setup("fit")
    check_writable(run_dir)
    handler = signal.getsignal(signal.SIGINT)
    take_sigint = handler is signal.default_int_handler and threading.current_thread() is threading.main_thread()
    if take_sigint:
        signal.signal(signal.SIGINT, _InterruptOnce())
    interrupted = False
    try:
        with run_dir_lock(run_dir) as owner:
            if owner:
                remove_partial_checkpoints(run_dir)
            return _train(cfg, dm, run_dir)
    except (KeyboardInterrupt, Stopped):
        interrupted = True
        raise
    finally:
        if take_sigint and not interrupted:  # after an interrupt, further ones stay ignored until exit
            signal.signal(signal.SIGINT, handler)


def _train(cfg: Config, dm: TranslationDataModule, run_dir: Path) -> Path:
    t = cfg.train
    tok = dm.tokenizer
    cfg.model.src_vocab_size, cfg.model.tgt_vocab_size, cfg.model.pad_id = len(tok.src), len(tok.tgt), tok.pad_id
    cfg.model.__post_init__()  # validate what the tokenizer decided (e.g. shared embeddings need a joint vocab)
    cfg.train.precision = resolve_precision(cfg)  # before config.yaml records it
    resume = resume_point(run_dir)
    if resume:
        try:
            check_checkpoint(resume)
        except MTError as e:
            raise MTError(f"{e}; to resume, replace it with a step=N.ckpt of the same directory") from None
        print(f"resuming from {resume}")
        # the checkpoints it warns about are the ones being resumed from
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    for f in tok.files(cfg.data.prepared_path()):
        (run_dir / f.name).write_bytes(f.read_bytes())

    # TranslationDataModule skips the batches a mid-epoch checkpoint already
    # trained on (its state_dict), which Lightning cannot see: its warning does not apply.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    L.seed_everything(t.seed, workers=True, verbose=False)
    module = TranslationModule(cfg, tok, dm.split(cfg.data.valid_split).tgt_text)
    print(f"model: {module.model.num_parameters():,} parameters")
    monitor, mode = ("val_bleu", "max") if t.val_bleu else ("val_loss", "min")
    ckpt_dir = run_dir / "checkpoints"
    callbacks = [
        ModelCheckpoint(
            ckpt_dir, filename="best", monitor=monitor, mode=mode, save_top_k=1, enable_version_counter=False
        ),
        LastStepCheckpoints(
            ckpt_dir,
            filename="step={step}",
            monitor="step",
            mode="max",
            save_top_k=t.keep_checkpoints,
            save_last=True,
            auto_insert_metric_name=False,
            enable_version_counter=False,
        ),  # fmt: skip
        LearningRateMonitor(logging_interval="step"),
        data_wait := DataWait(),
        TQDMProgressBar() if sys.stderr.isatty() else LinePrinter(t.log_every_steps * 10),
    ]
    if t.ema_decay:
        callbacks.append(WeightEMA(t.ema_decay))
    if t.early_stopping_patience:
        callbacks.append(EarlyStopping(monitor=monitor, mode=mode, patience=t.early_stopping_patience))
    val_every = {"val_check_interval": 1.0}
    if t.val_every_steps:
        val_every = {
            "val_check_interval": t.val_every_steps * t.accumulate_grad_batches,
            "check_val_every_n_epoch": None,
        }
    trainer_args = dict(
        default_root_dir=run_dir,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        strategy=cfg.trainer.strategy,
        num_nodes=cfg.trainer.num_nodes,
        precision=t.precision,
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        max_time={"minutes": t.max_minutes} if t.max_minutes else None,
        gradient_clip_val=t.clip_grad_norm or None,
        accumulate_grad_batches=t.accumulate_grad_batches,
        logger=loggers(run_dir),
        callbacks=callbacks,
        plugins=[SafeCheckpointIO()],
        use_distributed_sampler=False,  # TokenBatchSampler shards by rank itself
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_steps,
        enable_model_summary=False,
        enable_progress_bar=sys.stderr.isatty(),
        deterministic=True,
        **val_every,
    )
    try:
        trainer = L.Trainer(**trainer_args)
    except (MisconfigurationException, ValueError, TypeError) as e:  # e.g. a GPU asked for where there is none
        chosen = " ".join(f"trainer.{k}={v}" for k, v in dataclasses.asdict(cfg.trainer).items())
        raise ConfigError(f"{chosen}: cannot run here: {e}") from None
    if t.cooldown_minutes and trainer.world_size > 1:  # each process's clock would set its own rate
        raise ConfigError("train.cooldown_minutes: needs a single-process run (use train.cooldown_steps with several)")
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
    except SIGTERMException:  # Lightning stops at the next update and tears down, then raises this
        point = resume_point(run_dir)
        hint = f"rerun the same command to resume from {point}" if point else "no checkpoint yet: a rerun starts over"
        raise Stopped(f"stopped by SIGTERM at update {trainer.global_step}; {hint}", 128 + signal.SIGTERM) from None
    except SystemExit:
        # Lightning answers Ctrl-C with a graceful shutdown and sys.exit(1): report the interrupt as one
        # (the CLI exits 130) and say how to go on; the checkpoints on disk are complete (SafeCheckpointIO)
        if not trainer.interrupted:
            raise
        point = resume_point(run_dir)
        hint = f"rerun the same command to resume from {point}" if point else "no checkpoint yet: a rerun starts over"
        print(f"training interrupted at update {trainer.global_step}; {hint}", file=sys.stderr)
        raise KeyboardInterrupt from None
    minutes = (time.perf_counter() - start) / 60
    if trainer.is_global_zero:
        val = list(dm.val_dataloader()) if t.average_choose or t.ema_decay else None
        source = export_from_checkpoints(cfg, run_dir, t.average_last, val, ema=t.ema_decay > 0)
        metrics = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()}
        print(f"trained {trainer.global_step} steps in {minutes:.1f} min; last metrics: {metrics}")
        print(f"waiting for data: {data_wait.share:.1%} of the training steps' time")
        print(f"inference model ({source}) written to {run_dir}")
        if t.choose_alpha:
            best = choose_alpha(run_dir, DECODING.choose_alphas, cfg.data.valid_split)
            print(f"length penalty {best:g}: the highest BLEU on {cfg.data.valid_split} (beam {DECODING.beam})")
    return run_dir
