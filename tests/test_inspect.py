"""`deltafin inspect` against figures computed by hand from K3_MODEL.md."""
from __future__ import annotations

import json
import struct

import pytest

from deltafin.checkpoint.layout import DTYPE_BYTES, all_tensors
from deltafin.checkpoint.synthetic import config_dict
from deltafin.cli import main
from deltafin.config import parse_config
from deltafin.inspect import inspect_path


def k3_dims(t: dict) -> tuple[int, ...]:
    """The sizes the hand computations use, from a K3 text config."""
    lac = t["linear_attn_config"]
    return (t["hidden_size"], lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"],
            t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"], t["qk_nope_head_dim"],
            t["qk_rope_head_dim"], t["v_head_dim"], t["num_experts"], t["num_experts_per_token"],
            t["moe_intermediate_size"], t["routed_expert_hidden_size"])


def hand_figures(t: dict, vocab: int) -> dict:
    """Bytes of a K3 checkpoint written out from the tensor list of K3_MODEL.md section 2 (bf16 = 2 bytes)."""
    V = vocab
    H, nh, d, K, mh, ql, kl, nope, rope, vd, E, k, I, L = k3_dims(t)
    lac = t["linear_attn_config"]
    D = nh * d
    Is = I * t["num_shared_experts"]
    n = t["num_hidden_layers"]
    common = 2 * H * 2 + 4 * H * 2  # two layernorms + attn-res norm/proj pairs
    padded_heads = -(-nh // 128) * 128
    kda = (4 * D * H * 2 + D * H * 2  # q, k, v, g projections and o_proj
           + 3 * D * K * 4 + padded_heads * 4 + D * 4  # convs, A_log (padded), dt_bias (fp32)
           + d * H * 2 + D * d * 2 + nh * H * 2 + d * 4)  # f_a, f_b, b_proj, o_norm (fp32)
    mla = (ql * H * 2 + ql * 2 + mh * (nope + rope) * ql * 2 + (kl + rope) * H * 2 + kl * 2
           + mh * (nope + vd) * kl * 2 + H * mh * vd * 2 + mh * vd * H * 2)
    dense = 3 * t["intermediate_size"] * H * 2
    moe = E * H * 2 + E * 4 + 3 * Is * H * 2 + 2 * L * H * 2 + L * 2
    expert = 2 * (I * L // 2 + I * L // 32) + (L * I // 2 + L * I // 32)  # MXFP4 packed + E8M0 scales
    kda_layers = [i - 1 for i in lac["kda_layers"]]
    layers = [common + (kda if i in kda_layers else mla) + (dense if i < t["first_k_dense_replace"] else moe)
              for i in range(n)]
    head = V * H * 2 * 2 + H * 2 + 2 * H * 2  # embed + lm_head, final norm, output attn-res
    moe_layers = n - t["first_k_dense_replace"]
    return {
        "bytes_per_expert": expert,
        "spine_bytes": head + sum(layers),
        "expert_bytes": expert * E * moe_layers,
        "bytes_per_token": sum(layers) + head - V * H * 2 + H * 2 + k * expert * moe_layers,
    }


def write_sparse_checkpoint(path, raw_config: dict) -> None:
    """Headers of every tensor, data left as a hole: exact layout and sizes, no disk space."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw_config))
    specs = all_tensors(parse_config(raw_config))
    header, off = {}, 0
    for name, s in specs.items():
        n = DTYPE_BYTES[s.dtype]
        for dim in s.shape:
            n *= dim
        header[name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)


def test_inspect_tiny_k3_matches_hand_computation(tiny_k3_path, capsys):
    raw = json.loads((tiny_k3_path / "config.json").read_text())
    t = raw["text_config"]
    got = json.loads(inspect_path(tiny_k3_path, as_json=True))
    want = hand_figures(t, t["vocab_size"])
    for key, value in want.items():
        assert got[key] == value, key
    lac = t["linear_attn_config"]
    assert got["architecture"] == "k3"
    assert got["kda_layers"] == [i - 1 for i in lac["kda_layers"]]
    assert got["mla_layers"] == [i - 1 for i in lac["full_attn_layers"]]
    assert got["num_layers"] == t["num_hidden_layers"]
    assert got["num_experts"] == t["num_experts"] and got["experts_per_token"] == t["num_experts_per_token"]
    assert main(["inspect", str(tiny_k3_path)]) == 0
    assert "per token" in capsys.readouterr().out


def test_inspect_k3_slice_real_shapes(tmp_path):
    raw = config_dict("k3-slice", {"num_experts": 32})
    t = raw["text_config"]
    write_sparse_checkpoint(tmp_path / "slice", raw)
    got = json.loads(inspect_path(tmp_path / "slice", as_json=True))
    # One real K3 expert: w1, w3 packed [3072,1792] + scales [3072,112]; w2 [3584,1536] + [3584,96].
    assert got["bytes_per_expert"] == 17_547_264
    want = hand_figures(t, t["vocab_size"])
    for key, value in want.items():
        assert got[key] == value, key
    assert got["kda_layers"] == [0, 1, 2] and got["mla_layers"] == [3]


def test_inspect_rejects_a_folder_without_config(tmp_path):
    from deltafin.config import ConfigError
    with pytest.raises(ConfigError, match="config.json"):
        inspect_path(tmp_path)


def hand_params(t: dict) -> tuple[int, int]:
    """(total, active) parameters of a K3 text config, written out from K3_MODEL.md sections 1-2.
    Active: every spine parameter but the input embedding table, plus top-k routed experts."""
    V, n = t["vocab_size"], t["num_hidden_layers"]
    H, nh, d, K, mh, ql, kl, nope, rope, vd, E, k, I, L = k3_dims(t)
    lac = t["linear_attn_config"]
    D = nh * d
    head = 2 * V * H + 3 * H  # embed, lm_head, final norm, output attn-res norm + proj
    common = 6 * H  # two layernorms, two attn-res norm + proj pairs
    kda = 5 * D * H + 3 * D * K + 128 + D + d * H + D * d + nh * H + d  # A_log stored padded to 128
    mla = ql * H + ql + mh * (nope + rope) * ql + (kl + rope) * H + kl + mh * (nope + vd) * kl + 2 * H * mh * vd
    dense = 3 * t["intermediate_size"] * H
    moe = E * H + E + 3 * I * t["num_shared_experts"] * H + 2 * L * H + L
    full = set(lac["full_attn_layers"])
    spine = head + sum(common + (mla if i + 1 in full else kda) + (dense if i == 0 else moe) for i in range(n))
    expert = 3 * I * L
    return spine + (n - 1) * E * expert, spine - V * H + (n - 1) * k * expert


def test_inspect_released_k3_config_gives_the_published_totals(tmp_path, capsys):
    raw = config_dict("k3-slice", {"num_hidden_layers": 93, "num_experts": 896})
    t = raw["text_config"]
    assert (t["num_attention_heads"], t["intermediate_size"], t["routed_scaling_factor"]) == (96, 33792, 1.0)
    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "config.json").write_text(json.dumps(raw))
    total, active = hand_params(t)
    assert (total, active) == (2_779_484_478_208, 104_189_614_848)  # 2.78 T and 104.2 B, as released
    got = json.loads(inspect_path(tmp_path / "k3", as_json=True))
    assert (got["total_params"], got["active_params"]) == (total, active)
    assert got["source"] == "config only" and got["bytes_per_expert"] == 17_547_264
    assert main(["inspect", str(tmp_path / "k3")]) == 0
    out = capsys.readouterr().out
    assert "total 2.78 T" in out and "active/token 104.2 B" in out
