"""The native KDA decode step (cpu_native.kda_steps) against kda.py's torch code."""
from __future__ import annotations

import pytest
import torch

import deltafin
from conftest import KL_CODE_TINY
from deltafin.config import parse_config
from deltafin.kernels import cpu_native
from deltafin.model import kda
from deltafin.model.binding import bind
from deltafin.model.kda import KDAttention
from deltafin.model.state import Rows
from test_model_pieces import k3_config, random_weights

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


def kimi_linear_config(heads: int, head_dim: int):
    """A Kimi Linear attention shape: low-rank gate, softplus decay (no lower bound)."""
    return parse_config({"architectures": ["KimiLinearForCausalLM"], "vocab_size": 64, "hidden_size": 48,
                         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                         "head_dim": 8, "intermediate_size": 32, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                         "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": None, "num_experts": 4,
                         "num_experts_per_token": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                         "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": heads,
                                                "head_dim": head_dim, "short_conv_kernel_size": 4}})


def torch_path(monkeypatch):
    monkeypatch.setattr(kda, "_native_steps", lambda *a: False)


def layer(cfg, seed: int, small_dtype: torch.dtype) -> KDAttention:
    """A bound KDA layer; the conv weights, A_log and o_norm in `small_dtype` (a store keeps them bf16)."""
    attn = KDAttention(cfg)
    w = random_weights(attn, torch.Generator().manual_seed(seed))
    for name in ("q_conv", "k_conv", "v_conv", "A_log", "o_norm"):
        w[name] = w[name].to(small_dtype)
    bind(attn, w)
    return attn


