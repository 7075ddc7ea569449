"""The generation loop on the real tiny K3 model: speculation is lossless, the decode state after
generation is a plain prefill of what was produced, and the EOS / stop string / max_new_tokens /
cancel contract holds wherever in a verified burst it triggers."""
from __future__ import annotations

import random

import pytest
import torch

from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.generate import Decoding, DraftLengths, NgramDrafter, generate

from conftest import KL_CODE_TINY

STATE_TOL = 1e-4
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The tiny model's ops are far too small to gain from threads, and on a shared machine a
    # second thread makes every op wait for a busy core.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tiny_k3_model):
    torch.set_num_threads(1)  # deltafin.load sets the thread count; take it back for this module
    return tiny_k3_model


def plain_greedy(model, prompt, n, eos=()):
    """Reference decoding written out by hand: prefill, then one token per forward."""
    state = model.new_state()
    token = int(model.forward(list(prompt), state)[-1].argmax())
    out = []
    while token not in eos:
        out.append(token)
        if len(out) == n:
            break
        token = int(model.forward([token], state)[-1].argmax())
    return out


def prefilled(model, ids):
    state = model.new_state()
    model.forward(list(ids), state)
    return state


def assert_state_is_prefill(model, prompt, g):
    assert g.state.num_tokens == len(prompt) + len(g.generated) - 1
    assert g.state.max_abs_diff(prefilled(model, list(prompt) + g.generated[:-1])) <= STATE_TOL


PROMPT_NAMES = ["random-short", "random", "repetitive-ids", "repetitive-text", "code", "code-loop"]


def _prompts(model):
    r = random.Random(0)
    vocab = model.config.vocab_size
    return {
        "random-short": [r.randrange(6, vocab) for _ in range(3)],
        "random": [r.randrange(6, vocab) for _ in range(40)],
        "repetitive-ids": [7, 8, 9, 10, 11] * 6,
        "repetitive-text": model.encode("the cat sat on the mat. " * 5),
        "code": model.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"),
        "code-loop": model.encode("for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n"),
    }


@pytest.fixture(scope="module")
def truths(model):
    """prompt name -> (prompt, plain greedy continuation of MAX_NEW tokens, no EOS)."""
    return {name: (p, plain_greedy(model, p, MAX_NEW)) for name, p in _prompts(model).items()}


class Oracle:
    """Drafts the known greedy continuation (``length`` tokens, default as many as asked), with
    the token at ``wrong_at`` changed so that the verifier must reject it there."""

    def __init__(self, prompt, truth, vocab, wrong_at=None, length=None):
        self.prompt_len, self.truth, self.vocab = len(prompt), truth, vocab
        self.wrong_at, self.length = wrong_at, length
        self.calls = []  # (tokens produced before the call, draft)

    def __call__(self, context, max_len):
        done = len(context) - self.prompt_len
        draft = list(self.truth[done:done + (max_len if self.length is None else self.length)])
        if self.wrong_at is not None and self.wrong_at < len(draft):
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % self.vocab
        self.calls.append((done, draft))
        return draft


# -- speculation is lossless -----------------------------------------------------------------

