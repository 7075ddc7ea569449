"""The native CPU kernels (MXFP4, int8, int4, int6, bf16) against the torch references, and the choice between
them in qlinear and ops.linear."""
from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest
import torch

from deltafin.kernels import cpu_native, intq, linear, quantize
from deltafin.kernels.int8 import (int8_dequantize, int8_interleave, int8_interleaved, int8_quantize,
                                  int8_round_inputs)
from deltafin.kernels.mxfp4 import mxfp4_dequantize
from deltafin.model import ops

native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")
# Both code paths of the library: AVX-512 (where the CPU has it) and portable C.
SIMD = pytest.mark.parametrize("use_simd", [True, False], ids=["simd", "portable"])


# ---------------------------------------------------------------- MXFP4

def _random_weight(out: int, n: int, seed: int, scales: tuple[int, int] = (118, 136)
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out, n // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(scales[0], scales[1], (out, n // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def _extreme_weight() -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value (so every pair of codes) in each row; one row per extreme scale, plus a
    row whose only NaN is one group's scale."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(6, 1)      # [6, 256]: in = 512
    scale = torch.tensor([0, 1, 127, 254, 255, 127], dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    scale[5, 7] = 255
    return packed, scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN compares equal to itself."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_gemv_close(y: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """y equals x @ W^T up to float32 summation order: the bound scales with sum |x||w|, plus the
    absolute float32 resolution for products that fall among subnormals (scales near 0)."""
    w = mxfp4_dequantize(packed, scale)
    ref = x @ w.T
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    finite = torch.isfinite(ref)
    bound = 1e-5 * (x.abs() @ w.abs().T) + x.shape[1] * 2.0 ** -149
    assert ((y - ref).abs()[finite] <= bound[finite]).all()


def test_a_built_library_loads():
    # A library file that exists but cannot be loaded (stale ABI, missing symbols) is a broken build.
    if importlib.util.find_spec(cpu_native.LIBRARY) is not None:
        assert cpu_native.available()


@native
@SIMD
@pytest.mark.parametrize("out,n", [(1, 32), (3, 64), (13, 96), (67, 1024)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_mxfp4_gemv_matches_reference(out, n, m, use_simd):
    packed, scale = _random_weight(out, n, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    y = cpu_native.mxfp4_gemv(x, packed, scale, use_simd=use_simd)
    assert y.shape == (m, out) and y.dtype == torch.float32
    _assert_gemv_close(y, x, packed, scale)


@native
@SIMD
def test_mxfp4_gemv_every_code_and_scale_extreme(use_simd):
    packed, scale = _extreme_weight()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    y = cpu_native.mxfp4_gemv(x, packed, scale, use_simd=use_simd)
    _assert_gemv_close(y, x, packed, scale)
    # Scale 255 (NaN) poisons its rows; scale 254 decodes codes >= 2 to +-inf, whose sum is NaN.
    assert torch.isnan(y[:, 3:6]).all() and torch.isfinite(y[:, :3]).all()
    assert (y[:, 0] != 0).all()       # 2^-127 scaled products survive as subnormals


@native
@SIMD
def test_mxfp4_gemv_items_equal_each_product_alone(use_simd):
    # A MoE layer's experts for a batch: items of 1..5 rows, gathered from and written to any rows.
    weights = [_random_weight(24, 96, seed=s) for s in range(6)]
    x = torch.randn(12, 96, generator=torch.Generator().manual_seed(9))
    x_rows, rows, y_rows = [0, 3, 3, 7, 11, 2], [3, 4, 1, 5, 1, 2], [13, 0, 5, 6, 4, 11]
    for threads in (1, 2, 5):
        y = cpu_native.mxfp4_gemv_items(x, weights, x_rows, y_rows, rows, 16, threads=threads, use_simd=use_simd)
        assert y.shape == (16, 24)
        written = torch.zeros(16, dtype=torch.bool)
        for (p, s), a, b, r in zip(weights, x_rows, y_rows, rows):
            assert torch.equal(y[b:b + r], cpu_native.mxfp4_gemv(x[a:a + r], p, s, threads=1, use_simd=use_simd))
            written[b:b + r] = True
        assert (y[~written] == 0).all()


@native
def test_mxfp4_gemv_items_refuses_bad_items():
    w = _random_weight(8, 64, seed=1)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="one x row"):
        cpu_native.mxfp4_gemv_items(x, [w, w], [0], [0, 1], [1, 1], 2)
    with pytest.raises(ValueError, match="one shape"):
        cpu_native.mxfp4_gemv_items(x, [w, _random_weight(16, 64, seed=2)], [0, 1], [0, 1], [1, 1], 2)
    with pytest.raises(ValueError, match="outside"):
        cpu_native.mxfp4_gemv_items(x, [w], [3], [0], [2], 2)  # x has 4 rows
    with pytest.raises(ValueError, match="outside"):
        cpu_native.mxfp4_gemv_items(x, [w], [0], [1], [2], 2)  # y has 2 rows
    with pytest.raises(ValueError, match="outside"):
        cpu_native.mxfp4_gemv_items(x, [w], [0], [0], [-1], 2)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        cpu_native.mxfp4_gemv_items(torch.randn(4, 32), [w], [0], [0], [1], 2)


@native
def test_mxfp4_gemv_thread_split_gives_identical_results():
    packed, scale = _random_weight(523, 2048, seed=5)  # enough work for 4 threads; 523 = 4k + 3
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(5))
    ys = [cpu_native.mxfp4_gemv(x, packed, scale, threads=t) for t in (1, 2, 3, 4)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    _assert_gemv_close(ys[0], x, packed, scale)


@native
def test_mxfp4_gemv_accepts_strided_inputs_and_float8_scales():
    packed, scale = _random_weight(24, 256, seed=6)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    y = cpu_native.mxfp4_gemv(x, packed, scale)
    wide_p = torch.cat([packed, packed], dim=1)[:, :128]            # non-contiguous views
    wide_s = torch.cat([scale, scale], dim=1)[:, :8]
    x_t = x.T.contiguous().T
    assert not (wide_p.is_contiguous() or wide_s.is_contiguous() or x_t.is_contiguous())
    assert torch.equal(cpu_native.mxfp4_gemv(x_t, wide_p, wide_s), y)
    assert torch.equal(cpu_native.mxfp4_gemv(x, packed, scale.view(torch.float8_e8m0fnu)), y)


@native
def test_mxfp4_gemv_rejects_mismatched_shapes():
    packed, scale = _random_weight(4, 64, seed=7)
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.mxfp4_gemv(torch.zeros(1, 32), packed, scale)
    with pytest.raises(ValueError, match="weight_scale shape"):
        cpu_native.mxfp4_gemv(torch.zeros(1, 64), packed, scale[:, :1])


@native
@SIMD
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequant_is_bit_exact(dtype, use_simd):
    for packed, scale in [_extreme_weight(), _random_weight(7, 96, seed=8, scales=(0, 256)),
                          _random_weight(1, 32, seed=9)]:
        w = cpu_native.mxfp4_dequant(packed, scale, dtype, use_simd=use_simd)
        ref = mxfp4_dequantize(packed, scale, dtype)
        assert w.dtype == dtype and torch.equal(torch.isnan(w), torch.isnan(ref))
        # torch's own float32 -> bf16 conversion writes NaN as 0x7FC0 or 0xFFFF depending on
        # its code path, so NaN payloads are not compared; every other value is, bit for bit.
        keep = ~torch.isnan(ref)
        assert torch.equal(_bits(w)[keep], _bits(ref)[keep])
        if dtype == torch.float32:
            assert torch.equal(_bits(w), _bits(ref))


@native
@pytest.mark.parametrize("rows", [1, 4, 64, 65])
def test_qlinear_mxfp4_dispatches_to_native_kernel(monkeypatch, rows):
    w = torch.randn(40, 160, generator=torch.Generator().manual_seed(rows))
    q = quantize(w, "mxfp4")
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = {"gemv": 0, "dequant": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(cpu_native, "mxfp4_gemv", counted("gemv", cpu_native.mxfp4_gemv))
    monkeypatch.setattr(cpu_native, "mxfp4_dequant", counted("dequant", cpu_native.mxfp4_dequant))
    y = linear.qlinear(x.view(1, rows, 160), q)
    assert y.shape == (1, rows, 40) and y.dtype == torch.bfloat16
    # Decode-sized batches use the gemv; larger ones dequantize natively and use a matmul.
    gemv = rows <= cpu_native.GEMV_MAX_ROWS
    assert calls == {"gemv": int(gemv), "dequant": int(not gemv)}
    ref = (x.float() @ mxfp4_dequantize(q.tensors["weight_packed"], q.tensors["weight_scale"]).T)
    assert torch.allclose(y[0].float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_qlinear_mxfp4_falls_back_to_torch_without_library(monkeypatch):
    q = quantize(torch.randn(24, 64, generator=torch.Generator().manual_seed(2)), "mxfp4")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    expect = linear.qlinear(x, q)                   # native when built, else already torch
    monkeypatch.setattr(cpu_native, "_library", lambda: None)
    assert not cpu_native.available()
    with pytest.raises(RuntimeError, match="not built"):
        cpu_native.mxfp4_gemv(x, q.tensors["weight_packed"], q.tensors["weight_scale"])
    y = linear.qlinear(x, q)
    packed, scale = q.tensors["weight_packed"], q.tensors["weight_scale"]
    assert torch.equal(y, x @ mxfp4_dequantize(packed, scale).T)
    _assert_gemv_close(expect, x, packed, scale)
    assert torch.equal(_bits(linear.dequantize(q)), _bits(mxfp4_dequantize(packed, scale)))


# ---------------------------------------------------------------- int8

def _random_int8(out: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, n), generator=g, dtype=torch.int8)
    # Row scales spanning several orders of magnitude, as quantized checkpoints have.
    scale = torch.rand(out, 1, generator=g) * torch.logspace(-4, 1, out).unsqueeze(1)
    return codes, scale


def _assert_int8_close(y: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """y is x, rounded as int8_round_inputs rounds it, times W^T up to float32 summation order; so within
    half a step of each row's inputs (2^-16 of the row's largest) of the float32 product x @ W^T."""
    w = int8_dequantize(codes, scale).double()
    xr = int8_round_inputs(x.float())
    ref = xr @ w.T
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= 1e-5 * (xr.abs() @ w.abs().T) + 1e-37).all()
    exact = x.double() @ w.T
    half_step = x.double().abs().amax(1, keepdim=True) / 65534
    assert ((y.double() - exact).abs() <= half_step * w.abs().sum(1) + 1e-5 * (x.double().abs() @ w.abs().T)
            + 1e-37).all()


@native
@SIMD
@pytest.mark.parametrize("out,n", [(1, 16), (2, 7), (3, 17), (13, 100), (67, 1024)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_int8_gemv_matches_reference(out, n, m, use_simd):
    # n = 7 has only a tail, 17 and 100 a body plus a tail past the 16-wide steps.
    codes, scale = _random_int8(out, n, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    y = cpu_native.int8_gemv(x, codes, scale, use_simd=use_simd)
    _assert_int8_close(y, x, codes, scale)


@native
@SIMD
def test_int8_gemv_zero_rows_zero_scales_and_extreme_codes(use_simd):
    n = 200
    codes = torch.zeros(6, n, dtype=torch.int8)
    codes[1] = 127
    codes[2] = -127
    codes[3] = torch.tensor([127, -127], dtype=torch.int8).repeat(n // 2)
    codes[4] = 127                                    # nonzero codes, but scale 0
    codes[5] = torch.randint(-127, 128, (n,), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
    scale = torch.tensor([[0.5], [0.25], [3.0], [1.0], [0.0], [1e-3]])
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(4)) * 1e3
    y = cpu_native.int8_gemv(x, codes, scale, use_simd=use_simd)
    _assert_int8_close(y, x, codes, scale)
    assert (y[:, 0] == 0).all() and (y[:, 4] == 0).all()
    # Sums of +-127 * the rounded x are exact integers before the scales: checked in float64 directly.
    x64 = int8_round_inputs(x).sum(1)
    torch.testing.assert_close(y[:, 1].double(), 0.25 * 127 * x64, rtol=1e-6, atol=0)
    torch.testing.assert_close(y[:, 2].double(), -3.0 * 127 * x64, rtol=1e-6, atol=0)


@native
@pytest.mark.parametrize("path", ["simd", "avx2", "portable"])
@pytest.mark.parametrize("n,group", [(16384 + 17, 0), (16384, 16384), (12288, 4096)])
def test_int8_gemv_sums_of_the_largest_codes_and_inputs_do_not_overflow(path, n, group):
    """Every product at its largest (127 x 32767) over a long row or group: the int32 sums are cut into
    spans short enough, so the result is the exact sum times the scales."""
    if path == "avx2" and cpu_native.simd() == "portable":
        pytest.skip("no AVX2 here")
    codes = torch.full((3, n), 127, dtype=torch.int8)
    codes[1] = -127
    scale = torch.full((3, n // group), 0.5, dtype=torch.float16) if group else torch.full((3, 1), 0.5)
    x = torch.full((2, n), 3.0)
    x[1, ::2] = -3.0
    with cpu_native.limit_simd("avx2" if path == "avx2" else "avx512"):
        y = cpu_native.int8_gemv(x, codes, scale, use_simd=path != "portable")
    sums = torch.tensor([n * 3.0 * 127 * 0.5, 0.0]).double() if n % 2 == 0 else None
    assert torch.equal(y[:, 2], y[:, 0]) and torch.equal(y[:, 1], -y[:, 0])
    if sums is not None:
        torch.testing.assert_close(y[:, 0].double(), sums, rtol=1e-6, atol=1e-3)
    else:
        torch.testing.assert_close(y[0, 0].double(), torch.tensor(n * 3.0 * 127 * 0.5).double(), rtol=1e-6, atol=0)


@native
@SIMD
@pytest.mark.parametrize("group", [0, 32])
def test_int8_gemv_rounds_each_row_of_x_alone_and_gives_nan_for_a_row_with_inf_or_nan(group, use_simd):
    """A row's result does not depend on the other rows of the call (each is rounded on its own: a row
    10^6 times larger beside it changes nothing), and a row holding inf or NaN gives NaN, the others not."""
    n = 96
    codes, scale = _random_grouped_int8(7, n, 32, seed=8) if group else _random_int8(7, n, seed=8)
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(8))
    x[1] *= 1e6
    y = cpu_native.int8_gemv(x, codes, scale, use_simd=use_simd)
    _assert_int8_close(y, x, codes, scale)
    for i in range(4):
        assert torch.equal(cpu_native.int8_gemv(x[i:i + 1], codes, scale, use_simd=use_simd), y[i:i + 1])
    bad = x.clone()
    bad[1, 5], bad[2, 90] = float("inf"), float("nan")
    yb = cpu_native.int8_gemv(bad, codes, scale, use_simd=use_simd)
    assert yb[1:3].isnan().all()
    assert torch.equal(yb[[0, 3]], y[[0, 3]])


@native
@SIMD
def test_int8_gemv_thread_split_gives_identical_results(use_simd):
    codes, scale = _random_int8(523, 2048, seed=5)   # enough work for 4 threads; 523 = 4k + 3
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(5))
    ys = [cpu_native.int8_gemv(x, codes, scale, threads=t, use_simd=use_simd) for t in (1, 2, 3, 4)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    _assert_int8_close(ys[0], x, codes, scale)


@native
def test_int8_gemv_accepts_strided_and_bf16_inputs():
    codes, scale = _random_int8(24, 80, seed=6)
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(6))
    y = cpu_native.int8_gemv(x, codes, scale)
    wide_c = torch.cat([codes, codes], dim=1)[:, :80]             # non-contiguous views
    wide_s = torch.cat([scale, scale], dim=1)[:, :1]
    x_t = x.T.contiguous().T
    assert not (wide_c.is_contiguous() or wide_s.is_contiguous() or x_t.is_contiguous())
    assert torch.equal(cpu_native.int8_gemv(x_t, wide_c, wide_s), y)
    # bf16 rows are widened to float32 exactly, then multiplied as float32 rows.
    xb = x.to(torch.bfloat16)
    assert torch.equal(cpu_native.int8_gemv(xb, codes, scale), cpu_native.int8_gemv(xb.float(), codes, scale))


@native
def test_int8_gemv_rejects_mismatched_shapes():
    codes, scale = _random_int8(4, 64, seed=7)
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.int8_gemv(torch.zeros(1, 32), codes, scale)
    with pytest.raises(ValueError, match="weight_scale"):
        cpu_native.int8_gemv(torch.zeros(1, 64), codes, scale.view(1, 4))
    with pytest.raises(ValueError, match="int8 tensor"):
        cpu_native.int8_gemv(torch.zeros(1, 64), codes.to(torch.int16), scale)


@native
@pytest.mark.parametrize("rows", [1, 4, 64, 65])
def test_qlinear_int8_dispatches_to_native_kernel(monkeypatch, rows):
    q = quantize(torch.randn(40, 160, generator=torch.Generator().manual_seed(rows)), "int8")
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = []
    gemv = cpu_native.int8_gemv

    def counted(*args, **kwargs):
        calls.append(1)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(cpu_native, "int8_gemv", counted)
    y = linear.qlinear(x.view(1, rows, 160), q)
    assert y.shape == (1, rows, 40) and y.dtype == torch.bfloat16
    # Decode-sized batches use the gemv; larger ones dequantize and use a matmul.
    assert len(calls) == int(rows <= cpu_native.GEMV_MAX_ROWS)
    ref = x.float() @ linear.dequantize(q).T
    assert torch.allclose(y[0].float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    calls.clear()
    linear.qlinear(x, q, use_triton=False)             # an explicit torch request is honoured
    assert calls == []


def test_qlinear_int8_falls_back_to_torch_without_library(monkeypatch):
    q = quantize(torch.randn(24, 64, generator=torch.Generator().manual_seed(2)), "int8")
    codes, scale = q.tensors["weight"], q.tensors["weight_scale"]
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    expect = linear.qlinear(x, q)                   # native when built, else already torch
    _assert_int8_close(expect, x, codes, scale)
    monkeypatch.setattr(cpu_native, "_library", lambda: None)
    assert not cpu_native.available()
    with pytest.raises(RuntimeError, match="not built"):
        cpu_native.int8_gemv(x, codes, scale)
    assert torch.equal(linear.qlinear(x, q), x @ int8_dequantize(codes, scale).T)


def _random_grouped_int8(out: int, n: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes with float16 group scales [out, n/group] spanning several orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, n), generator=g, dtype=torch.int8)
    scale = (torch.rand(out, n // group, generator=g) * torch.logspace(-4, 1, out).unsqueeze(1)).half()
    return codes, scale


@native
@SIMD
@pytest.mark.parametrize("out,n,group", [(1, 32, 32), (5, 96, 32), (13, 256, 64), (67, 1024, 128), (9, 2048, 32),
                                         (4, 16384, 16384), (3, 6144, 3072)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_grouped_int8_gemv_matches_reference(out, n, group, m, use_simd):
    """Group scales: every weight decodes to int8_dequantize's value, so the product is the
    dequantized one times the rounded x up to float32 summation order; the thread split changes no bit."""
    codes, scale = _random_grouped_int8(out, n, group, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    y = cpu_native.int8_gemv(x, codes, scale, use_simd=use_simd)
    _assert_int8_close(y, x, codes, scale)
    for threads in (2, 3):
        assert torch.equal(cpu_native.int8_gemv(x, codes, scale, threads=threads, use_simd=use_simd), y)


@native
@SIMD
def test_grouped_int8_items_and_transposed_items_match_the_dequantized_products(use_simd):
    g = torch.Generator().manual_seed(3)
    ws = [_random_grouped_int8(48, 256, 32, seed=i) for i in range(3)]
    xs = [torch.randn(m, 256, generator=g) for m in (1, 4, 2)]
    y = cpu_native.dense_gemv_items(xs, [w for w, _ in ws], [s for _, s in ws], use_simd=use_simd)
    want = torch.cat([cpu_native.int8_gemv(x, w, s, use_simd=use_simd) for x, (w, s) in zip(xs, ws)])
    assert torch.equal(y, want)
    # Transposed: W [depth 48, n 256], its group scales along n (the product's output side).
    xt = [torch.randn(m, 48, generator=g) for m in (1, 3, 1)]
    yt = cpu_native.dense_gemv_t_items(xt, [w for w, _ in ws], [s for _, s in ws], use_simd=use_simd)
    at = 0
    for x, (w, s) in zip(xt, ws):
        full = int8_dequantize(w, s)
        got, at = yt[at:at + x.shape[0]], at + x.shape[0]
        assert ((got - x @ full).abs() <= 1e-5 * (x.abs() @ full.abs()) + 1e-30).all()


@native
@pytest.mark.parametrize("path", ["simd", "avx2", "portable"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out,n", [(5, 96), (5, 384), (9, 512), (13, 2304), (67, 1024), (3, 6144)])
def test_interleaved_grouped_int8_gemv_matches_the_plain_layouts_reference(path, group, out, n):
    """Codes in the interleaved layout (int8_interleaved, groups of 32, 64 and 128; rows of 96 and 384 have
    no whole block, 2304 end in half of one) give the dequantized product of the plain codes times the
    rounded x, at every SIMD level and 1-5 rows of x; int8_dequantize reads both layouts alike, the layout
    change is its own inverse and the same for every group, and other scalings do not interleave."""
    if path == "avx2" and cpu_native.simd() == "portable":
        pytest.skip("no AVX2 here")
    if n % group:
        pytest.skip(f"groups of {group} do not divide {n}")
    g = torch.Generator().manual_seed(out * n)
    codes, scale = int8_quantize(torch.randn(out, n, generator=g) * torch.logspace(-2, 1, n), group)
    inter, iscale = int8_interleaved(codes, scale)
    assert torch.equal(int8_interleave(inter), codes) and (n < 512 or not torch.equal(inter, codes))
    assert torch.equal(int8_dequantize(inter, iscale), int8_dequantize(codes, scale))
    in_place = codes.clone()
    assert cpu_native.int8_interleave_(in_place) is in_place and torch.equal(in_place, inter)
    for m in (1, 2, 3, 5):
        x = torch.randn(m, n, generator=g)
        ref = int8_round_inputs(x) @ int8_dequantize(codes, scale).double().T
        with cpu_native.limit_simd("avx2" if path == "avx2" else "avx512"):
            y = cpu_native.int8_gemv(x, inter, iscale, use_simd=path != "portable")
        assert ((y.double() - ref).abs() <= 2e-6 * ref.abs().max()).all()
    assert torch.equal(inter, int8_interleave(codes))  # one permutation for every group size
    with pytest.raises(ValueError, match="whole spans of 32"):
        int8_interleave(torch.zeros(2, 48, dtype=torch.int8))
    with pytest.raises(ValueError, match="got group 256"):
        int8_interleaved(*int8_quantize(torch.randn(2, 512), 256))
    with pytest.raises(ValueError, match="got per-row scales"):
        int8_interleaved(*int8_quantize(torch.randn(2, 512), 0))
    with pytest.raises(ValueError, match="already interleaved"):
        int8_interleaved(inter, iscale)


def test_grouped_int8_quantize_rounds_within_half_a_scale_and_refuses_bad_groups():
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 128)
    codes, scale = int8_quantize(w, 32)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (6, 4)
    err = (int8_dequantize(codes, scale) - w).abs()
    assert (err <= scale.float().repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all()
    # Finer than one scale per row on weights whose range varies along the row.
    assert err.mean() < (int8_dequantize(*int8_quantize(w)) - w).abs().mean() / 2
    q = quantize(w, "int8", 64)
    assert q.group_size == 64 and torch.equal(linear.dequantize(q), int8_dequantize(*int8_quantize(w, 64)))
    for bad in (16, 48, 100, -32):
        with pytest.raises(ValueError, match="multiple of 32"):
            int8_quantize(w, bad)
    with pytest.raises(ValueError, match="weight_scale"):
        cpu_native.int8_gemv(torch.zeros(1, 128), codes, scale.float())


# ---------------------------------------------------------------- int4 / int6

INTQ = pytest.mark.parametrize("codec", ["int4", "int6"])


def _random_intq(codec: str, out: int, n: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes (every code, including -offset, which quantize never writes) and
    float16 scales spanning several orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out, intq.packed_width(codec, n)), generator=g, dtype=torch.uint8)
    scale = torch.rand(out, n // group, generator=g) * torch.logspace(-4, 1, out).unsqueeze(1)
    return packed, scale.half()


def _assert_intq_close(y: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       codec: str) -> None:
    """y equals x @ W^T (W decoded by the torch reference) up to float32 summation order."""
    w = intq.intq_dequantize(packed, scale, codec)
    ref = x.float() @ w.T
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y - ref).abs() <= 1e-5 * (x.float().abs() @ w.abs().T)).all()


@native
@SIMD
@INTQ
@pytest.mark.parametrize("out,n,group", [(1, 32, 32), (3, 64, 16), (13, 96, 32), (67, 1024, 64),
                                         (5, 40, 8), (7, 200, 8), (9, 96, 48), (4, 512, 256),
                                         (6, 120, 40)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_intq_gemv_matches_reference(codec, out, n, group, m, use_simd):
    # Groups of 8, 16, 40 and 48 straddle the AVX-512 steps (32 int4 / 16 int6 elements); widths
    # 40, 200 and 120 end inside a step.
    packed, scale = _random_intq(codec, out, n, group, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    y = cpu_native.intq_gemv(x, packed, scale, codec, group, use_simd=use_simd)
    _assert_intq_close(y, x, packed, scale, codec)


@native
@SIMD
@INTQ
@pytest.mark.parametrize("group", [8, 32])
def test_intq_gemv_extreme_codes_and_zero_scales(codec, group, use_simd):
    n, lo, hi = 96, -intq.offset(codec), intq.offset(codec) - 1
    codes = torch.zeros(5, n, dtype=torch.int32)
    codes[0] = lo
    codes[1] = hi
    codes[2] = torch.arange(n) % (hi - lo + 1) + lo               # every code in turn
    codes[3] = hi                                                  # nonzero codes, but scale 0
    packed = intq.pack(codes, codec)
    scale = torch.full((5, n // group), 0.5).half()
    scale[3] = 0.0
    scale[4, 0] = 65504.0                                          # largest float16; codes 0
    x = torch.randint(-8, 9, (4, n), generator=torch.Generator().manual_seed(4)).float()
    y = cpu_native.intq_gemv(x, packed, scale, codec, group, use_simd=use_simd)
    _assert_intq_close(y, x, packed, scale, codec)
    # Small integers times 0.5: every product and partial sum is exact, so the sums are too.
    assert torch.equal(y[:, :3], x @ (codes[:3].float() * 0.5).T)
    assert (y[:, 3] == 0).all() and (y[:, 4] == 0).all()


@native
@SIMD
@INTQ
def test_intq_gemv_thread_split_gives_identical_results(codec, use_simd):
    packed, scale = _random_intq(codec, 523, 2048, 32, seed=5)    # enough for 4 threads; 523 = 4k + 3
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(5))
    ys = [cpu_native.intq_gemv(x, packed, scale, codec, 32, threads=t, use_simd=use_simd) for t in (1, 2, 3, 4)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    _assert_intq_close(ys[0], x, packed, scale, codec)
    # A row of x gives the same result alone as inside a batch (blocks of 4 rows of x).
    assert torch.equal(cpu_native.intq_gemv(x[1:], packed, scale, codec, 32, use_simd=use_simd), ys[0][1:])


@native
@INTQ
def test_intq_gemv_accepts_strided_and_bf16_inputs(codec):
    packed, scale = _random_intq(codec, 24, 128, 32, seed=6)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    y = cpu_native.intq_gemv(x, packed, scale, codec, 32)
    wide_p = torch.cat([packed, packed], dim=1)[:, :packed.shape[1]]   # non-contiguous views
    wide_s = torch.cat([scale, scale], dim=1)[:, :scale.shape[1]]
    x_t = x.T.contiguous().T
    assert not (wide_p.is_contiguous() or wide_s.is_contiguous() or x_t.is_contiguous())
    assert torch.equal(cpu_native.intq_gemv(x_t, wide_p, wide_s, codec, 32), y)
    xb = x.to(torch.bfloat16)
    assert torch.equal(cpu_native.intq_gemv(xb, packed, scale, codec, 32),
                       cpu_native.intq_gemv(xb.float(), packed, scale, codec, 32))


@native
def test_intq_gemv_rejects_bad_arguments():
    packed, scale = _random_intq("int4", 4, 64, 16, seed=7)
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.intq_gemv(torch.zeros(1, 32), packed, scale, "int4", 16)
    with pytest.raises(ValueError, match="implies group size 16"):
        cpu_native.intq_gemv(torch.zeros(1, 64), packed, scale, "int4", 32)
    with pytest.raises(ValueError, match="unknown group-wise"):
        cpu_native.intq_gemv(torch.zeros(1, 64), packed, scale, "int5", 16)
    p4, s4 = _random_intq("int4", 4, 64, 4, seed=7)                # valid layout, group too small
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_native.intq_gemv(torch.zeros(1, 64), p4, s4, "int4", 4)
    assert cpu_native.intq_gemv(torch.zeros(0, 64), packed, scale, "int4", 16).shape == (0, 4)


@native
@INTQ
@pytest.mark.parametrize("rows", [1, 4, 16, 17])
def test_qlinear_intq_dispatches_to_native_kernel(monkeypatch, codec, rows):
    q = quantize(torch.randn(40, 160, generator=torch.Generator().manual_seed(rows)), codec, group_size=32)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = []
    gemv = cpu_native.intq_gemv

    def counted(*args, **kwargs):
        calls.append(1)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(cpu_native, "intq_gemv", counted)
    y = linear.qlinear(x.view(1, rows, 160), q)
    assert y.shape == (1, rows, 40) and y.dtype == torch.bfloat16
    # Decode-sized batches use the gemv; larger ones dequantize and use a matmul.
    assert len(calls) == int(rows <= cpu_native.INTQ_GEMV_MAX_ROWS)
    ref = x.float() @ linear.dequantize(q).T
    assert torch.allclose(y[0].float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    calls.clear()
    linear.qlinear(x, q, use_triton=False)             # an explicit torch request is honoured
    # A group size the kernel does not take (not a multiple of 8) stays on the torch path.
    q4 = quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(3)), codec, group_size=4)
    x4 = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(linear.qlinear(x4, q4), x4 @ linear.dequantize(q4).T)
    assert calls == []


@INTQ
def test_qlinear_intq_falls_back_to_torch_without_library(monkeypatch, codec):
    q = quantize(torch.randn(24, 64, generator=torch.Generator().manual_seed(2)), codec, group_size=16)
    packed, scale = q.tensors["weight_packed"], q.tensors["weight_scale"]
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    expect = linear.qlinear(x, q)                   # native when built, else already torch
    _assert_intq_close(expect, x, packed, scale, codec)
    monkeypatch.setattr(cpu_native, "_library", lambda: None)
    assert not cpu_native.available()
    with pytest.raises(RuntimeError, match="not built"):
        cpu_native.intq_gemv(x, packed, scale, codec, 16)
    assert torch.equal(linear.qlinear(x, q), x @ intq.intq_dequantize(packed, scale, codec).T)


# ---------------------------------------------------------------- bf16

def _random_bf16(out: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows spanning several orders of magnitude, as checkpoint weights do.
    return (torch.randn(out, n, generator=g) * torch.logspace(-3, 1, out).unsqueeze(1)).to(torch.bfloat16)


def _assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y equals x @ w^T (w widened to float32, exactly) up to float32 summation order."""
    wf = w.float()
    ref = x.float() @ wf.T
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y - ref).abs() <= 1e-5 * (x.float().abs() @ wf.abs().T)).all()


