"""Native CPU kernels for stored weights (_cpu_kernels.c), called through ctypes.

``mxfp4_gemv``, ``int8_gemv``, ``intq_gemv`` (int4, int6) and ``bf16_gemv`` multiply a few float32 rows of x by a stored
weight without materializing it, at close to memory speed (AVX-512 where the CPU has it; the
bf16 and MXFP4 gemvs also have an AVX2 path, bit-identical to their portable C, and the int8 gemv an AVX2+FMA
path that differs from its portable C only in rounding order); ``mxfp4_dequant`` decodes MXFP4 rows
bit-for-bit like ``mxfp4.mxfp4_dequantize``. The library is an optional part of the install (setup.py): when it
was not built, ``available()`` is False and callers use the torch references in mxfp4.py,
int8.py and intq.py (and a float32 conversion for bf16). It is loaded on first use, not at import.

Every function releases the GIL while it runs (ctypes does) and splits the output rows over
``threads`` threads, torch.get_num_threads() unless given.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util

import torch

from .int8 import int8_check_shapes
from .intq import BITS, intq_check_shapes
from .mxfp4 import check_shapes, scale_bits

LIBRARY = "deltafin.kernels._cpu_kernels"
# Must equal KERNELS_ABI in _cpu_kernels.c; a library built from older source is ignored.
ABI = 7
# int4/int6 group sizes the native gemv handles are multiples of this (it decodes 8 elements of
# one group at a time); others stay on the torch reference.
INTQ_GROUP_MULTIPLE = 8
# Rows of x up to which the gemvs beat dequantize-then-matmul (they decode each weight row once
# per 4 rows of x, where a matmul decodes once for all of them); bf16 follows the same rule.
GEMV_MAX_ROWS = 16
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1}

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled library, or None when it was not built or does not match this source."""
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.cpu_kernels_abi.restype = _int
        if lib.cpu_kernels_abi() != ABI:
            return None
        lib.cpu_kernels_has_avx512.restype = _int
        lib.cpu_kernels_simd.restype = _int
        lib.mxfp4_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _int, _int]
        lib.mxfp4_gemv_f32.restype = _int
        lib.mxfp4_gemv_items_f32.argtypes = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _p, _int, _int]
        lib.mxfp4_gemv_items_f32.restype = _int
        lib.mxfp4_dequant.argtypes = [_p, _p, _i64, _i64, _p, _int, _int, _int]
        lib.mxfp4_dequant.restype = _int
        lib.int8_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _int, _int]
        lib.int8_gemv_f32.restype = _int
        lib.intq_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _i64, _int, _p, _int, _int]
        lib.intq_gemv_f32.restype = _int
        lib.bf16_gemv_f32.argtypes = [_p, _i64, _p, _i64, _i64, _p, _int, _int]
        lib.bf16_gemv_f32.restype = _int
    except (OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    """True when the native library is built and loadable."""
    return _library() is not None


def has_avx512() -> bool:
    """True when the native library runs its AVX-512 code on this CPU (else its portable C)."""
    lib = _library()
    return lib is not None and bool(lib.cpu_kernels_has_avx512())


def simd() -> str:
    """The widest code the gemvs run on this CPU: "avx512", "avx2" (int8, bf16 and MXFP4 gemvs; the others
    run portable C there), "portable", or "none" when the library is not built."""
    lib = _library()
    return "none" if lib is None else ("portable", "avx2", "avx512")[lib.cpu_kernels_simd()]


def _lib_or_raise() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels ({LIBRARY}) are not built; reinstall deltafin "
                           "with a C compiler present, or use the torch code in deltafin.kernels")
    return lib


def _threads(threads: int | None) -> int:
    return max(1, torch.get_num_threads() if threads is None else threads)


