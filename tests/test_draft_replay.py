"""tools/draft_replay.py: its replay of drafting is what generation does, pass for pass."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import draft_replay  # noqa: E402

import deltafin  # noqa: E402
from deltafin.runtime.generate import DRAFT_KEEP_CHANCE, generate  # noqa: E402
from deltafin.runtime.sampling import SamplingParams  # noqa: E402
from conftest import KL_CODE_TINY  # noqa: E402


def test_cost_tables_are_straight_lines_through_their_points():
    cost = draft_replay.parse_cost("5:1.8,1:0.8")
    assert cost(1) == pytest.approx(0.8) and cost(3) == pytest.approx(1.3) and cost(9) == pytest.approx(2.8)
    three = draft_replay.parse_cost("1:1,2:4.6,3:4.8")
    assert three(2) == pytest.approx(4.6) and three(5) == pytest.approx(5.2)
    for bad in ("2:1,3:2", "1:1", "1:1,1:2", "1:0,2:1", "1:1,2", "one:1,2:2", ""):
        with pytest.raises(SystemExit, match="--cost"):
            draft_replay.parse_cost(bad)


def test_bad_arguments_are_refused_by_name(tmp_path, capsys):
    for args, says in (([str(tmp_path), "--tokens", "1"], "--tokens"),
                       ([str(tmp_path), "--draft-len", "0"], "--draft-len"),
                       ([str(tmp_path / "none")], "no such checkpoint")):
        with pytest.raises(SystemExit):
            draft_replay.main(args)
        assert says in capsys.readouterr().err


@pytest.mark.skipif(not (KL_CODE_TINY / "config.json").exists(), reason="kl-code-tiny is not on this machine")
def test_the_replay_makes_the_passes_generation_makes(capsys):
    """kl-code-tiny (trained): the passes and rows the replay counts for the drafting generation does (drafts
    cut, n-grams up to 4, drafts up to 8) are those of a real greedy generation of the same prompts."""
    model = deltafin.load(KL_CODE_TINY, stream="off", ram_budget="0", dtype="float32")
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
    runs, passes, rows = [], 0, 0
    for text in prompts:
        ids = model.encode(text)
        plain = generate(model, ids, SamplingParams(max_new_tokens=96, speculate=False), eos_token_ids=[])
        drafted = generate(model, ids, SamplingParams(max_new_tokens=96), eos_token_ids=[])
        assert drafted.generated == plain.generated
        runs.append((ids, plain.generated))
        passes += drafted.stats["passes"]
        rows += drafted.stats["passes"] + drafted.stats["drafted_tokens"]
    replayed = draft_replay.replay(runs, ngram=4, most=8, least=DRAFT_KEEP_CHANCE)
    assert (len(replayed), sum(replayed)) == (passes, rows) and rows > passes
    assert draft_replay.main([str(KL_CODE_TINY), "--tokens", "96", "--cost", "1:1,5:2"] +
                             [a for t in prompts for a in ("--prompt", t)]) == 0
    out = json.loads(capsys.readouterr().out)["policies"]["cut (ngram 4, up to 8)"]
    assert (out["passes"], out["rows"]) == (passes, rows) and out["speedup"]["1:1,5:2"] > 1
