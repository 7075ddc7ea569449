"""A model split across processes (deltafin.dist), gloo on loopback: the same logits and tokens as
one process, the server on rank 0 answering as one process does, a rank that dies or stops answering
named within the timeout (in the CLI and in the server), different checkpoints refused at start; the
placement and launch rules in-process."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltafin
from deltafin.checkpoint.sizes import ModelSizes
from deltafin.dist.launch import LaunchError, from_environment
from deltafin.dist.placement import PlacementError, check_same, plan, share_compute, split
from deltafin.settings import Settings, SettingsError

sys.path.insert(0, str(Path(__file__).parent))
from dist_rank import parity  # noqa: E402

RANK_SCRIPT = Path(__file__).parent / "dist_rank.py"
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, **extra) -> dict:
    env = dict(os.environ, WORLD_SIZE=str(world), RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME="lo", DELTAFIN_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.update(extra)
    return env


def _start(argv_for_rank, world: int, **extra) -> list[subprocess.Popen]:
    """One process per rank, as torchrun would start them (its environment, on 127.0.0.1)."""
    port = _free_port()
    return [subprocess.Popen(argv_for_rank(r), env=_env(r, world, port, **extra), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(world)]


def _finish(procs, timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        finally:
            p.kill()
        out.append((p.returncode, so, se))
    return out


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "deltafin", *args]


# -- parity with one process ----------------------------------------------------------------------
@pytest.mark.parametrize("which,world", [("k3", 2), ("k3", 3), ("kl", 2), ("kl", 3)])
def test_split_model_equals_one_process(which, world, tiny_k3_path, tiny_kl_path, tmp_path):
    path = tiny_k3_path if which == "k3" else tiny_kl_path
    out = tmp_path / "out.pt"
    # One pass in flight per rank (the ranks here share the machine's cores: auto would keep one).
    results = _finish(_start(lambda r: [sys.executable, str(RANK_SCRIPT), str(path), str(out)], world,
                             DELTAFIN_PIPELINE=str(world)))
    for rank, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {rank}: {se}"
        assert so == ""  # the ranks print nothing to stdout
    got = torch.load(out)
    assert got.pop("graphs") is None  # on the CPU
    ranges = [range(a, b) for a, b in got.pop("placement")]
    assert len(ranges) == world and ranges[0].start == 0 and ranges[-1].stop == deltafin.load(path).config.num_layers
    alone = deltafin.load(path, device="cpu", stream="off")
    want = parity(alone, tmp_path / "alone.state")
    assert set(got) == set(want)
    for key in ("logits", "after_rollback", "after_restore", "after_load", "after_saved"):
        assert torch.equal(got[key], want[key]), key
    # A state saved across ranks is one process's file, and the other way round.
    from deltafin.runtime.saved_state import load_state
    _, state, _ = load_state(alone, str(out) + ".state")
    assert torch.equal(alone.forward([6], state), want["after_load"])
    assert (tmp_path / "alone.state").read_bytes() == (tmp_path / "out.pt.state").read_bytes()
    for key in ("batch", "batch2", "in_flight", "groups"):
        assert len(got[key]) == len(want[key]) and all(torch.equal(g, w) for g, w in zip(got[key], want[key])), key
    for key in ("greedy", "greedy_plain", "sampled", "drafted", "scheduled"):
        assert got[key] == want[key], key
    assert got["drafted"] == got["greedy"] and got["accepted"] > 0


@pytest.mark.parametrize("which", ["k3", "kl"])
def test_ranks_in_recorded_mode_equal_one_process_in_it(which, tiny_k3_path, tiny_kl_path, tmp_path):
    """Every rank's passes through the code a CUDA graph records (decode_graph.py, run eagerly here:
    each rank's layers over its state slots, rows in and out of its input buffer): logits, batches,
    passes in flight, rollbacks and every generation equal to one process running that code."""
    from dist_rank import recorded_mode
    path = tiny_k3_path if which == "k3" else tiny_kl_path
    out = tmp_path / "out.pt"
    results = _finish(_start(lambda r: [sys.executable, str(RANK_SCRIPT), str(path), str(out)], 2,
                             DELTAFIN_PIPELINE="2", DIST_RANK_RECORDED="1"))
    for rank, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {rank}: {se}"
    got = torch.load(out)
    got.pop("placement")
    slots = got.pop("graphs")
    assert slots["replayed"] == 0  # recorded mode runs eagerly
    alone = deltafin.load(path, device="cpu", stream="off")
    recorded_mode(alone)
    want = parity(alone, tmp_path / "alone.state")
    assert slots["states_moved_in"] > 0
    # Two groups taking turns, in flight together: each kept its own slots on rank 0 (each sequence
    # moved in once, and the first group again when the second group's slots were added), where one
    # process, running a pass at a time, moves a group in at every turn.
    assert (got.pop("groups_moved_in"), want.pop("groups_moved_in")) == (6, 16)
    for key in ("logits", "after_rollback", "after_restore", "after_load", "after_saved"):
        assert torch.equal(got[key], want[key]), key
    for key in ("batch", "batch2", "in_flight", "groups"):
        assert all(torch.equal(g, w) for g, w in zip(got[key], want[key])), key
    for key in ("greedy", "greedy_plain", "sampled", "drafted", "scheduled"):
        assert got[key] == want[key], key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "graphs"])
@pytest.mark.parametrize("which", ["k3", "kl"])
def test_ranks_on_cuda_equal_one_process_on_cuda(which, graphs, tiny_k3_path, tiny_kl_path, tmp_path):
    """Two ranks, each holding its layers on a GPU (the host's GPU LOCAL_RANK, modulo the GPUs there:
    with one GPU both share it), rows handed on through host memory: every logit equal to one process
    on that GPU running the same kernels, each kernel launched or, with graphs, each rank replaying
    its layers' recorded passes against the one process replaying its whole passes."""
    path = tiny_k3_path if which == "k3" else tiny_kl_path
    out = tmp_path / "out.pt"
    results = _finish(_start(lambda r: [sys.executable, str(RANK_SCRIPT), str(path), str(out), "cuda"], 2,
                             DELTAFIN_PIPELINE="2", DELTAFIN_CUDA_GRAPHS=str(int(graphs))),
                      timeout=300)
    for rank, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {rank}: {se}"
    got = torch.load(out)
    got.pop("placement")
    replayed = got.pop("graphs")
    assert (replayed is not None and replayed["replayed"] > 0 and not replayed["failed"]) if graphs else replayed is None
    alone = deltafin.load(path, device="cuda", stream="off", cuda_graphs=graphs)
    want = parity(alone, tmp_path / "alone.state")
    assert set(got) == set(want)
    for key in ("logits", "after_rollback", "after_restore", "after_load", "after_saved"):
        assert got[key].device.type == "cpu" and torch.equal(got[key], want[key].cpu()), key
    for key in ("batch", "batch2", "in_flight", "groups"):
        assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got[key], want[key])), key
    for key in ("greedy", "greedy_plain", "sampled", "drafted", "scheduled"):
        assert got[key] == want[key], key
    assert (tmp_path / "alone.state").read_bytes() == (tmp_path / "out.pt.state").read_bytes()
    # groups taking turns keep their slots across ranks (see the recorded-mode test)
    assert (got["groups_moved_in"], want["groups_moved_in"]) == ((6, 16) if graphs else (None, None))


