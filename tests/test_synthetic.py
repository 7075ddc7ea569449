"""Synthetic checkpoints: exact published layout, determinism, transformers compatibility, tokenizer."""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint import synthetic
from deltafin.checkpoint.layout import all_tensors, nbytes
from deltafin.checkpoint.synthetic import PRESETS, config_dict, make_checkpoint
from deltafin.config import load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def read_checkpoint_headers(path: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, safetensors dtype, shard) for every tensor in every listed shard."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype(), shard)
    return out


def load_tensor(path: Path, name: str) -> torch.Tensor:
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(path / shard), "pt") as f:
        return f.get_tensor(name)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return E2M1[codes] * torch.pow(2.0, scale.float() - 127).repeat_interleave(32, dim=1)


def weights_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each small preset written once for this module."""
    root = tmp_path_factory.mktemp("synthetic")
    return {p: make_checkpoint(p, root / p, seed=0, progress=False)
            for p in ("tiny-k3", "tiny-kimi-linear", "small-k3")}


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear", "small-k3"])
def test_checkpoint_holds_exactly_the_layout(made, preset):
    path = made[preset]
    cfg = load_config(path)
    expected = all_tensors(cfg)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    headers = read_checkpoint_headers(path)
    extra = set(index["weight_map"]) - set(expected)
    if cfg.is_k3:  # K3 ships a vision tower that text inference ignores
        assert extra and all(n.startswith(("vision_tower.", "mm_projector.")) for n in extra)
    else:
        assert not extra
    assert set(expected) <= set(index["weight_map"])
    assert set(headers) == set(index["weight_map"])
    for name, spec in expected.items():
        shape, dtype, shard = headers[name]
        assert spec.accepts(shape), (name, shape, spec)
        assert dtype == spec.dtype, (name, dtype, spec.dtype)
        assert index["weight_map"][name] == shard
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert shards == sorted(p.name for p in path.glob("*.safetensors"))
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    total = sum(math.prod(s) * {"BF16": 2, "F32": 4, "U8": 1}[d] for s, d, _ in headers.values())
    assert index["metadata"]["total_size"] == total
    assert not list(path.parent.glob(f"{path.name}.partial-*"))


def test_k3_checkpoint_format(made):
    path = made["tiny-k3"]
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"] and raw["model_type"] == "kimi_k3"
    text = raw["text_config"]
    assert text["architectures"] == ["KimiK3ForCausalLM"] and text["model_type"] == "kimi_linear"
    assert text["hidden_act"] == "situ" and text["moe_router_activation_func"] == "sigmoid"
    assert text["topk_method"] == "noaux_tc" and text["attn_res_block_size"] == 2
    lac = text["linear_attn_config"]
    assert lac["use_full_rank_gate"] is True and lac["gate_lower_bound"] == -5.0
    assert sorted(lac["kda_layers"] + lac["full_attn_layers"]) == list(range(1, text["num_hidden_layers"] + 1))
    q = text["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["group_size"]) == (4, "float", 32)
    cfg = parse_config(raw)
    assert cfg.expert_format == "mxfp4" and cfg.tensor_prefix == "language_model."
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert kinds[0] == "dense_kda" and "kda" in kinds and "mla" in kinds
    assert len({i // cfg.attn_res_block_size for i in range(cfg.num_layers)}) >= 3
    # A_log is stored as K3 publishes it: zero-padded to a multiple of 128 entries
    a_log = load_tensor(path, f"language_model.model.layers.{cfg.kda_layers[0]}.self_attn.A_log")
    assert a_log.shape == (128,) and a_log.dtype == torch.float32
    assert torch.all(a_log[cfg.kda_num_heads:] == 0) and torch.all(a_log[:cfg.kda_num_heads] != 0)


def test_k3_slice_has_the_real_k3_tensor_shapes():
    raw = config_dict("k3-slice", {"num_hidden_layers": 2, "num_experts": 2})
    cfg = parse_config(raw)
    specs = synthetic.checkpoint_tensors(cfg)
    assert [cfg.layer_kind(i) for i in range(2)] == ["dense_kda", "mla"]
    L = "language_model.model.layers."
    expert = sum(nbytes(s) for n, s in specs.items() if n.startswith(L + "1.block_sparse_moe.experts.1."))
    assert expert == 17_547_264
    shapes = {n: s.shape for n, s in specs.items()}
    assert shapes[L + "1.block_sparse_moe.experts.0.w1.weight_packed"] == (3072, 1792)
    assert shapes[L + "1.block_sparse_moe.experts.0.w1.weight_scale"] == (3072, 112)
    assert shapes[L + "1.block_sparse_moe.experts.0.w2.weight_packed"] == (3584, 1536)
    assert shapes[L + "1.block_sparse_moe.experts.0.w2.weight_scale"] == (3584, 96)
    assert shapes["language_model.model.embed_tokens.weight"] == (163840, 7168)
    assert shapes["language_model.lm_head.weight"] == (163840, 7168)
    assert shapes[L + "0.self_attn.q_proj.weight"] == (96 * 128, 7168)
    assert shapes[L + "0.self_attn.g_proj.weight"] == (96 * 128, 7168)
    # the released values: a dense layer-0 MLP of 33792, 96 MLA heads
    assert shapes[L + "0.mlp.gate_proj.weight"] == (33792, 7168)
    assert shapes[L + "0.mlp.down_proj.weight"] == (7168, 33792)
    assert shapes[L + "1.self_attn.q_a_proj.weight"] == (1536, 7168)
    assert shapes[L + "1.self_attn.q_b_proj.weight"] == (18432, 1536)
    assert shapes[L + "1.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes[L + "1.self_attn.kv_b_proj.weight"] == (24576, 512)
    assert shapes[L + "1.self_attn.g_proj.weight"] == (96 * 128, 7168)
    assert shapes[L + "1.self_attn.o_proj.weight"] == (7168, 96 * 128)
    t = raw["text_config"]
    assert (t["routed_scaling_factor"], t["bos_token_id"], t["pad_token_id"], t["max_position_embeddings"]) == \
        (1.0, 163584, 163839, 1048576)
    assert shapes[L + "1.block_sparse_moe.shared_experts.gate_proj.weight"] == (2 * 3072, 7168)
    assert shapes[L + "1.block_sparse_moe.routed_expert_down_proj.weight"] == (3584, 7168)
    assert shapes[L + "1.block_sparse_moe.gate.weight"] == (2, 7168)
    # the random E8M0 exponents the real-size experts get stay in a sane band
    for w in ("w1", "w3", "w2"):
        name = f"1.block_sparse_moe.experts.0.{w}.weight_scale"
        fill = synthetic._fill_for(cfg, "model.layers." + name, specs[L + name], eps_matched_latent=False)
        exponent = synthetic._mxfp4_scale_exponent(fill.std)  # groups get exponent - 1 .. exponent + 1
        assert -10 <= exponent - 1 and exponent + 1 <= -4


def test_k3_slice_default_is_sized_to_ram():
    import psutil

    cfg = parse_config(config_dict("k3-slice"))
    assert cfg.num_layers == 4 and [cfg.layer_kind(i) for i in range(4)] == ["dense_kda", "kda", "kda", "mla"]
    assert cfg.experts_per_token == 16 and cfg.num_experts >= 16
    total = sum(nbytes(s) for s in synthetic.checkpoint_tensors(cfg).values())
    target = synthetic.K3_SLICE_RAM_FACTOR * psutil.virtual_memory().total
    one_expert_everywhere = 3 * 17_547_264
    assert abs(total - target) <= one_expert_everywhere or cfg.num_experts in (16, 896)


def test_same_seed_same_bytes_other_seed_other_bytes(made, tmp_path):
    again = make_checkpoint("tiny-k3", tmp_path / "again", seed=0, progress=False)
    other = make_checkpoint("tiny-k3", tmp_path / "other", seed=1, progress=False)
    assert weights_digest(again) == weights_digest(made["tiny-k3"])
    assert weights_digest(other) != weights_digest(made["tiny-k3"])
    for name in ("config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (made["tiny-k3"] / name).read_bytes()
    a = load_tensor(made["tiny-k3"], "language_model.model.embed_tokens.weight")
    b = load_tensor(other, "language_model.model.embed_tokens.weight")
    assert not torch.equal(a, b)


def test_transformers_loads_and_runs_tiny_kimi_linear(made):
    from transformers import KimiLinearForCausalLM

    from deltafin.tokenizer import load_tokenizer

    path = made["tiny-kimi-linear"]
    model, info = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    # the checkpoint's values were loaded, not freshly initialized ones
    assert torch.equal(model.lm_head.weight, load_tensor(path, "lm_head.weight").float())
    tok = load_tokenizer(path)
    ids = torch.tensor([tok.encode("The river ran slowly past the old mill.")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all() and 0.5 < logits.std().item() < 20


def test_kimi_linear_config_is_what_transformers_writes(made, tmp_path):
    from transformers import KimiLinearConfig

    path = made["tiny-kimi-linear"]
    KimiLinearConfig.from_pretrained(path).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["KimiLinearForCausalLM"] and raw["hidden_act"] == "silu"
    assert "moe_router_activation_func" not in raw


def test_tokenizer_training_is_deterministic():
    assert synthetic.trained_tokens.__wrapped__() == synthetic.trained_tokens()
    assert len(synthetic.trained_tokens()) == synthetic.TRAINED_TOKENS


def test_overrides_make_variants(tmp_path):
    raw = config_dict("tiny-k3", {"num_hidden_layers": 8, "num_experts": 16, "num_expert_group": 4,
                                  "topk_group": 2, "q_lora_rank": None, "attn_res_block_size": 3,
                                  "num_heads": 2, "linear_attn_config.head_dim": 32})
    cfg = parse_config(raw)
    assert (cfg.num_layers, cfg.num_expert_group, cfg.topk_group, cfg.q_lora_rank) == (8, 4, 2, None)
    assert (cfg.attn_res_block_size, cfg.kda_num_heads, cfg.kda_head_dim) == (3, 2, 32)
    assert cfg.mla_layers == (3, 7) and cfg.kda_layers == (0, 1, 2, 4, 5, 6)
    one_list = parse_config(config_dict("tiny-kimi-linear", {"full_attn_layers": [2, 5]}))
    assert one_list.mla_layers == (1, 4) and one_list.kda_layers == (0, 2, 3)
    with pytest.raises(KeyError):
        config_dict("tiny-k3", {"num_hiden_layers": 3})
    with pytest.raises(KeyError):
        config_dict("tiny-kimi-linear", {"attn_res_block_size": 2})
    with pytest.raises(KeyError):
        config_dict("no-such-preset")
    path = make_checkpoint("tiny-k3", tmp_path / "variant", progress=False,
                           overrides={"num_hidden_layers": 3, "q_lora_rank": None, "attn_res_block_size": None})
    headers = read_checkpoint_headers(path)
    expected = all_tensors(load_config(path))
    assert set(expected) <= set(headers)
    assert "language_model.model.layers.2.self_attn.q_proj.weight" in headers
    assert not any("attn_res" in n or "_res_" in n for n in headers)


def test_parse_override():
    assert synthetic.parse_override("num_experts=16") == ("num_experts", 16)
    assert synthetic.parse_override("q_lora_rank=null") == ("q_lora_rank", None)
    assert synthetic.parse_override("kda_layers=[1,2]") == ("kda_layers", [1, 2])
    assert synthetic.parse_override("hidden_act=silu") == ("hidden_act", "silu")
    with pytest.raises(ValueError):
        synthetic.parse_override("no_value")


def test_weight_scales_keep_the_model_healthy(made):
    """Decay gates in (0.5, 1), router bias comparable to score spread, experts decode sanely."""
    gen = torch.Generator().manual_seed(0)
    for preset in ("tiny-k3", "tiny-kimi-linear"):
        path = made[preset]
        cfg = load_config(path)
        p = f"{cfg.tensor_prefix}model.layers.{cfg.kda_layers[1]}."
        x = torch.randn(256, cfg.hidden_size, generator=gen)  # normalized inputs: rms ~ 1
        w = {n: load_tensor(path, p + n).float() for n in
             ("self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight", "self_attn.dt_bias", "self_attn.A_log",
              "block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias")}
        nh, d = cfg.kda_num_heads, cfg.kda_head_dim
        r = (x @ w["self_attn.f_a_proj.weight"].T @ w["self_attn.f_b_proj.weight"].T + w["self_attn.dt_bias"])
        r = r.view(-1, nh, d)
        a = w["self_attn.A_log"].reshape(-1)[:nh].view(1, nh, 1)
        if cfg.kda_gate_lower_bound is not None:
            g = cfg.kda_gate_lower_bound * torch.sigmoid(torch.exp(a) * r)
        else:
            g = -torch.exp(a) * torch.nn.functional.softplus(r)
        decay = torch.exp(g)
        assert ((decay > 0.5) & (decay < 1)).float().mean() > 0.9
        scores = torch.sigmoid(x @ w["block_sparse_moe.gate.weight"].T)
        bias_std = w["block_sparse_moe.gate.e_score_correction_bias"].std()
        assert 0.2 * scores.std() < bias_std < 2 * scores.std()
    path = made["tiny-k3"]
    e = "language_model.model.layers.1.block_sparse_moe.experts.3.w1."
    w1 = decode_mxfp4(load_tensor(path, e + "weight_packed"), load_tensor(path, e + "weight_scale"))
    cfg = load_config(path)
    pre = torch.randn(512, cfg.expert_width, generator=gen) @ w1.T  # gate pre-activations
    assert torch.isfinite(w1).all() and 2.0 < pre.std() < 8.0  # where SiTU differs from SiLU


def test_capped_random_pool_still_writes_the_layout(tmp_path, monkeypatch, made):
    """k3-slice reuses a capped pool at shifting offsets; the same path on a tiny model."""
    monkeypatch.setattr(synthetic, "POOL_CAP_ELEMS", 1000)
    monkeypatch.setattr(synthetic, "CHUNK_ELEMS", 300)
    path = make_checkpoint("tiny-k3", tmp_path / "capped", progress=False)
    headers = read_checkpoint_headers(path)
    for name, spec in all_tensors(load_config(path)).items():
        assert spec.accepts(headers[name][0]) and headers[name][1] == spec.dtype
    emb = load_tensor(path, "language_model.model.embed_tokens.weight").float()
    assert torch.isfinite(emb).all() and 0.8 < emb.std() < 1.2
    assert weights_digest(path) != weights_digest(made["tiny-k3"])


def test_existing_output_is_refused_or_replaced(made, tmp_path):
    path = make_checkpoint("tiny-kimi-linear", tmp_path / "ck", progress=False)
    with pytest.raises(FileExistsError):
        make_checkpoint("tiny-kimi-linear", path, progress=False)
    make_checkpoint("tiny-k3", path, progress=False, overwrite=True)
    assert load_config(path).is_k3
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_killed_run_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "small"
    code = ("import sys; sys.path.insert(0, %r); from deltafin.checkpoint.synthetic import make_checkpoint; "
            "make_checkpoint('small-k3', %r, progress=True)" % (str(REPO), str(out)))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    seen = b""
    while b"writing small" not in seen:  # the first progress line: shards are being written
        ch = proc.stderr.read(1)
        assert ch, seen.decode(errors="replace")
        seen += ch
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"small.partial-{proc.pid}"]
    make_checkpoint("tiny-k3", out, progress=False)  # a later run cleans up the dead run's leftovers
    assert [p.name for p in tmp_path.iterdir()] == ["small"]
    assert load_config(out).is_k3


def test_presets_exist():
    assert {"tiny-k3", "tiny-kimi-linear", "small-k3", "k3-slice"} <= set(PRESETS)
