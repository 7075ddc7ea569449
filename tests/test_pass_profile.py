"""tools/pass_profile.py on the CPU: its record, and the experts a batch's decode pass chose."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import pass_profile  # noqa: E402

import deltafin  # noqa: E402


def test_the_record_per_batch(tiny_kl_path, capsys):
    assert pass_profile.main(["--model", str(tiny_kl_path), "--device", "cpu", "--batches", "1,3", "--tokens", "2",
                              "--top", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = deltafin.load(tiny_kl_path, device="cpu").config
    assert out["device"] == "cpu" and [b["batch"] for b in out["batches"]] == [1, 3]
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    for b in out["batches"]:
        assert len(b["ms_per_pass"]) == pass_profile.TIMING_ROUNDS
        prof = b["profile"]
        assert prof["what"].startswith("host operators") and 0 < len(prof["top"]) <= 4
        assert prof["total_ms_per_pass"] >= sum(k["ms_per_pass"] for k in prof["top"]) - 1e-9
        chosen = {int(k): v for k, v in b["experts_chosen"].items()}
        assert sorted(chosen) == moe
        # one row chooses exactly its top-k; more rows choose at least that and at most every expert
        k, E = cfg.experts_per_token, cfg.num_experts
        assert all(v == k for v in chosen.values()) if b["batch"] == 1 else \
            all(k <= v <= min(E, 3 * k) for v in chosen.values())


def test_a_bad_argument_is_a_usage_error(tiny_kl_path, capsys):
    with pytest.raises(SystemExit) as e:
        pass_profile.main(["--model", str(tiny_kl_path), "--batches", "0,8"])
    assert e.value.code == 2 and "positive integers" in capsys.readouterr().err
