"""Triton kernels of ``grouped.grouped_mlp`` (CUDA only; importing this imports Triton).

Pair j of the flattened expert index list is token j // TOPK times expert ids[j]. Each program
takes one pair and BN output rows and walks the inputs BK at a time, summing in fp32; the expert
id is read on the device, so no launch depends on the routing reaching the host. The gate and up
rows of one program are the same rows of the two halves of ``w13``, so the activation is applied
before anything is stored.

Two weight formats: plain (bf16 / fp32 stacks) and MXFP4, whose codes and scales are decoded in
the kernel as they are read (the stored 4.25 bits per weight are all that crosses memory), with
the decoding of ``triton_kernels`` (codes as twice their E2M1 value, scales as 2^(s - 128)),
exactly the reference's values.

With several pairs per expert (a prompt, a wide batch) the pair kernels would decode an expert's
weights once per pair. ``sorted_mxfp4_mlp`` takes the pairs sorted by expert instead, in tiles of BT
pairs of one expert (a power of two from 4), on the tensor cores: each program multiplies BN output
rows of the expert, its codes and scales as stored (``tl.dot_scaled``, which decodes them in
registers), by the tile's rows as the product's N side. Each fp32 input is given as three bf16 parts
that sum to it exactly (a fourth, zero, makes the side a power of two: 4 x BT columns), and the
decoded weights are exact in bf16 (an E2M1 value, two significant bits, times a power of two), so
every product is exact and the sums are fp32: the pair kernels' values up to summation order. The
tiles are laid out on the device (no routing read back), so a recorded graph holds them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _scale_factors

MXFP4 = tl.constexpr(2)  # triton_kernels' codec id
GROUP = tl.constexpr(32)  # MXFP4 inputs per scale
PARTS = tl.constexpr(3)  # bf16 parts of an fp32 input on the tensor cores

BN = 16
BK = 256


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _tanh(v):
    return 2.0 * _sigmoid(2.0 * v) - 1.0


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, H, INTER, TOPK: tl.constexpr, SITU: tl.constexpr,
                    BETA, LBETA, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    t = j // TOPK
    base = w_ptr + e * (2 * INTER * H)
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    nmask = n < INTER
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        x = tl.load(x_ptr + t * H + kk, mask=kmask, other=0.0)
        m = nmask[:, None] & kmask[None, :]
        wg = tl.load(base + n[:, None] * H + kk[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(base + (n[:, None] + INTER) * H + kk[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], 1)
        acc_u += tl.sum(wu * x[None, :], 1)
    tl.store(out_ptr + j * INTER + n, _glu(acc_g, acc_u, SITU, BETA, LBETA), mask=nmask)


@triton.jit
def _glu(acc_g, acc_u, SITU: tl.constexpr, BETA, LBETA):
    """SiTU-GLU or SiLU-GLU of the gate and up sums (model.moe.glu)."""
    if SITU:
        g = acc_g
        if BETA != 0.0:
            g = BETA * _tanh(acc_g / BETA)
        act = g * _sigmoid(acc_g)
        u = acc_u
        if LBETA != 0.0:
            u = LBETA * _tanh(acc_u / LBETA)
        y = act * u
    else:
        y = acc_g * _sigmoid(acc_g) * acc_u
    return y


@triton.jit
def _down_kernel(a_ptr, ids_ptr, w_ptr, out_ptr, H, INTER, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    base = w_ptr + e * (H * INTER)
    acc = tl.zeros([BN], dtype=tl.float32)
    nmask = n < H
    for k0 in range(0, INTER, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < INTER
        a = tl.load(a_ptr + j * INTER + kk, mask=kmask, other=0.0)
        w = tl.load(base + n[:, None] * INTER + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], 1)
    tl.store(out_ptr + j * H + n, acc, mask=nmask)


@triton.jit
def _e2m1_fp16(b, SHIFT: tl.constexpr):
    """The 4-bit E2M1 codes at bit SHIFT (0: low nibble, 4: high) of bytes b (int32) as fp32 values
    times 2^-14 (the doubled E2M1 value times 2^-15): sign and magnitude bits placed into an fp16's
    sign, low exponent and top mantissa bits (codes 0 and 1 are fp16 subnormals, converted exactly)."""
    h = ((b << (9 - SHIFT)) & 0x0E00) | ((b << (12 - SHIFT)) & 0x8000)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp4_decoded(w_ptr, s_ptr, rows, nmask, K, k0, stride_w, stride_s, G: tl.constexpr):
    """MXFP4 rows `rows` (codes stride_w bytes apart, scales stride_s apart) at the G groups of 32 inputs
    from k0: the low and the high nibbles' values fp32 [BN, G, 16] (times 2^-14) and each group's
    factor fp32 [BN, G] that takes them back to the weights (applied to the groups' sums)."""
    g = k0 // GROUP + tl.arange(0, G)
    gmask = g < K // GROUP
    byte = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]  # [G, 16] bytes of each group
    m = nmask[:, None, None] & gmask[None, :, None]
    b = tl.load(w_ptr + rows[:, None, None] * stride_w + byte[None, :, :], mask=m, other=0).to(tl.int32)
    sc = tl.load(s_ptr + rows[:, None] * stride_s + g[None, :], mask=nmask[:, None] & gmask[None, :], other=0)
    # 2^15 undoes the fp16 placement (exact); the scale factor 2^(s-128) takes the doubling back
    return _e2m1_fp16(b, 0), _e2m1_fp16(b, 4), 32768.0 * _scale_factors(sc, MXFP4)


