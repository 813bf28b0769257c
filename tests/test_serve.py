"""mt serve in-process: the API through an HTTP client against the app, each test with a
service of its own: answers equal to mt translate's, bad requests as 4xx that name the
field, hosts and content types, batching, and decoding processes that die, stop or hang
(tests/test_serve_faults.py starts the real server process)."""

import asyncio
import contextlib
import json
import os
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from test_sentences import piece_count, too_long_clauses

from mt.decode.inference import load
from mt.decode.sentences import cut_long
from mt.decode.translator import Translator
from mt.serve.app import Limits, Service, create_app, model_info

SENTENCES = ["the big dog sees a red bird", "a cat runs", "the small bird sees the big cat", "dogs run"]
BASE = "http://127.0.0.1"  # a Host the service answers to by default
# lines that are not blank to str.strip() but that the tokenizer turns into no pieces
JSON, JSON_UTF8 = {"content-type": "application/json"}, "application/json; charset=utf-8"
NO_PIECES = ["\ufeff", "\u200b", "\u200e", "\x01", "\ufffd", "\u2581", "\ufeff\u200b"]


@pytest.fixture
def make_service(toy_run):
    """``make_service(**fields)``: a Service of the toy model, this test's own."""
    model, tok, meta = load(toy_run)
    textbook, _, _ = load(toy_run, fast=False)

    def make(limits: Limits | None = None, **fields) -> Service:
        translator = Translator(model, tok, beam=5, workers=1)
        fields = {"max_wait_ms": 50, "workers": 2, **fields}
        return Service(translator, textbook, tok, model_info(toy_run, textbook, meta, 1), limits or Limits(max_lines=8),
                       **fields)  # fmt: skip

    return make


@pytest.fixture
def service(make_service):
    return make_service()


@pytest.fixture
def client(service):
    with TestClient(create_app(service), base_url=BASE) as c:  # runs the app's startup and shutdown
        yield c


@contextlib.asynccontextmanager
async def running(service):
    """The app's lifespan and an async client on it: for requests sent concurrently."""
    transport = httpx.ASGITransport(app=create_app(service))
    app = transport.app
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url=BASE) as c:
        yield c


def offline(service, lines, beam=5, n_best=1, prefixes=None):
    """What mt translate gives with the same options."""
    t = Translator(service.translator.model, service.tok, beam=beam, workers=1)
    return t.translate_nbest(lines, 1, n_best, prefixes)


def texts(reply) -> list[str]:
    assert reply.status_code == 200, reply.text
    return [t["text"] for t in reply.json()["translations"]]


def test_translate_equals_mt_translate(client, service):
    r = client.post("/v1/translate", json={"text": SENTENCES})
    assert texts(r) == [n[0][0] for n in offline(service, SENTENCES)]
    r = client.post("/v1/translate", json={"text": SENTENCES[0], "beam": 1, "scores": True})
    (item,) = r.json()["translations"]
    ((text, score),) = offline(service, SENTENCES[:1], beam=1)[0]
    assert item["text"] == text and item["score"] == pytest.approx(score, abs=1e-5)
    r = client.post("/v1/translate", json={"text": SENTENCES[:2], "n_best": 3})
    got = [[(h["text"], h["score"]) for h in t["n_best"]] for t in r.json()["translations"]]
    want = offline(service, SENTENCES[:2], n_best=3)
    assert [[t for t, _ in n] for n in got] == [[t for t, _ in n] for n in want]
    assert all(a[0][1] >= a[1][1] >= a[2][1] for a in got)  # best first


