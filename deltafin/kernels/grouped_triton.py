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
weights once per pair. ``sorted_mxfp4_mlp`` takes the pairs sorted by expert instead, in tiles of one
expert's pairs: of CORE_TILE_ROWS (4) pairs, the pair kernels' work with each step's codes decoded
once for the four rows (CUDA cores: decode batches); or of BM pairs (32), each program decoding the
expert's tile once for all BM rows and multiplying on the tensor cores, as exact as fp32 products
(``_exact_dot``: the pair kernels' values up to summation order; on a K3-shaped layer 3.8x faster than
fp32 products without tensor cores; prompts). The tiles are laid out on the device (no routing read
back), so a recorded graph holds them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _scale_factors

MXFP4 = tl.constexpr(2)  # triton_kernels' codec id
GROUP = tl.constexpr(32)  # MXFP4 inputs per scale

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
def _row_step(acc, lo, hi, f, x_ptr, n_groups, k0, G: tl.constexpr):
    """acc [BN, G] plus one row's group sums of a step against the decoded groups."""
    x_lo, x_hi = _group_inputs(x_ptr, n_groups, k0, G)
    return acc + _group_sums(lo, hi, f, x_lo, x_hi)


@triton.jit
def _gate_up_step(acc_g, acc_u, lg, hg, fg, lu, hu, fu, x_ptr, n_groups, k0, G: tl.constexpr):
    """The gate and up accumulators of one row plus its group sums of a step, its inputs read once for both."""
    x_lo, x_hi = _group_inputs(x_ptr, n_groups, k0, G)
    return acc_g + _group_sums(lg, hg, fg, x_lo, x_hi), acc_u + _group_sums(lu, hu, fu, x_lo, x_hi)


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
def _mxfp4_tile(w_ptr, s_ptr, rows, nmask, k0, K, stride_w, stride_s, BK: tl.constexpr):
    """MXFP4 rows `rows` (BN of them) at inputs k0 .. k0 + BK, decoded and transposed for a product:
    bf16 [BK/2, BN] of the even inputs (low nibbles) and of the odd ones (high nibbles). Exact: a
    decoded weight is an E2M1 value (two significant bits) times a power of two."""
    byte = k0 // 2 + tl.arange(0, BK // 2)
    m = (byte < K // 2)[:, None] & nmask[None, :]
    b = tl.load(w_ptr + rows[None, :] * stride_w + byte[:, None], mask=m, other=0).to(tl.int32)
    sc = tl.load(s_ptr + rows[None, :] * stride_s + (byte // (GROUP // 2))[:, None], mask=m, other=0)
    f = _scale_factors(sc, MXFP4) * 32768.0  # as in _mxfp4_groups
    return (_e2m1_fp16(b, 0) * f).to(tl.bfloat16), (_e2m1_fp16(b, 4) * f).to(tl.bfloat16)


@triton.jit
def _exact_dot(x, w):
    """x fp32 [M, K] @ w bf16 [K, N] on the tensor cores, as exact as fp32 products: x is split into
    three bf16 parts that sum to it exactly (8 significant bits each, fp32 has 24), each part times
    the exact bf16 weights is an exact product, and the sums are fp32."""
    x1 = x.to(tl.bfloat16)
    r = x - x1.to(tl.float32)
    x2 = r.to(tl.bfloat16)
    x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(x1, w) + tl.dot(x2, w) + tl.dot(x3, w)


@triton.jit
def _tile_rows(tile_e_ptr, tile_r_ptr, ends_ptr, BM: tl.constexpr):
    """Tile program_id(0)'s expert (-1: no tile) and its sorted rows (with their mask)."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    r = tl.load(tile_r_ptr + t) + tl.arange(0, BM)
    end = tl.load(ends_ptr + tl.maximum(e, 0))
    return e, r, r < end


@triton.jit
def _rows_times_tile(acc, x_ptr, row_off, rmask, w_ptr, s_ptr, wrows, nmask, K, stride_w, stride_s,
                     BK: tl.constexpr):
    """acc [BM, BN] += x[rows, :K] @ w[wrows, :K]^T, the MXFP4 tile decoded BK inputs at a time."""
    for k0 in range(0, K, BK):
        i = k0 + 2 * tl.arange(0, BK // 2)
        m = rmask[:, None] & (i < K)[None, :]
        xe = tl.load(x_ptr + row_off[:, None] + i[None, :], mask=m, other=0.0)
        xo = tl.load(x_ptr + row_off[:, None] + i[None, :] + 1, mask=m, other=0.0)
        lo, hi = _mxfp4_tile(w_ptr, s_ptr, wrows, nmask, k0, K, stride_w, stride_s, BK)
        acc += _exact_dot(xe, lo) + _exact_dot(xo, hi)
    return acc


@triton.jit
def _sorted_mxfp4_gate_up_kernel(x_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H,
                                 INTER, stride_w, stride_s, TOPK: tl.constexpr, SITU: tl.constexpr, BETA, LBETA,
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, r, rmask = _tile_rows(tile_e_ptr, tile_r_ptr, ends_ptr, BM)
    if e < 0:
        return
    token = (tl.load(order_ptr + r, mask=rmask, other=0) // TOPK).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < INTER
    gate_rows = e.to(tl.int64) * (2 * INTER) + n
    acc_g = _rows_times_tile(tl.zeros([BM, BN], dtype=tl.float32), x_ptr, token * H, rmask, w_ptr, s_ptr,
                             gate_rows, nmask, H, stride_w, stride_s, BK)
    acc_u = _rows_times_tile(tl.zeros([BM, BN], dtype=tl.float32), x_ptr, token * H, rmask, w_ptr, s_ptr,
                             gate_rows + INTER, nmask, H, stride_w, stride_s, BK)
    y = _glu(acc_g, acc_u, SITU, BETA, LBETA)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * INTER + n[None, :], y, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _sorted_mxfp4_down_kernel(a_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H, INTER,
                              stride_w, stride_s, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, r, rmask = _tile_rows(tile_e_ptr, tile_r_ptr, ends_ptr, BM)
    if e < 0:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < H
    acc = _rows_times_tile(tl.zeros([BM, BN], dtype=tl.float32), a_ptr, r.to(tl.int64) * INTER, rmask, w_ptr,
                           s_ptr, e.to(tl.int64) * H + n, nmask, INTER, stride_w, stride_s, BK)
    pair = tl.load(order_ptr + r, mask=rmask, other=0).to(tl.int64)  # stored at the pair's own place
    tl.store(out_ptr + pair[:, None] * H + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr):
    """Tile program_id(0)'s expert (-1: no tile), first sorted place and the end of its expert's places."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    r = tl.load(tile_r_ptr + t)
    return e, r, tl.load(ends_ptr + tl.maximum(e, 0))


@triton.jit
def _row_in(order_ptr, r, i: tl.constexpr, end, div: tl.constexpr):
    """Sorted place r + i of a tile: whether it is one of the expert's, and its pair // div."""
    valid = r + i < end
    return valid, (tl.load(order_ptr + r + i, mask=valid, other=0) // div).to(tl.int64)


@triton.jit
def _groups_of(v0, v1, v2, v3, K):
    """Groups of 32 inputs of each of a tile's four rows: K's, or 0 for a missing row."""
    return (tl.where(v0, K // GROUP, 0), tl.where(v1, K // GROUP, 0), tl.where(v2, K // GROUP, 0),
            tl.where(v3, K // GROUP, 0))


@triton.jit
def _rows_mxfp4_gate_up_kernel(x_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H, INTER,
                               stride_w, stride_s, TOPK: tl.constexpr, SITU: tl.constexpr, BETA, LBETA,
                               BN: tl.constexpr, G: tl.constexpr):
    """The pair kernel's work for the CORE_TILE_ROWS (4) rows of a tile of one expert, its codes decoded
    once for all of them: one accumulator per row, unrolled (Triton keeps no arrays of tensors)."""
    e, r, end = _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr)
    if e < 0:
        return
    v0, t0 = _row_in(order_ptr, r, 0, end, TOPK)
    v1, t1 = _row_in(order_ptr, r, 1, end, TOPK)
    v2, t2 = _row_in(order_ptr, r, 2, end, TOPK)
    v3, t3 = _row_in(order_ptr, r, 3, end, TOPK)
    n0, n1, n2, n3 = _groups_of(v0, v1, v2, v3, H)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < INTER
    gate_rows = e.to(tl.int64) * (2 * INTER) + n
    g0 = tl.zeros([BN, G], dtype=tl.float32)
    u0 = tl.zeros([BN, G], dtype=tl.float32)
    g1 = tl.zeros([BN, G], dtype=tl.float32)
    u1 = tl.zeros([BN, G], dtype=tl.float32)
    g2 = tl.zeros([BN, G], dtype=tl.float32)
    u2 = tl.zeros([BN, G], dtype=tl.float32)
    g3 = tl.zeros([BN, G], dtype=tl.float32)
    u3 = tl.zeros([BN, G], dtype=tl.float32)
    for k0 in range(0, H, G * GROUP):
        lg, hg, fg = _mxfp4_decoded(w_ptr, s_ptr, gate_rows, nmask, H, k0, stride_w, stride_s, G)
        lu, hu, fu = _mxfp4_decoded(w_ptr, s_ptr, gate_rows + INTER, nmask, H, k0, stride_w, stride_s, G)
        g0, u0 = _gate_up_step(g0, u0, lg, hg, fg, lu, hu, fu, x_ptr + t0 * H, n0, k0, G)
        g1, u1 = _gate_up_step(g1, u1, lg, hg, fg, lu, hu, fu, x_ptr + t1 * H, n1, k0, G)
        g2, u2 = _gate_up_step(g2, u2, lg, hg, fg, lu, hu, fu, x_ptr + t2 * H, n2, k0, G)
        g3, u3 = _gate_up_step(g3, u3, lg, hg, fg, lu, hu, fu, x_ptr + t3 * H, n3, k0, G)
    out = out_ptr + r.to(tl.int64) * INTER + n  # act rows in sorted order
    tl.store(out, _glu(tl.sum(g0, 1), tl.sum(u0, 1), SITU, BETA, LBETA), mask=n < tl.where(v0, INTER, 0))
    tl.store(out + INTER, _glu(tl.sum(g1, 1), tl.sum(u1, 1), SITU, BETA, LBETA), mask=n < tl.where(v1, INTER, 0))
    tl.store(out + 2 * INTER, _glu(tl.sum(g2, 1), tl.sum(u2, 1), SITU, BETA, LBETA), mask=n < tl.where(v2, INTER, 0))
    tl.store(out + 3 * INTER, _glu(tl.sum(g3, 1), tl.sum(u3, 1), SITU, BETA, LBETA), mask=n < tl.where(v3, INTER, 0))


@triton.jit
def _rows_mxfp4_down_kernel(a_ptr, order_ptr, tile_e_ptr, tile_r_ptr, ends_ptr, w_ptr, s_ptr, out_ptr, H, INTER,
                            stride_w, stride_s, BN: tl.constexpr, G: tl.constexpr):
    e, r, end = _tile_pairs(tile_e_ptr, tile_r_ptr, ends_ptr)
    if e < 0:
        return
    v0, p0 = _row_in(order_ptr, r, 0, end, 1)
    v1, p1 = _row_in(order_ptr, r, 1, end, 1)
    v2, p2 = _row_in(order_ptr, r, 2, end, 1)
    v3, p3 = _row_in(order_ptr, r, 3, end, 1)
    n0, n1, n2, n3 = _groups_of(v0, v1, v2, v3, INTER)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < H
    a = a_ptr + r.to(tl.int64) * INTER  # act rows in sorted order
    acc0 = tl.zeros([BN, G], dtype=tl.float32)
    acc1 = tl.zeros([BN, G], dtype=tl.float32)
    acc2 = tl.zeros([BN, G], dtype=tl.float32)
    acc3 = tl.zeros([BN, G], dtype=tl.float32)
    for k0 in range(0, INTER, G * GROUP):
        lo, hi, f = _mxfp4_decoded(w_ptr, s_ptr, e.to(tl.int64) * H + n, nmask, INTER, k0, stride_w, stride_s, G)
        acc0 = _row_step(acc0, lo, hi, f, a, n0, k0, G)
        acc1 = _row_step(acc1, lo, hi, f, a + INTER, n1, k0, G)
        acc2 = _row_step(acc2, lo, hi, f, a + 2 * INTER, n2, k0, G)
        acc3 = _row_step(acc3, lo, hi, f, a + 3 * INTER, n3, k0, G)
    # each row stored at its pair's own place
    tl.store(out_ptr + p0 * H + n, tl.sum(acc0, 1), mask=n < tl.where(v0, H, 0))
    tl.store(out_ptr + p1 * H + n, tl.sum(acc1, 1), mask=n < tl.where(v1, H, 0))
    tl.store(out_ptr + p2 * H + n, tl.sum(acc2, 1), mask=n < tl.where(v2, H, 0))
    tl.store(out_ptr + p3 * H + n, tl.sum(acc3, 1), mask=n < tl.where(v3, H, 0))


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


# Sorted tiles: BM pairs of one expert (grouped.TILE_ROWS, the layout's) x BN outputs, BK inputs a step.
_SORTED_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
                   for bn, bk, w, st in ((64, 64, 4, 2), (32, 128, 4, 2), (128, 64, 8, 2))]
_sorted_gate_up_tuned = triton.autotune(_SORTED_CONFIGS, key=["H", "INTER"])(_sorted_mxfp4_gate_up_kernel)
_sorted_down_tuned = triton.autotune(_SORTED_CONFIGS, key=["H", "INTER"])(_sorted_mxfp4_down_kernel)
# Tiles of CORE_TILE_ROWS pairs go to the CUDA-core kernels (the pair kernels' tiles, each code decoded
# once for the tile's four rows), wider ones to the tensor cores.
CORE_TILE_ROWS = 4
_rows_gate_up_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER"])(_rows_mxfp4_gate_up_kernel)
_rows_down_tuned = triton.autotune(_MXFP4_CONFIGS, key=["H", "INTER"])(_rows_mxfp4_down_kernel)


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


def sorted_mxfp4_mlp(x: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, tiles: tuple, tile_rows: int,
                     topk: int, packed13, scale13, packed2, scale2, cfg, config: dict | None = None) -> torch.Tensor:
    """Every pair's w2 @ glu(w1 x, w3 x) from MXFP4 stacks (as ``mxfp4_gate_up``), the pairs sorted by
    expert: x fp32 [T, H]; order int32 [P], the pair at each sorted place (pair j: token j // topk);
    ends int32 [E]; tiles ``grouped.sorted_tiles(ends, P, tile_rows)`` -> fp32 [P, H] in pair order.
    Tiles of CORE_TILE_ROWS rows run on the CUDA cores, wider ones on the tensor cores.
    config: fixed {"BN", "BK"} (tensor cores) or {"BN", "G"} (CUDA cores) instead of tuning (tests)."""
    pairs, (_, two_i, half) = order.numel(), packed13.shape
    inter, H = two_i // 2, 2 * half
    tile_e, tile_r = tiles
    act = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)  # in sorted order
    out = torch.empty(pairs, H, dtype=torch.float32, device=x.device)
    w13, s13, sw13, ss13 = _mxfp4_args(packed13, scale13)
    w2, s2, sw2, ss2 = _mxfp4_args(packed2, scale2)
    count = tile_e.numel()
    gate_up = (x, order, tile_e, tile_r, ends, w13, s13, act, H, inter, sw13, ss13)
    down = (act, order, tile_e, tile_r, ends, w2, s2, out, H, inter, sw2, ss2)
    glu = dict(TOPK=topk, **_glu_args(cfg))
    if tile_rows == CORE_TILE_ROWS:
        kernels = (_rows_gate_up_tuned, _rows_down_tuned, _rows_mxfp4_gate_up_kernel, _rows_mxfp4_down_kernel)
        rows = {}
    else:
        kernels = (_sorted_gate_up_tuned, _sorted_down_tuned, _sorted_mxfp4_gate_up_kernel, _sorted_mxfp4_down_kernel)
        rows = {"BM": tile_rows}
    if config:
        kernels[2][(count, triton.cdiv(inter, config["BN"]))](*gate_up, **glu, **rows, **config)
        kernels[3][(count, triton.cdiv(H, config["BN"]))](*down, **rows, **config)
    else:
        kernels[0][lambda m: (count, triton.cdiv(inter, m["BN"]))](*gate_up, **glu, **rows)
        kernels[1][lambda m: (count, triton.cdiv(H, m["BN"]))](*down, **rows)
    return out
