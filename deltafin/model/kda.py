"""Kimi Delta Attention (K3_MODEL.md section 3.1).

Per head, with state S in R^{Dk x Dv} (fp32):  S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q.
The recurrence itself (step by step, chunked, rollback) is in kda_recurrence; this is the sublayer around it.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from ..kernels import cpu_native
from ..kernels.kept import KeptByWeights
from ..kernels.linear import dense_kind, native_dense
from .binding import Bindable
from .ops import HalfMatmul, l2_normalize, linear, linears, products, rms_norm, triton_kernels
from .kda_recurrence import (fused_decode_available, fused_prompt_available, kda_decode_fused, kda_prompt,
                             kda_prompt_fused, kda_recurrent)
from .state import KDAState, Rows, stacked


# Sequences of at most this many new tokens (decode steps, drafts, short prompt pieces) take the
# step-by-step recurrence; longer ones the chunked form.
RECURRENT_MAX_ROWS = 16


def _block_weights(q, k, v, b, f_a, g_a, f_b, g_b, o, norm, q_conv, k_conv, v_conv, dt_bias, a_log, o_norm
                   ) -> cpu_native.KdaWeights | None:
    """A KDA layer's weights checked for cpu_native.kda_block, or None where the native products do not
    take its projections (another codec, or kinds the separate calls would not group in one call)."""
    first = [native_dense(w) for w in (q, k, v, b, f_a, g_a)]
    second = [native_dense(w) for w in (f_b, g_b)]
    out = native_dense(o)
    if out is None or any(d is None for d in first + second) \
            or any(len({dense_kind(d) for d in ds}) != 1 for ds in (first, second)) \
            or not all(isinstance(t, torch.Tensor) for t in (norm, q_conv, k_conv, v_conv, dt_bias, a_log, o_norm)) \
            or not norm.is_contiguous():  # a copy would not outlive this call, and the pointers are kept
        return None
    return cpu_native.kda_weights(norm, first, second, out, (q_conv, k_conv, v_conv), dt_bias, a_log,
                                  o_norm)


# KDAttention.block's checked weights, kept while the layer's weights are the same objects (a resident
# model's every token).
_kept_blocks = KeptByWeights()


def causal_conv(x: torch.Tensor, tail: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over time for any leading dims: x [..., T, D], tail [..., K-1, D]
    (the previous inputs), w [..., D, K] -> [..., T, D]. Every channel of every leading index is
    one group of a single conv1d call: its setup cost, paid per call, dominated a decode step
    when each sequence and each of q, k, v had its own."""
    T, D, K = x.shape[-2], x.shape[-1], w.shape[-1]
    seq = torch.cat([tail.to(x.dtype), x], dim=-2)  # [..., K-1+T, D]
    lead = seq.shape[:-2]
    channels = seq.movedim(-1, -2).reshape(1, -1, seq.shape[-2])  # [1, C, K-1+T]
    taps = w.to(x.dtype).expand(*lead, D, K).reshape(-1, 1, K)  # [C, 1, K]
    out = F.conv1d(channels, taps, groups=taps.shape[0])  # [1, C, T]
    return out.reshape(*lead, D, T).movedim(-1, -2)


