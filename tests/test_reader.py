"""The Hugging Face checkpoint reader: bit-exact tensors by byte range, and clear errors."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint.hf import CheckpointError, HFCheckpoint
from deltafin.checkpoint.layout import all_tensors
from deltafin.config import ConfigError


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_every_tensor_round_trips_bit_exact(request, fixture):
    path = request.getfixturevalue(fixture)
    ckpt = HFCheckpoint(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2  # sharded
    for name, shard in index.items():
        with safe_open(str(path / shard), "pt") as f:
            want = f.get_tensor(name)
        got = ckpt.tensor(name)
        if want.dtype != got.dtype:  # E8M0 scales are read as their raw bytes
            want = want.view(torch.uint8)
        assert got.shape == want.shape and torch.equal(got, want), name
    # and the config implies exactly the text tensors present
    text = {n for n in index if not n.startswith(("vision_tower.", "mm_projector."))}
    assert text == set(all_tensors(ckpt.config))


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite_header(file, edit):
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (n - len(blob)) if len(blob) <= n else b""
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def test_missing_tensor_is_named(tiny_k3_path, tmp_path):
    path = _copy(tiny_k3_path, tmp_path)
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = _shard_of(path, name)
    del index["weight_map"][name]
    index_file.write_text(json.dumps(index))
    _rewrite_header(shard, lambda h: h.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.q_proj\.weight' is missing"):
        HFCheckpoint(path)


def test_shape_disagreeing_with_config_names_tensor_and_file(tiny_k3_path, tmp_path):
    path = _copy(tiny_k3_path, tmp_path)
    name = "language_model.model.layers.1.block_sparse_moe.gate.weight"
    shard = _shard_of(path, name)

    def edit(h):
        shape = h[name]["shape"]
        h[name]["shape"] = [shape[1], shape[0]]  # same bytes, transposed shape
    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert name in str(e.value) and shard.name in str(e.value) and "config implies" in str(e.value)


def test_truncated_shard_is_named(tiny_k3_path, tmp_path):
    path = _copy(tiny_k3_path, tmp_path)
    shard = _shard_of(path, "language_model.lm_head.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated"):
        HFCheckpoint(path)


@pytest.mark.parametrize("damage", ["not-json", "huge-length", "empty"])
def test_bad_header_is_named(tiny_k3_path, tmp_path, damage):
    path = _copy(tiny_k3_path, tmp_path)
    shard = _shard_of(path, "language_model.model.norm.weight")
    raw = shard.read_bytes()
    if damage == "not-json":
        raw = raw[:8] + b"{garbage" + raw[16:]
    elif damage == "huge-length":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    else:
        raw = b""
    shard.write_bytes(raw)
    with pytest.raises(CheckpointError, match=shard.name):
        HFCheckpoint(path)


def test_config_errors_are_specific(tiny_k3_path, tmp_path):
    path = _copy(tiny_k3_path, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2]  # no longer covers every layer
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="cover layers"):
        HFCheckpoint(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        HFCheckpoint(path)
    with pytest.raises(CheckpointError, match="not a directory"):
        HFCheckpoint(tmp_path / "nowhere")
