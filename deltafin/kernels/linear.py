"""One description of a stored 2-D weight, whatever its codec, and one way to multiply by it.

``QWeight`` holds a weight W [out, in] as the named tensors of its codec:

| codec | tensors (suffixes of the store name)                              | group_size   |
|-------|-------------------------------------------------------------------|--------------|
| bf16  | weight bf16 [out, in]                                             | 0 (none)     |
| int8  | weight int8 [out, in], weight_scale fp32 [out, 1]                  | 0 (per row)  |
| int8  | weight int8 [out, in], weight_scale fp16 [out, in/g] (grouped)      | g            |
| int4  | weight_packed uint8 [out, in/2], weight_scale fp16 [out, in/g]     | g            |
| int6  | weight_packed uint8 [out, in*3/4], weight_scale fp16 [out, in/g]   | g            |
| mxfp4 | weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 [out, in/32] | 32        |

The layouts are documented in int8.py, intq.py and mxfp4.py. ``qlinear(x, q)`` computes
x @ W^T: on CUDA with at most ``TRITON_MAX_ROWS`` rows it runs the fused Triton kernel when
Triton is installed; on the CPU with at most ``cpu_native.GEMV_MAX_ROWS`` rows (int4 / int6:
``INTQ_GEMV_MAX_ROWS``), the native gemv
(cpu_native.py) when the optional extension was built; otherwise a torch reference that
dequantizes a block of output rows at a time (fp32 compute), so the whole weight is never
materialized.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import torch

from . import cpu_native, intq
from .int8 import (INTERLEAVE_BLOCK, INTERLEAVE_GROUPS, int8_check_shapes, int8_dequantize, int8_interleaved,
                   int8_plain, int8_quantize)
from .mxfp4 import GROUP as MXFP4_GROUP
from .mxfp4 import check_shapes as mxfp4_check_shapes
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize, scale_bits

CODECS = ("bf16", "int8", "int4", "int6", "mxfp4")
# Tensor name suffixes each codec stores.
TENSOR_NAMES = {
    "bf16": ("weight",),
    "int8": ("weight", "weight_scale"),
    "int4": ("weight_packed", "weight_scale"),
    "int6": ("weight_packed", "weight_scale"),
    "mxfp4": ("weight_packed", "weight_scale"),
}
# Rows of x up to which the fused GPU kernel is used (decode and short speculative batches).
TRITON_MAX_ROWS = 16
# Elements of weight dequantized at once by the torch reference: a few MB of scratch.
BLOCK_ELEMS = 1 << 20


@dataclass(frozen=True)
class QWeight:
    """A quantized (or bf16) 2-D weight [out, in]."""
    codec: str
    shape: tuple[int, int]
    group_size: int
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies on disk (sum of its tensors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def derived(self, key: str, make):
        """A value derived from the weight's tensors, made once by ``make()`` and kept on the weight
        beside its frozen fields (the tensors never change; decode asks for such values per token)."""
        if key not in self.__dict__:
            self.__dict__[key] = make()
        return self.__dict__[key]

    def to(self, device: torch.device | str) -> "QWeight":
        """On another device; interleaved int8 (a CPU layout, see int8.int8_interleave) in the plain one
        there."""
        tensors = self.tensors if torch.device(device).type == "cpu" else self.plain_tensors()
        return QWeight(self.codec, self.shape, self.group_size, {k: t.to(device) for k, t in tensors.items()})

    def plain_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors in the store's layout (int8 codes interleaved in RAM turned back)."""
        if self.codec != "int8" or self.tensors["weight_scale"].dim() != 3:
            return self.tensors
        codes, scale = int8_plain(self.tensors["weight"], self.tensors["weight_scale"])
        return {"weight": codes, "weight_scale": scale}

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Named tensors for a safetensors file: ``prefix + suffix`` (prefix e.g. 'x.q_proj.'), in the
        store's layout."""
        return {prefix + k: t for k, t in self.plain_tensors().items()}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str, codec: str) -> "QWeight":
        """Inverse of ``to_tensors``: shape and group size are read off the tensors themselves.

        The codec must be given (the store's manifest records it): int4 and int6 tensors alone
        cannot always be told apart.
        """
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        found = {}
        for name in TENSOR_NAMES[codec]:
            if prefix + name not in tensors:
                raise ValueError(f"{codec} weight {prefix!r} lacks tensor {prefix + name!r}")
            found[name] = tensors[prefix + name]
        if codec == "mxfp4":
            found["weight_scale"] = scale_bits(found["weight_scale"])
        try:
            shape, group = _shape_of(codec, found)
        except ValueError as e:  # name the weight: a store's damaged tensor is found by it
            raise ValueError(f"{prefix.rstrip('.') or 'weight'}: {e}") from None
        return cls(codec, shape, group, found)


