"""Continuous batching: several generations share every forward pass.

When weights stream from disk a pass costs about the same whether it computes one token or
eight, so the server runs every active request in the same pass. One engine thread loops while
any request is active:

    admit waiting requests (at most ``max_batch`` active)  ->  drop cancelled ones  ->
    ask each active ``Decoding`` what to feed  ->  one pass (``start_batch``)  ->  hand each its logits
    ->  resolve the finished ones, which leave

Requests join and leave between passes. While others decode, a pass carries at most PASS_ROWS
rows (up to MAX_PASS_ROWS where the measured costs say extra rows are nearly free, as when the
weights stream from disk), and newcomers' prompts go in pieces sized by what passes have cost
(``PassCosts``): a pass with a prompt piece may take at most PROMPT_COST_FACTOR times as long as
the decoding sequences' rows alone, and (PROMPT_COST_FACTOR - 1) of that again for each further
newcomer waiting, so the streams already running keep their pace while a long prompt is read in,
and a crowd of newcomers is let in within a few passes (at least one prompt token per pass,
earliest newcomer first). The decoding sequences' drafts share the rows first (one kept for a
newcomer), so speculation keeps going beside a newcomer; a sequence whose drafts have mostly been
accepted drafts as much as it would alone (``draft_limits``), as far as MAX_PASS_ROWS allows. With
nobody decoding, prompts go in pieces of ``prefill_chunk`` tokens. On a device that replays
recorded passes (``Model.replays_passes``: CUDA graphs, one per pass shape), where a decode pass
costs a small fraction of any pass run eagerly, a pass of several decoding sequences carries one token
of each (one sequence's drafts mixed in would make the whole pass eager). A short prompt
(REPLAYED_PROMPT_MAX) is read in pieces that graphs replay (16, 8, 4, 2, 1 tokens): the earliest
newcomer's piece in the decode pass itself, so the streams go on while a newcomer reads its prompt,
and while nobody decodes, newcomers with as many tokens to go together; a longer prompt in
``prefill_chunk`` pieces, in passes of its own taking turns with the decode passes. Each request keeps
its own drafts and sampling generator; pieces and draft lengths change speed only, so its output is
the one it gets served alone (up to the rounding of products over a different number of rows, which
leaves greedy tokens and seeded samples unchanged in the tests).

On a model split across ranks (``Model.pipeline_depth`` > 1) the engine thread keeps that many
passes in flight, each over a share of the active requests not already in one: while rank 1 runs one
group's layers, rank 0 runs the next group's, and a group's next pass starts as soon as its last one
ended. A request is in one pass at a time, so its tokens are those it gets in one pass at a time.

Where a pass computes on a CUDA device while the host goes on, a pass's tokens go out (each request's
``on_token``: the text made, stop strings looked for, the HTTP side handed its pieces) once the next
pass has begun, so the device does not wait for that: each request only takes its token first
(``Decoding.advance``), which is all the next pass needs; a request with stop strings, whose text may
end it, or with a draft, whose callback may stop it inside the burst, hands its tokens out at once.

The engine thread tallies what its passes carried and where their time went (``PassTally``;
the server's /metrics and /health show it).

What it holds: the waiting and active requests, each with its own ``DecodeState`` (handed in
pre-filled, or a fresh one). Nothing else outlives a request.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..errors import DeviceOutOfMemory
from .generate import Decoding
from .sampling import SamplingParams

log = logging.getLogger(__name__)

# Rows the decoding sequences' tokens and drafts may always take (one kept for a newcomer's prompt
# piece). Past it, where the weights are in RAM, every product pays for the extra rows (the native
# CPU products widen or decode a weight once for a few rows only), and the running streams'
# inter-token time with it.
PASS_ROWS = 16
# Rows a pass carries at most while sequences decode, where the measured costs allow: streamed
# from disk a pass reads the same bytes for 8 rows or 40, so drafts and prompt pieces beyond
# PASS_ROWS come almost free (measured: docs/benchmarks.md#scheduler).
MAX_PASS_ROWS = 64
# Drafts take rows beyond PASS_ROWS while a pass is estimated to cost at most this much more than
# the decoding sequences' tokens alone (a rejected draft row then costs next to nothing).
FREE_ROWS_COST = 1.1
# How much longer than the decoding sequences' own pass a pass that also reads one newcomer's
# prompt may take. Rows are not a measure of cost: in RAM a few prompt rows beside one decoding
# token cost several times the token alone, beside many decoding tokens little more. At 1.5 a
# running stream's inter-token time grows by about half while a long prompt is read in.
# Each further newcomer waiting adds as much again (PROMPT_COST_FACTOR - 1 of the streams' pass):
# their waits are latency users see too, and a newcomer let in a row or two per pass beside
# several streams stays out of the shared passes for dozens of them (measured:
# docs/benchmarks.md#scheduler).
PROMPT_COST_FACTOR = 1.5
# With recorded passes, a newcomer's prompt with at most this many tokens to go is read in pieces that
# graphs replay (decode_graph.PIECE_MAX_ROWS at most, ~1.5-2 ms a pass of small-k3 on an H100), where a
# plain pass of any length costs ~20-30 ms of launches there; longer prompts go in plain passes of
# prefill_chunk tokens, whose cost per token falls as they grow.
REPLAYED_PROMPT_MAX = 64
# A sequence whose drafts have been accepted at least at this rate (accepted over drafted tokens,
# over its generation so far) drafts as it would alone, not only its share of the rows: its draft
# rows then yield tokens at that rate, while one pass per token is what the batch saves (measured:
# docs/benchmarks.md#scheduler).
ACCEPTED_DRAFTS = 0.5
# When the engine is idle and a request comes, it waits up to this share of a one-row pass's
# measured cost for others arriving with it, so that they start in the same pass: clients that
# send together reach the engine milliseconds apart, and a newcomer one pass late beside the
# others finishes one pass late. A lone request's first token comes up to this share of a pass
# later (measured: docs/benchmarks.md#scheduler).
GATHER_SHARE = 0.05
# ... and at least this long, or one pass where a pass is shorter: in RAM that share of a one-row pass
# is shorter than clients sending together take to arrive. A replayed GPU pass (~1.5 ms of small-k3)
# costs less than waiting longer: a latecomer reads its prompt a few passes later (replayed pieces)
# and runs that many passes behind, where 20 ms of waiting held a lone client's every request up by
# 14 such passes (one client, two requests of 64 tokens: idle 21 % of its run, 2026-12-06).
GATHER_MIN_SECONDS = 0.02
# While requests keep coming, each arrival extends the wait to GATHER_MIN_SECONDS after it, up to
# this long (or the share above, when longer): clients of one load generator arrive spread over
# more than GATHER_MIN_SECONDS, and a late one runs a pass behind the others for the rest of the
# run. A lone request still waits GATHER_MIN_SECONDS.
GATHER_MAX_SECONDS = 0.1
# Weight of the newest pass in the running mean of pass seconds per row count.
COST_SMOOTHING = 0.3


class PassCosts:
    """What passes have cost: a running mean of the seconds of a pass for each number of rows it
    carried. ``rows_for(d, w)`` is how many rows a pass with ``d`` decoding rows may carry when it
    also reads the prompts of ``w`` waiting newcomers: the most whose cost stays within
    1 + (PROMPT_COST_FACTOR - 1) * w times the cost of the ``d`` rows alone, the pace the running
    streams keep. ``draft_rows(n)``: how many rows ``n`` decoding sequences may fill with their
    tokens and drafts. A row count not measured yet is priced by straight lines between the
    nearest measured ones, and beyond the largest on the line from the smallest to the largest (as
    the one measured count while there is only one, and then no more than PASS_ROWS rows), so the
    budget starts optimistic (streamed from disk, extra rows cost almost nothing) and finds this
    model's costs on this machine within a few passes, without trying every row count in turn."""

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        self.seconds[rows] = _mean(self.seconds.get(rows), seconds)

    def estimate(self, rows: int) -> float | None:
        """Seconds a pass of ``rows`` rows is expected to take (None: nothing measured yet)."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None:
            return None if above is None else self.seconds[above]
        if above is None:  # beyond the largest: the line through the smallest and the largest
            above, below = below, min(self.seconds)
            if above == below:
                return self.seconds[above]
            lo, hi = self.seconds[below], self.seconds[above]
            return max(hi, lo + (hi - lo) * (rows - below) / (above - below))
        lo, hi = self.seconds[below], self.seconds[above]
        return lo + (hi - lo) * (rows - below) / (above - below)

    def rows_for(self, decoding: int, waiting: int = 1) -> int:
        """Rows (at least decoding + 1, at most MAX_PASS_ROWS) for a pass of ``decoding`` rows plus
        the prompt pieces of ``waiting`` newcomers (PASS_ROWS while nothing is measured)."""
        pace = self.estimate(decoding)
        if pace is None:
            return PASS_ROWS
        return max(decoding + 1, self._most_rows(decoding + 1,
                                                 (1 + (PROMPT_COST_FACTOR - 1) * max(1, waiting)) * pace))

    def draft_rows(self, sequences: int) -> int:
        """Rows (at least PASS_ROWS, at most MAX_PASS_ROWS) that ``sequences`` decoding sequences'
        tokens and drafts may fill: beyond PASS_ROWS while the pass costs at most FREE_ROWS_COST
        times their tokens alone."""
        pace = self.estimate(sequences)
        if pace is None:
            return PASS_ROWS
        return max(PASS_ROWS, self._most_rows(sequences + 1, FREE_ROWS_COST * pace))

    def _most_rows(self, start: int, limit: float) -> int:
        """The most rows (from start - 1 up to MAX_PASS_ROWS) whose estimated cost stays within
        limit; up to PASS_ROWS only until two row counts are measured (a line then says what more
        rows cost)."""
        top = MAX_PASS_ROWS if len(self.seconds) > 1 else PASS_ROWS
        for rows in range(start, top + 1):
            if self.estimate(rows) > limit:
                return rows - 1
        return top


def gather_deadline(start: float, last_arrival: float, pace: float) -> float:
    """When an idle engine that began gathering at ``start`` stops waiting, the latest request having
    come at ``last_arrival``, for passes of ``pace`` seconds: GATHER_SHARE of a pass (at least
    ``least``: GATHER_MIN_SECONDS, or one pass if shorter) after the start, or ``least`` after the latest
    arrival when that is later, but no later than GATHER_MAX_SECONDS (or that share, when longer) after
    the start."""
    least = min(GATHER_MIN_SECONDS, pace)
    base = max(GATHER_SHARE * pace, least)
    return min(start + max(base, GATHER_MAX_SECONDS), max(start + base, last_arrival + least))


def draft_limits(stats: list[dict], draft_lens: list[int], share: int, room: int) -> list[int]:
    """The most draft tokens each decoding sequence may verify in a pass: its ``draft_len`` (as alone)
    when its drafts have been accepted at ACCEPTED_DRAFTS or more (``stats``: its generation's
    ``drafted_tokens`` and ``accepted_draft_tokens``), else ``share``; at most ``room`` in all, the
    largest limits cut first."""
    def accepted(s: dict) -> bool:
        return s["drafted_tokens"] > 0 and s["accepted_draft_tokens"] >= ACCEPTED_DRAFTS * s["drafted_tokens"]
    limits = [n if accepted(s) else min(n, share) for s, n in zip(stats, draft_lens)]
    while sum(limits) > max(0, room):
        top = max(range(len(limits)), key=limits.__getitem__)
        limits[top] -= 1
    return limits


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + COST_SMOOTHING * (new - old)


@dataclass
class PassTally:
    """What the engine thread has done since it started (read from any thread; the engine thread
    alone writes). Means per pass are these sums divided by ``passes``: ``sequences / passes`` is
    how many requests a pass carried on average, ``decoding / passes`` how many of them were past
    their prompt, ``in_flight / passes`` how many passes were in flight at once (more than one: a
    model split across ranks, its groups pipelined). The seconds split each pass's time: ``plan``
    (what to feed: drafts, prompt pieces), ``forward`` (the model: starting and ending it), ``take``
    (picking tokens, detokenizing, handing text to the HTTP side). ``wait_seconds / started``: how long
    a request waited from being submitted to its first pass (an idle engine gathering the requests
    that come with it, the passes of others before it was let in)."""
    passes: int = 0
    sequences: int = 0
    decoding: int = 0
    rows: int = 0
    prompt_rows: int = 0
    in_flight: int = 0  # passes in flight as each began, itself included (several: pipelined)
    started: int = 0  # requests whose first pass has begun
    wait_seconds: float = 0.0  # their seconds from being submitted to their first pass, summed
    plan_seconds: float = 0.0
    forward_seconds: float = 0.0
    take_seconds: float = 0.0

    def summary(self) -> dict:
        n = max(self.passes, 1)
        return {"passes": self.passes, "sequences_per_pass": self.sequences / n,
                "decoding_per_pass": self.decoding / n, "rows_per_pass": self.rows / n,
                "prompt_rows_per_pass": self.prompt_rows / n, "in_flight_per_pass": self.in_flight / n,
                "plan_ms_per_pass": 1e3 * self.plan_seconds / n,
                "forward_ms_per_pass": 1e3 * self.forward_seconds / n, "take_ms_per_pass": 1e3 * self.take_seconds / n,
                "wait_ms_per_request": 1e3 * self.wait_seconds / max(self.started, 1)}


@dataclass
class _Flight:
    """A pass begun: its requests and their Seqs, when planning began (t0) and the pass began (t1),
    the seconds its start took, and its logits (one process) or the pass to end (``pending``)."""
    batch: list
    t0: float
    t1: float
    in_flight: int = 1
    forward_seconds: float = 0.0
    logits: list | None = None
    pending: object = None


@dataclass
class _Request:
    decoding: Decoding
    future: Future
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False  # its first pass has begun


class Scheduler:
    """Runs generations on one engine thread, up to ``max_batch`` of them in each pass."""

    def __init__(self, model, max_batch: int, prefill_chunk: int,
                 hand_out: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 overlap: bool | None = None):
        """hand_out: entered around handing a pass's tokens to its requests (their callbacks run inside
        it; the server defers waking its event loop to its end, serve.handoff). overlap: whether a
        pass's tokens go out once the next pass has begun (None: where passes run on a CUDA device,
        which computes while the host goes on; elsewhere a pass computes as it begins, so its tokens
        would only go out later)."""
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1, got {max_batch} and {prefill_chunk}")
        self.model, self.max_batch, self.prefill_chunk = model, max_batch, prefill_chunk
        self._hand_out = hand_out
        self._prompt_turn = False  # with recorded passes: whether the next pass reads prompt pieces
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []  # touched by the engine thread only
        # Passes begun and not yet ended, oldest first, and their requests (see _step).
        self._depth = max(1, getattr(model, "pipeline_depth", 1))
        self._flight: collections.deque[_Flight] = collections.deque()
        self._flying: set[int] = set()
        # The requests of the pass ended last, while their tokens wait to go out. Where a pass computes
        # on a device while the host goes on, they go out once the next pass has begun.
        self._ended: list | None = None
        self._overlap = (getattr(getattr(model, "device", None), "type", "cpu") == "cuda"
                         if overlap is None else overlap)
        self._closed = False
        self.tally = PassTally()
        self.costs = PassCosts()
        self._thread = threading.Thread(target=self._run, name="deltafin-engine", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def passes(self) -> int:
        return self.tally.passes

    def submit(self, prompt_ids, params: SamplingParams | None = None, *, cancel: threading.Event | None = None,
               **options) -> Future:
        """Queue one generation; its Future resolves to a ``Generation`` (or the error that ended it).

        ``params`` and ``options`` are ``Decoding``'s (on_token, a pre-filled ``state``, ...);
        ``on_token`` is called from the engine thread. Setting ``cancel`` ends the generation before
        the next pass with finish_reason "cancelled". Bad arguments fail the Future at once.
        """
        future: Future = Future()
        try:
            decoding = Decoding(self.model, prompt_ids, params, prefill_chunk=self.prefill_chunk, **options)
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
                if not self._active:
                    self._gather()
                if self._closed:
                    gone = list(self._waiting) + self._active
                    self._waiting.clear()
                    self._active.clear()
                    break
                while self._waiting and len(self._active) < self.max_batch:
                    self._active.append(self._waiting.popleft())
            self._step()
        for f in self._flight:  # end them, so that every rank of a split model is between passes
            try:
                if f.pending is not None:
                    f.pending.result()
            except Exception:  # their requests fail below either way
                pass
        for r in gone:
            if not r.future.done():
                r.future.set_exception(RuntimeError("the server is shutting down"))

    def _gather(self) -> None:
        """The engine was idle and requests have come (lock held): wait for others arriving with them
        (gather_deadline), or until a whole batch is here."""
        pace = self.costs.estimate(1)
        if pace is None:
            return
        start = last = time.monotonic()
        seen = len(self._waiting)
        while not self._closed and len(self._waiting) < self.max_batch:
            now = time.monotonic()
            if len(self._waiting) > seen:
                seen, last = len(self._waiting), now
            left = gather_deadline(start, last, pace) - now
            if left <= 0:
                return
            self._cond.wait(left)

    def _step(self) -> None:
        """Start passes until ``pipeline_depth`` are in flight (each over a share of the active requests
        not in one), hand out the tokens of the pass that ended last where the device computes the new
        pass meanwhile (``_overlap``), then end the oldest pass: one pass over every active request in
        one process."""
        for r in self._active:
            if r.cancel.is_set() and id(r) not in self._flying:
                r.decoding.cancel()
        if self._ended is None:
            self._retire()
        while len(self._flight) < self._depth:
            idle = [r for r in self._active
                    if id(r) not in self._flying and not r.decoding.done and not r.future.done()]
            if not idle:
                break
            share = -(-len(idle) // (self._depth - len(self._flight)))  # the rest split over the free places
            if not self._start(idle[:share]):
                break
        if self._ended is not None:
            self._hand_out_tokens(self._ended)
        if self._flight:
            self._end(self._flight.popleft())

    def _start(self, requests: list[_Request]) -> bool:
        """Begin a pass over `requests` (in flight until ``_end``); False when it failed."""
        t0 = time.perf_counter()
        batch = self._plan(requests)
        seqs = [seq for _, seq in batch]
        flight = _Flight(batch, t0, time.perf_counter(), in_flight=len(self._flight) + 1)
        try:
            # start_batch where the model has it (a deltafin model always does; its pending pass gives
            # the greedy picks of the whole pass in one read-back, see _end); a model that only runs
            # whole passes runs this one now
            start = getattr(self.model, "start_batch", None)
            if start is not None:
                flight.pending = start(seqs)
            else:
                flight.logits = self.model.forward_batch(seqs)
        except Exception as e:
            self._failed(batch, e)
            return False
        flight.forward_seconds = time.perf_counter() - flight.t1
        self._flight.append(flight)
        self._flying.update(id(r) for r, _ in batch)
        for r, _ in batch:
            if not r.started:
                r.started = True
                self.tally.started += 1
                self.tally.wait_seconds += flight.t1 - r.submitted
        return True

    def _end(self, flight: "_Flight") -> None:
        """Hand each request of a pass its tokens (``Decoding.advance``), once the pass has ended; their
        text goes out now, or (``_overlap``) in the next ``_step``, once the next pass has begun."""
        batch = flight.batch
        self._flying.difference_update(id(r) for r, _ in batch)
        t2 = time.perf_counter()
        try:
            logits = flight.logits if flight.pending is None else flight.pending.result()
            # the greedy requests' picks: one argmax and read-back for the pass, not one per request
            picks = flight.pending.argmax() if flight.pending is not None and any(
                r.decoding.picks_argmax for r, _ in batch) else [None] * len(batch)
        except Exception as e:
            self._failed(batch, e)
            return
        t3 = time.perf_counter()
        rows = sum(len(seq.ids) for _, seq in batch)
        self.costs.record(rows, t3 - flight.t1)
        t = self.tally
        t.sequences, t.rows, t.in_flight = t.sequences + len(batch), t.rows + rows, t.in_flight + flight.in_flight
        t.prompt_rows += sum(len(seq.ids) for r, seq in batch if r.decoding.prefilling)
        t.decoding += sum(1 for r, _ in batch if not r.decoding.prefilling)
        t.plan_seconds += flight.t1 - flight.t0
        t.forward_seconds += flight.forward_seconds + t3 - t2
        for (r, _), out, ids in zip(batch, logits, picks):
            if r.future.done():  # failed while its pass ran (its callback): nothing more to do
                continue
            try:
                r.decoding.advance(out, ids)
            except Exception as e:  # this request's own checks: only it fails
                r.future.set_exception(e)
        t.take_seconds += time.perf_counter() - t3
        self._ended = batch
        if not self._overlap:
            self._hand_out_tokens(batch)

    def _hand_out_tokens(self, batch: list) -> None:
        """The tokens a pass gave its requests go out (their ``on_token``); the finished requests are
        resolved. Counts the pass."""
        self._ended = None
        t0 = time.perf_counter()
        with self._hand_out():
            for r, _ in batch:
                if r.future.done():
                    continue
                try:
                    r.decoding.deliver()
                except Exception as e:  # this request's own callback: only it fails
                    r.future.set_exception(e)
            t = self.tally  # counted before the finished requests are resolved, so their callers see it
            t.take_seconds += time.perf_counter() - t0
            t.passes += 1
            self._retire()

    def _failed(self, batch: list, e: Exception) -> None:
        """A pass over `batch` failed (starting or ending)."""
        rows = sum(len(seq.ids) for _, seq in batch)
        if isinstance(e, torch.OutOfMemoryError):
            # Only the pass's own requests end (their states may be half updated); requests outside
            # it were not touched and go on. With recorded passes a long prompt's pieces are passes of
            # their own (a short one's, at most PIECE_MAX_ROWS rows, ride in the decode passes), so a
            # prompt too long for the device ends its request alone.
            torch.cuda.empty_cache()
            rows_of = {id(r): len(seq.ids) for r, seq in batch}
            log.warning("the device ran out of memory in a pass of %d rows over %d request(s)", rows, len(batch))
            for r in self._active:
                if id(r) in rows_of:
                    what = "reading a prompt piece" if r.decoding.prefilling else "decoding"
                    r.future.set_exception(DeviceOutOfMemory(
                        f"the compute device ran out of memory {what} ({rows_of[id(r)]} of the pass's {rows} "
                        f"rows, {len(batch)} request(s) in the pass); retry with a shorter prompt or fewer "
                        "requests at once"))
            self._active = [r for r in self._active if id(r) not in rows_of]
            return
        # A failed pass leaves every state in it unusable, and a split model's group with it: every
        # request ends, those of passes still in flight too (they will not end).
        log.error("a forward pass over %d request(s) failed: %s", len(batch), e, exc_info=e)
        for r in self._active:
            r.future.set_exception(e)
        self._active.clear()
        self._flight.clear()
        self._flying.clear()

    def _plan(self, requests: list[_Request]) -> list:
        """(request, Seq) for each of `requests` in this pass (see the module docstring for the rows)."""
        decoding = [r for r in requests if not r.decoding.prefilling]
        prefilling = [r for r in requests if r.decoding.prefilling]
        replays = getattr(self.model, "replays_passes", False)
        if not decoding:
            return self._prompt_pass(prefilling) if replays else [(r, r.decoding.next_pass()) for r in prefilling]
        if replays:
            # Several decoding sequences feed one token each (a lone one may check drafts). The earliest
            # newcomer's short prompt goes in replayed pieces beside those tokens, in the same pass (a
            # graph replays both; one newcomer a pass keeps the shapes to record few: a graph per
            # decoding count and piece size); longer prompts in plain passes of their own, taking turns
            # with the decode passes.
            room = self.model.replayed_rows - len(decoding)
            if prefilling and room > 0 and self._replays_piece(prefilling[0]):
                return ([(r, r.decoding.next_pass(max_draft=0)) for r in decoding]
                        + self._prompt_pass(prefilling[:1], room))
            if not prefilling or self._prompt_turn is False:
                self._prompt_turn = True
                return [(r, r.decoding.next_pass(max_draft=0 if len(decoding) > 1 else None)) for r in decoding]
            self._prompt_turn = False
            return self._prompt_pass(prefilling)
        # The decoding sequences first, each with a draft of what their rows leave (one row kept
        # for a newcomer); then newcomers, earliest first, share the prompt rows the cost budget
        # allows beside those rows (at least one row for the earliest).
        keep = 1 if prefilling else 0
        share = max(0, (self.costs.draft_rows(len(decoding)) - keep) // len(decoding) - 1)
        limits = draft_limits([r.decoding.stats for r in decoding], [r.decoding.draft_len for r in decoding],
                              share, MAX_PASS_ROWS - keep - len(decoding))
        batch = [(r, r.decoding.next_pass(max_draft=k)) for r, k in zip(decoding, limits)]
        used = sum(len(seq.ids) for _, seq in batch)
        room = self.costs.rows_for(used, waiting=len(prefilling)) - used
        for r in prefilling:
            if room <= 0 and len(batch) > len(decoding):
                break
            batch.append((r, r.decoding.next_pass(max_prompt=room)))
            room -= len(batch[-1][1].ids)
        return batch

    def _replays_piece(self, newcomer: _Request) -> bool:
        """Whether the newcomer's next prompt piece is one a recorded pass takes (its prompt short)."""
        left = newcomer.decoding.prompt_left
        return left <= REPLAYED_PROMPT_MAX and self.model.replayed_piece(min(left, self.prefill_chunk)) > 0

    def _prompt_pass(self, prefilling: list[_Request], room: int | None = None) -> list:
        """Newcomers' prompt pieces on a model that replays recorded passes, in at most `room` rows (a
        recorded pass's, where None). A prompt with at most REPLAYED_PROMPT_MAX tokens to go is read in
        the pieces a graph replays (``Model.replayed_piece``: 16, 8, 4, 2 or 1 tokens): the earliest
        newcomer's, beside every other newcomer with as many tokens to go, as many as the room takes.
        Longer prompts go in ``prefill_chunk`` pieces, together, in a plain pass (at matrix speed)."""
        room = self.model.replayed_rows if room is None else room
        first = prefilling[0].decoding.prompt_left
        piece = self.model.replayed_piece(min(first, self.prefill_chunk, room))
        if not piece:  # no piece replays here (a rank's layers): every newcomer's next piece, together
            return [(r, r.decoding.next_pass()) for r in prefilling]
        if first > REPLAYED_PROMPT_MAX:
            return [(r, r.decoding.next_pass()) for r in prefilling if r.decoding.prompt_left > REPLAYED_PROMPT_MAX]
        group = [r for r in prefilling if piece <= r.decoding.prompt_left <= REPLAYED_PROMPT_MAX]
        return [(r, r.decoding.next_pass(max_prompt=piece)) for r in group[:max(1, room // piece)]]

    def _retire(self) -> None:
        """Resolve the finished requests, and drop them and the failed ones. One still in a pass (its
        callback stopped it once that pass had begun, see ``Decoding.advance``) stays until it ends."""
        still = []
        for r in self._active:
            if r.future.done():
                continue
            if r.decoding.done and id(r) not in self._flying:
                r.future.set_result(r.decoding.result())
            else:
                still.append(r)
        self._active = still


