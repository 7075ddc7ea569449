"""One-token decode passes recorded once as a CUDA graph and replayed.

When every weight is resident on the device and every MoE layer's experts are stacked (the grouped
kernels read the routing on the device), a one-token decode pass is a fixed sequence of kernels
whose only inputs from the host are the token's embedding row and its position. Replaying that
sequence as a CUDA graph costs one launch, where the plain pass launches about a hundred kernels
per layer, each with its Python around it: on a fast GPU those launches, not memory, bound decoding.

What recording needs, and how it gets it:
- Fixed addresses. The recorder owns one set of state buffers (each KDA layer's conv tail and S,
  each MLA layer's latent cache of ``capacity`` rows). The sequence being decoded lives in them:
  its layer states point at the buffers, so decoding token after token copies nothing. When another
  sequence's turn comes, the previous one first gets copies of its tensors back, then the new
  one's are copied in. A state whose tensors were replaced meanwhile (a plain pass, a rollback,
  a restore) is copied in again the same way.
- No host reads. The MLA row to write and the causal mask come from a device position tensor
  (``MLAState.at``) instead of the host's length; KDA states are updated in place
  (``KDAState.in_place``); the embedding row is copied into a fixed input buffer.
- Capacity. A sequence longer than the buffers doubles them (outside any graph), and a new graph
  is recorded for the new capacity.

The first pass at a capacity runs eagerly through the same code (which also warms up cuBLAS and
the Triton autotuners: neither may run inside a recording) and the graph is recorded after it, for
the next pass. Prefill, several sequences, speculation's keep_states passes and streamed weights
run the plain pass. A recording that fails is reported once and the plain pass is used from then on.
"""
from __future__ import annotations

import sys
import time
import weakref

import torch

from ..model.state import KDAState, MLAState
from .pass_stats import PassStats

MIN_CAPACITY = 256  # MLA cache rows of the first buffers (then doubled as needed)
# PassStats fields a replay adds as the recorded pass counted them (what it reads does not change).
REPLAYED_COUNTS = ("bytes_on_device", "bytes_to_device", "experts_loaded")


class DecodeGraphs:
    def __init__(self, engine, record: bool = True):
        """record=False runs the recorded-mode pass eagerly every time (the CPU tests of this code)."""
        self.engine = engine
        self.record = record
        self.capacity = 0
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._owner = None  # weak reference to the DecodeState that lives in the buffers
        self.graph = None
        self.out: torch.Tensor | None = None
        self.counts: dict[str, int] = {}
        self.failed: str | None = None
        self.recorded = 0  # graphs recorded so far (one per capacity reached)
        self.replayed = 0
        self.record_seconds = 0.0  # spent recording (not running) graphs
        dev = engine.device
        self.x = torch.zeros(1, engine.cfg.hidden_size, dtype=engine.dtype, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        # The pass's input row and position are written on the host into page-locked buffers, so
        # their copies to the device are queued without waiting (a pageable copy waits, each time).
        pin = dev.type == "cuda"
        self.x_host = torch.zeros(1, engine.cfg.hidden_size, dtype=engine.dtype, pin_memory=pin)
        self.pos_host = torch.zeros(1, dtype=torch.long, pin_memory=pin)

    @staticmethod
    def possible(engine) -> bool:
        """A CUDA device, graphs not switched off, and a provider that holds everything a pass reads."""
        return (engine.device.type == "cuda" and engine.settings.cuda_graphs
                and getattr(engine.provider, "graph_ready", False))

    def applies(self, seqs) -> bool:
        s = seqs[0]
        return (self.failed is None and len(seqs) == 1 and len(s.ids) == 1 and not s.keep_states
                and s.logits != "none")

    def run(self, seq, ids_t: torch.Tensor, stats) -> torch.Tensor:
        """The pass of one sequence's one new token, queued; float32 logits [1, vocab] on the device."""
        t0 = time.perf_counter()
        state = seq.state
        n = state.num_tokens
        self._fit(n + 1)
        self._adopt(state)
        self.pos_host[0] = n
        self.x_host.copy_(self.engine.provider.globals()["embed"][ids_t])  # widened to fp32 here
        self.pos.copy_(self.pos_host, non_blocking=True)
        self.x.copy_(self.x_host, non_blocking=True)
        if self.graph is None:
            logits = self._recorded_mode(seq, stats, capture=False)
            if self.record:
                t1 = time.perf_counter()
                self._capture(seq)
                self.record_seconds += time.perf_counter() - t1
        else:
            self.graph.replay()
            self.replayed += 1
            logits = self.out.clone()  # the recorded output buffer is the next replay's
            for k, v in self.counts.items():
                setattr(stats, k, getattr(stats, k) + v)
        for st in state.layers:
            if isinstance(st, MLAState):
                st.length += 1
        stats.compute_seconds = time.perf_counter() - t0  # the whole pass (device_pass counted a part)
        return logits

    # -- recording -----------------------------------------------------------------------------
    def _recorded_mode(self, seq, stats, capture: bool):
        for st in seq.state.layers:
            if isinstance(st, KDAState):
                st.in_place = True
            else:
                st.at = self.pos
        try:
            if not capture:
                return self.engine.device_pass(self.x, [seq], stats)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.engine.device_pass(self.x, [seq], stats)
            return graph, out
        finally:
            for st in seq.state.layers:
                if isinstance(st, KDAState):
                    st.in_place = False
                else:
                    st.at = None

    def _capture(self, seq) -> None:
        stats = PassStats()
        try:
            self.graph, self.out = self._recorded_mode(seq, stats, capture=True)
        except Exception as e:  # a kernel or library that cannot be recorded: keep the plain pass
            self.failed = f"{type(e).__name__}: {e}"
            print(f"deltafin: recording the decode step as a CUDA graph failed ({self.failed}); "
                  "decoding without it", file=sys.stderr)
            self.graph = self.out = None
            return
        self.counts = {k: getattr(stats, k) for k in REPLAYED_COUNTS}
        self.recorded += 1

    # -- state buffers ---------------------------------------------------------------------------
    def _fit(self, need: int) -> None:
        """Buffers whose MLA caches hold `need` rows (new, larger ones drop the recorded graph)."""
        if need <= self.capacity:
            return
        owner = self._owner() if self._owner else None
        if owner is not None:
            self._release(owner)
        cap = max(MIN_CAPACITY, 1 << (need - 1).bit_length())
        self.graph = self.out = None
        self.buffers = []
        for st in self.engine.new_state().layers:
            if isinstance(st, KDAState):
                self.buffers.append((st.conv, st.S))
            else:
                self.buffers.append((st.ckv.new_zeros((cap, st.ckv.shape[1])),
                                     st.krot.new_zeros((cap, st.krot.shape[1]))))
        self.capacity = cap

    def _adopt(self, state) -> None:
        """Make `state` live in the buffers (copying in what is not there already)."""
        owner = self._owner() if self._owner else None
        if owner is not None and owner is not state:
            self._release(owner)
        for st, (a, b) in zip(state.layers, self.buffers):
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
        self._owner = weakref.ref(state)

    def _release(self, state) -> None:
        """Give `state` its own copies of whatever of it lives in the buffers."""
        mine = {id(t) for pair in self.buffers for t in pair}
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
        self._owner = None