def test_a_rank_takes_the_gpu_of_its_local_rank():
    from deltafin.dist.launch import rank_device
    cuda = torch.device("cuda")
    assert rank_device(cuda, 0, 2) == torch.device("cuda", 0)
    assert rank_device(cuda, 1, 2) == torch.device("cuda", 1)
    assert rank_device(cuda, 3, 2) == torch.device("cuda", 1)  # more ranks than GPUs: they share
    assert rank_device(torch.device("cuda", 1), 0, 2) == torch.device("cuda", 1)  # named: as named
    assert rank_device(torch.device("cpu"), 1, 0) == torch.device("cpu")


def test_a_rank_holds_its_share_and_refuses_a_budget_it_does_not_fit(tiny_k3_path):
    """A rank's device plan counts its layers (and rank 0 the globals) only, and a rank holds them whole."""
    from deltafin.checkpoint.sizes import ModelSizes
    from deltafin.io.placement import PlacementError, plan, require_everything
    source = deltafin.load(tiny_k3_path, device="cpu").source
    sizes = ModelSizes.of(source)
    first, rest = range(0, 1), range(1, len(sizes.spine_bytes))
    one = sizes.restricted(first, True)
    two = sizes.restricted(rest, False)
    assert one.total + two.total == sizes.total and two.globals_bytes == 0
    assert plan(two, two.total, "cuda:1").everything
    with pytest.raises(PlacementError, match="does not fit in cuda:1"):
        require_everything(plan(two, two.total - 1, "cuda:1"), "gpu_budget")
    from deltafin.io.device import device_placement
    from deltafin.settings import Settings
    with pytest.raises(PlacementError, match="a rank on a GPU holds its layers whole"):
        device_placement(source, Settings.resolve({"gpu_budget": "0.000001"}), torch.device("cpu"), "auto", rest,
                         False)
    # a share with no MoE layer needs no expert slot
    dense = [i for i in range(len(sizes.expert_bytes)) if not sizes.expert_bytes[i]]
    if dense:
        share = sizes.restricted(range(dense[0], dense[0] + 1), False)
        assert plan(share, share.total, "cuda:0").everything


