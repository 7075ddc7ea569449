"""Per-sequence decode state: what each layer remembers between passes.

KDA layers keep their three conv tails and the recurrent state S per head; MLA layers keep the
normalized latent c_kv and the shared rope-part key per token (the absorbed-MLA cache).

Speculative decoding verifies several tokens in one pass and may keep only some of them. A pass
run with ``keep_states=True`` records, per KDA layer, the state before the pass and each new
position's (k, v, g, beta) and conv inputs; ``rollback(n)`` replays the accepted steps from those
(cheap: a few rank-1 updates) instead of storing a full S per position. MLA rolls back by length.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    conv: torch.Tensor  # [3, K-1, D] last K-1 pre-conv inputs of q, k, v
    S: torch.Tensor  # [heads, Dk, Dv] fp32
    # Set by a keep_states pass, cleared by rollback / the next pass:
    pending: dict | None = None


@dataclass
class MLAState:
    ckv: torch.Tensor  # [capacity, kv_lora] normalized latents
    krot: torch.Tensor  # [capacity, rope] shared rope-part keys
    length: int = 0

    def append(self, ckv: torch.Tensor, krot: torch.Tensor) -> None:
        n = ckv.shape[0]
        need = self.length + n
        if need > self.ckv.shape[0]:
            cap = max(need, 2 * self.ckv.shape[0], 16)
            self.ckv = _grow(self.ckv, cap)
            self.krot = _grow(self.krot, cap)
        self.ckv[self.length:need] = ckv
        self.krot[self.length:need] = krot
        self.length = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ckv[: self.length], self.krot[: self.length]


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    out = t.new_zeros((cap, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


@dataclass
class DecodeState:
    layers: list  # KDAState | MLAState per layer
    num_tokens: int = 0
    _pass_start: int | None = field(default=None, repr=False)

    def rollback(self, num_tokens: int) -> None:
        """Return to the state after ``num_tokens`` tokens, within the last keep_states pass."""
        if self._pass_start is None:
            raise RuntimeError("rollback() is only possible right after a forward(..., keep_states=True)")
        if not self._pass_start <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens: must be within [{self._pass_start}, "
                             f"{self.num_tokens}]")
        keep = num_tokens - self._pass_start
        for st in self.layers:
            if isinstance(st, KDAState):
                _kda_rollback(st, keep)
            else:
                st.length -= self.num_tokens - num_tokens
        self.num_tokens = num_tokens
        self._pass_start = None

    def begin_pass(self, keep_states: bool) -> None:
        for st in self.layers:
            if isinstance(st, KDAState):
                st.pending = None
        self._pass_start = self.num_tokens if keep_states else None

    def snapshot(self) -> "DecodeState":
        snap = copy.deepcopy(self)
        for st in snap.layers:
            if isinstance(st, MLAState):  # drop unused capacity
                st.ckv, st.krot = st.ckv[: st.length].clone(), st.krot[: st.length].clone()
        return snap

    def restore(self, snap: "DecodeState") -> None:
        fresh = copy.deepcopy(snap)
        self.layers, self.num_tokens, self._pass_start = fresh.layers, fresh.num_tokens, fresh._pass_start

    def max_abs_diff(self, other: "DecodeState") -> float:
        """Largest difference over every state tensor (inf when the shapes do not match)."""
        if self.num_tokens != other.num_tokens or len(self.layers) != len(other.layers):
            return float("inf")
        worst = 0.0
        for a, b in zip(self.layers, other.layers):
            pairs = ([(a.conv, b.conv), (a.S, b.S)] if isinstance(a, KDAState)
                     else list(zip(a.view(), b.view())))
            for x, y in pairs:
                if x.shape != y.shape:
                    return float("inf")
                if x.numel():
                    worst = max(worst, (x.float() - y.float()).abs().max().item())
        return worst


def _kda_rollback(st: KDAState, keep: int) -> None:
    from .kda import kda_recurrent  # the same step the decode path uses
    p = st.pending
    if p is None:
        return
    st.S = p["S0"].clone()
    if keep:
        _, st.S = kda_recurrent(p["q"][:keep], p["k"][:keep], p["v"][:keep], p["g"][:keep], p["beta"][:keep], st.S)
    # conv tail: the last K-1 pre-conv inputs among (old tail, first `keep` new inputs)
    Km1 = p["conv0"].shape[1]
    if Km1:
        seq = torch.cat([p["conv0"], p["xin"][:, :keep]], dim=1)
        st.conv = seq[:, seq.shape[1] - Km1:].clone()
    st.pending = None
