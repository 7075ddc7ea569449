"""A model split across processes (deltafin.dist), gloo on loopback: the same logits and tokens as
one process, a rank that dies or stops answering named within the timeout, different checkpoints
refused at start; the placement and launch rules in-process."""
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
from deltafin.dist.placement import PlacementError, check_same, plan, split
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
               GLOO_SOCKET_IFNAME="lo", DELTAFIN_THREADS="1", PYTHONPATH=str(ROOT))
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
    results = _finish(_start(lambda r: [sys.executable, str(RANK_SCRIPT), str(path), str(out)], world))
    for rank, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {rank}: {se}"
        assert so == ""  # the ranks print nothing to stdout
    got = torch.load(out)
    ranges = [range(a, b) for a, b in got.pop("placement")]
    assert len(ranges) == world and ranges[0].start == 0 and ranges[-1].stop == deltafin.load(path).config.num_layers
    want = parity(deltafin.load(path, device="cpu", stream="off"))
    assert set(got) == set(want)
    for key in ("logits", "after_rollback", "after_restore"):
        assert torch.equal(got[key], want[key]), key
    for key in ("batch", "batch2"):
        assert all(torch.equal(g, w) for g, w in zip(got[key], want[key])), key
    for key in ("greedy", "greedy_plain", "sampled", "drafted", "scheduled"):
        assert got[key] == want[key], key
    assert got["drafted"] == got["greedy"] and got["accepted"] > 0


def test_streamed_ranks_equal_one_process_on_the_cli(tiny_kl_path):
    args = ("run", "--model", str(tiny_kl_path), "--device", "cpu", "--max-new-tokens", "16", "--stream", "on",
            "The river")
    alone = subprocess.run(_cli(*args), env=dict(os.environ, DELTAFIN_THREADS="1"), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    results = _finish(_start(lambda r: _cli(*args), 2))
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2] + results[1][2]
    assert results[0][1] == alone.stdout
    assert results[1][1] == ""
    assert "placement across 2 ranks" in results[0][2] and "rank 1: layers" in results[0][2]


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


def test_check_same_names_the_field_and_ranks():
    check_same([{"a": 1, "b": "x"}] * 3)
    with pytest.raises(PlacementError, match=r"'b' differs \(ranks 0, 2: 'x'; rank 1: 'y'\)"):
        check_same([{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "x"}])


def test_launch_from_environment():
    assert from_environment({}) is None and from_environment({"WORLD_SIZE": "1"}) is None
    got = from_environment({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                            "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (got.rank, got.world_size, got.master_port, got.agent_store) == (1, 2, 29500, True)
    with pytest.raises(LaunchError, match="torchrun"):
        from_environment({"WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="outside"):
        from_environment({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
