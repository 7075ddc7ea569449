"""The streaming provider against the in-RAM one, its byte accounting and memory bound, the
range reader in every read mode, and ``deltafin bench``."""
from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

from deltafin.runtime.sampling import SamplingParams
import deltafin
from deltafin.checkpoint.hf import CheckpointError, TensorInfo
from deltafin.checkpoint.synthetic import make_checkpoint
from deltafin.runtime.pass_stats import PassStats
from deltafin.io.reader import ALIGN, URGENT, AlignedBuffer, Files, ReadPool, Run, chunked, make_layout, \
    merge_extents
from deltafin.io.stream import StreamProvider
from deltafin.profile import PassRecorder, format_pass, format_summary

PROMPT = [5, 17, 99, 3, 42, 7, 11, 250, 64, 1]
DECODE = [8, 200, 31]


def passes(model) -> list[torch.Tensor]:
    """Logits of a prefill and a few single-token decode steps."""
    state = model.new_state()
    out = [model.forward(PROMPT, state)]
    for t in DECODE:
        out.append(model.forward([t], state))
    return out


@pytest.fixture(scope="module")
def reference(tiny_k3_path, tiny_kl_path):
    refs = {}
    for name, path in (("k3", tiny_k3_path), ("kl", tiny_kl_path)):
        refs[name] = (path, passes(deltafin.load(path, device="cpu", stream="off")))
    return refs


@pytest.mark.parametrize("name", ["k3", "kl"])
@pytest.mark.parametrize("mode", ["buffered", "nocache", "mmap"])
@pytest.mark.parametrize("pin", [0, 2])
def test_streamed_logits_equal_in_ram(reference, name, mode, pin):
    path, want = reference[name]
    model = deltafin.load(path, device="cpu", stream="on", read_mode=mode, pin_layers=pin, io_workers=3)
    assert isinstance(model.engine.provider, StreamProvider)
    got = passes(model)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"pass {k} differs ({mode}, pin_layers={pin})"


@pytest.mark.parametrize("pin", [0, 2])
def test_decode_pass_bytes_add_up(tiny_k3_path, pin):
    model = deltafin.load(tiny_k3_path, device="cpu", stream="on", pin_layers=pin)
    cfg, src = model.config, model.source
    state = model.new_state()
    model.forward(PROMPT, state)
    model.forward([3], state)
    s = model.engine.last_pass

    def nbytes(infos):
        return sum(t.nbytes for t in infos.values())

    spine = [nbytes(src.spine_infos(i)) for i in range(cfg.num_layers)]
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    expert = nbytes(src.expert_infos(moe[0], 0))
    assert s.tokens == 1
    assert s.experts_loaded == len(moe) * cfg.experts_per_token
    assert s.bytes_read > 0
    assert s.bytes_read == sum(spine[pin:]) + s.experts_loaded * expert
    g = {k: t for k, t in src.global_infos().items()}
    embed = g.pop("model.embed_tokens.weight")
    assert s.bytes_from_ram == sum(spine[:pin]) + nbytes(g) + embed.nbytes // cfg.vocab_size
    assert 0 <= s.compute_seconds <= s.seconds
    assert s.spine_wait_seconds >= 0 and s.expert_wait_seconds >= 0


