import contextlib
import csv
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mt.cli.main import main
from mt.config import DataConfig, load_config
from mt.data.prepare import prepare
from mt.data.toy import toy_corpus


def write_corpus(directory: Path, splits: dict, langs=("en", "de"), gz=False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, sides in splits.items():
        for lang, lines in zip(langs, sides):
            data = "".join(line + "\n" for line in lines).encode()
            if gz:
                (directory / f"{name}.{lang}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / f"{name}.{lang}").write_bytes(data)
    return directory


@pytest.fixture
def corpus_splits():
    return toy_corpus({"train": 300, "val": 40, "test_2016_flickr": 30}, seed=3)


@pytest.fixture
def data_cfg(tmp_path, monkeypatch, corpus_splits):
    """A small local corpus (plain text) and a config pointing at it."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "raw", corpus_splits)
    return DataConfig(
        corpus="synth", source="local", local_dir=str(tmp_path / "raw"), prepared_dir=str(tmp_path / "prepared"),
        vocab_size=60, max_tokens=512, max_len=60,
    )  # fmt: skip


ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs" / "toy.yaml"


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy") / "prepared"
    cfg = load_config(TOY, [f"data.prepared_dir={path}", "data.toy_sizes={train: 1500, val: 100, test: 100}"])
    prepare(cfg.data, verbose=False)
    return path


@pytest.fixture(scope="session")
def toy_test_lines(toy_data):
    """The first 40 source lines of the toy test set."""
    from mt.data.batches import Split

    return Split(toy_data / "test").src_text[:40]


#: every architecture option the exports must hold exactly, one at a time and all together
ARCHITECTURE_OPTIONS = [
    {},
    {"norm_first": False},
    {"positional": "learned"},
    {"activation": "gelu"},
    {"share_embeddings": False},
    {"tie_output": False},
    {"share_embeddings": False, "tie_output": False, "norm_first": False, "activation": "gelu"},
]


def option_id(option: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in option.items()) or "default"


def perturbed_model(cfg, seed: int = 0):
    """A model with every parameter moved off its initial value (layer norms too, so that
    a swapped or missing gain or bias shows)."""
    import torch

    from mt.model.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def mt_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mt", *args]  # mt/__main__.py, as `python -m mt` runs it


def train_args(toy_data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        "train", "--config", str(TOY), f"data.prepared_dir={toy_data}", f"train.run_dir={run_dir}",
        "data.toy_sizes={train: 1500, val: 100, test: 100}", *overrides,
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    """Validation rows of every (resumed) run of a run directory, in order."""
    rows = []
    for version in sorted((run_dir / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            rows += [r for r in csv.DictReader(f) if r.get("val_loss")]
    return [{k: r[k] for k in ("step", "val_loss", "val_bleu")} for r in rows]


@pytest.fixture(scope="session")
def toy_run(toy_data, tmp_path_factory):
    """A toy model trained once for the whole session (tests of translate/evaluate/attention use it)."""
    run_dir = tmp_path_factory.mktemp("runs") / "toy"
    assert main(train_args(toy_data, run_dir)) == 0
    return run_dir


def _default_signals() -> None:
    """In a child, before exec: SIGINT at its default (a shell gives background jobs SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def children():
    """``spawn(args, **popen_kwargs)`` for a test that starts processes: each runs in a
    process group of its own, with SIGINT at its default (``sigint_ignored=True``: as
    a shell's background job gets it), ``PYTHONPATH`` set to this tree; whatever still
    runs when the test ends, passed or failed, is killed with its group."""
    procs: list[subprocess.Popen] = []

    def spawn(args: list[str], sigint_ignored: bool = False, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", os.environ | {"PYTHONPATH": str(ROOT)})
        preexec = _sigint_ignored if sigint_ignored else _default_signals
        proc = subprocess.Popen(args, start_new_session=True, preexec_fn=preexec, **kwargs)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    """Poll ``condition`` until it holds; fail at once if ``proc`` exits first, or after
    ``timeout`` seconds (generous: a busy machine can be many times slower than a quiet one)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.05)


def run_command(args: list[str], timeout: float = 1200, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(..., capture_output=True, text=True)`` for a child that may start
    children of its own: it runs in a process group of its own with SIGINT at its
    default, and the whole group is killed when it outlives ``timeout`` (generous: for
    a hung child, not a slow machine) or when the test is interrupted. ``check``: a
    non-zero exit fails the test, with the child's stderr."""
    given = kwargs.pop("input", None)
    if given is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(
        args, start_new_session=True, preexec_fn=_default_signals, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **kwargs,
    ) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(given, timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if check and proc.returncode:
        raise AssertionError(f"{args} exited {proc.returncode}:\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 60):
    """GET url's JSON; an HTTP error status raises (urllib's HTTPError, an OSError)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: dict, timeout: float = 600):
    """POST body as JSON: (status, JSON answer), the answer of a 4xx/5xx included."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())
