"""The KDA recurrence itself, on tensors and layer states (K3_MODEL.md section 3.1).

Per head, with state S in R^{Dk x Dv} (fp32):  S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q.
``kda_recurrent`` steps it row by row, ``kda_chunked`` is the equivalent chunked form for long prompt
pieces (``kda_prompt`` runs flash-linear-attention's chunked kernels instead on CUDA where that
package is installed, and ``kda_decode_fused`` its fused recurrent kernel for decode steps:
deltafin's own forms stay the fallback and the reference), and ``kda_rollback`` returns a layer
state to a row of its last check pass (the S recorded after that row, or, after the native steps,
the start state stepped over the accepted rows again). The sublayer around it (projections,
conv, gates) is ``kda.KDAttention``; the state classes are in ``state``, which this module does not
import (it only reads their fields).
"""
from __future__ import annotations

import functools
import inspect

import torch

from ..kernels import cpu_native


def kda_recurrent(q, k, v, g, beta, S, in_place: bool = False, trace: torch.Tensor | None = None):
    """q, k, g: [T, ..., H, Dk]; v: [T, ..., H, Dv]; beta: [T, ..., H]; S: [..., H, Dk, Dv].
    Returns o [T, ..., H, Dv] and the new S. The dims between T and H are independent sequences
    (a batch of them steps together). With in_place the new S is written over the given one (the
    caller gives it up), else the given S is left as it was. ``trace`` [T, ..., H, Dk, Dv], when
    given, receives S after each step (what a rollback to any row copies back).

    Each step updates S in place: a decode step of kl_medium's S (32 x 128 x 128 fp32, 2 MB per
    layer) allocated it twice per layer and token (S * decay, S + k u^T: 570 and 510 us on one core,
    against 150 and 180 us in place). The rank-1 update is one fused multiply-add per element
    (addcmul_), so S may differ from S + k u^T, which rounds k u^T first, in its last bit."""
    S = S if in_place else S.clone()
    outs = []
    for t in range(q.shape[0]):
        S.mul_(torch.exp(g[t]).unsqueeze(-1))
        kv = torch.einsum("...hd,...hdv->...hv", k[t], S)
        u = beta[t].unsqueeze(-1) * (v[t] - kv)
        S.addcmul_(k[t].unsqueeze(-1), u.unsqueeze(-2))
        outs.append(torch.einsum("...hd,...hdv->...hv", q[t], S))
        if trace is not None:
            trace[t].copy_(S)
    return torch.stack(outs), S


def kda_chunked(q, k, v, g, beta, S, chunk: int = 64):
    """The same recurrence over chunks of length `chunk`, exact up to rounding.

    Within a chunk with cumulative log decay G_t = sum_{s<=t} g_s and start state S0, the updates
    u_i = beta_i (v_i - S_{i-1,decayed}^T k_i) solve a unit lower-triangular system
    (I + A) u = beta (v - (k * exp(G)) S0),   A_ti = beta_t sum_d k_td k_id exp(G_td - G_id)  (i < t),
    and then o_t = (q_t * exp(G_t)) S0 + sum_{i<=t} (sum_d q_td k_id exp(G_td - G_id)) u_i.
    Decay ratios are formed as exp of differences (always <= 1), so nothing overflows.
    """
    T = q.shape[0]
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[s:s + chunk].transpose(0, 1) for x in (q, k, v, g, beta))  # head-major
        C = qc.shape[1]
        G = gc.cumsum(dim=1)  # [H, C, Dk]
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, C(t), C(i), Dk]
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(diff.masked_fill(~incl[None, :, :, None], float("-inf")))
        A = torch.einsum("htd,hid,htid->hti", kc, kc, decay) * bc.unsqueeze(-1)
        A = A.masked_fill(~incl.tril(-1)[None], 0.0)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("htd,hdv->htv", kc * torch.exp(G), S))
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("htd,hid,htid->hti", qc, kc, decay)
        o = torch.einsum("htd,hdv->htv", qc * torch.exp(G), S) + qk @ u
        G_end = G[:, -1:]  # [H, 1, Dk]
        S = torch.exp(G_end).transpose(1, 2) * S + torch.einsum("hid,hiv->hdv", kc * torch.exp(G_end - G), u)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs), S