def _shape_of(codec: str, t: dict[str, torch.Tensor]) -> tuple[tuple[int, int], int]:
    if codec == "bf16":
        w = t["weight"]
        if w.dim() != 2:
            raise ValueError(f"bf16 weight must be 2-D, got shape {tuple(w.shape)}")
        return (w.shape[0], w.shape[1]), 0
    if codec == "int8":
        out, n, g = int8_check_shapes(t["weight"], t["weight_scale"])
        return (out, n), abs(g)  # interleaved codes: minus their group
    if codec == "mxfp4":
        return mxfp4_check_shapes(t["weight_packed"], t["weight_scale"]), MXFP4_GROUP
    out, n, g = intq.intq_check_shapes(t["weight_packed"], t["weight_scale"], codec)
    return (out, n), g


def _validate(q: QWeight) -> None:
    if q.codec not in CODECS:
        raise ValueError(f"unknown codec {q.codec!r}; expected one of {CODECS}")
    if set(q.tensors) != set(TENSOR_NAMES[q.codec]):
        raise ValueError(f"{q.codec} weight needs tensors {TENSOR_NAMES[q.codec]}, got {tuple(q.tensors)}")
    if q.codec == "bf16" and q.tensors["weight"].dtype != torch.bfloat16:
        raise ValueError(f"bf16 weight has dtype {q.tensors['weight'].dtype}")
    if q.codec == "mxfp4" and q.tensors["weight_scale"].dtype != torch.uint8:
        raise ValueError("mxfp4 weight_scale must be held as uint8 (from_tensors converts float8 labels)")
    shape, group = _shape_of(q.codec, q.tensors)
    if tuple(q.shape) != shape or q.group_size != group:
        raise ValueError(f"{q.codec} weight declared shape {tuple(q.shape)} group {q.group_size}, "
                         f"but its tensors hold shape {shape} group {group}")


