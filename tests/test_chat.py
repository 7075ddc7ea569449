"""`deltafin chat` and prompt input: each turn prefills only new tokens and answers as a full
prefill would; Ctrl-C stops an answer and leaves the state holding exactly what was fed; the
commands work and refuse bad files; `run` reads prompts from stdin and files, and keeps a prompt
cache that is refused when it belongs to another model."""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from deltafin.runtime.sampling import SamplingParams
import deltafin
from deltafin.chat import Conversation, fixed_prefix, repl
from deltafin.cli import main
from deltafin.runtime.generate import generate
from conftest import KL_CODE_TINY as CODE_TINY

STATE_TOL = 1e-4


@pytest.fixture(scope="module")
def k3(tiny_k3_path):
    m = deltafin.load(tiny_k3_path, device="cpu", stream="off", threads=1, max_new_tokens=8)
    torch.set_num_threads(1)
    return m


@pytest.fixture(scope="module")
def trained():
    if not (CODE_TINY / "config.json").exists():
        pytest.skip("the trained tiny model is not on this machine")
    m = deltafin.load(CODE_TINY, device="cpu", stream="off", threads=1, max_new_tokens=10)
    torch.set_num_threads(1)
    return m


def prefilled(model, ids):
    st = model.new_state()
    model.forward(list(ids), st)
    return st


def args(**kw):
    base = dict(max_new_tokens=None, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None)
    return SimpleNamespace(**{**base, **kw})


def test_each_turn_prefills_only_new_tokens_and_answers_as_a_full_prefill(trained):
    conv = Conversation(trained, system="You write Python.")
    for i, text in enumerate(["def add(a, b):", "Now subtract.", "And multiply."]):
        held = len(conv.held)
        g = conv.ask(text)
        assert conv.last["reused_tokens"] == held  # the template renders past turns as they were fed
        whole = generate(trained, trained.encode_chat(conv.messages[:-1]), SamplingParams())
        assert (g.tokens, g.text) == (whole.tokens, whole.text)
        assert conv.state.max_abs_diff(prefilled(trained, conv.held)) <= STATE_TOL
    assert conv.last["prefilled_tokens"] < len(conv.held) // 2


def test_a_differently_rendered_answer_falls_back_to_the_kept_prompt_state(k3):
    conv = Conversation(k3)
    conv.ask("Hello")
    first_prompt = conv.anchor[0]
    conv.messages[-1]["content"] = "an answer the model never gave"
    notes = []
    g = conv.ask("Again", on_note=notes.append)
    assert conv.last["reused_tokens"] == len(first_prompt)
    assert "differently" in notes[0] and "kept after the last prompt" in notes[0]
    whole = generate(k3, k3.encode_chat(conv.messages[:-1]), SamplingParams())
    assert g.tokens == whole.tokens
    assert conv.state.max_abs_diff(prefilled(k3, conv.held)) <= STATE_TOL


class _CtrlCOnFirstPiece(io.StringIO):
    """Standard output that gets a real SIGINT the first time an answer writes to it."""

    def __init__(self):
        super().__init__()
        self.sent = False

    def write(self, s):
        if s and not self.sent and self.tell() > 0:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_stops_the_answer_not_the_program(k3, tmp_path):
    out, err = _CtrlCOnFirstPiece(), io.StringIO()
    out.write("\n")  # the write that follows is the first answer piece
    # What SIGINT did before (a job started in the background inherits SIG_IGN, not Python's default).
    before = signal.getsignal(signal.SIGINT)
    conv = Conversation(k3)
    lines = "Tell me a long story\n/stats\nShorter\n/quit\n"
    assert repl(conv, args(max_new_tokens=8), inp=io.StringIO(lines), out=out, err=err) == 0
    assert out.sent and "[answer stopped]" in err.getvalue()
    assert len(conv.messages) == 4  # both turns happened
    assert conv.state.max_abs_diff(prefilled(k3, conv.held)) <= STATE_TOL
    assert "state holds" in out.getvalue()
    assert signal.getsignal(signal.SIGINT) == before  # handler given back


