"""Native CPU kernels for stored weights (_cpu_kernels.c), called through ctypes.

``mxfp4_gemv``, ``int8_gemv``, ``intq_gemv`` (int4, int6) and ``bf16_gemv`` multiply a few float32 rows of x by a stored
weight without materializing it (``dense_gemv_items`` many int8 or bf16 products in one call, and
``dense_gemv_t_items`` the transposed products x @ W), at close to memory speed (AVX-512 where the CPU has it, for
int8 its VNNI integer dot products of x rounded to int16; the MXFP4, int8 and bf16 gemvs also have an AVX2+FMA path
that differs from their portable C only in rounding order; ``limit_simd`` narrows the choice); ``mxfp4_dequant``
decodes MXFP4 rows
bit-for-bit like ``mxfp4.mxfp4_dequantize``; ``kda_steps`` runs a KDA layer's recurrence between its
projections (conv, norms, decay, the delta rule on S, output norm and gate) for the sequences of a pass. The library is an optional part of the install (setup.py): when it
was not built, ``available()`` is False and callers use the torch references in mxfp4.py,
int8.py and intq.py (and a float32 conversion for bf16). It is loaded on first use, not at import.

Every function releases the GIL while it runs (ctypes does) and splits the output rows over
``threads`` threads: unless given, torch.get_num_threads(), or inside ``decode_threads()`` the
count torch had when it was entered.
"""
from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from itertools import accumulate
import functools
import importlib.util
import warnings
from collections.abc import Iterator

import torch

from .int8 import GROUP_MULTIPLE as INT8_GROUP_MULTIPLE, INTERLEAVE_GROUPS, int8_check_shapes
from .intq import BITS, intq_check_shapes
from .mxfp4 import check_shapes, scale_bits

LIBRARY = "deltafin.kernels._cpu_kernels"
# Must equal KERNELS_ABI in _cpu_kernels.c; a library built from older source is ignored.
ABI = 24
# int4/int6 group sizes the native gemv handles are multiples of this (it decodes 8 elements of
# one group at a time); others stay on the torch reference.
INTQ_GROUP_MULTIPLE = 8
# Rows of x up to which the int8, bf16 and MXFP4 gemvs beat dequantize-then-matmul (they widen or
# decode each weight row once per few rows of x, where a matmul does it once for all of them, but
# the torch path first widens the weight to float32, a block of rows at a time; measured:
# docs/benchmarks.md#native-cpu-products). 64 is also the most rows a server pass carries.
GEMV_MAX_ROWS = 64
# The same for int4 / int6, whose gemv is portable C on CPUs without AVX-512: there it was slower
# than the torch path already at 16 rows (2048 x 7168: 63 against 48 ms), so it keeps the limit
# of its AVX-512 code.
INTQ_GEMV_MAX_ROWS = 16
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
        built = lib.cpu_kernels_abi()
        if built != ABI:
            # Said once: otherwise every product silently runs in torch, several times slower.
            warnings.warn(f"the native CPU kernels at {spec.origin} were built from other source (ABI {built}, "
                          f"this deltafin needs {ABI}); products run in torch, much slower, until deltafin is "
                          "installed again (./run.sh does it)", RuntimeWarning, stacklevel=2)
            return None
        lib.cpu_kernels_simd.restype = _int
        lib.cpu_kernels_limit_simd.argtypes = [_int]
        lib.cpu_kernels_limit_simd.restype = _int
        lib.mla_attend_blocked.argtypes = [_i64, _i64]
        lib.mla_attend_blocked.restype = _int
        lib.mxfp4_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _int, _int]
        lib.mxfp4_gemv_f32.restype = _int
        lib.mxfp4_gemv_items_f32.argtypes = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _p, _int, _int]
        lib.mxfp4_gemv_items_f32.restype = _int
        lib.mxfp4_dequant.argtypes = [_p, _p, _i64, _i64, _p, _int, _int, _int]
        lib.mxfp4_dequant.restype = _int
        lib.int8_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _i64, _p, _int, _int]
        lib.int8_gemv_f32.restype = _int
        lib.intq_gemv_f32.argtypes = [_p, _i64, _p, _p, _i64, _i64, _i64, _int, _p, _int, _int]
        lib.intq_gemv_f32.restype = _int
        lib.bf16_gemv_f32.argtypes = [_p, _i64, _p, _i64, _i64, _p, _int, _int]
        lib.bf16_gemv_f32.restype = _int
        lib.dense_gemv_outs_f32.argtypes = [_p, _i64, _p, _p, _p, _i64, _p, _i64, _int, _i64, _int, _int]
        lib.dense_gemv_outs_f32.restype = _int
        for items in (lib.dense_gemv_items_f32, lib.dense_gemv_t_items_f32):
            items.argtypes = [_p, _p, _p, _p, _p, _i64, _i64, _i64, _int, _i64, _int, _int]
            items.restype = _int
        lib.moe_silu_f32.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _int, _int, _i64, _i64, _i64,
                                     _i64, _p, _p, _int, _int]
        lib.moe_silu_f32.restype = _int
        lib.moe_block_silu_f32.argtypes = [_p, _i64, _i64, _p, _int, ctypes.c_float, _p, _int, _p, _i64, _i64, _int,
                                           ctypes.c_float, _i64, _p, _p, _p, _p, _int, _i64, _i64, _i64, _i64, _p, _p,
                                           _int, _int]
        lib.moe_block_silu_f32.restype = _int
        lib.mlp_block_silu_f32.argtypes = [_p, _i64, _i64, _p, _int, ctypes.c_float, _i64, _p, _p, _int, _i64, _i64,
                                           _p, _int, _int]
        lib.mlp_block_silu_f32.restype = _int
        lib.kda_block_f32.argtypes = [_p, _i64, _i64, _p, _int, ctypes.c_float, _p, _p, _int, _i64, _p, _p, _int, _i64,
                                      _p, _p, _int, _i64, _i64, _p, _p, _p, _int, _p, _int, _p, _int, _int,
                                      ctypes.c_float, _p, _int, _p, _i64, _i64, _i64, _p, _int, _int]
        lib.kda_block_f32.restype = _int
        lib.silu_glu_f32.argtypes = [_p, _p, _p, _i64, _int]
        lib.silu_glu_f32.restype = _int
        lib.rms_norm_f32.argtypes = [_p, _i64, _i64, _p, _int, ctypes.c_float, _p, _int]
        lib.rms_norm_f32.restype = _int
        lib.route_sigmoid_f32.argtypes = [_p, _i64, _i64, _p, _int, _p, _i64, _i64, _int, ctypes.c_float, _p, _p, _int]
        lib.route_sigmoid_f32.restype = _int
        lib.kda_steps_f32.argtypes = [_i64, _p, _p, _p, _p, _int, _p, _p, _int, _p, _int, _p, _int, ctypes.c_float,
                                      _p, _p, _int, ctypes.c_float, _p, _p, _i64, _i64, _i64, _int]
        lib.kda_steps_f32.restype = _int
        lib.mla_decode_attend_f32.argtypes = [_i64, _p, _p, _p, _p, _p, ctypes.c_float, _p, _i64, _i64, _i64, _int]
        lib.mla_decode_attend_f32.restype = _int
        lib.mla_block_f32.argtypes = [_p, _i64, _i64, _p, _int, ctypes.c_float, _p, _p, _int, _i64, _p, _int,
                                      ctypes.c_float, _p, _p, _int, _i64, _p, _p, _int, _i64, _p, _p, _int, _i64,
                                      _p, _p, _p, ctypes.c_float, _i64, _i64, _i64, _i64, _i64, _p, _int, _int]
        lib.mla_block_f32.restype = _int
        lib.read_memory.argtypes = [_p, _p, _i64, _int, _p]
        lib.read_memory.restype = _int
        lib.int8_interleave_inplace.argtypes = [_p, _i64, _i64]
        lib.int8_interleave_inplace.restype = _int
    except (OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    """True when the native library is built and loadable."""
    return _library() is not None


def simd() -> str:
    """The widest code the gemvs run on this CPU: "avx512", "avx2" (int8, bf16 and MXFP4 gemvs; the others
    run portable C there), "portable", or "none" when the library is not built."""
    lib = _library()
    return "none" if lib is None else _SIMD_LEVELS[lib.cpu_kernels_simd()]


_SIMD_LEVELS = ("portable", "avx2", "avx512")


def mla_attend_blocked(r: int, rope: int) -> bool:
    """Whether ``mla_decode_attend`` runs its AVX-512 kernel for latents of width r and rope keys of width
    rope (both multiples of 16, a CPU with AVX-512 and no narrower ``limit_simd``: the library's own rule):
    a blocked product faster than torch's at every cache length measured; else its plain loops."""
    lib = _library()
    return lib is not None and bool(lib.mla_attend_blocked(r, rope))


@contextlib.contextmanager
def limit_simd(level: str) -> Iterator[None]:
    """Inside, the kernels run no wider code than ``level`` ("avx2" or "portable"): the narrower
    paths on a CPU that has wider ones (how their tests run on an AVX-512 machine). For one thread
    of the process at a time: the limit is the library's, not the caller's."""
    if level not in _SIMD_LEVELS:
        raise ValueError(f"limit_simd takes one of {', '.join(_SIMD_LEVELS)}, got {level!r}")
    lib = _lib_or_raise()
    previous = lib.cpu_kernels_limit_simd(_SIMD_LEVELS.index(level))
    try:
        yield
    finally:
        lib.cpu_kernels_limit_simd(previous)


def _lib_or_raise() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels ({LIBRARY}) are not built; reinstall deltafin "
                           "with a C compiler present, or use the torch code in deltafin.kernels")
    return lib


