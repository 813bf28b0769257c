"""Nine hostile requests, each sent while eight well-formed beam-5 requests run beside it.

    python experiments/hostile_neighbours.py RUN [--sentences 8]

Starts `mt serve` (the code of the tree this script is in: run a copy from an old
commit's worktree to measure that code) on loopback, and for each hostile request
sends it together with eight well-formed requests of --sentences sentences each.
Prints, per hostile request, its status and how many of its eight neighbours were
not answered 200. What issue 65 measured on the code before it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["A man in a blue shirt is standing on a ladder.", "Two dogs are playing in the snow.",
             "A group of people are sitting at a table.", "A little girl climbs into a wooden playhouse.",
             "A woman is riding a bicycle down the street.", "Children play in the water at the beach.",
             "A black dog runs through the grass.", "An older man plays the guitar on a stage."]  # fmt: skip
JSON = {"Content-Type": "application/json"}
HOSTILE = [
    ("byte-order mark", "/v1/translate", json.dumps({"text": "\ufeff"}).encode(), JSON),
    ("zero-width space", "/v1/translate", json.dumps({"text": "\u200b"}).encode(), JSON),
    ("control character U+0001", "/v1/translate", json.dumps({"text": "\x01"}).encode(), JSON),
    ("alpha 2000, beam 5", "/v1/translate", b'{"text": "A dog runs.", "beam": 5, "alpha": 2000}', JSON),
    ("lone surrogate", "/v1/translate", b'{"text": "\\ud800"}', JSON),
    ("alpha of 400 digits", "/v1/translate", b'{"text": "A dog.", "alpha": 1' + b"0" * 400 + b"}", JSON),
    ("attention on a zero-width space", "/v1/attention", json.dumps({"text": "\u200b"}).encode(), JSON),
    ("a text/plain body", "/v1/translate", b'{"text": "A dog runs."}', {"Content-Type": "text/plain"}),
    ("replacement character U+FFFD", "/v1/translate", json.dumps({"text": "\ufffd"}).encode(), JSON),
]


def request(port: int, path: str, body: bytes, headers: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body, headers)
        r = conn.getresponse()
        r.read()
        return r.status
    except (TimeoutError, OSError):
        return 0  # no answer
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--sentences", type=int, default=8, help="sentences per well-formed request (default 8)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mt", "serve", "--model", args.model, "--port", str(port)],
                              cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    good = json.dumps({"text": SENTENCES[: args.sentences], "beam": 5}).encode()
    try:
        deadline = time.monotonic() + 300
        while request(port, "/v1/translate", good, JSON) != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("mt serve did not start")
            time.sleep(0.5)
        print("| hostile request | its status | neighbours not 200 (of 8) |")
        print("|---|---|---|")
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            for name, path, body, headers in HOSTILE:
                neighbours = [pool.submit(request, port, "/v1/translate", good, JSON) for _ in range(8)]
                time.sleep(0.05)  # the neighbours are decoding when it arrives
                status = request(port, path, body, headers)
                bad = sum(f.result() != 200 for f in neighbours)
                print(f"| {name} | {status or 'no answer'} | {bad} |", flush=True)
                time.sleep(5)  # a process that died is replaced before the next
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


if __name__ == "__main__":
    main()