@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_speculation_equals_plain_greedy(model, truths, name):
    prompt, truth = truths[name]
    assert len(truth) == MAX_NEW  # the tiny model's EOS never comes first here
    if name in ("random", "code"):  # the non-speculative path of generate() itself
        plain = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW, speculate=False))
        assert plain.tokens == truth and plain.stats["drafted_tokens"] == 0
        assert plain.stats["passes"] == MAX_NEW - 1
        assert_state_is_prefill(model, prompt, plain)
    for n in (1, 7, MAX_NEW):
        g = generate(model, prompt, SamplingParams(max_new_tokens=n, speculate=True))
        assert g.tokens == truth[:n] and g.generated == truth[:n]
        assert g.finish_reason == "length"
        assert_state_is_prefill(model, prompt, g)
        s = g.stats
        assert s["tokens"] == n and s["prefill_tokens"] == len(prompt)
        assert s["passes"] + s["accepted_draft_tokens"] == n - 1  # each pass: its accepted drafts + 1
        assert s["accepted_draft_tokens"] <= s["drafted_tokens"]
        if s["passes"]:
            assert s["tokens_per_pass"] == pytest.approx((n - 1) / s["passes"])


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3])
def test_draft_rejected_at_every_position(model, truths, wrong_at):
    prompt, truth = truths["code"]
    n = 16
    assert model.settings.draft_len == 8  # every wrong_at lies inside the drafts
    oracle = Oracle(prompt, truth, model.config.vocab_size, wrong_at=wrong_at)
    g = generate(model, prompt, SamplingParams(max_new_tokens=n), drafter=oracle)
    assert g.tokens == truth[:n]
    assert_state_is_prefill(model, prompt, g)
    # One pass per draft, and each pass took exactly the drafts before the wrong one plus the
    # verifier's own token: a rejection never costs a second pass.
    end = 1
    for done, draft in oracle.calls:
        assert done == end
        end = done + (wrong_at if wrong_at < len(draft) else len(draft)) + 1
    # with one token left to produce there is nothing to draft: that last pass asks no drafter
    assert g.stats["passes"] == len(oracle.calls) + (n - end) and n - end in (0, 1)
    assert g.stats["accepted_draft_tokens"] == sum(
        (wrong_at if wrong_at < len(d) else len(d)) for _, d in oracle.calls)


def test_full_acceptance_and_longer_drafts_are_trimmed(model, truths):
    prompt, truth = truths["random"]
    oracle = Oracle(prompt, truth, model.config.vocab_size, length=9)  # ignores max_len
    for n in (2, 5, 7, 13):
        oracle.calls.clear()
        g = generate(model, prompt, SamplingParams(max_new_tokens=n), drafter=oracle)
        assert g.tokens == truth[:n] and g.finish_reason == "length"
        assert_state_is_prefill(model, prompt, g)
        # bursts of draft_len + 1 tokens; the last one shortened to what may still be produced
        assert g.stats["passes"] == -(-(n - 1) // (model.settings.draft_len + 1))
        assert g.stats["accepted_draft_tokens"] == n - 1 - g.stats["passes"]


# -- the stop contract inside a burst ---------------------------------------------------------

def test_eos_inside_an_accepted_burst(model, truths):
    prompt, truth = truths["code"]
    span = model.settings.draft_len + 1
    # bursts cover truth[1:6], truth[6:11], ...; pick a drafted (not the bonus) position whose
    # token has not occurred before, and call it EOS
    i = next(j for j in range(min(3 * span, len(truth) - 1), 1, -1)
             if (j - 1) % span != span - 1 and truth[j] not in truth[:j])
    eos = [truth[i]]
    oracle = Oracle(prompt, truth, model.config.vocab_size)
    seen = []
    g = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW),
                 eos_token_ids=eos, drafter=oracle, on_token=lambda t, text: seen.append(t))
    assert g.tokens == truth[:i] == plain_greedy(model, prompt, MAX_NEW, eos=eos)
    assert g.finish_reason == "stop" and seen == g.tokens
    assert g.generated == truth[:i + 1]  # the EOS was produced, never returned
    done, draft = oracle.calls[-1]
    assert done <= i < done + len(draft)  # EOS was an accepted draft with more accepted after it
    assert_state_is_prefill(model, prompt, g)
    # EOS as the very first token: nothing returned, the state is the prompt
    g = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW), eos_token_ids=[truth[0]])
    assert (g.tokens, g.generated, g.finish_reason, g.stats["passes"]) == ([], truth[:1], "stop", 0)
    assert_state_is_prefill(model, prompt, g)


def test_cancel_inside_a_burst(model, truths):
    prompt, truth = truths["repetitive-text"]
    oracle = Oracle(prompt, truth, model.config.vocab_size)
    seen = []

    def on_token(token, text):
        seen.append(token)
        return len(seen) < 3  # False on the 3rd token: inside the first verified burst

    # (the 4th token of this continuation is the first byte of a character: on_token would see it
    # only with the 5th, which completes it)
    g = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW), drafter=oracle, on_token=on_token)
    assert g.finish_reason == "cancelled"
    assert g.tokens == seen == truth[:3] and g.generated == truth[:3]
    assert len(oracle.calls) == 1 and g.stats["passes"] == 1
    assert_state_is_prefill(model, prompt, g)


