"""Each K3-only piece against a direct, loop-style computation written here from K3_MODEL.md."""
from __future__ import annotations

import math

import pytest
import torch

from deltafin.config import parse_config
from deltafin.model.binding import bind, slot_names
from deltafin.model.kda import KDAttention
from deltafin.model.kda_recurrence import kda_chunked, kda_recurrent
from deltafin.model.layers import attn_res
from deltafin.model.mla import MLAttention
from deltafin.model.state import Rows
from deltafin.kernels.grouped import ExpertStack
from deltafin.model.moe import ExpertRows, MoE, chosen_experts
from deltafin.model.ops import situ_glu
from deltafin.io.ram import done



def fetch_from(experts: dict):
    """A MoE layer's ``fetch`` that hands out the routed experts from `experts` at once (as an
    in-RAM provider does)."""
    return lambda ids, x, residual: done({e: experts[e] for e in chosen_experts(ids)})

def k3_config(**over):
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=5, rms_norm_eps=1e-5, hidden_act="situ",
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0, num_attention_heads=2,
                q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                mla_use_output_gate=True, first_k_dense_replace=1, intermediate_size=48,
                num_experts=8, num_experts_per_token=3, num_shared_experts=2, moe_intermediate_size=16,
                routed_expert_hidden_size=32, latent_moe_use_norm=True, routed_scaling_factor=2.0,
                num_expert_group=1, topk_group=1, attn_res_block_size=2,
                linear_attn_config=dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, kda_layers=[1, 2, 4],
                                        full_attn_layers=[3, 5], use_full_rank_gate=True, gate_lower_bound=-5.0))
    text.update(over)
    return parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": text})


def random_weights(module, gen, scale=1.0):
    w = {}
    for name, shape in slot_names(module).items():
        t = torch.randn(shape, generator=gen)
        if len(shape) == 2:
            t = t * scale / math.sqrt(shape[1])
        elif "norm" in name:
            t = 1 + 0.2 * t
        w[name] = t
    return w


def rms(x, w, eps):
    return [w[i] * x[i] / math.sqrt(sum(v * v for v in x) / len(x) + eps) for i in range(len(x))]


def sigmoid(v):
    return 1 / (1 + math.exp(-v))


def test_situ_matches_formula():
    g = torch.tensor([-30.0, -3.0, -0.5, 0.0, 0.7, 2.0, 6.0, 40.0])
    u = torch.tensor([-80.0, -1.0, 0.3, 2.0, -4.0, 10.0, 30.0, 100.0])
    got = situ_glu(g, u, 4.0, 25.0)
    for i in range(len(g)):
        gi, ui = g[i].item(), u[i].item()
        want = (4.0 * math.tanh(gi / 4.0) * sigmoid(gi)) * (25.0 * math.tanh(ui / 25.0))
        assert abs(got[i].item() - want) <= 1e-5 * max(1.0, abs(want))
    # it is not SiLU: large gates saturate at beta
    assert abs(situ_glu(torch.tensor([40.0]), torch.tensor([1.0]), 4.0, None).item() - 4.0) < 1e-4


def test_safe_gate_matches_formula():
    cfg = k3_config()
    gen = torch.Generator().manual_seed(0)
    attn = KDAttention(cfg)
    w = random_weights(attn, gen)
    bind(attn, w)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    g = attn.decay(x)
    fa = x @ w["f_a_proj"].t()
    r = fa @ w["f_b_proj"].t() + w["dt_bias"]
    nh, d = cfg.kda_num_heads, cfg.kda_head_dim
    for t in range(3):
        for h in range(nh):
            for c in range(d):
                want = -5.0 * sigmoid(math.exp(w["A_log"][h].item()) * r[t, h * d + c].item())
                assert abs(g[t, h, c].item() - want) < 1e-5
    assert (g > -5.0).all() and (g < 0).all()


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (70, 16), (130, 64)])
def test_chunked_kda_equals_recurrent(T, chunk):
    gen = torch.Generator().manual_seed(T)
    H, D = 3, 8
    q = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen), dim=-1) * D ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=gen), dim=-1)
    v = torch.randn(T, H, D, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, D, generator=gen))  # the safe gate's range
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    S0 = torch.randn(H, D, D, generator=gen) * 0.1
    o1, S1 = kda_recurrent(q, k, v, g, beta, S0)
    o2, S2 = kda_chunked(q, k, v, g, beta, S0, chunk)
    assert (o1 - o2).abs().max() < 1e-4
    assert (S1 - S2).abs().max() < 1e-4


