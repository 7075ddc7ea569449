"""Throughput of the dequant-matmul kernels on real K3 weight shapes.

For each (shape, codec, rows) it reports the weight bytes consumed per second by the Triton
kernel (CUDA only) and by the torch reference, next to the device's memory bandwidth measured
with a plain large copy and a plain large sum. Prints one JSON line, then a table.

    python tools/bench_kernels.py                      # CUDA if present, else CPU (reference only)
    python tools/bench_kernels.py --rows 1,16 --dtype bfloat16
    python tools/bench_kernels.py --device cpu --shapes 1024x2048 --iters 2

On CUDA every timing replays a CUDA graph of many calls, so the figure is the kernel's, not
Python's launch overhead; the calls rotate over enough copies of the weight to exceed the L2
cache, so the bytes really come from device memory. ``eager_us`` is one ordinary call, launch
overhead included.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch

from deltafin.kernels import CODECS, QWeight, qlinear
from deltafin.kernels import intq

# name, [out, in], codecs worth measuring at that shape
K3_SHAPES = [
    ("kda_qkvg_proj", (12288, 7168), ("bf16", "int8", "int8g", "int6", "int4", "mxfp4")),
    ("o_proj", (7168, 12288), ("bf16", "int8", "int8g", "int6", "int4", "mxfp4")),
    ("expert_w1", (3072, 3584), ("mxfp4", "int4", "int8", "int8g")),
    ("expert_w2", (3584, 3072), ("mxfp4", "int4", "int8", "int8g")),
]
TOOL_CODECS = (*CODECS, "int8g")  # int8g: grouped int8 (linear's "int8" with group scales)
L2_BYTES = 64 << 20  # H100/H200 class; rotating over 4x this keeps the weight out of L2


def random_qweight(codec: str, shape: tuple[int, int], group: int, device: str) -> QWeight:
    """A weight with random codes and plausible scales (content does not change the speed)."""
    out, n = shape
    if codec == "bf16":
        return QWeight(codec, shape, 0, {"weight": torch.randn(out, n, device=device).bfloat16()})
    if codec in ("int8", "int8g"):  # int8g: int8 with a float16 scale per group (--group)
        grouped = codec == "int8g"
        return QWeight("int8", shape, group if grouped else 0, {
            "weight": torch.randint(-127, 128, (out, n), dtype=torch.int8, device=device),
            "weight_scale": (torch.rand(out, n // group, device=device) * 1e-3).half() if grouped
            else torch.rand(out, 1, device=device) * 1e-3})
    if codec == "mxfp4":
        return QWeight(codec, shape, 32, {
            "weight_packed": torch.randint(0, 256, (out, n // 2), dtype=torch.uint8, device=device),
            "weight_scale": torch.randint(118, 124, (out, n // 32), dtype=torch.uint8, device=device)})
    return QWeight(codec, shape, group, {
        "weight_packed": torch.randint(0, 256, (out, intq.packed_width(codec, n)), dtype=torch.uint8,
                                       device=device),
        "weight_scale": (torch.rand(out, n // group, device=device) * 1e-3).half()})


def _cuda_time(fn, calls: int, reps: int) -> float:
    """Seconds per call of fn(i), replaying a CUDA graph of `calls` calls; events if capture fails."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        run = graph.replay
    except RuntimeError:
        torch.cuda.synchronize()

        def run() -> None:
            for i in range(calls):
                fn(i)
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * calls)


