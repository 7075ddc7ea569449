"""Batched passes: several sequences share every weight pass, and each gets what it gets alone.

A sequence's logits in a batch differ from the same sequence run alone only by the rounding of
matrix products over a different number of rows (the native gemvs serve up to 64 rows, larger
batches go through torch's sgemm; both sum in their own order). That difference is measured here
and bounded by ROUNDING, the same budget as decode-with-cache against full recompute; greedy
tokens and seeded samples must be identical.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import deltafin

from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.engine import Seq
from deltafin.runtime.generate import generate
from deltafin.runtime.scheduler import (ACCEPTED_DRAFTS, COST_SMOOTHING, MAX_PASS_ROWS, PASS_ROWS, PassCosts, Scheduler,
                                draft_limits)
from deltafin.serve.app import create_app

ROUNDING = 1e-4  # fp32 logits of magnitude ~10: a few ulps of accumulated rounding


@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


def _ids(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def _compare(alone: list, batched: list) -> float:
    worst = 0.0
    for a, b in zip(alone, batched):
        if a is None:
            assert b is None
            continue
        assert a.shape == b.shape
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        worst = max(worst, (a - b).abs().max().item())
    return worst


def test_batched_pass_equals_each_sequence_alone(model):
    """Ragged passes: prompt chunks (with and without logits), single decode tokens, and drafts
    verified with keep_states then rolled back per sequence, over three passes."""
    prompts = [_ids(model, n, seed) for seed, n in enumerate((3, 40, 1, 23))]
    alone = [model.new_state() for _ in prompts]
    batch = [model.new_state() for _ in prompts]
    worst = 0.0
    plan = [  # per pass: (ids, keep_states, logits, rollback-to) for each sequence
        [(prompts[0], False, "all", None), (prompts[1][:32], False, "none", None),
         (prompts[2], False, "last", None), (prompts[3], False, "last", None)],
        [(_ids(model, 1, 10), False, "all", None), (prompts[1][32:], False, "last", None),
         (_ids(model, 4, 11), True, "all", 2), (_ids(model, 3, 12), True, "all", 23 + 3)],
        [(_ids(model, 5, 13), True, "all", 3 + 1 + 1), (_ids(model, 1, 14), False, "all", None),
         (_ids(model, 1, 15), False, "all", None), (_ids(model, 1, 16), False, "all", None)],
    ]
    for step in plan:
        want = [model.engine.forward_batch([Seq(ids, st, keep, logits)])[0]
                for (ids, keep, logits, _), st in zip(step, alone)]
        got = model.engine.forward_batch([Seq(ids, st, keep, logits) for (ids, keep, logits, _), st in zip(step, batch)])
        assert model.engine.last_pass.tokens == sum(len(ids) for ids, *_ in step)
        worst = max(worst, _compare(want, got))
        for (_, _, _, back), a, b in zip(step, alone, batch):
            if back is not None:
                a.rollback(back)
                b.rollback(back)
            assert a.num_tokens == b.num_tokens
            assert a.max_abs_diff(b) <= ROUNDING
    assert worst <= ROUNDING
    # the rolled-back states are exact prefills: one more token agrees with a fresh full prefill
    full = model.new_state()
    assert batch[0].num_tokens == 5
    history = prompts[0] + _ids(model, 1, 10) + _ids(model, 5, 13)[:1]
    model.forward(history, full)
    assert full.max_abs_diff(batch[0]) <= ROUNDING


def test_a_pass_reads_back_every_sequences_argmax_at_once(model):
    """PendingPass.argmax: each sequence's wanted rows' argmax (none for a prompt piece that wants no
    logits), the ids each row's own argmax gives; asked before the pass ended, an error."""
    states = [model.new_state() for _ in range(3)]
    seqs = [Seq(_ids(model, 7, 1), states[0], logits="none"), Seq(_ids(model, 4, 2), states[1], logits="all"),
            Seq(_ids(model, 5, 3), states[2], logits="last")]
    pending = model.start_batch(seqs)
    with pytest.raises(RuntimeError, match="before result"):
        pending.argmax()
    logits = pending.result()
    assert pending.argmax() == [[], logits[1].argmax(-1).tolist(), logits[2].argmax(-1).tolist()]
    assert [len(a) for a in pending.argmax()] == [0, 4, 1]
    # a pass none of whose sequences wants logits has no ids to give
    pending = model.start_batch([Seq(_ids(model, 3, 4), model.new_state(), logits="none")])
    assert pending.result() == [None] and pending.argmax() == [[]]


