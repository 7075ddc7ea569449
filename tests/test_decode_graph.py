"""The recorded one-token decode pass (decode_graph.py) against the plain pass.

On the CPU the recorded-mode code runs eagerly (record=False): the MLA write at a device position,
attention over the whole buffer, KDA states updated in place, and the state buffers every
sequence is moved in and out of. On CUDA the same passes are recorded and replayed.
"""
from __future__ import annotations

import pytest
import torch

import deltafin
from deltafin.runtime import decode_graph
from deltafin.runtime.decode_graph import DecodeGraphs
from deltafin.runtime.engine import Seq
from deltafin.settings import Settings, SettingsError

PROMPT = [11, 42, 7, 300, 5, 99]


def _recorded(path):
    """A CPU model whose decode passes run the recorded-mode code eagerly (record=False)."""
    m = deltafin.load(path, device="cpu", stream="off")
    assert m.engine.graphs is None  # only on CUDA
    m.engine.graphs = DecodeGraphs(m.engine, record=False)
    return m


def _decode(model, state, tokens):
    return torch.cat([model.forward([t], state) for t in tokens])


def _tokens(n, seed):
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(plain, prompts, tokens):
    """Each prompt read and then its tokens decoded alone, by plain passes: the logits, and the states."""
    want, refs = [], []
    for prompt, toks in zip(prompts, tokens):
        st = plain.new_state()
        plain.forward(prompt, st)
        want.append(_decode(plain, st, toks))
        refs.append(st)
    return want, refs


def _two_sequences(plain, m, n, b_prompt):
    """Two sequences (prompts PROMPT and PROMPT[:b_prompt]) decoding n tokens each: with `plain`
    one after the other, with `m` taking turns token by token (each moves into the buffers in
    turn). Returns [(want logits, got logits, want state, got state)] for both."""
    ids = (_tokens(n, 1), _tokens(n, 2))
    prompts = (PROMPT, PROMPT[:b_prompt])
    want, ref = _alone(plain, prompts, ids)
    states = [m.new_state() for _ in prompts]
    for prompt, st in zip(prompts, states):
        m.forward(prompt, st)
    got = [[], []]
    for i in range(n):
        for j in (0, 1):
            got[j].append(m.forward([ids[j][i]], states[j]))
    return [(want[j], torch.cat(got[j]), ref[j], states[j]) for j in (0, 1)]


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_recorded_mode_matches_plain_pass_across_sequences_and_growth(request, fixture, monkeypatch):
    monkeypatch.setattr(decode_graph, "MIN_CAPACITY", 4)  # grow the buffers several times
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cpu", stream="off")
    m = _recorded(path)
    graphs = m.engine.graphs
    for want, got, ref, st in _two_sequences(plain, m, 14, 3):
        # the same fp32 arithmetic up to summation order (attention over the whole buffer)
        assert (got - want).abs().max().item() < 1e-4
        assert st.max_abs_diff(ref) < 1e-4
    assert graphs.capacity == 32  # 6 + 14 tokens: 4 -> 8 -> 16 -> 32


def test_recorded_mode_with_speculation_snapshot_and_rollback(tiny_k3_path):
    """Plain passes between recorded ones (a verify pass, a rollback, a restored snapshot) leave
    the state's tensors elsewhere; the next recorded pass copies them in again."""
    plain = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    m = _recorded(tiny_k3_path)
    ids = _tokens(10, 3)

    def script(model):
        s = model.new_state()
        model.forward(PROMPT, s)
        out = [_decode(model, s, ids[:3])]
        out.append(model.forward(ids[3:6], s, keep_states=True))  # a verify pass, two of three kept
        s.rollback(s.num_tokens - 1)
        out.append(_decode(model, s, ids[6:8]))
        snap = s.snapshot()
        out.append(_decode(model, s, ids[8:10]))
        s.restore(snap)
        out.append(_decode(model, s, ids[8:10]))
        return torch.cat(out), s

    want, ref = script(plain)
    got, s = script(m)
    assert (got - want).abs().max().item() < 1e-4
    assert s.max_abs_diff(ref) < 1e-4


