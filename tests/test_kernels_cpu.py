"""The native MXFP4 CPU kernel against the torch reference, and qlinear's choice between them."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from deltafin.kernels import linear, mxfp4_cpu, quantize
from deltafin.kernels.mxfp4 import mxfp4_dequantize

native = pytest.mark.skipif(not mxfp4_cpu.available(), reason="native MXFP4 kernel not built")
# Both code paths of the library: AVX-512 (where the CPU has it) and portable C.
SIMD = pytest.mark.parametrize("use_simd", [True, False], ids=["simd", "portable"])


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
    if importlib.util.find_spec(mxfp4_cpu.LIBRARY) is not None:
        assert mxfp4_cpu.available()


@native
@SIMD
@pytest.mark.parametrize("out,n", [(1, 32), (3, 64), (13, 96), (67, 1024)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_matches_reference(out, n, m, use_simd):
    packed, scale = _random_weight(out, n, seed=out * n + m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    y = mxfp4_cpu.mxfp4_gemv(x, packed, scale, use_simd=use_simd)
    assert y.shape == (m, out) and y.dtype == torch.float32
    _assert_gemv_close(y, x, packed, scale)


@native
@SIMD
def test_gemv_every_code_and_scale_extreme(use_simd):
    packed, scale = _extreme_weight()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    y = mxfp4_cpu.mxfp4_gemv(x, packed, scale, use_simd=use_simd)
    _assert_gemv_close(y, x, packed, scale)
    # Scale 255 (NaN) poisons its rows; scale 254 decodes codes >= 2 to +-inf, whose sum is NaN.
    assert torch.isnan(y[:, 3:6]).all() and torch.isfinite(y[:, :3]).all()
    assert (y[:, 0] != 0).all()       # 2^-127 scaled products survive as subnormals


@native
def test_gemv_thread_split_gives_identical_results():
    packed, scale = _random_weight(523, 2048, seed=5)  # enough work for 4 threads; 523 = 4k + 3
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(5))
    ys = [mxfp4_cpu.mxfp4_gemv(x, packed, scale, threads=t) for t in (1, 2, 3, 4)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    _assert_gemv_close(ys[0], x, packed, scale)


@native
def test_gemv_accepts_strided_inputs_and_float8_scales():
    packed, scale = _random_weight(24, 256, seed=6)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    y = mxfp4_cpu.mxfp4_gemv(x, packed, scale)
    wide_p = torch.cat([packed, packed], dim=1)[:, :128]            # non-contiguous views
    wide_s = torch.cat([scale, scale], dim=1)[:, :8]
    x_t = x.T.contiguous().T
    assert not (wide_p.is_contiguous() or wide_s.is_contiguous() or x_t.is_contiguous())
    assert torch.equal(mxfp4_cpu.mxfp4_gemv(x_t, wide_p, wide_s), y)
    assert torch.equal(mxfp4_cpu.mxfp4_gemv(x, packed, scale.view(torch.float8_e8m0fnu)), y)


@native
def test_gemv_rejects_mismatched_shapes():
    packed, scale = _random_weight(4, 64, seed=7)
    with pytest.raises(ValueError, match="x must be"):
        mxfp4_cpu.mxfp4_gemv(torch.zeros(1, 32), packed, scale)
    with pytest.raises(ValueError, match="weight_scale shape"):
        mxfp4_cpu.mxfp4_gemv(torch.zeros(1, 64), packed, scale[:, :1])


@native
@SIMD
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_is_bit_exact(dtype, use_simd):
    for packed, scale in [_extreme_weight(), _random_weight(7, 96, seed=8, scales=(0, 256)),
                          _random_weight(1, 32, seed=9)]:
        w = mxfp4_cpu.mxfp4_dequant(packed, scale, dtype, use_simd=use_simd)
        ref = mxfp4_dequantize(packed, scale, dtype)
        assert w.dtype == dtype and torch.equal(torch.isnan(w), torch.isnan(ref))
        # torch's own float32 -> bf16 conversion writes NaN as 0x7FC0 or 0xFFFF depending on
        # its code path, so NaN payloads are not compared; every other value is, bit for bit.
        keep = ~torch.isnan(ref)
        assert torch.equal(_bits(w)[keep], _bits(ref)[keep])
        if dtype == torch.float32:
            assert torch.equal(_bits(w), _bits(ref))


@native
@pytest.mark.parametrize("rows", [1, 4, 16, 20])
def test_qlinear_dispatches_to_native_kernel(monkeypatch, rows):
    w = torch.randn(40, 160, generator=torch.Generator().manual_seed(rows))
    q = quantize(w, "mxfp4")
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = {"gemv": 0, "dequant": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(mxfp4_cpu, "mxfp4_gemv", counted("gemv", mxfp4_cpu.mxfp4_gemv))
    monkeypatch.setattr(mxfp4_cpu, "mxfp4_dequant", counted("dequant", mxfp4_cpu.mxfp4_dequant))
    y = linear.qlinear(x.view(1, rows, 160), q)
    assert y.shape == (1, rows, 40) and y.dtype == torch.bfloat16
    # Decode-sized batches use the gemv; larger ones dequantize natively and use a matmul.
    gemv = rows <= mxfp4_cpu.GEMV_MAX_ROWS
    assert calls == {"gemv": int(gemv), "dequant": int(not gemv)}
    ref = (x.float() @ mxfp4_dequantize(q.tensors["weight_packed"], q.tensors["weight_scale"]).T)
    assert torch.allclose(y[0].float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_qlinear_falls_back_to_torch_without_library(monkeypatch):
    q = quantize(torch.randn(24, 64, generator=torch.Generator().manual_seed(2)), "mxfp4")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    expect = linear.qlinear(x, q)                   # native when built, else already torch
    monkeypatch.setattr(mxfp4_cpu, "_library", lambda: None)
    assert not mxfp4_cpu.available()
    with pytest.raises(RuntimeError, match="not built"):
        mxfp4_cpu.mxfp4_gemv(x, q.tensors["weight_packed"], q.tensors["weight_scale"])
    y = linear.qlinear(x, q)
    packed, scale = q.tensors["weight_packed"], q.tensors["weight_scale"]
    assert torch.equal(y, x @ mxfp4_dequantize(packed, scale).T)
    _assert_gemv_close(expect, x, packed, scale)
    assert torch.equal(_bits(linear.dequantize(q)), _bits(mxfp4_dequantize(packed, scale)))