def test_the_scheduler_hands_greedy_requests_the_picks_of_one_read_back(model, alone):
    """In one process too, every pass the scheduler runs is a pending pass whose argmax the greedy
    requests take (one read-back a pass); the outputs stay each alone's."""
    shapes = _Pending(model)
    got = _run_all(Scheduler(shapes, 8, PREFILL_CHUNK), model, alone)
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in alone]
    decode = [p for p in shapes.pending if any(s.logits == "all" for s in p.seqs)]
    assert decode and all(p._argmax is not None for p in decode)


class _Pending:
    """The model, keeping every pass the scheduler starts."""

    def __init__(self, model):
        self.model, self.pending = model, []

    def start_batch(self, seqs):
        self.pending.append(self.model.start_batch(seqs))
        return self.pending[-1]

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_routed_experts_are_read_once_per_layer_for_the_batch(model):
    """The experts a batch asks for are the union of what its rows chose, each read once."""
    seqs = [Seq(_ids(model, 1, 20 + k), model.new_state()) for k in range(6)]
    model.engine.forward_batch(seqs)
    together = model.engine.last_pass.experts_loaded
    apart = 0
    for s in seqs:
        model.engine.forward_batch([Seq(s.ids, model.new_state())])
        apart += model.engine.last_pass.experts_loaded
    cfg = model.config
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert together <= moe_layers * cfg.num_experts and together < apart


def test_bad_batches_are_refused_and_change_nothing(model):
    st = model.new_state()
    model.forward(_ids(model, 4, 1), st)
    cases = [
        ([], "at least one sequence"),
        ([Seq([1], st), Seq([2], st)], "appears twice"),
        ([Seq([1], st, logits="some")], "'all', 'last' or 'none'"),
        ([Seq([], st)], "at least one token id"),
        ([Seq([1], model.new_state()), Seq([model.config.vocab_size], st)], "outside the vocabulary"),
    ]
    for seqs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.engine.forward_batch(seqs)
        assert st.num_tokens == 4


# -- the scheduler ---------------------------------------------------------------------------

PREFILL_CHUNK = 8


def _requests(model):
    """Mixed prompt lengths (some longer than a prefill chunk), max_tokens, greedy (speculating)
    and seeded sampling."""
    out = []
    for k in range(8):
        prompt = _ids(model, (2, 9, 30, 5, 17, 1, 12, 40)[k], 100 + k)
        if k % 3 == 1:
            prompt = prompt + prompt[:6] + prompt  # repetition gives the n-gram drafter something
        options = {"temperature": 0.0} if k % 2 == 0 else {"temperature": 0.8, "top_k": 20, "seed": 7 + k}
        out.append((prompt, SamplingParams(max_new_tokens=(12, 5, 20, 1, 9, 16, 3, 7)[k], **options)))
    return out


def _drafts(model, k: int, prompt: list[int], truth: list[int]) -> dict:
    """For every other greedy request, a drafter that proposes the true continuation with one
    wrong token (at a position that varies), so drafts are accepted, cut and rolled back per
    sequence inside shared passes; the rest keep the n-gram drafter."""
    if k % 4:
        return {}
    wrong_at = k % 3 + 1

    def drafter(context, n):
        done = len(context) - len(prompt)
        draft = list(truth[done:done + n])
        if wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % model.config.vocab_size
        return draft
    return {"drafter": drafter}


@pytest.fixture(scope="module")
def alone(model):
    return [generate(model, p, params, prefill_chunk=PREFILL_CHUNK) for p, params in _requests(model)]