def _storage_bytes(state) -> int:
    """Bytes of the storages a state's tensors (rollback records included) keep alive."""
    seen = {}
    for st in state.layers:
        held = list(vars(st).values()) + list((getattr(st, "pending", None) or {}).values())
        for t in (v for v in held if isinstance(v, torch.Tensor)):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_a_snapshot_of_a_state_in_the_slots_holds_only_its_own_tensors(tiny_k3_path):
    """Three sequences decoding together live in the recorder's slots, views of buffers that hold every
    slot: a snapshot copies its own entries only (the bytes nbytes() counts; a deep copy kept whole
    buffers), equals the state, does not change as the state decodes on, and after a check pass rolls
    back and restores as the state itself does."""
    m = _recorded(tiny_k3_path)
    prompts = [PROMPT, PROMPT[:2], PROMPT[:4]]
    _, states = _batched(m, [[0, 1, 2]] * 4, prompts, [_tokens(4, 20 + j) for j in range(3)])
    st = states[1]
    assert _storage_bytes(st) > 2 * st.nbytes()  # the slots' buffers behind the views
    snap = st.snapshot()
    assert snap.max_abs_diff(st) == 0 and _storage_bytes(snap) == snap.nbytes() == st.nbytes()
    before = snap.snapshot()
    _decode(m, st, _tokens(2, 30))
    assert snap.max_abs_diff(before) == 0 and st.max_abs_diff(before) > 0

    plain = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    ref = plain.new_state()
    plain.forward(PROMPT, ref)
    draft = _tokens(3, 31)
    plain.forward(draft, ref, keep_states=True)
    kept = ref.snapshot()  # its rollback records copied with it
    ref.rollback(ref.num_tokens - 2)
    kept.rollback(kept.num_tokens - 2)
    assert kept.max_abs_diff(ref) == 0
    again = plain.new_state()
    again.restore(kept)
    assert again.max_abs_diff(ref) == 0 and torch.equal(plain.forward([7], again), plain.forward([7], ref))


def _batched(model, plan, prompts, tokens):
    """Sequences decoding together as `plan` says: per pass, the indices of the sequences in it (in
    that order). Returns each sequence's logits, in its passes' order, and its state."""
    from deltafin.runtime.engine import Seq
    states = [model.new_state() for _ in prompts]
    for p, st in zip(prompts, states):
        model.forward(p, st)
    got = [[] for _ in prompts]
    fed = [0] * len(prompts)
    for members in plan:
        out = model.forward_batch([Seq([tokens[j][fed[j]]], states[j]) for j in members])
        for j, logits in zip(members, out):
            got[j].append(logits)
            fed[j] += 1
    return [torch.cat(g) for g in got], states


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_batched_recorded_mode_matches_each_sequence_alone(request, fixture, monkeypatch):
    """Passes of several sequences in slots: newcomers, leavers, another order (sequences move
    between slots) and buffers that grow, against each sequence decoded alone by plain passes."""
    monkeypatch.setattr(decode_graph, "MIN_CAPACITY", 8)
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cpu", stream="off")
    m = _recorded(path)
    graphs = m.engine.graphs
    prompts = [PROMPT, PROMPT[:2], PROMPT[:4], [9]]
    plan = [[0, 1], [0, 1], [0, 1, 2], [2, 0, 1], [2, 0, 1, 3], [3, 1], [1, 3, 0, 2]] + [[0, 1, 2, 3]] * 6
    tokens = [_tokens(len(plan), 10 + j) for j in range(len(prompts))]
    got, states = _batched(m, plan, prompts, tokens)
    for j, prompt in enumerate(prompts):
        st = plain.new_state()
        plain.forward(prompt, st)
        n = sum(j in members for members in plan)
        want = _decode(plain, st, tokens[j][:n])
        assert (got[j] - want).abs().max().item() < 1e-4
        assert states[j].max_abs_diff(st) < 1e-4
    assert graphs.capacity == 32 and len(graphs.slots) == 4  # 6 + 12 tokens: 8 -> 16 -> 32


