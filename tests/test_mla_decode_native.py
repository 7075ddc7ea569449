"""The native MLA decode attention (cpu_native.mla_decode_attend) against mla.py's torch code."""
from __future__ import annotations

import contextlib

import pytest
import torch

from deltafin.kernels import cpu_native
from deltafin.model import mla
from deltafin.model.binding import bind
from deltafin.model.mla import MLAttention
from deltafin.model.state import MLAState, Rows
from test_model_pieces import k3_config, random_weights

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


def caches(lengths: list[int], r: int, rope: int, seed: int) -> list[MLAState]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        st = MLAState(ckv=torch.zeros(0, r), krot=torch.zeros(0, rope))
        st.append(torch.randn(n, r, generator=g), torch.randn(n, rope, generator=g) * 3)
        out.append(st)
    return out


# 11 heads: two claims of a sequence (8 and 3 heads); widths of multiples of 16 take the AVX-512 kernel
# where the CPU has it (8 and 4 heads a claim: its fixed forms), the plain loops under limit_simd("avx2")
@pytest.mark.parametrize("simd", ["widest", "avx2"])
@pytest.mark.parametrize("nh,r,rope", [(2, 8, 4), (11, 64, 16), (4, 32, 16)])
def test_native_attention_matches_the_torch_code_and_each_sequence_alone(nh, r, rope, simd):
    """Caches of 1 to 4,300 rows (several blocks of rows, a grown running max, a last block of one row; on
    the AVX-512 kernel a long cache in chunks merged after): each sequence's latents follow _attend_latent
    within float32 rounding, and are the same bits alone, among others and on any number of threads."""
    if simd == "avx2" and cpu_native.simd() != "avx512":
        pytest.skip("the plain loops are what this CPU runs anyway")
    with cpu_native.limit_simd(simd) if simd == "avx2" else contextlib.nullcontext():
        _native_attention_matches(nh, r, rope)


def _native_attention_matches(nh, r, rope):
    lengths = [1, 5, 17, 70, 289, 4300]
    states = caches(lengths, r, rope, 1)
    g = torch.Generator().manual_seed(2)
    q_lat, q_rot = torch.randn(len(lengths), nh, r, generator=g), torch.randn(len(lengths), nh, rope, generator=g)
    attn = MLAttention(k3_config())  # for its torch code: the scale below stands for its own
    scale = attn.scale = 0.3
    views = [st.view() for st in states]
    together = cpu_native.mla_decode_attend(q_lat, q_rot, [v[0] for v in views], [v[1] for v in views], scale,
                                            threads=2)
    for b, st in enumerate(states):
        want = attn._attend_latent(q_lat[b].unsqueeze(1), q_rot[b].unsqueeze(0), st)[:, 0]
        assert (together[b] - want).abs().max() <= 1e-5 * want.abs().max()
        for threads in (1, 3):
            alone = cpu_native.mla_decode_attend(q_lat[b:b + 1], q_rot[b:b + 1], [views[b][0]], [views[b][1]], scale,
                                                 threads=threads)
            assert torch.equal(alone[0], together[b])


def test_native_attention_refuses_bad_inputs():
    ckv, krot = torch.zeros(3, 8), torch.zeros(3, 4)
    good = dict(q_lat=torch.zeros(1, 2, 8), q_rot=torch.zeros(1, 2, 4), ckvs=[ckv], krots=[krot], scale=1.0)
    assert cpu_native.mla_decode_attend(**good).shape == (1, 2, 8)
    bad = [dict(q_lat=torch.zeros(1, 2, 8, dtype=torch.float64)), dict(q_rot=torch.zeros(1, 3, 4)),
           dict(q_lat=torch.zeros(2, 2, 8)), dict(ckvs=[torch.zeros(3, 9)]), dict(krots=[torch.zeros(2, 4)]),
           dict(ckvs=[ckv.bfloat16()]), dict(krots=[torch.zeros(4, 3).t()]), dict(ckvs=[], krots=[]),
           dict(krots=[krot, krot])]
    for change in bad:
        with pytest.raises(ValueError, match="MLA attention"):
            cpu_native.mla_decode_attend(**{**good, **change})


