"""One-token CPU passes replayed as their recorded native calls (runtime/cpu_replay.py) against the plain
pass of the same model: the same logits, bit for bit, whatever happened to the states and weights between."""
from __future__ import annotations

import contextlib

import pytest
import torch

import deltafin
from deltafin.kernels import cpu_native
from deltafin.model import moe
from deltafin.runtime.engine import Seq
from deltafin.runtime.pass_stats import PassObserver
from deltafin.settings import Settings, SettingsError

from conftest import KL_CODE_TINY

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")


@pytest.fixture(scope="module", params=["bf16", "q8", "trained"])
def model(request, tiny_kl_path, wide_q8_path):
    """Random bf16 and grouped int8 weights, and the trained model (whose bf16 router bias the MoE call
    reads widened: a tensor made for the call, which the recording must keep)."""
    if request.param == "trained":
        if not (KL_CODE_TINY / "config.json").exists():
            pytest.skip(f"the trained model is not at {KL_CODE_TINY}")
        return deltafin.load(KL_CODE_TINY, device="cpu", stream="off")
    return deltafin.load(tiny_kl_path if request.param == "bf16" else wide_q8_path, device="cpu", stream="off")


def _plain(model, fn):
    """fn() with the model's passes run through its Python."""
    engine = model.engine
    kept, engine.cpu_replay = engine.cpu_replay, None
    try:
        return fn()
    finally:
        engine.cpu_replay = kept


def _step(model, states, ids):
    """One pass of one new token per state; each state's logits row."""
    return [lg[-1] for lg in model.engine.forward_batch([Seq([t], st, logits="last") for t, st in zip(ids, states)])]


def test_a_replayed_decode_equals_the_plain_pass(model):
    """40 greedy tokens (the MLA caches grow twice on the way: each growth records again): every logit
    equal to the plain pass's, and each pass's logits still its own after the passes that followed it."""
    replay = model.engine.cpu_replay
    assert replay is not None
    mine, plain = model.new_state(), model.new_state()
    got = [model.forward([5, 6, 7], mine)[-1]]
    want = [_plain(model, lambda: model.forward([5, 6, 7], plain)[-1])]
    recorded, replayed = replay.recorded, replay.replayed
    for _ in range(40):
        assert torch.equal(got[-1], want[-1])
        got.append(model.forward([int(got[-1].argmax())], mine)[-1])
        want.append(_plain(model, lambda: model.forward([int(want[-1].argmax())], plain)[-1]))
    assert torch.equal(torch.stack(got), torch.stack(want))
    assert replay.replayed - replayed >= 35 and replay.recorded - recorded >= 2 and not replay.failed


def test_a_batch_replays_as_its_sequences_come_and_go(model):
    """Three sequences decoding together, then in another order, then two of them: the same logits as the
    plain pass at each step (a new order or set of states records again)."""
    def states():
        out = []
        for prompt in ([1, 2], [3, 4, 5, 6], [7]):
            st = model.new_state()
            model.forward(prompt, st)
            out.append(st)
        return out
    mine = states()
    plain = _plain(model, states)
    orders = [[0, 1, 2]] * 4 + [[2, 0, 1]] * 3 + [[1, 2]] * 3
    for step, order in enumerate(orders):
        ids = [(step * 7 + k) % 50 + 1 for k in order]
        got = _step(model, [mine[k] for k in order], ids)
        want = _plain(model, lambda: _step(model, [plain[k] for k in order], ids))
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_a_restored_state_is_not_replayed_over_its_old_tensors(model):
    """A state restored from a snapshot holds new tensors: the pass after it records again, and decoding
    from the snapshot gives what the plain pass gives."""
    replay = model.engine.cpu_replay
    mine, plain = model.new_state(), model.new_state()
    model.forward([9, 8, 7], mine)
    _plain(model, lambda: model.forward([9, 8, 7], plain))
    snap = mine.snapshot()
    for t in (3, 4, 5):
        model.forward([t], mine)
    recorded = replay.recorded
    mine.restore(snap)
    for t in (11, 12, 13):
        got = model.forward([t], mine)[-1]
        want = _plain(model, lambda: model.forward([t], plain)[-1])
        assert torch.equal(got, want)
    assert replay.recorded > recorded


