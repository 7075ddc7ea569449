"""deltafin serve: the real server (uvicorn in a thread) driven by the openai client and raw HTTP.

Expected answers come from calling the engine directly (deltafin.runtime.generate.generate) on the same
model, so the server is checked against the engine, not against itself.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import logging
import socket
import threading

import openai
import pytest
import uvicorn

from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.generate import generate
from deltafin.serve.app import create_app
from deltafin.serve.cli import uvicorn_config
from deltafin.serve.protocol import (COMPLETION_DEFAULT_MAX_TOKENS, MAX_BODY_BYTES, parse_chat, parse_completion,
                                    resolve_max_tokens)

# A generation long enough to still be running while a test sends other requests; it is always
# cut short by closing its stream, so its length costs nothing.
LONG = 4000
LONG_PROMPT = "The river ran"  # greedy output of the tiny model runs hundreds of tokens without an EOS


class RunningServer:
    """uvicorn serving an app on 127.0.0.1, on a port picked by the OS, in a background thread, as
    ``deltafin serve`` runs it (``uvicorn_config``: h11 with the header time limit). The socket
    listens before the thread starts, so requests wait in its backlog, never fail."""

    def __init__(self, app):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn_config(app, app.state.service.settings)
        config.log_level = "warning"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=120)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None):
        """(status, body, headers) of one plain HTTP request: a JSON body decoded, any other as text;
        header names in lower case."""
        if isinstance(body, dict):
            body = json.dumps(body)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            got = {k.lower(): v for k, v in resp.getheaders()}
            if not data:
                return resp.status, None, got
            if got.get("content-type", "").startswith("application/json"):
                return resp.status, json.loads(data), got
            return resp.status, data.decode(), got
        finally:
            conn.close()


class LogWatch(logging.Handler):
    """Collects deltafin.serve.app's log lines and lets a test wait for one (no sleeping)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.cond = threading.Condition()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.lines.append(record.getMessage())
            self.cond.notify_all()

    def count(self, needle: str) -> int:
        with self.cond:
            return sum(needle in line for line in self.lines)

    def wait_for(self, needle: str, at_least: int = 1) -> list[str]:
        with self.cond:
            assert self.cond.wait_for(lambda: self.count(needle) >= at_least, timeout=120), self.lines
            return [line for line in self.lines if needle in line]


@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


@pytest.fixture(scope="module")
def server(model):
    with RunningServer(create_app(model)) as srv:
        yield srv


@pytest.fixture
def logs():
    logger = logging.getLogger("deltafin.serve.app")
    watch, level = LogWatch(), logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.INFO)
    yield watch
    logger.removeHandler(watch)
    logger.setLevel(level)


def _ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]


def _start_long_stream(srv: RunningServer, model):
    """A streaming completion that is generating when this returns (its first chunk arrived)."""
    stream = srv.client().completions.create(model=model.name, prompt=LONG_PROMPT, max_tokens=LONG, temperature=0,
                                             stream=True)
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    return stream


# -- the happy paths, checked against the engine ----------------------------------------------

def test_models_and_health(server, model):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [model.name]
    assert c.models.retrieve(model.name).id == model.name
    status, body, _ = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == model.name


def test_chat_matches_engine_and_tokenizer(server, model):
    messages = _ask("What is the capital of France?")
    r = server.client().chat.completions.create(model=model.name, messages=messages, max_tokens=6, temperature=0,
                                                user="someone", metadata={"k": "v"})  # harmless extras
    ids = model.encode_chat(messages)
    tok = model.tokenizer
    assert ids == tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)
    want = generate(model, ids, SamplingParams(max_new_tokens=6))
    assert want.tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model.name
    assert r.created > 0 and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.tokens))
    assert r.usage.total_tokens == len(ids) + len(want.tokens)


def test_chat_stream_with_usage(server, model):
    messages = _ask("How many days are there in a week?")
    chunks = list(server.client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    ids = model.encode_chat(messages)
    want = generate(model, ids, SamplingParams(max_new_tokens=5))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + [want.finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), len(want.tokens))


