"""The engine on a CUDA device (skipped where there is none): same answers as on the CPU."""
from __future__ import annotations

import pytest
import torch

import deltafin
from deltafin.checkpoint.sizes import ModelSizes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_logits_match_cpu(request, fixture):
    path = request.getfixturevalue(fixture)
    ids = torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = deltafin.load(path, device="cpu", stream="off").logits(ids)
    gpu_model = deltafin.load(path, device="cuda", stream="off")
    gpu = gpu_model.logits(ids)
    assert gpu.device.type == "cpu"  # logits come back to the host
    assert (gpu - cpu).abs().max().item() <= 1e-3
    # Streamed through a budget that holds the first spine only (the per-expert path instead of the
    # grouped one): the CPU's answer too.
    sizes = ModelSizes.of(gpu_model.source)
    budget = (sizes.globals_bytes + sizes.spine_bytes[0]) / 1e9
    streamed_model = deltafin.load(path, device="cuda", stream="on", gpu_budget=str(budget))
    assert streamed_model.streaming
    assert (streamed_model.logits(ids) - cpu).abs().max().item() <= 1e-3


def test_cuda_greedy_generation_matches_cpu(tiny_k3_path):
    prompt = [7, 93, 41, 250, 12, 77]
    cpu = deltafin.load(tiny_k3_path, device="cpu", stream="off").generate(prompt, max_new_tokens=12, speculate=False)
    gpu = deltafin.load(tiny_k3_path, device="cuda", stream="on")
    assert gpu.generate(prompt, max_new_tokens=12) == gpu.generate(prompt, max_new_tokens=12, speculate=False)
    assert len(cpu) == 12 and gpu.generate(prompt, max_new_tokens=12, speculate=False)[:4] == cpu[:4]