@native
@SIMD
@pytest.mark.parametrize("out,n", [(1, 16), (2, 7), (3, 17), (13, 100), (67, 1024)])
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_bf16_gemv_matches_reference(out, n, m, use_simd):
    # n = 7 has only a tail, 17 and 100 a body plus a tail past the 16-wide steps; m = 5 is one
    # full block of 4 rows of x plus one.
    w = _random_bf16(out, n, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    _assert_bf16_close(cpu_native.bf16_gemv(x, w, use_simd=use_simd), x, w)


@native
@SIMD
def test_bf16_gemv_is_exact_on_exact_sums_and_keeps_special_values(use_simd):
    n = 40                                            # two 16-wide steps and a tail of 8
    g = torch.Generator().manual_seed(4)
    # Small integers: every product and partial sum is exact in float32, in any order.
    w = torch.randint(-50, 51, (7, n), generator=g).to(torch.bfloat16)
    w[1, 20] = float("nan")
    w[2, 3] = float("inf")
    w[4] = -0.0
    w[5, 37] = float("-inf")                          # in the scalar tail
    x = torch.randint(-8, 9, (5, n), generator=g).float().abs() + 1.0
    y = cpu_native.bf16_gemv(x, w, use_simd=use_simd)
    ref = x @ w.float().T
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[:, 1]).all()
    assert torch.equal(y[:, [0, 2, 3, 4, 5, 6]], ref[:, [0, 2, 3, 4, 5, 6]])
    assert (y[:, 2] == float("inf")).all() and (y[:, 5] == float("-inf")).all() and (y[:, 4] == 0).all()
    # bf16 subnormals (+-2^-133) widen to float32 subnormals, in the 16-wide steps and the tail
    # alike, and are not flushed to zero on the way.
    sub = torch.tensor([[1] * 16 + [-32767] * 16 + [1]], dtype=torch.int16).view(torch.bfloat16)
    x = torch.zeros(1, 33)
    x[0, 0], x[0, 16], x[0, 32] = 2.0 ** 100, 2.0 ** 99, 2.0 ** 98
    assert cpu_native.bf16_gemv(x, sub, use_simd=use_simd).item() == 3 * 2.0 ** -35


