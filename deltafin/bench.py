"""``deltafin bench``: decode and prefill speed, bytes per token, and how close the streamer gets
to this machine's raw read bandwidth, in one record.

Cold measurements evict only the model's own files from the page cache (per file, with
``POSIX_FADV_DONTNEED``): before the prefill, before the decode and before each raw-read probe.
Nothing else on the machine loses its cache.

The raw bandwidth is probed only when the model streams (in RAM a decode token reads nothing from
disk), by the same command on the same files with the same access pattern and settings: every
streamed layer's spine extents and ``experts_per_token`` randomly chosen experts per MoE layer,
read with ``io_workers`` workers in ``read_mode``, all the probe's tokens queued at once so the
workers always have reads in flight (decoding also reads ahead), and only the reads timed; up to 4
tokens, and at most 4 GB (``PROBE_MAX_BYTES``: a K3-shaped token is ~10 GB), layer by layer. The
probe runs twice, immediately before and immediately after the decode measurement; both are
reported with their spread, which tells the disk's drift from a real gain. ``io_efficiency`` is
the time the bytes one token reads from disk would take at the probes' mean bandwidth divided by
the time a token took (1.0: the disk never idles and nothing else costs time);
``io_efficiency_range`` is the same against the faster and the slower probe.

The record also says which numerics produced the figures: the spine read (bf16 is exact; int8 and
mixed are lossy), the experts' codec (as published, or re-encoded: lossy), the product dtype
(float32 is the reference) and the compute threads.

Memory tiers: ``disk_bytes_per_token`` (what came off the model's files) and ``ram_bytes_per_token``
(pinned and cached layers and experts, the head), the host-RAM cache's ``spine_cache_hit_rate``
(of the spines the streamer served) and ``expert_cache_hit_rate`` (of the routed experts), the
budget it ended with (``ram_budget_bytes``: its own buffers plus what the cache may hold; 0 = no
cache) and what it held (``ram_cache``). ``limit_tok_s`` is the tok/s the disk allows for the bytes
a token read from it (raw read bandwidth of the probes / disk bytes per token; None when a token
read nothing), and ``decode_vs_limit`` the share of it reached (``decode_vs_limit_range`` against the
faster and the slower probe; ``limit_note`` explains a share above 1, see ``disk_limit``). With ``prefetch`` on,
``prefetch_useful_rate`` is the share of the bytes read ahead of the router that it then chose
(prefetched bytes are disk bytes too). ``expert_routing`` is what the decode's routers chose, and
the hit rate the best fixed experts of the cache's size would have had (``routing_figures``). On CUDA the limit is the slowest
tier's instead (see ``device_figures``).

In RAM on the CPU (``--stream off``) nothing is read from disk per token; the bound is memory
instead. ``ram_read_gbps`` is how fast the run's threads read the weights a token reads (every
layer's spine, ``experts_per_token`` random experts per MoE layer, the head) where they lie, in one
native call that only loads and sums their bytes (best of 3 passes, probed immediately before and
immediately after the decode, like the disk, and between its passes every ``RAM_PROBE_EVERY`` tokens, the
probes' time left out of the decode's; ``ram_read`` has the probes and their spread).
``ram_limit_tok_s`` = ram_read_gbps / weight bytes per token is the tok/s that reading the
weights alone allows, ``decode_vs_ram_limit`` the share of it the decode reached,
``decode_vs_ram_limit_range`` the same against the fastest and the slowest probe, and ``ram_limit_note``
explains a decode that read faster than any probe (see ``ram_limit``).

A model split across ranks (``torchrun ... -m deltafin bench``, docs/distributed.md): the figures
above are rank 0's (its layers and the head; the probes read its layers only), and ``dist`` has the
placement, each rank's disk and RAM bytes per token, the bytes it sent and its busy share, the bytes
on the wire per token and the latency per hop (``dist_figures``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import platform
import random
import resource
import sys
import time
from pathlib import Path

from . import gpu_figures
from .checkpoint import expert_codec
from .checkpoint.sizes import ModelSizes, summarize as size_summary
from .io.reader import ALIGN, EXPERT_CHUNK, SPINE_CHUNK, URGENT, AlignedBuffer, Files, ReadPool, chunked, drop_file_cache, \
    expert_layout, spine_layout
from .profile import SOURCES, PassRecorder, summarize
from .runtime.generate import Decoding
from .runtime.pass_stats import PassObserver
from .runtime.sampling import SamplingParams
from .runtime.scheduler import PASS_ROWS
from .settings import Settings, add_arguments, from_args
from .units import GB, MB, GiB, MiB



def checkpoint_files(source) -> list[str]:
    """Every file the model's tensors live in."""
    cfg = source.config
    files = {t.file for t in source.global_infos().values()}
    for i in range(cfg.num_layers):
        files.update(t.file for t in source.spine_infos(i).values())
        if cfg.is_moe(i):
            for e in range(cfg.num_experts):
                files.update(t.file for t in source.expert_infos(i, e).values())
    return sorted(files)


# The most a raw-read probe reads: enough for a steady figure (seconds on a slow disk), far less than
# the 4 tokens of a K3-shaped model (the 18 GB slice reads ~10 GB a token: two probes of 4 tokens
# took over a minute of a bench run on a 1.36 GB/s disk).
PROBE_MAX_BYTES = 4 * GB
# A resident CPU model's memory probe runs again after every this many decode tokens (between passes,
# untimed): a host's memory bandwidth moved by a third within seconds between the probes before and after.
RAM_PROBE_EVERY = 8