@triton.jit
def _group_inputs(x_ptr, n_groups, k0, G: tl.constexpr):
    """The inputs of x at the G groups of 32 from k0 as fp32 [G, 16] twice: those of the low nibbles
    (even inputs) and of the high ones (odd), from one contiguous load; x has n_groups groups (0 for
    a tile's missing row: nothing read, zeros)."""
    g = k0 // GROUP + tl.arange(0, G)
    x = tl.load(x_ptr + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :], mask=(g < n_groups)[:, None], other=0.0)
    return tl.split(tl.reshape(x, (G, GROUP // 2, 2)))


@triton.jit
def _group_sums(lo, hi, f, x_lo, x_hi):
    """fp32 [BN, G]: the decoded groups (``_mxfp4_decoded``) times their inputs (``_group_inputs``),
    each group summed and scaled."""
    return tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], 2) * f


@triton.jit
def _mxfp4_groups(w_ptr, s_ptr, rows, nmask, x_lo, x_hi, K, k0, stride_w, stride_s, G: tl.constexpr):
    """fp32 [BN, G]: MXFP4 rows `rows` at the G groups of 32 inputs from k0 times those inputs of x
    (``_group_inputs``): each group's sum of weight x input."""
    lo, hi, f = _mxfp4_decoded(w_ptr, s_ptr, rows, nmask, K, k0, stride_w, stride_s, G)
    return _group_sums(lo, hi, f, x_lo, x_hi)


@triton.jit
def _mxfp4_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, H, INTER, stride_w, stride_s,
                          TOPK: tl.constexpr, SITU: tl.constexpr, BETA, LBETA, BN: tl.constexpr, G: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    x_row = x_ptr + (j // TOPK) * H
    nmask = n < INTER
    gate_rows = e * (2 * INTER) + n
    acc_g = tl.zeros([BN, G], dtype=tl.float32)
    acc_u = tl.zeros([BN, G], dtype=tl.float32)
    for k0 in range(0, H, G * GROUP):
        x_lo, x_hi = _group_inputs(x_row, H // GROUP, k0, G)  # once for the gate and the up rows
        acc_g += _mxfp4_groups(w_ptr, s_ptr, gate_rows, nmask, x_lo, x_hi, H, k0, stride_w, stride_s, G)
        acc_u += _mxfp4_groups(w_ptr, s_ptr, gate_rows + INTER, nmask, x_lo, x_hi, H, k0, stride_w, stride_s, G)
    y = _glu(tl.sum(acc_g, 1), tl.sum(acc_u, 1), SITU, BETA, LBETA)
    tl.store(out_ptr + j * INTER + n, y, mask=nmask)


@triton.jit
def _mxfp4_down_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, H, INTER, stride_w, stride_s, BN: tl.constexpr,
                       G: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    nmask = n < H
    acc = tl.zeros([BN, G], dtype=tl.float32)
    for k0 in range(0, INTER, G * GROUP):
        x_lo, x_hi = _group_inputs(a_ptr + j * INTER, INTER // GROUP, k0, G)
        acc += _mxfp4_groups(w_ptr, s_ptr, e * H + n, nmask, x_lo, x_hi, INTER, k0, stride_w, stride_s, G)
    tl.store(out_ptr + j * H + n, tl.sum(acc, 1), mask=nmask)


@triton.jit
def _store_parts(ptr, stride, x, mask):
    """Store fp32 x as three bf16 parts that sum to it exactly (8 significant bits each; fp32 has 24),
    `stride` elements apart: what a bf16 product on the tensor cores needs to be as exact as fp32."""
    x1 = x.to(tl.bfloat16)
    r = x - x1.to(tl.float32)
    x2 = r.to(tl.bfloat16)
    tl.store(ptr, x1, mask=mask)
    tl.store(ptr + stride, x2, mask=mask)
    tl.store(ptr + 2 * stride, (r - x2.to(tl.float32)).to(tl.bfloat16), mask=mask)


@triton.jit
def _parts_kernel(x_ptr, out_ptr, n, K, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    _store_parts(out_ptr + (i // K) * (PARTS * K) + i % K, K, tl.load(x_ptr + i, mask=m, other=0.0), m)


@triton.jit
def _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr):
    """Tile program_id(0)'s expert (-1: no tile), first sorted place and the end of its expert's places."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    r = tl.load(tile_r_ptr + t)
    return e, r, tl.load(ends_ptr + tl.maximum(e, 0))


@triton.jit
def _tile_columns(r, end, BT: tl.constexpr):
    """A tile's 4 * BT product columns: column c is part c // BT (the fourth part is zero) of the tile's
    row c % BT, sorted place r + c % BT; whether that place is one of the tile's expert's."""
    c = tl.arange(0, 4 * BT)
    place = r + c % BT
    return place, place < end, c // BT


@triton.jit
def _codes_dot(acc, w_ptr, s_ptr, rows, nmask, p_ptr, prow, pvalid, part, k0, K, stride_w, stride_s,
               BK: tl.constexpr):
    """acc [BN, 4 * BT] plus MXFP4 rows `rows` at inputs k0 .. k0 + BK (codes and scales as stored) times
    the columns' bf16 parts (``_tile_columns``; parts [rows, PARTS, K] at p_ptr, row prow of each)."""
    byte = k0 // 2 + tl.arange(0, BK // 2)
    codes = tl.load(w_ptr + rows[:, None] * stride_w + byte[None, :], mask=nmask[:, None] & (byte < K // 2)[None, :],
                    other=0)
    g = k0 // GROUP + tl.arange(0, BK // GROUP)
    scales = tl.load(s_ptr + rows[:, None] * stride_s + g[None, :], mask=nmask[:, None] & (g < K // GROUP)[None, :],
                     other=0)
    kk = k0 + tl.arange(0, BK)
    m = (pvalid & (part < PARTS))[None, :] & (kk < K)[:, None]
    x = tl.load(p_ptr + (prow * PARTS + part)[None, :] * K + kk[:, None], mask=m, other=0.0)  # [BK, 4 * BT]
    # Each step's BK products summed on the tensor cores, the steps in fp32 here: summed across all K
    # inside the product, the results were ~10x further from fp32 sums (3e-6 against 3e-7 relative).
    return acc + tl.dot_scaled(codes, scales, "e2m1", x, None, "bf16")


@triton.jit
def _tile_gate_up_kernel(xp_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, act_ptr, H, INTER,
                         stride_w, stride_s, TOPK: tl.constexpr, SITU: tl.constexpr, BETA, LBETA, BT: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    e, r, end = _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr)
    if e < 0:
        return
    place, valid, part = _tile_columns(r, end, BT)
    token = (tl.load(order_ptr + place, mask=valid, other=0) // TOPK).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < INTER
    gate = e.to(tl.int64) * (2 * INTER) + n
    acc_g = tl.zeros([BN, 4 * BT], dtype=tl.float32)
    acc_u = tl.zeros([BN, 4 * BT], dtype=tl.float32)
    for k0 in range(0, H, BK):
        acc_g = _codes_dot(acc_g, w_ptr, s_ptr, gate, nmask, xp_ptr, token, valid, part, k0, H, stride_w, stride_s, BK)
        acc_u = _codes_dot(acc_u, w_ptr, s_ptr, gate + INTER, nmask, xp_ptr, token, valid, part, k0, H, stride_w,
                           stride_s, BK)
    # the parts' columns summed: [BN, BT], the tile's rows' gate and up sums
    y = _glu(tl.sum(tl.reshape(acc_g, (BN, 4, BT)), 1), tl.sum(tl.reshape(acc_u, (BN, 4, BT)), 1), SITU, BETA, LBETA)
    j = r + tl.arange(0, BT)  # act rows in sorted order, as parts for the down kernel
    _store_parts(act_ptr + (j.to(tl.int64) * (PARTS * INTER))[None, :] + n[:, None], INTER, y,
                 nmask[:, None] & (j < end)[None, :])


@triton.jit
def _tile_down_kernel(ap_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H, INTER,
                      stride_w, stride_s, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, r, end = _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr)
    if e < 0:
        return
    place, valid, part = _tile_columns(r, end, BT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < H
    acc = tl.zeros([BN, 4 * BT], dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        acc = _codes_dot(acc, w_ptr, s_ptr, e.to(tl.int64) * H + n, nmask, ap_ptr, place.to(tl.int64), valid, part, k0,
                         INTER, stride_w, stride_s, BK)
    j = r + tl.arange(0, BT)
    jm = j < end
    pair = tl.load(order_ptr + j, mask=jm, other=0).to(tl.int64)  # each row stored at its pair's own place
    tl.store(out_ptr + pair[None, :] * H + n[:, None], tl.sum(tl.reshape(acc, (BN, 4, BT)), 1),
             mask=nmask[:, None] & jm[None, :])


def _glu_args(cfg) -> dict:
    situ = cfg.hidden_act == "situ"
    return dict(SITU=situ, BETA=float(cfg.situ_beta or 0.0) if situ else 0.0,
                LBETA=float(cfg.situ_linear_beta or 0.0) if situ else 0.0)


# MXFP4 tiles: BN output rows x G scale groups (32 inputs each) per step. Tuned per shape on the
# first (eager) call: a decode graph cannot run the tuner.
_MXFP4_CONFIGS = [triton.Config({"BN": bn, "G": g}, num_warps=w, num_stages=st)
                  for bn, g, w, st in ((16, 8, 4, 2), (32, 4, 4, 2), (32, 8, 8, 2), (64, 4, 8, 2), (8, 16, 4, 2),
                                       (16, 4, 4, 3))]
_mxfp4_gate_up_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER", "TOPK"])(_mxfp4_gate_up_kernel)
_mxfp4_down_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER"])(_mxfp4_down_kernel)


# Sorted tiles: BT pairs of one expert (x 4 parts: the product's N) x BN outputs (its M), BK inputs a step.
_TILE_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
                 for bn, bk, w, st in ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3))]
_tile_gate_up_tuned = triton.autotune(_TILE_CONFIGS, key=["H", "INTER", "BT"])(_tile_gate_up_kernel)
_tile_down_tuned = triton.autotune(_TILE_CONFIGS, key=["H", "INTER", "BT"])(_tile_down_kernel)


def _mxfp4_args(packed: torch.Tensor, scale: torch.Tensor) -> tuple:
    packed, scale = packed.contiguous(), scale.contiguous().view(torch.uint8)
    return packed, scale, packed.shape[-1], scale.shape[-1]


def mxfp4_gate_up(x: torch.Tensor, ids: torch.Tensor, topk: int, packed: torch.Tensor, scale: torch.Tensor, cfg,
                  config: dict | None = None) -> torch.Tensor:
    """glu(w1 x, w3 x) for every pair from MXFP4 w13 (codes [E, 2I, H/2], scales [E, 2I, H/32]):
    x fp32 [T, H], ids int32 [T*topk] -> fp32 [T*topk, I]. config: fixed {"BN", "G"} instead of
    tuning (tests)."""
    pairs, (_, two_i, half) = ids.numel(), packed.shape
    inter = two_i // 2
    out = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    w, s, sw, ss = _mxfp4_args(packed, scale)
    args = (x, ids, w, s, out, 2 * half, inter, sw, ss)
    if config:
        _mxfp4_gate_up_kernel[(pairs, triton.cdiv(inter, config["BN"]))](*args, TOPK=topk, **_glu_args(cfg),
                                                                          **config)
    else:
        _mxfp4_gate_up_tuned[lambda m: (pairs, triton.cdiv(inter, m["BN"]))](*args, TOPK=topk, **_glu_args(cfg))
    return out


def mxfp4_down(act: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               config: dict | None = None) -> torch.Tensor:
    """w2[ids[j]] @ act[j] for every pair from MXFP4 w2 (codes [E, H, I/2], scales [E, H, I/32]):
    act fp32 [P, I] -> fp32 [P, H]."""
    pairs, (_, H, half) = ids.numel(), packed.shape
    out = torch.empty(pairs, H, dtype=torch.float32, device=act.device)
    w, s, sw, ss = _mxfp4_args(packed, scale)
    args = (act, ids, w, s, out, H, 2 * half, sw, ss)
    if config:
        _mxfp4_down_kernel[(pairs, triton.cdiv(H, config["BN"]))](*args, **config)
    else:
        _mxfp4_down_tuned[lambda m: (pairs, triton.cdiv(H, m["BN"]))](*args)
    return out


def grouped_gate_up(x: torch.Tensor, ids: torch.Tensor, topk: int, w13: torch.Tensor, cfg) -> torch.Tensor:
    """glu(w1 x, w3 x) for every pair: x fp32 [T, H], ids int32 [T*topk] -> fp32 [T*topk, I]."""
    pairs, (_, two_i, H) = ids.numel(), w13.shape
    inter = two_i // 2
    out = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    grid = (pairs, triton.cdiv(inter, BN))
    _gate_up_kernel[grid](x, ids, w13.contiguous(), out, H, inter, TOPK=topk, **_glu_args(cfg), BN=BN, BK=BK)
    return out


def grouped_down(act: torch.Tensor, ids: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2[ids[j]] @ act[j] for every pair: act fp32 [P, I] -> fp32 [P, H]."""
    pairs, (_, H, inter) = ids.numel(), w2.shape
    out = torch.empty(pairs, H, dtype=torch.float32, device=act.device)
    _down_kernel[(pairs, triton.cdiv(H, BN))](act, ids, w2.contiguous(), out, H, inter, BN=BN, BK=BK)
    return out


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """fp32 [T, K] -> bf16 [T, PARTS, K], three parts of each row that sum to it exactly (one launch)."""
    T, K = x.shape
    out = torch.empty(T, PARTS, K, dtype=torch.bfloat16, device=x.device)
    _parts_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), K, BLOCK=1024)
    return out


def sorted_mxfp4_mlp(x: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, tiles: tuple, tile_rows: int,
                     topk: int, packed13, scale13, packed2, scale2, cfg, config: dict | None = None) -> torch.Tensor:
    """Every pair's w2 @ glu(w1 x, w3 x) from MXFP4 stacks (as ``mxfp4_gate_up``), the pairs sorted by
    expert: x fp32 [T, H]; order int32 [P], the pair at each sorted place (pair j: token j // topk);
    ends int32 [E]; tiles ``grouped.sorted_tiles(ends, P, tile_rows)`` (tile_rows a power of two from
    4) -> fp32 [P, H] in pair order. config: fixed {"BN", "BK"} instead of tuning (tests)."""
    pairs, (_, two_i, half) = order.numel(), packed13.shape
    inter, H = two_i // 2, 2 * half
    tile_e, tile_r = tiles
    act = torch.empty(pairs, PARTS, inter, dtype=torch.bfloat16, device=x.device)  # in sorted order
    out = torch.empty(pairs, H, dtype=torch.float32, device=x.device)
    w13, s13, sw13, ss13 = _mxfp4_args(packed13, scale13)
    w2, s2, sw2, ss2 = _mxfp4_args(packed2, scale2)
    count = tile_e.numel()
    gate_up = (bf16_parts(x), order, tile_e, tile_r, ends, w13, s13, act, H, inter, sw13, ss13)
    down = (act, order, tile_e, tile_r, ends, w2, s2, out, H, inter, sw2, ss2)
    glu = dict(TOPK=topk, **_glu_args(cfg))
    if config:
        _tile_gate_up_kernel[(count, triton.cdiv(inter, config["BN"]))](*gate_up, **glu, BT=tile_rows, **config)
        _tile_down_kernel[(count, triton.cdiv(H, config["BN"]))](*down, BT=tile_rows, **config)
    else:
        _tile_gate_up_tuned[lambda m: (count, triton.cdiv(inter, m["BN"]))](*gate_up, **glu, BT=tile_rows)
        _tile_down_tuned[lambda m: (count, triton.cdiv(H, m["BN"]))](*down, BT=tile_rows)
    return out