# The native kernels' thread count while decode_threads() holds torch's at one (None outside it).
_decode_threads: int | None = None


@contextlib.contextmanager
def decode_threads(native: int | None = None) -> Iterator[None]:
    """A decode-sized pass on the CPU: torch's own ops run on one thread while these kernels keep
    every compute thread torch had (or ``native`` threads, when given). A decode step's torch ops are small (norms, the KDA step, conv,
    routing): on more threads they only wait on each other, and torch's OpenMP workers spin after
    each of them on the cores these kernels' threads need (measured: docs/benchmarks.md#native-cpu-products).
    Nested use keeps the outer counts."""
    global _decode_threads
    if _decode_threads is not None:
        yield
        return
    threads = torch.get_num_threads()
    _decode_threads = native or threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _decode_threads = None


def _threads(threads: int | None) -> int:
    if threads is None:
        threads = _decode_threads or torch.get_num_threads()
    return max(1, threads)


def pass_threads() -> int:
    """The threads a call made now would compute on (given no ``threads``)."""
    return _threads(None)


@dataclass(frozen=True)
class NativeCall:
    """One call a ``recording`` saw, as it was made: the function, its ctypes arguments (which hold the
    pointer arrays they name), and the tensors it read rows from (``src``) and wrote (``out``), kept alive
    so that the addresses in ``args`` stay theirs. ``lengths``: an MLA call's array of cache lengths,
    which differ from pass to pass; ``ids``: a MoE call's chosen experts; ``keep``: what else the call read
    by address (weights, and what the caller made of them for this call, such as a widened bias), held for
    the same reason."""
    fn: object
    args: tuple
    who: str
    rows: int
    src: torch.Tensor
    out: torch.Tensor
    lengths: ctypes.Array | None = None
    ids: torch.Tensor | None = None
    keep: tuple = ()


# The calls of the pass now being recorded (runtime/cpu_replay.py), or None.
_recording: list[NativeCall] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[NativeCall]]:
    """Inside, the layer-half calls (``kda_block``, ``mla_block``, ``moe_block_silu``, ``mlp_block_silu``)
    and the head's (``rms_norm``, ``dense_gemv``) run as always and are also appended to the list this
    yields, in order; ``replay`` makes them again."""
    global _recording
    if _recording is not None:
        raise RuntimeError("a native recording is already running")
    calls: list[NativeCall] = []
    _recording = calls
    try:
        yield calls
    finally:
        _recording = None


def _made(fn, args: tuple, who: str, rows: int, src: torch.Tensor, out: torch.Tensor, **more) -> int:
    """fn(*args), and the call appended to the recording running (if one is)."""
    rc = fn(*args)
    if _recording is not None:
        _recording.append(NativeCall(fn, args, who, rows, src, out, **more))
    return rc


