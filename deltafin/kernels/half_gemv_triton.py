"""Products of a few rows with a bf16 weight on CUDA, as ``ops.HalfMatmul`` defines them, in one launch.

The input rows are rounded to bf16, each product (exact in fp32) is summed in fp32, and the sum is
rounded to bf16 and returned in the input's dtype: what torch does in three launches (convert the
rows, the product, convert the result back). Used for every one-row product and for most of up to
MAX_ROWS rows (``applies``): inside a decode graph the two conversions around torch's product cost
more than the product itself is faster (a k3-slice pass of ~200 one-row products: 5.7-5.9 ms with
torch's above 2**23 elements, 5.1-5.2 ms with this kernel for all; docs/benchmarks.md, "One-row bf16
products" and "bf16 products of a few rows").

One row (``_gemv_kernel``): each program takes BN rows of the weight and walks the inputs BK at a
time; enough rows give enough programs for the device. Where BN and BK divide the weight (EVEN), the
loads carry no masks, so each thread reads 16 contiguous bytes of a row at once. Two to MAX_ROWS rows
(``_rows_kernel``, a batch of decodes or a draft check) against a weight of ROWS_MIN_OUT outputs or
more: the same walk, the rows padded to 16 on the tensor cores, each weight read once for all of them.
Up to FMA_MAX_ROWS unrounded rows against a small weight (``_rows_fma_kernel``): the one-row walk with
every row beside the weight's, on the CUDA cores, so a small weight gives as many programs as one row.

The same two kernels run fp32 rows against a bf16 weight unrounded (``float_gemv``, ``ops.linear``'s
path for a float32 model over bf16 weights): one row multiplies the weight, widened in registers
(exactly), by the fp32 row as torch's fp32 product does; several go to the tensor cores as three bf16
parts each. Torch would widen the weight to fp32 first, a launch that writes twice the weight's bytes
and a product that reads them (a small-k3 fp32 pass: 99 widenings, a quarter of it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Both kernels drop their masks where the block sizes divide the weight.
_even = triton.heuristics({"EVEN": lambda a: a["K"] % a["BK"] == 0 and a["N"] % a["BN"] == 0})


@_even
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                 ROUND: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    rows = w_ptr + n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        if EVEN:
            x = tl.load(x_ptr + k)
            w = tl.load(rows + k[None, :])
        else:
            kmask = k < K
            x = tl.load(x_ptr + k, mask=kmask, other=0.0)
            w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if ROUND:
            x = x.to(tl.bfloat16).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if ROUND:
        y = y.to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + n, y, mask=nmask)


@triton.jit
def _step_tiles(rows, xs, k, K, nmask, mmask, EVEN: tl.constexpr):
    """One step's tiles of the rows kernels: the weight's rows [BN, BK] and x's rows [BM, BK] at inputs k
    (x's rows past M, and with EVEN false inputs past K, read as zeros)."""
    if EVEN:
        w = tl.load(rows + k[None, :])
        x = tl.load(xs + k[None, :], mask=mmask[:, None], other=0.0)
    else:
        kmask = k < K
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(xs + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    return w, x


@_even
@triton.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_w, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 EVEN: tl.constexpr, ROUND: tl.constexpr):
    """M rows (M <= BM) on the tensor cores: bf16 x bf16 products are exact and sum in fp32. Unrounded
    (ROUND false), each fp32 row goes in as three bf16 parts whose sum is the row to fp32's precision
    (x - hi is exact in fp32, and so is the next remainder), so the three products give the fp32 product."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    nmask, mmask = n < N, m < M
    rows = w_ptr + n[:, None].to(tl.int64) * stride_w
    xs = x_ptr + m[:, None] * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        w, x = _step_tiles(rows, xs, k0 + tl.arange(0, BK), K, nmask, mmask, EVEN)
        wt = tl.trans(w)
        hi = x.to(w.dtype)
        if not ROUND:
            rest = x - hi.to(tl.float32)
            mid = rest.to(w.dtype)
            acc = tl.dot((rest - mid.to(tl.float32)).to(w.dtype), wt, acc)  # smallest first
            acc = tl.dot(mid, wt, acc)
        acc = tl.dot(hi, wt, acc)
    y = acc
    if ROUND:
        y = y.to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=mmask[:, None] & nmask[None, :])


@_even
@triton.jit
def _rows_fma_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_w, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     EVEN: tl.constexpr):
    """M fp32 rows (M <= BM), unrounded, on the CUDA cores: ``_gemv_kernel``'s walk with every row of x
    beside the weight's BN rows, which are read and widened once for all of them; each row's products
    summed in fp32 lanes of BK and the lanes at the end, as one row's are."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    nmask, mmask = n < N, m < M
    rows = w_ptr + n[:, None].to(tl.int64) * stride_w
    xs = x_ptr + m[:, None] * K
    acc = tl.zeros([BM, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        w, x = _step_tiles(rows, xs, k0 + tl.arange(0, BK), K, nmask, mmask, EVEN)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, 2)
    tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=mmask[:, None] & nmask[None, :])


# Rows of a pass that take _rows_kernel (a batch of 8 decodes, a one-sequence draft check); also the kernel's
# padded block of rows, so at least 16, tl.dot's smallest.
MAX_ROWS = 16
# Several rows take the kernel only for weights of at least this many outputs: narrower ones leave it too
# few programs, where torch's product splits the inputs (8 rows x [1536, 7168]: 17.4 us against 13.5).
ROWS_MIN_OUT = 3072


# Up to FMA_MAX_ROWS unrounded rows against a weight of at most FMA_MAX_OUT outputs take _rows_fma_kernel:
# there the tensor-core kernel's few programs (N / 32) walk the inputs in turn, waiting on each step's
# loads, and its fp32 rows go through the tensor cores in three passes. Timed at 2, 4 and 8 rows on an
# H100 (docs/benchmarks.md, "A CUDA-core kernel for a few rows"): 8 rows against 512 x 512 2.7 us a launch
# against 6.8, 2304 x 2304 16.4 against 24.8, 4096 x 512 8.6 against 7.0. Rounded rows keep the
# tensor-core kernel, which only takes weights of ROWS_MIN_OUT outputs or more and is faster there.
FMA_MAX_ROWS = 8
FMA_MAX_OUT = 2304
# Registers of a _rows_fma_kernel program: BM x BN x BK float32 lanes over its threads.
FMA_LANES = 8192


def fma_config(M: int, K: int) -> dict:
    """_rows_fma_kernel's launch for M rows of K inputs: BM the rows padded to a power of two, steps of
    up to 256 inputs, and as many weight rows a program as FMA_LANES allow."""
    bm = max(2, triton.next_power_of_2(M))
    bk = min(256, max(16, triton.next_power_of_2(K)))
    return {"BM": bm, "BN": max(1, FMA_LANES // (bm * bk)), "BK": bk, "num_warps": 4}


def rows_config(N: int) -> dict:
    """The rows kernel's launch for N outputs. Timed in CUDA graphs on an H200 at 2, 8 and 16 rows over a
    k3-slice pass's weight shapes (29 configurations, docs/benchmarks.md, "bf16 products of a few rows"):
    with torch below ROWS_MIN_OUT, these products take 0.92-0.93 of torch's time."""
    return _launch(32, 256, 4, stages=4) if N < 6144 else _launch(64, 256, 4, stages=3)


def config_for(N: int, K: int) -> dict:
    """The launch of a weight of N rows of K inputs: rows a program (BN), inputs a step (BK), warps.

    A table, not Triton's autotuner: tuning each shape on its first call (14 configurations, ~15
    shapes a k3-slice pass) held up that model's first decode pass ~50 s. The table comes from timing
    14 configurations on 136 shapes, each inside a CUDA graph of 20 launches over weights larger than
    L2, on an H200 (docs/benchmarks.md, "One-row bf16 products"): every shape within 12 % of its best
    configuration, half of them at it, a k3-slice pass's products 0.8 % over their sum of bests.
    Its two rules: a step that divides K (no masks) where one of 1024 or 512 does, and fewer rows a
    program where N is small, so that enough programs run."""
    if K <= 256:
        return _launch(8, 256, 2)
    if K % 1024 == 0:
        if N <= 1536 and K >= 2048:
            return _launch(4, 2048, 8)
        if N <= 2304 or (N > 4096 and K >= 4096):
            return _launch(2, 1024, 4)
        return _launch(4, 1024, 4)
    if K % 512 == 0:
        if N <= 4608:
            return _launch(4, 512, 4)
        return _launch(16, 256, 4) if K == 512 else _launch(8, 512, 4)
    # K a multiple of 256 at best: masked long steps while N is small, then steps that divide it
    if N <= 1024:
        return _launch(2, 2048, 4)
    if N <= 2304:
        return _launch(4, 1024, 4)
    return _launch(8, 512, 4) if N <= 7168 else _launch(8, 256, 2)


def _launch(bn: int, bk: int, warps: int, stages: int = 2) -> dict:
    return {"BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages}


def applies(x: torch.Tensor, w: torch.Tensor, rounded: bool = True) -> bool:
    """One fp32 row, or up to MAX_ROWS of them (any leading shape), times a contiguous 2-D bf16 weight, on
    CUDA; several rounded rows only against a weight of at least ROWS_MIN_OUT outputs (below, torch's
    bf16 product is faster), unrounded ones against any (torch's would first widen the whole weight)."""
    return (x.is_cuda and x.dtype == torch.float32 and w.dim() == 2 and x.shape[-1] == w.shape[1]
            and 0 < x.numel() <= MAX_ROWS * w.shape[1] and w.dtype == torch.bfloat16 and w.is_cuda
            and w.stride(1) == 1 and (not rounded or x.numel() == w.shape[1] or w.shape[0] >= ROWS_MIN_OUT))


def half_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (up to MAX_ROWS rows) @ w[N, K]^T with the input and the result rounded to bf16 -> x's
    shape with N. config: {"BN", "BK"} and optionally "num_warps", "num_stages" instead of the chosen
    launch (``config_for`` for one row, ``rows_config`` for more)."""
    return _product(x, w, config, rounded=True)


def float_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (up to MAX_ROWS fp32 rows) @ w[N, K]^T in fp32 arithmetic, the bf16 weight read once as
    stored: the product torch computes after widening the weight to fp32 (``ops.linear``), up to
    summation order, without writing and reading the widened copy. config as ``half_gemv``'s, or
    ``fma_config``'s (with "BM") for the CUDA-core kernel of a few rows."""
    return _product(x, w, config, rounded=False)


def _product(x: torch.Tensor, w: torch.Tensor, config: dict | None, rounded: bool) -> torch.Tensor:
    N, K = w.shape
    M = x.numel() // K
    xr = x.reshape(M, K).contiguous()
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 1:
        launch = config or config_for(N, K)
        _gemv_kernel[(triton.cdiv(N, launch["BN"]),)](xr, w, y, N, K, w.stride(0), ROUND=rounded, **launch)
    elif not rounded and ("BM" in (config or {}) or (config is None and M <= FMA_MAX_ROWS and N <= FMA_MAX_OUT)):
        launch = config or fma_config(M, K)
        _rows_fma_kernel[(triton.cdiv(N, launch["BN"]),)](xr, w, y, M, N, K, w.stride(0), **launch)
    else:
        launch = config or rows_config(N)
        _rows_kernel[(triton.cdiv(N, launch["BN"]),)](xr, w, y, M, N, K, w.stride(0), BM=MAX_ROWS, ROUND=rounded,
                                                      **launch)
    return y.view(*x.shape[:-1], N)