def kda_prompt(q, k, v, g, beta, S, chunk: int = 64, fused: bool = True):
    """One sequence's long prompt piece (arguments as kda_chunked's: q already scaled, q and k
    normalized, g the log decay): with ``fused``, flash-linear-attention's ``chunk_kda`` on a CUDA
    device where it is installed (one fused pass over the chunks, fp32 state in and out; its
    products run on the tensor cores, at TF32 or bf16 precision), else ``kda_chunked``."""
    kernel = _fla_chunk_kda() if fused and q.is_cuda else None
    if kernel is None:
        return kda_chunked(q, k, v, g, beta, S, chunk)
    o, S = kernel(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=S[None].float(),
                  output_final_state=True)
    return o[0].float(), S[0].float()


def kda_prompt_fused(xin, tail, conv_w, g, beta, S, *, a_log, dt_bias, lower_bound, scale: float):
    """One sequence's prompt piece in flash-linear-attention's kernels: its causal conv with the SiLU,
    from and to the conv tail, then its chunked KDA with q and k normalized, q scaled, the decay
    formed from its low-rank input and beta's sigmoid taken inside. xin [3, n, D] float32 pre-conv q,
    k, v; tail [3, K-1, D] their previous K-1 inputs; conv_w [3, D, K]; g [1, n, H, Dk] the decay's
    input before dt_bias; beta [1, n, H] logits; S [H, Dk, Dv] float32. Returns (o [1, n, H, Dv]
    float32, the new S, the new tail [3, K-1, D]) (callers check ``fused_prompt_available``)."""
    conv, chunk = _fla_causal_conv(), _fla_chunk_kda()
    if conv is None or chunk is None:
        raise RuntimeError("KDA: flash-linear-attention's conv and chunked kernels are not installed")
    _, n, D = xin.shape
    K = conv_w.shape[-1]
    x = xin.transpose(0, 1).reshape(1, n, 3 * D)  # time-major, channels q | k | v
    # the kernel's state holds the last K inputs, oldest first; the conv reads the last K - 1 of them
    start = x.new_zeros(1, 3 * D, K)
    start[0, :, 1:] = tail.to(x.dtype).transpose(1, 2).reshape(3 * D, K - 1)
    y, end = conv(x, conv_w.reshape(3 * D, K).to(x.dtype), initial_state=start, output_final_state=True,
                  activation="silu")
    new_tail = end[0, :, 1:].reshape(3, D, K - 1).transpose(1, 2).contiguous()
    H, Dk = g.shape[2], g.shape[3]
    q, k, v = (t.reshape(1, n, H, -1).contiguous() for t in y.view(1, n, 3, D).unbind(2))
    o, S_new = chunk(q, k, v, g.contiguous(), beta.contiguous(), scale=scale, initial_state=S[None].float(),
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, A_log=a_log.float(), dt_bias=dt_bias.float(),
                     lower_bound=lower_bound)
    return o.float(), S_new[0].float(), new_tail.to(tail.dtype)