def _text_after(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _stop_across_boundary(model, truths, burst):
    """Find a prompt and a burst boundary b where the two characters around it make a stop
    string whose first occurrence is at that boundary."""
    tok = model.tokenizer
    for name in truths:
        prompt, truth = truths[name]
        for b in range(1 + burst, MAX_NEW - 1, burst):
            before, after = _text_after(tok, truth[:b]), _text_after(tok, truth[:b + 1])
            if (not before or "\ufffd" in before[-1] + after[len(before):len(before) + 1]
                    or _text_after(tok, truth[:b - 1]).endswith("\ufffd") or not after.startswith(before)
                    or len(after) == len(before)):
                continue
            stop = before[-1] + after[len(before)]
            full = _text_after(tok, truth)
            if full.find(stop) == len(before) - 1:
                return prompt, truth, b, stop
    raise AssertionError("no usable burst boundary in the test prompts")


def test_stop_string_across_a_burst_boundary(model, truths):
    tok = model.tokenizer
    burst = 3  # drafts of 2 tokens: bursts truth[1:4], truth[4:7], ...
    prompt, truth, b, stop = _stop_across_boundary(model, truths, burst)
    at = len(_text_after(tok, truth[:b])) - 1  # the stop string starts in token b-1, ends in token b
    # a token is kept iff its text starts before the stop string
    kept = b if len(_text_after(tok, truth[:b - 1])) < at else b - 1
    full = _text_after(tok, truth)
    for speculate in (True, False):
        oracle = Oracle(prompt, truth, model.config.vocab_size, length=2)
        calls = []
        g = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW, speculate=speculate, stop=["\x00none", stop]),
                     drafter=oracle, on_token=lambda t, text: calls.append((t, text)))
        assert g.finish_reason == "stop"
        assert g.text == full[:at] and stop not in g.text
        assert g.tokens == truth[:kept] and g.generated == truth[:b + 1]
        assert [t for t, _ in calls] == g.tokens and "".join(x for _, x in calls) == g.text
        assert all(stop not in x for _, x in calls)
        assert_state_is_prefill(model, prompt, g)
        if speculate:
            assert oracle.calls[-1][0] == b  # token b began the burst that completed the stop string


def test_text_held_back_for_a_possible_stop_string_is_released(model, truths):
    prompt, truth = truths["code"]
    base = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert base.text == _text_after(model.tokenizer, truth)
    # stop strings that begin like pieces of the output but never complete
    stops = [base.text[k] + "\x00" for k in range(0, len(base.text), 3)] + [base.text[-2:] + "\x00"]
    calls = []
    g = generate(model, prompt, SamplingParams(max_new_tokens=MAX_NEW, stop=stops),
                 on_token=lambda t, text: calls.append((t, text)))
    assert (g.tokens, g.text, g.finish_reason) == (truth, base.text, "length")
    assert [t for t, _ in calls] == truth and "".join(x for _, x in calls) == base.text


# -- sampling ---------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(model, truths):
    prompt, truth = truths["random"]
    n = 12
    kw = dict(temperature=0.9, top_p=0.95, top_k=40)
    a = generate(model, prompt, SamplingParams(max_new_tokens=n, seed=123, **kw))
    b = generate(model, prompt, SamplingParams(max_new_tokens=n, seed=123, **kw))
    assert a.tokens == b.tokens and len(a.tokens) == n
    assert a.stats["drafted_tokens"] == 0  # sampling never speculates
    assert_state_is_prefill(model, prompt, a)
    others = {tuple(generate(model, prompt, SamplingParams(max_new_tokens=n, seed=s, temperature=1.5)).tokens) for s in (1, 2)}
    assert len(others) > 1
    # top_k=1 and a tiny top_p leave only the argmax
    assert generate(model, prompt, SamplingParams(max_new_tokens=n, seed=5, temperature=1.0, top_k=1)).tokens == truth[:n]
    assert generate(model, prompt, SamplingParams(max_new_tokens=n, seed=5, temperature=1.0, top_p=1e-6)).tokens == truth[:n]