def measure_raw_read(source, settings: Settings, tokens: int = 4, seed: int = 0, evict: list[str] = (),
                     max_bytes: int = PROBE_MAX_BYTES) -> dict:
    """Read what `tokens` decode passes read (streamed spines + random experts), reads only timed;
    layer by layer, at most `max_bytes` (at least one layer): ``tokens`` in the result is how many
    tokens' worth that was.

    Every token's reads are queued at once, so ``io_workers`` reads stay in flight until the end.
    ``evict``: files whose cached pages are dropped first, so the bytes come off the disk."""
    cfg = source.config
    rng = random.Random(seed)
    layers = range(min(settings.pin_layers, cfg.num_layers), cfg.num_layers)
    spines = {i: spine_layout(source, i) for i in layers}
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    k = min(cfg.experts_per_token, cfg.num_experts) if moe else 0
    # Which experts each token reads, chosen (and laid out) before any timing.
    picks = [[expert_layout(source, i, e) for i in moe for e in rng.sample(range(cfg.num_experts), k)]
             for _ in range(tokens)]
    # The bytes are not used, only the reads timed: every piece lands in one small scratch buffer
    # (at its file offset's place in a page, as O_DIRECT needs), read in the pieces decode reads
    # (spines in SPINE_CHUNK, experts in EXPERT_CHUNK). A buffer per spine and expert slot would
    # take a dense layer's size besides (1.2 GB on k3-slice) just before and after the timed
    # decode, forcing a capped run's RAM cache to shrink and read again.
    scratch = AlignedBuffer(SPINE_CHUNK + 2 * ALIGN)

    def pieces(layouts, chunk: int) -> list:
        jobs = [(r, scratch.mem, s) for lay in layouts for r, s in zip(lay.runs, lay.starts)]
        return [(run, scratch.mem, run.offset % ALIGN) for run, _, _ in chunked(jobs, chunk)]

    jobs, nbytes = [], 0
    for experts in picks:
        chosen = iter(experts)  # k per MoE layer, in layer order
        for i in range(cfg.num_layers):
            part = [spines[i]] if i in spines else []
            mine = [next(chosen) for _ in range(k)] if cfg.is_moe(i) else []
            jobs += pieces(part, SPINE_CHUNK) + pieces(mine, EXPERT_CHUNK)
            nbytes += sum(lay.nbytes for lay in part + mine)
            if nbytes >= max_bytes:
                break
        if nbytes >= max_bytes:
            break
    whole = sum(lay.nbytes for lay in spines.values()) + (sum(lay.nbytes for lay in picks[0]) if picks else 0)
    files = Files(settings.read_mode)
    pool = ReadPool(files, settings.io_workers)
    try:
        method = drop_file_cache(evict) if evict else "none"
        t0 = time.perf_counter()
        pool.submit(jobs, URGENT).wait()
        seconds = time.perf_counter() - t0
    finally:
        pool.shutdown()
        files.close()
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / GB if seconds > 0 else 0.0,
            "cache_drop": method, "tokens": round(nbytes / whole, 3) if whole else 0.0}


def _tensors(w) -> list:
    """The tensors of a provider's weight (a tensor, a stored QWeight, or tuples and dicts of them)."""
    if hasattr(w, "data_ptr"):
        return [w]
    if hasattr(w, "tensors"):
        return list(w.tensors.values())
    if isinstance(w, dict):
        w = list(w.values())
    return [t for part in w for t in _tensors(part)] if isinstance(w, (list, tuple)) else []


def measure_ram_read(model, threads: int, seed: int = 0, passes: int = 3) -> dict:
    """How fast `threads` threads read, where they lie, the weights one decode token of a resident
    CPU model reads: every spine, ``experts_per_token`` random experts per MoE layer and every global
    but the embedding (of which a token reads one row). Best of `passes` reads, each one native call."""
    from .kernels import cpu_native
    cfg = model.config
    rng = random.Random(seed)
    weights = [w for name, w in model.global_weights().items() if name != "embed"]
    for i in model.layers:  # a rank of a split model holds its own layers only
        weights.append(model.layer_weights(i))
        if cfg.is_moe(i):
            k = min(cfg.experts_per_token, cfg.num_experts)
            weights.append(model.expert_weights(i, rng.sample(range(cfg.num_experts), k)))
    tensors = [t for t in _tensors(weights) if t.is_cpu and t.is_contiguous()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        cpu_native.read_memory(tensors, threads)
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / GB if best > 0 else 0.0,
            "threads": threads, "passes": passes}


def raw_read_summary(probes: list[dict]) -> dict:
    """The probes' mean bandwidth and their spread ((fastest - slowest) / mean)."""
    rates = [p["gbps"] for p in probes]
    mean = sum(rates) / len(rates)
    return {"gbps": mean, "min_gbps": min(rates), "max_gbps": max(rates),
            "spread": (max(rates) - min(rates)) / mean if mean > 0 else 0.0, "probes": probes}


def disk_limit(tok_s: float, read_bytes_per_token: float, raw: dict | None) -> dict:
    """What the disk allows for the bytes a decode token read from it: ``limit_tok_s`` at the probes'
    mean bandwidth, ``decode_vs_limit`` the share reached, ``decode_vs_limit_range`` the same against
    the fastest and the slowest probe, and, when the decode itself read faster than the fastest probe,
    ``limit_note`` saying so: a share above 1 then says that the probes understate the disk under this
    run's conditions (reads the page cache of a memory group served, a device's own cache, the probes'
    drift), not that the decode beat the disk."""
    return _limit(tok_s, read_bytes_per_token, raw, "from the model's files", "the disk",
                  "(the page cache of a memory group, a device cache, or drift), so decode_vs_limit above 1 is the "
                  "probe's error, not a decode faster than the disk")