def _alone_and_on_two_ranks(args) -> tuple[str, list[tuple[int, str, str]]]:
    """The command's stdout in one process, and (rc, stdout, stderr) of each of 2 ranks running it;
    both ran cleanly and rank 1 printed nothing."""
    alone = subprocess.run(_cli(*args), env=dict(os.environ, DELTAFIN_THREADS="1"), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    results = _finish(_start(lambda r: _cli(*args), 2))
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2] + results[1][2]
    assert results[1][1] == ""
    return alone.stdout, results


def test_streamed_ranks_equal_one_process_on_the_cli(tiny_kl_path):
    alone, results = _alone_and_on_two_ranks(("run", "--model", str(tiny_kl_path), "--device", "cpu",
                                              "--max-new-tokens", "16", "--stream", "on", "The river"))
    assert results[0][1] == alone
    assert "placement across 2 ranks" in results[0][2] and "rank 1: layers" in results[0][2]
    assert "1 pass of different sequences in flight at once (auto: ranks share this host's cores" in results[0][2]


def test_prompt_cache_across_ranks(tiny_k3_path, tmp_path):
    """--prompt-cache under a launch: two ranks save the state after the prompt, and restore it on
    the next run, with one process's output either way; the file is one process's."""
    cache = tmp_path / "split.state"
    args = ("run", "--model", str(tiny_k3_path), "--device", "cpu", "--max-new-tokens", "8", "--prompt-cache",
            str(cache), "The river bank")
    alone, results = _alone_and_on_two_ranks(args)  # the one process saves, the ranks restore
    assert results[0][1] == alone and "restored the state" in results[0][2]
    cache.unlink()
    results = _finish(_start(lambda r: _cli(*args), 2))  # the ranks save ...
    assert [rc for rc, _, _ in results] == [0, 0] and "saved the state" in results[0][2]
    again = subprocess.run(_cli(*args), env=dict(os.environ, DELTAFIN_THREADS="1"), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)  # ... and one process restores
    assert again.returncode == 0 and again.stdout == alone and "restored the state" in again.stderr


