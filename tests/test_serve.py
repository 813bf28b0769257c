"""mt serve: the API through an HTTP client against the app, batching, a decoding process that dies, and the
real server process (health while decoding, graceful stop on SIGINT and SIGTERM)."""

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import urllib.request

import httpx
import pytest
from conftest import ROOT, mt_cmd, run_command, wait_for
from fastapi.testclient import TestClient

from mt.decode.inference import load
from mt.decode.translator import Translator
from mt.serve.app import Limits, Service, create_app, model_info

SENTENCES = ["the big dog sees a red bird", "a cat runs", "the small bird sees the big cat", "dogs run"]


@pytest.fixture(scope="module")
def service(toy_run):
    model, tok, meta = load(toy_run)
    textbook, _, _ = load(toy_run, fast=False)
    translator = Translator(model, tok, beam=5, workers=1)
    return Service(translator, textbook, tok, model_info(toy_run, textbook, meta, 1), Limits(max_lines=8),
                   max_wait_ms=50, workers=2)  # fmt: skip


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as c:  # runs the app's startup and shutdown
        yield c


def offline(service, lines, beam=5, n_best=1, prefixes=None):
    """What mt translate gives with the same options."""
    t = Translator(service.translator.model, service.tok, beam=beam, workers=1)
    return t.translate_nbest(lines, 1, n_best, prefixes)


def test_translate_equals_mt_translate(client, service):
    r = client.post("/v1/translate", json={"text": SENTENCES})
    assert r.status_code == 200
    assert [t["text"] for t in r.json()["translations"]] == [n[0][0] for n in offline(service, SENTENCES)]
    r = client.post("/v1/translate", json={"text": SENTENCES[0], "beam": 1, "scores": True})
    (item,) = r.json()["translations"]
    ((text, score),) = offline(service, SENTENCES[:1], beam=1)[0]
    assert item["text"] == text and item["score"] == pytest.approx(score, abs=1e-5)
    r = client.post("/v1/translate", json={"text": SENTENCES[:2], "n_best": 3})
    got = [[(h["text"], h["score"]) for h in t["n_best"]] for t in r.json()["translations"]]
    want = offline(service, SENTENCES[:2], n_best=3)
    assert [[t for t, _ in n] for n in got] == [[t for t, _ in n] for n in want]
    assert all(a[0][1] >= a[1][1] >= a[2][1] for a in got)  # best first


def test_a_prefix_is_kept_and_the_search_continues(client, service):
    (full,) = offline(service, SENTENCES[:1], beam=1)
    words = full[0][0].split()
    prefix = " ".join(words[:2])
    r = client.post("/v1/translate", json={"text": SENTENCES[0], "prefix": prefix, "beam": 1})
    assert r.json()["translations"][0]["text"] == full[0][0]  # greedy, from its own start: the same sentence
    given = "zzz qqq  "
    for beam in (1, 5):
        r = client.post("/v1/translate", json={"text": SENTENCES[:2], "prefix": [given, ""], "beam": beam})
        first, second = (t["text"] for t in r.json()["translations"])
        assert first.startswith("zzz qqq") and len(first) > len("zzz qqq")  # verbatim, then more
        assert second == offline(service, SENTENCES[1:2], beam=beam)[0][0][0]
        assert first == offline(service, SENTENCES[:1], beam=beam, prefixes=[given])[0][0][0]


def test_model_health_and_page(client, toy_run):
    assert client.get("/healthz").json() == {"status": "ok"}
    info = client.get("/v1/model").json()
    assert info["run"] == toy_run.name and info["parameters"] > 0 and info["n_heads"] >= 1
    assert info["test_scores"] == [] or "bleu" in info["test_scores"][0]
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for src in ("/static/steps.js", "/static/explorer.js", "/static/serve.js", "/static/serve.css"):
        assert src in page.text
        r = client.get(src)
        assert r.status_code == 200 and len(r.text) > 100
        assert "http://" not in r.text and "https://" not in r.text  # no CDN: it works offline
    assert client.get("/static/serve.py").status_code == 404
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/translate", "/v1/attention", "/v1/model", "/healthz"} <= set(paths)


