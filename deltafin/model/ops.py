"""Small numeric building blocks shared by every layer kind (K3_MODEL.md section 3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class HalfMatmul:
    """A plain weight whose products run in a 16-bit dtype (opt-in, labeled). The input row is
    rounded to that dtype, the products are summed in fp32 and the result is rounded to that dtype
    before it comes back in the input's dtype; norms, states, softmax and the residual stream stay
    fp32. Where it runs is chosen by ``linear`` per device (see there)."""
    weight: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def plain(w) -> torch.Tensor:
    """The weight tensor itself, for the few places that use a weight other than as a product."""
    return w.weight if isinstance(w, HalfMatmul) else w


# Weights stored in another dtype than the compute dtype are converted this many elements at a
# time: converting a whole [163840, 7168] head to fp32 at once would need 4.7 GB.
CONVERT_BLOCK = 1 << 24


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for a plain weight tensor or a quantized weight (dequantized inside the product)."""
    if isinstance(w, HalfMatmul):
        return _half_linear(x, w)
    if not isinstance(w, torch.Tensor):
        from ..kernels.linear import qlinear
        return qlinear(x, w)
    if w.dtype == x.dtype:
        return F.linear(x, w)
    if _native_bf16_gemv_applies(x, w):
        # Decode-sized fp32 rows against a bf16 weight: the native gemv widens each weight as it
        # reads it, at memory speed, where converting w to fp32 first runs at ~1 GB/s.
        from ..kernels import cpu_native
        y = cpu_native.bf16_gemv(x.reshape(-1, w.shape[1]), w)
        return y.reshape(*x.shape[:-1], w.shape[0])
    if w.numel() <= CONVERT_BLOCK:
        return F.linear(x, w.to(x.dtype))
    rows = max(1, CONVERT_BLOCK // w.shape[1])
    return torch.cat([F.linear(x, w[r:r + rows].to(x.dtype)) for r in range(0, w.shape[0], rows)], dim=-1)


def _half_linear(x: torch.Tensor, w: HalfMatmul) -> torch.Tensor:
    """x @ W^T with x rounded to w.dtype and the result rounded to it, on the fastest kernel here.

    On the CPU a bf16 weight is not handed to torch's 16-bit matmul: without 16-bit matrix units
    (AVX2 / AVX-512F-only processors) it widens every element per call and measured slower than
    the fp32 path (kl_medium on 2 cores, in RAM: 9.3 against 11.9 tok/s). The rounded row goes
    through the fp32 path instead (the native gemv for decode-sized batches, fp32 GEMM on widened
    blocks otherwise): bf16 * bf16 products are exact in fp32 and both sum in fp32, so this is the
    same product up to summation order. For float16 the stored bf16 weight is used as stored
    (converting it to fp16 changes only weights below fp16's normal range, ~6e-5, or above 65504).
    On CUDA and MPS torch's 16-bit matmul runs on the device's matrix units and is kept.
    """
    if isinstance(w.weight, torch.Tensor):
        if x.device.type == "cpu" and w.weight.device.type == "cpu" and w.weight.dtype == torch.bfloat16:
            rounded = x.to(w.dtype).to(torch.float32)
            return linear(rounded, w.weight).to(w.dtype).to(x.dtype)
        return F.linear(x.to(w.dtype), w.weight.to(w.dtype)).to(x.dtype)
    from ..kernels.linear import qlinear
    return qlinear(x.to(w.dtype), w.weight).to(x.dtype)


def _native_bf16_gemv_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True for float32 rows (at most GEMV_MAX_ROWS) times a 2-D bf16 weight, all on the CPU,
    when the native library is built."""
    if not (x.dtype == torch.float32 and w.dtype == torch.bfloat16 and w.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == w.shape[1] > 0
            and x.device.type == "cpu" and w.device.type == "cpu"):
        return False
    from ..kernels import cpu_native
    return x.numel() // w.shape[1] <= cpu_native.GEMV_MAX_ROWS and cpu_native.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with the mean square taken in fp32; the result has x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the KDA q/k normalization)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: [beta*tanh(g/beta)*sigmoid(g)] * [linear_beta*tanh(u/linear_beta)], in fp32."""
    g, u = gate.float(), up.float()
    act = (beta * torch.tanh(g / beta) if beta else g) * torch.sigmoid(g)
    if linear_beta:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
