"""A MoE layer's routed MXFP4 experts for a whole batch of rows, in two native calls on the CPU.

The per-expert path costs three product calls and a few small torch ops per chosen expert, which
for a batch of decoding sequences (the union of their choices: ~35 experts of 64 per layer for 8
sequences of small-k3) cost more in Python than the products themselves. Here the (row, expert)
pairs are sorted by expert, every expert's gate and up products for its rows run in one native
call, the activation once over all pairs, every down product in a second call, and one
``index_add_`` sums each row's experts weighted by the router. Each product is the one
``mxfp4_gemv`` computes for that expert's rows alone, so a row's result does not depend on which
other rows share the pass.
"""
from __future__ import annotations

import torch

from . import cpu_native
from .linear import QWeight


def applies(z: torch.Tensor, experts) -> bool:
    """True for float32 rows on the CPU and MXFP4 experts there, with the native kernels built."""
    if z.device.type != "cpu" or z.dtype != torch.float32 or not cpu_native.available():
        return False
    w1 = next(iter(experts.values()))[0] if isinstance(experts, dict) and experts else None
    return isinstance(w1, QWeight) and w1.codec == "mxfp4" and w1.device.type == "cpu"


def routed_mxfp4(glu, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: dict) -> torch.Tensor | None:
    """sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) as fp32 [T, H], or None when some expert has
    more rows than the native gemv takes (a prompt: the per-expert path multiplies those faster).
    ``glu(gate, up)`` is the model's activation; ``experts`` maps each chosen id to (w1, w3, w2)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, rows in order within each
    chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
    counts = counts.tolist()
    if max(counts) > cpu_native.GEMV_MAX_ROWS:
        return None
    chosen = chosen.tolist()
    starts = [0] * len(counts)
    for i in range(1, len(counts)):
        starts[i] = starts[i - 1] + counts[i - 1]
    P = T * k
    rows = order // k
    x = z[rows]  # [P, H]: each pair's row, grouped by expert
    w = [experts[e] for e in chosen]
    gate_up = cpu_native.mxfp4_gemv_items(
        x, [_parts(w1) for w1, _, _ in w] + [_parts(w3) for _, w3, _ in w],
        starts + starts, starts + [P + s for s in starts], counts + counts, 2 * P)
    act = glu(gate_up[:P], gate_up[P:])
    out = cpu_native.mxfp4_gemv_items(act, [_parts(w2) for _, _, w2 in w], starts, starts, counts, P)
    y = torch.zeros(T, out.shape[1], dtype=torch.float32)
    return y.index_add_(0, rows, out * weights.reshape(-1)[order].float().unsqueeze(-1))


def _parts(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    return w.tensors["weight_packed"], w.tensors["weight_scale"]
