"""Weight codecs on the CPU: error bounds, exact decoding, fused matmul, (de)serialization."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltafin.kernels import (CODECS, QWeight, dequantize, mxfp4_dequantize, mxfp4_linear,
                              mxfp4_quantize, qlinear, quantize)
from deltafin.kernels import cpu_native, intq, linear
from deltafin.kernels.int8 import int8_round_inputs


def _weight(out: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, as in real checkpoints, so scales vary a lot.
    return torch.randn(out, n, generator=g) * torch.logspace(-3, 1, out).unsqueeze(1)


# ---------------------------------------------------------------- int8

def test_int8_error_within_half_a_step_per_row():
    w = _weight(64, 96)
    w[5] = 0.0
    q = quantize(w, "int8")
    codes, scale = q.tensors["weight"], q.tensors["weight_scale"]
    assert codes.dtype == torch.int8 and scale.shape == (64, 1)
    assert codes.abs().max() <= 127
    assert torch.allclose(scale.squeeze(1), w.abs().amax(1) / 127)
    err = (dequantize(q) - w).abs()
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-30).all()
    assert (dequantize(q)[5] == 0).all() and scale[5] == 0


# ---------------------------------------------------------------- int4 / int6

@pytest.mark.parametrize("codec", ["int4", "int6"])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_intq_error_within_half_a_step_per_group(codec, group):
    out, n = 24, 192
    w = _weight(out, n, seed=group)
    q = quantize(w, codec, group_size=group)
    scale = q.tensors["weight_scale"]
    assert scale.dtype == torch.float16 and scale.shape == (out, n // group)
    amax = w.view(out, n // group, group).abs().amax(-1)
    # Stored scales are rounded up, never down, so nothing clips.
    assert (scale.float() >= amax / intq.qmax(codec)).all()
    err = (dequantize(q) - w).view(out, n // group, group).abs()
    assert (err <= scale.float().unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert q.tensors["weight_packed"].shape == (out, intq.packed_width(codec, n))


@pytest.mark.parametrize("codec", ["int4", "int6"])
def test_intq_pack_unpack_every_code(codec):
    lo, hi = -intq.offset(codec), intq.offset(codec) - 1
    codes = torch.arange(lo, hi + 1, dtype=torch.int32).repeat(3, 4)
    codes = codes[:, torch.randperm(codes.shape[1], generator=torch.Generator().manual_seed(1))]
    assert torch.equal(intq.unpack(intq.pack(codes, codec), codec), codes)


def test_intq_packed_layouts_by_hand():
    # int4: element 0 in the low nibble, stored as code + 8.
    assert intq.pack(torch.tensor([[-8, 7]]), "int4").tolist() == [[0xF0]]
    # int6: u = code + 32 = 1, 2, 3, 4 -> word 1 | 2<<6 | 3<<12 | 4<<18 = 0x103081, low byte first.
    assert intq.pack(torch.tensor([[-31, -30, -29, -28]]), "int6").tolist() == [[0x81, 0x30, 0x10]]


# ---------------------------------------------------------------- MXFP4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pack_codes(codes: list[int]) -> torch.Tensor:
    c = torch.tensor(codes, dtype=torch.uint8).view(1, -1)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def test_mxfp4_decodes_every_code():
    codes = list(range(16)) * 2
    packed = _pack_codes(codes)
    assert packed[0, 0] == 0x10  # codes 0 (low nibble) and 1 (high nibble)
    w = mxfp4_dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))
    expected = E2M1 + [-v for v in E2M1]
    assert w[0].tolist() == expected * 2


def test_mxfp4_scale_extremes():
    codes = [2, 1, 10] + [0] * 29  # 1.0, 0.5, -1.0
    packed = _pack_codes(codes * 4)
    scale = torch.tensor([[0, 1, 254, 255]], dtype=torch.uint8)
    w = mxfp4_dequantize(packed, scale)
    assert w[0, 0].item() == math.ldexp(1.0, -127) and w[0, 1].item() == math.ldexp(1.0, -128)
    assert w[0, 2].item() == -math.ldexp(1.0, -127)
    assert w[0, 32].item() == math.ldexp(1.0, -126)
    assert w[0, 64].item() == math.ldexp(1.0, 127) and w[0, 65].item() == math.ldexp(1.0, 126)
    assert torch.isnan(w[0, 96:]).all()  # E8M0 255 is NaN: the whole group is poisoned


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu")
def test_mxfp4_reads_float8_scale_bits():
    packed = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    scale = torch.randint(100, 150, (4, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mxfp4_dequantize(packed, scale.view(torch.float8_e8m0fnu)),
                       mxfp4_dequantize(packed, scale))


def _representable(out: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, n), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 0                    # no negative zero: it re-encodes as +0
    codes[:, ::32] = 7                       # every group reaches magnitude 6, fixing its scale
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(90, 160, (out, n // 32), generator=gen, dtype=torch.uint8)
    return packed, scale, mxfp4_dequantize(packed, scale)


def test_mxfp4_round_trip_of_representable_values_is_exact():
    packed, scale, w = _representable(16, 128, seed=4)
    p2, s2 = mxfp4_quantize(w)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # Groups whose largest magnitude is below 6 get a smaller factor but still decode exactly.
    w_small = w.clone()
    w_small[:, ::32] = w_small[:, 1::32]
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w_small)), w_small)


def test_mxfp4_quantize_picks_smallest_fitting_scale_and_nearest_value():
    w = _weight(8, 256, seed=5)
    packed, scale = mxfp4_quantize(w)
    factor = torch.ldexp(torch.ones(scale.shape), scale.int() - 127)
    amax = w.view(8, 8, 32).abs().amax(-1)
    assert (amax <= 6 * factor).all() and (amax > 3 * factor).all()
    grid = torch.tensor(E2M1 + [-v for v in E2M1])
    candidates = grid.view(1, 1, 1, 16) * factor.view(8, 8, 1, 1)
    best = (candidates - w.view(8, 8, 32, 1)).abs().amin(-1)
    got = (mxfp4_dequantize(packed, scale) - w).view(8, 8, 32).abs()
    assert torch.equal(got, best)


def test_mxfp4_ties_round_to_even():
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24).view(1, 32)
    w = mxfp4_dequantize(*mxfp4_quantize(row))
    assert w[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


# ---------------------------------------------------------------- fused matmul

@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("rows", [1, 37])
def test_qlinear_matches_dequantize_then_matmul(codec, rows, monkeypatch):
    # A small block size makes the weight span many blocks, the last one partial.
    monkeypatch.setattr(linear, "BLOCK_ELEMS", 7 * 128)
    q = quantize(_weight(100, 128, seed=6), codec)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(7))
    y = qlinear(x, q)
    if codec == "int8" and cpu_native.available() and rows <= cpu_native.GEMV_MAX_ROWS:
        x = int8_round_inputs(x).float()  # the native int8 products round x first
    ref = x @ dequantize(q).t()
    assert y.shape == (rows, 100) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("codec", CODECS)
def test_qlinear_of_no_rows_is_empty(codec):
    y = qlinear(torch.zeros(0, 128), quantize(_weight(100, 128), codec))
    assert y.shape == (0, 100) and y.dtype == torch.float32


def test_qlinear_keeps_leading_dims_and_dtype():
    q = quantize(_weight(20, 64), "int4")
    x = torch.randn(2, 3, 64)
    y = qlinear(x.bfloat16(), q)
    assert y.shape == (2, 3, 20) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.bfloat16().float() @ dequantize(q).t()), rtol=1e-2, atol=1e-2)


def test_mxfp4_linear_matches_dequantize_then_matmul():
    packed, scale = mxfp4_quantize(_weight(48, 96, seed=8))
    x = torch.randn(5, 96)
    torch.testing.assert_close(mxfp4_linear(x, packed, scale), x @ mxfp4_dequantize(packed, scale).t(),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- storage

@pytest.mark.parametrize("codec", CODECS)
def test_to_tensors_from_tensors_round_trip_through_safetensors(codec, tmp_path):
    q = quantize(_weight(40, 128, seed=9), codec, group_size=64 if codec in ("int4", "int6") else 32)
    prefix = "model.layers.3.self_attn.q_proj."
    named = q.to_tensors(prefix)
    assert all(name.startswith(prefix) for name in named)
    save_file(named, str(tmp_path / "w.safetensors"))
    q2 = QWeight.from_tensors(load_file(str(tmp_path / "w.safetensors")), prefix, codec)
    assert (q2.codec, q2.shape, q2.group_size, q2.nbytes) == (q.codec, q.shape, q.group_size, q.nbytes)
    assert all(torch.equal(q2.tensors[k], q.tensors[k]) for k in q.tensors)
    assert torch.equal(dequantize(q2), dequantize(q))


def test_nbytes_counts_codes_and_scales():
    out, n = 16, 128
    w = _weight(out, n)
    assert quantize(w, "bf16").nbytes == out * n * 2
    assert quantize(w, "int8").nbytes == out * n + out * 4
    assert quantize(w, "int4").nbytes == out * n // 2 + out * n // 32 * 2
    assert quantize(w, "int6").nbytes == out * n * 3 // 4 + out * n // 32 * 2
    assert quantize(w, "mxfp4").nbytes == out * n // 2 + out * n // 32


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu")
def test_from_tensors_accepts_e8m0_labelled_scales():
    packed, scale = mxfp4_quantize(_weight(8, 64))
    q = QWeight.from_tensors({"w.weight_packed": packed, "w.weight_scale": scale.view(torch.float8_e8m0fnu)},
                             "w.", "mxfp4")
    assert q.tensors["weight_scale"].dtype == torch.uint8 and torch.equal(q.tensors["weight_scale"], scale)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("codec, shape, group, match", [
    ("int4", (8, 100), 32, "not divisible by the group size"),
    ("int6", (8, 6), 2, "multiple of 4"),
    ("int4", (8, 64), 0, "group size must be positive"),
    ("mxfp4", (8, 48), 32, "multiple of the group size"),
    ("mxfp4", (8, 64), 64, "fixed group size"),
    ("int8", (8,), 32, "2-D"),
    ("fp8", (8, 64), 32, "unknown codec"),
])
def test_quantize_rejects_bad_shapes(codec, shape, group, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(*shape), codec, group_size=group)


def test_quantize_rejects_non_finite_weights():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    for codec in ("int8", "int4", "int6", "mxfp4"):
        with pytest.raises(ValueError, match="NaN"):
            quantize(w, codec)


def test_mismatched_tensors_are_rejected():
    q = quantize(_weight(8, 64), "int4")
    named = q.to_tensors("p.")
    with pytest.raises(ValueError, match="lacks tensor 'p.weight_scale'"):
        QWeight.from_tensors({"p.weight_packed": named["p.weight_packed"]}, "p.", "int4")
    with pytest.raises(ValueError, match="weight_scale"):
        QWeight.from_tensors({**named, "p.weight_scale": named["p.weight_scale"][:4]}, "p.", "int4")
    # int8 scales that are neither per row nor groups of a multiple of 32: named by the weight
    g = quantize(_weight(8, 64), "int8", 32).to_tensors("layer.o_proj.")
    for bad in (g["layer.o_proj.weight_scale"].float(), g["layer.o_proj.weight_scale"].repeat(1, 2)):
        with pytest.raises(ValueError, match=r"^layer\.o_proj: int8"):
            QWeight.from_tensors({**g, "layer.o_proj.weight_scale": bad}, "layer.o_proj.", "int8")
    with pytest.raises(ValueError, match="declared shape"):
        QWeight("int4", (8, 32), 32, q.tensors)
    with pytest.raises(ValueError, match="does not match"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_qlinear_rejects_wrong_width_and_unavailable_kernel():
    q = quantize(_weight(8, 64), "int8")
    with pytest.raises(ValueError, match="input width 32"):
        qlinear(torch.randn(1, 32), q)
    with pytest.raises(ValueError, match="Triton kernel cannot run"):
        qlinear(torch.randn(1, 64), q, use_triton=True)
