"""Which codec each spine tensor is stored in: tensor roles, and policies that map roles to codecs.

A *role* names what a spine tensor does (``kda.qkv``, ``moe.shared``, ``lm_head`` ...). Every
tensor name ``layout.py`` can produce has exactly one role (``role_of``). A *policy* maps roles
to codecs: ``plain`` (kept exactly as published; ``bf16`` is accepted as a synonym), ``int8``,
``int6`` or ``int4`` (symmetric, group-wise along the input dimension; int8 with a float16 scale
per group, as llama.cpp's Q8_0 at group 32, or one float32 scale per output channel where no
group of at least 32 fits, which is also how stores written before grouped int8 hold it), ``int8-row``
(int8 with one scale per output row everywhere).
Roles a policy does not name are kept plain.

Rules every policy obeys (a policy that breaks one is rejected, naming the role):

- Protected roles are always plain: routers (a flipped expert choice changes which weights run at
  all), norms, the KDA depthwise convs, Block Attention Residual queries and norms, embeddings.
  They are a small share of the bytes read per token, so quantizing them would buy little.
- ``kda.decay`` is no coarser than int8. Its projections f_a / f_b feed the per-channel decay
  exp(g) that multiplies the recurrent state at every token, so their error compounds over the
  context instead of staying local to one token; int8 is what the int8 spine has always used.
  Its vectors A_log and dt_bias are never quantized (see the next rule).
- A role's codec applies to its 2-D projection weights (``*_proj.weight`` and ``lm_head``). Any
  other tensor of a role (A_log, dt_bias) is kept plain.

The group size of a policy (a power of two in 16..256, so the fused GPU kernels apply) is halved
for a weight whose input width it does not divide, down to 16 (int8: 32); a weight that still does
not fit is stored as int8 with one scale per output channel. The store records the codec of every
tensor, and the reader takes the group size from the stored tensors' shapes, so no reader needs the
policy.

A policy file is JSON: ``{"name": "mine", "group_size": 32, "roles": {"moe.shared": "int4", ...}}``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ModelConfig
from .layout import global_tensors, layer_spine_tensors, nbytes

PLAIN = "plain"  # the store's name for "as stored in the source" (store.PLAIN)
KEEP_NAMES = (PLAIN, "bf16")
# int8 with one float32 scale per output row (what int8 was before group scales): ~6 % fewer bytes
ROW_INT8 = "int8-row"
CODECS = (PLAIN, "int8", ROW_INT8, "int6", "int4")
# Stored bits per weight element (scales aside): how fine a codec is.
CODEC_BITS = {PLAIN: 16, "int8": 8, ROW_INT8: 8, "int6": 6, "int4": 4}
GROUP_SIZES = (16, 32, 64, 128, 256)
MIN_GROUP = 16
INT8_MIN_GROUP = 32  # the native int8 kernels' steps (kernels/int8.py GROUP_MULTIPLE)

ROLES: dict[str, str] = {
    "kda.qkv": "KDA q/k/v projections",
    "kda.conv": "KDA depthwise causal convs on q/k/v",
    "kda.decay": "KDA decay gate: f_a/f_b projections, A_log, dt_bias",
    "kda.beta": "KDA delta-rule strength b_proj",
    "kda.gate": "KDA output gate g_proj (or g_a/g_b)",
    "kda.o_norm": "KDA per-head output norm",
    "kda.out": "KDA output projection o_proj",
    "mla.q": "MLA query projections q_a/q_b (or q_proj)",
    "mla.kv": "MLA compressed kv projections kv_a_proj_with_mqa, kv_b_proj",
    "mla.norm": "MLA q_a/kv_a layernorms",
    "mla.gate": "MLA output gate g_proj",
    "mla.out": "MLA output projection o_proj",
    "dense.mlp": "dense MLP gate/up/down of the first layers",
    "moe.router": "MoE router weight and score-correction bias",
    "moe.shared": "shared-expert MLP gate/up/down",
    "moe.latent_down": "LatentMoE projection hidden -> latent",
    "moe.latent_up": "LatentMoE projection latent -> hidden",
    "moe.latent_norm": "LatentMoE norm on the latent sum",
    "attn_res": "Block Attention Residual queries and norms",
    "norms": "input / post-attention / final RMSNorms",
    "embed": "token embeddings",
    "lm_head": "output projection to the vocabulary",
}
PROTECTED = frozenset({"kda.conv", "kda.o_norm", "mla.norm", "moe.router", "moe.latent_norm", "attn_res",
                       "norms", "embed"})
FLOORS = {"kda.decay": "int8"}  # the coarsest codec a role may be given

ATTENTION_ROLES = ("kda.qkv", "kda.decay", "kda.beta", "kda.gate", "kda.out", "mla.q", "mla.kv", "mla.gate",
                   "mla.out")
MLP_ROLES = ("dense.mlp", "moe.shared", "moe.latent_down", "moe.latent_up")


class PolicyError(ValueError):
    """A policy names an unknown role or codec, or quantizes a role that must stay plain."""


# -- roles ---------------------------------------------------------------------------------------
_GLOBAL_ROLES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norms",
    "lm_head.weight": "lm_head",
    "model.output_attn_res_norm.weight": "attn_res",
    "model.output_attn_res_proj.weight": "attn_res",
}
_LAYER_ROLES = {
    "input_layernorm.weight": "norms",
    "post_attention_layernorm.weight": "norms",
    "self_attention_res_norm.weight": "attn_res",
    "self_attention_res_proj.weight": "attn_res",
    "mlp_res_norm.weight": "attn_res",
    "mlp_res_proj.weight": "attn_res",
    "block_sparse_moe.gate.weight": "moe.router",
    "block_sparse_moe.gate.e_score_correction_bias": "moe.router",
    "block_sparse_moe.routed_expert_down_proj.weight": "moe.latent_down",
    "block_sparse_moe.routed_expert_up_proj.weight": "moe.latent_up",
    "block_sparse_moe.routed_expert_norm.weight": "moe.latent_norm",
}
_KDA_ROLES = {
    "q_proj.weight": "kda.qkv", "k_proj.weight": "kda.qkv", "v_proj.weight": "kda.qkv",
    "q_conv1d.weight": "kda.conv", "k_conv1d.weight": "kda.conv", "v_conv1d.weight": "kda.conv",
    "f_a_proj.weight": "kda.decay", "f_b_proj.weight": "kda.decay", "A_log": "kda.decay", "dt_bias": "kda.decay",
    "b_proj.weight": "kda.beta",
    "g_proj.weight": "kda.gate", "g_a_proj.weight": "kda.gate", "g_b_proj.weight": "kda.gate",
    "o_norm.weight": "kda.o_norm",
    "o_proj.weight": "kda.out",
}
_MLA_ROLES = {
    "q_a_proj.weight": "mla.q", "q_b_proj.weight": "mla.q", "q_proj.weight": "mla.q",
    "kv_a_proj_with_mqa.weight": "mla.kv", "kv_b_proj.weight": "mla.kv",
    "q_a_layernorm.weight": "mla.norm", "kv_a_layernorm.weight": "mla.norm",
    "g_proj.weight": "mla.gate",
    "o_proj.weight": "mla.out",
}
_MLP_LEAVES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def role_of(rel_name: str, attention: str | None = None) -> str:
    """The role of a spine tensor, by its relative name (``lm_head.weight``, ``self_attn.q_proj.weight``).

    attention: "kda" or "mla", the kind of the tensor's layer. Needed only for the names both kinds
    use (``self_attn.q_proj`` / ``o_proj`` / ``g_proj``); the others tell their kind themselves.
    """
    if attention not in (None, "kda", "mla"):
        raise ValueError(f"attention kind must be 'kda' or 'mla', got {attention!r}")
    for table in (_GLOBAL_ROLES, _LAYER_ROLES):
        if rel_name in table:
            return table[rel_name]
    if rel_name.startswith("self_attn."):
        leaf = rel_name[len("self_attn."):]
        kda, mla = _KDA_ROLES.get(leaf), _MLA_ROLES.get(leaf)
        if attention == "kda" and kda:
            return kda
        if attention == "mla" and mla:
            return mla
        if attention is None and (kda is None) != (mla is None):
            return kda or mla
        if attention is None and kda and mla:
            raise ValueError(f"'{rel_name}' is in both KDA and MLA layers; give the layer's attention kind")
    for prefix, role in (("block_sparse_moe.shared_experts.", "moe.shared"), ("mlp.", "dense.mlp"),
                         ("block_sparse_moe.", "dense.mlp")):  # Kimi Linear as saved by transformers
        if rel_name.startswith(prefix) and rel_name[len(prefix):] in _MLP_LEAVES:
            return role
    kind = f" in a {attention.upper()} layer" if attention else ""
    raise ValueError(f"no role for spine tensor '{rel_name}'{kind}")


def attention_kind(cfg: ModelConfig, layer: int) -> str:
    return "kda" if layer in cfg.kda_layers else "mla"


def tensor_roles(cfg: ModelConfig, layer: int | None = None) -> dict[str, str]:
    """{relative name: role} of every spine tensor of `layer`, or of the globals when layer is None."""
    if layer is None:
        return {rel: role_of(rel) for rel in global_tensors(cfg)}
    kind = attention_kind(cfg, layer)
    return {rel: role_of(rel, kind) for rel in layer_spine_tensors(cfg, layer)}


def is_spine_projection(rel: str) -> bool:
    """A 2-D projection of the spine: attention (KDA q/k/v/o/g/f/b, MLA), dense MLP, shared
    experts, latent down/up, lm_head. Not: embeddings, norms, conv, router, attn-res queries.
    Only these are ever quantized."""
    if rel == "lm_head.weight":
        return True
    if rel.startswith("model.") or rel.endswith("_res_proj.weight"):
        return False
    return rel.endswith("_proj.weight") or rel.endswith("_proj_with_mqa.weight")


# -- codecs and their sizes ----------------------------------------------------------------------
def _pack_multiple(codec: str) -> int:
    return 2 if codec == "int4" else 4


def fit_group(codec: str, in_features: int, group_size: int) -> int:
    """The group size a weight of width in_features gets: group_size halved until it divides the
    width (and the codec can pack it), at least MIN_GROUP (int8: INT8_MIN_GROUP); 0 when none fits."""
    g = group_size
    while g >= (INT8_MIN_GROUP if codec == "int8" else MIN_GROUP):
        if in_features % g == 0 and in_features % _pack_multiple(codec) == 0:
            return g
        g //= 2
    return 0


def stored_nbytes(codec: str, rows: int, cols: int, group_size: int = 0, plain_bytes_per_elem: int = 2) -> int:
    """Bytes a [rows, cols] weight occupies in `codec` (scales included, alignment padding not)."""
    if codec == PLAIN:
        return rows * cols * plain_bytes_per_elem
    if codec == "int8":  # codes + one fp32 scale per row, or one fp16 scale per group
        return rows * cols + (rows * (cols // group_size) * 2 if group_size else rows * 4)
    if codec in ("int4", "int6"):
        packed = cols // 2 if codec == "int4" else cols * 3 // 4
        return rows * packed + rows * (cols // group_size) * 2  # fp16 scale per group
    raise ValueError(f"unknown codec {codec!r}")


def tensor_codec(rel: str, shape, codec: str, group_size: int) -> tuple[str, int]:
    """(codec, group size) a tensor gets when its role asks for `codec`: plain for anything but a
    2-D projection; a group-wise codec whose group cannot fit the width falls back to int8, and
    int8 to one scale per row (group size 0), which ROW_INT8 asks for."""
    if codec == PLAIN or not is_spine_projection(rel) or len(shape) != 2:
        return PLAIN, 0
    if codec == ROW_INT8:
        return "int8", 0
    g = fit_group(codec, shape[1], group_size)
    return (codec, g) if g else ("int8", 0)


# -- policies ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpinePolicy:
    name: str
    group_size: int = 32
    roles: Mapping[str, str] = field(default_factory=dict)  # role -> codec; unnamed roles are plain

    def __post_init__(self) -> None:
        _check(self.name, self.group_size, self.roles)
        object.__setattr__(self, "roles", {r: _canonical(c) for r, c in sorted(self.roles.items())})

    def role_codec(self, role: str) -> str:
        if role not in ROLES:
            raise PolicyError(f"unknown role '{role}'")
        return self.roles.get(role, PLAIN)

    def tensor_codec(self, rel: str, role: str, shape) -> tuple[str, int]:
        """(codec, group size) of one tensor of `role` (see ``tensor_codec``)."""
        return tensor_codec(rel, shape, self.role_codec(role), self.group_size)

    def to_dict(self) -> dict:
        return {"name": self.name, "group_size": self.group_size, "roles": dict(self.roles)}


def _canonical(codec: str) -> str:
    return PLAIN if codec in KEEP_NAMES else codec


def _check(name, group_size, roles, where: str = "policy") -> None:
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    if not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise PolicyError(f"{where} '{name}': group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if not isinstance(roles, Mapping):
        raise PolicyError(f"{where} '{name}': 'roles' must be an object {{role: codec}}")
    for role, codec in roles.items():
        if role not in ROLES:
            raise PolicyError(f"{where} '{name}': unknown role '{role}' (known roles: {', '.join(ROLES)})")
        if codec not in CODECS and codec not in KEEP_NAMES:
            raise PolicyError(f"{where} '{name}': unknown codec {codec!r} for role '{role}' "
                              f"(codecs: {', '.join((*CODECS, 'bf16'))})")
        codec = _canonical(codec)
        if role in PROTECTED and codec != PLAIN:
            raise PolicyError(f"{where} '{name}': role '{role}' ({ROLES[role]}) must stay plain; "
                              f"it cannot be stored as {codec}")
        floor = FLOORS.get(role)
        if floor and CODEC_BITS[codec] < CODEC_BITS[floor]:
            raise PolicyError(f"{where} '{name}': role '{role}' ({ROLES[role]}) may be stored no coarser "
                              f"than {floor}, not {codec}")


def _int8_everywhere() -> dict[str, str]:
    return {r: "int8" for r in ROLES if r not in PROTECTED}


NAMED: dict[str, SpinePolicy] = {
    # Exactly the int8 spine: every projection int8, a scale per 32 inputs.
    "int8": SpinePolicy("int8", 32, _int8_everywhere()),
    # int8 with one scale per output row, what the int8 spine was before group scales: ~6 % fewer
    # bytes, for a RAM cache that holds less than the model.
    ROW_INT8: SpinePolicy(ROW_INT8, 32, {r: ROW_INT8 for r in _int8_everywhere()}),
    # The MLP side (dense MLP, shared experts, latent down/up) int4; attention and lm_head int8.
    "moe4": SpinePolicy("moe4", 32, {**_int8_everywhere(), **{r: "int4" for r in MLP_ROLES}}),
    # Smaller still: attention and lm_head int6 as well (the decay projections keep their int8 floor).
    "moe4-attn6": SpinePolicy("moe4-attn6", 32, {**{r: "int6" for r in ATTENTION_ROLES}, "kda.decay": "int8",
                                                 **{r: "int4" for r in MLP_ROLES}, "lm_head": "int6"}),
}


def policy_from_dict(d, where: str = "policy") -> SpinePolicy:
    if not isinstance(d, dict):
        raise PolicyError(f"{where}: a policy is a JSON object {{\"name\", \"group_size\", \"roles\"}}")
    unknown = set(d) - {"name", "group_size", "roles"}
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (a policy has name, group_size, roles)")
    name, group_size, roles = d.get("name"), d.get("group_size", 32), d.get("roles", {})
    _check(name, group_size, roles, where)
    return SpinePolicy(name, group_size, roles)


def load_policy(spec: str | Path | SpinePolicy) -> SpinePolicy:
    """A named policy (``int8``, ``moe4``, ``moe4-attn6``) or a JSON policy file."""
    if isinstance(spec, SpinePolicy):
        return spec
    if str(spec) in NAMED:
        return NAMED[str(spec)]
    path = Path(spec)
    if not path.is_file():
        raise PolicyError(f"unknown spine policy '{spec}': not one of {', '.join(NAMED)} and not a policy file")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PolicyError(f"{path}: cannot read the policy file ({e})") from None
    return policy_from_dict(d, str(path))


def layer_codecs(policy: SpinePolicy, cfg: ModelConfig, layer: int | None) -> dict[str, tuple[str, int]]:
    """{relative name: (codec, group size)} for the spine tensors of `layer` (None: the globals)."""
    specs = global_tensors(cfg) if layer is None else layer_spine_tensors(cfg, layer)
    roles = tensor_roles(cfg, layer)
    return {rel: policy.tensor_codec(rel, roles[rel], spec.shape) for rel, spec in specs.items()}


def role_bytes(cfg: ModelConfig, policy: SpinePolicy | None = None) -> dict[str, dict[str, int]]:
    """{role: {"plain": bytes, "stored": bytes}} one decode token reads of the spine (every layer and
    the head; of the embedding table one row), as published and under `policy` (None: plain).
    Computed from the layout and the codec formulas, so it needs no weights."""
    out: dict[str, dict[str, int]] = {}
    for layer in (None, *range(cfg.num_layers)):
        specs = global_tensors(cfg) if layer is None else layer_spine_tensors(cfg, layer)
        roles = tensor_roles(cfg, layer)
        for rel, spec in specs.items():
            plain = nbytes(spec)
            if rel == "model.embed_tokens.weight":
                plain //= cfg.vocab_size  # a token reads one row of the table
            codec, g = policy.tensor_codec(rel, roles[rel], spec.shape) if policy else (PLAIN, 0)
            stored = plain if codec == PLAIN else stored_nbytes(codec, *spec.shape, g)
            row = out.setdefault(roles[rel], {"plain": 0, "stored": 0})
            row["plain"] += plain
            row["stored"] += stored
    return {r: out[r] for r in ROLES if r in out}