@native
@SIMD
def test_bf16_gemv_thread_split_gives_identical_results(use_simd):
    w = _random_bf16(523, 2048, seed=5)              # enough work for 4 threads; 523 = 4k + 3
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(5))
    ys = [cpu_native.bf16_gemv(x, w, threads=t, use_simd=use_simd) for t in (1, 2, 3, 4)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    _assert_bf16_close(ys[0], x, w)


@native
def test_bf16_gemv_rows_of_x_do_not_affect_each_other():
    # A row's result is the same whether it comes alone or inside a batch (blocks of 4 rows of x).
    w = _random_bf16(37, 300, seed=9)
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(9))
    y = cpu_native.bf16_gemv(x, w)
    for i in range(7):
        assert torch.equal(cpu_native.bf16_gemv(x[i:i + 1], w), y[i:i + 1])


@native
def test_bf16_gemv_accepts_strided_and_bf16_inputs():
    w = _random_bf16(24, 80, seed=6)
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(6))
    y = cpu_native.bf16_gemv(x, w)
    wide_w = torch.cat([w, w], dim=1)[:, :80]                     # non-contiguous views
    x_t = x.T.contiguous().T
    assert not (wide_w.is_contiguous() or x_t.is_contiguous())
    assert torch.equal(cpu_native.bf16_gemv(x_t, wide_w), y)
    assert torch.equal(cpu_native.bf16_gemv(x, w.T.contiguous().T), y)
    xb = x.to(torch.bfloat16)
    assert torch.equal(cpu_native.bf16_gemv(xb, w), cpu_native.bf16_gemv(xb.float(), w))


