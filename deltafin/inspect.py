"""`deltafin inspect`: what a checkpoint is and what one decode token must read."""
from __future__ import annotations

import json
from pathlib import Path

from .checkpoint.hf import TensorInfo
from .checkpoint.layout import expert_tensors, full_name, global_tensors, layer_spine_tensors, nbytes
from .checkpoint.sizes import summarize
from .config import load_config
from .io.sources import open_source
from .units import GB, MB


def _gb(n: int) -> str:
    return f"{n / GB:,.3f} GB" if n >= 100 * MB else f"{n / MB:,.3f} MB"


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
    path = Path(path)
    src = (open_source(path, spine) if _has_weights(path) or not (path / "config.json").exists()
           else PlannedSource(path))
    try:
        s = summarize(src)
    finally:
        src.close()
    return json.dumps(s, indent=2) if as_json else format_summary(s)
