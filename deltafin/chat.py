"""``deltafin chat``: a multi-turn conversation in the terminal that never re-reads its history.

``Conversation`` keeps the decode state of the conversation so far. Each turn renders the whole
conversation with the checkpoint's chat template and prefills only the tokens the state does not
hold yet. The REPL around it streams answers, turns Ctrl-C into "stop this answer" (the state then
holds exactly the tokens that were fed), and offers /tools, /reset, /stats, /save, /load, /help, /quit.

With tools loaded (``/tools FILE``: OpenAI function tools, as JSON), each answer may call them: the
calls are constrained to the tools' schemas, shown as they are made, and the REPL asks for each
call's result; the results go back as tool messages and the model answers again. A thinking block
at the start of an answer is shown on the error stream and kept apart from the answer's text.
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .errors import DeltafinError
from .model.state import DecodeState, StateFileError
from .runtime import sampling
from .runtime.generate import Generation, generate
from .runtime.grammar import Constraint, GrammarError
from .runtime.sampling import SamplingParams
from .units import MiB
from .runtime.tool_calls import Parsed, ToolCallStream, parse

HELP = """commands:
  /tools FILE  offer the tools in FILE (a JSON list of OpenAI function tools) to the model;
               /tools lists them, /tools off takes them away
  /reset       forget the conversation (keeps the system prompt)
  /stats       tokens held, what the last turn reused and prefilled, speeds
  /save FILE   write the conversation and its decode state to FILE
  /load FILE   continue a conversation saved with /save (same model, codec and dtype)
  /help        this list
  /quit        leave (Ctrl-D too); Ctrl-C stops the answer being written"""


def fixed_prefix(model, messages: list[dict]) -> list[int]:
    """The ids every next turn starts with: what the template renders before a new user message.

    Found as the common prefix of two renderings that differ only in that message's text, which
    holds for any template without knowing its markup."""
    a = model.encode_chat(messages + [{"role": "user", "content": "x"}])
    b = model.encode_chat(messages + [{"role": "user", "content": "y"}])
    return a[:common_prefix(a, b)]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """A conversation and the decode state that holds it.

    ``held`` is what the live state holds: the last prompt followed by the answer's tokens as they
    were fed. A new turn whose rendering starts with ``held`` prefills only the rest. A template
    may render a past answer differently from how it was generated (whitespace trimmed, a thinking
    part dropped); then the copy kept right after the last prompt (``anchor``) is the longest
    usable prefix, and failing that the ``base`` state (the fixed prefix from a prompt cache) or
    nothing. KDA states cannot be cut back, so these kept copies are the only ways back.
    """

    def __init__(self, model, system: str | None = None, base: tuple[list[int], DecodeState] | None = None,
                 tools: list[dict] | None = None, tool_choice="auto"):
        self.model = model
        self.system = system
        self.base = base
        self.tools = tools  # OpenAI function tools offered to the model, or None
        # For the answer to each user message: "auto", "required" or {"name": NAME}. An answer to tool
        # results is always "auto" (it may call again or answer), as agent frameworks do, so that a
        # required call cannot loop for ever.
        self.tool_choice = tool_choice
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        if self.base is not None:
            self.held, self.state = list(self.base[0]), self.base[1].snapshot()
        else:
            self.held, self.state = [], self.model.new_state()
        self.anchor: tuple[list[int], DecodeState] | None = None
        self.last: dict = {}
        self.answer: Parsed | None = None  # the last answer, read for reasoning and tool calls

    def _start(self, ids: list[int]) -> tuple[int, DecodeState, str | None]:
        """(tokens reused, the state to continue, a note when the live state could not be used)."""
        if len(self.held) < len(ids) and ids[:len(self.held)] == self.held:
            return len(self.held), self.state, None
        shared = common_prefix(self.held, ids)
        for name, kept in (("the state kept after the last prompt", self.anchor), ("the prompt cache", self.base)):
            if kept is not None and len(kept[0]) < len(ids) and ids[:len(kept[0])] == kept[0]:
                note = (f"the chat template renders the conversation differently from what was fed (they share "
                        f"{shared} of {len(self.held)} tokens); continuing from {name}, {len(kept[0])} tokens")
                return len(kept[0]), kept[1].snapshot(), note
        note = (f"the chat template renders the conversation differently from what was fed (they share {shared} "
                f"of {len(self.held)} tokens) and no kept state is a prefix; prefilling all {len(ids)} tokens")
        return 0, self.model.new_state(), note if self.held else None

    @property
    def calls_made(self) -> int:
        """Tool calls in the conversation so far (the next call's index K in functions.NAME:K)."""
        return sum(len(m.get("tool_calls") or ()) for m in self.messages)

    def ask(self, text: str, params: SamplingParams | None = None, on_note=None, **kw) -> Generation:
        """One turn: the user's ``text`` in, the answer out (``params`` and ``kw`` go to ``generate``)."""
        return self._turn(self.messages + [{"role": "user", "content": text}], params, on_note, self.tool_choice,
                          **kw)

    def send_results(self, results: list[tuple[str, str]], params: SamplingParams | None = None, on_note=None,
                     **kw) -> Generation:
        """The results of the last answer's tool calls, as (call id, text), go back; the model answers."""
        messages = self.messages + [{"role": "tool", "tool_call_id": cid, "content": text} for cid, text in results]
        return self._turn(messages, params, on_note, "auto", **kw)

    def _turn(self, messages: list[dict], params: SamplingParams | None, on_note, tool_choice, **kw) -> Generation:
        params = SamplingParams() if params is None else params
        first = self.calls_made
        if self.tools and params.constraint is None:
            # Calls' arguments follow the tools' schemas (under "auto" the answer may be text instead).
            params = params.replace(constraint=Constraint.tool_calls(self.tools, tool_choice, first_index=first))
        ids = self.model.encode_chat(messages, tools=self.tools)
        n, state, note = self._start(ids)
        if note and on_note:
            on_note(note)
        def keep(st: DecodeState) -> None:
            self.anchor = (list(ids), st.snapshot())

        limit = self.model.config.max_position_embeddings
        budget = self.model.settings.max_new_tokens if params.max_new_tokens is None else params.max_new_tokens
        if len(ids) + budget > limit:  # refused before the state is touched
            raise ValueError(f"the conversation is {len(ids)} tokens; with {budget} new tokens it exceeds the "
                             f"model's context of {limit} (/reset starts over)")
        try:
            g = generate(self.model, ids[n:], params, state=state, held_ids=ids[:n], on_prefill=keep,
                         special_text=True, **kw)
        except BaseException:
            # The state may be half-updated: forget it rather than continue from something unknown.
            self.held, self.state = [], self.model.new_state()
            raise
        self.state, self.held = g.state, ids + g.generated[:-1]
        self.answer = parse(g.text or "", first, calls=bool(self.tools))
        reply = {"role": "assistant", "content": self.answer.content}
        if self.answer.reasoning is not None:
            reply["reasoning_content"] = self.answer.reasoning
        if self.answer.calls:
            reply["tool_calls"] = [c.openai() for c in self.answer.calls]
        self.messages = messages + [reply]
        self.last = {"reused_tokens": n, "prefilled_tokens": len(ids) - n, **g.stats,
                     "finish_reason": g.finish_reason}
        return g

    def save(self, path) -> None:
        from .runtime.saved_state import save_state
        save_state(self.model, path, self.held, self.state, extra={"messages": self.messages, "tools": self.tools})

    def load(self, path) -> None:
        from .runtime.saved_state import load_state
        ids, state, meta = load_state(self.model, path)
        messages = meta.get("messages")
        if (not isinstance(messages, list)
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages)):
            raise StateFileError(f"{path}: a decode state, but not a saved conversation (no messages)")
        tools = meta.get("tools")
        if tools is not None:
            try:
                tools = check_tools(tools)
            except ValueError as e:
                raise StateFileError(f"{path}: the saved tools are not usable: {e}") from None
        self.messages, self.held, self.state, self.anchor, self.last = messages, ids, state, None, {}
        self.tools, self.answer = tools, None

    def stats_line(self) -> str:
        mb = self.state.nbytes() / MiB
        head = f"{len(self.messages)} messages, state holds {len(self.held)} tokens ({mb:.1f} MiB)"
        s = self.last
        if not s:
            return head
        # The first token comes out of the prefill pass: prefill time is the time to the first token.
        return (f"{head}; last turn: reused {s['reused_tokens']} tokens, prefilled {s['prefilled_tokens']} "
                f"(first token after {s['prefill_seconds']:.2f} s), {s['tokens']} tokens at "
                f"{s['decode_tok_s']:.2f} tok/s ({s['tokens_per_pass']:.2f} tokens/pass), finish: {s['finish_reason']}")