@native
def test_bf16_gemv_rejects_bad_arguments():
    w = _random_bf16(4, 64, seed=7)
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.bf16_gemv(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        cpu_native.bf16_gemv(torch.zeros(1, 64), w.float())
    with pytest.raises(ValueError, match="2-D bfloat16"):
        cpu_native.bf16_gemv(torch.zeros(1, 64), w.view(2, 2, 64))
    assert cpu_native.bf16_gemv(torch.zeros(0, 64), w).shape == (0, 4)


@native
@pytest.mark.parametrize("rows", [1, 4, 64, 65])
def test_linear_float32_by_bf16_dispatches_to_native_kernel(monkeypatch, rows):
    w = _random_bf16(40, 160, seed=rows)
    x = torch.randn(1, rows, 160, generator=torch.Generator().manual_seed(1))
    calls = []
    gemv = cpu_native.dense_gemv  # the per-token path (bf16_gemv's values, test_dense_gemv_equals_...)

    def counted(*args, **kwargs):
        calls.append(1)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(cpu_native, "dense_gemv", counted)
    y = ops.linear(x, w)
    assert y.shape == (1, rows, 40) and y.dtype == torch.float32
    # Decode-sized batches use the gemv; larger ones convert w and use a matmul.
    assert len(calls) == int(rows <= cpu_native.GEMV_MAX_ROWS)
    _assert_bf16_close(y[0], x[0], w)
    calls.clear()
    # Other dtype pairs keep their torch products.
    assert ops.linear(x.to(torch.bfloat16), w).dtype == torch.bfloat16
    assert torch.equal(ops.linear(x, w.float()), torch.nn.functional.linear(x, w.float()))
    assert calls == []
    # bf16 products round the row and take the same kernel as float32 (test_fast_paths.py).
    assert ops.linear(x, ops.HalfMatmul(w, torch.bfloat16)).dtype == torch.float32
    assert len(calls) == int(rows <= cpu_native.GEMV_MAX_ROWS)


def test_linear_float32_by_bf16_falls_back_to_torch_without_library(monkeypatch):
    w = _random_bf16(24, 64, seed=2)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    expect = ops.linear(x, w)                       # native when built, else already torch
    _assert_bf16_close(expect, x, w)
    monkeypatch.setattr(cpu_native, "_library", lambda: None)
    assert not cpu_native.available()
    with pytest.raises(RuntimeError, match="not built"):
        cpu_native.bf16_gemv(x, w)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w.float()))


@pytest.fixture
def avx2():
    """The kernels' AVX2 code: as it is where AVX2 is the widest, within limit_simd on AVX-512."""
    if cpu_native.simd() not in ("avx2", "avx512"):
        pytest.skip("the AVX2 gemvs need a CPU with AVX2")
    with cpu_native.limit_simd("avx2"):
        assert cpu_native.simd() == "avx2"
        yield


@pytest.mark.parametrize("out,n,m", [(5, 16, 1), (7, 40, 3), (33, 161, 4), (17, 200, 8), (9, 300, 9), (12, 2304, 16)])
def test_avx2_dense_gemvs_fuse_products_and_ignore_the_thread_split(avx2, out, n, m):
    """The int8 and bf16 gemvs' AVX2 code (int8: integer dot products of the rounded x; bf16: FMAs):
    within float rounding of the reference, whatever the row blocks, x blocks and thread split."""
    g = torch.Generator().manual_seed(out * n + m)
    x = torch.randn(m, n, generator=g) * 3
    codes = torch.randint(-127, 128, (out, n), generator=g, dtype=torch.int8)
    scale = torch.rand(out, 1, generator=g) + 0.01
    w = _random_bf16(out, n, seed=n)
    y, yb = cpu_native.int8_gemv(x, codes, scale), cpu_native.bf16_gemv(x, w)
    _assert_int8_close(y, x, codes, scale)
    _assert_bf16_close(yb, x, w)
    for threads in (2, 3):
        assert torch.equal(cpu_native.int8_gemv(x, codes, scale, threads=threads), y)
        assert torch.equal(cpu_native.bf16_gemv(x, w, threads=threads), yb)
    for rows in range(m):  # a row of x gives the same result alone as among the others
        assert torch.equal(cpu_native.int8_gemv(x[rows:rows + 1], codes, scale), y[rows:rows + 1])
        assert torch.equal(cpu_native.bf16_gemv(x[rows:rows + 1], w), yb[rows:rows + 1])


