"""Reading an answer written in the Kimi formats: a thinking block, tool calls, and the text around them.

A Kimi model answers an agent turn like this (the markers are special tokens of its tokenizer)::

    <think>reasoning</think>text<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>  (once per call)
    <|tool_calls_section_end|>

``ToolCallStream`` reads such an answer piece by piece, as it is generated, and hands out OpenAI-style
message deltas (``{"content": ...}``, ``{"reasoning_content": ...}``, ``{"tool_calls": [...]}``);
``parse`` reads a whole answer the same way, so a streamed answer and the same answer read at once
always agree. Every front end (the server, ``deltafin chat``, the Python API) reads answers here, and
prepares a conversation's history with ``number_calls``.

Rules, in the order they apply:
- A ``<think>`` block is reasoning only at the very start of the answer (leading whitespace aside);
  an answer cut off inside it is all reasoning.
- A call is kept when its header is ``functions.NAME:IDX`` (or ``NAME:IDX``, or ``NAME``) and its
  arguments are a JSON object. Its id is renumbered ``functions.NAME:K``, K counting the calls of the
  conversation from 0 (the ``first_index`` given, then this answer's calls in order), as Moonshot's
  API numbers them: a model that repeats an index still gives every call its own id.
- Anything else is content: the text outside sections, a call that does not parse, text inside a
  section between calls, a section cut off before its end. Content never holds the markers, as it
  never holds other special tokens; what did not parse is kept in ``malformed`` (raw) for logging.
  Nothing here raises on what a model writes.
- With ``calls=False`` (no tools, or tool_choice "none") sections are not read: their text is content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# The special tokens whose text an answer must keep to be read here (Decoding(special_text=True) keeps
# them; every other special token's text is left out of an answer, as before); grammar.py writes them.
MARKERS = (THINK_BEGIN, THINK_END, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

# OpenAI's rule for function names: 1 to 64 letters, digits, underscores and dashes.
NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}"
_HEADER = re.compile(rf"(?:functions\.)?({NAME_PATTERN})(?::\d+)?")


def call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


@dataclass(frozen=True)
class ToolCall:
    id: str  # functions.NAME:K
    name: str
    arguments_json: str  # a JSON object, as the model wrote it (outer whitespace trimmed)

    def openai(self) -> dict:
        """The call as an OpenAI message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class Parsed:
    content: str
    reasoning: str | None  # None: the answer has no thinking block
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # raw text of the parts that did not parse


def parse(text: str, first_index: int = 0, calls: bool = True) -> Parsed:
    """Read a whole answer (see the module's rules)."""
    stream = ToolCallStream(first_index, calls)
    stream.feed(text)
    stream.finish()
    return stream.parsed()


