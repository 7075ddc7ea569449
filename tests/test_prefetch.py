"""Expert prefetch (prefetch prev): the same logits as the plain streamed path, with and without a
host-RAM cache; prefetched bytes are accounted; demand reads go before prefetches, and a cancelled
prefetch reads nothing more."""
from __future__ import annotations

import os
import queue

import pytest
import torch

from deltafin.api import open_source
from deltafin.checkpoint.synthetic import make_checkpoint
from deltafin.engine import Engine
from deltafin.io.memory import GiB
from deltafin.io.reader import PREFETCH, URGENT, AlignedBuffer, Batch, Files, Run, _work
from deltafin.io.stream import StreamProvider
from deltafin.settings import Settings, SettingsError

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


def settings(prefetch, budget):
    return Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": budget, "prefetch": prefetch,
                             "read_mode": "buffered"})


@pytest.mark.parametrize("budget", ["0", "auto"])
@pytest.mark.parametrize("model", ["skewed-k3", "kl"])
def test_prefetched_logits_equal_plain_streamed(tmp_path, skewed_k3, tiny_kl_path, model, budget):
    path = skewed_k3 if model == "skewed-k3" else tiny_kl_path
    host(tmp_path, free=8 * GiB)
    kw = {"memory_root": str(tmp_path), "watch": False} if budget != "0" else {}
    want, plain = decode(path, settings("off", budget), **kw)
    got, stats = decode(path, settings("prev", budget), **kw)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"pass {k} differs"
    assert all(s.prefetch_bytes == 0 for s in plain)
    fetched = sum(s.prefetch_bytes for s in stats)
    used = sum(s.prefetch_used_bytes for s in stats)
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
    with pytest.raises(SettingsError, match="prefetch.*allowed: off, prev"):
        Settings.resolve({"prefetch": "psychic"})
