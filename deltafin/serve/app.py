"""``deltafin serve``: an OpenAI-compatible HTTP server over one loaded model.

Routes: POST /v1/chat/completions, POST /v1/completions (both with or without ``stream``),
GET /v1/models, GET /v1/models/{id}, GET|HEAD /health, GET /metrics. The wire format lives in
serve_protocol, listening and the header time limit in serve_http; this module owns the engine's
use: up to ``max_batch`` generations at a time, batched into shared passes by the scheduler
(``deltafin.scheduler``), a bounded wait queue in front of them (429 beyond ``queue_size`` waiting
or ``queue_timeout`` seconds), prompt cancellation when a client goes away, a memo of
deterministic answers, and a prefix cache of decode states (``deltafin.prefix_cache``): a request
whose prompt starts with the tokens of an earlier request's prompt (or prompt + answer, as chat
clients resend it) prefills only the rest.

What the server trusts: the model folder (its chat template is rendered in a sandbox, off the
event loop, within ``render_timeout``), and nothing a client sends. Requests are validated before
anything runs; a fault reading the weights is answered 503 without local paths and turns
/health to "degraded".
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deltafin.serve import metrics as metrics_mod
from deltafin import settings as settings_mod
from deltafin.errors import DeltafinError
from deltafin.serve.prefix_cache import PrefixCache
from deltafin.runtime.pass_stats import PassObserver
from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.scheduler import Scheduler
from deltafin.serve.protocol import (
    MAX_BODY_BYTES, SSE_DONE, APIError, ParsedRequest, Shaper, bad, decode_body, parse_chat, parse_completion,
    resolve_max_tokens, sse)
from deltafin.serve.http import bind, header_timeout_protocol
from deltafin.settings import Settings, SettingsError

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class EngineBusy(APIError):
    def __init__(self, message: str, code: str):
        super().__init__(429, message, code=code, type="rate_limit_error")


class EngineGate:
    """Admits up to ``slots`` generations at a time. At most ``queue_size`` requests wait, first
    come first served, each for at most ``queue_timeout`` seconds. Used from the event loop thread
    only."""

    def __init__(self, queue_size: int, queue_timeout: float, slots: int = 1):
        self.queue_size = queue_size
        self.queue_timeout = max(float(queue_timeout), 0.0)
        self.slots = slots
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def busy(self) -> bool:
        return self.running >= self.slots

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, abandon: asyncio.Event) -> bool:
        """Wait for the engine. True: it is ours (call ``release`` once done). False: ``abandon``
        was set while waiting. Raises EngineBusy when the queue is full or the wait times out."""
        if not self.busy:
            self.running += 1
            return True
        if len(self._waiters) >= self.queue_size:
            raise EngineBusy(f"the engine is busy and {len(self._waiters)} request(s) are already waiting "
                             f"(queue_size={self.queue_size}); retry later", code="queue_full")
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        gone = asyncio.ensure_future(abandon.wait())
        try:
            await asyncio.wait({turn, gone}, timeout=self.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release()  # the engine was handed to us just as we were cancelled
            raise
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
                self._waiters.remove(turn)
        if turn.cancelled():
            if abandon.is_set():
                return False
            raise EngineBusy(f"the engine stayed busy for the whole queue_timeout of {self.queue_timeout:g} s; "
                             "retry later", code="queue_timeout")
        if abandon.is_set():
            self.release()
            return False
        return True

    def release(self) -> None:
        # A freed slot passes straight to the next live waiter, so a newcomer cannot jump the queue.
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1


@dataclass(frozen=True)
class Job:
    """One generation, as the engine sees it (also its memo key, with the served name)."""
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # max_new_tokens resolved; canonical (greedy ignores the sampling knobs)


@dataclass(frozen=True)
class MemoEntry:
    pieces: tuple[str, ...]  # the text as it was streamed
    completion_tokens: int
    finish_reason: str
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ResponseMemo:
    """Least-recently-used answers to deterministic requests; size 0 keeps nothing."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict[tuple, MemoEntry] = collections.OrderedDict()

    def get(self, key: tuple) -> MemoEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: MemoEntry) -> None:
        if self.size <= 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class _CountBytes(PassObserver):
    """Every pass's weight bytes into the server's counter, by where they came from."""

    def __init__(self, counter):
        self.counter = counter

    def on_pass(self, stats) -> None:
        self.counter.inc(stats.bytes_read, source="disk")
        self.counter.inc(stats.bytes_from_ram, source="ram")