def check_tools(tools) -> list[dict]:
    """OpenAI function tools, checked as a request's are; a bare function ({"name", "parameters", ...})
    is taken as {"type": "function", "function": it}. ValueError says what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("expected a non-empty JSON list of tools")
    tools = [t if isinstance(t, dict) and "function" in t else {"type": "function", "function": t} for t in tools]
    try:
        Constraint.tool_calls(tools)
    except GrammarError as e:
        raise ValueError(str(e)) from None
    return tools


def load_tools(path) -> list[dict]:
    from .files import read_json
    try:
        return check_tools(read_json(path, "a tools file"))
    except (DeltafinError, OSError) as e:
        raise ValueError(str(e)) from None


class _StopOnInterrupt:
    """While generating, Ctrl-C asks the answer to stop (at the next token) instead of raising."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._before)
        return False


def repl(conv: Conversation, args, inp=None, out=None, err=None) -> int:
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    interactive = inp.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    print("deltafin chat: type a message; /help lists commands; Ctrl-C stops an answer, Ctrl-D leaves",
          file=err, flush=True)
    while True:
        try:
            line = input("> ") if interactive else inp.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:  # at the prompt: drop the line, like a shell
            print(file=out)
            continue
        if not line:
            if interactive:
                print(file=out)
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("/"):
            if command(conv, line, out, err):
                return 0
            continue
        g = _answer(conv, args, out, err, text=line)
        while g is not None and g.finish_reason != "cancelled" and conv.answer.calls:
            results = []
            try:
                for call in conv.answer.calls:
                    result = _read_line(f"result of {call.id}> ", interactive, inp)
                    if result is None:  # the input ended
                        return 0
                    results.append((call.id, result))
            except KeyboardInterrupt:
                print("\n[tool results not sent]", file=err, flush=True)
                break
            g = _answer(conv, args, out, err, results=results)