@pytest.mark.parametrize("out,n,group", [(5, 32, 32), (9, 256, 64), (13, 1024, 128), (6, 8192, 8192), (3, 6144, 3072)])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_avx2_grouped_int8_gemv_and_items_match_the_reference(avx2, out, n, group, m):
    """Grouped int8 on the AVX2 code (one output row block per row of x, two-by-two for more rows): the
    reference's values, items equal to each product alone, rows alone equal to rows among others."""
    codes, scale = _random_grouped_int8(out, n, group, seed=out + n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m)) * 2
    y = cpu_native.int8_gemv(x, codes, scale)
    _assert_int8_close(y, x, codes, scale)
    assert torch.equal(cpu_native.dense_gemv_items([x, x[:1]], [codes, codes], [scale, scale]),
                       torch.cat([y, y[:1]]))
    for i in range(m):
        assert torch.equal(cpu_native.int8_gemv(x[i:i + 1], codes, scale, threads=2), y[i:i + 1])


@pytest.mark.parametrize("out,n,m", [(1, 32, 1), (7, 64, 3), (33, 160, 5), (9, 1024, 16), (6, 256, 4)])
def test_avx2_mxfp4_gemv_fuses_products_and_ignores_the_thread_split(avx2, out, n, m):
    """The MXFP4 gemv's AVX2 code decodes every weight to the portable code's value and multiplies and
    adds in one rounding (FMA): within float rounding of the reference (and no further from a float64
    product than the portable code, on average), whatever the row blocks, x blocks and thread split."""
    packed, scale = _random_weight(out, n, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m)) * 3
    y = cpu_native.mxfp4_gemv(x, packed, scale)
    _assert_gemv_close(y, x, packed, scale)
    exact = x.double() @ mxfp4_dequantize(packed, scale).double().T
    portable = cpu_native.mxfp4_gemv(x, packed, scale, use_simd=False)
    assert (y.double() - exact).abs().mean() <= 1.5 * (portable.double() - exact).abs().mean() + 1e-12
    for threads in (2, 3):
        assert torch.equal(cpu_native.mxfp4_gemv(x, packed, scale, threads=threads), y)
    for rows in range(m):  # a row of x gives the same result alone as among the others
        assert torch.equal(cpu_native.mxfp4_gemv(x[rows:rows + 1], packed, scale), y[rows:rows + 1])
    # every code under every kind of scale (subnormal, NaN, huge) decodes like the portable code
    packed, scale = _extreme_weight()
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    y = cpu_native.mxfp4_gemv(x, packed, scale)
    _assert_gemv_close(y, x, packed, scale)
    portable = cpu_native.mxfp4_gemv(x, packed, scale, use_simd=False)
    assert torch.equal(torch.isnan(y), torch.isnan(portable)) and torch.equal(torch.isinf(y), torch.isinf(portable))


