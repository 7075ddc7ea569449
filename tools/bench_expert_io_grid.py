"""Which io_workers x read_mode reads a checkpoint's routed experts fastest on this machine.

Each cell evicts the checkpoint from the page cache, then reads, layer by layer as decoding
does, `experts_per_token` randomly chosen experts of every MoE layer for --tokens tokens (the
same experts in every cell), waiting for each layer's reads before the next layer's start.
Only reads are timed. Prints a table and the best cell, or one JSON record with --json.

    python tools/bench_expert_io_grid.py --model PATH [--workers 1,2,4,8,16] [--modes buffered,nocache,mmap]
                                         [--tokens 8] [--json] [--no-drop-cache]

The extra mode ``mmap-view`` measures the alternative to copying from a map: the compute
thread itself faulting in mapped pages (after ``MADV_WILLNEED``), as it would when handed views
into the map; it does not use the workers.
"""
from __future__ import annotations

import argparse
import json
import mmap
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltafin.io.sources import open_source  # noqa: E402
from deltafin.bench import checkpoint_files  # noqa: E402
from deltafin.io.reader import (URGENT, AlignedBuffer, Files, ReadPool, align_down,  # noqa: E402
                                drop_file_cache, make_layout)


def expert_plan(source, tokens: int, seed: int) -> list[list[list]]:
    """[token][moe layer] -> layouts of the experts read there."""
    cfg = source.config
    rng = random.Random(seed)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    if not moe:
        raise SystemExit("this model has no MoE layers")
    k = cfg.experts_per_token
    extent = getattr(source, "expert_extent", None)
    return [[[make_layout(source.expert_infos(i, e), extent(i, e) if extent else None)
              for e in rng.sample(range(cfg.num_experts), k)] for i in moe] for _ in range(tokens)]


def read_cell(plan, mode: str, workers: int) -> tuple[int, float]:
    """(bytes, seconds) reading the plan with the streamer's reader."""
    k = len(plan[0][0])
    size = max(lay.capacity for token in plan for layer in token for lay in layer)
    slots = [AlignedBuffer(size) for _ in range(k)]
    files = Files(mode)
    pool = ReadPool(files, workers)
    nbytes, seconds = 0, 0.0
    try:
        for token in plan:
            for layer in token:
                jobs = [(r, slot.mem, s) for lay, slot in zip(layer, slots) for r, s in zip(lay.runs, lay.starts)]
                t0 = time.perf_counter()
                pool.submit(jobs, URGENT).wait()
                seconds += time.perf_counter() - t0
                nbytes += sum(lay.nbytes for lay in layer)
    finally:
        pool.shutdown()
        files.close()
    return nbytes, seconds


def view_cell(plan) -> tuple[int, float]:
    """(bytes, seconds) faulting the experts' mapped pages in from one thread."""
    maps: dict[str, mmap.mmap] = {}
    handles = []
    nbytes, seconds = 0, 0.0
    try:
        for token in plan:
            for layer in token:
                runs = [r for lay in layer for r in lay.runs]
                t0 = time.perf_counter()
                for r in runs:
                    if r.file not in maps:
                        handles.append(open(r.file, "rb"))
                        maps[r.file] = mmap.mmap(handles[-1].fileno(), 0, access=mmap.ACCESS_READ)
                    a = align_down(r.offset)
                    maps[r.file].madvise(mmap.MADV_WILLNEED, a, r.offset + r.nbytes - a)
                for r in runs:  # touch one byte per page, as a computation over a view would
                    np.frombuffer(maps[r.file], dtype=np.uint8, count=r.nbytes, offset=r.offset)[::4096].sum()
                seconds += time.perf_counter() - t0
                nbytes += sum(r.nbytes for r in runs)
    finally:
        for m in maps.values():
            m.close()
        for h in handles:
            h.close()
    return nbytes, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder or converted store")
    p.add_argument("--workers", default="1,2,4,8,16", help="comma-separated io_workers values")
    p.add_argument("--modes", default="buffered,nocache,mmap", help="comma-separated read modes (and mmap-view)")
    p.add_argument("--tokens", type=int, default=8, help="decode tokens' worth of expert reads per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--drop-cache", default=True, action=argparse.BooleanOptionalAction,
                   help="evict the checkpoint from the page cache before each cell (default on)")
    args = p.parse_args(argv)
    source = open_source(args.model)
    plan = expert_plan(source, args.tokens, args.seed)
    files = checkpoint_files(source)
    workers = [int(w) for w in args.workers.split(",")]
    cells = []
    for mode in args.modes.split(","):
        for w in ([1] if mode == "mmap-view" else workers):
            method = drop_file_cache(files) if args.drop_cache else "none"
            nbytes, seconds = view_cell(plan) if mode == "mmap-view" else read_cell(plan, mode, w)
            cells.append({"read_mode": mode, "io_workers": w, "bytes": nbytes, "seconds": seconds,
                          "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0, "cache_drop": method})
    best = max(cells, key=lambda c: c["gbps"])
    cfg = source.config
    record = {"model": args.model, "tokens": args.tokens, "experts_per_layer": cfg.experts_per_token,
              "expert_bytes": plan[0][0][0].nbytes, "cells": cells, "best": best}
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print(f"{args.model}: {args.tokens} tokens x {len(plan[0])} MoE layers x {cfg.experts_per_token} experts "
          f"of {plan[0][0][0].nbytes / 1e6:.2f} MB")
    print(f"{'read_mode':<10} {'workers':>7} {'GB/s':>8} {'seconds':>8}")
    for c in cells:
        print(f"{c['read_mode']:<10} {c['io_workers']:>7} {c['gbps']:>8.3f} {c['seconds']:>8.3f}")
    print(f"best: read_mode={best['read_mode']} io_workers={best['io_workers']} ({best['gbps']:.3f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
