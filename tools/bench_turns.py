"""Time to first token of a conversation's second turn, with the history's decode state reused vs a
full re-prefill, and a saved prompt state's load time vs its prefill time. Prints one JSON record.

    python tools/bench_turns.py --model PATH [--history-tokens 1000] [--new-tokens 8] [engine flags]

Turn 1 sends a user message of about ``--history-tokens`` tokens (chat template applied); turn 2
asks a short question. ``reused``: turn 2 on the conversation's live state (``deltafin chat``'s
path: only the new tokens are prefilled). ``full``: the same turn-2 prompt prefilled from nothing,
as a server without a prefix cache does. Both answers must be the same tokens. Time to first token
is the time of the pass that produces the first token (reuse overhead, such as copying the state
kept after the prompt, included). The prompt state is the state kept after turn 1's prompt, written
with ``save_state`` and read back with ``load_state`` (identity check and tensor checks included;
the model identity fingerprint is timed separately since a process computes it once); its prefill
time is turn 1's time to first token.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from deltafin.runtime.sampling import SamplingParams
import deltafin
from deltafin.chat import Conversation
from deltafin.checkpoint.tokenizer_data import CORPUS
from deltafin.runtime.saved_state import load_state, save_state
from deltafin.settings import add_arguments, from_args


def history_text(model, tokens: int) -> str:
    """Real prose and code, repeated until it is about ``tokens`` tokens long."""
    text, paragraphs = "", [p for p in CORPUS.split("\n\n") if p.strip()]
    i = 0
    while len(model.encode(text)) < tokens:
        text += paragraphs[i % len(paragraphs)] + "\n\n"
        i += 1
    ids = model.encode(text)[:tokens]
    return model.decode(ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--history-tokens", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per turn")
    add_arguments(p, groups=("engine",))
    args = p.parse_args(argv)
    settings = from_args(args)
    model = deltafin.load(args.model, settings=settings)
    n = args.new_tokens
    question = "Summarize the text above in one sentence."

    conv = Conversation(model, system="You are a helpful assistant.")
    t1 = conv.ask("Read this:\n\n" + history_text(model, args.history_tokens), SamplingParams(max_new_tokens=n, speculate=False))
    turn1 = dict(conv.last)
    prompt_ids, prompt_state = conv.anchor  # the state right after turn 1's prompt
    history = list(conv.messages)
    reused = conv.ask(question, SamplingParams(max_new_tokens=n, speculate=False))
    turn2 = dict(conv.last)

    fresh = Conversation(model, system="You are a helpful assistant.")
    fresh.messages = history
    full = fresh.ask(question, SamplingParams(max_new_tokens=n, speculate=False))
    turn2_full = dict(fresh.last)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompt.state"
        ids, state, prefill_s = prompt_ids, prompt_state, turn1["prefill_seconds"]
        model.__dict__.pop("identity", None)  # time the fingerprint on its own
        t0 = time.perf_counter()
        _ = model.identity
        identity_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        save_state(model, path, ids, state)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded_ids, loaded, _ = load_state(model, path)
        load_s = time.perf_counter() - t0
        same = loaded_ids == ids and loaded.max_abs_diff(state) == 0.0
        record_state = {"tokens": len(ids), "bytes": path.stat().st_size, "prefill_s": prefill_s,
                        "save_s": save_s, "load_s": load_s, "identity_s": identity_s,
                        "prefill_over_load": prefill_s / load_s, "identical_after_load": same}

    record = {
        "model": str(args.model), "architecture": model.config.architecture, "layers": model.config.num_layers,
        "streaming": model.streaming, "threads": model.threads, "settings": settings.summary(),
        "turn1": {"prompt_tokens": turn1["prefilled_tokens"], "ttft_s": turn1["prefill_seconds"],
                  "answer_tokens": len(t1.generated)},
        "turn2": {"prompt_tokens": turn2["reused_tokens"] + turn2["prefilled_tokens"],
                  "reused_tokens": turn2["reused_tokens"], "prefilled_tokens": turn2["prefilled_tokens"],
                  "ttft_reused_s": turn2["prefill_seconds"], "ttft_full_s": turn2_full["prefill_seconds"],
                  "ttft_speedup": turn2_full["prefill_seconds"] / turn2["prefill_seconds"],
                  "identical_output": reused.tokens == full.tokens, "answer_tokens": len(reused.tokens)},
        "prompt_state": record_state,
    }
    json.dump(record, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