def test_sequences_stay_in_their_slots_as_others_leave_join_and_reorder(tiny_k3_path):
    """A pass of B sequences runs over slots 0..B-1, each sequence where it already lives whatever order
    they come in: one leaving from the front moves only the one in the last slot into its place, another
    order moves no one, a newcomer takes the free slot (each move copies every layer state of a
    sequence). The logits are each sequence's alone, in the order given."""
    plain = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    m = _recorded(tiny_k3_path)
    graphs = m.engine.graphs
    prompts = [PROMPT[:3], PROMPT[:5], PROMPT, PROMPT + [8], PROMPT[:3] + [4, 4]]  # no piece size: plain passes
    plan = [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3], [3, 1, 2], [1, 2, 3, 4], [4, 3, 2, 1], [2, 4]]
    moves = []
    forward_batch = m.forward_batch

    def counted(seqs):
        before = graphs.moved_in
        out = forward_batch(seqs)
        moves.append(graphs.moved_in - before)
        return out

    m.forward_batch = counted
    tokens = [_tokens(len(plan), 50 + j) for j in range(len(prompts))]
    got, states = _batched(m, plan, prompts, tokens)
    assert moves == [4, 0, 1, 0, 1, 0, 2]
    for j, prompt in enumerate(prompts):
        st = plain.new_state()
        plain.forward(prompt, st)
        want = _decode(plain, st, tokens[j][:sum(j in members for members in plan)])
        assert (got[j] - want).abs().max().item() < 1e-4
        assert states[j].max_abs_diff(st) < 1e-4


def _pieces(plain, m, tol):
    """Two prompts (23 and 22 tokens) read by `m` in the pieces a graph takes (16, 4, 2, 1 rows; both
    sharing each pass, one wanting the last row's logits where the other wants none), against each read
    in one plain pass by `plain`: the last logits, the states and a decode after them, within `tol`."""
    prompts = [_tokens(23, 30), _tokens(22, 31)]
    want, refs = [], []
    for prompt in prompts:
        st = plain.new_state()
        want.append(plain.forward(prompt, st, last_only=True))
        refs.append(st)
    states = [m.new_state() for _ in prompts]
    got = [None, None]
    fed = [0, 0]
    for sizes in ((16, 16), (4, 4), (2, 2), (1,)):  # the second prompt ends at 22, so it sits out the last
        seqs = []
        for j, n in enumerate(sizes):
            piece = prompts[j][fed[j]:fed[j] + n]
            fed[j] += n
            seqs.append(Seq(piece, states[j], logits="last" if fed[j] == len(prompts[j]) else "none"))
        assert m.engine.graphs.applies(seqs)
        for j, out in enumerate(m.engine.forward_batch(seqs)):
            if out is not None:
                got[j] = out
    for j in (0, 1):
        assert (got[j] - want[j]).abs().max().item() < tol
        assert states[j].max_abs_diff(refs[j]) < tol
        tokens = _tokens(4, 40 + j)
        assert (_decode(m, states[j], tokens) - _decode(plain, refs[j], tokens)).abs().max().item() < tol