def test_decode_pass_takes_one_native_call_and_matches_the_torch_path(monkeypatch):
    """An MLA layer, three sequences after prompts of different lengths, two decode passes: the native
    call runs once a pass (not for a prompt or a draft check) and the outputs and caches follow the
    torch path's within float32 rounding."""
    cfg = k3_config()
    attn = MLAttention(cfg)
    bind(attn, random_weights(attn, torch.Generator().manual_seed(3), scale=2.0))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(n, cfg.hidden_size, generator=gen) for n in (2, 7, 4)]
    steps = [torch.randn(3, cfg.hidden_size, generator=gen) for _ in range(2)]
    draft = torch.randn(2, cfg.hidden_size, generator=gen)
    calls = []
    real = cpu_native.mla_decode_attend
    monkeypatch.setattr(cpu_native, "mla_decode_attend", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))

    def run(native: bool):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(mla, "_native_attend_applies", lambda *a: False)
            states = [attn.new_state(torch.float32) for _ in prompts]
            for st, p in zip(states, prompts):
                attn(p, [Rows(st, len(p), False)], 4)
            outs = [attn(x, [Rows(st, 1, False) for st in states], 4) for x in steps]
            outs.append(attn(draft, [Rows(states[0], 2, True)], 4))
        return torch.cat(outs), states
    want, _ = run(False)
    assert calls == []
    got, states = run(True)
    assert calls == [3, 3]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert [st.length for st in states] == [2 + 2 + 2, 7 + 2, 4 + 2]
    # a cache past NATIVE_ATTEND_MAX_WORK: torch's matrix products (faster there)
    width = cfg.mla_num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    monkeypatch.setattr(mla, "NATIVE_ATTEND_MAX_WORK", 8 * width)
    calls.clear()
    states = [attn.new_state(torch.float32) for _ in range(2)]
    attn(prompts[1], [Rows(states[0], 7, False)], 4)
    attn(prompts[0], [Rows(states[1], 2, False)], 4)
    attn(steps[0][:2], [Rows(st, 1, False) for st in states], 4)
    assert calls == [2]  # caches of 8 and 3 rows
    attn(steps[1][:2], [Rows(st, 1, False) for st in states], 4)
    assert calls == [2]  # 9 rows: past the limit


