"""One-token CPU passes of a model held in RAM replayed as the native calls they make.

With every weight in RAM, a decode pass on the CPU is one native call per layer half (``kda_block``,
``mla_block``, ``moe_block_silu``, ``mlp_block_silu``) and two for the head (``rms_norm``,
``dense_gemv``): the products read the weights at memory speed, and what is left between them is the
model's Python (binding the layer's weights, the checks, the arguments of each call), about 2 ms of a
23 ms kl_medium token, while the other compute threads wait. A pass here records the calls once
(``cpu_native.recording``) and later passes of the same shape make them again, in order, with the same
arguments: the same addresses, so each call reads what the previous one wrote.

What makes the same arguments right for a later pass:
- Its rows: the token's embedding is copied into the input the recording read.
- The states: each sequence's KDA conv tail and S are updated in place by the calls, and its MLA caches
  have room for the new row (``MLAState.reserve``, done before the pass). A pass replays only when
  every state tensor is at the address the recording saw (same sequences, in the same order, no cache
  grown, no state restored or rolled back into new tensors); else it runs the model's Python and is
  recorded again.
- The lengths: the MLA calls' arrays of cache lengths are rewritten before each replay.
- The weights: the provider's weight objects are those of the recording (the sensitivity tool swaps
  weights in place; a streamed model's cache may drop weights and read them again; such a pass is
  recorded again). The recording holds them, and every intermediate tensor, so no address in it can be
  freed under it. A streamed model replays only while its cache holds every weight (its ``held`` is None
  else), and a drop clears the recordings at once (``forget``), so they do not keep dropped memory.
- The calls are all there is: the recording is used only when each call read exactly what the previous
  one wrote (the first the input rows, the last wrote the logits). A pass with anything else between
  its calls (a torch op, a layer that does not take its one native call) is not replayed, ever, for
  that shape.

Counting stays the pass's: the provider counts the globals', the spines' and the chosen experts' bytes
as a plain pass does. A pass whose routing an observer watches, or that keeps rollback states (a
speculation check), runs the plain pass.
"""
from __future__ import annotations

import operator
import time

import torch

from ..kernels import cpu_native
from ..model.mla import native_attend_reaches
from ..model.state import KDAState, MLAState
from .pass_stats import PassStats


class Recorded:
    """A recorded pass: its calls, what it read first, and the logits it wrote."""

    def __init__(self, calls: list[cpu_native.NativeCall], states: tuple, weights: list, mla_layers: list[int],
                 moe_layers: list[int]):
        self.calls = calls
        self.x, self.logits = calls[0].src, calls[-1].out
        self.states = states  # the state tensors' addresses, per sequence and layer
        self.weights = weights  # the provider's weight objects, held
        self.lengths = [(c.lengths, i) for c, i in zip((c for c in calls if c.lengths is not None), mla_layers)]
        self.ids = [(i, c.ids) for c, i in zip((c for c in calls if c.ids is not None), moe_layers)]


