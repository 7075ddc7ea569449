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
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import uvicorn

import deltafin
from deltafin.generate import generate
from deltafin.serve import create_app, uvicorn_config

REPO = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


# -- helpers --------------------------------------------------------------------------------------

class Server:
    """The app under uvicorn as ``deltafin serve`` runs it (h11 with the header time limit)."""

    def __init__(self, app, settings):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn_config(app, settings)
        config.log_level = "warning"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            try:
                parsed = json.loads(data) if data else None
            except ValueError:
                parsed = data.decode()
            return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()


@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


def serving(model, **settings):
    s = dataclasses.replace(model.settings, **settings)
    return Server(create_app(model, settings=s), s)


def deltafin_cli(*args, cwd=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltafin", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def assert_one_error_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, one 'deltafin: error:' line naming every needle, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("deltafin: error:")]
    assert len(lines) == 1, r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


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
    greedy = generate(model, ids, 6).tokens
    for t in (1e-300, 1e-30, 1e-9):
        assert generate(model, ids, 6, temperature=t, seed=1, top_p=0.9, top_k=5).tokens == greedy
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            generate(model, ids, 2, temperature=bad)
    with pytest.raises(ValueError, match="seed"):
        generate(model, ids, 2, temperature=0.5, seed=1 << 64)


def test_server_ranges_name_the_parameter(model):
    with serving(model) as srv:
        r = srv.request("POST", COMPLETIONS, {"prompt": "The river ran", "max_tokens": 4, "temperature": 1e-300})
        assert r[0] == 200
        assert r[1]["choices"][0]["text"] == generate(model, model.encode("The river ran"), 4).text
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
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
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
        assert srv.request("GET", "/health")[0] == 200


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


def test_head_health_and_bind_errors(model):
    with serving(model) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("HEAD", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b""
        conn.close()
        # the port is checked before the model is loaded, so a missing model is not what is reported
        for port, needles in ((srv.port, ("in use", str(srv.port))), (70000, ("'port'", "65535"))):
            r = deltafin_cli("serve", "--model", "/nonexistent", "--port", port)
            assert_one_error_line(r, *needles)
