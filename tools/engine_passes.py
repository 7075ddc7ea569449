"""The server's engine thread without HTTP: rounds of C concurrent requests through the ``Scheduler``,
every pass timed. Prints one JSON record.

    python tools/engine_passes.py --model PATH [--clients 1,8] [--rounds 2] [--max-tokens 64]
        [--prompt-tokens 16] [engine flags, e.g. --device cuda --stream off]

Each round submits C requests of ``--prompt-tokens`` random token ids at once (greedy, ``--max-tokens``
each, speculation as the settings say) and waits for all of them; its ``tok_s`` is the tokens they made
over its wall time. Every pass the scheduler runs is timed from its start to its logits (on CUDA after a
device sync, so a pass's time is its GPU time too), with its sequences, the rows each fed and whether it
kept rollback states (a draft check): a round's first passes and slowest passes say where a slow round's
time went (a prompt pass, a first recording), its ``pass_ms_p50`` what a steady pass costs. This is what
``tools/load.py`` measures minus the HTTP side: the two side by side show what the server adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import deltafin
from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.scheduler import Scheduler
from deltafin.settings import add_arguments, from_args


def _positive_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class TimedPasses:
    """Wraps a model's ``start_batch`` (what the scheduler calls) so that every pass is timed from its
    start to the end of its ``result()`` (synchronized on CUDA) and logged."""

    def __init__(self, model):
        self.model, self.log = model, []
        self._start = model.start_batch
        self._sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        model.start_batch = self

    def __call__(self, seqs):
        self._sync()
        t0 = time.perf_counter()
        pending = self._start(seqs)
        result = pending.result

        def timed_result():
            out = result()
            self._sync()
            self.log.append({"sequences": len(seqs), "rows": sorted({len(s.ids) for s in seqs}),
                             "check": any(s.keep_states for s in seqs), "ms": 1e3 * (time.perf_counter() - t0)})
            return out
        pending.result = timed_result
        return pending


def run_round(scheduler: Scheduler, timed: TimedPasses, clients: int, prompt_tokens: int, max_tokens: int,
              vocab: int, gen: torch.Generator) -> dict:
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(clients)]
    del timed.log[:]
    t0 = time.perf_counter()
    futures = [scheduler.submit(p, SamplingParams(max_new_tokens=max_tokens)) for p in prompts]
    made = sum(len(f.result().tokens) for f in futures)
    wall = time.perf_counter() - t0
    passes = list(timed.log)
    times = [p["ms"] for p in passes]
    return {"clients": clients, "tokens": made, "wall_s": wall, "tok_s": made / wall if wall > 0 else 0.0,
            "passes": len(passes), "pass_ms_p50": statistics.median(times) if times else None,
            "first_passes": passes[:3], "slowest_passes": sorted(passes, key=lambda p: -p["ms"])[:3]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=_positive_list, default=[1, 8], help="requests at once, per round kind")
    p.add_argument("--rounds", type=_positive, default=2, help="rounds of each client count (the first compiles)")
    p.add_argument("--max-tokens", type=_positive, default=64)
    p.add_argument("--prompt-tokens", type=_positive, default=16)
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    add_arguments(p, groups=("engine",))
    args = p.parse_args(argv)
    model = deltafin.load(args.model, settings=from_args(args))
    timed = TimedPasses(model)
    scheduler = Scheduler(model, max(args.clients), model.settings.prefill_chunk)  # the server's pieces
    gen = torch.Generator().manual_seed(args.seed)
    try:
        rounds = [run_round(scheduler, timed, c, args.prompt_tokens, args.max_tokens, model.config.vocab_size, gen)
                  for _ in range(args.rounds) for c in args.clients]
    finally:
        scheduler.close()
    print(json.dumps({"model": args.model, "device": str(model.device), "rounds": rounds,
                      "graphs": model.graph_stats()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