class CpuReplay:
    def __init__(self, engine):
        self.engine = engine
        cfg = engine.cfg
        self.mla_layers = [i for i in engine.layers if i not in cfg.kda_layers]
        self.moe_layers = [i for i in engine.layers if cfg.is_moe(i)]
        self.recordings: dict[tuple, Recorded] = {}  # (sequences, threads) -> the latest recording
        self.failed: dict[tuple, str] = {}  # shapes whose passes are not calls alone, and why
        self.recorded = 0
        self.replayed = 0
        # A provider whose RAM may give weights up (a streamed model's cache) says when it does: the
        # recordings hold them, and let them go with it.
        if hasattr(engine.provider, "on_drop"):
            engine.provider.on_drop.append(self.forget)

    @staticmethod
    def possible(engine) -> bool:
        """The CPU, switched on, float32 products, a provider that may hold every weight in RAM and hand
        them out (``held``: the resident one always, a streamed one once its cache holds the whole
        model), and layers without attention residuals (whose depth mix runs in torch)."""
        provider = engine.provider
        return (engine.device.type == "cpu" and engine.settings.cpu_replay and engine.matmul_dtype == torch.float32
                and callable(getattr(provider, "held", None)) and callable(getattr(provider, "held_experts", None))
                and not engine.cfg.attn_res_block_size and cpu_native.available())

    def applies(self, seqs) -> bool:
        """One new row of each sequence, its logits wanted, no rollback kept, every MLA cache within
        what the native attention takes (past it the layer attends in torch)."""
        if (len(seqs), cpu_native.pass_threads()) in self.failed or len(seqs) > cpu_native.GEMV_MAX_ROWS \
                or self.engine.provider.held() is None:
            return False
        return all(len(s.ids) == 1 and not s.keep_states and s.logits in ("all", "last")
                   and all(native_attend_reaches(self.engine.cfg, st.length + 1)
                           for st in s.state.layers if isinstance(st, MLAState)) for s in seqs)

    def run(self, seqs, ids_t: torch.Tensor, stats: PassStats) -> torch.Tensor:
        """The pass: replayed where a recording of its shape fits it, else run (and recorded). Float32
        logits [sequences, vocab]."""
        engine = self.engine
        key = (len(seqs), cpu_native.pass_threads())
        for s in seqs:
            for st in s.state.layers:
                if isinstance(st, MLAState):
                    st.reserve(1)
        states = _addresses(seqs)
        weights = self._weights()
        rec = self.recordings.get(key)
        if rec is None or rec.states != states or not _same(rec.weights, weights):
            return self._record(key, seqs, ids_t, stats, states, weights)
        c0 = time.perf_counter()
        rec.x.copy_(engine.embed(ids_t))
        for lengths, i in rec.lengths:
            for b, s in enumerate(seqs):
                lengths[b] = s.state.layers[i].length + 1
        provider = engine.provider
        provider.start_pass(stats)
        for i in engine.layers:
            provider.spine(i, stats)  # counts the spine's bytes
        cpu_native.replay(rec.calls)
        for s in seqs:
            for st in s.state.layers:
                if isinstance(st, MLAState):
                    st.length += 1
        for i, ids in rec.ids:
            for on_choice in engine.choices:
                on_choice(i, ids)
            provider.count_experts(i, ids, stats)
        provider.end_pass(stats)
        self.replayed += 1
        stats.compute_seconds += time.perf_counter() - c0
        return rec.logits.clone()  # the recorded logits are the next replay's

    def _record(self, key, seqs, ids_t, stats, states, weights) -> torch.Tensor:
        self.recordings.pop(key, None)
        x = self.engine.embed(ids_t)
        with cpu_native.recording() as calls:
            logits = self.engine.device_pass(x, seqs, stats)
        why = _not_calls_alone(calls, x, logits)
        if why is None and sum(c.lengths is not None for c in calls) != len(self.mla_layers):
            why = "an MLA layer attended outside its native call"
        if why is None and sum(c.ids is not None for c in calls) != len(self.moe_layers):
            why = "a MoE layer computed outside its native call"
        if why is not None:
            self.failed[key] = why
        else:
            self.recordings[key] = Recorded(calls, states, weights, self.mla_layers, self.moe_layers)
            self.recorded += 1
            logits = logits.clone()  # the recorded logits are the next replay's
        return logits

    def forget(self) -> None:
        """The provider gave up weights (maybe from another thread): drop the recordings holding them,
        and what failed with them (a layer kept partly in the store's layout may be whole again)."""
        self.recordings.clear()
        self.failed.clear()

    def _weights(self) -> list:
        """Every weight object the provider holds, in a fixed order."""
        globals_, spines, experts = self.engine.provider.held()
        out = list(globals_.values())
        for d in (*spines, *experts):
            out.extend(d.values())
        return out


def _addresses(seqs) -> tuple:
    return tuple((st.conv.data_ptr(), st.S.data_ptr()) if isinstance(st, KDAState) else (st.ckv.data_ptr(), st.krot.data_ptr())
                 for s in seqs for st in s.state.layers)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _not_calls_alone(calls: list[cpu_native.NativeCall], x: torch.Tensor, logits: torch.Tensor) -> str | None:
    """Why the recorded calls are not the whole pass (None: each read what the one before it wrote)."""
    if not calls:
        return "no native call"
    before = x
    for c in calls:
        if c.src.data_ptr() != before.data_ptr() or c.src.shape != before.shape:
            return f"something ran before {c.who} in torch"
        before = c.out
    if before.data_ptr() != logits.data_ptr() or before.shape != logits.shape:
        return "the logits were not the last call's"
    return None