def _run_all(sched, model, alone) -> list:
    """Every request of _requests submitted at once (some with their own drafters); the results,
    with the scheduler closed."""
    try:
        futures = [sched.submit(p, params, **_drafts(model, k, p, want.generated))
                   for k, ((p, params), want) in enumerate(zip(_requests(model), alone))]
        return [f.result(timeout=300) for f in futures]
    finally:
        sched.close()


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_scheduler_output_equals_each_request_alone(model, alone, max_batch):
    sched = Scheduler(model, max_batch, PREFILL_CHUNK)
    got = _run_all(sched, model, alone)
    for g, want in zip(got, alone):
        assert (g.tokens, g.finish_reason) == (want.tokens, want.finish_reason)
        assert g.state.num_tokens == want.state.num_tokens
    passes = sum(len(want.tokens) for want in alone)  # at least one pass per token alone
    if max_batch > 1:
        assert sched.passes < passes  # sequences shared passes
    assert sum(g.stats["accepted_draft_tokens"] for g in got) > 0  # speculation ran inside the batch
    # The engine thread's tally against what each request counted itself: every prompt token fed
    # once, one decoding row per decode pass plus its drafts.
    t = sched.tally
    assert t.passes == sched.passes and t.forward_seconds > 0
    assert t.prompt_rows == sum(len(p) for p, _ in _requests(model))
    assert t.decoding == sum(g.stats["passes"] for g in got)
    assert t.rows - t.prompt_rows == sum(g.stats["passes"] + g.stats["drafted_tokens"] for g in got)
    assert t.decoding + len(got) <= t.sequences <= max_batch * t.passes
    assert t.summary()["sequences_per_pass"] == pytest.approx(t.sequences / t.passes)


class _Shapes:
    """The model, noting each pass's rows and wanted logits per sequence ("all": a decoding sequence)."""

    def __init__(self, model):
        self.model, self.passes, self.replayable = model, [], []

    def start_batch(self, seqs):
        self.passes.append(([len(s.ids) for s in seqs], [s.logits for s in seqs]))
        graphs = self.model.engine.graphs
        self.replayable.append(graphs is not None and graphs.applies(seqs))
        return self.model.start_batch(seqs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_device_that_replays_passes_gets_one_token_of_each_sequence(tiny_k3_path, alone):
    """With recorded passes (on the CPU their code runs eagerly) a pass of several decoding sequences
    carries one row of each, and newcomers' short prompts go beside them in pieces a graph replays, so a
    few graphs replay every pass; the outputs stay each alone's."""
    from deltafin.runtime.decode_graph import DecodeGraphs, piece_size
    m = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    m.engine.graphs = DecodeGraphs(m.engine, record=False)
    assert m.replays_passes
    shapes = _Shapes(m)
    got = _run_all(Scheduler(shapes, 8, PREFILL_CHUNK), m, alone)
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in alone]
    # decoding sequences (every row's logits wanted) feed one row each where there are several
    decode = [[n for n, k in zip(rows, kinds) if k == "all"] for rows, kinds in shapes.passes]
    assert any(len(rows) > 1 for rows in decode) and all(set(rows) == {1} for rows in decode if len(rows) > 1)
    # prompts in pieces a graph replays (8, 4, 2, 1 tokens here), newcomers with as many to go together
    # while nobody decodes, and the earliest one's beside the decoding sequences' rows
    prompt = [[n for n, k in zip(rows, kinds) if k != "all"] for rows, kinds in shapes.passes]
    assert all(len(set(rows)) <= 1 and piece_size(rows[0]) == rows[0] for rows in prompt if rows)
    assert any(d and p and p[0] > 1 for d, p in zip(decode, prompt))  # decode rows and a prompt piece together
    assert all(len(p) <= 1 for d, p in zip(decode, prompt) if d)
    assert all(shapes.replayable)  # every pass one that a graph records


class _SmallDevice(_Shapes):
    """A device whose memory holds a sequence's piece of at most `rows` rows (a longer one raises as
    CUDA does)."""

    def __init__(self, model, rows):
        super().__init__(model)
        self.rows = rows

    def start_batch(self, seqs):
        if any(len(s.ids) > self.rows for s in seqs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().start_batch(seqs)


def test_a_prompt_too_long_for_the_device_ends_its_request_alone(tiny_k3_path, alone):
    """With recorded passes a long prompt's pieces are passes of their own: the one that does not fit
    ends its request with a clear error, the others go on to the outputs they get alone."""
    from deltafin.errors import DeviceOutOfMemory
    from deltafin.runtime.decode_graph import DecodeGraphs
    m = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    m.engine.graphs = DecodeGraphs(m.engine, record=False)
    sched = Scheduler(_SmallDevice(m, 100), 8, 256)
    try:
        started = [threading.Event() for _ in range(8)]
        futures = [sched.submit(p, params, on_token=lambda *_, e=e: e.set())
                   for (p, params), e in zip(_requests(m), started)]
        for f, e in zip(futures, started):
            f.add_done_callback(lambda _, e=e: e.set())
        # The long prompt joins once every other request has read its prompt (else it could share a
        # prompt pass with one that has not, which the device would not hold either), while most decode.
        assert all(e.wait(timeout=300) for e in started)
        long = sched.submit(_ids(m, 200, 1), SamplingParams(max_new_tokens=4))
        got = [f.result(timeout=300) for f in futures]
        with pytest.raises(DeviceOutOfMemory, match="ran out of memory reading a prompt piece"):
            long.result(timeout=300)
    finally:
        sched.close()
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in alone]


