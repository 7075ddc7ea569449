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


def _decoded_logits(model, ids, prompt: int = 6):
    """Logits of a prompt pass, then of one token per pass (decode passes), with each pass's stats."""
    eng = model.engine
    state = eng.new_state()
    out, stats = [eng.forward(ids[:prompt], state).float().cpu()], []
    for t in ids[prompt:]:
        out.append(eng.forward([t], state).float().cpu())
        stats.append(eng.last_pass)
    return torch.cat(out), stats


def test_cuda_resident_model_feeds_the_device_from_one_host_thread(tiny_k3_path, monkeypatch):
    import os

    from deltafin.runtime import engine
    from deltafin.startup import threads_message
    gathers = []
    real = engine.torch_threads

    def spy(n):
        gathers.append(n)
        return real(n)

    monkeypatch.setattr(engine, "torch_threads", spy)
    monkeypatch.setattr(engine, "GATHER_SHARED_ROWS", 32)
    ids = torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        cpu = deltafin.load(tiny_k3_path, device="cpu", stream="off").logits(ids)
        m = deltafin.load(tiny_k3_path, device="cuda", stream="off", threads=0)
        assert m.threads == 1 and torch.get_num_threads() == 1
        cores = os.cpu_count() or 1
        assert threads_message(m) == (f"1 compute thread (auto, the device holds the whole model: the host only "
                                      f"feeds it; {cores} for a long prompt's embedding rows)")
        assert (m.logits(ids) - cpu).abs().max().item() <= 1e-3
        # a pass of at least GATHER_SHARED_ROWS rows: its rows gathered on every core, the run's one after
        gathers.clear()
        rows = m.engine.embed(torch.tensor(ids))
        assert gathers == [cores] and torch.get_num_threads() == 1
        assert torch.equal(rows.cpu(), m.engine.provider.globals()["embed"][torch.tensor(ids)].float())
        # streamed through the host, or threads set: as on the CPU
        sizes = ModelSizes.of(m.source)
        budget = (sizes.globals_bytes + sizes.spine_bytes[0]) / 1e9
        streamed = deltafin.load(tiny_k3_path, device="cuda", stream="on", gpu_budget=str(budget), threads=0)
        assert streamed.threads == max(1, cores - 1)
        assert deltafin.load(tiny_k3_path, device="cuda", stream="off", threads=3).engine.gather_threads is None
    finally:
        torch.set_num_threads(1)  # process-wide; the other tests run with one


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_spines_from_ram_are_copied_ahead(request, fixture):
    """The device holds the first spine only, the host-RAM cache the others: once cached, each
    streamed spine crosses to the device while the layer before it runs (copied ahead), and the
    logits are the CPU's."""
    path = request.getfixturevalue(fixture)
    ids = torch.randint(5, 500, (14,), generator=torch.Generator().manual_seed(4)).tolist()
    want, _ = _decoded_logits(deltafin.load(path, device="cpu", stream="off"), ids)
    sizes = ModelSizes.of(deltafin.load(path, device="cpu", stream="off").source)
    budget = (sizes.globals_bytes + sizes.spine_bytes[0]) / 1e9
    m = deltafin.load(path, device="cuda", stream="on", gpu_budget=str(budget), ram_budget="auto")
    got, _ = _decoded_logits(m, ids)
    assert (got - want).abs().max().item() <= 1e-3
    before = m.residency_now()["spines_copied_ahead"]
    m.engine.forward([ids[0]], m.engine.new_state())
    assert m.residency_now()["spines_copied_ahead"] - before == len(sizes.spine_bytes) - 1  # all but the held one


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
@pytest.mark.parametrize("cpu_experts", ["on", "off", "auto"])
def test_cuda_over_host_ram_cache_with_host_experts_matches_cpu(request, fixture, cpu_experts):
    """The device holds every spine and two experts per layer, the pinned host-RAM cache the rest;
    decode passes compute the host's experts on its cores (on), copy them (off), or as measured (auto):
    the CPU's logits every way, and the bytes say where each expert went."""
    path = request.getfixturevalue(fixture)
    ids = torch.randint(5, 500, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    want, _ = _decoded_logits(deltafin.load(path, device="cpu", stream="off"), ids)
    sizes = ModelSizes.of(deltafin.load(path, device="cpu", stream="off").source)
    budget = (sizes.globals_bytes + sum(sizes.spine_bytes) + 2 * sum(sizes.expert_bytes)) / 1e9
    m = deltafin.load(path, device="cuda", stream="on", gpu_budget=str(budget), ram_budget="auto",
                      cpu_experts=cpu_experts)
    got, stats = _decoded_logits(m, ids)
    assert (got - want).abs().max().item() <= 1e-3
    host = sum(s.bytes_host_compute for s in stats)
    assert sum(s.bytes_on_device for s in stats) > 0 and sum(s.bytes_from_ram for s in stats) > 0
    assert (host > 0) if cpu_experts == "on" else (host == 0) if cpu_experts == "off" else True
    res = m.residency_now()
    assert res["pinned_host_buffers"] > 0 and res["host"]["cache"]["experts_held"] > 0
    if cpu_experts == "auto":
        assert res["host_choices"]  # measured, per layer


def test_cuda_kda_prompt_matches_reference():
    """A long prompt piece's recurrence on the device (flash-linear-attention's chunked kernel where it
    is installed, else deltafin's chunked form) against the chunked form in float64 on the CPU."""
    from deltafin.model.kda_recurrence import kda_chunked, kda_prompt
    from deltafin.model.ops import l2_normalize
    gen = torch.Generator().manual_seed(6)
    T, H, d = 300, 4, 64
    q = l2_normalize(torch.randn(T, H, d, generator=gen)) * d ** -0.5
    k = l2_normalize(torch.randn(T, H, d, generator=gen))
    v, g = torch.randn(T, H, d, generator=gen), -torch.rand(T, H, d, generator=gen) * 0.5
    beta, S0 = torch.sigmoid(torch.randn(T, H, generator=gen)), torch.randn(H, d, d, generator=gen) * 0.1
    o_ref, S_ref = kda_chunked(*(t.double() for t in (q, k, v, g, beta, S0)))
    o, S = kda_prompt(*(t.cuda() for t in (q, k, v, g, beta, S0)))
    assert o.dtype == S.dtype == torch.float32 and o.shape == (T, H, d) and S.shape == (H, d, d)
    assert (o.cpu().double() - o_ref).abs().max().item() < 2e-3 * o_ref.abs().max().item()
    assert (S.cpu().double() - S_ref).abs().max().item() < 2e-3 * S_ref.abs().max().item()


def test_cuda_kda_prompt_piece_in_the_fused_kernels_matches_the_reference():
    """A prompt piece's conv (from and to its tail), normalizations, decay, beta and chunked recurrence in
    flash-linear-attention's kernels (kda_prompt_fused) against deltafin's conv and formulas in float64
    on the CPU, with and without K3's lower-bounded gate."""
    pytest.importorskip("fla")
    import torch.nn.functional as F
    from deltafin.model.kda import causal_conv
    from deltafin.model.kda_recurrence import fused_prompt_available, kda_chunked, kda_prompt_fused
    from deltafin.model.ops import l2_normalize
    assert fused_prompt_available()
    gen = torch.Generator().manual_seed(8)
    n, H, d, K = 300, 4, 64, 4
    D = H * d
    xin, tail = torch.randn(3, n, D, generator=gen), torch.randn(3, K - 1, D, generator=gen)
    w = torch.randn(3, D, K, generator=gen) * 0.3
    g, beta = torch.randn(1, n, H, d, generator=gen), torch.randn(1, n, H, generator=gen)
    S0, a_log, dt_bias = (torch.randn(H, d, d, generator=gen) * 0.1, torch.randn(H, generator=gen) * 0.3,
                          torch.randn(D, generator=gen) * 0.3)
    for lower_bound in (None, -5.0):
        o, S, new_tail = kda_prompt_fused(*(t.cuda() for t in (xin, tail, w, g, beta, S0)), a_log=a_log.cuda(),
                                          dt_bias=dt_bias.cuda(), lower_bound=lower_bound, scale=d ** -0.5)
        x64 = F.silu(causal_conv(xin[None].double(), tail[None].double(), w.double()))[0]
        q, k, v = (t.view(n, H, d) for t in x64)
        r = g[0].double() + dt_bias.double().view(H, d)
        a = torch.exp(a_log.double()).view(1, H, 1)
        decay = lower_bound * torch.sigmoid(a * r) if lower_bound is not None else -a * F.softplus(r)
        o_ref, S_ref = kda_chunked(l2_normalize(q) * d ** -0.5, l2_normalize(k), v, decay,
                                   torch.sigmoid(beta[0].double()), S0.double())
        assert o.shape == (1, n, H, d) and S.shape == (H, d, d) and new_tail.shape == tail.shape
        assert (o[0].cpu().double() - o_ref).abs().max().item() < 2e-3 * o_ref.abs().max().item()
        assert (S.cpu().double() - S_ref).abs().max().item() < 2e-3 * S_ref.abs().max().item()
        assert torch.equal(new_tail.cpu(), xin[:, -(K - 1):])


def test_cuda_kda_decode_steps_in_the_fused_kernel_match_the_reference():
    """B sequences' decode steps in flash-linear-attention's fused recurrent kernel (which normalizes,
    scales, gates and steps S in place) against deltafin's formulas in float64 on the CPU, with and
    without K3's lower-bounded gate."""
    pytest.importorskip("fla")
    import torch.nn.functional as F
    from deltafin.model.kda_recurrence import kda_decode_fused, kda_recurrent
    from deltafin.model.ops import l2_normalize
    gen = torch.Generator().manual_seed(7)
    B, n, H, d = 3, 2, 4, 64
    q, k, v, r = (torch.randn(B, n, H, d, generator=gen) for _ in range(4))
    b, S0 = torch.randn(B, n, H, generator=gen), torch.randn(B, H, d, d, generator=gen) * 0.1
    a_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * d, generator=gen) * 0.5
    for lower_bound in (None, -5.0):
        x = r.double() + dt_bias.double().view(H, d)
        a = torch.exp(a_log.double()).view(H, 1)
        g = lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * F.softplus(x)
        o_ref, S_ref = kda_recurrent(*(t.transpose(0, 1) for t in (
            l2_normalize(q.double()) * d ** -0.5, l2_normalize(k.double()), v.double(), g, torch.sigmoid(b.double()))),
            S0.double())
        S = S0.cuda()
        o = kda_decode_fused(*(t.cuda() for t in (q, k, v, r, b)), S, a_log=a_log.cuda(), dt_bias=dt_bias.cuda(),
                             lower_bound=lower_bound, scale=d ** -0.5)
        o_ref = o_ref.transpose(0, 1)
        assert o.shape == (B, n, H, d) and o.dtype == torch.float32
        assert (o.cpu().double() - o_ref).abs().max().item() < 1e-4 * o_ref.abs().max().item()
        assert (S.cpu().double() - S_ref).abs().max().item() < 1e-4 * S_ref.abs().max().item()  # in place