def test_completions_plain_and_streamed(server, model):
    c = server.client()
    prompt = "The river ran slowly past the old mill"
    ids = model.encode(prompt)
    assert ids == model.tokenizer.encode(prompt, add_special_tokens=False)
    want = generate(model, ids, SamplingParams(max_new_tokens=6))
    r = c.completions.create(model=model.name, prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want.tokens), len(ids) + len(want.tokens))

    whole = want
    want = generate(model, ids, SamplingParams(max_new_tokens=4))
    chunks = list(c.completions.create(model=model.name, prompt=prompt, max_tokens=4, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    assert all(ch.usage is None for ch in chunks)  # usage only when stream_options asks for it

    # a prompt given as token ids is the same prompt
    r = c.completions.create(model=model.name, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == whole.text


def test_stop_strings_plain_and_streamed(server, model):
    prompt = "Question: What is the capital of France?\nAnswer:"
    ids = model.encode(prompt)
    text = generate(model, ids, SamplingParams(max_new_tokens=12)).text
    # a stop string of plain letters that first occurs inside the output, not at its start
    at = next((i for i in range(2, len(text) - 2)
               if text[i:i + 2].isascii() and text[i:i + 2].isalpha() and text.find(text[i:i + 2]) == i), None)
    assert at is not None, text
    stop = [text[at:at + 2], "never-in-the-output"]
    c = server.client()
    r = c.completions.create(model=model.name, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:at], "stop")
    chunks = list(c.completions.create(model=model.name, prompt=prompt, max_tokens=13, temperature=0, stop=stop[0],
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_is_clamped_to_the_cap(model):
    app = create_app(model, settings=dataclasses.replace(model.settings, max_tokens_cap=3))
    messages = _ask("Tell me a long story.")
    ids = model.encode_chat(messages)
    want = generate(model, ids, SamplingParams(max_new_tokens=3))
    with RunningServer(app) as srv:
        c = srv.client()
        for extra in ({}, {"max_tokens": 50}, {"max_completion_tokens": 50}):  # omitted: chat runs to EOS, capped
            r = c.chat.completions.create(model=model.name, messages=messages, temperature=0, **extra)
            assert r.choices[0].message.content == want.text
            assert r.usage.completion_tokens == len(want.tokens) <= 3


def test_max_tokens_resolution():
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    plain = parse_completion({"prompt": "hi"})
    assert resolve_max_tokens(chat, 10, context=100, cap=0) == 90  # to EOS, bounded by the context
    assert resolve_max_tokens(chat, 10, context=100, cap=50) == 50
    assert resolve_max_tokens(plain, 10, context=10_000, cap=0) == COMPLETION_DEFAULT_MAX_TOKENS
    assert resolve_max_tokens(parse_completion({"prompt": "hi", "max_tokens": 80}), 10, context=50, cap=0) == 40


def test_memo_answers_repeated_deterministic_requests(server, model, logs):
    c = server.client()
    ask = dict(model=model.name, prompt="Memory is faster than disk, and", max_tokens=4)
    first = c.completions.create(temperature=0, **ask)
    hits = logs.count("memo hit")
    again = c.completions.create(temperature=0, seed=5, top_p=0.5, **ask)  # greedy ignores seed and top_p
    assert logs.count("memo hit") == hits + 1
    assert again.choices[0].text == first.choices[0].text and again.usage == first.usage
    assert again.id != first.id
    streamed = list(c.completions.create(temperature=0, stream=True, **ask))  # replayed as a stream
    assert logs.count("memo hit") == hits + 2
    assert "".join(ch.choices[0].text for ch in streamed) == first.choices[0].text
    assert streamed[-1].choices[0].finish_reason == first.choices[0].finish_reason

    seeded = [c.completions.create(temperature=0.9, seed=123, **ask) for _ in range(2)]
    assert logs.count("memo hit") == hits + 3
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    for _ in range(2):  # sampling without a seed is never remembered
        c.completions.create(temperature=0.9, **{**ask, "max_tokens": 1})
    assert logs.count("memo hit") == hits + 3


# -- at most max_batch generations at a time -------------------------------------------------

@pytest.mark.parametrize("max_batch", [1, 2])
def test_request_beyond_max_batch_waits(model, logs, max_batch):
    messages = _ask("Is this request waiting?")
    want = generate(model, model.encode_chat(messages), SamplingParams(max_new_tokens=3)).text  # the engine serves one thread at a time
    settings = dataclasses.replace(model.settings, max_batch=max_batch)
    with RunningServer(create_app(model, settings=settings)) as srv:
        longs = [_start_long_stream(srv, model) for _ in range(max_batch)]
        result = {}
        waiter = threading.Thread(target=lambda: result.update(r=srv.client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=3, temperature=0)))
        waiter.start()
        while srv.request("GET", "/health")[1]["waiting"] < 1:  # returns once the request is queued
            assert waiter.is_alive()
        assert "r" not in result and srv.request("GET", "/health")[1]["running"] == max_batch
        longs[0].close()  # the client leaves; its generation stops and the waiting request runs
        waiter.join()
        assert result["r"].choices[0].message.content == want
        logs.wait_for("generation cancelled")
        for stream in longs[1:]:
            stream.close()


@pytest.mark.parametrize("queue_size,queue_timeout,code", [(0, 60.0, "queue_full"), (1, 0.0, "queue_timeout")])
def test_busy_engine_answers_429(model, logs, queue_size, queue_timeout, code):
    settings = dataclasses.replace(model.settings, queue_size=queue_size, queue_timeout=queue_timeout, max_batch=1)
    with RunningServer(create_app(model, settings=settings)) as srv:
        long = _start_long_stream(srv, model)
        with pytest.raises(openai.RateLimitError) as info:
            srv.client().completions.create(model=model.name, prompt="hello", max_tokens=2, temperature=0)
        assert info.value.status_code == 429
        assert info.value.body["code"] == code and info.value.body["type"] == "rate_limit_error"
        long.close()
        logs.wait_for("generation cancelled")  # logged after the engine was handed back
        r = srv.client().completions.create(model=model.name, prompt="hello", max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_client_disconnect_stops_generation(server, model, logs):
    stream = _start_long_stream(server, model)
    next(iter(stream))
    stream.close()
    line = logs.wait_for("generation cancelled")[-1]
    assert int(line.split(" after ")[1].split()[0]) < LONG
    status, health, _ = server.request("GET", "/health")
    assert status == 200 and not health["busy"] and health["waiting"] == 0
    r = server.client().chat.completions.create(model=model.name, messages=_ask("Still there?"), max_tokens=2,
                                                temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


# -- errors -----------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("path,body,param,code", [
    (CHAT, "{not json", None, "invalid_json"),
    (CHAT, "[1, 2]", None, "invalid_json"),
    (CHAT, "", None, "invalid_json"),
    (CHAT, {}, "messages", "missing_required_parameter"),
    (CHAT, {"messages": "hi"}, "messages", "invalid_type"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "invalid_value"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature", "invalid_type"),
    (CHAT, {"messages": MSG, "temperature": 7}, "temperature", "invalid_value"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p", "invalid_value"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSG, "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    (CHAT, {"messages": MSG, "seed": "x"}, "seed", "invalid_type"),
    (CHAT, {"messages": MSG, "stream": "yes"}, "stream", "invalid_type"),
    (CHAT, {"messages": MSG, "stop": [1]}, "stop", "invalid_type"),
    (CHAT, {"messages": MSG, "model": 3}, "model", "invalid_type"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    (CHAT, {"messages": MSG, "n": 0}, "n", "invalid_value"),
    (CHAT, {"messages": MSG, "n": 17}, "n", "invalid_value"),
    (CHAT, {"messages": MSG, "logprobs": "yes"}, "logprobs", "invalid_type"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name",
     "invalid_value"),
    (CHAT, {"messages": MSG, "tools": {"type": "function"}}, "tools", "invalid_type"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice", "invalid_value"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    (CHAT, {"messages": MSG, "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    (CHAT, {"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    (CHAT, {"messages": [{"role": "function", "content": "1", "name": "f"}]}, "messages[0]", "unsupported_parameter"),
    (COMPLETIONS, {}, "prompt", "missing_required_parameter"),
    (COMPLETIONS, {"prompt": 5}, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
])
def test_bad_requests_answer_400(server, path, body, param, code):
    status, got, _ = server.request("POST", path, body)
    assert status == 400, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    assert (got["error"]["param"], got["error"]["code"]) == (param, code)


def test_unsupported_parameter_reaches_the_openai_client(server, model):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=model.name, messages=MSG, logit_bias={"1": 5})
    assert "logit_bias is not supported" in info.value.message and info.value.body["param"] == "logit_bias"


def test_prompt_longer_than_the_context_is_a_400(server, model):
    context = model.config.max_position_embeddings
    status, got, _ = server.request("POST", COMPLETIONS, {"prompt": [1] * context, "max_tokens": 1})
    assert status == 400 and got["error"]["param"] == "prompt"
    assert got["error"]["code"] == "context_length_exceeded" and str(context) in got["error"]["message"]
    words = " ".join(["river"] * context)
    status, got, _ = server.request("POST", CHAT, {"messages": [{"role": "user", "content": words}]})
    assert status == 400 and got["error"]["param"] == "messages"


def test_model_names(server, model):
    status, got, _ = server.request("POST", CHAT, {"model": "gpt-4o", "messages": MSG})
    assert (status, got["error"]["param"], got["error"]["code"]) == (404, "model", "model_not_found")
    assert server.request("GET", "/v1/models/gpt-4o")[0] == 404
    status, got, _ = server.request("POST", CHAT, {"messages": MSG, "max_tokens": 2})  # no model: the served one
    assert status == 200 and got["model"] == model.name


def test_routes_and_methods(server):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/nothing"), ("GET", "/")):
        status, got, _ = server.request(method, path)
        assert (status, got["error"]["code"]) == (404, "unknown_url")
    status, got, headers = server.request("GET", CHAT)
    assert (status, got["error"]["code"]) == (405, "method_not_allowed") and "POST" in headers["allow"]
    assert server.request("DELETE", "/health")[0] == 405


def _raw_exchange(port: int, head: bytes, body_part: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + body_part)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())


def test_body_too_large_is_a_413(server):
    # Declared too large: refused from the headers alone, without waiting for the body.
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n").encode()
    status, got = _raw_exchange(server.port, head, b'{"messages": ')
    assert (status, got["error"]["code"]) == (413, "request_too_large")
    # Chunked, so only counting the bytes can tell.
    big = b'{"messages": [], "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    status, got = _raw_exchange(server.port, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    assert (status, got["error"]["code"]) == (413, "request_too_large")
    assert server.request("GET", "/health")[0] == 200


def test_model_without_tokenizer_explains_itself(model):
    import copy
    bare = copy.copy(model)
    bare.tokenizer = None
    with RunningServer(create_app(bare)) as srv:
        status, got, _ = srv.request("POST", CHAT, {"messages": MSG})
        assert status == 500 and got["error"]["code"] == "no_tokenizer" and "tokenizer" in got["error"]["message"]


# -- the prefix cache -----------------------------------------------------------------------------

def _conversation(srv: RunningServer, model, turns: int, stream: bool = False) -> tuple[list[str], list]:
    """A chat resent in full every turn, as OpenAI clients do: (answers, usages)."""
    client, messages, answers, usages = srv.client(), [{"role": "system", "content": "Answer briefly."}], [], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what comes next?"})
        if stream:
            chunks = list(client.chat.completions.create(model=model.name, messages=messages, max_tokens=6,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            r = client.chat.completions.create(model=model.name, messages=messages, max_tokens=6, temperature=0)
            text, usage = r.choices[0].message.content, r.usage
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
        usages.append(usage)
    return answers, usages


@pytest.mark.parametrize("stream", [False, True])
def test_prefix_cache_reuses_the_conversation_and_changes_no_text(model, stream):
    plain = dataclasses.replace(model.settings, memo_size=0, prefix_cache_mb=0)
    with RunningServer(create_app(model, plain)) as srv:
        want, usages = _conversation(srv, model, 5, stream)
    assert all(u.prompt_tokens_details.cached_tokens == 0 for u in usages)
    cached = dataclasses.replace(plain, prefix_cache_mb=64)
    app = create_app(model, cached)
    with RunningServer(app) as srv:
        got, usages = _conversation(srv, model, 5, stream)
        health = srv.request("GET", "/health")[1]["prefix_cache"]
    assert got == want
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, u in zip(usages, usages[1:]):
        # at least the whole previous prompt was reused, never the whole new one
        assert before.prompt_tokens <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens
    assert health["hits"] == 4 and health["misses"] == 1 and health["entries"] >= 2
    assert health["cached_tokens"] == sum(u.prompt_tokens_details.cached_tokens for u in usages)


def test_prefix_cache_stays_within_its_budget(model):
    settings = dataclasses.replace(model.settings, memo_size=0, prefix_cache_mb=1)
    with RunningServer(create_app(model, settings)) as srv:
        want, _ = _conversation(srv, model, 4)
    app = create_app(model, settings)
    state = model.new_state()
    model.forward([5] * 60, state)
    cache = app.state.service.prefix_cache
    cache.budget_bytes = 3 * state.nbytes()  # the tiny model's states are far below a MiB: room for ~3
    with RunningServer(app) as srv:
        got, usages = _conversation(srv, model, 4)
        stats = srv.request("GET", "/health")[1]["prefix_cache"]
    assert got == want
    assert stats["evictions"] > 0 and stats["bytes"] <= cache.budget_bytes
    assert usages[-1].prompt_tokens_details.cached_tokens > 0  # the latest states survived


def test_server_prompt_cache_is_restored_or_refused(model, tiny_kl_path, tmp_path):
    import deltafin
    from deltafin.chat import fixed_prefix
    from deltafin.model.state import StateFileError
    from deltafin.runtime.saved_state import restore_or_build
    system = [{"role": "system", "content": "Answer briefly."}]
    prefix = fixed_prefix(model, system)
    path = tmp_path / "sys.state"
    restore_or_build(model, path, prefix, lambda m: None)
    settings = dataclasses.replace(model.settings, memo_size=0, prefix_cache_mb=0, prompt_cache=str(path))
    with RunningServer(create_app(model, settings)) as srv:
        _, usages = _conversation(srv, model, 2)
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [len(prefix), len(prefix)]
    other = deltafin.load(tiny_kl_path, device="cpu", stream="off", threads=1)
    with pytest.raises(StateFileError, match="cannot be reused here"):
        create_app(other, dataclasses.replace(other.settings, prompt_cache=str(path)))
    with pytest.raises(StateFileError, match="no such state file"):
        create_app(model, dataclasses.replace(settings, prompt_cache=str(tmp_path / "missing")))


def _metrics(srv) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def test_long_prompts_leave_block_states_for_prompts_that_share_a_beginning(model):
    settings = dataclasses.replace(model.settings, memo_size=0, prefix_cache_mb=64, prefill_chunk=8,
                                   prefix_cache_block=16)
    base = [7 + (i * 13) % 200 for i in range(40)]
    with RunningServer(create_app(model, settings)) as srv:
        client = srv.client()

        def complete(prompt):
            return client.completions.create(model=model.name, prompt=prompt, max_tokens=3, temperature=0)

        first = complete(base + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 50 tokens, fed 8 at a time
        # kept: after 16, 32 and 48 tokens (the pieces crossing each block) and after all 50
        second = complete(base + [11, 12])
        metrics = _metrics(srv)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.choices[0].text == generate(model, base + [11, 12], SamplingParams(max_new_tokens=3)).text
    for line in ('deltafin_prefix_cache_lookups_total{result="hit"} 1',
                 'deltafin_prefix_cache_lookups_total{result="miss"} 1', "deltafin_prefix_cache_tokens_total 32",
                 "deltafin_prefix_cache_entries 7"):  # 16, 32, 48, 50, 52 (its end); 42, 44
        assert line in metrics


def test_metrics_count_recorded_passes_and_states_moved_into_their_slots(tiny_k3_path, server):
    """A server whose passes run in state slots (recorded passes; on the CPU their code runs eagerly) shows
    the passes replayed by kind and the states copied into the slots; one without them shows neither."""
    import deltafin
    from deltafin.runtime.decode_graph import DecodeGraphs
    m = deltafin.load(tiny_k3_path, device="cpu", stream="off", threads=1)
    m.engine.graphs = DecodeGraphs(m.engine, record=False)
    settings = dataclasses.replace(m.settings, memo_size=0, prefix_cache_mb=0)
    with RunningServer(create_app(m, settings)) as srv:
        client = srv.client()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: client.completions.create(model=m.name, prompt=p, max_tokens=4, temperature=0),
                          [[5, 6, 7], [8, 9, 10, 11, 12]]))
        text = _metrics(srv)
    assert 'deltafin_passes_replayed_total{kind="decode"} 0' in text  # eager here: nothing recorded
    moved = next(line for line in text.splitlines() if line.startswith("deltafin_pass_states_moved_total "))
    assert int(float(moved.split()[1])) >= 2  # each sequence into a slot at least once
    assert "deltafin_pass_states_moved_total" not in _metrics(server)


def test_metrics_split_a_streamed_requests_first_token_by_phase(model):
    """Each streamed request's way to its first text is counted by phase (reading its body, rendering,
    waiting for a slot, the engine, writing it); the phases add up to no more than the client waited.
    A request answered in one body is not counted."""
    import time
    settings = dataclasses.replace(model.settings, memo_size=0, prefix_cache_mb=0)
    with RunningServer(create_app(model, settings)) as srv:
        client = srv.client()
        client.completions.create(model=model.name, prompt=[5, 6, 7], max_tokens=2, temperature=0)
        t0 = time.perf_counter()
        stream = client.completions.create(model=model.name, prompt=[8, 9, 10], max_tokens=3, temperature=0,
                                           stream=True)
        next(c for c in stream if c.choices and c.choices[0].text)
        waited = time.perf_counter() - t0
        list(stream)
        text = _metrics(srv)
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("deltafin_first_token")}
    assert values["deltafin_first_tokens_total"] == 1
    phases = {k.split('"')[1]: v for k, v in values.items() if "phase=" in k}
    assert set(phases) == {"read", "prepare", "queue", "engine", "send"} and min(phases.values()) >= 0
    assert 0 < sum(phases.values()) <= waited and phases["engine"] > 0
    # both requests reached a first pass, each after a wait counted apart (part of the engine's phase)
    started = next(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("deltafin_requests_started_total "))
    wait = next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("deltafin_request_wait_seconds_total "))
    assert started == 2 and 0 < wait


def test_prefix_cache_settings_are_range_checked():
    from deltafin.settings import Settings, SettingsError
    for name in ("prefix_cache_mb", "prefix_cache_block"):
        with pytest.raises(SettingsError, match=name):
            Settings.resolve({name: -1})


def test_handoff_deferred_wakes_each_loop_once_when_the_hand_out_ends():
    """Inside ``deferred()`` (the engine thread handing out a pass) no put wakes a loop; at its end each
    loop with items is woken once and gets them in order; puts from another thread meanwhile wait for
    that wake-up; a loop closed meanwhile loses its items without an error."""
    import asyncio

    from deltafin.serve.handoff import Handoff
    handoff = Handoff()
    loops = [asyncio.new_event_loop() for _ in range(3)]
    wakeups = []
    for k, loop in enumerate(loops):
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, k=k, real=real: (real(*a), wakeups.append(k))[0]  # if it took it
    try:
        queues = [asyncio.Queue() for _ in loops]
        with handoff.deferred():
            for i in range(12):
                handoff.put(loops[i % 2], queues[i % 2], i)
            other = threading.Thread(target=lambda: handoff.put(loops[0], queues[0], "other"))
            other.start()
            other.join()
            handoff.put(loops[2], queues[2], "lost")
            loops[2].close()
            assert wakeups == []
        assert sorted(wakeups) == [0, 1]  # the closed loop's wake-up was refused, quietly
        for loop in loops[:2]:
            loop.run_until_complete(asyncio.sleep(0))
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues[:2]]
        assert got == [[0, 2, 4, 6, 8, 10, "other"], [1, 3, 5, 7, 9, 11]]
        assert not handoff._pending
        handoff.put(loops[0], queues[0], "after")  # outside the block: at once
        assert wakeups[-1] == 0
    finally:
        for loop in loops:
            loop.close()


def test_handoff_wakes_the_loop_once_for_a_burst_and_keeps_each_queues_order():
    """The engine thread's pieces reach each request's queue in order; a burst of them put while the
    loop is busy wakes it once, not once per piece (tokens of 8 streams a pass: one wake-up)."""
    import asyncio

    from deltafin.serve.handoff import Handoff
    handoff, loop = Handoff(), asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe

    def counted(*args):
        wakeups.append(args)
        return real(*args)
    loop.call_soon_threadsafe = counted
    try:
        queues = [asyncio.Queue() for _ in range(3)]
        burst = threading.Thread(target=lambda: [handoff.put(loop, queues[i % 3], i) for i in range(30)])
        burst.start()
        burst.join()  # the loop is not running: everything waits behind the first wake-up
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [list(range(k, 30, 3)) for k in range(3)]
        handoff.put(loop, queues[0], "next")  # delivered: the next put wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakeups) == 2 and queues[0].get_nowait() == "next"
    finally:
        loop.close()
    with pytest.raises(RuntimeError):  # a closed loop: refused, and nothing is left pending for it
        handoff.put(loop, queues[0], "late")
    assert not handoff._pending