class _FlatCosts(PassCosts):
    """Every pass costs the same whatever its rows (as when a pass streams its weights from disk)."""

    def __init__(self):
        super().__init__()
        self.seconds = {1: 1.0, PASS_ROWS: 1.0}

    def record(self, rows, seconds):
        pass


class _Widest:
    """The model, noting the most rows a pass carried and how many sequences each pass carried."""

    def __init__(self, model):
        self.model, self.widest, self.sequences = model, 0, []

    def start_batch(self, seqs):
        self.widest = max(self.widest, sum(len(s.ids) for s in seqs))
        self.sequences.append(len(seqs))
        return self.model.start_batch(seqs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_scheduler_output_is_unchanged_by_passes_wider_than_pass_rows(model, alone):
    widest = _Widest(model)
    sched = Scheduler(widest, 8, PREFILL_CHUNK)
    sched.costs = _FlatCosts()  # drafts and prompt pieces may fill up to MAX_PASS_ROWS rows
    got = _run_all(sched, model, alone)
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in alone]
    assert PASS_ROWS < widest.widest <= MAX_PASS_ROWS


class _SteepCosts(PassCosts):
    """Every row costs as much as a pass of one (as when products are compute-bound): rows are never
    free, so drafts get only their share of PASS_ROWS from the costs."""

    def __init__(self):
        super().__init__()
        self.seconds = {1: 1.0, PASS_ROWS: float(PASS_ROWS)}

    def record(self, rows, seconds):
        pass


def test_sequences_whose_drafts_are_accepted_draft_as_they_would_alone(model):
    """Eight greedy requests whose drafters propose the true continuation: once their drafts are
    accepted each verifies up to draft_len tokens a pass, as alone, though the costs say rows are
    not free (one draft each within PASS_ROWS before), and every output is still the one it gets
    alone."""
    requests = [(_ids(model, 3 + k, 300 + k), 14) for k in range(8)]
    alone = [generate(model, p, SamplingParams(max_new_tokens=n, speculate=False)) for p, n in requests]

    def oracle(prompt, truth):
        return lambda context, n: list(truth[len(context) - len(prompt):][:n])

    widest = _Widest(model)
    sched = Scheduler(widest, 8, PREFILL_CHUNK)
    sched.costs = _SteepCosts()
    try:
        futures = [sched.submit(p, SamplingParams(max_new_tokens=n, speculate=True), drafter=oracle(p, want.generated))
                   for (p, n), want in zip(requests, alone)]
        got = [f.result(timeout=300) for f in futures]
    finally:
        sched.close()
    assert [g.tokens for g in got] == [w.tokens for w in alone]
    assert PASS_ROWS < widest.widest <= MAX_PASS_ROWS
    accepted = sum(g.stats["accepted_draft_tokens"] for g in got)
    assert accepted >= 0.5 * sum(len(g.tokens) for g in got)


def test_draft_limits_follow_each_sequences_accepted_drafts():
    def stats(drafted, accepted):
        return {"drafted_tokens": drafted, "accepted_draft_tokens": accepted}
    good = stats(10, int(10 * ACCEPTED_DRAFTS))
    poor = stats(10, int(10 * ACCEPTED_DRAFTS) - 1)
    fresh = stats(0, 0)
    # accepted at the rate or more: draft_len; below it, or nothing drafted yet: the share
    assert draft_limits([good, poor, fresh], [4, 4, 4], 1, 100) == [4, 1, 1]
    assert draft_limits([good, poor], [4, 4], 9, 100) == [4, 4]  # the share never exceeds draft_len
    assert draft_limits([good, good, good], [4, 4, 2], 0, 7) == [2, 3, 2]  # the largest cut first (ties: earliest)
    assert draft_limits([good], [4], 0, -1) == [0]


