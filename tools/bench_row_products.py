"""Microseconds a launch of the bf16-weight products of a few rows, by kernel (CUDA only).

For each weight shape and row count: the one-row kernel (``one_row``), the tensor-core rows kernel
unrounded and rounded (``tensor_cores``, ``tensor_cores_rounded``: float_gemv / half_gemv with
``rows_config``) and the CUDA-core kernel (``cuda_cores``: float_gemv with ``fma_config``), each timed
replaying a CUDA graph of many launches over eight copies of the weight, and the CUDA-core kernel's
largest error against the float64 product, relative to the sum of the terms' magnitudes. One JSON line
per shape. What ``half_gemv_triton.FMA_MAX_OUT`` was chosen from (docs/benchmarks.md, "A CUDA-core
kernel for a few rows").

    python tools/bench_row_products.py
    python tools/bench_row_products.py --shapes 512x512,2304x2304 --rows 2,8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _cuda_time  # noqa: E402

SHAPES = "512x512,1536x512,2304x512,4096x512,512x1536,1024x2304,2304x1024,2304x2304,4096x2304"
COPIES = 8  # weights the launches rotate over


def _us(fn) -> float:
    return round(_cuda_time(fn, calls=40, reps=20) * 1e6, 2)


def measure(N: int, K: int, rows: list[int]) -> dict:
    from deltafin.kernels import half_gemv_triton as hg
    ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(COPIES)]
    one = torch.randn(1, K, device="cuda")
    rec = {"N": N, "K": K, "one_row": _us(lambda i: hg.float_gemv(one, ws[i % COPIES]))}
    for M in rows:
        x = torch.randn(M, K, device="cuda")
        tc, fma = hg.rows_config(N), hg.fma_config(M, K)
        want = x.double() @ ws[0].double().T
        error = (hg.float_gemv(x, ws[0], fma).double() - want).abs() / (x.double().abs() @ ws[0].double().abs().T)
        rec[M] = {"tensor_cores": _us(lambda i: hg.float_gemv(x, ws[i % COPIES], tc)),
                  "tensor_cores_rounded": _us(lambda i: hg.half_gemv(x, ws[i % COPIES], tc)),
                  "cuda_cores": _us(lambda i: hg.float_gemv(x, ws[i % COPIES], fma)),
                  "cuda_cores_error": float(f"{error.max().item():.2g}")}
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated NxK weight shapes (outputs x inputs)")
    ap.add_argument("--rows", default="2,4,8", help="comma-separated row counts, 2 to FMA_MAX_ROWS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_row_products: needs a CUDA device", file=sys.stderr)
        return 2
    from deltafin.kernels import half_gemv_triton as hg
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error("--shapes takes NxK[,NxK...] and --rows integers")
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or any(not 2 <= r <= hg.FMA_MAX_ROWS for r in rows):
        ap.error(f"shapes are NxK with N, K >= 1; rows from 2 to {hg.FMA_MAX_ROWS}")
    torch.manual_seed(0)
    for N, K in shapes:
        print(json.dumps(measure(N, K, rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
