"""Synthetic checkpoints in the published Kimi K3 and Kimi Linear formats.

No real weights are needed to develop or test deltafin: ``make_checkpoint`` writes a folder
that looks exactly like a Hugging Face checkpoint of the family (config.json,
generation_config.json, sharded safetensors with an index, and the Kimi tokenizer files
tiktoken.model and tokenizer_config.json with a chat template), filled with seeded random
weights whose scales keep the model numerically healthy.

Names, shapes and dtypes come from ``layout.all_tensors(parse_config(config.json))``: the
config is generated first, parsed like any other checkpoint's, and exactly the tensors the
layout lists are written (plus a few vision tensors for K3, which text inference ignores).

Random values come from two seeded pools (bf16 N(0, 1) values and uniform bytes) that tensors
take consecutive slices of, scaled per tensor. For small presets the pools are as large as the
checkpoint, so every value is independent; for ``k3-slice`` (tens of GB) they are capped and
reused at shifting offsets, so writing is bound by the disk, not by the random generator, and
memory stays bounded. Files are streamed shard by shard into ``OUT.partial-<pid>`` and renamed
to ``OUT`` only when complete.
"""
from __future__ import annotations

import base64
import copy
import functools
import importlib.metadata
import json
import math
import os
import queue
import shutil
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig, parse_config
from ..files import fsync_dir
from .layout import DTYPE_BYTES, MXFP4_GROUP, TensorSpec, all_tensors, nbytes
from .tokenizer_data import BOS_TOKEN, CHAT_TEMPLATE, CORPUS, EOS_TOKEN, IM_END, MEDIA_PAD, PAD_TOKEN, \
    SPECIAL_OFFSETS, UNK_TOKEN

# The configs carry the installed transformers' version, as its save_pretrained writes them (a fixed
# version went stale with the next transformers release: the config test compares the whole file).
TRANSFORMERS_VERSION = importlib.metadata.version("transformers")

# ----------------------------------------------------------------------------------------------
# Weight scales. Linear weights are N(0, (gain / sqrt(fan_in))^2), so with an RMS-normalized
# input (rms ~ 1) a projection's output has rms ~ gain. The gains are chosen so the features
# that distinguish K3 from its relatives change the logits visibly (> 1e-2) in tiny models.
# ----------------------------------------------------------------------------------------------
EMBED_STD = 1.0  # embeddings: residual stream starts at rms ~ 1
LM_HEAD_GAIN = 3.0  # logits spread of a few units: clear top-1 choices, no saturation
GLU_GATE_GAIN = 4.0  # dense/shared gate_proj: pre-activations ~ +-4, where SiTU (beta 4) and SiLU differ
GLU_UP_GAIN = 1.0
GLU_DOWN_GAIN = 0.5  # act(gate) * up has rms ~ 2-3; this brings the MLP output back to rms ~ 1
EXPERT_GATE_GAIN = 4.0  # routed w1, same reason as GLU_GATE_GAIN
EXPERT_UP_GAIN = 1.0  # routed w3
EXPERT_DOWN_GAIN = 1.0  # routed w2: routed output comparable to the shared expert's
ROUTER_GAIN = 1.0  # router logits ~ N(0, 1): sigmoid scores spread ~ 0.2
CORRECTION_BIAS_STD = 0.1  # e_score_correction_bias: same order as the score spread, so it moves selections
KDA_DECAY_NOISE_GAIN = 0.5  # f_b(f_a(x)): the per-token variation of the decay pre-activation
ATTN_RES_SCORE_STD = 1.5  # attn-res pseudo-query: depth-mixing scores ~ N(0, 1.5^2), far from uniform
NORM_WEIGHT_JITTER = 0.1  # RMSNorm weights 1 + N(0, 0.1^2)
# K3 "safe" decay gate g = lower_bound * sigmoid(exp(A_log) * r), r = f_b(f_a(x)) + dt_bias.
# exp(A_log) in [0.8, 1.25] and dt_bias in [-4, -2.5] put sigmoid(.) at ~0.01..0.1, so
# exp(g) is ~0.6..0.95: a state that remembers, but decays.
K3_A_RANGE = (0.8, 1.25)
K3_DT_BIAS_RANGE = (-4.0, -2.5)
# Kimi Linear gate g = -exp(A_log) * softplus(r): exp(A_log) in [1, 2] and softplus(dt_bias)
# in [0.05, 0.3] give exp(g) ~0.55..0.95.
KL_A_RANGE = (1.0, 2.0)
KL_DT_SOFTPLUS_RANGE = (0.05, 0.3)
# KDA short conv: the current-token tap ~1 keeps q/k/v close to their projections, the older
# taps mix in some history.
CONV_CURRENT_TAP = 1.0
CONV_TAP_STD = 0.25
# MXFP4: uniform random E2M1 codes have rms sqrt(mean(code^2)) ~ 2.93; per-group exponents vary
# by -1/0/+1 around the one that gives the target std (a factor ~1.32 on average in rms).
MXFP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
MXFP4_JITTER_RMS = math.sqrt((0.25 + 1 + 4) / 3)
# K3 normalizes the latent sum of the routed experts (RMSNorm over L), which cancels
# routed_scaling_factor except through the norm's eps. In the presets listed here the expert
# down-projection is scaled so that the latent sum has rms ~ sqrt(rms_norm_eps): there the
# factor, as in any checkpoint, only acts through eps, but visibly.
EPS_MATCHED_LATENT_PRESETS = frozenset({"tiny-k3"})
EXPERT_HIDDEN_RMS = 2.3  # rms of SiTU(w1 z) * (w3 z) with the gains above (measured on tiny-k3)

# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
DEFAULT_SHARD_BYTES = 2 * 1024**3
MIN_SHARDS = 3  # without an explicit shard size, even tiny checkpoints get several shards
POOL_CAP_ELEMS = 32 * 1024 * 1024  # bf16 normal pool (64 MB) and byte pool (32 MB) for huge checkpoints
CHUNK_ELEMS = 8 * 1024 * 1024  # largest piece scaled or written at once
K3_SLICE_RAM_FACTOR = 1.5  # default k3-slice: this many times the machine's RAM, so it cannot all be cached

TOKENIZER_VOCAB_SIZE = 512  # model vocabulary of the small presets
TRAINED_TOKENS = 480  # base tokens learned from the corpus: the 256 bytes + 224 merges
SPECIAL_BLOCK = 256  # special ids after the base vocabulary in real-size vocabularies (Kimi: 163,584 + 256)
SMALL_SPECIAL_BLOCK = 32  # the same block, shortened, where the vocabulary is small
FILLER_LEAD_BYTES = range(0xF8, 0x100)  # never in UTF-8 text: tokens starting with them are never produced


# ==============================================================================================
# Tokenizer (tiktoken.model + tokenizer_config.json, the Kimi format)
# ==============================================================================================
def special_block(vocab_size: int) -> int:
    return SPECIAL_BLOCK if vocab_size >= TRAINED_TOKENS + 2 * SPECIAL_BLOCK else SMALL_SPECIAL_BLOCK


