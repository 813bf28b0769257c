"""``mt serve``: translation and attention over HTTP, and a page to use them.

Built on FastAPI over uvicorn: the standard ASGI pair of the Python web
world. FastAPI declares each endpoint's body once, as a typed model that
validates requests and documents them at ``/docs`` (OpenAPI); uvicorn serves
it and stops gracefully on SIGINT and SIGTERM (no new connections, the
requests in flight answered, then exit 0).

Requests that arrive together are decoded together, and continuously: each
sentence joins a beam search under way in a decoding process and is
answered as soon as it is finished (``mt.serve.batcher``), off the event loop, so
the server answers ``/healthz`` while it decodes. A translation is the same
as ``mt translate``'s with the same options.

What a client may send, and what the service promises in return (limits,
deadlines, hosts, content type): SECURITY.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated

import yaml
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from mt.config import DECODING
from mt.data.tokenizer import Tokenizer
from mt.decode.sentences import per_line, split_lines
from mt.decode.translator import Translator
from mt.inspect.capture import KINDS, force_decode, head_table, translate_with_attention
from mt.inspect.plotting import explorer_data, web_asset
from mt.model.transformer import Transformer
from mt.serve.batcher import Batcher, DecodingError, DecodingTimeout, Options, Overloaded


@dataclass
class Limits:
    """What one request may ask for."""

    max_lines: int = 64  #: sentences per request
    max_chars: int = 1000  #: characters per sentence (and per prefix)
    max_beam: int = 16
    max_attention_chars: int = 300  #: the attention endpoint draws one sentence (and its target)
    max_queue: int = 1024  #: sentences outstanding in the decoding processes; past it, 503 at once
    max_attention_queue: int = 4  #: attention requests in flight; past it, 503 at once

    @property
    def max_body_bytes(self) -> int:
        """The largest body read: room for the largest request the other limits allow, texts and
        prefixes, each character escaped as JSON at its longest (a surrogate pair, 12 bytes)."""
        return 2 * self.max_lines * (12 * self.max_chars + 16) + 4096


# The request bodies. Strict types: a number is not a sentence, "5" is not a beam.
Text = Annotated[StrictStr, Field(description="a sentence")]


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text | list[Text] = Field(description="one sentence, or a list of them")
    beam: StrictInt | None = Field(None, description="beam size (default: the server's --beam); 1 = greedy")
    alpha: StrictFloat | StrictInt | None = Field(
        None, description=f"length penalty, 0 to {DECODING.max_alpha:g}: score / length**alpha"
    )
    n_best: StrictInt = Field(1, description="hypotheses per sentence, at most the beam")
    scores: bool = Field(False, description="include each translation's score")
    prefix: Text | list[Text] | None = Field(
        None, description="the start of the translation (one per sentence, '' for none); the search continues from it"
    )
    split: bool = Field(
        False,
        description="cut each text into sentences (the rules of the model's source language), translate each and "
        "join them with the text's own spacing, for paragraphs; each translation then lists its sentences",
    )


class AttentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text = Field(description="a sentence")
    target: Text | None = Field(None, description="a translation to force-decode (default: the greedy translation)")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Service:
    """What the endpoints share: the translator, the batcher, the model to look inside."""

    translator: Translator
    inspect_model: Transformer  # the textbook model (mt.decode.inference.load(..., fast=False))
    tok: Tokenizer
    info: dict
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 64
    max_wait_ms: float = 10.0
    workers: int = 1
    timeout_s: float = 60.0  #: a request's deadline (504 past it)
    stall_s: float = 30.0  #: a decoding process with sentences and no report for this long is replaced
    allowed_hosts: tuple[str, ...] = LOOPBACK  #: names the Host header may give; "*" = any
    batcher: Batcher | None = None
    inspect_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "mt-attention"))
    attention_in_flight: int = 0


def model_info(run_dir: Path, model: Transformer, meta: dict, members: int) -> dict:
    """What ``GET /v1/model`` says: languages, sizes, parameters, vocabulary, recorded test scores."""
    cfg = model.cfg
    info = {
        "run": run_dir.name,
        "ensemble_members": members,
        "parameters": model.num_parameters(),
        "d_model": cfg.d_model, "n_heads": cfg.n_heads, "enc_layers": cfg.enc_layers, "dec_layers": cfg.dec_layers,
        "d_ff": cfg.d_ff, "src_vocab_size": cfg.src_vocab_size, "tgt_vocab_size": cfg.tgt_vocab_size,
        "max_positions": cfg.max_positions, "source": meta.get("source"),
    }  # fmt: skip
    try:
        data = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data", {})
        info["src_lang"], info["tgt_lang"] = data.get("src_lang"), data.get("tgt_lang")
    except (OSError, yaml.YAMLError, AttributeError):
        info["src_lang"] = info["tgt_lang"] = None
    scores = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            r = json.loads(path.read_text())
            scores.append({k: r.get(k) for k in ("test_set", "beam", "bleu", "paper_bleu", "chrf", "dtype")})
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
    info["test_scores"] = scores
    return info


def _error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _check_text(where: str, text: str) -> None:
    """JSON can carry a lone surrogate (``"\\ud800"``), which is no text: refuse it by field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = f"U+{ord(text[e.start]):04X}"
        raise BadRequest(f"{where} holds a lone surrogate ({code}) at character {e.start}") from None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    example = 'a JSON object such as {"text": "A man rides a bike."}'
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        if err.get("type") == "json_invalid":
            return "the body is not valid JSON"
        if where == "body":
            return f"the body is empty: send {example}" if err.get("type") == "missing" else f"send {example}"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def _host_name(header: bytes) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


