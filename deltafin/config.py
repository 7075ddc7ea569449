"""The model's shape, read from a checkpoint's config.json.

One dataclass covers the whole family: Kimi K3 (``KimiK3ForConditionalGeneration`` with a
``text_config``) and Kimi Linear (``KimiLinearForCausalLM``). Every size, flag and layer list
comes from the file; nothing here knows the real K3's numbers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """config.json is missing, malformed, or describes a model deltafin cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "k3" | "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    kda_full_rank_gate: bool
    kda_gate_lower_bound: float | None  # K3's safe gate; None -> Kimi Linear softplus gate
    # MLA
    mla_num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    # MLP / MoE
    first_k_dense: int
    intermediate_size: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    latent_size: int | None  # routed_expert_hidden_size; None -> experts work on hidden_size
    latent_norm: bool
    router_activation: str  # "sigmoid" | "softmax"
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    hidden_act: str  # "situ" | "silu"
    situ_beta: float | None
    situ_linear_beta: float | None
    attn_res_block_size: int | None
    expert_format: str  # "mxfp4" | "dense"
    tensor_prefix: str  # "language_model." for K3, "" for Kimi Linear
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    # -- derived ---------------------------------------------------------------------------
    @property
    def is_k3(self) -> bool:
        return self.architecture == "k3"

    @property
    def expert_width(self) -> int:
        """Width the routed experts work in (the latent L for K3, H otherwise)."""
        return self.latent_size or self.hidden_size

    def layer_kind(self, i: int) -> str:
        """'dense' (layer < first_k_dense), 'kda' or 'mla' (both with MoE)."""
        if i < self.first_k_dense:
            return "dense_" + ("kda" if i in self.kda_layers else "mla")
        return "kda" if i in self.kda_layers else "mla"

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense

    def to_dict(self) -> dict:
        return asdict(self)


