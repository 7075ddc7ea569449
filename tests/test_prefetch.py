"""Expert prefetch (prefetch prev / early): the same logits as the plain streamed path, with and
without a host-RAM cache; prefetched bytes are accounted; demand reads go before prefetches, a
cancelled prefetch reads nothing more, and a guess confirmed while still being read is waited for,
not read again."""
from __future__ import annotations

import os
import queue

import pytest
import torch

from deltafin.io.sources import open_source
from deltafin.checkpoint.synthetic import make_checkpoint
from deltafin.runtime.engine import Engine
from deltafin.io.reader import PREFETCH, URGENT, AlignedBuffer, Batch, Files, Run, _work
from deltafin.io.stream import StreamProvider
from deltafin.settings import Settings, SettingsError
from deltafin.units import GiB

from conftest import KL_CODE_TINY
from test_ram_cache import host

PROMPT = [5, 17, 99, 3, 250, 42, 7, 300]
STEPS = 14


@pytest.fixture(scope="module")
def skewed_k3(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("pf") / "skewed", seed=3, progress=False,
                           routing_skew=1.0)


def decode(path, settings, **provider_kwargs):
    """Greedy decode; every pass's logits and stats."""
    src = open_source(path)
    provider = StreamProvider(src, settings, **provider_kwargs)
    engine = Engine(src.config, provider, settings)
    state = engine.new_state()
    logits, stats = [engine.forward(PROMPT, state)], [engine.last_pass]
    for _ in range(STEPS):
        logits.append(engine.forward([int(logits[-1][-1].argmax())], state))
        stats.append(engine.last_pass)
    provider.close()
    return logits, stats


def settings(prefetch, budget, pin_layers=0):
    return Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": budget, "prefetch": prefetch,
                             "read_mode": "buffered", "pin_layers": pin_layers})


@pytest.mark.parametrize("budget", ["0", "auto"])
@pytest.mark.parametrize("model", ["skewed-k3", "kl"])
@pytest.mark.parametrize("mode", ["prev", "early"])
def test_prefetched_logits_equal_plain_streamed(tmp_path, skewed_k3, tiny_kl_path, model, budget, mode):
    path = skewed_k3 if model == "skewed-k3" else tiny_kl_path
    host(tmp_path, free=8 * GiB)
    kw = {"memory_root": str(tmp_path), "watch": False} if budget != "0" else {}
    # early guesses need the next layer's router in memory: pinned spines make that certain here
    pin = 99 if mode == "early" else 0
    want, plain = decode(path, settings("off", budget, pin), **kw)
    got, stats = decode(path, settings(mode, budget, pin), **kw)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"pass {k} differs"
    assert all(s.prefetch_bytes == 0 for s in plain)
    fetched = sum(s.prefetch_bytes for s in stats)
    used = sum(s.prefetch_used_bytes for s in stats)
    if mode == "prev":
        assert stats[0].prefetch_bytes == 0  # nothing to go on before the first pass
    if budget == "0":
        assert 0 < used <= fetched
        # every disk byte is either what the plain path read or a prefetch it did not need
        assert sum(s.bytes_read for s in stats) == sum(s.bytes_read for s in plain) + fetched - used
    else:
        assert used <= fetched


def test_demand_reads_go_first_and_cancelled_prefetch_reads_nothing(tmp_path):
    data = os.urandom(3 * 4096)
    f = tmp_path / "blob"
    f.write_bytes(data)
    files = Files("buffered")
    q: queue.PriorityQueue = queue.PriorityQueue()
    order = []
    guess, cancelled, needed = (Batch(1, lambda e, n=n: order.append(n)) for n in ("guess", "cancelled", "needed"))
    bufs = [AlignedBuffer(4096) for _ in range(3)]
    q.put((PREFETCH, 0, (Run(str(f), 0, 4096), bufs[0].mem, 0), guess))
    q.put((PREFETCH, 1, (Run(str(f), 4096, 4096), bufs[1].mem, 0), cancelled))
    q.put((URGENT, 2, (Run(str(f), 8192, 4096), bufs[2].mem, 0), needed))
    q.put((float("inf"), 3, None, None))
    cancelled.cancel()
    _work(q, files)  # the worker loop itself, run here until the stop marker
    files.close()
    assert order == ["needed", "guess", "cancelled"]
    assert bytes(bufs[2].mem[:4096]) == data[8192:] and bytes(bufs[0].mem[:4096]) == data[:4096]
    assert cancelled.done() and not cancelled.failed() and cancelled.read_bytes == 0
    assert not any(bufs[1].mem[:4096]) and guess.read_bytes == needed.read_bytes == 4096


def test_prefetch_setting():
    assert Settings.resolve({}).prefetch == "off"
    assert Settings.resolve({}, env={"DELTAFIN_PREFETCH": "prev"}).prefetch == "prev"
    assert Settings.resolve({}, env={"DELTAFIN_PREFETCH": "early"}).prefetch == "early"
    with pytest.raises(SettingsError, match="prefetch.*allowed: off, early, prev"):
        Settings.resolve({"prefetch": "psychic"})


