"""One-row products with a bf16 weight on CUDA, as ``ops.HalfMatmul`` defines them, in one launch.

The input row is rounded to bf16, each product (exact in fp32) is summed in fp32, and the sum is
rounded to bf16 and returned in the input's dtype: what torch does in three launches (convert the
row, the product, convert the result back). Used for every such product: inside a decode graph the
two conversions around torch's product cost more than the product itself is faster (a k3-slice pass
of ~200 one-row products: 5.7-5.9 ms with torch's above 2**23 elements, 5.1-5.2 ms with this
kernel for all; docs/benchmarks.md, "One-row bf16 products").

Each program takes BN rows and walks the inputs BK at a time; enough rows give enough programs
for the device. Where BN and BK divide the weight (EVEN), the loads carry no masks, so each
thread reads 16 contiguous bytes of a row at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.heuristics({"EVEN": lambda a: a["K"] % a["BK"] == 0 and a["N"] % a["BN"] == 0})
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
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
        acc += w.to(tl.float32) * x.to(tl.bfloat16).to(tl.float32)[None, :]
    y = tl.sum(acc, 1).to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + n, y, mask=nmask)


def _config(bn: int, bk: int, warps: int, stages: int = 2) -> triton.Config:
    return triton.Config({"BN": bn, "BK": bk}, num_warps=warps, num_stages=stages)


_CONFIGS = [_config(*c) for c in ((1, 1024, 4), (2, 1024, 4), (4, 512, 4), (8, 512, 4), (16, 256, 4), (8, 256, 2),
                                  (4, 1024, 4), (8, 1024, 8), (16, 512, 8), (4, 2048, 8), (2, 2048, 4),
                                  (8, 512, 4, 3), (4, 1024, 4, 3), (16, 512, 8, 3))]
# Tuned per weight shape on the first call, which is eager (a decode graph cannot run the tuner).
_gemv_tuned = triton.autotune(_CONFIGS, key=["N", "K"])(_gemv_kernel)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One fp32 row (any leading shape) times a contiguous 2-D bf16 weight, on CUDA."""
    return (x.is_cuda and x.dtype == torch.float32 and x.numel() == x.shape[-1] and w.dim() == 2
            and w.dtype == torch.bfloat16 and w.is_cuda and w.stride(1) == 1)


def half_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ w[N, K]^T with the input and the result rounded to bf16 -> x's shape with N.
    config: fixed {"BN", "BK"} (and optionally "num_warps", "num_stages") instead of tuning."""
    N, K = w.shape
    xr = x.reshape(K).contiguous()
    y = torch.empty(N, dtype=torch.float32, device=x.device)
    if config:
        meta = {k: v for k, v in config.items() if k in ("BN", "BK")}
        launch = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}
        _gemv_kernel[(triton.cdiv(N, meta["BN"]),)](xr, w, y, N, K, w.stride(0), **meta, **launch)
    else:
        _gemv_tuned[lambda m: (triton.cdiv(N, m["BN"]),)](xr, w, y, N, K, w.stride(0))
    return y.view(*x.shape[:-1], N)
