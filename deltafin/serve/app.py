"""The HTTP side of ``deltafin serve``: an OpenAI-compatible ASGI app over one ``Service``.

Routes: POST /v1/chat/completions, POST /v1/completions (both with or without ``stream``),
GET /v1/models, GET /v1/models/{id}, GET|HEAD /health, GET /metrics. This module owns reading
request bodies (a size limit, and a time limit on the whole body), the API key check, counting
answered requests, OpenAI-style error bodies for every failure, and one request's generations' life
as an HTTP response: the wait for the engine (429 beyond ``queue_size`` waiting or ``queue_timeout``
seconds), the answer (each of its ``n`` choices) as one JSON body or as server-sent events, the
generations stopped when the client goes away, and answers from the memo shaped like fresh ones.
Tool-call text a model wrote that did not parse is logged here (it went out as content). The wire format lives in
``protocol``, the engine's use in ``service``, listening and the header time limit in ``http``,
the ``deltafin serve`` command in ``cli``.

What it trusts: nothing a client sends. Bodies are decoded and validated (``protocol``) before
the service sees them; a fault reading the weights is answered 503 without local paths and turns
/health to "degraded", and so does a lost rank of a model split across processes (naming the rank).
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

from ..dist.transport import RankFault
from ..errors import DeltafinError, DeviceOutOfMemory
from ..settings import Settings
from . import metrics as metrics_mod
from .admission import EngineBusy
from .handoff import HANDOFF
from .memo import MemoChoice, MemoEntry
from .protocol import (MAX_BODY_BYTES, SSE_DONE, APIError, ParsedRequest, Shaper, bad, decode_body, parse_chat,
                       parse_completion, sse)
from .server_metrics import FirstToken
from .service import Job, Service

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


async def _respond(service: Service, req: ParsedRequest, arrived: float) -> Response:
    received = time.perf_counter()
    service.check_model(req.model)
    job = await service.prepare(req)
    prompt_n = len(job.prompt_ids)
    shaper = Shaper(req.kind, service.name, req.include_usage, choices=job.choices, calls=req.reads_calls,
                    first_index=req.calls_before, describe=service.describe)
    key = service.memo_key(job)
    entry = service.memo.get(key) if key is not None else None
    if key is not None:
        service.metrics.memo_lookups.inc(result="hit" if entry is not None else "miss")
    if entry is not None:
        log.info("memo hit: %s %d prompt tokens -> %d completion tokens", shaper.id, prompt_n, entry.completion_tokens)
        return memo_response(shaper, req.stream, entry, prompt_n)
    return _GenerationResponse(service, req, job, key, shaper, FirstToken(arrived, received, time.perf_counter()))


def memo_response(shaper: Shaper, stream: bool, entry: MemoEntry, prompt_tokens: int) -> Response:
    """A remembered answer, shaped like a fresh one (streamed the same way when asked to stream),
    usage included."""
    if not stream:
        answers = [(list(c.pieces), c.finish_reason) for c in entry.choices]
        return JSONResponse(shaper.response(answers, prompt_tokens, entry.completion_tokens, entry.cached_tokens))
    chunks = shaper.opening_chunks()
    for i, c in enumerate(entry.choices):
        for piece in c.pieces:
            chunks += shaper.piece_chunks(i, [piece])
        chunks += shaper.final_chunks(i, c.finish_reason)
    if shaper.include_usage:
        chunks.append(shaper.usage_chunk(prompt_tokens, entry.completion_tokens, entry.cached_tokens))
    return Response(b"".join(sse(c) for c in chunks) + SSE_DONE,
                    headers={k.decode(): v.decode() for k, v in _SSE_HEADERS})


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
    """Waits for the engine, runs the request's generations (one per choice) and sends the answer, as
    one JSON body or as server-sent events. The whole life of the request is in ``__call__``, so
    whatever happens (a 429, a client leaving while queued or mid-stream, an engine error) the
    generations are stopped and the engine handed on."""

    def __init__(self, service: Service, req: ParsedRequest, job: Job, memo_key: tuple | None, shaper: Shaper,
                 first: FirstToken):
        super().__init__()
        self.service, self.req, self.job, self.memo_key, self.shaper = service, req, job, memo_key, shaper
        self.first = first

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
        pieces_in: asyncio.Queue = asyncio.Queue()  # (choice, piece or None at its end)
        first = self.first

        def emit(i: int, piece) -> None:
            if piece is not None and not first.made:
                first.made = time.perf_counter()
            HANDOFF.put(loop, pieces_in, (i, piece))

        t0 = first.started = time.perf_counter()
        futures = service.start(job, emit, cancel)
        if req.stream:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if opening := shaper.opening_chunks():
                await _send_body(send, b"".join(sse(c) for c in opening))
        pieces: list[list] = [[] for _ in futures]
        gens: list = [None] * len(futures)
        error: Exception | None = None
        running = len(futures)
        while running:
            # Everything the engine produced since the last send goes out in one write.
            batch = [await pieces_in.get()]
            while not pieces_in.empty():
                batch.append(pieces_in.get_nowait())
            chunks = []
            for i, piece in batch:
                if piece is not None:
                    pieces[i].append(piece)
                    if req.stream:
                        chunks += shaper.piece_chunks(i, [piece])
                    continue
                running -= 1
                try:
                    gens[i] = futures[i].result()  # resolved before its end was announced
                except Exception as e:
                    error = error or e
                    cancel.set()  # one choice failed: the request has failed, the others stop
                    continue
                if req.stream and gens[i].finish_reason != "cancelled":
                    chunks += shaper.final_chunks(i, gens[i].finish_reason)
            if req.stream and chunks and error is None and not left.is_set():
                await _send_body(send, b"".join(sse(c) for c in chunks))
                if first.made and not first.sent:
                    first.sent = time.perf_counter()
                    service.metrics.first_token(first)
        if error is not None:
            if isinstance(error, DeviceOutOfMemory):  # this request's pass did not fit: the server goes on
                log.warning("%s: %s", shaper.id, error)
                failure = APIError(503, str(error), code="device_out_of_memory")
            elif isinstance(error, RankFault):  # a rank of a split model is lost: so is every pass after it
                log.error("%s: %s", shaper.id, error)
                failure = APIError(503, f"{service.rank_lost(error)}; the server is degraded (see /health)",
                                   code="rank_lost")
            elif isinstance(error, (DeltafinError, OSError)):  # the weights could not be read: not the client's doing
                log.error("%s: reading the weights failed: %s", shaper.id, error)
                fault = service.weights_failed(error)
                failure = APIError(503, f"{fault}; the server is degraded (see /health)", code="engine_fault")
            else:  # requests are validated before they reach the engine: this is a bug
                log.error("%s: generation failed", shaper.id, exc_info=error)
                failure = APIError(500, f"generation failed: {type(error).__name__}", code="engine_error")
            if req.stream:  # headers are out: the error travels as an event
                await _send_body(send, sse(failure.body()) + SSE_DONE, more=False)
            else:
                await _send_json(send, failure.status, failure.body())
            return

        prompt_n, completion_n = len(job.prompt_ids), sum(len(g.tokens) for g in gens)
        cached_n = gens[0].stats.get("cached_tokens", 0)
        service.metrics.prompt_tokens.inc(prompt_n)
        service.metrics.completion_tokens.inc(completion_n)
        elapsed = time.perf_counter() - t0
        if any(g.finish_reason == "cancelled" for g in gens):
            log.info("%s: generation cancelled (client disconnected) after %d tokens", shaper.id, completion_n)
            return
        finishes = ",".join(g.finish_reason for g in gens)
        log.info("%s: %d prompt (%d cached) + %d completion tokens, finish_reason=%s, %.2f s (%.1f tok/s)",
                 shaper.id, prompt_n, cached_n, completion_n, finishes, elapsed,
                 completion_n / elapsed if elapsed > 0 else 0.0)
        if self.memo_key is not None:
            service.memo.put(self.memo_key, MemoEntry(tuple(MemoChoice(tuple(p), len(g.tokens), g.finish_reason)
                                                            for p, g in zip(pieces, gens)), cached_n))
        if not req.stream:
            answers = [(p, g.finish_reason) for p, g in zip(pieces, gens)]
            body = shaper.response(answers, prompt_n, completion_n, cached_n)
            _log_malformed(shaper)
            await _send_json(send, 200, body)
            return
        _log_malformed(shaper)
        tail = sse(shaper.usage_chunk(prompt_n, completion_n, cached_n)) if shaper.include_usage else b""
        await _send_body(send, tail + SSE_DONE, more=False)


def _log_malformed(shaper: Shaper) -> None:
    """Tool-call text the model wrote that did not parse went out as content; the log keeps it raw."""
    for raw in shaper.malformed:
        log.warning("%s: a malformed tool call was answered as content: %r", shaper.id, raw[:500])


async def _send_body(send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _read_json(request: Request, timeout: float) -> dict:
    """The body as a JSON object; all of it must arrive within `timeout` seconds (a client that
    sends a byte now and then cannot hold the connection for ever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    raw = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > MAX_BODY_BYTES:
                raise _too_large(None)
    try:
        # One deadline for the whole body, not one task a chunk: each task is a turn of the event loop,
        # which eight streams keep busy (a small body's read took 3.4-4.3 ms under eight clients).
        await asyncio.wait_for(read(), timeout)
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
        return await _respond(service, parse_chat(await _read_json(request, body_timeout)), _arrived(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _respond(service, parse_completion(await _read_json(request, body_timeout)), _arrived(request))

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


_ARRIVED = "deltafin.arrived"  # the scope key _CountRequests sets


def _arrived(request: Request) -> float:
    """When the request reached the app (now, where no _CountRequests stands in front)."""
    return request.scope.get(_ARRIVED) or time.perf_counter()


class _CountRequests:
    """Counts answered requests by route (the matched path template) and status, and notes when each
    reached the app (``_arrived``: the first token's "read" phase starts there)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[_ARRIVED] = time.perf_counter()

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.inc(route=getattr(route, "path", "other"), status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