def test_split_translates_each_sentence_of_a_text_in_place(client, service):
    """split: every sentence of each text translated as alone, joined with the text's own
    spacing, each item listing its sentences; one translation per text, with no prefix."""
    paragraph = f"{SENTENCES[0]}. {SENTENCES[1]}!  {SENTENCES[2]}."
    alone = [f"{SENTENCES[0]}.", f"{SENTENCES[1]}!", f"{SENTENCES[2]}.", SENTENCES[3]]
    want = [n[0] for n in offline(service, alone)]
    r = client.post("/v1/translate", json={"text": [paragraph, SENTENCES[3]], "split": True, "scores": True})
    first, second = r.json()["translations"]
    assert first["text"] == f"{want[0][0]} {want[1][0]}  {want[2][0]}"
    assert first["sentences"] == [{"source": s, "text": t} for s, (t, _) in zip(alone[:3], want[:3])]
    assert first["score"] == pytest.approx(sum(score for _, score in want[:3]), abs=1e-4)
    assert second["text"] == want[3][0] and len(second["sentences"]) == 1
    assert texts(client.post("/v1/translate", json={"text": paragraph})) != [first["text"]]  # unsplit: one sentence
    for extra, named in (({"n_best": 2}, "n_best"), ({"prefix": "x"}, "prefix")):
        r = client.post("/v1/translate", json={"text": paragraph, "split": True, **extra})
        assert r.status_code == 422 and named in r.json()["error"] and "split" in r.json()["error"]


def test_a_text_longer_than_the_model_reads_is_translated_in_parts(make_service, toy_test_lines):
    """As mt translate: cut where it fits, every part translated, with and without split."""
    service = make_service(Limits(max_lines=8, max_chars=20_000))
    most = service.translator.max_source_pieces
    line = ", ".join(too_long_clauses(service.tok, toy_test_lines, most))
    offline = Translator(service.translator.model, service.tok, beam=5, workers=1)
    with TestClient(create_app(service), base_url=BASE) as client:
        for split in (None, service.info["src_lang"]):
            ((want, _),) = next(iter(offline.stream([line], split_lang=split)))
            (item,) = client.post("/v1/translate", json={"text": line, "split": bool(split)}).json()["translations"]
            assert item["text"] == want
        parts = cut_long(line, piece_count(service.tok), most)[0]
        assert [s["source"] for s in item["sentences"]] == parts  # split: the parts are its sentences


def test_a_prefix_is_kept_and_the_search_continues(client, service):
    (full,) = offline(service, SENTENCES[:1], beam=1)
    words = full[0][0].split()
    prefix = " ".join(words[:2])
    r = client.post("/v1/translate", json={"text": SENTENCES[0], "prefix": prefix, "beam": 1})
    assert texts(r) == [full[0][0]]  # greedy, from its own start: the same sentence
    given = "zzz qqq  "
    for beam in (1, 5):
        r = client.post("/v1/translate", json={"text": SENTENCES[:2], "prefix": [given, ""], "beam": beam})
        first, second = texts(r)
        assert first.startswith("zzz qqq") and len(first) > len("zzz qqq")  # verbatim, then more
        assert second == offline(service, SENTENCES[1:2], beam=beam)[0][0][0]
        assert first == offline(service, SENTENCES[:1], beam=beam, prefixes=[given])[0][0][0]


def test_model_health_and_page(client, toy_run):
    health = client.get("/healthz").json()
    assert health["status"] in ("ok", "unavailable", "degraded")  # its workers may still be loading
    assert len(health["workers"]) == 2 and health["queued"] == 0
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


BAD_TRANSLATE = [
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
    (b'{"text": "a", "beam": 100000}', 422, "beam must be between 1 and 16"),
    (b'{"text": "a", "beam": "5"}', 422, "beam"),
    (b'{"text": "a", "n_best": 6}', 422, "n_best must be between 1 and the beam (5)"),
    (b'{"text": "a", "alpha": -1}', 422, "alpha must be between 0 and 10"),
    (b'{"text": "a", "alpha": 2000}', 422, "alpha must be between 0 and 10, got 2000"),
    (b'{"text": "a", "alpha": 1' + b"0" * 400 + b"}", 422, "(401 digits)"),
    (b'{"text": "a", "alpha": 1e400}', 422, "alpha must be between 0 and 10"),
    (b'{"text": "a", "beam": 1' + b"0" * 5000 + b"}", 400, "more than 4,300 digits"),
    (b'{"text": "a", "alpha": NaN}', 422, "alpha"),
    (b'{"text": "a", "colour": 1}', 422, "colour: Extra inputs are not permitted"),
    (b'{"text": ["a", "b"], "prefix": "x"}', 422, "prefix must be a list of 2 strings"),
    (json.dumps({"text": "a", "prefix": "x " * 300}).encode(), 422, "subword tokens, more than the model's"),
    (json.dumps({"text": ["a"], "prefix": ["b" * 1001]}).encode(), 413, "prefix[0] has 1001 characters"),
    (b'{"text": "\\ud800"}', 422, "text holds a lone surrogate (U+D800) at character 0"),
    (b'{"text": ["a", "b\\udfff"]}', 422, "text[1] holds a lone surrogate (U+DFFF) at character 1"),
    (b'{"text": "a", "prefix": "\\ud800x"}', 422, "prefix holds a lone surrogate"),
    (b'{"text": "a"' + b" " * 300_000 + b"}", 413, "the body is larger than 196352 bytes"),
]


