"""Typed configuration: one dataclass per section, one home for each default.

A YAML file in ``configs/`` maps one-to-one onto :class:`Config`; every
field is validated on construction, and a bad value raises
:class:`ConfigError` naming the field (and the file, when there is one).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mt.errors import MTError


class ConfigError(MTError, ValueError):
    """A configuration value is missing, unknown or invalid."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass
class ModelConfig:
    """The Transformer's shape. Vocabulary sizes and the pad id come from the
    tokenizer (``mt prepare``), never from the YAML file."""

    d_model: int = 256  #: model width
    n_heads: int = 4  #: attention heads; must divide d_model
    enc_layers: int = 3  #: encoder layers
    dec_layers: int = 3  #: decoder layers
    d_ff: int = 1024  #: feed-forward inner width
    dropout: float = 0.1  #: dropout on embeddings and sublayer outputs
    activation_dropout: float | None = None  #: dropout on the FFN's hidden activations; None = dropout
    attn_dropout: float = 0.0  #: dropout on attention weights
    activation: str = "relu"  #: relu | gelu
    norm_first: bool = True  #: pre-LN (True) or post-LN (False)
    positional: str = "sinusoidal"  #: sinusoidal | learned
    max_positions: int = 256  #: longest sequence the model accepts, in subword tokens
    share_embeddings: bool = True  #: one embedding for source, target and output (joint vocab only)
    tie_output: bool = True  #: target embedding doubles as output projection
    attention_impl: str = "auto"  #: auto (fused on CUDA, explicit on CPU) | explicit | fused
    src_vocab_size: int = 0  #: from the tokenizer
    tgt_vocab_size: int = 0  #: from the tokenizer
    pad_id: int = 0  #: from the tokenizer

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "enc_layers", "dec_layers", "d_ff", "max_positions"):
            _check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        _check(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"{self.d_model} is not divisible by model.n_heads={self.n_heads}",
        )
        for name in ("dropout", "attn_dropout"):
            _check(0.0 <= getattr(self, name) < 1.0, f"model.{name}", "must be in [0, 1)")
        if self.activation_dropout is not None:
            _check(0.0 <= self.activation_dropout < 1.0, "model.activation_dropout", "must be in [0, 1)")
        _check(self.activation in ("relu", "gelu"), "model.activation", f"unknown activation {self.activation!r}")
        _check(
            self.positional in ("sinusoidal", "learned"),
            "model.positional",
            f"must be sinusoidal or learned, got {self.positional!r}",
        )
        _check(
            self.attention_impl in ("auto", "explicit", "fused"),
            "model.attention_impl",
            f"must be auto, explicit or fused, got {self.attention_impl!r}",
        )
        _check(self.src_vocab_size >= 0 and self.tgt_vocab_size >= 0, "model.vocab_size", "must be >= 0")
        if self.share_embeddings and self.src_vocab_size and self.tgt_vocab_size:
            _check(
                self.src_vocab_size == self.tgt_vocab_size,
                "model.share_embeddings",
                "needs a joint vocabulary (source and target vocab sizes differ)",
            )


MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{split}.{lang}.gz"
MULTI30K_TOK_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/tok/{split}.lc.norm.tok.{lang}"


