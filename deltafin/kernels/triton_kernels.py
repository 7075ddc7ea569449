"""Fused dequant-matmul Triton kernels for decode-sized inputs (x of 1..16 rows), CUDA only.

Importing this module imports Triton; ``linear.qlinear`` does that lazily, on the first CUDA
input, and falls back to the torch reference when Triton is missing.

Each program owns BN output rows (and, for weights with few rows, one slice of the inputs:
the partial sums of the slices are added afterwards). It walks the input dimension a tile at
a time, requesting the next tile's bytes before decoding the current one. Two ways to do the
arithmetic, chosen per weight shape and row count by the autotuner (USE_DOT):

- CUDA cores (x of at most FMA_MAX_ROWS rows): codes times scales in fp32, exactly the values
  the torch reference dequantizes, then fp32 dot products with each x row.
- Tensor cores: every codec's codes are small integers (int8, int4, int6) or E2M1 values
  times two (integers up to 12), all exact in bfloat16, so they go to the tensor cores as
  they are and the scales are applied to the fp32 partial sums. A float32 (or float16) x is
  split into two bfloat16 rows hi + lo (x - hi) that keep about 16 bits of it; a bfloat16 x
  is used as is. For group-wise codecs one step covers NG scale groups: X^T gets NG copies of
  the x rows ("virtual rows"), copy j holding x only at the inputs of group j, so one matmul
  yields every group's partial sum separately; each is multiplied by its group's scale and
  the copies are summed at the end. The copies fill tensor-core rows that would otherwise be
  padding (16 is the smallest tile).

Either way the result differs from the torch reference in summation order (and, on the
tensor cores with a float32 x, the ~16-bit split) only.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # qlinear sends at most this many rows of x
FMA_MAX_ROWS = 4  # the CUDA-core way multiplies each weight once per row; past this it loses
GROUPED = {"int4": 0, "int6": 1, "mxfp4": 2}
_BK_MAX = 128  # inputs per step of the grouped kernel (larger tiles spill registers)


def supports(codec: str, group_size: int) -> bool:
    """Whether a kernel exists for this codec and group size."""
    if codec == "int8":
        return True
    if codec in GROUPED:
        # Tiles must be powers of two; one step spans whole groups.
        return 16 <= group_size <= 256 and group_size & (group_size - 1) == 0
    return False


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def plan_rows(m: int, split_x: bool, group_size: int | None) -> tuple[int, int, int]:
    """(R, NG, RF) for m rows of x.

    Tensor cores: R virtual rows per group copy (x rows, doubled when split) and NG group copies
    per step, with R * NG >= 16. CUDA cores: RF rows (m rounded up to a power of two).
    """
    rf = _next_pow2(m)
    rows = _next_pow2(m * (2 if split_x else 1))
    if group_size is None:
        return max(16, rows), 1, rf
    ng = max(1, min(_BK_MAX // group_size, 16 // rows), 64 // group_size)
    return max(rows, 16 // ng), ng, rf


@triton.jit
def _x_tile(x_ptr, stride_xm, M, K, k0, BK: tl.constexpr, R: tl.constexpr, SPLIT_X: tl.constexpr,
            DOT_F32: tl.constexpr):
    """x^T for inputs k0..k0+BK-1 as [BK, R]: column r is x row r, or with SPLIT_X the hi (even r)
    or lo (odd r) bfloat16 part of x row r // 2. Columns past the real rows are zero."""
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
def _fma_rows(acc, w, x_ptr, stride_xm, M, K, k0, BK: tl.constexpr, RF: tl.constexpr):
    """acc [BN, RF] += w [BN, BK] (fp32) times each x row's inputs k0..k0+BK-1, in fp32."""
    offs_k = k0 + tl.arange(0, BK)
    cols = tl.arange(0, RF)
    for r in tl.static_range(RF):
        xr = tl.load(x_ptr + r * stride_xm + offs_k, mask=(offs_k < K) & (r < M), other=0.0).to(tl.float32)
        val = tl.sum(w * xr[None, :], axis=1)
        acc += tl.where(cols[None, :] == r, val[:, None], 0.0)
    return acc


@triton.jit
def _zeros_acc(BN: tl.constexpr, DOT_COLS: tl.constexpr, RF: tl.constexpr, USE_DOT: tl.constexpr):
    if USE_DOT:
        acc = tl.zeros((BN, DOT_COLS), dtype=tl.float32)
    else:
        acc = tl.zeros((BN, RF), dtype=tl.float32)
    return acc