def _input(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as the contiguous float32 [M, n] the kernels read (bf16 rows are widened exactly)."""
    if x.dim() != 2 or x.shape[1] != n:
        raise ValueError(f"x must be [M, {n}] for this weight, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"the native CPU kernels need a CPU input, got {x.device}")
    return x.to(torch.float32).contiguous()


def _mxfp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    out, n = check_shapes(packed, scale)
    if packed.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError(f"the native MXFP4 kernel needs CPU tensors, got {packed.device} and {scale.device}")
    return packed.contiguous(), scale_bits(scale).contiguous(), out, n


def mxfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """y [M, out] float32 = x [M, in] @ W^T for an MXFP4 weight, accumulating in float32.

    x is converted to contiguous float32 first if it is not. use_simd=False runs the portable C
    code even where AVX-512 is present (both must give the reference's result).
    """
    lib = _lib_or_raise()
    packed, scale, out, n = _mxfp4_weight(packed, scale)
    x = _input(x, n)
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if y.numel() == 0:
        return y
    rc = lib.mxfp4_gemv_f32(x.data_ptr(), x.shape[0], packed.data_ptr(), scale.data_ptr(), out, n,
                            y.data_ptr(), _threads(threads), int(use_simd))
    if rc != 0:
        raise MemoryError(f"MXFP4 gemv could not allocate scratch for x of shape {tuple(x.shape)}")
    return y


def mxfp4_gemv_items(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], x_rows: list[int],
                     y_rows: list[int], rows: list[int], y_len: int, threads: int | None = None,
                     use_simd: bool = True) -> torch.Tensor:
    """Many MXFP4 products in one native call (a MoE layer's routed experts for a whole batch).

    weights[i] = (packed, scale) of one [out, in] weight, all of one shape; item i computes
    y[y_rows[i] : y_rows[i] + rows[i]] = x[x_rows[i] : x_rows[i] + rows[i]] @ W_i^T, exactly as
    ``mxfp4_gemv`` computes it alone. y is float32 [y_len, out]; rows no item writes are zero.
    """
    lib = _lib_or_raise()
    count = len(weights)
    if not count == len(x_rows) == len(y_rows) == len(rows):
        raise ValueError("mxfp4_gemv_items needs one x row, y row and row count per weight")
    if count == 0:
        return torch.zeros(y_len, 0, dtype=torch.float32)
    first_packed, first_scale, out, n = _mxfp4_weight(*weights[0])
    # The others must look exactly like the first (checked cheaply: this runs per expert per layer).
    like = (first_packed.shape, first_scale.shape, torch.uint8, "cpu")
    checked = [(first_packed, first_scale)]
    for p, s in weights[1:]:
        s = scale_bits(s)
        if (p.shape, s.shape, p.dtype, p.device.type) != like or s.device.type != "cpu":
            raise ValueError(f"mxfp4_gemv_items needs CPU weights of one shape: {tuple(p.shape)} and "
                             f"{tuple(first_packed.shape)}")
        checked.append((p.contiguous(), s.contiguous()))
    x = _input(x, n)
    if any(r < 0 or a < 0 or b < 0 or a + r > x.shape[0] or b + r > y_len for a, b, r in zip(x_rows, y_rows, rows)):
        raise ValueError(f"an item's rows fall outside x ({x.shape[0]} rows) or y ({y_len} rows)")
    y = torch.zeros(y_len, out, dtype=torch.float32)

    def array(ctype, values):
        return (ctype * count)(*values)
    rc = lib.mxfp4_gemv_items_f32(x.data_ptr(), array(_p, [p.data_ptr() for p, _ in checked]),
                                  array(_p, [s.data_ptr() for _, s in checked]), array(_i64, x_rows),
                                  array(_i64, y_rows), array(_i64, rows), count, out, n, y.data_ptr(),
                                  _threads(threads), int(use_simd))
    if rc != 0:
        raise MemoryError(f"MXFP4 gemv could not allocate scratch for {count} products")
    return y


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                  threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """W [out, in] in ``dtype``, equal bit for bit to mxfp4.mxfp4_dequantize.

    float32 and bfloat16 are written directly (bf16 holds every decoded value exactly); other
    dtypes are converted from float32 by torch, as the reference does. One exception to equal
    bits: a NaN (scale byte 255) in bf16 is always 0x7FC0, where torch's conversion writes
    0x7FC0 or 0xFFFF depending on its code path.
    """
    lib = _lib_or_raise()
    packed, scale, out, n = _mxfp4_weight(packed, scale)
    direct = dtype if dtype in _OUT_KIND else torch.float32
    w = torch.empty(out, n, dtype=direct)
    if w.numel() > 0:
        rc = lib.mxfp4_dequant(packed.data_ptr(), scale.data_ptr(), out, n, w.data_ptr(),
                               _OUT_KIND[direct], _threads(threads), int(use_simd))
        if rc != 0:
            raise RuntimeError(f"MXFP4 dequant failed with code {rc}")
    return w.to(dtype)


def int8_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """y [M, out] float32 = x [M, in] @ W^T for an int8 weight (int8.py's layout).

    y[m, r] = scale[r] * sum_k codes[r, k] * x[m, k], summed in float32 with the row's scale
    applied once, after the sum; this matches int8_dequantize-then-matmul to float32 rounding.
    x is converted to contiguous float32 first if it is not. use_simd=False runs the portable C
    code even where AVX-512 is present.
    """
    lib = _lib_or_raise()
    out, n = int8_check_shapes(codes, scale)
    if codes.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError(f"the native int8 kernel needs CPU tensors, got {codes.device} and {scale.device}")
    x = _input(x, n)
    codes, scale = codes.contiguous(), scale.contiguous()
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if y.numel() == 0:
        return y
    rc = lib.int8_gemv_f32(x.data_ptr(), x.shape[0], codes.data_ptr(), scale.data_ptr(), out, n,
                           y.data_ptr(), _threads(threads), int(use_simd))
    if rc != 0:
        raise RuntimeError(f"int8 gemv failed with code {rc}")
    return y


def intq_gemv_fits(codec: str, group_size: int) -> bool:
    """True when ``intq_gemv`` handles this codec and group size (given a valid int4/int6 layout)."""
    return codec in BITS and group_size > 0 and group_size % INTQ_GROUP_MULTIPLE == 0


def intq_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, codec: str, group_size: int,
              threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """y [M, out] float32 = x [M, in] @ W^T for an int4 or int6 weight (intq.py's layout).

    y[m, r] = sum over groups g of sum_{k in g} code[r, k] * scale[r, g] * x[m, k], summed in
    float32. Every weight is decoded to the same float32 value intq_dequantize gives, so this
    matches dequantize-then-matmul up to float32 summation order. group_size must be the one the
    tensors hold and a multiple of INTQ_GROUP_MULTIPLE. x is converted to contiguous float32 first
    if it is not. use_simd=False runs the portable C code even where AVX-512 is present.
    """
    lib = _lib_or_raise()
    out, n, group = intq_check_shapes(packed, scale, codec)
    if group != group_size:
        raise ValueError(f"{codec} weight_scale implies group size {group}, not {group_size}")
    if not intq_gemv_fits(codec, group_size):
        raise ValueError(f"the native {codec} gemv needs a group size that is a multiple of "
                         f"{INTQ_GROUP_MULTIPLE}, got {group_size}")
    if packed.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError(f"the native {codec} kernel needs CPU tensors, got {packed.device} and {scale.device}")
    x = _input(x, n)
    packed, scale = packed.contiguous(), scale.contiguous()
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if y.numel() == 0:
        return y
    rc = lib.intq_gemv_f32(x.data_ptr(), x.shape[0], packed.data_ptr(), scale.data_ptr(), out, n,
                           group_size, BITS[codec], y.data_ptr(), _threads(threads), int(use_simd))
    if rc == -1:
        raise MemoryError(f"{codec} gemv could not allocate scratch for x of shape {tuple(x.shape)}")
    if rc != 0:
        raise RuntimeError(f"{codec} gemv failed with code {rc}")
    return y


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, threads: int | None = None,
              use_simd: bool = True) -> torch.Tensor:
    """y [M, out] float32 = x [M, in] @ w^T for a bf16 weight w [out, in], summed in float32.

    Each weight widens to float32 exactly, so this matches ``x.float() @ w.float().T`` up to
    float32 summation order, without a float32 copy of w. A non-contiguous w is copied first
    (weights read from a checkpoint are contiguous). x is converted to contiguous float32 first
    if it is not. use_simd=False runs the portable C code even where AVX-512 is present.
    """
    lib = _lib_or_raise()
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"w must be a 2-D bfloat16 tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if w.device.type != "cpu":
        raise ValueError(f"the native bf16 kernel needs a CPU weight, got {w.device}")
    out, n = w.shape
    x = _input(x, n)
    w = w.contiguous()
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if y.numel() == 0:
        return y
    rc = lib.bf16_gemv_f32(x.data_ptr(), x.shape[0], w.data_ptr(), out, n, y.data_ptr(),
                           _threads(threads), int(use_simd))
    if rc != 0:
        raise RuntimeError(f"bf16 gemv failed with code {rc}")
    return y
