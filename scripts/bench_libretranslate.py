"""mt serve beside LibreTranslate, on the same model, sentences, clients and machine.

    python scripts/bench_libretranslate.py --model runs/multi30k_cpu [--clients 1 8 32] [--seconds 30]

Exports the model with ``mt export --to argos``, installs the package into a
LibreTranslate of its own (a virtual environment, ``--lt-venv``, made with
``pip install libretranslate==1.9.6 spacy`` when it does not exist; its package,
cache and config directories are temporary), and starts it on loopback, offline:
ARGOS_CHUNK_TYPE=SPACY splits sentences with the package's spaCy pipeline, and
ARGOS_BEAM_SIZE sets its beam. Then, one server at a time (LibreTranslate first,
then ``mt serve``): for each client count, that many clients for a bounded time,
one sentence per request (``bench_serve.load_test``: client i takes sentences
i, i + C, ...; each count starts further into the sentences, so no server sees
a sentence twice in a row), then every test sentence once with 8 clients, for
the BLEU of what it answered.

The search is the same where both can set it: beam ``--beam``, and Argos's
fixed length penalty of 0.2 given to mt as alpha. Argos also replaces an
``<unk>`` in the output with the source word it attends to most, and splits
each request into sentences; mt does neither. LibreTranslate then formats
each answer (``improve_translation_formatting``: an all-lowercase source gets
an all-lowercase answer, the answer takes the source's final punctuation
mark and first letter's case): lines are counted the same as mt translate's
both as they are and once mt's are formatted so. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlencode

from bench_serve import DEFAULT_SOURCE, ask_mt, free_port, load_test, offline, read_lines, wait_for_port

ROOT = Path(__file__).resolve().parents[1]
LIBRETRANSLATE = "libretranslate==1.9.6"  # pins argos-translate-lt 1.12.1, as its release does
ARGOS_ALPHA = 0.2  # argostranslate.translate.apply_packaged_translation's length_penalty


def libretranslate_venv(venv: Path) -> Path:
    """The ``libretranslate`` command of ``venv``, installed there first if missing."""
    command = venv / "bin" / "libretranslate"
    if not command.exists():
        print(f"installing {LIBRETRANSLATE} and spaCy into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LIBRETRANSLATE, "spacy"], check=True)
    return command


def ask_libretranslate(src: str, tgt: str):
    """One sentence to LibreTranslate's /translate: (answered, translation)."""

    def ask(conn: http.client.HTTPConnection, sentence: str) -> tuple[bool, str]:
        body = urlencode({"q": sentence, "source": src, "target": tgt, "format": "text"})
        conn.request("POST", "/translate", body, {"Content-Type": "application/x-www-form-urlencoded"})
        r = conn.getresponse()
        reply = json.loads(r.read())
        return r.status == 200, reply.get("translatedText", "") if r.status == 200 else ""

    return ask


