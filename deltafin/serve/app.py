"""The HTTP side of ``deltafin serve``: an OpenAI-compatible ASGI app over one ``Service``.

Routes: POST /v1/chat/completions, POST /v1/completions (both with or without ``stream``),
GET /v1/models, GET /v1/models/{id}, GET|HEAD /health, GET /metrics. This module owns reading
request bodies (a size limit, and a time limit on the whole body), the API key check, counting
answered requests, OpenAI-style error bodies for every failure, and one generation's life as an
HTTP response: the wait for the engine (429 beyond ``queue_size`` waiting or ``queue_timeout``
seconds), the answer as one JSON body or as server-sent events, the generation stopped when the
client goes away, and answers from the memo shaped like fresh ones. The wire format lives in
``protocol``, the engine's use in ``service``, listening and the header time limit in ``http``,
the ``deltafin serve`` command in ``cli``.

What it trusts: nothing a client sends. Bodies are decoded and validated (``protocol``) before
the service sees them; a fault reading the weights is answered 503 without local paths and turns
/health to "degraded".
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import DeltafinError
from ..settings import Settings
from . import metrics as metrics_mod
from .admission import EngineBusy
from .memo import MemoEntry
from .protocol import (MAX_BODY_BYTES, SSE_DONE, APIError, ParsedRequest, Shaper, bad, decode_body, parse_chat,
                       parse_completion, sse)
from .service import Job, Service

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


async def _respond(service: Service, req: ParsedRequest) -> Response:
    service.check_model(req.model)
    prompt_ids = await service.encode(req)
    job = service.job(req, prompt_ids)
    shaper = Shaper(req.kind, service.name, req.include_usage)
    key = service.memo_key(job)
    entry = service.memo.get(key) if key is not None else None
    if key is not None:
        service.metrics.memo_lookups.inc(result="hit" if entry is not None else "miss")
    if entry is not None:
        log.info("memo hit: %s %d prompt tokens -> %d completion tokens", shaper.id, len(prompt_ids),
                 entry.completion_tokens)
        return memo_response(shaper, req.stream, entry, len(prompt_ids))
    return _GenerationResponse(service, req, job, key, shaper)


def memo_response(shaper: Shaper, stream: bool, entry: MemoEntry, prompt_tokens: int) -> Response:
    """A remembered answer, shaped like a fresh one (streamed the same way when asked to stream),
    usage included."""
    if not stream:
        return JSONResponse(shaper.response(entry.text, entry.finish_reason, prompt_tokens, entry.completion_tokens,
                                            entry.cached_tokens))
    events = [] if (opening := shaper.opening_chunk()) is None else [sse(opening)]
    events += [sse(shaper.text_chunk(p)) for p in entry.pieces]
    events.append(sse(shaper.final_chunk(entry.finish_reason)))
    if shaper.include_usage:
        events.append(sse(shaper.usage_chunk(prompt_tokens, entry.completion_tokens, entry.cached_tokens)))
    events.append(SSE_DONE)
    return Response(b"".join(events), headers={k.decode(): v.decode() for k, v in _SSE_HEADERS})


async def _watch_disconnect(receive, left: asyncio.Event, cancel: threading.Event) -> None:
    # The body has been read already, so the next message is the client going away (or the
    # server reporting the response complete, after which cancelling is harmless).
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            left.set()
            cancel.set()
            return


async def _send_json(send, status: int, obj: dict) -> None:
    body = json.dumps(obj, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _GenerationResponse(Response):
    """Waits for the engine, runs one generation and sends the answer, as one JSON body or as
    server-sent events. The whole life of the request is in ``__call__``, so whatever happens
    (a 429, a client leaving while queued or mid-stream, an engine error) the generation is
    stopped and the engine handed on."""

    def __init__(self, service: Service, req: ParsedRequest, job: Job, memo_key: tuple | None, shaper: Shaper):
        super().__init__()
        self.service, self.req, self.job, self.memo_key, self.shaper = service, req, job, memo_key, shaper

    async def __call__(self, scope, receive, send) -> None:
        left = asyncio.Event()  # the client went away
        cancel = threading.Event()  # read by the engine thread
        watcher = asyncio.ensure_future(_watch_disconnect(receive, left, cancel))
        try:
            await self._run(scope, receive, send, left, cancel)
        except OSError:  # the client is gone; nothing left to tell it
            pass
        finally:
            cancel.set()
            watcher.cancel()

    async def _run(self, scope, receive, send, left: asyncio.Event, cancel: threading.Event) -> None:
        service, req, job, shaper = self.service, self.req, self.job, self.shaper
        try:
            admitted = await service.gate.acquire(left)
        except EngineBusy as e:
            log.info("%s refused: %s", shaper.id, e.message)
            await _send_json(send, e.status, e.body())
            return
        if not admitted:
            log.info("%s: client left while waiting for the engine", shaper.id)
            return

        # An identical request may have finished while this one waited.
        entry = service.memo.get(self.memo_key) if self.memo_key is not None else None
        if entry is not None:
            service.gate.release()
            log.info("memo hit: %s (after waiting) -> %d completion tokens", shaper.id, entry.completion_tokens)
            await memo_response(shaper, req.stream, entry, len(job.prompt_ids))(scope, receive, send)
            return

        loop = asyncio.get_running_loop()
        texts: asyncio.Queue[str | None] = asyncio.Queue()

        def emit(text: str | None) -> None:
            loop.call_soon_threadsafe(texts.put_nowait, text)

        t0 = time.perf_counter()
        future = service.start(job, emit, cancel)
        if req.stream:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if (opening := shaper.opening_chunk()) is not None:
                await _send_body(send, sse(opening))
        pieces: list[str] = []
        ended = False
        while not ended:
            # Everything the engine produced since the last send goes out in one write.
            batch = [await texts.get()]
            while not texts.empty():
                batch.append(texts.get_nowait())
            if batch[-1] is None:
                ended = True
                batch.pop()
            pieces += batch
            if req.stream and batch and not left.is_set():
                await _send_body(send, b"".join(sse(shaper.text_chunk(t)) for t in batch))
        try:
            gen = await asyncio.wrap_future(future)
        except Exception as e:
            if isinstance(e, (DeltafinError, OSError)):  # the weights could not be read: not the client's doing
                log.error("%s: reading the weights failed: %s", shaper.id, e)
                fault = service.weights_failed(e)
                error = APIError(503, f"{fault}; the server is degraded (see /health)", code="engine_fault")
            else:  # requests are validated before they reach the engine: this is a bug
                log.exception("%s: generation failed", shaper.id)
                error = APIError(500, f"generation failed: {type(e).__name__}", code="engine_error")
            if req.stream:  # headers are out: the error travels as an event
                await _send_body(send, sse(error.body()) + SSE_DONE, more=False)
            else:
                await _send_json(send, error.status, error.body())
            return

        prompt_n, completion_n = len(job.prompt_ids), len(gen.tokens)
        cached_n = gen.stats.get("cached_tokens", 0)
        service.metrics.prompt_tokens.inc(prompt_n)
        service.metrics.completion_tokens.inc(completion_n)
        elapsed = time.perf_counter() - t0
        if gen.finish_reason == "cancelled":
            log.info("%s: generation cancelled (client disconnected) after %d tokens", shaper.id, completion_n)
            return
        log.info("%s: %d prompt (%d cached) + %d completion tokens, finish_reason=%s, %.2f s (%.1f tok/s)",
                 shaper.id, prompt_n, cached_n, completion_n, gen.finish_reason, elapsed, completion_n / elapsed if elapsed > 0 else 0.0)
        text = "".join(pieces)  # equals gen.text: on_token is handed every piece of it
        if self.memo_key is not None:
            service.memo.put(self.memo_key, MemoEntry(tuple(pieces), completion_n, gen.finish_reason, cached_n))
        if not req.stream:
            await _send_json(send, 200, shaper.response(text, gen.finish_reason, prompt_n, completion_n, cached_n))
            return
        tail = sse(shaper.final_chunk(gen.finish_reason))
        if shaper.include_usage:
            tail += sse(shaper.usage_chunk(prompt_n, completion_n, cached_n))
        await _send_body(send, tail + SSE_DONE, more=False)


async def _send_body(send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _read_json(request: Request, timeout: float) -> dict:
    """The body as a JSON object; all of it must arrive within `timeout` seconds (a client that
    sends a byte now and then cannot hold the connection for ever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    raw = bytearray()
    parts = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(parts.__anext__(), max(deadline - loop.time(), 0.0))
            except StopAsyncIteration:
                break
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise _too_large(None)
    except ClientDisconnect:
        raise bad("the client went away while sending the request body", code="incomplete_body") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
    return decode_body(bytes(raw))


def _too_large(size: int | None) -> APIError:
    got = f" (got {size} bytes)" if size is not None else ""
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes{got}",
                    code="request_too_large")