def _pool_products(seed: int) -> tuple[torch.Tensor, ...]:
    """Products that use the worker threads: a split int8 gemv and several MXFP4 items."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 1024, generator=g)
    codes = torch.randint(-127, 128, (512, 1024), generator=g, dtype=torch.int8)
    scale = torch.rand(512, 1, generator=g) + 0.01
    return x, codes, scale


@native
def test_worker_threads_serve_concurrent_callers_and_forked_children():
    """The kernels' worker threads are started once and reused: two Python threads calling at once
    (one finds the workers busy and starts its own) and a forked child (which has no workers) get
    exactly the results of one caller alone."""
    import os
    import signal
    import threading

    calls = [_pool_products(seed) for seed in range(4)]
    alone = [cpu_native.int8_gemv(x, c, s, threads=2) for x, c, s in calls]
    got: dict[int, list] = {}

    def work(k: int) -> None:
        got[k] = [cpu_native.int8_gemv(x, c, s, threads=2) for _ in range(20) for x, c, s in calls]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for k in range(2):
        assert all(torch.equal(y, alone[i % len(calls)]) for i, y in enumerate(got[k]))

    pid = os.fork()
    if pid == 0:  # the child: a hang would be killed by the alarm (exit by signal, not 0)
        signal.alarm(60)
        ok = all(torch.equal(cpu_native.int8_gemv(x, c, s, threads=2), y) for (x, c, s), y in zip(calls, alone))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_memory_reads_every_byte_once(threads):
    """The warm bench's memory probe: every byte of every buffer is read once, whatever the split
    (pieces of 1 MiB claimed by the threads; sizes around a piece, odd tails, an empty tensor)."""
    import numpy as np
    g = torch.Generator().manual_seed(threads)
    sizes = [0, 1, 7, 8, 13, (1 << 20) - 3, (1 << 20) + 5, 3 << 20, 12345]
    tensors = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    tensors.append(torch.randn(300, 7, generator=g))  # any dtype: its bytes

    def reference(t: torch.Tensor) -> int:
        raw = t.numpy().tobytes()
        body = len(raw) // 8 * 8
        return int(np.frombuffer(raw[:body], dtype=np.uint64).sum(dtype=np.uint64)) + sum(raw[body:])
    assert cpu_native.read_memory(tensors, threads) == sum(map(reference, tensors)) % 2**64
    assert cpu_native.read_memory([], threads) == 0


@native
def test_read_memory_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        cpu_native.read_memory([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="contiguous CPU tensors, got bytes"):
        cpu_native.read_memory([b"1234"])


# ---------------------------------------------------------------- many dense products in one call

def _dense_weights(kind: str, count: int, out: int, n: int, seed: int) -> list[tuple]:
    """count (weight, scale) pairs as the native dense products read them: int8 codes + row scale,
    or a bf16 weight and None."""
    if kind == "int8":
        return [_random_int8(out, n, seed + i) for i in range(count)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(out, n, generator=g).to(torch.bfloat16), None) for _ in range(count)]


def _expert_weights(kind: str, H: int, I: int, seed: int, shared: bool = False) -> list[tuple]:
    """An expert's (gate, up, down) as _dense_weights makes them; kind "interleaved": grouped int8 in the
    RAM tier's layout, routed experts at groups of 128 and the shared expert at 32 (as a store whose
    experts and spine were written at those groups holds them)."""
    if kind != "interleaved":
        return _dense_weights(kind, 2, I, H, seed=seed) + _dense_weights(kind, 1, H, I, seed=seed + 5)
    g = torch.Generator().manual_seed(seed)
    group = 32 if shared else 128
    return [int8_interleaved(*int8_quantize(torch.randn(o, n, generator=g), group)) for o, n in ((I, H), (I, H), (H, I))]


def _one_product(kind: str, x, w, s, use_simd: bool, threads: int | None = None):
    if kind == "int8":
        return cpu_native.int8_gemv(x, w, s, threads=threads, use_simd=use_simd)
    return cpu_native.bf16_gemv(x, w, threads=threads, use_simd=use_simd)


@native
@SIMD
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("out,n,rows", [(13, 100, [1, 3, 1]), (67, 1024, [1] * 9), (523, 2048, [2, 16])])
def test_dense_gemv_items_equal_each_product_alone(kind, out, n, rows, use_simd):
    """Every item of one call equals the single product of that item, bit for bit, whatever the
    number of threads (they share every item's rows), with items of different row counts."""
    ws = _dense_weights(kind, len(rows), out, n, seed=out + n)
    g = torch.Generator().manual_seed(len(rows))
    xs = [torch.randn(m, n, generator=g) for m in rows]
    want = torch.cat([_one_product(kind, x, w, s, use_simd) for x, (w, s) in zip(xs, ws)])
    for threads in (1, 2, 3):
        y = cpu_native.dense_gemv_items(xs, [w for w, _ in ws], [s for _, s in ws], threads=threads,
                                        use_simd=use_simd)
        assert torch.equal(y, want)


@native
def test_dense_gemv_items_refuse_bad_items():
    (c, s), (c2, s2) = _dense_weights("int8", 2, 8, 32, seed=1)
    b = torch.zeros(8, 32, dtype=torch.bfloat16)
    x = torch.zeros(1, 32)
    cases = [(([x], [c], [s, s2]), "one x and one scale"), (([], [], []), "at least one"),
             (([x, x], [c, c2[:4]], [s, s2[:4]]), "one shape and kind"),
             (([x, x], [c, b], [s, None]), "one shape and kind"),
             (([x], [c], [None]), "int8 codes with a scale or a bf16"),
             (([torch.zeros(1, 16)], [c], [s]), r"float32 \[M, 32\]"),
             (([x.double()], [c], [s]), "float32"), (([x], [c.T.contiguous().T], [s]), "contiguous"),
             (([x], [c], [s.view(1, 8)]), "weight_scale")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_native.dense_gemv_items(*args)


@native
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("m", [1, 3])
def test_dense_heads_gemv_equals_the_items_calls(kind, m):
    """An attention layer's heads, checked once (``dense_heads``): each call's products are the items
    calls' bit for bit, both ways (x @ W^T and, transposed, x @ W), and a wrong x is refused."""
    ws = _dense_weights(kind, 4, 24, 64, seed=m)
    heads = cpu_native.dense_heads([w for w, _ in ws], [s for _, s in ws])
    g = torch.Generator().manual_seed(m)
    x, xt = torch.randn(4, m, 64, generator=g), torch.randn(4, m, 24, generator=g)
    want = cpu_native.dense_gemv_items(list(x.unbind(0)), [w for w, _ in ws], [s for _, s in ws])
    want_t = cpu_native.dense_gemv_t_items(list(xt.unbind(0)), [w for w, _ in ws], [s for _, s in ws])
    assert torch.equal(cpu_native.dense_heads_gemv(x, heads), want)
    assert torch.equal(cpu_native.dense_heads_gemv(xt, heads, transposed=True), want_t)
    for bad in (x[:3], x.double(), x.transpose(1, 2).contiguous(), x[..., :32], x.transpose(0, 1)):
        with pytest.raises(ValueError, match="dense_heads_gemv needs"):
            cpu_native.dense_heads_gemv(bad, heads)
    with pytest.raises(ValueError, match="one shape and kind"):
        cpu_native.dense_heads([ws[0][0], ws[1][0][:8]], [ws[0][1], None if ws[1][1] is None else ws[1][1][:8]])


@native
@SIMD
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("depth,n,rows", [(7, 5, [1]), (128, 512, [1] * 4), (40, 100, [3, 16]), (64, 96, [2, 1, 2]),
                                           (256, 1040, [1] * 4)])
def test_dense_gemv_t_items_match_the_dequantized_transposed_product(kind, depth, n, rows, use_simd):
    """x @ W for W [depth, n] per item (columns past whole 32-wide steps included), against
    dequantize-then-matmul; the thread split changes no bit."""
    ws = _dense_weights(kind, len(rows), depth, n, seed=depth * n)
    g = torch.Generator().manual_seed(depth)
    xs = [torch.randn(m, depth, generator=g) for m in rows]
    y = cpu_native.dense_gemv_t_items(xs, [w for w, _ in ws], [s for _, s in ws], threads=1, use_simd=use_simd)
    at = 0
    for x, (w, s) in zip(xs, ws):
        full = int8_dequantize(w, s) if kind == "int8" else w.float()
        ref = x @ full
        got = y[at:at + x.shape[0]]
        at += x.shape[0]
        assert ((got - ref).abs() <= 1e-5 * (x.abs() @ full.abs()) + 1e-30).all()
    for threads in (2, 3):
        assert torch.equal(cpu_native.dense_gemv_t_items(xs, [w for w, _ in ws], [s for _, s in ws],
                                                         threads=threads, use_simd=use_simd), y)


@native
def test_linears_equal_one_linear_per_weight(monkeypatch):
    """ops.linears: one native call for int8 or bf16 weights of one shape (decode-sized rows), one for
    each kind where the kinds differ, the plain per-weight products otherwise; the values are
    ops.linear's bit for bit either way."""
    g = torch.Generator().manual_seed(9)
    int8 = [quantize(torch.randn(48, 80, generator=g), "int8") for _ in range(3)]
    bf16 = [torch.randn(48, 80, generator=g).bfloat16() for _ in range(2)]
    other = [torch.randn(48, 80, generator=g), quantize(torch.randn(40, 80, generator=g), "int8")]
    calls = []
    real = cpu_native.dense_gemv_items
    monkeypatch.setattr(cpu_native, "dense_gemv_items", lambda *a: calls.append(1) or real(*a))
    for ws, native_calls in [(int8, 1), (bf16, 1), (int8[:1] + bf16[:1], 0), (int8[:1] + other[1:], 0),
                             (other[:1] * 2, 0), (int8[:2] + bf16 + int8[2:], 2)]:
        for shape in [(1, 80), (2, 3, 80), (cpu_native.GEMV_MAX_ROWS + 1, 80)]:
            x = torch.randn(*shape, generator=g)
            calls.clear()
            got = ops.linears(x, ws)
            assert len(calls) == (native_calls if x.numel() // 80 <= cpu_native.GEMV_MAX_ROWS else 0)
            want = [ops.linear(x, w) for w in ws]
            assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


@native
def test_products_equal_one_linear_per_input_and_weight(monkeypatch):
    """ops.products: each input against its own weight (KDA's low-rank halves) in one native call when
    inputs and weights each share a shape, bit for bit ops.linear's values either way."""
    g = torch.Generator().manual_seed(10)
    ws = [quantize(torch.randn(48, 80, generator=g), "int8") for _ in range(2)]
    calls = []
    real = cpu_native.dense_gemv_items
    monkeypatch.setattr(cpu_native, "dense_gemv_items", lambda *a: calls.append(1) or real(*a))
    for shapes, native_call in [([(1, 80), (1, 80)], True), ([(2, 80), (2, 80)], True), ([(1, 80), (2, 80)], False)]:
        xs = [torch.randn(*s, generator=g) for s in shapes]
        calls.clear()
        got = ops.products(xs, ws)
        assert len(calls) == int(native_call)
        assert all(torch.equal(a, ops.linear(x, w)) for a, x, w in zip(got, xs, ws)) and len(got) == 2


@native
@pytest.mark.parametrize("m", [1, 3, 16])
def test_dense_gemv_equals_the_general_wrappers(m, monkeypatch):
    """cpu_native.dense_gemv (the lean per-token product ops.linear takes for int8 and bf16 weights) gives
    int8_gemv's and bf16_gemv's values bit for bit, and ops.linear takes it for decode-sized rows."""
    codes, scale = _random_int8(67, 100, seed=m)
    w = torch.randn(67, 100).bfloat16()
    x = torch.randn(m, 100)
    assert torch.equal(cpu_native.dense_gemv(x, codes, scale), cpu_native.int8_gemv(x, codes, scale))
    assert torch.equal(cpu_native.dense_gemv(x, w, None), cpu_native.bf16_gemv(x, w))
    q = quantize(torch.randn(67, 100), "int8")
    # The wrappers' values first: they call dense_gemv themselves, after their conversions.
    want_q = cpu_native.int8_gemv(x, q.tensors["weight"], q.tensors["weight_scale"])
    want_w = cpu_native.bf16_gemv(x, w).view(1, m, 67)
    calls = []
    real = cpu_native.dense_gemv
    monkeypatch.setattr(cpu_native, "dense_gemv", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(ops.linear(x, q), want_q)
    assert torch.equal(ops.linear(x.view(1, m, 100), w), want_w)
    assert len(calls) == 2


@native
def test_dense_gemv_refuses_bad_inputs():
    codes, scale = _random_int8(8, 16, seed=1)
    x = torch.randn(2, 16)
    bad = [(x.double(), codes, scale), (torch.randn(16, 2).T, codes, scale), (torch.randn(2, 17), codes, scale),
           (x[0], codes, scale), (x, codes, None), (x, codes.bfloat16(), scale), (x, codes.half(), None),
           (x, codes, scale[:4]), (x, codes, scale.double()), (x, codes.T.contiguous().T, scale)]
    for args in bad:
        with pytest.raises(ValueError, match="dense_gemv"):
            cpu_native.dense_gemv(*args)


@native
def test_a_decode_pass_gives_torch_one_thread_and_the_native_kernels_all(tiny_kl_path, monkeypatch):
    """cpu_native.decode_threads around a decode-sized CPU pass: the native products split over every
    compute thread while torch's own ops run on one; a prompt pass keeps torch's threads; both are
    restored after the pass."""
    import deltafin
    m = deltafin.load(tiny_kl_path, device="cpu", stream="off", threads=2)
    seen = []

    def watched(real):
        return lambda *a, **k: seen.append((torch.get_num_threads(), cpu_native._threads(None))) or real(*a, **k)
    # the products a pass calls from Python: its layers' halves in one call each and the head's product
    for name in ("dense_gemv_items", "dense_gemv", "kda_block", "mla_block", "moe_block_silu", "mlp_block_silu"):
        monkeypatch.setattr(cpu_native, name, watched(getattr(cpu_native, name)))
    st = m.new_state()
    m.forward(list(range(5, 5 + cpu_native.GEMV_MAX_ROWS + 8)), st)  # a prompt pass
    assert seen and all(s == (2, 2) for s in seen)
    seen.clear()
    m.forward([7], st)
    assert seen and all(s == (1, 2) for s in seen)
    assert torch.get_num_threads() == 2 and cpu_native._threads(None) == 2


@native
def test_a_streamed_pass_of_several_rows_runs_its_products_on_every_core(tiny_kl_path, monkeypatch):
    """Streaming with automatic threads leaves a core to the readers in one-token passes only: a pass
    of several rows (drafts, a batch, a prompt piece) runs its native products on every core, torch's
    own ops on one; a set thread count holds for every pass."""
    import os
    import deltafin
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("needs two cores to tell the counts apart")
    seen = []
    real = cpu_native.dense_gemv_items
    monkeypatch.setattr(cpu_native, "dense_gemv_items",
                        lambda *a, **k: seen.append((torch.get_num_threads(), cpu_native._threads(None))) or real(*a, **k))
    try:
        m = deltafin.load(tiny_kl_path, device="cpu", stream="on", threads=0)
        st = m.new_state()
        m.forward(list(range(5, 13)), st)  # 8 rows
        assert seen and all(s == (1, cores) for s in seen)
        seen.clear()
        m.forward([7], st)
        assert seen and all(s == (1, cores - 1) for s in seen)
        m = deltafin.load(tiny_kl_path, device="cpu", stream="on", threads=1)
        seen.clear()
        m.forward(list(range(5, 13)), m.new_state())
        assert seen and all(s == (1, 1) for s in seen)
    finally:
        torch.set_num_threads(1)  # process-wide; the other tests run with one


def test_a_library_built_from_other_source_is_ignored_with_a_warning(monkeypatch):
    """A built library of another ABI (an older install) is not called, and the user is told why the
    products are slow, once."""
    if importlib.util.find_spec(cpu_native.LIBRARY) is None:
        pytest.skip("native CPU kernels not built")

    def abi():  # the stale library's answer (a function takes the restype ctypes sets)
        return cpu_native.ABI - 1
    monkeypatch.setattr(cpu_native.ctypes, "CDLL", lambda path: types.SimpleNamespace(cpu_kernels_abi=abi))
    with pytest.warns(RuntimeWarning, match=f"ABI {cpu_native.ABI - 1}, this deltafin needs {cpu_native.ABI}"):
        assert cpu_native._library.__wrapped__() is None


# ---------------------------------------------------------------- a MoE layer's experts in one call

@native
@SIMD
def test_silu_glu_matches_torch_within_its_exp_rounding_and_keeps_special_values(use_simd):
    g = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 88.5, -88.5, 1e-30])])
    u = torch.randn(g.shape[0], generator=torch.Generator().manual_seed(2))
    act = cpu_native.silu_glu(g, u, use_simd=use_simd)
    ref = (g.double() * torch.sigmoid(g.double()) * u.double())
    # relative 4e-7 (torch's own silu: 1.4e-7 here); below ~1e-36, where 1 + exp(-g) overflows float32
    # (g < -88.7), the result is 0 as torch's is
    assert ((act.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-36).all()
    assert torch.equal(act[g < -90], torch.nn.functional.silu(g[g < -90]) * u[g < -90])
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -1e4, 1e4])
    got = cpu_native.silu_glu(special, torch.ones(5), use_simd=use_simd)
    assert got[0] == float("inf") and got[2].isnan() and got[3] == 0 and got[4] == 1e4
    assert got[1] == 0 or got[1].isnan()  # -inf / (1 + inf): the limit 0, or NaN as torch's inf * 0


