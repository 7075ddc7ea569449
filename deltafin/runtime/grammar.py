"""Guided decoding: what a generation must look like, as a token mask for every step.

A ``Constraint`` says what the output must be: JSON (any object, or one satisfying a JSON schema),
a Kimi tool-call section whose every call's arguments satisfy that tool's parameters schema, or
text that may end in such a section. It is a small frozen value (its specs held as JSON strings),
checked when it is made, so a bad schema is refused with the request field named before any work.

The Kimi tool-call section (special tokens of the Kimi tokenizer)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>  (once per call)
    <|tool_calls_section_end|>

IDX counts calls from ``first_index`` (the calls earlier in the conversation) up, one per call, so
every id of a conversation is different. A thinking block ``<think>...</think>`` may come first when
the constraint allows it; its text is free.

The grammars are llguidance's (JSON schemas and Lark with the special tokens named), compiled once per
(tokenizer, constraint) and kept in a small cache; each generation gets its own ``Matcher``, a copy.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import DeltafinError
from ..tokenizer import KimiTokenizer
from .tool_calls import (ARGS_BEGIN, CALL_BEGIN, CALL_END, MARKERS, NAME_PATTERN, SECTION_BEGIN, SECTION_END,
                         THINK_BEGIN, THINK_END)

TOOL_TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

CHOICES = ("auto", "required", "none")
MAX_CALLS = 16  # calls in one section: the grammar numbers each call, so it lists them
TOOL_NAME = re.compile(NAME_PATTERN)
# Whitespace between JSON tokens: enough for pretty-printed JSON a few levels deep, but bounded, so
# that a model cannot fill its whole budget with blanks between two tokens.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
CACHE_SIZE = 64  # compiled constraints kept per tokenizer


class GrammarError(DeltafinError):
    """A constraint that cannot be made: ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.message, self.param = message, param