def base_vocab_size(vocab_size: int) -> int:
    """Tokens of tiktoken.model for a model vocabulary: all ids below the special block."""
    return vocab_size - special_block(vocab_size)


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Named special tokens -> ids: Kimi's offsets after the base vocabulary; [UNK], [PAD] last."""
    base, block = base_vocab_size(vocab_size), special_block(vocab_size)
    ids = {t: base + k for t, k in SPECIAL_OFFSETS.items()}
    ids.update({UNK_TOKEN: base + block - 2, PAD_TOKEN: base + block - 1})
    return ids


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=1)
def trained_tokens() -> tuple[bytes, ...]:
    """Byte-level BPE tokens trained on the built-in corpus (deterministic), in rank order: the 256
    single bytes, then the merges in the order they were learned (the order BPE applies them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    alphabet = _byte_level_alphabet()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merged = [bytes(alphabet[c] for c in t) for t, _ in vocab if len(t) > 1]
    out = tuple(bytes([b]) for b in range(256)) + tuple(merged)
    if len(out) != TRAINED_TOKENS:
        raise RuntimeError(f"tokenizer training gave {len(out)} tokens, not {TRAINED_TOKENS}")
    return out


def tiktoken_model(vocab_size: int) -> str:
    """tiktoken.model text for a model vocabulary: the trained tokens, then (for a real-size
    vocabulary) unreachable filler tokens up to the special block, so the special ids sit where
    the real model has them."""
    base = base_vocab_size(vocab_size)
    tokens = list(trained_tokens())
    if base < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is too small for the synthetic tokenizer "
                         f"(at least {TRAINED_TOKENS + SMALL_SPECIAL_BLOCK})")
    fillers = (bytes([lead, hi, lo]) for lead in FILLER_LEAD_BYTES for hi in range(256) for lo in range(256))
    while len(tokens) < base:
        tokens.append(next(fillers))
    return "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


def tokenizer_config(vocab_size: int, model_max_length: int) -> dict:
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in sorted(special_token_ids(vocab_size).items(), key=lambda kv: kv[1])
        },
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }


# ==============================================================================================
# Presets and config.json
# ==============================================================================================
LINEAR_ATTN_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                    "use_full_rank_gate", "gate_lower_bound")
# Fields written by config_dict from other fields; overriding them directly would desynchronize.
DERIVED_KEYS = ("num_key_value_heads", "head_dim", "qk_head_dim", "layer_types", "mlp_layer_types",
                "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "bos_token_id",
                "eos_token_id", "pad_token_id")


def attention_layers(num_layers: int) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), 1-indexed: full attention every 4th layer and the last (as K3)."""
    full = sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})
    return [i for i in range(1, num_layers + 1) if i not in full], full


def _linear_attn_config(n: int, sizes: dict, defaults: dict) -> dict:
    """linear_attn_config: defaults, overridden by (and removed from) `sizes`, plus the layer lists."""
    lac = dict(defaults)
    for k in list(sizes):
        if k in LINEAR_ATTN_KEYS:
            lac[k] = sizes.pop(k)
    kda, full = attention_layers(n)
    lac.update(kda_layers=kda, full_attn_layers=full)
    return lac


def _k3_text(**sizes) -> dict:
    """K3 text_config with the real model's values; `sizes` replaces some of them."""
    n = sizes.pop("num_hidden_layers", 93)
    lac = _linear_attn_config(n, sizes, {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                         "use_full_rank_gate": True, "gate_lower_bound": -5.0})
    text = {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "num_hidden_layers": n,
        "num_attention_heads": 96,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "moe_intermediate_size": 3072,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": lac,
        "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "dtype": "bfloat16",
    }
    unknown = set(sizes) - set(text)
    if unknown:
        raise KeyError(f"unknown K3 field(s): {sorted(unknown)}")
    text.update(sizes)
    return text


def _kimi_linear_text(**sizes) -> dict:
    """Kimi Linear config fields (the 48B model's values); `sizes` replaces some of them."""
    n = sizes.pop("num_hidden_layers", 27)
    lac = _linear_attn_config(n, sizes, {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4})
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": n,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        "tie_word_embeddings": False,
        "model_max_length": 1048576,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "output_router_logits": False,
        "pretraining_tp": 1,
        "linear_attn_config": lac,
        "dtype": "bfloat16",
    }
    unknown = set(sizes) - set(text)
    if unknown:
        raise KeyError(f"unknown Kimi Linear field(s): {sorted(unknown)}")
    text.update(sizes)
    return text


# name -> the text config (K3: text_config; Kimi Linear: the whole config) before derived fields.
PRESETS: dict[str, dict] = {
    # ~0.5 MB. Layers: 0 dense KDA, 1-2 KDA+MoE, 3 MLA+MoE, 4 KDA+MoE, 5 MLA+MoE; attn-res
    # blocks start at layers 0, 2, 4. KDA A_log is stored zero-padded to 128 entries, as in K3.
    "tiny-k3": _k3_text(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_heads=4, head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=16, num_experts_per_token=4,
        moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2,
        max_position_embeddings=8192),
    # ~0.3 MB, loadable by transformers' KimiLinearForCausalLM. Layers: 0 dense KDA, 1-2
    # KDA+MoE, 3-4 MLA+MoE.
    "tiny-kimi-linear": _kimi_linear_text(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        num_heads=4, head_dim=16, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=32, model_max_length=8192),
    # ~145 MB: K3's structure at a size that runs anywhere (the default model of `deltafin run`).
    "small-k3": _k3_text(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_heads=4, head_dim=128, num_attention_heads=4, q_lora_rank=256, kv_lora_rank=128,
        num_experts=64, num_experts_per_token=8, moe_intermediate_size=512, routed_expert_hidden_size=256,
        attn_res_block_size=3, max_position_embeddings=8192),
    # The real K3's per-tensor shapes with 4 layers (dense KDA, KDA+MoE, KDA+MoE, MLA+MoE);
    # num_experts None = sized so the checkpoint is K3_SLICE_RAM_FACTOR x this machine's RAM.
    "k3-slice": _k3_text(num_hidden_layers=4, num_experts=None),
}