def test_an_idle_engine_gathers_while_requests_keep_coming():
    from deltafin.runtime.scheduler import GATHER_MAX_SECONDS, GATHER_MIN_SECONDS, GATHER_SHARE, gather_deadline
    fast = 0.02  # a 20 ms pass: its share is shorter than the minimum
    assert gather_deadline(10.0, 10.0, fast) == pytest.approx(10.0 + GATHER_MIN_SECONDS)  # a lone request
    # each arrival extends the wait to GATHER_MIN_SECONDS after it ...
    assert gather_deadline(10.0, 10.015, fast) == pytest.approx(10.015 + GATHER_MIN_SECONDS)
    # ... up to GATHER_MAX_SECONDS after the start
    assert gather_deadline(10.0, 10.095, fast) == pytest.approx(10.0 + GATHER_MAX_SECONDS)
    slow = 4.0  # a streamed pass of seconds: its share is the wait, arrivals inside it change nothing
    assert gather_deadline(10.0, 10.0, slow) == pytest.approx(10.0 + GATHER_SHARE * slow)
    assert gather_deadline(10.0, 10.15, slow) == pytest.approx(10.0 + GATHER_SHARE * slow)
    assert gather_deadline(10.0, 10.195, slow) == pytest.approx(10.0 + GATHER_SHARE * slow)
    replayed = 0.0015  # a replayed GPU pass: one pass, not GATHER_MIN_SECONDS, after the start or an arrival
    assert gather_deadline(10.0, 10.0, replayed) == pytest.approx(10.0 + replayed)
    assert gather_deadline(10.0, 10.001, replayed) == pytest.approx(10.001 + replayed)


def test_requests_sent_together_to_an_idle_engine_start_in_one_pass(model, alone):
    widest = _Widest(model)
    sched = Scheduler(widest, 2, PREFILL_CHUNK)
    sched.costs.record(1, 600.0)  # a pass costs ten minutes: the first of two waits for the second
    try:
        (p, a), (q, b) = _requests(model)[:2]
        first, second = sched.submit(p, a), sched.submit(q, b)
        assert first.result(timeout=300).tokens == alone[0].tokens
        assert second.result(timeout=300).tokens == alone[1].tokens
    finally:
        sched.close()
    assert widest.sequences[0] == 2  # both prompts in the first pass


def test_scheduler_takes_a_prefilled_state_and_cancels(model, alone):
    prefix, rest = _ids(model, 10, 50), _ids(model, 6, 51)
    held = model.new_state()
    model.forward(prefix, held)
    want = generate(model, rest, SamplingParams(max_new_tokens=8), state=held.snapshot(), prefill_chunk=PREFILL_CHUNK)
    gone = threading.Event()
    gone.set()
    sched = Scheduler(model, 4, PREFILL_CHUNK)
    try:
        cancelled = sched.submit(_ids(model, 30, 52), SamplingParams(max_new_tokens=50), cancel=gone)
        got = sched.submit(rest, SamplingParams(max_new_tokens=8), state=held.snapshot())
        p, params = _requests(model)[2]
        other = sched.submit(p, params)
        bad = sched.submit([], SamplingParams(max_new_tokens=3))
        assert cancelled.result(timeout=300).finish_reason == "cancelled"
        assert cancelled.result().tokens == []
        assert got.result(timeout=300).tokens == want.tokens
        assert got.result().state.num_tokens == 10 + 6 + len(want.generated) - 1
        assert other.result(timeout=300).tokens == alone[2].tokens
        with pytest.raises(ValueError, match="prompt is empty"):
            bad.result(timeout=10)
    finally:
        sched.close()


class _Starts(_Shapes):
    """The model, counting the passes begun."""

    def start_batch(self, seqs):
        self.passes.append(len(seqs))
        return self.model.start_batch(seqs)