@pytest.mark.skipif(cpu_native.simd() != "avx512", reason="the blocked attention kernel needs AVX-512")
def test_the_blocked_kernel_takes_caches_of_any_length(monkeypatch):
    """Latent and rope widths of multiples of 16 on an AVX-512 CPU: the native attention (faster than
    torch's products at every length) takes a cache past NATIVE_ATTEND_MAX_WORK; the plain loops
    (limit_simd("avx2")) leave it to torch."""
    cfg = kimi_linear_mla(qk_rope_head_dim=16)
    assert cpu_native.mla_attend_blocked(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    monkeypatch.setattr(mla, "NATIVE_ATTEND_MAX_WORK", 0)
    assert mla.native_attend_reaches(cfg, 10_000)
    with cpu_native.limit_simd("avx2"):
        assert not cpu_native.mla_attend_blocked(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        assert not mla.native_attend_reaches(cfg, 1)
    assert not cpu_native.mla_attend_blocked(32, 8)


def kimi_linear_mla(**over):
    """A Kimi Linear MLA shape (plain query projection, no output gate) whose products take int8 groups of 32."""
    from deltafin.config import parse_config
    return parse_config({"architectures": ["KimiLinearForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "head_dim": 16, "intermediate_size": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": None, "num_experts": 4,
                         "num_experts_per_token": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                         "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                                                "head_dim": 16, "short_conv_kernel_size": 4}, **over})


def mla_layer(cfg, codec: str, seed: int) -> MLAttention:
    """A bound MLA layer with its projections as a store holds them: bf16, or grouped int8 laid out as the
    RAM tier lays it out (interleaved, but kv_b, which the transposed products read by columns)."""
    from deltafin.io.ram import cpu_layout
    from deltafin.kernels import quantize
    attn = MLAttention(cfg)
    w = random_weights(attn, torch.Generator().manual_seed(seed), scale=2.0)
    for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        w[name] = w[name].bfloat16() if codec == "bf16" else cpu_layout(name, quantize(w[name], "int8", 32))
    bind(attn, w)
    return attn


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_an_mla_layers_norm_attention_and_sum_in_one_call_equal_the_calls_apart(monkeypatch, codec):
    """MLAttention.block (cpu_native.mla_block: the norm, the projections, the new cache rows, the absorbed
    products, the attention, the output projection and the residual sum in one native call) against the
    layer's own calls, for three sequences with caches of other lengths (one grown past its capacity),
    two steps: the same outputs, cache rows and lengths bit for bit, the weights checked once. Rows of
    several tokens, a cache past NATIVE_ATTEND_MAX_WORK, float32 weights and a query low-rank projection
    take the calls apart (None)."""
    import copy

    from deltafin.model.ops import rms_norm
    cfg = kimi_linear_mla()
    attn = mla_layer(cfg, codec, 5)
    gen = torch.Generator().manual_seed(6)
    norm = (torch.rand(cfg.hidden_size, generator=gen) + 0.5).to(torch.bfloat16)
    checks = []
    real = cpu_native.mla_weights
    monkeypatch.setattr(cpu_native, "mla_weights", lambda *a: checks.append(1) or real(*a))
    states = [attn.new_state(torch.float32) for _ in range(3)]
    for st, n in zip(states, (3, 16, 9)):  # 16: a full buffer, which the next row grows
        attn(torch.randn(n, cfg.hidden_size, generator=gen), [Rows(st, n, False)], 4)
    for _ in range(2):
        h = torch.randn(3, cfg.hidden_size, generator=gen) * 2
        apart_states = copy.deepcopy(states)
        whole = attn.block(h, norm, 1e-5, [Rows(st, 1, False) for st in states])
        apart = h + attn(rms_norm(h, norm, 1e-5), [Rows(st, 1, False) for st in apart_states], 4)
        assert torch.equal(whole, apart)
        for st, ref in zip(states, apart_states):
            assert st.length == ref.length and all(torch.equal(a, b) for a, b in zip(st.view(), ref.view()))
    assert [st.length for st in states] == [5, 18, 11] and len(checks) == 1
    assert attn.block(h[:2], norm, 1e-5, [Rows(states[0], 2, False)]) is None
    width = cfg.mla_num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    with monkeypatch.context() as m:
        m.setattr(mla, "NATIVE_ATTEND_MAX_WORK", 11 * width)  # the cache of 11 rows would grow to 12
        assert attn.block(h, norm, 1e-5, [Rows(st, 1, False) for st in states]) is None
    assert [st.length for st in states] == [5, 18, 11]  # nothing written by a pass that did not run
    float32 = MLAttention(cfg)
    bind(float32, random_weights(float32, gen))
    assert float32.block(h[:1], norm, 1e-5, [Rows(float32.new_state(torch.float32), 1, False)]) is None
    low_rank = MLAttention(k3_config())
    assert low_rank.block(torch.zeros(1, k3_config().hidden_size), norm, 1e-5,
                          [Rows(low_rank.new_state(torch.float32), 1, False)]) is None


def test_mla_block_refuses_what_does_not_fit():
    nh, nope, rope, r, dv, H = 2, 8, 4, 8, 8, 16

    def bf16(out, n):
        return torch.zeros(out, n, dtype=torch.bfloat16), None
    heads_k = cpu_native.dense_heads([torch.zeros(nope, r, dtype=torch.bfloat16)] * nh, [None] * nh)
    heads_v = cpu_native.dense_heads([torch.zeros(dv, r, dtype=torch.bfloat16)] * nh, [None] * nh)
    good_w = dict(norm=torch.ones(H), q_proj=bf16(nh * (nope + rope), H), kv_a=bf16(r + rope, H),
                  latent_norm=torch.ones(r), heads_k=heads_k, heads_v=heads_v, o_proj=bf16(H, nh * dv), nope=nope,
                  rope=rope)
    good = dict(h=torch.zeros(1, H), ckvs=[torch.zeros(4, r)], krots=[torch.zeros(4, rope)], lengths=[4])

    def block(weights, h, ckvs, krots, lengths):
        return cpu_native.mla_block(h, 1e-5, 1e-6, cpu_native.mla_weights(**weights), ckvs, krots, lengths, 0.5)
    assert torch.equal(block(good_w, **good), torch.zeros(1, H))
    int8 = (torch.zeros(r + rope, H, dtype=torch.int8), torch.ones(r + rope, 1))
    for change, message in [(dict(q_proj=bf16(nh * (nope + rope) + 1, H)), "q_proj"), (dict(kv_a=int8), "one kind"),
                            (dict(o_proj=bf16(H, nh * dv + 1)), "o_proj"), (dict(norm=torch.ones(H + 1)), "norm"),
                            (dict(latent_norm=torch.ones(r + 1)), "kv_a_proj"), (dict(nope=nope + 1), "q_proj"),
                            (dict(heads_v=cpu_native.dense_heads([torch.zeros(dv, r + 8, dtype=torch.bfloat16)] * nh,
                                                                 [None] * nh)), "W_v"),
                            (dict(heads_v=cpu_native.dense_heads([torch.zeros(dv, r, dtype=torch.bfloat16)], [None])),
                             "as many W_v heads")]:
        with pytest.raises(ValueError, match=message):
            block({**good_w, **change}, **good)
    for change, message in [(dict(h=torch.zeros(1, H + 1)), "float32 rows"), (dict(lengths=[5]), "no room"),
                            (dict(lengths=[0]), "no room"), (dict(ckvs=[torch.zeros(4, r).bfloat16()]), "latent cache"),
                            (dict(krots=[torch.zeros(4, rope + 1)]), "rope-key cache"), (dict(lengths=[4, 4]), "one cache")]:
        with pytest.raises(ValueError, match=message):
            block(good_w, **{**good, **change})
