"""What a checkpoint holds and what one decode token must read: parameters and bytes per part,
from the source's tensor index (nothing is read)."""
from __future__ import annotations

from . import expert_codec
from .layout import global_tensors, layer_spine_tensors


def _params(spec) -> int:
    n = 1
    for s in spec.shape:
        n *= s
    return n


def expert_params(cfg) -> int:
    """Parameters of one routed expert (an MXFP4 byte holds two)."""
    L, I = cfg.expert_width, cfg.moe_intermediate_size
    return 3 * L * I


def summarize(source) -> dict:
    cfg = source.config
    g_infos = source.global_infos()
    global_bytes = sum(i.nbytes for i in g_infos.values())
    layer_bytes = [sum(i.nbytes for i in source.spine_infos(l).values()) for l in range(cfg.num_layers)]
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    one_expert = (sum(i.nbytes for i in source.expert_infos(moe_layers[0], 0).values()) if moe_layers else 0)
    spine_params = sum(_params(s) for s in global_tensors(cfg).values()) + sum(
        _params(s) for l in range(cfg.num_layers) for s in layer_spine_tensors(cfg, l).values())
    n_expert_params = expert_params(cfg) * cfg.num_experts * len(moe_layers)
    embed = g_infos["model.embed_tokens.weight"]
    embed_row = embed.nbytes // cfg.vocab_size
    # Per decode token: every layer's spine, the head (all but the embedding table, of which one row),
    # and top-k experts in each MoE layer.
    per_token = (sum(layer_bytes) + global_bytes - embed.nbytes + embed_row
                 + cfg.experts_per_token * one_expert * len(moe_layers))
    schedule = []
    for l in range(cfg.num_layers):
        attn = "KDA" if l in cfg.kda_layers else "MLA"
        schedule.append(f"{attn}+{'MoE' if cfg.is_moe(l) else 'dense'}")
    return {
        "path": str(source.path),
        "source": source.kind,
        "spine_codec": getattr(source, "spine_codec", "bf16"),
        "spines": list(getattr(source, "spines", ("bf16",))),
        "architecture": cfg.architecture,
        "num_layers": cfg.num_layers,
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "dense_layers": [l for l in range(cfg.num_layers) if not cfg.is_moe(l)],
        "moe_layers": moe_layers,
        "layer_schedule": schedule,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts,
        "experts_per_token": cfg.experts_per_token,
        "expert_format": cfg.expert_format,
        # What the experts are stored as here (bf16 / MXFP4 as published, or int8 / int4 / MXFP4
        # re-encoded by deltafin convert --experts).
        "expert_codec": expert_codec.describe(cfg, expert_codec.of(source)),
        "attn_res_block_size": cfg.attn_res_block_size,
        "spine_params": spine_params,
        "expert_params": n_expert_params,
        "total_params": spine_params + n_expert_params,
        # What a token multiplies with: the embedding table is a lookup, not a product, so it is
        # left out (the convention behind published "active parameter" figures).
        "active_params": (spine_params - _params(global_tensors(cfg)["model.embed_tokens.weight"])
                          + expert_params(cfg) * cfg.experts_per_token * len(moe_layers)),
        "global_bytes": global_bytes,
        "spine_bytes": global_bytes + sum(layer_bytes),
        "layer_spine_bytes": layer_bytes,
        "expert_bytes": one_expert * cfg.num_experts * len(moe_layers),
        "bytes_per_expert": one_expert,
        "bytes_per_token": per_token,
    }


def model_bytes(source) -> int:
    s = summarize(source)
    return s["spine_bytes"] + s["expert_bytes"]