@pytest.mark.parametrize("cfg,small_dtype,threads", [
    (k3_config(), torch.float32, 1),  # bounded gate, full-rank output gate
    (kimi_linear_config(2, 16), torch.bfloat16, 1),  # softplus decay, low-rank gate, bf16 small weights
    (kimi_linear_config(4, 128), torch.bfloat16, 2),  # S large enough for the heads to be split over threads
])
def test_native_decode_steps_match_the_torch_path(monkeypatch, cfg, small_dtype, threads):
    """A prompt, then decode steps: the native recurrence's outputs, S and conv tails follow the torch
    code's (chunked for the prompt, step by step after) within float32 rounding."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    attn = layer(cfg, 3, small_dtype)
    gen = torch.Generator().manual_seed(4)
    n = kda.RECURRENT_MAX_ROWS + 24  # a prompt the torch code takes in chunks
    prompt = torch.randn(n, cfg.hidden_size, generator=gen)
    steps = [torch.randn(1, cfg.hidden_size, generator=gen) for _ in range(5)]

    def run(native: bool):
        with monkeypatch.context() as m:
            if not native:
                torch_path(m)
            st = attn.new_state(torch.float32)
            outs = [attn(prompt, [Rows(st, n, False)], 4)] + [attn(x, [Rows(st, 1, False)], 4) for x in steps]
        return torch.cat(outs), st
    want, st_want = run(False)
    got, st_got = run(True)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (st_got.S - st_want.S).abs().max() <= 1e-5 * st_want.S.abs().max()
    assert torch.equal(st_got.conv, st_want.conv)  # the tails are copies of the inputs


def test_native_recurrence_is_taken_where_it_applies(monkeypatch):
    """Decode steps, drafts and prompt pieces of any length take one native call a pass; the torch code
    only where the native call cannot run (here: a state a recorded decode graph updates in place)."""
    cfg = kimi_linear_config(2, 16)
    attn = layer(cfg, 5, torch.bfloat16)
    calls = []
    real = cpu_native.kda_steps
    monkeypatch.setattr(cpu_native, "kda_steps", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    long = kda.RECURRENT_MAX_ROWS + 1
    x = torch.randn(long + 3, cfg.hidden_size)
    st = attn.new_state(torch.float32)
    attn(x[:3], [Rows(st, 3, False)], 4)
    attn(x[:long], [Rows(attn.new_state(torch.float32), long, False)], 4)
    attn(x[:long + 3], [Rows(st, 1, False), Rows(attn.new_state(torch.float32), long, False),
                        Rows(attn.new_state(torch.float32), 2, True)], 4)
    assert calls == [[3], [long], [1, long, 2]]
    odd = attn.new_state(torch.float32)
    odd.in_place = True
    attn(x[:3], [Rows(st, 1, False), Rows(odd, 2, False)], 4)
    assert len(calls) == 3


def test_native_draft_pass_rolls_back_like_the_torch_code():
    """A pass of drafts on the native path, then a rollback to each possible accepted count: the state
    is the torch path's after the same rollback, and a native pass of only the accepted rows' (within
    the rounding of torch's products of these float32 weights over 4 rows instead of fewer)."""
    from deltafin.model.kda_recurrence import kda_rollback
    cfg = k3_config()
    attn = layer(cfg, 13, torch.float32)
    gen = torch.Generator().manual_seed(14)
    prompt, drafts = torch.randn(5, cfg.hidden_size, generator=gen), torch.randn(4, cfg.hidden_size, generator=gen)

    def after(native: bool, keep: int):
        with pytest.MonkeyPatch.context() as m:
            if not native:
                torch_path(m)
            st = attn.new_state(torch.float32)
            attn(prompt, [Rows(st, 5, False)], 4)
            attn(drafts, [Rows(st, 4, True)], 4)
            p = st.pending
            kda_rollback(st, keep)
        return st, p
    for keep in range(5):
        want, _ = after(False, keep)
        got, p = after(True, keep)
        assert got.pending is None
        assert (got.S - want.S).abs().max() <= 1e-5 * want.S.abs().max()
        assert (got.conv - want.conv).abs().max() <= 1e-5 * want.conv.abs().max()
        st = attn.new_state(torch.float32)  # the accepted rows alone, natively
        attn(prompt, [Rows(st, 5, False)], 4)
        if keep:
            attn(drafts[:keep], [Rows(st, keep, False)], 4)
        assert (got.S - st.S).abs().max() <= 1e-6 * st.S.abs().max()
        assert (got.conv - st.conv).abs().max() <= 1e-6 * st.conv.abs().max()
        assert "native" in p  # the draft pass took the native call


def test_a_pass_of_decoding_sequences_and_prompt_pieces_equals_each_alone():
    """Sequences decoding next to a prompt piece and a draft check, in one native call, give what each
    gives alone, states included (within float32 rounding: torch's products of these float32 weights
    may round an 8-row product differently from a 1-row one)."""
    cfg = kimi_linear_config(2, 16)
    attn = layer(cfg, 8, torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randn(3, cfg.hidden_size, generator=gen) for _ in range(3)]
    x = torch.randn(1 + 4 + 1 + 2, cfg.hidden_size, generator=gen)
    pieces = [(0, 0, 1, False), (None, 1, 4, False), (1, 5, 1, False), (2, 6, 2, True)]  # (prompt, row, n, keep)

    def state(i):
        st = attn.new_state(torch.float32)
        if i is not None:
            attn(prompts[i], [Rows(st, 3, False)], 4)
        return st
    together = [state(i) for i, _, _, _ in pieces]
    out = attn(x, [Rows(st, n, keep) for st, (_, _, n, keep) in zip(together, pieces)], 4)
    for st, (i, row, n, keep) in zip(together, pieces):
        alone_st = state(i)
        alone = attn(x[row:row + n], [Rows(alone_st, n, keep)], 4)
        assert (out[row:row + n] - alone).abs().max() <= 1e-5 * alone.abs().max()
        assert (st.S - alone_st.S).abs().max() <= 1e-5 * alone_st.S.abs().max()
        assert (st.conv - alone_st.conv).abs().max() <= 1e-5 * alone_st.conv.abs().max()


def test_a_batch_of_decoding_sequences_equals_each_alone():
    """Each sequence of a decode pass steps its own state (torch's float32 matmuls of the projections
    may round a 3-row product differently from a 1-row one, hence the tolerance)."""
    cfg = kimi_linear_config(2, 16)
    attn = layer(cfg, 6, torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randn(2 + i, cfg.hidden_size, generator=gen) for i in range(3)]
    x = torch.randn(3, cfg.hidden_size, generator=gen)

    def warm(i):
        st = attn.new_state(torch.float32)
        attn(prompts[i], [Rows(st, len(prompts[i]), False)], 4)
        return st
    together = [warm(i) for i in range(3)]
    out = attn(x, [Rows(st, 1, False) for st in together], 4)
    for i in range(3):
        st = warm(i)
        alone = attn(x[i:i + 1], [Rows(st, 1, False)], 4)
        assert (out[i:i + 1] - alone).abs().max() <= 1e-5 * alone.abs().max()
        assert (together[i].S - st.S).abs().max() <= 1e-5 * st.S.abs().max()
        assert (together[i].conv - st.conv).abs().max() <= 1e-5 * st.conv.abs().max()


def test_native_step_refuses_bad_inputs():
    nh, d, K = 2, 8, 4
    D = nh * d
    good = dict(xin=torch.zeros(1, 3, D), counts=[1], convs=[torch.zeros(3, K - 1, D)], conv_w=(torch.zeros(D, K),) * 3,
                r=torch.zeros(1, D), dt_bias=torch.zeros(D), a_log=torch.zeros(nh), b=torch.zeros(1, nh),
                lower_bound=None, gate=torch.zeros(1, D), o_norm=torch.ones(d), eps=1e-5,
                states=[torch.zeros(nh, d, d)])
    assert cpu_native.kda_steps(**good).shape == (1, nh, d)
    two = dict(xin=torch.zeros(2, 3, D), r=torch.zeros(2, D), b=torch.zeros(2, nh), gate=torch.zeros(2, D))
    bad = [dict(states=[torch.zeros(nh, d, d, dtype=torch.float64)]), dict(states=[torch.zeros(nh, d, d + 1)]),
           dict(states=[torch.zeros(1, 300, 300)]), dict(convs=[torch.zeros(3, K - 1, D + 1)]),
           dict(xin=torch.zeros(1, 3, D, dtype=torch.bfloat16)), dict(r=torch.zeros(1, D + 1)),
           dict(conv_w=(torch.zeros(D, K, dtype=torch.float16),) * 3),
           dict(conv_w=(torch.zeros(D, K), torch.zeros(D, K, dtype=torch.bfloat16), torch.zeros(D, K))),
           dict(o_norm=torch.ones(d + 1)), dict(a_log=torch.zeros(nh, 2)), dict(gate=torch.zeros(1, 2 * D)[:, ::2]),
           # every sequence's state is checked, not only the first one's
           dict(states=[torch.zeros(nh, d, d), torch.zeros(nh, d, d).transpose(1, 2)], counts=[1, 1],
                convs=[torch.zeros(3, K - 1, D)] * 2, **two),
           dict(states=[torch.zeros(nh, d, d), torch.zeros(nh, d, d)], counts=[1, 1],
                convs=[torch.zeros(3, K - 1, D), torch.zeros(3, K - 1, D, dtype=torch.bfloat16)], **two),
           dict(states=[torch.zeros(nh, d, d)] * 2, counts=[1, 1]),  # tails for one sequence, states for two
           dict(counts=[2]), dict(counts=[0], **{k: v[:0] for k, v in two.items()}),  # rows and counts disagree
           dict(states=[], convs=[], counts=[])]
    for change in bad:
        with pytest.raises(ValueError, match="KDA step"):
            cpu_native.kda_steps(**{**good, **change})


@pytest.mark.skipif(not (KL_CODE_TINY / "config.json").exists(), reason="kl-code-tiny is not on this machine")
def test_trained_model_decodes_the_same_with_the_native_step(monkeypatch):
    """16 greedy tokens of the trained kl-code-tiny: the same tokens, logits within float32 rounding."""
    model = deltafin.load(KL_CODE_TINY, stream="off", ram_budget="0")
    prompt = model.encode("def fibonacci(n):\n    ")

    def greedy(native: bool):
        with monkeypatch.context() as m:
            if not native:
                torch_path(m)
            st = model.new_state()
            rows = [model.forward(prompt, st, last_only=True)[-1]]
            for _ in range(16):
                rows.append(model.forward([int(rows[-1].argmax())], st, last_only=True)[-1])
        return torch.stack(rows)
    want, got = greedy(False), greedy(True)
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _random_steps(counts: list[int], nh: int, d: int, K: int, seed: int):
    """Arguments of kda_steps for sequences of counts[i] new rows, and their states (conv tails, S)."""
    D, B, T = nh * d, len(counts), sum(counts)
    g = torch.Generator().manual_seed(seed)
    args = dict(xin=torch.randn(T, 3, D, generator=g), counts=counts,
                conv_w=tuple(torch.randn(D, K, generator=g) for _ in range(3)),
                r=torch.randn(T, D, generator=g), dt_bias=torch.randn(D, generator=g).bfloat16(),
                a_log=torch.randn(nh, generator=g), b=torch.randn(T, nh, generator=g), lower_bound=None,
                gate=torch.randn(T, D, generator=g), o_norm=torch.rand(d, generator=g).bfloat16(), eps=1e-5)
    return args, [torch.randn(3, K - 1, D, generator=g) for _ in range(B)], [torch.randn(nh, d, d, generator=g)
                                                                             for _ in range(B)]


def test_native_step_gives_the_same_bits_on_any_number_of_threads():
    """Each (sequence, head) is one thread's work from start to end, so the split cannot change a result."""
    args, conv0, S0 = _random_steps([1, 3, 1], 8, 128, 4, 11)  # states large enough to be shared between threads
    results = []
    for threads in (1, 2, 3):
        convs, states = [c.clone() for c in conv0], [S.clone() for S in S0]
        o = cpu_native.kda_steps(**args, convs=convs, states=states, threads=threads)
        results.append((o, convs, states))
    for o, convs, states in results[1:]:
        assert torch.equal(o, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(convs + states, results[0][1] + results[0][2]))
    assert not torch.equal(results[0][2][0], S0[0])  # the state moved


def test_a_sequence_steps_the_same_bits_alone_as_among_others():
    """One call for a pass's sequences (decoding ones and prompt pieces) gives each of them what a call
    for it alone gives, and a prompt piece of n rows what n calls of one row give."""
    counts = [1, 5, 1, 3]
    args, conv0, S0 = _random_steps(counts, 4, 32, 4, 12)
    convs, states = [c.clone() for c in conv0], [S.clone() for S in S0]
    together = cpu_native.kda_steps(**args, convs=convs, states=states, threads=2)
    first = 0
    for i, n in enumerate(counts):
        rows = slice(first, first + n)
        one = {k: (v[rows] if k in ("xin", "r", "b", "gate") else v) for k, v in args.items() if k != "counts"}
        conv, S = conv0[i].clone(), S0[i].clone()
        alone = cpu_native.kda_steps(**one, counts=[n], convs=[conv], states=[S], threads=1)
        assert torch.equal(alone, together[rows])
        assert torch.equal(conv, convs[i]) and torch.equal(S, states[i])
        conv, S = conv0[i].clone(), S0[i].clone()
        for t in range(n):
            step = {k: (v[t:t + 1] if k in ("xin", "r", "b", "gate") else v) for k, v in one.items()}
            assert torch.equal(cpu_native.kda_steps(**step, counts=[1], convs=[conv], states=[S], threads=1)[0],
                               together[first + t])
        first += n


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_every_simd_level_steps_the_same_values(lower_bound):
    """The AVX-512 step (16 channels at a time, exp and log by polynomial) against the AVX2 and portable
    ones (libm's expf and log1pf per channel; the state passes the same loops, so the same bits): equal to
    float32 rounding, outputs and states, over decay inputs wide enough to take softplus' every branch
    (1 + e^r rounding to 1, r past the threshold of 20)."""
    if cpu_native.simd() == "none":
        pytest.skip("native CPU kernels not built")
    args, conv0, S0 = _random_steps([2, 1], 4, 32, 4, 13)
    args["r"] = args["r"] * 12.0
    args["lower_bound"] = lower_bound
    order = ("portable", "avx2", "avx512")
    levels = order[:order.index(cpu_native.simd()) + 1]
    results = {}
    for level in levels:
        convs, states = [c.clone() for c in conv0], [S.clone() for S in S0]
        with cpu_native.limit_simd(level):
            o = cpu_native.kda_steps(**args, convs=convs, states=states, threads=1)
        results[level] = (o, convs, states)
    o0, convs0, states0 = results["portable"]
    for level, (o, convs, states) in results.items():
        assert (o - o0).abs().max() <= 1e-6 * o0.abs().max(), level
        assert all((S - T).abs().max() <= 1e-6 * T.abs().max() for S, T in zip(states, states0)), level
        assert all(torch.equal(c, c0) for c, c0 in zip(convs, convs0)), level  # the tails are the inputs
    if "avx2" in results:
        assert torch.equal(results["avx2"][0], o0)  # AVX2 runs the portable per-channel code


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_kda_layers_norm_attention_and_sum_in_one_call_equal_the_calls_apart(codec):
    """KDAttention.block (cpu_native.kda_block: the norm, the projections, the recurrence, the output
    projection and the residual sum in one native call) against the layer's own calls, for sequences of
    one and of several rows in one pass: the same outputs, S and conv tails bit for bit. A pass that
    keeps rollback states, a full-rank gate or float32 projections take the calls apart (None)."""
    import copy

    from deltafin.kernels import quantize
    from deltafin.model.ops import rms_norm
    cfg = kimi_linear_config(4, 32)
    attn = layer(cfg, 5, torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    norm = (torch.rand(cfg.hidden_size, generator=gen) + 0.5).to(torch.bfloat16)
    assert attn.block(torch.zeros(1, cfg.hidden_size), norm, 1e-5, [Rows(attn.new_state(torch.float32), 1, False)]) is None
    names = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj", "f_b_proj", "g_b_proj", "o_proj")
    bind(attn, {**{n: getattr(attn, n) for n in attn._slot_shapes},
                **{n: getattr(attn, n).to(torch.bfloat16) if codec == "bf16" else quantize(getattr(attn, n), "int8")
                   for n in names}})
    states = []
    for i in range(2):
        st = attn.new_state(torch.float32)
        attn(torch.randn(5 + i, cfg.hidden_size, generator=gen), [Rows(st, 5 + i, False)], 4)
        states.append(st)
    h = torch.randn(3, cfg.hidden_size, generator=gen) * 2
    apart_states = copy.deepcopy(states)
    whole = attn.block(h, norm, 1e-5, [Rows(states[0], 1, False), Rows(states[1], 2, False)])
    apart = h + attn(rms_norm(h, norm, 1e-5), [Rows(apart_states[0], 1, False), Rows(apart_states[1], 2, False)], 4)
    assert torch.equal(whole, apart)
    for st, ref in zip(states, apart_states):
        assert torch.equal(st.S, ref.S) and torch.equal(st.conv, ref.conv)
    assert attn.block(h[:1], norm, 1e-5, [Rows(states[0], 1, True)]) is None
    full_rank = layer(k3_config(), 3, torch.float32)
    assert full_rank.block(torch.zeros(1, k3_config().hidden_size), norm[:0], 1e-5,
                           [Rows(full_rank.new_state(torch.float32), 1, False)]) is None


def test_a_kda_layers_checked_weights_are_kept_while_they_are_the_same_objects(monkeypatch):
    """KDAttention.block checks a layer's weights once (cpu_native.kda_weights) while the bound weights are
    the same objects, checks them again when one is swapped (and computes with the new one), and keeps no
    weight alive."""
    import gc
    import weakref

    from deltafin.kernels import quantize
    from deltafin.model.ops import rms_norm
    cfg = kimi_linear_config(4, 32)
    attn = layer(cfg, 7, torch.float32)
    names = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj", "f_b_proj", "g_b_proj", "o_proj")
    weights = {**{n: getattr(attn, n) for n in attn._slot_shapes}, **{n: quantize(getattr(attn, n), "int8") for n in names}}
    bind(attn, weights)
    checks = []
    real = cpu_native.kda_weights
    monkeypatch.setattr(cpu_native, "kda_weights", lambda *a: checks.append(1) or real(*a))
    gen = torch.Generator().manual_seed(8)
    norm = torch.rand(cfg.hidden_size, generator=gen) + 0.5
    st = attn.new_state(torch.float32)

    def both(h):
        before = (st.S.clone(), st.conv.clone())
        whole = attn.block(h, norm, 1e-5, [Rows(st, 1, False)])
        after = (st.S.clone(), st.conv.clone())
        st.S.copy_(before[0]), st.conv.copy_(before[1])
        apart = h + attn(rms_norm(h, norm, 1e-5), [Rows(st, 1, False)], 4)
        assert torch.equal(whole, apart) and torch.equal(st.S, after[0]) and torch.equal(st.conv, after[1])

    for _ in range(3):
        both(torch.randn(1, cfg.hidden_size, generator=gen))
    assert len(checks) == 1
    swapped = quantize(torch.randn(attn.v_proj.shape, generator=gen) * 0.05, "int8")
    bind(attn, {**weights, "v_proj": swapped})
    both(torch.randn(1, cfg.hidden_size, generator=gen))
    both(torch.randn(1, cfg.hidden_size, generator=gen))
    assert len(checks) == 2
    first = id(weights["q_proj"])
    gone = weakref.ref(swapped)
    bind(attn, {n: torch.zeros(shape) for n, shape in attn._slot_shapes.items()})
    del weights, swapped
    gc.collect()
    assert first not in kda._kept_blocks and gone() is None


def test_kda_block_refuses_what_does_not_fit():
    nh, d, K, H = 2, 8, 4, 16
    D = nh * d

    def bf16(out, n):
        return torch.zeros(out, n, dtype=torch.bfloat16), None
    good = dict(h=torch.zeros(1, H), norm=torch.ones(H), eps=1e-5,
                first=[bf16(D, H), bf16(D, H), bf16(D, H), bf16(nh, H), bf16(d, H), bf16(d, H)],
                second=[bf16(D, d), bf16(D, d)], o_proj=bf16(H, D), counts=[1], convs=[torch.zeros(3, K - 1, D)],
                conv_w=(torch.zeros(D, K),) * 3, dt_bias=torch.zeros(D), a_log=torch.zeros(nh), lower_bound=None,
                o_norm=torch.ones(d), states=[torch.zeros(nh, d, d)])

    def block(h, norm, eps, first, second, o_proj, counts, convs, conv_w, dt_bias, a_log, lower_bound, o_norm, states):
        weights = cpu_native.kda_weights(norm, first, second, o_proj, conv_w, dt_bias, a_log, o_norm)
        return cpu_native.kda_block(h, eps, weights, counts, convs, states, lower_bound)
    assert torch.equal(block(**good), torch.zeros(1, H))
    int8 = (torch.zeros(D, d, dtype=torch.int8), torch.ones(D, 1))
    for change, message in [(dict(h=torch.zeros(1, H, dtype=torch.float64)), "float32 rows"),
                            (dict(norm=torch.ones(H + 1)), "norm"), (dict(counts=[2]), "rows"),
                            (dict(first=good["first"][:5]), "first projections"),
                            (dict(first=[bf16(D, H)] * 6), "first projections"),
                            (dict(second=[bf16(D, d), int8]), "one kind"),
                            (dict(o_proj=bf16(H, D + 1)), "output projection"),
                            (dict(states=[torch.zeros(nh, d, d + 1)]), "KDA step")]:
        with pytest.raises(ValueError, match=message):
            block(**{**good, **change})