def test_attention_is_what_mt_attention_captures(client, service):
    from mt.inspect.capture import force_decode

    r = client.post("/v1/attention", json={"text": SENTENCES[0]})
    a = r.json()
    tok, model = service.tok, service.inspect_model
    src = tok.encode_src([SENTENCES[0]])[0]
    tgt = tok.encode_tgt([a["target"]])[0]
    maps = force_decode(model, tok, src, tgt)
    for kind in ("encoder", "decoder", "cross"):
        got = a["kinds"][kind]
        assert len(got["layers"]) == len(maps.layers(kind))
        want = maps.layers(kind)[1][0].tolist()
        assert got["layers"][1][0] == [[round(v, 4) for v in row] for row in want]
        assert len(got["stats"]) == len(got["layers"]) * model.cfg.n_heads and "steps" in got
    forced = client.post("/v1/attention", json={"text": SENTENCES[0], "target": "dribo dero"}).json()
    assert forced["target"] == "dribo dero"


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{bad", 400, "the body is not valid JSON"),
        (b'{"text": "\xff"}', 400, "not valid UTF-8"),
        (b"", 422, "the body is empty"),
        (b"[1]", 422, "send a JSON object"),
        (b'{"text": 5}', 422, "text"),
        (b'{"text": ""}', 422, "text is empty"),
        (b'{"text": []}', 422, "text is an empty list"),
        (b'{"text": ["a", " "]}', 422, "text[1] is empty"),
        (b'{"text": "a\\nb"}', 422, "spans several lines"),
        (json.dumps({"text": ["a"] * 9}).encode(), 413, "9 sentences; at most 8"),
        (json.dumps({"text": "a" * 1001}).encode(), 413, "1001 characters; at most 1000"),
        (b'{"text": "a", "beam": 0}', 422, "beam must be between 1 and 16"),
        (b'{"text": "a", "beam": "5"}', 422, "beam"),
        (b'{"text": "a", "n_best": 6}', 422, "n_best must be between 1 and the beam (5)"),
        (b'{"text": "a", "alpha": -1}', 422, "alpha must be a number >= 0"),
        (b'{"text": "a", "colour": 1}', 422, "colour: Extra inputs are not permitted"),
        (b'{"text": ["a", "b"], "prefix": "x"}', 422, "prefix must be a list of 2 strings"),
        (json.dumps({"text": "a", "prefix": "x " * 300}).encode(), 422, "subword tokens, more than the model's"),
        (json.dumps({"text": ["a"], "prefix": ["b" * 1001]}).encode(), 413, "prefix[0] has 1001 characters"),
        (b'{"text": "a"' + b" " * 300_000 + b"}", 413, "the body is larger than 196352 bytes"),
    ],
)
def test_bad_requests_are_clear_4xx_and_the_server_keeps_serving(client, body, status, message):
    r = client.post("/v1/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"] and "Traceback" not in r.text
    assert client.post("/v1/translate", json={"text": "a cat runs"}).status_code == 200


def test_a_body_without_its_length_is_not_read_past_the_limit(client):
    def chunks():  # no Content-Length: the server counts what it reads
        yield b'{"text": "a"'
        for _ in range(100):
            yield b" " * 4096
        yield b"}"

    r = client.post("/v1/translate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]
    assert client.post("/v1/translate", json={"text": "a cat runs"}).status_code == 200


def test_bad_attention_requests(client):
    for body, message in (({"text": " "}, "text is empty"), ({"text": "a" * 301}, "at most 300"), ({}, "text")):
        r = client.post("/v1/attention", json=body)
        assert r.status_code == 422 and message in r.json()["error"]
    assert client.post("/v1/attention", content=b"{", headers={"content-type": "text/plain"}).status_code == 400


def test_requests_that_arrive_together_are_decoded_together(service):
    async def go():
        transport = httpx.ASGITransport(app=create_app(service))
        app = transport.app
        client = httpx.AsyncClient(transport=transport, base_url="http://mt")
        async with app.router.lifespan_context(app), client as c:
            before = service.batcher.joins
            lines = SENTENCES * 4
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}) for x in lines))
            return lines, replies, service.batcher.joins - before

    lines, replies, joins = asyncio.run(go())
    assert [r.json()["translations"][0]["text"] for r in replies] == [n[0][0] for n in offline(service, lines)]
    assert joins < len(lines) / 2  # 16 one-sentence requests start in a few groups (50 ms to gather)