@functools.cache
def fused_prompt_available() -> bool:
    """Whether ``kda_prompt_fused`` has its kernels here (flash-linear-attention installed, this version's)."""
    chunk, conv = _fla_chunk_kda(), _fla_causal_conv()
    if chunk is None or conv is None:
        return False
    wanted = {"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "lower_bound"}
    return wanted <= set(inspect.signature(chunk).parameters) and \
        {"initial_state", "output_final_state", "activation"} <= set(inspect.signature(conv).parameters)


@functools.cache
def _fla_causal_conv():
    """flash-linear-attention's causal conv (Triton), or None where the package is not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def kda_decode_fused(q, k, v, g, beta, S, *, a_log, dt_bias, lower_bound, scale: float):
    """B sequences' steps of n rows each in one launch of flash-linear-attention's fused recurrent KDA
    kernel, S [B, H, Dk, Dv] (contiguous float32) stepped in place: the kernel takes what the torch
    step computes around the recurrence too (q and k normalized, q scaled, the decay from its low-rank
    input and the gate's constants, beta's sigmoid), each a few small launches a layer there.
    q, k, v, g (the decay's input before dt_bias): [B, n, H, D]; beta (logits): [B, n, H].
    Returns o [B, n, H, Dv] float32 (callers check ``fused_decode_available`` first)."""
    kernel = _fla_fused_recurrent_kda()
    if kernel is None or not S.is_contiguous():
        raise RuntimeError("KDA: the fused recurrent kernel is not installed, or a state is not contiguous")
    o, _ = kernel(q, k, v, g, beta, A_log=a_log.float(), dt_bias=dt_bias.float(), initial_state=S, scale=scale,
                  inplace_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    return o.float()


def fused_decode_available() -> bool:
    """Whether ``kda_decode_fused`` has its kernel here (flash-linear-attention installed, this version's)."""
    return _fla_fused_recurrent_kda() is not None


@functools.cache
def _fla_fused_recurrent_kda():
    """flash-linear-attention's fused recurrent KDA step (its in-place form), or None where the package
    (and Triton) is not installed or has no such function."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    # Not its public wrapper (which copies the state out): check that this version takes what is passed.
    wanted = {"inplace_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
              "lower_bound", "A_log", "dt_bias", "initial_state", "scale"}
    if not wanted <= set(inspect.signature(fused_recurrent_kda_fwd).parameters):
        return None
    return fused_recurrent_kda_fwd


@functools.cache
def _fla_chunk_kda():
    """flash-linear-attention's chunked KDA kernel, or None where the package (and Triton) is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def kda_rollback(st, keep: int) -> None:
    """Back to the state after the first ``keep`` rows of the last keep_states pass of a KDA layer
    state (its pending record): the state that pass reached after those rows, so the same bits."""
    p = st.pending
    if p is None:
        return
    if "native" in p:
        native_rollback(st, keep)
        st.pending = None
        return
    # Copied into the state's own tensors (the pass gave it fresh ones, or a recorded graph's slot,
    # which must keep its addresses); they were made by an inference-mode pass, so updated in one.
    # The pass kept S after each of its rows: a rollback is a copy, not a replay of the steps.
    with torch.inference_mode():
        st.S.copy_(p["S_rows"][keep - 1] if keep else p["S0"])
        # conv tail: the last K-1 pre-conv inputs among (old tail, first `keep` new inputs)
        Km1 = p["conv0"].shape[1]
        if Km1:
            seq = torch.cat([p["conv0"], p["xin"][:, :keep]], dim=1)
            st.conv.copy_(seq[:, seq.shape[1] - Km1:])
    st.pending = None


def native_rollback(st, keep: int) -> None:
    """Back to the state after the first ``keep`` rows of the last native pass (its pending record):
    the saved start state stepped over those rows again, the same call on the same inputs as a pass
    of only those rows, so the same bits. In the state's own tensors: a one-token pass replayed as its
    recorded native calls (runtime/cpu_replay.py) reads them where the recording saw them, so the
    passes after a check replay at once instead of recording again."""
    p = st.pending
    st.S.copy_(p["S0"])
    st.conv.copy_(p["conv0"])
    if keep:
        w = p["native"]
        D = p["r"].shape[1]
        cpu_native.kda_steps(p["xin"][:keep], [keep], [st.conv], r=p["r"][:keep], b=p["b"][:keep],
                             gate=torch.zeros(keep, D), states=[st.S], **w)
