"""Fused dequant-matmul Triton kernels for decode-sized inputs (x of 1..16 rows), CUDA only.

Importing this module imports Triton; ``linear.qlinear`` does that lazily, on the first CUDA
input, and falls back to the torch reference when Triton is missing.

Every kernel gives each program BN output rows and, for weights with few rows (experts), one
slice of the inputs, the slices' partial sums being added afterwards, so that every SM has
work. Programs walk the inputs a tile at a time and request the next tile's bytes before
decoding the current one. Two kernels:

- GEMV (x of at most GEMV_MAX_ROWS rows; see GEMV_CODECS), CUDA cores. Weights are read as int32 words; each
  word holds several codes, decoded by shifts and masks and turned into floats with the
  2^23 trick (OR the integer into the mantissa of 2^23, subtract 2^23) instead of the slow
  int-to-float instruction. A word's j-th code meets the x inputs at stride j, so nothing is
  reordered. Codes times scales are exactly the values the torch reference dequantizes, and
  the sums run in fp32.
- Tensor cores (more rows). Every codec's codes are small integers (int8, int4, int6) or
  E2M1 values times two (integers up to 12), all exact in bfloat16, so they go to the tensor
  cores as they are and the scales are applied to the fp32 partial sums. A float32 (or
  float16) x is split into two bfloat16 rows hi + lo (x - hi) that keep about 16 bits of it;
  a bfloat16 x is used as is. For group-wise codecs one step covers NG scale groups: X^T gets
  NG copies of the x rows ("virtual rows"), copy j holding x only at the inputs of group j,
  so one matmul yields every group's partial sum separately; each is multiplied by its
  group's scale and the copies are summed at the end. The copies fill tensor-core rows that
  would otherwise be padding (16 is the smallest tile).

Either way the result differs from the torch reference in summation order (and, on the
tensor cores with a float32 x, the ~16-bit split) only.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # qlinear sends at most this many rows of x
GEMV_MAX_ROWS = 4  # the CUDA-core kernel multiplies each weight once per row; past this it loses
# Codecs whose GEMV beat the tensor-core kernel at one row on an H200 (K3 shapes, fp32 x):
# int8 2.0 vs 1.6 TB/s, int6 0.58 vs 0.20, MXFP4 about equal (experts 0.35 vs 0.32); for
# int4 the tensor-core kernel won (0.80 vs 0.68 TB/s), so int4 always uses it.
GEMV_CODECS = ("int8", "int6", "mxfp4")
CODEC_IDS = {"int4": 0, "int6": 1, "mxfp4": 2, "int8": 3}
GROUPED_INT8 = 4  # the GEMV kernel's CODEC for int8 codes with float16 group scales (the kernels test CODEC == 4)
# Codes per int32 word (int6: per 3 words) in the GEMV kernel; the input width must divide by it.
_PER_ENTRY = {"int4": 8, "int6": 16, "mxfp4": 8, "int8": 4}
_BK_MAX_DOT = 128  # inputs per step of the grouped tensor-core kernel (larger tiles spill registers)
_MAGIC = 8388608.0  # 2^23


def supports(codec: str, group_size: int) -> bool:
    """Whether a kernel exists for this codec and group size."""
    if codec == "int8":
        # Row scales; grouped (float16 per group of a multiple of 32 dividing the width): the GEMV kernel.
        return group_size == 0 or group_size % 32 == 0
    if codec in CODEC_IDS:
        # Tiles must be powers of two; one step spans whole groups.
        return 16 <= group_size <= 256 and group_size & (group_size - 1) == 0
    return False


def usable(codec: str, group_size: int, tensors: dict[str, torch.Tensor]) -> bool:
    """supports() plus what the GEMV kernel's int32 view of the codes needs."""
    if not supports(codec, group_size):
        return False
    w = tensors["weight"] if codec == "int8" else tensors["weight_packed"]
    n_in = w.shape[1] * 4 // 3 if codec == "int6" else w.shape[1] * (1 if codec == "int8" else 2)
    return w.is_contiguous() and w.data_ptr() % 4 == 0 and n_in % _PER_ENTRY[codec] == 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def plan_rows(m: int, split_x: bool, group_size: int | None) -> tuple[int, int]:
    """(R, NG) of the tensor-core kernels: R virtual x rows per group copy (x rows, doubled
    when split) and NG group copies per step, with R * NG >= 16."""
    rows = _next_pow2(m * (2 if split_x else 1))
    if group_size is None:
        return max(16, rows), 1
    ng = max(1, min(_BK_MAX_DOT // group_size, 16 // rows), 64 // group_size)
    return max(rows, 16 // ng), ng


# ----------------------------------------------------------------------------- GEMV

@triton.jit
def _float_code(u, OFFSET: tl.constexpr):
    """Small non-negative int32 u -> float(u - OFFSET), exactly, without int-to-float."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _word_code(a, J: tl.constexpr, CODEC: tl.constexpr):
    """Code J of each int32 word as fp32: int8 byte, int4 nibble, or twice the MXFP4 value."""
    if CODEC == 3 or CODEC == 4:  # int8, row or group scales
        # Flipping the sign bit of a two's complement byte gives code + 128.
        f = _float_code(((a >> (8 * J)) & 255) ^ 128, 128)
    elif CODEC == 0:
        f = _float_code((a >> (4 * J)) & 15, 8)
    else:
        nib = (a >> (4 * J)) & 15
        mag = nib & 7
        # E2M1 magnitude times two: 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12.
        twice = mag + tl.maximum(mag - 4, 0) + 2 * tl.maximum(mag - 6, 0)
        f = _float_code(twice, 0)
        f = tl.where((nib & 8) != 0, -f, f)
    return f


@triton.jit
def _int6_code(a, b, c, T: tl.constexpr):
    """Code T (0..15) of the 16 int6 codes in the 96 bits a | b << 32 | c << 64, as fp32."""
    if T < 5:
        u = (a >> (6 * T)) & 63
    elif T == 5:
        u = ((a >> 30) & 3) | ((b & 15) << 2)
    elif T < 10:
        u = (b >> (6 * T - 32)) & 63
    elif T == 10:
        u = ((b >> 28) & 15) | ((c & 3) << 4)
    else:
        u = (c >> (6 * T - 64)) & 63
    return _float_code(u, 32)


@triton.jit
def _scale_factors(s, CODEC: tl.constexpr):
    """Stored group scales -> fp32 factors (MXFP4: E8M0 byte s -> 2^(s-128), folding in the doubled
    codes; 255 -> NaN; others: the fp16 scale itself)."""
    if CODEC == 2:
        e = s.to(tl.int32)
        bits = tl.where(e >= 2, (e - 1) << 23, tl.where(e == 1, 1 << 22, 1 << 21))
        bits = tl.where(e == 255, 0x7FC00000, bits)
        f = bits.to(tl.float32, bitcast=True)
    else:
        f = s.to(tl.float32)
    return f


@triton.jit
def _gemv_scales(s_ptr, rows, mask_n, stride_sn, e, k_end, P: tl.constexpr, G: tl.constexpr,
                 CODEC: tl.constexpr):
    """fp32 [BN, W]: the scale of each entry's group (MXFP4: 2^(s-128), the codes being doubled)."""
    s = tl.load(s_ptr + rows[:, None] * stride_sn + ((e * P) // G)[None, :],
                mask=mask_n[:, None] & ((e * P)[None, :] < k_end), other=0)
    return _scale_factors(s, CODEC)


@triton.jit
def _gemv_accumulate(acc, f, x_ptr, stride_xm, M, e, k_end, J: tl.constexpr, P: tl.constexpr,
                     RF: tl.constexpr):
    """acc [RF, BN, W] += f [BN, W] times x at inputs e * P + J of every row."""
    k = e * P + J
    r = tl.arange(0, RF)
    x = tl.load(x_ptr + r[:, None] * stride_xm + k[None, :], mask=(r[:, None] < M) & (k[None, :] < k_end),
                other=0.0).to(tl.float32)
    return acc + f[None, :, :] * x[:, None, :]


@triton.jit
def _load_words(w_ptr, rows, mask_n, stride_wn, e, e_end, PLANE: tl.constexpr, STEP: tl.constexpr):
    return tl.load(w_ptr + rows[:, None] * stride_wn + (e * STEP + PLANE)[None, :],
                   mask=mask_n[:, None] & (e[None, :] < e_end), other=0)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym,
                 stride_ys, CODEC: tl.constexpr, G: tl.constexpr, P: tl.constexpr, RF: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    """y = x @ W^T on the CUDA cores. w_ptr: int32 words; an entry is one word of P codes
    (int8, int4, MXFP4) or three words of 16 codes (int6)."""
    W: tl.constexpr = BK // P
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    e_end = k_end // P
    acc = tl.zeros((RF, BN, W), dtype=tl.float32)
    if CODEC == 1:
        e = k_begin // P + tl.arange(0, W)
        an = _load_words(w_ptr, rows, mask_n, stride_wn, e, e_end, 0, 3)
        bn_ = _load_words(w_ptr, rows, mask_n, stride_wn, e, e_end, 1, 3)
        cn = _load_words(w_ptr, rows, mask_n, stride_wn, e, e_end, 2, 3)
        for k0 in range(k_begin, k_end, BK):
            a = an
            b = bn_
            c = cn
            e = k0 // P + tl.arange(0, W)
            an = _load_words(w_ptr, rows, mask_n, stride_wn, e + W, e_end, 0, 3)
            bn_ = _load_words(w_ptr, rows, mask_n, stride_wn, e + W, e_end, 1, 3)
            cn = _load_words(w_ptr, rows, mask_n, stride_wn, e + W, e_end, 2, 3)
            s = _gemv_scales(s_ptr, rows, mask_n, stride_sn, e, k_end, P, G, CODEC)
            for t in tl.static_range(16):
                acc = _gemv_accumulate(acc, _int6_code(a, b, c, t) * s, x_ptr, stride_xm, M, e, k_end, t, P, RF)
    else:
        e = k_begin // P + tl.arange(0, W)
        an = _load_words(w_ptr, rows, mask_n, stride_wn, e, e_end, 0, 1)
        for k0 in range(k_begin, k_end, BK):
            a = an
            e = k0 // P + tl.arange(0, W)
            an = _load_words(w_ptr, rows, mask_n, stride_wn, e + W, e_end, 0, 1)
            if CODEC == 3:
                for j in tl.static_range(P):
                    acc = _gemv_accumulate(acc, _word_code(a, j, CODEC), x_ptr, stride_xm, M, e, k_end, j, P, RF)
            else:
                s = _gemv_scales(s_ptr, rows, mask_n, stride_sn, e, k_end, P, G, CODEC)
                for j in tl.static_range(P):
                    acc = _gemv_accumulate(acc, _word_code(a, j, CODEC) * s, x_ptr, stride_xm, M, e, k_end, j,
                                           P, RF)
    out = tl.sum(acc, axis=2)
    if CODEC == 3:  # row scales, applied after the sum (grouped int8 scaled each code above)
        out = out * tl.load(s_ptr + rows, mask=mask_n, other=0.0)[None, :]
    m = tl.arange(0, RF)
    tl.store(y_ptr + tl.program_id(1) * stride_ys + m[:, None] * stride_ym + rows[None, :],
             out.to(y_ptr.dtype.element_ty), mask=(m[:, None] < M) & mask_n[None, :])


# ----------------------------------------------------------------------------- tensor cores

@triton.jit
def _x_tile(x_ptr, stride_xm, M, K, k0, BK: tl.constexpr, R: tl.constexpr, SPLIT_X: tl.constexpr,
            DOT_F32: tl.constexpr):
    """x^T for inputs k0..k0+BK-1 as [BK, R]: column r is x row r, or with SPLIT_X the hi (even r)
    or lo (odd r) bfloat16 part of x row r // 2. Columns past the real rows are zero.
    DOT_F32 keeps fp32 (Triton's CPU interpreter mishandles bfloat16; tests use it there)."""
    offs_k = k0 + tl.arange(0, BK)
    r = tl.arange(0, R)
    m = r // 2 if SPLIT_X else r
    x = tl.load(x_ptr + m[None, :] * stride_xm + offs_k[:, None],
                mask=(m[None, :] < M) & (offs_k[:, None] < K), other=0.0).to(tl.float32)
    if SPLIT_X:
        hi = x.to(tl.bfloat16).to(tl.float32)
        x = tl.where((r % 2 == 0)[None, :], hi, x - hi)
    if not DOT_F32:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _dot(w, xt, DOT_F32: tl.constexpr):
    if DOT_F32:
        out = tl.dot(w.to(tl.float32), xt, input_precision="ieee")
    else:
        out = tl.dot(w.to(tl.bfloat16), xt)
    return out


@triton.jit
def _store_cols(y_ptr, stride_ym, acc, rows, mask_n, M, BN: tl.constexpr, R: tl.constexpr,
                SPLIT_X: tl.constexpr):
    """acc [BN, R] (one column per virtual row) -> y[m, n], adding the hi and lo columns."""
    if SPLIT_X:
        out = tl.sum(tl.reshape(acc, (BN, R // 2, 2)), axis=2)
        m = tl.arange(0, R // 2)
    else:
        out = acc
        m = tl.arange(0, R)
    tl.store(y_ptr + m[None, :] * stride_ym + rows[:, None], out.to(y_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (m[None, :] < M))


@triton.jit
def _load_int8(w_ptr, rows, mask_n, stride_wn, k0, k_end, BK: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :],
                   mask=mask_n[:, None] & (offs_k[None, :] < k_end), other=0)


@triton.jit(do_not_specialize=["M"])
def _int8_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                     BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, SPLIT_X: tl.constexpr,
                     DOT_F32: tl.constexpr = False):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BN, R), dtype=tl.float32)
    w_next = _load_int8(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, BK)
    for k0 in range(k_begin, k_end, BK):
        w = w_next
        w_next = _load_int8(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, BK)
        acc += _dot(w, _x_tile(x_ptr, stride_xm, M, k_end, k0, BK, R, SPLIT_X, DOT_F32), DOT_F32)
    acc = acc * tl.load(s_ptr + rows, mask=mask_n, other=0.0)[:, None]
    _store_cols(y_ptr + tl.program_id(1) * stride_ys, stride_ym, acc, rows, mask_n, M, BN, R, SPLIT_X)


@triton.jit
def _load_packed(w_ptr, rows, mask_n, stride_wn, k0, k_end, BK: tl.constexpr):
    """int4 / MXFP4 bytes of inputs k0..k0+BK-1: uint8 [BN, BK/2]."""
    offs = k0 // 2 + tl.arange(0, BK // 2)
    return tl.load(w_ptr + rows[:, None] * stride_wn + offs[None, :],
                   mask=mask_n[:, None] & (offs[None, :] < k_end // 2), other=0)


@triton.jit
def _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k0, k_end, PLANE: tl.constexpr, BK: tl.constexpr):
    """Byte PLANE (0..2) of every 3-byte word of int6 inputs k0..k0+BK-1: uint8 [BN, BK/4]."""
    word = k0 // 4 + tl.arange(0, BK // 4)
    return tl.load(w_ptr + rows[:, None] * stride_wn + (word * 3 + PLANE)[None, :],
                   mask=mask_n[:, None] & (word[None, :] < k_end // 4), other=0)


@triton.jit
def _unpack_nibbles(b, CODEC: tl.constexpr):
    """uint8 [BN, BK/2] -> int32 codes [BN, BK] (int4: signed code; MXFP4: twice the E2M1 value)."""
    b = b.to(tl.int32)
    nib = tl.interleave(b & 15, b >> 4)
    if CODEC == 0:
        codes = nib - 8
    else:
        mag = nib & 7
        twice = mag + tl.maximum(mag - 4, 0) + 2 * tl.maximum(mag - 6, 0)
        codes = tl.where(nib >= 8, -twice, twice)
    return codes


@triton.jit
def _unpack_int6(p0, p1, p2):
    """The three byte planes [BN, BK/4] -> int32 codes [BN, BK] (layout in intq.py)."""
    b0 = p0.to(tl.int32)
    b1 = p1.to(tl.int32)
    b2 = p2.to(tl.int32)
    u0 = b0 & 63
    u1 = (b0 >> 6) | ((b1 & 15) << 2)
    u2 = (b1 >> 4) | ((b2 & 3) << 4)
    u3 = b2 >> 2
    return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3)) - 32


@triton.jit
def _scales(s_ptr, rows, mask_n, stride_sn, g0, n_groups, CODEC: tl.constexpr, NG: tl.constexpr):
    """fp32 [BN, NG] factors of groups g0..g0+NG-1 (MXFP4: 2^(s-128), folding in the doubled codes)."""
    g = g0 + tl.arange(0, NG)
    s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=mask_n[:, None] & (g[None, :] < n_groups),
                other=0)
    return _scale_factors(s, CODEC)


@triton.jit
def _group_step(acc, codes, x_ptr, stride_xm, M, s_ptr, rows, mask_n, stride_sn, k0, k_end, n_groups,
                CODEC: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                SPLIT_X: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BN, NG*R] += per-group partial sums of one step, each times its group's scale."""
    BK: tl.constexpr = NG * G
    BM: tl.constexpr = NG * R
    # Virtual row (j, r), at column j * R + r, sees x row r only at inputs of the step's group j.
    in_group = (tl.arange(0, BK) // G)[:, None, None] == tl.arange(0, NG)[None, :, None]
    xt = _x_tile(x_ptr, stride_xm, M, k_end, k0, BK, R, SPLIT_X, DOT_F32)
    xv = tl.reshape(tl.where(in_group, xt[:, None, :], 0.0).to(xt.dtype), (BK, BM))
    s = _scales(s_ptr, rows, mask_n, stride_sn, k0 // G, n_groups, CODEC, NG)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, NG, R)), (BN, BM))
    return acc + _dot(codes, xv, DOT_F32) * s


@triton.jit(do_not_specialize=["M"])
def _grouped_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn,
                        stride_ym, stride_ys, CODEC: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                        R: tl.constexpr, BN: tl.constexpr, SPLIT_X: tl.constexpr, DOT_F32: tl.constexpr = False):
    BK: tl.constexpr = NG * G
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    n_groups = k_end // G
    acc = tl.zeros((BN, NG * R), dtype=tl.float32)
    if CODEC == 1:
        p0n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, 0, BK)
        p1n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, 1, BK)
        p2n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, 2, BK)
        for k0 in range(k_begin, k_end, BK):
            p0 = p0n
            p1 = p1n
            p2 = p2n
            p0n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, 0, BK)
            p1n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, 1, BK)
            p2n = _load_int6_plane(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, 2, BK)
            acc = _group_step(acc, _unpack_int6(p0, p1, p2), x_ptr, stride_xm, M, s_ptr, rows, mask_n,
                              stride_sn, k0, k_end, n_groups, CODEC, G, NG, R, BN, SPLIT_X, DOT_F32)
    else:
        b_next = _load_packed(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, BK)
        for k0 in range(k_begin, k_end, BK):
            b = b_next
            b_next = _load_packed(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, BK)
            acc = _group_step(acc, _unpack_nibbles(b, CODEC), x_ptr, stride_xm, M, s_ptr, rows, mask_n,
                              stride_sn, k0, k_end, n_groups, CODEC, G, NG, R, BN, SPLIT_X, DOT_F32)
    out = tl.sum(tl.reshape(acc, (BN, NG, R)), axis=1)
    _store_cols(y_ptr + tl.program_id(1) * stride_ys, stride_ym, out, rows, mask_n, M, BN, R, SPLIT_X)


# ----------------------------------------------------------------------------- launch

def _configs(shapes: list[dict]) -> list:
    # num_stages=1: the kernels prefetch the next tile themselves.
    return [triton.Config({k: v for k, v in d.items() if k != "warps"}, num_warps=d["warps"], num_stages=1)
            for d in shapes]


_GEMV_CONFIGS = _configs([dict(BN=bn, BK=bk, warps=w) for bn, bk, w in
                          ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8))])
