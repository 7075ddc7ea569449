"""Which expert-cache policy keeps more hits: least-recently-used, or routing scores with aging.

Records the experts a model routes to while it decodes (greedy, in RAM, from prompts of real text
or random ids), then replays that routing through each policy at several cache sizes (slots per MoE
layer) and prints the share of routed experts found held. Both policies see exactly the same
sequence, and are driven the way the streamer drives the cache: per pass and layer, the chosen
experts are scored first, then each one not held is offered a slot.

    python tools/expert_cache_policy.py /work/shared/data/kl-code-tiny --tokens 200
    python tools/expert_cache_policy.py CHECKPOINT --random --tokens 100 --json

Policies: ``lru`` (admit every miss, evict the least recently used), and ``aged-H``
(``placement.ExpertSlots`` with half-life H passes; ``aged-inf`` = plain counts).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deltafin  # noqa: E402
from deltafin.io.placement import ExpertSlots  # noqa: E402
from deltafin.runtime.pass_stats import PassObserver  # noqa: E402

TEXTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n",
    "for i, line in enumerate(open(path)):\n    if not line.strip():\n        continue\n",
]


def record(path: str, tokens: int, prompts: int, use_random: bool, seed: int) -> list[list[tuple[int, list[int]]]]:
    """Per decode pass: [(layer, chosen experts), ...], over `prompts` generations."""
    model = deltafin.load(path, device="cpu", stream="off", speculate=False)
    passes: list[list[tuple[int, list[int]]]] = []

    class Recorder(PassObserver):
        routes: list = []

        def on_route(self, layer, ids, x):
            self.routes.append((layer, sorted(set(ids.flatten().tolist()))))

        def on_pass(self, stats):
            passes.append(self.routes)
            self.routes = []

    rng = random.Random(seed)
    for k in range(prompts):
        if use_random or model.tokenizer is None:
            ids = [rng.randrange(model.config.vocab_size) for _ in range(32)]
        else:
            ids = model.encode(TEXTS[k % len(TEXTS)])
        before = len(passes)
        with model.observe(Recorder()):
            model.generate(ids, max_new_tokens=tokens, speculate=False)
        del passes[before]  # the prefill: one pass over the whole prompt, not decode routing
    return passes


def replay_lru(passes, slots: int) -> float:
    held: dict[int, OrderedDict] = {}
    hits = total = 0
    for p in passes:
        for i, chosen in p:
            layer = held.setdefault(i, OrderedDict())
            for e in chosen:
                total += 1
                if e in layer:
                    hits += 1
                    layer.move_to_end(e)
                else:
                    layer[e] = True
                    if len(layer) > slots:
                        layer.popitem(last=False)
    return hits / max(total, 1)


def replay_aged(passes, slots: int, half_life: float) -> float:
    s = ExpertSlots(slots, half_life)
    hits = total = 0
    for p in passes:
        for i, chosen in p:
            s.routed(i, chosen)
            for e in chosen:
                total += 1
                if s.get(i, e) is not None:
                    hits += 1
                else:
                    s.offer(i, e, True)
    return hits / max(total, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=200, help="decode tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--random", action="store_true", help="random prompt ids instead of the built-in code texts")
    ap.add_argument("--slots", default="", help="comma-separated slots per layer (default: 1/8, 1/4, 1/2 of "
                                                "the experts)")
    ap.add_argument("--half-lives", default="8,32,128,inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    passes = record(a.model, a.tokens, a.prompts, a.random, a.seed)
    E = deltafin.load(a.model, device="cpu", stream="on", ram_budget="0").config.num_experts
    slots = [int(x) for x in a.slots.split(",")] if a.slots else sorted({max(1, E // 8), max(1, E // 4), E // 2})
    rows = []
    for n in slots:
        row = {"slots": n, "experts": E, "lru": replay_lru(passes, n)}
        for h in a.half_lives.split(","):
            row[f"aged-{h}"] = replay_aged(passes, n, float(h))
        rows.append(row)
    if a.json:
        print(json.dumps({"model": a.model, "decode_passes": len(passes), "rows": rows}, indent=2))
        return 0
    keys = [k for k in rows[0] if k not in ("slots", "experts")]
    print(f"{a.model}: {len(passes)} decode passes; hit rate of routed experts")
    print("slots/experts  " + "  ".join(f"{k:>10}" for k in keys))
    for r in rows:
        print(f"{r['slots']:>5}/{r['experts']:<7}  " + "  ".join(f"{r[k]:>10.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
