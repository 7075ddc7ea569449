"""The in-RAM provider: every weight read once at load, then served from memory."""
from __future__ import annotations

import time
from concurrent.futures import Future

from ..checkpoint.sizes import weight_bytes
from ..kernels.linear import interleaved
from ..model.moe import chosen_experts


def cpu_layout(name: str, w):
    """A weight held in RAM as the CPU's native products read it fastest: grouped int8 interleaved
    (kernels/linear.py ``interleaved``, in place: `w` is handed over), except attention's latent
    projection, whose transposed products read it by columns; anything else as it is."""
    return w if name.endswith("kv_b_proj") else interleaved(w)


def spine_in_cpu_layout(weights: dict) -> dict:
    return {k: cpu_layout(k, w) for k, w in weights.items()}


def expert_in_cpu_layout(weights: tuple) -> tuple:
    return tuple(cpu_layout("expert", w) for w in weights)


class HeldExperts(dict):
    """A layer's experts held in memory, {expert id: (w1, w3, w2)}. What a kernel derives from all of them
    at once (kernels/experts_cpu.py ``held_table``) is kept on it, so it lives as long as they do."""


def done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class RAMProvider:
    def __init__(self, source, progress=None, layers: range | None = None, with_globals: bool = True):
        """``layers``: the layers whose weights are read (default all; a rank of a split model reads
        its own); ``with_globals``: whether the embedding, head and final norm are read too."""
        cfg = self.config = source.config
        self._globals = source.read_globals() if with_globals else {}
        embed = self._globals.get("embed")
        # Per pass every global but the embedding is read (the head, the final norm); of the
        # embedding one row per token, as the streamer counts them.
        self._embed_row_bytes = weight_bytes(embed) // max(1, embed.shape[0]) if embed is not None else 0
        self._global_pass_bytes = sum(weight_bytes(w) for k, w in self._globals.items() if k != "embed")
        # Indexed by layer; layers outside `layers` hold nothing.
        self._spines: list[dict] = [{} for _ in range(cfg.num_layers)]
        self._experts: list[dict] = [{} for _ in range(cfg.num_layers)]
        layers = range(cfg.num_layers) if layers is None else layers
        self._globals = spine_in_cpu_layout(self._globals)
        for i in (progress(layers) if progress else layers):
            self._spines[i] = spine_in_cpu_layout(source.read_spine(i))
            self._experts[i] = HeldExperts({e: expert_in_cpu_layout(source.read_expert(i, e))
                                            for e in range(cfg.num_experts)} if cfg.is_moe(i) else {})
        self._spine_bytes = [sum(weight_bytes(w) for w in s.values()) for s in self._spines]
        # counted once here: summing them per expert per layer per pass cost ~8% of a batched pass
        self._expert_bytes = [{e: weight_bytes(w) for e, w in layer.items()} for layer in self._experts]

    def globals(self) -> dict:
        return self._globals

    def held(self) -> tuple[dict, list[dict], list[dict]]:
        """The weights themselves: the globals, each layer's spine, each layer's {expert: (w1, w3, w2)}.
        A caller may swap entries in place (the sensitivity tool puts re-encoded weights there); the
        byte counts stay those of the weights read at load."""
        return self._globals, self._spines, self._experts

    def start_pass(self, stats) -> None:
        stats.bytes_from_ram += self._global_pass_bytes + self._embed_row_bytes * stats.tokens

    def end_pass(self, stats) -> None:
        pass

    def spine(self, i: int, stats) -> dict:
        stats.bytes_from_ram += self._spine_bytes[i]
        return self._spines[i]

    def experts(self, i: int, ids, stats, residual=None) -> Future:
        t0 = time.perf_counter()
        got = {e: self._experts[i][e] for e in chosen_experts(ids)}
        self._count(i, got, stats)
        stats.expert_wait_seconds += time.perf_counter() - t0
        return done(got)

    def held_experts(self, i: int) -> HeldExperts:
        """Every expert of layer i, for a layer that computes with them before it knows its choice (a
        resident MoE layer in one native call); it then tells the choice (``count_experts``)."""
        return self._experts[i]

    def count_experts(self, i: int, ids, stats) -> None:
        """Account the experts of layer i that a routing chose, as ``experts`` does for what it hands out."""
        self._count(i, chosen_experts(ids), stats)

    def _count(self, i: int, chosen, stats) -> None:
        stats.bytes_from_ram += sum(self._expert_bytes[i][e] for e in chosen)
        stats.experts_loaded += len(chosen)
