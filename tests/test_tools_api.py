"""Agents against `deltafin serve`: tool calls, structured output, reasoning, logprobs and n, in the Kimi
formats through the OpenAI API, driven by real clients (the openai SDK, openai-agents, langchain-openai).

The model is the tiny synthetic K3 (random weights): whatever it calls, only the grammar makes the calls
valid, so every call is checked against its tool's schema (jsonschema). The reader of the Kimi format
(runtime.tool_calls) and the chat template's agent parts are checked on their own first.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import json
import random
from types import SimpleNamespace
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from hypothesis import given, settings, strategies as st

from deltafin.chat import Conversation, command, repl
from deltafin.runtime.tool_calls import (ARGS_BEGIN, CALL_BEGIN, CALL_END, MARKERS, SECTION_BEGIN, SECTION_END,
                                         ToolCallStream, number_calls, parse)
from deltafin.serve.app import create_app
from deltafin.serve.protocol import Shaper
from test_serve import RunningServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 6},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["query", "limit"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


def call(header: str, args: str) -> str:
    return CALL_BEGIN + header + ARGS_BEGIN + args + CALL_END


def assert_valid(calls, tools=SCHEMAS) -> None:
    """Every call names one of the tools and its arguments satisfy that tool's schema."""
    for c in calls:
        fn = c["function"] if isinstance(c, dict) else c.function
        name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
        assert name in tools, name
        jsonschema.validate(json.loads(args), tools[name])


# -- the reader of the Kimi format ---------------------------------------------------------------