@pytest.mark.skipif(not KL_CODE_TINY.exists(), reason="the trained kl-code-tiny checkpoint is not beside the repository")
def test_early_guess_is_mostly_right_on_a_trained_model():
    """The next layer's router on this layer's residual stream: most of what it reads ahead is then
    routed to (random routers could not show this; the trained model's residual stream carries over)."""
    _, stats = decode(KL_CODE_TINY, settings("early", "0", pin_layers=99))
    fetched = sum(s.prefetch_bytes for s in stats[1:])
    used = sum(s.prefetch_used_bytes for s in stats[1:])
    assert fetched > 0 and used / fetched > 0.5


def test_guess_confirmed_while_reading_is_waited_for_not_read_again(tmp_path):
    """A prefetch the router confirms before its read finished is handed over (``Ahead``), its
    bytes counted once as prefetched and used, and its weights come when the read completes."""
    import threading

    from deltafin.runtime.pass_stats import PassStats
    from deltafin.io.prefetch import Ahead, Prefetcher
    from deltafin.io.reader import Layout

    data = os.urandom(2 * 4096)
    f = tmp_path / "blob"
    f.write_bytes(data)
    files = Files("buffered")
    layout = Layout((Run(str(f), 0, 8192),), (0,), (), 8192)
    gate = threading.Event()

    class HeldPool:  # reads with the real files, once the test lets it
        def submit(self, jobs, priority, on_done=None):
            batch = Batch(len(jobs), on_done)

            def run():
                gate.wait()
                for job in jobs:
                    files.read(*job)
                    batch.job_done(None, job[0].nbytes)
            threading.Thread(target=run, daemon=True).start()
            return batch

    decoded = []
    pf = Prefetcher(HeldPool(), lambda i, e: layout, lambda i, e, v: decoded.append(e) or f"weights of {e}")
    stats = PassStats()
    pf.start(3, stats, [7, 9])
    got = pf.take(3, 7, stats)
    assert isinstance(got, Ahead) and not got.batch.done()
    assert stats.prefetch_bytes == stats.prefetch_used_bytes == stats.bytes_read == 8192
    gate.set()
    got.batch.wait()
    assert got.weights == "weights of 7" and decoded == [7]
    assert bytes(got.buf.mem[:8192]) == data
    pf.close()
    files.close()


def test_demand_path_waits_for_guesses_still_being_read(tmp_path, skewed_k3):
    """Prefetch reads held back until the router has confirmed one of them while it is still under
    way: the pass waits for it (no second read of it) and computes the same logits."""
    import threading

    from deltafin.io.prefetch import Ahead

    want, _ = decode(skewed_k3, settings("off", "0", 99))
    src = open_source(skewed_k3)
    s = settings("early", "0", 99)
    provider = StreamProvider(src, s)
    pf = provider.prefetcher
    gate, held = threading.Event(), []
    real_submit, real_take = pf._pool.submit, pf.take

    def submit(jobs, priority, on_done=None):  # prefetch reads start once the gate opens
        batch = Batch(len(jobs), on_done)
        def run():
            gate.wait()
            inner = real_submit(jobs, priority)
            inner.wait()
            for job in jobs:
                batch.job_done(None, job[0].nbytes)
        threading.Thread(target=run, daemon=True).start()
        return batch

    def take(i, e, stats):
        got = real_take(i, e, stats)
        if isinstance(got, Ahead):
            held.append(e)
            gate.set()
        return got

    pf._pool = type("HeldPool", (), {"submit": staticmethod(submit)})()
    pf.take = take
    engine = Engine(src.config, provider, s)
    state = engine.new_state()
    got = [engine.forward(PROMPT, state)]
    for _ in range(STEPS):
        got.append(engine.forward([int(got[-1][-1].argmax())], state))
    provider.close()
    assert held, "no guess was confirmed while under way"
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"pass {k} differs"


def test_first_moe_layer_is_guessed_and_guesses_stay_few(tmp_path, skewed_k3):
    """With early guesses the first MoE layer (no MoE layer before it to guess from) is guessed
    from the previous pass's last token when the pass starts; no layer's guess reads more than
    top-k experts, and no more than top-k spare guess buffers are kept."""
    src = open_source(skewed_k3)
    s = settings("early", "0", 99)
    provider = StreamProvider(src, s)
    pf = provider.prefetcher
    k = src.config.experts_per_token
    first = next(i for i in range(src.config.num_layers) if src.config.is_moe(i))
    started, real_start = [], pf.start

    def start(i, stats, predicted=None, computing=None):
        real_start(i, stats, predicted, computing)
        started.append((i, len(pf._ahead)))
        assert len(pf._ahead) <= k and len(pf._free) <= k

    pf.start = start
    engine = Engine(src.config, provider, s)
    state = engine.new_state()
    logits = engine.forward(PROMPT, state)
    for _ in range(4):
        started.clear()
        logits = engine.forward([int(logits[-1].argmax())], state)
        assert started[0][0] == first and started[0][1] > 0  # queued at the pass's start, before layer 0
    provider.close()