def test_bad_requests_are_clear_4xx_and_the_server_keeps_serving(client):
    for body, status, message in BAD_TRANSLATE:
        r = client.post("/v1/translate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:60], r.text)
        assert message in r.json()["error"] and "Traceback" not in r.text, (body[:60], r.text)
    assert texts(client.post("/v1/translate", json={"text": "a cat runs"}))


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
    for body, message in (
        ({"text": " "}, "text is empty"),
        ({"text": "a" * 301}, "text has 301 characters; the attention endpoint takes at most 300"),
        ({"text": "a cat", "target": "b" * 301}, "target has 301 characters"),
        ({}, "text"),
        ({"text": "\u200b"}, "text has no pieces to look at"),
        ({"text": "a cat", "target": "\u200b"}, "target has no pieces to force-decode"),
        ({"text": "\ud800"}, "text holds a lone surrogate"),
        ({"text": "a cat", "target": "x\udc00"}, "target holds a lone surrogate"),
    ):
        r = client.post("/v1/attention", content=json.dumps(body).encode(), headers=JSON)
        assert r.status_code == 422 and message in r.json()["error"], (body, r.text)
    bad_json = client.post("/v1/attention", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert client.post("/v1/attention", json={"text": "a cat"}).status_code == 200


def test_only_json_bodies_are_read(client):
    """A cross-site page may POST text/plain (or a form) without a preflight; JSON needs one."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"content-type": content_type} if content_type else {}
        for path in ("/v1/translate", "/v1/attention"):
            r = client.post(path, content=b'{"text": "a cat runs"}', headers=headers)
            assert r.status_code == 415, (content_type, r.text)
            assert "Content-Type: application/json" in r.json()["error"]
    ok = client.post("/v1/translate", content=b'{"text": "a"}', headers={"content-type": JSON_UTF8})
    assert ok.status_code == 200


def test_only_the_hosts_it_was_started_for_are_answered(make_service):
    with TestClient(create_app(make_service(workers=1)), base_url=BASE) as c:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""):
            r = c.get("/v1/model", headers={"host": host})
            assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"], host
            assert c.post("/v1/translate", json={"text": "a"}, headers={"host": host}).status_code == 400
        for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000"):
            assert c.get("/v1/model", headers={"host": host}).status_code == 200, host
    with TestClient(create_app(make_service(workers=1, allowed_hosts=("*",))), base_url="http://any.example") as c:
        assert c.get("/v1/model").status_code == 200


def test_lines_that_encode_to_nothing_translate_to_nothing_and_harm_no_one(make_service):
    """U+FEFF, U+200B, a control character...: not blank to str.strip(), no pieces to
    the tokenizer. mt translate gives them an empty line; so does the service, and the
    decoding processes and the sentences beside them are untouched."""
    service = make_service(Limits(max_lines=16))

    async def go():
        async with running(service) as c:
            pids = [w.process.pid for w in service.batcher.workers]
            mixed = [SENTENCES[0], *NO_PIECES, SENTENCES[1]]
            replies = await asyncio.gather(
                c.post("/v1/translate", json={"text": mixed}),
                *(c.post("/v1/translate", json={"text": x, "beam": 5}) for x in NO_PIECES),
                *(c.post("/v1/translate", json={"text": x}) for x in SENTENCES * 2),
                c.post("/v1/translate", json={"text": NO_PIECES[:2], "n_best": 3}),
                c.post("/v1/translate", json={"text": "\ufeff", "prefix": "zzz"}),
            )
            return mixed, replies, pids, [w.process.pid for w in service.batcher.workers]

    mixed, replies, pids, pids_after = asyncio.run(go())
    first, *rest = replies
    assert texts(first) == [n[0][0] for n in offline(service, mixed)]
    assert texts(first)[1:-1] == [""] * len(NO_PIECES)
    assert [texts(r) for r in rest[: len(NO_PIECES)]] == [[""]] * len(NO_PIECES)
    neighbours = rest[len(NO_PIECES) : -2]
    assert [texts(r)[0] for r in neighbours] == [n[0][0] for n in offline(service, SENTENCES * 2)]
    nbest = rest[-2].json()["translations"]
    assert [[h["text"] for h in t["n_best"]] for t in nbest] == [[""] * 3] * 2
    assert texts(rest[-1]) == [offline(service, ["\ufeff"], prefixes=["zzz"])[0][0][0]]
    assert pids_after == pids  # no decoding process died


def test_a_large_alpha_cannot_overflow_the_search(toy_run):
    """The length normalisation is a product with length**-alpha: any alpha the search
    is handed scores without overflow (the options refuse more than 10 before that)."""
    from mt.decode.continuous import ContinuousBeamSearch, Sentence
    from mt.decode.search import normalized

    assert normalized(-3.0, 40.0, 2000.0) == 0.0 and normalized(-3.0, 2.0, 1.0) == -1.5
    model, tok, _ = load(toy_run)
    t = Translator(model, tok, beam=5, alpha=2000.0, workers=1)
    assert all(isinstance(x, str) for x in t.translate(SENTENCES))
    search = ContinuousBeamSearch(model, t.settings, beam=5)
    search.add([Sentence(x, alpha=2000.0, tag=n) for n, x in enumerate(t.encode(SENTENCES))])
    done = []
    for _ in range(200):
        done += search.step()
        if not len(search):
            break
    assert sorted(x.tag for x, _ in done) == [0, 1, 2, 3]


def test_requests_that_arrive_together_are_decoded_together(service):
    async def go():
        async with running(service) as c:
            before = service.batcher.joins
            lines = SENTENCES * 4
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}) for x in lines))
            return lines, replies, service.batcher.joins - before

    lines, replies, joins = asyncio.run(go())
    assert [texts(r)[0] for r in replies] == [n[0][0] for n in offline(service, lines)]
    assert joins < len(lines) / 2  # 16 one-sentence requests start in a few groups (50 ms to gather)


async def until(condition, what: str, timeout: float = 300) -> None:
    """Poll ``condition`` on the event loop; fail after ``timeout`` seconds (a busy machine is slow)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        await asyncio.sleep(0.05)


def all_ready(service) -> bool:
    return all(w.ready and w.alive for w in service.batcher.workers)


def test_a_decoding_process_that_dies_fails_only_its_requests_and_is_replaced(service):
    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "ready workers")
            first, other = service.batcher.workers
            os.kill(first.process.pid, signal.SIGSTOP)  # it takes the request and can never answer it
            try:
                pending = asyncio.ensure_future(c.post("/v1/translate", json={"text": SENTENCES[0]}, timeout=600))
                await until(lambda: first.jobs, "a job on the stopped worker")
                beside = await c.post("/v1/translate", json={"text": SENTENCES[1]}, timeout=600)  # the other one
                assert not pending.done()
            finally:  # a stopped process would hold up the app's shutdown
                os.kill(first.process.pid, signal.SIGKILL)
            failed = await pending
            await until(lambda: service.batcher.workers[0] is not first and all_ready(service), "a new worker")
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}, timeout=600) for x in SENTENCES))
            return failed, beside, replies

    failed, beside, replies = asyncio.run(go())
    assert failed.status_code == 503 and "the decoding process ended" in failed.json()["error"]
    assert failed.headers["retry-after"] == "5"
    assert texts(beside) == [offline(service, SENTENCES[1:2])[0][0][0]]
    assert [texts(r)[0] for r in replies] == [n[0][0] for n in offline(service, SENTENCES)]


