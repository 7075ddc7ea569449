"""One forward pass over all layers: get the layer's weights, bind, compute, account.

A pass may carry several sequences (``forward_batch``): their rows are concatenated, so each
weight is read once for all of them, and each layer runs attention per sequence on that
sequence's own state; the routed experts read are the union of what the rows chose.

The engine does not know where weights come from. A *provider* hands it each layer's spine (in
order, so it can read ahead) and the routed experts the router chose, already on the compute
device; ``io.ram`` keeps a whole model in memory, ``io.stream`` reads it from disk per layer,
``io.device`` keeps what its budget holds in a GPU's memory and streams the rest. Timing and
byte counts are kept in a ``PassStats`` the engine owns and returns; whoever wants to watch passes
(profiles, benchmarks, metrics, routing traces) gives the engine a ``PassObserver`` (``observe``).

An engine may run a contiguous range of the layers only (``layers``): a rank of a model split across
processes (deltafin.dist), whose states then hold those layers alone. ``device_pass`` is the layers
(``run_layers``) followed by the head (``head``), so that the split can hand the rows on in between.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..kernels import cpu_native
from ..model.binding import bind, slot_names, unbind
from ..model.layers import NOT_PRODUCTS, attn_res, build_templates, layer_kind
from ..model.ops import HalfMatmul, linear, rms_norm
from ..model.state import DecodeState, Rows, runs
from ..settings import Settings
from .cpu_replay import CpuReplay
from .decode_graph import DecodeGraphs
from .pass_stats import PassObserver, PassStats
from .thread_policy import ThreadPolicy

# A plain pass's embedding rows from this many on are gathered from the host's table on
# ``gather_threads`` where the run's threads are fewer: one thread took 7.6 ms for 4,096 random rows of a
# 163,840 x 2,304 bf16 table (two: 3.4), a sixth of a 4 k prompt's 43 ms on an H200.
GATHER_SHARED_ROWS = 256


class Engine:
    def __init__(self, cfg: ModelConfig, provider, settings: Settings, row_threads: int | None = None,
                 layers: range | None = None):
        """row_threads: the native products' threads in a CPU pass of several rows (a batch, drafts,
        a prompt piece) when that differs from the run's threads (api.row_threads says when).
        layers: the layers this engine runs (default all of them)."""
        self.cfg = cfg
        self.layers = range(cfg.num_layers) if layers is None else layers
        self.row_threads = row_threads
        # Threads for gathering a long prompt's embedding rows where the run keeps fewer (api.Model: a
        # device holding the whole model leaves the host one); None: the run's.
        self.gather_threads: int | None = None
        self.provider = provider
        self.settings = settings
        self.device = settings.torch_device()
        # The residual stream, states and all reductions are fp32; `dtype` only sets the dtype
        # matrix products run in (float32 = the reference).
        self.dtype = torch.float32
        self.matmul_dtype = settings.torch_dtype()
        self.templates = build_templates(cfg)
        self._product_slots = {name for t in self.templates.values() for name, shape in slot_names(t).items()
                               if len(shape) == 2 and name not in NOT_PRODUCTS} | {"lm_head"}
        self.last_pass = PassStats()
        self.observers: list[PassObserver] = []
        # The native threads of one-token CPU passes, chosen from where their bytes come from
        # (thread_policy.py); the loader sets it for a streamed model with automatic threads.
        self.thread_policy: ThreadPolicy | None = None
        self.choices: list = []  # the observers' on_choice callbacks, for the pass under way
        # Decode and check passes replayed as CUDA graphs where everything they read is resident: the
        # whole pass, or a rank's layers of a model split across processes (the rank hands its rows
        # on between its replays; dist.worker, dist.pipeline).
        whole = self.layers == range(cfg.num_layers)
        self.graphs = DecodeGraphs(self) if DecodeGraphs.possible(self) else None
        # On the CPU, one-token passes of a resident model replayed as the native calls they make.
        self.cpu_replay = CpuReplay(self) if whole and CpuReplay.possible(self) else None

    @contextlib.contextmanager
    def observe(self, observer: PassObserver):
        """Call ``observer`` for every pass inside the ``with`` block (see pass_stats.PassObserver)."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)

    def new_state(self) -> DecodeState:
        return DecodeState(layers=self.layer_states())

    def layer_states(self) -> list:
        """Empty per-layer states of this engine's layers (a state's parts, nobody's yet)."""
        return [self.templates[layer_kind(self.cfg, i)].self_attn.new_state(self.dtype, self.device)
                for i in self.layers]

    def _for_products(self, weights: dict) -> dict:
        """Mark the plain projection weights for 16-bit products when that path was chosen."""
        if self.matmul_dtype == torch.float32:
            return weights
        return {k: HalfMatmul(w, self.matmul_dtype) if k in self._product_slots else w
                for k, w in weights.items()}

    def forward(self, ids: list[int], state: DecodeState, keep_states: bool = False,
                last_only: bool = False) -> torch.Tensor:
        """Consume `ids` after what `state` holds; return float32 logits [len(ids), vocab]
        (or [1, vocab] for the last position only: a long prompt's full logits are large)."""
        return self.forward_batch([Seq(list(ids), state, keep_states, "last" if last_only else "all")])[0]

    def forward_batch(self, seqs: list[Seq]) -> list[torch.Tensor | None]:
        """One pass for several sequences: each consumes its ids after what its own state holds.

        Their rows are concatenated, so every weight is read once for all of them; attention runs
        per sequence over its own state. Returns each sequence's float32 logits as ``Seq.logits``
        asks, on the host, or on the compute device when every sequence asks for that
        (``Seq.on_device``). Either way the pass has ended on the device when this returns.
        """
        return self.start_batch(seqs).result()

    def record_passes(self, shapes: list[tuple[int, int]], reach: int) -> int:
        """Records now the decode graphs of these pass shapes ((sequences, rows each): one row is a
        decode step, more are a token and its drafts, checked), with state buffers for sequences of up
        to `reach` tokens, so that the passes which need them replay at once: the first pass of a shape
        otherwise runs eagerly (compiling and tuning its kernels) and then records, ~50-150 ms inside a
        generation. Throwaway states fed one token id; returns how many graphs were recorded (0 where
        passes replay no graphs)."""
        g = self.graphs
        if g is None:
            return 0
        before = g.recorded
        token = self.cfg.bos_token_id or 0
        for B, n in shapes:
            if (B, n, n > 1, 0) in g.graphs:
                continue
            seqs = [Seq([token] * n, self.new_state(), n > 1, "all", reach=reach) for _ in range(B)]
            if g.applies(seqs):
                self.forward_batch(seqs)
        return g.recorded - before

    @torch.inference_mode()
    def start_batch(self, seqs: list[Seq]) -> "PendingPass":
        """``forward_batch`` in two steps: the pass starts here, ``result()`` ends it. In one process
        the whole pass runs here; on rank 0 of a split model this returns once rank 0's layers are done
        and the rows are handed on, so the next pass (of other sequences) can start while the other
        ranks run this one (dist.pipeline). Passes end in the order they started."""
        ids_t = _check_batch(seqs, self.cfg.vocab_size)
        stats = PassStats(tokens=len(ids_t))
        t0 = time.perf_counter()
        for s in seqs:
            s.state.begin_pass(s.keep_states)
        routes = [o.on_route for o in self.observers if o.on_route is not None]
        self.choices = [o.on_choice for o in self.observers if o.on_choice is not None]
        if self.graphs is not None and self.graphs.whole and not routes and not self.choices \
                and self.graphs.applies(seqs):
            logits = self.graphs.run(seqs, ids_t, stats)
            finish = lambda: logits  # noqa: E731
        else:
            with self.pass_threads(len(ids_t)):
                if self.cpu_replay is not None and not routes and self.cpu_replay.applies(seqs):
                    logits = self.cpu_replay.run(seqs, ids_t, stats)
                    finish = lambda: logits  # noqa: E731
                else:
                    finish = self.start_device_pass(self.embed(ids_t), seqs, stats, routes)
        return PendingPass(self, seqs, stats, t0, finish)

    def finish_batch(self, pending: "PendingPass") -> list[torch.Tensor | None]:
        """The rest of a pass ``start_batch`` began (called by ``PendingPass.result``)."""
        seqs, stats, finish = pending.seqs, pending.stats, pending.finish
        if finish is None:
            raise RuntimeError("this pass has ended already")
        pending.finish = None
        with self.pass_threads(stats.tokens):
            logits = finish()
        c0 = time.perf_counter()
        on_device = all(s.on_device for s in seqs)
        if on_device or logits.numel() == 0:
            _wait_for(self.device)  # the pass's time includes the device's work (an empty read-back waits for none)
        if not on_device:
            logits = logits.cpu()
        stats.compute_seconds += time.perf_counter() - c0
        stats.seconds = time.perf_counter() - pending.started
        for s in seqs:
            s.state.num_tokens += len(s.ids)
        self.last_pass = stats
        if self.thread_policy is not None and stats.tokens == 1:
            self.thread_policy.after(stats)
        for o in self.observers:
            o.on_pass(stats)
        out: list[torch.Tensor | None] = []
        start = 0
        for s in seqs:
            n = _logit_count(s)
            out.append(logits[start:start + n] if s.logits != "none" else None)
            start += n
        pending.logits = logits
        return out

    def pass_threads(self, rows: int):
        """The threads a pass of `rows` rows computes on: a decode-sized pass on the CPU runs its
        products in the native kernels, on every compute thread, and torch's small ops on one
        (see cpu_native.decode_threads)."""
        if self.device.type == "cpu" and rows <= cpu_native.GEMV_MAX_ROWS:
            one = self.thread_policy.now if self.thread_policy is not None else None
            return cpu_native.decode_threads(self.row_threads if rows > 1 else one)
        return contextlib.nullcontext()

    def _fetch(self, i: int, stats: PassStats, routes) -> "LayerExperts":
        """Layer i's expert fetch (model.moe.ExpertFetch): the provider's read, seen by the observers."""
        return LayerExperts(self.provider, i, stats, routes, self.choices)

    def embed(self, ids_t: torch.Tensor) -> torch.Tensor:
        """The rows of the residual stream for token ids (the table stays on the host). They cross to
        the device as stored and are widened there (a 4 k-token prompt's float32 rows took 2.7 ms to
        cross to an H200 from pageable memory: half the bytes, half the time)."""
        table = self.provider.globals()["embed"]
        if self.gather_threads is None or len(ids_t) < GATHER_SHARED_ROWS:
            rows = table[ids_t]
        else:
            with torch_threads(self.gather_threads):
                rows = table[ids_t]
        return rows.to(self.device).to(self.dtype)

    def device_pass(self, h: torch.Tensor, seqs: list[Seq], stats: PassStats, routes=()) -> torch.Tensor:
        """Every layer and the head over the pass's rows h; float32 logits of the wanted rows, on the
        compute device. Reads nothing back to the host when every weight is resident and every MoE
        layer's experts are stacked (what a recorded decode graph needs, see decode_graph.py), and no
        observer watches the routing (``routes``: their on_route callbacks)."""
        blocks: list[torch.Tensor] = []
        h = self.run_layers(h, blocks, seqs, stats, routes)
        return self.head(h, blocks, seqs, stats)

    def start_device_pass(self, h: torch.Tensor, seqs: list[Seq], stats: PassStats,
                          routes=()) -> Callable[[], torch.Tensor]:
        """``device_pass`` begun: a function that returns its logits. One process runs the whole pass
        here (a split model's rank 0 hands its rows on and returns, see dist.pipeline)."""
        logits = self.device_pass(h, seqs, stats, routes)
        return lambda: logits

    def run_layers(self, h: torch.Tensor, blocks: list[torch.Tensor], seqs: list[Seq], stats: PassStats,
                   routes=()) -> torch.Tensor:
        """The engine's layers over the pass's rows h; the residual stream after them. ``blocks``
        (K3's attention-residual block summaries so far) grows as the layers start new blocks."""
        cfg = self.cfg
        chunk = self.settings.kda_chunk
        first = self.layers.start  # a state holds the engine's layers only
        self.provider.start_pass(stats)
        try:
            for i in self.layers:
                weights = self.provider.spine(i, stats)
                tmpl = self.templates[layer_kind(cfg, i)]
                bind(tmpl, self._for_products(weights))
                w0, c0 = stats.expert_wait_seconds, time.perf_counter()
                parts = [Rows(s.state.layers[i - first], len(s.ids), s.keep_states) for s in seqs]
                h = tmpl(i, h, blocks, parts, chunk, self._fetch(i, stats, routes))
                # Waiting for routed experts happens inside the layer; it is I/O, not compute.
                stats.compute_seconds += time.perf_counter() - c0 - (stats.expert_wait_seconds - w0)
                unbind(tmpl)
                del weights
        finally:
            self.provider.end_pass(stats)
        return h

    def run_stacked(self, x: torch.Tensor, seqs: list[Seq], stats: PassStats, routes=()) -> torch.Tensor:
        """``run_layers`` over rows as they travel between ranks, x [summaries + 1, rows, H] (the block
        summaries so far, then the residual stream), and the rows after them stacked alike (the
        summaries the layers began appended)."""
        blocks = list(x[:-1])
        h = self.run_layers(x[-1], blocks, seqs, stats, routes)
        return torch.stack([*blocks, h])

    def head(self, h: torch.Tensor, blocks: list[torch.Tensor], seqs: list[Seq], stats: PassStats) -> torch.Tensor:
        """The final norm and lm_head over the rows whose logits the sequences want (h may hold
        those rows only, see logit_rows); float32 logits on the compute device."""
        cfg = self.cfg
        g = self.provider.globals()
        c0 = time.perf_counter()
        rows = logit_rows(seqs)
        if len(rows) == h.shape[0]:  # every row wanted (a full-logits pass): no copy
            pick = None
        elif all(_logit_count(s) == 1 for s in seqs):
            # each sequence's last row: strided views, which a recorded pass (prompt pieces, decode rows
            # beside them) can take where an index tensor would be copied from the host
            def pick(t):
                return last_rows(t, [len(s.ids) for s in seqs])
        else:
            def pick(t):
                return t[rows]
        if pick is not None:
            h, blocks = pick(h), [pick(b) for b in blocks]
        if cfg.attn_res_block_size:
            h = attn_res(h, blocks, g["out_res_proj"], g["out_res_norm"], cfg.rms_norm_eps)
        head = self._for_products({"lm_head": g["lm_head"]})["lm_head"]
        logits = linear(rms_norm(h, g["norm"], cfg.rms_norm_eps), head).float()
        stats.compute_seconds += time.perf_counter() - c0
        return logits