def replay(calls: list[NativeCall]) -> None:
    """Make the recorded calls again, in order, each as it was made (the same addresses, so the same
    tensors are read and written); a call's failure raised as its first making would have raised it."""
    for c in calls:
        rc = c.fn(*c.args)
        _check_block(rc, c.who, c.rows)


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
    rc = lib.mxfp4_gemv_items_f32(x.data_ptr(), _array(_p, [p.data_ptr() for p, _ in checked]),
                                  _array(_p, [s.data_ptr() for _, s in checked]), _array(_i64, x_rows),
                                  _array(_i64, y_rows), _array(_i64, rows), count, out, n, y.data_ptr(),
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

    Each row of x is first rounded to int16 on its own, q = round(x / step) with step = max |x| / 32767
    (an input moves by at most step / 2, 2^-16 of the row's largest; a row holding inf or NaN gives
    NaN), and codes times q are summed exactly in integers per group (row scales: per 2048 inputs)
    before the scales: y[m, r] = step[m] * sum_g scale[r, g] * sum_{k in g} codes[r, k] * q[m, k].
    Against int8_dequantize-then-matmul that is the rounding of x plus float32 summation order; a
    row's result never depends on the other rows of x. x is converted to contiguous float32 first if
    it is not. use_simd=False runs the portable C code (the same integers) even where AVX-512 is
    present.
    """
    _lib_or_raise()  # "not built" before any complaint about the arguments
    out, n, _ = int8_check_shapes(codes, scale)
    if codes.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError(f"the native int8 kernel needs CPU tensors, got {codes.device} and {scale.device}")
    return dense_gemv(_input(x, n), codes.contiguous(), scale.contiguous(), threads, use_simd)


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
    _lib_or_raise()
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"w must be a 2-D bfloat16 tensor, got {w.dtype} of shape {tuple(w.shape)}")
    if w.device.type != "cpu":
        raise ValueError(f"the native bf16 kernel needs a CPU weight, got {w.device}")
    return dense_gemv(_input(x, w.shape[1]), w.contiguous(), None, threads, use_simd)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, threads: int | None = None,
               use_simd: bool = True) -> torch.Tensor:
    """y [M, out] float32 = x [M, in] @ W^T for one int8 (codes w, row scales `scale`) or bf16 (scale None)
    weight: the native call ``int8_gemv`` / ``bf16_gemv`` make after their conversions, called straight
    by the per-token products of a resident model. x must already be contiguous float32 on the CPU,
    and the checks are the few that keep a wrong pointer out of C (the general wrappers' conversions
    and checks cost ~30 us a product)."""
    lib = _lib_or_raise()
    if not (x.dtype == torch.float32 and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and x.is_contiguous() and w.is_contiguous() and x.is_cpu and w.is_cpu):
        raise ValueError(f"dense_gemv needs contiguous CPU float32 x [M, {w.shape[-1]}] and a 2-D weight, got "
                         f"{x.dtype} {tuple(x.shape)} and {tuple(w.shape)}")
    out, n = w.shape
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if w.dtype == torch.int8 and scale is not None:
        group = _int8_group(out, n, scale)
        if group is None:
            raise ValueError(f"dense_gemv: int8 codes [{out}, {n}] need float32 row scales [{out}, 1] or float16 "
                             f"group scales [{out}, groups], got {scale.dtype} {tuple(scale.shape)}")
        rc = _made(lib.int8_gemv_f32, (x.data_ptr(), x.shape[0], w.data_ptr(), scale.data_ptr(), out, n, group,
                                       y.data_ptr(), _threads(threads), int(use_simd)),
                   "int8 gemv", x.shape[0], x, y, keep=(w, scale)) if y.numel() else 0
    elif w.dtype == torch.bfloat16 and scale is None:
        rc = _made(lib.bf16_gemv_f32, (x.data_ptr(), x.shape[0], w.data_ptr(), out, n, y.data_ptr(), _threads(threads),
                                       int(use_simd)), "bf16 gemv", x.shape[0], x, y, keep=(w,)) if y.numel() else 0
    else:
        raise ValueError(f"dense_gemv needs int8 codes with a scale or a bf16 weight, got {w.dtype} "
                         f"with{'out' if scale is None else ''} a scale")
    _check_dense(rc, 1)
    return y


def _check_dense(rc: int, count: int) -> None:
    """A native dense call's return code as the error it stands for (-1: int8 x rounded into scratch
    that could not be allocated)."""
    if rc == -1:
        raise MemoryError(f"dense gemv could not allocate scratch for {count} products")
    if rc != 0:
        raise RuntimeError(f"dense gemv failed with code {rc}")


def _int8_group(out: int, n: int, scale: torch.Tensor) -> int | None:
    """The group size int8 scales imply (0: per row; minus the group: int8.int8_interleaved's pair), or None
    if the kernels cannot take them (the cheap checks of the per-token path: contiguous CPU float32 [out, 1],
    float16 [out, n / group] or float16 [out, n / group, 1] for an interleaving group)."""
    if not (scale.dim() >= 2 and scale.is_contiguous() and scale.is_cpu and scale.shape[0] == out):
        return None
    if scale.dim() == 3:
        fits = scale.dtype == torch.float16 and scale.shape[2] == 1 and scale.shape[1] and n % scale.shape[1] == 0 \
            and n // scale.shape[1] in INTERLEAVE_GROUPS
        return -(n // scale.shape[1]) if fits else None
    if scale.dim() != 2:
        return None
    if scale.dtype == torch.float32 and scale.shape[1] == 1:
        return 0
    if scale.dtype == torch.float16 and scale.shape[1] and n % scale.shape[1] == 0:
        group = n // scale.shape[1]
        return group if group % INT8_GROUP_MULTIPLE == 0 else None
    return None


def _dense_weights(ws: list[torch.Tensor], scales: list[torch.Tensor | None]) -> tuple[int, int]:
    """Checks weights of one native dense call (one shape and kind, contiguous CPU tensors) and returns
    the kind (1 int8, 0 bf16) and the int8 group size (0: row scales). The checks are what keeps a
    wrong pointer out of C; they run for every weight of every call, so they use torch's cheapest
    queries."""
    if not len(ws) == len(scales) or not ws:
        raise ValueError("dense items need one x and one scale (None for bf16) per weight, and at least one")
    w0, s0 = ws[0], scales[0]
    group = 0
    if w0.dtype == torch.int8 and s0 is not None:
        _, _, group = int8_check_shapes(w0, s0)
        kind, scale_shape = 1, s0.shape
    elif w0.dtype == torch.bfloat16 and s0 is None and w0.dim() == 2:
        kind, scale_shape = 0, None
    else:
        raise ValueError(f"a dense item needs int8 codes with a scale or a bf16 weight, got {w0.dtype} "
                         f"{tuple(w0.shape)} with{'out' if s0 is None else ''} a scale")
    shape, dtype = w0.shape, w0.dtype
    for w, s in zip(ws, scales):
        if w.shape != shape or w.dtype != dtype or (s is None) != (kind == 0) or \
                (s is not None and (s.shape != scale_shape or s.dtype != s0.dtype)):
            raise ValueError(f"dense items need weights of one shape and kind: {tuple(w.shape)} {w.dtype} "
                             f"and {tuple(shape)} {dtype}")
        if not (w.is_contiguous() and (s is None or s.is_contiguous())):
            raise ValueError("dense items need contiguous tensors")
        if not (w.is_cpu and (s is None or s.is_cpu)):
            raise ValueError("the native dense items need CPU tensors")
    return kind, group


def _dense_items(xs: list[torch.Tensor], ws: list[torch.Tensor], scales: list[torch.Tensor | None],
                 x_width: int, y_width: int) -> tuple[torch.Tensor, list, int, int]:
    """Checks the items (``_dense_weights``, and float32 contiguous CPU x [M, x_width]) and returns y
    float32 [sum of M, y_width] (item i's rows after item i-1's), the ctypes arrays (x, rows, weights,
    scales, y), the kind (1 int8, 0 bf16) and the int8 group size (0: row scales)."""
    count = len(ws)
    if count != len(xs):
        raise ValueError("dense items need one x and one scale (None for bf16) per weight, and at least one")
    kind, group = _dense_weights(ws, scales)
    for x in xs:
        if x.dim() != 2 or x.shape[1] != x_width or x.dtype != torch.float32:
            raise ValueError(f"each x must be float32 [M, {x_width}], got {x.dtype} {tuple(x.shape)}")
        if not (x.is_contiguous() and x.is_cpu):
            raise ValueError("dense items need contiguous tensors" if x.is_cpu else
                             "the native dense items need CPU tensors")
    rows = [x.shape[0] for x in xs]
    y = torch.empty(sum(rows), y_width, dtype=torch.float32)
    at, base, ys = 0, y.data_ptr(), []
    for m in rows:
        ys.append(base + at * y_width * 4)
        at += m

    args = [_array(_p, [x.data_ptr() for x in xs]), _array(_i64, rows), _array(_p, [w.data_ptr() for w in ws]),
            _array(_p, [0 if s is None else s.data_ptr() for s in scales]), _array(_p, ys)]
    return y, args, kind, group


def _array(ctype, values: list):
    return (ctype * len(values))(*values)


def dense_gemv_items(xs: list[torch.Tensor], ws: list[torch.Tensor], scales: list[torch.Tensor | None],
                     threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """Many products of one weight shape in one native call (a MoE layer's chosen experts, a layer's
    projections of one input): item i is xs[i] [M_i, in] float32 @ W_i^T for W_i [out, in] given as
    int8 codes ws[i] with row scale scales[i] (int8.py's layout) or as a bf16 ws[i] (scale None).
    Returns float32 [sum of M_i, out], item i's rows after item i-1's, each equal bit for bit to
    ``int8_gemv`` / ``bf16_gemv`` of that item alone; the threads share every item's rows."""
    return _dense_call(False, xs, ws, scales, threads, use_simd)


def dense_gemv_outs(x: torch.Tensor, ws: list[torch.Tensor], scales: list[torch.Tensor | None],
                    threads: int | None = None, use_simd: bool = True) -> list[torch.Tensor]:
    """One x [M, in] float32 against several int8 or bf16 weights of one kind and width `in` but any
    number of output rows each (a KDA layer's beta and low-rank projections), in one native call:
    [x @ W_i^T float32 [M, out_i]], each equal bit for bit to ``int8_gemv`` / ``bf16_gemv`` of it alone."""
    lib = _lib_or_raise()
    if not ws or any(w.dim() != 2 or w.shape[1] != ws[0].shape[1] for w in ws):
        raise ValueError("dense outs need at least one 2-D weight, all of one input width")
    n = ws[0].shape[1]
    if not (x.dim() == 2 and x.shape[1] == n and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu):
        raise ValueError(f"dense outs need contiguous CPU float32 x [M, {n}], got {x.dtype} {tuple(x.shape)}")
    if len(scales) != len(ws):
        raise ValueError("dense outs need one scale (None for bf16) per weight")
    checked = {_dense_weights([w], [s]) for w, s in zip(ws, scales)}  # the items' checks, weight by weight
    if len(checked) != 1:
        raise ValueError("dense outs need weights of one kind (and one int8 group size)")
    kind, group = checked.pop()
    ys = [torch.empty(x.shape[0], w.shape[0], dtype=torch.float32) for w in ws]
    rc = lib.dense_gemv_outs_f32(x.data_ptr(), x.shape[0], _array(_p, [w.data_ptr() for w in ws]),
                                 _array(_p, [0 if s is None else s.data_ptr() for s in scales]),
                                 _array(_p, [y.data_ptr() for y in ys]), len(ws),
                                 _array(_i64, [w.shape[0] for w in ws]), n, kind, group, _threads(threads),
                                 int(use_simd)) if x.shape[0] else 0
    _check_dense(rc, len(ws))
    return ys


def dense_gemv_t_items(xs: list[torch.Tensor], ws: list[torch.Tensor], scales: list[torch.Tensor | None],
                       threads: int | None = None, use_simd: bool = True) -> torch.Tensor:
    """The transposed products in one native call (every head of an attention layer applying a key
    projection to its query): item i is xs[i] [M_i, depth] float32 @ W_i for W_i [depth, n], int8
    codes with row scales (one per depth row) or bf16. Returns float32 [sum of M_i, n] as
    ``dense_gemv_items``; equal to dequantize-then-matmul up to float32 rounding."""
    return _dense_call(True, xs, ws, scales, threads, use_simd)


@dataclass(frozen=True)
class DenseHeads:
    """One layer's per-head weights of one shape and kind (``dense_heads``), checked once, with their
    pointer arrays: an attention layer multiplies by the same heads every token, and building and
    checking 32 heads' arguments took longer (~70 us a call) than the native products themselves."""
    ws: tuple  # kept alive while the pointers are in use
    scales: tuple
    w_ptrs: ctypes.Array
    s_ptrs: ctypes.Array
    kind: int  # 1 int8, 0 bf16
    group: int  # int8 group size (0: row scales)
    rows: int
    cols: int


def dense_heads(ws: list[torch.Tensor], scales: list[torch.Tensor | None]) -> DenseHeads:
    """``DenseHeads`` of int8 codes with their scales or bf16 weights (scales None), as the dense items
    take them."""
    kind, group = _dense_weights(ws, scales)
    return DenseHeads(tuple(ws), tuple(scales), _array(_p, [w.data_ptr() for w in ws]),
                      _array(_p, [0 if s is None else s.data_ptr() for s in scales]), kind, group,
                      ws[0].shape[0], ws[0].shape[-1])


def dense_heads_gemv(x: torch.Tensor, heads: DenseHeads, transposed: bool = False, threads: int | None = None,
                     use_simd: bool = True) -> torch.Tensor:
    """Every head's product in one native call, x float32 [heads, M, in] (head i's rows x[i]):
    ``dense_gemv_items`` (W_i [out, in], y_i = x[i] @ W_i^T) or, ``transposed``, ``dense_gemv_t_items``
    (W_i [in, out], y_i = x[i] @ W_i), with the same values. Returns float32 [heads * M, out]."""
    lib = _lib_or_raise()
    count = len(heads.ws)
    x_width, y_width = (heads.rows, heads.cols) if transposed else (heads.cols, heads.rows)
    if not (x.dim() == 3 and x.shape[0] == count and x.shape[2] == x_width and x.dtype == torch.float32
            and x.is_contiguous() and x.is_cpu):
        raise ValueError(f"dense_heads_gemv needs contiguous CPU float32 x [{count}, M, {x_width}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    m = x.shape[1]
    y = torch.empty(count * m, y_width, dtype=torch.float32)
    if y.numel():
        xp, yp = x.data_ptr(), y.data_ptr()
        args = [_array(_p, [xp + i * m * x_width * 4 for i in range(count)]), _array(_i64, [m] * count),
                heads.w_ptrs, heads.s_ptrs, _array(_p, [yp + i * m * y_width * 4 for i in range(count)])]
        _items_call(lib, transposed, args, count, heads.rows, heads.cols, heads.kind, heads.group, threads, use_simd)
    return y


def _dense_call(transposed: bool, xs, ws, scales, threads: int | None, use_simd: bool) -> torch.Tensor:
    lib = _lib_or_raise()
    if not ws or ws[0].dim() != 2:
        raise ValueError("dense items need at least one weight, each 2-D")
    rows, cols = ws[0].shape[0], ws[0].shape[-1]
    y, args, kind, group = _dense_items(xs, ws, scales, rows if transposed else cols, cols if transposed else rows)
    if y.numel():
        _items_call(lib, transposed, args, len(ws), rows, cols, kind, group, threads, use_simd)
    return y


def _items_call(lib, transposed: bool, args: list, count: int, rows: int, cols: int, kind: int, group: int,
                threads: int | None, use_simd: bool) -> None:
    """The native items call (``dense_gemv_items_f32``, or ``dense_gemv_t_items_f32`` when transposed) over
    the ctypes arrays args (x, rows, weights, scales, y), its return code raised as the error it means."""
    fn = lib.dense_gemv_t_items_f32 if transposed else lib.dense_gemv_items_f32
    _check_dense(fn(*args, count, rows, cols, kind, group, _threads(threads), int(use_simd)), count)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, use_simd: bool = True) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim of contiguous CPU float32 x, the weight float32
    or bf16 [n] (or None), in float32: ops.rms_norm's formula in one native call (its torch ops cost
    ~50 us a call in a decode token); equal to it up to float32 rounding."""
    lib = _lib_or_raise()
    n = x.shape[-1] if x.dim() else 0
    if not (x.dtype == torch.float32 and x.dim() >= 1 and n > 0 and x.is_contiguous() and x.is_cpu):
        raise ValueError(f"rms_norm needs contiguous CPU float32 rows, got {x.dtype} {tuple(x.shape)}")
    w_bf16 = 0 if weight is None else _norm_weight("rms_norm", "weight", weight, n)
    y = torch.empty_like(x)
    _made(lib.rms_norm_f32, (x.data_ptr(), x.numel() // n, n, 0 if weight is None else weight.data_ptr(), w_bf16,
                             eps, y.data_ptr(), int(use_simd)), "rms_norm", x.numel() // n, x, y, keep=(weight,))
    return y


def _norm_weight(who: str, name: str, w: torch.Tensor, n: int) -> int:
    """Checks an RMSNorm's weight (contiguous CPU float32 or bf16 [n]); 1 when it holds bf16, else 0."""
    if not (w.dtype in (torch.float32, torch.bfloat16) and tuple(w.shape) == (n,) and w.is_contiguous() and w.is_cpu):
        raise ValueError(f"{who} needs a contiguous CPU float32 or bf16 {name} [{n}], got {w.dtype} {tuple(w.shape)}")
    return int(w.dtype == torch.bfloat16)


def route_sigmoid(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool,
                  scale: float, use_simd: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid router without expert groups over contiguous CPU float32 rows x [T, H] (gate float32 or
    bf16 [E, H], bias float32 [E]): the ids [T, k] of the k largest sigmoid(x @ gate^T) + bias, in
    descending order, and their weights [T, k] (the scores, renormalized to sum 1 if asked, times
    scale), as model/moe.py route computes them, in one native call; scores differ from torch's by
    float32 rounding."""
    lib = _lib_or_raise()
    if not (x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu):
        raise ValueError(f"route_sigmoid needs contiguous CPU float32 rows [T, H], got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    E = _check_router("route_sigmoid", gate, gate.shape[0] if gate.dim() == 2 else -1, H, bias, k)
    ids = torch.empty(T, k, dtype=torch.int64)
    w = torch.empty(T, k, dtype=torch.float32)
    rc = lib.route_sigmoid_f32(x.data_ptr(), T, H, gate.data_ptr(), int(gate.dtype == torch.bfloat16),
                               bias.data_ptr(), E, k, int(renormalize), scale, ids.data_ptr(), w.data_ptr(),
                               int(use_simd))
    if rc == -1:
        raise MemoryError("route_sigmoid could not allocate its scores")
    if rc != 0:
        raise RuntimeError(f"route_sigmoid failed with code {rc}")
    return ids, w


def _check_router(who: str, gate: torch.Tensor, E: int, H: int, bias: torch.Tensor, k: int) -> int:
    """The checks of a sigmoid router's gate (contiguous CPU float32 or bf16 [E, H]), bias (float32 [E])
    and k (1..E); returns E."""
    if not (gate.dtype in (torch.float32, torch.bfloat16) and tuple(gate.shape) == (E, H) and gate.is_contiguous()
            and gate.is_cpu):
        raise ValueError(f"{who} needs a contiguous CPU float32 or bf16 gate [{E}, {H}], got {gate.dtype} "
                         f"{tuple(gate.shape)}")
    if not (bias.dtype == torch.float32 and tuple(bias.shape) == (E,) and bias.is_contiguous() and bias.is_cpu):
        raise ValueError(f"{who} needs a float32 bias [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if not 1 <= k <= E:
        raise ValueError(f"{who} picks 1..{E} experts a row, got {k}")
    return E


def silu_glu(gate: torch.Tensor, up: torch.Tensor, use_simd: bool = True) -> torch.Tensor:
    """silu(gate) * up for contiguous CPU float32 tensors of one shape, as ``moe_silu`` computes its
    activation (g / (1 + exp(-g)) * u; the exp differs from torch's by ~1 ulp), so that the products
    of a decode-sized pass and its activation give the same bits in every path that computes them."""
    lib = _lib_or_raise()
    if not (gate.dtype == up.dtype == torch.float32 and gate.shape == up.shape and gate.is_contiguous()
            and up.is_contiguous() and gate.is_cpu and up.is_cpu):
        raise ValueError(f"silu_glu needs contiguous CPU float32 tensors of one shape, got {gate.dtype} "
                         f"{tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}")
    act = torch.empty_like(gate)
    lib.silu_glu_f32(gate.data_ptr(), up.data_ptr(), act.data_ptr(), gate.numel(), int(use_simd))
    return act


@dataclass(frozen=True)
class MoeExpert:
    """One expert's (gate, up, down) checked for ``moe_silu`` (``moe_expert``), kept so that a decode
    token's MoE layers check each expert once, not every token: its weights' pointers, what the
    experts of one call must share (kind, group of gate/up, group of down, I, H), and the weights."""
    pointers: tuple[int, ...]   # gate, up, down weights, then their scales (0: bf16)
    signature: tuple[int, int, int, int, int]
    tensors: tuple


def moe_expert(gate: tuple, up: tuple, down: tuple) -> MoeExpert:
    """An expert's (gate, up, down), each (weight, scale) as ``native_dense`` gives them (int8 codes and
    scales, or a bf16 weight and None), checked as the native dense items check their weights: gate and
    up [I, H] and down [H, I], contiguous on the CPU, of one kind."""
    kind, group_in = _dense_weights([gate[0], up[0]], [gate[1], up[1]])
    kind_out, group_out = _dense_weights([down[0]], [down[1]])
    I, H = gate[0].shape
    if kind_out != kind or tuple(down[0].shape) != (H, I):
        raise ValueError(f"a MoE expert needs gate and up [I, H] and down [H, I] of one kind, got "
                         f"{tuple(gate[0].shape)} and {tuple(down[0].shape)}")
    mats = (gate, up, down)
    return MoeExpert(tuple(w.data_ptr() for w, _ in mats) + tuple(0 if s is None else s.data_ptr() for _, s in mats),
                     (kind, group_in, group_out, I, H), mats)


def moe_silu(z: torch.Tensor, counts: list[int], pair_rows: list[int], pair_weights: torch.Tensor,
             experts: list[MoeExpert], shared: MoeExpert | None = None, threads: int | None = None,
             use_simd: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A MoE layer's chosen experts (and its shared expert) with a SiLU-GLU over the rows z [T, H] in one
    native call: pair p (grouped by expert, counts[e] pairs of experts[e] in order) is row pair_rows[p]
    of z with routing weight pair_weights[p] (float32 [P]); the experts (``moe_expert``) of one
    signature. Returns the routed sum [T, H] (each row's pairs added in pair order, as ``index_add_``
    adds them) and the shared expert's output [T, H] (None without one). Each product equals
    ``dense_gemv_items``' for those rows; the activation is ``silu_glu``'s."""
    lib = _lib_or_raise()
    if not (z.dim() == 2 and z.dtype == torch.float32 and z.is_contiguous() and z.is_cpu):
        raise ValueError(f"moe_silu needs contiguous CPU float32 rows [T, H], got {z.dtype} {tuple(z.shape)}")
    T, H = z.shape
    P = len(pair_rows)
    if len(counts) != len(experts) or any(c < 0 for c in counts) or sum(counts) != P:
        raise ValueError(f"moe_silu needs one count per expert summing to the {P} pairs, got {counts}")
    if any(not 0 <= r < T for r in pair_rows):
        raise ValueError(f"moe_silu: pair rows must lie in 0..{T - 1}")
    if not (pair_weights.dtype == torch.float32 and pair_weights.is_contiguous() and pair_weights.is_cpu
            and tuple(pair_weights.shape) == (P,)):
        raise ValueError(f"moe_silu needs float32 pair weights [{P}], got {pair_weights.dtype} "
                         f"{tuple(pair_weights.shape)}")
    items = list(experts) + ([shared] if shared is not None else [])
    if not items or not all(isinstance(e, MoeExpert) for e in items):
        raise ValueError("moe_silu needs at least one expert, each made by moe_expert")
    signature = items[0].signature
    kind, group_in, group_out, I, width = signature
    if width != H or any(e.signature != signature for e in experts) or not shared_fits(shared, signature):
        raise ValueError(f"moe_silu needs experts of one shape and kind reading rows of width {H}, got "
                         f"{sorted({e.signature for e in items})}")
    shared_in, shared_out = (group_in, group_out) if shared is None else shared.signature[1:3]
    y = torch.zeros(T, H, dtype=torch.float32)
    y_shared = torch.zeros(T, H, dtype=torch.float32) if shared is not None else None
    # gate, up, down weights of every item, then their scales, as the C call reads them
    order = [e.pointers[j] for j in range(3) for e in items]
    scales = [e.pointers[3 + j] for j in range(3) for e in items]
    rc = lib.moe_silu_f32(z.data_ptr(), T, H, I, len(experts), _array(_i64, counts), _array(_i64, pair_rows),
                          pair_weights.data_ptr(), _array(_p, order), _array(_p, scales), int(shared is not None),
                          kind, group_in, group_out, shared_in, shared_out, y.data_ptr(),
                          0 if y_shared is None else y_shared.data_ptr(),
                          _threads(threads), int(use_simd)) if T else 0
    if rc == -1:
        raise MemoryError(f"moe_silu could not allocate scratch for {P} pairs")
    if rc != 0:
        raise RuntimeError(f"moe_silu failed with code {rc}")
    return y, y_shared


def shared_fits(shared: MoeExpert | None, signature: tuple) -> bool:
    """Whether a shared expert fits one native call with routed experts of `signature`: the same kind
    and shape; its int8 groups may differ (it is stored with the spine, the experts apart)."""
    return shared is None or (shared.signature[0], *shared.signature[3:]) == (signature[0], *signature[3:])


def _check_block(rc: int, who: str, rows: int) -> None:
    """A layer-half native call's return code raised as the error it means (0: none)."""
    if rc == -1:
        raise MemoryError(f"{who} could not allocate scratch for {rows} rows")
    if rc == -2:
        raise ValueError(f"{who}: an int8 group size does not fit its weight")
    if rc != 0:
        raise RuntimeError(f"{who} failed with code {rc}")


@dataclass(frozen=True)
class MoeTable:
    """Every expert of a MoE layer (``moe_table``), checked once, with the pointer arrays
    ``moe_block_silu`` hands the native call: a resident layer's experts are the same every token."""
    experts: tuple  # the MoeExperts, by expert id (they keep the weights alive)
    w_ptrs: ctypes.Array  # [E * 3]: each expert's gate, up, down
    s_ptrs: ctypes.Array
    signature: tuple


def moe_table(experts: list[MoeExpert]) -> MoeTable:
    """The table of a layer's experts 0..E-1 (each made by ``moe_expert``), all of one signature."""
    if not experts or any(not isinstance(e, MoeExpert) or e.signature != experts[0].signature for e in experts):
        raise ValueError("a MoE table needs at least one expert, all made by moe_expert with one signature")
    return MoeTable(tuple(experts), _array(_p, [p for e in experts for p in e.pointers[:3]]),
                    _array(_p, [p for e in experts for p in e.pointers[3:]]), experts[0].signature)


def moe_block_silu(p: torch.Tensor, norm: torch.Tensor, eps: float, gate: torch.Tensor, bias: torch.Tensor, k: int,
                   renormalize: bool, scale: float, table: MoeTable, shared: MoeExpert | None,
                   threads: int | None = None, use_simd: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's feed-forward half over the residual rows p [T, H] in one native call: p + the routed
    experts and the shared expert of rms_norm(p) * norm, routed by the sigmoid router (gate [E, H] float32
    or bf16, bias float32 [E]) to its top k of the table's E experts. Returns (that sum [T, H], the chosen
    ids [T, k]); equal bit for bit to ``rms_norm``, ``route_sigmoid`` and ``moe_silu`` called in turn and
    their outputs added as the layer adds them (moe_block_silu_f32 in _cpu_kernels.c)."""
    lib = _lib_or_raise()
    if not (p.dim() == 2 and p.dtype == torch.float32 and p.is_contiguous() and p.is_cpu):
        raise ValueError(f"moe_block_silu needs contiguous CPU float32 rows [T, H], got {p.dtype} {tuple(p.shape)}")
    T, H = p.shape
    kind, group_in, group_out, I, width = table.signature
    E = len(table.experts)
    if width != H or not shared_fits(shared, table.signature):
        raise ValueError(f"moe_block_silu: experts reading rows of width {width} (shared: "
                         f"{None if shared is None else shared.signature}) for rows of width {H}")
    norm_bf16 = _norm_weight("moe_block_silu", "norm", norm, H)
    _check_router("moe_block_silu", gate, E, H, bias, k)
    out = torch.empty(T, H, dtype=torch.float32)
    ids = torch.empty(T, k, dtype=torch.int64)
    shared_w = shared_s = None
    shared_in, shared_out = group_in, group_out
    if shared is not None:
        shared_w, shared_s = _array(_p, list(shared.pointers[:3])), _array(_p, list(shared.pointers[3:]))
        shared_in, shared_out = shared.signature[1:3]
    args = (p.data_ptr(), T, H, norm.data_ptr(), norm_bf16, eps, gate.data_ptr(), int(gate.dtype == torch.bfloat16),
            bias.data_ptr(), E, k, int(renormalize), scale, I, table.w_ptrs, table.s_ptrs, shared_w, shared_s, kind,
            group_in, group_out, shared_in, shared_out, ids.data_ptr(), out.data_ptr(), _threads(threads),
            int(use_simd))
    rc = _made(lib.moe_block_silu_f32, args, "moe_block_silu", T, p, out, ids=ids,
               keep=(norm, gate, bias, table, shared))
    _check_block(rc, "moe_block_silu", T)
    return out, ids


def mlp_block_silu(p: torch.Tensor, norm: torch.Tensor, eps: float, mlp: MoeExpert, threads: int | None = None,
                   use_simd: bool = True) -> torch.Tensor:
    """A dense SiLU-GLU MLP's feed-forward half over the residual rows p [T, H] in one native call:
    p + down(silu(gate(x)) * up(x)) for x = rms_norm(p) * norm, the MLP's weights checked as one expert
    (``moe_expert``). Equal bit for bit to ``rms_norm``, ``dense_gemv_items`` (gate and up), ``silu_glu`` and
    ``dense_gemv`` (down) called in turn and added (mlp_block_silu_f32 in _cpu_kernels.c)."""
    lib = _lib_or_raise()
    if not (p.dim() == 2 and p.dtype == torch.float32 and p.is_contiguous() and p.is_cpu):
        raise ValueError(f"mlp_block_silu needs contiguous CPU float32 rows [T, H], got {p.dtype} {tuple(p.shape)}")
    if not isinstance(mlp, MoeExpert):
        raise ValueError("mlp_block_silu needs the MLP's weights checked by moe_expert")
    T, H = p.shape
    kind, group_in, group_out, I, width = mlp.signature
    if width != H:
        raise ValueError(f"mlp_block_silu: an MLP reading rows of width {width} for rows of width {H}")
    norm_bf16 = _norm_weight("mlp_block_silu", "norm", norm, H)
    out = torch.empty(T, H, dtype=torch.float32)
    args = (p.data_ptr(), T, H, norm.data_ptr(), norm_bf16, eps, I, _array(_p, list(mlp.pointers[:3])),
            _array(_p, list(mlp.pointers[3:])), kind, group_in, group_out, out.data_ptr(), _threads(threads),
            int(use_simd))
    rc = _made(lib.mlp_block_silu_f32, args, "mlp_block_silu", T, p, out, keep=(norm, mlp))
    _check_block(rc, "mlp_block_silu", T)
    return out


# The widest KDA head the native decode step takes (KDA_MAX_D in _cpu_kernels.c).
KDA_MAX_HEAD_DIM = 256


def _f32_or_bf16(t: torch.Tensor, shape: tuple, name: str) -> int:
    """1 when t holds bf16, 0 for float32; refuses anything the native KDA step cannot read."""
    if t.dtype not in (torch.float32, torch.bfloat16) or tuple(t.shape) != shape or not t.is_contiguous() \
            or not t.is_cpu:
        raise ValueError(f"KDA step: {name} must be a contiguous float32 or bf16 CPU tensor of shape "
                         f"{list(shape)}, got {t.dtype} {list(t.shape)}")
    return int(t.dtype == torch.bfloat16)


def kda_steps(xin: torch.Tensor, counts: list[int], convs: list[torch.Tensor],
              conv_w: tuple[torch.Tensor, torch.Tensor, torch.Tensor], r: torch.Tensor, dt_bias: torch.Tensor,
              a_log: torch.Tensor, b: torch.Tensor, lower_bound: float | None, gate: torch.Tensor,
              o_norm: torch.Tensor, eps: float, states: list[torch.Tensor], threads: int | None = None) -> torch.Tensor:
    """The KDA recurrence of B sequences of one layer over their new rows, in one native call (see
    kda_step_row in _cpu_kernels.c for the formulas; kda.py's torch code is the reference). The T
    rows are the sequences' in order, counts[i] of them for sequence i (one for a decoding one).
    xin float32 [T, 3, D]: the pre-conv q, k, v inputs; convs[i] float32 [3, K-1, D] and states[i]
    float32 [nh, d, d]: sequence i's state, both updated in place; conv_w: the three [D, K] conv
    weights; r float32 [T, D]: the decay inputs before dt_bias; b float32 [T, nh]: beta logits; gate
    float32 [T, D]: the output gate's logits; dt_bias [D], a_log [nh], o_norm [d] in float32 or bf16.
    Returns the gated, normalized outputs float32 [T, nh, d]; a sequence's rows do not depend on the
    other sequences in the call."""
    lib = _lib_or_raise()
    step = _kda_states(counts, convs, states)  # what keeps a wrong pointer out of C: the states and ...
    small = _kda_small(conv_w, dt_bias, a_log, o_norm, step.nh, step.d, step.K)  # ... the small weights
    T, nh, d, D = step.rows, step.nh, step.d, step.nh * step.d
    for t, shape, name in ((xin, (T, 3, D), "xin"), (r, (T, D), "r"), (b, (T, nh), "b"), (gate, (T, D), "gate")):
        if _f32_or_bf16(t, shape, name):
            raise ValueError(f"KDA step: {name} must be float32, got bf16")
    o = torch.empty(T, nh, d, dtype=torch.float32)
    rc = lib.kda_steps_f32(
        len(states), step.offsets, xin.data_ptr(), step.convs, small.conv_w, small.conv_bf16, r.data_ptr(),
        dt_bias.data_ptr(), small.dt_bf16, a_log.data_ptr(), small.a_bf16, b.data_ptr(), int(lower_bound is not None),
        0.0 if lower_bound is None else float(lower_bound), gate.data_ptr(), o_norm.data_ptr(), small.norm_bf16,
        float(eps), step.states, o.data_ptr(), nh, d, step.K, _threads(threads))
    if rc != 0:
        raise RuntimeError(f"KDA step failed with code {rc}")
    return o


@dataclass(frozen=True)
class _KdaStates:
    """The sequences of a native KDA call checked (their states are written in place, so each is checked
    whole): the arrays the call reads them by."""
    rows: int
    nh: int
    d: int
    K: int
    offsets: ctypes.Array
    convs: ctypes.Array
    states: ctypes.Array


def _kda_states(counts: list[int], convs: list[torch.Tensor], states: list[torch.Tensor],
                shape: tuple[int, int, int] | None = None) -> _KdaStates:
    """The checks of B sequences' conv tails and S, and their arrays; ``shape`` (heads, head dim, conv
    taps) where the weights set it (``kda_weights`` checked it), else the first state's."""
    B = len(states)
    if B == 0 or len(convs) != B or len(counts) != B or any(n < 1 for n in counts):
        raise ValueError(f"KDA step: needs a conv tail and at least one row per state, got {len(convs)} "
                         f"tails and rows {counts} for {B} states")
    if shape is None:
        S0 = states[0]
        if S0.dim() != 3 or S0.shape[1] != S0.shape[2]:
            raise ValueError(f"KDA step: S must be [heads, d, d], got {list(S0.shape)}")
        if convs[0].dim() != 3 or convs[0].shape[0] != 3 or convs[0].shape[2] != S0.shape[0] * S0.shape[1]:
            raise ValueError(f"KDA step: conv must be [3, K-1, {S0.shape[0] * S0.shape[1]}], got {list(convs[0].shape)}")
        shape = S0.shape[0], S0.shape[1], convs[0].shape[1] + 1
        _check_head_dim(shape[1])
    nh, d, K = shape
    for S, conv in zip(states, convs):
        _f32_state(S, (nh, d, d), "S")
        _f32_state(conv, (3, K - 1, nh * d), "conv")
    return _KdaStates(sum(counts), nh, d, K, (_i64 * (B + 1))(*accumulate(counts, initial=0)),
                      (_p * B)(*(c.data_ptr() for c in convs)), (_p * B)(*(S.data_ptr() for S in states)))


@dataclass(frozen=True)
class _KdaSmall:
    """A KDA layer's conv taps, dt_bias, A_log and o_norm checked for the native step: the conv weights'
    array and which of them hold bf16."""
    conv_w: ctypes.Array
    conv_bf16: int
    dt_bf16: int
    a_bf16: int
    norm_bf16: int


def _kda_small(conv_w: tuple, dt_bias: torch.Tensor, a_log: torch.Tensor, o_norm: torch.Tensor,
               nh: int, d: int, K: int) -> _KdaSmall:
    D = nh * d
    kinds = {_f32_or_bf16(w, (D, K), "conv weight") for w in conv_w}
    if len(conv_w) != 3 or len(kinds) != 1:
        raise ValueError("KDA step: needs three conv weights of one dtype")
    return _KdaSmall((_p * 3)(*(w.data_ptr() for w in conv_w)), kinds.pop(), _f32_or_bf16(dt_bias, (D,), "dt_bias"),
                     _f32_or_bf16(a_log, (nh,), "A_log"), _f32_or_bf16(o_norm, (d,), "o_norm"))


def _check_head_dim(d: int) -> None:
    if not 0 < d <= KDA_MAX_HEAD_DIM:
        raise ValueError(f"KDA step: head dim {d} is outside 1..{KDA_MAX_HEAD_DIM}")


@dataclass(frozen=True)
class KdaWeights:
    """A KDA layer's weights checked for ``kda_block`` (made by ``kda_weights``): their sizes, pointers and
    kinds as the native call reads them. It holds no weight: whoever calls with it holds the weights it
    was made from (a resident layer's are the same every token, so model/kda.py keeps it while they live)."""
    H: int
    nh: int
    d: int
    K: int
    norm: int  # pointers
    norm_bf16: int
    groups: tuple  # (weights, scales, kind, int8 group) of the first projections, the second halves, o_proj
    small: _KdaSmall
    dt_bias: int
    a_log: int
    o_norm: int


def kda_weights(norm: torch.Tensor, first: list[tuple], second: list[tuple], o_proj: tuple, conv_w: tuple,
                dt_bias: torch.Tensor, a_log: torch.Tensor, o_norm: torch.Tensor) -> KdaWeights:
    """Checks a KDA layer's weights for ``kda_block``: the input norm [H]; first: the (weight, scale) of q,
    k, v, beta and the decay's and the gate's first low-rank halves (one kind, ``native_dense``'s pairs);
    second: the two second halves; o_proj: the output projection; conv_w: the three [D, K] conv weights;
    dt_bias [D], A_log [heads] and o_norm [head dim] in float32 or bf16."""
    if a_log.dim() != 1 or o_norm.dim() != 1 or not conv_w or conv_w[0].dim() != 2 or o_proj[0].dim() != 2:
        raise ValueError("kda_weights: A_log and o_norm must be vectors, the conv weights and o_proj matrices")
    H, nh, d, K = o_proj[0].shape[0], a_log.shape[0], o_norm.shape[0], conv_w[0].shape[1]
    D = nh * d
    _check_head_dim(d)
    norm_bf16 = _norm_weight("kda_block", "norm", norm, H)
    small = _kda_small(conv_w, dt_bias, a_log, o_norm, nh, d, K)
    groups = []
    for ws, outs, n, name in ((first, (D, D, D, nh, d, d), H, "first projections"), (second, (D, D), d, "second halves"),
                              ([o_proj], (H,), D, "output projection")):
        if len(ws) != len(outs) or any(tuple(w.shape) != (out, n) for (w, _), out in zip(ws, outs)):
            raise ValueError(f"kda_block: the {name} must be {len(outs)} weights [out, {n}] with outputs {list(outs)}, "
                             f"got {[tuple(w.shape) for w, _ in ws]}")
        checked = {_dense_weights([w], [s]) for w, s in ws}
        if len(checked) != 1:
            raise ValueError(f"kda_block: the {name} must be of one kind (and one int8 group size)")
        groups.append((_array(_p, [w.data_ptr() for w, _ in ws]), _array(_p, [0 if s is None else s.data_ptr() for _, s in ws]),
                       *checked.pop()))
    return KdaWeights(H, nh, d, K, norm.data_ptr(), norm_bf16, tuple(groups), small, dt_bias.data_ptr(),
                      a_log.data_ptr(), o_norm.data_ptr())


def kda_block(h: torch.Tensor, eps: float, weights: KdaWeights, counts: list[int], convs: list[torch.Tensor],
              states: list[torch.Tensor], lower_bound: float | None, threads: int | None = None,
              use_simd: bool = True) -> torch.Tensor:
    """A KDA layer's attention half over the residual rows h [T, H] of B sequences in one native call:
    h + o_proj(the recurrence of (rms_norm(h) * norm)'s projections), with the layer's weights as
    ``kda_weights`` checked them (the caller holds them) and the sequences as ``kda_steps`` takes them
    (states updated in place). Equal bit for bit to ``rms_norm``, ``dense_gemv_outs``,
    ``dense_gemv_items``, ``kda_steps`` and ``dense_gemv`` called in turn and added as the layer adds
    them (kda_block_f32 in _cpu_kernels.c)."""
    lib = _lib_or_raise()
    w = weights
    if not (h.dim() == 2 and h.dtype == torch.float32 and h.is_contiguous() and h.is_cpu and h.shape[1] == w.H):
        raise ValueError(f"kda_block needs contiguous CPU float32 rows [T, {w.H}], got {h.dtype} {tuple(h.shape)}")
    T = h.shape[0]
    seqs = _kda_states(counts, convs, states, (w.nh, w.d, w.K))
    if seqs.rows != T:
        raise ValueError(f"kda_block: the sequences' rows {counts} are not the {T} rows of h")
    out = torch.empty(T, w.H, dtype=torch.float32)
    (w1, s1, k1, g1), (w2, s2, k2, g2), (wo, so, ko, go) = w.groups
    small = w.small
    args = (h.data_ptr(), T, w.H, w.norm, w.norm_bf16, float(eps), w1, s1, k1, g1, w2, s2, k2, g2, wo[0], so[0], ko,
            go, len(states), seqs.offsets, seqs.convs, small.conv_w, small.conv_bf16, w.dt_bias, small.dt_bf16, w.a_log,
            small.a_bf16, int(lower_bound is not None), 0.0 if lower_bound is None else float(lower_bound), w.o_norm,
            small.norm_bf16, seqs.states, w.nh, w.d, w.K, out.data_ptr(), _threads(threads), int(use_simd))
    rc = _made(lib.kda_block_f32, args, "kda_block", T, h, out, keep=(weights, seqs))
    _check_block(rc, "kda_block", T)
    return out


def _f32_state(t: torch.Tensor, shape: tuple, name: str) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"KDA step: {name} must be a contiguous float32 CPU tensor of shape {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)}")


def mla_decode_attend(q_lat: torch.Tensor, q_rot: torch.Tensor, ckvs: list[torch.Tensor], krots: list[torch.Tensor],
                      scale: float, threads: int | None = None) -> torch.Tensor:
    """Latent attention of one new query per sequence over its own cache, B sequences of one MLA layer
    in one native call (mla_decode_attend_f32 in _cpu_kernels.c; mla.py's _attend_latent is the
    reference). q_lat float32 [B, nh, r]: each query with W_k absorbed; q_rot float32 [B, nh, rope];
    ckvs[b] float32 [L_b, r] and krots[b] float32 [L_b, rope]: sequence b's cache, its new row included.
    Returns the attended latents float32 [B, nh, r]; a sequence's row does not depend on the others."""
    lib = _lib_or_raise()
    B = len(ckvs)
    if B == 0 or len(krots) != B:
        raise ValueError(f"MLA attention: needs one rope-key cache per latent cache, got {len(krots)} and {B}")
    for t, name in ((q_lat, "q_lat"), (q_rot, "q_rot")):
        if t.dim() != 3 or t.shape[0] != B or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"MLA attention: {name} must be a contiguous float32 CPU tensor [{B}, heads, width], "
                             f"got {t.dtype} {list(t.shape)}")
    nh, r, rope = q_lat.shape[1], q_lat.shape[2], q_rot.shape[2]
    if q_rot.shape[1] != nh:
        raise ValueError(f"MLA attention: q_rot has {q_rot.shape[1]} heads, q_lat {nh}")
    for ckv, krot in zip(ckvs, krots):
        if (ckv.dim() != 2 or krot.dim() != 2 or ckv.shape[1] != r or krot.shape[1] != rope
                or ckv.shape[0] != krot.shape[0]):
            raise ValueError(f"MLA attention: a cache must be [L, {r}] and [L, {rope}], got {list(ckv.shape)} and "
                             f"{list(krot.shape)}")
        for t in (ckv, krot):
            if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"MLA attention: a cache must be a contiguous float32 CPU tensor, got {t.dtype}")
    out = torch.empty(B, nh, r, dtype=torch.float32)
    rc = lib.mla_decode_attend_f32(B, q_lat.data_ptr(), q_rot.data_ptr(), (_p * B)(*(t.data_ptr() for t in ckvs)),
                                   (_p * B)(*(t.data_ptr() for t in krots)), (_i64 * B)(*(t.shape[0] for t in ckvs)),
                                   float(scale), out.data_ptr(), nh, r, rope, _threads(threads))
    if rc != 0:
        raise RuntimeError(f"MLA attention failed with code {rc}")
    return out


