"""The decoder layer template, Block Attention Residuals, and checkpoint-name mapping.

``sanitize`` is the one place where checkpoint tensor names become template slot names.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .binding import Bindable
from .kda import KDAttention
from .mla import MLAttention
from .moe import DenseMLP, MoE
from .ops import rms_norm, triton_kernels


# 2-D slots that are not used as matrix products (router scores, depth-mix pseudo-queries, conv
# taps): they stay in their stored precision whatever the product dtype.
NOT_PRODUCTS = {"mlp.gate", "attn_res_proj", "mlp_res_proj", "self_attn.q_conv", "self_attn.k_conv",
                "self_attn.v_conv"}


def attn_res(p: torch.Tensor, blocks: list[torch.Tensor], w_proj, w_norm, eps: float) -> torch.Tensor:
    """Softmax mix over depth of [blocks..., p] for each token (K3_MODEL.md section 3.4), in fp32; on
    CUDA in one Triton launch (row_ops_triton.depth_mix) instead of ~10."""
    if p.is_cuda and (row_ops := triton_kernels("row_ops_triton")) is not None \
            and row_ops.depth_mix_applies(p, blocks, w_proj, w_norm):
        return row_ops.depth_mix(p, blocks, w_proj, w_norm, eps)
    values = torch.stack([*blocks, p]).float()  # [N, T, H]
    keys = rms_norm(values, None, eps)
    score = (keys * (w_norm.float() * w_proj.float().view(-1))).sum(-1)  # [N, T]
    probs = torch.softmax(score, dim=0)
    return (probs.unsqueeze(-1) * values).sum(0).to(p.dtype)


class DecoderLayer(Bindable):
    """One template per layer kind: attention (KDA | MLA) x feed-forward (dense | MoE)."""

    def __init__(self, cfg: ModelConfig, attention: str, moe: bool):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.slots(input_layernorm=(H,), post_attention_layernorm=(H,))
        if cfg.attn_res_block_size:
            self.slots(attn_res_norm=(H,), attn_res_proj=(1, H), mlp_res_norm=(H,), mlp_res_proj=(1, H))
        self.self_attn = KDAttention(cfg) if attention == "kda" else MLAttention(cfg)
        self.mlp = MoE(cfg) if moe else DenseMLP(cfg, cfg.intermediate_size)

    def forward(self, i: int, h: torch.Tensor, blocks: list, parts: list, chunk: int, fetch):
        """h: the rows of every sequence in the pass, concatenated; parts: each one's Rows."""
        c = self.cfg
        eps = c.rms_norm_eps
        B = c.attn_res_block_size
        if B:
            a_in = attn_res(h, blocks, self.attn_res_proj, self.attn_res_norm, eps) if blocks else h
            if i % B == 0:  # a new block starts: the running sum so far becomes a block summary
                blocks.append(h)
                base = torch.zeros_like(h)
            else:
                base = h
        else:
            a_in, base = h, h
        # An attention half's norm, attention and sum in one native call where it runs (KDAttention.block,
        # MLAttention.block)
        p = self.self_attn.block(h, self.input_layernorm, eps, parts) if not B else None
        if p is None:
            p = base + self.self_attn(rms_norm(a_in, self.input_layernorm, eps), parts, chunk)
        if not B:  # the feed-forward half likewise (MoE.block, DenseMLP.block)
            norm = self.post_attention_layernorm
            out = self.mlp.block(p, norm, eps, fetch) if isinstance(self.mlp, MoE) else self.mlp.block(p, norm, eps)
            if out is not None:
                return out
        m_in = attn_res(p, blocks, self.mlp_res_proj, self.mlp_res_norm, eps) if B else p
        x = rms_norm(m_in, self.post_attention_layernorm, eps)
        return p + (self.mlp(x, fetch, m_in) if isinstance(self.mlp, MoE) else self.mlp(x))


def layer_kind(cfg: ModelConfig, i: int) -> tuple[str, bool]:
    return ("kda" if i in cfg.kda_layers else "mla"), cfg.is_moe(i)


def build_templates(cfg: ModelConfig) -> dict[tuple[str, bool], DecoderLayer]:
    """One template per layer kind present in the model; placeholders live on the meta device."""
    kinds = {layer_kind(cfg, i) for i in range(cfg.num_layers)}
    return {k: DecoderLayer(cfg, *k) for k in sorted(kinds)}


_RENAMES = {
    "self_attention_res_norm.weight": "attn_res_norm",
    "self_attention_res_proj.weight": "attn_res_proj",
    "mlp_res_norm.weight": "mlp_res_norm",
    "mlp_res_proj.weight": "mlp_res_proj",
    "block_sparse_moe.gate.weight": "mlp.gate",
    "block_sparse_moe.gate.e_score_correction_bias": "mlp.e_score_correction_bias",
}


def sanitize(cfg: ModelConfig, rel: str, t):
    """Checkpoint-relative tensor name -> (slot name, tensor in the template's shape)."""
    if rel in _RENAMES:
        return _RENAMES[rel], t
    name = rel[: -len(".weight")] if rel.endswith(".weight") else rel
    if name.startswith("self_attn."):
        leaf = name[len("self_attn."):]
        if leaf in ("q_conv1d", "k_conv1d", "v_conv1d"):
            return f"self_attn.{leaf[0]}_conv", t.reshape(t.shape[0], -1)
        if leaf == "A_log":  # stored as [heads], [1,1,heads,1] or zero-padded to a multiple of 128
            return "self_attn.A_log", t.reshape(-1)[: cfg.kda_num_heads]
        return name, t
    if name.startswith("block_sparse_moe.shared_experts."):
        return "mlp.shared_" + name.rsplit(".", 1)[1], t
    if name.startswith("block_sparse_moe.routed_expert_"):
        return "mlp." + name[len("block_sparse_moe."):], t
    if name.startswith("block_sparse_moe.") or name.startswith("mlp."):  # the dense layer's MLP
        return "mlp." + name.rsplit(".", 1)[1], t
    return name, t