def test_stream_from_converted_store_uses_its_extents(tiny_k3_path, tmp_path):
    from deltafin.checkpoint.convert import convert
    store = convert(tiny_k3_path, tmp_path / "store", spine="int8", progress=False)
    want = passes(deltafin.load(store, device="cpu", stream="off"))
    model = deltafin.load(store, device="cpu", stream="on", read_mode="nocache", pin_layers=1)
    got = passes(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    src, cfg, s = model.source, model.config, model.engine.last_pass
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    # One read per layer spine and per expert, each the store's whole extent.
    assert s.bytes_read == (sum(src.spine_extent(i)[2] for i in range(1, cfg.num_layers))
                            + s.experts_loaded * src.expert_extent(moe[0], 0)[2])


def test_resident_memory_does_not_grow_with_layers(tmp_path):
    resident = {}
    for n in (4, 8):
        path = make_checkpoint("tiny-k3", tmp_path / f"k3-{n}", overrides={"num_hidden_layers": n}, progress=False,
                               shard_size=1 << 30)
        model = deltafin.load(path, device="cpu", stream="on")
        p = model.engine.provider
        state = model.new_state()
        model.forward(PROMPT, state)
        slots, bufs = p.expert_buffers(), p.spine_buffers()
        for t in DECODE:
            model.forward([t], state)
        # Decoding after the prefill allocates nothing: the same buffers, reused.
        assert [id(s) for s in p.expert_buffers()] == [id(s) for s in slots]
        assert [id(b) for b in p.spine_buffers()] == [id(b) for b in bufs]
        assert len(p.expert_buffers()) <= model.config.num_experts
        resident[n] = p.resident_bytes()
        resident[n]["slot_sizes"] = {s.nbytes for s in p.expert_buffers()}
    # The same two spine buffers and the same slot size whatever the depth; at most E slots.
    assert resident[4]["spine_buffers"] == resident[8]["spine_buffers"] > 0
    assert resident[4]["globals"] == resident[8]["globals"]
    assert resident[4]["pinned"] == resident[8]["pinned"] == 0
    assert len(resident[4]["slot_sizes"]) == 1 and resident[4]["slot_sizes"] == resident[8]["slot_sizes"]


def test_read_error_is_raised_and_the_provider_recovers(tiny_k3_path, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_path, path)
    want = passes(deltafin.load(path, device="cpu", stream="off"))
    model = deltafin.load(path, device="cpu", stream="on", io_workers=2)
    shards = sorted(path.glob("model-*.safetensors"))
    saved = {f: f.read_bytes() for f in shards}
    for f in shards:  # cut every shard right after its header: all layer reads now fail
        os.truncate(f, 8 + int.from_bytes(saved[f][:8], "little"))
    with pytest.raises(CheckpointError, match="unexpected end of file"):
        model.forward(PROMPT, model.new_state())
    for f, data in saved.items():
        f.write_bytes(data)
    got = passes(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def _info(file, offset, nbytes, name="t"):
    return TensorInfo(name, str(file), offset, nbytes, (nbytes,), "U8")


def test_merge_extents():
    a, b = "/x/a", "/x/b"
    runs = merge_extents([_info(a, 100, 10), _info(b, 0, 5), _info(a, 110, 20), _info(a, 140, 4), _info(a, 0, 0)])
    assert runs == [Run(a, 100, 30), Run(a, 140, 4), Run(b, 0, 5)]


def test_layout_keeps_file_alignment_and_respects_extent(tmp_path):
    infos = {"x": _info("/f", 5000, 100), "y": _info("/f", 5100, 28), "z": _info("/g", 8192, 10)}
    lay = make_layout(infos)
    assert lay.nbytes == 138 and lay.size % ALIGN == 0
    assert [s % ALIGN for s in lay.starts] == [r.offset % ALIGN for r in lay.runs]
    with pytest.raises(CheckpointError, match="outside"):
        make_layout(infos, extent=("/f", 5000, 128))
    one = make_layout({"x": infos["x"], "y": infos["y"]}, extent=("/f", 4096, 2048))
    assert one.runs == (Run("/f", 4096, 2048),) and one.nbytes == 2048


@pytest.mark.parametrize("mode,direct", [("buffered", True), ("nocache", True), ("nocache", False), ("mmap", True)])
def test_reader_reads_exact_bytes_in_every_mode(tmp_path, mode, direct):
    data = os.urandom(5 * ALIGN + 777)
    file = tmp_path / "blob"
    file.write_bytes(data)
    f = str(file)
    # Unaligned starts and ends, a run ending exactly at end of file, one spanning several pages.
    infos = {"a": _info(f, 3, 100), "b": _info(f, ALIGN - 1, 2), "c": _info(f, 2 * ALIGN + 10, 2 * ALIGN + 5),
             "d": _info(f, len(data) - 300, 300)}
    lay = make_layout(infos)
    buf = AlignedBuffer(lay.size)
    files = Files(mode, direct=direct)
    pool = ReadPool(files, 3)
    try:
        jobs = [(r, buf.mem, s) for r, s in zip(lay.runs, lay.starts)]
        pool.submit(chunked(jobs, ALIGN), URGENT).wait()  # small chunks: runs split across workers
        for key, t, off in lay.tensors:
            assert bytes(buf.mem[off:off + t.nbytes]) == data[t.offset:t.offset + t.nbytes], key
        with pytest.raises(CheckpointError, match="unexpected end of file"):
            pool.submit([(Run(f, len(data) - 10, 20), buf.mem, 0)], URGENT).wait()
    finally:
        pool.shutdown()
        files.close()


def test_pass_recorder_and_profile_lines(tiny_k3_path):
    from deltafin.runtime.generate import generate
    model = deltafin.load(tiny_k3_path, device="cpu", stream="on")
    seen = []
    rec = PassRecorder(report=lambda i, s: seen.append(i))
    with model.observe(rec):
        g = generate(model, PROMPT, SamplingParams(max_new_tokens=4, speculate=False), eos_token_ids=[])
    assert len(rec.passes) == g.stats["passes"] + 1 == len(seen) == 4
    line = format_pass(1, rec.passes[1])
    assert "pass    1" in line and "MB" in line and "experts" in line
    text = format_summary(rec.passes)
    assert text.startswith(f"prefill: {len(PROMPT)} tok") and "decode: 3 tok in 3 passes" in text
    assert format_summary(rec.passes, made=3) == text  # no drafts: the rows fed are the tokens made


def test_profile_summary_counts_the_tokens_a_speculating_run_made():
    """Passes that checked drafts fed more rows than they made tokens: the rate is of tokens made."""
    passes = [PassStats(tokens=9, seconds=0.5)] + [PassStats(tokens=5, seconds=0.01) for _ in range(4)]
    text = format_summary(passes, made=10)
    assert "decode: 10 tok in 4 passes (20 rows fed, drafts included), 250.00 tok/s, 4.0 ms/tok" in text
    assert "  per row: " in text


def _bench_json(capsys, *argv) -> dict:
    from deltafin.bench import add_cli
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["bench", "--tokens", "3", "--prompt-tokens", "4", "--json", "--device", "cpu",
                              *map(str, argv)])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_cli_json(tiny_k3_path, capsys):
    r = _bench_json(capsys, "--model", tiny_k3_path, "--stream", "on", "--io-workers", "2")
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "bytes_per_token", "raw_read_gbps", "achieved_read_gbps",
                "io_efficiency", "io_efficiency_range", "peak_rss_bytes", "tokens_per_pass", "settings", "machine",
                "io_split", "spine", "spine_exact", "product_dtype", "threads"):
        assert key in r, key
    assert r["streaming"] is True and r["decode_tokens"] == 2 and r["tokens_per_pass"] == 1.0
    assert r["bytes_per_token"] == r["read_bytes_per_token"] + r["ram_bytes_per_token"] > 0
    # Two raw probes, one on each side of the decode, each evicting only the model's files first.
    raw = r["raw_read"]
    assert len(raw["probes"]) == 2 and all(p["bytes"] > 0 and p["tokens"] == 2 for p in raw["probes"])
    assert r["cache_drop"] == "fadvise" and all(p["cache_drop"] == "fadvise" for p in raw["probes"])
    rates = [p["gbps"] for p in raw["probes"]]
    assert raw["min_gbps"] == min(rates) and raw["max_gbps"] == max(rates) and r["raw_read_gbps"] == raw["gbps"] > 0
    assert raw["spread"] == pytest.approx((max(rates) - min(rates)) / (sum(rates) / 2))
    low, high = r["io_efficiency_range"]
    assert 0 < low <= r["io_efficiency"] <= high
    low, high = r["decode_vs_limit_range"]
    assert 0 < low <= r["decode_vs_limit"] <= high
    # a share above the fastest probe's never comes without the note saying why
    assert (r["limit_note"] is not None) == (r["achieved_read_gbps"] > raw["max_gbps"])
    assert r["settings"]["io_workers"] == 2 and r["machine"]["cpu_count"] >= 1
    assert r["io_split"]["experts_per_token"] == 20  # 5 MoE layers x top-4
    # What the decode's routers chose: 2 tokens x 5 MoE layers x top-4, by layer, most routed first.
    rt = r["expert_routing"]
    assert rt["routings"] == 40 and len(rt["counts_by_rank"]) == 5 and 0 < rt["top10_share"] <= 1
    assert all(c == sorted(c, reverse=True) and sum(c) == 8 for c in rt["counts_by_rank"].values())
    # Which numerics produced the figures: the synthetic folder has only the exact bf16 spine.
    assert (r["spine"], r["spine_exact"], r["product_dtype"], r["threads"]) == ("bf16", True, "float32", 1)
    assert r["ram_read"] is None and r["ram_read_gbps"] is r["ram_limit_tok_s"] is r["decode_vs_ram_limit"] is None
    assert r["decode_vs_ram_limit_range"] is r["ram_limit_note"] is None
    from deltafin.bench import format_table
    assert "probes before / after decode" in format_table(r) and "spine bf16 (exact)" in format_table(r)


