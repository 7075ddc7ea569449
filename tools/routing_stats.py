#!/usr/bin/env python3
"""Routing statistics of a model on a decode: expert popularity skew, token-to-token locality, and
the recall of the expert predictors a prefetcher can use (see deltafin/routing_stats.py).

    tools/routing_stats.py MODEL [--prompt-tokens 512] [--tokens 16] [--text FILE] [--guesses K] [--layers]

The prompt is random token ids (seeded) unless --text gives a file whose text is tokenized. Prints
one JSON record.
"""
import argparse
import json
import sys

import torch

import deltafin
from deltafin.routing_stats import predictor_recall, skew_stats, trace_routing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--tokens", type=int, default=16, help="greedy decode after the prompt")
    p.add_argument("--text", help="tokenize this file for the prompt instead of random ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guesses", type=int, default=None, help="predictor guesses per layer (default: top-k)")
    p.add_argument("--layers", action="store_true", help="also print per-layer figures")
    a = p.parse_args(argv)
    model = deltafin.load(a.model, stream="off")
    if a.text:
        with open(a.text, encoding="utf-8") as f:
            prompt = model.encode(f.read())[:a.prompt_tokens]
    else:  # ids the synthetic tokenizers and real vocabularies both have
        high = min(model.config.vocab_size, 480)
        prompt = torch.randint(0, high, (a.prompt_tokens,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    trace = trace_routing(model, prompt, a.tokens)
    stats = skew_stats(trace)
    recall = predictor_recall(trace, a.guesses)
    if not a.layers:
        stats.pop("layers")
        recall = {"guesses": recall["guesses"], "prev": recall["prev"]["mean"], "early": recall["early"]["mean"]}
    print(json.dumps({"model": a.model, "prompt": a.text or "random", **stats, "recall": recall}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
