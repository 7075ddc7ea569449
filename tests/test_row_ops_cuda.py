"""The one-launch CUDA row steps (RMSNorm, the depth mix, the KDA conv step and recurrence) against deltafin's torch
formulas on the CPU (a model's decode passes with and without them: test_cuda.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from deltafin.kernels import row_ops_triton  # noqa: E402
from deltafin.model.kda import causal_conv  # noqa: E402
from deltafin.model.kda_recurrence import kda_recurrent  # noqa: E402
from deltafin.model.layers import attn_res  # noqa: E402
from deltafin.model.ops import rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """Equal up to `steps` rounding steps of the dtype at each value (the kernels sum in another
    order), plus float32 noise relative to the largest value (where terms cancel)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_cuda
    g, w = got.cpu().double(), want.double()
    rel = steps * (2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -20)
    assert ((g - w).abs() <= w.abs() * rel + 1e-5 * w.abs().max()).all()


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 1000, 7168])
def test_rms_norm_matches_the_torch_formula(dtype, width):
    x, w = _randn(5, width, dtype=dtype, seed=width), _randn(width, dtype=dtype, seed=1)
    for weight in (w, None):
        want = rms_norm(x, weight, 1e-6)  # the CPU: the torch formula
        assert row_ops_triton.rms_norm_applies(x.cuda(), None if weight is None else weight.cuda())
        _close(rms_norm(x.cuda(), None if weight is None else weight.cuda(), 1e-6), want)
    # a strided input (MLA's latent keys are a slice) and a float32 weight on 16-bit rows
    wide = _randn(3, 4, width + 64, dtype=dtype, seed=2)
    _close(rms_norm(wide.cuda()[..., :width], w.float().cuda(), 1e-6), rms_norm(wide[..., :width], w.float(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [0, 1, 5])
def test_depth_mix_matches_the_torch_formula(dtype, blocks):
    H = 2304
    p = _randn(6, H, dtype=dtype, seed=3)
    bs = [_randn(6, H, dtype=dtype, seed=10 + i) * (i + 1) for i in range(blocks)]
    wp, wn = _randn(1, H, dtype=dtype, seed=4), _randn(H, dtype=dtype, seed=5)
    want = attn_res(p, bs, wp, wn, 1e-6)
    assert row_ops_triton.depth_mix_applies(p.cuda(), [b.cuda() for b in bs], wp.cuda(), wn.cuda())
    _close(attn_res(p.cuda(), [b.cuda() for b in bs], wp.cuda(), wn.cuda(), 1e-6), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, n, D, K", [(1, 1, 4096, 4), (3, 1, 200, 4), (2, 5, 130, 4), (2, 40, 64, 3)])
def test_conv_step_matches_the_torch_formula_and_moves_the_tails(dtype, B, n, D, K):
    xin, tail = _randn(B, 3, n, D, dtype=dtype, seed=6), _randn(B, 3, K - 1, D, dtype=dtype, seed=7)
    taps = tuple(_randn(D, K, dtype=torch.float32, seed=8 + j) for j in range(3))
    want = F.silu(causal_conv(xin, tail, torch.stack(taps))).transpose(0, 1)  # [3, B, n, D]
    want_tail = torch.cat([tail, xin], dim=2)[:, :, -(K - 1):]
    taps_d = tuple(t.cuda() for t in taps)
    # xin as the layer has it: a transposed view of [3, B, n, D]
    x_d = xin.transpose(0, 1).contiguous().cuda().transpose(0, 1)
    assert row_ops_triton.conv_step_applies(x_d, tail.cuda(), taps_d)
    new_tail = torch.empty_like(tail).cuda()
    _close(row_ops_triton.conv_step(x_d, tail.cuda(), taps_d, new_tail), want, steps=2)
    assert torch.equal(new_tail.cpu(), want_tail)
    in_place = tail.cuda()  # the tails of a decode graph's slots move on where they are
    got = row_ops_triton.conv_step(x_d, in_place, taps_d, in_place, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got.to(dtype), got)  # rounded to xin's dtype first
    _close(got.to(dtype), want, steps=2)
    assert torch.equal(in_place.cpu(), want_tail)


@pytest.mark.parametrize("T,B,H,DK,DV", [(1, 1, 32, 128, 128), (1, 8, 4, 128, 128), (5, 3, 2, 64, 96),
                                           (2, 2, 3, 24, 20)])
def test_kda_step_matches_the_torch_recurrence(T, B, H, DK, DV):
    """Rows of B sequences stepped in one launch, S in place, the trace after each row: the CPU's
    kda_recurrent (float32) on the same inputs, given as the model gives them (time-major views)."""
    q, k = _randn(B, T, H, DK, dtype=torch.float32, seed=1), _randn(B, T, H, DK, dtype=torch.float32, seed=2)
    q, k = F.normalize(q, dim=-1) * DK ** -0.5, F.normalize(k, dim=-1)
    v = _randn(B, T, H, DV, dtype=torch.float32, seed=3)
    g = -torch.rand(B, T, H, DK, generator=torch.Generator().manual_seed(4))
    beta = torch.rand(B, T, H, generator=torch.Generator().manual_seed(5))
    S0 = _randn(B, H, DK, DV, dtype=torch.float32, seed=6)
    want_trace = torch.empty(T, B, H, DK, DV)
    want_o, want_S = kda_recurrent(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), S0.clone(), trace=want_trace)
    S, trace = S0.cuda(), torch.empty(T, B, H, DK, DV, device="cuda")
    rows = [t.cuda().transpose(0, 1) for t in (q, k, v, g, beta)]
    assert row_ops_triton.kda_step_applies(rows[0], S)
    o = row_ops_triton.kda_step(*rows, S, trace)
    _close(o, want_o, 4)
    _close(S, want_S, 4)
    _close(trace, want_trace, 4)
    S2 = S0.cuda()  # without a trace
    _close(row_ops_triton.kda_step(*rows, S2), want_o, 4)
    _close(S2, want_S, 4)


def test_shapes_the_kernels_do_not_take_fall_back():
    x = torch.zeros(2, 20000, device="cuda")
    assert not row_ops_triton.rms_norm_applies(x, None)
    assert torch.equal(rms_norm(x, None, 1e-6), x)
    assert not row_ops_triton.rms_norm_applies(x[:, :8], torch.ones(9, device="cuda"))
    xin, taps = torch.zeros(1, 3, 1, 64, device="cuda"), (torch.zeros(64, 1, device="cuda"),) * 3
    assert not row_ops_triton.conv_step_applies(xin, torch.zeros(1, 3, 0, 64, device="cuda"), taps)