def config_dict(preset: str, overrides: dict | None = None) -> dict:
    """The config.json content of `preset` with `overrides` applied.

    Overrides name text-config fields (``num_hidden_layers``, ``num_experts``, ``q_lora_rank``
    ...) or linear_attn_config fields (``num_heads``, ``head_dim``, ``kda_layers`` ...; also as
    ``linear_attn_config.<key>``). Changing ``num_hidden_layers`` re-derives the KDA/MLA layer
    lists unless they are given too; giving one list makes the other its complement.
    ``num_experts_per_token`` is capped at ``num_experts`` unless set explicitly.
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown preset '{preset}' (known: {', '.join(PRESETS)})")
    text = copy.deepcopy(PRESETS[preset])
    lac = text["linear_attn_config"]
    overrides = dict(overrides or {})
    for key, value in overrides.items():
        k = key.removeprefix("linear_attn_config.")
        if k in DERIVED_KEYS and k != "head_dim":
            raise KeyError(f"'{key}' is derived from other fields and cannot be set")
        if k in LINEAR_ATTN_KEYS:
            lac[k] = value
        elif k in text:
            text[k] = value
        else:
            raise KeyError(f"unknown config field '{key}' for preset '{preset}'")
    given = {k.removeprefix("linear_attn_config.") for k in overrides}
    n = int(text["num_hidden_layers"])
    if "kda_layers" in given and "full_attn_layers" not in given:
        lac["full_attn_layers"] = [i for i in range(1, n + 1) if i not in set(lac["kda_layers"])]
    elif "full_attn_layers" in given and "kda_layers" not in given:
        lac["kda_layers"] = [i for i in range(1, n + 1) if i not in set(lac["full_attn_layers"])]
    elif "num_hidden_layers" in given and "kda_layers" not in given:
        lac["kda_layers"], lac["full_attn_layers"] = attention_layers(n)
    if text["num_experts"] is None:
        text["num_experts"] = k3_slice_default_experts(text)
    if "num_experts_per_token" not in given:
        text["num_experts_per_token"] = min(text["num_experts_per_token"], text["num_experts"])

    ids = special_token_ids(text["vocab_size"])
    text.update(bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN])
    text["num_key_value_heads"] = text["num_attention_heads"]
    if text["architectures"] == ["KimiLinearForCausalLM"]:
        return _kimi_linear_config(text)
    return _k3_config(text)


def _kimi_linear_config(t: dict) -> dict:
    """Exactly the fields transformers' KimiLinearForCausalLM.save_pretrained writes."""
    lac = t["linear_attn_config"]
    n = t["num_hidden_layers"]
    kinds = ["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention" for i in range(n)]
    t.update(
        head_dim=t["qk_rope_head_dim"],
        qk_head_dim=t["qk_nope_head_dim"] + t["qk_rope_head_dim"],
        layer_types=kinds,
        mlp_layer_types=["dense" if i < t["first_k_dense_replace"] else "sparse" for i in range(n)],
        linear_head_dim=lac["head_dim"],
        linear_num_heads=lac["num_heads"],
        linear_conv_kernel_dim=lac["short_conv_kernel_size"],
        transformers_version=TRANSFORMERS_VERSION,
    )
    return dict(sorted(t.items()))