@dataclass
class DataConfig:
    """Where the parallel corpus comes from and how it is tokenized and batched."""

    corpus: str = "multi30k"  #: name; also names the prepared directory
    source: str = "auto"  #: auto | local | download | hf | toy
    local_dir: str | None = None  #: directory of <split>.<lang>[.gz] files (or env MT_DATA_DIR)
    url: str = MULTI30K_URL  #: download template with {split} and {lang}
    download_splits: list[str] = field(default_factory=lambda: ["train", "val", "test_2016_flickr"])
    paper_ref_url: str | None = MULTI30K_TOK_URL  #: download template of tokenized references, for --paper BLEU
    paper_ref_splits: list[str] = field(default_factory=lambda: ["test_2016_flickr"])  #: ... fetched where sha256 known
    checksums: str | None = None  #: sha256 file ("<sha256>  <file name>" lines); default: shipped with mt
    hf_name: str | None = None  #: a Hugging Face dataset with a translation column
    hf_config: str | None = None  #: its configuration name, e.g. de-en
    hf_revision: str | None = None  #: a branch, tag or commit of the hub dataset; null = its main branch
    toy_sizes: dict[str, int] = field(default_factory=lambda: {"train": 4000, "val": 200, "test": 200})  #: source toy
    src_lang: str = "en"
    tgt_lang: str = "de"
    train_split: str = "train"
    valid_split: str = "val"
    prepared_dir: str | None = None  #: default data/prepared/<corpus>.<src>-<tgt>[.paper]
    text: str = "raw"  #: raw | paper (lowercased, Moses-normalised and -tokenized, as Multi30k papers train)
    vocab_size: int = 8000  #: sentencepiece vocabulary size (each, when not joint)
    joint_vocab: bool = True  #: one sentencepiece model for both languages
    spm_model_type: str = "bpe"  #: bpe | unigram
    spm_sample: int = 1_000_000  #: sentencepiece trains on a random sample of this many training lines at most
    max_len: int = 100  #: training pairs longer than this (subword tokens) are dropped
    max_ratio: float = 3.0  #: training pairs with a longer/shorter length ratio above this are dropped
    max_tokens: int = 4096  #: tokens per batch, padding included (max of source and target side)
    bpe_dropout: float = 0.0  #: training only: skip each BPE merge with this probability, every epoch anew; 0 = off
    num_proc: int | None = None  #: prepare's encoding processes; null = one per CPU for splits of 100k pairs or more
    num_workers: int = 0  #: processes that read training batches (0 = the training process; BPE-dropout needs 0)

    def __post_init__(self) -> None:
        _check(
            self.source in ("auto", "local", "download", "hf", "toy"), "data.source", f"unknown source {self.source!r}"
        )
        _check(self.spm_model_type in ("bpe", "unigram"), "data.spm_model_type", "must be bpe or unigram")
        _check(self.text in ("raw", "paper"), "data.text", f"unknown text mode {self.text!r} (raw or paper)")
        _check(self.src_lang != self.tgt_lang, "data.tgt_lang", "must differ from data.src_lang")
        for name in ("vocab_size", "max_len", "max_tokens"):
            _check(getattr(self, name) > 0, f"data.{name}", "must be positive")
        _check(self.spm_sample > 0, "data.spm_sample", "must be positive")
        _check(self.max_ratio >= 1.0, "data.max_ratio", "must be >= 1")
        _check(0.0 <= self.bpe_dropout < 1.0, "data.bpe_dropout", "must be in [0, 1)")
        _check(
            self.bpe_dropout == 0.0 or self.spm_model_type == "bpe",
            "data.bpe_dropout",
            f"needs data.spm_model_type=bpe (got {self.spm_model_type})",
        )
        _check(self.num_proc is None or self.num_proc > 0, "data.num_proc", "must be positive (or null)")
        _check(self.num_workers >= 0, "data.num_workers", "must be >= 0")
        _check(
            self.num_workers == 0 or self.bpe_dropout == 0.0,
            "data.num_workers",
            "must be 0 with BPE-dropout (it resegments in the training process)",
        )
        _check(self.max_tokens >= self.max_len + 2, "data.max_tokens", "must hold at least one sentence of max_len")

    @property
    def pair(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"

    def prepared_path(self) -> Path:
        suffix = "" if self.text == "raw" else f".{self.text}"
        return Path(self.prepared_dir or f"data/prepared/{self.corpus}.{self.pair}{suffix}")


@dataclass
class TrainConfig:
    """Optimisation and the training schedule."""

    seed: int = 1
    max_steps: int = -1  #: optimizer updates; -1 = no limit
    max_epochs: int = 100
    max_minutes: float | None = None  #: wall-clock limit for training
    lr: float = 1e-3  #: peak learning rate, reached after warmup
    warmup_steps: int = 4000
    cooldown_steps: int = 0  #: the last N of max_steps updates take the rate linearly down to 0; 0 = off
    cooldown_minutes: float = 0.0  #: the last N of max_minutes take the rate linearly down to 0; 0 = off
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    rdrop_alpha: float = 0.0  #: R-Drop: run each batch twice, add alpha x the passes' symmetric KL; 0 = off
    clip_grad_norm: float = 1.0  #: 0 = off
    accumulate_grad_batches: int = 1
    precision: str = "32-true"  #: 32-true | bf16-mixed | 16-mixed | auto = the faster here (mt.train.run)
    val_every_steps: int = 0  #: validate every N updates; 0 = at each epoch end
    val_bleu: bool = True  #: greedy-decode the validation split and report BLEU
    early_stopping_patience: int = 0  #: validations without better BLEU before stopping; 0 = off
    keep_checkpoints: int = 5  #: the last N validation checkpoints are kept (for averaging)
    average_last: int = 0  #: average the last N checkpoints into the final model; 0 = best only
    average_choose: bool = False  #: average the last k <= average_last instead: the k of lowest validation loss
    ema_decay: float = 0.0  #: keep an exponential moving average of the weights and export it; 0 = off
    choose_alpha: bool = False  #: after training, choose the length penalty on validation (mt choose-alpha)
    log_every_steps: int = 50
    run_dir: str = "runs/default"

    def __post_init__(self) -> None:
        _check(self.lr > 0, "train.lr", "must be positive")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(self.cooldown_steps >= 0, "train.cooldown_steps", "must be >= 0")
        _check(
            self.cooldown_steps == 0 or self.cooldown_steps <= self.max_steps,
            "train.cooldown_steps",
            "needs train.max_steps and cannot exceed it",
        )
        _check(self.cooldown_minutes >= 0.0, "train.cooldown_minutes", "must be >= 0")
        _check(
            self.cooldown_minutes == 0 or (self.max_minutes is not None and self.cooldown_minutes <= self.max_minutes),
            "train.cooldown_minutes",
            "needs train.max_minutes and cannot exceed it",
        )
        _check(0.0 <= self.ema_decay < 1.0, "train.ema_decay", "must be in [0, 1)")
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
        _check(self.rdrop_alpha >= 0.0, "train.rdrop_alpha", "must be >= 0")
        _check(self.accumulate_grad_batches >= 1, "train.accumulate_grad_batches", "must be >= 1")
        _check(
            self.precision in ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "auto"),
            "train.precision",
            f"unknown precision {self.precision!r}",
        )
        _check(len(self.betas) == 2, "train.betas", "needs two values")
        _check(self.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
        _check(self.average_last <= self.keep_checkpoints, "train.average_last", "cannot exceed keep_checkpoints")
        _check(
            not self.average_choose or self.average_last >= 1, "train.average_choose", "needs train.average_last >= 1"
        )


@dataclass
class TrainerConfig:
    """Passed to ``lightning.Trainer`` as is."""

    accelerator: str = "auto"  #: auto | cpu | gpu
    devices: Any = 1  #: number of devices, or "auto"
    strategy: str = "auto"  #: auto | ddp | ...
    num_nodes: int = 1


@dataclass(frozen=True)
class DecodingDefaults:
    """What ``mt translate`` and ``mt evaluate`` decode with unless told
    otherwise; the search, the CLI and evaluate's file names read them here
    (a module without torch, so that ``mt --help`` stays fast)."""

    beam: int = 5
    alpha: float = 1.0  #: length penalty: score / length**alpha
    batch_size: int = 64  #: sentences decoded together
    max_len_a: float = 1.5  #: at most a * source_len + b output tokens
    max_len_b: int = 10
    #: the loop guard: no output holds an n-gram of up to ``loop_ngram`` pieces more
    #: than R + ``loop_margin`` times in a row, R being the most times any n-gram comes
    #: in a row in its source (so "no no no no" may become "nein nein nein nein", and a
    #: sentence without repeats gets at most 3 copies in a row). The token that would go
    #: past that is ruled out while the output is shorter than its source (a stutter,
    #: which models recover from), and the output ends there once it is as long (a loop
    #: with nothing left to translate). None: no guard
    loop_ngram: int = 8
    loop_margin: int | None = 2
    dtype: str = "auto"
    #: the largest beam (and n-best) any command takes: a search holds beam x batch rows
    #: of keys and values for every layer, and beyond ~10 a wider beam rarely scores better
    max_beam: int = 32
    #: the largest length penalty: at 10 a hypothesis one token longer already gains more
    #: than any likely difference in log-probability, so larger values only say "longest"
    max_alpha: float = 10.0
    #: the length penalties ``mt choose-alpha`` (and ``train.choose_alpha``) try on validation
    choose_alphas: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


DECODING = DecodingDefaults()


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> Config:
        return _build(cls, raw, where)


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(x, item) for k, x in value.items())
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(x, item) for x in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _wants_float(value: Any, hint: Any) -> bool:
    """An int given for a float field (``lr: 1``, ``max_minutes: 60``) is stored as a float."""
    floats = hint is float or float in typing.get_args(hint)
    return floats and isinstance(value, int) and not isinstance(value, bool)


