"""Continuous batching: several generations share every forward pass.

When weights stream from disk a pass costs about the same whether it computes one token or
eight, so the server runs every active request in the same pass. One engine thread loops while
any request is active:

    admit waiting requests (at most ``max_batch`` active)  ->  drop cancelled ones  ->
    ask each active ``Decoding`` what to feed  ->  one ``forward_batch``  ->  hand each its logits
    ->  resolve the finished ones, which leave

Requests join and leave between passes. While others decode, a pass carries at most PASS_ROWS
rows: newcomers' prompts go in pieces that fill what the decoding sequences leave (earliest
first), and their drafts shrink to fit, so the streams already
running keep their pace while it is read in. With nobody decoding, prompts go in pieces of
``prefill_chunk`` tokens. Each request keeps its own drafts and sampling generator; pieces and
draft lengths change speed only, so its output is the one it gets served alone (up to the
rounding of products over a different number of rows, which leaves greedy tokens and seeded
samples unchanged in the tests).

What it holds: the waiting and active requests, each with its own ``DecodeState`` (handed in
pre-filled, or a fresh one). Nothing else outlives a request.
"""
from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from .generate import Decoding

log = logging.getLogger(__name__)

# Rows a pass carries while sequences are decoding (their tokens and drafts, plus a newcomer's
# prompt piece). The native CPU products read each weight once for up to this many rows
# (kernels.cpu_native.GEMV_MAX_ROWS); past it every product pays for the extra rows, and the
# running streams' inter-token time with it.
PASS_ROWS = 16

@dataclass
class _Request:
    decoding: Decoding
    future: Future
    cancel: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    """Runs generations on one engine thread, up to ``max_batch`` of them in each pass."""

    def __init__(self, model, max_batch: int, prefill_chunk: int):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1, got {max_batch} and {prefill_chunk}")
        self.model, self.max_batch, self.prefill_chunk = model, max_batch, prefill_chunk
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []  # touched by the engine thread only
        self._closed = False
        self.passes = 0
        self._thread = threading.Thread(target=self._run, name="deltafin-engine", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, prompt_ids, max_new_tokens: int | None = None, *, cancel: threading.Event | None = None,
               **options) -> Future:
        """Queue one generation; its Future resolves to a ``Generation`` (or the error that ended it).

        ``options`` are ``Decoding``'s (sampling, stop, on_token, a pre-filled ``state``, ...);
        ``on_token`` is called from the engine thread. Setting ``cancel`` ends the generation before
        the next pass with finish_reason "cancelled". Bad arguments fail the Future at once.
        """
        future: Future = Future()
        try:
            decoding = Decoding(self.model, prompt_ids, max_new_tokens, prefill_chunk=self.prefill_chunk, **options)
        except Exception as e:
            future.set_exception(e)
            return future
        request = _Request(decoding, future, cancel if cancel is not None else threading.Event())
        with self._cond:
            if self._closed:
                future.set_exception(RuntimeError("the scheduler is closed"))
                return future
            self._waiting.append(request)
            self._cond.notify()
        return future

    def close(self) -> None:
        """Stop the engine thread after the pass in flight; requests still open fail."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._active):
                    self._cond.wait()
                if self._closed:
                    gone = list(self._waiting) + self._active
                    self._waiting.clear()
                    self._active.clear()
                    break
                while self._waiting and len(self._active) < self.max_batch:
                    self._active.append(self._waiting.popleft())
            self._step()
        for r in gone:
            if not r.future.done():
                r.future.set_exception(RuntimeError("the server is shutting down"))

    def _step(self) -> None:
        """One pass over every active request that is still going."""
        for r in self._active:
            if r.cancel.is_set():
                r.decoding.cancel()
        self._retire()
        if not self._active:
            return
        batch = self._plan()
        try:
            logits = self.model.forward_batch([seq for _, seq in batch])
        except Exception as e:  # a failed pass leaves every state in it unusable
            log.exception("a forward pass over %d request(s) failed", len(self._active))
            for r in self._active:
                r.future.set_exception(e)
            self._active.clear()
            return
        self.passes += 1
        for (r, _), out in zip(batch, logits):
            try:
                r.decoding.take(out)
            except Exception as e:  # this request's own callback or checks: only it fails
                r.future.set_exception(e)
        self._retire()

    def _plan(self) -> list:
        """(request, Seq) for each request in this pass (see the module docstring for the rows)."""
        decoding = [r for r in self._active if not r.decoding.prefilling]
        prefilling = [r for r in self._active if r.decoding.prefilling]
        if not decoding:
            return [(r, r.decoding.next_pass()) for r in prefilling]
        # Newcomers first, earliest first: their pieces share what one token per decoding sequence
        # leaves (at least one token per pass for the earliest, so it always advances).
        batch = []
        room = PASS_ROWS - len(decoding)
        for r in prefilling:
            if batch and room <= 0:
                break
            batch.append((r, r.decoding.next_pass(max_prompt=room)))
            room -= len(batch[-1][1].ids)
        room = PASS_ROWS - sum(len(seq.ids) for _, seq in batch)
        draft = max(0, room // len(decoding) - 1)
        return batch + [(r, r.decoding.next_pass(max_draft=draft)) for r in decoding]

    def _retire(self) -> None:
        still = []
        for r in self._active:
            if r.future.done():
                continue
            if r.decoding.done:
                r.future.set_result(r.decoding.result())
            else:
                still.append(r)
        self._active = still