class ToolCallStream:
    """Reads an answer piece by piece; ``feed`` and ``finish`` return the OpenAI deltas the new text
    settles. Text that might still turn out to be (the start of) a marker is held back until the next
    piece or ``finish`` decides it, so no delta is ever taken back, and however the answer is cut
    into pieces the deltas add up to the same reading."""

    def __init__(self, first_index: int = 0, calls: bool = True):
        self.first_index = first_index
        self.calls_on = calls
        self._mode = "start"  # start -> reasoning | content; content <-> section
        self._buf = ""  # text not read yet
        self._held = {"reasoning_content": "", "content": ""}  # read, but not handed out yet
        self.content = ""
        self.reasoning: str | None = None
        self.calls: list[ToolCall] = []
        self.malformed: list[str] = []
        self._out: list[dict] = []

    def feed(self, piece: str) -> list[dict]:
        self._buf += piece
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        """The end of the answer: whatever is held back is settled."""
        self._advance(final=True)
        self._emit("content", "", final=True)
        return self._take()

    def parsed(self) -> Parsed:
        return Parsed(self.content, self.reasoning, list(self.calls), list(self.malformed))

    # -- the reader ---------------------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        while True:
            before = (self._mode, len(self._buf))
            getattr(self, "_read_" + self._mode)(final)
            if (self._mode, len(self._buf)) == before:
                return

    def _read_start(self, final: bool) -> None:
        lead = self._buf.lstrip()
        if lead.startswith(THINK_BEGIN):
            self._buf = lead[len(THINK_BEGIN):]
            self.reasoning = ""
            self._mode = "reasoning"
        elif final or not THINK_BEGIN.startswith(lead):
            self._mode = "content"

    def _read_reasoning(self, final: bool) -> None:
        at = self._buf.find(THINK_END)
        if at >= 0:
            self._emit("reasoning_content", self._buf[:at], final=True)
            self._buf = self._buf[at + len(THINK_END):]
            self._mode = "content"
            return
        keep = 0 if final else _partial_marker(self._buf, (THINK_END,))
        self._emit("reasoning_content", self._buf[:len(self._buf) - keep], final)
        self._buf = self._buf[len(self._buf) - keep:]

    def _read_content(self, final: bool) -> None:
        at = self._buf.find(SECTION_BEGIN) if self.calls_on else -1
        if at >= 0:
            self._emit("content", self._buf[:at], final=False)
            self._buf = self._buf[at + len(SECTION_BEGIN):]
            self._mode = "section"
            return
        keep = 0 if final or not self.calls_on else _partial_marker(self._buf, (SECTION_BEGIN,))
        self._emit("content", self._buf[:len(self._buf) - keep], final=False)
        self._buf = self._buf[len(self._buf) - keep:]

    def _read_section(self, final: bool) -> None:
        # Whitespace between the parts of a section is dropped; anything else that is not a part
        # (text where a call should begin) is content, up to the next part.
        buf = self._buf
        lead = buf.lstrip()
        if lead.startswith(SECTION_END):
            self._buf = lead[len(SECTION_END):]
            self._mode = "content"
        elif lead.startswith(CALL_BEGIN):
            end, again = lead.find(CALL_END), lead.find(CALL_BEGIN, len(CALL_BEGIN))
            if again >= 0 and (end < 0 or again < end):  # a call begun again before this one ended
                self._malformed(lead[:again].rstrip())
                self._buf = lead[again:]
            elif end >= 0:
                self._call(lead[:end + len(CALL_END)])
                self._buf = lead[end + len(CALL_END):]
            elif final:  # cut off inside a call
                self._malformed(lead)
                self._buf = ""
        else:
            ends = [i for i in (buf.find(CALL_BEGIN), buf.find(SECTION_END)) if i >= 0]
            if ends:
                self._malformed(buf[:min(ends)].rstrip())
                self._buf = buf[min(ends):]
            elif final:
                self._malformed(buf)
                self._buf = ""
            else:  # trailing whitespace may still turn out to come before a part
                settled = buf[:len(buf) - _partial_marker(buf, (CALL_BEGIN, SECTION_END))].rstrip()
                self._malformed(settled)
                self._buf = buf[len(settled):]

    def _call(self, raw: str) -> None:
        header, sep, args = raw[len(CALL_BEGIN):-len(CALL_END)].partition(ARGS_BEGIN)
        m = _HEADER.fullmatch(header.strip())
        arguments = args.strip()
        if sep and m and ARGS_BEGIN not in args and _is_json_object(arguments):
            call = ToolCall(call_id(m.group(1), self.first_index + len(self.calls)), m.group(1), arguments)
            self._out.append({"tool_calls": [{"index": len(self.calls), **call.openai()}]})
            self.calls.append(call)
        else:
            self._malformed(raw)

    # -- what comes out -------------------------------------------------------------------------
    def _emit(self, kind: str, text: str, final: bool) -> None:
        """Text read as ``kind``, out without markers: a tail that could still become one is held
        (markers are removed until none is left, as removing one may join the text around it into another)."""
        held = self._held[kind] + text
        while (cleaned := _without_markers(held)) != held:
            held = cleaned
        keep = 0 if final else _partial_marker(held, MARKERS)
        out, self._held[kind] = held[:len(held) - keep], held[len(held) - keep:]
        if out:
            if kind == "content":
                self.content += out
            else:
                self.reasoning += out
            self._out.append({kind: out})

    def _malformed(self, raw: str) -> None:
        if raw.strip():
            self.malformed.append(raw)
        self._emit("content", raw, final=False)

    def _take(self) -> list[dict]:
        """The deltas produced since the last call, neighbours of one kind merged."""
        merged: list[dict] = []
        for d in self._out:
            key = next(iter(d))
            if merged and key != "tool_calls" and next(iter(merged[-1])) == key:
                merged[-1] = {key: merged[-1][key] + d[key]}
            else:
                merged.append(d)
        self._out = []
        return merged


def _partial_marker(text: str, markers) -> int:
    """Length of the longest tail of ``text`` that is a proper start of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _without_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def number_calls(messages: list[dict]) -> tuple[list[dict], int]:
    """A conversation's history with every tool call's id renumbered ``functions.NAME:K`` (K counting
    the calls from 0) and each tool message's ``tool_call_id`` following its call, as the model was
    taught to read them; and how many calls there were (the next call's K). A tool message naming an
    id no call had keeps it. Clients that reuse ids across turns are fine: a tool message follows the
    latest call with its id."""
    out, renamed, count = [], {}, 0
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                new = call_id(c["function"]["name"], count)
                count += 1
                if c.get("id"):
                    renamed[c["id"]] = new
                calls.append({**c, "id": new})
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:
            m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
        out.append(m)
    return out, count
