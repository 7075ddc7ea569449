"""One forward pass over all layers: get the layer's weights, bind, compute, account.

The engine does not know where weights come from. A *provider* hands it each layer's spine (in
order, so it can read ahead) and the routed experts the router chose; ``io.ram`` keeps a whole
model in memory, ``io.stream`` reads it from disk per layer. Timing and byte counts are kept in a
``PassStats`` the engine owns and returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .model.binding import bind, slot_names, unbind
from .model.layers import attn_res, build_templates, layer_kind
from .model.ops import HalfMatmul, linear, rms_norm
from .model.state import DecodeState
from .settings import Settings


# 2-D slots that are not used as matrix products (router scores, depth-mix pseudo-queries, conv
# taps): they stay in their stored precision whatever the product dtype.
NOT_PRODUCTS = {"mlp.gate", "attn_res_proj", "mlp_res_proj", "self_attn.q_conv", "self_attn.k_conv",
                "self_attn.v_conv"}


@dataclass
class PassStats:
    tokens: int = 0
    seconds: float = 0.0
    compute_seconds: float = 0.0
    spine_wait_seconds: float = 0.0
    expert_wait_seconds: float = 0.0
    bytes_read: int = 0
    bytes_from_ram: int = 0
    experts_loaded: int = 0

    def add(self, other: "PassStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


def to_device(w, device):
    if isinstance(w, HalfMatmul):
        return HalfMatmul(to_device(w.weight, device), w.dtype)
    return w.to(device, non_blocking=True) if isinstance(w, torch.Tensor) else w.to(device)


class _OnDevice:
    """An expert read whose result is moved to the compute device when the layer asks for it."""

    def __init__(self, pending, engine: "Engine"):
        self.pending, self.device = pending, engine.device

    def result(self) -> dict:
        got = self.pending.result()
        if self.device.type == "cpu":
            return got
        return {e: tuple(to_device(w, self.device) for w in ws) for e, ws in got.items()}


class Engine:
    def __init__(self, cfg: ModelConfig, provider, settings: Settings):
        self.cfg = cfg
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
        self._head = None  # (provider globals, the same moved to the device)

    def new_state(self) -> DecodeState:
        layers = []
        for i in range(self.cfg.num_layers):
            attn = self.templates[layer_kind(self.cfg, i)].self_attn
            layers.append(attn.new_state(self.dtype, self.device))
        return DecodeState(layers=layers)

    def _on_device(self, weights: dict) -> dict:
        if self.device.type == "cpu":
            return weights
        return {k: to_device(w, self.device) for k, w in weights.items()}

    def _head_on_device(self, g: dict) -> dict:
        """The head's weights, moved to the compute device once (the embedding table stays put)."""
        if self.device.type == "cpu":
            return g
        if self._head is None or self._head[0] is not g:
            self._head = (g, {k: w if k == "embed" else to_device(w, self.device) for k, w in g.items()})
        return self._head[1]

    def _for_products(self, weights: dict) -> dict:
        """Mark the plain projection weights for 16-bit products when that path was chosen."""
        if self.matmul_dtype == torch.float32:
            return weights
        return {k: HalfMatmul(w, self.matmul_dtype) if k in self._product_slots else w
                for k, w in weights.items()}

    @torch.inference_mode()
    def forward(self, ids: list[int], state: DecodeState, keep_states: bool = False,
                last_only: bool = False) -> torch.Tensor:
        """Consume `ids` after what `state` holds; return float32 logits [len(ids), vocab]
        (or [1, vocab] for the last position only: a long prompt's full logits are large)."""
        cfg = self.cfg
        ids_t = torch.as_tensor(list(ids), dtype=torch.long)
        if ids_t.numel() == 0:
            raise ValueError("forward() needs at least one token id")
        bad = ids_t[(ids_t < 0) | (ids_t >= cfg.vocab_size)]
        if bad.numel():
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {cfg.vocab_size})")
        stats = PassStats(tokens=len(ids_t))
        t0 = time.perf_counter()
        state.begin_pass(keep_states)
        g = self.provider.globals()
        h = g["embed"][ids_t].to(self.device, self.dtype)
        g = self._head_on_device(g)
        blocks: list[torch.Tensor] = []
        chunk = self.settings.kda_chunk
        self.provider.start_pass(stats)
        try:
            for i in range(cfg.num_layers):
                weights = self.provider.spine(i, stats)
                tmpl = self.templates[layer_kind(cfg, i)]
                bind(tmpl, self._for_products(self._on_device(weights)))
                w0, c0 = stats.expert_wait_seconds, time.perf_counter()
                h = tmpl(i, h, blocks, state.layers[i], keep_states, chunk,
                         lambda chosen, i=i: _OnDevice(self.provider.experts(i, chosen, stats), self))
                # Waiting for routed experts happens inside the layer; it is I/O, not compute.
                stats.compute_seconds += time.perf_counter() - c0 - (stats.expert_wait_seconds - w0)
                unbind(tmpl)
                del weights
        finally:
            self.provider.end_pass(stats)
        c0 = time.perf_counter()
        if last_only:
            h, blocks = h[-1:], [b[-1:] for b in blocks]
        if cfg.attn_res_block_size:
            h = attn_res(h, blocks, g["out_res_proj"], g["out_res_norm"], cfg.rms_norm_eps)
        head = self._for_products({"lm_head": g["lm_head"]})["lm_head"]
        logits = linear(rms_norm(h, g["norm"], cfg.rms_norm_eps), head).float().cpu()
        stats.compute_seconds += time.perf_counter() - c0
        stats.seconds = time.perf_counter() - t0
        state.num_tokens += len(ids_t)
        self.last_pass = stats
        return logits