@native
@SIMD
@pytest.mark.parametrize("kind", ["int8", "bf16", "interleaved"])
@pytest.mark.parametrize("T,k,shared", [(1, 4, True), (5, 2, True), (3, 3, False)])
def test_moe_silu_equals_its_products_activation_and_weighted_sum_apart(kind, T, k, shared, use_simd):
    """One native call for a MoE layer's experts against the same steps apart (dense_gemv_items, the
    native activation, index_add_): bit for bit, whatever the thread count; also with a shared expert
    interleaved at another group size than the routed experts."""
    H, I, E = (512, 256, 6) if kind == "interleaved" else (64, 96, 6)
    g = torch.Generator().manual_seed(T * k)
    mats = [_expert_weights(kind, H, I, 10 * e, shared=e == E) for e in range(E + 1)]
    z = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
    experts, counts, rows = [mats[e] for e in chosen.tolist()], counts.tolist(), order // k
    pair_w = w.reshape(-1)[order].contiguous()
    for threads in (1, 2, 3):
        y, ys = cpu_native.moe_silu(z, counts, rows.tolist(), pair_w, [cpu_native.moe_expert(*d) for d in experts],
                                    cpu_native.moe_expert(*mats[E]) if shared else None, threads=threads,
                                    use_simd=use_simd)
        xs = list(z[rows].split(counts))
        gu = cpu_native.dense_gemv_items(xs + xs, [d[0][0] for d in experts] + [d[1][0] for d in experts],
                                         [d[0][1] for d in experts] + [d[1][1] for d in experts], use_simd=use_simd)
        if shared:  # the shared expert's products apart (its group may differ from the routed experts')
            gs, us = cpu_native.dense_gemv_items([z, z], [mats[E][0][0], mats[E][1][0]], [mats[E][0][1], mats[E][1][1]],
                                                 use_simd=use_simd).split(T)
            R = gu.shape[0] // 2
            gu, xs = torch.cat([gu[:R], gs, gu[R:], us]), xs + [z]
        R = gu.shape[0] // 2
        act = cpu_native.silu_glu(gu[:R].contiguous(), gu[R:].contiguous(), use_simd=use_simd)
        parts = list(act.split([x.shape[0] for x in xs]))
        out = cpu_native.dense_gemv_items(parts[:len(experts)], [d[2][0] for d in experts], [d[2][1] for d in experts],
                                          use_simd=use_simd)
        if shared:
            out = torch.cat([out, cpu_native.dense_gemv_items([parts[-1]], [mats[E][2][0]], [mats[E][2][1]],
                                                              use_simd=use_simd)])
        want = torch.zeros(T, H).index_add_(0, rows, out[:len(rows)] * pair_w.unsqueeze(-1))
        assert torch.equal(y, want)
        assert (ys is None) == (not shared) and (ys is None or torch.equal(ys, out[len(rows):]))