def test_tokens_go_out_while_the_next_pass_computes(model, alone):
    """With ``overlap`` (automatic on CUDA) a pass's tokens are handed out once the next pass has begun,
    so the device computes while the host makes and sends the text; the outputs stay each alone's."""
    got = _run_all(Scheduler(model, 8, PREFILL_CHUNK, overlap=True), model, alone)
    for g, want in zip(got, alone):
        assert (g.tokens, g.finish_reason, g.generated) == (want.tokens, want.finish_reason, want.generated)
        assert g.state.num_tokens == want.state.num_tokens
    # One request alone, one token a pass: each on_token call notes the passes begun by then. With
    # overlap every call comes one pass later (the next one has begun), but for those at the end.
    p, params = _requests(model)[2]
    params = dataclasses.replace(params, speculate=False)
    begun = {}
    for overlap in (False, True):
        one, seen = _Starts(model), []
        sched = Scheduler(one, 4, 64, overlap=overlap)
        try:
            g = sched.submit(p, params, on_token=lambda t, text: seen.append(len(one.passes))).result(timeout=300)
        finally:
            sched.close()
        assert g.tokens == alone[2].tokens and len(one.passes) == params.max_new_tokens
        begun[overlap] = seen
    n = params.max_new_tokens
    assert begun[False][0] == 1 and begun[False][-1] == n  # the first token right after the prompt's pass
    assert begun[True] == [min(k + 1, n) for k in begun[False]]


def test_a_request_cancelled_by_its_callback_while_its_next_pass_runs(model, alone):
    """A callback that stops its request when the request's next pass has already begun (overlap): the
    request ends with what its callback saw, and its state is a plain prefill of the prompt and
    ``generated[:-1]``, so a prefix cache may keep it; a request with a stop string beside it and the
    others get what they get alone."""
    starts = _Starts(model)
    sched = Scheduler(starts, 8, PREFILL_CHUNK, overlap=True)
    seen = []

    def stop_at_third(token, text):
        seen.append(token)
        return len(seen) < 3

    p, params = _requests(model)[2]  # greedy, 20 tokens
    text = model.decode(alone[4].tokens)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    q, q_params = _requests(model)[4]
    stopped_alone = generate(model, q, dataclasses.replace(q_params, stop=(stop,)), prefill_chunk=PREFILL_CHUNK)
    try:
        cancelled = sched.submit(p, params, on_token=stop_at_third)
        stopped = sched.submit(q, dataclasses.replace(q_params, stop=(stop,)))
        others = [sched.submit(r, rp) for r, rp in _requests(model)[:2]]
        g, s = cancelled.result(timeout=300), stopped.result(timeout=300)
        assert [o.result(timeout=300).tokens for o in others] == [a.tokens for a in alone[:2]]
    finally:
        sched.close()
    assert (g.finish_reason, g.tokens, seen) == ("cancelled", alone[2].tokens[:3], alone[2].tokens[:3])
    assert g.generated == alone[2].generated[:len(g.generated)] and len(g.generated) in (3, 4)
    assert g.state.num_tokens == len(p) + len(g.generated) - 1
    fresh = model.new_state()
    model.forward(p + g.generated[:-1], fresh)
    assert g.state.max_abs_diff(fresh) <= ROUNDING
    assert (s.tokens, s.text, s.finish_reason) == (stopped_alone.tokens, stopped_alone.text, "stop")


def test_scheduler_settings_are_checked(model):
    with pytest.raises(ValueError, match="max_batch and prefill_chunk must be >= 1"):
        Scheduler(model, 0, 8)


# -- through the real server -------------------------------------------------------------------

def _server_requests():
    """(kind, prompt, max_tokens, sampling, stream, stop): mixed lengths, greedy and seeded."""
    words = "the river ran past old stones and over the weir into the town where lamps were lit".split()
    out = []
    for k in range(8):
        prompt = " ".join(words[: (2, 14, 5, 17, 1, 9, 11, 3)[k]] * (1 + k % 3))
        sampling = {"temperature": 0} if k % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 40 + k}
        out.append((prompt, (9, 4, 16, 6, 12, 2, 7, 10)[k], sampling, k % 3 == 0, ["e t"] if k == 5 else None))
    return out


def _ask_server(srv, name, request) -> tuple:
    prompt, max_tokens, sampling, stream, stop = request
    c = srv.client()
    r = c.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, stream=stream, stop=stop, **sampling)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in r:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("clients", [1, 3, 8])