@dataclass(frozen=True)
class MlaWeights:
    """An MLA layer's weights checked for ``mla_block`` (made by ``mla_weights``), as the native call reads
    them: pointers, and kv_b's per-head views with their pointer arrays (``DenseHeads``, which keep that
    weight's storage alive while the entry lives; the caller holds the other weights)."""
    H: int
    nh: int
    nope: int
    rope: int
    r: int
    dv: int
    norm: int
    norm_bf16: int
    latent: int
    latent_bf16: int
    first: tuple  # (weights, scales, kind, int8 group) of q_proj and kv_a_proj
    heads_k: DenseHeads
    heads_v: DenseHeads
    o_proj: tuple  # (weight, scale, kind, int8 group)


def mla_weights(norm: torch.Tensor, q_proj: tuple, kv_a: tuple, latent_norm: torch.Tensor, heads_k: DenseHeads,
                heads_v: DenseHeads, o_proj: tuple, nope: int, rope: int) -> MlaWeights:
    """Checks an MLA layer's weights for ``mla_block``: the input norm [H]; q_proj [nh * (nope + rope), H] and
    kv_a_proj [r + rope, H] (``native_dense``'s pairs, one kind); the latent norm [r]; kv_b's per-head W_k
    [nope, r] and W_v [dv, r] (``dense_heads``); o_proj [H, nh * dv]."""
    (wq, sq), (wkv, skv), (wo, so) = q_proj, kv_a, o_proj
    if wq.dim() != 2 or wkv.dim() != 2 or wo.dim() != 2 or latent_norm.dim() != 1:
        raise ValueError("mla_weights: the projections must be matrices and the latent norm a vector")
    H, r, nh = wq.shape[1], latent_norm.shape[0], len(heads_k.ws)
    dv = heads_v.rows
    if nope < 1 or rope < 1 or r < 1 or nh < 1 or dv < 1 or len(heads_v.ws) != nh:
        raise ValueError(f"mla_weights: needs positive sizes and as many W_v heads as W_k heads, got nope {nope}, "
                         f"rope {rope}, r {r}, {nh} and {len(heads_v.ws)} heads")
    want = {"q_proj": ((nh * (nope + rope), H), wq), "kv_a_proj": ((r + rope, H), wkv), "o_proj": ((H, nh * dv), wo)}
    for name, (shape, w) in want.items():
        if tuple(w.shape) != shape:
            raise ValueError(f"mla_block: {name} must be {list(shape)}, got {list(w.shape)}")
    if (heads_k.rows, heads_k.cols, heads_v.cols) != (nope, r, r):
        raise ValueError(f"mla_block: kv_b's heads must be W_k [{nope}, {r}] and W_v [{dv}, {r}], got "
                         f"[{heads_k.rows}, {heads_k.cols}] and [{heads_v.rows}, {heads_v.cols}]")
    first = {_dense_weights([w], [s]) for w, s in (q_proj, kv_a)}
    if len(first) != 1:
        raise ValueError("mla_block: q_proj and kv_a_proj must be of one kind (and one int8 group size)")
    return MlaWeights(H, nh, nope, rope, r, dv, norm.data_ptr(), _norm_weight("mla_block", "norm", norm, H),
                      latent_norm.data_ptr(), _norm_weight("mla_block", "latent norm", latent_norm, r),
                      (_array(_p, [wq.data_ptr(), wkv.data_ptr()]),
                       _array(_p, [0 if s is None else s.data_ptr() for s in (sq, skv)]), *first.pop()),
                      heads_k, heads_v, (wo.data_ptr(), 0 if so is None else so.data_ptr(), *_dense_weights([wo], [so])))