def test_a_decoding_process_that_dies_fails_its_requests_and_is_replaced(service):
    async def go():
        transport = httpx.ASGITransport(app=create_app(service))
        app = transport.app
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://mt") as c:
            first = service.batcher.workers[0]
            os.kill(first.process.pid, signal.SIGSTOP)  # it takes the request and can never answer it
            try:
                pending = asyncio.ensure_future(c.post("/v1/translate", json={"text": SENTENCES[0]}, timeout=600))
                await asyncio.sleep(0.5)
                assert first.jobs and not pending.done()
            finally:  # a stopped process would hold up the app's shutdown
                os.kill(first.process.pid, signal.SIGKILL)
            failed = await pending
            for _ in range(600):  # its reader starts a new process (generous: a busy machine)
                if service.batcher.workers[0] is not first:
                    break
                await asyncio.sleep(0.1)
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}, timeout=600) for x in SENTENCES))
            return failed, replies, service.batcher.workers[0] is not first

    failed, replies, replaced = asyncio.run(go())
    assert failed.status_code == 503 and "the decoding process ended" in failed.json()["error"]
    assert replaced
    assert [r.json()["translations"][0]["text"] for r in replies] == [n[0][0] for n in offline(service, SENTENCES)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 60):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: dict, timeout: float = 600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_server_answers_health_while_decoding_and_stops_gracefully(toy_run, children, sig):
    import subprocess

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = children([*mt_cmd("serve", "--model", str(toy_run), "--port", str(port), "--max-lines", "64")],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def healthy() -> bool:
        try:
            return get(base + "/healthz", timeout=5)["status"] == "ok"
        except OSError:
            return False

    wait_for(healthy, proc, "an answer on /healthz")
    long = {"text": [" ".join(SENTENCES)] * 64, "beam": 8, "n_best": 8}
    result = {}
    worker = threading.Thread(target=lambda: result.update(reply=post(base + "/v1/translate", long)))
    worker.start()
    answered_while_busy = 0
    while worker.is_alive():  # health answers while the long request decodes
        answered_while_busy += healthy() and worker.is_alive()
        if answered_while_busy >= 3:
            break
    in_flight = worker.is_alive()
    proc.send_signal(sig)  # with the long request still in flight
    assert answered_while_busy >= 3 and in_flight
    worker.join(timeout=600)
    status, body = result["reply"]
    assert status == 200 and len(body["translations"]) == 64  # answered, not cut off
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped after" in out and "Traceback" not in err


def test_the_load_benchmark_gets_every_answer_equal_to_the_offline_translation(toy_run, tmp_path):
    source = tmp_path / "sentences.txt"
    source.write_text("\n".join(SENTENCES * 5) + "\n")
    done = run_command([sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--model", str(toy_run),
                        "--source", str(source), "--clients", "1", "4", "--seconds", "3", "--beam", "3"],
                       timeout=600, check=True)  # fmt: skip
    rows = [
        line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "clients" not in line
    ]
    assert [int(r[0]) for r in rows] == [1, 4], done.stdout
    for _, sentences, rate, _, _, _, errors, differ, health_p99, cpu in rows:
        assert int(sentences) > 0 and float(rate) > 0
        assert (int(errors), int(differ)) == (0, 0), done.stdout
        assert float(health_p99) > 0, done.stdout  # health checks were answered while it decoded
        server, decoding, clients = (float(x) for x in cpu.split("/"))
        if sys.platform == "linux":  # read from /proc: the decoding processes did the work
            assert decoding > 0 and server >= 0 and decoding > server, done.stdout


def test_bad_serve_options_are_named_before_anything_loads(toy_run, capsys):
    from mt.cli.main import main

    for opts, message in (
        (["--max-lines", "0"], "--max-lines and --max-chars must be at least 1"),
        (["--max-chars", "-5"], "--max-lines and --max-chars must be at least 1"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--port", "70000"], "--port must be between 1 and 65535"),
    ):
        assert main(["serve", "--model", str(toy_run), *opts]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
