"""What guided decoding costs: decode tok/s with and without a constraint, runs alternating.

Each round generates --tokens tokens after the same prompt once per case (no constraint, a JSON
schema, tool calls with tool_choice "required", tool calls under "auto"), in that order, so slow
and fast stretches of the machine fall on every case alike. Greedy, with speculation off (the mask
alone) and on (the default: drafts are cut at the first illegal token, forced tokens drafted). The
schemas' strings are unbounded so that every run decodes all its tokens inside the grammar. Prints
the median decode tok/s of each case and its change against no constraint, then the time the mask
itself takes per token (computing it, applying it, advancing the matcher), measured apart.

    python tools/grammar_cost.py --model PATH [--tokens 128] [--rounds 9] [--stream off]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deltafin  # noqa: E402
from deltafin.runtime.generate import generate  # noqa: E402
from deltafin.runtime.grammar import Constraint, Matcher  # noqa: E402
from deltafin.runtime.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "notes"]}
TOOLS = [{"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
CASES = {"none": None, "json_schema": Constraint.json_schema(SCHEMA),
         "tools required": Constraint.tool_calls(TOOLS, "required"), "tools auto": Constraint.tool_calls(TOOLS, "auto")}


def mask_seconds(model, constraint: Constraint, tokens: list[int]) -> float:
    """Mean seconds per token of the mask's own work along ``tokens``, on the model's logits' device."""
    m = Matcher(constraint, model.tokenizer, model.config.vocab_size, set(model.config.eos_token_ids))
    logits = torch.zeros(1, model.config.vocab_size, device=model.device)
    start = time.perf_counter()
    for t in tokens:
        row = logits.masked_fill(~m.allowed().to(logits.device), float("-inf"))
        int(row.argmax())
        m.advance(t)
    return (time.perf_counter() - start) / max(len(tokens), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--stream", default="off")
    args = ap.parse_args()
    model = deltafin.load(args.model, stream=args.stream)
    prompt = model.encode("Write the record as JSON, please: name, city, notes.")
    print(f"{args.model}: {args.tokens} tokens a run, {args.rounds} rounds, threads {model.threads}, "
          f"streaming {model.streaming}")
    for speculate in (False, True):
        rates: dict[str, list[float]] = {k: [] for k in CASES}
        last = {}
        for _ in range(args.rounds):
            for name, c in CASES.items():
                g = generate(model, prompt, SamplingParams(max_new_tokens=args.tokens, constraint=c, speculate=speculate))
                rates[name].append(g.stats["decode_tok_s"])
                last[name] = g
        base = statistics.median(rates["none"])
        print(f"speculate={speculate}: decode tok/s, median of {args.rounds} (min-max)")
        for name, r in rates.items():
            med = statistics.median(r)
            g = last[name]
            print(f"  {name:15s} {med:7.2f}  {100 * (med / base - 1):+5.1f}%  ({min(r):.1f}-{max(r):.1f})  "
                  f"{len(g.generated)} tokens, {g.finish_reason}, {g.stats['tokens_per_pass']:.2f} tokens/pass")
    print("the mask's own work per token:")
    for name, c in CASES.items():
        if c is not None:
            g = last[name]
            us = mask_seconds(model, c, g.generated) * 1e6
            print(f"  {name:15s} {us:7.1f} us  ({100 * us * 1e-6 * base:.2f}% of a token at {base:.1f} tok/s)")


if __name__ == "__main__":
    main()