def test_kda_recurrence_matches_loop():
    """The recurrent step itself, element by element, as K3_MODEL.md 3.1 writes it."""
    gen = torch.Generator().manual_seed(3)
    T, H, D = 4, 2, 3
    q, k, v, g = (torch.randn(T, H, D, generator=gen) for _ in range(4))
    g = -g.abs()
    beta = torch.rand(T, H, generator=gen)
    o, S = kda_recurrent(q, k, v, g, beta, torch.zeros(H, D, D))
    for h in range(H):
        Sl = [[0.0] * D for _ in range(D)]
        for t in range(T):
            Sl = [[Sl[a][b] * math.exp(g[t, h, a].item()) for b in range(D)] for a in range(D)]
            stk = [sum(Sl[a][b] * k[t, h, a].item() for a in range(D)) for b in range(D)]
            u = [beta[t, h].item() * (v[t, h, b].item() - stk[b]) for b in range(D)]
            Sl = [[Sl[a][b] + k[t, h, a].item() * u[b] for b in range(D)] for a in range(D)]
            for b in range(D):
                want = sum(Sl[a][b] * q[t, h, a].item() for a in range(D))
                assert abs(o[t, h, b].item() - want) < 1e-5


def naive_mla(cfg, w, x):
    """Expanded keys/values, one head and one query at a time."""
    T, nh = x.shape[0], cfg.mla_num_heads
    nope, rope, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = torch.zeros(T, nh * dv)
    for t in range(T):
        ca = x[t] @ w["q_a_proj"].t()
        q = torch.tensor(rms(ca.tolist(), w["q_a_layernorm"].tolist(), 1e-6)) @ w["q_b_proj"].t()
        gate = torch.sigmoid(x[t] @ w["g_proj"].t())
        for h in range(nh):
            qh = q[h * (nope + rope):(h + 1) * (nope + rope)]
            scores, vals = [], []
            for s in range(t + 1):
                kv = x[s] @ w["kv_a_proj_with_mqa"].t()
                c = torch.tensor(rms(kv[:r].tolist(), w["kv_a_layernorm"].tolist(), 1e-6))
                kvb = (c @ w["kv_b_proj"].t()).view(nh, nope + dv)[h]
                key = torch.cat([kvb[:nope], kv[r:]])
                scores.append((qh @ key).item() / math.sqrt(nope + rope))
                vals.append(kvb[nope:])
            m = max(scores)
            p = [math.exp(s_ - m) for s_ in scores]
            z = sum(p)
            out[t, h * dv:(h + 1) * dv] = sum(pi / z * vi for pi, vi in zip(p, vals)) * gate[h * dv:(h + 1) * dv]
    return out @ w["o_proj"].t()