def _bf16_passes(path, singles: int, batched: int) -> torch.Tensor:
    """A bf16 model's logits on CUDA over decode passes: `singles` passes of one sequence, `batched` of two
    together, a draft check that keeps one row of three, its rollback and one more pass."""
    from deltafin.runtime.engine import Seq
    m = deltafin.load(path, device="cuda", stream="off", dtype="bfloat16")
    a, b = m.new_state(), m.new_state()
    m.forward([5, 6, 7, 8], a), m.forward([9, 10], b)
    rows = [m.forward([20 + t], a) for t in range(singles)]
    rows += [torch.cat(m.forward_batch([Seq([11 + t], a), Seq([30 + t], b)])) for t in range(batched)]
    rows.append(m.forward([40, 41, 42], a, keep_states=True))
    a.rollback(a.num_tokens - 2)
    rows.append(m.forward([43], a))
    return torch.cat(rows).float()


def _same_with_and_without(paths, monkeypatch, without, singles: int, batched: int) -> None:
    """For each checkpoint, `_bf16_passes` as deltafin runs them and with `without(mp)` applied (a
    monkeypatch context that switches a path off): equal to bf16 rounding."""
    for path in paths:
        out = {}
        for take in (True, False):
            with monkeypatch.context() as mp:
                if not take:
                    without(mp)
                out[take] = _bf16_passes(path, singles, batched)
        assert torch.isfinite(out[True]).all()
        assert (out[True] - out[False]).abs().max().item() < 2e-2 * out[False].abs().max().item()