def _eager_time(fn, iters: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for i in range(iters):
        fn(i)
    sync()
    return (time.perf_counter() - t0) / iters


def memory_bandwidth(device: str, nbytes: int, iters: int) -> tuple[float, float]:
    """GB/s of (a device-to-device copy, counting bytes read plus written; a sum, bytes read)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    out = torch.empty((), dtype=torch.float32, device=device)

    def timer(fn) -> float:
        if device.startswith("cuda"):
            return _cuda_time(fn, 1, iters)
        return _eager_time(fn, iters, lambda: None)

    copy = timer(lambda i: dst.copy_(src))
    read = timer(lambda i: torch.sum(src, dim=0, out=out))
    return 2 * nbytes / copy / 1e9, nbytes / read / 1e9


def bench_one(codec: str, shape: tuple[int, int], rows: int, dtype: torch.dtype, device: str,
              group: int, iters: int, warmup: int) -> dict:
    cuda = device.startswith("cuda")
    q0 = random_qweight(codec, shape, group, device)
    copies = max(1, min(64, math.ceil(4 * L2_BYTES / q0.nbytes))) if cuda else 1
    weights = [q0] + [random_qweight(codec, shape, group, device) for _ in range(copies - 1)]
    x = torch.randn(rows, shape[1], device=device).to(dtype)
    rec = {"name": None, "shape": list(shape), "codec": codec, "group": q0.group_size, "rows": rows,
           "dtype": str(dtype).removeprefix("torch."), "weight_bytes": q0.nbytes, "copies": copies}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    modes: list[tuple[str, bool | str]] = [("torch", False)]
    if cuda and codec != "bf16":
        from deltafin.kernels import triton_kernels
        modes.insert(0, ("triton", True))
        if rows <= triton_kernels.GEMV_MAX_ROWS:
            # Both kernels on the same input: the figures behind triton_kernels.GEMV_CODECS.
            modes[1:1] = [("triton_gemv", "gemv"), ("triton_dot", "dot")]
    for label, use_triton in modes:
        def call(i: int) -> torch.Tensor:
            q = weights[i % copies]
            if isinstance(use_triton, str):
                return triton_kernels.qlinear_triton(x, q.codec, q.tensors, q.group_size, method=use_triton)
            return qlinear(x, q, use_triton=use_triton)
        for i in range(warmup):
            call(i)  # the first Triton call autotunes for this shape
        if cuda:
            sec = _cuda_time(call, calls=max(copies, 8), reps=max(1, iters // max(copies, 8)))
            rec[f"{label}_eager_us"] = round(_eager_time(call, max(3, iters // 10), sync) * 1e6, 1)
        else:
            sec = _eager_time(call, iters, sync)
        rec[f"{label}_us"] = round(sec * 1e6, 2)
        rec[f"{label}_gbps"] = round(q0.nbytes / sec / 1e9, 3)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="1", help="comma-separated row counts of x (decode: 1)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--codecs", default=",".join(TOOL_CODECS), help="subset of codecs to run")
    ap.add_argument("--shapes", default="", help="OUTxIN,... instead of the K3 shapes (all codecs each)")
    ap.add_argument("--group", type=int, default=32, help="group size for int4/int6 and int8g")
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default: 100 cuda, 2 cpu)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 3 cuda, 1 cpu)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    iters = args.iters or (100 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    wanted = set(args.codecs.split(","))
    if args.shapes:
        shapes = [(s, tuple(int(v) for v in s.lower().split("x")), TOOL_CODECS) for s in args.shapes.split(",")]
    else:
        shapes = K3_SHAPES
    dtype = getattr(torch, args.dtype)

    results = []
    for name, shape, codecs in shapes:
        for codec in codecs:
            if codec not in wanted:
                continue
            for rows in (int(r) for r in args.rows.split(",")):
                try:
                    rec = bench_one(codec, shape, rows, dtype, args.device, args.group, iters, warmup)
                except Exception as e:  # keep the other measurements; the record says what failed
                    rec = {"shape": list(shape), "codec": codec, "rows": rows, "error": repr(e)}
                rec["name"] = name
                results.append(rec)
                print(f"# {name} {codec} rows={rows}: " + ", ".join(
                    f"{k}={rec[k]}" for k in ("triton_gbps", "torch_gbps", "error") if k in rec), file=sys.stderr)
    copy_bytes = (1 << 30) if cuda else (256 << 20)
    copy_gbps, read_gbps = memory_bandwidth(args.device, copy_bytes, 20 if cuda else 3)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    summary = {
        "bench": "kernels", "device": torch.cuda.get_device_name(args.device) if cuda else platform.processor()
        or platform.machine(), "torch": torch.__version__, "triton": triton_version, "dtype": args.dtype,
        "copy_gbps_read_plus_write": round(copy_gbps, 1), "sum_gbps_read": round(read_gbps, 1),
        "bandwidth_bytes": copy_bytes,
        "timing": "cuda graph replay, weights rotated past L2" if cuda else "wall clock",
        "iters": iters, "results": results,
    }
    print(json.dumps(summary))
    print(f"\ndevice: {summary['device']}  copy (read+write): {copy_gbps:.0f} GB/s  sum (read): {read_gbps:.0f} GB/s"
          f"  x dtype: {args.dtype}")
    head = f"{'weight':<14}{'shape':>13} {'codec':<6}{'rows':>5}{'MB':>8}{'triton GB/s':>13}{'us':>9}" \
           f"{'% read':>8}{'gemv GB/s':>10}{'dot GB/s':>10}{'torch GB/s':>12}{'us':>10}"
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r:
            print(f"{r['name']:<14}{'x'.join(map(str, r['shape'])):>13} {r['codec']:<6}{r['rows']:>5}  "
                  f"failed: {r['error']}")
            continue
        tg = r.get("triton_gbps")
        print(f"{r['name']:<14}{'x'.join(map(str, r['shape'])):>13} {r['codec']:<6}{r['rows']:>5}"
              f"{r['weight_bytes'] / 1e6:>8.1f}"
              f"{(f'{tg:.0f}' if tg else '-'):>13}{(str(r['triton_us']) if tg else '-'):>9}"
              f"{(f'{100 * tg / read_gbps:.0f}' if tg else '-'):>8}"
              f"{(str(round(r['triton_gemv_gbps'])) if 'triton_gemv_gbps' in r else '-'):>10}"
              f"{(str(round(r['triton_dot_gbps'])) if 'triton_dot_gbps' in r else '-'):>10}"
              f"{r['torch_gbps']:>12.2f}{r['torch_us']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
