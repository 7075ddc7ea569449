"""The model's shape, read from a checkpoint's config.json.

One dataclass covers the whole family: Kimi K3 (``KimiK3ForConditionalGeneration`` with a
``text_config``) and Kimi Linear (``KimiLinearForCausalLM``). Every size, flag and layer list
comes from the file; nothing here knows the real K3's numbers.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import DeltafinError


class ConfigError(DeltafinError):
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


# Sane maxima: far above any published Kimi model (K3: 93 layers, 896 experts, H 7168, vocab
# 163840) and far below what would make deltafin allocate or enumerate without end. The files'
# real sizes are checked against the config by the checkpoint readers.
MAX_LAYERS = 1024
MAX_EXPERTS = 1 << 16
MAX_DIM = 1 << 20  # any width, rank or head dimension
MAX_HEADS = 1 << 12
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 30


def _present(d: dict, key: str) -> bool:
    return key in d and d[key] is not None


def _int(d: dict, keys, where: str, default=None, lo: int = 0, hi: int = MAX_DIM, required: bool = False):
    """The first of `keys` present in d, as an integer in [lo, hi] (JSON integers only: "64", 64.5
    and true are refused, naming the field)."""
    keys = (keys,) if isinstance(keys, str) else keys
    key = next((k for k in keys if _present(d, k)), None)
    if key is None:
        if required:
            raise ConfigError(f"{where}: required field '{keys[0]}' is missing")
        return default
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{where}: field '{key}' must be an integer, got {json.dumps(v)[:60]}")
    if not lo <= v <= hi:
        raise ConfigError(f"{where}: field '{key}' = {v} is out of range [{lo}, {hi}]")
    return v


def _float(d: dict, key: str, where: str, default=None):
    if not _present(d, key):
        return default
    v = d[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ConfigError(f"{where}: field '{key}' must be a finite number, got {json.dumps(v)[:60]}")
    return float(v)


def _int_list(d: dict, key: str, where: str, lo: int, hi: int) -> list[int]:
    v = d[key]
    if not isinstance(v, list) or len(v) > MAX_LAYERS or not all(
            isinstance(i, int) and not isinstance(i, bool) and lo <= i <= hi for i in v):
        raise ConfigError(f"{where}: field '{key}' must be a list of layer numbers in [{lo}, {hi}]")
    return v


def _obj(d: dict, key: str, where: str) -> dict:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: field '{key}' must be an object, got {json.dumps(v)[:60]}")
    return v


def load_config(path: str | Path) -> ModelConfig:
    """Read config.json from a checkpoint folder (or the file itself)."""
    from .files import CheckpointError, read_json
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json (is this a Hugging Face checkpoint folder?)")
    try:
        raw = read_json(file, "config.json", max_bytes=16 << 20)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return parse_config(raw, str(file))


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the config must be a JSON object")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{where}: field 'architectures' must be a list of strings")
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
    n = _int(t, "num_hidden_layers", where, lo=1, hi=MAX_LAYERS, required=True)
    lac = _obj(t, "linear_attn_config", where)
    if "kda_layers" in lac and "full_attn_layers" in lac:
        kda = sorted(i - 1 for i in _int_list(lac, "kda_layers", where, 1, n))  # the file is 1-indexed
        mla = sorted(i - 1 for i in _int_list(lac, "full_attn_layers", where, 1, n))
    elif t.get("layer_types"):
        kinds = t["layer_types"]
        if not isinstance(kinds, list):
            raise ConfigError(f"{where}: field 'layer_types' must be a list")
        kda = [i for i, k in enumerate(kinds) if k == "linear_attention"]
        mla = [i for i, k in enumerate(kinds) if k == "full_attention"]
    else:
        raise ConfigError(f"{where}: linear_attn_config must list kda_layers and full_attn_layers")
    if sorted(kda + mla) != list(range(n)):
        raise ConfigError(
            f"{where}: kda_layers and full_attn_layers must cover layers 1..{n} exactly once "
            f"(got kda={[i + 1 for i in kda]}, full={[i + 1 for i in mla]})")

    heads = _int(lac, "num_heads", where, default=None, hi=MAX_HEADS)
    heads = _int(t, "linear_num_heads", where, default=0, hi=MAX_HEADS) if heads is None else heads
    head_dim = _int(lac, "head_dim", where, default=None)
    head_dim = _int(t, "linear_head_dim", where, default=0) if head_dim is None else head_dim
    if kda and (heads <= 0 or head_dim <= 0):
        raise ConfigError(f"{where}: linear_attn_config needs num_heads and head_dim")

    act = str(t.get("hidden_act", "silu")).lower()
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: hidden_act '{act}' is not supported (allowed: situ, silu)")
    router_act = str(t.get("moe_router_activation_func") or "sigmoid")
    if router_act not in ("sigmoid", "softmax"):
        raise ConfigError(f"{where}: moe_router_activation_func '{router_act}' (allowed: sigmoid, softmax)")

    num_experts = _int(t, ("num_experts", "num_local_experts", "n_routed_experts"), where, default=0,
                       hi=MAX_EXPERTS)
    top_k = _int(t, ("num_experts_per_token", "num_experts_per_tok"), where, default=0, hi=MAX_EXPERTS)
    first_dense = _int(t, "first_k_dense_replace", where, default=None, hi=n)
    if first_dense is None:
        mlp_types = t.get("mlp_layer_types") or []
        if not isinstance(mlp_types, list):
            raise ConfigError(f"{where}: field 'mlp_layer_types' must be a list")
        first_dense = sum(1 for k in mlp_types if k == "dense") if mlp_types else 1
    if num_experts and not (0 < top_k <= num_experts):
        raise ConfigError(f"{where}: num_experts_per_token={top_k} must be in 1..num_experts={num_experts}")
    groups = _int(t, ("num_expert_group", "n_group"), where, default=1, lo=1, hi=MAX_EXPERTS)
    if num_experts and num_experts % groups:
        raise ConfigError(f"{where}: num_experts={num_experts} is not divisible by num_expert_group={groups}")

    expert_format = "dense"
    if quant:
        fmt = str(quant.get("format", "")) if isinstance(quant, dict) else ""
        groups_cfg = quant.get("config_groups", {}) if isinstance(quant, dict) else {}
        if fmt == "pack-quantized" or "mxfp4" in json.dumps(quant).lower() or groups_cfg:
            expert_format = "mxfp4"

    eos = t.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_list):
        raise ConfigError(f"{where}: field 'eos_token_id' must be a token id or a list of token ids")
    bos = _int(t, "bos_token_id", where, default=None, hi=MAX_VOCAB)
    latent = _int(t, "routed_expert_hidden_size", where, default=0)
    attn_res = _int(t, "attn_res_block_size", where, default=0, hi=MAX_LAYERS)
    q_lora = _int(t, "q_lora_rank", where, default=0)
    lower = _float(lac, "gate_lower_bound", where)
    beta, linear_beta = _float(t, "activation_situ_beta", where), _float(t, "activation_situ_linear_beta", where)
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(t, "vocab_size", where, lo=1, hi=MAX_VOCAB, required=True),
        hidden_size=_int(t, "hidden_size", where, lo=1, required=True),
        num_layers=n,
        rms_norm_eps=_float(t, "rms_norm_eps", where, 1e-5),
        kda_layers=tuple(kda),
        mla_layers=tuple(mla),
        kda_num_heads=heads,
        kda_head_dim=head_dim,
        conv_kernel=_int(lac, "short_conv_kernel_size", where, default=None, lo=1, hi=64)
        or _int(t, "linear_conv_kernel_dim", where, default=4, lo=1, hi=64),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        kda_gate_lower_bound=lower,
        mla_num_heads=_int(t, "num_attention_heads", where, default=0, hi=MAX_HEADS),
        q_lora_rank=q_lora or None,
        kv_lora_rank=_int(t, "kv_lora_rank", where, default=0),
        qk_nope_head_dim=_int(t, "qk_nope_head_dim", where, default=0),
        qk_rope_head_dim=_int(t, "qk_rope_head_dim", where, default=0),
        v_head_dim=_int(t, "v_head_dim", where, default=0),
        mla_output_gate=bool(t.get("mla_use_output_gate", False)),
        first_k_dense=first_dense,
        intermediate_size=_int(t, "intermediate_size", where, default=0),
        num_experts=num_experts,
        experts_per_token=top_k,
        num_shared_experts=_int(t, ("num_shared_experts", "n_shared_experts"), where, default=0, hi=MAX_EXPERTS),
        moe_intermediate_size=_int(t, "moe_intermediate_size", where, default=0),
        latent_size=latent or None,
        latent_norm=bool(t.get("latent_moe_use_norm", False)) and bool(latent),
        router_activation=router_act,
        num_expert_group=groups,
        topk_group=_int(t, "topk_group", where, default=1, lo=0, hi=MAX_EXPERTS) or 1,
        renormalize=bool(t.get("moe_renormalize", t.get("norm_topk_prob", True))),
        routed_scaling_factor=_float(t, "routed_scaling_factor", where, 1.0) or 1.0,
        hidden_act=act,
        situ_beta=beta,
        situ_linear_beta=linear_beta,
        attn_res_block_size=attn_res or None,
        expert_format=expert_format,
        tensor_prefix=prefix,
        max_position_embeddings=_int(t, ("max_position_embeddings", "model_max_length"), where, default=1 << 20,
                                     lo=1, hi=MAX_CONTEXT),
        bos_token_id=bos,
        eos_token_ids=tuple(eos_list),
    )
