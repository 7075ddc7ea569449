"""A MoE layer's routed experts for a whole batch of rows, in two native calls on the CPU.

The per-expert path costs three product calls and a few small torch ops per chosen expert: for
one decoding sequence of kl_medium (8 experts of 64, 7 MoE layers) ~170 calls a token, each with
tens of microseconds of Python around a product of ~7 MB; for a batch of decoding sequences (the
union of their choices: ~35 experts of 64 per layer for 8 sequences of small-k3) the Python cost
more than the products themselves. Here the (row, expert) pairs are sorted by expert, every
expert's gate and up products for its rows run in one native call, the activation once over all
pairs, every down product in a second call, and one ``index_add_`` sums each row's experts
weighted by the router, in the order the per-expert path adds them. Each product is the one the
single-product kernel computes for that expert's rows alone, so a row's result does not depend
on which other rows share the pass, and equals the per-expert path's bit for bit.

Experts in MXFP4 (K3) use ``mxfp4_gemv_items``; int8 experts (``convert --experts int8``) and bf16
ones (Kimi Linear as published) use ``dense_gemv_items``, and there a shared expert of the routed
experts' shape (Kimi Linear) can ride along in the same two calls (``routed_and_shared``). With a
SiLU-GLU (Kimi Linear) int8 and bf16 experts take one call for everything (``cpu_native.moe_silu``:
products, activation, weighted sum, shared expert): the torch ops and the second call between them
cost ~250 us a MoE layer of a decode token, and the products' rows and results are those above.
"""
from __future__ import annotations

import contextlib
import operator
from itertools import accumulate

import torch

from . import cpu_native
from .kept import KeptByWeights
from .linear import QWeight, dense_kind, native_dense


def applies(z: torch.Tensor, experts) -> bool:
    """True for float32 rows on the CPU and MXFP4, int8 or bf16 experts there, with the native kernels
    built."""
    if z.device.type != "cpu" or z.dtype != torch.float32 or not cpu_native.available():
        return False
    w1 = next(iter(experts.values()))[0] if isinstance(experts, dict) and experts else None
    return _is_mxfp4(w1) or native_dense(w1) is not None


def routed(glu, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: dict,
           silu: bool = False) -> torch.Tensor | None:
    """sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) as fp32 [T, H], or None when an int8 or bf16
    expert has more rows than the native gemvs take (a prompt: the per-expert path multiplies those
    faster; MXFP4 experts take such rows in pieces) or the chosen experts are not all of one kind the
    native calls take. ``glu(gate, up)`` is the model's
    activation (``silu``: it is the SiLU-GLU, which int8 and bf16 experts then compute in the same native
    call as their products, ``cpu_native.moe_silu``); ``experts`` maps each chosen id to (w1, w3, w2)."""
    done = _routed(glu, z, ids, weights, experts, None, silu)
    return None if done is None else done[0]