class LayerExperts:
    """A layer's routed experts as its MoE asks for them (model.moe.ExpertFetch): called with a routing,
    the provider's read of the chosen ones, seen first by the observers (``routes``: their on_route
    callbacks). ``held()`` offers every expert of the layer at once where the provider holds them all in
    memory and no observer watches the routing (a routing computed inside a native call is not seen);
    whoever computes with them tells the choice afterwards (``count``). Either way the choice goes to
    ``choices`` (the observers' on_choice callbacks)."""

    def __init__(self, provider, i: int, stats: PassStats, routes, choices=()):
        self.provider, self.i, self.stats, self.routes, self.choices = provider, i, stats, routes, choices

    def __call__(self, ids, x, residual):
        for on_route in self.routes:
            on_route(self.i, ids, x)
        for on_choice in self.choices:
            on_choice(self.i, ids)
        return self.provider.experts(self.i, ids, self.stats, residual)

    def held(self):
        get = getattr(self.provider, "held_experts", None)
        return get(self.i) if get is not None and not self.routes else None

    def count(self, ids) -> None:
        for on_choice in self.choices:
            on_choice(self.i, ids)
        self.provider.count_experts(self.i, ids, self.stats)


@dataclass
class Seq:
    """One sequence's share of a pass: its new ids, its own state, and which logits it wants."""
    ids: list[int]
    state: DecodeState
    keep_states: bool = False  # record what a later rollback() needs (speculation)
    logits: str = "all"  # "all" positions | "last" position | "none" (a prompt chunk that is not the last)
    # Leave the logits on the compute device: a caller that only picks tokens from them (greedy
    # argmax) then reads back a few ids instead of a vocabulary-wide row per position.
    on_device: bool = False
    # The tokens its state may hold by the end of its generation (cached, prompt and new tokens; 0:
    # unknown). A decode-graph recorder sizes the state buffers for it at once, so that the graphs are
    # not recorded again as the sequence grows.
    reach: int = 0