def _answer(conv: Conversation, args, out, err, text: str | None = None,
            results: list[tuple[str, str]] | None = None) -> Generation | None:
    """One turn (the user's ``text``, or the results of the last answer's tool calls), streaming the
    answer: its text to ``out``, its thinking to ``err``, each tool call as it is made. None when the
    turn was refused (the context overflowing, the template)."""
    stop = _StopOnInterrupt()
    reader = ToolCallStream(conv.calls_made, calls=bool(conv.tools))

    def show(deltas) -> None:
        for d in deltas:
            if "content" in d:
                out.write(d["content"])
            elif "reasoning_content" in d:
                err.write(d["reasoning_content"])
                err.flush()
            else:
                call = d["tool_calls"][0]
                out.write(f"\n[tool call {call['id']}: {call['function']['name']} {call['function']['arguments']}]")
        out.flush()

    def on_token(token: int, piece: str):
        show(reader.feed(piece))
        return not stop.hit

    def note(message: str) -> None:
        print(f"[{message}]", file=err, flush=True)

    try:
        with stop:
            params = sampling.from_args(args, args.max_new_tokens)
            if results is None:
                g = conv.ask(text, params, on_note=note, on_token=on_token)
            else:
                g = conv.send_results(results, params, on_note=note, on_token=on_token)
    except ValueError as e:  # the template refusing the messages, the context overflowing
        print(f"[{e}]", file=err, flush=True)
        return None
    show(reader.finish())
    print(file=out, flush=True)
    if g.finish_reason == "cancelled":
        print("[answer stopped]", file=err, flush=True)
    return g