def _canonical(obj) -> str:
    # Keys keep their order: a schema's property order is the order the output writes them in.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Constraint:
    """What a generation's output must be. Make one with ``json_object``, ``json_schema``,
    ``tool_calls`` or ``from_request``; the fields are canonical JSON and flags, so a Constraint is
    hashable (it is part of the server's memo key)."""

    schema: str | None = None  # the JSON answer's schema; None: the answer is text
    strict: bool = True  # for ``schema``: schema keywords the grammar cannot enforce are an error
    tools: str | None = None  # [[name, parameters, strict], ...]; None: no tool calls
    choice: str = "auto"  # with tools: "auto" | "required" | "none" | "function" (one call of ``function``)
    function: str | None = None  # the function tool_choice names
    parallel: bool = True  # with tools: more than one call per section
    first_index: int = 0  # with tools: IDX of the first call (the calls before it in the conversation)
    thinking: bool = False  # a <think>...</think> block may come before the constrained output

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def json_object(cls, *, thinking: bool = False) -> "Constraint":
        """Any JSON object."""
        return cls(schema=_canonical({"type": "object"}), thinking=thinking)

    @classmethod
    def json_schema(cls, schema: dict, strict: bool = True, *, thinking: bool = False,
                    param: str = "response_format.json_schema.schema") -> "Constraint":
        """JSON satisfying ``schema``. ``strict``: a keyword the grammar cannot enforce (e.g.
        ``uniqueItems``) is refused; otherwise it is ignored. ``param`` names the schema in errors."""
        check_schema(schema, strict, param)
        return cls(schema=_canonical(schema), strict=bool(strict), thinking=thinking)

    @classmethod
    def tool_calls(cls, tools: list[dict], choice="auto", *, parallel: bool = True, first_index: int = 0,
                   thinking: bool = False) -> "Constraint":
        """Calls of OpenAI function tools (``{"type": "function", "function": {"name", "description",
        "parameters", "strict"}}``) in the Kimi format. ``choice``: "auto" (text, or text ending in a
        tool-call section: once ``<|tool_calls_section_begin|>`` is written the rest is constrained),
        "required" (a section of one or more calls), {"name": NAME} (one call of that function) or
        "none" (no call: the tool-call tokens are masked). Every call's arguments satisfy its tool's
        ``parameters`` (enforced leniently unless the tool says ``strict``)."""
        if not isinstance(tools, (list, tuple)) or not tools:
            raise GrammarError("must be a non-empty list of tools", "tools")
        specs, names = [], set()
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise GrammarError("only function tools are supported ({'type': 'function', 'function': {...}})",
                                   f"{where}.type")
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise GrammarError("must be an object with a name and parameters", f"{where}.function")
            name = fn.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise GrammarError("a function name is 1 to 64 letters, digits, '_' or '-'", f"{where}.function.name")
            if name in names:
                raise GrammarError(f"function {name!r} is defined twice", f"{where}.function.name")
            names.add(name)
            params = fn.get("parameters")
            if params is None:  # OpenAI: a function without parameters takes an empty object
                params = {"type": "object", "properties": {}, "additionalProperties": False}
            strict = bool(fn.get("strict") or False)
            check_schema(params, strict, f"{where}.function.parameters")
            specs.append([name, params, strict])
        choice, function = _tool_choice(choice, names)
        if isinstance(first_index, bool) or not isinstance(first_index, int) or first_index < 0:
            raise GrammarError(f"must be an integer >= 0, got {first_index!r}", "first_index")
        return cls(tools=_canonical(specs), choice=choice, function=function, parallel=bool(parallel),
                   first_index=first_index, thinking=thinking)

    @classmethod
    def from_request(cls, response_format=None, tools=None, tool_choice=None, parallel_tool_calls=True,
                     *, first_index: int = 0, thinking: bool = False) -> "Constraint | None":
        """The constraint of an OpenAI chat request's fields (None: the output is free). With tools
        and a JSON response_format under "auto", the answer is either a tool-call section or that
        JSON; "required" or a named function must call; "none" leaves only the JSON (or text with
        the tool-call tokens masked)."""
        answer = _response_format(response_format, thinking)
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise GrammarError("tool_choice needs tools", "tool_choice")
            return answer
        choice = "auto" if tool_choice is None else tool_choice
        parallel = parallel_tool_calls is None or bool(parallel_tool_calls)  # OpenAI's default: on
        calls = cls.tool_calls(tools, choice, parallel=parallel, first_index=first_index, thinking=thinking)
        if answer is None:
            return calls
        if calls.choice == "none":
            return answer
        if calls.choice == "auto":
            return dataclasses.replace(calls, schema=answer.schema, strict=answer.strict)
        return calls  # a call is required: the answer's format does not apply

    # -- what it asks of a generation -----------------------------------------------------------
    @property
    def calls_tools(self) -> bool:
        """The output may contain a tool-call section."""
        return self.tools is not None and self.choice != "none"

    @property
    def special_text(self) -> bool:
        """The generation's text must keep the tool-call and thinking tokens for its parser."""
        return self.calls_tools or self.thinking


def _tool_choice(choice, names: set[str]) -> tuple[str, str | None]:
    """(mode, the function named or None)."""
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    if isinstance(choice, dict):
        # {"name": NAME}, or OpenAI's {"type": "function", "function": {"name": NAME}}
        fn = choice.get("function", choice) if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            if name not in names:
                raise GrammarError(f"names function {name!r}, which is not among the tools", "tool_choice")
            return "function", name
    raise GrammarError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                       "tool_choice")


