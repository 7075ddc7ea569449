"""Compare deltafin on a CUDA device with transformers' generate() and with deltafin's CPU reference.

    python tools/gpu_compare.py MODEL --tokens 32 [--hf] [--cpu-check] [--launches] [--out FILE.json]

--hf          transformers' KimiLinearForCausalLM, bf16, on the same GPU: greedy generate() of
              --tokens tokens after a random prompt (decode tok/s from two timed lengths, so the
              prompt's cost cancels)
--cpu-check   deltafin float32 on the GPU against deltafin float32 on the CPU (the reference):
              the greedy tokens of both, and whether they are identical
--launches    CUDA kernels and host launch calls per layer in one resident bf16 decode pass
              (torch.profiler), launched kernel by kernel and replayed as the recorded decode graph
Prints one JSON record (and writes it to --out).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

import deltafin


def _prompt(vocab: int, n: int = 64, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def hf_decode_tok_s(path: str, tokens: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([_prompt(model.config.vocab_size)], device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    run(4)  # warm-up
    short, long = run(2), run(2 + tokens)
    del model
    torch.cuda.empty_cache()
    return {"hf_decode_tok_s": tokens / (long - short), "hf_seconds": [short, long]}


def cpu_check(path: str, tokens: int) -> dict:
    prompt = _prompt(deltafin.load(path, device="cpu", stream="off").config.vocab_size, 16)
    out = {}
    for dev in ("cuda", "cpu"):
        m = deltafin.load(path, device=dev, stream="off", dtype="float32")
        out[dev] = m.generate(prompt, max_new_tokens=tokens, speculate=False)
        del m
    return {"fp32_tokens_cuda": out["cuda"], "fp32_tokens_cpu": out["cpu"],
            "fp32_tokens_identical": out["cuda"] == out["cpu"]}


# Host-side calls that put work on the GPU (kernel launches, and a graph's one launch).
HOST_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _profile_pass(m, state, token: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        m.forward([token], state)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in HOST_LAUNCHES]
    top: dict = {}
    for e in kernels:
        n, us = top.get(e.name[:90], (0, 0.0))
        top[e.name[:90]] = (n + 1, us + e.time_range.elapsed_us())
    L = m.config.num_layers
    return {"kernels_per_pass": len(kernels), "kernels_per_layer": len(kernels) / L,
            "kernel_us_per_pass": sum(e.time_range.elapsed_us() for e in kernels),
            "host_launches_per_pass": len(host), "host_launches_per_layer": len(host) / L,
            "top_kernels_by_time": [(k, n, round(us, 1)) for k, (n, us) in
                                    sorted(top.items(), key=lambda kv: -kv[1][1])[:15]]}


def launches(path: str, tokens: int = 64) -> dict:
    """Kernels and host launch calls of one resident bf16 decode pass (torch.profiler): launched
    kernel by kernel, and replayed as the recorded decode graph."""
    out = {}
    for name, graphs in (("eager", False), ("graph", True)):
        m = deltafin.load(path, device="cuda", stream="off", dtype="bfloat16", cuda_graphs=graphs)
        state = m.new_state()
        m.forward(_prompt(m.config.vocab_size, 8), state)
        m.forward([5], state)  # with graphs: the pass that records
        m.forward([6], state)
        out[name] = _profile_pass(m, state, 7)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in range(tokens):  # plain forward() calls: the pass itself, no sampling
            m.forward([8 + t], state)
        out[name]["pass_ms"] = (time.perf_counter() - t0) / tokens * 1e3
        if graphs:
            out[name]["replayed"] = (m.graph_stats() or {}).get("replayed", 0)
        del m, state
        torch.cuda.empty_cache()
    return {"launches": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--launches", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    rec: dict = {"model": a.model, "device": torch.cuda.get_device_name()}
    if a.launches:
        rec.update(launches(a.model))
    if a.hf:
        rec.update(hf_decode_tok_s(a.model, a.tokens))
    if a.cpu_check:
        rec.update(cpu_check(a.model, a.tokens))
    text = json.dumps(rec, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
