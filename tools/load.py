"""Load a running ``deltafin serve`` with N concurrent streaming clients (the real openai client).

Each client, a process of its own, sends its requests one after another: a prompt of
``--prompt-tokens`` token ids (a different one per request and per run unless ``--seed`` is given, so
the server's memo of deterministic answers never answers) with ``--max-tokens`` and ``--temperature``.
Printed as one JSON record: aggregate completion tok/s over the whole run, time to first token and
inter-token latency (p50 / p95) over every stream.

``--join-prompt-tokens N`` also measures what admitting a newcomer costs the streams already
running: once every client is streaming, one more client sends an N-token prompt, and the
inter-token latency of the running streams is reported separately for the window in which the
newcomer's prompt is being read (from its send to its first token) and for the time before
(``--join-after`` tokens of every running stream).

Clients are processes, not threads of this one: the openai client spends ~0.26 ms of Python on each
streamed chunk (measured on a 2-core EPYC), so eight clients in one process at 3,000 tok/s would keep its
one interpreter lock busy most of the time, and a chunk would wait for the lock before its arrival is
noted (a stream's end before its client's next request is sent): the figures would be the client's.

``--warmup N`` sends N requests from one client before the measured run and leaves them out of every
figure: a server whose caches start cold (a streamed model's RAM cache) otherwise counts its warm-up as
the first configuration's speed.

The record also says how the server batched the run (``passes``, from its /metrics before and
after): the forward passes it ran, the requests they carried on average (all, and those past their
prompt), the passes in flight at once (above 1: a split model's groups pipelined), their rows, the
engine thread's milliseconds per pass in planning, the model, and taking the tokens, the share
of the run it was busy, where passes replay CUDA graphs the share replayed and the decode states
moved into their slots per pass, ``first_token_ms``: the server's own mean time from a request
handed to its app (headers read) to its first text written, by phase (what the client's ``ttft`` adds
to it is the client, the connection and the server reading the headers), and
``wait_ms_per_request``: of its "engine" phase, the wait for the request's first
pass. Another client using the server at the same time shows in these too.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import openai


@dataclass
class Stream:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per content chunk
    completion_tokens: int = 0
    ended: float = 0.0

    @property
    def first(self) -> float:
        """When the first text came (or the stream ended, for an answer without visible text)."""
        return self.arrivals[0] if self.arrivals else self.ended


def _prompt(rng: random.Random, n: int, top: int) -> list[int]:
    # Clear of the special tokens that vocabularies put first.
    return [rng.randrange(min(10, top - 1), top) for _ in range(n)]


def run_stream(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int, temperature: float,
               seed: int, shown=None) -> Stream:
    """One streamed completion. ``shown(n)``, where given, is told each time the stream has shown n chunks
    of text (so that another process can watch it grow)."""
    s = Stream(sent=time.perf_counter())
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                         seed=seed, stream=True, stream_options={"include_usage": True})
    for chunk in response:
        if chunk.usage is not None:
            s.completion_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            s.arrivals.append(time.perf_counter())
            if shown is not None:
                shown(len(s.arrivals))
    s.ended = time.perf_counter()
    return s


# The processes' clocks agree: perf_counter is CLOCK_MONOTONIC on Linux, one clock for the whole machine.
FAILED = -1  # a client's entry in ``shown`` once it failed


def client_process(c: int, url: str, model: str, knobs: dict, seed: int, start, shown, results) -> None:
    """One client (a process of its own): its requests one after another, once every client is ready
    (``start``, a barrier); ``shown[c]`` follows its first stream's chunks (the joining newcomer waits on
    them). Puts (c, its streams, an error or None) on ``results``."""
    rng = random.Random(seed * 1_000_003 + c)
    streams, error = [], None

    def first_shows(n: int) -> None:
        shown[c] = n
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
        start.wait()
        for r in range(knobs["requests"]):
            s = run_stream(client, model, _prompt(rng, knobs["prompt_tokens"], knobs["max_token_id"]),
                           knobs["max_tokens"], knobs["temperature"], seed=c * 1000 + r,
                           shown=first_shows if r == 0 else None)
            streams.append(s)
    except Exception as e:  # reported, not raised: the other clients' figures still count
        error = f"client {c}: {type(e).__name__}: {e}"
        shown[c] = FAILED
        start.abort()  # a client that failed before the start lets the others go rather than wait forever
    results.put((c, streams, error))


def run_clients(args: argparse.Namespace, model: str, seed: int, joining) -> tuple[list[Stream], list[str], float,
                                                                                      Stream | None]:
    """Every client's streams (in client order), the errors, the wall time from the start to the last
    stream's end, and the joining newcomer's stream (``joining()``, once every client's first stream has
    shown ``--join-after`` chunks; None without one)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's client is shared
    start = ctx.Barrier(args.clients + 1)
    shown = ctx.Array("i", args.clients)
    results = ctx.Queue()
    knobs = {k: getattr(args, k) for k in ("requests", "prompt_tokens", "max_tokens", "temperature", "max_token_id")}
    procs = [ctx.Process(target=client_process, args=(c, args.url, model, knobs, seed, start, shown, results),
                         daemon=True) for c in range(args.clients)]
    for p in procs:
        p.start()
    errors: list[str] = []
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass  # a client failed before the start: its error comes with its results
    t0 = time.perf_counter()
    joined = None
    if joining is not None:
        need = max(1, min(args.join_after, args.max_tokens // 2))
        while (any(0 <= n < need for n in shown[:]) and FAILED not in shown[:]
               and any(p.is_alive() for p in procs)):
            time.sleep(0.01)
        try:
            joined = joining()
        except Exception as e:
            errors.append(f"joining client: {type(e).__name__}: {e}")
    got: dict[int, tuple] = {}
    while len(got) < args.clients:
        try:
            c, streams, error = results.get(timeout=0.5)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break  # a client died without reporting
            continue
        got[c] = (streams, error)
    for p in procs:
        p.join()
    streams = []
    for c in range(args.clients):
        if c not in got:
            errors.append(f"client {c}: ended without a report (exit code {procs[c].exitcode})")
            continue
        streams.extend(got[c][0])
        if got[c][1]:
            errors.append(got[c][1])
    ends = [s.ended for s in streams]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    return streams, errors, wall, joined


def gaps(streams: list[Stream], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """Inter-token gaps (seconds) of the given streams whose later chunk arrived in [start, end)."""
    return [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]) if start <= b < end]


def server_counts(url: str) -> dict[str, float] | None:
    """The server's pass counters (name{labels} -> value) from /metrics, None when it has none."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None
    counts = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("deltafin_pass", "deltafin_first_token", "deltafin_request_wait",
                            "deltafin_requests_started")):
            counts[name] = float(value)
    return counts or None


def batching(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """Means per pass over the run, from the pass counters before and after it; ``busy``: the
    share of the run's wall time the engine thread spent in passes."""
    if not before or not after:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("deltafin_passes_total", 0.0)
    if n <= 0:
        return {"passes": 0}
    per = lambda k: d.get(k, 0.0) / n  # noqa: E731
    return {
        "passes": int(n),
        "sequences_per_pass": per("deltafin_pass_sequences_total"),
        "decoding_per_pass": per("deltafin_pass_decoding_sequences_total"),
        "in_flight_per_pass": per("deltafin_pass_in_flight_total"),
        "decode_rows_per_pass": per('deltafin_pass_rows_total{kind="decode"}'),
        "prompt_rows_per_pass": per('deltafin_pass_rows_total{kind="prompt"}'),
        "plan_ms_per_pass": 1e3 * per('deltafin_pass_seconds_total{part="plan"}'),
        "forward_ms_per_pass": 1e3 * per('deltafin_pass_seconds_total{part="forward"}'),
        "take_ms_per_pass": 1e3 * per('deltafin_pass_seconds_total{part="take"}'),
        "busy": sum(v for k, v in d.items() if k.startswith("deltafin_pass_seconds_total")) / wall,
        # a server whose passes replay CUDA graphs: the share replayed, and states moved into their slots
        "replayed_share": (sum(v for k, v in d.items() if k.startswith("deltafin_passes_replayed_total")) / n
                           if "deltafin_pass_states_moved_total" in d else None),
        "states_moved_per_pass": per("deltafin_pass_states_moved_total") if "deltafin_pass_states_moved_total" in d
        else None,
        "first_token_ms": first_token_phases(d),
        # from handed to the engine thread to the request's first pass (within first_token_ms' "engine")
        "wait_ms_per_request": (1e3 * d.get("deltafin_request_wait_seconds_total", 0.0)
                                / d["deltafin_requests_started_total"]
                                if d.get("deltafin_requests_started_total") else None),
    }


def first_token_phases(d: dict[str, float]) -> dict | None:
    """The server's own mean milliseconds from a streamed request handed to its app to its first text
    written, by phase (its /metrics counters over the run), and their sum; None when it counted none."""
    n = d.get("deltafin_first_tokens_total", 0.0)
    if n <= 0:
        return None
    out = {}
    for k, v in d.items():
        if k.startswith('deltafin_first_token_seconds_total{phase="'):
            out[k.split('"')[1]] = 1e3 * v / n
    out["total"] = sum(out.values())
    return out


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50_ms": None, "p95_ms": None}
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    return {"n": len(xs), "p50_ms": pick(0.50), "p95_ms": pick(0.95), "mean_ms": statistics.fmean(xs) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", type=int, default=1, help="requests per client, one after another (default 1)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in tokens (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--join-prompt-tokens", type=int, default=0,
                   help="once all clients stream, one more client sends a prompt this long (0 = none)")
    p.add_argument("--join-after", type=int, default=6,
                   help="tokens every running stream shows before the newcomer is sent: the latency before "
                        "it is measured over these (default 6; at most half of --max-tokens)")
    p.add_argument("--max-token-id", type=int, default=500,
                   help="prompt token ids are drawn below this (must be inside the model's vocabulary)")
    p.add_argument("--seed", type=int, default=None,
                   help="makes the prompts repeatable (a repeated greedy run is then answered from the memo)")
    p.add_argument("--warmup", type=int, default=0,
                   help="requests one client sends (other prompts, same lengths) before the measured run, not "
                        "counted: a server whose RAM cache starts cold otherwise measures its warm-up (default 0)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(6), "little")
    for name in ("clients", "requests", "prompt_tokens", "max_tokens", "max_token_id", "join_after"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")

    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=3600)
    try:
        model = client.models.list().data[0].id
    except openai.APIConnectionError as e:
        print(f"load: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    warm = random.Random(seed - 2)
    for i in range(args.warmup):
        try:
            run_stream(client, model, _prompt(warm, args.prompt_tokens, args.max_token_id), args.max_tokens,
                       args.temperature, seed=-1 - i)
        except Exception as e:
            print(f"load: the warm-up request failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    joining = None
    if args.join_prompt_tokens:
        def joining() -> Stream:
            return run_stream(client, model, _prompt(random.Random(seed - 1), args.join_prompt_tokens,
                                                     args.max_token_id), 1, args.temperature, seed=0)
    before = server_counts(args.url)
    everything, errors, wall, joined = run_clients(args, model, seed, joining)
    passes = batching(before, server_counts(args.url), wall)
    tokens = sum(s.completion_tokens for s in everything)
    record = {
        "url": args.url, "model": model, "clients": args.clients, "requests_per_client": args.requests,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "seed": seed, "warmup_requests": args.warmup,
        "completion_tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft": percentiles([s.first - s.sent for s in everything]),
        "itl": percentiles(gaps(everything)),
        "passes": passes,
        "errors": errors,
    }
    if joined is not None:
        record["join"] = {
            "prompt_tokens": args.join_prompt_tokens, "ttft_s": joined.first - joined.sent,
            "itl_before": percentiles(gaps(everything, end=joined.sent)),
            "itl_while_joining": percentiles(gaps(everything, joined.sent, joined.first)),
        }
    print(json.dumps(record, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