def _build(cls: type, raw: Any, where: str, prefix: str = "") -> Any:
    if not isinstance(raw, dict):
        what = "the top level must be a mapping of sections"  # as load_config says it
        if prefix:
            what = f"{prefix.removesuffix('.')} must be a mapping"
        raise ConfigError(f"{where}: {what}, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        keys = ", ".join(prefix + k for k in unknown)
        raise ConfigError(f"{where}: unknown key {keys} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            section = {} if value is None else value  # "train:" alone keeps the defaults
            kwargs[name] = _build(hint, section, where, f"{prefix}{name}.")
        elif not _type_ok(value, hint):
            shown = getattr(hint, "__name__", str(hint))
            raise ConfigError(f"{where}: {prefix}{name} must be {shown}, got {value!r}")
        else:
            kwargs[name] = float(value) if _wants_float(value, hint) else value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides (value parsed as YAML) to a raw dict."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(text)
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply overrides, validate. Errors name the file and the overrides."""
    raw: dict = {}
    where = "overrides"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as e:  # a directory, no permission, ...
            raise ConfigError(f"{path}: cannot read the config ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}), so not a YAML config") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        raw = {} if loaded is None else loaded  # an empty file: all defaults
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides))
    if path is not None and overrides:
        where += " with " + " ".join(overrides)  # the fault may lie in either
    return Config.from_dict(raw, where)