class KDAttention(Bindable):
    """Template for the KDA sublayer; weights are bound per layer (see binding.py)."""

    def __init__(self, cfg):
        super().__init__()
        H, nh, d, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        D = nh * d
        self.cfg = cfg
        self.slots(q_proj=(D, H), k_proj=(D, H), v_proj=(D, H), q_conv=(D, K), k_conv=(D, K), v_conv=(D, K),
                   A_log=(nh,), dt_bias=(D,), f_a_proj=(d, H), f_b_proj=(D, d), b_proj=(nh, H),
                   o_norm=(d,), o_proj=(H, D))
        if cfg.kda_full_rank_gate:
            self.slots(g_proj=(D, H))
        else:
            self.slots(g_a_proj=(d, H), g_b_proj=(D, d))

    def new_state(self, dtype, device=None) -> KDAState:
        c = self.cfg
        D = c.kda_num_heads * c.kda_head_dim
        return KDAState(conv=torch.zeros(3, c.conv_kernel - 1, D, dtype=dtype, device=device),
                        S=torch.zeros(c.kda_num_heads, c.kda_head_dim, c.kda_head_dim, dtype=torch.float32,
                                      device=device))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [T, H, Dk], fp32."""
        return self._decay(self._decay_input(x))

    def _decay(self, r_in: torch.Tensor) -> torch.Tensor:
        """The log decay from its low-rank projection [T, D] (before dt_bias)."""
        c = self.cfg
        nh, d = c.kda_num_heads, c.kda_head_dim
        r = r_in.float() + self.dt_bias.float()
        r = r.view(-1, nh, d)
        a = torch.exp(self.A_log.float()).view(1, nh, 1)
        if c.kda_gate_lower_bound is not None:  # K3's bounded ("safe") gate
            return c.kda_gate_lower_bound * torch.sigmoid(a * r)
        return -a * F.softplus(r)

    def forward(self, x: torch.Tensor, parts: list[Rows], chunk: int) -> torch.Tensor:
        """x: rows of one or more sequences; the projections run over all of them at once, the
        conv and the recurrence on each sequence's own state: in one native call for all of them
        where it runs (_native_steps), else stepping sequences of the same length together."""
        if _native_steps(x, parts, self.cfg.kda_head_dim):
            return self._native_forward(x, parts)
        return self._torch_forward(x, parts, chunk)

    def block(self, h: torch.Tensor, norm: torch.Tensor, eps: float, parts: list[Rows]) -> torch.Tensor | None:
        """h + forward(rms_norm(h) * norm) in one native call (cpu_native.kda_block: the norm, the
        projections, the recurrence, the output projection, the sum) for decode-sized rows on the CPU that
        the native step takes (_native_steps), with the low-rank decay and gate, int8 or bf16 projections of
        one kind a call as the separate calls group them, and no sequence keeping rollback states (a draft
        check keeps its inputs for them: forward does); else None. The same bits as the separate calls."""
        c = self.cfg
        if (c.kda_full_rank_gate or h.dim() != 2 or h.shape[0] > cpu_native.GEMV_MAX_ROWS
                or any(keep for _, _, keep in parts) or not _native_steps(h, parts, c.kda_head_dim)):
            return None
        projections = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_a_proj,
                       self.f_b_proj, self.g_b_proj, self.o_proj)
        weights = (*projections, norm, self.q_conv, self.k_conv, self.v_conv, self.dt_bias, self.A_log, self.o_norm)
        checked = _kept_blocks.get(weights, lambda: _block_weights(*weights))
        if checked is None:
            return None
        return cpu_native.kda_block(h.contiguous(), eps, checked, [n for _, n, _ in parts], [st.conv for st, _, _ in parts],
                                    [st.S for st, _, _ in parts], c.kda_gate_lower_bound)

    def _torch_forward(self, x: torch.Tensor, parts: list[Rows], chunk: int) -> torch.Tensor:
        c = self.cfg
        T = x.shape[0]
        nh, d = c.kda_num_heads, c.kda_head_dim
        xin = torch.stack(linears(x, [self.q_proj, self.k_proj, self.v_proj]))  # [3, T, D]
        fused = self._fused_steps(x, parts)
        prompt_fused = not fused and self._fused_prompt(x)
        if fused or prompt_fused:  # the kernels form the decay and beta from these themselves
            g, beta = self._decay_input(x).float(), linear(x, self.b_proj).float()
        else:
            g, beta = self.decay(x), torch.sigmoid(linear(x, self.b_proj).float())
        o = torch.empty(T, nh, d, dtype=torch.float32, device=x.device)
        for rows, n, states, keep_states in _groups(parts, x.device):
            B = len(states)
            piece = prompt_fused and n > RECURRENT_MAX_ROWS and not keep_states  # a long prompt piece
            g_rows, beta_rows = g[rows], beta[rows]
            if prompt_fused and not piece:  # the short rows of a mixed pass take deltafin's steps
                g_rows, beta_rows = self._decay(g_rows), torch.sigmoid(beta_rows)
            args = xin[:, rows].view(3, B, n, -1), g_rows.view(B, n, nh, d), beta_rows.view(B, n, nh), states
            if fused:
                out = self._recur_fused(*args, keep_states)
            elif piece:
                out = self._prompt_fused(*args)
            else:
                out = self._recur(*args, keep_states, chunk)
            o[rows] = out.reshape(B * n, nh, d)
        gate = self._gate(x)
        o = rms_norm(o, self.o_norm, c.rms_norm_eps) * torch.sigmoid(gate.float().view(T, nh, d))
        return linear(o.reshape(T, nh * d).to(x.dtype), self.o_proj)

    def _decay_input(self, x: torch.Tensor) -> torch.Tensor:
        """The decay's low-rank projection [T, D], before dt_bias."""
        return linear(linear(x, self.f_a_proj), self.f_b_proj)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate's logits [T, D]."""
        if self.cfg.kda_full_rank_gate:
            return linear(x, self.g_proj)
        return linear(linear(x, self.g_a_proj), self.g_b_proj)

    def _native_forward(self, x: torch.Tensor, parts: list[Rows]) -> torch.Tensor:
        """forward() with everything between the projections in one native call for all the
        sequences (cpu_native.kda_steps): the same formulas as the torch code, in another summation
        order. A sequence that checks drafts keeps what a rollback needs to step its accepted rows
        again (native_rollback)."""
        c = self.cfg
        qkv = [self.q_proj, self.k_proj, self.v_proj]
        if c.kda_full_rank_gate:
            q, k, v = linears(x, qkv)
            b = linear(x, self.b_proj)
            r, gate = self._decay_input(x), self._gate(x)
        else:  # beta and the decay's and the gate's low-rank pairs: one native call for each half,
            # the first halves in q, k and v's (one call a kind)
            q, k, v, b, f_a, g_a = linears(x, qkv + [self.b_proj, self.f_a_proj, self.g_a_proj])
            r, gate = products([f_a, g_a], [self.f_b_proj, self.g_b_proj])
        xin = torch.stack([q, k, v], dim=1)  # [T, 3, D]
        b, r = b.contiguous(), r.contiguous()
        step = dict(conv_w=(self.q_conv, self.k_conv, self.v_conv), dt_bias=self.dt_bias, a_log=self.A_log,
                    lower_bound=c.kda_gate_lower_bound, o_norm=self.o_norm, eps=c.rms_norm_eps)
        counts = [n for _, n, _ in parts]
        kept = [(i, st.S.clone(), st.conv.clone()) for i, (st, _, keep) in enumerate(parts) if keep]
        o = cpu_native.kda_steps(xin, counts, [st.conv for st, _, _ in parts], r=r, b=b, gate=gate.contiguous(),
                                 states=[st.S for st, _, _ in parts], **step)
        if kept:
            # The layer's small weights outlive the pass only as copies (a streamed layer's buffers are
            # reused by the next layers before the drafts are checked).
            step = {k: tuple(w.clone() for w in v) if k == "conv_w" else v.clone() if torch.is_tensor(v) else v
                    for k, v in step.items()}
            first = list(accumulate(counts, initial=0))
            for i, S0, conv0 in kept:
                rows = slice(first[i], first[i + 1])
                parts[i].state.pending = dict(native=step, S0=S0, conv0=conv0, xin=xin[rows], r=r[rows], b=b[rows])
        return linear(o.view(x.shape[0], -1), self.o_proj)

    def _fused_steps(self, x: torch.Tensor, parts: list[Rows]) -> bool:
        """Whether the pass's recurrence runs in flash-linear-attention's fused recurrent kernel
        (kda_recurrence.kda_decode_fused): on CUDA with 16-bit products (float32 ones keep deltafin's
        float32 steps, the reference), where it is installed, every sequence stepping at most
        RECURRENT_MAX_ROWS rows (longer prompt pieces take the chunked kernels)."""
        return (x.is_cuda and isinstance(self.q_proj, HalfMatmul) and fused_decode_available()
                and all(n <= RECURRENT_MAX_ROWS for _, n, _ in parts))

    def _fused_prompt(self, x: torch.Tensor) -> bool:
        """Whether a pass's long prompt pieces run the conv, the normalizations, the decay and beta in
        flash-linear-attention's kernels (``_prompt_fused``): CUDA, 16-bit products, the package's conv
        and chunked kernels installed."""
        return x.is_cuda and isinstance(self.q_proj, HalfMatmul) and fused_prompt_available()

    def _prompt_fused(self, xin, g, beta, states: list[KDAState]) -> torch.Tensor:
        """One sequence's prompt piece (B = 1, n rows) in two launches of flash-linear-attention's kernels:
        its causal conv with the SiLU (from the state's conv tail, returning the new tail) and its
        chunked KDA with the normalizations, the scale, the decay from its low-rank input and beta's
        sigmoid inside. xin [3, 1, n, D] (pre-conv q, k, v), g the decay's input before dt_bias, beta
        logits. Where deltafin's own path copies the piece three times to lay it out for a conv and
        normalizes, decays and gates in separate element-wise passes (docs/benchmarks.md)."""
        c = self.cfg
        _, _, n, D = xin.shape
        nh, d = c.kda_num_heads, c.kda_head_dim
        st = states[0]
        o, S, conv = kda_prompt_fused(xin[:, 0], st.conv, torch.stack([self.q_conv, self.k_conv, self.v_conv]),
                                      g.view(1, n, nh, d), beta.view(1, n, nh), st.S, a_log=self.A_log,
                                      dt_bias=self.dt_bias, lower_bound=c.kda_gate_lower_bound, scale=d ** -0.5)
        st.conv, st.S = conv, S
        return o

    def _recur_fused(self, xin, g, beta, states: list[KDAState], keep_states: bool) -> torch.Tensor:
        """``_recur`` in flash-linear-attention's fused kernel (see _fused_steps): g is the decay's
        input before dt_bias, beta the logits; the kernel normalizes, scales, gates and steps S in
        place. A pass that keeps rollback states (a draft check) launches it once a row and copies S
        after each, the record ``_recur`` keeps."""
        c = self.cfg
        _, B, n, _ = xin.shape
        nh, d = c.kda_num_heads, c.kda_head_dim
        S0 = [st.S for st in states]
        xin, qkv, conv0, S_run = self._conv(xin, states, keep_states, out_dtype=torch.float32)
        S, starts = _to_step(S0, S_run, keep_states)
        qkv = qkv.contiguous().view(3, B, n, nh, d)  # the kernel reads every input contiguous
        step = dict(a_log=self.A_log, dt_bias=self.dt_bias, lower_bound=c.kda_gate_lower_bound, scale=d ** -0.5)
        if not keep_states:
            o = kda_decode_fused(*qkv.unbind(0), g.contiguous(), beta.contiguous(), S, **step)
            trace = None
        else:
            # row-major, so that each row's inputs are contiguous
            qkv, g, beta = (t.transpose(i, i + 1).contiguous() for t, i in ((qkv, 1), (g, 0), (beta, 0)))
            trace = S.new_empty((n, *S.shape))  # S after each row, for a rollback
            outs = []
            for t in range(n):
                outs.append(kda_decode_fused(*(x[t].unsqueeze(1) for x in qkv.unbind(0)), g[t].unsqueeze(1),
                                             beta[t].unsqueeze(1), S, **step))
                trace[t].copy_(S)
            o = torch.cat(outs, dim=1) if n > 1 else outs[0]
        _hand_back(states, S, S_run is not None, starts, trace, conv0, xin)
        return o

    def _conv(self, xin, states: list[KDAState], keep_states: bool, out_dtype=None) -> tuple:
        """The causal conv of B sequences' pre-conv inputs xin [3, B, n, D] (silu after), each state's
        conv tail moved on. Returns (xin [B, 3, n, D], q, k, v stacked [3, B, n, D] in out_dtype
        (xin's by default, rounded to it first), the start tails [B, 3, K-1, D], and the layer's
        stacked S slots in a recorded pass, else None). On CUDA one Triton launch does the conv, the
        silu and the tails' move (row_ops_triton.conv_step) where torch takes ~10."""
        xin = xin.transpose(0, 1)  # [B, 3, n, D]
        # In a decode graph's slots (recorded mode) the B states are entries of one buffer per layer:
        # stepped there as one tensor, in place (no stacking copy in, no copies back out), so the
        # recorded kernels keep writing to the same addresses.
        conv_run = S_run = None
        if states[0].in_place:
            conv_run, S_run = stacked([st.conv for st in states]), stacked([st.S for st in states])
            if conv_run is None or S_run is None:
                raise RuntimeError("a recorded pass's KDA states are not consecutive decode-graph slots")
        conv0 = conv_run if conv_run is not None else torch.stack([st.conv for st in states])  # [B, 3, K-1, D]
        if conv_run is not None and keep_states:  # the start tails, for a rollback, before the slots move on
            conv0 = conv0.clone()
        taps = (self.q_conv, self.k_conv, self.v_conv)
        Km1 = conv0.shape[2]
        row_ops = triton_kernels("row_ops_triton") if xin.is_cuda else None
        fused = row_ops is not None and row_ops.conv_step_applies(xin, conv0, taps)
        if fused:
            tails = conv_run if conv_run is not None else torch.empty(conv0.shape, dtype=xin.dtype, device=xin.device)
            qkv = row_ops.conv_step(xin, conv0, taps, tails, out_dtype)
        else:
            qkv = F.silu(causal_conv(xin, conv0, torch.stack(taps))).transpose(0, 1)  # [3, B, n, D]
            if out_dtype is not None:
                qkv = qkv.to(out_dtype)
            # the last K-1 inputs
            tails = torch.cat([conv0.to(xin.dtype), xin[:, :, -Km1:]], dim=2)[:, :, -Km1:] if Km1 else None
            if conv_run is not None and Km1:
                conv_run.copy_(tails)
        if conv_run is None and Km1:
            for st, tail in zip(states, tails):
                # the kernel's tails are a new buffer: one sequence keeps it whole; the cat's are a view
                st.conv = tail if fused and len(states) == 1 else tail.clone()
        return xin, qkv, conv0, S_run

    def _recur(self, xin, g, beta, states: list[KDAState], keep_states: bool, chunk: int) -> torch.Tensor:
        """B sequences of n new tokens each, stepped together: conv over their pre-conv inputs
        xin [3, B, n, D], then the delta rule from each one's S. Returns o [B, n, H, Dv]."""
        c = self.cfg
        _, B, n, _ = xin.shape
        nh, d = c.kda_num_heads, c.kda_head_dim
        xin, qkv, conv0, S_run = self._conv(xin, states, keep_states)
        q, k, v = qkv.unbind(0)
        q = l2_normalize(q.float().view(B, n, nh, d)) * d ** -0.5
        k = l2_normalize(k.float().view(B, n, nh, d))
        v = v.float().view(B, n, nh, d)
        S0 = [st.S for st in states]
        if n <= RECURRENT_MAX_ROWS or keep_states or S_run is not None:
            # Time first: every step updates all B states at once (_to_step: which S is stepped).
            S, starts = _to_step(S0, S_run, keep_states)
            trace = S.new_empty((n, *S.shape)) if keep_states else None  # S after each row, for a rollback
            rows = [t.transpose(0, 1) for t in (q, k, v, g, beta)]
            # On CUDA one launch steps every row with S held in registers (row_ops_triton.kda_step),
            # where the torch steps read and write the B states six times a row (kl_medium batch 32:
            # ~1 ms of a 6.5 ms pass on an H100).
            row_ops = triton_kernels("row_ops_triton") if S.is_cuda else None
            if row_ops is not None and row_ops.kda_step_applies(q, S):
                o = row_ops.kda_step(*rows, S, trace)
            else:
                o, S = kda_recurrent(*rows, S, in_place=True, trace=trace)
            o = o.transpose(0, 1)
        else:  # one sequence (see _groups)
            # the fused kernels where the model's products are 16-bit; float32 products keep float32 here
            fused = isinstance(self.q_proj, HalfMatmul)
            o, S = kda_prompt(q[0], k[0], v[0], g[0], beta[0], S0[0], chunk, fused=fused)
            o, S, starts, trace = o.unsqueeze(0), S.unsqueeze(0), S0, None
        _hand_back(states, S, S_run is not None, starts, trace, conv0, xin)
        return o