def _mixed(plain, m, tol):
    """Two sequences decode while a newcomer's prompt (23 tokens) is read beside them in the pieces a graph
    takes (16, 4 and 2 rows, then its last token a row like theirs), the newcomer given first; then the
    three decode together. Against each alone in plain passes (`plain`): every logit and state within
    `tol`. Returns the slot moves of each pass."""
    prompts, newcomer = [PROMPT, PROMPT[:5]], _tokens(23, 60)
    tokens = [_tokens(8, 61 + j) for j in range(3)]
    want, refs = _alone(plain, prompts, tokens)
    st = plain.new_state()
    want_first = plain.forward(newcomer, st, last_only=True)
    want.append(_decode(plain, st, tokens[2][:4]))
    refs.append(st)
    states = [m.new_state() for _ in range(3)]
    for prompt, st in zip(prompts, states):
        m.forward(prompt, st)
    graphs, got, fed, moves = m.engine.graphs, [[], [], []], 0, []
    for i in range(8):
        seqs = [Seq([tokens[j][i]], states[j]) for j in (0, 1)]
        if fed < len(newcomer):
            n = {0: 16, 1: 4, 2: 2, 3: 1}[i]
            piece, fed = newcomer[fed:fed + n], fed + n
            seqs.insert(0, Seq(piece, states[2], logits="last" if fed == len(newcomer) else "none"))
        else:
            seqs.insert(0, Seq([tokens[2][i - 4]], states[2]))
        assert graphs.applies(seqs)
        before = graphs.moved_in
        out = m.engine.forward_batch(seqs)
        moves.append(graphs.moved_in - before)
        if i == 3:
            got_first = out[0]
        elif i > 3:
            got[2].append(out[0])
        got[0].append(out[1])
        got[1].append(out[2])
    assert (got_first - want_first).abs().max().item() < tol
    for j in range(3):
        assert (torch.cat(got[j]) - want[j]).abs().max().item() < tol
        assert states[j].max_abs_diff(refs[j]) < tol
    return moves


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_decode_rows_and_a_prompt_piece_share_a_pass_in_slots(request, fixture):
    """A newcomer's prompt pieces ride in the decoding sequences' passes (decode rows first, then the
    piece, whatever order they come in): each sequence is moved into a slot once and stays there, the
    newcomer too when it starts decoding; every logit and state is each sequence's alone."""
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cpu", stream="off")
    m = _recorded(path)
    assert _mixed(plain, m, 1e-4) == [3, 0, 0, 0, 0, 0, 0, 0]
    assert m.engine.graphs._pieces_seen == {(3, (1, 1, 16), False, 0), (3, (1, 1, 4), False, 0),
                                            (3, (1, 1, 2), False, 0)}  # the fourth pass a decode's shape
    # the shapes as /metrics and bench list them (recorded ones on a GPU), decode and mixed together
    m.engine.graphs.graphs = dict.fromkeys(m.engine.graphs._pieces_seen | {(3, 1, False, 0)})
    assert m.graph_stats()["shapes"] == [[3, 1, False, 0], [3, (1, 1, 2), False, 0], [3, (1, 1, 4), False, 0],
                                         [3, (1, 1, 16), False, 0]]


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_prompt_pieces_in_slots_read_the_prompt_as_one_plain_pass_does(request, fixture):
    """Prompt pieces of the sizes a graph takes in recorded mode read a prompt as one plain pass does
    (_pieces); other lengths, or every row's logits, run the plain pass."""
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cpu", stream="off")
    m = _recorded(path)
    graphs = m.engine.graphs
    _pieces(plain, m, 1e-4)
    assert graphs._pieces_seen == {(2, 16, False, 0), (2, 4, False, 0), (2, 2, False, 0)}  # the last one a decode's
    st = m.new_state()
    assert not graphs.applies([Seq(_tokens(3, 1), st, logits="last")])  # not a piece size
    assert not graphs.applies([Seq(_tokens(4, 1), st, logits="all")])  # every row's logits: the plain pass
    assert not graphs.applies([Seq(_tokens(32, 1), st, logits="last")])  # past PIECE_MAX_ROWS


@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_check_passes_in_slots_roll_back_as_plain_passes_do(request, fixture):
    """Draft-check passes (n rows each, keep_states) of one and of two sequences in slots, each
    rolled back to some of its rows, then decode passes: the same logits and states as plain passes."""
    from deltafin.runtime.engine import Seq
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cpu", stream="off")
    m = _recorded(path)
    rows = _tokens(40, 5)

    def script(model):
        a, b = model.new_state(), model.new_state()
        model.forward(PROMPT, a)
        model.forward(PROMPT[:3], b)
        out, at = [], 0
        for members, n, keep in (([a], 4, 2), ([a, b], 3, 1), ([b, a], 3, 3), ([a, b], 1, None), ([a], 5, 0),
                                 ([a, b], 1, None)):
            seqs = [Seq(rows[at + j * n:at + (j + 1) * n], st, keep is not None) for j, st in enumerate(members)]
            at += n * len(members)
            out += model.forward_batch(seqs)
            if keep is not None:
                for st in members:
                    st.rollback(st.num_tokens - n + keep)
        return torch.cat(out), (a, b)

    want, ref = script(plain)
    got, states = script(m)
    assert (got - want).abs().max().item() < 1e-4
    assert all(s.max_abs_diff(r) < 1e-4 for s, r in zip(states, ref))


