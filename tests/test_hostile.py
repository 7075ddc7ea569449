"""Hostile input and faults: every bad input is a clear error, nothing is read outside the model
folder, nothing hangs. One section per class of defect:

a. paths from data files escaping the model folder      g. malformed data files: one error line
b. sizes from config or manifest trusted                h. numerics and ranges of sampling
c. special files (FIFO) as shards or store files        i. settings and config types
d. verify with a short checksum list                    j. concurrent writers of one destination
e. chat template on the event loop                      k. clients that never finish a request
f. engine faults reported as client errors

The property-based fuzzers (hypothesis) at the end feed random safetensors headers, index
files, store manifests and request bodies through the same paths.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import http.client
import io
import json
import os
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest

from deltafin.runtime.sampling import SamplingParams
import deltafin
from deltafin.runtime.generate import generate
from deltafin.serve.app import create_app
from test_serve import RunningServer

REPO = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


# -- helpers --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


def serving(model, **settings):
    return RunningServer(create_app(model, settings=dataclasses.replace(model.settings, **settings)))


# -- e. the chat template runs off the event loop, within a time limit ----------------------------

SLOW_TEMPLATE = ("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_slow_chat_template_neither_blocks_the_server_nor_waits_for_ever(model):
    slow = copy.copy(model)
    slow.tokenizer = copy.copy(model.tokenizer)
    slow.tokenizer.chat_template = SLOW_TEMPLATE  # nine million loop turns: seconds, not 0.2 s
    with serving(slow, render_timeout=0.2) as srv:
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=srv.request("POST", CHAT, {"messages": MSG})))
        t.start()
        # While the template renders, /health answers (and says why it is degraded once it is late).
        seen = set()
        while t.is_alive():
            status, body, _ = srv.request("GET", "/health")
            seen.add(body["status"])
        t.join()
        status, body, _ = answer["r"]
        assert (status, body["error"]["code"], body["error"]["type"]) == (503, "render_timeout", "server_error")
        assert "ok" in seen or "degraded" in seen


def test_token_id_prompts_do_not_wait_for_a_busy_renderer(model):
    """A completion whose prompt is token ids has nothing to render: it is checked on the event loop and
    answers while every renderer thread is held (by slow templates, say), where a text prompt waits."""
    with serving(model, render_timeout=0.2) as srv:
        held = threading.Event()
        renderer = srv.server.config.app.state.service.renderer
        for _ in range(renderer._max_workers):
            renderer.submit(held.wait, 30)
        try:
            status, body, _ = srv.request("POST", COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "temperature": 0})
            assert (status, body["error"]["code"]) == (503, "render_timeout")
            status, body, _ = srv.request("POST", COMPLETIONS,
                                          {"prompt": [11, 42, 7], "max_tokens": 2, "temperature": 0})
            assert status == 200 and body["usage"]["prompt_tokens"] == 3
            status, body, _ = srv.request("POST", COMPLETIONS, {"prompt": [11, 10 ** 9], "max_tokens": 2})
            assert (status, body["error"]["param"]) == (400, "prompt") and "prompt[1]" in body["error"]["message"]
        finally:
            held.set()


# -- f. engine faults are server errors, without local paths; /health says degraded -------------

def test_weights_read_fault_is_a_503_and_health_turns_degraded(tiny_k3_path, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_path, path)
    m = deltafin.load(path, device="cpu", stream="on", io_workers=2)
    with serving(m) as srv:
        assert srv.request("GET", "/health")[0] == 200
        for f in path.glob("model-*.safetensors"):  # cut every shard after its header
            head = f.read_bytes()[:8]
            os.truncate(f, 8 + int.from_bytes(head, "little"))
        status, body, _ = srv.request("POST", COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "temperature": 0})
        err = body["error"]
        assert (status, err["type"], err["code"], err["param"]) == (503, "server_error", "engine_fault", None)
        assert str(tmp_path) not in err["message"] and "unexpected end of file" in err["message"]
        status, health, _ = srv.request("GET", "/health")
        assert status == 503 and health["status"] == "degraded" and str(tmp_path) not in health["reason"]
        assert "deltafin_engine_faults_total 1" in srv.request("GET", "/metrics")[1]


# -- h. numerics and ranges ----------------------------------------------------------------------

def test_tiny_temperature_is_greedy_and_nan_is_refused(model):
    ids = model.encode("The river ran")
    greedy = generate(model, ids, SamplingParams(max_new_tokens=6)).tokens
    for t in (1e-300, 1e-30, 1e-9):
        assert generate(model, ids, SamplingParams(max_new_tokens=6, temperature=t, seed=1, top_p=0.9, top_k=5)).tokens == greedy
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            generate(model, ids, SamplingParams(max_new_tokens=2, temperature=bad))
    with pytest.raises(ValueError, match="seed"):
        generate(model, ids, SamplingParams(max_new_tokens=2, temperature=0.5, seed=1 << 64))


def test_server_ranges_name_the_parameter(model):
    with serving(model) as srv:
        r = srv.request("POST", COMPLETIONS, {"prompt": "The river ran", "max_tokens": 4, "temperature": 1e-300})
        assert r[0] == 200
        assert r[1]["choices"][0]["text"] == generate(model, model.encode("The river ran"), SamplingParams(max_new_tokens=4)).text
        r = srv.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "temperature": 0.5, "seed": 1 << 63})
        assert r[0] == 200  # any 64-bit seed is a seed
        for body, param in (({"seed": 1 << 64}, "seed"), ({"seed": -(1 << 63) - 1}, "seed"),
                            ({"temperature": "NaN"}, "temperature"), ({"top_k": -2}, "top_k"),
                            ({"max_tokens": True}, "max_tokens")):
            status, got, _ = srv.request("POST", COMPLETIONS, {"prompt": "hi", **body})
            assert (status, got["error"]["param"]) == (400, param), got
        # JSON's non-standard NaN / Infinity literals are parsed by Python: refused as values.
        status, got, _ = srv.request("POST", COMPLETIONS, '{"prompt": "hi", "temperature": NaN}')
        assert (status, got["error"]["param"], got["error"]["code"]) == (400, "temperature", "invalid_value")


# -- k. clients that never finish their headers or body --------------------------------------------

def _read_all(sock: socket.socket) -> bytes:
    """What the server sent until it closed. A server that closes with our bytes still unread
    answers the next ones with a reset; the kernel hands out the data queued before it first, so a
    reset ends the reply like a close does."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_unfinished_headers_and_body_are_cut_off(model):
    with serving(model, header_timeout=0.3, body_timeout=0.3) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # and nothing more
            reply = _read_all(s)  # returns once the server closes the connection
        assert reply.startswith(b"HTTP/1.1 408") and b"header_timeout" in reply
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
        # A keep-alive connection gets the same limit for its next request.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in reply
        # Sending a byte now and then does not stretch either limit: they cover the whole head / body.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        assert b"header_timeout" in _drip(srv.port, b"", head + b"X-Pad: " + b"a" * 400 + b"\r\n\r\n")
        body = b'{"prompt": "' + b"a" * 400 + b'"}'
        reply = _drip(srv.port, head + b"Content-Length: %d\r\n\r\n" % len(body), body)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
        assert srv.request("GET", "/health")[0] == 200


