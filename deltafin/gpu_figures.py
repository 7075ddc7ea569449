"""What ``bench`` adds for a model resident on a CUDA device: how much of the matrix units a prompt
used (``prefill_mfu``) and how many kernels each kind of pass launches per layer.

``prefill_mfu`` is the prompt's useful FLOPs per second over the bf16 matrix peak measured now (one
large bf16 GEMM, ``bench.measure_matmul_peak``): every product with a weight a token touches (2 x
the active parameters: the spine but the embedding lookup, and ``experts_per_token`` experts per MoE
layer), MLA's causal attention
(scores and values, 2 x heads x (qk + v head dims) x T^2 / 2 over a T-token prompt) and the KDA
recurrence (three products with each head's S per token). Work a kernel does beyond that (padding,
recomputation) does not count.

Launches are counted by the profiler over whole passes: kernel launches by the host (a replayed
graph is one) and kernels the device ran, each divided by the layers.
"""
from __future__ import annotations

from collections.abc import Callable

# Host calls that start work on the device (runtime and driver API; Triton launches by the driver).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def prefill_flops(cfg, active_params: int, tokens: int) -> float:
    """Useful FLOPs of a T-token prompt of a fresh sequence (see the module docstring)."""
    mla = len(cfg.mla_layers) * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                      + cfg.v_head_dim) * tokens * tokens
    kda = len(cfg.kda_layers) * 6 * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * tokens
    return 2.0 * active_params * tokens + mla + kda


def count_launches(work: Callable[[], object]) -> dict:
    """Kernel launches by the host and kernels run on the device while `work()` runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    launches = kernels = 0
    # The profiler's raw records: its event tree (``prof.events()``) took minutes to build for the
    # passes of 32 or more sequences, and a count needs no tree.
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if name in LAUNCH_CALLS:
            launches += 1
        elif event.device_type() == torch.autograd.DeviceType.CUDA and not name.startswith("Memcpy") \
                and not name.startswith("Memset"):
            kernels += 1
    return {"launches": launches, "kernels": kernels}
