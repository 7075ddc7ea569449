"""Time one MXFP4 MoE layer's routed experts on a CUDA device, path by path, at several token counts.

    python tools/moe_layer_bench.py [--experts 32] [--top-k 16] [--hidden 3584] [--inter 3072]
                                    [--tokens 1,2,4,8,16,32,128] [--rows 8,16]
                                    [--tile-configs BN:BK:WARPS:STAGES,...] [--pair-configs BN:G:WARPS:STAGES,...]
                                    [--out FILE.json]

Random MXFP4 codes and scales (K3's expert shapes by default), uniform routing, SiTU. Each path's work
for one layer (the pairs' sort and tile layout included) is recorded as a CUDA graph of 20 repeats and
replayed three times; the best replay, in microseconds per layer, is reported with its largest relative
difference from the pair kernels:
  pairs    the pair kernels (``grouped_triton.mxfp4_gate_up`` / ``mxfp4_down``: one program per pair)
  tiles    the sorted tiles at the rows ``MXFP4Stack.sorted_tile_rows`` picks for the layer
  tilesN   the sorted tiles of N rows, for each N of --rows
  tiles@BN:BK:WARPS:STAGES   the sorted tiles at the rule's rows with that fixed kernel configuration
           instead of the tuner's, for each of --tile-configs
  pairs@BN:G:WARPS:STAGES    the pair kernels (both) with that fixed configuration, for each of --pair-configs
  tuned    the configurations the tuner chose for the pair kernels and the tiles' two kernels
  floor    the chosen experts' bytes at the device's copy rate (what no path can beat)
Prints one JSON record (and writes it to --out).
"""
from __future__ import annotations

import argparse
import json

import torch

from deltafin.bench import measure_device_copy
from deltafin.kernels import grouped


def _graph_us(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / repeats)
    return best


