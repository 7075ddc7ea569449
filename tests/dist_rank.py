"""One rank of a split model in tests/test_dist.py: ``python dist_rank.py CHECKPOINT OUT [DEVICE]`` under a
torchrun-like environment (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT). Rank 0 runs ``parity`` and
saves what it returns to OUT (or, with OUT ``hostile:HOW``, sends rank 1 a control message it must
refuse); the other ranks serve its passes."""
from __future__ import annotations

import sys

import torch


def parity(model, state_file=None) -> dict:
    """Logits and tokens of every kind of pass and state operation (the test runs it in one process
    too); with `state_file`, a state saved there and read back too."""
    from deltafin.runtime.engine import Seq
    from deltafin.runtime.generate import generate
    from deltafin.runtime.scheduler import Scheduler
    from deltafin.runtime.sampling import SamplingParams
    prompt, other = [5, 17, 42, 7, 99, 3, 250, 11], [8, 8, 1, 300]
    out = {"logits": model.logits(prompt)}
    a, b = model.new_state(), model.new_state()
    out["batch"] = model.forward_batch([Seq(prompt, a, logits="last"), Seq(other, b, logits="all")])
    out["batch2"] = model.forward_batch([Seq([4], b), Seq([9, 10], a)])
    # Passes of other sequences begun before the first has ended (a split model runs them pipelined).
    c, d = model.new_state(), model.new_state()
    first = model.start_batch([Seq(prompt, c, logits="last")])
    second = model.start_batch([Seq(other, d)])
    out["in_flight"] = first.result() + second.result()
    third = model.start_batch([Seq([6, 7], c)])
    fourth = model.start_batch([Seq([9], d, logits="last")])
    out["in_flight"] += third.result() + fourth.result()
    del c, d
    # Two groups of sequences taking turns, each pass begun before the other group's has ended (as a
    # split model's scheduler runs them): on ranks that replay graphs each group keeps its own slots.
    groups = [[model.new_state(), model.new_state()], [model.new_state(), model.new_state()]]
    for j, st in enumerate(groups[0] + groups[1]):
        model.forward(prompt[:4 + j], st)
    moved = model.graph_stats()["states_moved_in"] if model.graph_stats() else None
    out["groups"], pending = [], None
    for step in range(8):
        begun = model.start_batch([Seq([20 + step + 7 * j], st) for j, st in enumerate(groups[step % 2])])
        if pending is not None:
            out["groups"] += pending.result()
        pending = begun
    out["groups"] += pending.result()
    out["groups_moved_in"] = model.graph_stats()["states_moved_in"] - moved if moved is not None else None
    del groups, pending, begun
    # Speculation's pattern: a keep_states pass, a rollback into it, and a snapshot restored later.
    snap = a.snapshot()
    model.forward([1, 2, 3, 4], a, keep_states=True)
    a.rollback(a.num_tokens - 2)
    out["after_rollback"] = model.forward([6], a)
    a.restore(snap)
    out["after_restore"] = model.forward([6], a)
    del snap, b
    if state_file is not None:
        from deltafin.runtime.saved_state import load_state, save_state
        saved = model.new_state()
        model.forward(prompt, saved)
        save_state(model, state_file, prompt, saved)
        ids, loaded, _ = load_state(model, state_file)
        out["after_load"] = model.forward([6], loaded)
        out["after_saved"] = model.forward([6], saved)
    out["greedy"] = model.generate(prompt, max_new_tokens=24)
    out["greedy_plain"] = model.generate(prompt, max_new_tokens=24, speculate=False)
    out["sampled"] = model.generate(prompt, max_new_tokens=24, temperature=0.9, seed=3)
    # Drafts that are right (the greedy output itself) get accepted: rollbacks of part of a pass.
    want = out["greedy"]
    drafted = generate(model, prompt, SamplingParams(max_new_tokens=24),
                       drafter=lambda ctx, n: want[len(ctx) - len(prompt):][:n])
    out["drafted"], out["accepted"] = drafted.tokens, drafted.stats["accepted_draft_tokens"]
    sched = Scheduler(model, 4, 4)
    try:
        futures = [sched.submit(prompt, SamplingParams(max_new_tokens=12)),
                   sched.submit(other, SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)),
                   sched.submit(prompt[:3], SamplingParams(max_new_tokens=12))]
        out["scheduled"] = [f.result(timeout=120).tokens for f in futures]
    finally:
        sched.close()
    return out