def test_the_passes_after_a_draft_check_replay_at_once(model):
    """A pass of several rows whose later rows are then given back (a draft check, half accepted) leaves
    the states in the tensors the recording read: the one-token passes after it replay without recording
    again, with the plain pass's logits."""
    replay = model.engine.cpu_replay
    mine, plain = model.new_state(), model.new_state()
    model.forward([4, 5, 6], mine)
    _plain(model, lambda: model.forward([4, 5, 6], plain))
    for t in (7, 8):  # recorded, then replayed
        model.forward([t], mine)
        _plain(model, lambda: model.forward([t], plain))
    for state, run in ((mine, lambda f: f()), (plain, lambda f: _plain(model, f))):
        kept = state.num_tokens + 2
        run(lambda: model.forward([9, 10, 11, 12], state, keep_states=True))
        state.rollback(kept)
    recorded, replayed = replay.recorded, replay.replayed
    for t in (10, 13, 14, 15):
        got = model.forward([t], mine)[-1]
        want = _plain(model, lambda: model.forward([t], plain)[-1])
        assert torch.equal(got, want)
    assert replay.recorded == recorded and replay.replayed == replayed + 4


def test_a_swapped_weight_is_computed_with(model):
    """A weight swapped in the provider's dicts (as the sensitivity tool does) takes effect on the next
    pass: the recording made with the old one is not replayed."""
    _, spines, _ = model.engine.provider.held()
    layer = next(i for i, s in enumerate(spines) if s)
    name = next(k for k, w in spines[layer].items() if isinstance(w, torch.Tensor) and w.dim() == 1)
    mine, plain = model.new_state(), model.new_state()
    model.forward([2, 3], mine)
    _plain(model, lambda: model.forward([2, 3], plain))
    for t in (4, 5):
        model.forward([t], mine)
        _plain(model, lambda: model.forward([t], plain))
    old = spines[layer][name]
    spines[layer][name] = old * 1.5
    try:
        got = model.forward([6], mine)[-1]
        want = _plain(model, lambda: model.forward([6], plain)[-1])
    finally:
        spines[layer][name] = old
    assert torch.equal(got, want)


def test_a_pass_with_torch_between_its_calls_is_never_replayed(tiny_kl_path, monkeypatch):
    """A layer that leaves its one native call (here every MoE layer) makes the shape's passes run plain,
    with the reason kept; their logits are the plain pass's."""
    model = deltafin.load(tiny_kl_path, device="cpu", stream="off")
    monkeypatch.setattr(moe.MoE, "block", lambda *a: None)
    replay = model.engine.cpu_replay
    mine, plain = model.new_state(), model.new_state()
    model.forward([1, 2], mine)
    _plain(model, lambda: model.forward([1, 2], plain))
    for t in (3, 4, 5, 6):
        assert torch.equal(model.forward([t], mine), _plain(model, lambda: model.forward([t], plain)))
    assert replay.replayed == 0 and replay.recorded == 0
    assert replay.failed and all("in torch" in why for why in replay.failed.values())


def test_a_watched_routing_runs_the_plain_pass(model):
    replay = model.engine.cpu_replay
    seen = []

    class Watch(PassObserver):
        def on_route(self, layer, ids, x):
            seen.append(layer)
    st = model.new_state()
    model.forward([1, 2], st)
    model.forward([3], st)
    replayed = replay.replayed
    with model.engine.observe(Watch()):
        model.forward([4], st)
    assert replay.replayed == replayed and seen


def test_the_replay_setting():
    assert Settings.resolve({}).cpu_replay is True
    assert Settings.resolve({}, env={"DELTAFIN_CPU_REPLAY": "off"}).cpu_replay is False
    with pytest.raises(SettingsError, match="DELTAFIN_CPU_REPLAY"):
        Settings.resolve({}, env={"DELTAFIN_CPU_REPLAY": "sometimes"})


def test_off_or_with_attention_residuals_there_is_no_replay(tiny_kl_path, tiny_k3_model):
    assert deltafin.load(tiny_kl_path, device="cpu", stream="off", cpu_replay=False).engine.cpu_replay is None
    assert tiny_k3_model.engine.cpu_replay is None  # its depth mix runs in torch between the calls


