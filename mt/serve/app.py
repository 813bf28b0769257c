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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated

import yaml
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from mt.data.tokenizer import Tokenizer
from mt.decode.translator import Translator
from mt.inspect.capture import KINDS, force_decode, head_table, translate_with_attention
from mt.inspect.plotting import explorer_data, web_asset
from mt.model.transformer import Transformer
from mt.serve.batcher import Batcher, DecodingError, Options


@dataclass
class Limits:
    """What one request may ask for."""

    max_lines: int = 64  #: sentences per request
    max_chars: int = 1000  #: characters per sentence (and per prefix)
    max_beam: int = 16
    max_attention_chars: int = 300  #: the attention endpoint draws one sentence

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
    alpha: StrictFloat | StrictInt | None = Field(None, description="length penalty: score / length**alpha")
    n_best: StrictInt = Field(1, description="hypotheses per sentence, at most the beam")
    scores: bool = Field(False, description="include each translation's score")
    prefix: Text | list[Text] | None = Field(
        None, description="the start of the translation (one per sentence, '' for none); the search continues from it"
    )


class AttentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text = Field(description="a sentence")
    target: Text | None = Field(None, description="a translation to force-decode (default: the greedy translation)")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


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
    batcher: Batcher | None = None
    inspect_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "mt-attention"))


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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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


