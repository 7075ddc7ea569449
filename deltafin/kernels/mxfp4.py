"""MXFP4 weights as K3 ships its routed experts (compressed-tensors "pack-quantized", group 32).

Layout, for a weight W of shape [out, in] (in divisible by 32):

- ``weight_packed``: uint8 [out, in/2]. Byte j of a row holds element 2j in its low nibble and
  element 2j+1 in its high nibble. Each nibble is an E2M1 code: 0..7 decode to
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 to the same values negated (bit 3 is the sign).
- ``weight_scale``: uint8 [out, in/32], one E8M0 byte per group of 32 inputs: the group's factor
  is 2^(s - 127). Files may label these bytes F8_E8M0 (torch.float8_e8m0fnu); only the raw bits
  are read.

W[r, c] = E2M1(code[r, c]) * 2^(scale[r, c // 32] - 127).

Scale extremes: s = 0 is 2^-127 (a float32 subnormal, kept exactly) and s = 254 is 2^127.
s = 255 is NaN in E8M0; it decodes to NaN so that a corrupt group poisons its outputs visibly
instead of passing as plausible numbers. ``mxfp4_quantize`` never writes 255.

All functions here are the torch reference and run on any device.
"""
from __future__ import annotations

import torch

GROUP = 32
# E2M1 magnitudes for codes 0..7; codes 8..15 are their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Output rows dequantized at once by mxfp4_linear: bounds its scratch memory to a few MB.
BLOCK_ELEMS = 1 << 20


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [16]: the value of every E2M1 code.

    Computed on the device rather than copied from a Python list, so that decoding issues no
    host-to-device copy and can be captured in a CUDA graph.
    """
    c = torch.arange(8, device=device)
    # 0..3 -> 0, 0.5, 1, 1.5; 4..7 -> (2 + low bit) * 2^(c/2 - 2) = 2, 3, 4, 6.
    mags = torch.where(c < 4, c * 0.5, ((c & 1) + 2) * torch.exp2((c >> 1) - 2.0))
    return torch.cat([mags, -mags]).float()


def scale_bits(scale: torch.Tensor) -> torch.Tensor:
    """The raw E8M0 bytes of a scale tensor as uint8 (accepts uint8 or any 1-byte float8 dtype)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.element_size() == 1 and scale.dtype.is_floating_point:
        return scale.view(torch.uint8)
    raise ValueError(f"MXFP4 scales must be 1-byte E8M0 values (uint8 or float8), got {scale.dtype}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 factors 2^(s-127) of E8M0 bytes, built bit by bit so every value is exact."""
    s = scale_bits(scale).to(torch.int32)
    # For 1 <= s <= 254 the float32 with exponent field s and zero mantissa is 2^(s-127).
    bits = s << 23
    bits = torch.where(s == 0, torch.full_like(bits, 1 << 22), bits)          # 2^-127, subnormal
    bits = torch.where(s == 255, torch.full_like(bits, 0x7FC00000), bits)     # NaN
    return bits.view(torch.float32)


def check_shapes(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Validate a packed/scale pair; returns the weight shape (out, in)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed must be a 2-D uint8 tensor, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    out, n = packed.shape[0], packed.shape[1] * 2
    if n % GROUP:
        raise ValueError(f"MXFP4 input width {n} is not a multiple of the group size {GROUP}")
    if tuple(scale.shape) != (out, n // GROUP):
        raise ValueError(f"MXFP4 weight_scale shape {tuple(scale.shape)} does not match "
                         f"weight_packed {tuple(packed.shape)}: expected {(out, n // GROUP)}")
    scale_bits(scale)
    return out, n


def byte_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [256, 2]: the two values (low nibble, high nibble) every packed byte decodes to.

    Decoding a byte at a time through this table is about twice as fast on a CPU as splitting
    nibbles and looking each up.
    """
    b = torch.arange(256, device=device)
    t = e2m1_table(device)
    return torch.stack([t[b & 0x0F], t[b >> 4]], dim=1)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a whole MXFP4 weight to [out, in] in ``dtype``."""
    out, n = check_shapes(packed, scale)
    values = torch.nn.functional.embedding(packed.int(), byte_table(packed.device))
    factors = e8m0_to_float(scale).to(packed.device)
    w = values.view(out, n // GROUP, GROUP) * factors.unsqueeze(-1)
    return w.view(out, n).to(dtype)


def _round_to_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude code (0..7) for a >= 0, ties to the even code; values past 6 clamp."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=a.device)
    mids = (mags[1:] + mags[:-1]) / 2
    idx = torch.bucketize(a, mids, right=True)        # a tie lands on the upper code here
    tie = (idx > 0) & (a == mids[(idx - 1).clamp(min=0)])
    return torch.where(tie & (idx % 2 == 1), idx - 1, idx)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [out, in] to (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]).

    Each group gets the smallest power-of-two factor 2^e with max|w| <= 6 * 2^e, so the group's
    largest magnitude fits without clipping; every element then rounds to the nearest code
    (ties to even). Values exactly representable under that factor are reproduced exactly.
    """
    if w.dim() != 2:
        raise ValueError(f"MXFP4 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    out, n = w.shape
    if n % GROUP:
        raise ValueError(f"MXFP4 input width {n} is not a multiple of the group size {GROUP}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding NaN or infinity")
    g = w.view(out, n // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    # First guess from frexp (amax = m * 2^p, 0.5 <= m < 1), then correct by one step either way,
    # so the result does not depend on how log2 rounds.
    _, p = torch.frexp(amax / E2M1_MAX)
    e = p.to(torch.int32)

    def fits(ex: torch.Tensor) -> torch.Tensor:
        return amax <= E2M1_MAX * torch.ldexp(torch.ones_like(amax), ex)

    e = torch.where(fits(e - 1), e - 1, e)
    e = torch.where(fits(e), e, e + 1)
    e = torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    factor = e8m0_to_float((e + 127).to(torch.uint8))
    x = g / factor.unsqueeze(-1)
    codes = _round_to_e2m1(x.abs()) + torch.where(x < 0, 8, 0)
    codes = codes.view(out, n).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T with W in MXFP4, dequantizing a block of output rows at a time (fp32 compute).

    x: [..., in]; returns [..., out] in x's dtype. Scratch memory stays near BLOCK_ELEMS floats
    whatever the weight's size.
    """
    out, n = check_shapes(packed, scale)
    if x.shape[-1] != n:
        raise ValueError(f"input width {x.shape[-1]} does not match the weight's {n}")
    xf = x.reshape(-1, n).float()
    y = torch.empty(xf.shape[0], out, dtype=torch.float32, device=x.device)
    rows = max(1, BLOCK_ELEMS // n)
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        wb = mxfp4_dequantize(packed[r0:r1], scale[r0:r1])
        y[:, r0:r1] = xf @ wb.t()
    return y.to(x.dtype).reshape(*x.shape[:-1], out)
