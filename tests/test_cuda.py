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


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_batch_of_8_greedy_tokens_equal_each_alone(request, fixture):
    """fp32, resident: 8 sequences decoded together (their decode passes replay one recorded graph)
    give each the 32 greedy tokens it gets alone by plain passes on the device, which begin as the CPU
    reference's (random tiny models have near ties that the two devices' rounding may split later)."""
    from deltafin.runtime.generate import Decoding
    from deltafin.runtime.sampling import SamplingParams
    path = request.getfixturevalue(fixture)
    prompts = [torch.randint(5, 500, (3 + k,), generator=torch.Generator().manual_seed(k)).tolist() for k in range(8)]
    params = SamplingParams(max_new_tokens=32, speculate=False)
    cpu = deltafin.load(path, device="cpu", stream="off", dtype="float32")
    want = [cpu.generate(p, params) for p in prompts]
    gpu = deltafin.load(path, device="cuda", stream="off", dtype="float32")
    runs = [Decoding(gpu, p, params) for p in prompts]
    while not all(d.done for d in runs):
        going = [d for d in runs if not d.done]
        for d, logits in zip(going, gpu.forward_batch([d.next_pass() for d in going])):
            d.take(logits)
    got = [d.result().tokens for d in runs]
    plain = deltafin.load(path, device="cuda", stream="off", dtype="float32", cuda_graphs=False)
    assert got == [plain.generate(p, params) for p in prompts]
    assert all(g[:4] == w[:4] for g, w in zip(got, want))
    assert gpu.graph_stats()["replayed_by_kind"]["decode"] > 0
