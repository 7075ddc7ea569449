"""Device residency: the placement plan, the expert slots, the gpu_budget setting, and the device
provider's answers at every residency split (on the CPU here: the same provider code with plain
copies; on a CUDA device also with the copy stream and the grouped Triton kernels)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltafin
from deltafin.io.sources import open_source
from deltafin.runtime.engine import Engine
from deltafin.runtime.pass_stats import PassStats
from deltafin.io.device import DeviceProvider
from deltafin.checkpoint.sizes import ModelSizes
from deltafin.io.placement import ExpertSlots, PlacementError, plan, require_everything
from deltafin.io.ram import RAMProvider
from deltafin.settings import Settings, SettingsError

SIZES = ModelSizes(globals_bytes=100, spine_bytes=(50, 50, 50), expert_bytes=(0, 10, 10), num_experts=8)


def test_plan_holds_globals_then_spines_in_order_then_experts_evenly():
    assert SIZES.total == 100 + 150 + 8 * 20
    p = plan(SIZES, 180, "dev")
    assert p.spine_layers == {0} and p.expert_slots == 0 and not p.everything  # 100 + 50; not 3 spines
    p = plan(SIZES, 250 + 3 * 20 + 5, "dev")
    assert p.spine_layers == {0, 1, 2} and p.expert_slots == 3 and p.held_bytes == 310
    assert plan(SIZES, 10**6, "dev").everything
    assert plan(SIZES, 10**6, "dev").expert_slots == 8  # capped at the layer's experts
    with pytest.raises(PlacementError, match="globals alone need"):
        plan(SIZES, 99, "dev")


def test_refusal_names_the_sizes():
    with pytest.raises(PlacementError) as e:
        require_everything(plan(SIZES, 200, "cuda:0"), "gpu_budget=0.0000002 GB")
    msg = str(e.value)
    assert "does not fit in cuda:0" in msg and "globals" in msg and "experts" in msg and "--stream on" in msg


def test_expert_slots_keep_the_most_routed():
    s = ExpertSlots(slots=2)
    for chosen in ([1, 2], [1, 3], [3, 4], [3, 1]):
        s.routed(0, chosen)
        for e in chosen:
            if s.get(0, e) is None:
                s.offer(0, e, f"w{e}")
    assert set(s.held[0]) == {1, 3}  # routed 3 times each; 2 and 4 once
    assert s.get(0, 3) == "w3" and s.get(0, 2) is None
    empty = ExpertSlots(slots=0)
    empty.offer(0, 1, "w")
    assert empty.held_count() == 0


def test_expert_slots_give_up_spare_copies_first():
    """A copy a tier above also holds is evicted before any other, however often it is routed."""
    s = ExpertSlots(slots=2)
    for chosen in ([1, 2], [1, 2], [1], [3]):
        s.routed(0, chosen)
    s.offer(0, 1, "w1")
    s.offer(0, 2, "w2")
    assert not s.admit(0, 3)  # 3 is the coldest: no room for it
    s.spare[0] = {1}
    assert s.admit(0, 3) and s.get(0, 1) is None and s.get(0, 2) == "w2"
    s.put(0, 3, "w3")
    assert s.resize(1) == ["w3"]  # no spare left: the coldest goes


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf", "nan", ""])
def test_gpu_budget_rejects_bad_values(value):
    with pytest.raises(SettingsError, match="gpu_budget"):
        Settings.resolve({"gpu_budget": value})
    with pytest.raises(SettingsError, match="DELTAFIN_GPU_BUDGET"):
        Settings.resolve({}, env={"DELTAFIN_GPU_BUDGET": value})


def test_gpu_budget_values():
    assert Settings.resolve({}).gpu_budget_bytes() is None
    assert Settings.resolve({"gpu_budget": "1.5"}).gpu_budget_bytes() == 1_500_000_000
    assert Settings.resolve({}, env={"DELTAFIN_GPU_BUDGET": "2"}).gpu_budget_bytes() == 2_000_000_000


def _logits(source, provider, settings, ids):
    eng = Engine(source.config, provider, settings)
    state = eng.new_state()
    out = [eng.forward(ids[:6], state)]
    stats = []
    for t in ids[6:]:  # decode token by token: the slots fill from observed routing
        out.append(eng.forward([t], state))
        stats.append(eng.last_pass)
    return torch.cat(out), stats


def _splits(sizes: ModelSizes) -> dict[str, int]:
    """Budgets for: everything held; every spine and two experts per layer; the first spines only."""
    return {"all": sizes.total + 1,
            "experts_partial": sizes.globals_bytes + sum(sizes.spine_bytes) + 2 * sum(sizes.expert_bytes),
            "spines_partial": sizes.globals_bytes + sizes.spine_bytes[0] + sizes.spine_bytes[1]}


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_device_provider_matches_ram_at_every_split(request, fixture):
    """Held, streamed and partly held weights give the RAM provider's logits; bytes add up."""
    source = open_source(request.getfixturevalue(fixture))
    ids = torch.randint(5, 500, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    settings = Settings.resolve({"device": "cpu"})
    want, _ = _logits(source, RAMProvider(source), settings, ids)
    sizes = ModelSizes.of(source)
    for name, budget in _splits(sizes).items():
        p = plan(sizes, budget, "cpu")
        provider = DeviceProvider(source, settings, p)
        try:
            got, stats = _logits(source, provider, settings, ids)
            assert (got - want).abs().max().item() < 1e-4, name
            assert provider.streaming == (name != "all")
            res = provider.residency()
            if name == "all":
                assert res["grouped_expert_layers"] == res["moe_layers"]  # bf16 and MXFP4 experts stack
            if name == "experts_partial":
                assert res["experts_per_layer"] == 2 and 0 < res["experts_held"] <= 2 * res["moe_layers"]
            # One decode token: every spine and every chosen expert came from the device or crossed to it.
            last = stats[-1]
            streamed = sum(b for i, b in enumerate(sizes.spine_bytes) if i not in p.spine_layers)
            assert last.bytes_to_device >= streamed
            assert (last.bytes_on_device + last.bytes_to_device
                    == sum(sizes.spine_bytes) + last.experts_loaded * max(sizes.expert_bytes))
        finally:
            provider.close()


def test_stacked_experts_count_at_most_the_layers_experts(tiny_k3_path):
    """With every expert of a layer stacked the routing is not read back: a pass's experts count as
    its (token, expert) pairs, exact for one token and capped at the layer's experts for a batch that
    has more pairs than that (the union cannot be larger)."""
    source = open_source(tiny_k3_path)
    sizes = ModelSizes.of(source)
    settings = Settings.resolve({"device": "cpu"})
    provider = DeviceProvider(source, settings, plan(sizes, sizes.total + 1, "cpu"))
    try:
        cfg = source.config
        layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
        k, E = cfg.experts_per_token, cfg.num_experts
        for rows, want in ((1, k), (E, E)):  # one token; more pairs than experts
            stats = PassStats()
            ids = torch.stack([torch.randperm(E)[:k] for _ in range(rows)])
            provider.experts(layer, ids, stats).result()
            assert stats.experts_loaded == want
            assert stats.bytes_on_device == want * sizes.expert_bytes[layer]
    finally:
        provider.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_residency_splits_match_cpu(request, fixture):
    path = request.getfixturevalue(fixture)
    ids = torch.randint(5, 500, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = deltafin.load(path, device="cpu", stream="off").logits(ids)
    sizes = ModelSizes.of(open_source(path))
    for name, budget in _splits(sizes).items():
        m = deltafin.load(path, device="cuda", stream="auto", gpu_budget=str(budget / 1e9))
        assert m.streaming == (name != "all")
        assert (m.logits(ids) - cpu).abs().max().item() <= 1e-3, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_stream_off_refuses_what_does_not_fit(tiny_k3_path):
    with pytest.raises(PlacementError, match="does not fit"):
        deltafin.load(tiny_k3_path, device="cuda", stream="off", gpu_budget="0.0001")


def _routed(gen, E, H, T, k):
    """Expert ids [T, k] (distinct per token), routing weights [T, k] and rows [T, H]; then the
    config of each activation."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    cfgs = [type("C", (), {"hidden_act": act, "situ_beta": 4.0, "situ_linear_beta": 25.0})()
            for act in ("silu", "situ")]
    return ids, torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen), cfgs


def _glu(cfg):
    from deltafin.model.moe import glu
    return lambda g, u: glu(cfg, g, u)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_grouped_kernels_match_reference():
    from deltafin.kernels import grouped
    gen = torch.Generator().manual_seed(3)
    E, I, H, T, k = 6, 96, 200, 3, 4
    experts = [(torch.randn(I, H, generator=gen), torch.randn(I, H, generator=gen), torch.randn(H, I, generator=gen))
               for _ in range(E)]
    stack = grouped.ExpertStack.from_experts(experts)
    ids, w, z, cfgs = _routed(gen, E, H, T, k)
    for cfg in cfgs:
        want = grouped.grouped_mlp(cfg, z, ids, w, stack, _glu(cfg))
        dev = grouped.ExpertStack(stack.w13.cuda().bfloat16().float(), stack.w2.cuda().bfloat16().float())
        got = grouped.grouped_mlp(cfg, z.cuda(), ids.cuda(), w.cuda(), dev, _glu(cfg)).cpu()
        ref = grouped.grouped_mlp(cfg, z, ids, w, grouped.ExpertStack(dev.w13.cpu(), dev.w2.cpu()), _glu(cfg))
        assert want.shape == got.shape
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, cfg.hidden_act


def _mxfp4_stacks(gen, E: int, I: int, H: int) -> tuple:
    """E random MXFP4 experts stacked on the CPU and the same stack on the GPU."""
    from deltafin.kernels import grouped
    from deltafin.kernels.linear import quantize
    experts = [tuple(quantize(torch.randn(*shape, generator=gen), "mxfp4") for shape in ((I, H), (I, H), (H, I)))
               for _ in range(E)]
    stack = grouped.MXFP4Stack.from_experts(experts)
    return stack, grouped.MXFP4Stack(*(t.cuda() for t in (stack.w13_packed, stack.w13_scale, stack.w2_packed,
                                                          stack.w2_scale)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_grouped_mxfp4_kernels_match_reference():
    """The fused MXFP4 kernels (codes decoded as read) against the reference that decodes first."""
    from deltafin.kernels import grouped
    gen = torch.Generator().manual_seed(4)
    E, I, H, T, k = 6, 96, 160, 3, 4
    stack, dev = _mxfp4_stacks(gen, E, I, H)
    ids, w, z, cfgs = _routed(gen, E, H, T, k)
    for cfg in cfgs:
        ref = grouped.grouped_mlp(cfg, z, ids, w, stack, _glu(cfg))
        got = grouped.grouped_mlp(cfg, z.cuda(), ids.cuda(), w.cuda(), dev, _glu(cfg)).cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, cfg.hidden_act


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_mxfp4_kernels_at_every_scale():
    """Scales from 2^-127 to 2^13 (past 2^1, where the tiles' decoding splits its multiplier in two) and
    one 255 (no scale: NaN), through the pair kernels and the sorted tiles, against the reference: the
    same NaN rows, the finite ones as close as at ordinary scales."""
    from deltafin.kernels import grouped, grouped_triton
    gen = torch.Generator().manual_seed(11)
    E, I, H, T, k = 4, 96, 160, 40, 2
    stack, _ = _mxfp4_stacks(gen, E, I, H)
    stack.w13_scale.copy_(torch.randint(0, 141, stack.w13_scale.shape, generator=gen, dtype=torch.uint8))
    stack.w13_scale[1, 3, 2] = 255
    dev = grouped.MXFP4Stack(*(t.cuda() for t in (stack.w13_packed, stack.w13_scale, stack.w2_packed,
                                                   stack.w2_scale)))
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w, z = torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen) * 1e-3
    cfg = _routed(gen, E, H, 1, 1)[3][0]
    ref = grouped.grouped_mlp(cfg, z, ids, w, stack, _glu(cfg))
    by, order = ids.reshape(-1).cuda().sort(stable=True)
    ends = torch.searchsorted(by, torch.arange(E, device="cuda"), right=True).to(torch.int32)
    out = grouped_triton.sorted_mxfp4_mlp(z.cuda(), order.to(torch.int32), ends, grouped.sorted_tiles(ends, T * k, 8),
                                          8, k, dev.w13_packed, dev.w13_scale, dev.w2_packed, dev.w2_scale, cfg)
    tiles = torch.bmm(w.cuda().unsqueeze(1), out.view(T, k, -1)).squeeze(1).cpu()
    pairs = grouped.grouped_mlp(cfg, z[:3].cuda(), ids[:3].cuda(), w[:3].cuda(), dev, _glu(cfg)).cpu()
    assert torch.isnan(ref).any(1).sum() > 3  # the tokens that chose expert 1
    for got, want in ((tiles, ref), (pairs, ref[:3])):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        fin = ~nan.any(1)
        assert ((got[fin] - want[fin]).norm() / want[fin].norm()).item() < 1e-5


@pytest.mark.parametrize("args, says", [
    (["--rows", "3"], "--rows: 3: want powers of two >= 4"),
    (["--tokens", "1,x"], "not a comma-separated list of whole numbers"),
    (["--tokens", "0"], "--tokens: 0: want >= 1"),
    (["--top-k", "40"], "--top-k 40: want 1 .. --experts (32)"),
    (["--hidden", "100"], "--hidden 100: want a positive multiple of 32"),
    (["--tile-configs", "64:256:8"], "'64:256:8': want BN:BK:WARPS:STAGES"),
    (["--tile-configs", "64:100:8:2"], "64:100:8:2: want BN >= 16, BK >= 32"),
    (["--tile-configs", "8:64:4:3"], "8:64:4:3: want BN >= 16"),
    (["--pair-configs", "16:8:4"], "'16:8:4': want BN:G:WARPS:STAGES"),
    (["--pair-configs", "16:3:4:2"], "16:3:4:2: want BN >= 1, G >= 1")])
def test_moe_layer_bench_refuses_bad_arguments_in_one_line(args, says):
    """tools/moe_layer_bench.py: a bad argument is a usage error before anything touches a device."""
    tool = Path(__file__).parent.parent / "tools" / "moe_layer_bench.py"
    # the deltafin this test imported, installed or not (a GPU machine may run the tree from its folder)
    path = os.pathsep.join([str(Path(deltafin.__file__).parents[1])] + ([os.environ["PYTHONPATH"]]
                                                                         if os.environ.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr


def test_sorted_tiles_cover_each_experts_pairs_once():
    """The sorted MXFP4 kernels' tiles: each covers at most its `rows` pairs of one expert, together every
    sorted pair exactly once, whatever the routing (experts never chosen, one expert taking all)."""
    from deltafin.kernels.grouped import sorted_tiles
    gen = torch.Generator().manual_seed(8)
    for (E, P), rows in zip(((6, 200), (64, 9), (3, 1), (5, 96)), (32, 4, 8, 64)):
        for ids in (torch.randint(0, E, (P,), generator=gen), torch.full((P,), E - 1)):
            by = ids.sort().values
            ends = torch.searchsorted(by, torch.arange(E), right=True).to(torch.int32)
            tile_e, first = sorted_tiles(ends, P, rows)
            assert tile_e.shape == first.shape == (-(-P // rows) + E,)
            seen = []
            for e, f in zip(tile_e.tolist(), first.tolist()):
                if e < 0:
                    continue
                covered = list(range(f, min(f + rows, int(ends[e]))))
                assert covered and all(by[r] == e for r in covered)
                seen += covered
            assert sorted(seen) == list(range(P))
            # the tiles of no expert all come after the real ones
            real = (tile_e >= 0).tolist()
            assert real == sorted(real, reverse=True)


def test_a_layer_takes_the_sorted_path_from_its_pairs_per_expert(monkeypatch):
    """``Stacked.takes_sorted``: where the sorted kernels run at all, a layer takes them from
    ``sorted_min_rows`` pairs per expert of the layer (bf16 and MXFP4 4: the measured crossovers), so a
    decode batch of few rows per expert keeps the pair kernels; nowhere else. MXFP4 tiles hold the
    layer's pairs per expert, rounded up to a power of two from 8 to 64."""
    from deltafin.kernels import grouped
    bf16 = grouped.ExpertStack(torch.zeros(64, 8, 4, dtype=torch.bfloat16), torch.zeros(64, 4, 4, dtype=torch.bfloat16),
                               bf16_products=True)
    mx = grouped.MXFP4Stack(*(torch.zeros(32, 2, 2, dtype=torch.uint8) for _ in range(4)))
    assert not bf16.takes_sorted(10 ** 6) and not mx.takes_sorted(10 ** 6)  # CPU tensors: never
    monkeypatch.setattr(grouped.ExpertStack, "sorted_gemm", lambda self: True)
    monkeypatch.setattr(grouped.MXFP4Stack, "sorted_gemm", lambda self: True)
    assert [bf16.takes_sorted(p) for p in (64, 255, 256, 4096)] == [False, False, True, True]  # top-8 at b8, 32
    assert [mx.takes_sorted(p) for p in (64, 127, 128, 512)] == [False, False, True, True]  # top-16 at b4, b8, b32
    assert [mx.sorted_tile_rows(p) for p in (128, 256, 257, 512, 2048, 10 ** 5)] == [8, 8, 16, 16, 64, 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_sorted_mxfp4_kernels_match_reference():
    """Many pairs of MXFP4 experts (a prompt's worth; some experts chosen by many rows, some never)
    through the sorted tiles, tuned and with fixed tiles, against the reference that decodes first; inputs
    that are not whole steps of the tiles (masked loads) and inputs that are (EVEN_K)."""
    for I, H in ((96, 160), (128, 256)):
        _sorted_mxfp4_tiles_match_reference(I, H)


def _sorted_mxfp4_tiles_match_reference(I: int, H: int) -> None:
    from deltafin.kernels import grouped, grouped_triton
    gen = torch.Generator().manual_seed(9)
    E, T, k = 7, 100, 4
    stack, dev = _mxfp4_stacks(gen, E, I, H)
    assert dev.sorted_gemm() and not stack.sorted_gemm() and dev.applies(T * k)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert 6 never
    w, z = torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen)
    cfgs = _routed(gen, E, H, 1, 1)[3]
    for cfg in cfgs:
        ref = grouped.grouped_mlp(cfg, z, ids, w, stack, _glu(cfg))
        got = grouped.grouped_mlp(cfg, z.cuda(), ids.cuda(), w.cuda(), dev, _glu(cfg)).cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, cfg.hidden_act
        few = slice(0, 20)  # 80 pairs, 12 an expert: 16-row tiles
        ref_few = grouped.grouped_mlp(cfg, z[few], ids[few], w[few], stack, _glu(cfg))
        got_few = grouped.grouped_mlp(cfg, z[few].cuda(), ids[few].cuda(), w[few].cuda(), dev, _glu(cfg)).cpu()
        assert ((got_few - ref_few).norm() / ref_few.norm()).item() < 1e-5, cfg.hidden_act
        by, order = ids.reshape(-1).cuda().sort(stable=True)
        ends = torch.searchsorted(by, torch.arange(E, device="cuda"), right=True).to(torch.int32)
        codes = (dev.w13_packed, dev.w13_scale, dev.w2_packed, dev.w2_scale)
        # every tile size, tuned and with a fixed tile
        for rows, config in ((4, {"BN": 32, "BK": 64}), (8, None), (16, None), (64, {"BN": 64, "BK": 64})):
            tiles = grouped.sorted_tiles(ends, T * k, rows)
            out = grouped_triton.sorted_mxfp4_mlp(z.cuda(), order.to(torch.int32), ends, tiles, rows, k, *codes, cfg,
                                                  config=config)
            fixed = torch.bmm(w.cuda().unsqueeze(1), out.view(T, k, -1)).squeeze(1).cpu()
            assert ((fixed - ref).norm() / ref.norm()).item() < 1e-5, (cfg.hidden_act, rows, config)
    assert dev.sorted_tile_rows(T * k) == 64 and dev.sorted_tile_rows(80) == 16  # what grouped_mlp took above


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_half_gemv_matches_torch_products():
    """The one-launch bf16 product of a few rows against torch's three launches: one row on small weights,
    one over 2**23 elements and a shape for every branch of ``config_for``; 2 to MAX_ROWS rows (any leading
    shape) on some of them; the same rounding of the rows and of the result; a different summation order
    may move a result by one bf16 step, more where its products cancel."""
    from deltafin.kernels import half_gemv_triton
    from deltafin.model.ops import HalfMatmul, linear
    gen = torch.Generator().manual_seed(5)
    shapes = ((37, 300), (128, 7168), (5, 2050), (9000, 1024),  # the last over 2**23 elements
              (300, 128), (1000, 2048), (2000, 1024), (3000, 1024), (5000, 4096), (4608, 512), (4700, 512),
              (4700, 1536), (700, 2304), (2000, 2304), (7000, 2304), (7200, 2304))
    assert len({tuple(half_gemv_triton.config_for(N, K).values()) for N, K in shapes}) == 8  # all of them
    # leading shapes of several rows, beside one row
    more = {(37, 300): ((2,), (16,)), (128, 7168): ((2, 4),), (5, 2050): ((3,),), (9000, 1024): ((8,),),
            (4700, 1536): ((4, 2),), (7200, 2304): ((16,),), (3000, 1024): ((2,),)}
    for N, K in shapes:
        w = torch.randn(N, K, generator=gen).bfloat16().cuda()
        for lead in ((1,), *more.get((N, K), ())):
            x = torch.randn(*lead, K, generator=gen).cuda()
            want = torch.nn.functional.linear(x.bfloat16(), w).float()
            # one bf16 step of the result, plus float32 summation-order error where the products cancel
            bound = want.abs() * 2 ** -7 + 1e-5 * torch.nn.functional.linear(x.bfloat16().float().abs(), w.float().abs())
            # several rows take the kernel where the weight gives it programs enough (the call below, any)
            assert half_gemv_triton.applies(x, w) == (x.numel() == K or N >= half_gemv_triton.ROWS_MIN_OUT)
            fixed = {"BN": 4, "BK": 128} if x.numel() == K else {"BN": 16, "BK": 64, "num_stages": 2}
            for got in (linear(x, HalfMatmul(w, torch.bfloat16)), half_gemv_triton.half_gemv(x, w, fixed)):
                assert got.shape == want.shape and got.dtype == torch.float32
                assert ((got - want).abs() <= bound).all(), (N, K, lead)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device="cuda")
    assert not half_gemv_triton.applies(torch.zeros(half_gemv_triton.MAX_ROWS + 1, 32, device="cuda"), w)
    assert not half_gemv_triton.applies(torch.zeros(2, 33, device="cuda"), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_float_gemv_is_the_float32_product_of_the_stored_bf16_weight():
    """fp32 rows against a bf16 weight, unrounded: one row and 2 to MAX_ROWS rows (three bf16 parts on the
    tensor cores, or up to FMA_MAX_ROWS on the CUDA cores), narrow weights included, through
    ``ops.linear``, against the float64 product. The bound is float32 summation error, which torch's own
    widened product meets too; rows rounded to bf16 would miss it by ~10x (the products' rounding is
    2**-9 of each term)."""
    from deltafin.kernels import half_gemv_triton
    from deltafin.model.ops import linear
    gen = torch.Generator().manual_seed(6)
    for N, K, leads in (((37, 300, ((1,), (2,), (16,)))), (128, 7168, ((1,), (2, 4))), (5, 2050, ((1,), (3,))),
                        (512, 1024, ((8,),)), (4700, 1536, ((1,), (4, 2))), (7200, 2304, ((16,),))):
        w = torch.randn(N, K, generator=gen).bfloat16().cuda()
        for lead in leads:
            x = torch.randn(*lead, K, generator=gen).cuda()
            want = (x.double() @ w.double().T)
            bound = 2 ** -17 * (x.double().abs() @ w.double().abs().T) + 1e-30
            assert half_gemv_triton.applies(x, w, rounded=False)
            widened = torch.nn.functional.linear(x, w.float())
            assert ((widened.double() - want).abs() <= bound).all(), (N, K, lead)  # the bound is fair
            fixed = {"BN": 4, "BK": 128} if x.numel() == K else {"BN": 16, "BK": 64, "num_stages": 2}
            rows = x.numel() // K
            fma = ((half_gemv_triton.float_gemv(x, w, half_gemv_triton.fma_config(rows, K)),)
                   if 1 < rows <= half_gemv_triton.FMA_MAX_ROWS else ())  # the CUDA-core kernel, on any weight
            for got in (linear(x, w), half_gemv_triton.float_gemv(x, w), half_gemv_triton.float_gemv(x, w, fixed),
                        *fma):
                assert got.shape == want.shape and got.dtype == torch.float32
                assert ((got.double() - want).abs() <= bound).all(), (N, K, lead)
            rounded = half_gemv_triton.half_gemv(x, w) if half_gemv_triton.applies(x, w) else None
            if rounded is not None:  # what the bound tells apart
                assert not ((rounded.double() - want).abs() <= bound).all(), (N, K, lead)
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device="cuda")
    assert not half_gemv_triton.applies(torch.zeros(half_gemv_triton.MAX_ROWS + 1, 32, device="cuda"), w, False)
    assert half_gemv_triton.applies(torch.zeros(2, 32, device="cuda"), w, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_row_products_tool(capsys):
    """tools/bench_row_products.py: a record per shape with every kernel's time and the CUDA-core kernel's
    error within float32 summation error; bad shapes or rows refused by the parser."""
    import json
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_row_products
    assert bench_row_products.main(["--shapes", "64x300,512x512", "--rows", "2,8"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["N"], r["K"]) for r in recs] == [(64, 300), (512, 512)]
    for r in recs:
        for rows in ("2", "8"):
            assert r[rows]["cuda_cores"] > 0 and r[rows]["tensor_cores"] > 0 and r[rows]["cuda_cores_error"] < 2 ** -17
    for bad in (["--rows", "9"], ["--shapes", "0x4"], ["--shapes", "ax4"]):
        with pytest.raises(SystemExit):
            bench_row_products.main(bad)


def _expert_reads(source, budget: int, ram_budget: str, ids):
    """Logits, the decode passes' stats, and what each tier holds at the end, for a device that
    holds every spine and two experts per layer over a host-RAM cache of `ram_budget` over disk."""
    settings = Settings.resolve({"device": "cpu", "ram_budget": ram_budget})
    provider = DeviceProvider(source, settings, plan(ModelSizes.of(source), budget, "cpu"))
    try:
        logits, stats = _logits(source, provider, settings, ids)
        host = provider._host.cache
        on_device = {i: set(v) for i, v in provider._slots.held.items()}
        in_ram = {i: set(v) for i, v in host._experts.held.items()} if host is not None else {}
        return logits, stats, on_device, in_ram
    finally:
        provider.close()


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_device_over_host_ram_over_disk(request, fixture):
    """Three tiers at once: the device's slots, the host-RAM cache under them, the disk under both.
    Logits equal the RAM provider's whatever holds what; with room in RAM no expert is read from
    disk twice (an expert the device lets go is still in RAM); with too little, RAM gives up its
    copies of the device's experts first, and bytes come from all three tiers."""
    source = open_source(request.getfixturevalue(fixture))
    ids = torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    want, _ = _logits(source, RAMProvider(source), Settings.resolve({"device": "cpu"}), ids)
    sizes = ModelSizes.of(source)
    budget = sizes.globals_bytes + sum(sizes.spine_bytes) + 2 * sum(sizes.expert_bytes)
    every_expert = sizes.num_experts * sum(sizes.expert_bytes)

    got, stats, on_device, in_ram = _expert_reads(source, budget, "auto", ids)
    assert (got - want).abs().max().item() < 1e-4
    assert sum(s.bytes_read for s in stats) <= every_expert  # each expert off the disk once at most
    assert sum(s.bytes_from_ram for s in stats) > 0 and sum(s.bytes_on_device for s in stats) > 0

    got, stats, _, _ = _expert_reads(source, budget, "0", ids)  # no RAM tier: device misses go to disk
    assert (got - want).abs().max().item() < 1e-4
    assert sum(s.bytes_read for s in stats) > every_expert

    # Room in RAM for three experts per layer beyond the streamer's own buffers (as a decode pass
    # needs them): the three tiers all serve.
    moe = sum(1 for b in sizes.expert_bytes if b)
    settings = Settings.resolve({"device": "cpu", "ram_budget": "auto"})
    probe = DeviceProvider(source, settings, plan(sizes, budget, "cpu"))
    try:
        _logits(source, probe, settings, ids[:8])
        host = probe.residency()["host"]
    finally:
        probe.close()
    ram = host["fixed_bytes"] + 3 * host["cache"]["slot_bytes"]
    got, stats, on_device, in_ram = _expert_reads(source, budget, str(ram / 1e9), ids)
    assert (got - want).abs().max().item() < 1e-4
    assert all(sum(getattr(s, k) for s in stats) > 0 for k in ("bytes_on_device", "bytes_from_ram", "bytes_read"))
    assert all(len(v) <= 3 for v in in_ram.values())
    # the RAM slots went to experts the device does not hold (its copies of the device's went first)
    assert not any(in_ram[i] & on_device.get(i, set()) for i in in_ram)
    assert sum(len(v) for v in in_ram.values()) >= moe


def test_host_ram_cache_under_a_device_gives_memory_back(tiny_k3_path):
    """Under a device the host-RAM cache still follows its target: when pressure lowers it (what the
    memory watcher does), it lets go of what it holds at once, and decoding goes on with the same
    logits, reading the rest from disk again."""
    source = open_source(tiny_k3_path)
    ids = torch.randint(5, 500, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    settings = Settings.resolve({"device": "cpu", "ram_budget": "auto"})
    want, _ = _logits(source, RAMProvider(source), settings, ids)
    sizes = ModelSizes.of(source)
    budget = sizes.globals_bytes + sum(sizes.spine_bytes) + 2 * sum(sizes.expert_bytes)
    provider = DeviceProvider(source, settings, plan(sizes, budget, "cpu"))
    try:
        cache = provider._host.cache
        provider._host.watcher.close()  # the test moves the target itself
        eng = Engine(source.config, provider, settings)
        state = eng.new_state()
        out = [eng.forward(ids[:6], state)] + [eng.forward([t], state) for t in ids[6:18]]
        assert cache.held_bytes() > 0
        cache.set_target(0, "memory pressure")
        assert cache.held_bytes() == 0 and cache.residency()["experts_held"] == 0
        read = []
        for t in ids[18:]:
            out.append(eng.forward([t], state))
            read.append(eng.last_pass.bytes_read)
        assert (torch.cat(out) - want).abs().max().item() < 1e-4
        assert all(b > 0 for b in read) and cache.held_bytes() == 0  # from disk now, nothing kept
    finally:
        provider.close()