def test_a_hung_decoding_process_is_noticed_killed_and_replaced(make_service):
    """SIGSTOP stands for a deadlock: a process that holds sentences and never reports."""
    service = make_service(stall_s=2.0)

    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "ready workers")
            first, other = service.batcher.workers
            os.kill(first.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}, timeout=600) for x in SENTENCES))
            waited = time.monotonic() - started
            stalled = (await c.get("/healthz")).json()
            await until(lambda: service.batcher.workers[0] is not first and all_ready(service), "a new worker")
            health = await c.get("/healthz")
            after = await c.post("/v1/translate", json={"text": SENTENCES}, timeout=600)
            return first, replies, waited, stalled, health, after

    first, replies, waited, stalled, health, after = asyncio.run(go())
    assert first.process.exitcode == -signal.SIGKILL  # the watchdog ended it
    failed = [r for r in replies if r.status_code != 200]
    assert failed and all(r.status_code == 503 and r.headers["retry-after"] for r in failed)
    assert all("made no progress for 2 s" in r.json()["error"] for r in failed)
    assert [texts(r)[0] for r in replies if r.status_code == 200] == [
        n[0][0] for r, n in zip(replies, offline(service, SENTENCES)) if r.status_code == 200
    ]
    assert waited < 120  # noticed after 2 s, not never (generous: a busy machine)
    assert stalled["status"] in ("degraded", "ok") and health.json()["status"] == "ok"
    assert texts(after) == [n[0][0] for n in offline(service, SENTENCES)]


