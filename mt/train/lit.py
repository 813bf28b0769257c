"""The LightningModule: a thin wrapper that owns loss, optimiser, schedule
and logging around the plain ``mt.model.transformer.Transformer``."""

from __future__ import annotations

import copy
import math
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer

from mt.config import Config
from mt.data.batches import Batch
from mt.data.tokenizer import Tokenizer
from mt.decode.fastpath import speed_up
from mt.decode.search import SearchSettings, greedy_search
from mt.evaluate.metrics import bleu
from mt.model.transformer import Transformer
from mt.train.loss import linear_rdrop_cross_entropy, token_loss
from mt.train.speed import for_training


def inverse_sqrt(warmup: int, cooldown: int = 0, total: int = -1):
    """Linear warmup to the peak learning rate, then decay with 1/sqrt(step).

    With ``cooldown`` > 0 the last ``cooldown`` of ``total`` updates also scale
    that rate down linearly, reaching 1/cooldown of it at the last update
    (a warmup-stable-decay cooldown; without it the schedule ignores ``total``).
    """

    def factor(step: int) -> float:
        step += 1
        rate = 1.0 / math.sqrt(step) if warmup == 0 else min(step / warmup, math.sqrt(warmup / step))
        if cooldown > 0:
            rate *= min(1.0, max(total - step + 1, 0) / cooldown)
        return rate

    return factor


def timed_cooldown(factor, seconds_left, window: float):
    """``factor`` (a schedule of the update number) scaled down linearly to 0 over
    the last ``window`` seconds of a time budget, of which ``seconds_left()`` remain:
    a warmup-stable-decay cooldown for a run bounded by ``train.max_minutes``, whose
    number of updates is not known in advance."""

    def cooled(step: int) -> float:
        return factor(step) * min(1.0, max(seconds_left(), 0.0) / window)

    return cooled


class TranslationModule(L.LightningModule):
    def __init__(self, cfg: Config, tokenizer: Tokenizer, val_refs: list[str] | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = for_training(Transformer(cfg.model))  # the textbook model, with training's speed tricks
        self._decoder: Transformer | None = None  # validation's copy on decoding's fast path
        self.tok = tokenizer
        self.val_refs = val_refs
        self.search = SearchSettings(tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        self._clock: float | None = None
        self._started = time.perf_counter()
        self._pending_rng: torch.Tensor | None = None
        self._val_nll = self._val_tokens = 0.0
        self._val_hyps: dict[int, list[int]] = {}

    def loss(self, batch: Batch, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss(self.model, batch, label_smoothing)

    def rdrop_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R-Drop: the batch twice in one forward pass (independent dropout), both
        cross-entropies plus ``train.rdrop_alpha`` x their symmetric KL.
        Returns the summed loss, its token count (both passes) and the summed KL."""
        states = self.model.hidden(torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in]))
        first, second = states.chunk(2)
        t = self.cfg.train
        loss, kl = linear_rdrop_cross_entropy(
            first, second, self.model.output_weight, batch.tgt_out, self.tok.pad_id, t.label_smoothing, t.rdrop_alpha
        )
        return loss, 2 * batch.tgt_mask.sum(), kl

    def on_train_start(self) -> None:
        self._started = time.perf_counter()

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        if self._pending_rng is not None:  # resumed: continue the dropout stream where it stopped
            torch.set_rng_state(self._pending_rng)
            self._pending_rng = None

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self.cfg.train.rdrop_alpha > 0:
            loss_sum, n_tokens, kl = self.rdrop_loss(batch)
            # mean over target tokens of (KL(a||b) + KL(b||a)) / 2
            self.log("rdrop_kl", 2 * kl / n_tokens, batch_size=int(n_tokens))
        else:
            loss_sum, n_tokens = self.loss(batch, self.cfg.train.label_smoothing)
        loss = loss_sum / n_tokens
        now = time.perf_counter()
        if self._clock is not None:
            self.log("tok_per_s", n_tokens.float() / (now - self._clock), prog_bar=True, batch_size=1)
        self._clock = now
        self.log("train_loss", loss, prog_bar=True, batch_size=int(n_tokens))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        # before clipping: shows how often train.clip_grad_norm bites (fairseq's "gnorm");
        # Lightning writes it every train.log_every_steps with the other step metrics
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.log("grad_norm", norm, batch_size=1)

    def on_validation_epoch_start(self) -> None:
        self._val_nll = self._val_tokens = 0.0
        self._val_hyps = {}
        # validation runs as mt translate would: on the fast path, of this step's weights
        # (copied as ordinary tensors, which the fast path's packed weights can be keyed on)
        with torch.inference_mode(False):
            decoder = speed_up(copy.deepcopy(self.model)).eval()
        # held outside the module tree: not a submodule, so never in a checkpoint's state dict
        object.__setattr__(self, "_decoder", decoder)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        nll, n_tokens = token_loss(self._decoder, batch, 0.0)
        self._val_nll += float(nll)
        self._val_tokens += float(n_tokens)
        if self.cfg.train.val_bleu and self.val_refs is not None:
            for i, hyp in zip(batch.index.tolist(), greedy_search(self._decoder, batch.src, self.search)):
                self._val_hyps[i] = hyp.tokens

    def on_validation_epoch_end(self) -> None:
        nll = self._val_nll / max(self._val_tokens, 1.0)
        self.log("val_loss", nll, prog_bar=True)
        self.log("val_ppl", math.exp(min(nll, 50.0)))
        # wall-clock minutes since this run (or this resumption) started, validations included
        self.log("minutes", (time.perf_counter() - self._started) / 60)
        if self._val_hyps:
            hyps = self.tok.decode_tgt([self._val_hyps[i] for i in range(len(self.val_refs))])
            score = bleu(hyps, self.val_refs, lowercase=self.tok.lowercase).score
            self.log("val_bleu", score, prog_bar=True)
        self._decoder = None
        self._clock = None  # validation time is not training throughput

    def configure_optimizers(self):
        t = self.cfg.train
        opt = torch.optim.AdamW(self.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        factor = inverse_sqrt(t.warmup_steps, t.cooldown_steps, t.max_steps)
        if t.cooldown_minutes:
            # Lightning's Timer enforces max_minutes and carries the time spent across resumptions
            timer = next(c for c in self.trainer.callbacks if isinstance(c, Timer))
            factor = timed_cooldown(factor, timer.time_remaining, 60 * t.cooldown_minutes)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mt_config"] = self.cfg.to_dict()
        checkpoint["torch_rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._pending_rng = checkpoint.get("torch_rng_state")