class JsonBodies:
    """ASGI middleware: a POST body is JSON whatever its Content-Type says (curl -d
    sends a form type); invalid UTF-8 in it is a 400 that says so, before any
    parsing; a body of more than ``max_bytes`` is a 413, and is not read further.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's version of
    that runs each request in a task group and streams its response through a
    queue: a third of the server's CPU per request under load (docs/results/README.md)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        too_large = (
            f"the body is larger than {self.max_bytes} bytes, more than the limits on sentences and characters "
            "per request allow"
        )
        declared = dict(scope["headers"]).get(b"content-length", b"")
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
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def create_app(service: Service) -> FastAPI:
    """The application: the API under /v1, /healthz, and the page at /."""

    async def lifespan(app: FastAPI):
        batcher = service.batcher = Batcher(service.translator, service.max_batch, service.max_wait_ms, service.workers)
        batcher.start()
        yield
        await batcher.stop()  # this app's own, whatever another app on the same service has set since
        service.inspect_pool.shutdown(wait=True)

    app = FastAPI(
        title="mt",
        summary="Transformer translation: translate, look inside the attention",
        lifespan=lifespan,
    )

    app.add_middleware(JsonBodies, max_bytes=service.limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message = _validation_message(exc)
        return _error(400 if message == "the body is not valid JSON" else 422, message)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return _error(exc.status, str(exc))

    @app.exception_handler(DecodingError)
    async def decoding_failed(_, exc: DecodingError):  # a worker failed or ended; it is replaced, try again
        return _error(503, f"decoding failed: {exc}")

    @app.exception_handler(Exception)
    async def unexpected(_, exc: Exception):  # never a traceback to the client; the server keeps serving
        return _error(500, f"internal error: {type(exc).__name__}")

    @app.get("/healthz", summary="Liveness: answers while the server decodes")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/model", summary="The model: languages, sizes, parameters, vocabulary, recorded test scores")
    async def model() -> dict:
        return {**service.info, "beam": service.translator.beam, "limits": service.limits.__dict__}

    @app.post("/v1/translate", summary="Translate one sentence or a list, in order")
    async def translate(req: TranslateRequest) -> dict:
        lines, prefixes, options = _check_translate(req, service)
        results = await service.batcher.translate(lines, prefixes, options)
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
        if len(text) > service.limits.max_attention_chars:
            raise BadRequest(f"text has {len(text)} characters; the attention endpoint takes at most "
                             f"{service.limits.max_attention_chars}")  # fmt: skip
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(service.inspect_pool, _attention, service, text, req.target)

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
    if req.prefix is None:
        prefixes = [""] * len(lines)
    elif isinstance(req.prefix, str) != single or (not single and len(req.prefix) != len(lines)):
        raise BadRequest(f"prefix must be {'a string' if single else f'a list of {len(lines)} strings'}, as text is")
    else:
        prefixes = [req.prefix] if single else list(req.prefix)
        for n, p in enumerate(prefixes):
            if len(p) > limits.max_chars:
                raise BadRequest(
                    f"prefix{'' if single else f'[{n}]'} has {len(p)} characters; at most {limits.max_chars}", 413
                )
    beam = service.translator.beam if req.beam is None else req.beam
    if not 1 <= beam <= limits.max_beam:
        raise BadRequest(f"beam must be between 1 and {limits.max_beam}, got {beam}")
    if not 1 <= req.n_best <= beam:
        raise BadRequest(f"n_best must be between 1 and the beam ({beam}), got {req.n_best}")
    alpha = service.translator.alpha if req.alpha is None else float(req.alpha)
    if not 0 <= alpha < math.inf:
        raise BadRequest(f"alpha must be a number >= 0, got {alpha}")
    try:
        service.translator.encode_prefixes(prefixes)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return lines, prefixes, Options(beam, alpha, req.n_best)


def _attention(service: Service, text: str, target: str | None) -> dict:
    """``mt attention``'s capture for one sentence, as the page's explorer draws it."""
    from mt.inspect.command import explorer_steps

    model, tok = service.inspect_model, service.tok
    limit = model.cfg.max_positions
    src_ids = tok.encode_src([text])[0][: limit - 1]
    if src_ids[-1] != tok.eos_id:
        src_ids.append(tok.eos_id)
    if target is not None and target.strip():
        tgt_ids = tok.encode_tgt([target])[0][: limit - 2]
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


def run(args) -> None:
    """``mt serve``: load the model(s) and serve until SIGINT or SIGTERM."""
    import uvicorn

    from mt.decode.inference import DecodingOptions, load, open_translator
    from mt.errors import MTError

    if args.max_batch < 1 or args.max_wait_ms < 0:
        raise MTError("--max-batch must be at least 1 and --max-wait-ms at least 0")
    if not 0 < args.port < 65536:
        raise MTError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_lines < 1 or args.max_chars < 1:
        raise MTError(f"--max-lines and --max-chars must be at least 1, got {args.max_lines} and {args.max_chars}")
    translator, meta = open_translator(args.model, DecodingOptions.from_args(args))  # as mt translate's
    workers = translator.workers
    translator.workers = (
        1  # mt serve's --workers are decoding processes (mt.serve.batcher), each with its share of threads
    )
    inspect_model, tok, _ = load(args.model[0], fast=False)
    service = Service(
        translator, inspect_model, tok, model_info(Path(args.model[0]), inspect_model, meta, len(args.model)),
        Limits(max_lines=args.max_lines, max_chars=args.max_chars), args.max_batch, args.max_wait_ms, workers,
    )  # fmt: skip
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=30)  # fmt: skip
    server = _Server(config)
    print(f"mt serve: {args.model[0]} on http://{args.host}:{args.port}/ (API docs at /docs)", flush=True)
    started = time.monotonic()
    server.run()
    if not server.started:
        raise MTError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    print(f"mt serve: stopped after {time.monotonic() - started:.0f} s", flush=True)


class _Server:
    """uvicorn's server, where SIGINT or SIGTERM is the normal end: it stops accepting,
    answers the requests in flight, and the command exits 0 (uvicorn alone re-raises
    the signal once it has stopped, which would end the process by that signal)."""

    def __new__(cls, config):
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

        return Server(config)


def _page_file(name: str) -> str:
    """A file of the service's page, shipped in the package (mt/serve/web); the attention
    explorer's parts come from ``mt.inspect`` (``web_asset``)."""
    return resources.files("mt.serve").joinpath("web", name).read_text(encoding="utf-8")