def out_of_order(model) -> dict:
    """Two passes begun, the second ended first: refused, and the group is down after it."""
    from deltafin.runtime.engine import Seq
    first = model.start_batch([Seq([5, 6], model.new_state())])
    second = model.start_batch([Seq([7], model.new_state())])
    said = {}
    for what, call in (("second", second.result), ("next", lambda: model.forward([1], model.new_state()))):
        try:
            call()
        except Exception as e:
            said[what] = f"{type(e).__name__}: {e}"
    del first
    return said


def hostile(model, how: str) -> None:
    """Rank 0 sends rank 1 a control message it must refuse: a huge declared length, bytes that are
    not JSON, a pass naming a state that does not exist, or a decode state to load that is too long
    or is not its layers'."""
    from deltafin.dist import launch
    from deltafin.dist.transport import CONTROL
    group = launch.joined()
    if how == "length":
        group._send(torch.tensor([1 << 62], dtype=torch.int64), 1, CONTROL)
    elif how == "json":
        group._send(torch.tensor([4], dtype=torch.int64), 1, CONTROL)
        group._send(torch.tensor([0xff, 0xfe, 0x7b, 0x7b], dtype=torch.uint8), 1, CONTROL)
    elif how == "state":
        group.send_message(1, {"ops": [["new", 7]], "state_in": 7, "num_tokens": 1 << 40, "tensors": []})
    elif how == "layers":
        group.send_message(1, {"ops": [["new", 7]], "state_in": 7, "num_tokens": 2,
                               "tensors": [["layers.0.S", "F32", [1 << 30, 1 << 30]]]})
    elif how == "base":
        group.send_message(1, {"ops": [["new", 7]], "base": 1 << 40, "seqs": [[7, [1, 2], False, "all", 0]]})
    elif how == "reach":
        group.send_message(1, {"ops": [["new", 7]], "seqs": [[7, [1, 2], False, "all", 1 << 40]]})
    else:
        group.send_message(1, {"ops": [], "seqs": [[12345, [1, 2], False, "all", 0]]})


def recorded_mode(model) -> None:
    """The model's decode passes run the recorded-mode code eagerly, as a CPU test of decode_graph does."""
    from deltafin.runtime.decode_graph import DecodeGraphs
    assert model.engine.graphs is None  # only on CUDA
    model.engine.graphs = DecodeGraphs(model.engine, record=False)


def main(path: str, out: str, device: str = "cpu") -> int:
    """With DIST_RANK_RECORDED=1 in the environment (CPU only) every rank's passes run in recorded
    mode (recorded_mode). A rank other than 0 whose passes could take the recorded-mode code and never
    did (replayed no graph on CUDA) ends with status 3."""
    import os

    import deltafin
    from deltafin.dist import launch
    from deltafin.dist.worker import serve_passes
    group = launch.join(launch.from_environment(), timeout=30)
    try:
        model = deltafin.load(path, device=device, stream="off" if device != "cpu" else "auto")
        recorded = os.environ.get("DIST_RANK_RECORDED") == "1"
        if recorded:
            recorded_mode(model)
        if group.rank:
            rc = serve_passes(group, model.engine)
            g = model.engine.graphs
            if g is not None and not (g.slots if recorded else g.replayed):
                return 3  # its passes never took the recorded-mode code, or never replayed a graph
            return rc
        if out.startswith("hostile:"):
            hostile(model, out.split(":", 1)[1])
            return 0
        if out.startswith("order:"):
            torch.save(out_of_order(model), out.split(":", 1)[1])
            return 0
        torch.save({**parity(model, out + ".state"), "placement": [(r.start, r.stop) for r in model.placement.ranges],
                    "graphs": model.graph_stats()}, out)
        return 0
    finally:
        launch.leave()


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
