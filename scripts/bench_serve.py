"""mt serve under load, beside mt translate's throughput on the same sentences.

    python scripts/bench_serve.py --model runs/multi30k_cpu [--clients 1 8 32] [--seconds 30] [--beam 5] [--dtype int8]

Translates the sentences offline first (``mt translate``'s Translator, the same
options, on the CPU; again at the end, as the machine's speed may drift), then starts
``mt serve`` on the CPU, on loopback, and for each client count, runs that many
concurrent clients for a bounded time, each sending one sentence per request
(client i takes sentences i, i + C, ...), while a health check goes
every 50 ms. Reports sentences/s, p50/p99 latency, errors, answers that differ
from the offline translation, the health checks' p99 latency, and where the
CPU went: CPU milliseconds per sentence of the server's process, of its
decoding processes and of the clients, beside mt translate's own (on Linux,
from /proc). A benchmark, not a test: the figures depend on the machine and
its load.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "shared/data/multi30k/raw/test_2016_flickr.en.gz"


def read_lines(path: Path, n: int) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f) if line.strip()]


def own_cpu() -> float:
    """CPU seconds this process has used, all its threads."""
    t = os.times()
    return t.user + t.system


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None
    where /proc cannot tell (not Linux, or the process has gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_of(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (all its threads), or None where /proc cannot tell."""
    fields = proc_stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux; none elsewhere)."""
    return [int(e.name) for e in Path("/proc").glob("[0-9]*") if (proc_stat(e.name) or [None, None])[1] == str(pid)]


def offline(
    model: str, lines: list[str], beam: int, dtype: str = "auto", alpha: float | None = None
) -> tuple[list[str], float, float]:
    """mt translate's translations of ``lines``, its sentences/s and its CPU ms per
    sentence (model loading excluded), on the CPU in ``dtype`` (auto or float32: float32)."""
    from mt.decode.inference import DecodingOptions, open_translator

    options = DecodingOptions(beam=beam, device="cpu", dtype=dtype, **({} if alpha is None else {"alpha": alpha}))
    translator, _ = open_translator([model], options)  # as mt serve
    translator.translate(lines[:32])  # warm up, as the server is by its first requests
    start, cpu = time.perf_counter(), own_cpu()
    out = translator.translate(lines)
    return out, len(lines) / (time.perf_counter() - start), 1000 * (own_cpu() - cpu) / len(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p99(values: list[float]) -> float:
    """The 99th percentile of sorted ``values`` (nan if none)."""
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def ask_mt(beam: int, alpha: float | None = None) -> Callable[[http.client.HTTPConnection, str], tuple[bool, str]]:
    """One sentence to ``mt serve``'s /v1/translate: (answered, translation)."""
    options = {"beam": beam} | ({"alpha": alpha} if alpha is not None else {})

    def ask(conn: http.client.HTTPConnection, sentence: str) -> tuple[bool, str]:
        conn.request("POST", "/v1/translate", json.dumps({"text": sentence, **options}),
                     {"Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        reply = json.loads(r.read())
        return r.status == 200, reply["translations"][0]["text"] if r.status == 200 else ""

    return ask


def wait_for_port(port: int, proc: subprocess.Popen, what: str, seconds: float = 300) -> None:
    """Until ``proc`` listens on ``port``; exits naming ``what`` if it ends or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{what} did not start (exit {proc.poll()})")
            time.sleep(0.2)


def load_test(
    port: int, lines: list[str], want: list[str], clients: int, seconds: float, beam: int, server: int | None = None,
    ask: Callable[[http.client.HTTPConnection, str], tuple[bool, str]] | None = None, health: str | None = "/healthz",
) -> dict:  # fmt: skip
    """``clients`` clients for ``seconds``, each request one sentence through ``ask``
    (default: mt serve's API with ``beam``); with the ``server``'s pid, the CPU its
    process and its children used meanwhile, per sentence answered; a GET of ``health``
    every 50 ms where given."""
    ask = ask or ask_mt(beam)
    latencies: list[float] = []
    errors = mismatches = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        nonlocal errors, mismatches
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for n in range(i, len(lines), clients):
            if time.perf_counter() > stop_at:
                break
            t0 = time.perf_counter()
            try:
                ok, text = ask(conn, lines[n])
            except (OSError, ValueError, KeyError, http.client.HTTPException):
                ok, text = False, ""
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            elapsed = time.perf_counter() - t0
            with lock:
                if not ok:
                    errors += 1
                    continue
                latencies.append(elapsed)
                mismatches += text != want[n]
        conn.close()

    checks: list[float] = []
    finished = threading.Event()

    def probe() -> None:  # a health check every 50 ms, as a load balancer would send
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while health:  # the first at once: every load test gets at least one
            t0 = time.perf_counter()
            try:
                conn.request("GET", health)
                conn.getresponse().read()
                checks.append(time.perf_counter() - t0)
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            if finished.wait(0.05):
                break
        conn.close()

    decoders = children_of(server) if server else []
    cpu_before = [cpu_of(p) for p in [server, *decoders]] if server else []
    start, clients_cpu = time.perf_counter(), own_cpu()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    prober = threading.Thread(target=probe)
    prober.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu_after = [cpu_of(p) for p in [server, *decoders]] if server else []
    clients_cpu = own_cpu() - clients_cpu  # the clients and the health checks: this process
    finished.set()
    prober.join()
    latencies.sort()
    checks.sort()
    per_sentence = 1000 / max(1, len(latencies))
    used = [b - a if None not in (a, b) else float("nan") for a, b in zip(cpu_before, cpu_after)]
    return {
        "clients": clients,
        "sentences": len(latencies),
        "sentences_per_s": len(latencies) / wall,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * p99(latencies),
        "errors": errors,
        "mismatches": mismatches,
        "healthz_p99_ms": 1000 * p99(checks),
        "cpu_ms": {  # CPU milliseconds per sentence answered
            "server": used[0] * per_sentence if used else float("nan"),
            "decoding": sum(used[1:]) * per_sentence if used else float("nan"),
            "clients": clients_cpu * per_sentence,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="run directory")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="sentences, one per line (.gz or plain)")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=30.0, help="per client count (default 30)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--workers", type=int, help="mt serve --workers (default: its own)")
    p.add_argument(
        "--dtype", choices=["auto", "float32", "int8"], default="auto", help="both engines' --dtype (default auto)"
    )
    args = p.parse_args()

    lines = read_lines(args.source, args.sentences)
    want, offline_rate, offline_cpu = offline(args.model, lines, args.beam, args.dtype)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mt", "serve", "--model", args.model, "--port", str(port), "--beam", str(args.beam),
         "--max-wait-ms", str(args.max_wait_ms), "--dtype", args.dtype, "--device", "cpu",  # as offline: the CPU
         *(["--workers", str(args.workers)] if args.workers else [])],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, server, "mt serve")
        load_test(port, lines[:64], want[:64], 4, 5, args.beam)  # warm up
        results = [load_test(port, lines, want, c, args.seconds, args.beam, server.pid) for c in args.clients]
    finally:
        server.terminate()  # mt serve stops gracefully on SIGTERM
        server.wait()
    # again: the machine's speed may have changed meanwhile
    again, rate_after, cpu_after = offline(args.model, lines, args.beam, args.dtype)
    if again != want:
        print("warning: mt translate's second run gave different translations", file=sys.stderr)
    print(f"mt translate (offline, same sentences, beam {args.beam}): {offline_rate:.1f} sentences/s before the "
          f"load tests, {rate_after:.1f} after; × offline is against their mean. It used {offline_cpu:.1f} and "
          f"{cpu_after:.1f} CPU ms per sentence")  # fmt: skip
    offline_rate = (offline_rate + rate_after) / 2
    print("| clients | sentences | sentences/s | × offline | p50 ms | p99 ms | errors | differ from offline "
          "| /healthz p99 ms | CPU ms per sentence: server / decoding / clients |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cpu = " / ".join(f"{r['cpu_ms'][k]:.1f}" for k in ("server", "decoding", "clients"))
        print(f"| {r['clients']} | {r['sentences']} | {r['sentences_per_s']:.1f} | "
              f"{r['sentences_per_s'] / offline_rate:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['errors']} | {r['mismatches']} | {r['healthz_p99_ms']:.0f} | {cpu} |")  # fmt: skip


if __name__ == "__main__":
    main()