def k3_quantization_config() -> dict:
    """compressed-tensors pack-quantized MXFP4 for the routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                            "group_size": MXFP4_GROUP, "dynamic": False, "actorder": None},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", r"re:.*self_attn\..*", r"re:.*mlp\..*", r"re:.*shared_experts\..*",
                   r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_(down|up)_proj$",
                   r"re:vision_tower\..*", r"re:mm_projector\..*"],
        "kv_cache_scheme": None,
    }


VISION_HIDDEN = 32  # tiny on purpose: the vision tower only has to be present (text inference ignores it)
VISION_PATCH = 14
VISION_MERGE = 2


def _k3_config(t: dict) -> dict:
    quant = k3_quantization_config()
    t["quantization_config"] = quant
    vision = {
        "model_type": "kimi_k3_vision",
        "patch_size": VISION_PATCH,
        "vt_hidden_size": VISION_HIDDEN,
        "vt_num_hidden_layers": 1,
        "vt_num_attention_heads": 2,
        "vt_intermediate_size": 2 * VISION_HIDDEN,
        "merge_kernel_size": [VISION_MERGE, VISION_MERGE],
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": VISION_HIDDEN,
        "text_hidden_size": t["hidden_size"],
        "media_placeholder_token_id": special_token_ids(t["vocab_size"])[MEDIA_PAD],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "ignore_index": -100,
        "media_placeholder_token_id": special_token_ids(t["vocab_size"])[MEDIA_PAD],
        "pad_token_id": t["pad_token_id"],
        "tie_word_embeddings": False,
        "quantization_config": quant,
        "text_config": dict(sorted(t.items())),
        "vision_config": vision,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def k3_vision_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """A few vision-tower / projector tensors, as K3 ships them (not used for text)."""
    merged = VISION_HIDDEN * VISION_MERGE * VISION_MERGE
    return {
        "vision_tower.patch_embed.proj.weight": TensorSpec((VISION_HIDDEN, 3, VISION_PATCH, VISION_PATCH), "BF16"),
        "mm_projector.proj.0.weight": TensorSpec((merged, merged), "BF16"),
        "mm_projector.proj.2.weight": TensorSpec((cfg.hidden_size, merged), "BF16"),
    }


def checkpoint_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Everything a synthetic checkpoint of `cfg` holds: the layout's tensors (+ K3 vision)."""
    out = dict(all_tensors(cfg))
    if cfg.is_k3:
        out.update(k3_vision_tensors(cfg))
    return out


