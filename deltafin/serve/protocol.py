"""The OpenAI wire format for ``deltafin serve``: request parsing and validation, response shaping.

No HTTP and no engine here: a request body (already decoded JSON) goes in, a ``ParsedRequest`` or an
``APIError`` comes out; results go out as the dicts OpenAI clients expect. Every rejection names
the offending parameter, so a client sees at once what to change.

Agent requests: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` become one
``Constraint`` (``constraint``; checked there, a bad schema named down to its field); a history's
assistant ``tool_calls`` and ``tool`` messages go to the chat template with the calls numbered as
Kimi numbers them (``functions.NAME:K``). Answers are read with ``runtime.tool_calls``: a thinking
block becomes ``reasoning_content``, a tool-call section ``tool_calls`` (finish_reason "tool_calls"),
whole calls in a stream too; what does not parse stays content. ``n`` choices, each with its own
index (and its own seed, ``seed + i``), and ``logprobs`` in the shapes of each endpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..runtime.grammar import Constraint, GrammarError
from ..runtime.sampling import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from ..runtime.tool_calls import ToolCallStream, number_calls, parse

# Larger request bodies are refused with 413 before they are read in full.
MAX_BODY_BYTES = 1 << 20
# /v1/completions without max_tokens generates at most this many tokens (the OpenAI default is 16;
# 256 is more useful for a local model and still bounded). Chat without max_tokens runs to EOS.
COMPLETION_DEFAULT_MAX_TOKENS = 256
# OpenAI's defaults when a request omits them. temperature 1 samples; ask for 0 to get greedy
# decoding (deterministic, n-gram speculation, answered from the memo when repeated).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_STOP_STRINGS = 16
# Choices per request: each is a sequence of its own in the engine's passes (they share the prompt's
# prefill), so a bound keeps one request from filling every batch slot many times over.
MAX_CHOICES = 16
# Chat roles the chat template is given; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# What JSON carries for a logprob of -inf (a token the constraint or top-k left no chance), as OpenAI does.
NO_CHANCE = -9999.0


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None  # None: the request did not name one (the served model is meant)
    # chat: [{"role", "content": str, and "tool_calls" / "reasoning_content" (assistant), "tool_call_id"
    # (tool)}, ...], roles normalized, tool calls numbered functions.NAME:K
    messages: list[dict] | None
    prompt: str | list[int] | None  # completion: text, or token ids
    max_tokens: int | None  # None: omitted (chat runs to EOS, completions take the default)
    # max_new_tokens left None: the server resolves max_tokens against its context; no constraint yet:
    # ``constraint`` makes it (off the event loop: checking a schema can take a while)
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    tools: list | None = None  # as sent (``constraint`` checks them); None: no tools
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    calls_before: int = 0  # tool calls in the history: the index K of the next one

    @property
    def prompt_param(self) -> str:
        """The parameter a problem with the prompt is reported against."""
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def reads_calls(self) -> bool:
        """Answers are read for tool calls (tools given, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


def decode_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {_json_type(body)}", code="invalid_json")
    return body


def parse_chat(body: dict) -> ParsedRequest:
    """Validate a /v1/chat/completions body."""
    _reject_unsupported(body, _CHAT_UNSUPPORTED)
    messages, calls_before = _messages(body)
    try:
        f = ChatFields.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    if f.top_logprobs is not None and not f.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad(f"'tools' must be an array of function tools, got {_json_type(tools)}", param="tools",
                  code="invalid_type")
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad(f"'response_format' must be an object with a 'type', got {_json_type(fmt)}",
                  param="response_format", code="invalid_type")
    req = _parse_common(body, "chat", messages=messages, prompt=None,
                        logprobs=(f.top_logprobs or 0) if f.logprobs else None)
    return dataclasses.replace(req, tools=tools or None, tool_choice=body.get("tool_choice"),
                               parallel_tool_calls=f.parallel_tool_calls is not False, response_format=fmt,
                               calls_before=calls_before)


def parse_completion(body: dict) -> ParsedRequest:
    """Validate a /v1/completions body."""
    _reject_unsupported(body, _COMPLETION_UNSUPPORTED)
    try:
        f = CompletionFields.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    return _parse_common(body, "completion", messages=None, prompt=_prompt(body), logprobs=f.logprobs)


def constraint(req: ParsedRequest) -> Constraint | None:
    """The request's Constraint (None: the output is free), or a 400 naming the field at fault. No
    thinking block is opened before a constrained answer (one that must call, or be JSON): it would
    be free text with no end in sight on weights that do not think; under tool_choice "auto" the
    answer is free until a call begins, thinking included."""
    if req.kind != "chat":
        return None
    try:
        return Constraint.from_request(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls,
                                       first_index=req.calls_before)
    except GrammarError as e:
        raise bad(f"'{e.param}': {e.message}", param=e.param) from None


def resolve_max_tokens(req: ParsedRequest, prompt_tokens: int, context: int, cap: int) -> int:
    """How many tokens to allow: the request's max_tokens (or the default), clamped to what is
    left of the context and to the server's cap (0 = no cap). Clamping instead of refusing keeps
    clients that always send a large max_tokens working; finish_reason "length" tells them."""
    room = context - prompt_tokens
    if room < 1:
        raise bad(f"the prompt is {prompt_tokens} tokens but the model's context is {context} tokens; "
                  "shorten it so at least one token is left for the reply",
                  param=req.prompt_param, code="context_length_exceeded")
    if req.max_tokens is not None:
        wanted = req.max_tokens
    elif req.kind == "completion":
        wanted = COMPLETION_DEFAULT_MAX_TOKENS
    else:
        wanted = room  # chat runs to EOS
    if cap > 0:
        wanted = min(wanted, cap)
    return min(wanted, room)


# -- validation helpers -------------------------------------------------------------------------

def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, float):
        return f"the number {v!r}" if math.isfinite(v) else repr(v)
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# Seeds are what torch's generator accepts: any 64-bit value, signed or not.


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """The request fields shared by both endpoints, with their types and ranges (JSON types are
    taken strictly: "0.5" is not a number, 1.0 is not an integer, true is not 1)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # max_tokens' newer name; wins
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # an extension many servers accept; -1 and 0 mean off
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    # one string or a list of them; a lone string is read as a list of one
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS),
                    BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None


class ChatFields(BaseModel):
    """The fields only /v1/chat/completions has (tools, tool_choice and response_format are checked by
    their Constraint)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    parallel_tool_calls: bool | None = None


class CompletionFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # the legacy API's: a count


def _validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as OpenAI reports one: named parameter, type or value."""
    first = e.errors(include_url=False)[0]
    loc = first["loc"]
    param = f"{loc[0]}.{loc[1]}" if loc[0] == "stream_options" and len(loc) > 1 else str(loc[0])
    kind = first["type"]
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) or kind == "union_tag_invalid" else "invalid_value"
    got = first.get("input")
    try:
        shown = json.dumps(got)[:80]
    except (TypeError, ValueError):
        shown = repr(got)[:80]
    return bad(f"'{param}': {first['msg']} (got {shown})", param=param, code=code)


def _parse_common(body: dict, kind: str, messages, prompt, logprobs: int | None) -> ParsedRequest:
    try:
        f = SamplingFields.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    stream = bool(f.stream)
    if f.stream_options is not None and not stream:
        raise bad("'stream_options' is only allowed together with 'stream': true", param="stream_options")
    stop = tuple(f.stop or ())
    return ParsedRequest(
        kind=kind, model=f.model, messages=messages, prompt=prompt,
        max_tokens=f.max_completion_tokens if f.max_completion_tokens is not None else f.max_tokens,
        sampling=SamplingParams(temperature=DEFAULT_TEMPERATURE if f.temperature is None else f.temperature,
                                top_p=DEFAULT_TOP_P if f.top_p is None else f.top_p, top_k=max(f.top_k or 0, 0),
                                seed=f.seed, stop=stop, logprobs=logprobs),
        stream=stream,
        include_usage=bool(f.stream_options and f.stream_options.include_usage),
        n=f.n or 1)


def _messages(body: dict) -> tuple[list[dict], int]:
    """The messages as the chat template takes them, and how many tool calls the history holds."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", param="messages",
                  code="invalid_type" if not isinstance(msgs, list) else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, got {_json_type(m)}", param=where, code="invalid_type")
        role = m.get("role")
        if role == "function" or m.get("function_call"):
            raise bad(f"'{where}': legacy function calls are not supported; use tools, tool_calls and tool "
                      "messages", param=where, code="unsupported_parameter")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(_ROLES)}; got {role!r}",
                      param=f"{where}.role")
        role = _ROLES[role]
        calls = m.get("tool_calls")
        msg = {"role": role, "content": _content(m.get("content"), f"{where}.content",
                                                 optional=role == "assistant")}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if calls is not None and calls != []:
            if role != "assistant":
                raise bad(f"'{where}.tool_calls': only assistant messages carry tool calls",
                          param=f"{where}.tool_calls")
            msg["tool_calls"] = _history_calls(calls, f"{where}.tool_calls")
        if role == "assistant":
            key = "reasoning_content" if "reasoning_content" in m else "reasoning"
            reasoning = m.get(key)
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad(f"'{where}.{key}' must be a string, got {_json_type(reasoning)}",
                              param=f"{where}.{key}", code="invalid_type")
                msg["reasoning_content"] = reasoning
        if role == "tool":
            call = m.get("tool_call_id")
            if not isinstance(call, str) or not call:
                raise bad(f"'{where}.tool_call_id' must name the call this message answers (a string), got "
                          f"{_json_type(call)}", param=f"{where}.tool_call_id",
                          code="missing_required_parameter" if call is None else "invalid_type")
            msg["tool_call_id"] = call
        out.append(msg)
    return number_calls(out)


