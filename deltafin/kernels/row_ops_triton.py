"""One-launch CUDA forms of a decode pass's small per-row steps, in Triton.

Outside its matrix products a decode pass is many small kernels of a few KB each: torch takes ~4
for an RMSNorm with its dtype casts, ~10 for a Block Attention Residual mix and ~10 for a KDA conv
step (what they cost shows most in passes that are not replayed graphs, and in batches; a replayed
one-row pass launches cheaply). Each function here does one of them in one launch, with the formulas of
the torch code it stands in for (fp32 arithmetic, the result in the input's dtype); only the order
of the sums differs. Importing this imports Triton; ``model.ops`` does that lazily, on the first
CUDA input, and keeps the torch code where Triton is missing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 16384  # rows up to this width are held whole in one program's registers
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 1


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, W, stride_x, eps, HAS_W: tl.constexpr, BW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BW)
    mask = i < W
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / W + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * W + i, y, mask=mask)


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    W = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype in DTYPES and 0 < W <= MAX_WIDTH and x.numel() > 0
            and (weight is None or (weight.is_cuda and weight.dtype in DTYPES and weight.is_contiguous()
                                    and tuple(weight.shape) == (W,))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32, the result in x's dtype."""
    W = x.shape[-1]
    rows = x.reshape(-1, W)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    BW = triton.next_power_of_2(W)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight if weight is not None else rows, y, W, rows.stride(0), eps,
                                       HAS_W=weight is not None, BW=BW, num_warps=_warps(BW))
    return y.view(x.shape)