def test_save_load_reset_and_bad_files(k3, tiny_kl_path, tmp_path):
    conv = Conversation(k3)
    conv.ask("Hello")
    held, messages = list(conv.held), list(conv.messages)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x07" * 100)
    kl = deltafin.load(tiny_kl_path, device="cpu", stream="off", threads=1)
    torch.set_num_threads(1)
    other = Conversation(kl)
    other.ask("Hi")
    other.save(tmp_path / "kl.state")
    from deltafin.runtime.saved_state import save_state
    save_state(k3, tmp_path / "plain.state", conv.held, conv.state)  # a state, but no conversation
    out, err = io.StringIO(), io.StringIO()
    lines = (f"/save {tmp_path / 'c.state'}\n/reset\n/stats\n/load {tmp_path / 'c.state'}\n/load {garbage}\n"
             f"/load {tmp_path / 'kl.state'}\n/load {tmp_path / 'plain.state'}\n/load\n/load {tmp_path}\n/help\n")
    assert repl(conv, args(), inp=io.StringIO(lines), out=out, err=err) == 0
    e = err.getvalue()
    assert "[saved" in e and "[conversation reset]" in e and "[loaded" in e
    assert "not a readable state file" in e and "different" in e and "not a saved conversation" in e
    assert "needs a file name" in e and "/load failed" in e
    assert "/save FILE" in out.getvalue()
    assert (conv.held, conv.messages) == (held, messages)  # failed loads changed nothing
    g = conv.ask("More")  # continues from the loaded state (as far as the template renders it the same)
    assert g.tokens == generate(k3, k3.encode_chat(conv.messages[:-1]), SamplingParams()).tokens


def test_a_conversation_too_long_for_the_context_is_refused_and_kept(k3):
    conv = Conversation(k3)
    conv.ask("Hello")
    held = list(conv.held)
    err = io.StringIO()
    repl(conv, args(max_new_tokens=10 ** 6), inp=io.StringIO("again\n"), out=io.StringIO(), err=err)
    assert "exceeds the model's context" in err.getvalue()
    assert conv.held == held and conv.state.num_tokens == len(held)


def test_chat_cli_through_a_pipe_with_a_prompt_cache(tiny_k3_path, tmp_path):
    cache = tmp_path / "sys.state"
    cmd = [sys.executable, "-m", "deltafin", "chat", "--model", str(tiny_k3_path), "--stream", "off",
           "--max-new-tokens", "4", "--system", "You are terse.", "--prompt-cache", str(cache)]
    env = dict(os.environ, DELTAFIN_THREADS="1")
    for made in (True, False):
        r = subprocess.run(cmd, input="Hi\n/stats\n", capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert ("saved the state" if made else "restored the state") in r.stderr
        prefix = re.search(r"the state after (\d+) tokens", r.stderr).group(1)
        assert "3 messages, state holds" in r.stdout and f"reused {prefix} tokens" in r.stdout


def test_fixed_prefix_is_what_every_turn_starts_with(k3):
    p = fixed_prefix(k3, [{"role": "system", "content": "Be brief."}])
    for text in ("a", "something longer"):
        ids = k3.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
        assert ids[:len(p)] == p and len(p) < len(ids)


def test_run_reads_the_prompt_from_stdin_or_a_file(tiny_k3_path, tmp_path, capsys, monkeypatch):
    base = ["run", "--model", str(tiny_k3_path), "--stream", "off", "--max-new-tokens", "3"]
    assert main(base + ["Once upon a time"]) == 0
    direct = capsys.readouterr().out
    (tmp_path / "p.txt").write_text("Once upon a time")
    assert main(base + [f"@{tmp_path / 'p.txt'}"]) == 0
    assert capsys.readouterr().out == direct
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    assert main(base + ["-"]) == 0
    assert capsys.readouterr().out == direct
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "empty.txt").write_text("")
    for arg, message in ((f"@{tmp_path / 'nope.txt'}", "no such prompt file"), (f"@{tmp_path / 'bad.txt'}", "UTF-8"),
                         (f"@{tmp_path}", "cannot read"), (f"@{tmp_path / 'empty.txt'}", "empty")):
        assert main(base + [arg]) == 2
        assert message in capsys.readouterr().err


def test_run_prompt_cache_restores_extends_and_refuses(tiny_k3_path, tiny_kl_path, tmp_path, capsys):
    cache = tmp_path / "p.state"
    base = ["--stream", "off", "--max-new-tokens", "3", "--prompt-cache", str(cache)]
    k3 = ["run", "--model", str(tiny_k3_path), *base]
    assert main(k3 + ["Once upon a time"]) == 0
    first = capsys.readouterr()
    assert "saved the state" in first.err
    assert main(k3 + ["Once upon a time"]) == 0
    again = capsys.readouterr()
    assert "restored the state" in again.err and again.out == first.out
    assert main(k3 + ["Once upon a time there was"]) == 0
    assert "reused" in capsys.readouterr().err  # the saved prefix extended
    assert main(k3 + ["Something else entirely"]) == 0
    assert "holds a different prefix" in capsys.readouterr().err
    made = cache.read_bytes()
    assert main(["run", "--model", str(tiny_kl_path), *base, "Once upon a time"]) == 2
    assert "cannot be reused here" in capsys.readouterr().err
    assert cache.read_bytes() == made  # a refused file is left as it was
