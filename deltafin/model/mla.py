"""Gated multi-head latent attention without rotary embeddings (K3_MODEL.md section 3.2).

The cache holds, per token, only the normalized latent c_kv and the rope-part key k_rot shared by
all heads. Decoding absorbs kv_b into the query: for head h with kv_b split into W_k [nope, r] and
W_v [v, r],  q_nope . (W_k c) = (W_k^T q_nope) . c  and  sum_j p_j W_v c_j = W_v (sum_j p_j c_j),
so keys and values are never expanded. Prefill of a fresh sequence expands them (cheaper there).
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from ..kernels import cpu_native
from ..kernels.kept import KeptByWeights
from ..kernels.linear import QWeight, dense_kind, native_dense
from .binding import Bindable
from .ops import HalfMatmul, linear, linears, plain, rms_norm
from .state import MLAState, Rows, joined, runs, stacked

# The latent norms use a fixed eps of 1e-6 (not rms_norm_eps), like the published implementations.
LATENT_NORM_EPS = 1e-6


class MLAttention(Bindable):
    def __init__(self, cfg):
        super().__init__()
        c = self.cfg = cfg
        H, nh = c.hidden_size, c.mla_num_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.slots(q_a_proj=(c.q_lora_rank, H), q_a_layernorm=(c.q_lora_rank,),
                       q_b_proj=(nh * qk, c.q_lora_rank))
        else:
            self.slots(q_proj=(nh * qk, H))
        self.slots(kv_a_proj_with_mqa=(c.kv_lora_rank + c.qk_rope_head_dim, H),
                   kv_a_layernorm=(c.kv_lora_rank,),
                   kv_b_proj=(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                   o_proj=(H, nh * c.v_head_dim))
        if c.mla_output_gate:
            self.slots(g_proj=(nh * c.v_head_dim, H))
        self.scale = qk ** -0.5

    def new_state(self, dtype, device=None) -> MLAState:
        c = self.cfg
        return MLAState(ckv=torch.zeros(0, c.kv_lora_rank, dtype=dtype, device=device),
                        krot=torch.zeros(0, c.qk_rope_head_dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, parts: list[Rows], chunk: int) -> torch.Tensor:
        """x: rows of one or more sequences; projections over all of them, attention per sequence
        over its own cache."""
        c = self.cfg
        T, nh = x.shape[0], c.mla_num_heads
        nope, rope, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank:  # the query's and the keys' down projections read x in one native call
            q_a, kv = linears(x, [self.q_a_proj, self.kv_a_proj_with_mqa])
            q = linear(rms_norm(q_a, self.q_a_layernorm, LATENT_NORM_EPS), self.q_b_proj)
        else:
            q, kv = linear(x, self.q_proj), linear(x, self.kv_a_proj_with_mqa)
        q = q.view(T, nh, nope + rope)
        ckv_new = rms_norm(kv[:, :r], self.kv_a_layernorm, LATENT_NORM_EPS)
        kv_b = KvB(plain(self.kv_b_proj), nh, nope, dv, x.dtype)
        # A fresh sequence's prompt attends with expanded keys and values; every other sequence in
        # the latent form, whose W_k and W_v products run once for all of them (two native calls a
        # layer, not two per sequence).
        expand = [st.at is None and st.length == 0 and n > 1 for st, n, _ in parts]
        starts = list(accumulate((n for _, n, _ in parts[:-1]), initial=0))
        latent_rows = [j for (st, n, _), s, e in zip(parts, starts, expand) if not e for j in range(s, s + n)]
        every = len(latent_rows) == T
        if latent_rows:
            q_lat = kv_b.absorb_query(q[:, :, :nope] if every else q[latent_rows, :, :nope])  # [nh, R, r]
        groups = _slot_groups(parts)
        if groups is not None:  # a decode graph's slots: each group's new rows written in one go
            for rows, ckv_all, krot_all, at, n in groups:
                B, cap = ckv_all.shape[:2]
                # row j of the group is its sequence j // n's
                index = at + torch.arange(at.shape[0], device=at.device) // n * cap
                ckv_all.view(B * cap, -1).index_copy_(0, index, ckv_new[rows].to(ckv_all.dtype))
                krot_all.view(B * cap, -1).index_copy_(0, index, kv[rows, r:].to(krot_all.dtype))
        else:
            for (st, n, _), s in zip(parts, starts):  # MLA rolls back by length: nothing extra to keep
                st.append(ckv_new[s:s + n], kv[s:s + n, r:])
        if groups is not None:
            lats = [self._attend_slots(q_lat[:, rows], q[rows, :, nope:], ckv_all, krot_all, at)
                    for rows, ckv_all, krot_all, at, _ in groups]
            latent, pieces, sizes = torch.cat(lats, dim=1) if len(lats) > 1 else lats[0], [None], [T]  # one piece
        elif not any(expand) and _native_attend_applies(x, parts, c):
            # Every sequence decodes one token: the attention of all of them in one native call.
            lat = cpu_native.mla_decode_attend(q_lat.transpose(0, 1).contiguous(), q[:, :, nope:].contiguous(),
                                               *zip(*(st.view() for st, _, _ in parts)), self.scale)
            pieces, latent, sizes = [None] * len(parts), lat.transpose(0, 1), [1] * len(parts)
        else:
            pieces, lats, at = [], [], 0
            for (st, n, _), s, e in zip(parts, starts, expand):
                rows = slice(s, s + n)
                if e:
                    pieces.append(self._attend_expanded(q[rows, :, :nope], q[rows, :, nope:], st, kv_b))
                else:
                    lats.append(self._attend_latent(q_lat[:, at:at + n], q[rows, :, nope:], st))
                    pieces.append(None)
                    at += n
            latent = (torch.cat(lats, dim=1) if len(lats) > 1 else lats[0]) if lats else None
            sizes = [lat.shape[1] for lat in lats]
        if latent is not None:
            values = iter(kv_b.absorb_value(latent).split(sizes))  # W_v on the way out
            pieces = [next(values) if p is None else p for p in pieces]
        out = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).reshape(T, nh * dv)
        if c.mla_output_gate:
            out = out * torch.sigmoid(linear(x, self.g_proj).float()).to(out.dtype)
        return linear(out, self.o_proj)

    def block(self, h: torch.Tensor, norm: torch.Tensor, eps: float, parts: list[Rows]) -> torch.Tensor | None:
        """h + forward(rms_norm(h) * norm) in one native call (cpu_native.mla_block: the norm, the
        projections, the new cache rows, the absorbed products and the attention, the sum) where every
        sequence decodes one row into a float32 CPU cache that the native attention takes
        (_native_attend_applies), with a plain query projection, no output gate, and projections the
        native products read (q and kv_a of one kind); else None. The same bits as the separate calls."""
        c = self.cfg
        if (c.q_lora_rank or c.mla_output_gate or h.dim() != 2 or h.shape[0] > cpu_native.GEMV_MAX_ROWS
                or not _native_attend_applies(h, parts, c, new_rows=1)):
            return None
        weights = (self.q_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj, norm, self.kv_a_layernorm)
        checked = _kept_blocks.get(weights, lambda: _block_weights(c, *weights))
        if checked is None:
            return None
        states = [st for st, _, _ in parts]
        for st in states:
            st.reserve(1)
        out = cpu_native.mla_block(h.contiguous(), eps, LATENT_NORM_EPS, checked, [st.ckv for st in states],
                                   [st.krot for st in states], [st.length + 1 for st in states], self.scale)
        for st in states:
            st.length += 1
        return out

    def _positions(self, st: MLAState, T: int, device) -> tuple:
        """The cache to attend over (ckv, krot) and the mask of positions each of the T new queries
        may not see (the cache already holds their own keys)."""
        ckv, krot = st.view()  # [P+T, r], [P+T, rope]
        past = st.length - T
        # causal mask: new token t sits at position past + t
        pos_q = torch.arange(past, past + T, device=device)
        return ckv, krot, torch.arange(ckv.shape[0], device=device)[None, :] > pos_q[:, None]  # [T, P+T]

    def _attend_expanded(self, q_nope, q_rot, st: MLAState, kv_b: "KvB") -> torch.Tensor:
        """A fresh sequence's prompt [T, nh, dv]: keys and values expanded once (cheaper there) and
        attended by torch's fused attention (causal: the cache holds exactly the prompt), which never
        forms the [nh, T, T] scores (2 GB of float32 for 4 k tokens of kl_medium). With bf16 products
        on CUDA the attention runs in bf16 too (its softmax sums in fp32), on the flash kernels."""
        ckv, krot = st.view()
        w_k, w_v = kv_b.full()
        dtype = torch.bfloat16 if q_nope.is_cuda and isinstance(self.kv_b_proj, HalfMatmul) else q_nope.dtype
        ckv = ckv.to(dtype)
        k_nope = torch.einsum("nr,hdr->hnd", ckv, w_k.to(dtype))
        vals = torch.einsum("nr,hdr->hnd", ckv, w_v.to(dtype))
        nh, N = k_nope.shape[:2]
        q = torch.cat([q_nope, q_rot], dim=-1).transpose(0, 1).to(dtype)  # [nh, T, nope + rope]
        k = torch.cat([k_nope, krot.to(dtype).expand(nh, N, -1)], dim=-1)
        # batch, heads, rows, dims: the fused kernels take only 4-D inputs (3-D ones run the unfused math)
        out = F.scaled_dot_product_attention(q[None], k[None], vals[None], is_causal=True, scale=self.scale)[0]
        return out.transpose(0, 1).to(q_nope.dtype)  # [T, nh, dv]

    def _attend_slots(self, q_lat, q_rot, ckv, krot, at) -> torch.Tensor:
        """_attend_latent for B sequences of n rows each whose caches are entries of one slot buffer
        (ckv [B, cap, r], krot [B, cap, rope]; `at` [B * n] the new rows' positions): the same
        products for all of them at once. q_lat [nh, B * n, r] -> the attended latent, same shape."""
        nh, R, r = q_lat.shape
        B, cap = ckv.shape[:2]
        n = R // B
        scores = (torch.einsum("hbtr,bcr->bhtc", q_lat.view(nh, B, n, r), ckv)
                  + torch.einsum("bthd,bcd->bhtc", q_rot.reshape(B, n, nh, -1), krot)).float() * self.scale
        unseen = torch.arange(cap, device=at.device)[None, None, :] > at.view(B, n)[:, :, None]  # [B, n, cap]
        probs = torch.softmax(scores.masked_fill(unseen[:, None], float("-inf")), dim=-1).to(q_lat.dtype)
        return torch.einsum("bhtc,bcr->hbtr", probs, ckv).reshape(nh, R, r)

    def _attend_latent(self, q_lat, q_rot, st: MLAState) -> torch.Tensor:
        """T new queries with W_k absorbed (q_lat [nh, T, r]) against the cache: the attended
        latent [nh, T, r], still to be multiplied by W_v."""
        ckv, krot, mask = self._positions(st, q_rot.shape[0], q_rot.device)
        scores = (torch.einsum("htr,nr->htn", q_lat, ckv)
                  + torch.einsum("thd,nd->htn", q_rot, krot)).float() * self.scale
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(q_lat.dtype)
        return torch.einsum("htn,nr->htr", probs, ckv)


def _block_weights(cfg, q_proj, kv_a, kv_b, o_proj, norm, latent_norm) -> cpu_native.MlaWeights | None:
    """An MLA layer's weights checked for cpu_native.mla_block, or None where the native products do not
    take its projections (another codec, q_proj and kv_a of kinds the separate calls would not share)."""
    dense = [native_dense(w) for w in (q_proj, kv_a, kv_b, o_proj)]
    if any(d is None for d in dense) or dense_kind(dense[0]) != dense_kind(dense[1]) \
            or not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in (norm, latent_norm)):
        return None  # a copy of a norm would not outlive this call, and its pointer is kept
    nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = KvB(kv_b, cfg.mla_num_heads, nope, dv, torch.float32)
    return cpu_native.mla_weights(norm, dense[0], dense[1], latent_norm, kv.heads(dense[2], 0, nope),
                                  kv.heads(dense[2], nope, dv), dense[3], nope, cfg.qk_rope_head_dim)


# MLAttention.block's checked weights, kept while the layer's weights are the same objects.
_kept_blocks = KeptByWeights()


def _slot_groups(parts: list[Rows]) -> list[tuple] | None:
    """A recorded pass's sequences (decode_graph.py) in runs that feed the same number n of rows from
    consecutive slots (decode rows, then prompt pieces): per run, (its rows of the pass, ckv [B, cap, r],
    krot [B, cap, rope], positions [B * n], n), its caches entries of one buffer and its positions one
    device tensor. None for any other pass."""
    if parts[0].state.at is None:
        return None
    groups = []
    for which, rows, n in runs([p.n for p in parts]):
        run = parts[which]
        ckv, krot = stacked([st.ckv for st, _, _ in run]), stacked([st.krot for st, _, _ in run])
        at = joined([st.at for st, _, _ in run])
        if ckv is None or krot is None or at is None:
            raise RuntimeError("a recorded pass's MLA caches are not consecutive decode-graph slots")
        groups.append((rows, ckv, krot, at, n))
    return groups


# The native decode attention takes a pass while no sequence's cache is larger than this many
# multiply-adds per score pass (heads x cached tokens x (kv_lora_rank + rope)) where it runs its plain
# loops: below it, torch's ~8 small ops per sequence cost more than the attention itself; above it,
# torch's matrix products are faster than those loops. Its AVX-512 kernel (cpu_native.mla_attend_blocked)
# is faster than torch's products at every length measured, so there it takes any cache
# (docs/benchmarks.md#mla-decode-attention).
NATIVE_ATTEND_MAX_WORK = 1 << 22


def native_attend_reaches(cfg, length: int) -> bool:
    """Whether the native decode attention takes a cache of `length` rows of this model's MLA layers."""
    r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return cpu_native.mla_attend_blocked(r, rope) or length * cfg.mla_num_heads * (r + rope) <= NATIVE_ATTEND_MAX_WORK


def _native_attend_applies(x: torch.Tensor, parts: list[Rows], cfg, new_rows: int = 0) -> bool:
    """True when every sequence of the pass decodes one token into a float32 CPU cache outside a
    recorded decode graph, each within what the native attention takes (``native_attend_reaches``) once
    its ``new_rows`` not yet appended are, with the native kernels built (cpu_native.mla_decode_attend)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and cpu_native.available()
            and all(n == 1 and st.at is None and st.ckv.dtype == torch.float32 and st.krot.dtype == torch.float32
                    and native_attend_reaches(cfg, st.length + new_rows) for st, n, _ in parts))


class KvB:
    """kv_b_proj [nh * (nope + dv), r] as attention applies it: per head, W_k [nope, r] (its first
    nope rows) and W_v [dv, r] (the rest).

    Decoding multiplies by them without forming them: with float32 rows on the CPU, an int8 or bf16
    weight and the native kernels, all heads' products run in one native call each (W_k from the
    query's side, W_v from the latent's) on the stored bytes. A prompt, another codec or another
    device decodes the weight once per layer and pass (``full``); doing that for every decode step
    cost ~4 ms per MLA layer on kl_medium, more than the layer's products.
    """

    def __init__(self, w, nh: int, nope: int, dv: int, dtype: torch.dtype):
        self.w, self.nh, self.nope, self.dv, self.dtype = w, nh, nope, dv, dtype
        self._full = None

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_k [nh, nope, r] and W_v [nh, dv, r] in the compute dtype."""
        if self._full is None:
            w = self.w
            if not isinstance(w, torch.Tensor):
                from ..kernels.linear import dequantize
                w = dequantize(w)
            w = w.to(self.dtype).view(self.nh, self.nope + self.dv, -1)
            self._full = w[:, :self.nope], w[:, self.nope:]
        return self._full

    def _native(self, rows: int):
        """The stored (weight, scale) when the native kernels take this product, else None."""
        if self.dtype != torch.float32 or rows > cpu_native.GEMV_MAX_ROWS or not cpu_native.available():
            return None
        return native_dense(self.w)

    def heads(self, dense, first: int, count: int) -> cpu_native.DenseHeads:
        """Each head's rows first..first+count-1 of the stored weight (and of its scales), checked for the
        native call. A quantized weight keeps them (64 views a layer and token otherwise)."""
        cache = self.w.derived("_kv_b_heads", dict) if isinstance(self.w, QWeight) else {}
        key = (self.nh, self.nope + self.dv, first, count)
        if key not in cache:
            w, s = dense
            step = self.nope + self.dv
            cache[key] = cpu_native.dense_heads(
                [w[h * step + first:h * step + first + count] for h in range(self.nh)],
                [None if s is None else s[h * step + first:h * step + first + count] for h in range(self.nh)])
        return cache[key]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, nh, nope] -> [nh, T, r]: each head's query times its W_k."""
        dense = self._native(q_nope.shape[0])
        if dense is None:
            return torch.einsum("thd,hdr->htr", q_nope, self.full()[0])
        y = cpu_native.dense_heads_gemv(q_nope.transpose(0, 1).contiguous(), self.heads(dense, 0, self.nope),
                                        transposed=True)
        return y.view(self.nh, q_nope.shape[0], -1)

    def absorb_value(self, lat: torch.Tensor) -> torch.Tensor:
        """lat [nh, T, r] -> [T, nh, dv]: each head's attended latent times W_v^T."""
        dense = self._native(lat.shape[1])
        if dense is None:
            return torch.einsum("htr,hdr->thd", lat, self.full()[1])
        y = cpu_native.dense_heads_gemv(lat.contiguous(), self.heads(dense, self.nope, self.dv))
        return y.view(self.nh, lat.shape[1], self.dv).transpose(0, 1)
