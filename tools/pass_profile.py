"""Where a decode pass's time goes, by kernel, at several batch sizes. Prints one JSON record.

    python tools/pass_profile.py --model PATH [--batches 1,8,32] [--tokens 24] [--prompt-tokens 8]
        [--top 25] [engine flags, e.g. --device cuda --stream off --dtype bfloat16]

For each batch size: random prompts of ``--prompt-tokens`` tokens are prefilled and decoded greedily
(``bench._decode``: one token of every sequence a pass, no speculation) once untimed (on CUDA this
compiles the kernels and records the decode graphs), then:

- ``ms_per_pass``: three timings of a pass, each the difference of a decode of ``--tokens`` + 8 and one
  of 8 tokens over ``--tokens`` passes (so the prefill and the first passes cancel), synchronized;
- ``profile``: ``torch.profiler`` over a decode of ``--tokens`` tokens, its time divided by its passes
  (prefill included, one pass more): on CUDA the device's kernels (what a replayed graph runs, one by
  one), elsewhere the host's operators by their own time; per name the milliseconds and launches a
  pass, the ``--top`` largest, and their total;
- ``experts_chosen``: per MoE layer, the distinct routed experts one decode pass of the batch chose
  (one pass watched by a routing observer, which runs the plain pass): what a batch's experts' kernels
  must read at least.

The kernels' names say what to fuse or speed up; ``ms_per_pass`` against the profile's total says
how long the device waits for the host between passes.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import deltafin
from deltafin.bench import _decode
from deltafin.model.moe import chosen_experts
from deltafin.runtime.pass_stats import PassObserver
from deltafin.settings import add_arguments, from_args
from engine_passes import _positive, _positive_list  # this folder: the same argument types

TIMING_ROUNDS = 3
BASE_TOKENS = 8  # the shorter decode of a timing, subtracted


class ChosenExperts(PassObserver):
    """Per MoE layer, how many distinct experts the last pass watched chose for its rows."""

    def __init__(self):
        self.per_layer: dict[int, int] = {}

    def on_route(self, layer: int, ids, x) -> None:
        self.per_layer[layer] = len(chosen_experts(ids))


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def time_passes(model, prompts: list[list[int]], tokens: int) -> list[float]:
    """Milliseconds a decode pass, TIMING_ROUNDS times (see the module docstring)."""
    out = []
    for _ in range(TIMING_ROUNDS):
        seconds = []
        for n in (tokens + BASE_TOKENS, BASE_TOKENS):
            _sync(model)
            t0 = time.perf_counter()
            _decode(model, prompts, n)
            _sync(model)
            seconds.append(time.perf_counter() - t0)
        out.append(1e3 * (seconds[0] - seconds[1]) / tokens)
    return out


def profile_passes(model, prompts: list[list[int]], tokens: int, top: int) -> dict:
    """Kernel (CUDA) or operator (CPU) time a pass by name, over a decode of `tokens` tokens."""
    cuda = model.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        _decode(model, prompts, tokens)
        _sync(model)
    passes = tokens  # the prefill pass and tokens - 1 decode passes
    us, calls = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t > 0:
            us[e.key] += t
            calls[e.key] += e.count
    return {"what": "device kernels" if cuda else "host operators (self time)",
            "total_ms_per_pass": sum(us.values()) / passes / 1e3,
            "top": [{"name": name[:120], "ms_per_pass": t / passes / 1e3, "calls_per_pass": calls[name] / passes}
                    for name, t in us.most_common(top)]}


def experts_chosen(model, prompts: list[list[int]]) -> dict[int, int]:
    """Distinct experts per MoE layer in the batch's first decode pass (after the prefill)."""
    watch = ChosenExperts()
    with model.observe(watch):
        _decode(model, prompts, 2)
    return dict(sorted(watch.per_layer.items()))  # the decode pass routed after the prefill


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", type=_positive_list, default=[1, 8, 32], help="sequences a pass (default 1,8,32)")
    p.add_argument("--tokens", type=_positive, default=24, help="decode passes timed and profiled (default 24)")
    p.add_argument("--prompt-tokens", type=_positive, default=8)
    p.add_argument("--top", type=_positive, default=25, help="kernels listed per batch (default 25)")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    add_arguments(p, groups=("engine",))
    args = p.parse_args(argv)
    model = deltafin.load(args.model, settings=from_args(args))
    rng = random.Random(args.seed)
    batches = []
    for b in args.batches:
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(b)]
        _decode(model, prompts, BASE_TOKENS)  # untimed: compiles kernels, records the graphs of this batch
        batches.append({"batch": b, "ms_per_pass": time_passes(model, prompts, args.tokens),
                        "profile": profile_passes(model, prompts, args.tokens, args.top),
                        "experts_chosen": experts_chosen(model, prompts)})
    print(json.dumps({"model": args.model, "device": str(model.device), "dtype": model.settings.dtype,
                      "batches": batches, "graphs": model.graph_stats()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