def test_a_request_past_its_deadline_is_504_and_leaves_the_queue(make_service):
    service = make_service(workers=1, timeout_s=1.0, stall_s=600.0)

    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "a ready worker")
            (worker,) = service.batcher.workers
            os.kill(worker.process.pid, signal.SIGSTOP)
            try:
                late = await c.post("/v1/translate", json={"text": SENTENCES}, timeout=600)
                queued = service.batcher.queued()
            finally:
                os.kill(worker.process.pid, signal.SIGCONT)
            after = await c.post("/v1/translate", json={"text": SENTENCES[0]}, timeout=600)
            return late, queued, after, service.batcher.workers[0] is worker

    late, queued, after, same_worker = asyncio.run(go())
    assert late.status_code == 504 and late.headers["retry-after"] and "within 1 s" in late.json()["error"]
    assert queued == 0  # its sentences were dropped, not left to be decoded for nobody
    assert texts(after) == [offline(service, SENTENCES[:1])[0][0][0]] and same_worker


def test_a_full_queue_refuses_at_once(make_service):
    service = make_service(Limits(max_lines=8, max_queue=6), workers=1, stall_s=600.0)

    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "a ready worker")
            (worker,) = service.batcher.workers
            os.kill(worker.process.pid, signal.SIGSTOP)  # what it is given stays queued
            try:
                held = asyncio.ensure_future(c.post("/v1/translate", json={"text": SENTENCES}, timeout=600))
                await until(lambda: service.batcher.queued() == 4, "4 queued sentences")
                started = time.monotonic()
                refused = await c.post("/v1/translate", json={"text": SENTENCES[:3]}, timeout=600)
                waited = time.monotonic() - started
                fits = asyncio.ensure_future(c.post("/v1/translate", json={"text": SENTENCES[:2]}, timeout=600))
                await until(lambda: service.batcher.queued() == 6, "6 queued sentences")
            finally:
                os.kill(worker.process.pid, signal.SIGCONT)
            return refused, waited, await held, await fits

    refused, waited, held, fits = asyncio.run(go())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "4 sentences are queued (--max-queue 6)" in refused.json()["error"] and waited < 60
    assert texts(held) == [n[0][0] for n in offline(service, SENTENCES)]
    assert texts(fits) == [n[0][0] for n in offline(service, SENTENCES[:2])]


