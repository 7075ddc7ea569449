"""Triton kernels of ``grouped.grouped_mlp`` (CUDA only; importing this imports Triton).

Pair j of the flattened expert index list is token j // TOPK times expert ids[j]. Each program
takes one pair and BN output rows and walks the inputs BK at a time, summing in fp32; the expert
id is read on the device, so no launch depends on the routing reaching the host. The gate and up
rows of one program are the same rows of the two halves of ``w13``, so the activation is applied
before anything is stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BN = 16
BK = 256


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _tanh(v):
    return 2.0 * _sigmoid(2.0 * v) - 1.0


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, H, INTER, TOPK: tl.constexpr, SITU: tl.constexpr,
                    BETA, LBETA, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    t = j // TOPK
    base = w_ptr + e * (2 * INTER * H)
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    nmask = n < INTER
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        x = tl.load(x_ptr + t * H + kk, mask=kmask, other=0.0)
        m = nmask[:, None] & kmask[None, :]
        wg = tl.load(base + n[:, None] * H + kk[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(base + (n[:, None] + INTER) * H + kk[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], 1)
        acc_u += tl.sum(wu * x[None, :], 1)
    if SITU:
        g = acc_g
        if BETA != 0.0:
            g = BETA * _tanh(acc_g / BETA)
        act = g * _sigmoid(acc_g)
        u = acc_u
        if LBETA != 0.0:
            u = LBETA * _tanh(acc_u / LBETA)
        y = act * u
    else:
        y = acc_g * _sigmoid(acc_g) * acc_u
    tl.store(out_ptr + j * INTER + n, y, mask=nmask)


@triton.jit
def _down_kernel(a_ptr, ids_ptr, w_ptr, out_ptr, H, INTER, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + j).to(tl.int64)
    base = w_ptr + e * (H * INTER)
    acc = tl.zeros([BN], dtype=tl.float32)
    nmask = n < H
    for k0 in range(0, INTER, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < INTER
        a = tl.load(a_ptr + j * INTER + kk, mask=kmask, other=0.0)
        w = tl.load(base + n[:, None] * INTER + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], 1)
    tl.store(out_ptr + j * H + n, acc, mask=nmask)


def grouped_gate_up(x: torch.Tensor, ids: torch.Tensor, topk: int, w13: torch.Tensor, cfg) -> torch.Tensor:
    """glu(w1 x, w3 x) for every pair: x fp32 [T, H], ids int32 [T*topk] -> fp32 [T*topk, I]."""
    pairs, (_, two_i, H) = ids.numel(), w13.shape
    inter = two_i // 2
    out = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    situ = cfg.hidden_act == "situ"
    grid = (pairs, triton.cdiv(inter, BN))
    _gate_up_kernel[grid](x, ids, w13.contiguous(), out, H, inter, TOPK=topk, SITU=situ,
                          BETA=float(cfg.situ_beta or 0.0) if situ else 0.0,
                          LBETA=float(cfg.situ_linear_beta or 0.0) if situ else 0.0, BN=BN, BK=BK)
    return out


def grouped_down(act: torch.Tensor, ids: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2[ids[j]] @ act[j] for every pair: act fp32 [P, I] -> fp32 [P, H]."""
    pairs, (_, H, inter) = ids.numel(), w2.shape
    out = torch.empty(pairs, H, dtype=torch.float32, device=act.device)
    _down_kernel[(pairs, triton.cdiv(H, BN))](act, ids, w2.contiguous(), out, H, inter, BN=BN, BK=BK)
    return out