@native
def test_moe_silu_refuses_what_does_not_fit():
    H, I = 32, 64
    e = _dense_weights("int8", 2, I, H, seed=1) + _dense_weights("int8", 1, H, I, seed=2)
    b = _dense_weights("bf16", 2, I, H, seed=3) + _dense_weights("bf16", 1, H, I, seed=4)
    me, mb = cpu_native.moe_expert(*e), cpu_native.moe_expert(*b)
    z, pw = torch.zeros(2, H), torch.ones(2)
    cases = [((z, [1], [0, 1], pw, [me]), "one count per expert"), ((z, [2], [0, 2], pw, [me]), "pair rows"),
             ((z, [2], [0, 1], torch.ones(3), [me]), "pair weights"), ((z.double(), [2], [0, 1], pw, [me]), "float32"),
             ((z, [1, 1], [0, 1], pw, [me, mb]), "one shape and kind"),
             ((z, [], [], torch.ones(0), []), "at least one"),
             ((z, [2], [0, 1], pw, [e]), "made by moe_expert"),
             ((torch.zeros(2, 16), [2], [0, 1], pw, [me]), "width 16")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_native.moe_silu(*args)
    for bad, message in [((e[0], e[1], e[0]), r"down \[H, I\]"), ((e[0], b[1], e[2]), "one shape and kind"),
                         ((e[0], e[1], (e[2][0].T.contiguous().T, e[2][1])), "contiguous")]:
        with pytest.raises(ValueError, match=message):
            cpu_native.moe_expert(*bad)


@native
@SIMD
@pytest.mark.parametrize("kind", ["int8", "bf16", "interleaved"])
@pytest.mark.parametrize("T,k,shared", [(1, 4, True), (5, 2, True), (3, 3, False)])
def test_moe_block_equals_the_norm_router_and_experts_called_apart(kind, T, k, shared, use_simd):
    """A MoE layer's feed-forward half in one native call against its steps apart (rms_norm,
    route_sigmoid, moe_silu on the pairs ordered by a stable sort, the sums as the layer adds them):
    bit for bit, the chosen ids too, whatever the thread count; a bf16 norm and router as well, and a
    shared expert at another group size than the routed experts."""
    H, I, E = (512, 256, 6) if kind == "interleaved" else (64, 96, 6)
    g = torch.Generator().manual_seed(T * k + 7)
    mats = [_expert_weights(kind, H, I, 10 * e, shared=e == E) for e in range(E + 1)]
    table = cpu_native.moe_table([cpu_native.moe_expert(*d) for d in mats[:E]])
    one = cpu_native.moe_expert(*mats[E]) if shared else None
    p = torch.randn(T, H, generator=g) * 3
    for wdtype in (torch.float32, torch.bfloat16):
        norm = (torch.rand(H, generator=g) + 0.5).to(wdtype)
        gate = torch.randn(E, H, generator=g).to(wdtype)
        bias = torch.randn(E, generator=g) * 0.1
        x = cpu_native.rms_norm(p, norm, 1e-5, use_simd=use_simd)
        ids, w = cpu_native.route_sigmoid(x, gate, bias, k, True, 2.5, use_simd=use_simd)
        flat = ids.reshape(-1).tolist()
        order = sorted(range(len(flat)), key=flat.__getitem__)
        chosen = sorted(set(flat))
        y, ys = cpu_native.moe_silu(x, [flat.count(e) for e in chosen], [i // k for i in order],
                                    w.reshape(-1)[order].contiguous(), [table.experts[e] for e in chosen], one,
                                    use_simd=use_simd)
        want = p + (y + (ys if shared else 0.0))
        for threads in (1, 2, 3):
            out, got_ids = cpu_native.moe_block_silu(p, norm, 1e-5, gate, bias, k, True, 2.5, table, one,
                                                     threads=threads, use_simd=use_simd)
            assert torch.equal(got_ids, ids) and torch.equal(out, want)


@native
@pytest.mark.parametrize("codec", ["bf16", "int8-row", "int8"])
@pytest.mark.parametrize("T", [1, 3])
def test_a_dense_mlps_half_in_one_call_equals_its_calls_apart(codec, T):
    """DenseMLP.block (cpu_native.mlp_block_silu: the norm, gate and up, the SiLU-GLU, down and the residual
    sum in one native call) against the layer's own calls, bit for bit: bf16, per-row int8 and grouped int8
    in the RAM tier's interleaved layout; float32 weights take the calls apart (None)."""
    from deltafin.io.ram import cpu_layout
    from deltafin.kernels import quantize
    from deltafin.model.binding import bind
    from deltafin.model.moe import DenseMLP
    from deltafin.model.ops import rms_norm
    from test_model_pieces import k3_config
    cfg = dataclasses.replace(k3_config(), hidden_act="silu")  # Kimi Linear's activation
    H, I = cfg.hidden_size, 96
    g = torch.Generator().manual_seed(T + 3)
    mlp = DenseMLP(cfg, I)
    plain = {"gate_proj": torch.randn(I, H, generator=g) / H ** 0.5, "up_proj": torch.randn(I, H, generator=g) / H ** 0.5,
             "down_proj": torch.randn(H, I, generator=g) / I ** 0.5}
    norm = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    p = torch.randn(T, H, generator=g) * 2
    bind(mlp, plain)
    assert mlp.block(p, norm, 1e-5) is None
    if codec == "bf16":
        bind(mlp, {k: w.bfloat16() for k, w in plain.items()})
    else:
        bind(mlp, {k: cpu_layout(k, quantize(w, "int8", 0 if codec == "int8-row" else 32)) for k, w in plain.items()})
    whole = mlp.block(p, norm, 1e-5)
    assert whole is not None and torch.equal(whole, p + mlp(rms_norm(p, norm, 1e-5)))


@native
def test_mlp_block_refuses_what_does_not_fit():
    H, I = 32, 64
    one = cpu_native.moe_expert(*(_dense_weights("int8", 2, I, H, seed=1) + _dense_weights("int8", 1, H, I, seed=2)))
    p, norm = torch.zeros(2, H), torch.ones(H)
    assert torch.equal(cpu_native.mlp_block_silu(p, norm, 1e-5, one), p)
    for args, message in [((p.double(), norm, 1e-5, one), "float32 rows"), ((torch.zeros(2, 16), norm, 1e-5, one), "width 32"),
                          ((p, torch.ones(H + 1), 1e-5, one), "norm"), ((p, norm, 1e-5, "mlp"), "moe_expert")]:
        with pytest.raises(ValueError, match=message):
            cpu_native.mlp_block_silu(*args)


@native
def test_moe_block_refuses_what_does_not_fit():
    H, I, E = 32, 64, 3
    int8 = [cpu_native.moe_expert(*(_dense_weights("int8", 2, I, H, seed=e) + _dense_weights("int8", 1, H, I, seed=9)))
            for e in range(E)]
    bf16 = cpu_native.moe_expert(*(_dense_weights("bf16", 2, I, H, seed=1) + _dense_weights("bf16", 1, H, I, seed=2)))
    table = cpu_native.moe_table(int8)
    p, norm, gate, bias = torch.zeros(2, H), torch.ones(H), torch.zeros(E, H), torch.zeros(E)
    cases = [((p.double(), norm, 1e-5, gate, bias, 2, True, 1.0, table, None), "float32 rows"),
             ((torch.zeros(2, 16), norm, 1e-5, gate, bias, 2, True, 1.0, table, None), "width 32"),
             ((p, norm, 1e-5, gate, bias, 2, True, 1.0, table, bf16), "shared"),
             ((p, torch.ones(H + 1), 1e-5, gate, bias, 2, True, 1.0, table, None), "norm"),
             ((p, norm, 1e-5, torch.zeros(E + 1, H), bias, 2, True, 1.0, table, None), "gate"),
             ((p, norm, 1e-5, gate, bias.double(), 2, True, 1.0, table, None), "bias"),
             ((p, norm, 1e-5, gate, bias, E + 1, True, 1.0, table, None), "picks 1..3")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_native.moe_block_silu(*args)
    for bad in ([], [int8[0], bf16], [int8[0], "expert"]):
        with pytest.raises(ValueError, match="one signature"):
            cpu_native.moe_table(bad)


@native
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_a_moe_experts_checks_run_once_per_weights_and_keep_none_of_them_alive(kind, monkeypatch):
    """experts_cpu.moe_expert_of checks an expert's weights once (bf16 tensors as QWeights; a decode token
    asks for every chosen expert of every layer): again only when one of the three is another object,
    and what it keeps holds no weight alive and leaves with the first one."""
    import gc
    import weakref

    from deltafin.kernels import experts_cpu

    def weights(seed):
        ws = _dense_weights(kind, 2, 96, 64, seed=seed) + _dense_weights(kind, 1, 64, 96, seed=seed + 1)
        if kind == "bf16":
            return tuple(w for w, _ in ws)
        return tuple(linear.QWeight("int8", tuple(w.shape), 0, {"weight": w, "weight_scale": s}) for w, s in ws)

    def codes(w):
        return w if kind == "bf16" else w.tensors["weight"]
    checks = []
    check = cpu_native.moe_expert
    monkeypatch.setattr(cpu_native, "moe_expert", lambda *d: checks.append(1) or check(*d))
    ws, other = weights(1), weights(3)
    first = experts_cpu.moe_expert_of(ws)
    again = experts_cpu.moe_expert_of(ws)
    assert len(checks) == 1 and (again.pointers, again.signature) == (first.pointers, first.signature)
    assert first.pointers[:3] == tuple(codes(w).data_ptr() for w in ws)
    swapped = experts_cpu.moe_expert_of((ws[0], other[1], ws[2]))
    assert len(checks) == 2 and swapped.pointers[1] == codes(other[1]).data_ptr()
    experts_cpu.moe_expert_of((ws[0], other[1], ws[2]))
    assert len(checks) == 2
    key, up = id(ws[0]), weakref.ref(other[1])
    del ws, other, first, again, swapped
    gc.collect()
    assert key not in experts_cpu._kept_experts and up() is None


@native
@SIMD
@pytest.mark.parametrize("wdtype", [None, torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_torch_formula(wdtype, use_simd):
    """The native RMSNorm of decode-sized rows against ops.rms_norm's torch formula (float32 rounding),
    rows of zeros (eps alone) and a row holding inf or NaN (NaN out, the other rows untouched)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2307, generator=g) * torch.logspace(-3, 3, 5).unsqueeze(1)
    x[2] = 0
    w = None if wdtype is None else torch.randn(2307, generator=g).to(wdtype)
    y = cpu_native.rms_norm(x, w, 1e-6, use_simd=use_simd)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 if w is None else w.double())
    assert ((y.double() - ref).abs() <= 1e-6 * ref.abs().amax(-1, keepdim=True)).all()
    assert (y[2] == 0).all()
    bad = x.clone()
    bad[1, 7], bad[3, 0] = float("inf"), float("nan")
    yb = cpu_native.rms_norm(bad, w, 1e-6, use_simd=use_simd)
    assert yb[1].isnan().any() and yb[3].isnan().all() and torch.equal(yb[[0, 2, 4]], y[[0, 2, 4]])
    with pytest.raises(ValueError, match="weight"):
        cpu_native.rms_norm(x, torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="float32 rows"):
        cpu_native.rms_norm(x.double(), None, 1e-6)
    # ops.rms_norm takes it for decode-sized rows, the torch formula for more (equal to float32 rounding)
    many = torch.randn(cpu_native.GEMV_MAX_ROWS + 1, 64, generator=g)
    assert torch.allclose(ops.rms_norm(many[:3], None, 1e-6), ops.rms_norm(many, None, 1e-6)[:3], rtol=1e-6, atol=1e-6)


@native
@SIMD
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_sigmoid_matches_the_torch_router(gate_dtype, renormalize, use_simd):
    """The native sigmoid router against moe.route's torch formula: the same experts in the same order
    (no near-ties among these seeded scores) and weights within float32 rounding; equal choices take
    the lower expert first; k out of range is refused."""
    g = torch.Generator().manual_seed(5)
    T, H, E, k = 6, 200, 64, 8
    x = torch.randn(T, H, generator=g)
    gate = (torch.randn(E, H, generator=g) / H ** .5).to(gate_dtype)
    bias = torch.randn(E, generator=g) * 0.1
    ids, w = cpu_native.route_sigmoid(x, gate, bias, k, renormalize, 2.5, use_simd=use_simd)
    scores = torch.sigmoid(x @ gate.float().T)
    want = (scores + bias).topk(k, dim=-1).indices
    assert torch.equal(ids, want)
    ref = scores.gather(1, want)
    if renormalize:
        ref = ref / (ref.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w, ref * 2.5, rtol=1e-5, atol=0)
    tied, _ = cpu_native.route_sigmoid(torch.zeros(1, H), gate, torch.zeros(E), 3, True, 1.0, use_simd=use_simd)
    assert tied.tolist() == [[0, 1, 2]]
    for bad in (0, E + 1):
        with pytest.raises(ValueError, match="experts a row"):
            cpu_native.route_sigmoid(x, gate, bias, bad, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        cpu_native.route_sigmoid(x, gate, bias[:3], k, True, 1.0)


@native
@SIMD
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_dense_gemv_outs_equal_each_product_alone(kind, use_simd, monkeypatch):
    """One x against weights of one width and kind but other output sizes (a KDA layer's beta and its
    low-rank projections): each output equals the single product bit for bit, whatever the thread count;
    ops.linears takes that call for them; mixed kinds or widths are refused."""
    n = 256
    ws = [w for out, seed in ((32, 1), (128, 2), (7, 3)) for w in _dense_weights(kind, 1, out, n, seed)]
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(9))
    want = [_one_product(kind, x, w, s, use_simd) for w, s in ws]
    for threads in (1, 2, 3):
        got = cpu_native.dense_gemv_outs(x, [w for w, _ in ws], [s for _, s in ws], threads=threads,
                                         use_simd=use_simd)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    calls = []
    real = cpu_native.dense_gemv_outs
    monkeypatch.setattr(cpu_native, "dense_gemv_outs", lambda *a, **k: calls.append(1) or real(*a, **k))
    qs = [quantize(torch.randn(out, n, generator=torch.Generator().manual_seed(out)), "int8") for out in (32, 128)]
    ys = ops.linears(x, qs)
    assert calls == [1] and all(torch.equal(y, ops.linear(x, q)) for y, q in zip(ys, qs))
    other = _dense_weights("bf16" if kind == "int8" else "int8", 1, 16, n, seed=4)[0]
    with pytest.raises(ValueError, match="one kind"):
        real(x, [ws[0][0], other[0]], [ws[0][1], other[1]])
    with pytest.raises(ValueError, match="input width"):
        real(x, [ws[0][0], ws[0][0][:, :128].contiguous()], [ws[0][1], ws[0][1]])


@native
def test_silu_glu_and_limit_simd_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="one shape"):
        cpu_native.silu_glu(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="float32"):
        cpu_native.silu_glu(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.silu_glu(torch.zeros(4, 4).T, torch.zeros(4, 4))
    before = cpu_native.simd()
    for bad in ("avx1024", "", "AVX2"):
        with pytest.raises(ValueError, match="limit_simd takes one of"):
            with cpu_native.limit_simd(bad):
                pass
    assert cpu_native.simd() == before
    with cpu_native.limit_simd("portable"):
        assert cpu_native.simd() == "portable"
    assert cpu_native.simd() == before