def test_a_dropped_sentence_leaves_the_search_and_the_others_are_unchanged(toy_run):
    from mt.decode.continuous import ContinuousBeamSearch, JoinError, Sentence

    model, tok, _ = load(toy_run)
    t = Translator(model, tok, beam=5, workers=1)
    ids = t.encode(SENTENCES)
    want = [h[0][0] for h in t.translate_ids(ids)]
    search = ContinuousBeamSearch(model, t.settings, beam=5)
    search.add([Sentence(x, tag=n) for n, x in enumerate(ids)])
    search.step()
    search.drop({1, 3})
    got = {}
    while len(search):
        got |= {x.tag: h[0].tokens for x, h in search.step()}
    assert got == {0: want[0], 2: want[2]}

    # a join that fails takes only the joiners: the sentences under way go on
    search = ContinuousBeamSearch(model, t.settings, beam=5)
    search.add([Sentence(ids[0], tag=0)])
    search.step()
    real = model.encode

    def broken(src):
        raise RuntimeError("no memory")

    model.encode = broken
    search.add([Sentence(ids[1], tag=1)])
    with pytest.raises(JoinError) as e:
        search.step()
    model.encode = real
    assert [x.tag for x in e.value.sentences] == [1] and "no memory" in str(e.value)
    got = {}
    while len(search):
        got |= {x.tag: h[0].tokens for x, h in search.step()}
    assert got == {0: want[0]}


def test_stop_is_bounded_with_a_stopped_worker(make_service):
    service = make_service(workers=1, stall_s=600.0)

    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "a ready worker")
            (worker,) = service.batcher.workers
            os.kill(worker.process.pid, signal.SIGSTOP)
            pending = asyncio.ensure_future(c.post("/v1/translate", json={"text": SENTENCES}, timeout=600))
            await until(lambda: worker.jobs, "a queued job")
            started = time.monotonic()
            await service.batcher.stop(timeout=1.0)
            took = time.monotonic() - started
            return worker, await pending, took, service.batcher.workers

    worker, pending, took, workers = asyncio.run(go())
    assert took < 60 and not worker.process.is_alive()
    assert pending.status_code == 503  # its sentences failed, not left hanging
    assert workers == [worker]  # nothing new started while stopping


def test_bad_serve_options_are_named_before_anything_loads(toy_run, capsys):
    from mt.cli.main import main

    for opts, message in (
        (["--max-lines", "0"], "--max-lines and --max-chars must be at least 1"),
        (["--max-chars", "-5"], "--max-lines and --max-chars must be at least 1"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--port", "70000"], "--port must be between 1 and 65535"),
        (["--max-wait-ms", "inf"], "--max-wait-ms must be between 0 and 1000, got inf"),
        (["--max-wait-ms", "nan"], "--max-wait-ms must be between 0 and 1000, got nan"),
        (["--beam", "20"], "--beam 20 is more than --max-beam 16"),
        (["--max-beam", "33"], "--max-beam must be between 1 and 32"),
        (["--beam", "100000", "--max-beam", "32"], "--beam 100000 is more than --max-beam 32"),
        (["--alpha", "-1"], "--alpha must be between 0 and 10.0, got -1.0"),
        (["--alpha", "2000"], "--alpha must be between 0 and 10.0, got 2000.0"),
        (["--timeout", "0"], "--timeout must be between 1 and 3600"),
        (["--timeout", "nan"], "--timeout must be between 1 and 3600"),
        (["--stall-timeout", "inf"], "--stall-timeout must be between 1 and 3600"),
        (["--max-queue", "10"], "--max-queue 10 is less than --max-lines 64"),
        (["--allowed-hosts", " , "], "--allowed-hosts names no host"),
    ):
        assert main(["serve", "--model", str(toy_run), *opts]) == 1, opts
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (opts, err)


def test_once_a_stop_begins_no_process_is_started(service):
    """uvicorn drains the requests in flight after SIGTERM; a worker that ends meanwhile is not replaced."""

    async def go():
        async with running(service) as c:
            await until(lambda: all_ready(service), "ready workers")
            first, other = service.batcher.workers
            service.batcher.drain()  # what the server's signal handler calls
            os.kill(first.process.pid, signal.SIGKILL)
            await until(lambda: not first.alive, "the end of the killed worker")
            await asyncio.sleep(1)  # time in which a replacement would have been started
            replies = await asyncio.gather(*(c.post("/v1/translate", json={"text": x}, timeout=600) for x in SENTENCES))
            health = (await c.get("/healthz")).json()
            return first, other, replies, health, list(service.batcher.workers)

    first, other, replies, health, workers = asyncio.run(go())
    assert workers == [first, other] and not first.process.is_alive()
    assert [texts(r)[0] for r in replies] == [n[0][0] for n in offline(service, SENTENCES)]  # the other one
    assert health["status"] == "stopping" and health["workers"][0]["state"] == "restarting"