def test_a_shape_that_cannot_be_recorded_runs_plain_and_others_still_record(tiny_k3_path, capsys, monkeypatch):
    """A recording that fails turns graphs off for its shape only: a batch kernel that cannot be
    recorded must not cost one-row passes their graphs. (Recording here stands in for torch's capture:
    it fails for two sequences, and for one sequence records nothing but counts.)"""
    m = _recorded(tiny_k3_path)
    graphs = m.engine.graphs
    graphs.record = True
    captured, eager = [], graphs._recorded_mode

    def recorded_mode(seqs, stats, capture):
        if not capture:
            return eager(seqs, stats, capture)
        if len(seqs) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(len(seqs))
        return None, None  # no graph to replay: the test ends before a pass of this shape would
    monkeypatch.setattr(graphs, "_recorded_mode", recorded_mode)
    a, b = m.new_state(), m.new_state()
    m.forward(PROMPT, a)
    m.forward(PROMPT, b)
    from deltafin.runtime.engine import Seq
    m.engine.forward_batch([Seq([5], a, False, "last"), Seq([6], b, False, "last")])
    assert graphs.failed_shapes == {(2, 1, False)} and "2 sequence(s)" in capsys.readouterr().err
    assert not graphs.applies([Seq([5], a, False, "last"), Seq([6], b, False, "last")])
    m.forward([7], a)  # one sequence: still recorded
    assert captured == [1] and (1, 1, False, 0) in graphs.graphs


def test_a_released_state_keeps_its_values(tiny_kl_path):
    """A sequence that leaves the buffers gets its own copies: the next one cannot change it."""
    m = _recorded(tiny_kl_path)
    graphs = m.engine.graphs
    a, b = m.new_state(), m.new_state()
    m.forward(PROMPT, a)
    m.forward([5], a)
    kept = a.snapshot()
    m.forward(PROMPT[:2], b)
    m.forward([6], b)  # b moves in, a moves out
    buffers = {id(t) for pair in graphs.buffers for t in pair}
    assert not any(id(getattr(st, name, None)) in buffers for st in a.layers for name in ("conv", "S", "ckv"))
    assert a.max_abs_diff(kept) == 0.0


def test_a_generation_sizes_the_buffers_for_its_reach_once(tiny_kl_path, monkeypatch):
    """A generation says how long its state will grow (prompt + max new tokens): the buffers are sized
    for that at its first pass, up to REACH_MAX_CAPACITY rows, so its graphs are not recorded again midway;
    past that bound they double as the tokens come. The tokens are the plain pass's either way."""
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    monkeypatch.setattr(decode_graph, "MIN_CAPACITY", 4)
    monkeypatch.setattr(decode_graph, "REACH_MAX_CAPACITY", 64)
    plain, m = deltafin.load(tiny_kl_path, device="cpu", stream="off"), _recorded(tiny_kl_path)
    graphs = m.engine.graphs
    for max_new, capacities in ((40, {64}), (100, {64, 128})):
        seen = set()
        params = SamplingParams(max_new_tokens=max_new, speculate=False)
        got = generate(m, PROMPT, params, on_token=lambda *_: seen.add(graphs.capacity), eos_token_ids=()).tokens
        assert len(got) == max_new and got == generate(plain, PROMPT, params, eos_token_ids=()).tokens
        assert seen == capacities


def test_passes_recorded_ahead_size_the_buffers_and_leave_the_tokens_alone(tiny_kl_path):
    """record_passes runs each shape's pass on throwaway states (here eagerly: nothing is recorded on
    the CPU), sizing the buffers for the reach; a speculating generation after it makes the plain
    model's tokens, and no throwaway state keeps a slot."""
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    plain, m = deltafin.load(tiny_kl_path, device="cpu", stream="off"), _recorded(tiny_kl_path)
    graphs = m.engine.graphs
    assert m.record_passes(300, drafts=2) == 0 and graphs.capacity == 512
    assert all(graphs._owner(slot) is None for slot in range(len(graphs.slots)))
    params = SamplingParams(max_new_tokens=30, speculate=True)
    assert generate(m, PROMPT, params).tokens == generate(plain, PROMPT, params).tokens
    assert deltafin.load(tiny_kl_path, device="cpu", stream="off").record_passes(300, drafts=2) == 0  # no graphs
    assert m.record_passes(300, drafts=500) == 0  # shapes past the largest graph are skipped, not an error
    for bad in ({"sequences": 0}, {"drafts": -1}):
        with pytest.raises(ValueError, match="record_passes needs"):
            m.record_passes(300, **bad)


