"""mt serve as a process, with faults injected while it serves: a decoding process stopped,
SIGTERM to the whole process group with requests in flight, a client that disconnects,
a slow client, a worker whose pipe is full. Every well-formed request beside a fault is
answered, or answered 503/504 with Retry-After: none is left hanging."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from conftest import ROOT, free_port, get, mt_cmd, post, run_command, wait_for

SENTENCES = ["the big dog sees a red bird", "a cat runs", "the small bird sees the big cat", "dogs run"]


def serve(children, toy_run, *options: str):
    """Start mt serve on a free port; (process, base URL) once every worker is ready."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = children([*mt_cmd("serve", "--model", str(toy_run), "--port", str(port), *options)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: health(base).get("status") == "ok", proc, "an ok on /healthz")
    return proc, base


def health(base: str) -> dict:
    try:
        return get(base + "/healthz", timeout=10)
    except OSError:  # not up yet, or a 503
        return {}


def worker_pids(base: str) -> list[int]:
    return [w["pid"] for w in get(base + "/healthz")["workers"]]


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run fn(*args) in a thread; its result lands in the dict under "result" (or "error")."""
    out = {}

    def go():
        try:
            out["result"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


def offline(toy_run, lines: list[str], beam: int = 5) -> list[str]:
    from mt.decode.inference import load
    from mt.decode.translator import Translator

    model, tok, _ = load(toy_run)
    return Translator(model, tok, beam=beam, workers=1).translate(lines)


def stop(proc, sig=signal.SIGTERM, group=False, timeout=180) -> tuple[str, str]:
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return out, err


def test_the_server_answers_health_while_the_decoder_holds_a_request_and_stops_gracefully(toy_run, children):
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc, base = serve(children, toy_run, "--max-lines", "64")
        long = {"text": [" ".join(SENTENCES)] * 64, "beam": 8, "n_best": 8}
        thread, result = in_thread(post, base + "/v1/translate", long)
        held = 0
        deadline = time.monotonic() + 600
        while thread.is_alive() and held < 3 and time.monotonic() < deadline:
            h = health(base)  # answered while the request is in the decoders' hands
            held += bool(h.get("queued")) and thread.is_alive()
        in_flight = thread.is_alive()
        proc.send_signal(sig)  # with the long request still in flight
        assert held >= 3 and in_flight, (held, in_flight)
        thread.join(timeout=600)
        status, body = result["result"]
        assert status == 200 and len(body["translations"]) == 64  # answered, not cut off
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert "stopped after" in out and "Traceback" not in err


def test_sigterm_to_the_process_group_drains_the_requests_in_flight(toy_run, children):
    """systemd and kill -- -PGID signal every process of the group, the decoders too."""
    proc, base = serve(children, toy_run, "--max-lines", "64")
    pids = worker_pids(base)
    lines = [" ".join(SENTENCES[:2])] * 40
    calls = [in_thread(post, base + "/v1/translate", {"text": lines, "beam": 8}) for _ in range(4)]
    wait_for(lambda: health(base).get("queued", 0) >= 40, proc, "requests in the decoders")
    out, err = stop(proc, group=True)
    for thread, result in calls:
        thread.join(timeout=600)
        status, body = result["result"]
        assert status == 200 and len(body["translations"]) == 40, body
    assert proc.returncode == 0 and "Traceback" not in err, err
    for pid in pids:  # the decoders ended with the server (gone, or a zombie of this test's child)
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z", pid


def raw_request(port: int, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=600)
    s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    return s


def test_a_client_that_disconnects_has_its_sentences_dropped(toy_run, children):
    proc, base = serve(children, toy_run, "--workers", "1", "--stall-timeout", "600")
    port = int(base.rsplit(":", 1)[1])
    (pid,) = worker_pids(base)
    os.kill(pid, signal.SIGSTOP)  # what it is given stays queued
    try:
        s = raw_request(port, json.dumps({"text": SENTENCES * 2}).encode())
        wait_for(lambda: health(base).get("queued") == 8, proc, "8 queued sentences")
        s.close()  # the client goes away
        wait_for(lambda: health(base).get("queued") == 0, proc, "the sentences dropped")
    finally:
        os.kill(pid, signal.SIGCONT)
    status, body = post(base + "/v1/translate", {"text": SENTENCES})
    assert status == 200 and [t["text"] for t in body["translations"]] == offline(toy_run, SENTENCES)
    assert worker_pids(base) == [pid]
    out, err = stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err


def test_a_slow_client_holds_up_no_one(toy_run, children):
    proc, base = serve(children, toy_run, "--workers", "1")
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"text": SENTENCES[0]}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=600)
    s.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
    for i in range(0, len(body) - 1, 4):  # the body a few bytes at a time; others are served meanwhile
        s.sendall(body[i : i + 4])
        status, answer = post(base + "/v1/translate", {"text": SENTENCES[1]})
        assert status == 200 and answer["translations"][0]["text"] == offline(toy_run, SENTENCES[1:2])[0]
        if i > 12:
            break
    s.sendall(body[i + 4 :])
    reply = b""
    while b"}]}" not in reply:
        chunk = s.recv(65536)
        assert chunk, reply
        reply += chunk
    s.close()
    assert b"200 OK" in reply.split(b"\r\n")[0]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["translations"][0]["text"] == offline(toy_run, SENTENCES[:1])[0]
    stop(proc)
    assert proc.returncode == 0


def test_a_stopped_worker_with_a_full_pipe_never_blocks_the_server(toy_run, children):
    """Large jobs for a stopped worker fill its pipe: only its sender thread waits; the
    event loop answers, the requests end by their deadline, and a stop is bounded."""
    proc, base = serve(children, toy_run, "--workers", "1", "--timeout", "2", "--stall-timeout", "600")
    (pid,) = worker_pids(base)
    os.kill(pid, signal.SIGSTOP)
    words = " ".join(SENTENCES * 50)[:1000]
    calls = [in_thread(post, base + "/v1/translate", {"text": [words] * 64}) for _ in range(8)]
    started = time.monotonic()
    for _ in range(5):
        assert health(base).get("queued", 0) >= 0 and get(base + "/v1/model", timeout=30)["parameters"] > 0
    answered_in = time.monotonic() - started
    for thread, result in calls:
        thread.join(timeout=600)
        status, body = result["result"]
        assert status in (503, 504) and ("within 2 s" in body["error"] or "busy" in body["error"]), body
    assert answered_in < 120
    started = time.monotonic()
    out, err = stop(proc)  # the worker is still stopped: the stop kills it after --timeout
    assert proc.returncode == 0 and time.monotonic() - started < 170 and "Traceback" not in err, err


def test_the_soak_script_reports_no_hung_or_differing_answer(toy_run, tmp_path):
    report_file = tmp_path / "soak.json"
    done = run_command([sys.executable, str(ROOT / "scripts" / "soak_serve.py"), "--model", str(toy_run),
                        "--minutes", "0.25", "--fault-every", "4", "--bad-share", "0.5", "--pool", "50",
                        "--json", str(report_file)],
                       timeout=900, check=True)  # fmt: skip
    report = json.loads(report_file.read_text())
    assert (report["hung"], report["differ"], report["unexpected"]) == (0, 0, 0), done.stdout
    assert report["well_formed_ok"] > 0 and report["faults"] >= 2, done.stdout
    sent = {name for name, codes in report["bad_inputs"].items() if codes}
    assert len(sent) >= 10 and report["outcomes"]["bad input: as expected"] > 0, done.stdout
    assert report["server_exit"] == 0 and not report["server_traceback"]
