"""int8 weights: symmetric quantization, one scale per output row or per group of inputs.

Layout, for a weight W of shape [out, in]:

- ``weight``: int8 [out, in], codes in -127..127 (-128 is never written).
- ``weight_scale``, one of:

  per row: float32 [out, 1], scale = max|W[r, :]| / 127 (0 for an all-zero row);
  W[r, c] = weight[r, c] * weight_scale[r].

  grouped (group size g, a multiple of GROUP_MULTIPLE dividing in): float16 [out, in/g],
  scale = max|W[r, group]| / 127, rounded *up* to the next float16 (so no code is clipped);
  W[r, c] = weight[r, c] * weight_scale[r, c // g]. The product of a code (8 significant bits)
  and a float16 scale (11) is exact in float32. At g = 32 this is 1.0625 bytes a weight, as
  llama.cpp's Q8_0; a group follows the weights' local range, so it rounds finer than a row.

  interleaved (in RAM on the CPU only, see int8_interleave): grouped codes (groups of 32, 64 or 128)
  permuted within each block of 512 inputs, the same float16 scales viewed as [out, in/g, 1].

The scale's dtype and shape say which: a store written before grouped scales existed stays
readable. Rounding is to nearest, so |error| <= scale / 2.
"""
from __future__ import annotations

import torch

from .intq import round_up_to_fp16

QMAX = 127
# A grouped scale covers a multiple of this many inputs (the native kernels' steps).
GROUP_MULTIPLE = 32