def _to_step(S0: list[torch.Tensor], S_run: torch.Tensor | None, keep_states: bool) -> tuple:
    """The B states' S to step in place, and each one's S before the pass (what a rollback starts
    from): a recorded pass's slots, their start copied first when the pass keeps rollback states;
    one sequence that keeps none, its own S (nothing else holds it: snapshots and saved states are
    copies); otherwise a stacked copy, the states' own S left as the starts."""
    if S_run is not None:
        return S_run, S_run.clone() if keep_states else None
    return (S0[0].unsqueeze(0) if len(S0) == 1 and not keep_states else torch.stack(S0)), S0


def _hand_back(states: list[KDAState], S: torch.Tensor, in_slots: bool, starts, trace, conv0, xin) -> None:
    """After B sequences' steps: each state's rollback record where the pass keeps one (``trace``: S
    after each row), and its new S unless it was stepped in its slot."""
    for b, st in enumerate(states):
        if trace is not None:
            st.pending = dict(S0=starts[b], S_rows=trace[:, b], conv0=conv0[b], xin=xin[b])
        if not in_slots:
            st.S = S[b].clone() if len(states) > 1 else S[b]


def _native_steps(x: torch.Tensor, parts: list[Rows], head_dim: int) -> bool:
    """True when the pass's recurrence runs in one native call (cpu_native.kda_steps): float32 rows on
    the CPU with the native kernels built, a head they take, and every sequence's state float32 and
    outside a recorded decode graph. Decode steps, draft checks and prompt pieces of any length alike:
    stepping token by token with each head's S in cache beat torch's chunked form for long prompts
    too (a 256-token prompt of small-k3: 487 against 959 ms)."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and head_dim <= cpu_native.KDA_MAX_HEAD_DIM
            and cpu_native.available()):
        return False
    return all(not st.in_place and st.S.dtype == torch.float32 and st.conv.dtype == torch.float32
               and st.S.is_contiguous() and st.conv.is_contiguous() for st, _, _ in parts)


def _groups(parts: list[Rows], device) -> list[tuple]:
    """The pass's sequences in groups that step together: those with the same number n of new rows
    (at most RECURRENT_MAX_ROWS, or drafts) and the same keep_states; a longer prompt piece alone.
    Each group: (its rows in the pass, n, its states, keep_states); the rows are a slice when the
    group's sequences sit next to each other in the pass (no gather), else an index tensor."""
    found: dict = {}
    start = 0
    for i, (st, n, keep) in enumerate(parts):
        key = (n, keep) if n <= RECURRENT_MAX_ROWS or keep else i
        found.setdefault(key, ([], n, [], keep))
        found[key][0].append(start)
        found[key][2].append(st)
        start += n
    out = []
    for starts, n, states, keep in found.values():
        first, B = starts[0], len(starts)
        if starts == list(range(first, first + B * n, n)):
            rows = slice(first, first + B * n)
        else:
            rows = torch.tensor([s + j for s in starts for j in range(n)], dtype=torch.long, device=device)
        out.append((rows, n, states, keep))
    return out
