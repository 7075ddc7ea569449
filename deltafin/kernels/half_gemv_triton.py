"""One-row products with a bf16 weight on CUDA, as ``ops.HalfMatmul`` defines them, in one launch.

The input row is rounded to bf16, each product (exact in fp32) is summed in fp32, and the sum is
rounded to bf16 and returned in the input's dtype: what torch does in three launches (convert the
row, the product, convert the result back). Used for weights with few elements, where those
launches, not the weight's bytes, take the time (a decode step's small projections); larger
weights keep torch's products, which read memory faster. Importing this imports Triton.

Each program takes BN rows and walks the inputs BK at a time; enough rows give enough programs
for the device, and a small weight is read in a few microseconds whatever its shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ELEMENTS = 1 << 23  # weights up to this size take this kernel


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.bfloat16).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, 1).to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + n, y, mask=nmask)


_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w) for bn, bk, w in
            ((1, 1024, 4), (2, 1024, 4), (4, 512, 4), (8, 512, 4), (16, 256, 4), (8, 256, 2))]
# Tuned per weight shape on the first call, which is eager (a decode graph cannot run the tuner).
_gemv_tuned = triton.autotune(_CONFIGS, key=["N", "K"])(_gemv_kernel)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One fp32 row (any leading shape) times a small contiguous 2-D bf16 weight, on CUDA."""
    return (x.is_cuda and x.dtype == torch.float32 and x.numel() == x.shape[-1] and w.dim() == 2
            and w.dtype == torch.bfloat16 and w.is_cuda and w.stride(1) == 1 and w.numel() <= MAX_ELEMENTS)


def half_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ w[N, K]^T with the input and the result rounded to bf16 -> x's shape with N.
    config: fixed {"BN", "BK"} instead of tuning (tests)."""
    N, K = w.shape
    xr = x.reshape(K).contiguous()
    y = torch.empty(N, dtype=torch.float32, device=x.device)
    if config:
        _gemv_kernel[(triton.cdiv(N, config["BN"]),)](xr, w, y, N, K, w.stride(0), **config)
    else:
        _gemv_tuned[lambda m: (triton.cdiv(N, m["BN"]),)](xr, w, y, N, K, w.stride(0))
    return y.view(*x.shape[:-1], N)