def answer_all(port: int, ask, lines: list[str], clients: int = 8) -> list[str | None]:
    """Every line once, ``clients`` at a time: the answers (None where a request failed)."""
    answers: list[str | None] = [None] * len(lines)

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for n in range(i, len(lines), clients):
            try:
                ok, text = ask(conn, lines[n])
                answers[n] = text if ok else None
            except (OSError, ValueError, KeyError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def lt_formatted(python: str, lines: list[str], want: list[str]) -> list[str]:
    """``want`` as LibreTranslate would return it: its ``improve_translation_formatting``
    (run in its own venv) lowercases the answer to a lowercase source, takes the source's
    final punctuation mark and case of the first letter, whatever the model wrote."""
    code = (
        "import json, sys; from libretranslate.language import improve_translation_formatting as f; "
        "print(json.dumps([f(s, t) for s, t in json.load(sys.stdin)]))"
    )
    done = subprocess.run([python, "-c", code], input=json.dumps(list(zip(lines, want))), capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)


def measure(name, port, ask, lines, want, refs, args, pid, formatted=None) -> dict:
    """Warm up, the load tests (each client count from its own place in the sentences), the BLEU
    pass; lines compared with ``want`` and, where given, with ``formatted`` (want as the server formats it)."""
    from mt.evaluate.metrics import bleu

    load_test(port, lines[-64:], want[-64:], 4, 5, args.beam, ask=ask, health=None)  # warm up
    results = []
    for k, clients in enumerate(args.clients):
        shift = k * len(lines) // len(args.clients)
        rotated, rotated_want = lines[shift:] + lines[:shift], want[shift:] + want[:shift]
        results.append(load_test(port, rotated, rotated_want, clients, args.seconds, args.beam, pid, ask, None))
    answers = answer_all(port, ask, lines)
    failed = sum(a is None for a in answers)
    score = bleu([a or "" for a in answers], refs).score
    same = sum(a == b for a, b in zip(answers, want))
    formatted = formatted or want
    same_formatted = sum(a == b for a, b in zip(answers, formatted))
    for line, ours, theirs in [(s, b, a) for s, a, b in zip(lines, answers, formatted) if a != b][:8]:
        print(f"{name} differs from mt translate (as {name} formats it) on {line!r}:\n  mt:   {ours}\n"
              f"  {name}: {theirs}", file=sys.stderr)  # fmt: skip
    return {"name": name, "results": results, "bleu": score, "failed": failed, "same": same,
            "same_formatted": same_formatted}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="run directory")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="sentences, one per line (.gz or plain)")
    p.add_argument("--reference", type=Path, help="their reference translations (default: beside --source)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=30.0, help="per client count (default 30)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lt-venv", type=Path, default=ROOT / ".venv-libretranslate", help="LibreTranslate's venv")
    p.add_argument("--lt-threads", type=int, default=4, help="libretranslate --threads (default 4, its own)")
    p.add_argument("--argos-inter-threads", type=int, default=1,
                   help="ARGOS_INTER_THREADS: batches CTranslate2 decodes at once, each with cores/N threads "
                        "(default 1, Argos's own)")  # fmt: skip
    args = p.parse_args()
    from mt.export.argos import export_argos
    from mt.export.ct2 import run_language

    reference = args.reference or Path(str(args.source).replace(".en", ".de"))
    lines, refs = read_lines(args.source, 100_000), read_lines(reference, 100_000)
    if len(lines) != len(refs):
        sys.exit(f"{args.source} and {reference}: {len(lines)} and {len(refs)} lines")
    src, tgt = run_language(Path(args.model), "src"), run_language(Path(args.model), "tgt")
    command = libretranslate_venv(args.lt_venv)
    want, offline_rate, _ = offline(args.model, lines, args.beam, alpha=ARGOS_ALPHA)
    print(f"mt translate, offline, beam {args.beam}, alpha {ARGOS_ALPHA}: {offline_rate:.1f} sentences/s",
          file=sys.stderr)  # fmt: skip

    measured = []
    with tempfile.TemporaryDirectory(prefix="mt-bench-lt-") as tmp:
        home = Path(tmp)
        package = home / "model.argosmodel"
        export_argos(Path(args.model), package)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_"))}
        env |= {f"XDG_{d}_HOME": str(home / d) for d in ("DATA", "CACHE", "CONFIG")}
        env |= {"ARGOS_CHUNK_TYPE": "SPACY", "ARGOS_BEAM_SIZE": str(args.beam), "HOME": str(home),
                "ARGOS_INTER_THREADS": str(args.argos_inter_threads)}  # fmt: skip
        # spaCy's multi-language model is cached at import unless this exists (a download, offline)
        (home / "CACHE/argos-translate/spacy/senter/model").mkdir(parents=True)
        python = str(command.parent / "python")
        install = "import sys, argostranslate.package as p; p.install_from_path(sys.argv[1])"
        subprocess.run([python, "-c", install, str(package)], env=env, check=True)

        port = free_port()
        server = subprocess.Popen(
            [str(command), "--host", "127.0.0.1", "--port", str(port), "--disable-web-ui",
             "--disable-files-translation", "--threads", str(args.lt_threads)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for_port(port, server, "LibreTranslate")
            formatted = lt_formatted(python, lines, want)
            measured.append(measure("LibreTranslate", port, ask_libretranslate(src, tgt), lines, want, refs, args,
                                    server.pid, formatted))  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mt", "serve", "--model", args.model, "--port", str(port), "--beam", str(args.beam),
         "--alpha", str(ARGOS_ALPHA), "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, server, "mt serve")
        measured.append(measure("mt serve", port, ask_mt(args.beam, ARGOS_ALPHA), lines, want, refs, args, server.pid))
    finally:
        server.terminate()
        server.wait(timeout=60)

    print(f"{args.model}, {len(lines)} sentences of {args.source.name}, beam {args.beam}, length penalty "
          f"{ARGOS_ALPHA}, {args.seconds:g} s per client count, {os.cpu_count()} CPUs")  # fmt: skip
    print("| server | clients | sentences/s | p50 ms | p99 ms | errors | same as mt translate | CPU ms per sentence |")
    print("|---|---|---|---|---|---|---|---|")
    for m in measured:
        for r in m["results"]:
            cpu = r["cpu_ms"]["server"] + r["cpu_ms"]["decoding"]
            print(f"| {m['name']} | {r['clients']} | {r['sentences_per_s']:.1f} | {r['p50_ms']:.0f} | "
                  f"{r['p99_ms']:.0f} | {r['errors']} | {r['sentences'] - r['mismatches']} of {r['sentences']} | "
                  f"{cpu:.1f} |")  # fmt: skip
    print("| server | sacreBLEU on every sentence | failed requests | same as mt translate | same once formatted |")
    print("|---|---|---|---|---|")
    for m in measured:
        print(f"| {m['name']} | {m['bleu']:.2f} | {m['failed']} | {m['same']} of {len(lines)} | "
              f"{m['same_formatted']} of {len(lines)} |")  # fmt: skip
    lt, ours = measured[0]["results"], measured[1]["results"]
    for a, b in zip(lt, ours):
        print(f"{a['clients']} clients: mt serve {b['sentences_per_s'] / a['sentences_per_s']:.2f}× LibreTranslate's "
              f"sentences/s, p99 {b['p99_ms']:.0f} vs {a['p99_ms']:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