class Guard:
    """ASGI middleware, before anything else reads a request: the ``Host`` header must
    name a host the service was started for (400 otherwise: a page that DNS rebinding
    pointed at 127.0.0.1 is refused). A POST body must be declared ``application/json``
    (415 otherwise: a cross-site page can send ``text/plain`` without a preflight, not
    JSON), must be UTF-8 (400, before any parsing), and is not read past ``max_bytes`` (413).

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's version of
    that runs each request in a task group and streams its response through a
    queue: a third of the server's CPU per request under load (docs/results/serving.md)."""

    def __init__(self, app, max_bytes: int, allowed_hosts: tuple[str, ...]):
        self.app, self.max_bytes = app, max_bytes
        self.hosts = None if "*" in allowed_hosts else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.hosts is not None:
            host = _host_name(headers.get(b"host", b""))
            if host not in self.hosts:
                message = f"Host {host or '(none)'!r} is not one this service answers to (mt serve --allowed-hosts)"
                return await _error(400, message)(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            shown = media_type.decode("latin-1") or "none"
            message = f"send the body as JSON, with Content-Type: application/json (got {shown})"
            return await _error(415, message)(scope, receive, send)
        too_large = (
            f"the body is larger than {self.max_bytes} bytes, more than the limits on sentences and characters "
            "per request allow"
        )
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await _error(413, too_large)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client has gone: nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _error(413, too_large)(scope, receive, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _error(400, f"the body is not valid UTF-8 (byte {e.start})")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _disconnected(receive) -> None:
    """Return once the client has closed the connection (the request's body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable):
    """``await work``, unless the client closes the connection first: then ``work`` is
    cancelled (the request's sentences leave the queue) and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request is cancelled itself
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():  # the client went first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


def create_app(service: Service) -> FastAPI:
    """The application: the API under /v1, /healthz, and the page at /."""

    async def lifespan(app: FastAPI):
        batcher = service.batcher = Batcher(
            service.translator, service.max_batch, service.max_wait_ms, service.workers, service.limits.max_queue,
            service.stall_s,
        )  # fmt: skip
        batcher.start()
        yield
        await batcher.stop(timeout=service.timeout_s)  # this app's own, whatever another app has set since
        service.inspect_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="mt",
        summary="Transformer translation: translate, look inside the attention",
        lifespan=lifespan,
    )

    app.add_middleware(Guard, max_bytes=service.limits.max_body_bytes, allowed_hosts=service.allowed_hosts)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message = _validation_message(exc)
        return _error(400 if message == "the body is not valid JSON" else 422, message)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):  # what Python's JSON parser refused
            return _error(400, "the body is not valid JSON (or holds a number of more than 4,300 digits)")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return _error(exc.status, str(exc))

    @app.exception_handler(Overloaded)
    async def overloaded(_, exc: Overloaded):  # refused at once: the queue is full
        return _error(503, f"busy: {exc}; try again", retry_after=1)

    @app.exception_handler(DecodingError)
    async def decoding_failed(_, exc: DecodingError):  # a worker failed or ended; it is replaced, try again
        return _error(503, f"decoding failed: {exc}", retry_after=5)

    @app.exception_handler(DecodingTimeout)
    async def timed_out(_, exc: DecodingTimeout):
        return _error(504, str(exc), retry_after=5)

    @app.exception_handler(ClientGone)
    async def client_gone(_, exc: ClientGone):  # nobody reads this: the connection is closed
        return _error(499, "the client closed the connection")

    @app.exception_handler(Exception)
    async def unexpected(_, exc: Exception):  # never a traceback to the client; the server keeps serving
        return _error(500, f"internal error: {type(exc).__name__}")

    @app.get("/healthz", summary="Health: ok, degraded (a decoding process starting, stalled or restarting), "
             "unavailable or stopping (503); answers while the server decodes")  # fmt: skip
    async def healthz():
        health = service.batcher.health()
        return JSONResponse(health, status_code=200 if health["status"] in ("ok", "degraded") else 503)

    @app.get("/v1/model", summary="The model: languages, sizes, parameters, vocabulary, recorded test scores")
    async def model() -> dict:
        return {**service.info, "beam": service.translator.beam, "limits": service.limits.__dict__}

    @app.post("/v1/translate", summary="Translate one sentence or a list, in order")
    async def translate(req: TranslateRequest, request: Request) -> dict:
        lines, prefixes, options = _check_translate(req, service)
        if options.n_best == 1 and not any(prefixes):
            return {"translations": await _translate_whole(service, request, lines, options, req.scores, req.split)}
        results = await _unless_gone(request, service.batcher.translate(lines, prefixes, options, service.timeout_s))
        out = []
        for nbest in results:
            item = {"text": nbest[0][0]}
            if req.scores:
                item["score"] = round(nbest[0][1], 6)
            if options.n_best > 1:
                item["n_best"] = [{"text": text, "score": round(score, 6)} for text, score in nbest]
            out.append(item)
        return {"translations": out}

    @app.post("/v1/attention", summary="Tokens and every kind, layer and head's attention weights for a sentence")
    async def attention(req: AttentionRequest) -> dict:
        text = req.text.strip()
        if not text:
            raise BadRequest("text is empty")
        most = service.limits.max_attention_chars
        for where, value in (("text", text), ("target", req.target or "")):
            _check_text(where, value)
            if len(value) > most:
                raise BadRequest(f"{where} has {len(value)} characters; the attention endpoint takes at most {most}")
        if service.attention_in_flight >= service.limits.max_attention_queue:
            return _error(503, f"busy: {service.attention_in_flight} attention requests in flight; try again",
                          retry_after=1)  # fmt: skip
        service.attention_in_flight += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(
                service.inspect_pool, _attention, service, text, req.target
            )
            return await asyncio.wait_for(asyncio.shield(work), service.timeout_s)
        except asyncio.TimeoutError:
            raise DecodingTimeout(f"not drawn within {service.timeout_s:g} s (--timeout)") from None
        finally:
            service.attention_in_flight -= 1

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> str:
        return _page_file("serve.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        types = {".js": "text/javascript", ".css": "text/css"}
        suffix = Path(name).suffix
        if name not in ("steps.js", "explorer.js", "attention.css", "serve.js", "serve.css") or suffix not in types:
            raise HTTPException(404, f"no such file: {name}")
        text = _page_file(name) if name.startswith("serve.") else web_asset(name)
        return Response(text, media_type=types[suffix] + "; charset=utf-8")

    return app


async def _translate_whole(
    service: Service, request: Request, lines: list[str], options: Options, scores: bool, split: bool
) -> list[dict]:
    """One translation per line, of all of it: with ``split``, each line cut into sentences,
    and its items list them with their translations. A line (or sentence) longer than the
    model's positions is translated in parts, as ``mt translate`` does (a warning in the
    log); all are decoded together and joined back per line with the line's own spacing."""
    lang = (service.info.get("src_lang") or "en") if split else None
    splits = service.translator.cut_long(split_lines(lines, lang), 1, split)[0]
    sentences = [s for sp in splits for s in sp.sentences]
    work = service.batcher.translate(sentences, [""] * len(sentences), options, service.timeout_s)
    best = [(source, *nbest[0]) for source, nbest in zip(sentences, await _unless_gone(request, work))]
    out = []
    for sp, line in zip(splits, per_line(best, splits)):
        item = {"text": sp.join([text for _, text, _ in line])}
        if split:
            item["sentences"] = [{"source": source, "text": text} for source, text, _ in line]
        if scores:
            item["score"] = round(sum(score for _, _, score in line), 6)
        out.append(item)
    return out


def _check_translate(req: TranslateRequest, service: Service) -> tuple[list[str], list[str], Options]:
    limits = service.limits
    single = isinstance(req.text, str)
    lines = [req.text] if single else list(req.text)
    if not lines:
        raise BadRequest("text is an empty list")
    if len(lines) > limits.max_lines:
        raise BadRequest(f"text has {len(lines)} sentences; at most {limits.max_lines} per request", 413)
    for n, line in enumerate(lines):
        where = "text" if single else f"text[{n}]"
        if not line.strip():
            raise BadRequest(f"{where} is empty")
        if len(line) > limits.max_chars:
            raise BadRequest(f"{where} has {len(line)} characters; at most {limits.max_chars}", 413)
        if "\n" in line or "\r" in line:
            raise BadRequest(f"{where} spans several lines; send them as a list")
        _check_text(where, line)
    if req.prefix is None:
        prefixes = [""] * len(lines)
    elif isinstance(req.prefix, str) != single or (not single and len(req.prefix) != len(lines)):
        raise BadRequest(f"prefix must be {'a string' if single else f'a list of {len(lines)} strings'}, as text is")
    else:
        prefixes = [req.prefix] if single else list(req.prefix)
        for n, p in enumerate(prefixes):
            where = "prefix" if single else f"prefix[{n}]"
            if len(p) > limits.max_chars:
                raise BadRequest(f"{where} has {len(p)} characters; at most {limits.max_chars}", 413)
            _check_text(where, p)
    beam = service.translator.beam if req.beam is None else req.beam
    if not 1 <= beam <= limits.max_beam:
        raise BadRequest(f"beam must be between 1 and {limits.max_beam}, got {beam}")
    if not 1 <= req.n_best <= beam:
        raise BadRequest(f"n_best must be between 1 and the beam ({beam}), got {req.n_best}")
    if req.split and (req.n_best > 1 or req.prefix is not None):
        given = "n_best" if req.n_best > 1 else "prefix"
        raise BadRequest(f"split gives one translation per text, with no prefix: {given} cannot go with it")
    alpha = service.translator.alpha if req.alpha is None else req.alpha
    if not 0 <= alpha <= DECODING.max_alpha:  # compared before float(): an int of 400 digits overflows it
        shown = alpha if len(str(alpha)) <= 20 else f"{str(alpha)[:12]}... ({len(str(alpha))} digits)"
        raise BadRequest(f"alpha must be between 0 and {DECODING.max_alpha:g}, got {shown}")
    try:
        service.translator.encode_prefixes(prefixes)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return lines, prefixes, Options(beam, float(alpha), req.n_best)


def _attention(service: Service, text: str, target: str | None) -> dict:
    """``mt attention``'s capture for one sentence, as the page's explorer draws it."""
    from mt.inspect.command import explorer_steps

    model, tok = service.inspect_model, service.tok
    limit = model.cfg.max_positions
    src_ids = tok.encode_src([text])[0][: limit - 1]
    if not src_ids:
        raise BadRequest("text has no pieces to look at (only characters the tokenizer drops)")
    if src_ids[-1] != tok.eos_id:
        src_ids.append(tok.eos_id)
    if target is not None and target.strip():
        tgt_ids = tok.encode_tgt([target])[0][: limit - 2]
        if not tgt_ids:
            raise BadRequest("target has no pieces to force-decode (only characters the tokenizer drops)")
    else:
        tgt_ids, _ = translate_with_attention(model, tok, src_ids, min(2 * len(src_ids) + 10, limit - 1))
    maps = force_decode(model, tok, src_ids, tgt_ids)
    kinds = {k: (*maps.axes(k), maps.layers(k)) for k in KINDS}
    steps = explorer_steps(model, tok, src_ids, tgt_ids, 1.0)
    stats = {k: head_table(maps, k) for k in KINDS}
    return {
        "source_tokens": maps.src_tokens,
        "target_tokens": maps.tgt_outputs,
        "target": tok.decode_tgt([tgt_ids])[0],
        "kinds": explorer_data(kinds, steps, stats),
    }


def check_options(args) -> tuple[str, ...]:
    """Refuse, by name, ``mt serve`` options that would fail requests later rather than now;
    the hosts the service answers to."""
    from mt.errors import MTError

    if args.max_batch < 1:
        raise MTError(f"--max-batch must be at least 1, got {args.max_batch}")
    if not 0 <= args.max_wait_ms <= 1000:  # NaN fails this too
        raise MTError(f"--max-wait-ms must be between 0 and 1000, got {args.max_wait_ms}")
    if not 0 < args.port < 65536:
        raise MTError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_lines < 1 or args.max_chars < 1:
        raise MTError(f"--max-lines and --max-chars must be at least 1, got {args.max_lines} and {args.max_chars}")
    if not 1 <= args.max_beam <= DECODING.max_beam:
        raise MTError(f"--max-beam must be between 1 and {DECODING.max_beam}, got {args.max_beam}")
    if args.beam > args.max_beam:
        raise MTError(f"--beam {args.beam} is more than --max-beam {args.max_beam}, the widest a request may ask for")
    if not 1 <= args.timeout <= 3600:
        raise MTError(f"--timeout must be between 1 and 3600 seconds, got {args.timeout}")
    if not 1 <= args.stall_timeout <= 3600:
        raise MTError(f"--stall-timeout must be between 1 and 3600 seconds, got {args.stall_timeout}")
    if args.max_queue < args.max_lines:
        raise MTError(f"--max-queue {args.max_queue} is less than --max-lines {args.max_lines}: a full request "
                      "could never be queued")  # fmt: skip
    if args.allowed_hosts is not None:
        hosts = tuple(h.strip().lower().strip("[]") for h in args.allowed_hosts.split(",") if h.strip())
        if not hosts:
            raise MTError("--allowed-hosts names no host (a comma-separated list, or * for any)")
        return hosts
    if args.host in ("0.0.0.0", "::", ""):  # every interface: the names it is reached by are not known here
        return ("*",)
    return (*LOOPBACK, args.host.lower().strip("[]"))


def run(args) -> None:
    """``mt serve``: load the model(s) and serve until SIGINT or SIGTERM."""
    import uvicorn

    from mt.decode.inference import DecodingOptions, load, open_translator
    from mt.errors import MTError

    hosts = check_options(args)
    translator, meta = open_translator(args.model, DecodingOptions.from_args(args))  # as mt translate's
    workers = translator.workers
    translator.workers = (
        1  # mt serve's --workers are decoding processes (mt.serve.batcher), each with its share of threads
    )
    inspect_model, tok, _ = load(args.model[0], fast=False)
    limits = Limits(max_lines=args.max_lines, max_chars=args.max_chars, max_beam=args.max_beam,
                    max_queue=args.max_queue)  # fmt: skip
    service = Service(
        translator, inspect_model, tok, model_info(Path(args.model[0]), inspect_model, meta, len(args.model)),
        limits, args.max_batch, args.max_wait_ms, workers, args.timeout, args.stall_timeout, hosts,
    )  # fmt: skip
    # the requests in flight at a stop end within --timeout (answered, or 504): uvicorn waits for them
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.timeout) + 5)  # fmt: skip
    server = _Server(config, service)
    print(f"mt serve: {args.model[0]} on http://{args.host}:{args.port}/ (API docs at /docs)", flush=True)
    if hosts == ("*",):
        print("mt serve: answering to any Host name; --allowed-hosts limits them", flush=True)
    started = time.monotonic()
    server.run()
    if not server.started:
        raise MTError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    print(f"mt serve: stopped after {time.monotonic() - started:.0f} s", flush=True)


class _Server:
    """uvicorn's server, where SIGINT or SIGTERM is the normal end: it stops accepting,
    answers the requests in flight, and the command exits 0 (uvicorn alone re-raises
    the signal once it has stopped, which would end the process by that signal). From
    the signal on, the batcher starts no process (``Batcher.drain``); the requests in
    flight are decoded. The workers ignore the signal, which reaches them too when it
    is sent to the process group."""

    def __new__(cls, config, service: Service):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                handled = (signal.SIGINT, signal.SIGTERM)
                original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

            def handle_exit(self, sig, frame):
                if service.batcher is not None:
                    service.batcher.drain()
                super().handle_exit(sig, frame)

        return Server(config)


def _page_file(name: str) -> str:
    """A file of the service's page, shipped in the package (mt/serve/web); the attention
    explorer's parts come from ``mt.inspect`` (``web_asset``)."""
    return resources.files("mt.serve").joinpath("web", name).read_text(encoding="utf-8")