def test_cuda_graphs_setting():
    assert Settings.resolve({}).cuda_graphs is True
    assert Settings.resolve({}, env={"DELTAFIN_CUDA_GRAPHS": "off"}).cuda_graphs is False
    with pytest.raises(SettingsError, match="DELTAFIN_CUDA_GRAPHS"):
        Settings.resolve({}, env={"DELTAFIN_CUDA_GRAPHS": "sometimes"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_matches_plain_pass(request, fixture, dtype, monkeypatch):
    monkeypatch.setattr(decode_graph, "MIN_CAPACITY", 8)  # record again at 16 and 32 rows
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cuda", stream="off", dtype=dtype, cuda_graphs=False)
    m = deltafin.load(path, device="cuda", stream="off", dtype=dtype)
    graphs = m.engine.graphs
    assert plain.engine.graphs is None and graphs is not None
    results = _two_sequences(plain, m, 20, 2)
    assert graphs.failed is None
    assert graphs.recorded == 3 and graphs.replayed >= 30
    # the same arithmetic up to summation order; in bf16 that moves a logit by a rounding step
    tol = 1e-4 if dtype == "float32" else 1e-2
    for want, got, _, _ in results:
        assert (got - want).abs().max().item() < tol * want.abs().max().item()
    # a replay accounts the bytes the recorded pass read
    assert m.engine.last_pass.bytes_on_device == plain.engine.last_pass.bytes_on_device > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
@pytest.mark.parametrize("passes, kind, shapes", [
    (_pieces, "prompt", [(2, 16, False, 0), (2, 4, False, 0), (2, 2, False, 0)]),
    (_mixed, "mixed", [(3, (1, 1, 16), False, 0), (3, (1, 1, 4), False, 0), (3, (1, 1, 2), False, 0)])])
def test_cuda_prompt_pieces_replay_as_plain_passes_read_them(request, fixture, passes, kind, shapes):
    """fp32 on the device: prompt pieces, alone (_pieces) and beside decode rows (_mixed), run in recorded
    mode, are recorded the second time their shapes come and replayed the third, each time against plain
    passes."""
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cuda", stream="off", cuda_graphs=False)
    m = deltafin.load(path, device="cuda", stream="off")
    graphs = m.engine.graphs
    for _ in range(3):
        passes(plain, m, 1e-4)
    assert graphs.failed is None and graphs.replayed_by_kind[kind] == 3
    assert set(shapes) <= set(graphs.graphs)
    assert all(list(shape) in m.graph_stats()["shapes"] for shape in shapes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_batched_graph_replay_matches_each_sequence_alone(request, fixture):
    """fp32 on the device: batched replays (one graph per batch size) give every sequence the
    logits of its own plain passes, and its greedy tokens."""
    path = request.getfixturevalue(fixture)
    plain = deltafin.load(path, device="cuda", stream="off", dtype="float32", cuda_graphs=False)
    m = deltafin.load(path, device="cuda", stream="off", dtype="float32")
    prompts = [PROMPT, PROMPT[:2], PROMPT[:4], [9], PROMPT[1:], [3, 4]]
    plan = [[0, 1], [0, 1], [0, 1, 2], [2, 0, 1]] + [[0, 1, 2, 3, 4, 5]] * 8 + [[5, 4, 3, 2, 1, 0]] * 4
    tokens = [_tokens(len(plan), 20 + j) for j in range(len(prompts))]
    got, _ = _batched(m, plan, prompts, tokens)
    graphs = m.engine.graphs
    assert graphs.failed is None and graphs.replayed >= 10 and (6, 1, False, 0) in graphs.graphs
    for j, prompt in enumerate(prompts):
        st = plain.new_state()
        plain.forward(prompt, st)
        n = sum(j in members for members in plan)
        want = _decode(plain, st, tokens[j][:n])
        assert (got[j] - want).abs().max().item() < 1e-4 * want.abs().max().item()
        assert torch.equal(got[j].argmax(-1), want.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_speculation_replays_check_passes_with_the_same_tokens(request, fixture):
    """Greedy speculation on the device: check passes replay recorded graphs, rollbacks write into
    the slots, and the tokens equal plain greedy decoding's."""
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    path = request.getfixturevalue(fixture)
    m = deltafin.load(path, device="cuda", stream="off", dtype="float32")
    params = SamplingParams(max_new_tokens=40, speculate=False)
    want = generate(m, PROMPT, params).tokens
    full = PROMPT + want

    def drafter(context, n):
        """The true continuation with its second token wrong: drafts are accepted, cut and rolled back."""
        draft = full[len(context):len(context) + n]
        return draft[:1] + [(t + 1) % 500 for t in draft[1:2]] + draft[2:]

    for _ in range(2):  # the second run replays the check-pass graphs the first recorded
        g = generate(m, PROMPT, params.replace(speculate=True), drafter=drafter)
        assert g.tokens == want
    graphs = m.engine.graphs
    assert graphs.failed is None and any(keep for (_, n, keep, _) in graphs.graphs)
    assert m.graph_stats()["replayed_by_kind"]["check"] > 0
    assert g.stats["accepted_draft_tokens"] > 0 and g.stats["passes"] < len(want) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_passes_recorded_ahead_are_the_ones_a_generation_replays(tiny_kl_path):
    """record_passes before a speculating greedy generation: the decode step and every check shape up
    to draft_len are recorded, at buffers for the generation's reach; the generation then records
    nothing and makes the tokens of a model that recorded as it went."""
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    params = SamplingParams(max_new_tokens=300, speculate=True)
    want = generate(deltafin.load(tiny_kl_path, device="cuda", stream="off", dtype="float32"), PROMPT, params,
                    eos_token_ids=()).tokens
    m = deltafin.load(tiny_kl_path, device="cuda", stream="off", dtype="float32", draft_len=3)
    assert m.record_passes(len(PROMPT) + 300, drafts=3) == 4
    graphs = m.engine.graphs
    assert set(graphs.graphs) == {(1, 1, False, 0), (1, 2, True, 0), (1, 3, True, 0), (1, 4, True, 0)}
    assert graphs.capacity == 512 and m.record_passes(len(PROMPT) + 300, drafts=3) == 0
    g = generate(m, PROMPT, params, eos_token_ids=())
    assert g.tokens == want and graphs.recorded == 4 and graphs.failed is None
    assert m.graph_stats()["replayed_by_kind"]["check"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_logits_stay_on_the_device_when_asked(tiny_k3_path):
    from deltafin.runtime.engine import Seq
    m = deltafin.load(tiny_k3_path, device="cuda", stream="off", dtype="float32")
    on_host, on_device = m.new_state(), m.new_state()
    kept = []
    # the prompt (plain pass), the recording pass, then replays; the two states take turns
    for ids in (PROMPT, [5], [6], [7], [8]):
        want = m.forward_batch([Seq(ids, on_host)])[0]
        got = m.forward_batch([Seq(ids, on_device, on_device=True)])[0]
        assert want.device.type == "cpu" and got.is_cuda
        assert (got.cpu() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        kept.append((got, got.cpu()))
    assert m.engine.graphs.replayed >= 4
    # logits handed out earlier are not the replay's output buffer: later passes leave them alone
    for got, copy in kept:
        assert torch.equal(got.cpu(), copy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_recording_survives_garbage_collected_meanwhile(tiny_k3_path):
    """A dropped model is cyclic garbage (engine <-> recorder) holding recorded graphs, and a graph
    freed while another records breaks that recording. Here a recorded graph becomes such garbage
    inside the recording, with collection due at every allocation: the recording still succeeds."""
    import gc
    from deltafin.runtime.engine import Seq
    m = deltafin.load(tiny_k3_path, device="cuda", stream="off", dtype="float32")
    old = [torch.cuda.CUDAGraph()]
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(old[0]):
        x.add_(1)
    device_pass = m.engine.device_pass

    def dropping(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing() and old:
            cycle = [old.pop()]
            cycle.append(cycle)
            del cycle  # garbage now, freed by the next collection
            _ = [[] for _ in range(100)]  # allocations that make a collection due
        return device_pass(*args, **kwargs)

    m.engine.device_pass = dropping
    st = m.new_state()
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for ids in (PROMPT, [5], [6], [7]):
            m.forward_batch([Seq(ids, st)])
    finally:
        gc.set_threshold(*thresholds)
    assert not old  # the recording ran with the garbage made
    assert m.engine.graphs.failed is None and m.engine.graphs.replayed >= 2


def _greedy_together(model, prompts, n):
    """Each prompt's n greedy tokens (no speculation, no EOS), all decoded in shared passes."""
    from deltafin.runtime.generate import Decoding
    from deltafin.runtime.sampling import SamplingParams
    runs = [Decoding(model, p, SamplingParams(max_new_tokens=n, speculate=False), eos_token_ids=[]) for p in prompts]
    while not runs[0].done:
        for d, logits in zip(runs, model.forward_batch([d.next_pass() for d in runs])):
            d.take(logits)
    return [d.result().generated for d in runs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_k3_path", "tiny_kl_path"])
def test_cuda_batch_of_eight_decodes_the_cpu_reference_tokens(request, fixture):
    """float32 on CUDA, eight sequences decoded together (one replayed pass a token): every sequence's
    32 greedy tokens are the CPU float32 reference's for it alone."""
    path = request.getfixturevalue(fixture)
    prompts = [_tokens(5 + i, 20 + i) for i in range(8)]
    cpu = deltafin.load(path, device="cpu", stream="off")
    want = [_greedy_together(cpu, [p], 32)[0] for p in prompts]
    m = deltafin.load(path, device="cuda", stream="off")
    assert _greedy_together(m, prompts, 32) == want
    graphs = m.engine.graphs
    assert graphs.replayed_by_kind["decode"] >= 30 and (8, 1, False, 0) in graphs.graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_scheduler_hands_tokens_out_while_the_next_pass_runs(tiny_k3_path):
    """The server's scheduler on CUDA hands a pass's tokens out once the next (replayed) pass has begun:
    greedy, seeded, stop-string and callback-cancelled requests sharing passes get what each gets alone,
    and the cancelled one's state is a plain prefill of its prompt and ``generated[:-1]``."""
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    from deltafin.runtime.scheduler import Scheduler
    m = deltafin.load(tiny_k3_path, device="cuda", stream="off")
    prompts = [_tokens(4 + 3 * i, 60 + i) for i in range(6)]
    params = [SamplingParams(max_new_tokens=16 + i, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(6)]
    alone = [generate(m, p, q) for p, q in zip(prompts, params)]
    text = m.decode(alone[2].tokens)
    params[2] = params[2].replace(stop=(text[len(text) // 2:len(text) // 2 + 2],))
    stopped_alone = generate(m, prompts[2], params[2])
    seen = []

    def stop_at_third(token, text):
        seen.append(token)
        return len(seen) < 3

    sched = Scheduler(m, 8, 8)
    try:
        futures = [sched.submit(p, q, **({"on_token": stop_at_third} if i == 4 else {}))
                   for i, (p, q) in enumerate(zip(prompts, params))]
        got = [f.result(timeout=300) for f in futures]
    finally:
        sched.close()
    for i, (g, want) in enumerate(zip(got, alone)):
        if i == 2:
            assert (g.tokens, g.text, g.finish_reason) == (stopped_alone.tokens, stopped_alone.text, "stop")
        elif i == 4:
            assert (g.finish_reason, g.tokens, seen) == ("cancelled", want.tokens[:3], want.tokens[:3])
            assert g.generated == want.generated[:len(g.generated)]
            fresh = m.new_state()
            m.forward(prompts[4] + g.generated[:-1], fresh)
            assert g.state.num_tokens == fresh.num_tokens and g.state.max_abs_diff(fresh) < 1e-4
        else:
            assert (g.tokens, g.finish_reason) == (want.tokens, want.finish_reason)
    assert m.graph_stats()["replayed_by_kind"]["decode"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_recorded_sorted_mxfp4_tiles_decode_the_cpu_reference_tokens(tiny_k3_path):
    """float32 on CUDA, 64 sequences of tiny-k3 decoded together: 256 (token, expert) pairs a pass, 16 an
    expert, so the MXFP4 experts take the sorted 16-row tiles inside the recorded graph (and wider ones in
    the prompt pass before it); every sequence's greedy tokens are the CPU float32 reference's for it
    alone."""
    from deltafin.kernels import grouped
    prompts = [_tokens(3 + i % 7, 40 + i) for i in range(64)]
    cpu = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    want = [_greedy_together(cpu, [p], 8)[0] for p in prompts]
    m = deltafin.load(tiny_k3_path, device="cuda", stream="off")
    assert 64 * m.config.experts_per_token >= grouped.MXFP4Stack.sorted_min_rows * m.config.num_experts
    assert _greedy_together(m, prompts, 8) == want
    graphs = m.engine.graphs
    assert graphs.failed is None and (64, 1, False, 0) in graphs.graphs and graphs.replayed_by_kind["decode"] >= 5