def _history_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls, as the template renders them: {"id", "type", "function":
    {"name", "arguments": JSON text}} (arguments given as an object are written as JSON)."""
    if not isinstance(calls, list):
        raise bad(f"'{where}' must be an array of tool calls, got {_json_type(calls)}", param=where,
                  code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise bad(f"'{at}' must be a function call: an object with a 'function' object (name, arguments)",
                      param=at, code="invalid_type")
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise bad(f"'{at}.function.name' must be a non-empty string", param=f"{at}.function.name")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise bad(f"'{at}.function.arguments' must be a JSON string, got {_json_type(args)}",
                      param=f"{at}.function.arguments", code="invalid_type")
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(c.get("id"), str) and c["id"]:
            call["id"] = c["id"]
        out.append(call)
    return out


def _content(v: Any, where: str, optional: bool) -> str:
    if v is None and optional:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise bad(f"'{where}[{j}]': only text parts are supported (got {kind!r})", param=f"{where}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"'{where}' must be a string or an array of text parts, got {_json_type(v)}", param=where,
              code="invalid_type")


def _prompt(body: dict) -> str | list[int]:
    v = body.get("prompt")
    if v is None:
        raise bad("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return list(v)
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise bad("only one prompt per request is supported; send the prompts one at a time", param="prompt",
                  code="unsupported_parameter")
    raise bad("'prompt' must be a string or an array of token ids", param="prompt", code="invalid_type")


def _none_or(*ok):
    """Accepts null and exactly the given values (1 but not 1.0 or true)."""
    return lambda v: v is None or any(v == o and type(v) is type(o) for o in ok)


# (parameter, is this value acceptable, what to say). A parameter absent from the body is fine.
_SHARED_UNSUPPORTED = [
    ("logit_bias", lambda v: v is None or v == {}, "logit_bias is not supported"),
    ("presence_penalty", lambda v: v is None or (_is_number(v) and v == 0), "presence_penalty is not supported"),
    ("frequency_penalty", lambda v: v is None or (_is_number(v) and v == 0), "frequency_penalty is not supported"),
]
_CHAT_UNSUPPORTED = _SHARED_UNSUPPORTED + [
    ("functions", lambda v: v is None or v == [], "legacy functions are not supported; use tools"),
    ("function_call", _none_or("none", "auto"), "legacy function_call is not supported; use tool_choice"),
    ("audio", _none_or(), "audio output is not supported"),
    ("modalities", lambda v: v is None or v == ["text"], "only the text modality is supported"),
    ("prediction", _none_or(), "predicted outputs are not supported"),
    ("web_search_options", _none_or(), "web search is not supported"),
]
_COMPLETION_UNSUPPORTED = _SHARED_UNSUPPORTED + [
    ("echo", _none_or(False), "echo is not supported"),
    ("best_of", _none_or(1), "only best_of=1 is supported"),
    ("suffix", _none_or(""), "suffix (insertion) is not supported"),
]


def _reject_unsupported(body: dict, table) -> None:
    for name, ok, why in table:
        if name in body and not ok(body[name]):
            raise bad(f"'{name}': {why} (got {json.dumps(body[name])[:80]})", param=name,
                      code="unsupported_parameter")


# -- response shaping ---------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    # cached_tokens: prompt tokens not recomputed (a reused decode state), as OpenAI reports them
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# One returned token as the engine hands it out: its text, and its logprob entry when asked for
# ((token_id, logprob, [(alt_id, alt_logprob), ...]), runtime.generate's), else None.
Piece = tuple[str, "tuple | None"]


def finish_reason(generation: str, called: bool) -> str:
    """The choice's finish_reason: "tool_calls" when its answer called and ended there (a cut-off
    answer stays "length"), and never "tool_calls" for an answer that turned out to hold no call."""
    if generation in ("stop", "tool_calls"):
        return "tool_calls" if called else "stop"
    return generation


class Shaper:
    """Builds the response objects of one request: the whole answer, or its stream of chunks, for
    each of its choices. ``describe(token_id) -> (text, bytes)`` names tokens in logprobs; ``calls``
    and ``first_index`` say how chat answers are read (``runtime.tool_calls``)."""

    def __init__(self, kind: str, model: str, include_usage: bool = False, *, choices: int = 1,
                 calls: bool = False, first_index: int = 0, describe=None):
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.calls, self.first_index = calls, first_index
        self.describe = describe
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._readers = [ToolCallStream(first_index, calls) for _ in range(choices)]
        self._offsets = [0] * choices  # completions: where the next piece's text starts
        self.malformed: list[str] = []  # what did not parse as a tool call (raw), for the log

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- the whole answer ------------------------------------------------------------------------
    def response(self, answers: list[tuple[list[Piece], str]], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> dict:
        """``answers``: each choice's pieces and the finish reason of its generation."""
        choices = []
        for i, (pieces, generation) in enumerate(answers):
            text = "".join(t for t, _ in pieces)
            entries = [e for _, e in pieces if e is not None]
            if self.kind == "chat":
                read = parse(text, self.first_index, self.calls)
                self.malformed += read.malformed
                message = {"role": "assistant", "content": read.content if read.content or not read.calls else None}
                if read.reasoning is not None:
                    message["reasoning_content"] = read.reasoning
                if read.calls:
                    message["tool_calls"] = [c.openai() for c in read.calls]
                choices.append({"index": i, "message": message,
                                "logprobs": self._chat_logprobs(entries) if entries else None,
                                "finish_reason": finish_reason(generation, bool(read.calls))})
            else:
                choices.append({"index": i, "text": text,
                                "logprobs": self._completion_logprobs(pieces, 0) if entries else None,
                                "finish_reason": finish_reason(generation, False)})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    # -- streaming -------------------------------------------------------------------------------
    def _chunk(self, index: int, delta_or_text, finish_reason: str | None, logprobs=None) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return out

    def opening_chunks(self) -> list[dict]:
        """Chat streams start by announcing the role, once per choice; completion streams have no opening."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(self._readers))]

    def piece_chunks(self, index: int, pieces: list[Piece]) -> list[dict]:
        """The chunks for new pieces of choice ``index`` (none while their text is held back, unless
        they carry logprobs)."""
        entries = [e for _, e in pieces if e is not None]
        text = "".join(t for t, _ in pieces)
        if self.kind != "chat":
            logprobs = self._completion_logprobs(pieces, self._offsets[index]) if entries else None
            self._offsets[index] += len(text)
            return [self._chunk(index, text, None, logprobs)] if text or entries else []
        deltas = self._readers[index].feed(text)
        return self._delta_chunks(index, deltas, self._chat_logprobs(entries) if entries else None)

    def final_chunks(self, index: int, generation: str) -> list[dict]:
        """The last chunks of choice ``index``: the text held back until the end, then the finish reason
        (its generation's, read as ``finish_reason`` says)."""
        called = False
        out = []
        if self.kind == "chat":
            reader = self._readers[index]
            out = self._delta_chunks(index, reader.finish(), None)
            self.malformed += reader.malformed
            called = bool(reader.calls)
        return out + [self._chunk(index, {} if self.kind == "chat" else "", finish_reason(generation, called))]

    def _delta_chunks(self, index: int, deltas: list[dict], logprobs) -> list[dict]:
        if not deltas:
            return [self._chunk(index, {}, None, logprobs)] if logprobs is not None else []
        return [self._chunk(index, d, None, logprobs if k == 0 else None) for k, d in enumerate(deltas)]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    # -- logprobs ----------------------------------------------------------------------------------
    def _token(self, token_id: int, logprob: float) -> dict:
        text, raw = self.describe(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    def _chat_logprobs(self, entries) -> dict:
        """Chat's shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
        content = [{**self._token(t, lp), "top_logprobs": [self._token(a, alp) for a, alp in alts]}
                   for t, lp, alts in entries]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, pieces: list[Piece], offset: int) -> dict:
        """The legacy shape: parallel lists of tokens, their logprobs, the alternatives (token text ->
        logprob) and where each token's text starts in the choice's text."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, entry in pieces:
            if entry is not None:
                t, lp, alts = entry
                out["tokens"].append(self.describe(t)[0])
                out["token_logprobs"].append(_finite(lp))
                out["top_logprobs"].append({self.describe(a)[0]: _finite(alp) for a, alp in alts})
                out["text_offset"].append(offset)
            offset += len(text)
        return out


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_CHANCE


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
