"""The inference model of a run directory: save it, load it, and open a
translator on it the one way every command does.

A run directory holds ``model.safetensors`` (weights; loading never unpickles
code), ``model.json`` (the model config and the tokenizer's special ids) and
the sentencepiece model(s). ``translate``, ``evaluate`` and ``attention``
need nothing else.

``open_translator`` is the loading policy that ``mt translate``, ``mt
evaluate``, ``mt serve`` and the benchmarks share: a CTranslate2 export or
a run, one model or an ensemble, int8, the dtype and the device, each
option checked by name before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from mt.config import DECODING, ConfigError, ModelConfig
from mt.data.tokenizer import Tokenizer
from mt.decode.allocator import keep_freed_memory
from mt.decode.ct2 import EXPORT_JSON, CT2Translator, is_ct2_dir
from mt.decode.ensemble import Ensemble
from mt.decode.fastpath import speed_up
from mt.decode.translator import Translator
from mt.errors import ModelDirError, MTError
from mt.hardware import fast_bf16
from mt.model.transformer import Transformer
from mt.textio import publish

WEIGHTS, MODEL_JSON = "model.safetensors", "model.json"


def export_model(model: Transformer, tokenizer_dir: Path, run_dir: Path, extra: dict | None = None) -> None:
    """Write the inference model into ``run_dir`` (each file via a temporary name)."""
    run_dir = Path(run_dir)
    tmp = run_dir / (WEIGHTS + ".tmp")
    save_model(model, str(tmp))  # safetensors creates it 0o600
    publish(tmp, run_dir / WEIGHTS)
    for f in Tokenizer.files(tokenizer_dir):
        if f.parent.resolve() != run_dir.resolve():
            shutil.copyfile(f, run_dir / f.name)
    meta = {"model": dataclasses.asdict(model.cfg), **(extra or {})}
    tmp = run_dir / (MODEL_JSON + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    publish(tmp, run_dir / MODEL_JSON)


def load(
    run_dir: str | Path, device: str | torch.device = "cpu", fast: bool = True
) -> tuple[Transformer, Tokenizer, dict]:
    """(model in eval mode, tokenizer, metadata) from a run directory, checked for
    consistency. The model is on decoding's fast path unless ``fast=False``
    (the textbook modules, as training ran them)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ModelDirError(f"{run_dir}: a file, not a model directory (give the run directory that holds it)")
    if not run_dir.is_dir():
        raise ModelDirError(f"{run_dir}: model directory does not exist")
    if (run_dir / EXPORT_JSON).exists():
        raise ModelDirError(f"{run_dir}: a CTranslate2 export (mt export); this needs the mt run it was exported from")
    for name in (MODEL_JSON, WEIGHTS):
        if not (run_dir / name).exists():
            raise ModelDirError(f"{run_dir}: incomplete model directory, {name} missing (has training finished?)")
    try:
        meta = json.loads((run_dir / MODEL_JSON).read_text())
        cfg = ModelConfig(**meta["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as e:
        raise ModelDirError(f"{run_dir / MODEL_JSON}: unreadable model config ({e})") from None
    tok = Tokenizer.load(run_dir)
    if (len(tok.src), len(tok.tgt)) != (cfg.src_vocab_size, cfg.tgt_vocab_size) or tok.pad_id != cfg.pad_id:
        raise ModelDirError(
            f"{run_dir}: tokenizer does not match the model (vocab {len(tok.src)}/{len(tok.tgt)}, pad {tok.pad_id}; "
            f"model expects {cfg.src_vocab_size}/{cfg.tgt_vocab_size}, pad {cfg.pad_id})"
        )
    model = Transformer(cfg)
    try:
        load_model(model, str(run_dir / WEIGHTS), device="cpu")
    except Exception as e:  # safetensors raises several types for truncated or mismatched files
        raise ModelDirError(f"{run_dir / WEIGHTS}: cannot load weights ({e})") from None
    if fast:
        speed_up(model)
    return model.to(device).eval(), tok, meta


def _tokenizer_bytes(run_dir: Path) -> list[bytes] | None:
    """The contents of a run directory's tokenizer files; None if one is missing."""
    files = Tokenizer.files(run_dir)
    return [f.read_bytes() for f in files] if all(f.is_file() for f in files) else None


def load_ensemble(run_dirs: list[str | Path], device: str | torch.device = "cpu") -> tuple[Ensemble, Tokenizer, dict]:
    """(ensemble in eval mode, tokenizer, the first run's metadata) from run
    directories whose tokenizers are the same files, byte for byte. Each
    member's tokenizer is compared before its weights are read."""
    first = Path(run_dirs[0])
    loaded = [load(first, device)]
    want = _tokenizer_bytes(first)
    for d in run_dirs[1:]:
        got = _tokenizer_bytes(Path(d))
        if got is not None and got != want:  # missing files: load() names them
            raise ModelDirError(f"{d}: its tokenizer differs from {first}'s; ensemble members must share one")
        loaded.append(load(d, device))
    return Ensemble([m for m, _, _ in loaded]).eval(), loaded[0][1], loaded[0][2]


def decoding_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype to decode in: ``float32``, ``bfloat16`` or ``auto`` =
    bfloat16 on CUDA GPUs that support it, float32 elsewhere (on CPUs with
    native bfloat16, ``bfloat16`` pays for wide models only: docs/performance.md).
    Search scores stay float32 either way."""
    if name == "int8":  # the weights stay float32; mt.decode.int8 makes int8 copies of those it uses
        return torch.float32
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


@dataclass
class DecodingOptions:
    """How to decode: the options that ``mt translate``, ``mt evaluate`` and ``mt
    serve`` share (their ``--help`` says what each does), with the same defaults."""

    beam: int = DECODING.beam
    alpha: float | None = None  #: None: the model's own (``default_alpha``)
    batch_size: int = DECODING.batch_size
    max_len_a: float = DECODING.max_len_a
    max_len_b: int = DECODING.max_len_b
    loop_margin: int | None = DECODING.loop_margin
    device: str = "auto"
    dtype: str = DECODING.dtype
    workers: int | None = None
    n_best: int = 1

    @classmethod
    def from_args(cls, args) -> DecodingOptions:
        """The options of a parsed command line (``mt.cli``), those it has."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    def check(self) -> None:
        """Raise ``MTError`` naming the option whose value cannot decode anything."""
        for option, value in (("--beam", self.beam), ("--batch-size", self.batch_size), ("--workers", self.workers)):
            if value is not None and value < 1:
                raise MTError(f"{option} must be at least 1, got {value}")
        if not 1 <= self.beam <= DECODING.max_beam:
            raise MTError(f"--beam must be between 1 and {DECODING.max_beam}, got {self.beam}")
        if self.alpha is not None and not 0 <= self.alpha <= DECODING.max_alpha:  # NaN fails this too
            raise MTError(f"--alpha must be between 0 and {DECODING.max_alpha}, got {self.alpha}")
        a, b = self.max_len_a, self.max_len_b
        if not (0 <= a < math.inf and b >= 0 and a + b > 0):
            raise MTError(
                f"--max-len-a {a} --max-len-b {b}: the output length limit a*source_len+b needs a >= 0, b >= 0, "
                "not both 0"
            )
        if self.loop_margin is not None and self.loop_margin < 0:
            raise MTError(f"--loop-margin must be at least 0 (or off), got {self.loop_margin}")
        if not 1 <= self.n_best <= self.beam:
            raise MTError(f"--n-best must be between 1 and --beam ({self.beam})")
        if self.dtype not in ("auto", "float32", "bfloat16", "int8"):
            raise MTError(f"--dtype {self.dtype}: auto, float32, bfloat16 or int8")


def resolve_device(name: str) -> str:
    """--device: auto = the first CUDA GPU if there is one, else the CPU; an
    unknown or absent device is an error here, not deep inside torch."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MTError(f"--device {name}: not a device name (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()  # 0 without a GPU or a CUDA build of torch
        if count == 0:
            raise MTError(f"--device {name}: no CUDA GPU available (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            raise MTError(f"--device {name}: only {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise MTError(f"--device {name}: mt decodes on cpu or cuda")
    return name


def warn_on_stderr(msg: str) -> None:
    print(f"mt: warning: {msg}", file=sys.stderr)


def source_language(model_dir: str | Path) -> str:
    """The source language of a run directory or an export (``data.src_lang`` in its
    ``config.yaml``): the rules sentence splitting follows."""
    from mt.config import load_config

    path = Path(model_dir) / "config.yaml"
    if not path.exists():
        raise MTError(f"{model_dir}: no config.yaml, so no source language to split sentences by")
    return load_config(path).data.src_lang


def default_alpha(models: list[str | Path]) -> float:
    """The length penalty a model decodes with unless told otherwise: the one chosen
    for it on validation (``"decoding": {"alpha": ...}`` in a run's model.json, or in
    an export's mt_export.json; ``mt.evaluate.alpha``), else ``DECODING.alpha``. An
    ensemble takes ``DECODING.alpha``: each member's was chosen for it alone."""
    if len(models) != 1:
        return DECODING.alpha
    directory = Path(models[0])
    try:
        meta = json.loads((directory / (EXPORT_JSON if is_ct2_dir(directory) else MODEL_JSON)).read_text())
        alpha = meta["decoding"]["alpha"]
    except (OSError, ValueError, KeyError, TypeError):  # none chosen (or unreadable: loading says so)
        return DECODING.alpha
    valid = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha <= DECODING.max_alpha
    return float(alpha) if valid else DECODING.alpha


def open_translator(models: list[str | Path], options: DecodingOptions, warn=warn_on_stderr):
    """A translator for run directories (several: an ensemble) or a CTranslate2 export,
    decoding as ``options`` say, and the (first) model's metadata. ``warn`` receives
    what the user should know (a slow dtype on this CPU, truncated lines)."""
    options.check()
    keep_freed_memory()  # a process that decodes: reuse freed memory (mt/decode/allocator.py)
    o = options
    alpha = default_alpha(models) if o.alpha is None else o.alpha
    if any(is_ct2_dir(d) for d in models):
        if len(models) > 1:
            raise MTError("--model: a CTranslate2 export decodes alone, not in an ensemble")
        if o.device not in ("auto", "cpu"):
            raise MTError(f"--device {o.device}: mt decodes CTranslate2 exports on the CPU")
        compute_type = {"auto": "default"}.get(o.dtype, o.dtype)
        t = CT2Translator(models[0], o.beam, alpha, o.batch_size, o.max_len_a, o.max_len_b, compute_type, warn)
        return t, t.info
    if o.dtype == "int8" and o.device not in ("auto", "cpu"):
        raise MTError(f"--dtype int8 decodes on the CPU (PyTorch's int8 kernels), not --device {o.device}")
    device = "cpu" if o.dtype == "int8" else resolve_device(o.device)
    model, tok, meta = load(models[0], device) if len(models) == 1 else load_ensemble(models, device)
    if o.dtype == "int8":
        from mt.decode.int8 import quantize

        quantize(model)
    dtype = decoding_dtype(o.dtype, next(model.parameters()).device)
    model = model.to(dtype)
    if dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu" and not fast_bf16():
        warn(
            "--dtype bfloat16: this CPU has no fast bfloat16 products (no AVX-512); decoding runs far slower "
            "than with --dtype float32"
        )
    t = Translator(
        model, tok, o.beam, alpha, o.batch_size, o.max_len_a, o.max_len_b, warn=warn, workers=o.workers,
        loop_margin=o.loop_margin,
    )  # fmt: skip
    return t, meta