def test_disk_limit_explains_a_decode_faster_than_its_probes():
    from deltafin.bench import disk_limit
    raw = {"gbps": 1.25, "min_gbps": 1.2, "max_gbps": 1.3}
    within = disk_limit(10.0, 0.1e9, raw)  # the decode read 1.0 GB/s
    assert within["limit_tok_s"] == pytest.approx(12.5) and within["decode_vs_limit"] == pytest.approx(0.8)
    assert within["decode_vs_limit_range"] == pytest.approx([1.0 / 1.3, 1.0 / 1.2]) and within["limit_note"] is None
    beyond = disk_limit(21.0, 0.1e9, raw)  # 2.1 GB/s, as in a 3 GiB group whose page cache served reads
    assert beyond["decode_vs_limit"] == pytest.approx(1.68) and "2.10 GB/s" in beyond["limit_note"]
    assert "1.20-1.30 GB/s" in beyond["limit_note"]
    assert disk_limit(5.0, 0, raw)["limit_tok_s"] is None and disk_limit(5.0, 1e6, None)["limit_note"] is None


def test_ram_limit_gives_its_range_and_explains_a_decode_faster_than_its_probes():
    """The memory bound as the disk's: the share against the mean probe and against each, and a note
    when the decode read faster than either probe (the host's memory moved between them)."""
    from deltafin.bench import ram_limit
    ram = {"gbps": 20.0, "min_gbps": 15.0, "max_gbps": 25.0}
    within = ram_limit(16.0, 1e9, ram)  # the decode read 16 GB/s
    assert within["limit_tok_s"] == pytest.approx(20.0) and within["decode_vs_limit"] == pytest.approx(0.8)
    assert within["decode_vs_limit_range"] == pytest.approx([16 / 25, 16 / 15]) and within["limit_note"] is None
    beyond = ram_limit(26.0, 1e9, ram)
    assert "26.00 GB/s its weights" in beyond["limit_note"] and "15.00-25.00 GB/s" in beyond["limit_note"]
    assert "memory" in beyond["limit_note"] and ram_limit(5.0, 1e9, None)["limit_tok_s"] is None