def _stored_spec(cfg: ModelConfig, name: str, spec: TensorSpec) -> TensorSpec:
    """The shape written for `name`: A_log as the published files store it."""
    if name.endswith("self_attn.A_log"):
        nh = cfg.kda_num_heads
        shape = (-(-nh // 128) * 128,) if cfg.is_k3 else (1, 1, nh, 1)
        if not spec.accepts(shape):
            raise RuntimeError(f"layout does not accept A_log shape {shape} for {name}")
        return TensorSpec(shape, spec.dtype)
    return spec


def k3_slice_default_experts(text: dict) -> int:
    """Experts per MoE layer that make a k3-slice about K3_SLICE_RAM_FACTOR x total RAM."""
    import psutil

    probe = copy.deepcopy(text)
    probe.update(num_experts=1, num_experts_per_token=1)
    ids = special_token_ids(probe["vocab_size"])
    probe.update(bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN],
                 num_key_value_heads=probe["num_attention_heads"])
    cfg = parse_config(_k3_config(probe))
    specs = checkpoint_tensors(cfg)
    expert = sum(nbytes(s) for n, s in specs.items() if ".experts." in n)
    base = sum(nbytes(s) for n, s in specs.items()) - expert
    target = K3_SLICE_RAM_FACTOR * psutil.virtual_memory().total
    return max(1, min(896, round((target - base) / expert)))


def parse_override(item: str) -> tuple[str, object]:
    """'key=value' from a command line: value as JSON (numbers, true/false, null, lists), else text."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"override '{item}' is not key=value")
    if raw.lower() in ("none", "null"):
        return key.strip(), None
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


# ==============================================================================================
# Values
# ==============================================================================================
@dataclass(frozen=True)
class _Fill:
    """How one tensor's values are made."""
    kind: str  # "normal" (pool, scaled) | "codes" (byte pool) | "scales" (E8M0 bytes) | "special"
    std: float = 0.0  # normal: the std; scales: the target std of the decoded weight


def _fan_in_std(gain: float, spec: TensorSpec) -> float:
    return gain / math.sqrt(spec.shape[-1])


def _fill_for(cfg: ModelConfig, rel: str, spec: TensorSpec, eps_matched_latent: bool) -> _Fill:
    """Pick the distribution of a tensor from its (prefix-free) name."""
    if rel == "model.embed_tokens.weight":
        return _Fill("normal", EMBED_STD)
    if rel == "lm_head.weight":
        return _Fill("normal", _fan_in_std(LM_HEAD_GAIN, spec))
    if ".experts." in rel and not rel.endswith(".weight"):  # MXFP4 pair
        w = rel.split(".")[-2]
        in_features = spec.shape[1] * (2 if rel.endswith("_packed") else MXFP4_GROUP)
        if rel.endswith("_packed"):
            return _Fill("codes")
        return _Fill("scales", _expert_std(cfg, w, in_features, eps_matched_latent))
    if ".experts." in rel:  # bf16 experts (Kimi Linear)
        return _Fill("normal", _expert_std(cfg, rel.split(".")[-2], spec.shape[1], False))
    if len(spec.shape) == 2 and spec.shape[0] > 1 and spec.dtype == "BF16":
        return _Fill("normal", _fan_in_std(_linear_gain(rel), spec))
    return _Fill("special")


def _expert_std(cfg: ModelConfig, w: str, in_features: int, eps_matched_latent: bool) -> float:
    if w == "w1":
        return EXPERT_GATE_GAIN / math.sqrt(in_features)
    if w == "w3":
        return EXPERT_UP_GAIN / math.sqrt(in_features)
    if eps_matched_latent and cfg.latent_norm:
        # rms(sum_j weight_j * w2 h_j) ~ rsf / sqrt(k) * std * sqrt(I) * rms(h) := sqrt(eps)
        k = cfg.experts_per_token
        return (math.sqrt(cfg.rms_norm_eps) * math.sqrt(k)
                / (cfg.routed_scaling_factor * math.sqrt(in_features) * EXPERT_HIDDEN_RMS))
    return EXPERT_DOWN_GAIN / math.sqrt(in_features)


def _linear_gain(rel: str) -> float:
    if rel.endswith("block_sparse_moe.gate.weight"):
        return ROUTER_GAIN
    if rel.endswith("gate_proj.weight"):
        return GLU_GATE_GAIN
    if rel.endswith("up_proj.weight") and "routed_expert" not in rel:
        return GLU_UP_GAIN
    if rel.endswith("down_proj.weight") and "routed_expert" not in rel:
        return GLU_DOWN_GAIN
    if rel.endswith("f_b_proj.weight"):
        return KDA_DECAY_NOISE_GAIN
    return 1.0


def _special_values(cfg: ModelConfig, rel: str, spec: TensorSpec, gen: torch.Generator,
                    routing_skew: float | None = None) -> torch.Tensor:
    """Small tensors with their own distributions (norms, decay parameters, biases, ...)."""
    shape = spec.shape
    n = math.prod(shape)
    if rel.endswith("self_attn.A_log"):
        nh = cfg.kda_num_heads
        lo, hi = K3_A_RANGE if cfg.kda_gate_lower_bound is not None else KL_A_RANGE
        a = torch.log(lo + (hi - lo) * torch.rand(nh, generator=gen))
        out = torch.zeros(n)
        out[:nh] = a  # K3 pads with zeros beyond num_heads
        return out.reshape(shape)
    if rel.endswith("self_attn.dt_bias"):
        u = torch.rand(n, generator=gen)
        if cfg.kda_gate_lower_bound is not None:
            lo, hi = K3_DT_BIAS_RANGE
            return lo + (hi - lo) * u
        lo, hi = KL_DT_SOFTPLUS_RANGE
        sp = lo + (hi - lo) * u
        return torch.log(torch.expm1(sp))  # softplus(dt_bias) = sp
    if "_conv1d.weight" in rel:
        w = CONV_TAP_STD * torch.randn(n, generator=gen).reshape(shape[0], -1)
        w[:, -1] += CONV_CURRENT_TAP  # the last tap multiplies the current token
        return w.reshape(shape)
    if rel.endswith("e_score_correction_bias"):
        if routing_skew is not None:
            from .routing_skew import skewed_correction_bias
            return skewed_correction_bias(cfg, routing_skew, gen)
        return CORRECTION_BIAS_STD * torch.randn(n, generator=gen)
    if rel.endswith("_res_proj.weight"):
        return ATTN_RES_SCORE_STD / math.sqrt(shape[-1]) * torch.randn(shape, generator=gen)
    if rel.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_JITTER * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


class _Pools:
    """Seeded random pools that tensors take consecutive (wrapping) slices of."""

    def __init__(self, seed: int, normal_elems: int, byte_elems: int):
        gen = torch.Generator().manual_seed(seed)
        self.normal = torch.empty(max(1, normal_elems), dtype=torch.bfloat16)
        for start in range(0, self.normal.numel(), CHUNK_ELEMS):
            stop = min(start + CHUNK_ELEMS, self.normal.numel())
            self.normal[start:stop] = torch.randn(stop - start, generator=gen)
        self.bytes = torch.randint(0, 256, (max(1, byte_elems),), dtype=torch.uint8, generator=gen)
        self._pos = {"normal": 0, "bytes": 0}

    def slices(self, which: str, n: int) -> Iterator[torch.Tensor]:
        pool = self.normal if which == "normal" else self.bytes
        pos = self._pos[which]
        while n > 0:
            m = min(n, pool.numel() - pos, CHUNK_ELEMS)
            yield pool[pos:pos + m]
            pos = (pos + m) % pool.numel()
            n -= m
        self._pos[which] = pos


def _mxfp4_scale_exponent(std: float) -> int:
    """The E8M0 exponent whose uniform random codes (with -1/0/+1 jitter) have about `std`."""
    return round(math.log2(std / (MXFP4_CODE_RMS * MXFP4_JITTER_RMS)))


def _tensor_chunks(cfg: ModelConfig, name: str, spec: TensorSpec, fill: _Fill, pools: _Pools,
                   seed: int, routing_skew: float | None = None) -> Iterator[memoryview]:
    """The tensor's bytes (little-endian, row-major) as a few chunks."""
    n = math.prod(spec.shape)
    if fill.kind == "normal":
        for piece in pools.slices("normal", n):
            yield _raw(piece * fill.std)
    elif fill.kind == "codes":
        for piece in pools.slices("bytes", n):
            yield _raw(piece)
    elif fill.kind == "scales":
        base = 127 + _mxfp4_scale_exponent(fill.std)
        for piece in pools.slices("bytes", n):
            yield _raw((piece % 3).to(torch.int16).add_(base - 1).clamp_(0, 254).to(torch.uint8))
    else:
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        rel = name.removeprefix(cfg.tensor_prefix)
        values = _special_values(cfg, rel, spec, gen, routing_skew).reshape(-1)
        yield _raw(values.to(torch.float32 if spec.dtype == "F32" else torch.bfloat16))


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _raw(t: torch.Tensor) -> memoryview:
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


# ==============================================================================================
# Writing
# ==============================================================================================
def make_checkpoint(preset: str, out: str | Path, seed: int = 0, overrides: dict | None = None,
                    progress: bool = True, shard_size: int | None = None, overwrite: bool = False,
                    routing_skew: float | None = None) -> Path:
    """Write a synthetic checkpoint of `preset` to the folder `out` and return its path.

    shard_size: the largest safetensors shard in bytes (a larger tensor gets a shard of its
    own); by default 2 GB, or less so that there are at least MIN_SHARDS shards.
    overwrite: replace an existing `out` (only once the new checkpoint is complete).
    routing_skew: Zipf exponent of expert popularity per MoE layer, set through the router's
    correction bias (see routing_skew.py); 0 gives every expert the same share. None (the default)
    keeps the plain random bias, so the checkpoint is the same as before the option existed.
    """
    from .routing_skew import check_routing_skew
    routing_skew = check_routing_skew(routing_skew)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    raw = config_dict(preset, overrides)
    cfg = parse_config(raw, f"preset {preset}")
    tiktoken_text = tiktoken_model(cfg.vocab_size)  # raises for a vocabulary too small for it
    specs = {name: _stored_spec(cfg, name, spec) for name, spec in checkpoint_tensors(cfg).items()}
    eps_matched = preset in EPS_MATCHED_LATENT_PRESETS
    fills = {name: _fill_for(cfg, name.removeprefix(cfg.tensor_prefix), spec, eps_matched)
             for name, spec in specs.items()}
    total = sum(nbytes(s) for s in specs.values())
    if shard_size is None:
        shard_size = min(DEFAULT_SHARD_BYTES, -(-total // MIN_SHARDS))
    shards = _plan_shards(specs, shard_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        normal_elems = sum(math.prod(specs[n].shape) for n, f in fills.items() if f.kind == "normal")
        byte_elems = sum(math.prod(specs[n].shape) for n, f in fills.items() if f.kind in ("codes", "scales"))
        pools = _Pools(seed, min(normal_elems, POOL_CAP_ELEMS), min(byte_elems, POOL_CAP_ELEMS))
        weight_map = _write_shards(tmp, cfg, specs, fills, shards, pools, seed, routing_skew, total,
                                   progress, label=out.name)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / "model.safetensors.index.json", index)
        _write_json(tmp / "config.json", raw)
        ids = special_token_ids(cfg.vocab_size)
        _write_json(tmp / "generation_config.json", {
            "_from_model_config": True,
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],  # a chat turn ends with <|im_end|>
            "pad_token_id": ids[PAD_TOKEN],
            "transformers_version": TRANSFORMERS_VERSION,
        })
        _write_text(tmp / "tiktoken.model", tiktoken_text)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(cfg.vocab_size, cfg.max_position_embeddings))
        fsync_dir(tmp)
        if out.exists():  # overwrite: swap only now that the new one is complete
            old = out.with_name(f"{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _plan_shards(specs: dict[str, TensorSpec], shard_size: int) -> list[list[str]]:
    """Fill shards in order up to shard_size; within a shard, wider dtypes first so every
    tensor starts aligned to its element size."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, spec in specs.items():
        size = nbytes(spec)
        if shards[-1] and used + size > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return [sorted(s, key=lambda n: -DTYPE_BYTES[specs[n].dtype]) for s in shards]


def _write_shards(folder: Path, cfg: ModelConfig, specs, fills, shards, pools: _Pools, seed: int,
                  routing_skew: float | None, total: int, progress: bool, label: str) -> dict[str, str]:
    from tqdm import tqdm

    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {label}",
              disable=not progress) as bar:
        for k, names in enumerate(shards):
            file_name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                size = nbytes(specs[name])
                header[name] = {"dtype": specs[name].dtype, "shape": list(specs[name].shape),
                                "data_offsets": [offset, offset + size]}
                offset += size
            head = json.dumps(header, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)
            with _BackgroundWriter(folder / file_name) as f:
                f.write(struct.pack("<Q", len(head)))
                f.write(head)
                for name in names:
                    written = 0
                    for chunk in _tensor_chunks(cfg, name, specs[name], fills[name], pools, seed, routing_skew):
                        f.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
                    if written != nbytes(specs[name]):
                        raise RuntimeError(f"{name}: wrote {written} bytes, expected {nbytes(specs[name])}")
                    weight_map[name] = file_name
    return weight_map


class _BackgroundWriter:
    """Writes buffers to a file on a separate thread, so making the next chunk overlaps
    writing the previous one; at most QUEUE_CHUNKS buffers wait in memory."""

    QUEUE_CHUNKS = 4

    def __init__(self, path: Path):
        self._file = open(path, "wb")
        self._queue: queue.Queue = queue.Queue(maxsize=self.QUEUE_CHUNKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._file.write(buf)
                except BaseException as e:  # reported to the producing thread
                    self._error = e

    def write(self, buf) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(buf)

    def __enter__(self) -> "_BackgroundWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._queue.put(None)
        self._thread.join()
        try:
            if exc_type is None and self._error is None:
                self._file.flush()
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if exc_type is None and self._error is not None:
            raise self._error


def _remove_stale_partials(out: Path) -> None:
    """Delete OUT.partial-<pid> folders left by runs that were killed (their pid is gone)."""
    for p in out.parent.glob(f"{out.name}.partial-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, obj) -> None:
    _write_text(path, json.dumps(obj, indent=2) + "\n")


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


