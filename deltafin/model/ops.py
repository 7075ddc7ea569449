"""Small numeric building blocks shared by every layer kind (K3_MODEL.md section 3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for a plain weight tensor or a quantized weight (dequantized inside the product)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))
    from ..kernels.linear import qlinear
    return qlinear(x, w)


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
