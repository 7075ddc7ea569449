"""The counters and gauges ``deltafin serve`` shows at ``GET /metrics``, declared in one place.

``ServerMetrics`` holds them in one ``metrics.Registry``: the counters the service and the HTTP
side increment (requests, tokens, memo and prefix-cache lookups, faults), the weight bytes of
every forward pass (fed by an engine observer, ``observer()``), and the gauges and engine-thread
sums read when the page is rendered (the gate's queue, the memo and prefix cache sizes, the
scheduler's ``PassTally``). It only reads what it is given; it changes nothing it reports on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..runtime.pass_stats import PassObserver
from ..runtime.scheduler import PassTally
from .admission import EngineGate
from .memo import ResponseMemo
from .metrics import Registry
from .prefix_cache import PrefixCache


class _CountBytes(PassObserver):
    """Every pass's weight bytes into the server's counter, by where they came from."""

    def __init__(self, counter):
        self.counter = counter

    def on_pass(self, stats) -> None:
        self.counter.inc(stats.bytes_read, source="disk")
        self.counter.inc(stats.bytes_from_ram, source="ram")


@dataclass
class FirstToken:
    """When a streamed request reached each step on the way to its first token's text going out: the
    request handed to the app (``arrived``: its headers read), its body read and parsed (``received``),
    its prompt rendered and tokenized (``prepared``), an engine slot granted (``started``), the engine
    thread's first text (``made``), that text written (``sent``)."""
    arrived: float
    received: float
    prepared: float
    started: float = 0.0
    made: float = 0.0
    sent: float = 0.0


class ServerMetrics:
    """The server's metrics. ``tally`` returns the scheduler's running sums (a function: the
    scheduler is made after the metrics, once the weight-byte observer watches the model); ``graphs``
    the model's recorded passes (``Model.graph_stats``: None where passes replay none, and then they
    are not shown)."""

    def __init__(self, gate: EngineGate, memo: ResponseMemo, prefix_cache: PrefixCache,
                 tally: Callable[[], PassTally], graphs: Callable[[], dict | None]):
        self.registry = m = Registry()
        self.requests = m.counter("deltafin_requests_total", "HTTP requests answered, by route and status",
                                  ("route", "status"))
        self.prompt_tokens = m.counter("deltafin_prompt_tokens_total", "prompt tokens of finished generations")
        self.completion_tokens = m.counter("deltafin_completion_tokens_total", "tokens generated")
        self.weight_bytes = m.counter("deltafin_weight_bytes_total",
                                      "weight bytes used by forward passes, by where they came from "
                                      "(ram: a cache hit, disk: read)", ("source",))
        self.memo_lookups = m.counter("deltafin_memo_lookups_total",
                                      "deterministic requests looked up in the response memo", ("result",))
        # Where a streamed request's time to its first token went, summed over requests (divide by the count).
        self._first_phases = m.counter("deltafin_first_token_seconds_total", "seconds from a streamed request "
                                       "handed to the app to its first text written, by phase (read: reading "
                                       "and parsing the body; prepare: rendering and "
                                       "tokenizing; queue: waiting for an engine slot; engine: until the engine "
                                       "thread made the text; send: until it was written), summed over requests",
                                       ("phase",))
        self._firsts = m.counter("deltafin_first_tokens_total", "streamed requests whose first text was written")
        self.faults = m.counter("deltafin_engine_faults_total", "generations ended by a fault (reading the "
                                "weights, or a lost rank of a model split across processes)")
        m.gauge("deltafin_queue_depth", "requests waiting for the engine", lambda: gate.waiting)
        m.gauge("deltafin_running", "generations running (batched into shared passes)", lambda: gate.running)
        m.gauge("deltafin_memo_entries", "answers held by the response memo", lambda: len(memo))
        self.prefix_lookups = m.counter("deltafin_prefix_cache_lookups_total",
                                        "prompts looked up in the prefix cache (hit: a kept state begins it)",
                                        ("result",))
        self.cached_tokens = m.counter("deltafin_prefix_cache_tokens_total",
                                       "prompt tokens served from the prefix cache instead of prefilled")
        m.gauge("deltafin_prefix_cache_entries", "decode states held by the prefix cache",
                lambda: len(prefix_cache))
        m.gauge("deltafin_prefix_cache_bytes", "bytes of the decode states held by the prefix cache",
                lambda: prefix_cache.nbytes)
        # What the engine thread's passes carried and where their time went (divide by the passes
        # for means per pass: requests batched together, rows, milliseconds in each part).
        m.read_counter("deltafin_passes_total", "forward passes run by the engine thread", lambda: tally().passes)
        m.read_counter("deltafin_pass_sequences_total", "requests carried by forward passes, summed over passes",
                       lambda: tally().sequences)
        m.read_counter("deltafin_pass_decoding_sequences_total", "requests past their prompt carried by forward "
                       "passes, summed over passes", lambda: tally().decoding)
        m.read_counter("deltafin_pass_in_flight_total", "passes in flight as each pass began, itself included, "
                       "summed over passes (above the passes: a split model's groups pipelined)",
                       lambda: tally().in_flight)
        m.read_counter("deltafin_pass_rows_total", "token rows fed to forward passes, by kind (prompt: a "
                       "newcomer's prompt piece; decode: tokens and drafts of decoding requests)",
                       lambda: {("prompt",): tally().prompt_rows, ("decode",): tally().rows - tally().prompt_rows},
                       ("kind",))
        m.read_counter("deltafin_pass_seconds_total", "engine thread seconds per part of a pass (plan: what to "
                       "feed; forward: the model; take: picking tokens, detokenizing, handing text on)",
                       lambda: {("plan",): tally().plan_seconds, ("forward",): tally().forward_seconds,
                                ("take",): tally().take_seconds}, ("part",))
        m.read_counter("deltafin_requests_started_total", "generations whose first forward pass has begun",
                       lambda: tally().started)
        m.read_counter("deltafin_request_wait_seconds_total", "seconds generations waited from being handed to the "
                       "engine thread to their first forward pass, summed (an idle engine gathering those sent "
                       "together, passes of others before one is let in)", lambda: tally().wait_seconds)
        if graphs() is not None:
            m.read_counter("deltafin_passes_replayed_total", "forward passes replayed as a recorded CUDA graph, by "
                           "kind (decode: one token of each sequence; check: drafts; prompt: prompt pieces; "
                           "mixed: decode rows and a prompt piece)",
                           lambda: {(k,): v for k, v in graphs()["replayed_by_kind"].items()}, ("kind",))
            m.read_counter("deltafin_pass_states_moved_total", "decode states copied into the recorded passes' "
                           "state slots (a sequence not already in one of its pass's slots)",
                           lambda: graphs()["states_moved_in"])

    def first_token(self, f: FirstToken) -> None:
        """Count a streamed request's way to its first token (its text written)."""
        for phase, seconds in (("read", f.received - f.arrived), ("prepare", f.prepared - f.received),
                               ("queue", f.started - f.prepared),
                               ("engine", f.made - f.started), ("send", f.sent - f.made)):
            self._first_phases.inc(seconds, phase=phase)
        self._firsts.inc()

    def observer(self) -> PassObserver:
        """The engine observer that counts every pass's weight bytes (give it to ``model.observe``)."""
        return _CountBytes(self.weight_bytes)

    def render(self) -> str:
        return self.registry.render()
