"""Leave `mt serve` running under mixed traffic and faults, and count what went wrong.

    python scripts/soak_serve.py --model runs/multi30k_cpu [--minutes 10] [--clients 8]

Starts `mt serve` on loopback (its own process group, ended at the end) and runs,
for --minutes: --clients threads sending well-formed requests (1-8 sentences of
the run's validation split, or --source) and, one request in --bad-share, each
bad input the service must answer without harm (a byte-order mark, a zero-width space,
a lone surrogate, alpha 2000, a text/plain body, a foreign Host...). Every
--fault-every seconds a decoding process is killed (SIGKILL) or stopped (SIGSTOP,
left stopped: the server must notice it).

It reports requests answered, errors by class, requests that hung (no answer
within --timeout plus a minute; must be 0), well-formed answers that differ from
`mt translate` with the same options (must be 0), bad inputs answered other than
as expected (must be 0), and the server's memory at the start and the end.
A well-formed request may be refused, 503 or 504 with Retry-After, beside a fault.
Exits 1 when any of the three counts is not 0. Figures: docs/serving.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (path, raw body, headers, what answers it: "empty" = 200 with empty translations, or a 4xx status)
NO_PIECES = {"bom": "\ufeff", "zero_width_space": "\u200b", "left_to_right_mark": "\u200e",
             "control_character": "\x01", "replacement_character": "\ufffd", "lone_u2581": "\u2581"}  # fmt: skip
JSON = {"Content-Type": "application/json"}


def bad_inputs() -> dict[str, tuple[str, bytes, dict, object]]:
    cases = {name: ("/v1/translate", json.dumps({"text": t}).encode(), JSON, "empty") for name, t in NO_PIECES.items()}
    cases |= {
        "lone_surrogate": ("/v1/translate", b'{"text": "\\ud800"}', JSON, 422),
        "lone_surrogate_prefix": ("/v1/translate", b'{"text": "a dog", "prefix": "\\udc00"}', JSON, 422),
        "alpha_2000": ("/v1/translate", b'{"text": "a dog runs", "beam": 5, "alpha": 2000}', JSON, 422),
        "alpha_400_digits": ("/v1/translate", b'{"text": "a dog", "alpha": 1' + b"0" * 400 + b"}", JSON, 422),
        "beam_100000": ("/v1/translate", b'{"text": "a dog", "beam": 100000}', JSON, 422),
        "attention_zero_width_space": ("/v1/attention", json.dumps({"text": "\u200b"}).encode(), JSON, 422),
        "attention_long_target": ("/v1/attention", json.dumps({"text": "a", "target": "b" * 5000}).encode(), JSON, 422),
        "text_plain": ("/v1/translate", b'{"text": "a dog"}', {"Content-Type": "text/plain"}, 415),
        "foreign_host": ("/v1/translate", b'{"text": "a dog"}', {**JSON, "Host": "evil.example"}, 400),
        "invalid_utf8": ("/v1/translate", b'{"text": "\xff"}', JSON, 400),
    }  # fmt: skip
    return cases


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


class Soak:
    def __init__(self, args, port: int, pool: list[str], refs: dict[str, str]):
        self.args, self.port, self.pool, self.refs = args, port, pool, refs
        self.bad = bad_inputs()
        self.lock = threading.Lock()
        self.counts: Counter = Counter()  # outcome classes
        self.bad_codes: dict[str, Counter] = {name: Counter() for name in self.bad}
        self.examples: dict[str, str] = {}
        self.end = time.monotonic() + args.minutes * 60
        self.client_timeout = args.timeout + 60

    def note(self, what: str, example: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if example and what not in self.examples:
                self.examples[what] = example[:300]

    def request(self, path: str, body: bytes, headers: dict) -> tuple[int, dict, dict] | None:
        """(status, JSON body, headers), or None if no answer came within the client's timeout."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.client_timeout)
        try:
            conn.request("POST", path, body, headers)
            r = conn.getresponse()
            data = r.read()
            try:
                answer = json.loads(data)
            except json.JSONDecodeError:
                answer = {"raw": data[:200].decode("utf-8", "replace")}
            return r.status, answer, {k.lower(): v for k, v in r.getheaders()}
        except TimeoutError:
            return None
        finally:
            conn.close()

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.end:
            if rng.random() < self.args.bad_share:
                name = rng.choice(sorted(self.bad))
                self.send_bad(name)
            else:
                self.send_good(rng.sample(self.pool, rng.randint(1, 8)))

    def send_good(self, lines: list[str]) -> None:
        try:
            got = self.request("/v1/translate", json.dumps({"text": lines}).encode(), JSON)
        except OSError as e:
            self.note(f"connection error ({type(e).__name__})", str(e))
            return
        if got is None:
            self.note("hung", json.dumps(lines))
            return
        status, answer, headers = got
        if status == 200:
            texts = [t["text"] for t in answer["translations"]]
            same = texts == [self.refs[x] for x in lines]
            self.note("well-formed: 200" if same else "well-formed: 200 but differs", json.dumps([lines, texts]))
        elif status in (503, 504) and "retry-after" in headers:
            self.note(f"well-formed: {status} with Retry-After", answer.get("error", ""))
        else:
            self.note(f"well-formed: {status} (unexpected)", json.dumps(answer))

    def send_bad(self, name: str) -> None:
        path, body, headers, expect = self.bad[name]
        try:
            got = self.request(path, body, headers)
        except OSError as e:
            self.note(f"connection error ({type(e).__name__})", str(e))
            return
        if got is None:
            self.note("hung", name)
            return
        status, answer, resp_headers = got
        with self.lock:
            self.bad_codes[name][status] += 1
        refused = status in (503, 504) and "retry-after" in resp_headers  # beside a fault, as any request
        if expect == "empty":
            ok = status == 200 and [t["text"] for t in answer["translations"]] == [""]
        else:
            ok = status == expect
        self.note("bad input: as expected" if ok else "bad input: refused, Retry-After" if refused else
                  f"bad input: unexpected ({name} -> {status})", json.dumps(answer))  # fmt: skip


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/healthz")
        return json.loads(conn.getresponse().read())
    except (OSError, json.JSONDecodeError):
        return {}
    finally:
        conn.close()


