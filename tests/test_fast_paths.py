"""The opt-in bf16-product path: its distance from the fp32 reference is measured, not assumed."""
from __future__ import annotations

import torch

import deltafin


def kl_and_top1(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    lp, lq = ref.log_softmax(-1), other.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == other.argmax(-1)).float().mean().item()


def test_bf16_products_stay_close_to_fp32(tiny_k3_path, tiny_kl_path):
    for path in (tiny_k3_path, tiny_kl_path):
        ref = deltafin.load(path, device="cpu", stream="off")
        fast = deltafin.load(path, device="cpu", stream="off", dtype="bfloat16")
        assert fast.engine.dtype == torch.float32  # states and the residual stream stay fp32
        g = torch.Generator().manual_seed(0)
        kls, tops = [], []
        for _ in range(4):
            ids = torch.randint(5, 500, (32,), generator=g).tolist()
            a, b = ref.logits(ids), fast.logits(ids)
            assert not torch.equal(a, b)  # the path really differs
            kl, top = kl_and_top1(a, b)
            kls.append(kl)
            tops.append(top)
        # Measured: tiny-k3 KL 0.11 / top-1 0.87. The synthetic weights are deliberately "hot" (every
        # term must move the logits), so small perturbations grow; real checkpoints are calmer.
        assert sum(kls) / 4 < 0.3 and sum(tops) / 4 > 0.75, (path.name, kls, tops)


def test_16_bit_products_on_the_cpu_take_the_fastest_kernel():
    """On the CPU a decode-sized 16-bit product is its rounded input row sent through the float32
    path (the native gemv); larger batches use torch's 16-bit GEMM only where the CPU has 16-bit
    instructions for it (else the float32 path again). Either way it is the product torch's
    16-bit matmul computes, up to summation order."""
    import torch.nn.functional as F
    from deltafin.kernels import cpu_native
    from deltafin.model.ops import HalfMatmul, cpu_16bit_gemm, linear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).bfloat16()
    for rows in (1, 3, cpu_native.GEMV_MAX_ROWS + 5):
        x = torch.randn(rows, 160, generator=g)
        for dtype in (torch.bfloat16, torch.float16):
            got = linear(x, HalfMatmul(w, dtype))
            assert got.dtype == torch.float32
            if rows > cpu_native.GEMV_MAX_ROWS and cpu_16bit_gemm(dtype):
                expect = F.linear(x.to(dtype), w.to(dtype)).float()
            else:
                expect = linear(x.to(dtype).float(), w).to(dtype).float()
            assert torch.equal(got, expect)
        if rows <= cpu_native.GEMV_MAX_ROWS and cpu_native.available():
            rounded = x.bfloat16().float()
            assert torch.equal(linear(x, HalfMatmul(w, torch.bfloat16)),
                               cpu_native.bf16_gemv(rounded, w).bfloat16().float())
        # torch's bf16 matmul: the same product up to summation order and the result's rounding
        torch.testing.assert_close(linear(x, HalfMatmul(w, torch.bfloat16)),
                                   F.linear(x.bfloat16(), w).float(), rtol=2 ** -7, atol=0.05)
