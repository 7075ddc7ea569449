"""int4 and int6 weights: symmetric, group-wise along the input dimension.

For a weight W of shape [out, in] and group size g (in divisible by g), group k of row r covers
inputs k*g .. k*g+g-1 and has one scale s[r, k] = max|W[r, group]| / qmax, with qmax = 7 (int4)
or 31 (int6). Codes q = round(W / s) lie in -qmax..qmax; W ~= q * s and |error| <= s / 2.

Tensors:

- ``weight_scale``: float16 [out, in/g]. The float32 scale is rounded *up* to the next float16,
  so no element is clipped and the bound above holds for the stored scale.
- ``weight_packed``: uint8, codes stored with an offset (u = q + 8 for int4, q + 32 for int6):

  int4, [out, in/2]: byte j of a row holds element 2j in its low nibble and element 2j+1 in
  its high nibble (the same order as MXFP4).

  int6, [out, in*3/4]: every 4 elements u0..u3 (in order) form a 24-bit little-endian word
  u0 | u1 << 6 | u2 << 12 | u3 << 18, stored as 3 bytes, low byte first:
      byte0 = u0 | (u1 & 3) << 6
      byte1 = u1 >> 2 | (u2 & 15) << 4
      byte2 = u2 >> 4 | u3 << 2
  so in must be divisible by 4.
"""
from __future__ import annotations

import torch

BITS = {"int4": 4, "int6": 6}


def qmax(codec: str) -> int:
    return (1 << (BITS[codec] - 1)) - 1


def offset(codec: str) -> int:
    return 1 << (BITS[codec] - 1)


def packed_width(codec: str, in_features: int) -> int:
    return in_features // 2 if codec == "int4" else in_features * 3 // 4


def check_layout(codec: str, out_features: int, in_features: int, group_size: int) -> None:
    """Raise ValueError unless [out, in] with this group size can be stored in ``codec``."""
    if codec not in BITS:
        raise ValueError(f"unknown group-wise integer codec {codec!r} (expected int4 or int6)")
    if group_size <= 0:
        raise ValueError(f"group size must be positive, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"{codec}: input width {in_features} is not divisible by the group size {group_size}")
    multiple = 2 if codec == "int4" else 4
    if in_features % multiple:
        raise ValueError(f"{codec}: input width {in_features} must be a multiple of {multiple} to pack")
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"{codec}: empty weight shape {(out_features, in_features)}")


def round_up_to_fp16(s: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= s (s >= 0, float32)."""
    h = s.to(torch.float16)
    low = h.float() < s
    # For non-negative float16 values the next larger one is the bit pattern plus one.
    return torch.where(low, (h.view(torch.int16) + 1).view(torch.float16), h)


def intq_quantize(w: torch.Tensor, codec: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (weight_packed uint8, weight_scale float16 [out, in/g])."""
    if w.dim() != 2:
        raise ValueError(f"{codec} quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    out, n = w.shape
    check_layout(codec, out, n, group_size)
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding NaN or infinity")
    g = w.view(out, n // group_size, group_size)
    scale = round_up_to_fp16(g.abs().amax(dim=-1) / qmax(codec))
    if not torch.isfinite(scale).all():
        raise ValueError(f"{codec}: weights too large for float16 group scales")
    sf = scale.float().unsqueeze(-1)
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.round(g / safe).clamp_(-qmax(codec), qmax(codec)).view(out, n).to(torch.int32)
    return pack(codes, codec), scale


def pack(codes: torch.Tensor, codec: str) -> torch.Tensor:
    """Signed codes [out, in] -> packed uint8 (layout in the module docstring)."""
    u = codes.to(torch.int32) + offset(codec)
    out, n = u.shape
    if codec == "int4":
        return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)
    q = u.view(out, n // 4, 4)
    word = q[..., 0] | (q[..., 1] << 6) | (q[..., 2] << 12) | (q[..., 3] << 18)
    b = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1)
    return b.reshape(out, n // 4 * 3).to(torch.uint8)


def unpack(packed: torch.Tensor, codec: str) -> torch.Tensor:
    """Packed uint8 -> signed codes int32 [out, in]."""
    out = packed.shape[0]
    p = packed.to(torch.int32)
    if codec == "int4":
        u = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(out, -1)
    else:
        b = p.view(out, -1, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        u = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).reshape(out, -1)
    return u - offset(codec)


def intq_check_shapes(packed: torch.Tensor, scale: torch.Tensor, codec: str) -> tuple[int, int, int]:
    """Validate a packed/scale pair; returns (out, in, group_size)."""
    if codec not in BITS:
        raise ValueError(f"unknown group-wise integer codec {codec!r} (expected int4 or int6)")
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"{codec} weight_packed must be a 2-D uint8 tensor, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if scale.dim() != 2 or scale.dtype != torch.float16 or scale.shape[0] != packed.shape[0]:
        raise ValueError(f"{codec} weight_scale must be float16 [{packed.shape[0]}, groups], got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    out, width = packed.shape
    if codec == "int4":
        n = width * 2
    else:
        if width % 3:
            raise ValueError(f"int6 weight_packed width {width} is not a multiple of 3")
        n = width // 3 * 4
    if scale.shape[1] == 0 or n % scale.shape[1]:
        raise ValueError(f"{codec} weight_scale has {scale.shape[1]} groups, which does not divide "
                         f"the input width {n}")
    group_size = n // scale.shape[1]
    check_layout(codec, out, n, group_size)
    return out, n, group_size


def _int4_byte_table(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: the signed codes (low nibble, high nibble) of every packed byte."""
    b = torch.arange(256, device=device)
    return torch.stack([b & 0x0F, b >> 4], dim=1).float() - offset("int4")


def intq_dequantize(packed: torch.Tensor, scale: torch.Tensor, codec: str,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out, n, g = intq_check_shapes(packed, scale, codec)
    if codec == "int4":
        # A byte at a time through a table: about twice as fast on a CPU as splitting nibbles.
        codes = torch.nn.functional.embedding(packed.int(), _int4_byte_table(packed.device))
    else:
        codes = unpack(packed, codec).float()
    codes = codes.view(out, n // g, g)
    return (codes * scale.float().unsqueeze(-1)).view(out, n).to(dtype)