def quantize(w: torch.Tensor, codec: str, group_size: int | None = None) -> QWeight:
    """Encode a 2-D float weight [out, in]. group_size applies to int4/int6 (default 32) and int8
    (default 0: one scale per row); mxfp4 needs 32."""
    if group_size is None:
        group_size = 0 if codec == "int8" else 32
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    shape = (w.shape[0], w.shape[1])
    if codec == "bf16":
        return QWeight(codec, shape, 0, {"weight": w.to(torch.bfloat16).contiguous()})
    if codec == "int8":
        codes, scale = int8_quantize(w, group_size)
        return QWeight(codec, shape, group_size, {"weight": codes, "weight_scale": scale})
    if codec in intq.BITS:
        packed, scale = intq.intq_quantize(w, codec, group_size)
        return QWeight(codec, shape, group_size, {"weight_packed": packed, "weight_scale": scale})
    if codec == "mxfp4":
        if group_size != MXFP4_GROUP:
            raise ValueError(f"MXFP4 has a fixed group size of {MXFP4_GROUP}, got {group_size}")
        packed, scale = mxfp4_quantize(w)
        return QWeight(codec, shape, MXFP4_GROUP, {"weight_packed": packed, "weight_scale": scale})
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def native_dense(w) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The (weight, scale) a native dense product reads: an int8 QWeight's codes and scales, or a
    bf16 tensor and None; None for any other weight (or one not contiguous on the CPU). A QWeight's
    answer is kept on it (its tensors never change): a decode token asks ~200 times."""
    if isinstance(w, QWeight):
        return w.derived("_native_dense", lambda: _native_dense_of(w))
    return _native_dense_of(w)


def interleaved(w):
    """w with its codes in the interleaved layout the CPU's int8 products sum fastest (int8.int8_interleave),
    where that layout applies: an int8 QWeight on the CPU with a float16 scale per 32, 64 or 128 inputs and
    at least one whole block of inputs, where the native kernels are built (without them every product
    dequantizes);
    w itself otherwise. Contiguous codes are permuted in place (w must not be used after: the caller hands
    its weight over, as the RAM provider does at load). For weights only the plain products read (not the
    transposed ones of attention's latent projection)."""
    if not (isinstance(w, QWeight) and w.codec == "int8" and w.group_size in INTERLEAVE_GROUPS
            and w.device.type == "cpu" and w.tensors["weight_scale"].dim() == 2 and w.shape[1] >= INTERLEAVE_BLOCK
            and cpu_native.available()):
        return w
    codes, scale = w.tensors["weight"], w.tensors["weight_scale"]
    if not codes.is_contiguous():
        codes, scale = int8_interleaved(codes, scale)
    else:  # in place: a resident model's codes are permuted at memory speed, and no second copy is held
        codes, scale = cpu_native.int8_interleave_(codes), scale.unsqueeze(-1)
    return QWeight(w.codec, w.shape, w.group_size, {"weight": codes, "weight_scale": scale})


def dense_kind(dense: tuple) -> tuple:
    """What the items of one native dense call share besides their shape (``native_dense``'s
    (weight, scale)): the weight's dtype and, for int8, its scaling (per row, or the group size)."""
    w, s = dense
    if s is None:
        return w.dtype, None
    if s.dim() == 3:  # interleaved: minus the group, as int8_check_shapes gives it
        return w.dtype, s.dtype, -(w.shape[1] // s.shape[1])
    return w.dtype, s.dtype, 0 if s.dtype == torch.float32 else w.shape[1] // s.shape[1]


def _native_dense_of(w) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(w, QWeight):
        if w.codec != "int8":
            return None
        codes, scale = w.tensors["weight"], w.tensors["weight_scale"]
    elif isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2:
        codes, scale = w, None
    else:
        return None
    if codes.device.type != "cpu" or not codes.is_contiguous() or (scale is not None and not scale.is_contiguous()):
        return None
    return codes, scale


def dequantize_rows(q: QWeight, r0: int, r1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows r0..r1-1 of W, decoded (every codec's tensors are row-major in the output dim)."""
    t = {k: v[r0:r1] for k, v in q.tensors.items()}
    if q.codec == "bf16":
        return t["weight"].to(dtype)
    if q.codec == "int8":
        return int8_dequantize(t["weight"], t["weight_scale"], dtype)
    if q.codec == "mxfp4":
        # The native decoder is bit-exact with the torch one and several times faster.
        if q.device.type == "cpu" and cpu_native.available():
            return cpu_native.mxfp4_dequant(t["weight_packed"], t["weight_scale"], dtype)
        return mxfp4_dequantize(t["weight_packed"], t["weight_scale"], dtype)
    return intq.intq_dequantize(t["weight_packed"], t["weight_scale"], q.codec, dtype)


def dequantize(q: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight [out, in] in ``dtype``."""
    return dequantize_rows(q, 0, q.out_features, dtype)


def blocked_linear(x: torch.Tensor, out_features: int, in_features: int,
                   rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x [M, in] float32 @ W^T with W produced ``rows_of(r0, r1)`` a block at a time."""
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    step = max(1, BLOCK_ELEMS // in_features)
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        y[:, r0:r1] = x @ rows_of(r0, r1).t()
    return y


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernels module, or None when Triton is not installed (imported on first use)."""
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def qlinear(x: torch.Tensor, q: QWeight, use_triton: bool | None = None) -> torch.Tensor:
    """y = x @ W^T for x [..., in]; y [..., out] in x's dtype.

    use_triton: None picks the fused Triton kernel where it applies (CUDA, Triton installed,
    at most TRITON_MAX_ROWS rows, a codec with a kernel); False forces the torch reference;
    True requires the kernel and raises if it cannot be used.
    """
    if x.shape[-1] != q.in_features:
        raise ValueError(f"input width {x.shape[-1]} does not match the weight's in_features {q.in_features}")
    x2 = x.reshape(-1, q.in_features)
    if use_triton is not False:
        kernels = _triton_kernels() if x.is_cuda else None
        usable = (kernels is not None and x2.shape[0] <= TRITON_MAX_ROWS
                  and kernels.usable(q.codec, q.group_size, q.tensors))
        if usable:
            y = kernels.qlinear_triton(x2, q.codec, q.tensors, q.group_size)
            return y.reshape(*x.shape[:-1], q.out_features)
        if use_triton:
            raise ValueError(f"the Triton kernel cannot run here: device {x.device}, rows {x2.shape[0]}, "
                             f"codec {q.codec}, Triton {'present' if kernels else 'absent'}")
    native_rows = (cpu_native.GEMV_MAX_ROWS if q.codec in ("mxfp4", "int8")
                   else cpu_native.INTQ_GEMV_MAX_ROWS if cpu_native.intq_gemv_fits(q.codec, q.group_size)
                   else -1)  # no native gemv for this codec, not even for an empty x
    if (use_triton is None and x2.shape[0] <= native_rows
            and x2.device.type == "cpu" and q.device.type == "cpu" and cpu_native.available()):
        # Decode-sized batches on the CPU: the native gemv reads the stored weight once.
        if q.codec == "mxfp4":
            y = cpu_native.mxfp4_gemv(x2, q.tensors["weight_packed"], q.tensors["weight_scale"])
        elif q.codec in intq.BITS:
            y = cpu_native.intq_gemv(x2, q.tensors["weight_packed"], q.tensors["weight_scale"],
                                     q.codec, q.group_size)
        else:
            y = cpu_native.int8_gemv(x2, q.tensors["weight"], q.tensors["weight_scale"])
        return y.to(x.dtype).reshape(*x.shape[:-1], q.out_features)
    y = blocked_linear(x2.float(), q.out_features, q.in_features,
                       lambda r0, r1: dequantize_rows(q, r0, r1))
    return y.to(x.dtype).reshape(*x.shape[:-1], q.out_features)
