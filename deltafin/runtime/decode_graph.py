"""Decode, draft-check and prompt-piece passes recorded once as CUDA graphs and replayed.

A pass qualifies when its sequences feed one token each (decode), one token and n - 1 drafts each
(speculation's check, which keeps what a rollback needs and wants every row's logits), or prompt pieces
of a power of two rows up to PIECE_MAX_ROWS (the last row's logits or none; a server cuts short
prompts into such pieces, see runtime.scheduler), alone or beside decode rows: a newcomer's prompt is
read in the passes that decode the others. When
every weight is resident on the device and every MoE layer's experts are stacked (the grouped kernels
read the routing on the device), such a pass of B sequences is a fixed sequence of kernels whose only
inputs from the host are the rows' embeddings and their positions. Replaying that sequence as a CUDA
graph costs one launch, where the plain pass launches about a hundred kernels
per layer, each with its Python around it: on a fast GPU those launches, not memory, bound decoding,
and a batch of B sequences costs B times the launches of one.

What recording needs, and how it gets it:
- Fixed addresses: state slots. The recorder owns ``slots``, each one sequence's set of state
  buffers (every KDA layer's conv tail and S, every MLA layer's latent cache of ``capacity`` rows).
  A pass of B sequences runs over slots 0..B-1 (from ``base``), each sequence in the one it already
  lives in where that is among them, whatever order the sequences come in (the rows go in and the
  logits come back in their order): its layer states point at that slot's buffers, so decoding
  token after token copies nothing, and one sequence leaving moves at most the one in the last slot.
  A sequence that is not among those slots (a newcomer, one past them, a state whose tensors a plain
  pass, a rollback or a restore replaced) is copied into a free one, after the slot's previous owner
  got copies of its tensors back.
- No host reads. Each sequence's MLA rows to write and its causal mask come from device positions
  (``MLAState.at``, n elements of the pass's position tensor) instead of the host's length; KDA
  states are updated in place (``KDAState.in_place``); the embedding rows are copied into a fixed
  input buffer.
- A check pass's rollback records. A keep_states pass leaves per KDA layer what a rollback replays
  (``KDAState.pending``, tensors of the graph's own memory, refilled by every replay); the recorder
  keeps the records the recording made and hands them to the states again after each replay. The
  rollback writes into the slot's tensors, so the next pass finds the state in place.
- One graph per shape: (B, n, keep_states, base), n the rows each sequence feeds or, where they differ,
  the tuple of each one's in the order they run (decode rows first, then pieces by size: each run of
  sequences with as many rows sits in consecutive slots, so its states step as one block). A pass
  replays the graph recorded for its shape,
  over slots base..base+B-1; a new shape records a new graph (no padding: a padded row would need a
  slot that no sequence owns, and the shapes a server or a speculating decode sees settle quickly).
  Graphs share one memory pool. One process runs a pass at a time, at base 0; a model split across
  processes keeps several in flight, each at its own base (chosen by rank 0, dist.pipeline), so two
  groups of sequences taking turns each find their states where they left them.
- A rank's layers. On a rank of a split model the recorder replays that rank's layers only
  (``run_rows``): its input buffer takes the rows the rank receives (the residual stream and the
  block summaries so far), its output is the rows it hands on, and its slots hold its layers' states.
- Capacity. A sequence longer than the buffers doubles every slot's MLA caches (outside any graph),
  which drops the recorded graphs; they are recorded again at the new capacity as passes need them.
  Where sequences say how long they will grow (``Seq.reach``: a generation's prompt and new tokens),
  the buffers are sized for that at once, up to REACH_MAX_CAPACITY rows, so that a generation is not
  recorded again midway.
  Each layer's slots are entries of one stacked buffer, so the layers step the pass's B states as one
  tensor in place (``state.stacked``: no stacking copies in, no copies back out, one batched MLA
  attention); more sequences than slots double the slots, which drops the graphs too.

The first pass of a batch size at a capacity runs eagerly through the same code (which also warms up
cuBLAS and the Triton autotuners: neither may run inside a recording) and the graph is recorded
after it, for the next pass; a prompt piece's shape is recorded the second time it comes (a one-off
prompt of a generation does not pay a recording). Prompt pieces of other lengths, passes whose
sequences feed different numbers of rows, and streamed weights run the plain pass. A recording that
fails is reported once and passes of that shape run the plain pass from then on (other shapes still
record).
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import time
import weakref

import torch

from ..kernels.grouped import GROUPED_MAX_PAIRS
from ..model.kda import RECURRENT_MAX_ROWS
from ..model.state import KDAState, MLAState
from .pass_stats import PassStats

MIN_CAPACITY = 256  # MLA cache rows of the first buffers (then doubled as needed)
# The most MLA cache rows sized ahead for what sequences say they will reach (``Seq.reach``): a recorded
# pass attends over its buffers' every row, so room far beyond the tokens held costs every pass.
REACH_MAX_CAPACITY = 2048
MAX_GRAPH_ROWS = 64  # rows of the largest pass recorded, where the experts' kernels allow any
# The most state slots: passes in flight at once (a split model's pipeline) sit in slots of their own
# (``base``); a pass reaching past this many runs the plain pass, so no pass can grow the buffers further.
MAX_SLOTS = 2 * MAX_GRAPH_ROWS
# The longest prompt piece a graph takes (its sizes are powers of two up to it): up to here the plain pass
# steps KDA's recurrence row by row too, as a recorded pass does (a fresh sequence's MLA attention is the
# one difference: the plain pass expands its keys, a recorded one stays latent; the same within float32
# rounding); longer pieces take the chunked form, at matrix speed, in the plain pass.
PIECE_MAX_ROWS = RECURRENT_MAX_ROWS
# PassStats fields a replay adds as the recorded pass counted them (what it reads does not change).
REPLAYED_COUNTS = ("bytes_on_device", "bytes_to_device", "experts_loaded")


class DecodeGraphs:
    def __init__(self, engine, record: bool = True):
        """record=False runs the recorded-mode pass eagerly every time (the CPU tests of this code)."""
        self.engine = engine
        self.record = record
        cfg = engine.cfg
        # Up to the rows whose routed experts the grouped kernels take (past that the per-expert
        # path reads the routing back to the host, which a graph cannot); MAX_GRAPH_ROWS when every
        # stack takes the grouped GEMMs, which take any number of rows.
        any_rows = getattr(engine.provider, "stacks_take_any_rows", False)
        self.max_rows = MAX_GRAPH_ROWS if any_rows else max(1, GROUPED_MAX_PAIRS // max(1, cfg.experts_per_token))
        self.capacity = 0
        self.slots: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # slot -> per layer (a, b)
        self._owners: list = []  # slot -> weak reference to the DecodeState living in it, or None
        self.graphs: dict[tuple, tuple] = {}  # (B, n, keep, base) -> (graph, output, counts, rollback records)
        self._pool = None
        self.failed: str | None = None  # the last recording that failed, why
        self.failed_shapes: set[tuple] = set()  # shapes whose recording failed: they run the plain pass
        self.recorded = 0  # graphs recorded so far (one per batch size and capacity reached)
        self.replayed = 0
        # one token of each sequence | drafts checked | prompt pieces | decode rows and prompt pieces together
        self.replayed_by_kind = {"decode": 0, "check": 0, "prompt": 0, "mixed": 0}
        self._pieces_seen: set[tuple] = set()  # prompt-piece shapes run once (recorded the next time)
        self.record_seconds = 0.0  # spent recording (not running) graphs
        self.moved_in = 0  # sequences whose states were copied into a slot (not already living there)
        # The whole pass (token ids in, logits out: ``run``), or this rank's layers of a model split
        # across processes (rows in, rows out: ``run_rows``).
        self.whole = engine.layers == range(cfg.num_layers)
        dev = engine.device
        # The pass's input: [1, rows, H] embedding rows for the whole pass; for a rank's layers the rows it
        # receives, [summaries + 1, rows, H] (under Block Attention Residuals the block summaries so far
        # travel with the residual stream), sized at its first pass.
        self.x = torch.zeros(1, self.max_rows, cfg.hidden_size, dtype=engine.dtype, device=dev)
        self.pos = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        # The pass's input rows and positions are written on the host into page-locked buffers, so
        # their copies to the device are queued without waiting (a pageable copy waits, each time).
        pin = dev.type == "cuda"
        self.x_host = (torch.zeros(self.max_rows, cfg.hidden_size, dtype=engine.dtype, pin_memory=pin)
                       if self.whole else None)
        self.pos_host = torch.zeros(self.max_rows, dtype=torch.long, pin_memory=pin)
        # Marks the end of the last copies out of those buffers: they are not written again before it (a
        # pass whose sequences want no logits reads nothing back, so nothing else waits for the device).
        self._copied = torch.cuda.Event() if pin else None

    @staticmethod
    def possible(engine) -> bool:
        """A CUDA device, graphs not switched off, and a provider that holds everything a pass reads."""
        return (engine.device.type == "cuda" and engine.settings.cuda_graphs
                and getattr(engine.provider, "graph_ready", False))

    def applies(self, seqs, base: int = 0) -> bool:
        ns, keep = sorted(len(s.ids) for s in seqs), seqs[0].keep_states
        if shape_of(seqs, base)[:3] in self.failed_shapes or sum(ns) > self.max_rows \
                or base + len(seqs) > MAX_SLOTS or any(s.keep_states != keep for s in seqs):
            return False
        if keep:  # a check pass: every sequence a token and as many drafts, every row's logits wanted
            return ns[0] == ns[-1] and all(s.logits == "all" for s in seqs)
        if ns[-1] > 1 and not self.whole:  # a rank's layers take its rows in the order they come
            return ns[0] == ns[-1] and all(s.logits in ("last", "none") and piece_size(len(s.ids)) == len(s.ids)
                                           for s in seqs)
        # decode steps (or one-token prompt pieces), and prompt pieces of a few sizes beside them
        return all(s.logits in ("all", "last", "none") if len(s.ids) == 1
                   else s.logits in ("last", "none") and piece_size(len(s.ids)) == len(s.ids) for s in seqs)

    @property
    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every slot's state buffers, (a, b) per layer and slot."""
        return [pair for slot in self.slots for pair in slot]

    def run(self, seqs, ids_t: torch.Tensor, stats: PassStats) -> torch.Tensor:
        """The whole pass of B sequences' n new rows each, queued; float32 logits of the rows they want
        on the device ([B * n, vocab] for a check pass)."""
        t0 = time.perf_counter()
        B = len(seqs)
        # The pass runs over the sequences as they sit in the slots; `at[b]`: where the b-th given one ran.
        order = self._placement(seqs, 0)
        at = list(range(B))
        if order is not None:
            for j, b in enumerate(order):
                at[b] = j
            first = [0]
            for s in seqs:
                first.append(first[-1] + len(s.ids))
            ids_t = torch.cat([ids_t[first[b]:first[b + 1]] for b in order])
        ran = seqs if order is None else [seqs[b] for b in order]
        rows = self._seat(ran, 0)
        self.x_host[:rows] = self.engine.provider.globals()["embed"][ids_t]  # widened to fp32 here
        self.x[0, :rows].copy_(self.x_host[:rows], non_blocking=True)
        self._mark_copied()
        # Rows picked by slices joined in one kernel: indexing a device tensor with a host list copies the
        # list from pageable memory, which waits for the pass queued before it.
        wanted = [at[b] for b, s in enumerate(seqs) if s.logits != "none"]
        if len(wanted) == B:  # a check pass (every row), or one row or the last of each
            out = self._pass(ran, stats, 0, t0)
            if order is None:
                return out
            each = out.view(B, -1, out.shape[-1])
            return torch.cat([each[j] for j in at])
        # Without rollback states a pass records every sequence's last row's logits (one shape, whatever
        # they asked), and hands on those of the sequences that want them.
        out = self._pass([dataclasses.replace(s, logits="last") for s in ran], stats, 0, t0)
        return torch.cat([out[j:j + 1] for j in wanted]) if wanted else out[:0]

    def run_rows(self, seqs, x: torch.Tensor, stats: PassStats, base: int = 0) -> torch.Tensor:
        """This rank's layers over the pass's rows x [summaries + 1, B * n, H] (on the device, as
        received), its sequences in slots base..base+B-1, queued; the rows after them, stacked alike
        (the summaries the layers began appended). Passes in flight together take different bases
        (dist.pipeline), so that neither moves the other's states out of their slots."""
        t0 = time.perf_counter()
        if x.shape[0] != self.x.shape[0]:  # the rank's first pass: its input's width is now known
            self.x = self.x.new_zeros((x.shape[0], *self.x.shape[1:]))
            self.graphs, self._pool = {}, None
        rows = self._seat(seqs, base)
        self._mark_copied()
        self.x[:, :rows].copy_(x)
        return self._pass(seqs, stats, base, t0)

    def _placement(self, seqs, base: int) -> list[int] | None:
        """The order to run a pass's sequences in over slots base..base+B-1: those feeding fewer rows
        first (decode rows, then prompt pieces by size: each run's rows, states and positions are one
        block), and within its run's slots each one already living in one of them stays there (the
        others take the free ones, in turn). Indices into seqs, or None where that is their own order.
        Sequences come and go in any order, and a pass over slots in its own order would move every
        sequence after one that left (a move is two copies a layer, and two more giving the slot's
        previous owner its own tensors back)."""
        B = len(seqs)
        where = {}
        if base + B <= len(self.slots):  # else the slots are made again for this pass: none holds a sequence
            for j in range(B):
                owner = self._owner(base + j)
                if owner is not None:
                    where[id(owner)] = j
        order: list[int | None] = [None] * B
        start = 0
        for n in sorted({len(s.ids) for s in seqs}):
            run = [b for b, s in enumerate(seqs) if len(s.ids) == n]
            span = range(start, start + len(run))
            rest = []
            for b in run:
                j = where.get(id(seqs[b].state))
                if j in span:
                    order[j] = b
                else:
                    rest.append(b)
            free = (j for j in span if order[j] is None)
            for b in rest:
                order[next(free)] = b
            start += len(run)
        return None if order == list(range(B)) else order

    def _seat(self, seqs, base: int) -> int:
        """Slots for the pass's sequences (each moved into its own, from `base` on) and its rows'
        positions queued; the pass's rows."""
        B = len(seqs)
        reach = min(max(s.reach for s in seqs), REACH_MAX_CAPACITY)  # room sized once for what they will hold
        self._fit(max(max(s.state.num_tokens + len(s.ids) for s in seqs), reach), base + B)
        for b, s in enumerate(seqs):
            self._adopt(s.state, base + b)
        rows = sum(len(s.ids) for s in seqs)
        if self._copied is not None:
            self._copied.synchronize()  # the last pass's copies out of the page-locked buffers are done
        self.pos_host[:rows] = torch.tensor([s.state.num_tokens + j for s in seqs for j in range(len(s.ids))])
        self.pos[:rows].copy_(self.pos_host[:rows], non_blocking=True)
        return rows

    def _mark_copied(self) -> None:
        if self._copied is not None:
            self._copied.record()

    def _pass(self, seqs, stats: PassStats, base: int, t0: float) -> torch.Tensor:
        """The pass over the input in place: recorded mode (then recorded) for a new shape, else replayed."""
        ns, keep = [len(s.ids) for s in seqs], seqs[0].keep_states
        shape = shape_of(seqs, base)
        recorded = self.graphs.get(shape)
        if recorded is None:
            out = self._recorded_mode(seqs, stats, capture=False)
            once = max(ns) > 1 and not keep and shape not in self._pieces_seen  # a prompt piece's first time
            if once:
                self._pieces_seen.add(shape)
            elif self.record:
                t1 = time.perf_counter()
                self._capture(seqs, base)
                self.record_seconds += time.perf_counter() - t1
        else:
            graph, recorded_out, counts, records = recorded
            graph.replay()
            self.replayed += 1
            self.replayed_by_kind["check" if keep else "decode" if max(ns) == 1 else "prompt" if min(ns) > 1
                                  else "mixed"] += 1
            out = recorded_out.clone()  # the recorded output buffer is the next replay's
            for k, v in counts.items():
                setattr(stats, k, getattr(stats, k) + v)
            _give_pending(seqs, records)  # what a rollback replays, refilled by this replay
        for s in seqs:
            for st in s.state.layers:
                if isinstance(st, MLAState):
                    st.length += len(s.ids)
        stats.compute_seconds = time.perf_counter() - t0  # the whole pass (device_pass counted a part)
        return out

    # -- recording -----------------------------------------------------------------------------
    def _recorded_mode(self, seqs, stats: PassStats, capture: bool):
        rows = 0
        for s in seqs:
            n = len(s.ids)
            for st in s.state.layers:
                if isinstance(st, KDAState):
                    st.in_place = True
                else:
                    st.at = self.pos[rows:rows + n]
            rows += n
        try:
            if not capture:
                return self._forward(rows, seqs, stats)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # No cyclic collection inside a recording: a dropped model is a cycle (engine <->
            # recorder) holding graphs, and a graph freed while another records invalidates that
            # recording. The garbage waits for the next collection after it.
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    out = self._forward(rows, seqs, stats)
            finally:
                if collecting:
                    gc.enable()
            return graph, out
        finally:
            for s in seqs:
                for st in s.state.layers:
                    if isinstance(st, KDAState):
                        st.in_place = False
                    else:
                        st.at = None

    def _forward(self, rows: int, seqs, stats: PassStats) -> torch.Tensor:
        """What a pass computes from its input buffer: the logits, or this rank's rows stacked."""
        if self.whole:
            return self.engine.device_pass(self.x[0, :rows], seqs, stats)
        return self.engine.run_stacked(self.x[:, :rows], seqs, stats)

    def _capture(self, seqs, base: int) -> None:
        stats = PassStats()
        shape = shape_of(seqs, base)
        # Recording runs the pass's Python again: the rollback records it leaves are the graph's
        # (filled by replays), while the states keep those of the pass that just ran.
        ran = _pending(seqs)
        try:
            graph, out = self._recorded_mode(seqs, stats, capture=True)
        except Exception as e:  # a kernel or library that cannot be recorded: keep the plain pass
            _give_pending(seqs, ran)
            # for this shape only (a kernel of batches may not record where one-row passes do); the
            # pool the failed recording drew from is dropped with every graph in it
            self.failed = f"{type(e).__name__}: {e}"
            self.failed_shapes.add(shape[:3])
            rows = f"x {shape[1]} row(s)" if isinstance(shape[1], int) else f"of {', '.join(map(str, shape[1]))} rows"
            print(f"deltafin: recording the decode pass of {shape[0]} sequence(s) {rows} as a CUDA "
                  f"graph failed ({self.failed}); such passes run without it", file=sys.stderr)
            self.graphs, self._pool = {}, None
            return
        records = _pending(seqs)
        _give_pending(seqs, ran)
        self.graphs[shape] = (graph, out, {k: getattr(stats, k) for k in REPLAYED_COUNTS}, records)
        self.recorded += 1

    # -- state slots -----------------------------------------------------------------------------
    def _fit(self, need: int, batch: int) -> None:
        """Slots for `batch` sequences whose MLA caches hold `need` rows. Each layer's slots are one
        stacked buffer (slot i is entry i), so a pass over slots 0..B-1 reads and writes every state
        of a layer as one tensor; a larger capacity or more slots replace every buffer (the count
        doubling) and drop the recorded graphs."""
        if need <= self.capacity and batch <= len(self.slots):
            return
        for slot in range(len(self.slots)):
            self._release(slot)
        self.capacity = max(self.capacity, MIN_CAPACITY, 1 << (need - 1).bit_length())
        count = max(batch, 2 * len(self.slots)) if batch > len(self.slots) else len(self.slots)
        stacks = []
        for st in self.engine.layer_states():
            if isinstance(st, KDAState):
                stacks.append((st.conv.new_zeros((count, *st.conv.shape)), st.S.new_zeros((count, *st.S.shape))))
            else:
                stacks.append((st.ckv.new_zeros((count, self.capacity, st.ckv.shape[1])),
                               st.krot.new_zeros((count, self.capacity, st.krot.shape[1]))))
        self.slots = [[(a[i], b[i]) for a, b in stacks] for i in range(count)]
        # A pool whose graphs are all gone is freed: the next recording starts a new one.
        self._owners, self.graphs, self._pool = [None] * count, {}, None

    def slot_of(self, state) -> int | None:
        """The slot `state` lives in (None: none)."""
        return next((i for i in range(len(self._owners)) if self._owner(i) is state), None)

    def _owner(self, slot: int):
        ref = self._owners[slot]
        return ref() if ref is not None else None

    def _adopt(self, state, slot: int) -> None:
        """Make `state` live in `slot` (copying in what is not there already)."""
        if self._owner(slot) is not state:
            self.moved_in += 1
            self._release(slot)
            for other in range(len(self.slots)):
                if other != slot and self._owner(other) is state:
                    self._owners[other] = None  # copied out of there below
        for st, (a, b) in zip(state.layers, self.slots[slot]):
            if isinstance(st, KDAState):
                if st.conv is not a:
                    a.copy_(st.conv)
                    st.conv = a
                if st.S is not b:
                    b.copy_(st.S)
                    st.S = b
                continue
            if st.length != state.num_tokens:
                raise RuntimeError(f"an MLA layer holds {st.length} tokens, the state {state.num_tokens}")
            if st.ckv is not a:
                a[: st.length].copy_(st.ckv[: st.length])
                b[: st.length].copy_(st.krot[: st.length])
                st.ckv, st.krot = a, b
        self._owners[slot] = weakref.ref(state)

    def _release(self, slot: int) -> None:
        """Give the state living in `slot` its own copies of whatever of it lives in the slot's buffers."""
        state = self._owner(slot)
        self._owners[slot] = None
        if state is None:
            return
        mine = {id(t) for pair in self.slots[slot] for t in pair}
        for st in state.layers:
            if isinstance(st, KDAState):
                if id(st.conv) in mine:
                    st.conv = st.conv.clone()
                if id(st.S) in mine:
                    st.S = st.S.clone()
                if st.pending:  # a keep_states pass's start state may be a buffer
                    st.pending = {k: v.clone() if id(v) in mine else v for k, v in st.pending.items()}
            elif id(st.ckv) in mine:
                st.ckv, st.krot = st.ckv[: st.length].clone(), st.krot[: st.length].clone()


def shape_of(seqs, base: int) -> tuple:
    """A pass's recorded shape: (B, n, keep_states, base), n the rows every sequence feeds or, where they
    differ (decode rows beside prompt pieces), each one's in the order they run (fewer rows first)."""
    ns = tuple(sorted(len(s.ids) for s in seqs))
    return len(seqs), ns[0] if len(set(ns)) == 1 else ns, seqs[0].keep_states, base


def piece_size(left: int) -> int:
    """The prompt piece a recorded pass takes from a prompt with `left` tokens to go: the largest power of
    two up to PIECE_MAX_ROWS (a few shapes cover every prompt: 23 tokens are pieces of 16, 4, 2 and 1)."""
    return 1 << (max(1, min(left, PIECE_MAX_ROWS)).bit_length() - 1)


def _pending(seqs) -> list[list]:
    """Each sequence's rollback records, per layer (None for MLA layers and passes that keep none)."""
    return [[st.pending if isinstance(st, KDAState) else None for st in s.state.layers] for s in seqs]


def _give_pending(seqs, records: list[list]) -> None:
    for s, layers in zip(seqs, records):
        for st, pending in zip(s.state.layers, layers):
            if isinstance(st, KDAState):
                st.pending = pending