class PendingPass:
    """A pass ``Engine.start_batch`` began: ``result()`` waits for its end and returns each sequence's
    logits as ``forward_batch`` does (once; passes of one engine end in the order they began)."""

    def __init__(self, engine: Engine, seqs: list[Seq], stats: PassStats, started: float,
                 finish: Callable[[], torch.Tensor]):
        self.engine, self.seqs, self.stats, self.started, self.finish = engine, seqs, stats, started, finish
        self.logits: torch.Tensor | None = None  # every wanted row's logits, once the pass ended
        self._argmax: list[list[int]] | None = None

    @torch.inference_mode()
    def result(self) -> list[torch.Tensor | None]:
        return self.engine.finish_batch(self)

    @torch.inference_mode()
    def argmax(self) -> list[list[int]]:
        """Each sequence's logit rows' argmax token ids (empty where it wanted none), after ``result()``:
        one argmax over all the pass's rows where the logits are and one read-back. Each sequence's own
        argmax would launch a kernel and wait for its ids once per sequence (on a GPU, ~30 us each: a
        millisecond a pass at 32 sequences)."""
        if self.finish is not None:
            raise RuntimeError("argmax() before result()")
        if self._argmax is None:
            flat = self.logits.argmax(dim=-1).tolist() if self.logits is not None and len(self.logits) else []
            self._argmax, start = [], 0
            for s in self.seqs:
                n = _logit_count(s)
                self._argmax.append(flat[start:start + n])
                start += n
        return self._argmax