@triton.jit
def _store_rows(y_ptr, stride_ym, acc, rows, mask_n, M, BN: tl.constexpr, COLS: tl.constexpr,
                PAIRS: tl.constexpr):
    """acc [BN, COLS] (one column per row of x, or with PAIRS per hi/lo half) -> y[m, n]."""
    if PAIRS:
        out = tl.sum(tl.reshape(acc, (BN, COLS // 2, 2)), axis=2)
        m = tl.arange(0, COLS // 2)
    else:
        out = acc
        m = tl.arange(0, COLS)
    tl.store(y_ptr + m[None, :] * stride_ym + rows[:, None], out.to(y_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (m[None, :] < M))


@triton.jit
def _load_int8(w_ptr, rows, mask_n, stride_wn, k0, k_end, BK: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :],
                   mask=mask_n[:, None] & (offs_k[None, :] < k_end), other=0)


@triton.jit(do_not_specialize=["M"])
def _int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                 BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, RF: tl.constexpr, SPLIT_X: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_F32: tl.constexpr = False):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = _zeros_acc(BN, R, RF, USE_DOT)
    w_next = _load_int8(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, BK)
    for k0 in range(k_begin, k_end, BK):
        w = w_next
        w_next = _load_int8(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, BK)
        if USE_DOT:
            xt = _x_tile(x_ptr, stride_xm, M, k_end, k0, BK, R, SPLIT_X, DOT_F32)
            if DOT_F32:
                acc += tl.dot(w.to(tl.float32), xt, input_precision="ieee")
            else:
                acc += tl.dot(w.to(tl.bfloat16), xt)
        else:
            acc = _fma_rows(acc, w.to(tl.float32), x_ptr, stride_xm, M, k_end, k0, BK, RF)
    acc = acc * tl.load(s_ptr + rows, mask=mask_n, other=0.0)[:, None]
    y_ptr += tl.program_id(1) * stride_ys
    if USE_DOT:
        _store_rows(y_ptr, stride_ym, acc, rows, mask_n, M, BN, R, SPLIT_X)
    else:
        _store_rows(y_ptr, stride_ym, acc, rows, mask_n, M, BN, RF, False)


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
        # E2M1 magnitude times two: codes 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12.
        mag = nib & 7
        shift = tl.maximum((mag >> 1) - 1, 0)
        twice = tl.where(mag < 4, mag, ((mag & 1) + 2) << shift)
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
    if CODEC == 2:
        e = s.to(tl.int32)
        bits = tl.where(e >= 2, (e - 1) << 23, tl.where(e == 1, 1 << 22, 1 << 21))
        bits = tl.where(e == 255, 0x7FC00000, bits)
        f = bits.to(tl.float32, bitcast=True)
    else:
        f = s.to(tl.float32)
    return f


@triton.jit
def _group_step(acc, codes, x_ptr, stride_xm, M, s_ptr, rows, mask_n, stride_sn, k0, k_end, n_groups,
                CODEC: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, R: tl.constexpr, RF: tl.constexpr,
                BN: tl.constexpr, SPLIT_X: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += this step's products: NG groups of G inputs starting at k0."""
    BK: tl.constexpr = NG * G
    BM: tl.constexpr = NG * R
    s = _scales(s_ptr, rows, mask_n, stride_sn, k0 // G, n_groups, CODEC, NG)
    if USE_DOT:
        # Virtual row (j, r), at column j * R + r, sees x row r only at inputs of group j.
        in_group = (tl.arange(0, BK) // G)[:, None, None] == tl.arange(0, NG)[None, :, None]
        xt = _x_tile(x_ptr, stride_xm, M, k_end, k0, BK, R, SPLIT_X, DOT_F32)
        xv = tl.reshape(tl.where(in_group, xt[:, None, :], 0.0).to(xt.dtype), (BK, BM))
        if DOT_F32:
            part = tl.dot(codes.to(tl.float32), xv, input_precision="ieee")
        else:
            part = tl.dot(codes.to(tl.bfloat16), xv)
        acc += part * tl.reshape(tl.broadcast_to(s[:, :, None], (BN, NG, R)), (BN, BM))
    else:
        w = codes.to(tl.float32) * tl.reshape(tl.broadcast_to(s[:, :, None], (BN, NG, G)), (BN, BK))
        acc = _fma_rows(acc, w, x_ptr, stride_xm, M, k_end, k0, BK, RF)
    return acc


@triton.jit(do_not_specialize=["M"])
def _grouped_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym,
                    stride_ys, CODEC: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, R: tl.constexpr,
                    RF: tl.constexpr, BN: tl.constexpr, SPLIT_X: tl.constexpr, USE_DOT: tl.constexpr,
                    DOT_F32: tl.constexpr = False):
    BK: tl.constexpr = NG * G
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    n_groups = k_end // G
    acc = _zeros_acc(BN, NG * R, RF, USE_DOT)
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
                              stride_sn, k0, k_end, n_groups, CODEC, G, NG, R, RF, BN, SPLIT_X, USE_DOT, DOT_F32)
    else:
        b_next = _load_packed(w_ptr, rows, mask_n, stride_wn, k_begin, k_end, BK)
        for k0 in range(k_begin, k_end, BK):
            b = b_next
            b_next = _load_packed(w_ptr, rows, mask_n, stride_wn, k0 + BK, k_end, BK)
            acc = _group_step(acc, _unpack_nibbles(b, CODEC), x_ptr, stride_xm, M, s_ptr, rows, mask_n,
                              stride_sn, k0, k_end, n_groups, CODEC, G, NG, R, RF, BN, SPLIT_X, USE_DOT, DOT_F32)
    y_ptr += tl.program_id(1) * stride_ys
    if USE_DOT:
        out = tl.sum(tl.reshape(acc, (BN, NG, R)), axis=1)
        _store_rows(y_ptr, stride_ym, out, rows, mask_n, M, BN, R, SPLIT_X)
    else:
        _store_rows(y_ptr, stride_ym, acc, rows, mask_n, M, BN, RF, False)


def _prune(configs: list, nargs: dict, **kwargs) -> list:
    """The CUDA-core configs only where x has few rows."""
    rf = kwargs.get("RF", nargs.get("RF"))
    return [c for c in configs if c.kwargs["USE_DOT"] or rf <= FMA_MAX_ROWS]


def _configs(shapes: list[dict]) -> list:
    return [triton.Config({k: v for k, v in d.items() if k != "warps"}, num_warps=d["warps"], num_stages=1)
            for d in shapes]


# num_stages=1: the kernels prefetch the next tile themselves.
_INT8_CONFIGS = _configs(
    [dict(BN=bn, BK=bk, USE_DOT=1, warps=w) for bn, bk, w in ((32, 256, 4), (64, 128, 4), (128, 128, 8))]
    + [dict(BN=bn, BK=bk, USE_DOT=0, warps=w) for bn, bk, w in ((16, 256, 4), (32, 256, 4), (64, 128, 4),
                                                                (64, 256, 8))])
_GROUPED_CONFIGS = _configs(
    [dict(BN=bn, USE_DOT=1, warps=w) for bn, w in ((32, 4), (64, 4), (128, 8))]
    + [dict(BN=bn, USE_DOT=0, warps=w) for bn, w in ((16, 4), (32, 4), (64, 4), (64, 8))])
# Tuned per weight shape and row plan on first use (a fraction of a second each), then cached.
_int8_tuned = triton.autotune(configs=_INT8_CONFIGS, key=["N", "K", "R", "RF"],
                              prune_configs_by={"early_config_prune": _prune})(_int8_kernel)
_grouped_tuned = triton.autotune(configs=_GROUPED_CONFIGS, key=["N", "K", "G", "CODEC", "R", "NG", "RF"],
                                 prune_configs_by={"early_config_prune": _prune})(_grouped_kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _k_split(n: int, k: int, step: int, x: torch.Tensor, splits: int | None) -> int:
    """Inputs per program along K. A weight with few output rows (an expert) gives too few
    programs to keep every SM reading, so K is split and the partial sums added afterwards."""
    if splits is None:
        sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
        splits = max(1, min(k // step, round(3 * sms / triton.cdiv(n, 64))))
    return triton.cdiv(triton.cdiv(k, splits), step) * step


def qlinear_triton(x: torch.Tensor, codec: str, tensors: dict[str, torch.Tensor], group_size: int,
                   config: dict | None = None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T for M <= 16, W given as a codec's tensors (see linear.py).

    config: fixed launch parameters instead of autotuning: {"BN": .., "BK": .. (int8 only),
    "USE_DOT": 0 | 1, optionally "num_warps", "DOT_F32", "SPLITS" (K splits)}; tests use it to
    check both ways and to run the kernels under TRITON_INTERPRET on a CPU.
    """
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"the Triton kernels take at most {MAX_ROWS} rows, got {m}")
    if not supports(codec, group_size):
        raise ValueError(f"no Triton kernel for codec {codec} with group size {group_size}")
    config = dict(config) if config is not None else None
    splits = config.pop("SPLITS", None) if config is not None else None
    x = x.contiguous()
    split_x = x.dtype != torch.bfloat16
    int8 = codec == "int8"
    w = tensors["weight"] if int8 else tensors["weight_packed"]
    s = tensors["weight_scale"]
    n = w.shape[0]
    r, ng, rf = plan_rows(m, split_x, None if int8 else group_size)
    k_split = _k_split(n, k, 256 if int8 else max(256, ng * group_size), x, splits)
    n_split = triton.cdiv(k, k_split)
    # One split writes y directly; several write fp32 partial sums that are added in order.
    y = torch.empty((n_split, m, n) if n_split > 1 else (1, m, n),
                    dtype=torch.float32 if n_split > 1 else x.dtype, device=x.device)
    if int8:
        args = (x, w, s, y, m, n, k, k_split, x.stride(0), w.stride(0), y.stride(1), y.stride(0))
        consts = dict(R=r, RF=rf, SPLIT_X=split_x)
        tuned, plain = _int8_tuned, _int8_kernel
    else:
        args = (x, w, s, y, m, n, k, k_split, x.stride(0), w.stride(0), s.stride(0), y.stride(1), y.stride(0))
        consts = dict(CODEC=GROUPED[codec], G=group_size, NG=ng, R=r, RF=rf, SPLIT_X=split_x)
        tuned, plain = _grouped_tuned, _grouped_kernel
    if config is None:
        tuned[lambda meta: (triton.cdiv(n, meta["BN"]), n_split)](*args, **consts)
    else:
        plain[(triton.cdiv(n, config["BN"]), n_split)](*args, **consts, **config)
    return y[0] if n_split == 1 else y.sum(0, dtype=x.dtype)