def test_cuda_bf16_decode_takes_the_fused_kda_kernel(tiny_k3_path, tiny_kl_path, monkeypatch):
    """With bf16 products and flash-linear-attention installed, batched decode passes (graphs and
    eager) and draft checks step KDA in the fused kernel; their logits, and a check pass's rollback,
    stay those of deltafin's own steps to bf16 rounding."""
    pytest.importorskip("fla")
    import deltafin.model.kda as kda
    calls = []
    real = kda.kda_decode_fused
    monkeypatch.setattr(kda, "kda_decode_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    _same_with_and_without((tiny_k3_path, tiny_kl_path), monkeypatch,
                           lambda mp: mp.setattr(kda.KDAttention, "_fused_steps", lambda self, x, parts: False),
                           singles=0, batched=6)
    assert calls


def test_cuda_decode_passes_with_the_row_kernels_match_the_torch_ops(tiny_k3_path, tiny_kl_path, monkeypatch):
    """bf16 decode passes (one sequence in its graph, two together, a draft check and its rollback)
    with the one-launch row kernels (row_ops_triton) against the same passes with torch's ops: equal
    to bf16 rounding."""
    pytest.importorskip("triton")
    import deltafin.model.kda as kda
    import deltafin.model.layers as layers
    import deltafin.model.ops as ops
    from deltafin.kernels import row_ops_triton
    calls = []
    real, kernels = row_ops_triton.conv_step, ops.triton_kernels
    monkeypatch.setattr(row_ops_triton, "conv_step", lambda *a, **k: calls.append(1) or real(*a, **k))

    def without(mp):
        for module in (kda, layers, ops):
            mp.setattr(module, "triton_kernels", lambda name: None if name == "row_ops_triton" else kernels(name))

    _same_with_and_without((tiny_k3_path, tiny_kl_path), monkeypatch, without, singles=4, batched=4)
    assert calls


