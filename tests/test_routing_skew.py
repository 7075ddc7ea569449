"""Synthetic checkpoints with skewed routing (--routing-skew): the skew is real (measured on a decode
through the engine), lives only in the published tensors, and bad values are refused cleanly."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

import deltafin
from deltafin.checkpoint.routing_skew import MAX_ROUTING_SKEW, check_routing_skew, target_shares
from deltafin.checkpoint.synthetic import make_checkpoint
from deltafin.cli import main
from deltafin.routing_stats import predictor_recall, skew_stats, trace_routing

from conftest import KL_CODE_TINY


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def random_prompt_stats(path, tokens=192) -> dict:
    model = deltafin.load(path, device="cpu", stream="off")
    prompt = torch.randint(0, 480, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return skew_stats(trace_routing(model, prompt, new_tokens=4))


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    root = tmp_path_factory.mktemp("skew")
    return {s: make_checkpoint("tiny-k3", root / f"s{s}", seed=0, progress=False, routing_skew=s)
            for s in (0.0, 1.0)}


def test_skew_lives_only_in_the_correction_bias_of_the_published_format(skewed, tiny_k3_path):
    plain, skew = tensors(tiny_k3_path), tensors(skewed[1.0])
    assert {n: (t.shape, t.dtype) for n, t in plain.items()} == {n: (t.shape, t.dtype) for n, t in skew.items()}
    changed = sorted(n for n in plain if not torch.equal(plain[n], skew[n]))
    assert changed and all(n.endswith("gate.e_score_correction_bias") for n in changed)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        assert (tiny_k3_path / name).read_bytes() == (skewed[1.0] / name).read_bytes()
    assert all(not t.any() for n, t in tensors(skewed[0.0]).items() if n in changed)  # 0: no bias at all
    # each layer ranks its experts in its own order
    biases = [skew[n].argsort() for n in changed]
    assert any(not torch.equal(biases[0], b) for b in biases[1:])


def test_skewed_routing_is_measured_on_a_decode(skewed, tiny_k3_path):
    """tiny-k3: 16 experts, top-4. S = 1 targets shares 1, .63, .42, ... (ranks 1..16)."""
    plain, uniform, skew = (random_prompt_stats(p) for p in (tiny_k3_path, skewed[0.0], skewed[1.0]))
    assert uniform["top10_share"] < plain["top10_share"] < skew["top10_share"]
    assert skew["top10_share"] > uniform["top10_share"] + 0.15
    assert skew["top10_share"] > 0.3  # the top 2 of 16 experts take ~1.6 of every 4 routings at S = 1
    assert 0.6 < skew["zipf_exponent"] < 1.6
    assert skew["repeat_rate"] > uniform["repeat_rate"]


def test_target_shares_are_zipf_capped_and_sum_to_top_k():
    q = target_shares(16, 4, 1.0)
    assert math.isclose(float(q.sum()), 4.0, rel_tol=1e-4) and float(q.max()) == 1.0
    uncapped = q[q < 1]
    ranks = torch.arange(16 - uncapped.numel() + 1, 17, dtype=torch.float32)
    assert torch.allclose(uncapped * ranks, uncapped[0] * ranks[0].expand_as(ranks), rtol=1e-4)
    assert torch.allclose(target_shares(16, 4, 0.0), torch.full((16,), 0.25))


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), MAX_ROUTING_SKEW + 1, 1e9, "lots", True])
def test_bad_routing_skew_is_refused(bad):
    with pytest.raises(ValueError, match="routing skew"):
        check_routing_skew(bad)


@pytest.mark.parametrize("bad", ["-1", "nan", "1e9", "inf"])
def test_bad_routing_skew_on_the_command_line_is_a_clean_error(capsys, tmp_path, bad):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-k3", "--out", str(out), "--quiet", "--routing-skew", bad]) != 0
    err = capsys.readouterr().err
    assert "routing skew" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(not KL_CODE_TINY.exists(), reason="kl-code-tiny not present")
def test_trained_model_routing_is_skewed_and_predictable():
    """The reference the synthetic skew imitates: a trained model's routing is far from uniform, and
    the router applied one layer early predicts a layer's experts better than the previous token."""
    model = deltafin.load(KL_CODE_TINY, device="cpu", stream="off")
    prompt = model.encode("def parse(self, text):\n    for line in text.splitlines():\n"
                          "        key, _, value = line.partition('=')\n        self.items[key] = value\n")
    trace = trace_routing(model, prompt, new_tokens=16)
    stats = skew_stats(trace)
    assert stats["top10_share"] > 1.5 * stats["uniform_top10_share"]
    assert stats["repeat_rate"] > stats["uniform_repeat_rate"]
    recall = predictor_recall(trace)
    assert recall["early"]["mean"] > recall["prev"]["mean"] > stats["uniform_repeat_rate"]
    json.dumps(recall)  # plain numbers, as the tool prints them
