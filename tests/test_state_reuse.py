"""Reusing a decode state: logits after a kept, copied, saved or cached prefix equal those of a full
prefill (fp32), for K3 (KDA + MLA) and Kimi Linear, at prefixes that cut KDA chunks and MLA caches
anywhere, and after speculation rollbacks; saved states refuse files that do not belong.

Two checks per reuse: bit-for-bit equality with the same split computed on a state that was never
copied (reuse adds no error at all), and <= 1e-4 from a one-pass full prefill (the chunked and
recurrent KDA paths legitimately differ by fp32 rounding, well under that)."""
from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from deltafin.runtime.sampling import SamplingParams
import deltafin
from deltafin.runtime.generate import generate
from deltafin.model.state import DecodeState, StateFileError
from deltafin.serve.prefix_cache import PrefixCache
from deltafin.runtime.saved_state import load_state, save_state

TOL = 1e-4
CHUNK = 16  # small KDA chunks, so short prompts cross several chunk boundaries


@pytest.fixture(scope="module")
def models(tiny_k3_path, tiny_kl_path):
    out = {name: deltafin.load(p, device="cpu", stream="off", kda_chunk=CHUNK, threads=1)
           for name, p in (("k3", tiny_k3_path), ("kl", tiny_kl_path))}
    torch.set_num_threads(1)
    return out


def _ids(model, n, seed=0):
    r = random.Random(seed)
    return [r.randrange(6, model.config.vocab_size) for _ in range(n)]


def _continue(model, state, ids):
    return model.forward(list(ids), state)


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_reused_prefix_gives_full_prefill_logits(models, name, tmp_path):
    model = models[name]
    ids = _ids(model, 3 * CHUNK + 5)
    full = model.logits(ids)
    # cuts: inside the recurrent path (<= 16 tokens), on and around chunk boundaries, one token left
    for cut in (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, len(ids) - 1):
        state = model.new_state()
        model.forward(ids[:cut], state)
        kept = state.snapshot()
        split = _continue(model, state, ids[cut:])  # the live state moves on; the snapshot must not
        assert (split - full[cut:]).abs().max() <= TOL, cut
        fresh = model.new_state()
        fresh.restore(kept)
        assert torch.equal(_continue(model, fresh, ids[cut:]), split), cut
        save_state(model, tmp_path / "s.state", ids[:cut], kept)
        held, loaded, _ = load_state(model, tmp_path / "s.state")
        assert held == ids[:cut] and loaded.num_tokens == cut
        assert torch.equal(_continue(model, loaded, ids[cut:]), split), cut


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_prefix_cache_serves_longest_prefix(models, name):
    model = models[name]
    ids = _ids(model, 40, seed=1)
    cache = PrefixCache(budget_bytes=1 << 30)
    for cut in (5, 20, 33):
        st = model.new_state()
        model.forward(ids[:cut], st)
        cache.put(ids[:cut], st, copy=False)
    assert cache.lookup(ids[:5]) == (0, None)  # an exact match is not a proper prefix
    n, st = cache.lookup(ids[:34] + [9, 10])
    assert n == 33
    full = model.logits(ids[:34] + [9, 10])
    assert (_continue(model, st, ids[33:34] + [9, 10]) - full[33:]).abs().max() <= TOL
    n2, st2 = cache.lookup(ids[:25])
    assert n2 == 20 and st2.num_tokens == 20
    assert cache.lookup([1] + ids) == (0, None)
    s = cache.stats()
    assert (s["hits"], s["misses"], s["cached_tokens"]) == (2, 2, 53)


