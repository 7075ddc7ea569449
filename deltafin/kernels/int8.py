"""int8 weights: per-output-row symmetric quantization.

Layout, for a weight W of shape [out, in]:

- ``weight``: int8 [out, in], codes in -127..127 (-128 is never written).
- ``weight_scale``: float32 [out, 1], scale = max|W[r, :]| / 127 (0 for an all-zero row).

W[r, c] = weight[r, c] * weight_scale[r]. Rounding is to nearest, so |error| <= scale / 2.
"""
from __future__ import annotations

import torch

QMAX = 127


def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (codes int8 [out, in], scale float32 [out, 1])."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding NaN or infinity")
    scale = w.abs().amax(dim=1, keepdim=True) / QMAX
    # An all-zero row keeps scale 0; dividing by 1 there gives codes 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def int8_check_shapes(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise ValueError(f"int8 weight must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    if tuple(scale.shape) != (codes.shape[0], 1) or scale.dtype != torch.float32:
        raise ValueError(f"int8 weight_scale must be float32 {(codes.shape[0], 1)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    return codes.shape[0], codes.shape[1]


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    int8_check_shapes(codes, scale)
    return (codes.float() * scale).to(dtype)
