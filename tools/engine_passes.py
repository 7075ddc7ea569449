"""The server's engine thread without HTTP: rounds of C concurrent requests through the ``Scheduler``,
every pass timed. Prints one JSON record.

    python tools/engine_passes.py --model PATH [--clients 1,8] [--rounds 2] [--max-tokens 64]
        [--prompt-tokens 16] [--requests N] [engine flags, e.g. --device cuda --stream off]

Each round submits C requests of ``--prompt-tokens`` random token ids at once (greedy, ``--max-tokens``
each, speculation as the settings say) and waits for all of them; its ``tok_s`` is the tokens they made
over its wall time. Every pass the scheduler runs is timed from its start to its logits (on CUDA after a
device sync, so a pass's time is its GPU time too), with its sequences, the rows each fed and whether it
kept rollback states (a draft check): a round's first passes and slowest passes say where a slow round's
time went (a prompt pass, a first recording), its ``pass_ms_p50`` what a steady pass costs.

``--requests N`` loads the engine as ``tools/load.py`` loads a server instead: C clients (threads), each
sending N requests one after another, so requests end and come while others decode. Nothing is
synchronized then (the host makes a pass's text while the device runs the next, as served); on CUDA each
pass is timed by device events around its work, and ``device_busy`` is the share of the round's passes'
span the device spent in them (the rest: the host between passes). This is what ``tools/load.py``
measures minus the HTTP side: the two side by side show what the server adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
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
    """Wraps a model's ``start_batch`` (what the scheduler calls) so that every pass is timed and logged:
    from its start to the end of its ``result()``, synchronized on CUDA; or (``events``, CUDA only) by
    device events around its work, read once the round is over (``settle``), nothing synchronized."""

    def __init__(self, model, events: bool = False):
        self.model, self.log = model, []
        self._start = model.start_batch
        cuda = model.device.type == "cuda"
        self._sync = torch.cuda.synchronize if cuda and not events else (lambda: None)
        self._events = [] if cuda and events else None  # (pass's log entry, start event, end event)
        model.start_batch = self

    def __call__(self, seqs):
        self._sync()
        t0 = time.perf_counter()
        entry = {"sequences": len(seqs), "rows": sorted({len(s.ids) for s in seqs}),
                 "check": any(s.keep_states for s in seqs)}
        if self._events is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        pending = self._start(seqs)
        if self._events is not None:
            end.record()
            self._events.append((entry, begin, end))
        result = pending.result

        def timed_result():
            out = result()
            self._sync()
            if self._events is None:
                entry["ms"] = 1e3 * (time.perf_counter() - t0)
            self.log.append(entry)
            return out
        pending.result = timed_result
        return pending

    def clear(self) -> None:
        del self.log[:]
        if self._events is not None:
            del self._events[:]

    def settle(self) -> float | None:
        """After a round timed by events: each pass's device milliseconds, and the share of the span from
        the first pass's start to the last one's end that the device spent in passes (None: no events)."""
        if not self._events:
            return None
        torch.cuda.synchronize()
        for entry, begin, end in self._events:
            entry["ms"] = begin.elapsed_time(end)
        span = self._events[0][1].elapsed_time(self._events[-1][2])
        return sum(e["ms"] for e, _, _ in self._events) / span if span > 0 else None


def run_round(scheduler: Scheduler, timed: TimedPasses, clients: int, prompt_tokens: int, max_tokens: int,
              vocab: int, gen: torch.Generator, requests: int = 0) -> dict:
    """One round: `clients` requests at once, or (`requests` > 0) `clients` threads sending that many
    one after another each."""
    prompts = [[torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(max(1, requests))]
               for _ in range(clients)]
    timed.clear()
    made = [0] * clients
    t0 = time.perf_counter()
    if not requests:
        futures = [scheduler.submit(p[0], SamplingParams(max_new_tokens=max_tokens)) for p in prompts]
        made = [len(f.result().tokens) for f in futures]
    else:
        failed: list[BaseException] = []

        def client(i: int) -> None:
            try:
                for p in prompts[i]:
                    made[i] += len(scheduler.submit(p, SamplingParams(max_new_tokens=max_tokens)).result().tokens)
            except BaseException as e:  # reported by the main thread
                failed.append(e)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
    wall = time.perf_counter() - t0
    busy = timed.settle()
    passes = list(timed.log)
    times = [p["ms"] for p in passes]
    out = {"clients": clients, "tokens": sum(made), "wall_s": wall, "tok_s": sum(made) / wall if wall > 0 else 0.0,
           "passes": len(passes), "pass_ms_p50": statistics.median(times) if times else None,
           "sequences_per_pass": sum(p["sequences"] for p in passes) / len(passes) if passes else None,
           "first_passes": passes[:3], "slowest_passes": sorted(passes, key=lambda p: -p["ms"])[:3]}
    if requests:
        out.update(requests_per_client=requests, device_busy=busy)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=_positive_list, default=[1, 8], help="requests at once, per round kind")
    p.add_argument("--rounds", type=_positive, default=2, help="rounds of each client count (the first compiles)")
    p.add_argument("--max-tokens", type=_positive, default=64)
    p.add_argument("--prompt-tokens", type=_positive, default=16)
    p.add_argument("--requests", type=int, default=0,
                   help="N >= 1: each client sends N requests one after another, as tools/load.py does "
                        "(default 0: a round's requests all at once)")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    add_arguments(p, groups=("engine",))
    args = p.parse_args(argv)
    if args.requests < 0:
        p.error(f"--requests: expected 0 or a positive integer, got {args.requests}")
    model = deltafin.load(args.model, settings=from_args(args))
    timed = TimedPasses(model, events=args.requests > 0)
    scheduler = Scheduler(model, max(args.clients), model.settings.prefill_chunk)  # the server's pieces
    gen = torch.Generator().manual_seed(args.seed)
    try:
        rounds = [run_round(scheduler, timed, c, args.prompt_tokens, args.max_tokens, model.config.vocab_size, gen,
                            args.requests) for _ in range(args.rounds) for c in args.clients]
    finally:
        scheduler.close()
    print(json.dumps({"model": args.model, "device": str(model.device), "rounds": rounds,
                      "graphs": model.graph_stats()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