def test_server_answers_equal_each_request_served_alone(model, clients):
    from test_serve import RunningServer

    requests = _server_requests()
    settings = dataclasses.replace(model.settings, max_batch=8, prefill_chunk=4, memo_size=0)
    # the engine itself, one request at a time (before the server's engine thread exists)
    engine = []
    for prompt, max_tokens, sampling, _, stop in requests:
        g = generate(model, model.encode(prompt), SamplingParams(max_new_tokens=max_tokens, stop=stop, temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0), seed=sampling.get("seed")),
                                         prefill_chunk=4)
        engine.append((g.text, g.finish_reason))
    with RunningServer(create_app(model, settings=settings)) as srv:
        scheduler = srv.server.config.app.state.service.scheduler
        alone = [_ask_server(srv, model.name, r) for r in requests]
        assert alone == engine
        alone_passes = scheduler.passes
        got: dict[int, tuple] = {}
        start = threading.Barrier(clients)

        def client(first: int):
            start.wait()
            for k in range(first, len(requests), clients):  # each client asks its share in turn
                got[k] = _ask_server(srv, model.name, requests[k])
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[k] for k in range(len(requests))] == alone
        if clients > 1:  # the concurrent requests shared passes
            assert scheduler.passes - alone_passes < alone_passes
        health = srv.request("GET", "/health")[1]
        assert health["running"] == 0 and health["passes"]["passes"] == scheduler.passes