def _req(d: dict, key: str, where: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return d[key]


def load_config(path: str | Path) -> ModelConfig:
    """Read config.json from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json (is this a Hugging Face checkpoint folder?)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    return parse_config(raw, str(file))


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    if "text_config" in raw or any("K3" in a for a in archs):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: a Kimi K3 config needs a 'text_config' object")
        quant = text.get("quantization_config") or raw.get("quantization_config")
        return _parse_text(text, where, architecture="k3", prefix="language_model.", quant=quant)
    if any("KimiLinear" in a for a in archs) or raw.get("model_type") == "kimi_linear":
        return _parse_text(raw, where, architecture="kimi_linear", prefix="",
                           quant=raw.get("quantization_config"))
    raise ConfigError(
        f"{where}: architectures {archs!r} is not a Kimi model "
        "(expected KimiK3ForConditionalGeneration or KimiLinearForCausalLM)")


def _parse_text(t: dict, where: str, architecture: str, prefix: str, quant) -> ModelConfig:
    n = int(_req(t, "num_hidden_layers", where))
    lac = t.get("linear_attn_config") or {}
    if "kda_layers" in lac and "full_attn_layers" in lac:
        kda = sorted(int(i) - 1 for i in lac["kda_layers"])  # the file is 1-indexed
        mla = sorted(int(i) - 1 for i in lac["full_attn_layers"])
    elif t.get("layer_types"):
        kinds = t["layer_types"]
        kda = [i for i, k in enumerate(kinds) if k == "linear_attention"]
        mla = [i for i, k in enumerate(kinds) if k == "full_attention"]
    else:
        raise ConfigError(f"{where}: linear_attn_config must list kda_layers and full_attn_layers")
    if sorted(kda + mla) != list(range(n)):
        raise ConfigError(
            f"{where}: kda_layers and full_attn_layers must cover layers 1..{n} exactly once "
            f"(got kda={[i + 1 for i in kda]}, full={[i + 1 for i in mla]})")

    heads = int(lac.get("num_heads", t.get("linear_num_heads", 0)) or 0)
    head_dim = int(lac.get("head_dim", t.get("linear_head_dim", 0)) or 0)
    if kda and (heads <= 0 or head_dim <= 0):
        raise ConfigError(f"{where}: linear_attn_config needs num_heads and head_dim")

    act = str(t.get("hidden_act", "silu")).lower()
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: hidden_act '{act}' is not supported (allowed: situ, silu)")
    router_act = str(t.get("moe_router_activation_func") or "sigmoid")
    if router_act not in ("sigmoid", "softmax"):
        raise ConfigError(f"{where}: moe_router_activation_func '{router_act}' (allowed: sigmoid, softmax)")

    num_experts = int(t.get("num_experts", t.get("num_local_experts", t.get("n_routed_experts", 0))) or 0)
    top_k = int(t.get("num_experts_per_token", t.get("num_experts_per_tok", 0)) or 0)
    first_dense = t.get("first_k_dense_replace")
    if first_dense is None:
        mlp_types = t.get("mlp_layer_types") or []
        first_dense = sum(1 for k in mlp_types if k == "dense") if mlp_types else 1
    first_dense = int(first_dense)
    if num_experts and not (0 < top_k <= num_experts):
        raise ConfigError(f"{where}: num_experts_per_token={top_k} must be in 1..num_experts={num_experts}")
    groups = int(t.get("num_expert_group", t.get("n_group", 1)) or 1)
    if num_experts and num_experts % groups:
        raise ConfigError(f"{where}: num_experts={num_experts} is not divisible by num_expert_group={groups}")

    expert_format = "dense"
    if quant:
        fmt = str(quant.get("format", "")) if isinstance(quant, dict) else ""
        groups_cfg = quant.get("config_groups", {}) if isinstance(quant, dict) else {}
        if fmt == "pack-quantized" or "mxfp4" in json.dumps(quant).lower() or groups_cfg:
            expert_format = "mxfp4"

    eos = t.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    latent = t.get("routed_expert_hidden_size")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_req(t, "vocab_size", where)),
        hidden_size=int(_req(t, "hidden_size", where)),
        num_layers=n,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
        kda_layers=tuple(kda),
        mla_layers=tuple(mla),
        kda_num_heads=heads,
        kda_head_dim=head_dim,
        conv_kernel=int(lac.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4))),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        kda_gate_lower_bound=(float(lac["gate_lower_bound"]) if lac.get("gate_lower_bound") is not None
                              else None),
        mla_num_heads=int(t.get("num_attention_heads", 0) or 0),
        q_lora_rank=(int(t["q_lora_rank"]) if t.get("q_lora_rank") else None),
        kv_lora_rank=int(t.get("kv_lora_rank", 0) or 0),
        qk_nope_head_dim=int(t.get("qk_nope_head_dim", 0) or 0),
        qk_rope_head_dim=int(t.get("qk_rope_head_dim", 0) or 0),
        v_head_dim=int(t.get("v_head_dim", 0) or 0),
        mla_output_gate=bool(t.get("mla_use_output_gate", False)),
        first_k_dense=first_dense,
        intermediate_size=int(t.get("intermediate_size", 0) or 0),
        num_experts=num_experts,
        experts_per_token=top_k,
        num_shared_experts=int(t.get("num_shared_experts", t.get("n_shared_experts", 0)) or 0),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 0) or 0),
        latent_size=(int(latent) if latent else None),
        latent_norm=bool(t.get("latent_moe_use_norm", False)) and bool(latent),
        router_activation=router_act,
        num_expert_group=groups,
        topk_group=int(t.get("topk_group", 1) or 1),
        renormalize=bool(t.get("moe_renormalize", t.get("norm_topk_prob", True))),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0) or 1.0),
        hidden_act=act,
        situ_beta=(float(t["activation_situ_beta"]) if t.get("activation_situ_beta") is not None else None),
        situ_linear_beta=(float(t["activation_situ_linear_beta"])
                          if t.get("activation_situ_linear_beta") is not None else None),
        attn_res_block_size=(int(t["attn_res_block_size"]) if t.get("attn_res_block_size") else None),
        expert_format=expert_format,
        tensor_prefix=prefix,
        max_position_embeddings=int(t.get("max_position_embeddings", t.get("model_max_length", 1 << 20))),
        bos_token_id=t.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