def test_sampling_respects_top_k(model, truths):
    prompt, _ = truths["code"]
    g = generate(model, prompt, SamplingParams(max_new_tokens=12, seed=7, temperature=2.0, top_k=3))
    logits = model.forward(prompt + g.tokens[:-1], model.new_state())[len(prompt) - 1:]
    allowed = logits.topk(3, dim=-1).indices.tolist()
    assert all(t in row for t, row in zip(g.tokens, allowed))


# -- bad input --------------------------------------------------------------------------------

def test_bad_input_is_refused(model):
    vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"id -1\b"):
        generate(model, [5, -1], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=rf"id {vocab}\b"):
        generate(model, [5, vocab, 6], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="not an integer"):
        generate(model, [5, "6"], SamplingParams(max_new_tokens=4))
    state = model.new_state()
    with pytest.raises(ValueError, match=rf"{limit} tokens \(max_position_embeddings\)"):
        generate(model, [5] * (limit - 3), SamplingParams(max_new_tokens=4), state=state)
    assert state.num_tokens == 0
    for kw in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(stop=[""]), dict(stop=[3])):
        with pytest.raises(ValueError):
            generate(model, [5, 6], SamplingParams(max_new_tokens=4, **kw))
    with pytest.raises(ValueError, match=rf"draft token 0 has id {vocab}\b"):
        generate(model, [5, 6], SamplingParams(max_new_tokens=4), drafter=lambda context, n: [vocab])
    g = generate(model, [5, 6], SamplingParams(max_new_tokens=0))
    assert (g.tokens, g.finish_reason, g.state.num_tokens) == ([], "length", 0)


# -- the n-gram drafter -----------------------------------------------------------------------