@pytest.mark.skipif(cpu_native.simd() != "avx512", reason="the blocked attention kernel needs AVX-512")
def test_long_caches_replay_where_the_blocked_attention_runs(monkeypatch):
    """kl-code-tiny (latent and rope widths of multiples of 16): with the MLA caches past the plain loops'
    limit, the passes still replay on the blocked kernel; with the kernels held to AVX2 they run the
    Python (torch attends), and both make the plain pass's logits."""
    from deltafin.model import mla
    if not (KL_CODE_TINY / "config.json").exists():
        pytest.skip(f"the trained model is not at {KL_CODE_TINY}")
    model = deltafin.load(KL_CODE_TINY, device="cpu", stream="off")
    cfg, replay = model.engine.cfg, model.engine.cpu_replay
    monkeypatch.setattr(mla, "NATIVE_ATTEND_MAX_WORK", 6 * cfg.mla_num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    for held_to_avx2, replays in ((False, True), (True, False)):
        with cpu_native.limit_simd("avx2") if held_to_avx2 else contextlib.nullcontext():
            mine, plain = model.new_state(), model.new_state()
            got, want = model.forward([5, 6, 7, 8, 9], mine)[-1], _plain(model, lambda: model.forward([5, 6, 7, 8, 9], plain)[-1])
            before = replay.replayed
            for _ in range(6):  # caches of 6 to 11 rows: past the limit
                assert torch.equal(got, want)
                got = model.forward([int(got.argmax())], mine)[-1]
                want = _plain(model, lambda: model.forward([int(want.argmax())], plain)[-1])
            assert torch.equal(got, want)
            assert (replay.replayed - before >= 4) == replays


def _decode_logits(model, prompt, tokens):
    """The prompt's last logits row and those of `tokens` greedy steps after it, stacked."""
    st = model.new_state()
    rows = [model.forward(prompt, st)[-1]]
    for _ in range(tokens):
        rows.append(model.forward([int(rows[-1].argmax())], st)[-1])
    return torch.stack(rows)


@pytest.mark.parametrize("which", ["bf16", "q8"])
def test_a_streamed_model_replays_once_its_cache_holds_all_of_it(which, tiny_kl_path, wide_q8_path):
    """Streamed with a RAM cache that takes the whole model: the experts no token routed to are read
    in behind the passes, after which its MoE layers compute in one native call and its passes replay;
    the logits stay the resident model's. When the cache gives anything up, the recordings go with it
    and the passes run as before."""
    path = tiny_kl_path if which == "bf16" else wide_q8_path
    resident = _decode_logits(deltafin.load(path, device="cpu", stream="off"), [3, 4, 5], 24)
    m = deltafin.load(path, device="cpu", stream="on", ram_budget="8")
    provider, replay, cfg = m.engine.provider, m.engine.cpu_replay, m.config
    assert replay is not None and provider.held() is None  # nothing read yet
    streamed = _decode_logits(m, [3, 4, 5], 24)
    assert (streamed - resident).abs().max() <= 1e-5 * resident.abs().max()
    assert torch.equal(streamed.argmax(-1), resident.argmax(-1))
    assert all(not provider.cache.missing_experts(i) for i in range(cfg.num_layers))
    assert provider.held() is not None and replay.replayed >= 10 and not replay.failed
    # the same again, every pass replayed but the few that record (new states, grown caches), now with
    # the weights in the resident model's layout and calls: its logits, bit for bit
    before = replay.replayed
    assert torch.equal(_decode_logits(m, [3, 4, 5], 24), resident)
    assert replay.replayed - before >= 18
    provider.watcher.close()  # the target is the test's from here on
    provider.cache.set_target(0, "a test")  # memory wanted elsewhere: everything goes
    assert provider.held() is None and not replay.recordings
    replayed = replay.replayed
    again = _decode_logits(m, [3, 4, 5], 24)
    assert replay.replayed == replayed
    # read per pass in the store's layout (grouped int8 not interleaved: the products sum in another order)
    assert (again - resident).abs().max() <= 1e-3 * resident.abs().max()
    assert torch.equal(again.argmax(-1), resident.argmax(-1))
    provider.cache.set_target(8 * 10**9, "a test")  # and back: read again, whole again, replayed again
    _decode_logits(m, [3, 4, 5], 24)
    assert provider.held() is not None and replay.replayed > replayed


class _Chosen(PassObserver):
    def __init__(self):
        self.chosen: set[tuple[int, int]] = set()

    def on_choice(self, layer, ids):
        self.chosen.update((layer, e) for e in ids.flatten().tolist())


def test_an_expert_that_fails_to_fill_is_read_once(wide_q8_path):
    """An expert no token routes to whose read-ahead fails (its decode raises) is not read again at every
    pass's end, and the other layers still fill: the rest of the model is read in and the logits are the
    resident model's."""
    resident = deltafin.load(wide_q8_path, device="cpu", stream="off")
    with resident.engine.observe(_Chosen()) as seen:
        want = _decode_logits(resident, [3, 4, 5], 16)
    cfg = resident.config
    bad = next((i, e) for i in range(cfg.num_layers) if cfg.is_moe(i) for e in range(cfg.num_experts)
               if (i, e) not in seen.chosen)
    m = deltafin.load(wide_q8_path, device="cpu", stream="on", ram_budget="8")
    source, calls = m.engine.provider.source, []
    decode = source.decode_expert

    def failing(i, e, *args, **kwargs):
        if (i, e) == bad:
            calls.append(e)
            raise ValueError("a damaged expert")
        return decode(i, e, *args, **kwargs)

    source.decode_expert = failing
    got = _decode_logits(m, [3, 4, 5], 16)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert len(calls) == 1
    cache = m.engine.provider.cache
    assert cache.missing_experts(bad[0]) == [bad[1]]
    assert all(not cache.missing_experts(i) for i in range(cfg.num_layers) if i != bad[0])


def test_a_bench_counts_the_routing_of_replayed_passes(wide_q8_path):
    """The bench's routing counter is told each MoE layer's choice after the fact (on_choice), so a
    streamed model it measures replays as it would unwatched, and the counts are all there."""
    from deltafin.bench import run_bench
    r = run_bench(wide_q8_path, tokens=12, prompt_tokens=4, warmup_tokens=16,
                  settings=Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "8"}))
    cfg = deltafin.load(wide_q8_path, device="cpu", stream="off").config
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert r["cpu_replay"]["passes"] == 11 and r["cpu_replay"]["replayed"] >= 9
    assert r["expert_routing"]["routings"] == 11 * moe_layers * cfg.experts_per_token