class Service:
    """Everything one app serves with: the model, its name, the gate, the memo, the engine thread."""

    def __init__(self, model, settings: Settings):
        self.model = model
        self.settings = settings
        aliases = [n.strip() for n in settings.served_model_name.split(",") if n.strip()]
        self.names = aliases or [model_name(model)]
        self.name = self.names[0]  # the name responses report
        self.tokenizer = getattr(model, "tokenizer", None)
        self.context = int(model.config.max_position_embeddings)
        if settings.max_model_len:
            if settings.max_model_len > self.context:
                raise SettingsError(f"setting 'max_model_len' is {settings.max_model_len}, more than the model's "
                                    f"context of {self.context} tokens")
            self.context = settings.max_model_len
        self.started = int(time.time())
        self.gate = EngineGate(settings.queue_size, settings.queue_timeout, settings.max_batch)
        self.memo = ResponseMemo(settings.memo_size)
        self.prefix_cache = PrefixCache(settings.prefix_cache_mb * 2 ** 20)
        if settings.prompt_cache:
            from deltafin.runtime.saved_state import load_state
            ids, state, _ = load_state(model, settings.prompt_cache)
            self.prefix_cache.put(ids, state, copy=False, pinned=True)
        self.fault: str | None = None  # why the server is degraded (no local paths), once it is
        self._renders: dict[int, float] = {}  # render job id -> when it started
        self._render_ids = iter(range(1 << 62))
        root = getattr(model, "path", None)
        self._roots = sorted({str(root), os.path.realpath(root)}, key=len, reverse=True) if root else []
        self.metrics = metrics_mod.Registry()
        self._count_metrics()
        # The engine runs off the event loop, on the scheduler's thread.
        self._open = contextlib.ExitStack()  # what close() ends
        self._open.enter_context(model.observe(_CountBytes(self.weight_bytes)))
        self.scheduler = Scheduler(model, settings.max_batch, settings.prefill_chunk)
        # Chat templates and tokenizers run here, so a slow one never holds up the event loop.
        self.renderer = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltafin-render")

    def _count_metrics(self) -> None:
        m = self.metrics
        self.requests = m.counter("deltafin_requests_total", "HTTP requests answered, by route and status",
                                  ("route", "status"))
        self.prompt_tokens = m.counter("deltafin_prompt_tokens_total", "prompt tokens of finished generations")
        self.completion_tokens = m.counter("deltafin_completion_tokens_total", "tokens generated")
        self.weight_bytes = m.counter("deltafin_weight_bytes_total",
                                      "weight bytes used by forward passes, by where they came from "
                                      "(ram: a cache hit, disk: read)", ("source",))
        self.memo_lookups = m.counter("deltafin_memo_lookups_total",
                                      "deterministic requests looked up in the response memo", ("result",))
        self.faults = m.counter("deltafin_engine_faults_total", "generations ended by a fault reading the weights")
        m.gauge("deltafin_queue_depth", "requests waiting for the engine", lambda: self.gate.waiting)
        m.gauge("deltafin_running", "generations running (batched into shared passes)", lambda: self.gate.running)
        m.gauge("deltafin_memo_entries", "answers held by the response memo", lambda: len(self.memo))
        self.prefix_lookups = m.counter("deltafin_prefix_cache_lookups_total",
                                        "prompts looked up in the prefix cache (hit: a kept state begins it)",
                                        ("result",))
        self.cached_tokens = m.counter("deltafin_prefix_cache_tokens_total",
                                       "prompt tokens served from the prefix cache instead of prefilled")
        m.gauge("deltafin_prefix_cache_entries", "decode states held by the prefix cache",
                lambda: len(self.prefix_cache))
        m.gauge("deltafin_prefix_cache_bytes", "bytes of the decode states held by the prefix cache",
                lambda: self.prefix_cache.nbytes)
        # What the engine thread's passes carried and where their time went (divide by the passes
        # for means per pass: requests batched together, rows, milliseconds in each part).
        tally = lambda: self.scheduler.tally  # noqa: E731  (the scheduler is made after the metrics)
        m.read_counter("deltafin_passes_total", "forward passes run by the engine thread", lambda: tally().passes)
        m.read_counter("deltafin_pass_sequences_total", "requests carried by forward passes, summed over passes",
                       lambda: tally().sequences)
        m.read_counter("deltafin_pass_decoding_sequences_total", "requests past their prompt carried by forward "
                       "passes, summed over passes", lambda: tally().decoding)
        m.read_counter("deltafin_pass_rows_total", "token rows fed to forward passes, by kind (prompt: a "
                       "newcomer's prompt piece; decode: tokens and drafts of decoding requests)",
                       lambda: {("prompt",): tally().prompt_rows, ("decode",): tally().rows - tally().prompt_rows},
                       ("kind",))
        m.read_counter("deltafin_pass_seconds_total", "engine thread seconds per part of a pass (plan: what to "
                       "feed; forward: the model; take: picking tokens, detokenizing, handing text on)",
                       lambda: {("plan",): tally().plan_seconds, ("forward",): tally().forward_seconds,
                                ("take",): tally().take_seconds}, ("part",))

    def close(self) -> None:
        self.scheduler.close()
        self._open.close()
        self.renderer.shutdown(wait=False, cancel_futures=True)

    def without_paths(self, text: str) -> str:
        """`text` with the model folder's location removed (file names inside it stay)."""
        for root in self._roots:
            text = text.replace(root + os.sep, "").replace(root, "<model>")
        return text

    def health(self) -> tuple[int, dict]:
        stuck = [time.monotonic() - t for t in list(self._renders.values())]
        stuck = [s for s in stuck if s > self.settings.render_timeout]
        reason = self.fault or (f"a prompt has been rendering for {max(stuck):.0f} s (is the chat template "
                                "looping?)" if stuck else None)
        body = {"status": "degraded" if reason else "ok", "model": self.name, "busy": self.gate.busy,
                "running": self.gate.running, "waiting": self.gate.waiting, "memo_entries": len(self.memo),
                "prefix_cache": self.prefix_cache.stats(), "passes": self.scheduler.tally.summary()}
        if reason:
            body["reason"] = reason
        return (503 if reason else 200), body

    # -- request -> job ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        # A request without "model" means the one model served here.
        if name is not None and name not in self.names:
            raise APIError(404, f"the model '{name}' does not exist here; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    async def encode(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids, rendered and tokenized off the event loop within render_timeout."""
        job = next(self._render_ids)

        def run():
            self._renders[job] = time.monotonic()
            try:
                return self._encode(req)
            finally:
                self._renders.pop(job, None)

        limit = self.settings.render_timeout
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.renderer, run), limit)
        except asyncio.TimeoutError:
            log.warning("rendering and tokenizing a prompt took longer than %g s; answered 503", limit)
            raise APIError(503, f"rendering and tokenizing the prompt took longer than {limit:g} s "
                           "(render_timeout)", code="render_timeout") from None

    def _encode(self, req: ParsedRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise APIError(500, f"the model '{self.name}' was loaded without a tokenizer, so the text endpoints "
                           "cannot answer", code="no_tokenizer")
        if req.kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise bad(f"the model '{self.name}' has no chat template; use /v1/completions with a prompt",
                          param="messages", code="no_chat_template")
            try:
                ids = self.model.encode_chat(req.messages)
            except Exception as e:  # the template's own checks (role order, ...) raise here
                raise bad(f"the chat template cannot render these messages: {e}", param="messages") from None
        elif isinstance(req.prompt, list):
            vocab = self.model.config.vocab_size
            for i, t in enumerate(req.prompt):
                if not 0 <= t < vocab:
                    raise bad(f"'prompt[{i}]' is token id {t}, outside the vocabulary [0, {vocab})", param="prompt")
            ids = list(req.prompt)
        else:
            ids = self.model.encode(req.prompt)
        if not ids:
            raise bad("the prompt is empty: at least one token is needed", param=req.prompt_param)
        return list(ids)

    def job(self, req: ParsedRequest, prompt_ids: list[int]) -> Job:
        max_tokens = resolve_max_tokens(req, len(prompt_ids), self.context, self.settings.max_tokens_cap)
        return Job(tuple(prompt_ids), req.sampling.replace(max_new_tokens=max_tokens).canonical())

    def memo_key(self, req: ParsedRequest, job: Job) -> tuple | None:
        return (self.name, job) if job.params.deterministic and self.memo.size > 0 else None

    # -- the engine ----------------------------------------------------------------------------
    def start(self, job: Job, emit, cancel: threading.Event) -> concurrent.futures.Future:
        """Run ``job`` on the engine thread, batched with the others (the caller holds a gate slot;
        it is released when the job is done). ``emit(text)`` is called from the engine thread for
        each new piece of text and ``emit(None)`` once at the end; setting ``cancel`` stops the
        generation.

        The generation starts from the longest cached prefix of the prompt and leaves states for
        later requests: the one at the end (prompt + answer as fed), the one right after the prompt,
        and, while a long prompt is read in, one each time another ``prefix_cache_block`` tokens
        are in. A chat client's next turn starts with the first when the template renders the
        answer as it was generated, with the second otherwise; prompts that share only a beginning
        (a long system prompt) with the third. ``stats["cached_tokens"]`` of the result counts the
        prompt tokens that were not prefilled."""
        loop = asyncio.get_running_loop()
        ids, cache, block = list(job.prompt_ids), self.prefix_cache, self.settings.prefix_cache_block
        cached, state = cache.lookup(ids) if cache.enabled else (0, None)
        if cache.enabled:
            self.prefix_lookups.inc(result="hit" if cached else "miss")
            self.cached_tokens.inc(cached)
        keep = cache.budget_bytes > 0
        kept_at = [cached]

        def on_prefill(st) -> None:
            n = st.num_tokens
            if n == len(ids) or (block and n // block > kept_at[0] // block):
                cache.put(ids[:n], st)
                kept_at[0] = n

        def on_token(token_id: int, text: str) -> bool:
            if text:
                emit(text)
            return not cancel.is_set()

        def engine_done(future):
            if not future.cancelled() and future.exception() is None:
                gen = future.result()
                gen.stats["cached_tokens"] = cached
                if keep and gen.generated:  # the state holds the prompt and every produced token but the last
                    cache.put(ids + gen.generated[:-1], gen.state, copy=False)
            # The slot is handed back before the end is announced, so a client that has its
            # answer never finds the server still counting its request.
            try:
                loop.call_soon_threadsafe(self.gate.release)
            except RuntimeError:  # the loop is already closed: nobody is left to admit
                return
            emit(None)

        try:
            future = self.scheduler.submit(ids[cached:], job.params, on_token=on_token, cancel=cancel,
                                           state=state, held_ids=ids[:cached] if cached else None,
                                           on_prefill=on_prefill if keep else None)
        except BaseException:
            self.gate.release()
            raise
        future.add_done_callback(engine_done)
        return future

    # -- responses -----------------------------------------------------------------------------
    async def respond(self, req: ParsedRequest) -> Response:
        self.check_model(req.model)
        prompt_ids = await self.encode(req)
        job = self.job(req, prompt_ids)
        shaper = Shaper(req.kind, self.name, req.include_usage)
        key = self.memo_key(req, job)
        entry = self.memo.get(key) if key is not None else None
        if key is not None:
            self.memo_lookups.inc(result="hit" if entry is not None else "miss")
        if entry is not None:
            log.info("memo hit: %s %d prompt tokens -> %d completion tokens", shaper.id, len(prompt_ids),
                     entry.completion_tokens)
            return memo_response(shaper, req.stream, entry, len(prompt_ids))
        return _GenerationResponse(self, req, job, key, shaper)


def model_name(model) -> str:
    name = getattr(model, "name", None)
    if name:
        return str(name)
    path = getattr(model, "path", None)
    return Path(path).name if path else "deltafin"


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
                service.faults.inc()
                service.fault = f"reading the model's weights failed: {service.without_paths(str(e))}"
                error = APIError(503, f"{service.fault}; the server is degraded (see /health)", code="engine_fault")
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
        service.prompt_tokens.inc(prompt_n)
        service.completion_tokens.inc(completion_n)
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
    app.add_middleware(_CountRequests, counter=service.requests)

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
        return await service.respond(parse_chat(await _read_json(request, body_timeout)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.respond(parse_completion(await _read_json(request, body_timeout)))

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


# -- running it ---------------------------------------------------------------------------------

def _url_host(host: str) -> str:
    # A wildcard address is not something to curl; the loopback of the same family is.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def serve(model, host: str | None = None, port: int | None = None, sock=None) -> None:
    """Serve ``model`` until interrupted. host/port default to the model's settings; ``sock``, a
    socket already listening (see ``serve_http.bind``), replaces them."""
    settings = model.settings
    host = settings.host if host is None else host
    port = settings.port if port is None else int(port)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = create_app(model)
    sock = bind(host, port) if sock is None else sock
    bound = sock.getsockname()[1]
    base = f"http://{_url_host(host)}:{bound}"
    name = app.state.service.name
    print(f"deltafin serving '{name}' at {base}/v1 (max_batch={settings.max_batch}, "
          f"prefill_chunk={settings.prefill_chunk}, queue_size={settings.queue_size}, "
          f"queue_timeout={settings.queue_timeout:g}s, memo_size={settings.memo_size}, "
          f"max_tokens_cap={settings.max_tokens_cap}, api key {'required' if settings.api_key else 'not required'})",
          flush=True)
    example = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    auth = " -H 'Authorization: Bearer $KEY'" if settings.api_key else ""
    print(f"try: curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{example}'",
          flush=True)
    uvicorn.Server(uvicorn_config(app, settings)).run(sockets=[sock])


def uvicorn_config(app, settings: Settings):
    """How uvicorn runs the app: h11 with the header time limit."""
    import uvicorn
    return uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(settings.header_timeout))


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to the CLI's subparsers (it runs ``run_cli``)."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                          "/v1/completions, /v1/models, /health). Without --model, serves the "
                                          "built-in default model.")
    p.add_argument("--model", metavar="PATH",
                   help="checkpoint folder, converted store, or hub repository owner/name (fetched lazily) "
                        "(default: built-in synthetic model)")
    settings_mod.add_arguments(p, groups=("engine", "generate", "serve"))
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    import sys

    import deltafin
    from deltafin.startup import default_model_path, startup_message

    settings = settings_mod.from_args(args)
    sock = bind(settings.host, settings.port)  # a busy port is reported before the model loads, not after
    try:
        path = args.model or default_model_path(settings)
        print(f"deltafin: {settings.summary()}", file=sys.stderr)
        model = deltafin.load(path, settings=settings)
        print(startup_message(model, path), file=sys.stderr)
        serve(model, sock=sock)
    finally:
        sock.close()
    return 0
