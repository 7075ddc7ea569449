"""Triton kernels of ``grouped.grouped_mlp`` (CUDA only; importing this imports Triton).

Pair j of the flattened expert index list is token j // TOPK times expert ids[j]. Each program
takes one pair and BN output rows and walks the inputs BK at a time, summing in fp32; the expert
id is read on the device, so no launch depends on the routing reaching the host. The gate and up
rows of one program are the same rows of the two halves of ``w13``, so the activation is applied
before anything is stored.

Two weight formats: plain (bf16 / fp32 stacks) and MXFP4, whose codes and scales are decoded in
the kernel as they are read (the stored 4.25 bits per weight are all that crosses memory), exactly
the reference's values. The codes are read as 32-bit words of eight and decoded two at a time, as
16-bit pairs (``_word_values``, ``_word_bf16``): the integer work per weight is what bounds these
kernels, not their bytes.

With several pairs per expert (a prompt, a wide batch) the pair kernels would decode an expert's
weights once per pair. ``sorted_mxfp4_mlp`` takes the pairs sorted by expert instead, in tiles of BT
pairs of one expert (a power of two from 4), on the tensor cores: each program multiplies BN output
rows of the expert, decoded in registers to bf16 (``_tile_weights``), by the tile's rows as the
product's N side. Each fp32 input is given as three bf16 parts
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


def _code_pairs_asm(head: str, magnitude_at: int, magnitude_mask: int, finish: str) -> str:
    """PTX over $8, an int32 word of 8 MXFP4 codes (input i in bits 4i .. 4i+3): for i = 0..3, codes i and
    i + 4 placed into one 16-bit pair p at once, the sign bits to 15 / 31 and the magnitude bits shifted to
    `magnitude_at` / + 16 (masked by `magnitude_mask`); then `finish` with {lo} = i and {hi} = i + 4.
    `head` declares what `finish` needs."""
    steps = []
    for i in range(4):
        to = magnitude_at - 4 * i
        a = f"shl.b32 a, $8, {to};" if to >= 0 else f"shr.b32 a, $8, {-to};"
        b = f"shl.b32 b, $8, {12 - 4 * i}; and.b32 b, b, 0x80008000;" if i < 3 else "and.b32 b, $8, 0x80008000;"
        steps.append(f" {a} {b} lop3.b32 p, a, 0x{magnitude_mask:08X}, b, 0xEA;" + finish.format(lo=i, hi=i + 4))
    return "{ " + head + "".join(steps) + " }"


# fp16 pairs (magnitude at bits 9-11: the doubled E2M1 value times 2^-15), each half converted to fp32
_FP16_PAIRS = tl.constexpr(_code_pairs_asm(".reg .b32 a, b, p; .reg .b16 l, h;", 9, 0x0E000E00,
                                           " mov.b32 {{l, h}}, p; cvt.f32.f16 ${lo}, l; cvt.f32.f16 ${hi}, h;"))
# bf16 pairs (magnitude at bits 6-8: the E2M1 value times 2^-126) times the multipliers $9 and $10
_BF16_PAIRS = tl.constexpr(_code_pairs_asm(".reg .b32 a, b, p, z; mov.b32 z, 0x80008000;", 6, 0x01C001C0,
                                           " fma.rn.bf16x2 p, p, $9, z; fma.rn.bf16x2 p, p, $10, z;"
                                           " mov.b32 {{${lo}, ${hi}}}, p;"))

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
def _word_values(w):
    """int32 words of 8 MXFP4 codes (input i of a word in bits 4i .. 4i+3) -> the 8 values as fp32, each
    times 2^-14 (the doubled E2M1 value times 2^-15): codes i and i + 4 go into one fp16 pair at once
    (sign to bits 15 / 31, magnitude to 9-11 / 25-27: two shifts and two logic ops a pair, codes 0 and 1
    fp16 subnormals), then each half converts exactly. Per weight that is about half the integer work of
    placing every code on its own."""
    return tl.inline_asm_elementwise(
        _FP16_PAIRS,
        "=f,=f,=f,=f,=f,=f,=f,=f,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _group_inputs(x_ptr, n_groups, k0, G: tl.constexpr):
    """The inputs of x at the G groups of 32 from k0, from one contiguous load, as eight fp32 [G, 4]:
    the i-th of each word's 8 inputs (``_word_values``' order); x has n_groups groups (0 for a tile's
    missing row: nothing read, zeros)."""
    g = k0 // GROUP + tl.arange(0, G)
    x = tl.load(x_ptr + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :], mask=(g < n_groups)[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(x, (G, 4, 2, 2, 2)))  # input 8q + 4a + 2b + c of a group: [G, q, a, b, c]
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    i0, i4 = tl.split(x0)
    i2, i6 = tl.split(x2)
    i1, i5 = tl.split(x1)
    i3, i7 = tl.split(x3)
    return i0, i1, i2, i3, i4, i5, i6, i7


@triton.jit
def _group_codes(w_ptr, s_ptr, rows, nmask, K, k0, stride_w, stride_s, G: tl.constexpr):
    """MXFP4 rows `rows` (codes stride_w int32 words apart, scales stride_s bytes apart) at the G groups of 32
    inputs from k0: int32 words [BN, G, 4] (a group's 16 bytes) and scale bytes [BN, G]; nothing is read past
    K (a step beyond the last one reads nothing)."""
    g = k0 // GROUP + tl.arange(0, G)
    gmask = g < K // GROUP
    word = g[:, None] * 4 + tl.arange(0, 4)[None, :]
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * stride_w + word[None, :, :],
                mask=nmask[:, None, None] & gmask[None, :, None], other=0)
    sc = tl.load(s_ptr + rows[:, None] * stride_s + g[None, :], mask=nmask[:, None] & gmask[None, :], other=0)
    return w, sc


@triton.jit
def _groups_dot(w, sc, xs):
    """fp32 [BN, G]: the groups' codes and scales (``_group_codes``) times their inputs of x (``_group_inputs``),
    each group's sum of weight x input."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(w)
    s = (v0 * xs[0][None] + v1 * xs[1][None] + v2 * xs[2][None] + v3 * xs[3][None] + v4 * xs[4][None]
         + v5 * xs[5][None] + v6 * xs[6][None] + v7 * xs[7][None])
    # 2^15 undoes the fp16 placement (exact); the scale factor 2^(s-128) takes the doubling back
    return tl.sum(s, 2) * (32768.0 * _scale_factors(sc, MXFP4))


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
    # Each step's codes are requested a step ahead, before the current step's are decoded: a program then has
    # two steps' bytes in flight, where one step's alone left these kernels waiting on memory (one row of x
    # gives every weight a single multiply-add, too little work to cover a load's latency).
    wg, sg = _group_codes(w_ptr, s_ptr, gate_rows, nmask, H, 0, stride_w, stride_s, G)
    wu, su = _group_codes(w_ptr, s_ptr, gate_rows + INTER, nmask, H, 0, stride_w, stride_s, G)
    for k0 in range(0, H, G * GROUP):
        next_g = _group_codes(w_ptr, s_ptr, gate_rows, nmask, H, k0 + G * GROUP, stride_w, stride_s, G)
        next_u = _group_codes(w_ptr, s_ptr, gate_rows + INTER, nmask, H, k0 + G * GROUP, stride_w, stride_s, G)
        xs = _group_inputs(x_row, H // GROUP, k0, G)  # once for the gate and the up rows
        acc_g += _groups_dot(wg, sg, xs)
        acc_u += _groups_dot(wu, su, xs)
        wg, sg = next_g
        wu, su = next_u
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
    w, sc = _group_codes(w_ptr, s_ptr, e * H + n, nmask, INTER, 0, stride_w, stride_s, G)
    for k0 in range(0, INTER, G * GROUP):  # codes a step ahead, as the gate and up kernel
        ahead = _group_codes(w_ptr, s_ptr, e * H + n, nmask, INTER, k0 + G * GROUP, stride_w, stride_s, G)
        acc += _groups_dot(w, sc, _group_inputs(a_ptr + j * INTER, INTER // GROUP, k0, G))
        w, sc = ahead
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
def _tile_inputs(p_ptr, prow, pvalid, part, k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """bf16 [BK, 4 * BT]: the columns' parts (``_tile_columns``; parts [rows, PARTS, K] at p_ptr, row prow
    of each) at inputs k0 .. k0 + BK."""
    kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BK), BK), BK)
    m = (pvalid & (part < PARTS))[None, :]
    if not EVEN_K:
        m = m & (kk < K)[:, None]
    return tl.load(p_ptr + (prow * PARTS + part)[None, :] * K + kk[:, None], mask=m, other=0.0)


@triton.jit
def _word_bf16(w, m1, m2):
    """int32 words of 8 MXFP4 codes (``_word_values``' order) -> the 8 weights as bf16, each times the
    word's pair multipliers m1 and m2 (int32, a bf16 pair each): codes i and i + 4 go into one bf16 pair
    at once (sign to bits 15 / 31, magnitude to 6-8 / 22-24: the E2M1 value times 2^-126, codes 0 and 1
    bf16 subnormals), then both multiplies (exact: powers of two; as fused multiply-adds of -0, which
    compute capability 8.0 has, where a bf16 pair multiply needs 9.0)."""
    return tl.inline_asm_elementwise(
        _BF16_PAIRS,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, m1, m2], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _tile_weights(w_ptr, s_ptr, rows, nmask, k0, K, stride_w, stride_s, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """bf16 [BN, BK]: MXFP4 rows `rows` (codes stride_w int32 words apart) at inputs k0 .. k0 + BK, decoded
    exactly (an E2M1 value, two significant bits, times a power of two)."""
    # Without a mask along the inputs (EVEN_K: K a multiple of BK) and with the step's words known to start
    # at a multiple of BK // 8, each thread copies 16 contiguous bytes of codes into shared memory in one
    # instruction; with the mask along the inputs those copies were 8 bytes wide.
    word = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BK // 8), BK // 8), BK // 8)
    g = k0 // GROUP + tl.arange(0, BK // GROUP)
    wmask, smask = nmask[:, None], nmask[:, None]
    if not EVEN_K:
        wmask, smask = wmask & (word < K // 8)[None, :], smask & (g < K // GROUP)[None, :]
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * stride_w + word[None, :], mask=wmask, other=0)
    sc = tl.load(s_ptr + rows[:, None] * stride_s + g[None, :], mask=smask, other=0).to(tl.int32)
    # 2^(s - 127) as 2^(min(s, 128) - 1) (undoing the placement's 2^-126) times 2^(max(s, 128) - 128): each
    # a normal bf16 for every s; 255 (no scale) gives NaN as the reference does
    e1 = (tl.minimum(sc, 128) + 126) << 7
    e2 = tl.where(sc == 255, 0x7FC0, (tl.maximum(sc, 128) - 1) << 7)
    m1 = tl.reshape(tl.broadcast_to((e1 | (e1 << 16))[:, :, None], (BN, BK // GROUP, 4)), (BN, BK // 8))
    m2 = tl.reshape(tl.broadcast_to((e2 | (e2 << 16))[:, :, None], (BN, BK // GROUP, 4)), (BN, BK // 8))
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_bf16(w, m1, m2)
    # weight 8q + 4a + 2b + c of the step: joined a, then b, then c (the last dimension the fastest)
    ab0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    ab1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(ab0, ab1), (BN, BK))


@triton.jit
def _codes_dot(acc, w_ptr, s_ptr, rows, nmask, x, k0, K, stride_w, stride_s, BN: tl.constexpr, BK: tl.constexpr,
               EVEN_K: tl.constexpr):
    """acc [BN, 4 * BT] plus MXFP4 rows `rows` at inputs k0 .. k0 + BK times x (``_tile_inputs``)."""
    # Each step's BK products summed on the tensor cores, the steps in fp32 here: summed across all K
    # inside the product (what the compiler makes of `acc + tl.dot(...)` unless the step's result passes
    # through an opaque move), the results were ~10x further from fp32 sums (3e-6 against 4e-7 relative).
    step = tl.dot(_tile_weights(w_ptr, s_ptr, rows, nmask, k0, K, stride_w, stride_s, BN, BK, EVEN_K), x)
    return acc + tl.inline_asm_elementwise("mov.b32 $0, $1;", "=f,f", [step], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tile_gate_up_kernel(xp_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, act_ptr, H, INTER,
                         stride_w, stride_s, TOPK: tl.constexpr, SITU: tl.constexpr, BETA, LBETA, BT: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
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
        x = _tile_inputs(xp_ptr, token, valid, part, k0, H, BK, EVEN_K)  # once for the gate and the up rows
        acc_g = _codes_dot(acc_g, w_ptr, s_ptr, gate, nmask, x, k0, H, stride_w, stride_s, BN, BK, EVEN_K)
        acc_u = _codes_dot(acc_u, w_ptr, s_ptr, gate + INTER, nmask, x, k0, H, stride_w, stride_s, BN, BK, EVEN_K)
    # the parts' columns summed: [BN, BT], the tile's rows' gate and up sums
    y = _glu(tl.sum(tl.reshape(acc_g, (BN, 4, BT)), 1), tl.sum(tl.reshape(acc_u, (BN, 4, BT)), 1), SITU, BETA, LBETA)
    j = r + tl.arange(0, BT)  # act rows in sorted order, as parts for the down kernel
    _store_parts(act_ptr + (j.to(tl.int64) * (PARTS * INTER))[None, :] + n[:, None], INTER, y,
                 nmask[:, None] & (j < end)[None, :])


@triton.jit
def _tile_down_kernel(ap_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H, INTER,
                      stride_w, stride_s, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    e, r, end = _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr)
    if e < 0:
        return
    place, valid, part = _tile_columns(r, end, BT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < H
    acc = tl.zeros([BN, 4 * BT], dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        x = _tile_inputs(ap_ptr, place.to(tl.int64), valid, part, k0, INTER, BK, EVEN_K)
        acc = _codes_dot(acc, w_ptr, s_ptr, e.to(tl.int64) * H + n, nmask, x, k0, INTER, stride_w, stride_s, BN,
                         BK, EVEN_K)
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
                                       (16, 4, 4, 3), (16, 16, 4, 2), (32, 8, 4, 2))]
_mxfp4_gate_up_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER", "TOPK"])(_mxfp4_gate_up_kernel)
_mxfp4_down_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER"])(_mxfp4_down_kernel)


# Sorted tiles: BT pairs of one expert (x 4 parts: the product's N) x BN outputs (its M), BK inputs a step.
_TILE_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
                 for bn, bk, w, st in ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3),
                                       (64, 64, 4, 3), (64, 64, 4, 4))]
# EVEN_K: the inputs are whole steps (K3's 3584 and 3072 for every BK here), so no load needs a mask along them
_tile_gate_up = triton.heuristics({"EVEN_K": lambda a: a["H"] % a["BK"] == 0})(_tile_gate_up_kernel)
_tile_down = triton.heuristics({"EVEN_K": lambda a: a["INTER"] % a["BK"] == 0})(_tile_down_kernel)
_tile_gate_up_tuned = triton.autotune(_TILE_CONFIGS, key=["H", "INTER", "BT"])(_tile_gate_up)
_tile_down_tuned = triton.autotune(_TILE_CONFIGS, key=["H", "INTER", "BT"])(_tile_down)


def _mxfp4_args(packed: torch.Tensor, scale: torch.Tensor) -> tuple:
    packed, scale = packed.contiguous(), scale.contiguous().view(torch.uint8)
    if packed.data_ptr() % 4:  # the kernels read the codes as 32-bit words (rows are H / 2 bytes: 16 k bytes)
        packed = packed.clone()
    # the codes' row stride in int32 words (a row is H / 2 bytes, H a multiple of 32): the kernels' offsets are
    # then multiples of it, which lets them read 16 bytes at once
    return packed, scale, packed.shape[-1] // 4, scale.shape[-1]


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
        _tile_gate_up[(count, triton.cdiv(inter, config["BN"]))](*gate_up, **glu, BT=tile_rows, **config)
        _tile_down[(count, triton.cdiv(H, config["BN"]))](*down, BT=tile_rows, **config)
    else:
        _tile_gate_up_tuned[lambda m: (count, triton.cdiv(inter, m["BN"]))](*gate_up, **glu, BT=tile_rows)
        _tile_down_tuned[lambda m: (count, triton.cdiv(H, m["BN"]))](*down, BT=tile_rows)
    return out
