"""`deltafin inspect`: what a checkpoint is and what one decode token must read."""
from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import expert_codec
from .checkpoint.hf import TensorInfo
from .checkpoint.layout import expert_tensors, full_name, global_tensors, layer_spine_tensors, nbytes
from .config import load_config


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


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'T' else 1}f} {unit}"
    return f"{n:,}"


def format_summary(s: dict) -> str:
    lines = [
        f"{s['path']}  ({s['source']}, {s['architecture']}, spine {s['spine_codec']} of "
        f"{', '.join(s['spines'])}, experts {s['expert_codec']})",
        f"layers        {s['num_layers']}: KDA {s['kda_layers']}  MLA {s['mla_layers']}  dense {s['dense_layers']}",
        f"schedule      {' '.join(s['layer_schedule'])}",
        f"experts       {s['num_experts']} per MoE layer, top-{s['experts_per_token']}, "
        f"{_gb(s['bytes_per_expert'])} each",
        f"parameters    total {_count(s['total_params'])} ({s['total_params']:,})  "
        f"active/token {_count(s['active_params'])} ({s['active_params']:,})  "
        f"spine {s['spine_params']:,}  experts {s['expert_params']:,}",
        f"on disk       spine {_gb(s['spine_bytes'])}  experts {_gb(s['expert_bytes'])}",
        f"per token     {_gb(s['bytes_per_token'])} read (all spines + head + top-k experts per MoE layer)",
    ]
    return "\n".join(lines)


class PlannedSource:
    """A folder with only config.json: the tensors the config implies, as a checkpoint would store
    them (spine bf16/fp32, experts as the config says), without any weights to read."""

    kind = "config only"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = load_config(self.path)

    def _infos(self, specs: dict, layer: int | None = None) -> dict[str, TensorInfo]:
        return {rel: TensorInfo(full_name(self.config, rel, layer), "", 0, nbytes(s), s.shape, s.dtype)
                for rel, s in specs.items()}

    def global_infos(self) -> dict[str, TensorInfo]:
        return self._infos(global_tensors(self.config))

    def spine_infos(self, i: int) -> dict[str, TensorInfo]:
        return self._infos(layer_spine_tensors(self.config, i), i)

    def expert_infos(self, i: int, e: int) -> dict[str, TensorInfo]:
        return self._infos(expert_tensors(self.config, i, e), i)

    def close(self) -> None:
        pass


def _has_weights(path: Path) -> bool:
    return any((path / f).exists() for f in ("model.safetensors.index.json", "model.safetensors",
                                               "deltafin-store.json"))


def inspect_path(path, as_json: bool = False, spine: str = "auto") -> str:
    """The summary of a checkpoint folder or store, for the spine `spine` would run (see Settings.spine)."""
    from .api import open_source
    path = Path(path)
    src = (open_source(path, spine) if _has_weights(path) or not (path / "config.json").exists()
           else PlannedSource(path))
    try:
        s = summarize(src)
    finally:
        src.close()
    return json.dumps(s, indent=2) if as_json else format_summary(s)
