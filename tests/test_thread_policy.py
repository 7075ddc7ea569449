"""One-token passes of a streamed model take every core once they stop waiting on the disk
(runtime/thread_policy.py), and go back to leaving the readers a core when they wait again."""
from __future__ import annotations

import pytest
import torch

import deltafin
from deltafin.kernels import cpu_native
from deltafin.runtime.pass_stats import PassObserver, PassStats
from deltafin.runtime.thread_policy import EVERY_CORE_BELOW, READERS_ABOVE, WINDOW, ThreadPolicy


def _pass(wait_share: float, spines_from_disk: int = 1, prefetched: int = 0) -> PassStats:
    return PassStats(tokens=1, seconds=1.0, spine_wait_seconds=wait_share / 2, expert_wait_seconds=wait_share / 2,
                     spines_loaded=4, spines_cached=4 - spines_from_disk, prefetch_bytes=prefetched)


def test_the_count_follows_the_waits_with_hysteresis():
    p = ThreadPolicy(waiting=1, every=4)
    for _ in range(WINDOW - 1):
        p.after(_pass(0.0))
    assert p.now == 1  # not decided before a whole window
    p.after(_pass(0.0))
    assert (p.now, p.switches) == (4, 1)
    between = (EVERY_CORE_BELOW + READERS_ABOVE) / 2
    for _ in range(3 * WINDOW):  # waits between the two limits change nothing
        p.after(_pass(between))
    assert (p.now, p.switches) == (4, 1)
    p.after(_pass(0.9))  # the window's mean, (3 x between + 0.9) / 4, is above READERS_ABOVE now
    assert (p.now, p.switches) == (1, 2)
    for _ in range(WINDOW - 1):  # after a switch the window starts again: passes of the new count only
        p.after(_pass(0.0))
    assert p.now == 1
    p.after(_pass(0.0))
    assert (p.now, p.switches) == (4, 3)
    for _ in range(WINDOW - 1):
        p.after(_pass(0.9))
    p.after(PassStats(tokens=1, seconds=0.0))  # a pass that took no time says nothing: no window yet
    assert p.now == 4
    p.after(_pass(0.9))
    assert (p.now, p.switches) == (1, 4)


def test_waits_for_the_chosen_experts_alone_leave_every_core_to_the_products():
    """A pass that read no spine from the disk and prefetched nothing read only while its products
    waited: every core, however long it waited; a spine read or a prefetch beside the products: the
    readers get their core back."""
    p = ThreadPolicy(waiting=1, every=2)
    for _ in range(WINDOW):
        p.after(_pass(0.6, spines_from_disk=0))
    assert (p.now, p.switches) == (2, 1)
    for _ in range(WINDOW):
        p.after(_pass(0.6, spines_from_disk=0, prefetched=1 << 20))
    assert (p.now, p.switches) == (1, 2)
    for _ in range(WINDOW):
        p.after(_pass(0.6, spines_from_disk=0))
    assert p.now == 2
    for _ in range(WINDOW):
        p.after(_pass(0.6, spines_from_disk=1))
    assert (p.now, p.switches) == (1, 4)


def test_a_streamed_model_runs_one_token_passes_on_the_policys_count(tiny_k3_path):
    """The real pass reads its threads from the policy: what the native kernels were given while the
    pass ran, seen from inside it by an observer."""
    if not cpu_native.available():
        pytest.skip("the native CPU kernels are not built")
    try:
        m = deltafin.load(tiny_k3_path, device="cpu", stream="on", threads=0, speculate=False)
        policy = m.engine.thread_policy
        if policy is None:
            pytest.skip("one core: there is no other count to choose")
        seen = []

        class Threads(PassObserver):
            def on_route(self, layer, ids, x):
                seen.append((ids.shape[0], cpu_native._decode_threads))

        with m.observe(Threads()):
            for forced in (policy.every, policy.waiting):
                policy.now = forced
                seen.clear()
                m.generate([5, 6, 7], max_new_tokens=3)
                assert {t for rows, t in seen if rows == 1} == {forced}
    finally:
        torch.set_num_threads(1)  # process-wide; the other tests run with one
