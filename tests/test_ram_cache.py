"""The host-RAM tier: memory readers on file trees the tests write (cgroup v1, v2, none, garbage),
the budget's decisions, the ram_budget setting, and the cached streamer against the plain one
(identical logits, also while the cache shrinks and grows mid-generation)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from deltafin.io.sources import open_source
from deltafin.runtime.engine import Engine
from deltafin.io.memory import FIXED_WINDOW_S, GROW_WINDOW_S, MemoryBudget, cgroup_levels, read_memory, read_meminfo, \
    read_stall_us
from deltafin.io.placement import ExpertSlots
from deltafin.io.ram_cache import RamCache
from deltafin.io.reader import spine_layout
from deltafin.io.stream import StreamProvider
from deltafin.settings import Settings, SettingsError
from deltafin.units import GiB

KB = 1024


def write(root: Path, rel: str, text: str) -> None:
    f = root / rel.lstrip("/")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)


def host(root: Path, free: int, total: int = 16 * GiB, full_us: int = 0, cached: int = 8 * GiB) -> None:
    write(root, "/proc/meminfo", f"MemTotal: {total // KB} kB\nMemFree: {free // KB} kB\n"
                                 f"MemAvailable: {(free + cached) // KB} kB\nCached: {cached // KB} kB\n")
    write(root, "/proc/pressure/memory", f"some avg10=0.00 avg60=0.00 avg300=0.00 total={2 * full_us}\n"
                                         f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full_us}\n")


def cgroup_v1(root: Path, limit: int, usage: int, parent_limit: int = 9223372036854771712) -> None:
    write(root, "/proc/self/cgroup", "9:pids:/\n4:memory:/box/job\n1:cpu,cpuacct:/\n")
    base = "/sys/fs/cgroup/memory"
    for rel, lim, use in ((base, 9223372036854771712, 20 * GiB), (base + "/box", parent_limit, usage),
                          (base + "/box/job", limit, usage)):
        write(root, rel + "/memory.limit_in_bytes", f"{lim}\n")
        write(root, rel + "/memory.usage_in_bytes", f"{use}\n")


def cgroup_v2(root: Path, limit: str, usage: int, some_us: int = 0) -> None:
    write(root, "/proc/self/cgroup", "0::/user.slice/job\n")
    write(root, "/sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    write(root, "/sys/fs/cgroup/user.slice/job/memory.max", limit + "\n")
    write(root, "/sys/fs/cgroup/user.slice/job/memory.current", f"{usage}\n")
    write(root, "/sys/fs/cgroup/user.slice/job/memory.pressure",
          f"some avg10=1.00 avg60=0.00 avg300=0.00 total={some_us}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


# -- readers -----------------------------------------------------------------------------------
def test_host_free_is_memfree_not_page_cache(tmp_path):
    host(tmp_path, free=2 * GiB, cached=10 * GiB, full_us=1234)
    r = read_memory(str(tmp_path))
    assert r.free == 2 * GiB and r.limit == 16 * GiB and r.where == "host" and r.stall_us == 1234
    assert read_meminfo(str(tmp_path))["Cached"] == 10 * GiB


def test_cgroup_v1_limit_and_usage_bind(tmp_path):
    host(tmp_path, free=10 * GiB)
    cgroup_v1(tmp_path, limit=3 * GiB, usage=2 * GiB)
    levels = cgroup_levels(str(tmp_path))
    assert [lv.path for lv in levels] == ["/sys/fs/cgroup/memory/box/job", "/sys/fs/cgroup/memory/box",
                                          "/sys/fs/cgroup/memory"]
    assert levels[0].limit == 3 * GiB and levels[1].limit is None  # "no limit" is a huge number in v1
    r = read_memory(str(tmp_path))
    assert r.free == 1 * GiB and r.limit == 3 * GiB and "cgroup v1" in r.where
    # A tighter ancestor wins.
    cgroup_v1(tmp_path, limit=3 * GiB, usage=2 * GiB, parent_limit=2 * GiB + 100)
    assert read_memory(str(tmp_path)).free == 100


def test_cgroup_v2_limit_usage_and_own_pressure(tmp_path):
    host(tmp_path, free=10 * GiB, full_us=999)
    cgroup_v2(tmp_path, "max", 1 * GiB, some_us=555)
    r = read_memory(str(tmp_path))
    assert r.free == 10 * GiB and r.limit == 16 * GiB and r.stall_us == 555  # the group's own pressure
    cgroup_v2(tmp_path, str(4 * GiB), 3 * GiB)
    write(tmp_path, "/sys/fs/cgroup/user.slice/job/memory.high", f"{int(3.5 * GiB)}\n")
    r = read_memory(str(tmp_path))
    assert r.free == GiB // 2 and r.limit == int(3.5 * GiB) and "cgroup v2" in r.where


def test_container_path_not_mounted_reads_the_mount_root(tmp_path):
    host(tmp_path, free=10 * GiB)
    write(tmp_path, "/proc/self/cgroup", "0::/kubepods/pod1/abc\n")
    write(tmp_path, "/sys/fs/cgroup/cgroup.controllers", "memory\n")
    write(tmp_path, "/sys/fs/cgroup/memory.max", f"{2 * GiB}\n")
    write(tmp_path, "/sys/fs/cgroup/memory.current", f"{GiB}\n")
    assert read_memory(str(tmp_path)).free == GiB


@pytest.mark.parametrize("garbage", ["", "\x00\xff\xfe", "MemFree: lots kB\n", "max\n", "-5\n", "1 2 3",
                                     "some total=abc\n", "4:memory\n", "0::../../etc\n"])
def test_garbage_reads_as_unknown(tmp_path, garbage):
    for rel in ("/proc/meminfo", "/proc/self/cgroup", "/proc/pressure/memory",
                "/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/cgroup.controllers", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"):
        write(tmp_path, rel, garbage)
    r = read_memory(str(tmp_path))
    assert r.free is None or r.free >= 0
    budget = MemoryBudget(None, str(tmp_path))
    target, why = budget.check(held=123, fixed=0, target=123)
    assert target >= 0 and isinstance(why, str)
    assert "ram budget" in budget.describe(0)


def test_nothing_there_reads_as_unknown(tmp_path):
    r = read_memory(str(tmp_path / "missing"))
    assert r == type(r)(None, None, "host", None)
    assert cgroup_levels(str(tmp_path / "missing")) == []
    assert read_stall_us(str(tmp_path), "/proc/pressure/memory", "full") is None
    # Unknown memory: a set budget is trusted, auto keeps what it holds.
    assert MemoryBudget(2 * 10**9, str(tmp_path)).check(0, 10**9, 0)[0] == 10**9
    assert MemoryBudget(None, str(tmp_path)).check(5, 0, 0)[0] == 5


# -- the budget's decisions ----------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_grows_into_free_memory_and_shrinks_by_the_shortfall(tmp_path):
    clock = Clock()
    b = MemoryBudget(None, str(tmp_path), clock=clock)
    host(tmp_path, free=4 * GiB)
    headroom = b.headroom(read_memory(str(tmp_path)))
    target, _ = b.check(held=0, fixed=0, target=0)
    assert 0 < target <= 4 * GiB - headroom
    free = (headroom - GiB // 2) // KB * KB
    host(tmp_path, free=free)  # someone took memory: give back the shortfall at once
    assert b.check(held=3 * GiB, fixed=0, target=target)[0] == 3 * GiB - (headroom - free)
    # A set budget is a ceiling that includes the streamer's own buffers.
    host(tmp_path, free=12 * GiB)
    assert MemoryBudget(2 * GiB, str(tmp_path)).check(0, GiB // 4, 0)[0] == 2 * GiB - GiB // 4


def test_growth_waits_until_memory_stayed_free(tmp_path):
    clock = Clock()
    b = MemoryBudget(None, str(tmp_path), clock=clock)
    host(tmp_path, free=4 * GiB)
    t0, _ = b.check(held=0, fixed=0, target=0)
    clock.t += 0.2
    host(tmp_path, free=GiB // 10)  # a passing allocation takes nearly all: shrink at once
    t1, _ = b.check(held=t0, fixed=0, target=t0)
    assert t1 < t0
    clock.t += 0.2
    host(tmp_path, free=4 * GiB)  # gone again: no growth while the dip is recent
    assert b.check(held=t1, fixed=0, target=t1)[0] == t1
    clock.t += 5.0
    assert b.check(held=t1, fixed=0, target=t1)[0] > t1


def test_pressure_shrinks_and_pauses_growth(tmp_path):
    clock = Clock()
    b = MemoryBudget(None, str(tmp_path), clock=clock)
    host(tmp_path, free=8 * GiB, full_us=0)
    t0, _ = b.check(held=GiB, fixed=0, target=GiB)
    clock.t += 1.0
    host(tmp_path, free=8 * GiB, full_us=200_000)  # 20% of the last second stalled on memory
    t1, why = b.check(held=GiB, fixed=0, target=t0)
    assert t1 == GiB - GiB // 8 and "pressure" in why
    clock.t += 1.0  # no more stalls, but still cooling down: no growth
    t2, why = b.check(held=t1, fixed=0, target=t1)
    assert t2 == t1 and "cooling" in why
    clock.t += 10.0
    assert b.check(held=t1, fixed=0, target=t1)[0] > t1


def test_streamer_buffers_count_at_their_recent_peak(tmp_path):
    """The streamer's own buffers going and coming back neither grow nor shrink the caches; once
    they stayed away for the window, the caches grow into what they left."""
    clock = Clock()
    b = MemoryBudget(None, str(tmp_path), clock=clock)
    host(tmp_path, free=4 * GiB)
    t0, _ = b.check(held=0, fixed=GiB, target=0)
    assert t0 > 0
    clock.t += 0.2
    host(tmp_path, free=5 * GiB)  # the streamer gave its 1 GiB back
    t1, why = b.check(held=t0, fixed=0, target=t0)
    assert t1 == t0 and "kept for the streamer" in why
    clock.t += 0.2
    host(tmp_path, free=4 * GiB)  # and took it again: nothing to give back
    assert b.check(held=t0, fixed=GiB, target=t0)[0] == t0
    for _ in range(int((FIXED_WINDOW_S + GROW_WINDOW_S) / 0.5) + 2):  # then stays away
        clock.t += 0.5
        host(tmp_path, free=5 * GiB)
        t2, why = b.check(held=t0, fixed=0, target=t0)
    assert t2 > t0 and "kept" not in why
    # A set budget counts the streamer's buffers at their recent peak too.
    c = MemoryBudget(2 * GiB, str(tmp_path), clock=clock)
    c.check(0, GiB // 2, 0)
    clock.t += 1.0
    assert c.check(0, 0, 0)[0] == 2 * GiB - GiB // 2


# -- the setting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value,want", [("auto", None), ("0", 0), ("2.5", 2_500_000_000), (" 1 ", 10**9)])
def test_ram_budget_values(value, want):
    assert Settings.resolve({"ram_budget": value}).ram_budget_bytes() == want
    assert Settings.resolve({}, env={"DELTAFIN_RAM_BUDGET": value}).ram_budget_bytes() == want


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan", "", "1e400", "2GB"])
def test_ram_budget_rejects_bad_values(value):
    with pytest.raises(SettingsError, match="ram_budget.*allowed: auto"):
        Settings.resolve({"ram_budget": value})
    with pytest.raises(SettingsError, match="DELTAFIN_RAM_BUDGET"):
        Settings.resolve({}, env={"DELTAFIN_RAM_BUDGET": value})


# -- the cache ------------------------------------------------------------------------------------
class Buf:
    def __init__(self, n):
        self.nbytes = n


def test_cache_shrinks_experts_first_then_spines_from_the_last():
    lines = []
    c = RamCache([30, 30, 30], [0, 10, 10], 4, log=lines.append)
    # Every spine and two expert slots; on the way, two spines and two buffers of the third (120).
    c.set_target(90 + 2 * 20, "test")
    for i in range(3):
        assert c.wants_spine(i)
        assert c.put_spine(i, Buf(30), {"layer": i})
    for i in (1, 2):
        c.routed(i, [0, 1])
        for e in (0, 1):
            assert c.admit_expert(i, e, 10) is not None
            c.put_expert(i, e, Buf(10), ("w", i, e))
    assert c.held_bytes() == 130 and c.expert(1, 0) == ("w", 1, 0)
    # A hotter expert takes the coldest one's slot, and its buffer (no new allocation).
    c.routed(1, [0, 1])
    c.routed(1, [1])
    c.routed(1, [3])
    assert c.admit_expert(1, 3, 10) is None  # not hotter than expert 0 yet
    c.routed(1, [3])
    c.routed(1, [3])
    victim = c._experts.held[1][0][0]
    assert c.admit_expert(1, 3, 10) is victim and c.expert(1, 0) is None and c.held_bytes() == 120
    c.put_expert(1, 3, victim, ("w", 1, 3))
    assert c.held_bytes() == 130 and c.expert(1, 3) == ("w", 1, 3)
    c.set_target(110, "less")
    assert c.residency()["expert_slots_per_layer"] == 1 and c.held_bytes() == 110
    c.set_target(90, "every spine, no expert")
    assert c.residency()["experts_held"] == 0 and c.held_bytes() == 90
    c.set_target(89, "less")  # one spine and two buffers for the others: 90; the buffers alone: 60
    assert c.held_bytes() == 0 and c.spine(0) is None
    c.set_target(100, "a little more")  # one spine (90), not two (120 on the way to all three)
    assert c.wants_spine(0) and not c.wants_spine(1)
    assert any("shrinks" in x for x in lines) and any("grows" in x for x in lines)


def test_cache_plan_counts_the_read_ahead_buffers_the_spines_leave():
    """Spine sizes of k3-slice (a large dense first layer, then smaller ones), in 10 MB units: the
    plan takes the most spines whose bytes plus two buffers of the largest layer still read fit at
    every step (none 234, one 243, two 306, three 327, four 285)."""
    c = RamCache([117, 63, 63, 42], [0, 5, 5, 5], 8)
    plans = {}
    for target in (340, 327, 320, 300, 240):
        c.set_target(target)
        plans[target] = (sorted(c._plan.spine_layers), c._plan.expert_slots)
    assert plans == {340: ([0, 1, 2, 3], 3), 327: ([0, 1, 2, 3], 2), 320: ([0, 1], 0), 300: ([0], 0),
                     240: ([], 0)}
    # What is charged: held spines and experts, and the streamer's read-ahead buffers now.
    c.set_target(340)
    c.ring_bytes = 84
    assert c.put_spine(0, Buf(117), {})
    assert c.held_bytes() == 117 and c.charged_bytes() == 201
    # A spine the plan left out is not kept.
    c.set_target(300)
    assert c.put_spine(1, Buf(63), {}) is False and not c.holds_spine(1)


def test_a_long_pass_borrows_from_the_target_and_gives_it_back():
    lines = []
    c = RamCache([100, 20], [0, 10], 8, log=lines.append)
    c.set_target(300)
    assert c.put_spine(0, Buf(100), {}) and c.put_spine(1, Buf(20), {})
    assert c._plan.expert_slots == 8
    c.make_room(150, "room for 15 more expert read buffers")
    assert c.target == 150 and c._plan.expert_slots == 3 and c.held_bytes() == 120
    c.make_room(1000, "more than there is")
    assert c.target == 0 and c.held_bytes() == 0
    c.repay(10_000)
    assert c.target == 300 and c._plan.expert_slots == 8 and "given back" in lines[-1]
    c.repay(10_000)  # nothing lent: nothing changes
    assert c.target == 300
    # Buffers the streamer keeps after the pass (a decode's own slots) are not given back.
    c.make_room(50, "room for 5 more expert read buffers")
    c.repay(20)
    assert c.target == 270
    c.repay(30)  # the loan is settled at the pass's end: nothing more comes back later
    assert c.target == 270


def test_expert_slots_age_out_old_favourites():
    s = ExpertSlots(slots=1, half_life=4)
    for _ in range(20):  # expert 1 popular long ago
        s.routed(0, [1])
    s.offer(0, 1, "w1")
    for _ in range(40):  # expert 2 popular now
        s.routed(0, [2])
    s.offer(0, 2, "w2")
    assert s.get(0, 2) == "w2" and s.get(0, 1) is None
    plain = ExpertSlots(slots=1, half_life=float("inf"))  # plain counts would keep the old one
    for _ in range(20):
        plain.routed(0, [1])
    plain.offer(0, 1, "w1")
    for _ in range(15):
        plain.routed(0, [2])
    plain.offer(0, 2, "w2")
    assert plain.get(0, 1) == "w1"


# -- the cached streamer against the plain one ---------------------------------------------------
PROMPT = [5, 17, 99, 3, 42, 7, 11, 250, 64, 1]
DECODE = [8, 200, 31, 4, 9, 77, 123, 6, 2, 40, 41, 42]


def generate(path, settings, provider_kwargs, between=None):
    src = open_source(path)
    provider = StreamProvider(src, settings, **provider_kwargs)
    engine = Engine(src.config, provider, settings)
    state = engine.new_state()
    out, stats = [engine.forward(PROMPT, state)], []
    for k, t in enumerate(DECODE):
        if between is not None:
            between(k, provider)
        out.append(engine.forward([t], state))
        stats.append(engine.last_pass)
    provider.close()
    return out, stats


def shrink_at_5_grow_at_8(tmp_path, lines: list):
    """generate's `between`: free memory the cache grows into, taken by another program before decode
    pass 5 (the cache gives everything back) and returned before pass 8. Log lines go to `lines`."""
    host(tmp_path, free=8 * GiB)
    clock = Clock()
    clock.t = time.monotonic()  # the provider's first look used the real clock

    def between(k, provider):
        provider.cache._log = lines.append
        provider.watcher.budget.clock = clock
        clock.t += 2.0  # a token every two seconds
        if k == 5:
            host(tmp_path, free=64 * 2**20)
            provider.watcher.check()
            assert provider.cache.held_bytes() == 0
        if k == 8:
            host(tmp_path, free=8 * GiB)
            provider.watcher.check()
    return between


@pytest.mark.parametrize("name", ["k3", "kl"])
@pytest.mark.parametrize("pin", [0, 1])
def test_cached_logits_equal_streamed_through_shrink_and_grow(tmp_path, tiny_k3_path, tiny_kl_path, name, pin):
    path = tiny_k3_path if name == "k3" else tiny_kl_path
    plain = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "0", "pin_layers": pin})
    want, base = generate(path, plain, {})
    assert all(s.experts_cached == 0 for s in base)

    lines = []
    cached = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "auto", "pin_layers": pin})
    got, stats = generate(path, cached, {"memory_root": str(tmp_path), "watch": False},
                          shrink_at_5_grow_at_8(tmp_path, lines))
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"pass {k} differs"
    streamed = sum(1 for _ in base[0].__dataclass_fields__) and base[0].bytes_read
    assert stats[3].bytes_read < streamed and stats[3].spines_cached > pin  # cached before the shrink
    assert stats[4].experts_cached > 0
    assert stats[5].bytes_read == streamed and stats[5].experts_cached == 0  # nothing held
    assert stats[-1].bytes_read < streamed  # grown back
    assert sum(s.bytes_read + s.bytes_from_ram for s in stats) == sum(s.bytes_read + s.bytes_from_ram for s in base)
    assert any("shrinks" in x for x in lines) and any("grows" in x for x in lines)


def test_set_budget_caps_what_is_held(tmp_path, tiny_k3_path):
    host(tmp_path, free=8 * GiB)
    src = open_source(tiny_k3_path)
    s = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "0.0012"})
    p = StreamProvider(src, s, memory_root=str(tmp_path), watch=False)
    engine = Engine(src.config, p, s)
    state = engine.new_state()
    for t in [PROMPT, *[[t] for t in DECODE]]:
        engine.forward(t, state)
        p.watcher.check()
        assert p.cache.held_bytes() + p.resident_bytes()["total"] <= 1_200_000 + 4096 * 8
    assert p.cache.held_bytes() > 0 and "1.2 GB set" not in p.budget_line and "0.0012 GB set" in p.budget_line
    p.close()


def test_spines_are_kept_in_their_read_buffers_and_a_prompt_borrows_expert_room(tmp_path, tiny_k3_path):
    """A spine enters the cache in the buffer it was read into (no copy, no buffer of its size
    beside the read-ahead ones); once every spine is held the read-ahead buffers are gone. A
    prompt's extra expert read buffers lower the target for its pass only: it is back at the end,
    but for the slots a decode keeps."""
    host(tmp_path, free=8 * GiB)
    src = open_source(tiny_k3_path)
    auto = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "auto"})
    first = StreamProvider(src, auto, memory_root=str(tmp_path), watch=False)
    sizes, fixed = first.cache._sizes, first.cache.fixed_bytes
    first.close()
    # A set budget of the streamer's buffers (a decode's expert slots too), every spine with the
    # read-ahead buffers on the way, and one expert of every MoE layer: a prompt needs more
    # expert buffers than that.
    budget = fixed + src.config.experts_per_token * max(sizes.expert_bytes) + sum(sizes.spine_bytes) \
        + 2 * max(sizes.spine_bytes) + sum(sizes.expert_bytes) * 3 // 2
    s = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": str(budget / 1e9)})
    p = StreamProvider(src, s, memory_root=str(tmp_path), watch=False)
    engine = Engine(src.config, p, s)
    state = engine.new_state()
    before = p.cache.target
    borrowed, make_room = [], p.cache.make_room
    p.cache.make_room = lambda n, why: borrowed.append(n) or make_room(n, why)
    engine.forward(PROMPT * 3, state)  # routes to every expert of a layer
    assert borrowed, "the prompt needed no extra buffers"
    # Back but for the expert slots a decode keeps (counted among the streamer's buffers now).
    assert p.cache.target == before - sum(b.nbytes for b in p.expert_buffers())
    engine.forward([3], state)
    held = p.cache._spines
    assert sorted(held) == p.streamable and p.resident_bytes()["spine_buffers"] == 0 and p.cache.ring_bytes == 0
    for i, (buf, weights) in held.items():
        assert buf.nbytes == spine_layout(src, i).capacity
        some = next(t for t in weights.values() if isinstance(t, torch.Tensor) and t.numel())
        start = torch.frombuffer(buf.mem, dtype=torch.uint8).data_ptr()
        assert start <= some.data_ptr() < start + buf.nbytes  # the weights view the kept buffer
    p.close()


def test_a_pass_is_admitted_no_more_experts_than_slots_and_keeps_its_hits():
    """Admitted experts hold their slot (and bytes) until stored, so a prompt routing to every
    expert of a layer gets no more own buffers than the layer's slots; an expert this pass routes
    to (a hit it computes from) is never the one evicted for another."""
    page = 4096  # the buffers made for admitted experts are whole pages
    c = RamCache([10 * page, page], [0, page], 8)
    c.set_target(13 * page)  # both spines and two slots
    assert c.put_spine(0, Buf(10 * page), {}) and c.put_spine(1, Buf(page), {})
    c.routed(1, [0, 1, 2, 3])
    got = [c.admit_expert(1, e, page) for e in (0, 1, 2, 3)]
    assert [b is not None for b in got] == [True, True, False, False]
    for e, b in zip((0, 1), got):
        c.put_expert(1, e, b, f"w{e}")
    for _ in range(3):  # expert 2 becomes the hottest
        c.routed(1, [2])
    c.routed(1, [0, 1, 2])  # both held experts are in use by this pass: neither makes room
    assert c.admit_expert(1, 2, page) is None and c.expert(1, 0) == "w0" and c.expert(1, 1) == "w1"
    c.routed(1, [1, 2])  # expert 0 is not in use now: its buffer is reused for expert 2
    assert c.admit_expert(1, 2, page) is got[0] and c.expert(1, 0) is None and c.expert(1, 1) == "w1"


def test_a_whole_layer_what_is_missing_and_what_is_dropped():
    """``whole_layer`` hands out a layer's experts only once all of them are held; ``missing_experts``
    names what a reader may fetch only while the plan holds every expert and spine (never a dense layer's);
    every drop (a slot taken by another, a shrink) is told to ``on_drop``, additions only bump the version."""
    c = RamCache([10, 10], [0, 4], 2)
    drops = []
    c.on_drop.append(lambda: drops.append(c.held_version))
    c.set_target(40)  # both spines (on the way, the read-ahead buffers of the second) and both experts
    assert c.missing_experts(1) == []  # a spine is still missing: nothing is fetched ahead yet
    assert c.put_spine(0, Buf(10), {}) and c.put_spine(1, Buf(10), {})
    assert c.missing_experts(0) == [] and c.missing_experts(1) == [0, 1] and c.whole_layer(1) is None
    version = c.held_version
    c.put_expert(1, 0, c.admit_expert(1, 0, 4, Buf(4)), "w0")
    assert c.held_version > version and c.whole_layer(1) is None and c.missing_experts(1) == [1]
    c.put_expert(1, 1, c.admit_expert(1, 1, 4, Buf(4)), "w1")
    assert c.whole_layer(1) == {0: "w0", 1: "w1"} and c.missing_experts(1) == [] and not drops
    c.set_target(20 + 4)  # one slot: an expert goes
    assert len(drops) == 1 and c.whole_layer(1) is None and c.missing_experts(1) == []  # the plan: not all
    c.set_target(0)
    assert len(drops) == 4  # then the other expert and both spines, a notice each
    assert drops == sorted(drops) and c.held_bytes() == 0


def test_a_cache_in_the_cpu_layout_keeps_the_logits_through_shrink_and_grow(tmp_path, wide_q8_path):
    """A streamed model computing on the CPU keeps its spines and experts interleaved (grouped int8): a
    pass served from the cache, one after it gave everything back (weights read per pass, stored layout)
    and one after it grew again compute the logits of the model streamed without a cache, within float32
    summation order, with the same greedy tokens; what the cache holds at the end is interleaved again."""
    plain = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "0"})
    want, _ = generate(wide_q8_path, plain, {})
    lines, held = [], []
    cached = Settings.resolve({"device": "cpu", "stream": "on", "ram_budget": "auto"})

    shrink_grow = shrink_at_5_grow_at_8(tmp_path, lines)

    def between(k, provider):
        shrink_grow(k, provider)
        if k in (4, len(DECODE) - 1):
            held.append([w for i in range(provider.config.num_layers) for name, w in (provider.cache.spine(i) or {}).items()
                         if getattr(w, "group_size", 0) == 32 and w.shape[1] >= 512 and not name.endswith("kv_b_proj")])
    got, stats = generate(wide_q8_path, cached, {"memory_root": str(tmp_path), "watch": False, "cpu_layout": True},
                          between)
    for k, (a, b) in enumerate(zip(want, got)):
        assert (a - b).abs().max() <= 1e-3 * a.abs().max(), f"pass {k} differs"
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert stats[4].spines_cached and stats[5].spines_cached == 0 and stats[-1].spines_cached
    assert all(ws and all(w.tensors["weight_scale"].dim() == 3 for w in ws) for ws in held)