def _wait_for(device: torch.device) -> None:
    """Wait until the work queued on `device` so far is done."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def _logit_count(s: Seq) -> int:
    return {"all": len(s.ids), "last": 1, "none": 0}[s.logits]


def last_rows(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The last row of each sequence's rows of t (`counts` rows each, one after another): a strided view
    for each run of sequences with as many rows, joined where there are several runs."""
    views = [t[rows].reshape(which.stop - which.start, n, *t.shape[1:])[:, -1] for which, rows, n in runs(counts)]
    return views[0] if len(views) == 1 else torch.cat(views)


def logit_rows(seqs: list[Seq]) -> torch.Tensor:
    """Which rows of a pass (all sequences' rows, concatenated) the sequences want logits of."""
    rows, start = [], 0
    for s in seqs:
        n = len(s.ids)
        rows.extend(range(start + n - _logit_count(s), start + n))
        start += n
    return torch.as_tensor(rows, dtype=torch.long)


def _check_batch(seqs: list[Seq], vocab: int) -> torch.Tensor:
    """All ids of the pass, concatenated, after checking each sequence's part."""
    if not seqs:
        raise ValueError("forward_batch() needs at least one sequence")
    if len({id(s.state) for s in seqs}) != len(seqs):
        raise ValueError("a decode state appears twice in one pass; each sequence needs its own")
    for s in seqs:
        if s.logits not in ("all", "last", "none"):
            raise ValueError(f"Seq.logits must be 'all', 'last' or 'none', got {s.logits!r}")
        if not s.ids:
            raise ValueError("forward() needs at least one token id")
    ids = [t for s in seqs for t in s.ids]
    # Checked on the host's list: a decode step has one id, and tensor ops here cost more than it.
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {vocab})")
    return torch.as_tensor(ids, dtype=torch.long)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's host ops on n threads inside (process-wide, like every thread count: the engine thread
    alone runs torch ops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