def create_app(model, settings: Settings | None = None) -> FastAPI:
    """The server as an ASGI app. ``settings`` defaults to the model's own."""
    service = Service(model, settings if settings is not None else model.settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.close()

    app = FastAPI(title="deltafin", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.service = service
    app.add_middleware(_RequireKey, key=service.settings.api_key)
    app.add_middleware(_CountRequests, counter=service.metrics.requests)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        # A timed-out body leaves the connection mid-request: it cannot carry another one.
        headers = {"connection": "close"} if e.status == 408 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            error = APIError(404, f"unknown route: {request.method} {request.url.path}", code="unknown_url")
        elif e.status_code == 405:
            error = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                             code="method_not_allowed")
        else:
            error = APIError(e.status_code, str(e.detail), code=None)
        return JSONResponse(error.body(), status_code=error.status, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        error = bad(f"invalid request: {first.get('msg', 'malformed input')}", param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.render(), media_type=metrics_mod.CONTENT_TYPE)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": service.started, "owned_by": "deltafin",
                "max_model_len": service.context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in service.names]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        service.check_model(model_id)
        return model_card(model_id)

    body_timeout = service.settings.body_timeout

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _respond(service, parse_chat(await _read_json(request, body_timeout)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _respond(service, parse_completion(await _read_json(request, body_timeout)))

    return app


class _RequireKey:
    """With an API key set, every /v1 route needs ``Authorization: Bearer KEY`` (401 otherwise);
    /health and /metrics stay open to monitors."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if self.key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401,
                                   headers={"www-authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountRequests:
    """Counts answered requests by route (the matched path template) and status."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.inc(route=getattr(route, "path", "other"), status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