def _ints(text: str, least: int = 1, powers_of_two: bool = False) -> list[int]:
    """A comma-separated list of whole numbers >= least (powers of two if asked), for argparse."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    for v in values:
        if v < least or (powers_of_two and v & (v - 1)):
            raise argparse.ArgumentTypeError(f"{v}: want {'powers of two ' if powers_of_two else ''}>= {least}")
    return values


def _configs(second: str, least: int, least_bn: int):
    """A parser for BN:<second>:WARPS:STAGES,... -> fixed launch configurations, for argparse: BN, the second
    value and WARPS powers of two (BN >= least_bn, the second >= `least`, WARPS <= 16), STAGES >= 1."""
    def parse(text: str) -> list[dict]:
        configs = []
        for item in (t for t in text.split(",") if t.strip()):
            try:
                bn, other, warps, stages = (int(v) for v in item.split(":"))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: want BN:{second}:WARPS:STAGES, four whole "
                                                 "numbers") from None
            if not (bn >= least_bn and other >= least and 1 <= warps <= 16 and stages >= 1
                    and not any(v & (v - 1) for v in (bn, other, warps))):
                raise argparse.ArgumentTypeError(f"{item}: want BN >= {least_bn}, {second} >= {least}, WARPS <= 16 "
                                                 "(powers of two), STAGES >= 1")
            configs.append({"BN": bn, second: other, "num_warps": warps, "num_stages": stages})
        return configs
    return parse


_tile_configs = _configs("BK", 32, 16)  # BK: whole MXFP4 groups; BN: the tensor cores' M side
_pair_configs = _configs("G", 1, 1)  # G: MXFP4 groups of 32 inputs a step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--hidden", type=int, default=3584, help="a multiple of 32 (MXFP4 groups)")
    p.add_argument("--inter", type=int, default=3072, help="a multiple of 32 (MXFP4 groups)")
    p.add_argument("--tokens", type=_ints, default=[1, 2, 4, 8, 16, 32, 128])
    p.add_argument("--rows", type=lambda t: _ints(t, 4, powers_of_two=True), default=[],
                   help="tile sizes to time besides the rule's (powers of two, from 4)")
    p.add_argument("--tile-configs", type=_tile_configs, default=[],
                   help="fixed configurations of the sorted tiles to time besides the tuner's choice")
    p.add_argument("--pair-configs", type=_pair_configs, default=[],
                   help="fixed configurations of the pair kernels (both of them) to time besides the tuner's choice")
    p.add_argument("--out")
    args = p.parse_args()
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k {args.top_k}: want 1 .. --experts ({args.experts})")
    for name in ("hidden", "inter"):
        if getattr(args, name) < 32 or getattr(args, name) % 32:
            p.error(f"--{name} {getattr(args, name)}: want a positive multiple of 32")
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer_bench: needs a CUDA device")
    try:
        from deltafin.kernels import grouped_triton
    except ImportError:
        raise SystemExit("moe_layer_bench: needs Triton (pip install triton)") from None
    E, K, H, I = args.experts, args.top_k, args.hidden, args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    codes = (torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=gen),
             torch.randint(118, 127, (E, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=gen),
             torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=gen),
             torch.randint(118, 127, (E, H, I // 32), dtype=torch.uint8, device="cuda", generator=gen))
    stack = grouped.MXFP4Stack(*codes)
    cfg = type("C", (), {"hidden_act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0})()
    expert_bytes = stack.nbytes / E
    gbps = measure_device_copy(torch.device("cuda"))  # GB/s read + written
    record = {"experts": E, "top_k": K, "hidden": H, "inter": I, "copy_gbps": round(gbps, 1), "layers": {}}
    for T in args.tokens:
        x = torch.randn(T, H, device="cuda", generator=gen)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(T)]).to(torch.int32)
        flat = ids.reshape(-1)

        def tiles(rows, config=None):
            def run():
                by, order = flat.sort(stable=True)
                ends = torch.searchsorted(by, torch.arange(E, device="cuda"), right=True).to(torch.int32)
                return grouped_triton.sorted_mxfp4_mlp(x, order.to(torch.int32), ends,
                                                       grouped.sorted_tiles(ends, flat.numel(), rows), rows, K,
                                                       *codes, cfg, config=config)
            return run

        rule = stack.sorted_tile_rows(flat.numel())
        def pairs(config=None):
            return lambda: grouped_triton.mxfp4_down(grouped_triton.mxfp4_gate_up(x, flat, K, *codes[:2], cfg,
                                                                                   config=config),
                                                     flat, *codes[2:], config=config)

        paths = {"pairs": pairs(), "tiles": tiles(rule)}
        paths.update({"pairs@{BN}:{G}:{num_warps}:{num_stages}".format(**c): pairs(c) for c in args.pair_configs})
        paths.update({f"tiles{r}": tiles(r) for r in args.rows if r != rule})
        paths.update({"tiles@{BN}:{BK}:{num_warps}:{num_stages}".format(**c): tiles(rule, c) for c in args.tile_configs})
        ref = paths["pairs"]()
        chosen = flat.unique().numel()
        row = {"pairs_per_expert": flat.numel() / E, "rule_rows": rule, "takes_sorted": stack.takes_sorted(flat.numel()),
               "floor_us": round(chosen * expert_bytes / gbps / 1e3, 1)}
        for name, fn in paths.items():
            diff = ((fn() - ref).abs().max() / ref.abs().max()).item()
            row[name] = {"us": round(_graph_us(fn), 1), "rel_diff": diff}
        paths["tiles"]()  # the tuner's choice for the rule's rows, last tuned for this shape
        row["tuned"] = {name: str(getattr(kernel, "best_config", None)) for name, kernel in
                        (("pair_gate_up", grouped_triton._mxfp4_gate_up_tuned),
                         ("pair_down", grouped_triton._mxfp4_down_tuned),
                         ("gate_up", grouped_triton._tile_gate_up_tuned), ("down", grouped_triton._tile_down_tuned))}
        record["layers"][T] = row
        print(T, json.dumps(row), flush=True)
    text = json.dumps(record, indent=1)
    if args.out:
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