def test_mla_with_output_gate_prefill_and_absorbed_decode():
    cfg = k3_config()
    gen = torch.Generator().manual_seed(1)
    attn = MLAttention(cfg)
    w = random_weights(attn, gen)
    bind(attn, w)
    x = torch.randn(6, cfg.hidden_size, generator=gen)
    want = naive_mla(cfg, w, x)
    st = attn.new_state(torch.float32)
    got_prefill = attn(x, [Rows(st, len(x), False)], 64)  # expanded path
    assert (got_prefill - want).abs().max() < 1e-5
    st = attn.new_state(torch.float32)
    steps = [x[:2]] + [x[t:t + 1] for t in range(2, 6)]
    got = torch.cat([attn(xs, [Rows(st, len(xs), False)], 64) for xs in steps])
    assert (got - want).abs().max() < 1e-5  # absorbed path, token by token
    assert st.length == 6


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_mla_decode_absorbs_a_stored_kv_b_without_decoding_it(monkeypatch, codec):
    """Decode steps multiply by an int8 or bf16 kv_b_proj in the native kernels (model/mla.py KvB):
    against the same steps with the weight decoded first, and against the naive expanded attention
    of the same weights; the prompt (expanded path) still decodes it."""
    from deltafin.kernels import cpu_native, dequantize, quantize
    from deltafin.model import mla
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built")
    cfg = k3_config(num_attention_heads=4, kv_lora_rank=40, qk_nope_head_dim=16, v_head_dim=24)
    gen = torch.Generator().manual_seed(7)
    attn = MLAttention(cfg)
    w = random_weights(attn, gen)
    stored = w["kv_b_proj"].to(torch.bfloat16) if codec == "bf16" else quantize(w["kv_b_proj"], "int8")
    w["kv_b_proj"] = stored.float() if codec == "bf16" else dequantize(stored)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    want = naive_mla(cfg, w, x)
    bind(attn, {**w, "kv_b_proj": stored})
    calls = []
    real = cpu_native.dense_heads_gemv
    monkeypatch.setattr(cpu_native, "dense_heads_gemv",
                        lambda *a, **k: calls.append(k.get("transposed", False)) or real(*a, **k))

    def run():
        st = attn.new_state(torch.float32)
        steps = [x[:3], x[3:4], x[4:6], x[6:7]]  # a prompt, then steps of one and two rows
        return torch.cat([attn(xs, [Rows(st, len(xs), False)], 64) for xs in steps])
    got = run()
    assert calls == [True, False] * 3  # every step after the prompt: the query's side, then the value's
    with monkeypatch.context() as m:
        m.setattr(mla.KvB, "_native", lambda self, rows: None)
        decoded = run()
    assert len(calls) == 6
    # float32 summation order; int8: the value side's product rounds the latent rows to int16 first
    assert (got - decoded).abs().max() < (1e-4 if codec == "int8" else 1e-5) * decoded.abs().max()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_latent_moe_matches_loop():
    cfg = k3_config()
    gen = torch.Generator().manual_seed(2)
    moe = MoE(cfg)
    w = random_weights(moe, gen, scale=3.0)
    w["e_score_correction_bias"] = torch.randn(cfg.num_experts, generator=gen) * 0.2
    bind(moe, w)
    L, I = cfg.latent_size, cfg.moe_intermediate_size
    experts = {e: (torch.randn(I, L, generator=gen) * 3 / L ** .5, torch.randn(I, L, generator=gen) / L ** .5,
                   torch.randn(L, I, generator=gen) / I ** .5) for e in range(cfg.num_experts)}

    x = torch.randn(4, cfg.hidden_size, generator=gen)
    got = moe(x, fetch_from(experts))
    # Every expert held as one stack (a device provider's resident layer): the grouped path, on the
    # CPU its torch reference, computes the same function.
    stack = ExpertStack.from_experts([experts[e] for e in range(cfg.num_experts)])
    stacked = moe(x, lambda ids, x, residual: done(stack))
    assert (stacked - got).abs().max() < 1e-5

    def situ_vec(g, u):
        return [(4 * math.tanh(a / 4) * sigmoid(a)) * (25 * math.tanh(b / 25)) for a, b in zip(g, u)]

    for t in range(4):
        xt = x[t]
        s = [sigmoid((xt @ w["gate"][e]).item()) for e in range(cfg.num_experts)]
        order = sorted(range(cfg.num_experts), key=lambda e: -(s[e] + w["e_score_correction_bias"][e].item()))
        top = order[:cfg.experts_per_token]
        tot = sum(s[e] for e in top)
        z = xt @ w["routed_expert_down_proj"].t()
        y = torch.zeros(L)
        for e in top:
            w1, w3, w2 = experts[e]
            h = torch.tensor(situ_vec((w1 @ z).tolist(), (w3 @ z).tolist()))
            y += (s[e] / tot * cfg.routed_scaling_factor) * (w2 @ h)
        y = torch.tensor(rms(y.tolist(), w["routed_expert_norm"].tolist(), cfg.rms_norm_eps))
        routed = y @ w["routed_expert_up_proj"].t()
        hs = torch.tensor(situ_vec((xt @ w["shared_gate_proj"].t()).tolist(), (xt @ w["shared_up_proj"].t()).tolist()))
        want = routed + hs @ w["shared_down_proj"].t()
        assert (got[t] - want).abs().max() < 1e-4


def test_expert_rows_found_once_equal_each_experts_nonzero():
    """A device pass finds every expert's rows and slots from one read-back of the routing: the
    same rows, in the same order, as a per-expert ``nonzero`` (so the sums add in the same order)."""
    gen = torch.Generator().manual_seed(5)
    for T, k, E in [(1, 8, 32), (5, 4, 16), (64, 6, 8)]:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        rows = ExpertRows(ids)
        for e in range(E):
            want = (ids == e).nonzero(as_tuple=True)
            got = rows.of(e)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(rows.host_ids, ids)