def test_parse_reads_reasoning_content_and_calls():
    text = ("<think>Paris, so get_weather.</think>Let me look." +
            section(call("functions.get_weather:0", ' {"city": "Paris", "unit": "c"} '),
                    call("functions.search:7", '{"query": "x", "limit": 2}')))
    got = parse(text, first_index=3)
    assert got.reasoning == "Paris, so get_weather." and got.content == "Let me look." and not got.malformed
    # ids are renumbered from the conversation's count, whatever index the model wrote
    assert [(c.id, c.name, c.arguments_json) for c in got.calls] == [
        ("functions.get_weather:3", "get_weather", '{"city": "Paris", "unit": "c"}'),
        ("functions.search:4", "search", '{"query": "x", "limit": 2}')]
    assert got.calls[0].openai() == {"id": "functions.get_weather:3", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    plain = parse("no tools here")
    assert (plain.content, plain.reasoning, plain.calls) == ("no tools here", None, [])


def test_malformed_sections_come_back_as_content():
    cut = section(call("functions.get_weather:0", '{"city": "Paris"}'))[:-len(CALL_END + SECTION_END) - 3]
    for text, content in [
        (section(call("functions.get_weather:0", '{"city": ')), 'functions.get_weather:0{"city": '),  # not JSON
        (section(call("functions.f:0", "[1, 2]")), "functions.f:0[1, 2]"),  # JSON, but not an object
        (section(call("no such header!", "{}")), "no such header!{}"),
        (section(CALL_BEGIN + "functions.f:0{}" + CALL_END), "functions.f:0{}"),  # no argument marker
        (cut, 'functions.get_weather:0{"city": "Pari'),  # cut off (max_tokens)
        (SECTION_BEGIN + "stray words", "stray words"),
    ]:
        got = parse("A " + text)
        assert (got.content, got.calls) == ("A " + content, []), text
        assert got.malformed and not any(m in got.content for m in MARKERS)
    # a good call beside a bad one is kept
    got = parse(section(call("functions.f:0", "{}"), call("functions.g:1", "{")))
    assert [c.name for c in got.calls] == ["f"] and got.content == "functions.g:1{"
    # tool_choice "none": a section is not read, and its markers are not shown
    assert parse(section(call("functions.f:0", "{}")), calls=False).content == "functions.f:0{}"


TEXT = st.lists(st.one_of(st.sampled_from(MARKERS + ("functions.f:0", "get_weather", '{"a": 1}', "{", "}", " ")),
                          st.text(max_size=6)), max_size=14).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_the_stream_reads_any_text_as_parse_does(text, cuts):
    """Never raises; content never shows a marker; deltas, whatever the pieces, assemble to parse()'s reading."""
    whole = parse(text, first_index=2)
    assert not any(m in whole.content for m in MARKERS)
    stream, deltas, at = ToolCallStream(2), [], 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert content == whole.content and reasoning == (whole.reasoning or "")
    assert [(c["index"], c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(i, c.id, c.name, c.arguments_json) for i, c in enumerate(whole.calls)]
    for c in whole.calls:
        assert isinstance(json.loads(c.arguments_json), dict)


def test_number_calls_renames_ids_and_follows_them_into_tool_messages():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "2"},
        {"role": "tool", "tool_call_id": "call_a", "content": "1"},
        {"role": "assistant", "content": "", "tool_calls": [  # a client that reuses its ids
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "3"},
        {"role": "tool", "tool_call_id": "unknown", "content": "4"},
    ]
    out, count = number_calls(messages)
    assert count == 3
    assert [c["id"] for c in out[1]["tool_calls"]] == ["functions.f:0", "functions.g:1"]
    assert [m.get("tool_call_id") for m in out[2:4]] == ["functions.g:1", "functions.f:0"]
    assert out[4]["tool_calls"][0]["id"] == "functions.f:2" and out[5]["tool_call_id"] == "functions.f:2"
    assert out[6]["tool_call_id"] == "unknown" and messages[1]["tool_calls"][0]["id"] == "call_a"  # input unchanged


# -- the chat template's agent parts -------------------------------------------------------------

def test_template_renders_tools_calls_results_and_recent_reasoning(tiny_k3_model):
    tok = tiny_k3_model.tokenizer
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "in Paris"},
        {"role": "assistant", "content": None, "reasoning_content": "use the tool",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
                        {"type": "function", "function": {"name": "search", "arguments": {"query": "x", "limit": 1}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    text = tok.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    head = "<|im_system|>tool_declare<|im_middle|>"
    assert text.startswith(head) and json.loads(text[len(head):text.index("<|im_end|>")]) == [WEATHER]
    assert text[text.index("<|im_end|>") + len("<|im_end|>"):] == (
        "<|im_user|>user<|im_middle|>weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Sure.<|im_end|>"  # a finished turn's reasoning is not shown again
        "<|im_user|>user<|im_middle|>in Paris<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>use the tool</think>" +
        section(call("functions.get_weather:0", '{"city": "Paris", "unit": "c"}'),
                call("functions.search:1", '{"query": "x", "limit": 1}')) +  # an id made up where there was none
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    for marker in MARKERS:  # each one special token
        assert tok.encode(marker) == [tok.special_tokens[marker]]


# -- shaping answers (protocol.Shaper) ------------------------------------------------------------

def describe(token_id: int) -> tuple[str, bytes]:
    return f"t{token_id}", f"t{token_id}".encode()


THOUGHT = ["<think>", "I should ", "call.", "</think>", "Calling", SECTION_BEGIN, CALL_BEGIN, "functions.f:0",
           ARGS_BEGIN, '{"a": ', "1}", CALL_END, SECTION_END]


def test_shaper_answers_reasoning_and_calls_alike_streamed_and_not():
    pieces = [(t, (i, -0.5, [(i, -0.5), (99, -float("inf"))])) for i, t in enumerate(THOUGHT)]
    whole = Shaper("chat", "m", calls=True, first_index=4, describe=describe).response([(pieces, "stop")], 10,
                                                                                      len(pieces))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Calling", "reasoning_content": "I should call.",
                                 "tool_calls": [{"id": "functions.f:4", "type": "function",
                                                 "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    first = choice["logprobs"]["content"][0]
    assert first == {"token": "t0", "logprob": -0.5, "bytes": list(b"t0"),
                     "top_logprobs": [{"token": "t0", "logprob": -0.5, "bytes": list(b"t0")},
                                      {"token": "t99", "logprob": -9999.0, "bytes": list(b"t99")}]}
    shaper = Shaper("chat", "m", calls=True, first_index=4, describe=describe)
    chunks = shaper.opening_chunks()
    for p in pieces:
        chunks += shaper.piece_chunks(0, [p])
    chunks += shaper.final_chunks(0, "stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call."
    assert "".join(d.get("content", "") for d in deltas) == "Calling"
    called = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert called == [{"index": 0, **choice["message"]["tool_calls"][0]}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"][0]["logprobs"]) == \
        len(pieces)  # every token's logprobs, held-back text or not
    # cut off inside the call: content, and "length"
    cut = Shaper("chat", "m", calls=True).response([([(t, None) for t in THOUGHT[:-3]], "length")], 1, 1)
    assert cut["choices"][0]["finish_reason"] == "length" and "tool_calls" not in cut["choices"][0]["message"]
    assert cut["choices"][0]["message"]["content"] == 'Callingfunctions.f:0{"a": '


def test_shaper_completions_logprobs_and_choices():
    pieces = [("ab", (1, -0.1, [(1, -0.1), (2, -2.0)])), ("", (3, -0.2, [])), ("c", (4, -0.3, []))]
    body = Shaper("completion", "m", choices=2, describe=describe).response([(pieces, "length"), ([], "stop")], 3, 3)
    a, b = body["choices"]
    assert (a["index"], a["text"], b["index"], b["text"], b["logprobs"]) == (0, "abc", 1, "", None)
    assert a["logprobs"] == {"tokens": ["t1", "t3", "t4"], "token_logprobs": [-0.1, -0.2, -0.3],
                             "top_logprobs": [{"t1": -0.1, "t2": -2.0}, {}, {}], "text_offset": [0, 2, 2]}
    shaper = Shaper("completion", "m", describe=describe)
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for p in pieces for c in shaper.piece_chunks(0, [p])]
    assert offsets == [[0], [2], [2]]


# -- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


@pytest.fixture(scope="module")
def server(model):
    with RunningServer(create_app(model, dataclasses.replace(model.settings, max_batch=16))) as srv:
        yield srv


def chat(server, model, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 120)
    return server.client().chat.completions.create(model=model.name, **kw)


def test_required_tool_call_streamed_and_not(server, model):
    # random weights make a call about 60 tokens long (the grammar allows some whitespace between JSON tokens)
    want = chat(server, model, tools=TOOLS, tool_choice="required", temperature=0.8, seed=11, max_tokens=400)
    got = want.choices[0]
    assert got.finish_reason == "tool_calls" and got.message.tool_calls and got.message.content is None
    assert_valid(got.message.tool_calls)
    assert [c.id for c in got.message.tool_calls] == [f"functions.{c.function.name}:{i}"
                                                       for i, c in enumerate(got.message.tool_calls)]
    for seed in (11, 12):  # 11: the same answer again (from the memo, streamed); 12: a fresh one
        chunks = list(chat(server, model, tools=TOOLS, tool_choice="required", temperature=0.8, seed=seed,
                           max_tokens=400, stream=True))
        assembled: dict[int, dict] = {}
        for ch in chunks:
            for d in ch.choices[0].delta.tool_calls or ():
                slot = assembled.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += d.id or ""
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = [{"function": c} for c in assembled.values()]
        assert calls and sorted(assembled) == list(range(len(assembled)))
        assert_valid(calls)
        if seed == 11:
            assert [(c["id"], c["name"], c["arguments"]) for c in assembled.values()] == \
                [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls]


def test_named_function_and_one_call_only(server, model):
    for seed in range(4):
        r = chat(server, model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
                 parallel_tool_calls=False, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "search"
        assert_valid(calls)


def test_tool_choice_none_and_auto_answer_in_text(server, model):
    for choice in ("none", "auto"):
        r = chat(server, model, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert_valid(r.choices[0].message.tool_calls or ())
        assert not any(m in (r.choices[0].message.content or "") for m in MARKERS)


def test_history_with_client_ids_is_numbered_as_kimi_numbers_it(server, model):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_x1", "content": "sunny, 21 C"}]
    r = chat(server, model, messages=history, tools=TOOLS, tool_choice="required", temperature=0)
    numbered, count = number_calls(history)
    assert r.usage.prompt_tokens == len(model.encode_chat(numbered, tools=TOOLS))
    assert "## Return of functions.get_weather:0" in model.tokenizer.apply_chat_template(
        numbered, tools=TOOLS, tokenize=False)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].id == f"functions.{calls[0].function.name}:{count}"  # counting on from the history
    assert_valid(calls)


def test_json_schema_answers_parse_and_validate(server, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}

    def ask(seed):
        return chat(server, model, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200).choices[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(24)))
    for a in answers:
        assert a.finish_reason == "stop", a
        jsonschema.validate(json.loads(a.message.content), schema)
    assert isinstance(json.loads(chat(server, model, response_format={"type": "json_object"}, temperature=0,
                                      max_tokens=200).choices[0].message.content), dict)
    # the SDK's structured-output helpers: a pydantic model as the response format, and as a strict tool
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=5)
        age: int = Field(ge=0, le=99)

    parsed = server.client().chat.completions.parse(model=model.name, messages=ASK, response_format=Person,
                                                    temperature=0, max_tokens=200)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    called = server.client().chat.completions.parse(model=model.name, messages=ASK, max_tokens=300, temperature=0,
                                                    tools=[openai.pydantic_function_tool(Person)],
                                                    tool_choice="required")
    assert all(isinstance(c.function.parsed_arguments, Person) for c in called.choices[0].message.tool_calls)


def test_bad_schemas_and_tools_are_400s_naming_the_field(server, model):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integr"}}}}}},
         "response_format.json_schema.schema.properties.a.type"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[1].function.parameters.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(server, model, **extra)
        assert info.value.body["param"] == param, info.value.body


def test_n_choices_share_the_prompt_and_sample_with_seed_plus_i(server, model):
    ids = model.encode_chat(ASK)
    r = chat(server, model, n=3, temperature=1.0, seed=40, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        alone = chat(server, model, temperature=1.0, seed=40 + i, max_tokens=6)
        assert c.message.content == alone.choices[0].message.content
    assert r.usage.prompt_tokens == len(ids)
    greedy = chat(server, model, n=2, temperature=0, max_tokens=5)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    chunks = list(chat(server, model, n=2, temperature=1.0, seed=40, max_tokens=6, stream=True))
    for i in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert text == r.choices[i].message.content
    completions = server.client().completions.create(model=model.name, prompt="The river", n=2, temperature=1.0,
                                                     seed=3, max_tokens=5)
    assert [c.index for c in completions.choices] == [0, 1]


def test_logprobs_on_chat_and_completions(server, model):
    r = chat(server, model, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = model.encode_chat(ASK)
    want = model.generate(ids, max_new_tokens=5)
    assert len(content) == len(want) == r.usage.completion_tokens
    logits = model.logits(ids + want)[len(ids) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for entry, token, row in zip(content, want, expected):
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-3)
        assert bytes(entry.bytes) == model.tokenizer.token_bytes(token)
    streamed = list(chat(server, model, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, stream=True,
                         messages=ASK + [{"role": "user", "content": "again"}]))
    tokens = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(tokens) == 5 or streamed[-1].choices[0].finish_reason == "stop"
    plain = server.client().completions.create(model=model.name, prompt="The river", max_tokens=4, temperature=0,
                                               logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == plain.choices[0].text or "\ufffd" in "".join(lp.tokens)
    assert all(len(alts) <= 2 for alts in lp.top_logprobs) and lp.text_offset[0] == 0


# -- the agent frameworks ------------------------------------------------------------------------

def test_openai_agents_round_trip(server, model):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model.name, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                               temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item) for item in result.new_items]
    # the forced call, its result sent back, and a final answer (the SDK lets tool_choice go back to auto)
    assert kinds[:3] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    assert seen and seen[0] in ("Paris", "Rome", "Oslo") and isinstance(result.final_output, str)


def test_langchain_bind_tools_gets_a_structured_call(server, model):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Query(BaseModel):
        query: str = Field(max_length=6)
        limit: int = Field(ge=1, le=9)

    @tool(args_schema=Query)
    def search(query: str, limit: int) -> str:
        """Search the web."""
        return "nothing"

    llm = ChatOpenAI(model=model.name, base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", temperature=0,
                     max_tokens=200, max_retries=0)
    message = llm.bind_tools([search], tool_choice="search").invoke("Search for rivers.")
    assert message.tool_calls and message.tool_calls[0]["name"] == "search"
    args = message.tool_calls[0]["args"]
    assert isinstance(args, dict) and isinstance(args["query"], str) and isinstance(args["limit"], int)
    assert message.tool_calls[0]["id"] == "functions.search:0"
    chunks = list(llm.bind_tools([search], tool_choice="search").stream("Search for lakes."))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "search"
    assert isinstance(whole.tool_calls[0]["args"], dict)


# -- deltafin chat ---------------------------------------------------------------------------------

def chat_args(**kw):
    base = dict(max_new_tokens=None, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None)
    return SimpleNamespace(**{**base, **kw})


def test_chat_tools_calls_shown_results_sent_back(model, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER, SEARCH["function"]]))  # a bare function is a tool too
    (tmp_path / "bad.json").write_text(json.dumps([{"type": "function", "function": {"name": "f g"}}]))
    conv = Conversation(model, tool_choice={"name": "get_weather"})  # one call
    out, err = io.StringIO(), io.StringIO()
    lines = (f"/tools {tmp_path / 'bad.json'}\n/tools\n/tools {tmp_path / 'tools.json'}\n/tools\n"
             "What is the weather in Paris?\nsunny, 21 C\n/quit\n")
    assert repl(conv, chat_args(max_new_tokens=120), inp=io.StringIO(lines), out=out, err=err) == 0
    e = err.getvalue()
    assert "/tools failed" in e and "tools[0].function.name" in e and "[no tools" in e
    assert "[2 tools: get_weather, search]" in e
    roles = [m["role"] for m in conv.messages]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[3] == "assistant", roles
    calls = conv.messages[1]["tool_calls"]
    assert_valid(calls)
    assert calls[0]["id"] == f"functions.{calls[0]['function']['name']}:0"
    assert f"[tool call {calls[0]['id']}: {calls[0]['function']['name']}" in out.getvalue()
    results = [m for m in conv.messages if m["role"] == "tool"]
    assert results[0] == {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}
    # what the model read: the tools declared, the call as it made it, the result under its id
    text = model.tokenizer.decode(conv.held)
    assert "tool_declare" in text and f"## Return of {calls[0]['id']}" in text
    assert conv.state.max_abs_diff(prefilled(model, conv.held)) <= 1e-4
    saved = tmp_path / "c.state"
    conv.save(saved)
    again = Conversation(model)
    again.load(saved)
    assert (again.tools, again.messages, again.held) == (conv.tools, conv.messages, conv.held)
    out2 = io.StringIO()
    command(again, "/tools off", out2, err)
    assert again.tools is None


def prefilled(model, ids):
    st = model.new_state()
    model.forward(list(ids), st)
    return st


# -- shaped like Moonshot's K2 Vendor Verifier ----------------------------------------------------

# Small tools keep 500 requests quick on random weights (a call's every JSON gap takes a few whitespace
# tokens there); what is checked is the same for any schema.
VERIFIER_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 4}}, "required": ["text"],
        "additionalProperties": False}}},
]
VERIFIER_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in VERIFIER_TOOLS}