def test_load_tool_reports_a_run(model):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_serve import RunningServer
    tool = [sys.executable, str(Path(__file__).parent.parent / "tools" / "load.py")]
    bad = subprocess.run(tool + ["--clients", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--clients must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run(tool + ["--join-after", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--join-after must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run(tool + ["--warmup", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--warmup must be >= 0" in bad.stderr and "Traceback" not in bad.stderr
    gone = subprocess.run(tool + ["--url", "http://127.0.0.1:9/v1"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot reach" in gone.stderr and "Traceback" not in gone.stderr
    settings = dataclasses.replace(model.settings, max_batch=4, prefill_chunk=4)
    with RunningServer(create_app(model, settings=settings)) as srv:
        url = f"http://127.0.0.1:{srv.port}/v1"
        run = subprocess.run(tool + ["--url", url, "--clients", "3", "--max-tokens", "4", "--prompt-tokens", "5",
                                     "--join-prompt-tokens", "20", "--join-after", "2", "--requests", "2",
                                     "--seed", "1", "--warmup", "2"],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    # A random prompt may draw EOS before max_tokens, so an answer can be shorter than 4 tokens.
    assert r["clients"] == 3 and 0 < r["completion_tokens"] <= 3 * 2 * 4 and r["errors"] == []
    assert r["ttft"]["n"] == 6 and r["itl"]["n"] > 0 and r["itl"]["p95_ms"] >= r["itl"]["p50_ms"]
    assert r["join"]["prompt_tokens"] == 20 and r["join"]["ttft_s"] > 0
    # how the server batched the run, from its /metrics: every prompt token fed once, the warm-up's not counted
    assert r["warmup_requests"] == 2
    b = r["passes"]
    assert b["passes"] > 0 and round(b["prompt_rows_per_pass"] * b["passes"]) == 3 * 2 * 5 + 20
    assert 1 <= b["sequences_per_pass"] <= 4 and b["decoding_per_pass"] <= b["sequences_per_pass"]
    assert b["forward_ms_per_pass"] > 0 and 0 < b["busy"]


def test_engine_passes_tool_times_every_pass(tiny_k3_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    tool = [sys.executable, str(Path(__file__).parent.parent / "tools" / "engine_passes.py"),
            "--model", str(tiny_k3_path)]
    for bad, says in ((["--clients", "0"], "--clients: expected positive integers"),
                      (["--rounds", "x"], "--rounds: expected a positive integer"),
                      (["--requests", "-1"], "--requests: expected 0 or a positive integer")):
        run = subprocess.run(tool + bad, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run(tool + ["--clients", "1,3", "--rounds", "1", "--max-tokens", "3", "--prompt-tokens", "4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert [x["clients"] for x in r["rounds"]] == [1, 3] and r["device"] == "cpu" and r["graphs"] is None
    for x in r["rounds"]:
        # a random prompt may draw EOS early; the round's prompts are read in its first pass, together
        assert 0 < x["tokens"] <= 3 * x["clients"] and x["passes"] >= 1 and x["pass_ms_p50"] > 0
        assert x["first_passes"][0]["rows"] == [4] and x["first_passes"][0]["sequences"] == x["clients"]
        assert x["slowest_passes"][0]["ms"] >= x["pass_ms_p50"]
    # as tools/load.py loads a server: each client's requests one after another, nothing synchronized
    run = subprocess.run(tool + ["--clients", "2", "--rounds", "1", "--max-tokens", "3", "--prompt-tokens", "4",
                                 "--requests", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (x,) = json.loads(run.stdout)["rounds"]
    assert x["clients"] == 2 and x["requests_per_client"] == 3 and 0 < x["tokens"] <= 2 * 3 * 3
    assert x["passes"] >= 3 and 1 <= x["sequences_per_pass"] <= 2
    assert x["device_busy"] is None  # device events on CUDA only


def test_prompt_pieces_beside_decoding_sequences_are_sized_by_what_passes_cost():
    costs = PassCosts()
    assert costs.rows_for(1) == PASS_ROWS  # nothing known yet: as many rows as a pass always takes
    assert costs.draft_rows(1) == PASS_ROWS
    costs.record(1, 0.100)  # the running stream's pace; limit 0.15 s
    assert costs.rows_for(1) == PASS_ROWS  # one row count measured: priced as one row, up to PASS_ROWS
    costs.record(PASS_ROWS, 0.100 + 0.010 * (PASS_ROWS - 1))  # 10 ms per extra row
    assert costs.estimate(4) == pytest.approx(0.130)  # between measured counts: a straight line
    assert costs.estimate(40) == pytest.approx(0.490)  # beyond the largest: the same line
    assert costs.rows_for(1) == 6  # 0.150 s: the most that fit
    assert costs.rows_for(1, waiting=0) == 6  # (nobody waiting is priced as one newcomer)
    assert costs.rows_for(1, waiting=2) == 11  # two newcomers: limit (1 + 0.5 x 2) x 0.1 = 0.2 s
    assert costs.rows_for(1, waiting=7) == 36  # seven beside one stream: limit 0.45 s, past PASS_ROWS
    assert costs.rows_for(1, waiting=20) == MAX_PASS_ROWS
    # The pace is that of the decoding rows this pass carries, not of one stream: beside four
    # streams (0.13 s on the line) one newcomer may take the pass to 0.195 s.
    assert costs.rows_for(4) == 10
    assert costs.rows_for(4, waiting=4) == 30  # four newcomers: limit 3 x 0.13 s
    # 10 ms per row is no longer free: drafts get what they always get
    assert costs.draft_rows(4) == PASS_ROWS
    costs.record(6, 0.200)  # six rows measured slower than the line said
    assert costs.rows_for(1) == 3  # the line from 1 row to 6 now crosses the limit after 3
    costs.record(3, 0.110)
    assert costs.rows_for(1) == 4  # 3 -> 0.110, 4 -> 0.140 on the line from 3 to 6
    costs.record(3, 0.300)  # a running mean: one slow pass moves it part of the way
    assert costs.seconds[3] == pytest.approx(0.110 + COST_SMOOTHING * 0.190)
    assert costs.rows_for(1) == 2  # at least one prompt row whatever the costs
    assert costs.rows_for(MAX_PASS_ROWS + 3) == MAX_PASS_ROWS + 4  # more decoding rows than a pass takes


def test_rows_beyond_pass_rows_when_passes_cost_the_same_whatever_their_rows():
    costs = PassCosts()  # streamed from disk: the pass reads the same bytes for 1 row or 16
    costs.record(1, 5.0)
    costs.record(PASS_ROWS, 5.2)
    costs.record(8, 5.1)
    # 8 streams' tokens cost 5.1 s; up to 5.61 s drafts may fill more rows: the line from 1 row to
    # PASS_ROWS goes on at 0.2 / 15 s per row, within 5.61 s up to 46 rows
    assert costs.draft_rows(8) == 46
    assert costs.rows_for(8 * 5) == MAX_PASS_ROWS  # drafts and a newcomer's prompt fill a whole pass