def test_ngram_drafter_prefers_longest_then_most_recent_match():
    context = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    assert NgramDrafter(3)(context, 4) == [9, 8, 2, 3]  # "1 2 3" seen at the start
    assert NgramDrafter(2)(context, 3) == [7, 6, 1]  # "2 3": the most recent earlier occurrence
    assert NgramDrafter(3)([4, 5, 6], 4) == []  # nothing repeats
    assert NgramDrafter(3)([4, 5, 6], 0) == []
    # a match that runs into the end continues with its period
    assert NgramDrafter(3)([0, 5, 5, 5], 4) == [5, 5, 5, 5]
    assert NgramDrafter(3)([1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]


def test_ngram_drafter_min_length_skips_short_matches():
    assert NgramDrafter(3)([1, 2, 3, 9, 3], 2) == [9, 3]  # a 1-gram match on "3"
    assert NgramDrafter(3, min_n=2)([1, 2, 3, 9, 3], 2) == []
    assert NgramDrafter(3, min_n=2)([1, 2, 3, 9, 2, 3], 2) == [9, 2]
    with pytest.raises(ValueError):
        NgramDrafter(2, min_n=3)


def test_ngram_drafter_indexes_a_growing_context():
    drafter = NgramDrafter(2)
    context = [1, 2, 3]
    assert drafter(context, 2) == []
    context += [1, 2]
    assert drafter(context, 2) == [3, 1]
    context += [4, 1, 2]
    assert drafter(context, 2) == [4, 1]  # the newest occurrence of "1 2" wins


def test_ngram_drafter_says_the_length_of_its_match():
    context = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    assert NgramDrafter(3).propose(context, 4) == ([9, 8, 2, 3], 3)
    assert NgramDrafter(2).propose(context, 3) == ([7, 6, 1], 2)
    assert NgramDrafter(3, min_n=2).propose([1, 2, 3, 9, 3], 2) == ([], 0)
    assert NgramDrafter(3).propose(context, 0) == ([], 0)


def test_draft_lengths_follow_how_each_match_lengths_drafts_fared():
    lengths = DraftLengths(least=0.3)
    assert lengths.length(2, 8) == 8 and lengths.length(4, 3) == 3  # untried: the whole draft
    lengths.record(2, 8, 0)  # rejected at its first token: 0 of 1 tried position
    assert lengths.tries[2] == (0, 1) and lengths.length(2, 8) == 1  # p = 1/2: 0.5 >= 0.3 > 0.25
    lengths.record(2, 1, 0)
    assert lengths.length(2, 8) == 1  # p = 1/3
    lengths.record(2, 1, 0)
    assert lengths.length(2, 8) == 0  # p = 1/4: not worth a row
    lengths.record(4, 8, 8)  # all accepted: 8 of 8 tried positions
    lengths.record(4, 8, 3)  # rejected at its fourth: 3 of 4
    assert lengths.tries[4] == (11, 12) and lengths.length(4, 8) == 8  # (12/13) ** 8 = 0.53
    assert lengths.length(4, 16) == 15  # (12/13) ** 15 = 0.30, ** 16 = 0.28
    lengths.record(3, 0, 0)  # nothing drafted: nothing learned
    assert 3 not in lengths.tries
    assert DraftLengths(least=0.0).length(2, 8) == 8


@pytest.mark.skipif(not (KL_CODE_TINY / "config.json").exists(), reason="kl-code-tiny is not on this machine")
def test_drafts_of_the_trained_model_are_cut_where_they_miss():
    """kl-code-tiny writing Python: the same tokens as plain greedy decoding, and with drafts cut by how
    their match length's drafts fared fewer draft tokens verified in vain than with every draft whole."""
    import deltafin
    model = deltafin.load(KL_CODE_TINY, stream="off", ram_budget="0", dtype="float32")
    prompt = model.encode("def fibonacci(n):")
    want = plain_greedy(model, prompt, 128)

    def run(least):
        d = Decoding(model, prompt, SamplingParams(max_new_tokens=128), eos_token_ids=[])
        d.draft_lengths = DraftLengths(least)
        while not d.done:
            d.take(model.forward_batch([d.next_pass()])[0])
        return d.result()
    cut, whole = run(0.3), run(0.0)
    assert cut.tokens == whole.tokens == want
    def wasted(g):
        return g.stats["drafted_tokens"] - g.stats["accepted_draft_tokens"]
    assert wasted(cut) < wasted(whole) / 2 and cut.stats["accepted_draft_tokens"] > 0


def test_prompt_pieces_follow_the_room(tiny_k3_path, capsys):
    """A prompt whose activations do not fit the room goes in pieces (said on stderr), with the same
    tokens as one pass; the bound grows with rows and with the context MLA attends over."""
    import deltafin
    from deltafin.runtime.prompt_piece import MIN_PIECE, activation_bytes, prompt_piece
    m = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    cfg = m.config
    assert activation_bytes(cfg, 64, 64) < activation_bytes(cfg, 128, 64) < activation_bytes(cfg, 128, 4096)
    assert prompt_piece(cfg, 300, 300, None) == 300  # room unknown: one pass
    assert prompt_piece(cfg, 300, 300, 1 << 40) == 300
    room = 4 * activation_bytes(cfg, 50, 300)  # half of it holds ~100 rows
    piece = prompt_piece(cfg, 300, 300, room)
    assert MIN_PIECE <= piece < 300 and activation_bytes(cfg, piece, 300) <= room / 2
    assert prompt_piece(cfg, 300, 300, 1) == MIN_PIECE
    prompt = list(range(5, 305))
    want = m.generate(prompt, max_new_tokens=6, speculate=False)
    m._activation_room = lambda: room
    passes = []

    class Count(deltafin.runtime.pass_stats.PassObserver):
        def on_pass(self, stats):
            passes.append(stats.tokens)

    with m.observe(Count()):
        got = m.generate(prompt, max_new_tokens=6, speculate=False)
    assert got == want
    pieces = [piece] * (300 // piece) + ([300 % piece] if 300 % piece else [])
    assert passes[:len(pieces)] == pieces and all(n == 1 for n in passes[len(pieces):])
    assert f"a prompt of 300 tokens goes in passes of {piece}" in capsys.readouterr().err
