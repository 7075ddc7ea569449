"""Every tensor a checkpoint of a given config must hold: names, shapes, dtypes.

This is the one place that knows checkpoint tensor names. The reader validates against it,
the synthetic-checkpoint writer generates from it, and the store converter walks it.

Names here are *relative*: top-level names like ``model.embed_tokens.weight`` and per-layer
names like ``self_attn.q_proj.weight`` (under ``model.layers.{i}.``). ``full_name`` adds the
layer path and the checkpoint's prefix (``language_model.`` for K3).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

BF16, F32, U8 = "BF16", "F32", "U8"
MXFP4_GROUP = 32


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    # Other shapes a published checkpoint may use for the same tensor (e.g. conv [D,1,K] vs [D,K]).
    alt_shapes: tuple[tuple[int, ...], ...] = ()

    def accepts(self, shape) -> bool:
        shape = tuple(shape)
        return shape == self.shape or shape in self.alt_shapes


def full_name(cfg: ModelConfig, rel: str, layer: int | None = None) -> str:
    if layer is None:
        return cfg.tensor_prefix + rel
    return f"{cfg.tensor_prefix}model.layers.{layer}.{rel}"


def global_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    H, V = cfg.hidden_size, cfg.vocab_size
    out = {
        "model.embed_tokens.weight": TensorSpec((V, H), BF16),
        "model.norm.weight": TensorSpec((H,), BF16),
        "lm_head.weight": TensorSpec((V, H), BF16),
    }
    if cfg.attn_res_block_size:
        out["model.output_attn_res_norm.weight"] = TensorSpec((H,), BF16)
        out["model.output_attn_res_proj.weight"] = TensorSpec((1, H), BF16)
    return out


def dense_mlp_prefix(cfg: ModelConfig) -> str:
    """Kimi Linear as written by transformers puts the dense MLP under block_sparse_moe."""
    return "mlp." if cfg.is_k3 else "block_sparse_moe."


def layer_spine_tensors(cfg: ModelConfig, i: int) -> dict[str, TensorSpec]:
    """Non-expert tensors of layer i (relative names)."""
    H = cfg.hidden_size
    t: dict[str, TensorSpec] = {
        "input_layernorm.weight": TensorSpec((H,), BF16),
        "post_attention_layernorm.weight": TensorSpec((H,), BF16),
    }
    if cfg.attn_res_block_size:
        for part in ("self_attention_res", "mlp_res"):
            t[f"{part}_norm.weight"] = TensorSpec((H,), BF16)
            t[f"{part}_proj.weight"] = TensorSpec((1, H), BF16)
    if i in cfg.kda_layers:
        nh, d, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        D = nh * d
        a = "self_attn."
        for p in ("q", "k", "v"):
            t[f"{a}{p}_proj.weight"] = TensorSpec((D, H), BF16)
            t[f"{a}{p}_conv1d.weight"] = TensorSpec((D, 1, K), F32, alt_shapes=((D, K),))
        padded = -(-nh // 128) * 128
        # K3 publishes A_log zero-padded to a multiple of 128 entries; Kimi Linear as [1, 1, heads, 1].
        shapes = [(padded,), (1, 1, nh, 1), (nh,)] if cfg.is_k3 else [(1, 1, nh, 1), (nh,), (padded,)]
        t[a + "A_log"] = TensorSpec(shapes[0], F32, alt_shapes=tuple(shapes[1:]))
        t[a + "dt_bias"] = TensorSpec((D,), F32)
        t[a + "f_a_proj.weight"] = TensorSpec((d, H), BF16)
        t[a + "f_b_proj.weight"] = TensorSpec((D, d), BF16)
        t[a + "b_proj.weight"] = TensorSpec((nh, H), BF16)
        if cfg.kda_full_rank_gate:
            t[a + "g_proj.weight"] = TensorSpec((D, H), BF16)
        else:
            t[a + "g_a_proj.weight"] = TensorSpec((d, H), BF16)
            t[a + "g_b_proj.weight"] = TensorSpec((D, d), BF16)
        t[a + "o_norm.weight"] = TensorSpec((d,), F32)
        t[a + "o_proj.weight"] = TensorSpec((H, D), BF16)
    else:
        nh = cfg.mla_num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        a = "self_attn."
        if cfg.q_lora_rank:
            t[a + "q_a_proj.weight"] = TensorSpec((cfg.q_lora_rank, H), BF16)
            t[a + "q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), BF16)
            t[a + "q_b_proj.weight"] = TensorSpec((nh * qk, cfg.q_lora_rank), BF16)
        else:
            t[a + "q_proj.weight"] = TensorSpec((nh * qk, H), BF16)
        t[a + "kv_a_proj_with_mqa.weight"] = TensorSpec((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), BF16)
        t[a + "kv_a_layernorm.weight"] = TensorSpec((cfg.kv_lora_rank,), BF16)
        t[a + "kv_b_proj.weight"] = TensorSpec(
            (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), BF16)
        t[a + "o_proj.weight"] = TensorSpec((H, nh * cfg.v_head_dim), BF16)
        if cfg.mla_output_gate:
            t[a + "g_proj.weight"] = TensorSpec((nh * cfg.v_head_dim, H), BF16)
    if not cfg.is_moe(i):
        I = cfg.intermediate_size
        m = dense_mlp_prefix(cfg)
        t[m + "gate_proj.weight"] = TensorSpec((I, H), BF16)
        t[m + "up_proj.weight"] = TensorSpec((I, H), BF16)
        t[m + "down_proj.weight"] = TensorSpec((H, I), BF16)
    else:
        E = cfg.num_experts
        m = "block_sparse_moe."
        t[m + "gate.weight"] = TensorSpec((E, H), BF16)
        t[m + "gate.e_score_correction_bias"] = TensorSpec((E,), F32)
        if cfg.num_shared_experts:
            Is = cfg.moe_intermediate_size * cfg.num_shared_experts
            t[m + "shared_experts.gate_proj.weight"] = TensorSpec((Is, H), BF16)
            t[m + "shared_experts.up_proj.weight"] = TensorSpec((Is, H), BF16)
            t[m + "shared_experts.down_proj.weight"] = TensorSpec((H, Is), BF16)
        if cfg.latent_size:
            L = cfg.latent_size
            t[m + "routed_expert_down_proj.weight"] = TensorSpec((L, H), BF16)
            t[m + "routed_expert_up_proj.weight"] = TensorSpec((H, L), BF16)
            if cfg.latent_norm:
                t[m + "routed_expert_norm.weight"] = TensorSpec((L,), BF16)
    return t


# Routed experts as a converted store may hold them (checkpoint/experts.py says when each is used).
# "plain" is as published: bf16 for Kimi Linear, MXFP4 for K3.
EXPERT_INT4_GROUP = 32  # int4 experts: one fp16 scale per 32 inputs, as the spine's int4 default
EXPERT_INT8_GROUP = 32  # int8g experts: one fp16 scale per 32 inputs ("int8": one fp32 per row, older stores)
# Grouped int8 experts by group size (convert --int8-group; expert_codec.DEFAULT_INT8_GROUP is what
# --experts int8 writes without it): "int8g" was the first, at 32.
EXPERT_INT8_CODECS = {EXPERT_INT8_GROUP: "int8g", 64: "int8g64", 128: "int8g128"}
EXPERT_CODECS = ("plain", "int8", *EXPERT_INT8_CODECS.values(), "int4", "mxfp4")
# Each re-encoded expert codec as a weight codec (kernels.linear) and its group size.
EXPERT_WEIGHTS = {"int8": ("int8", 0), **{c: ("int8", g) for g, c in EXPERT_INT8_CODECS.items()},
                  "int4": ("int4", EXPERT_INT4_GROUP), "mxfp4": ("mxfp4", MXFP4_GROUP)}


def expert_tensors(cfg: ModelConfig, i: int, e: int, codec: str = "plain") -> dict[str, TensorSpec]:
    """The tensors of routed expert e of MoE layer i (relative names), as published (codec
    "plain") or re-encoded by ``deltafin convert --experts`` (int8g / int8g64 / int8g128; int8 in older
    stores; int4, mxfp4)."""
    L, I = cfg.expert_width, cfg.moe_intermediate_size
    p = f"block_sparse_moe.experts.{e}."
    shapes = {"w1": (I, L), "w3": (I, L), "w2": (L, I)}
    if codec == "plain":
        codec = "mxfp4" if cfg.expert_format == "mxfp4" else "bf16"
    out = {}
    for w, (o, n) in shapes.items():
        if codec == "mxfp4":
            out[p + w + ".weight_packed"] = TensorSpec((o, n // 2), U8)
            out[p + w + ".weight_scale"] = TensorSpec((o, n // MXFP4_GROUP), U8)
        elif codec == "int8":
            out[p + w + ".weight"] = TensorSpec((o, n), "I8")
            out[p + w + ".weight_scale"] = TensorSpec((o, 1), F32)
        elif codec in EXPERT_INT8_CODECS.values():
            out[p + w + ".weight"] = TensorSpec((o, n), "I8")
            out[p + w + ".weight_scale"] = TensorSpec((o, n // EXPERT_WEIGHTS[codec][1]), "F16")
        elif codec == "int4":
            out[p + w + ".weight_packed"] = TensorSpec((o, n // 2), U8)
            out[p + w + ".weight_scale"] = TensorSpec((o, n // EXPERT_INT4_GROUP), "F16")
        elif codec == "bf16":
            out[p + w + ".weight"] = TensorSpec((o, n), BF16)
        else:
            raise ValueError(f"unknown expert codec {codec!r} (expected one of {', '.join(EXPERT_CODECS)})")
    return out


def all_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Full names of every tensor the checkpoint must hold."""
    out = {full_name(cfg, k): v for k, v in global_tensors(cfg).items()}
    for i in range(cfg.num_layers):
        for k, v in layer_spine_tensors(cfg, i).items():
            out[full_name(cfg, k, i)] = v
        if cfg.is_moe(i):
            for e in range(cfg.num_experts):
                for k, v in expert_tensors(cfg, i, e).items():
                    out[full_name(cfg, k, i)] = v
    return out


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F8_E8M0": 1}