def test_chat_under_a_launch_saves_and_loads_conversations(tiny_k3_path, tmp_path):
    """chat on rank 0 of two (stdin and the REPL there): the replies one process gives; a conversation
    /save-d across ranks loads in one process and continues the same."""
    saved = tmp_path / "talk.state"
    cmd = ["chat", "--model", str(tiny_k3_path), "--device", "cpu", "--max-new-tokens", "6"]
    env = dict(os.environ, DELTAFIN_THREADS="1")
    script = f"Hi there\n/save {saved}\nAnd then?\n"
    alone = subprocess.run(_cli(*cmd), input=script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    procs = _start_stdin(lambda r: _cli(*cmd), 2)
    try:
        so, se = procs[0].communicate(script, timeout=120)
        assert procs[0].returncode == 0, se
        assert so == alone.stdout
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    more = subprocess.run(_cli(*cmd), input=f"/load {saved}\nAnd then?\n", env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert more.returncode == 0, more.stderr
    assert alone.stdout.rstrip().splitlines()[-1] in more.stdout  # the same reply to the same turn


def test_torchrun_launch(tiny_k3_path):
    args = ("run", "--model", str(tiny_k3_path), "--device", "cpu", "--max-new-tokens", "8", "The river")
    alone = subprocess.run(_cli(*args), env=dict(os.environ, DELTAFIN_THREADS="1"), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"127.0.0.1:{_free_port()}", "-m", "deltafin", *args],
                         env=dict(os.environ, DELTAFIN_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT)),
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == alone.stdout


# -- faults ---------------------------------------------------------------------------------------
def _start_stdin(argv_for_rank, world: int) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen(argv_for_rank(r), env=_env(r, world, port), cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_rank_ends_the_request_naming_it(how, tiny_kl_path):
    """Rank 0 reads its prompt from stdin after every rank loaded: rank 1 is killed (or stopped) while
    the group waits for it, then the request starts and must end within the timeout, naming rank 1."""
    timeout = 3
    args = ("run", "--model", str(tiny_kl_path), "--device", "cpu", "--max-new-tokens", "64",
            "--dist-timeout", str(timeout), "-")
    procs = _start_stdin(lambda r: _cli(*args), 3)
    try:
        # The start-up lines end with the placement table, printed once every rank has agreed on it.
        while "rank 2: layers" not in procs[0].stderr.readline():
            assert procs[0].poll() is None
        os.kill(procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        procs[0].stdin.write("The river ran\n")
        procs[0].stdin.close()
        rc, err = procs[0].wait(timeout=timeout + 30), procs[0].stderr.read()
        assert rc == 1, err
        lines = [line for line in err.splitlines() if "error" in line]
        assert len(lines) == 1 and "rank 1 of 3" in lines[0], err
        assert ("stopped answering" if how == "stop" else "is gone") in lines[0]
        assert procs[0].stdout.read().strip() == ""  # no token came out of the failed pass
        # Nothing hangs: the third rank ends too (it lost its peers).
        assert procs[2].wait(timeout=timeout + 30) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()


@pytest.mark.parametrize("how,says", [("length", "control message of 4611686018427387904 bytes"),
                                      ("json", "not JSON"), ("pass", "cannot run (KeyError: 12345)"),
                                      ("state", "state transfer this rank cannot make (ValueError: a state of "
                                                "1099511627776 tokens)"),
                                      ("layers", "state transfer this rank cannot make (ValueError: the state's "
                                                 "tensors do not match"),
                                      ("reach", "cannot run (ValueError: a sequence reaching 1099511627776 tokens)"),
                                      ("base", "cannot run (ValueError: state slots from 1099511627776)")])
def test_a_rank_refuses_a_hostile_control_message(how, says, tiny_kl_path):
    """A rank takes nothing from the wire on trust: a message longer than any pass needs is refused
    before it is allocated, bytes that are not JSON, a pass it cannot run and a decode state it cannot
    hold (too long, or not its layers' tensors) end it with one line."""
    procs = _start(lambda r: ([sys.executable, str(RANK_SCRIPT), str(tiny_kl_path), f"hostile:{how}"] if r == 0
                              else _cli("run", "--model", str(tiny_kl_path), "--device", "cpu", "x")), 2)
    (_, _, err0), (rc, out, err) = _finish(procs)
    assert rc == 1, err + err0
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert out == ""


def test_passes_ending_out_of_order_are_refused(tiny_kl_path, tmp_path):
    """Rows come back in the order passes began: ending a later pass first is refused, and the group
    is down after it (the rows on the wire no longer match the passes waiting for them)."""
    out = tmp_path / "said.pt"
    procs = _start(lambda r: ([sys.executable, str(RANK_SCRIPT), str(tiny_kl_path), f"order:{out}"] if r == 0
                              else _cli("run", "--model", str(tiny_kl_path), "--device", "cpu", "x")), 2)
    (rc0, _, err0), _ = _finish(procs)
    assert rc0 == 0, err0
    said = torch.load(out)
    assert said["second"] == "RuntimeError: passes of a model split across ranks end in the order they began"
    assert said["next"].startswith("RankFault: the group is down: rank 0 ended passes out of order")


def test_different_checkpoints_are_refused_at_start(tiny_k3_path, tmp_path):
    from deltafin.checkpoint.synthetic import make_checkpoint
    other = make_checkpoint("tiny-k3", tmp_path / "other", seed=1, progress=False)
    paths = [tiny_k3_path, other]
    results = _finish(_start(lambda r: _cli("run", "--model", str(paths[r]), "--device", "cpu", "x"), 2))
    for rc, so, se in results:
        assert rc != 0 and so == ""
        assert "'weights_sha256' differs" in se and "rank 0:" in se and "rank 1:" in se, se


def test_a_command_that_does_not_split_is_refused(tiny_k3_path):
    results = _finish(_start(lambda r: _cli("inspect", str(tiny_k3_path)), 2))
    assert all(rc == 2 and "does not run across ranks" in se for rc, _, se in results)


def test_bench_across_ranks_reports_each_rank_and_the_wire(tiny_kl_path):
    import json
    alone, results = _alone_and_on_two_ranks(("bench", "--model", str(tiny_kl_path), "--device", "cpu", "--tokens",
                                              "8", "--prompt-tokens", "8", "--json"))
    one, split = json.loads(alone), json.loads(results[0][1])
    assert one["dist"] is None
    x = split["dist"]
    assert x["world_size"] == 2 and [p["rank"] for p in x["placement"]] == [0, 1]
    assert x["placement"][0]["layers"][0] == 0 and x["placement"][1]["layers"][1] == 4
    assert x["decode_passes"] == split["decode_tokens"]  # batch 1, no speculation: a pass a token
    # The ranks together read per token what one process reads (the same tokens route the same).
    assert sum(r["ram_bytes_per_token"] for r in x["ranks"]) == one["ram_bytes_per_token"]
    # Each hop carries the residual stream of the pass's row (float32): rank 0 -> 1, then 1 -> 0.
    assert all(r["sent_bytes_per_token"] >= 4 * deltafin.load(tiny_kl_path).config.hidden_size for r in x["ranks"])
    assert x["wire_bytes_per_token"] == pytest.approx(sum(r["sent_bytes_per_token"] for r in x["ranks"]))
    assert x["round_trip_s_per_pass"] > 0 and all(0 < r["busy_share"] < 1 for r in x["ranks"])


def test_bench_across_ranks_pipelines_a_batch(tiny_kl_path):
    """bench --batch 2 on 2 ranks: the sequences in two groups, a pass of each in flight at once (the
    hop figure needs one pass at a time, so it is left out), every token counted once."""
    import json
    results = _finish(_start(lambda r: _cli("bench", "--model", str(tiny_kl_path), "--device", "cpu", "--tokens", "6",
                                            "--prompt-tokens", "8", "--batch", "2", "--pipeline", "2", "--json"), 2))
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2] + results[1][2]
    r = json.loads(results[0][1])
    x = r["dist"]
    assert x["pipeline_groups"] == 2 and x["hop_latency_s"] is None and 0 <= x["idle_share"] < 1
    assert r["decode_tokens"] == 2 * 5 and x["decode_passes"] == r["decode_tokens"]  # a pass a group's token
    assert r["prefill_passes"] == 2


# -- the server on rank 0 ---------------------------------------------------------------------------
class _Server:
    """``deltafin serve`` on `world` ranks started as torchrun would (127.0.0.1, a port the OS picks)."""

    def __init__(self, path, world: int, *extra: str):
        self.procs = _start(lambda r: _cli("serve", "--model", str(path), "--device", "cpu", "--port", "0",
                                           "--memo-size", "0", *extra), world)
        # Rank 0 prints where it serves once every rank has loaded its layers.
        for line in self.procs[0].stdout:
            if line.startswith("deltafin serving"):
                self.base = line.split(" at ")[1].split()[0]
                break
        else:
            raise AssertionError(f"the server did not start: {self.procs[0].stderr.read()}")

    def client(self, timeout: float = 60):
        import openai
        return openai.OpenAI(base_url=self.base, api_key="x", max_retries=0, timeout=timeout)

    def health(self) -> tuple[int, dict]:
        import json
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(self.base.removesuffix("/v1") + "/health", timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self) -> list[tuple[int, str, str]]:
        """SIGTERM to rank 0 (it ends with 143 once it told the others to stop); each rank's (status,
        stdout, stderr)."""
        self.procs[0].send_signal(signal.SIGTERM)
        return _finish(self.procs, timeout=60)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.communicate()


def _generated(model, ids, **params) -> str:
    from deltafin.runtime.generate import generate
    from deltafin.runtime.sampling import SamplingParams
    return generate(model, ids, SamplingParams(**params)).text


@pytest.mark.parametrize("which,world,pipeline", [("k3", 3, "3"), ("kl", 2, "1"), ("kl", 2, "2")])
def test_server_on_rank_0_answers_as_one_process(which, world, pipeline, tiny_k3_path, tiny_kl_path):
    """The openai client against a split model's server: streaming, choices and concurrent requests
    (pipelined: a group's pass in flight per rank, or batched into shared passes), and a conversation
    served from the prefix cache, each answer the text one process generates."""
    import concurrent.futures
    path = tiny_k3_path if which == "k3" else tiny_kl_path
    model = deltafin.load(path, device="cpu", stream="off")
    server = _Server(path, world, "--pipeline", pipeline)
    try:
        client = server.client()
        messages = [{"role": "user", "content": "How many days are there in a week?"}]
        chunks = list(client.chat.completions.create(model=model.name, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        ids = model.encode_chat(messages)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            _generated(model, ids, max_new_tokens=12)
        assert chunks[-1].usage.prompt_tokens == len(ids)

        # n choices share one prefill, then run as one batch (each from a snapshot of the prefilled state).
        prompt = "The river ran slowly past the old mill"
        r = client.completions.create(model=model.name, prompt=prompt, n=3, temperature=0.9, seed=7, max_tokens=10)
        ids = model.encode(prompt)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
            [_generated(model, ids, max_new_tokens=10, temperature=0.9, seed=7 + i) for i in range(3)]
        passes = server.health()[1]["passes"]
        if pipeline == "1":  # one pass at a time, over every request
            assert passes["sequences_per_pass"] > 1 and passes["in_flight_per_pass"] == 1
        else:  # the choices' passes overlap (3 choices: 2 groups on 2 ranks, 3 of one on 3)
            assert passes["in_flight_per_pass"] > 1

        prompts = ["Once upon a time", "The quick brown fox", "In the beginning"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model=model.name, prompt=p, max_tokens=16,
                                                                        temperature=0).choices[0].text, prompts))
        assert answers == [_generated(model, model.encode(p), max_new_tokens=16) for p in prompts]

        # A conversation resent in full each turn starts from the state the last turn left.
        messages, usages = [{"role": "system", "content": "Answer briefly."}], []
        for i in range(3):
            messages.append({"role": "user", "content": f"Question {i}: what comes next?"})
            r = client.chat.completions.create(model=model.name, messages=messages, max_tokens=6, temperature=0)
            assert r.choices[0].message.content == _generated(model, model.encode_chat(messages), max_new_tokens=6)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            usages.append(r.usage)
        for before, u in zip(usages, usages[1:]):
            assert before.prompt_tokens <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens
        status, health = server.health()
        assert status == 200 and health["status"] == "ok" and health["prefix_cache"]["hits"] >= 2
        results = server.stop()
    finally:
        server.close()
    assert [rc for rc, _, _ in results] == [143] + [0] * (world - 1), [se for _, _, se in results]
    assert all(so == "" for _, so, _ in results[1:])  # only rank 0 prints


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_rank_ends_the_stream_and_degrades_the_server(how, tiny_kl_path):
    """Rank 1 is killed (or stopped) once the first token of a long answer is out: the stream ends with
    an error event naming it within the timeout, /health says degraded, later requests get a 503 at
    once, and rank 0 still shuts down cleanly."""
    import openai
    timeout = 3
    model = deltafin.load(tiny_kl_path, device="cpu", stream="off")
    prompt = [15, 7]  # greedy from here runs hundreds of tokens before the end-of-text token
    assert len(model.generate(prompt, max_new_tokens=300)) == 300
    server = _Server(tiny_kl_path, 2, "--dist-timeout", str(timeout))
    try:
        client = server.client(timeout=timeout + 30)  # a hang fails the test instead of blocking it
        got = 0
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(model=model.name, prompt=prompt, max_tokens=300, temperature=0,
                                               stream=True):
                got += 1
                if got == 1:
                    os.kill(server.procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        assert 1 <= got < 300
        assert "rank 1 of 2" in info.value.message and "degraded" in info.value.message
        assert ("stopped answering" if how == "stop" else "is gone") in info.value.message
        status, health = server.health()
        assert status == 503 and health["status"] == "degraded" and "rank 1 of 2" in health["reason"]
        with pytest.raises(openai.InternalServerError) as later:
            client.completions.create(model=model.name, prompt=prompt, max_tokens=4)
        assert later.value.body["code"] == "rank_lost" and "rank 1 of 2" in later.value.message
        server.procs[1].kill()  # a stopped rank would never end
        rc, _, err = server.stop()[0]
    finally:
        server.close()
    assert rc == 143, err


# -- placement and launch, in-process ---------------------------------------------------------------
def test_split_sizes_ranges_by_weight():
    per_layer = [10] * 8
    assert split(per_layer, 0, [1, 1]) == [range(0, 4), range(4, 8)]
    assert split(per_layer, 20, [1, 1]) == [range(0, 3), range(3, 8)]  # rank 0 also holds the globals
    assert split(per_layer, 0, [3, 1]) == [range(0, 6), range(6, 8)]
    assert split(per_layer, 0, [1, 1, 1]) == [range(0, 3), range(3, 5), range(5, 8)]
    assert split([1000, 1, 1], 0, [1, 1, 1]) == [range(0, 1), range(1, 2), range(2, 3)]  # one layer each at least
    for weights in ([1, 1], [5, 1], [1, 9], [1, 2, 3]):
        ranges = split([3, 7, 1, 9, 4, 4, 2], 5, weights)
        assert ranges[0].start == 0 and ranges[-1].stop == 7 and all(ranges)
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


def test_plan_takes_the_setting_then_budgets(tiny_k3_path):
    from deltafin.io.sources import open_source
    sizes = ModelSizes.of(open_source(tiny_k3_path, "auto", Settings.resolve({})))
    p = plan(sizes, [None, None], [range(0, 1), range(1, 6)])
    assert p.ranges == (range(0, 1), range(1, 6)) and p.how == "set by --placement"
    assert sum(p.weight_bytes) == sizes.stored
    assert plan(sizes, [0, 0], None).how == "equal weight bytes"
    assert plan(sizes, [4, 1], None).how == "by each rank's --ram-budget"
    with pytest.raises(PlacementError, match="one range per rank"):
        plan(sizes, [None, None, None], [range(0, 1), range(1, 6)])
    with pytest.raises(PlacementError, match="covering every layer"):
        plan(sizes, [None, None], [range(0, 1), range(1, 4)])
    with pytest.raises(PlacementError, match="only 6 layers"):
        plan(sizes, [None] * 7, None)
    assert "rank 1: layers 1-5" in p.table()


def test_placement_setting_is_checked():
    assert Settings.resolve({"placement": "0-3,4-7"}).placement == "0-3,4-7"
    for bad in ("0-3,5-7", "1-3", "a-b", "0-3,"):
        with pytest.raises(SettingsError, match="placement"):
            Settings.resolve({"placement": bad})
    with pytest.raises(SettingsError, match="dist_timeout"):
        Settings.resolve({"dist_timeout": 0})
    assert Settings.resolve({}, env={"DELTAFIN_PIPELINE": "3"}).pipeline == 3
    for bad in ({"pipeline": -1}, {"pipeline": 65}, {"pipeline": "two"}):
        with pytest.raises(SettingsError, match="pipeline"):
            Settings.resolve(bad)
    with pytest.raises(SettingsError, match="DELTAFIN_PIPELINE"):
        Settings.resolve({}, env={"DELTAFIN_PIPELINE": "many"})


def test_check_same_names_the_field_and_ranks():
    check_same([{"a": 1, "b": "x"}] * 3)
    with pytest.raises(PlacementError, match=r"'b' differs \(ranks 0, 2: 'x'; rank 1: 'y'\)"):
        check_same([{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "x"}])


def test_ranks_share_compute_only_on_one_host_with_the_same_cores_or_gpu():
    """What turns automatic pipelining off: two ranks of one host computing on the same cores, or on
    the same GPU; ranks on GPUs of their own pipeline whatever cores their launches run on."""
    assert share_compute([["a", [0, 1], "cpu"], ["a", [1, 2], "cpu"]])
    assert not share_compute([["a", [0, 1], "cpu"], ["b", [0, 1], "cpu"]])  # two hosts
    assert not share_compute([["a", [0], "cpu"], ["a", [1], "cpu"], ["b", [0], "cpu"]])  # a core each (taskset)
    assert not share_compute([["a", [0, 1], "cuda:0"], ["a", [0, 1], "cuda:1"]])  # a GPU each
    assert share_compute([["a", [0], "cuda:0"], ["a", [1], "cuda:0"]])  # one GPU for both
    assert share_compute([["a", [0, 1], "cuda:0"], ["a", [1], "cpu"]])  # a CPU rank on the GPU rank's cores
    assert not share_compute([["a", [0], "cuda:0"], ["a", [1], "cpu"]])
    for bad in (["a", [0]], ["a", "0-3", "cpu"], [1, [0], "cpu"], ["a", [0.5], "cpu"], ["a", [0], 7],
                ["a", [0], "x" * 33], None):
        with pytest.raises(PlacementError, match="rank 1 described where it computes"):
            share_compute([["a", [0], "cpu"], bad])


def test_launch_from_environment():
    assert from_environment({}) is None and from_environment({"WORLD_SIZE": "1"}) is None
    got = from_environment({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                            "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (got.rank, got.world_size, got.master_port, got.agent_store) == (1, 2, 29500, True)
    with pytest.raises(LaunchError, match="torchrun"):
        from_environment({"WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="outside"):
        from_environment({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    launch = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert from_environment(launch).local_rank == 1  # without LOCAL_RANK: the rank
    assert from_environment({**launch, "LOCAL_RANK": "0"}).local_rank == 0
    with pytest.raises(LaunchError, match="LOCAL_RANK 5 is outside WORLD_SIZE 2"):
        from_environment({**launch, "LOCAL_RANK": "5"})
    with pytest.raises(LaunchError, match="LOCAL_RANK an integer"):
        from_environment({**launch, "LOCAL_RANK": "x"})
