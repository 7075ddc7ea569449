"""The generation loop: greedy with lossless n-gram speculation, or seeded sampling, either of them
optionally under a constraint (runtime.grammar: JSON, tool calls) applied as a mask per token.

One function, ``generate``, serves the CLI, the HTTP server and the Python API. It owns the
contract every front end relies on: at most ``max_new_tokens`` tokens, nothing after an EOS
token, stop strings never shown, text released only once it is safe, cancellation through the
``on_token`` callback, and a decode state that is exactly a plain prefill of what was produced.

Speculation (greedy only): the drafter proposes up to ``draft_len`` tokens by matching the most
recent n-gram of prompt + output against earlier text, cut shorter where drafts from matches of that
length have been missing (``DraftLengths``). One forward pass over
``[last token, d1..dk]`` scores every draft position; the longest prefix of the draft that equals
the verifier's argmax is accepted together with the verifier's own next token, and the state is
rolled back to the last accepted position. Every emitted token is therefore the argmax the model
gives after exactly the tokens before it, so the output equals plain greedy decoding.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .engine import Seq
from .grammar import Matcher, special_ids
from .sampling import SamplingParams
from ..tokenizer import stream_decoder

if TYPE_CHECKING:
    from deltafin.model.state import DecodeState

# (context, max_len) -> up to max_len proposed token ids following the context
Drafter = Callable[[Sequence[int], int], Sequence[int]]
# (token_id, its text once safe to show) -> False to cancel
OnToken = Callable[[int, str], "bool | None"]

# Shortest n-gram that may draft. A verified draft token costs its own routed experts (top-k reads
# per MoE layer), so drafts must be likely to be accepted; single-token matches rarely are.
MIN_NGRAM = 2
# An n-gram draft is verified up to its last token whose chance of being used (all the tokens before it
# accepted too) is at least this, as the generation's own drafts of that match length have gone so far
# (DraftLengths). Greedy kl-code-tiny, six code prompts of 256 tokens, replayed against the costs of a
# pass by rows (tools/draft_replay.py; an H200's replayed passes, kl_medium q8 and kl-code-tiny in RAM):
# 0.2-0.4 within 7 % of each other, every draft whole 4-9 % slower than at 0.3 (docs/benchmarks.md).
DRAFT_KEEP_CHANCE = 0.3


@dataclass
class Generation:
    tokens: list[int]  # emitted tokens (no EOS, nothing from inside a stop string)
    text: str | None  # emitted text; None when the model has no tokenizer
    # "stop" (EOS, stop string, or the constrained output complete) | "tool_calls" (a constrained
    # tool-call section complete) | "length" | "cancelled"
    finish_reason: str
    stats: dict[str, Any]
    # Every token the model produced, in order: ``tokens`` plus a final EOS, the tokens dropped by
    # a stop string, or tokens produced but still held back when the caller cancelled. The decode
    # state holds the prompt followed by all of these except the last one (which was never fed).
    generated: list[int] = field(default_factory=list)
    state: "DecodeState | None" = None
    # With SamplingParams.logprobs: one (token_id, logprob, [(alt_id, alt_logprob), ...]) per entry
    # of ``tokens``, the alternatives the k most likely tokens, most likely first.
    logprobs: list | None = None


def generate(model, prompt_ids: Sequence[int], params: SamplingParams | None = None, **options) -> Generation:
    """Generate after ``prompt_ids`` as ``params`` says (default: greedy, the model's max_new_tokens):
    one ``Decoding`` driven alone, one forward pass at a time. The options are ``Decoding``'s."""
    d = Decoding(model, prompt_ids, params, **options)
    while not d.done:
        d.take(model.forward_batch([d.next_pass()])[0])
    return d.result()


class Decoding:
    """One sequence's generation, advanced one forward pass at a time.

    ``next_pass()`` says what the next pass must feed this sequence (a ``Seq``); ``take(logits)``
    hands that pass's logits back. ``generate`` drives one Decoding alone; the server's scheduler
    drives several through one batched pass. Nothing here depends on the other sequences of a
    pass, so a request's output is the same however it is batched (up to the rounding of matrix
    products over a different number of rows).

    ``params`` (a ``SamplingParams``; default greedy) says how tokens are picked and when generation
    stops; ``None`` for its ``max_new_tokens`` or ``speculate`` means the model's settings. The prompt is
    prefilled after whatever ``state`` already holds (a fresh state if none is given), in pieces of
    ``prefill_chunk`` tokens when that is > 0, else in the pieces the model's ``prompt_piece`` says
    the free memory holds (one pass for any prompt that fits; runtime.prompt_piece). The state is returned in
    ``Generation.state``. ``held_ids`` are the token ids that ``state`` already holds (a reused
    prefix): they change nothing in the computation, but give the drafter and the detokenizer the
    same context as a full prefill would, so the output is the same text. ``on_prefill(state)`` is
    called after each prefill pass, e.g. to keep a copy: the state then holds ``held_ids`` and the
    prompt fed so far (all of it, the last time).

    Decoding is greedy when ``temperature`` is 0. With ``temperature > 0`` tokens are sampled
    (``top_k`` > 0 keeps the k most likely, ``top_p`` < 1 keeps the smallest set whose probability
    reaches top_p) from a ``torch.Generator`` seeded with ``seed``: the same seed gives the same
    output (on a CUDA device the draw runs there, from a generator of that device: the same seed gives
    the same output on it, but not the CPU's). Sampling never speculates (``speculate`` is ignored),
    which keeps it trivially exact.

    Greedy decoding speculates with n-gram drafts when ``speculate`` is on; the output is the same
    token for token. ``drafter(context, max_len)`` replaces the n-gram drafter (its proposals only
    change speed, never the output).

    Termination: an EOS token (``eos_token_ids``, default the model config's) ends generation with
    finish_reason "stop"; it is not returned and not passed to ``on_token``. A stop string ends it
    with "stop": ``text`` ends right before the stop string; a token is kept in ``tokens`` iff its
    text starts before the stop string, so a token straddling the start of the stop string is kept
    (its part before the stop string is in ``text``) and tokens starting inside it are dropped.
    Reaching ``max_new_tokens`` gives "length".

    Constraint (``params.constraint``, runtime.grammar): every token is picked among those the
    constraint allows after the tokens before it (the others' logits are -inf), greedy or sampled.
    Speculation composes: a draft is cut at its first token the constraint forbids, and the
    verifier's pick at every position is the masked argmax, so the output is the same as without
    drafts; where the grammar forces the next tokens (a function name, a JSON key) they are the
    draft. End tokens are allowed only where the constrained output may end. When it is complete
    generation ends: "tool_calls" after a tool-call section, "stop" otherwise.

    ``logprobs`` (``params.logprobs`` = k): ``Generation.logprobs``, and ``on_logprob(entry)`` called
    with each returned token's entry right before its ``on_token`` call (for streaming).

    ``special_text``: the text keeps the tool-call section's special tokens and <think> / </think>
    (for the tool-call parser); on whenever the constraint may produce them. Other special tokens
    never appear in the text.

    ``on_token(token_id, text)`` is called once per returned token, in order, with that token's
    text. A token whose text might still be the start of a stop string is held back until that is
    settled, so a call can come a few tokens late; a token cut by a stop string gets its text
    before the stop string; a token ending inside a multi-byte character gets "" and the character
    comes with the token that completes it; without a tokenizer text is always "". Returning False
    (or calling ``cancel()`` between passes) stops generation at once with finish_reason
    "cancelled"; ``tokens`` and ``text`` are then exactly what was passed so far.

    After generation the state holds the prompt followed by ``Generation.generated[:-1]``, exactly
    as plain greedy decoding leaves it: the last produced token is known but not yet fed.
    """

    def __init__(self, model, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                 on_token: OnToken | None = None, state: "DecodeState | None" = None,
                 eos_token_ids: Sequence[int] | None = None, drafter: Drafter | None = None,
                 held_ids: Sequence[int] | None = None,
                 on_prefill: Callable[[DecodeState], None] | None = None, prefill_chunk: int = 0,
                 special_text: bool = False, on_logprob: Callable[[tuple], None] | None = None):
        config, settings = model.config, model.settings
        prompt = _check_ids(prompt_ids, config.vocab_size, "prompt")
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed to start generating")
        p = SamplingParams() if params is None else params
        max_new = settings.max_new_tokens if p.max_new_tokens is None else int(p.max_new_tokens)
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        if p.stop and model.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if p.constraint is not None and model.tokenizer is None:
            raise ValueError("a constrained output needs a tokenizer, and this model has none")
        if on_logprob is not None and p.logprobs is None:
            raise ValueError("on_logprob needs logprobs in the sampling parameters")
        state = model.new_state() if state is None else state
        held = state.num_tokens
        history = _check_ids(held_ids or (), config.vocab_size, "held")
        if held_ids is not None and len(history) != held:
            raise ValueError(f"held_ids has {len(history)} tokens, but the state holds {held}")
        limit = config.max_position_embeddings
        if held + len(prompt) + max_new > limit:
            raise ValueError(
                f"prompt of {len(prompt)} tokens" + (f" after {held} cached tokens" if held else "")
                + f" + max_new_tokens {max_new} = {held + len(prompt) + max_new} tokens exceeds the model's "
                f"context of {limit} tokens (max_position_embeddings)")
        self.eos = frozenset(config.eos_token_ids if eos_token_ids is None else (int(t) for t in eos_token_ids))
        self.vocab = config.vocab_size
        self.prompt, self.max_new, self.state = prompt, max_new, state
        self.reach = held + len(prompt) + max_new  # the most tokens its state will hold
        # No piece size given (one generation alone): the most the free memory holds the pass for.
        piece = getattr(model, "prompt_piece", None)
        self.prefill_chunk = prefill_chunk or (piece(len(prompt), held + len(prompt)) if piece else len(prompt))
        self.params = p
        self.rng: torch.Generator | None = None
        if not p.greedy:
            # Draws run where the logits are (see _sample): on a CUDA device with its own generator.
            device = getattr(model, "device", None)
            self.rng = torch.Generator(device) if device is not None and device.type == "cuda" else torch.Generator()
            if p.seed is None:
                self.rng.seed()  # fresh entropy for this call only; the global generator is untouched
            else:
                self.rng.manual_seed(int(p.seed))
        self.spec = p.speculates(settings.speculate)
        self.drafter = drafter
        if self.spec and drafter is None:
            self.drafter = NgramDrafter(settings.ngram, min(MIN_NGRAM, settings.ngram))
        self.draft_len = settings.draft_len
        self.draft_lengths = DraftLengths()
        self.matcher: Matcher | None = None
        if p.constraint is not None:
            self.matcher = Matcher(p.constraint, model.tokenizer, self.vocab, self.eos, history + prompt)
        keep = special_text or (p.constraint is not None and p.constraint.special_text)
        self.on_token, self.on_logprob = on_token, on_logprob
        self.out = _Output(model.tokenizer, history + prompt, list(p.stop),
                           self._returned if on_logprob is not None else on_token, keep)
        self.logprobs: list | None = None if p.logprobs is None else []
        self.on_prefill = on_prefill
        self.stats = {"passes": 0, "tokens": 0, "generated_tokens": 0, "accepted_draft_tokens": 0,
                      "drafted_tokens": 0, "tokens_per_pass": 0.0, "prefill_tokens": len(prompt),
                      "prefill_seconds": 0.0, "decode_seconds": 0.0, "decode_tok_s": 0.0}
        self.generated: list[int] = []
        self.context = history + prompt  # what the drafter matches against; grows with the output
        self.fed = 0  # prompt tokens fed so far
        self.finish: str | None = None  # set once generation has ended
        # The pass in flight: (state length before, draft, the length of the n-gram match the draft came
        # from; None for no n-gram draft)
        self._pass: tuple[int, list[int], int | None] | None = None
        self._held: list[int] = []  # produced by advance(), not handed out yet (deliver)
        self._ending: str | None = None  # the reason generation ended, while tokens are held
        self._muted = False  # cancelled by deliver() with a pass in flight: advance() hands nothing out
        self._defer = False  # whether advance() holds its token for deliver()
        self._times: list[float] = []  # start, end of prefill, end
        if max_new == 0:  # nothing to produce: the prompt is not even fed
            self.finish = "length"

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not fed yet."""
        return len(self.prompt) - self.fed

    def next_pass(self, max_draft: int | None = None, max_prompt: int | None = None) -> Seq:
        """What the next forward pass feeds this sequence: the next piece of the prompt (at most
        ``prefill_chunk`` tokens, and at most ``max_prompt`` when given), or the last produced
        token followed by a draft (verified in the same pass) of at most draft_len tokens, and at
        most ``max_draft`` when given. Neither limit changes the output beyond rounding: drafts
        only change speed, and a prompt read in other pieces gives the same state."""
        if self.done:
            raise RuntimeError("this generation has ended")
        if not self._times:
            self._times.append(time.perf_counter())
        if self.prefilling:
            n = self.prefill_chunk if max_prompt is None else max(1, min(self.prefill_chunk, max_prompt))
            piece = self.prompt[self.fed:self.fed + n]
            last = self.fed + len(piece) == len(self.prompt)
            self._pass = (self.state.num_tokens, [], None)
            return Seq(piece, self.state, False, "last" if last else "none", on_device=True, reach=self.reach)
        draft: list[int] = []
        match: int | None = None
        if self.spec:
            # No point verifying more tokens than may still be produced (the bonus token is one).
            room = min(self.draft_len, self.max_new - len(self.generated) - 1)
            if max_draft is not None:
                room = min(room, max_draft)
            if room > 0:
                # Tokens the grammar forces are the likeliest draft there is (the model may still
                # write them in other pieces: they are verified like any draft).
                forced = self.matcher.forced() if self.matcher is not None else []
                if forced:
                    draft = forced[:room]
                elif isinstance(self.drafter, NgramDrafter):
                    offered, match = self.drafter.propose(self.context, room)
                    draft = offered[:self.draft_lengths.length(match, len(offered))]
                else:
                    draft = list(self.drafter(self.context, room))[:room]
                draft = _check_ids(draft, self.vocab, "draft")
                if self.matcher is not None:
                    draft = draft[:self.matcher.legal_prefix(draft)]
        self._pass = (self.state.num_tokens, draft, match)
        return Seq([self.generated[-1]] + draft, self.state, bool(draft), "all", on_device=True, reach=self.reach)

    @property
    def picks_argmax(self) -> bool:
        """Whether its tokens are its logits' argmax (greedy, unconstrained): what ``take`` can be
        handed, found for a whole pass at once (``PendingPass.argmax``)."""
        return self.rng is None and self.matcher is None

    def take(self, logits: torch.Tensor | None, argmax: list[int] | None = None) -> None:
        """The logits of the pass ``next_pass()`` asked for; ``argmax``, when given, their rows' argmax
        ids, read back for the whole pass (used where ``picks_argmax``)."""
        self.advance(logits, argmax)
        self.deliver()

    def advance(self, logits: torch.Tensor | None, argmax: list[int] | None = None) -> None:
        """``take`` less handing the new token out, where the pass produced one (no draft) whose text
        cannot end the generation (no stop strings): afterwards ``done`` and ``next_pass`` are as after
        ``take``, and ``deliver`` hands the token out (``on_token``) and settles the output. A scheduler
        starts its next pass in between, so the device computes while the text is made and sent. A
        generation that ``deliver`` cancelled while its next pass was already under way takes that
        pass's tokens without handing them out, so its state still holds exactly the prompt and
        ``generated[:-1]``."""
        if self._pass is None:
            raise RuntimeError("take() without a pass in flight: call next_pass() first")
        before, draft, match = self._pass
        self._pass = None
        if self._muted:  # cancelled by deliver() after this pass began: its tokens go nowhere
            preds, ok, _ = self._pick(logits, draft, argmax)
            self.generated += preds[:ok + 1]
            if draft:
                self.state.rollback(before + ok + 1)
            return
        # One token, whose text cannot end the generation (no stop strings), may wait for deliver(); a
        # burst's tokens go out one by one, as a callback may stop it at any of them.
        self._defer = not draft and not self.out.stops
        if self.prefilling:
            self.fed += self.state.num_tokens - before
            if self.on_prefill is not None:
                self.on_prefill(self.state)
            if self.prefilling:
                return
            preds, _, logprobs = self._pick(logits, [], argmax)
            self._times.append(time.perf_counter())
            self.context.append(preds[0])
            self._end(self._consume(preds[0], logprobs[0] if logprobs else None))
            return
        self.stats["passes"] += 1
        self.stats["drafted_tokens"] += len(draft)
        preds, ok, logprobs = self._pick(logits, draft, argmax)
        if match is not None:
            self.draft_lengths.record(match, len(draft), ok)
        used = 0  # tokens of this burst (preds[:ok + 1]) that generation actually took
        reason = None
        for i, t in enumerate(preds[:ok + 1]):
            used += 1
            self.context.append(t)
            reason = self._consume(t, logprobs[i] if logprobs else None)
            if reason is not None:
                break
        self.stats["accepted_draft_tokens"] += used - 1
        if draft:
            # Fed: [token] + draft; keep [token] + the used-1 accepted drafts. The last used token
            # is the new "known but not fed" one.
            self.state.rollback(before + used)
        self._end(reason)

    def deliver(self) -> None:
        """Hand out what ``advance`` held back (``on_token``), then settle the output if the generation
        has ended. A callback asking to stop ends it as "cancelled" (see ``advance`` for the pass it
        may already be in)."""
        held, self._held = self._held, []
        for token in held:
            if self.out.add(token) is not None:  # "cancelled": stop strings never defer their tokens
                self.finish, self._ending = "cancelled", None
                self._muted = self._pass is not None
                self._mark_end()
                return
        if self._ending is not None:
            self.finish, self._ending = self.out.finish(self._ending), None
            self._mark_end()

    def cancel(self) -> None:
        """Stop between passes: finish_reason "cancelled", keeping what was passed to on_token."""
        if not self.done:
            self._pass = None
            self._held, self._ending = [], None
            self.out.pending, self.out.done = [], "cancelled"
            self._end("cancelled")

    def result(self) -> Generation:
        if not self.done:
            raise RuntimeError("result() before the generation ended")
        if self._held or self._ending is not None:
            raise RuntimeError("result() before deliver() handed out the last tokens")
        stats, t = self.stats, self._times
        stats.update(tokens=len(self.out.tokens), generated_tokens=len(self.generated))
        if len(t) == 3:
            stats.update(prefill_seconds=t[1] - t[0], decode_seconds=t[2] - t[1])
            decoded = len(self.generated) - 1  # tokens produced by decode passes (the first came from prefill)
            if stats["passes"]:
                stats["tokens_per_pass"] = decoded / stats["passes"]
            if t[2] > t[1]:
                stats["decode_tok_s"] = decoded / (t[2] - t[1])
        logprobs = None if self.logprobs is None else self.logprobs[:len(self.out.tokens)]
        return Generation(self.out.tokens, self.out.text(), self.finish, stats, self.generated, self.state,
                          logprobs)

    def _pick(self, logits: torch.Tensor, draft: list[int],
              argmax: list[int] | None = None) -> tuple[list[int], int, list | None]:
        """The tokens a pass produced: (picks, accepted, logprobs). ``picks[i]`` is the token after
        the i-th fed token, ``accepted`` how many draft tokens equal the picks before them (so
        picks[:accepted + 1] follow, the last being the verifier's own), ``logprobs`` their
        entries (None when not asked for). Logits may be on the compute device (``next_pass`` asks
        for that), where the argmax runs too, so only the chosen ids come back to the host."""
        p = self.params
        if self.matcher is None:
            if self.rng is not None:
                picks = [_sample(logits[-1], p.temperature, p.top_k, p.top_p, self.rng)]
            else:
                picks = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
            ok = 0
            while ok < len(draft) and draft[ok] == picks[ok]:
                ok += 1
            rows = logits[-1:] if self.rng is not None else logits[:ok + 1]
            return picks, ok, None if self.logprobs is None else _logprobs(rows, picks[:ok + 1], p.logprobs)
        # Constrained: row i's mask is the constraint's after the picks before it, so the rows are
        # taken in order, the matcher advanced over accepted drafts and then put back (``_consume``
        # advances it over what generation takes).
        picks, entries, ok = [], [], 0
        for i in range(len(draft) + 1):
            row = logits[i:i + 1] if self.rng is None else logits[-1:]
            row = row.masked_fill(~self.matcher.allowed().to(row.device), float("-inf"))
            t = int(row.argmax()) if self.rng is None else _sample(row[0], p.temperature, p.top_k, p.top_p, self.rng)
            picks.append(t)
            if self.logprobs is not None:
                entries += _logprobs(row, [t], p.logprobs)
            if i < len(draft) and draft[i] == t and t not in self.eos:
                self.matcher.advance(t)
                ok += 1
            else:
                break
        self.matcher.rollback(ok)
        return picks, ok, entries if self.logprobs is not None else None

    def _consume(self, token: int, logprob) -> str | None:
        """Record one produced token; return a finish reason when generation must end here."""
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if token in self.eos:
            return "stop"
        if self.matcher is not None:
            self.matcher.advance(token)
        if self._defer:
            self._held.append(token)
            reason = None
        else:
            reason = self.out.add(token)
        if reason is None and self.matcher is not None and self.matcher.done:
            reason = self.matcher.finish_reason
        if reason is None and len(self.generated) >= self.max_new:
            reason = "length"
        return reason

    def _returned(self, token: int, text: str) -> bool | None:
        """on_token with on_logprob first: the returned tokens are the first produced ones, in order."""
        self.on_logprob(self.logprobs[len(self.out.tokens) - 1])
        return self.on_token(token, text) if self.on_token is not None else None

    def _end(self, reason: str | None) -> None:
        if reason is None:
            return
        if self._held:  # ended: deliver() settles the output once the held tokens are out
            self.finish, self._ending = reason, reason
            return
        self.finish = self.out.finish(reason)
        self._mark_end()

    def _mark_end(self) -> None:
        if len(self._times) == 2:
            self._times.append(time.perf_counter())


class NgramDrafter:
    """Drafts by prompt lookup: find the most recent earlier occurrence of the context's last
    n tokens (n = max_n down to min_n, longest match first) and propose the tokens that followed it.

    When the match is so recent that the text after it runs into the end of the context, the
    context is periodic with period (length - match end) and the draft continues that period
    (``a b a b`` -> ``a b a b``...). One instance serves one growing context: it indexes the
    new tail on each call and assumes earlier tokens never change. ``propose`` also says the length
    of the match the draft came from (how far to trust it: ``DraftLengths``).
    """

    def __init__(self, max_n: int, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        # last_end[n][ngram] = position right after its most recent occurrence that ends before
        # the context's last token (so the context's own suffix never matches itself)
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 1  # n-grams ending at positions < _indexed are in the index

    def __call__(self, context: Sequence[int], max_len: int) -> list[int]:
        return self.propose(context, max_len)[0]

    def propose(self, context: Sequence[int], max_len: int) -> tuple[list[int], int]:
        """(up to max_len draft tokens, the length of the n-gram they follow; 0 with no draft)."""
        length = len(context)
        for end in range(self._indexed, length):
            for n in range(1, min(self.max_n, end) + 1):
                self._last_end[n][tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, length)
        if max_len <= 0:
            return [], 0
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._last_end[n].get(tuple(context[length - n:]))
            if end is not None:
                period = length - end
                return [context[end + i % period] for i in range(max_len)], n
        return [], 0


class DraftLengths:
    """How many tokens of an n-gram draft one generation verifies, from how its earlier drafts of the
    same match length fared: a draft token is used only if every draft token before it was accepted,
    so per match length the chance p that a drafted position is accepted once the ones before it were
    (accepted positions over tried ones, a draft's first rejection ending its tries; one accepted try
    assumed before any is made, so the first drafts go at full length), and the draft is cut after its
    last position whose chance of being used, p ** position, is at least ``least``. A long match that
    keeps being right drafts up to the limit; a short one that misses shrinks to a token or none, whose
    verifying rows would cost more than they give back."""

    def __init__(self, least: float = DRAFT_KEEP_CHANCE):
        self.least = least
        self.tries: dict[int, tuple[int, int]] = {}  # match length -> (accepted positions, tried positions)

    def length(self, n: int, offered: int) -> int:
        accepted, tried = self.tries.get(n, (0, 0))
        p = (accepted + 1) / (tried + 1)
        d = 0
        while d < offered and p ** (d + 1) >= self.least:
            d += 1
        return d

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """A pass verified `drafted` tokens of a draft from a match of length n and accepted the first
        `accepted`."""
        if drafted:
            a, t = self.tries.get(n, (0, 0))
            self.tries[n] = (a + accepted, t + min(accepted + 1, drafted))


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> list[int]:
    out = []
    for i, t in enumerate(ids):
        try:
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"{what} token {i} is {t!r}, not an integer token id") from None
        if not 0 <= t < vocab:
            raise ValueError(f"{what} token {i} has id {t}, outside the vocabulary [0, {vocab})")
        out.append(t)
    return out


def _logprobs(rows: torch.Tensor, picks: list[int], k: int) -> list:
    """(pick, logprob, top k [(id, logprob)]) per row: the log-softmax of the float32 logits the
    token was picked from, after the constraint's mask (a forbidden token has no probability) and
    before temperature, top-k and top-p, which change how a token is drawn, not the model's
    distribution (OpenAI's logprobs do not move with the temperature either)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(picks, device=lp.device)[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    out = []
    for t, c, ids, vals in zip(picks, chosen, top_ids.tolist(), top_lp.tolist()):
        out.append((t, c, [(i, v) for i, v in zip(ids, vals) if v != float("-inf")]))
    return out


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rng: torch.Generator) -> int:
    # In fp32 on the generator's device: a CUDA device's logits stay there (the vocabulary's sort for
    # top_p, 163,840 entries for K3, costs milliseconds on the host) and only the id comes back;
    # elsewhere on the CPU. Shifting the largest logit to 0 before dividing keeps a tiny temperature
    # finite (below fp32's smallest normal it would round to 0): the other logits go to -inf and the
    # draw becomes the argmax, the limit of sampling as the temperature goes to 0.
    x = logits.detach().float().to(rng.device)
    x = (x - x.max()) / max(temperature, torch.finfo(torch.float32).tiny)
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the more likely ones already reach top_p (the most likely always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=rng).item())


class _Output:
    """Turns produced tokens into returned tokens and text: stop strings, hold-back, on_token."""

    def __init__(self, tokenizer, prompt: list[int], stops: list[str], on_token: OnToken | None,
                 special_text: bool = False):
        self.decoder = stream_decoder(tokenizer, prompt) if tokenizer is not None else None
        # special tokens whose text is kept: {id: text}
        self.kept = {i: t for t, i in special_ids(tokenizer).items()} if special_text and tokenizer is not None else {}
        self.stops = stops
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.on_token = on_token
        self.tokens: list[int] = []  # returned, i.e. passed to on_token
        self.pending: list[tuple[int, int]] = []  # (token, offset where its text starts), held back
        self.full = ""  # text of every token added so far
        self.released = 0  # full[:released] has been passed to on_token
        self.searched = 0  # no stop string starts before this offset
        self.done: str | None = None  # set once a stop string or a cancel ended the output

    def text(self) -> str | None:
        return None if self.decoder is None else self.full[:self.released]

    def add(self, token: int) -> str | None:
        """Take one produced (non-EOS) token; return "stop" or "cancelled" when generation must end."""
        self.pending.append((token, len(self.full)))
        if self.decoder is None:
            return self._release(0, final=True)
        if token in self.kept:  # what the decoder still holds (a cut character) comes first
            self.full += self.decoder.flush() + self.kept[token]
        else:
            self.full += self.decoder.add(token)
        at = self._find_stop()
        if at is not None:
            return self._stop(at)
        return self._release(len(self.full) - self._stop_prefix_len(), final=False)

    def finish(self, reason: str) -> str:
        """Generation ended with ``reason``: release what is still held back; return the final reason."""
        if self.done is not None:
            return self.done
        if self.decoder is not None:
            self.full += self.decoder.flush()
            at = self._find_stop()
            if at is not None:
                return self._stop(at)
        return self._release(len(self.full), final=True) or reason

    def _find_stop(self) -> int | None:
        if not self.stops:
            return None
        hits = [i for s in self.stops if (i := self.full.find(s, self.searched)) >= 0]
        self.searched = max(self.searched, len(self.full) - self.longest_stop + 1)
        return min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.full)), best, -1):
                if self.full.endswith(s[:k]):
                    best = k
                    break
        return best

    def _stop(self, at: int) -> str:
        """A stop string starts at offset ``at``: return the tokens whose text starts before it."""
        reason = self._release(at, final=True) or "stop"
        self.pending = []
        self.done = reason
        return reason

    def _release(self, upto: int, final: bool) -> str | None:
        """Return held tokens with their text, cut at ``upto``; "cancelled" if on_token asked to stop.

        Not ``final``: only tokens whose whole text lies before ``upto`` (an empty-text token, the
        first bytes of a character, only when that character starts before ``upto``), so every
        call carries its own token's complete text. ``final``: every token that starts before
        ``upto`` (or every token, when ``upto`` is the end of the text).
        """
        n = 0
        while n < len(self.pending):
            token, start = self.pending[n]
            end = self.pending[n + 1][1] if n + 1 < len(self.pending) else len(self.full)
            if final:
                if start >= upto and upto < len(self.full):
                    break
            elif end > upto or start >= upto:
                break
            end = min(end, upto)
            piece = self.full[self.released:end] if end > self.released else ""
            self.released = max(self.released, end)
            self.tokens.append(token)
            n += 1
            if self.on_token is not None and self.on_token(token, piece) is False:
                self.pending = []
                self.done = "cancelled"
                return "cancelled"
        del self.pending[:n]
        return None