def test_experts_kept_before_the_cache_held_whole_layers_are_laid_out_once_it_does(wide_q8_path):
    """A cache that held half of each layer's experts keeps them in the store's layout; once it may hold
    them all (memory freed), what it kept before is laid out for the CPU, so the layers take their one
    native call and the passes replay, with the resident model's logits."""
    resident = _decode_logits(deltafin.load(wide_q8_path, device="cpu", stream="off"), [3, 4, 5], 12)
    m = deltafin.load(wide_q8_path, device="cpu", stream="on", ram_budget="8")
    provider, replay = m.engine.provider, m.engine.cpu_replay
    cache = provider.cache
    provider.watcher.close()  # the target is the test's
    half = m.config.num_experts // 2
    cache.set_target(sum(cache._sizes.spine_bytes) + half * cache.residency()["slot_bytes"], "a test")
    _decode_logits(m, [3, 4, 5], 12)
    kept = [ws for layer in cache._experts.held.values() for _, ws in layer.values()]
    assert kept and all(w.tensors["weight_scale"].dim() == 2 for ws in kept for w in ws)  # the store's layout
    assert provider.held() is None and replay.replayed == 0
    cache.set_target(8 * 10**9, "a test")
    _decode_logits(m, [3, 4, 5], 12)  # the rest read in; what was kept laid out
    before = replay.replayed
    assert torch.equal(_decode_logits(m, [3, 4, 5], 12), resident)
    assert provider.held() is not None and replay.replayed - before >= 8