def test_prefix_cache_evicts_least_recently_used(models):
    model = models["kl"]
    ids = _ids(model, 10, seed=2)
    one = model.new_state()
    model.forward(ids[:3], one)
    size = one.nbytes()
    cache = PrefixCache(budget_bytes=2 * size + size // 2)  # room for two states of this size
    for n in (3, 4, 5):
        st = model.new_state()
        model.forward(ids[:n], st)
        if n == 5:
            assert cache.lookup(ids[:3] + [1])[0] == 3  # touch it: the 4-token entry is now the oldest
        cache.put(ids[:n], st)
    assert cache.lookup(ids[:4] + [1])[0] == 3
    assert cache.lookup(ids)[0] == 5
    assert cache.stats()["evictions"] == 1 and len(cache) == 2
    assert cache.nbytes <= cache.budget_bytes
    assert not PrefixCache(budget_bytes=size - 1).put(ids[:3], one)  # larger than the whole budget
    cache.put(ids[:2] + [5], model.forward(ids[:2] + [5], s := model.new_state()) is not None and s,
              pinned=True)
    assert len(cache) == 3 and cache.nbytes <= cache.budget_bytes  # pinned entries do not count


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_state_after_speculation_rollbacks_is_reusable(models, name):
    """generate() with speculation ends on a state built by verify passes and rollbacks; continuing
    from a copy of it gives the logits of a full prefill of everything it holds."""
    model = models[name]
    prompt = _ids(model, 20, seed=3)
    truth = generate(model, prompt, SamplingParams(max_new_tokens=12, speculate=False)).generated

    def drafter(context, n):  # one right token, then a wrong one: every pass accepts and rolls back
        i = len(context) - len(prompt)
        return (truth[i:i + 1] + [5] * n)[:n]

    g = generate(model, prompt, SamplingParams(max_new_tokens=12, speculate=True), drafter=drafter)
    assert g.generated == truth and 0 < g.stats["accepted_draft_tokens"] < g.stats["drafted_tokens"]
    held = prompt + g.generated[:-1]
    cache = PrefixCache(budget_bytes=1 << 30)
    cache.put(held, g.state)
    nxt = held + [g.generated[-1], 21, 22]
    n, st = cache.lookup(nxt)
    assert n == len(held)
    full = model.logits(nxt)
    assert (_continue(model, st, nxt[n:]) - full[n:]).abs().max() <= TOL


def test_saved_state_from_another_model_or_dtype_is_refused(models, tmp_path):
    k3, kl = models["k3"], models["kl"]
    st = k3.new_state()
    k3.forward([5, 6, 7], st)
    save_state(k3, tmp_path / "k3.state", [5, 6, 7], st)
    with pytest.raises(StateFileError, match="different"):
        load_state(kl, tmp_path / "k3.state")
    # same config, other weights
    from deltafin.checkpoint.synthetic import make_checkpoint
    other = deltafin.load(make_checkpoint("tiny-k3", tmp_path / "seed1", seed=1, progress=False),
                          device="cpu", stream="off", threads=1)
    with pytest.raises(StateFileError, match="weights differ"):
        load_state(other, tmp_path / "k3.state")
    bf16 = deltafin.load(k3.path, device="cpu", stream="off", dtype="bfloat16", threads=1)
    with pytest.raises(StateFileError, match="product dtype"):
        load_state(bf16, tmp_path / "k3.state")
    torch.set_num_threads(1)


def test_bad_state_files_get_clear_errors(models, tmp_path):
    model = models["k3"]
    st = model.new_state()
    model.forward([5, 6, 7, 8], st)
    good = tmp_path / "good.state"
    save_state(model, good, [5, 6, 7, 8], st)
    raw = good.read_bytes()
    hlen = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + hlen])
    meta = json.loads(header["__metadata__"]["deltafin"])

    def write(name, data):
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    def with_header(name, h):
        body = json.dumps(h).encode()
        body += b" " * (-len(body) % 8)
        return write(name, struct.pack("<Q", len(body)) + body + raw[8 + hlen:])

    def with_meta(name, **changes):
        h = json.loads(json.dumps(header))
        h["__metadata__"]["deltafin"] = json.dumps({**meta, **changes})
        return with_header(name, h)

    # a tensor whose shape differs, as the header says (nothing is allocated from it)
    h = json.loads(json.dumps(header))
    name = next(k for k in h if k.endswith(".S"))
    h[name]["shape"] = [h[name]["shape"][0] * 2, *h[name]["shape"][1:]]
    cases = {
        "missing": (tmp_path / "nope.state", "no such state file"),
        "empty": (write("empty", b""), "not a readable state file"),
        "truncated": (write("trunc", raw[:-100]), "not a readable state file"),
        "huge header": (write("huge", struct.pack("<Q", 1 << 60) + raw[8:]), "not a readable state file"),
        "garbage": (write("garbage", b"\x00" * 64), "not a readable state file"),
        "not ours": (with_header("plain", {k: v for k, v in header.items() if k != "__metadata__"}),
                     "not a saved deltafin decode state"),
        "version": (with_meta("version", version=99), "version 99"),
        "ids": (with_meta("ids", token_ids=[5, 6]), "token_ids"),
        "out of vocab": (with_meta("vocab", token_ids=[5, 6, 7, 10 ** 9]), "token_ids"),
        "shape": (with_header("shape", h), "not a readable state file|needs"),
    }
    for what, (path, message) in cases.items():
        with pytest.raises(StateFileError, match=message):
            load_state(model, path)
    n_extra = dict(header)
    del n_extra[name]
    with pytest.raises(StateFileError):
        load_state(model, with_header("missing-tensor", n_extra))
    assert load_state(model, good)[0] == [5, 6, 7, 8]


def test_generate_after_a_reused_prefix_gives_the_same_text(models):
    model = models["k3"]
    ids = model.encode("The committee met on Thursday. After a long discussion about the budget, they agreed to")
    whole = generate(model, ids, SamplingParams(max_new_tokens=16, speculate=True))
    seen = []
    for cut in (3, len(ids) - 1):
        st = model.new_state()
        model.forward(ids[:cut], st)
        g = generate(model, ids[cut:], SamplingParams(max_new_tokens=16, speculate=True),
                     state=st, held_ids=ids[:cut], on_prefill=lambda s: seen.append(s.num_tokens))
        assert (g.tokens, g.text) == (whole.tokens, whole.text)
        assert g.state.num_tokens == len(ids) + len(g.generated) - 1
    assert seen == [len(ids), len(ids)]
    with pytest.raises(ValueError, match="held_ids has 2 tokens, but the state holds 3"):
        st = model.new_state()
        model.forward(ids[:3], st)
        generate(model, ids[3:], SamplingParams(max_new_tokens=4), state=st, held_ids=ids[:2])
