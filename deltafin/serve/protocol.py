"""The OpenAI wire format for ``deltafin serve``: request parsing and validation, response shaping.

No HTTP and no engine here: a request body (already decoded JSON) goes in, a ``ParsedRequest`` or an
``APIError`` comes out; results go out as the dicts OpenAI clients expect. Every rejection names
the offending parameter, so a client sees at once what to change.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..runtime.sampling import SEED_RANGE, SamplingParams

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
# Chat roles the chat template is given; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
    messages: list[dict] | None  # chat: [{"role", "content": str}, ...], roles normalized
    prompt: str | list[int] | None  # completion: text, or token ids
    max_tokens: int | None  # None: omitted (chat runs to EOS, completions take the default)
    sampling: SamplingParams  # max_new_tokens left None: the server resolves max_tokens against its context
    stream: bool
    include_usage: bool

    @property
    def prompt_param(self) -> str:
        """The parameter a problem with the prompt is reported against."""
        return "messages" if self.kind == "chat" else "prompt"


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
    return _parse_common(body, "chat", messages=_messages(body), prompt=None)


def parse_completion(body: dict) -> ParsedRequest:
    """Validate a /v1/completions body."""
    _reject_unsupported(body, _COMPLETION_UNSUPPORTED)
    return _parse_common(body, "completion", messages=None, prompt=_prompt(body))


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


def _parse_common(body: dict, kind: str, messages, prompt) -> ParsedRequest:
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
                                seed=f.seed, stop=stop),
        stream=stream,
        include_usage=bool(f.stream_options and f.stream_options.include_usage))


def _messages(body: dict) -> list[dict]:
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
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise bad(f"'{where}': tool and function calls are not supported by this server", param=where,
                      code="unsupported_parameter")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(_ROLES)}; got {role!r}",
                      param=f"{where}.role")
        msg = {"role": _ROLES[role], "content": _content(m.get("content"), f"{where}.content",
                                                         optional=role == "assistant")}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
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
    ("n", _none_or(1), "only n=1 is supported; send separate requests for more choices"),
    ("logit_bias", lambda v: v is None or v == {}, "logit_bias is not supported"),
    ("presence_penalty", lambda v: v is None or (_is_number(v) and v == 0), "presence_penalty is not supported"),
    ("frequency_penalty", lambda v: v is None or (_is_number(v) and v == 0), "frequency_penalty is not supported"),
]
_CHAT_UNSUPPORTED = _SHARED_UNSUPPORTED + [
    ("logprobs", _none_or(False), "logprobs are not supported"),
    ("top_logprobs", _none_or(0), "top_logprobs are not supported"),
    ("tools", lambda v: v is None or v == [], "tools (function calling) are not supported"),
    ("functions", lambda v: v is None or v == [], "functions (function calling) are not supported"),
    ("tool_choice", _none_or("none", "auto"), "tool_choice is not supported"),
    ("function_call", _none_or("none", "auto"), "function_call is not supported"),
    ("response_format", lambda v: v is None or v == {"type": "text"},
     "only response_format {\"type\": \"text\"} is supported"),
    ("audio", _none_or(), "audio output is not supported"),
    ("modalities", lambda v: v is None or v == ["text"], "only the text modality is supported"),
    ("prediction", _none_or(), "predicted outputs are not supported"),
    ("web_search_options", _none_or(), "web search is not supported"),
]
_COMPLETION_UNSUPPORTED = _SHARED_UNSUPPORTED + [
    ("logprobs", _none_or(), "logprobs are not supported"),
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


class Shaper:
    """Builds the response objects of one request: the whole answer, or its stream of chunks."""

    def __init__(self, kind: str, model: str, include_usage: bool = False):
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def _chunk(self, delta_or_text, finish_reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return out

    def opening_chunk(self) -> dict | None:
        """Chat streams start by announcing the role; completion streams have no opening."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.kind == "chat" else None

    def text_chunk(self, text: str) -> dict:
        return self._chunk({"content": text} if self.kind == "chat" else text, None)

    def final_chunk(self, finish_reason: str) -> dict:
        """The last chunk with a choice: no new text, the finish reason."""
        return self._chunk({} if self.kind == "chat" else "", finish_reason)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