_INT8_DOT_CONFIGS = _configs([dict(BN=bn, BK=bk, warps=w) for bn, bk, w in
                              ((32, 256, 4), (64, 128, 4), (128, 128, 8))])
_GROUPED_DOT_CONFIGS = _configs([dict(BN=bn, warps=w) for bn, w in ((32, 4), (64, 4), (128, 8))])
# Tuned per weight shape and row plan on first use (a fraction of a second each), then cached.
_gemv_tuned = triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "CODEC", "G", "RF"])(_gemv_kernel)
_int8_dot_tuned = triton.autotune(configs=_INT8_DOT_CONFIGS, key=["N", "K", "R"])(_int8_dot_kernel)
_grouped_dot_tuned = triton.autotune(configs=_GROUPED_DOT_CONFIGS, key=["N", "K", "G", "CODEC", "R", "NG"])(
    _grouped_dot_kernel)
_STEP = 512  # every BK above divides it, so a K slice is whole tiles


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _k_split(n: int, k: int, x: torch.Tensor, splits: int | None) -> int:
    """Inputs per program along K. A weight with few output rows (an expert) gives too few
    programs to keep every SM reading, so K is split and the partial sums added afterwards."""
    if splits is None:
        sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
        splits = max(1, min(k // _STEP, round(3 * sms / triton.cdiv(n, 64))))
    return triton.cdiv(triton.cdiv(k, splits), _STEP) * _STEP


def qlinear_triton(x: torch.Tensor, codec: str, tensors: dict[str, torch.Tensor], group_size: int,
                   method: str = "auto", config: dict | None = None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T for M <= 16, W given as a codec's tensors (see linear.py).

    method: "gemv" (CUDA cores), "dot" (tensor cores) or "auto" (gemv for GEMV_CODECS up to
    GEMV_MAX_ROWS rows, else dot).
    config: fixed launch parameters instead of autotuning ({"BN": .., "BK": .. (not for the
    grouped dot kernel), optionally "num_warps", "DOT_F32", "SPLITS" (K slices)}); tests use it
    to cover each kernel and to run them under TRITON_INTERPRET on a CPU.
    """
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"the Triton kernels take at most {MAX_ROWS} rows, got {m}")
    if not usable(codec, group_size, tensors):
        raise ValueError(f"no Triton kernel for codec {codec} with group size {group_size} and these tensors")
    config = dict(config or {})
    splits = config.pop("SPLITS", None)
    x = x.contiguous()
    w = tensors["weight"] if codec == "int8" else tensors["weight_packed"]
    s = tensors["weight_scale"]
    n = w.shape[0]
    k_split = _k_split(n, k, x, splits)
    n_split = triton.cdiv(k, k_split)
    # One slice writes y directly; several write fp32 partial sums that are added in order.
    y = torch.empty((n_split, m, n), dtype=torch.float32 if n_split > 1 else x.dtype, device=x.device)
    common = (x, None, s, y, m, n, k, k_split, x.stride(0))
    grouped_int8 = codec == "int8" and group_size > 0  # no tensor-core kernel: the GEMV one at any row count
    gemv = method == "gemv" or grouped_int8 or (method == "auto" and m <= GEMV_MAX_ROWS and codec in GEMV_CODECS)
    if gemv:
        wq = w.view(torch.int32)
        args = common[:1] + (wq,) + common[2:] + (wq.stride(0), s.stride(0), y.stride(1), y.stride(0))
        consts = dict(CODEC=GROUPED_INT8 if grouped_int8 else CODEC_IDS[codec], G=max(group_size, 1),
                      P=_PER_ENTRY[codec], RF=_next_pow2(m))
        tuned, plain = _gemv_tuned, _gemv_kernel
    else:
        split_x = x.dtype != torch.bfloat16
        if codec == "int8":
            r, _ = plan_rows(m, split_x, None)
            args = common[:1] + (w,) + common[2:] + (w.stride(0), y.stride(1), y.stride(0))
            consts = dict(R=r, SPLIT_X=split_x)
            tuned, plain = _int8_dot_tuned, _int8_dot_kernel
        else:
            r, ng = plan_rows(m, split_x, group_size)
            args = common[:1] + (w,) + common[2:] + (w.stride(0), s.stride(0), y.stride(1), y.stride(0))
            consts = dict(CODEC=CODEC_IDS[codec], G=group_size, NG=ng, R=r, SPLIT_X=split_x)
            tuned, plain = _grouped_dot_tuned, _grouped_dot_kernel
    if config:
        plain[(triton.cdiv(n, config["BN"]), n_split)](*args, **consts, **config)
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BN"]), n_split)](*args, **consts)
    return y[0] if n_split == 1 else y.sum(0, dtype=x.dtype)