def sentences(args) -> list[str]:
    if args.source:
        lines = [x.strip() for x in Path(args.source).read_text(encoding="utf-8").splitlines()]
    else:
        from mt.errors import MTError
        from mt.evaluate.scoring import split_texts

        try:
            lines, _, _ = split_texts(Path(args.model), "val")
        except MTError as e:
            sys.exit(f"soak_serve.py: the run's validation split is not at hand ({e}); give --source FILE")
    lines = sorted({x for x in lines if x})
    return random.Random(0).sample(lines, min(args.pool, len(lines)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="run directory")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    p.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    p.add_argument("--bad-share", type=float, default=0.15, help="share of requests that are bad inputs")
    p.add_argument("--source", help="sentences to send, one per line (default: the run's validation split)")
    p.add_argument("--pool", type=int, default=200, help="distinct sentences sent (default 200)")
    p.add_argument("--timeout", type=float, default=30.0, help="mt serve --timeout (default 30)")
    p.add_argument("--stall-timeout", type=float, default=10.0, help="mt serve --stall-timeout (default 10)")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args()

    from mt.decode.inference import DecodingOptions, open_translator

    pool = sentences(args)
    translator, _ = open_translator([args.model], DecodingOptions(workers=1))
    refs = dict(zip(pool, translator.translate(pool)))  # mt translate's, with mt serve's defaults
    del translator
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mt", "serve", "--model", args.model, "--port", str(port), "--timeout",
           str(args.timeout), "--stall-timeout", str(args.stall_timeout)]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while health(port).get("status") != "ok":
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"mt serve did not start:\n{server.communicate(timeout=60)[1]}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        rss_start = rss_kib(server.pid)
        soak = Soak(args, port, pool, refs)
        threads = [threading.Thread(target=soak.client, args=(n,), daemon=True) for n in range(args.clients)]
        for t in threads:
            t.start()
        faults = Counter()
        rng = random.Random(1)
        next_fault = time.monotonic() + args.fault_every
        while time.monotonic() < soak.end:
            time.sleep(0.2)
            if time.monotonic() < next_fault:
                continue
            next_fault += args.fault_every
            alive = [w["pid"] for w in health(port).get("workers", []) if w["state"] == "ok"]
            if alive:
                sig = signal.SIGKILL if faults.total() % 2 == 0 else signal.SIGSTOP
                try:
                    os.kill(rng.choice(alive), sig)
                    faults[sig.name] += 1
                except ProcessLookupError:
                    pass
        for t in threads:
            t.join(timeout=soak.client_timeout + 60)
        still = sum(t.is_alive() for t in threads)
        rss_end = rss_kib(server.pid)
        workers_end = [rss_kib(w["pid"]) for w in health(port).get("workers", [])]
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=args.timeout + 120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    c = soak.counts
    report = {
        "minutes": args.minutes, "clients": args.clients, "faults": faults.total(), "fault_kinds": dict(faults),
        "requests": c.total(), "well_formed_ok": c["well-formed: 200"], "differ": c["well-formed: 200 but differs"],
        "hung": c["hung"] + still, "outcomes": dict(sorted(c.items())),
        "unexpected": sum(v for k, v in c.items() if "unexpected" in k or k.startswith("connection error")),
        "bad_inputs": {k: dict(v) for k, v in soak.bad_codes.items()}, "examples": soak.examples,
        "server_rss_mib": [round(rss_start / 1024, 1), round(rss_end / 1024, 1)],
        "worker_rss_mib_end": [round(x / 1024, 1) for x in workers_end],
        "server_exit": server.returncode, "server_traceback": "Traceback" in err,
    }  # fmt: skip
    print(f"mt serve soak: {args.minutes:g} min, {args.clients} clients, {report['faults']} faults {dict(faults)}")
    for k, v in report["outcomes"].items():
        print(f"  {k:<45} {v}")
    print(f"hung: {report['hung']}  differ: {report['differ']}  unexpected: {report['unexpected']}")
    print(f"server RSS: {report['server_rss_mib'][0]} MiB at start, {report['server_rss_mib'][1]} MiB at the end; "
          f"workers at the end: {report['worker_rss_mib_end']} MiB; exit {server.returncode}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failed = report["hung"] or report["differ"] or report["unexpected"] or server.returncode or "Traceback" in err
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