def test_bench_in_ram_neither_evicts_nor_probes_the_disk(tiny_k3_path, capsys):
    r = _bench_json(capsys, "--model", tiny_k3_path, "--stream", "off", "--dtype", "bfloat16")
    assert r["streaming"] is False and r["read_bytes_per_token"] == 0
    assert r["cache_drop"] == "none" and r["raw_read"] is None and r["raw_read_gbps"] is None
    assert r["io_efficiency"] is None and r["io_efficiency_range"] is None
    assert r["product_dtype"] == "bfloat16" and r["decode_tok_s"] > 0
    from deltafin.bench import format_table
    assert "in RAM: raw bandwidth not probed" in format_table(r) and "products bfloat16" in format_table(r)


def test_bench_in_ram_bounds_decode_by_reading_the_weights(tiny_k3_path, capsys):
    """In RAM the bound is memory: the run's threads read a token's weights (every spine, top-k random
    experts per MoE layer, the head) before and after the decode; the limit is that rate over the
    bytes a token read; between the decode's passes the probe runs again every RAM_PROBE_EVERY tokens
    (17 timed passes of 8: after the 8th and the 16th), and the limit is the mean of all of them."""
    from deltafin.bench import RAM_PROBE_EVERY
    from deltafin.kernels import cpu_native
    if not cpu_native.available():
        pytest.skip("the native CPU kernels are not built")
    assert RAM_PROBE_EVERY == 8
    r = _bench_json(capsys, "--model", tiny_k3_path, "--stream", "off", "--threads", "2", "--tokens", "18")
    ram = r["ram_read"]
    assert r["decode_tokens"] == 17
    assert len(ram["probes"]) == 4 and all(p["threads"] == 2 and p["seconds"] > 0 for p in ram["probes"])
    # A probe reads what a decode token reads, but the one embedding row.
    src = deltafin.load(tiny_k3_path, device="cpu", stream="on").source
    embed_row = src.global_infos()["model.embed_tokens.weight"].nbytes // src.config.vocab_size
    assert all(p["bytes"] == r["bytes_per_token"] - embed_row for p in ram["probes"])
    rates = [p["gbps"] for p in ram["probes"]]
    assert r["ram_read_gbps"] == ram["gbps"] == pytest.approx(sum(rates) / 4) and ram["gbps"] > 0
    assert r["ram_limit_tok_s"] == pytest.approx(r["ram_read_gbps"] * 1e9 / r["bytes_per_token"])
    assert r["decode_vs_ram_limit"] == pytest.approx(r["decode_tok_s"] / r["ram_limit_tok_s"])
    fast, slow = max(rates), min(rates)
    assert r["decode_vs_ram_limit_range"] == pytest.approx([r["decode_vs_ram_limit"] * ram["gbps"] / fast,
                                                            r["decode_vs_ram_limit"] * ram["gbps"] / slow])
    from deltafin.bench import format_table
    assert "set by memory: 2 threads read the weights at" in format_table(r)


