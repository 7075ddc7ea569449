"""The synthetic presets are built so every modeling term measurably moves the logits: a model
test built on them can catch a dropped bias, a wrong activation or a misplaced block boundary."""
from __future__ import annotations

import pytest
import torch

import deltafin
from deltafin.checkpoint.synthetic import make_checkpoint

IDS = [7, 93, 41, 250, 12, 77, 301, 5, 64, 128]


def _logits(path):
    return deltafin.load(path, device="cpu", stream="off").logits(IDS)


def _variant(tmp_path, preset, name, **over):
    return _logits(make_checkpoint(preset, tmp_path / name, seed=0, overrides=over, progress=False))


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_dropping_the_router_correction_bias_moves_logits(tmp_path, preset):
    path = make_checkpoint(preset, tmp_path / "m", seed=0, progress=False)
    m = deltafin.load(path, device="cpu", stream="off")
    base = m.logits(IDS)
    for spine in m.engine.provider._spines:
        if "mlp.e_score_correction_bias" in spine:
            spine["mlp.e_score_correction_bias"] = torch.zeros_like(spine["mlp.e_score_correction_bias"])
    assert (m.logits(IDS) - base).abs().max().item() > 1e-2


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_routed_scaling_factor_moves_logits(tmp_path, preset):
    a = _variant(tmp_path, preset, "a", routed_scaling_factor=2.5)
    b = _variant(tmp_path, preset, "b", routed_scaling_factor=1.0)
    assert (a - b).abs().max().item() > 1e-2


def test_situ_versus_silu_moves_logits(tmp_path):
    a = _variant(tmp_path, "tiny-k3", "a")
    b = _variant(tmp_path, "tiny-k3", "b", hidden_act="silu")
    assert (a - b).abs().max().item() > 1e-2


def test_shifting_an_attn_res_block_boundary_moves_logits(tmp_path):
    a = _variant(tmp_path, "tiny-k3", "a", attn_res_block_size=2)  # blocks start at layers 0, 2, 4
    b = _variant(tmp_path, "tiny-k3", "b", attn_res_block_size=3)  # the second boundary moves to layer 3
    assert (a - b).abs().max().item() > 1e-2