def _read_line(prompt: str, interactive: bool, inp) -> str | None:
    """One line of input (None at its end)."""
    try:
        line = input(prompt) if interactive else inp.readline()
    except EOFError:
        return None
    if not interactive and not line:
        return None
    return line.rstrip("\n")


def command(conv: Conversation, line: str, out, err) -> bool:
    """Run one /command; True means leave."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return True
    if name == "/help":
        print(HELP, file=out)
    elif name == "/tools":
        if arg == "off":
            conv.tools = None
            print("[tools taken away]", file=err)
        elif arg:
            try:
                conv.tools = load_tools(Path(arg).expanduser())
            except ValueError as e:
                print(f"[/tools failed: {e}]", file=err)
                return False
            print(f"[{len(conv.tools)} tools: {', '.join(t['function']['name'] for t in conv.tools)}]", file=err)
        else:
            names = ", ".join(t["function"]["name"] for t in conv.tools or ())
            print(f"[tools: {names}]" if names else "[no tools; /tools FILE offers some]", file=err)
    elif name == "/reset":
        conv.reset()
        print("[conversation reset]", file=err)
    elif name == "/stats":
        print(conv.stats_line(), file=out)
    elif name in ("/save", "/load"):
        if not arg:
            print(f"[{name} needs a file name]", file=err)
            return False
        try:
            (conv.save if name == "/save" else conv.load)(Path(arg).expanduser())
        except (StateFileError, OSError, ValueError) as e:
            print(f"[{name} failed: {e}]", file=err)
            return False
        print(f"[{'saved' if name == '/save' else 'loaded'} {len(conv.held)} tokens, {len(conv.messages)} "
              f"messages {'to' if name == '/save' else 'from'} {arg}]", file=err)
    else:
        print(f"[unknown command {name}; /help lists them]", file=err)
    out.flush()
    err.flush()
    return False


def add_cli(subparsers) -> argparse.ArgumentParser:
    from . import settings as settings_mod
    p = subparsers.add_parser("chat", help="talk with a model in the terminal (multi-turn, streamed)",
                              description="An interactive conversation on the checkpoint's chat template. Each "
                                          "turn prefills only the new tokens. Without --model, uses the built-in "
                                          "default model.")
    p.add_argument("--model", metavar="PATH", help="checkpoint folder or converted store")
    p.add_argument("--system", help="system prompt; @FILE reads it from a file")
    sampling.add_arguments(p)
    settings_mod.add_arguments(p)
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from .startup import load_announced, read_text_arg, record_passes_announced
    from .runtime.saved_state import restore_or_build
    from .settings import from_args

    settings = from_args(args)
    model, path = load_announced(args.model, settings)
    tok = model.require_tokenizer()
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: this checkpoint has no chat template; use deltafin run instead")
    args.max_new_tokens = settings.max_new_tokens
    # A conversation grows turn by turn: its graphs are recorded for the longest buffers sized ahead.
    record_passes_announced(model, sampling.from_args(args, args.max_new_tokens), model.config.max_position_embeddings)
    system = read_text_arg(args.system) if args.system is not None else None
    conv = Conversation(model, system)
    if settings.prompt_cache:
        prefix = fixed_prefix(model, conv.messages)
        state = restore_or_build(model, settings.prompt_cache, prefix,
                                 lambda m: print(f"deltafin: {m}", file=sys.stderr))
        conv.base = (prefix, state)
        conv.reset()
    return repl(conv, args)