def mla_block(h: torch.Tensor, eps: float, latent_eps: float, weights: MlaWeights, ckvs: list[torch.Tensor],
              krots: list[torch.Tensor], lengths: list[int], scale: float, threads: int | None = None,
              use_simd: bool = True) -> torch.Tensor:
    """An MLA layer's attention half over one decoding row per sequence, h [B, H], in one native call:
    h + o_proj(W_v(attention of W_k-absorbed queries over each cache)) (mla_block_f32 in _cpu_kernels.c).
    ckvs[b] float32 [capacity, r] and krots[b] [capacity, rope]: sequence b's cache, with room for
    lengths[b] rows, the new one (row lengths[b] - 1) written by the call. Equal bit for bit to mla.py's
    decode path of ``rms_norm``, ``dense_gemv``, ``dense_heads_gemv``, ``mla_decode_attend`` and
    ``dense_gemv`` called in turn."""
    lib = _lib_or_raise()
    w = weights
    if not (h.dim() == 2 and h.dtype == torch.float32 and h.is_contiguous() and h.is_cpu and h.shape[1] == w.H):
        raise ValueError(f"mla_block needs contiguous CPU float32 rows [B, {w.H}], got {h.dtype} {tuple(h.shape)}")
    B = h.shape[0]
    if not (len(ckvs) == len(krots) == len(lengths) == B):
        raise ValueError(f"mla_block: needs one cache and length per row, got {len(ckvs)}, {len(krots)} and "
                         f"{len(lengths)} for {B} rows")
    for ckv, krot, n in zip(ckvs, krots, lengths):
        for t, width, name in ((ckv, w.r, "latent"), (krot, w.rope, "rope-key")):
            if not (t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == width and t.is_contiguous() and t.is_cpu):
                raise ValueError(f"mla_block: a {name} cache must be a contiguous CPU float32 [rows, {width}], got "
                                 f"{t.dtype} {list(t.shape)}")
            if not 1 <= n <= t.shape[0]:
                raise ValueError(f"mla_block: a {name} cache of {t.shape[0]} rows has no room for {n}")
    out = torch.empty(B, w.H, dtype=torch.float32)
    (w1, s1, k1, g1), (wo, so, ko, go), hk, hv = w.first, w.o_proj, w.heads_k, w.heads_v
    lens = _array(_i64, lengths)
    args = (h.data_ptr(), B, w.H, w.norm, w.norm_bf16, float(eps), w1, s1, k1, g1, w.latent, w.latent_bf16,
            float(latent_eps), hk.w_ptrs, hk.s_ptrs, hk.kind, hk.group, hv.w_ptrs, hv.s_ptrs, hv.kind, hv.group, wo, so,
            ko, go, _array(_p, [t.data_ptr() for t in ckvs]), _array(_p, [t.data_ptr() for t in krots]), lens,
            float(scale), w.nh, w.nope, w.rope, w.r, w.dv, out.data_ptr(), _threads(threads), int(use_simd))
    rc = _made(lib.mla_block_f32, args, "mla_block", B, h, out, lengths=lens, keep=(weights,))
    _check_block(rc, "mla_block", B)
    return out