def test_ram_provider_counts_the_head_once_per_pass(tiny_k3_path):
    """A resident pass reads every global but the embedding (the head, the final norm) and one
    embedding row per token, as a streamed pass counts them."""
    model = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    cfg, src = model.config, model.source
    state = model.new_state()
    model.forward(PROMPT, state)
    model.forward([3], state)
    s = model.engine.last_pass
    g = {k: t.nbytes for k, t in src.global_infos().items()}
    embed = g.pop("model.embed_tokens.weight")
    layers = PassStats()  # what the provider counts for every spine and top-k experts per MoE layer
    for i in range(cfg.num_layers):
        model.engine.provider.spine(i, layers)
        if cfg.is_moe(i):
            model.engine.provider.experts(i, list(range(cfg.experts_per_token)), layers)
    assert s.bytes_read == 0 and s.experts_loaded == layers.experts_loaded > 0
    assert s.bytes_from_ram == layers.bytes_from_ram + sum(g.values()) + embed // cfg.vocab_size


def test_drop_file_cache_evicts_only_the_files_given(tmp_path):
    from deltafin.io.reader import cached_fraction, drop_file_cache
    ours, theirs = tmp_path / "model.bin", tmp_path / "someone-else.bin"
    for f in (ours, theirs):
        f.write_bytes(os.urandom(1 << 20))
        f.read_bytes()  # now in the page cache
    if cached_fraction([theirs]) is None or cached_fraction([theirs]) < 0.99:
        pytest.skip("this filesystem does not keep file pages in a page cache mincore can see")
    assert drop_file_cache([ours]) == "fadvise"
    assert cached_fraction([ours]) == 0.0
    assert cached_fraction([theirs]) > 0.99  # nobody else's cache was emptied


