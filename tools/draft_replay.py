#!/usr/bin/env python3
"""How drafting policies would fare on a model's own greedy text, against what a pass costs by rows.

    tools/draft_replay.py MODEL [--prompt TEXT ...] [--tokens 256] [--keep-chance 0.3] [--cost 1:0.8,5:1.8] ...

Greedy decoding's output with float32 products does not depend on the drafts (each is verified), so
the model runs once per prompt without drafts; then each policy is replayed against those tokens: the
n-gram drafter proposes from the context, the policy cuts the draft, and the verifier accepts the
draft's longest prefix that equals the known continuation, as a real pass would. Policies: drafts as
generation makes them (n-grams up to ``--ngram``, drafts up to ``--draft-len``, cut by ``DraftLengths``
at ``--keep-chance``), the same drafts whole, and the drafting before draft lengths (n-grams up to 3,
drafts of 4, whole). Each ``--cost`` is a table of a pass's cost by rows ("rows:cost" pairs, straight
lines between and past them), e.g. measured one- and five-row passes; the speed-up is the cost of
one-row passes for every token over the policy's. Prints one JSON record.
"""
import argparse
import json

import deltafin
from deltafin.runtime.generate import DRAFT_KEEP_CHANCE, MIN_NGRAM, DraftLengths, NgramDrafter, generate
from deltafin.runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):",
           "def quicksort(arr):", "# read a CSV file and print the rows\nimport csv\n", "for i in range(10):"]


def parse_cost(spec: str):
    """'1:0.8,5:1.8' -> cost(rows), straight lines through the points (and past the last two)."""
    try:
        points = sorted((int(r), float(c)) for r, c in (p.split(":") for p in spec.split(",")))
    except ValueError:
        raise SystemExit(f"--cost {spec!r}: give rows:cost pairs separated by commas, e.g. 1:0.8,5:1.8") from None
    rows = [r for r, _ in points]
    if len(points) < 2 or rows[0] != 1 or len(set(rows)) < len(rows) or any(c <= 0 for _, c in points):
        raise SystemExit(f"--cost {spec!r}: give a positive cost for 1 row and for at least one more row count, "
                         f"each row count once")

    def cost(rows: int) -> float:
        # the segment that holds `rows`, or the last one past the last point
        lo, hi = next(((a, b) for a, b in zip(points, points[1:]) if rows <= b[0]), points[-2:])
        return lo[1] + (hi[1] - lo[1]) * (rows - lo[0]) / (hi[0] - lo[0])
    return cost


def replay(runs, ngram: int, most: int, least: float) -> list[int]:
    """Rows of every pass when drafting as the policy says: n-grams up to `ngram` tokens, drafts up to
    `most`, cut where a position's chance of being used is below `least` (0: whole)."""
    rows = []
    for prompt, tokens in runs:
        drafter, lengths = NgramDrafter(ngram, min(MIN_NGRAM, ngram)), DraftLengths(least)
        context, done = list(prompt) + tokens[:1], 1  # the first token comes from the prompt's pass
        while done < len(tokens):
            offered, n = drafter.propose(context, min(most, len(tokens) - done - 1))
            draft = offered[:lengths.length(n, len(offered))]
            ok = 0
            while ok < len(draft) and draft[ok] == tokens[done + ok]:
                ok += 1
            lengths.record(n, len(draft), ok)
            rows.append(1 + len(draft))
            context += tokens[done:done + ok + 1]
            done += ok + 1
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: six Python openings)")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--draft-len", type=int, default=8)
    p.add_argument("--keep-chance", type=float, default=DRAFT_KEEP_CHANCE,
                   help="where drafts are cut (default: what generation uses)")
    p.add_argument("--cost", action="append", default=[], help="a pass's cost by rows, e.g. 1:0.8,5:1.8")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    if a.tokens < 2 or a.ngram < 1 or a.draft_len < 1:
        p.error("--tokens must be at least 2, --ngram and --draft-len at least 1")
    costs = {spec: parse_cost(spec) for spec in a.cost}
    try:
        model = deltafin.load(a.model, stream="off", dtype=a.dtype)
    except (OSError, ValueError) as e:  # a missing folder, a checkpoint deltafin refuses (DeltafinError)
        p.error(str(e))
    runs = []
    for text in a.prompt or PROMPTS:
        ids = model.encode(text)
        g = generate(model, ids, SamplingParams(max_new_tokens=a.tokens, speculate=False), eos_token_ids=[])
        runs.append((ids, g.generated))
    tokens = sum(len(t) - 1 for _, t in runs)
    policies = {f"cut (ngram {a.ngram}, up to {a.draft_len})": (a.ngram, a.draft_len, a.keep_chance),
                f"whole (ngram {a.ngram}, up to {a.draft_len})": (a.ngram, a.draft_len, 0.0),
                "whole (ngram 3, up to 4)": (3, 4, 0.0)}
    out = {"prompts": len(runs), "tokens": tokens, "policies": {}}
    for name, (ngram, most, least) in policies.items():
        rows = replay(runs, ngram, most, least)
        rec = {"passes": len(rows), "rows": sum(rows), "tokens_per_pass": round(tokens / len(rows), 3)}
        rec["speedup"] = {spec: round(tokens * cost(1) / sum(cost(r) for r in rows), 3) for spec, cost in costs.items()}
        out["policies"][name] = rec
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