def test_cuda_bench_reports_the_host_ram_budget(tiny_k3_path):
    """Under a device, bench's RAM figures are the host streamer's (not the device budget's)."""
    from deltafin.bench import run_bench
    from deltafin.settings import Settings
    sizes = ModelSizes.of(deltafin.load(tiny_k3_path, device="cpu", stream="off").source)
    budget = str((sizes.globals_bytes + sizes.spine_bytes[0]) / 1e9)
    for ram, held in (("0", False), ("auto", True)):
        s = Settings.resolve({"device": "cuda", "stream": "on", "gpu_budget": budget, "ram_budget": ram})
        r = run_bench(tiny_k3_path, tokens=3, prompt_tokens=4, settings=s)
        assert r["ram_budget_bytes"] != r["residency"]["budget_bytes"]
        assert (r["ram_budget_bytes"] > 0) == held


def test_cuda_sampling_draws_on_the_device(tiny_k3_path):
    """Seeded sampling on a CUDA model draws there (a generator of the device; only the ids come back):
    the same seed gives the same tokens, top-k / top-p included."""
    from deltafin.runtime.generate import Decoding
    from deltafin.runtime.sampling import SamplingParams
    m = deltafin.load(tiny_k3_path, device="cuda", stream="off")
    prompt = [7, 93, 41, 250, 12, 77]
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=11)
    assert Decoding(m, prompt, params).rng.device.type == "cuda"
    a, b = m.generate(prompt, params), m.generate(prompt, params)
    assert a == b and len(a) == 16 and all(0 <= t < m.config.vocab_size for t in a)