def test_bench_batch_shares_each_pass(tiny_k3_path, capsys):
    """--batch N decodes N sequences together: N tokens per pass, the spine read once for all."""
    common = ("--model", tiny_k3_path, "--no-drop-cache", "--stream", "on", "--io-workers", "2")
    one = _bench_json(capsys, *common, "--batch", "1")
    three = _bench_json(capsys, *common, "--batch", "3")
    assert three["batch"] == 3 and three["decode_tokens"] == 3 * one["decode_tokens"] == 6
    assert three["read_bytes_per_token"] < one["read_bytes_per_token"]
    assert one["prefill_passes"] == three["prefill_passes"] == 1  # 12 prompt rows: one pass
    # Longer prompts are read in pieces: no pass carries more rows than batch 1's whole prompt.
    many = _bench_json(capsys, *common, "--batch", "6", "--prompt-tokens", "5")
    assert many["prefill_passes"] == 3 and many["prefill_bytes_by_source"]["tokens"] == 30  # 2 + 2 + 1 each
    assert many["decode_tokens"] == 12
    from deltafin.bench import add_cli
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["bench", "--model", str(tiny_k3_path), "--batch", "0"])
    with pytest.raises(ValueError, match="batch of at least 1"):
        args.func(args)


def test_routing_figures_best_cache_of_the_slots():
    """The best fixed choice of `slots` experts per layer serves the most routed ones' share."""
    from deltafin.bench import routing_figures
    before = {1: [1, 0, 0, 0], 3: [0, 0, 0, 0]}
    after = {1: [7, 2, 1, 0], 3: [0, 5, 0, 5]}  # decode: layer 1 [6, 2, 1, 0], layer 3 [0, 5, 0, 5]
    r = routing_figures(before, after, {"expert_slots_per_layer": 1})
    assert r["routings"] == 19 and r["counts_by_rank"] == {"1": [6, 2, 1, 0], "3": [5, 5, 0, 0]}
    assert r["best_hit_rate"] == (6 + 5) / 19 and r["top10_share"] == (6 + 5) / 19  # top 10% of 4 = 1
    assert routing_figures({}, {}, None) is None and "best_hit_rate" not in routing_figures(before, after, None)


def test_bench_warmup_tokens_are_decoded_but_not_timed(tiny_k3_path, capsys):
    r = _bench_json(capsys, "--model", tiny_k3_path, "--stream", "on", "--tokens", "3", "--warmup-tokens", "2",
                    "--ram-budget", "auto")
    assert r["warmup_tokens"] == 2 and r["decode_tokens"] == 2  # --tokens counts the prefill's token
    # after two tokens in the cache, the measured ones read less from disk than the whole model's spines
    assert r["disk_bytes_per_token"] < r["io_split"]["spine_bytes_per_token"]
    with pytest.raises(ValueError, match="--warmup-tokens"):
        _bench_json(capsys, "--model", tiny_k3_path, "--warmup-tokens", "-1")


def test_raw_read_probe_stops_at_its_byte_cap(tiny_k3_path):
    """The disk probe reads layer by layer up to its cap (a K3-sized token is ~10 GB): what it read
    is what it reports, and a token's worth is the spines plus top-k experts of every MoE layer."""
    from deltafin.bench import measure_raw_read
    from deltafin.checkpoint.sizes import ModelSizes
    from deltafin.io.sources import open_source
    from deltafin.settings import Settings
    source = open_source(tiny_k3_path)
    settings = Settings.resolve({"io_workers": 2})
    whole = measure_raw_read(source, settings, tokens=2)
    assert whole["tokens"] == 2.0
    sizes = ModelSizes.of(source)
    one = sum(sizes.spine_bytes) + 4 * sum(sizes.expert_bytes)  # top-4
    assert whole["bytes"] == pytest.approx(2 * one, rel=0.05)
    capped = measure_raw_read(source, settings, tokens=2, max_bytes=one // 2)
    assert one // 2 <= capped["bytes"] < one and 0.4 < capped["tokens"] < 1