def verifier_request(i: int) -> dict:
    """A request as agents send them: a system prompt, the user's task, and (mostly) a history of calls
    made with the client's own ids and their results."""
    rng = random.Random(i)
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": rng.choice(["Plan my trip.", "What is the weather?", "Note it."])}]
    for turn in range(rng.randint(0, 2)):
        calls = [{"id": f"call_{i}_{turn}_{k}", "type": "function",
                  "function": {"name": "weather", "arguments": json.dumps({"city": "Rome"})}}
                 for k in range(rng.randint(1, 2))]
        messages.append({"role": "assistant", "content": rng.choice([None, "Checking."]), "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
    choice = ["required", "required", "auto", {"type": "function", "function": {"name": "lookup"}}][i % 4]
    # an "auto" answer is mostly text on random weights: a few tokens of it say enough
    return {"messages": messages, "tools": VERIFIER_TOOLS, "tool_choice": choice, "parallel_tool_calls": i % 3 == 0,
            "temperature": 1.0, "seed": i, "max_tokens": 16 if choice == "auto" else 100}


def test_verifier_shaped_requests_all_answered_and_every_call_valid(model):
    settings = dataclasses.replace(model.settings, max_batch=32, memo_size=0, prefix_cache_block=64)
    with RunningServer(create_app(model, settings)) as srv:
        client = srv.client()

        def ask(i):
            body = verifier_request(i)
            return body, client.chat.completions.create(model=model.name, **body).choices[0]

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, range(500)))  # a 4xx or 5xx would raise here
    forced = [(b, a) for b, a in answers if b["tool_choice"] != "auto"]
    called = [(b, a) for b, a in forced if a.message.tool_calls]
    for body, a in answers:
        assert_valid(a.message.tool_calls or (), VERIFIER_SCHEMAS)
        if a.message.tool_calls and not body["parallel_tool_calls"]:
            assert len(a.message.tool_calls) == 1
    for body, a in called:
        if isinstance(body["tool_choice"], dict):
            assert {c.function.name for c in a.message.tool_calls} == {"lookup"}
        assert a.finish_reason in ("tool_calls", "length")
    # a forced answer without a call only ever ran out of tokens mid-call
    assert all(a.finish_reason == "length" for _, a in forced if not a.message.tool_calls)
    assert len(called) >= 0.9 * len(forced), (len(called), len(forced))
