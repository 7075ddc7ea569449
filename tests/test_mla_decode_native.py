"""The native MLA decode attention (cpu_native.mla_decode_attend) against mla.py's torch code."""
from __future__ import annotations

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


@pytest.mark.parametrize("nh,r,rope", [(2, 8, 4), (11, 64, 16)])  # 11 heads: two claims of a sequence
def test_native_attention_matches_the_torch_code_and_each_sequence_alone(nh, r, rope):
    """Caches of 1 to 70 rows (several blocks of rows, a grown running max): each sequence's latents
    follow _attend_latent within float32 rounding, and are the same bits alone, among others and on any
    number of threads."""
    lengths = [1, 5, 17, 70]
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