def routed_and_shared(glu, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: dict,
                      shared: tuple, silu: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``routed``'s sum and the shared expert's output for every row of z, (routed, shared) fp32 [T, H]
    each, with the shared expert's products in the same native calls as the routed experts' (one call
    with ``silu``, else two: two calls a layer fewer than apart), or None where ``routed`` gives None
    or the shared expert's (gate, up, down) are not int8 or bf16 weights of the routed experts' shape
    and kind. Each value equals the separate computation's bit for bit: the same row kernel per
    product, the same activation (with ``silu`` the native one, which ops.silu_glu takes for such rows
    too)."""
    if ids.shape[0] > cpu_native.GEMV_MAX_ROWS or _is_mxfp4(next(iter(experts.values()))[0]):
        return None  # apart, the shared expert's rows would take the torch path; MXFP4 calls take no int8/bf16
    return _routed(glu, z, ids, weights, experts, shared, silu)


def _routed(glu, z, ids, weights, experts, shared, silu) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    T, k = ids.shape
    if silu and T <= cpu_native.GEMV_MAX_ROWS and (done := _moe_silu(z, ids, weights, experts, shared)) is not None:
        return done
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, rows in order within each
    chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
    counts = counts.tolist()
    w = [experts[e] for e in chosen.tolist()]
    # The codec of each; their device, shape and dtype mxfp4_gemv_items checks (_is_mxfp4 per weight
    # cost ~4 ms a pass on small-k3 with 8 sequences: ~40 experts x 3 weights x 7 layers).
    mxfp4 = all(isinstance(m, QWeight) and m.codec == "mxfp4" for ws in w for m in ws)
    if max(counts) > cpu_native.GEMV_MAX_ROWS and not mxfp4:
        return None
    P = T * k
    rows = order // k
    pair_w = weights.reshape(-1)[order].float()
    if mxfp4:
        out, extra = _mxfp4_pairs(glu, z[rows], w, counts), None
    else:
        dense = [[native_dense(m) for m in ws] for ws in w]
        if not all(d is not None for ds in dense for d in ds) or len({dense_kind(d) for ds in dense for d in ds}) != 1:
            return None
        extra = None
        if shared is not None:  # one more item of each call: the shared expert over every row of z
            extra = [native_dense(m) for m in shared]
            if any(d is None or (d[0].shape, dense_kind(d)) != (r[0].shape, dense_kind(r))
                   for d, r in zip(extra, dense[0])):
                return None
        xs = list(z[rows].split(counts))  # each expert's rows
        if extra is not None:
            xs, dense = xs + [z.contiguous()], dense + [extra]
        out = _dense_pairs(glu, xs, dense)
    y = torch.zeros(T, out.shape[1], dtype=torch.float32)
    y.index_add_(0, rows, out[:P] * pair_w.unsqueeze(-1))
    return y, (out[P:] if extra is not None else None)


def _moe_silu(z, ids, weights, experts, shared) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The routed sum and the shared expert's output in one native call (``cpu_native.moe_silu``), or None
    where the experts are not int8 or bf16 experts of one shape and kind (the other paths decide). The
    pairs are ordered as torch's stable argsort orders them, in Python: a decode pass has a few dozen,
    and the torch ops cost ~10 us each between the products."""
    T, k = ids.shape
    flat = ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=flat.__getitem__)  # stable: by expert, rows in order within each
    chosen, counts = [], []
    for i in order:
        if chosen and chosen[-1] == flat[i]:
            counts[-1] += 1
        else:
            chosen.append(flat[i])
            counts.append(1)
    items = [moe_expert_of(experts[e]) for e in chosen] + ([moe_expert_of(shared)] if shared is not None else [])
    if any(it is None for it in items) or len({it.signature for it in items[:len(chosen)]}) != 1 \
            or not cpu_native.shared_fits(items[-1] if shared is not None else None, items[0].signature):
        return None
    pair_w = weights.reshape(-1).float().tolist()
    return cpu_native.moe_silu(z.contiguous(), counts, [i // k for i in order],
                               torch.tensor([pair_w[i] for i in order], dtype=torch.float32),
                               items[:len(chosen)], items[-1] if shared is not None else None)


def held_table(experts: dict) -> cpu_native.MoeTable | None:
    """The native table (cpu_native.moe_table) of a layer's experts 0..E-1 held in memory ({id: (w1, w3,
    w2)}, io.ram.HeldExperts), or None where one of them is not an int8 or bf16 expert of the others'
    signature. Made once and kept on `experts`, and made again when an entry was swapped (the
    sensitivity tool re-encodes experts in place): a token checks that each entry is the one it was."""
    kept = getattr(experts, "moe_table", None)
    if kept is not None and len(kept[0]) == len(experts) and all(map(operator.is_, kept[0], experts.values())):
        return kept[1]
    entries = tuple(experts.values())
    items = [moe_expert_of(ws) for ws in entries]
    table = None
    if list(experts) == list(range(len(items))) and all(it is not None for it in items) \
            and len({it.signature for it in items}) == 1:
        table = cpu_native.moe_table(items)
    with contextlib.suppress(AttributeError):  # a plain dict keeps nothing: made again next time
        experts.moe_table = (entries, table)
    return table


def moe_expert_of(ws: tuple) -> cpu_native.MoeExpert | None:
    """cpu_native.moe_expert of an expert's weights (w1, w3, w2), None unless all three are int8 or bf16
    weights the native products take; kept while they are the same objects (a decode token asks for each
    chosen expert in every layer; a caller may swap weights in place, see io.ram ``held``)."""
    kept = _kept_experts.get(tuple(ws), lambda: _checked_expert(ws))
    return None if kept is None else cpu_native.MoeExpert(*kept, ws)  # the weights hold what the pointers name


def _checked_expert(ws: tuple) -> tuple | None:
    """(pointers, signature) of cpu_native.moe_expert for the weights, or None."""
    dense = [native_dense(m) for m in ws]
    if any(d is None for d in dense) or len({dense_kind(d)[:2] for d in dense}) != 1:
        return None
    try:
        item = cpu_native.moe_expert(*dense)
    except ValueError:  # shapes that do not make an expert: the other paths decide (and say why)
        return None
    return item.pointers, item.signature


# moe_expert_of's checked experts, for QWeights and bf16 tensors alike.
_kept_experts = KeptByWeights()


def _is_mxfp4(w) -> bool:
    return isinstance(w, QWeight) and w.codec == "mxfp4" and w.device.type == "cpu"


def _mxfp4_pairs(glu, x: torch.Tensor, w: list, counts: list[int]) -> torch.Tensor:
    """Every pair's expert output [P, H] for MXFP4 experts (pairs grouped by expert, counts each).
    An expert with more rows than one item takes (a batch of prompt pieces) is several items of at
    most GEMV_MAX_ROWS rows: as fast as decoding it whole and multiplying (~30 G products/s at 64 rows
    on 2 cores), and its rows still get the single-row kernel's bits."""
    if max(counts) > cpu_native.GEMV_MAX_ROWS:
        step = cpu_native.GEMV_MAX_ROWS
        w, counts = zip(*[(ws, min(step, n - s)) for ws, n in zip(w, counts) for s in range(0, n, step)])
        w, counts = list(w), list(counts)
    P, starts = x.shape[0], list(accumulate(counts[:-1], initial=0))
    gate_up = cpu_native.mxfp4_gemv_items(
        x, [_parts(w1) for w1, _, _ in w] + [_parts(w3) for _, w3, _ in w],
        starts + starts, starts + [P + s for s in starts], counts + counts, 2 * P)
    act = glu(gate_up[:P], gate_up[P:])
    return cpu_native.mxfp4_gemv_items(act, [_parts(w2) for _, _, w2 in w], starts, starts, counts, P)


def _dense_pairs(glu, xs: list[torch.Tensor], dense: list) -> torch.Tensor:
    """The same for int8 or bf16 experts, given as (weight, scale) per matrix (``native_dense``), item i
    computing expert i over the rows xs[i]; the outputs' rows follow xs in order."""
    R = sum(x.shape[0] for x in xs)  # rows of every gate (and up) output
    gate_up = cpu_native.dense_gemv_items(xs + xs, [d[0][0] for d in dense] + [d[1][0] for d in dense],
                                          [d[0][1] for d in dense] + [d[1][1] for d in dense])
    act = glu(gate_up[:R], gate_up[R:])
    return cpu_native.dense_gemv_items(list(act.split([x.shape[0] for x in xs])),
                                       [d[2][0] for d in dense], [d[2][1] for d in dense])


def _parts(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    return w.tensors["weight_packed"], w.tensors["weight_scale"]