def ram_limit(tok_s: float, bytes_per_token: float, ram: dict | None) -> dict:
    """``disk_limit`` for a model in RAM: the tok/s reading a token's weights at the memory probes' mean
    rate allows (``limit_tok_s``), the share reached, its range against the fastest and the slowest probe,
    and a note when the decode read faster than any probe: the machine's memory moved between the
    probes and the decode (other tenants of a shared host), so the share says as much of the host as of
    the decode."""
    return _limit(tok_s, bytes_per_token, ram, "its weights", "memory",
                  "(the host's memory bandwidth moved between the probes and the decode), so a share near or above "
                  "1 is the probes' error, not a decode faster than memory")


def _limit(tok_s: float, bytes_per_token: float, probes: dict | None, read: str, tier: str, why: str) -> dict:
    if not probes or bytes_per_token <= 0:
        return {"limit_tok_s": None, "decode_vs_limit": None, "decode_vs_limit_range": None, "limit_note": None}
    limit = probes["gbps"] * GB / bytes_per_token
    share = lambda gbps: tok_s * bytes_per_token / (gbps * GB) if gbps > 0 else None  # noqa: E731
    achieved = tok_s * bytes_per_token / GB
    note = None
    if achieved > probes["max_gbps"]:
        note = (f"the decode read {achieved:.2f} GB/s {read}, faster than any probe "
                f"({probes['min_gbps']:.2f}-{probes['max_gbps']:.2f} GB/s): the probes understate {tier} in this run "
                + why)
    return {"limit_tok_s": limit, "decode_vs_limit": tok_s / limit,
            "decode_vs_limit_range": [share(probes["max_gbps"]), share(probes["min_gbps"])], "limit_note": note}


