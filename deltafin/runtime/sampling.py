"""How one generation picks its tokens and when it stops: one frozen value, made once by a front end
(a request, the command line, a Python call) and handed down unchanged to the ``Decoding`` that uses
it. Its checks live here, so a bad value is refused where it is made, with the parameter named.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from .grammar import Constraint

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = None  # None: the model's setting (max_new_tokens)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # < 1: sample from the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # > 0: sample from the k most likely tokens
    seed: int | None = None  # the same seed gives the same output; None: fresh entropy per generation
    stop: tuple[str, ...] = ()  # text that ends the generation (not shown)
    speculate: bool | None = None  # greedy only: verified n-gram drafts (same output); None: the setting
    constraint: Constraint | None = None  # what the output must be (JSON, tool calls: runtime.grammar)
    logprobs: int | None = None  # k: each emitted token's logprob and the k most likely alternatives

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        if self.max_new_tokens is not None and int(self.max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= int(self.seed) <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def speculates(self, setting: bool) -> bool:
        """Whether a generation with these parameters drafts and checks tokens: greedy only, as asked here
        or else as the model's `speculate` setting says."""
        return self.greedy and (setting if self.speculate is None else bool(self.speculate))

    @property
    def deterministic(self) -> bool:
        """Greedy, or sampling from a fixed seed: the same prompt gives the same output."""
        return self.greedy or self.seed is not None

    def canonical(self) -> "SamplingParams":
        """The same generation with the knobs it ignores reset: greedy decoding ignores top_p, top_k and
        the seed, so every greedy request with the same length and stops is one (e.g. one memo key)."""
        if self.greedy:
            return dataclasses.replace(self, top_p=1.0, top_k=0, seed=None)
        return self

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line's sampling flags (``from_args`` reads them back)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def from_args(args: argparse.Namespace, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
