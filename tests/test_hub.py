"""Lazy hub mode against a real local HTTP server that serves a synthetic checkpoint the way the
hub does (tests/hub_server.py): what a first answer transfers, a second run's zero bytes, offline
mode, injected faults, kill -9 in the middle of a fetch, the disk budget, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltafin
from deltafin.files import CheckpointError
from deltafin.checkpoint.source import HFSource
from deltafin.io.fetch import HubError
from deltafin.io.hub import HubSource, check_entry_file
from deltafin.model.moe import chosen_experts
from deltafin.settings import Settings, SettingsError

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import HubServer  # noqa: E402

REPO = "org/tiny-k3"
PROMPT = "The river ran slowly past the old mill"


@pytest.fixture
def hub(tiny_k3_path, monkeypatch):
    """The server, with huggingface_hub pointed at it (what HF_ENDPOINT does at import time)."""
    from huggingface_hub import constants
    with HubServer() as server:
        server.add(REPO, tiny_k3_path)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


def load(cache: Path, **kw):
    kw = {"device": "cpu", "cache_dir": str(cache), "hub_backoff": 0.001, **kw}
    return deltafin.load(REPO, **kw)


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("hub/*/*/entries/*.bin"))


def test_first_answer_fetches_what_it_touches_and_a_second_run_nothing(hub, tiny_k3_path, tmp_path):
    ref = deltafin.load(tiny_k3_path, device="cpu", stream="on")
    touched = set()
    inner = ref.engine.provider.experts

    def experts(i, ids, stats, residual=None):  # the routed experts the local run reads, layer by layer
        touched.update((i, e) for e in chosen_experts(ids))
        return inner(i, ids, stats, residual)

    ref.engine.provider.experts = experts
    ids = ref.encode(PROMPT)
    want = ref.generate(ids, max_new_tokens=8)
    src: HFSource = ref.source
    cfg = src.config
    spine = sum(t.nbytes for t in src.global_infos().values()) + sum(
        t.nbytes for i in range(cfg.num_layers) for t in src.spine_infos(i).values())
    experts_bytes = sum(t.nbytes for i, e in touched for t in src.expert_infos(i, e).values())
    meta_files = ["config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model",
                  "model.safetensors.index.json"]
    shards = sorted(set(json.loads((tiny_k3_path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    headers = sum(8 + int.from_bytes((tiny_k3_path / s).read_bytes()[:8], "little") for s in shards)
    metadata = sum((tiny_k3_path / f).stat().st_size for f in meta_files) + headers

    m = load(tmp_path)
    assert m.name == REPO and m.streaming
    got = m.generate(m.encode(PROMPT), max_new_tokens=8)
    assert got == want
    assert hub.sent <= 1.05 * (spine + experts_bytes + metadata), (hub.sent, spine, experts_bytes, metadata)
    assert hub.sent >= spine + experts_bytes  # everything used came over the wire once
    assert m.source.bytes_received == hub.sent
    assert all(check_entry_file(p) for p in entries(tmp_path))
    # large-file requests were ranges, coalesced: fewer requests than entries fetched
    ranges = [r for r in hub.requests if r[0] == "GET" and r[2] is not None and "/cdn/" in r[1]]
    assert len(ranges) < len(entries(tmp_path)) + 2 * len(shards)

    hub.reset_counts()
    again = load(tmp_path)
    assert again.generate(again.encode(PROMPT), max_new_tokens=8) == want
    assert hub.sent == 0 and [r[0] for r in hub.requests] == ["HEAD"]  # the revision check only
    assert torch.equal(again.logits(ids), ref.logits(ids))
    stats = again.engine.last_pass
    assert stats.bytes_from_network == 0 and stats.bytes_from_cache > 0 and stats.bytes_read == 0


def test_offline_serves_the_cache_and_names_what_is_missing(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants
    m = load(tmp_path)
    ids = m.encode(PROMPT)
    first = m.logits(ids)
    hub.reset_counts()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    off = load(tmp_path)
    assert torch.equal(off.logits(ids), first) and hub.requests == []
    other = [t for t in range(off.config.vocab_size) if t not in ids][:40]
    missing = r"offline \(HF_HUB_OFFLINE is set\) and not in the cache .*layer \d+ expert \d+"
    with pytest.raises(HubError, match=missing):
        off.logits(other)
    with pytest.raises(HubError, match="never fetched"):
        load(tmp_path / "empty")


@pytest.mark.parametrize("fault", ["429", "503", "truncate", "reset", "slow", "long"])
def test_injected_faults_end_in_retries(hub, tiny_k3_path, tmp_path, fault):
    hub.fail(fault, "-of-", times=3)  # shard data, not the index
    m = load(tmp_path)
    ids = m.encode(PROMPT)
    ref = deltafin.load(tiny_k3_path, device="cpu", stream="on")
    assert torch.equal(m.logits(ids), ref.logits(ids))
    assert not any(f[2] for f in hub.faults)  # every fault was hit
    assert all(check_entry_file(p) for p in entries(tmp_path))
    assert not list(tmp_path.glob("hub/*/*/entries/*.part"))


def test_persistent_faults_end_in_a_clear_error(hub, tmp_path, capsys):
    hub.fail("503", "-of-", times=1000)
    with pytest.raises(HubError, match=r"model-\d+-of-\d+\.safetensors: HTTP 503 \(gave up after 3 attempts\)"):
        load(tmp_path, hub_retries=2)
    from deltafin.cli import main
    assert main(["run", "--model", "org/other", "--cache-dir", str(tmp_path), "hi"]) == 2
    assert "org/other" in capsys.readouterr().err


KILLED_RUN = """
import sys, deltafin
m = deltafin.load({repo!r}, device="cpu", cache_dir={cache!r})
m.generate(m.encode({prompt!r}), max_new_tokens=4)
"""


def test_kill_mid_fetch_then_rerun_gives_identical_logits(hub, tiny_k3_path, tmp_path):
    # the shard headers (2 requests per shard) and the first entries go through; the next range
    # request sends half its body and hangs
    hub.fail("stall", "-of-", times=1, after=10)
    code = KILLED_RUN.format(repo=REPO, cache=str(tmp_path), prompt=PROMPT)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert hub.stalled.wait(120), proc.stderr.read1().decode() if proc.poll() is not None else "no stall"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
    assert list(tmp_path.glob("hub/*/*/entries/*.part"))  # it died mid-entry
    assert all(check_entry_file(p) for p in entries(tmp_path))  # and left no corrupt entry behind
    m = load(tmp_path)
    ref = deltafin.load(tiny_k3_path, device="cpu", stream="on")
    ids = ref.encode(PROMPT)
    assert torch.equal(m.logits(ids), ref.logits(ids))
    assert all(check_entry_file(p) for p in entries(tmp_path))
    assert not list(tmp_path.glob("hub/*/*/entries/*.part*"))


def test_damaged_entry_is_fetched_again(hub, tiny_k3_path, tmp_path, capsys):
    m = load(tmp_path)
    ids = m.encode(PROMPT)
    first = m.logits(ids)
    victim = next(p for p in entries(tmp_path) if p.name.startswith("expert-"))
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = load(tmp_path)
    assert torch.equal(again.logits(ids), first)
    assert "damaged" in capsys.readouterr().err and check_entry_file(victim)


def test_disk_budget_deletes_least_recently_used_experts(hub, tmp_path, capsys):
    m = load(tmp_path)
    m.logits(m.encode(PROMPT))
    before = {p.name for p in entries(tmp_path) if p.name.startswith("expert-")}
    m.source.close()
    small = load(tmp_path, hub_cache_gb=1e-9)  # a budget no expert fits in
    small.logits(small.encode("def f(x):\n    return x"))
    after = {p.name for p in entries(tmp_path) if p.name.startswith("expert-")}
    assert after and not before <= after  # experts of the first run were deleted to make room
    assert any(p.name.startswith("spine-") for p in entries(tmp_path))  # the spine stays
    assert "over its budget" in capsys.readouterr().err


def test_bad_input_is_refused(hub, tiny_k3_path, tmp_path):
    with pytest.raises(SettingsError, match="hub_connections"):
        Settings.resolve({"hub_connections": 0})
    with pytest.raises(SettingsError, match="revision"):
        Settings.resolve({"revision": " "})
    with pytest.raises(FileNotFoundError, match="nor a hub id"):
        deltafin.load("a/b/c", cache_dir=str(tmp_path))
    with pytest.raises(HubError, match=r"revision v9.*RevisionNotFound"):
        load(tmp_path, revision="v9")
    # an index that names a shard outside the repository folder
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_k3_path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../../etc/passwd"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    hub.add("org/bad", bad)
    with pytest.raises(CheckpointError, match="not a path inside the repository"):
        HubSource("org/bad", Settings.resolve({"cache_dir": str(tmp_path / "c")}))
    assert not (tmp_path / "etc").exists()


def test_a_killed_fetch_resumes_from_its_journal(hub, tiny_k3_path, tmp_path):
    src = HubSource(REPO, Settings.resolve({"cache_dir": str(tmp_path), "hub_backoff": 0.001}))
    entry, _ = src._spine_group(1)
    assert len(entry.pieces) > 1
    first = entry.pieces[0]
    part = src.cache.path(entry).with_suffix(".part")
    with open(tiny_k3_path / first.shard, "rb") as f:
        f.seek(first.offset)
        data = f.read(first.nbytes)
    with open(part, "wb") as f:  # what a killed run had written and journaled
        f.seek(first.at)
        f.write(data)
    part.with_name(part.name + ".log").write_text(f"{first.at} {first.nbytes}\n{first.at} 1")  # torn last line
    hub.reset_counts()
    src.cache.ensure([entry])
    assert hub.sent == sum(p.nbytes for p in entry.pieces) - first.nbytes
    assert check_entry_file(src.cache.path(entry)) and not part.exists()
    src.close()


def test_bench_splits_bytes_by_source(hub, tmp_path):
    from deltafin.bench import format_table, run_bench
    settings = Settings.resolve({"device": "cpu", "cache_dir": str(tmp_path), "hub_backoff": 0.001})
    first = run_bench(REPO, tokens=2, prompt_tokens=4, settings=settings, drop_cache=False)
    assert first["prefill_bytes_by_source"]["network"] > 0 and first["raw_read"] is None
    assert "a hub repository" in format_table(first)
    again = run_bench(REPO, tokens=2, prompt_tokens=4, settings=settings, drop_cache=False)
    by = again["bytes_by_source_per_token"]
    assert by["network"] == 0 and by["disk_cache"] > 0 and by["disk"] == 0
    assert again["bytes_per_token"] == pytest.approx(sum(by.values()))