def _drip(port: int, start: bytes, rest: bytes) -> bytes:
    """Send `start`, then `rest` a byte at a time, each after waiting 20 ms for an answer; return
    the answer (what the server sent before closing), or b"" if all of `rest` went out first."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(start)
        for i in range(len(rest)):
            s.settimeout(0.02)
            try:
                first = s.recv(65536)
            except socket.timeout:
                try:
                    s.sendall(rest[i:i + 1])
                except OSError:  # closed by the server just now: its answer is waiting to be read
                    pass
                continue
            s.settimeout(30)
            return first + _read_all(s)
    return b""


# -- server conventions: API key, served names, max model length, metrics, HEAD, bind errors ------

def test_api_key_guards_the_v1_routes(model):
    with serving(model, api_key="s3cret") as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, got, h = srv.request("POST", CHAT, {"messages": MSG, "max_tokens": 1}, headers)
            assert (status, got["error"]["code"]) == (401, "invalid_api_key") and h["www-authenticate"] == "Bearer"
            assert srv.request("GET", "/v1/models", headers=headers)[0] == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert srv.request("POST", CHAT, {"messages": MSG, "max_tokens": 1, "temperature": 0}, ok)[0] == 200
        assert srv.request("GET", "/health")[0] == 200 and srv.request("GET", "/metrics")[0] == 200


def test_served_model_names_and_max_model_len(model):
    with serving(model, served_model_name="kimi, gpt-4o-mini", max_model_len=32) as srv:
        status, got, _ = srv.request("GET", "/v1/models")
        assert [m["id"] for m in got["data"]] == ["kimi", "gpt-4o-mini"]
        assert {m["max_model_len"] for m in got["data"]} == {32}
        for name in ("kimi", "gpt-4o-mini"):
            status, got, _ = srv.request("POST", COMPLETIONS, {"model": name, "prompt": "hi", "max_tokens": 1})
            assert status == 200 and got["model"] == "kimi"
        assert srv.request("POST", COMPLETIONS, {"model": model.name, "prompt": "hi"})[0] == 404
        status, got, _ = srv.request("POST", COMPLETIONS, {"prompt": [1] * 32, "max_tokens": 1})
        assert (status, got["error"]["code"]) == (400, "context_length_exceeded") and "32" in got["error"]["message"]
        status, got, _ = srv.request("POST", COMPLETIONS, {"prompt": [1] * 30, "max_tokens": 50, "temperature": 0})
        assert status == 200 and got["usage"]["completion_tokens"] <= 2
    with pytest.raises(deltafin.errors.DeltafinError, match="max_model_len"):
        create_app(model, dataclasses.replace(model.settings, max_model_len=10 ** 9))


def test_metrics_count_requests_tokens_and_cache(model):
    with serving(model) as srv:
        body = {"prompt": "Counting is", "max_tokens": 3, "temperature": 0}
        first = srv.request("POST", COMPLETIONS, body)[1]
        srv.request("POST", COMPLETIONS, body)  # answered from the memo
        srv.request("POST", COMPLETIONS, {"prompt": 5})
        status, text, headers = srv.request("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert lines['deltafin_requests_total{route="/v1/completions",status="200"}'] == "2"
        assert lines['deltafin_requests_total{route="/v1/completions",status="400"}'] == "1"
        assert lines["deltafin_prompt_tokens_total"] == str(first["usage"]["prompt_tokens"])
        assert lines["deltafin_completion_tokens_total"] == str(first["usage"]["completion_tokens"])
        assert lines['deltafin_memo_lookups_total{result="hit"}'] == "1"
        assert lines['deltafin_memo_lookups_total{result="miss"}'] == "1"
        assert int(lines['deltafin_weight_bytes_total{source="ram"}']) > 0  # this model is in RAM
        assert lines["deltafin_queue_depth"] == "0"
        assert "# TYPE deltafin_requests_total counter" in text


def test_head_health_and_bind_errors(model, capsys):
    with serving(model) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("HEAD", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b""
        conn.close()
        # the port is checked before the model is loaded, so a missing model is not what is reported
        for port, needles in ((srv.port, ("in use", str(srv.port))), (70000, ("'port'", "65535"))):
            assert_cli_error(capsys, ["serve", "--model", "/nonexistent", "--port", port], *needles)


# -- the data-file side: fixtures ---------------------------------------------------------------

class OpenAudit:
    """Records every file opened (builtins.open and os.open raise the 'open' audit event) inside
    a folder that must stay untouched: the sentinel files planted outside the model folder."""

    def __init__(self):
        self.fence: str | None = None
        self.seen: list[str] = []
        sys.addaudithook(self._hook)  # for the rest of the session; a no-op while no fence is set

    def _hook(self, event: str, args) -> None:
        if event == "open" and self.fence is not None and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(self.fence):
                self.seen.append(path)

    @contextlib.contextmanager
    def forbid(self, folder: Path):
        self.fence, self.seen = os.path.realpath(folder) + os.sep, []
        try:
            yield self
        finally:
            self.fence = None
        assert not self.seen, f"opened outside the model folder: {self.seen}"


AUDIT = OpenAudit()
SECRET = "SENTINEL-4f9d-never-shown"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder beside the model with files a hostile checkpoint may point at."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_text(SECRET * 100)
    (d / "secret.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"x": 1}' + SECRET.encode())
    return d


@pytest.fixture
def ckpt(tiny_k3_path, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_path, path)
    return path


@pytest.fixture(scope="module")
def store_template(tiny_k3_path, tmp_path_factory) -> Path:
    from deltafin.checkpoint.convert import convert
    return convert(tiny_k3_path, tmp_path_factory.mktemp("hostile") / "store", progress=False)


@pytest.fixture
def store(store_template, tmp_path) -> Path:
    path = tmp_path / "store"
    shutil.copytree(store_template, path)
    return path


def edit_json(file: Path, change) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def cli(capsys, *args) -> tuple[int, str]:
    """`deltafin ARGS` in this process: (exit code, stderr). An unhandled error fails the test."""
    from deltafin.cli import main
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def assert_cli_error(capsys, args, *needles: str) -> str:
    rc, err = cli(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.startswith("deltafin: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert SECRET not in err
    return lines[0]


def manifest_file(store: Path) -> Path:
    return store / "deltafin-store.json"


# -- a. paths from data files stay inside the model folder --------------------------------------

@pytest.mark.parametrize("where", ["files", "region", "expert_file"])
@pytest.mark.parametrize("target", ["absolute", "dotdot", "symlink"])
def test_store_manifest_paths_stay_inside_the_store(store, outside, capsys, where, target):
    from deltafin.checkpoint.store import StoreError, StoreSource, verify
    rel = {"absolute": str(outside / "secret"), "dotdot": "../outside/secret", "symlink": "spine/escape.bin"}[target]
    if target == "symlink":
        os.symlink(outside / "secret", store / rel)

    def change(m):
        if where == "files":
            m["files"][rel] = {"nbytes": len(SECRET) * 100, "checksum": "00000000"}
        elif where == "region":
            m["spines"]["bf16"]["globals"]["file"] = rel
        else:
            m["experts"]["layers"]["1"]["file"] = rel
    edit_json(manifest_file(store), change)
    with AUDIT.forbid(outside):
        with pytest.raises(StoreError, match="outside the model folder|absolute") as e:
            StoreSource(store)
        assert SECRET not in str(e.value)
        problems = verify(store)
        assert len(problems) == 1 and ("outside the model folder" in problems[0] or "absolute" in problems[0])
        assert_cli_error(capsys, ["inspect", store], rel)
    assert "outside" in str(e.value) or "absolute" in str(e.value)


@pytest.mark.parametrize("shard", ["../outside/secret.safetensors", "ABS", "link.safetensors"])
def test_safetensors_index_paths_stay_inside_the_folder(ckpt, outside, capsys, shard):
    from deltafin.checkpoint.hf import CheckpointError, HFCheckpoint
    if shard == "ABS":
        shard = str(outside / "secret.safetensors")
    if shard == "link.safetensors":
        os.symlink(outside / "secret.safetensors", ckpt / shard)
    edit_json(ckpt / "model.safetensors.index.json", lambda m: m["weight_map"].update({"extra.weight": shard}))
    with AUDIT.forbid(outside):
        with pytest.raises(CheckpointError, match="outside the model folder|absolute") as e:
            HFCheckpoint(ckpt)
        assert SECRET not in str(e.value)
        assert_cli_error(capsys, ["inspect", ckpt], "model.safetensors.index.json")


def test_hub_cache_snapshot_symlinks_keep_working(tiny_k3_path, tmp_path):
    """The hub stores files once under blobs/ and links them from each snapshot: that is allowed."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in Path(tiny_k3_path).iterdir():
        shutil.copy(f, blobs / f"blob-{f.name}")
        os.symlink(Path("..") / ".." / "blobs" / f"blob-{f.name}", snap / f.name)
    m = deltafin.load(snap, device="cpu", stream="on")
    ref = deltafin.load(tiny_k3_path, device="cpu", stream="off")
    ids = ref.encode("The river ran")
    assert generate(m, ids, SamplingParams(max_new_tokens=4)).tokens == generate(ref, ids, SamplingParams(max_new_tokens=4)).tokens
    # ...but a snapshot link that leaves the repo's cache folder is still refused
    from deltafin.checkpoint.hf import CheckpointError, HFCheckpoint
    (tmp_path / "elsewhere.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "far.safetensors")
    index = snap / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["x.weight"] = "far.safetensors"
    index.unlink()
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        HFCheckpoint(snap)


# -- b. sizes are bounded before anything is allocated or enumerated ------------------------------

@pytest.mark.parametrize("experts,needle", [(1_000_000_000, "out of range"), (65536, "implies")])
def test_huge_expert_count_is_refused_in_bounded_memory(ckpt, capsys, experts, needle):
    import tracemalloc
    edit_json(ckpt / "config.json", lambda c: c["text_config"].update(num_experts=experts))
    tracemalloc.start()
    try:
        line = assert_cli_error(capsys, ["inspect", ckpt], "num_experts", needle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # a config claiming 65536 experts x 5 layers is not listed one by one
    assert str(ckpt / "config.json") in line


@pytest.mark.parametrize("field,value", [("nbytes", 10 ** 15), ("offset", 10 ** 15), ("nbytes", -1),
                                         ("offset", -4096)])
def test_store_region_sizes_are_bounded_by_the_files(store, capsys, field, value):
    edit_json(manifest_file(store), lambda m: m["spines"]["bf16"]["layers"][1].__setitem__(field, value))
    assert_cli_error(capsys, ["run", "--model", store, "--max-new-tokens", "1", "hi"], "layers", str(value)
                     if value > 0 else field)


def test_expert_span_and_count_must_fill_the_file(store, capsys):
    edit_json(manifest_file(store), lambda m: m["experts"]["layers"]["1"].__setitem__("num_experts", 60000))
    assert_cli_error(capsys, ["inspect", store], "experts.layers.1", "do not fill")


def test_threads_and_workers_are_bounded(capsys):
    assert_cli_error(capsys, ["run", "--threads", "100000", "hi"], "threads", "1024")
    assert_cli_error(capsys, ["run", "--io-workers", "100000", "hi"], "io_workers", "256")


# -- c. special files are refused, never waited on -------------------------------------------------

def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("name", ["model-00002-of-00004.safetensors", "config.json", "model.safetensors.index.json",
                                  "tiktoken.model", "tokenizer_config.json", "generation_config.json"])
def test_fifo_in_a_checkpoint_is_refused(ckpt, capsys, name):
    _fifo(ckpt / name)
    assert_cli_error(capsys, ["run", "--model", ckpt, "--max-new-tokens", "1", "hi"], name, "regular file")


@pytest.mark.parametrize("name", ["experts/layer-001.bin", "spine/layer-002.bin", "deltafin-store.json"])
def test_fifo_in_a_store_is_refused_by_run_and_verify(store, capsys, name):
    _fifo(store / name)
    assert_cli_error(capsys, ["run", "--model", store, "--max-new-tokens", "1", "hi"], name, "regular file")
    from deltafin.checkpoint.store import verify
    problems = verify(store)
    assert len(problems) == 1 and name in problems[0] and "regular file" in problems[0], problems
    assert cli(capsys, "verify", store)[0] == 1


# -- d. verify checks every expert: the checksum list must cover them all --------------------------

def test_short_checksum_list_is_refused_and_corruption_found(store, capsys):
    from deltafin.checkpoint.store import verify
    x = store / "experts" / "layer-002.bin"
    span = json.loads(manifest_file(store).read_text())["experts"]["layers"]["2"]["span"]
    data = bytearray(x.read_bytes())
    data[len(data) - span + 10] ^= 0xFF  # corrupt the last expert's first tensor
    x.write_bytes(bytes(data))
    assert any("checksum mismatch" in p for p in verify(store))
    edit_json(manifest_file(store), lambda m: m["experts"]["layers"]["2"]["checksums"].pop())
    problems = verify(store)
    assert len(problems) == 1 and "experts.layers.2.checksums" in problems[0], problems
    assert cli(capsys, "verify", store)[0] == 1


# -- g. malformed data files: one error line naming field and file ---------------------------------

MANIFEST_DAMAGE = {
    "negative offset": (lambda m: m["spines"]["bf16"]["layers"][0]["tensors"]["input_layernorm.weight"]
                        .__setitem__("offset", -64), "layers.0.tensors.input_layernorm.weight.offset"),
    "missing checksum": (lambda m: m["spines"]["bf16"]["globals"]["tensors"]["model.norm.weight"]
                         .pop("checksum"), "model.norm.weight.checksum"),
    "string size": (lambda m: m["files"]["config.json"].__setitem__("nbytes", "4121"), "files.config.json.nbytes"),
    "list for object": (lambda m: m["spines"]["bf16"].__setitem__("globals", []), "spines.bf16.globals"),
    "object for list": (lambda m: m["experts"]["layers"]["1"].__setitem__("checksums", {}), "checksums"),
    "bool for int": (lambda m: m["experts"]["layers"]["1"].__setitem__("span", True), "experts.layers.1.span"),
    "shape mismatch": (lambda m: m["spines"]["bf16"]["globals"]["tensors"]["model.norm.weight"]
                       .__setitem__("shape", [65]), "model.norm.weight"),
    "not json": (None, "not valid JSON"),
    "unknown expert codec": (lambda m: m["experts"].__setitem__("codec", "fp2"), "experts.codec"),
    "expert codecs disagree": (lambda m: m["experts"]["layers"]["1"].__setitem__("codec", "int8"),
                               "experts.layers.1.codec"),
    "expert codec relabelled": (lambda m: [x.__setitem__("codec", "int4") for x in [m["experts"],
                                                                                   *m["experts"]["layers"].values()]],
                                "stored as int4"),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_malformed_manifest_is_one_error_line(store, capsys, damage):
    change, needle = MANIFEST_DAMAGE[damage]
    if change is None:
        manifest_file(store).write_text('{"format": "deltafin-store", ')
    else:
        edit_json(manifest_file(store), change)
    assert_cli_error(capsys, ["inspect", store], "deltafin-store.json", needle)


INDEX_DAMAGE = {
    "list weight_map": (lambda m: m.__setitem__("weight_map", []), "weight_map"),
    "number shard": (lambda m: m["weight_map"].__setitem__("lm_head.weight", 3), "weight_map"),
    "not an object": (lambda m: m.clear() or m.update({"x": 1}), "weight_map"),
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_malformed_index_is_one_error_line(ckpt, capsys, damage):
    change, needle = INDEX_DAMAGE[damage]
    edit_json(ckpt / "model.safetensors.index.json", change)
    assert_cli_error(capsys, ["inspect", ckpt], "model.safetensors.index.json", needle)


def _rewrite_header(shard: Path, change) -> None:
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    new = json.dumps(header).encode()  # data offsets count from the end of the header: they stay valid
    shard.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


@pytest.mark.parametrize("offsets", [["0", "128"], [0.0, 128.0], [0], [128, 0], [-128, 0], None, [True, 128]])
def test_non_integer_data_offsets_are_one_error_line(ckpt, capsys, offsets):
    shard = ckpt / "model-00001-of-00004.safetensors"
    name = next(k for k in json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])
                if k != "__metadata__")
    _rewrite_header(shard, lambda h: h[name].__setitem__("data_offsets", offsets))
    assert_cli_error(capsys, ["inspect", ckpt], shard.name, name)


# -- i. settings and config types ------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_queue_timeout_must_be_finite_and_non_negative(value):
    from deltafin.settings import Settings, SettingsError
    with pytest.raises(SettingsError, match="queue_timeout"):
        Settings.resolve(env={"DELTAFIN_QUEUE_TIMEOUT": value})


@pytest.mark.parametrize("value", ["64", 64.5, 64.0, True, None, [64]])
def test_config_sizes_must_be_integers(ckpt, capsys, value):
    edit_json(ckpt / "config.json", lambda c: c["text_config"].__setitem__("hidden_size", value))
    needle = "is missing" if value is None else "must be an integer"
    assert_cli_error(capsys, ["inspect", ckpt], "hidden_size", str(ckpt / "config.json"), needle)


def test_debug_shows_the_traceback(ckpt, capsys):
    edit_json(ckpt / "config.json", lambda c: c["text_config"].__setitem__("hidden_size", "64"))
    from deltafin.config import ConfigError
    with pytest.raises(ConfigError):
        cli(capsys, "inspect", ckpt, "--debug")


# -- j. one writer per destination -----------------------------------------------------------------

# flock locks belong to an open file description, so a lock taken here through its own descriptor
# excludes the code under test in this same process exactly as another process would.

def test_second_convert_into_one_destination_is_refused(tiny_k3_path, tmp_path, capsys):
    from deltafin.files import writer_lock
    dst = tmp_path / "dst"
    with writer_lock(dst, "a conversion into this folder"):
        line = assert_cli_error(capsys, ["convert", tiny_k3_path, dst], str(dst), f"pid {os.getpid()}")
        assert "already in progress" in line
        assert not dst.exists()  # nothing was written
    rc, _ = cli(capsys, "convert", tiny_k3_path, dst)  # once the holder is gone, the conversion runs
    assert rc == 0 and (dst / "deltafin-store.json").exists()


def test_default_model_maker_waits_for_the_one_making_it(tmp_path, monkeypatch):
    from deltafin.files import writer_lock
    from deltafin.startup import DEFAULT_PRESET, default_model_path
    from deltafin.settings import Settings
    settings = Settings.resolve({"cache_dir": str(tmp_path)})
    target = tmp_path / DEFAULT_PRESET
    got = {}
    # A plain buffer, not capsys: capsys's readouterr() can drop a line another thread writes while it
    # reads, and this loop would then wait for ever.
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with writer_lock(target, "making the default model"):
        t = threading.Thread(target=lambda: got.update(path=default_model_path(settings)), daemon=True)
        t.start()
        for _ in range(6000):  # at most a minute, so a defect fails the test instead of hanging it
            if "waiting for pid" in err.getvalue():
                break
            assert t.is_alive()
            t.join(0.01)  # lets the waiting thread run; returns at once if it ended
        else:
            pytest.fail("a second maker of the default model never said it was waiting")
        target.mkdir()
        (target / "config.json").write_text("{}")  # what the holder made, just before it lets go
    t.join(timeout=60)
    assert got["path"] == target  # used as made, not made again


# -- property-based fuzzing ------------------------------------------------------------------------
# Each fuzzer feeds random (mostly broken) input through a real reader and asserts: the answer is
# either correct or a DeltafinError / APIError (never another exception, so never a traceback),
# nothing under the planted sentinel folder is opened, and Python memory stays bounded. Examples
# are derandomized, so CI runs the same cases every time; together they take well under a minute.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deltafin.errors import DeltafinError  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values that break readers: wrong types, out-of-range and huge numbers, hostile paths.
NASTY_INTS = st.sampled_from([-1, -(1 << 63), 0, 1, 7, 4096, 1 << 31, 1 << 40, 10 ** 15, 1 << 64, 10 ** 30])
NASTY_PATHS = st.sampled_from(["../outside/secret", "/etc/passwd", "..", ".", "", "a/../../outside/secret",
                               "spine/../../outside/secret", "\x00", "experts/layer-001.bin", "config.json"])
SCALARS = st.one_of(st.none(), st.booleans(), NASTY_INTS, st.floats(allow_nan=True), st.text(max_size=8),
                    NASTY_PATHS)
JSON_VALUES = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                           max_leaves=12)


@contextlib.contextmanager
def bounded(outside: Path, limit: int = 64 << 20):
    import tracemalloc
    tracemalloc.start()
    try:
        with AUDIT.forbid(outside):
            yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, peak


def _paths_in(obj, path=()):
    """Every (path, value) of a JSON document, to pick a place to damage."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths_in(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths_in(v, path + (i,))


def _damage(doc, data) -> None:
    """Replace the value at a few random places of `doc` with random JSON."""
    for _ in range(data.draw(st.integers(1, 3))):
        places = [p for p, _ in _paths_in(doc) if p]
        where = data.draw(st.sampled_from(places))
        parent = doc
        for k in where[:-1]:
            parent = parent[k]
        parent[where[-1]] = data.draw(JSON_VALUES)


TENSOR_ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(["BF16", "F32", "U8", "F8_E8M0", "Q4", ""]), SCALARS),
    "shape": st.one_of(st.lists(NASTY_INTS, max_size=3), st.lists(st.integers(0, 8), max_size=3), SCALARS),
    "data_offsets": st.one_of(st.lists(st.integers(-8, 64), min_size=2, max_size=2), st.lists(SCALARS, max_size=3),
                              SCALARS)})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=8), st.one_of(TENSOR_ENTRY, JSON_VALUES), max_size=4),
       declared=st.one_of(st.none(), NASTY_INTS), payload=st.binary(max_size=96))
def test_fuzz_safetensors_headers(tmp_path_factory, header, declared, payload):
    from deltafin.checkpoint.hf import read_safetensors_header
    d = tmp_path_factory.mktemp("st")
    raw = json.dumps(header).encode()
    n = len(raw) if declared is None else declared % (1 << 64)
    f = d / "x.safetensors"
    f.write_bytes(n.to_bytes(8, "little") + raw + payload)
    size = f.stat().st_size
    try:
        infos = read_safetensors_header(f)
    except DeltafinError as e:
        assert str(f) in str(e)
        return
    for info in infos.values():  # a header that is accepted describes bytes the file holds
        assert 8 + n <= info.offset and info.offset + info.nbytes <= size


@FUZZ
@given(data=st.data())
def test_fuzz_index_files(tiny_k3_path, ckpt, outside, data):
    from deltafin.checkpoint.hf import HFCheckpoint
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads((tiny_k3_path / index.name).read_text())  # the pristine index, damaged afresh each time
    if data.draw(st.booleans()):  # point an entry at a hostile path
        name = data.draw(st.sampled_from(sorted(doc["weight_map"])))
        doc["weight_map"][name] = data.draw(NASTY_PATHS)
    else:
        _damage(doc, data)
    index.write_text(json.dumps(doc))
    with bounded(outside):
        try:
            HFCheckpoint(ckpt).close()
        except DeltafinError as e:
            assert SECRET not in str(e)


@FUZZ
@given(data=st.data())
def test_fuzz_store_manifests(store_template, tmp_path_factory, data):
    from deltafin.checkpoint.store import StoreSource, verify
    root = tmp_path_factory.mktemp("fuzzstore")
    store, outside = root / "store", root / "outside"
    outside.mkdir()
    (outside / "secret").write_text(SECRET * 100)
    shutil.copytree(store_template, store)
    doc = json.loads(manifest_file(store).read_text())
    _damage(doc, data)
    manifest_file(store).write_text(json.dumps(doc))
    with bounded(outside):
        try:
            src = StoreSource(store)
        except DeltafinError as e:
            assert SECRET not in str(e)
        else:  # accepted: every tensor it would read lies inside its file
            for i in range(src.config.num_layers):
                for info in src.spine_infos(i).values():
                    assert info.offset + info.nbytes <= os.path.getsize(info.file)
            src.close()
        problems = verify(store)
        assert all(SECRET not in p for p in problems)


REQUEST_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                  "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs", "tools", "echo"]
MESSAGES = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"]),
                                                     "content": st.one_of(st.text(max_size=10), JSON_VALUES)}),
                              JSON_VALUES), max_size=3)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(body=st.dictionaries(st.sampled_from(REQUEST_FIELDS), st.one_of(JSON_VALUES, MESSAGES), max_size=6),
       kind=st.sampled_from(["chat", "completion"]))
def test_fuzz_request_bodies(body, kind):
    from deltafin.serve.protocol import APIError, decode_body, parse_chat, parse_completion
    try:
        req = (parse_chat if kind == "chat" else parse_completion)(decode_body(json.dumps(body).encode()))
    except APIError as e:
        assert e.status == 400 and e.message and (e.param is None or isinstance(e.param, str))
        return
    # accepted: every field is in its range
    assert 0.0 <= req.sampling.temperature <= 2.0 and 0.0 < req.sampling.top_p <= 1.0 and req.sampling.top_k >= 0
    assert req.max_tokens is None or req.max_tokens >= 1
    assert req.sampling.seed is None or -(1 << 63) <= req.sampling.seed < (1 << 64)
    assert all(isinstance(s, str) and s for s in req.sampling.stop) and len(req.sampling.stop) <= 16
    assert (req.messages is not None) == (kind == "chat")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(raw=st.binary(max_size=64))
def test_fuzz_raw_request_bytes(raw):
    from deltafin.serve.protocol import APIError, decode_body
    try:
        assert isinstance(decode_body(raw), dict)
    except APIError as e:
        assert e.status == 400 and e.code == "invalid_json"