def nbytes(spec: TensorSpec) -> int:
    n = DTYPE_BYTES[spec.dtype]
    for s in spec.shape:
        n *= s
    return n


def _least_nbytes(spec: TensorSpec) -> int:
    """The fewest bytes a checkpoint may store the tensor in: small fp32 tensors (gates' biases,
    A_log, norms) are also published in bf16, and the loader takes either."""
    return nbytes(spec) // 2 if spec.dtype == F32 else nbytes(spec)


def implied_totals(cfg: ModelConfig) -> tuple[int, int]:
    """(tensor count, bytes) every checkpoint of `cfg` must hold, computed without listing the
    experts one by one (a config may claim any number of them; the files decide)."""
    count, size = 0, 0
    specs = [global_tensors(cfg)] + [layer_spine_tensors(cfg, i) for i in range(cfg.num_layers)]
    for group in specs:
        count += len(group)
        size += sum(_least_nbytes(s) for s in group.values())
    moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    if moe and cfg.num_experts:
        one = expert_tensors(cfg, cfg.first_k_dense, 0)
        count += moe * cfg.num_experts * len(one)
        size += moe * cfg.num_experts * sum(_least_nbytes(s) for s in one.values())
    return count, size


def check_config_fits(cfg: ModelConfig, have_tensors: int, have_bytes: int, where: str) -> None:
    """Refuse a config whose sizes imply more tensors or bytes than the files hold, before anything
    is enumerated or allocated from those sizes."""
    from ..files import CheckpointError
    count, size = implied_totals(cfg)
    shape = (f"num_hidden_layers={cfg.num_layers}, hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}, "
             f"num_experts={cfg.num_experts}, moe_intermediate_size={cfg.moe_intermediate_size}")
    if count > have_tensors:
        raise CheckpointError(f"{where}: the config ({shape}) implies {count} tensors, but the files hold only "
                              f"{have_tensors}")
    if size > have_bytes:
        raise CheckpointError(f"{where}: the config ({shape}) implies {size} bytes of tensors, but the files hold "
                              f"only {have_bytes}")