def int8_quantize(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (codes int8 [out, in], scale: float32 [out, 1] for group_size 0, else
    float16 [out, in/group_size])."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding NaN or infinity")
    out, n = w.shape
    if group_size:
        _check_group(n, group_size)
        g = w.view(out, n // group_size, group_size)
        scale = round_up_to_fp16(g.abs().amax(dim=-1) / QMAX)
        if not torch.isfinite(scale).all():
            raise ValueError("int8: weights too large for float16 group scales")
        sf = scale.float().unsqueeze(-1)
        safe = torch.where(sf > 0, sf, torch.ones_like(sf))
        codes = torch.round(g / safe).clamp_(-QMAX, QMAX).view(out, n).to(torch.int8)
        return codes, scale
    scale = w.abs().amax(dim=1, keepdim=True) / QMAX
    # An all-zero row keeps scale 0; dividing by 1 there gives codes 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def _check_group(n: int, group_size: int) -> None:
    if group_size <= 0 or group_size % GROUP_MULTIPLE or n % group_size:
        raise ValueError(f"int8: a group size must be a positive multiple of {GROUP_MULTIPLE} dividing the "
                         f"input width {n}, got {group_size}")


def int8_check_shapes(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    """Validate a codes/scale pair; returns (out, in, group size: 0 for row scales, minus the group size
    for interleaved codes)."""
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise ValueError(f"int8 weight must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    out, n = codes.shape
    if scale.dtype == torch.float32 and tuple(scale.shape) == (out, 1):
        return out, n, 0
    if scale.dtype == torch.float16 and scale.dim() == 3 and scale.shape[0] == out and scale.shape[2] == 1 \
            and scale.shape[1] > 0 and n % scale.shape[1] == 0 and n // scale.shape[1] in INTERLEAVE_GROUPS:
        return out, n, -(n // scale.shape[1])
    if scale.dtype == torch.float16 and scale.dim() == 2 and scale.shape[0] == out and scale.shape[1] > 0 \
            and n % scale.shape[1] == 0:
        group = n // scale.shape[1]
        _check_group(n, group)
        return out, n, group
    raise ValueError(f"int8 weight_scale must be float32 {(out, 1)} (per row), float16 [{out}, groups] with "
                     f"groups dividing {n}, or float16 [{out}, {n} / g, 1] for g in {INTERLEAVE_GROUPS} "
                     f"(interleaved), got {scale.dtype} {tuple(scale.shape)}")


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out, n, group = int8_check_shapes(codes, scale)
    if group < 0:
        codes, scale, group = int8_interleave(codes), scale[..., 0], -group
    if not group:
        return (codes.float() * scale).to(dtype)
    w = codes.float().view(out, n // group, group) * scale.float().unsqueeze(-1)
    return w.view(out, n).to(dtype)


def int8_round_inputs(x: torch.Tensor) -> torch.Tensor:
    """x [M, in] as the native int8 products take it (the torch statement of their rounding,
    _cpu_kernels.c "int8 on the integer units"): each row to the nearest (ties to even) multiple of
    its own step max |x[m]| / 32767, the quotient taken in float64, the step kept in float32. A row of
    zeros stays zero; a row holding inf or NaN becomes NaN. Returns float64 [M, in]."""
    x64 = x.double()
    a = x64.abs().amax(-1, keepdim=True)
    q = torch.round(x64 * (32767.0 / torch.where(a > 0, a, 1.0)))
    step = (a / 32767.0).float().double()
    return torch.where(torch.isfinite(a), q * step, float("nan"))


# Interleaved grouped int8: the layout the CPU's integer products sum fastest. In each whole block of
# INTERLEAVE_BLOCK inputs of a row (16 spans of INTERLEAVE_SPAN), byte 32 s + 2 j + t holds input
# 32 j + 2 s + t of the block: a step of 32 codes widened to int16 then puts span j's pair of inputs into
# lane j, and 16 steps sum every span of the block exactly in int32 before one conversion and one
# multiplication by the 16 lanes' scales (in the plain layout each group is a conversion and a
# multiplication of its own). A span lies in one group, so the permutation is the same for every group
# size that interleaves (INTERLEAVE_GROUPS: lane j takes the scale of the group holding span j). Inputs
# past the last whole block keep their order. The scales keep theirs. int8_check_shapes gives interleaved
# codes minus their group size, as the native products take them.
INTERLEAVE_SPAN = 32
INTERLEAVE_BLOCK = 512
INTERLEAVE_GROUPS = (32, 64, 128)


def _blocks(codes: torch.Tensor) -> tuple[int, int]:
    if codes.dim() != 2 or codes.shape[1] % INTERLEAVE_SPAN:
        raise ValueError(f"interleaved int8 needs 2-D codes of whole spans of {INTERLEAVE_SPAN} inputs, got "
                         f"{tuple(codes.shape)}")
    return codes.shape[0], codes.shape[1] // INTERLEAVE_BLOCK * INTERLEAVE_BLOCK


def int8_interleave(codes: torch.Tensor) -> torch.Tensor:
    """Grouped int8 codes [out, in] in the plain layout -> the interleaved layout, as a new tensor; the
    same call turns interleaved codes back (the permutation is its own inverse)."""
    out, whole = _blocks(codes)
    y = codes.clone()
    g = INTERLEAVE_BLOCK // INTERLEAVE_SPAN
    # [out, blocks, span j, step s, half t] <-> [out, blocks, s, j, t]
    y[:, :whole] = codes[:, :whole].reshape(out, -1, g, g, 2).transpose(2, 3).reshape(out, whole)
    return y


def int8_interleaved(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped (codes, scale) of a group in INTERLEAVE_GROUPS -> the interleaved pair (new codes, the
    scales viewed [out, in/group, 1])."""
    out, n, group = int8_check_shapes(codes, scale)
    if group not in INTERLEAVE_GROUPS:
        raise ValueError(f"only int8 of groups of {', '.join(map(str, INTERLEAVE_GROUPS))} interleaves, got "
                         f"{'per-row scales' if group == 0 else f'group {abs(group)}'}"
                         f"{' (already interleaved)' if group < 0 else ''}")
    return int8_interleave(codes), scale.unsqueeze(-1)


def int8_plain(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain layout of an int8 pair (interleaved ones turned back; any other pair as it is)."""
    if int8_check_shapes(codes, scale)[2] >= 0:
        return codes, scale
    return int8_interleave(codes), scale[..., 0]