def _response_format(fmt, thinking: bool) -> Constraint | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise GrammarError("must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(thinking=thinking)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("must be an object with a 'schema' object", "response_format.json_schema")
        # OpenAI's default: strict is off, and a missing schema allows any JSON object
        return Constraint.json_schema(spec.get("schema", {"type": "object"}), bool(spec.get("strict") or False),
                                      thinking=thinking)
    raise GrammarError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type")


# ----------------------------------------------------------------------------------------------
# Checking a schema, with the field at fault named
# ----------------------------------------------------------------------------------------------
def check_schema(schema, strict: bool, param: str) -> None:
    """Refuse a schema that is not a JSON schema, or that the grammar cannot enforce, naming the
    field (``param`` + the path inside the schema)."""
    if not isinstance(schema, dict):
        raise GrammarError("must be a JSON schema object", param)
    try:
        text = _canonical(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"is not JSON ({e})", param) from None
    problem = _schema_problem(text, bool(strict))
    if problem is not None:
        message, path = problem
        raise GrammarError(message, _path(param, path))


@functools.lru_cache(maxsize=256)  # agents send the same tools with every request
def _schema_problem(text: str, strict: bool) -> tuple[str, tuple] | None:
    """(message, path inside the schema) of what is wrong with a schema, or None."""
    # The libraries are imported where used: every front end imports this module (SamplingParams
    # holds a Constraint), and most runs never constrain anything.
    import jsonschema

    schema = json.loads(text)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        return error.message, tuple(error.absolute_path)
    message = _llguidance_error(schema, strict)
    if message is None:
        return None
    # The field is the deepest subschema that fails on its own (its message is the most precise).
    path: list = []
    node = schema
    while True:
        for key, child in _subschemas(node):
            failed = _llguidance_error(_standalone(child, schema), strict)
            if failed is not None:
                path, node, message = path + key, child, failed
                break
        else:
            break
    named = re.search(r'Unimplemented keys: \["([^"]+)"', message)
    if named:
        path.append(named.group(1))
    elif "regex" in message and isinstance(node, dict) and "pattern" in node:
        path.append("pattern")
    # llguidance's regex errors span lines (the pattern, a caret): one line here
    return (" ".join(message.split()) if "regex" in message else message.splitlines()[0]), tuple(path)


def _llguidance_error(schema: dict, strict: bool) -> str | None:
    import llguidance
    options = dict(JSON_OPTIONS, lenient=not strict)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        return str(e)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if failed else None


def _subschemas(node):
    """(path, subschema) for the schemas directly inside ``node``."""
    if not isinstance(node, dict):
        return
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield [key, name], child
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems"):
        if isinstance(node.get(key), dict):
            yield [key], node[key]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield [key, i], child


def _standalone(child, root: dict):
    """A subschema checked on its own, with the root's definitions so its $refs still resolve."""
    if not isinstance(child, dict):
        return child
    out = dict(child)
    for key in ("$defs", "definitions"):
        if key in root and key not in out:
            out[key] = root[key]
    return out


def _path(param: str, keys) -> str:
    out = param
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else f".{k}"
    return out


# ----------------------------------------------------------------------------------------------
# Compiling for a tokenizer
# ----------------------------------------------------------------------------------------------
def special_ids(tokenizer, names=MARKERS) -> dict[str, int]:
    """{name: id} of those special tokens the tokenizer has."""
    vocab = getattr(tokenizer, "special_tokens", None)
    if vocab is None:  # a tokenizer.json tokenizer
        vocab = tokenizer.get_added_vocab()
    return {n: vocab[n] for n in names if n in vocab}


class _Vocab:
    """One tokenizer as llguidance sees it (with the model's vocabulary size), and its compiled
    constraints (least recently used dropped first)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        if len(tokenizer) > vocab_size:
            raise DeltafinError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary "
                                f"({vocab_size})")
        eos = tokenizer.eos_token_id
        if isinstance(tokenizer, KimiTokenizer):  # tiktoken underneath
            from llguidance.tiktoken import lltokenizer_from_encoding
            self.ll = lltokenizer_from_encoding(tokenizer.model, n_vocab=vocab_size, eos_token=eos)
        else:
            from llguidance.hf import from_tokenizer
            self.ll = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.llguidance = llguidance
        self.eos = eos
        self.size = vocab_size
        self.ids = special_ids(tokenizer)
        self.compiled: OrderedDict[Constraint, llguidance.LLMatcher | None] = OrderedDict()


_VOCABS: "weakref.WeakKeyDictionary[object, dict[int, _Vocab]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _vocab(tokenizer, vocab_size: int) -> _Vocab:
    with _LOCK:
        per_size = _VOCABS.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            per_size[vocab_size] = _Vocab(tokenizer, vocab_size)
        return per_size[vocab_size]


def _compile(vocab: _Vocab, c: Constraint):
    """The pristine llguidance matcher of ``c`` (None: no grammar, only masked tokens)."""
    with _LOCK:
        if c in vocab.compiled:
            vocab.compiled.move_to_end(c)
            return vocab.compiled[c]
    if c.calls_tools:
        missing = [n for n in TOOL_TOKENS if n not in vocab.ids]
        if missing:
            raise GrammarError(f"this model's tokenizer has no {missing[0]} token, so it cannot call tools", "tools")
        grammar = vocab.llguidance.LLMatcher.grammar_from_lark(_tools_lark(c))
    elif c.schema is not None:
        options = dict(JSON_OPTIONS, lenient=not c.strict)
        grammar = vocab.llguidance.LLMatcher.grammar_from_json_schema(c.schema, defaults=options)
    else:
        grammar = None
    matcher = None
    if grammar is not None:
        matcher = vocab.llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().splitlines()[0], "tools" if c.calls_tools else "response_format")
    with _LOCK:
        vocab.compiled[c] = matcher
        while len(vocab.compiled) > CACHE_SIZE:
            vocab.compiled.popitem(last=False)
    return matcher


def _json_rule(schema, strict: bool) -> str:
    # A %json block takes its options from the schema's "x-guidance" key.
    schema = dict(schema, **{"x-guidance": dict(JSON_OPTIONS, lenient=not strict)})
    return f"%json {_canonical(schema)}"


def _tools_lark(c: Constraint) -> str:
    """The Lark grammar of a tool-call section (or, under "auto" with a JSON answer, of either).

    Call k of the section is ``calls_k``: its IDX is first_index + k, and it may be followed by call
    k + 1 (parallel calls) up to MAX_CALLS. Under a named choice only that function is listed."""
    tools = json.loads(c.tools)
    if c.choice == "function":
        tools = [t for t in tools if t[0] == c.function]
    count = MAX_CALLS if c.parallel and c.choice != "function" else 1
    rules = ["start: section" + (" | answer" if c.schema is not None and c.choice == "auto" else ""),
             f"section: {SECTION_BEGIN} calls_0 {SECTION_END}"]
    for k in range(count):
        rules.append(f"calls_{k}: call_{k}" + (f" calls_{k + 1}?" if k + 1 < count else ""))
        index = c.first_index + k
        names = " | ".join(f'"{name}:{index}" {ARGS_BEGIN} args_{i}' for i, (name, _, _) in enumerate(tools))
        rules.append(f'call_{k}: {CALL_BEGIN} "functions." ({names}) {CALL_END}')
    for i, (_, params, strict) in enumerate(tools):
        rules.append(f"args_{i}: {_json_rule(params, strict)}")
    if c.schema is not None and c.choice == "auto":
        rules.append(f"answer: {_json_rule(json.loads(c.schema), c.strict)}")
    return "\n".join(rules)


# ----------------------------------------------------------------------------------------------
# One generation's matcher
# ----------------------------------------------------------------------------------------------
FREE, THINKING, START, GRAMMAR = "free", "thinking", "start", "grammar"


class Matcher:
    """The constraint applied to one generation: ``allowed()`` is the mask of the next token,
    ``advance(token)`` takes the token produced, ``rollback(n)`` undoes the last n advances.

    Phases: "free" text (tool_choice "auto" before any section, or "none": only the tool-call
    tokens are masked); "start" (the grammar has not begun, and a <think> block may open it);
    "thinking" (free text up to </think>, which may not end the generation); "grammar" (llguidance's
    mask). End tokens (``eos``) are allowed exactly where the grammar may end, and are never fed.
    """

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int, eos, context=()):
        vocab = _vocab(tokenizer, vocab_size)
        pristine = _compile(vocab, constraint)
        self.ll = pristine.deep_copy() if pristine is not None else None
        self.size = vocab_size
        self.eos = frozenset(eos)
        self._eos_ids = sorted(self.eos)
        # llguidance allows the tokenizer's own end token where the grammar may end; this
        # generation's end tokens (which may differ) take its place
        self._ll_eos = vocab.eos
        begin, end = vocab.ids.get(THINK_BEGIN), vocab.ids.get(THINK_END)
        thinks = constraint.thinking and begin is not None and end is not None  # else no block is possible
        self.think = (begin, end) if thinks else (None, None)
        tool_ids = [vocab.ids[n] for n in TOOL_TOKENS if n in vocab.ids]
        if constraint.calls_tools and constraint.choice == "auto" and constraint.schema is None:
            self.phase = FREE
            self.trigger = vocab.ids[SECTION_BEGIN]
            self.free = self._mask_without([i for i in tool_ids if i != self.trigger])
        elif self.ll is None:  # tool_choice "none"
            self.phase, self.trigger = FREE, None
            self.free = self._mask_without(tool_ids)
        else:
            self.phase, self.trigger = START if self.think[0] is not None else GRAMMAR, None
            # a prompt that ends in <think> (a template that opens the block) starts inside it
            if self.think[0] is not None and context and context[-1] == self.think[0]:
                self.phase = THINKING
        if self.think[0] is not None:
            self.thinking_mask = self._mask_without(self._eos_ids + tool_ids + [self.think[0]])
        self.section_end = vocab.ids.get(SECTION_END)
        self._history: list[tuple[str, bool, int]] = []  # (phase before, fed to llguidance, token)
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def _mask_without(self, ids) -> torch.Tensor:
        mask = torch.ones(self.size, dtype=torch.bool)
        mask[list(ids)] = False
        return mask

    @property
    def done(self) -> bool:
        """The output is complete: nothing may follow (generation ends here)."""
        return self.phase == GRAMMAR and self.ll.is_stopped()

    @property
    def finish_reason(self) -> str:
        """Why a complete output ended: "tool_calls" after a tool-call section, else "stop"."""
        called = any(fed and t == self.section_end for _, fed, t in self._history)
        return "tool_calls" if called else "stop"

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size] on the CPU: the tokens that may come next."""
        if self.phase == FREE:
            return self.free
        if self.phase == THINKING:
            return self.thinking_mask
        self.ll.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.size]
        mask = torch.from_numpy(bits.astype(np.bool_))
        if self._ll_eos is not None:
            mask[self._ll_eos] = False
        mask[self._eos_ids] = self.ll.is_accepting()
        if self.phase == START:
            mask[self.think[0]] = True
        return mask

    def allows(self, token: int) -> bool:
        if self.phase == FREE:
            return bool(self.free[token])
        if self.phase == THINKING:
            return bool(self.thinking_mask[token])
        if token in self.eos:
            return self.ll.is_accepting()
        if token == self._ll_eos:
            return False
        if self.phase == START and token == self.think[0]:
            return True
        return not self.done and self.ll.validate_tokens([token]) == 1

    def advance(self, token: int) -> None:
        """Take a produced token (never an end token): it must be allowed."""
        phase, fed = self.phase, False
        if phase == FREE:
            if token == self.trigger:
                fed, self.phase = True, GRAMMAR
        elif phase == THINKING:
            if token == self.think[1]:
                self.phase = GRAMMAR
        elif phase == START and token == self.think[0]:
            self.phase = THINKING
        else:
            fed, self.phase = True, GRAMMAR
        if fed and not self.ll.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.ll.get_error()}")
        self._history.append((phase, fed, token))

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undone = self._history[-n:]
        del self._history[-n:]
        fed = sum(1 for _, f, _ in undone if f)
        if fed:
            self.ll.rollback(fed)
        self.phase = undone[0][0]

    def legal_prefix(self, tokens) -> int:
        """How many of ``tokens``, in order from here, the constraint allows (an end token ends them)."""
        n = 0
        for t in tokens:
            if self.done or not self.allows(t):
                break
            n += 1
            if t in self.eos:
                break
            self.advance(t)
        self.rollback(n - (1 if n and tokens[n - 1] in self.eos else 0))
        return n

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (e.g. the rest of a function name or a JSON key)."""
        if self.phase != GRAMMAR or self.done:
            return []
        return list(self.ll.compute_ff_tokens())