@triton.jit
def _depth_mix_kernel(blocks_ptr, p_ptr, wn_ptr, wp_ptr, out_ptr, N, H, stride_block, stride_row, eps,
                      NB: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BH)
    mask = i < H
    wq = tl.load(wn_ptr + i, mask=mask, other=0.0).to(tl.float32) * tl.load(wp_ptr + i, mask=mask, other=0.0).to(tl.float32)
    slot = tl.arange(0, NB)  # the N blocks' scores, then p's at N
    vp = tl.load(p_ptr + row * stride_row + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(vp * wq, 0) * tl.rsqrt(tl.sum(vp * vp, 0) / H + eps)
    score = tl.where(slot == N, s, float("-inf"))
    for n in range(N):
        v = tl.load(blocks_ptr + n * stride_block + row * stride_row + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(v * wq, 0) * tl.rsqrt(tl.sum(v * v, 0) / H + eps)
        score = tl.where(slot == n, s, score)
    prob = tl.exp(score - tl.max(score, 0))
    prob = prob / tl.sum(prob, 0)
    acc = tl.sum(tl.where(slot == N, prob, 0.0), 0) * vp
    for n in range(N):
        v = tl.load(blocks_ptr + n * stride_block + row * stride_row + i, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(slot == n, prob, 0.0), 0) * v
    tl.store(out_ptr + row * stride_row + i, acc, mask=mask)


def depth_mix_applies(p: torch.Tensor, blocks: list[torch.Tensor], w_proj: torch.Tensor, w_norm: torch.Tensor) -> bool:
    H = p.shape[-1] if p.dim() else 0
    return (p.is_cuda and p.dtype in DTYPES and p.is_contiguous() and 0 < H <= MAX_WIDTH and p.numel() > 0
            and all(b.shape == p.shape and b.dtype == p.dtype and b.device == p.device for b in blocks)
            and all(w.is_cuda and w.dtype in DTYPES and w.is_contiguous() and w.numel() == H for w in (w_proj, w_norm)))


def depth_mix(p: torch.Tensor, blocks: list[torch.Tensor], w_proj: torch.Tensor, w_norm: torch.Tensor,
              eps: float) -> torch.Tensor:
    """``layers.attn_res``: each row's softmax mix over [blocks..., p], weighted by the RMS-normed
    values' dot with w_norm * w_proj, in fp32; the result in p's dtype."""
    H = p.shape[-1]
    rows = p.numel() // H
    stack = torch.stack(blocks) if blocks else p.unsqueeze(0)  # one launch; unread when there are none
    out = torch.empty_like(p)
    _depth_mix_kernel[(rows,)](stack, p, w_norm, w_proj, out, len(blocks), H, stack.stride(0), H, eps,
                               NB=triton.next_power_of_2(len(blocks) + 1), BH=triton.next_power_of_2(H),
                               num_warps=_warps(H))
    return out


@triton.jit
def _conv_step_kernel(x_ptr, tail_ptr, wq_ptr, wk_ptr, wv_ptr, out_ptr, new_tail_ptr, n, D,
                      sxb, sxj, sxt, stb, stj, stt, snb, snj, snt,
                      K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    bj = tl.program_id(0)
    b, j = bj // 3, bj % 3
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = c < D
    t = tl.program_id(2) * BT + tl.arange(0, BT)
    tmask = t < n
    dt = x_ptr.dtype.element_ty  # the torch code rounds taps, tails and the conv to the inputs' dtype
    w_ptr = tl.where(j == 0, wq_ptr, tl.where(j == 1, wk_ptr, wv_ptr))
    x_base = x_ptr + b.to(tl.int64) * sxb + j * sxj
    tail_base = tail_ptr + b.to(tl.int64) * stb + j * stj
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        s = t + k  # the output at t reads [tail, x][t + k]: the tail's K-1 rows, then x's
        from_tail = s < K - 1
        m = tmask[:, None] & cmask[None, :]
        v = tl.load(tail_base + s[:, None] * stt + c[None, :], mask=m & from_tail[:, None], other=0.0).to(dt)
        v += tl.load(x_base + (s - (K - 1))[:, None] * sxt + c[None, :], mask=m & ~from_tail[:, None], other=0.0)
        tap = tl.load(w_ptr + c * K + k, mask=cmask, other=0.0).to(dt).to(tl.float32)
        acc += v.to(tl.float32) * tap[None, :]
    acc = acc.to(dt).to(tl.float32)
    y = (acc * tl.sigmoid(acc)).to(dt)
    out = out_ptr + ((j * (tl.num_programs(0) // 3) + b).to(tl.int64) * n + t[:, None]) * D + c[None, :]
    if tl.program_id(2) == 0:  # the new tail: the last K-1 rows of [tail, x]; only this program read the old one
        r = tl.arange(0, BT)
        rmask = r < K - 1
        s = n + r
        from_tail = s < K - 1
        m = rmask[:, None] & cmask[None, :]
        v = tl.load(tail_base + s[:, None] * stt + c[None, :], mask=m & from_tail[:, None], other=0.0).to(dt)
        v += tl.load(x_base + (s - (K - 1))[:, None] * sxt + c[None, :], mask=m & ~from_tail[:, None], other=0.0)
        tl.debug_barrier()  # every read of the old tail before it is overwritten (it may be written in place)
        tl.store(new_tail_ptr + b.to(tl.int64) * snb + j * snj + r[:, None] * snt + c[None, :], v, mask=m)
    tl.store(out, y, mask=tmask[:, None] & cmask[None, :])


CONV_ROWS = 16  # time rows per program of the conv step


def conv_step_applies(xin: torch.Tensor, tail: torch.Tensor, ws: tuple) -> bool:
    K = ws[0].shape[-1]
    return (xin.is_cuda and xin.dtype in DTYPES and xin.dim() == 4 and xin.shape[1] == 3 and xin.stride(-1) == 1
            and tail.dim() == 4 and tail.shape[:2] == xin.shape[:2] and tail.shape[-1] == xin.shape[-1]
            and tail.stride(-1) == 1 and tail.dtype in DTYPES and 2 <= K <= CONV_ROWS + 1 and tail.shape[2] == K - 1
            and all(w.is_cuda and w.dtype in DTYPES and w.is_contiguous() and w.shape == (xin.shape[-1], K)
                    for w in ws))


def conv_step(xin: torch.Tensor, tail: torch.Tensor, ws: tuple, new_tail: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(causal conv) of B sequences' q, k, v inputs xin [B, 3, n, D] after their tails [B, 3, K-1, D]
    with the taps ws = (q [D, K], k, v): returns [3, B, n, D], rounded to xin's dtype and stored in
    out_dtype (xin's by default), and writes the last K-1 rows of [tail, x] into new_tail [B, 3, K-1, D]
    (which may be ``tail`` itself)."""
    B, _, n, D = xin.shape
    out = torch.empty(3, B, n, D, dtype=out_dtype or xin.dtype, device=xin.device)
    BD = 128
    grid = (3 * B, triton.cdiv(D, BD), max(1, triton.cdiv(n, CONV_ROWS)))
    _conv_step_kernel[grid](xin, tail, *ws, out, new_tail, n, D, *xin.stride()[:3], *tail.stride()[:3],
                            *new_tail.stride()[:3], K=ws[0].shape[-1], BT=CONV_ROWS, BD=BD, num_warps=4)
    return out


@triton.jit
def _kda_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, tr_ptr, T, BH, DK, DV,
                     HAS_TRACE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # one (sequence, head) and BV of its value columns: S [DK, BV] stays in registers for all T rows
    bh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BV + tl.arange(0, BV)
    d = tl.arange(0, BK)
    dm, jm = d < DK, j < DV
    m = dm[:, None] & jm[None, :]
    s_at = s_ptr + bh * DK * DV + d[:, None] * DV + j[None, :]
    S = tl.load(s_at, mask=m, other=0.0)
    for t in range(T):
        row = t * BH + bh  # inputs are [T, B * H, ...] contiguous
        g = tl.load(g_ptr + row * DK + d, mask=dm, other=0.0)
        k = tl.load(k_ptr + row * DK + d, mask=dm, other=0.0)
        q = tl.load(q_ptr + row * DK + d, mask=dm, other=0.0)
        v = tl.load(v_ptr + row * DV + j, mask=jm, other=0.0)
        beta = tl.load(b_ptr + row)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.sum(k[:, None] * S, 0))
        S = S + k[:, None] * u[None, :]
        tl.store(o_ptr + row * DV + j, tl.sum(q[:, None] * S, 0), mask=jm)
        if HAS_TRACE:
            tl.store(tr_ptr + row * DK * DV + d[:, None] * DV + j[None, :], S, mask=m)
    tl.store(s_at, S, mask=m)


KDA_MAX_DK = 256  # a head's key width held whole in one program


def kda_step_applies(q: torch.Tensor, S: torch.Tensor) -> bool:
    return (S.is_cuda and S.dtype == torch.float32 and S.is_contiguous() and q.dtype == torch.float32
            and S.dim() >= 3 and q.dim() == S.dim() and S.shape[-2] <= KDA_MAX_DK and S.numel() > 0)


def kda_step(q, k, v, g, beta, S: torch.Tensor, trace: torch.Tensor | None = None) -> torch.Tensor:
    """``kda_recurrence.kda_recurrent`` with ``in_place`` in one launch: q, k, g [T, ..., H, Dk]; v [T, ..., H,
    Dv]; beta [T, ..., H] (float32); S [..., H, Dk, Dv] float32, contiguous, stepped in place over the T rows
    (each program keeps its part of S in registers, so S is read and written once whatever T, where the
    torch steps read it four times and write it twice a row); ``trace`` [T, ..., H, Dk, Dv], when given,
    receives S after each row. Returns o [T, ..., H, Dv]. The same formulas (the decay, the delta rule's
    fused update); only the order of the sums over Dk differs."""
    T, DK, DV = q.shape[0], S.shape[-2], S.shape[-1]
    BH = S.numel() // (DK * DV)
    q, k, g = (x.reshape(T, BH, DK).contiguous() for x in (q, k, g))
    v, beta = v.reshape(T, BH, DV).contiguous(), beta.reshape(T, BH).contiguous()
    o = torch.empty((T, BH, DV), dtype=torch.float32, device=S.device)
    if trace is not None and not trace.is_contiguous():
        raise ValueError("kda_step: the trace must be contiguous")
    BK = triton.next_power_of_2(DK)
    BV = max(16, min(32, triton.next_power_of_2(DV), 8192 // BK))
    _kda_step_kernel[(BH, triton.cdiv(DV, BV))](q, k, v, g, beta, S, o, trace if trace is not None else S, T, BH,
                                                 DK, DV, HAS_TRACE=trace is not None, BK=BK, BV=BV, num_warps=4)
    return o.view(T, *S.shape[:-2], DV)