def read_memory(tensors: list[torch.Tensor], threads: int | None = None) -> int:
    """Reads every byte of the tensors once, on ``threads`` threads that claim 1 MiB pieces as they
    come free (how fast the products could read these weights at best), and returns the sum of each
    tensor's bytes as 8-byte words in the machine's order, its last ``nbytes % 8`` bytes added one by
    one, modulo 2**64 (the sum keeps the reads from being skipped, and lets a test check them)."""
    lib = _lib_or_raise()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"read_memory needs contiguous CPU tensors, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else f'{t.device} {t.dtype}'}")
    count = len(tensors)
    ptrs = (_p * max(count, 1))(*(t.data_ptr() for t in tensors))
    lens = (_i64 * max(count, 1))(*(t.numel() * t.element_size() for t in tensors))
    total = ctypes.c_uint64(0)
    if lib.read_memory(ptrs, lens, count, _threads(threads), ctypes.byref(total)) != 0:
        raise MemoryError(f"read_memory could not allocate its index of {count} buffers")
    return total.value


def int8_interleave_(codes: torch.Tensor) -> torch.Tensor:
    """int8.int8_interleave in place (at memory speed, no second copy of a weight), returning codes."""
    lib = _lib_or_raise()
    if not (codes.dtype == torch.int8 and codes.dim() == 2 and codes.is_contiguous() and codes.is_cpu
            and codes.shape[1] % INT8_GROUP_MULTIPLE == 0):
        raise ValueError(f"int8_interleave_ needs contiguous CPU int8 codes [out, whole groups of 32], got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    if lib.int8_interleave_inplace(codes.data_ptr(), codes.shape[0], codes.shape[1]) != 0:
        raise RuntimeError("int8_interleave_ failed")
    return codes