def machine_info(settings: Settings) -> dict:
    import psutil
    import torch
    device = settings.torch_device()
    from .kernels import cpu_native
    info = {"cpu_count": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total, "device": str(device),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_kernels": cpu_native.simd()}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def run_bench(path: str | Path, tokens: int = 32, prompt_tokens: int = 64, settings: Settings | None = None,
              seed: int = 0, drop_cache: bool = True, batch: int = 1, warmup_tokens: int | None = None) -> dict:
    """Prefill `batch` random prompts, decode `tokens` tokens of each greedily (no speculation, one
    token of every sequence per pass) between two raw read probes when streaming; return one flat
    record (see the module docstring). Token rates and bytes per token count every sequence's tokens.
    A batch's prompts are read together in pieces (``prefill_piece``), so a prefill pass carries no
    more rows than batch 1's. `warmup_tokens`: decode passes after the prefill that are not timed
    (a cache is measured in its steady state); None: 1 for a model streamed to a CUDA device (its
    first decode pass tunes kernels), else 0. They come on top of `tokens`."""
    from .api import load
    if tokens < 2:
        raise ValueError("bench needs at least 2 tokens (the first comes from the prefill)")
    if prompt_tokens < 1:
        raise ValueError("bench needs a prompt of at least 1 token")
    if batch < 1:
        raise ValueError("bench needs a batch of at least 1 sequence")
    if warmup_tokens is not None and warmup_tokens < 0:
        raise ValueError("bench needs --warmup-tokens of 0 or more")
    settings = settings or Settings.resolve({})
    t0 = time.perf_counter()
    model = load(path, settings=settings)
    load_seconds = time.perf_counter() - t0
    cfg = model.config
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(prompt_tokens)] for _ in range(batch)]
    # In RAM every weight was read at load: there is nothing to evict and no disk to measure. A hub
    # repository's cache fills as the run goes: nothing to evict beforehand, and probing random
    # experts would fetch them over the network.
    probing = model.streaming and model.source.kind != "hub"
    files = checkpoint_files(model.source) if drop_cache and probing else []
    probe_tokens = min(tokens - 1, 4)
    probes: list[dict] = []

    # A resident CPU model's bound is memory: probed the same way, before and after the decode.
    from .kernels import cpu_native
    ram_probing = not model.streaming and model.device.type == "cpu" and cpu_native.available()
    ram_probes: list[dict] = []

    def probe() -> None:
        if probing:
            probes.append(measure_raw_read(model.source, settings, tokens=probe_tokens, seed=seed + len(probes),
                                           evict=files))
        if ram_probing:
            ram_probes.append(measure_ram_read(model, model.threads, seed=seed + len(ram_probes)))

    marks: dict[str, float] = {}
    # What the decode's routers chose (streamed on the CPU), for the best-cache figure.
    routings = _RoutingCounter(model.config) if model.streaming and model.device.type == "cpu" else None

    # On CUDA the first decode passes of a process compile and tune the GPU kernels (seconds) and
    # record the decode graphs; the figures are the steady state's, so those passes are not timed. A
    # resident model decodes 3 tokens of its own first, the whole batch together (a graph is recorded
    # per batch size: the batch's own must exist before the timing starts). A streamed one must not
    # (they would fill its expert slots with the measured prompt's experts): its first decode pass is
    # left out instead.
    cuda = model.device.type == "cuda"
    warmup = 3 if cuda and not model.streaming else 0
    # decode passes before the timed ones (the model's own tokens, on top of `tokens`)
    untimed = warmup_tokens if warmup_tokens is not None else 1 if cuda and model.streaming else 0
    piece = prefill_piece(batch, prompt_tokens)
    # A split model's sequences go in groups, one pass of each in flight at once (_decode): a step of
    # every sequence is `groups` passes.
    groups = min(model.pipeline_depth, batch)
    prefills = groups * -(-prompt_tokens // piece)  # passes until every prompt is read (the last: first tokens)

    # A model split across ranks (deltafin.dist): every rank's totals before and after the decode.
    split = model.placement is not None  # bench runs on rank 0 of a split model
    ranks_before: list[dict] = []

    started = prefills - 1 + groups * untimed  # the pass after which the timed decode starts
    paused = [0.0]  # seconds of the timed decode spent in probes between its passes
    replay_before: list[dict | None] = []  # the CPU replay's counts as the timed decode starts

    def on_pass(index: int, stats) -> None:
        if index == prefills - 1:
            marks["first_token"] = time.perf_counter()
        # In RAM the host's memory drifts within seconds (other tenants): probes between the decode's
        # passes follow it, and their time is not the decode's.
        if ram_probing and index > started and (index - started) % (groups * RAM_PROBE_EVERY) == 0 \
                and index < started + groups * (tokens - 1):  # the last pass: the probe after the decode
            t = time.perf_counter()
            probe()
            paused[0] += time.perf_counter() - t
        # probe the disk, then decode is measured from disk, not from cache
        if index == started:
            probe()
            drop_file_cache(files)
            if split:
                ranks_before.extend(model.ranks_report())
            marks["decode_start"] = time.perf_counter()
            replay_before.append(model.cpu_replay_stats())
            if routings is not None:
                routings.on = True

    if warmup:
        _decode(model, prompts, warmup, piece)
    rec = PassRecorder(on_pass)
    cache_drop = drop_file_cache(files) if files else "none"
    start = time.perf_counter()
    with model.observe(rec), model.observe(routings) if routings else contextlib.nullcontext():
        gen_stats = _decode(model, prompts, tokens + untimed, piece)
    if len(rec.passes) < prefills + groups * (1 + untimed):
        raise RuntimeError("generation stopped after the prefill; nothing to measure")
    decode_seconds = rec.ended[-1] - marks["decode_start"] - paused[0]
    ranks_after = model.ranks_report() if split else []
    probe()
    prefill, decode = rec.passes[:prefills], rec.passes[prefills + groups * untimed:]
    prefill_tokens = sum(p.tokens for p in prefill)
    d = summarize(decode)
    s_per_tok = decode_seconds / d["tokens"]

    raw = raw_read_summary(probes) if probes else None
    disk_s_per_tok = d["read_bytes_per_token"] / GB  # seconds per token at 1 GB/s

    def efficiency(gbps: float) -> float:
        return disk_s_per_tok / gbps / s_per_tok if gbps > 0 else 0.0

    residency = (model.residency_now() or {}) if model.streaming else {}
    # Under a device the host streamer's own record (its RAM cache) is the residency's "host" part;
    # the rest is the device's (its budget is not the RAM's).
    host_residency = residency.get("host", {}) if "tier" in residency else residency
    disk = disk_limit(d["tokens"] / decode_seconds, d["read_bytes_per_token"], raw)
    limit = disk["limit_tok_s"]
    ram = raw_read_summary(ram_probes) if ram_probes else None
    in_ram = ram_limit(d["tokens"] / decode_seconds, d["bytes_per_token"], ram)
    sizes = ModelSizes.of(model.source)
    out = {
        "model": str(path),
        "streaming": model.streaming,
        # Which numerics produced these figures (bf16 spine + float32 products = the reference).
        "spine": model.source.spine_codec,
        "spine_exact": model.source.spine_codec == "bf16",
        "experts": expert_codec.describe(cfg, expert_codec.of(model.source)),
        # As published is exact (bf16, or K3's MXFP4); re-encoded by convert --experts is lossy.
        "experts_exact": expert_codec.of(model.source) == expert_codec.published(cfg),
        "product_dtype": settings.dtype,
        "threads": model.threads,
        # One-token passes of a streamed model: the products' threads as the run ended, and how often
        # the count changed (every core once the passes stopped waiting on the disk).
        "one_token_threads": model.one_token_threads(),
        # Of the timed decode's passes on the CPU, those replayed as their native calls and those
        # recorded (None: no replay on this model; a streamed one replays once its cache holds it all).
        "cpu_replay": _replay_counts(replay_before[0] if replay_before else None, model.cpu_replay_stats(),
                                     len(decode)),
        "prompt_tokens": prompt_tokens,
        "batch": batch,
        "prefill_passes": prefills,
        "decode_tokens": d["tokens"],
        "decode_tok_s": d["tokens"] / decode_seconds,
        "prefill_tok_s": prefill_tokens / sum(p.seconds for p in prefill),
        "ttft_s": marks["first_token"] - start,
        "load_seconds": load_seconds,
        "bytes_per_token": d["bytes_per_token"],
        "read_bytes_per_token": d["read_bytes_per_token"],
        "ram_bytes_per_token": d["ram_bytes_per_token"],
        "disk_bytes_per_token": d["read_bytes_per_token"],
        "spine_cache_hit_rate": d["spine_cache_hit_rate"],
        "expert_cache_hit_rate": d["expert_cache_hit_rate"],
        "ram_budget_bytes": (host_residency.get("budget_bytes", 0 if settings.ram_budget_bytes() == 0 else None)
                             if model.streaming else None),
        "ram_cache": host_residency.get("cache"),
        "expert_routing": routing_figures({}, routings.counts, host_residency.get("cache")) if routings else None,
        "limit_tok_s": limit,
        "limit_tier": "disk" if limit else None,
        "decode_vs_limit": disk["decode_vs_limit"],
        "decode_vs_limit_range": disk["decode_vs_limit_range"],
        "limit_note": disk["limit_note"],
        "ram_read_gbps": ram["gbps"] if ram else None,
        "ram_limit_tok_s": in_ram["limit_tok_s"],
        "decode_vs_ram_limit": in_ram["decode_vs_limit"],
        "decode_vs_ram_limit_range": in_ram["decode_vs_limit_range"],
        "ram_limit_note": in_ram["limit_note"],
        "ram_read": ram,
        "bytes_by_source_per_token": d["bytes_by_source_per_token"],
        "prefill_bytes_by_source": {name: sum(getattr(p, field) for p in prefill) for name, field in SOURCES}
                                   | {"tokens": prefill_tokens},
        "prefetch": settings.prefetch,
        "prefetch_useful_rate": d["prefetch_useful_rate"],
        "raw_read_gbps": raw["gbps"] if raw else None,
        "achieved_read_gbps": d["read_bytes_per_token"] / s_per_tok / GB,
        # Only what had to come off the disk counts: bytes served from RAM (pinned layers, the head)
        # cost no read time, so counting them would flatter the figure.
        "io_efficiency": efficiency(raw["gbps"]) if raw else None,
        "io_efficiency_range": [efficiency(raw["max_gbps"]), efficiency(raw["min_gbps"])] if raw else None,
        "io_split": {
            "spine_bytes_per_token": sum(sizes.spine_bytes),
            "expert_bytes_per_token": d["experts_per_token"] * sizes.one_expert,
            "experts_per_token": d["experts_per_token"],
            "spine_wait_s_per_token": d["spine_wait_seconds"] / d["tokens"],
            "expert_wait_s_per_token": d["expert_wait_seconds"] / d["tokens"],
            "compute_s_per_token": d["compute_seconds"] / d["tokens"],
            "other_s_per_token": d["other_seconds"] / d["tokens"],
        },
        "peak_rss_bytes": peak_rss_bytes(),
        "tokens_per_pass": gen_stats.get("tokens_per_pass", 1.0),
        "warmup_tokens": warmup + untimed,
        "raw_read": raw,
        "cache_drop": cache_drop,
        "settings": dataclasses.asdict(settings),
        "machine": machine_info(settings),
    }
    resident = model.resident_bytes()
    if resident is not None:
        out["provider_resident_bytes"] = resident
    if model.device.type == "cuda":
        out.update(device_figures(model, d, s_per_tok, raw, settings))
        if not model.streaming:
            out.update(resident_pass_figures(model, prompts, piece, prefills, out["prefill_tok_s"]))
    out["dist"] = dist_figures(model, d, decode_seconds, ranks_before, ranks_after, groups) if split else None
    return out


def dist_figures(model, d: dict, decode_seconds: float, before: list[dict], after: list[dict],
                 groups: int = 1) -> dict:
    """A model split across ranks: the placement, and per decode token each rank's weight bytes by
    tier and the bytes it sent, the bytes on the wire, and the time between ranks per hop.

    Rank 0's round trip (its rows handed on until the last rank's are back) less the other ranks'
    layer seconds is what the hops took (transfer, and each rank's handling of a pass outside its
    layers), spread over the world_size hops of a pass; with several groups in flight (``groups``)
    a round trip also holds the other groups' turns on the ranks, so the hop figure is left out
    (``--pipeline 1`` measures it). A rank's busy share is its layer seconds over the decode's; the
    rest is idle (``idle_share``: the pipeline's, averaged over the ranks)."""
    tokens, passes = d["tokens"], after[0]["passes"] - before[0]["passes"]
    diff = [{k: a[k] - b[k] for k in a if k != "rank"} for a, b in zip(after, before)]
    hops = len(diff)
    others = sum(r["layer_seconds"] for r in diff[1:])
    ranks = [{"rank": 0, "disk_bytes_per_token": d["read_bytes_per_token"],
              "ram_bytes_per_token": d["ram_bytes_per_token"]}]
    ranks += [{"rank": r, "disk_bytes_per_token": x["disk_bytes"] / tokens, "ram_bytes_per_token": x["ram_bytes"] / tokens}
              for r, x in enumerate(diff) if r]
    for rank, x in zip(ranks, diff):
        rank["sent_bytes_per_token"] = x["sent_bytes"] / tokens
        rank["layer_s_per_token"] = x["layer_seconds"] / tokens
        rank["busy_share"] = x["layer_seconds"] / decode_seconds
    placement = model.placement
    return {
        "world_size": hops,
        "placement": [{"rank": r, "layers": [layers.start, layers.stop - 1], "weight_bytes": nbytes}
                      for r, (layers, nbytes) in enumerate(zip(placement.ranges, placement.weight_bytes))],
        "placement_how": placement.how,
        "ranks": ranks,
        "wire_bytes_per_token": sum(x["sent_bytes"] for x in diff) / tokens,
        "round_trip_s_per_pass": diff[0]["round_trip_seconds"] / passes,
        "hop_latency_s": (diff[0]["round_trip_seconds"] - others) / passes / hops if groups == 1 else None,
        "decode_passes": passes,
        "pipeline_groups": groups,
        "idle_share": 1 - sum(r["busy_share"] for r in ranks) / hops,
    }


class _RoutingCounter(PassObserver):
    """Routings per expert of each MoE layer (the rows of every pass), counted while ``on``: an
    engine observer for the bench's run only, so no decode outside a bench pays for counting."""

    def __init__(self, cfg) -> None:
        self.on = False
        self.counts = {i: [0] * cfg.num_experts for i in range(cfg.num_layers) if cfg.is_moe(i)}

    def on_choice(self, layer: int, ids) -> None:
        if self.on:
            counts = self.counts[layer]
            for e in ids.flatten().tolist():
                counts[e] += 1


def routing_figures(before: dict[int, list[int]], after: dict[int, list[int]], cache: dict | None) -> dict | None:
    """What the decode's routers chose (``after`` less ``before``: routings per expert of each MoE
    layer), and what the best fixed choice of experts would have served: ``best_hit_rate`` is the
    share of the decode's routings that the `slots` most routed experts of each layer take (the
    cache's slots per layer at the end; a cache that knew the decode's routing in advance), to set
    ``expert_cache_hit_rate`` against. ``counts_by_rank``: each layer's counts, most routed first."""
    if not after:
        return None
    ranked = {i: sorted((a - b for a, b in zip(after[i], before.get(i, [0] * len(after[i])))), reverse=True)
              for i in after}
    total = sum(sum(c) for c in ranked.values())
    if total == 0:
        return None
    experts = len(next(iter(ranked.values())))
    top = max(1, -(-experts // 10))
    out = {"routings": total, "top10_share": sum(sum(c[:top]) for c in ranked.values()) / total,
           "counts_by_rank": {str(i): c for i, c in ranked.items()}}
    if cache:
        slots = cache["expert_slots_per_layer"]
        out["slots_per_layer"] = slots
        out["best_hit_rate"] = sum(sum(c[:slots]) for c in ranked.values()) / total
    return out


def device_figures(model, d: dict, s_per_tok: float, raw: dict | None, settings: Settings) -> dict:
    """On CUDA: each tier's bandwidth, measured now (the device's own copy, pinned host->device, a
    host-RAM read with the run's threads, and the disk's raw read when streaming), the bytes a decode
    token took from each, and the tok/s they allow together: the tiers deliver at once (the copy
    stream, the disk's reads and the device's compute overlap), so the slowest path for its bytes
    bounds a token (``limit_tier``), and experts computed on the host's cores (``cpu_experts``) add
    the time their bytes take to read from RAM. ``tier_seconds_per_token``: each path's time."""
    import torch
    device = model.device
    dev_gbps = measure_device_copy(device)
    h2d_gbps = measure_pinned_copy(device)
    host = measure_host_read(model.threads) if model.streaming else None
    dev_bytes, h2d_bytes = d["device_bytes_per_token"], d["h2d_bytes_per_token"]
    tier_seconds = {"device": dev_bytes / (dev_gbps * GB), "host_to_device": h2d_bytes / (h2d_gbps * GB)}
    if raw:
        tier_seconds["disk"] = d["read_bytes_per_token"] / (raw["gbps"] * GB)
    slowest = max(tier_seconds, key=tier_seconds.get)
    host_compute = d["host_compute_bytes_per_token"] / (host["gbps"] * GB) if host and host["gbps"] > 0 else 0.0
    bound = tier_seconds[slowest] + host_compute
    return {
        "device_name": torch.cuda.get_device_name(device),
        "device_bandwidth_gbps": dev_gbps,
        "pinned_h2d_gbps": h2d_gbps,
        "host_ram_read_gbps": host["gbps"] if host else None,
        "device_bytes_per_token": dev_bytes,
        "hbm_efficiency": dev_bytes / s_per_tok / (dev_gbps * GB),
        "h2d_bytes_per_token": h2d_bytes,
        "h2d_gbps": h2d_bytes / s_per_tok / GB,
        "host_compute_bytes_per_token": d["host_compute_bytes_per_token"],
        "expert_hit_rates": d["expert_hit_rates"],
        "tier_seconds_per_token": tier_seconds | ({"host_compute": host_compute} if host_compute else {}),
        "limit_tok_s": 1 / bound if bound > 0 else None,
        "limit_tier": slowest + (" + host compute" if host_compute else ""),
        "decode_vs_limit": bound / s_per_tok if bound > 0 else None,
        "cpu_experts": settings.cpu_experts,
        "residency": model.residency_now(),
        # One-token passes replayed as a recorded CUDA graph (None: every kernel launched per pass).
        "decode_graph": model.graph_stats(),
    }


def _replay_counts(before: dict | None, after: dict | None, passes: int) -> dict | None:
    if before is None or after is None:
        return None
    return {"passes": passes, "replayed": after["replayed"] - before["replayed"],
            "recorded": after["recorded"] - before["recorded"], "failed": after["failed"]}


def resident_pass_figures(model, prompts: list[list[int]], piece: int, prefills: int, prefill_tok_s: float) -> dict:
    """A model resident on CUDA: the prompt's share of the bf16 matrix peak and the kernels each kind
    of pass launches per layer (gpu_figures), counted over the same prompts decoded again."""
    cfg = model.config
    peak = measure_matmul_peak(model.device)
    T = len(prompts[0])
    flops_per_token = gpu_figures.prefill_flops(cfg, size_summary(model.source)["active_params"], T) / T
    decoded = 4
    prefill = gpu_figures.count_launches(lambda: _decode(model, prompts, 1, piece))
    both = gpu_figures.count_launches(lambda: _decode(model, prompts, 1 + decoded, piece))

    def per_layer(count: float, passes: int) -> float:
        return count / passes / cfg.num_layers
    return {
        "matmul_peak_tflops": peak,
        "prefill_tflops": prefill_tok_s * flops_per_token / 1e12,
        "prefill_mfu": prefill_tok_s * flops_per_token / (peak * 1e12),
        "launches_per_layer": {
            "prefill": per_layer(prefill["launches"], prefills),
            "decode": per_layer(both["launches"] - prefill["launches"], decoded)},
        "kernels_per_layer": {
            "prefill": per_layer(prefill["kernels"], prefills),
            "decode": per_layer(both["kernels"] - prefill["kernels"], decoded)},
    }


def _time_cuda(fn, repeat: int = 10) -> float:
    """Median seconds of fn() on the current stream, timed with events after a warm-up."""
    import torch
    fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_device_copy(device, nbytes: int = GiB) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    try:
        return 2 * nbytes / _time_cuda(lambda: dst.copy_(src)) / GB
    finally:
        del src, dst
        torch.cuda.empty_cache()


def measure_host_read(threads: int, nbytes: int = GiB, passes: int = 3) -> dict:
    """How fast `threads` threads read host RAM (a buffer of `nbytes`, touched first; best of `passes`
    reads, each one native call): what experts computed on the host's cores are bound by."""
    import torch
    from .kernels import cpu_native
    if not cpu_native.available():
        return {"gbps": 0.0}
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        cpu_native.read_memory([buf], threads)
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / GB if best > 0 else 0.0, "threads": threads}


def measure_matmul_peak(device, n: int = 8192) -> float:
    """bf16 TFLOP/s of an n x n x n GEMM on the device."""
    import torch
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2.0 * n ** 3 / _time_cuda(lambda: torch.matmul(a, b)) / 1e12


def measure_pinned_copy(device, nbytes: int = 256 << 20) -> float:
    """GB/s of a host->device copy from pinned memory (what streamed weights cross PCIe at)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _time_cuda(lambda: dst.copy_(src, non_blocking=True)) / GB


def prefill_piece(batch: int, prompt_tokens: int) -> int:
    """Prompt tokens of each sequence a batched prefill pass reads: the pass carries at most
    max(prompt_tokens, PASS_ROWS) rows (PASS_ROWS: the rows a server pass may always take), what batch
    1 carries. One pass of every prompt at once multiplies the rows, and the memory a pass needs grows
    with them (past cpu_native.GEMV_MAX_ROWS rows the CPU products widen weights to float32 for a
    matrix product; a streamed pass holds a slot for every expert its rows route to): ``bench --batch 8``
    of a k3-slice in a 6 GiB group ran at its limit, and was OOM-killed on a smaller slice."""
    return max(1, max(prompt_tokens, PASS_ROWS) // batch)


def _decode(model, prompts: list[list[int]], tokens: int, piece: int | None = None) -> dict:
    """Greedy decoding of `tokens` tokens per prompt, without speculation and without stopping at
    EOS; the prompts run together, `piece` tokens of each per prefill pass (all at once when None),
    then one token of each per pass."""
    params = SamplingParams(max_new_tokens=tokens, speculate=False)
    runs = [Decoding(model, p, params, eos_token_ids=[], prefill_chunk=piece or len(p)) for p in prompts]
    # A model split across ranks: the sequences in `pipeline_depth` groups, a pass of each in flight at
    # once (each group's passes in turn), as the server's scheduler runs them.
    groups = min(model.pipeline_depth, len(runs))
    flight = collections.deque()
    for g in range(groups):
        group = runs[g::groups]
        flight.append((group, model.start_batch([d.next_pass(max_prompt=piece) for d in group])))
    while flight:  # every group ends after the same passes
        group, pending = flight.popleft()
        for d, logits, ids in zip(group, pending.result(), pending.argmax()):
            d.take(logits, ids)
        if not group[0].done:
            flight.append((group, model.start_batch([d.next_pass(max_prompt=piece) for d in group])))
    return runs[0].result().stats


# -- command line ------------------------------------------------------------------------------
def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure decode/prefill speed and I/O efficiency against the "
                                            "disk's raw read bandwidth",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder, converted store, or hub repository owner/name")
    p.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="random prompt length (default 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, sharing every pass; "
                                                        "rates count all of them (default 1)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="decode passes after the prefill that are decoded but not timed, on top of --tokens (a "
                        "cache is measured in its steady state; default 1 for a model streamed to a CUDA "
                        "device, else 0)")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of a table")
    p.add_argument("--drop-cache", default=True, action=argparse.BooleanOptionalAction,
                   help="when streaming, evict the model's own files (only those, per file) from the page "
                        "cache before prefill, decode and each raw read probe, so the disk is measured "
                        "(default on)")
    add_arguments(p, groups=("engine",))
    p.set_defaults(func=handle_cli)
    return p


def handle_cli(args: argparse.Namespace) -> int:
    settings = from_args(args)
    r = run_bench(args.model, tokens=args.tokens, prompt_tokens=args.prompt_tokens, settings=settings,
                  drop_cache=args.drop_cache, batch=args.batch, warmup_tokens=args.warmup_tokens)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_table(r))
    return 0


def format_table(r: dict) -> str:
    s, m = r["settings"], r["machine"]
    sp = r["io_split"]
    rows = [
        ("decode", f"{r['decode_tok_s']:.2f} tok/s ({r['decode_tokens']} tokens, batch {r['batch']})"),
        ("prefill", f"{r['prefill_tok_s']:.1f} tok/s ({r['prompt_tokens']} tokens), ttft {r['ttft_s'] * 1e3:.0f} ms"),
        ("bytes/token", f"{r['bytes_per_token'] / MB:.2f} MB ("
                        + ", ".join(f"{k} {v / MB:.2f}" for k, v in r["bytes_by_source_per_token"].items())
                        + f"); spine {sp['spine_bytes_per_token'] / MB:.2f} MB, "
                        f"experts {sp['expert_bytes_per_token'] / MB:.2f} MB ({sp['experts_per_token']:.0f})"),
        ("time/token", f"compute {sp['compute_s_per_token'] * 1e3:.1f} ms, spine wait "
                       f"{sp['spine_wait_s_per_token'] * 1e3:.1f} ms, "
                       f"expert wait {sp['expert_wait_s_per_token'] * 1e3:.1f} ms, "
                       f"other {sp['other_s_per_token'] * 1e3:.1f} ms"),
        ("disk", _disk_line(r)),
        ("io efficiency", f"{r['io_efficiency']:.2f} ({r['io_efficiency_range'][0]:.2f}-"
                          f"{r['io_efficiency_range'][1]:.2f} against the faster / slower probe)"
         if r["raw_read"] else "- (in RAM: nothing read per token)" if not r["streaming"]
         else f"- ({_why_no_probe(r)}: raw bandwidth not probed)"),
        ("peak RSS", f"{r['peak_rss_bytes'] / MiB:.0f} MiB"),
    ]
    if "device_bandwidth_gbps" in r:
        res = r["residency"] or {}
        rows += [
            ("device", f"{r['device_bytes_per_token'] / MB:.1f} MB/token from device memory, hbm efficiency "
                       f"{r['hbm_efficiency']:.2f} of {r['device_bandwidth_gbps']:.0f} GB/s"),
            ("host->device", f"{r['h2d_bytes_per_token'] / MB:.1f} MB/token, {r['h2d_gbps']:.2f} GB/s "
                             f"(pinned copies {r['pinned_h2d_gbps']:.1f} GB/s)"),
            ("residency", f"spines {res.get('spine_layers')}/{res.get('layers')} layers, experts "
                          f"{res.get('experts_per_layer')}/{res.get('experts_in_layer')} per MoE layer "
                          f"({res.get('experts_held')} held now)"),
            ("limit", f"{r['limit_tok_s']:.1f} tok/s set by {r['limit_tier']}" if r["limit_tok_s"] else "-"),
            ("decode graph", "off" if not r.get("decode_graph") else
             f"{r['decode_graph']['replayed']} passes replayed, {r['decode_graph']['recorded']} recorded"
             + (f" (failed: {r['decode_graph']['failed']})" if r["decode_graph"]["failed"] else "")),
        ]
    elif r["ram_limit_tok_s"]:
        ram = r["ram_read"]
        rows.append(("limit", f"{r['ram_limit_tok_s']:.2f} tok/s set by memory: {r['threads']} threads read the "
                              f"weights at {r['ram_read_gbps']:.1f} GB/s (probes before, during and after decode "
                              + " / ".join(f"{p['gbps']:.1f}" for p in ram["probes"])
                              + f"); decode reached {r['decode_vs_ram_limit'] * 100:.0f}%, "
                              + "-".join(f"{x * 100:.0f}" for x in r["decode_vs_ram_limit_range"])
                              + "% against the fastest and the slowest probe"))
        if r["ram_limit_note"]:
            rows.append(("note", r["ram_limit_note"]))
    else:
        lo, hi = r["decode_vs_limit_range"] or (None, None)
        rows.append(("limit", f"{r['limit_tok_s']:.2f} tok/s set by the disk (decode reached "
                              f"{r['decode_vs_limit'] * 100:.0f}%, {lo * 100:.0f}-{hi * 100:.0f}% against the "
                              "faster and the slower probe)" if r["limit_tok_s"] else "-"))
        if r["limit_note"]:
            rows.append(("note", r["limit_note"]))
    if r["ram_cache"]:
        c = r["ram_cache"]
        rows.append(("ram cache", f"hits: spines {r['spine_cache_hit_rate'] * 100:.0f}%, experts "
                                  f"{(r['expert_cache_hit_rate'] or 0) * 100:.0f}%; holds {c['held_bytes'] / GB:.2f} "
                                  f"GB (spines {c['spine_layers_held']}/{c['streamed_layers']} layers, "
                                  f"{c['experts_held']} experts), budget {r['ram_budget_bytes'] / GB:.2f} GB"))
    if r.get("cpu_replay"):
        x = r["cpu_replay"]
        rows.append(("cpu replay", f"{x['replayed']} of {x['passes']} decode passes replayed, {x['recorded']} recorded"
                                   + (f" (failed: {x['failed']})" if x["failed"] else "")))
    if r.get("dist"):
        x = r["dist"]
        for rank, place in zip(x["ranks"], x["placement"]):
            rows.append((f"rank {rank['rank']}", f"layers {place['layers'][0]}-{place['layers'][1]} "
                                                 f"({place['weight_bytes'] / MB:.1f} MB), per token disk "
                                                 f"{rank['disk_bytes_per_token'] / MB:.2f} MB, ram "
                                                 f"{rank['ram_bytes_per_token'] / MB:.2f} MB, sent "
                                                 f"{rank['sent_bytes_per_token'] / 1e3:.1f} kB; layers "
                                                 f"{rank['layer_s_per_token'] * 1e3:.1f} ms/token, busy "
                                                 f"{rank['busy_share'] * 100:.0f}%"))
        hop = (f"{x['hop_latency_s'] * 1e3:.2f} ms a hop" if x["hop_latency_s"] is not None
               else f"{x['pipeline_groups']} groups in flight")
        rows.append(("wire", f"{x['wire_bytes_per_token'] / 1e3:.1f} kB/token over {x['world_size']} hops a pass, "
                             f"{hop} (round trip {x['round_trip_s_per_pass'] * 1e3:.1f} ms a pass); ranks idle "
                             f"{x['idle_share'] * 100:.0f}%"))
    head = (f"{r['model']}  stream={'on' if r['streaming'] else 'off'} read_mode={s['read_mode']} "
            f"io_workers={s['io_workers']} pin_layers={s['pin_layers']} threads={r['threads']}\n"
            f"spine {r['spine']} ({'exact' if r['spine_exact'] else 'lossy'}), "
            f"experts {r['experts']} ({'as published' if r['experts_exact'] else 'lossy'}), "
            f"products {r['product_dtype']}{' (reference)' if r['product_dtype'] == 'float32' else ''}\n"
            f"{m['cpu_count']} CPUs, {m['ram_bytes'] / GiB:.0f} GiB RAM, device {m['device']}")
    width = max(len(k) for k, _ in rows)
    return head + "\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _why_no_probe(r: dict) -> str:
    return "in RAM" if not r["streaming"] else "a hub repository, whose cache fills as it runs"


def _disk_line(r: dict) -> str:
    raw = r["raw_read"]
    if raw is None:
        return f"achieved {r['achieved_read_gbps']:.2f} GB/s ({_why_no_probe(r)}: raw bandwidth not probed)"
    before, after = (p["gbps"] for p in raw["probes"])
    return (f"achieved {r['achieved_read_gbps']:.2f} GB/s, raw {raw['gbps']:.2f} GB/s (probes before / after "
            f"decode {before:.2f} / {after:.2f}, spread {raw['spread'] * 100:.0f}%; cache drop: {r['cache_drop']})")
