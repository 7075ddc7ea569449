"""Triton dequant-matmul kernels against the torch reference, on a CUDA GPU."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from deltafin.kernels import QWeight, dequantize, qlinear, quantize  # noqa: E402
from deltafin.kernels import triton_kernels  # noqa: E402

DEV = "cuda"
# int8: row scales (group 0), or float16 scales per 32 / 128 inputs (the GEMV kernel at any row count)
CASES = [("int8", 0, 1040), ("int8", 32, 1024), ("int8", 128, 1024), ("int4", 32, 1024), ("int4", 128, 1024),
         ("int6", 32, 1024), ("int6", 16, 1024),
         ("mxfp4", 32, 1024)]


def _weight(out: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(out, n, generator=g, device=DEV) * torch.logspace(-2, 1, out, device=DEV).unsqueeze(1)


def _check(y: torch.Tensor, x: torch.Tensor, q: QWeight) -> None:
    w = dequantize(q)
    ref = x.float() @ w.t()
    # Error measured against the sum of |products|: the kernels differ from fp32 only in the
    # order of summation and, on the tensor cores with a float32 x, in the ~16-bit split of x.
    scale = x.float().abs() @ w.abs().t() + 1e-30
    tol = 4e-3 if y.dtype == torch.bfloat16 else 1e-4  # bf16 output rounding dominates there
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    assert ((y.float() - ref).abs() / scale).max().item() < tol


@pytest.mark.parametrize("codec, group, n", CASES)
@pytest.mark.parametrize("rows", [1, 16])
def test_autotuned_kernels_match_reference(codec, group, n, rows):
    # 304 output rows: a multiple of 16 (the benchmark's kernels serve) but not of every tile.
    q = quantize(_weight(304, n, seed=group + rows), codec, group_size=group)
    x = torch.randn(rows, n, device=DEV)
    _check(qlinear(x, q, use_triton=True), x, q)


@pytest.mark.parametrize("codec, group, n", CASES)
@pytest.mark.parametrize("method, rows, dtype", [("gemv", 1, torch.float32), ("gemv", 3, torch.bfloat16),
                                                 ("dot", 1, torch.bfloat16), ("dot", 5, torch.float32)])
def test_each_kernel_with_k_slices_matches_reference(codec, group, n, method, rows, dtype):
    q = quantize(_weight(200, n, seed=7), codec, group_size=group)
    x = torch.randn(rows, n, device=DEV).to(dtype)
    config = {"BN": 32, "SPLITS": 2}
    if method == "gemv" or codec == "int8":
        config["BK"] = 256 if method == "gemv" else 128
    y = triton_kernels.qlinear_triton(x, codec, q.tensors, q.group_size, method=method, config=config)
    _check(y, x, q)


@pytest.mark.parametrize("method", ["gemv", "dot"])
def test_mxfp4_scale_extremes_on_gpu(method):
    gen = torch.Generator(device=DEV).manual_seed(3)
    packed = torch.randint(0, 256, (32, 32), dtype=torch.uint8, device=DEV, generator=gen)
    packed[:, :16] &= 0x77  # first group non-negative so sums of huge values cannot cancel
    scale = torch.tensor([0, 1, 2, 100, 127, 150, 200, 230] * 4, dtype=torch.uint8, device=DEV)
    scale = torch.stack([scale, torch.full_like(scale, 127)], 1)
    scale[31, 1] = 255
    q = QWeight("mxfp4", (32, 64), 32, {"weight_packed": packed, "weight_scale": scale})
    x = torch.zeros(1, 64, device=DEV)
    x[0, :32] = 1.0
    y = triton_kernels.qlinear_triton(x, "mxfp4", q.tensors, 32, method=method)
    ref = qlinear(x, q, use_triton=False)
    assert torch.isnan(y[0, 31]) and torch.isnan(ref[0, 31])
    torch.testing.assert_close(y[0, :31], ref[0, :31], rtol=1e-6, atol=0.0)


def test_more_rows_than_the_kernels_take_use_the_reference():
    q = quantize(_weight(64, 256, seed=4), "int4")
    x = torch.randn(17, 256, device=DEV)
    torch.testing.assert_close(qlinear(x, q), x @ dequantize(q).t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most 16 rows"):
        triton_kernels.qlinear_triton(x, "int4", q.tensors, 32)
