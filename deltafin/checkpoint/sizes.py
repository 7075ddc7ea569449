"""What a checkpoint holds and what one decode token must read: parameters and bytes per part,
from the source's tensor index (nothing is read), and the bytes of weights once in memory.

Every size of a model is counted here: ``ModelSizes`` (the placement plans, ``inspect``, ``bench``)
and ``weight_bytes`` (the in-RAM provider's accounting of what it holds).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import expert_codec
from .layout import global_tensors, layer_spine_tensors

EMBED = "model.embed_tokens.weight"


def group_bytes(infos: dict) -> int:
    """Bytes of a group of tensors (a spine, an expert, the globals) as stored."""
    return sum(t.nbytes for t in infos.values())


@dataclass(frozen=True)
class ModelSizes:
    """Bytes of each part of a model as stored (from the source's tensor index, nothing read)."""
    globals_bytes: int  # without the embedding table
    spine_bytes: tuple[int, ...]  # per layer
    expert_bytes: tuple[int, ...]  # one routed expert of each layer (0 for dense layers)
    num_experts: int  # per MoE layer (0 for a model without routed experts)
    embed_bytes: int = 0  # the embedding table, which stays in host memory wherever the rest is
    embed_row_bytes: int = 0  # one row of it: what a token reads of it

    @classmethod
    def of(cls, source) -> "ModelSizes":
        cfg = source.config
        g = dict(source.global_infos())
        embed = g.pop(EMBED, None)
        spines = tuple(group_bytes(source.spine_infos(i)) for i in range(cfg.num_layers))
        experts = tuple(group_bytes(source.expert_infos(i, 0)) if cfg.is_moe(i) else 0
                        for i in range(cfg.num_layers))
        embed_bytes = embed.nbytes if embed is not None else 0
        return cls(group_bytes(g), spines, experts, cfg.num_experts if any(experts) else 0,
                   embed_bytes, embed_bytes // cfg.vocab_size)

    def restricted(self, layers: range, with_globals: bool) -> "ModelSizes":
        """What a rank of a split model holds: the layers in `layers` (the others count 0 bytes) and,
        `with_globals`, the globals and embedding table."""
        inside = [i in layers for i in range(len(self.spine_bytes))]
        return ModelSizes(self.globals_bytes if with_globals else 0,
                          tuple(b if k else 0 for b, k in zip(self.spine_bytes, inside)),
                          tuple(b if k else 0 for b, k in zip(self.expert_bytes, inside)),
                          self.num_experts, self.embed_bytes if with_globals else 0, self.embed_row_bytes)

    @property
    def one_expert(self) -> int:
        """Bytes of one routed expert (every MoE layer's are alike); 0 without routed experts."""
        return next((b for b in self.expert_bytes if b), 0)

    @property
    def experts_total(self) -> int:
        """Every routed expert of every MoE layer."""
        return self.num_experts * sum(self.expert_bytes)

    @property
    def total(self) -> int:
        """What a memory tier can hold: everything but the embedding table."""
        return self.globals_bytes + sum(self.spine_bytes) + self.experts_total

    @property
    def stored(self) -> int:
        """The whole model as stored, embedding table included."""
        return self.total + self.embed_bytes

    def token_bytes(self, experts_per_token: int) -> int:
        """What one decode token reads: every layer's spine, the globals but the embedding table
        (the head), one row of that, and `experts_per_token` experts in each MoE layer."""
        return (sum(self.spine_bytes) + self.globals_bytes + self.embed_row_bytes
                + experts_per_token * sum(self.expert_bytes))


def weight_bytes(w) -> int:
    """Bytes of a weight in memory: a tensor, a QWeight, or a tuple of them (an expert). A tensor
    stored padded past what the model uses (a KDA layer's A_log) counts only its used part."""
    if isinstance(w, tuple):
        return sum(weight_bytes(x) for x in w)
    return w.nbytes if not hasattr(w, "element_size") else w.numel() * w.element_size()


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
    sizes = ModelSizes.of(source)
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    spine_params = sum(_params(s) for s in global_tensors(cfg).values()) + sum(
        _params(s) for l in range(cfg.num_layers) for s in layer_spine_tensors(cfg, l).values())
    n_expert_params = expert_params(cfg) * cfg.num_experts * len(moe_layers)
    global_bytes = sizes.globals_bytes + sizes.embed_bytes
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
        "active_params": (spine_params - _params(global_tensors(cfg)[EMBED])
                          + expert_params(cfg) * cfg.experts_per_token * len(moe_layers)),
        "global_bytes": global_bytes,
        "spine_bytes": global_bytes + sum(sizes.spine_bytes),
        "layer_spine_bytes": list(sizes.spine_bytes),
        "expert_bytes": sizes.experts_total,
        "bytes_per_expert": sizes.one_expert,
        # Per decode token: every layer's spine, the head and top-k experts in each MoE layer.
        "bytes_per_token": sizes.token_bytes(cfg.experts_per_token),
    }


def model_bytes(source) -> int:
    return ModelSizes.of(source).stored