@pytest.mark.parametrize("codec", ["mxfp4", "int8", "bf16"])
def test_routed_experts_of_a_batch_in_two_native_calls_equal_the_per_expert_loop(monkeypatch, codec):
    """The routed experts of many rows at once (kernels/experts_cpu.py) against the per-expert path
    (int8 and bf16: bit for bit), and against each row computed alone; in a prompt, an MXFP4 expert with
    more rows than the native gemv takes is split into several items, an int8 or bf16 one takes the
    per-expert path."""
    from deltafin.kernels import cpu_native, experts_cpu, quantize
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built")
    cfg = k3_config(moe_intermediate_size=32)  # MXFP4 widths are multiples of 32
    gen = torch.Generator().manual_seed(4)
    moe = MoE(cfg)
    w = random_weights(moe, gen, scale=3.0)
    bind(moe, w)
    L, I = cfg.latent_size, cfg.moe_intermediate_size

    def q(t):
        return t.to(torch.bfloat16) if codec == "bf16" else quantize(t, codec)
    experts = {e: (q(torch.randn(I, L, generator=gen) * 3 / L ** .5), q(torch.randn(I, L, generator=gen) / L ** .5),
                   q(torch.randn(L, I, generator=gen) / I ** .5)) for e in range(cfg.num_experts)}
    calls = []
    real = experts_cpu.routed

    def counted(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]
    monkeypatch.setattr(experts_cpu, "routed", counted)

    x = torch.randn(7, cfg.hidden_size, generator=gen)
    fetch = fetch_from(experts)
    fused = moe(x, fetch)
    assert len(calls) == 1 and calls[0] is not None  # the native path ran
    alone = torch.cat([moe(x[t:t + 1], fetch) for t in range(7)])
    with monkeypatch.context() as m:
        m.setattr(experts_cpu, "applies", lambda z, e: False)
        loop = moe(x, fetch)
    if codec == "mxfp4":
        assert (fused - loop).abs().max() < 1e-4  # outputs ~20: float32 rounding
    else:  # the same products, activation and sums in the same order
        assert torch.equal(fused, loop)
    # alone, the float32 latent projection sums in another order; int8 rounds its result to int16
    # steps, which carries a last-bit difference up to one step (outputs ~20)
    assert (fused - alone).abs().max() < (5e-4 if codec == "int8" else 1e-4)
    calls.clear()
    # 3 x GEMV_MAX_ROWS rows x 3 of 8 experts: some expert gets more rows than the native gemvs take
    long = torch.randn(3 * cpu_native.GEMV_MAX_ROWS, cfg.hidden_size, generator=gen)
    with monkeypatch.context() as m:
        m.setattr(experts_cpu, "applies", lambda z, e: False)
        want = moe(long, fetch)
    got = moe(long, fetch)
    assert (got - want).abs().max() < 1e-4
    if codec == "mxfp4":  # such an expert is several items of the native calls
        assert len(calls) == 1 and calls[0] is not None
        rows = [0, 1, len(long) - 1]
        assert (got[rows] - torch.cat([moe(long[t:t + 1], fetch) for t in rows])).abs().max() < 1e-4
    else:  # int8 and bf16 experts with many rows: the per-expert path decodes and multiplies them
        assert calls == [None]


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_shared_expert_rides_in_the_routed_experts_native_calls_with_the_same_bits(monkeypatch, codec):
    """A Kimi Linear MoE layer (shared expert of the routed experts' shape, no latent projection, SiLU)
    with its routed experts in memory: the shared expert joins the routed experts' one native call
    (products, activation and weighted sum: 1 call a layer instead of 3), and the output equals
    computing it apart bit for bit, for one row and for several; a streamed layer whose experts are
    still arriving keeps them apart."""
    from concurrent.futures import Future
    from deltafin.checkpoint.synthetic import config_dict
    from deltafin.kernels import cpu_native, quantize
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built")
    cfg = parse_config(config_dict("tiny-kimi-linear"))
    assert cfg.num_shared_experts and not cfg.latent_size
    gen = torch.Generator().manual_seed(6)
    moe = MoE(cfg)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size

    def q(t):
        return t.to(torch.bfloat16) if codec == "bf16" else quantize(t, codec)
    w = random_weights(moe, gen, scale=3.0)
    for name in ("shared_gate_proj", "shared_up_proj", "shared_down_proj"):
        w[name] = q(w[name])
    bind(moe, w)
    experts = {e: (q(torch.randn(I, H, generator=gen) * 3 / H ** .5), q(torch.randn(I, H, generator=gen) / H ** .5),
                   q(torch.randn(H, I, generator=gen) / I ** .5)) for e in range(cfg.num_experts)}
    calls = []
    for name in ("dense_gemv", "dense_gemv_items", "moe_silu"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    for rows in (1, 5):
        x = torch.randn(rows, H, generator=gen)
        calls.clear()
        together = moe(x, fetch_from(experts))
        assert calls == ["moe_silu"]
        with monkeypatch.context() as m:
            m.setattr(MoE, "_routed_and_shared", lambda *a: None)
            calls.clear()
            apart = moe(x, fetch_from(experts))
            assert len(calls) == 3  # the routed experts' call, the shared expert's two products
        assert torch.equal(together, apart)
        # A streamed read not finished when the layer looks: the shared expert computes meanwhile.
        calls.clear()
        pending = Future()

        def arriving(ids, x, residual):
            pending.result = lambda timeout=None: {e: experts[e] for e in chosen_experts(ids)}
            return pending
        assert torch.equal(moe(x, arriving), apart) and len(calls) == 3


def test_a_resident_layers_halves_in_one_native_call_compute_and_count_what_their_calls_apart_do(
        tiny_kl_path, wide_q8_path, monkeypatch):
    """A resident Kimi Linear on the CPU (bf16, and a grouped int8 store) runs each MoE layer's norm,
    router, experts and sums in one native call (MoE.block), each KDA layer's norm, attention and
    sum in another (KDAttention.block), each MLA layer's in another where every sequence decodes one
    row (MLAttention.block), and the leading dense layer's MLP half in another (DenseMLP.block): the logits of a prompt, of decode steps and of a batch equal the
    separate calls' bit for bit, and the pass counts the same experts and bytes. An expert swapped in the
    held experts is used from the next pass; an observer of the routing sees every MoE layer (the layer
    then calls its steps apart)."""
    import deltafin
    from deltafin.kernels import cpu_native
    from deltafin.model.kda import KDAttention
    from deltafin.model.mla import MLAttention
    from deltafin.model.moe import DenseMLP, MoE

    def apart(p):
        p.setattr(MoE, "block", lambda *a: None)
        p.setattr(DenseMLP, "block", lambda *a: None)
        p.setattr(KDAttention, "block", lambda *a: None)
        p.setattr(MLAttention, "block", lambda *a: None)
    from deltafin.runtime.engine import Seq
    from deltafin.runtime.pass_stats import PassObserver
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built")
    calls, kda_calls, mla_calls, mlp_calls = [], [], [], []
    real, real_kda, real_mla = cpu_native.moe_block_silu, cpu_native.kda_block, cpu_native.mla_block
    real_mlp = cpu_native.mlp_block_silu
    monkeypatch.setattr(cpu_native, "mlp_block_silu", lambda *a, **k: mlp_calls.append(1) or real_mlp(*a, **k))
    monkeypatch.setattr(cpu_native, "mla_block", lambda *a, **k: mla_calls.append(1) or real_mla(*a, **k))
    monkeypatch.setattr(cpu_native, "moe_block_silu", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu_native, "kda_block", lambda *a, **k: kda_calls.append(1) or real_kda(*a, **k))
    for path in (tiny_kl_path, wide_q8_path):
        m = deltafin.load(path, device="cpu", stream="off", cpu_replay=False)  # the calls counted here, not replayed
        moe_layers = sum(m.config.is_moe(i) for i in range(m.config.num_layers))
        kda_layers = len(m.config.kda_layers)
        ids = torch.randint(3, 400, (9,), generator=torch.Generator().manual_seed(2)).tolist()

        def run():
            a, b = m.engine.new_state(), m.engine.new_state()
            out = [m.engine.forward(ids[:6], a)]
            counts = [(m.engine.last_pass.experts_loaded, m.engine.last_pass.bytes_from_ram)]
            for t in (6, 7):
                out.append(m.engine.forward(ids[t:t + 1], a))
            m.engine.forward(ids[:3], b)
            out += m.engine.forward_batch([Seq(ids[8:9], a), Seq(ids[3:5], b)])
            counts.append((m.engine.last_pass.experts_loaded, m.engine.last_pass.bytes_from_ram))
            return out, counts
        calls.clear(), kda_calls.clear(), mla_calls.clear(), mlp_calls.clear()
        whole, whole_counts = run()
        assert moe_layers < m.config.num_layers and len(mlp_calls) == 5 * (m.config.num_layers - moe_layers)
        assert len(calls) == 5 * moe_layers and len(kda_calls) == 5 * kda_layers  # every pass, every such layer
        mla_layers = m.config.num_layers - kda_layers
        assert mla_layers and len(mla_calls) == 2 * mla_layers  # the passes of one row a sequence
        with monkeypatch.context() as p:
            apart(p)
            separate, separate_counts = run()
        assert all(torch.equal(x, y) for x, y in zip(whole, separate)) and whole_counts == separate_counts
        layer = next(i for i in range(m.config.num_layers) if m.config.is_moe(i))
        held = m.engine.provider.held_experts(layer)
        saved = dict(held)
        try:
            for e in held:  # every expert of the layer the same: the pass must see the swap
                held[e] = held[1]
            calls.clear()
            swapped, _ = run()
            with monkeypatch.context() as p:
                apart(p)
                swapped_apart, _ = run()
            assert calls and all(torch.equal(x, y) for x, y in zip(swapped, swapped_apart))
            assert not torch.equal(swapped[0], whole[0])
        finally:
            held.update(saved)

        class Watch(PassObserver):
            def __init__(self):
                self.layers = []

            def on_route(self, layer, ids, x):
                self.layers.append(layer)
        calls.clear()
        with m.engine.observe(Watch()) as watch:
            m.engine.forward(ids[:2], m.engine.new_state())
        assert not calls and len(watch.layers) == moe_layers


def test_kda_steps_sequences_of_equal_length_together_like_each_alone():
    """Sequences with the same number of new rows step together (adjacent or not, with drafts kept
    for rollback); a long prompt piece goes alone. Each equals that sequence run alone."""
    cfg = k3_config()
    gen = torch.Generator().manual_seed(5)
    attn = KDAttention(cfg)
    bind(attn, random_weights(attn, gen))
    lengths, keep = [1, 3, 1, 20, 3, 2, 2], [False, False, False, False, False, True, True]
    prompts = [torch.randn(4 + i, cfg.hidden_size, generator=gen) for i in range(len(lengths))]
    xs = [torch.randn(n, cfg.hidden_size, generator=gen) for n in lengths]

    def warm(i):
        st = attn.new_state(torch.float32)
        attn(prompts[i], [Rows(st, len(prompts[i]), False)], 8)
        return st
    together = [warm(i) for i in range(len(lengths))]
    out = attn(torch.cat(xs), [Rows(st, n, k) for st, n, k in zip(together, lengths, keep)], 8)
    start = 0
    for i, (n, k) in enumerate(zip(lengths, keep)):
        st = warm(i)
        want = attn(xs[i], [Rows(st, n, k)], 8)
        assert (out[start:start + n] - want).abs().max() < 1e-5
        assert (together[i].S - st.S).abs().max() < 1e-5 and (together[i].conv - st.conv).abs().max() < 1e-6
        assert (together[i].pending is not None) == k
        start += n
    # a kept group rolls back like a sequence alone
    from deltafin.model.kda_recurrence import kda_rollback
    st = warm(5)
    attn(xs[5], [Rows(st, 2, True)], 8)
    kda_rollback(st, 1)
    kda_rollback(together[5], 1)
    assert (together[5].S - st.S).abs().max() < 1e-5 and (together[5].conv - st.conv).abs().max() < 1e-5


def test_grouped_routing_masks_groups():
    from deltafin.model.moe import route
    cfg = k3_config(num_expert_group=4, topk_group=2, num_experts_per_token=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, cfg.hidden_size, generator=gen)
    gate = torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen)
    bias = torch.randn(cfg.num_experts, generator=gen) * 0.1
    ids, _ = route(cfg, x, gate, bias)
    for t in range(6):
        s = [sigmoid((x[t] @ gate[e]).item()) + bias[e].item() for e in range(8)]
        groups = [sorted(s[2 * g:2 * g + 2], reverse=True) for g in range(4)]
        gscore = [sum(gr[:2]) for gr in groups]
        keep = sorted(range(4), key=lambda g: -gscore[g])[:2]
        allowed = [e for e in range(8) if e // 2 in keep]
        want = sorted(sorted(allowed, key=lambda e: -s[e])[:3])
        assert sorted(ids[t].tolist()) == want


def test_attn_res_mix_matches_loop():
    gen = torch.Generator().manual_seed(4)
    H = 16
    blocks = [torch.randn(2, H, generator=gen) for _ in range(3)]
    p = torch.randn(2, H, generator=gen)
    w_proj, w_norm = torch.randn(1, H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
    got = attn_res(p, blocks, w_proj, w_norm, 1e-5)
    for t in range(2):
        values = [b[t] for b in blocks] + [p[t]]
        scores = []
        for v in values:
            r = math.sqrt(sum(a * a for a in v.tolist()) / H + 1e-5)
            scores.append(sum(v[d].item() / r * w_norm[d].item() * w_proj[0, d].item() for d in range(H)))
        m = max(scores)
        e = [math.exp(s - m) for s in scores]
        want = sum(ei / sum(e) * v for ei, v in zip(e, values))
        assert (got[t] - want).abs().max() < 1e-5


def _sorted_reference(z, ids, weights, stack, act):
    """Each (token, expert) pair on its own, rounded as a bf16 product is: input and result to bf16,
    sums in fp32."""
    inter = stack.w2.shape[2]
    y = torch.zeros(z.shape, dtype=torch.float32)
    bf = torch.bfloat16
    for t in range(ids.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gu = (z[t].to(bf).float() @ stack.w13[e].float().t()).to(bf).float()
            a = act(gu[:inter], gu[inter:]).to(bf).float()
            y[t] += weights[t, j] * (a @ stack.w2[e].float().t()).to(bf).float()
    return y


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_sorted_grouped_gemm_matches_each_pair(device):
    """The grouped-GEMM path (pairs sorted by expert; torch's own fallback runs it on the CPU) against
    every pair computed alone, for rows that choose some experts many times and others never."""
    from deltafin.kernels.grouped import sorted_mlp
    from deltafin.model.moe import glu
    gen = torch.Generator().manual_seed(5)
    E, I, H, T, k = 8, 64, 96, 40, 3
    stack = ExpertStack((torch.randn(E, 2 * I, H, generator=gen) / H ** .5).bfloat16(),
                        (torch.randn(E, H, I, generator=gen) / I ** .5).bfloat16())
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(T)])  # experts 6, 7 unchosen
    weights, z = torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen)
    for act in ("silu", "situ"):
        cfg = type("C", (), {"hidden_act": act, "situ_beta": 4.0, "situ_linear_beta": 25.0})()
        ref = _sorted_reference(z, ids, weights, stack, lambda g, u: glu(cfg, g, u))
        dev = ExpertStack(stack.w13.to(device), stack.w2.to(device))
        # only a model whose products are bf16 gives its experts to the grouped GEMMs (they round rows to bf16)
        assert not dev.sorted_gemm() and not ExpertStack(stack.w13, stack.w2, bf16_products=True).sorted_gemm()
        if device == "cuda":
            assert ExpertStack(dev.w13, dev.w2, bf16_products=True).sorted_gemm() == (
                torch.cuda.get_device_capability() >= (8, 0))
        got = sorted_mlp(cfg, z.to(device), ids.to(device), weights.to(device), dev,
                         lambda g, u: glu(cfg, g, u)).cpu()
        assert got.dtype == torch.float32 and got.shape == (T, H)
        # the same roundings; another summation order may move a bf16 result by one step
        assert ((got - ref).norm() / ref.norm()).item() < 4e-3, act


def test_stacked_and_joined_view_slot_entries_without_copies():
    """The pass's states as one tensor only when they are consecutive entries of one buffer (a decode
    graph's slots), also for views made under inference mode, which keep no _base."""
    from deltafin.model.state import joined, stacked
    with torch.inference_mode():
        slots, pos = torch.zeros(4, 3, 2), torch.arange(10)
        run = stacked([slots[1], slots[2]])
        assert run.shape == (2, 3, 2)
        run.fill_(1.0)  # writes the slots themselves
        assert slots[:, 0, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
        assert stacked([slots[2], slots[1]]) is None and stacked([slots[1], slots[1].clone()]) is None
        assert stacked([slots[0], slots[2]]) is None
        assert joined([pos[0:2], pos[2:4]]).tolist() == [0, 1, 2, 3]
        assert joined([pos[0:2], pos[3:5]]) is None and joined([pos[0:2], pos[2:4].clone()]) is None
