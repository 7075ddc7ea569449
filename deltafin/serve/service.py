"""What ``deltafin serve`` serves with: one loaded model, used by many requests at once.

``Service`` owns the names the model is served under, its context (``max_model_len`` caps it),
turning a validated request into a ``Job`` (the prompt rendered with its tools and tokenized, and
its constraint checked and compiled, off the event loop within ``render_timeout``), the admission
gate, the memo of deterministic answers, the scheduler (generations batched into shared passes on
one engine thread), the prefix cache of decode states (a request whose prompt starts with the
tokens of an earlier request's prompt, or prompt + answer as chat clients resend it, prefills only
the rest; the choices of one request share one prefill), the server's metrics, and its health: a
fault reading the weights, or a prompt stuck rendering, turns it "degraded".

What it trusts: the model folder (its chat template is rendered in a sandbox), and requests the
wire format (``protocol``) has already validated; what they name is checked against the model
(served names, token ids, the context) before anything runs. Text it hands to clients about a
fault names no local paths.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..runtime.generate import Generation
from ..runtime.grammar import GrammarError, Matcher
from ..runtime.sampling import SEED_RANGE, SamplingParams
from ..runtime.scheduler import Scheduler
from ..settings import Settings, SettingsError
from ..units import MiB
from .admission import EngineGate
from .handoff import HANDOFF
from .memo import ResponseMemo
from .prefix_cache import PrefixCache
from .protocol import APIError, ParsedRequest, bad, constraint, resolve_max_tokens
from .server_metrics import ServerMetrics

log = logging.getLogger(__name__)

# The most token ids a completion's prompt may have to be checked on the event loop, not on a renderer
# thread: checking each id against the vocabulary is a Python loop (~0.15 ms for this many on a slow
# core), which a longer prompt would hold the loop for.
INLINE_PROMPT_IDS = 4096


@dataclass(frozen=True)
class Job:
    """One request's generations, as the engine sees them (also its memo key, with the served name)."""
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # max_new_tokens resolved; canonical (greedy ignores the sampling knobs)
    choices: int = 1  # choice i samples with seed + i
    special_text: bool = False  # chat: the text keeps the tool-call and thinking markers, for reading

    def choice_params(self, i: int) -> SamplingParams:
        if self.params.seed is None or i == 0:
            return self.params
        low, high = SEED_RANGE  # seed + i, wrapped around within the seeds torch takes
        return self.params.replace(seed=(self.params.seed + i - low) % (high - low + 1) + low)


def model_name(model) -> str:
    name = getattr(model, "name", None)
    if name:
        return str(name)
    path = getattr(model, "path", None)
    return Path(path).name if path else "deltafin"


class Service:
    """Everything one app serves with: the model, its name, the gate, the memo, the engine thread."""

    def __init__(self, model, settings: Settings):
        self.model = model
        self.settings = settings
        aliases = [n.strip() for n in settings.served_model_name.split(",") if n.strip()]
        self.names = aliases or [model_name(model)]
        self.name = self.names[0]  # the name responses report
        self.tokenizer = getattr(model, "tokenizer", None)
        self.context = int(model.config.max_position_embeddings)
        if settings.max_model_len:
            if settings.max_model_len > self.context:
                raise SettingsError(f"setting 'max_model_len' is {settings.max_model_len}, more than the model's "
                                    f"context of {self.context} tokens")
            self.context = settings.max_model_len
        self.started = int(time.time())
        self.gate = EngineGate(settings.queue_size, settings.queue_timeout, settings.max_batch)
        self.memo = ResponseMemo(settings.memo_size)
        self.prefix_cache = PrefixCache(settings.prefix_cache_mb * MiB)
        if settings.prompt_cache:
            from ..runtime.saved_state import load_state
            ids, state, _ = load_state(model, settings.prompt_cache)
            self.prefix_cache.put(ids, state, copy=False, pinned=True)
        self.fault: str | None = None  # why the server is degraded (no local paths), once it is
        self._renders: dict[int, float] = {}  # render job id -> when it started
        self._render_ids = iter(range(1 << 62))
        root = getattr(model, "path", None)
        self._roots = sorted({str(root), os.path.realpath(root)}, key=len, reverse=True) if root else []
        self.metrics = ServerMetrics(self.gate, self.memo, self.prefix_cache, lambda: self.scheduler.tally,
                                     model.graph_stats)
        # The engine runs off the event loop, on the scheduler's thread.
        self._open = contextlib.ExitStack()  # what close() ends
        self._open.enter_context(model.observe(self.metrics.observer()))
        self.scheduler = Scheduler(model, settings.max_batch, settings.prefill_chunk, hand_out=HANDOFF.deferred)
        # Chat templates and tokenizers run here, so a slow one never holds up the event loop.
        self.renderer = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltafin-render")

    def close(self) -> None:
        self.scheduler.close()
        self._open.close()
        self.renderer.shutdown(wait=False, cancel_futures=True)

    # -- health and faults ---------------------------------------------------------------------
    def without_paths(self, text: str) -> str:
        """`text` with the model folder's location removed (file names inside it stay)."""
        for root in self._roots:
            text = text.replace(root + os.sep, "").replace(root, "<model>")
        return text

    def weights_failed(self, error: Exception) -> str:
        """Count a generation ended by a fault reading the weights and turn the server degraded;
        the reason, without local paths."""
        self.metrics.faults.inc()
        self.fault = f"reading the model's weights failed: {self.without_paths(str(error))}"
        return self.fault

    def rank_lost(self, error: Exception) -> str:
        """A rank of a model split across processes was lost (dist.transport.RankFault, which names
        it): no pass can run any more, so the server is degraded for good; the reason."""
        self.metrics.faults.inc()
        self.fault = str(error)
        return self.fault

    def health(self) -> tuple[int, dict]:
        stuck = [time.monotonic() - t for t in list(self._renders.values())]
        stuck = [s for s in stuck if s > self.settings.render_timeout]
        reason = self.fault or (f"a prompt has been rendering for {max(stuck):.0f} s (is the chat template "
                                "looping?)" if stuck else None)
        body = {"status": "degraded" if reason else "ok", "model": self.name, "busy": self.gate.busy,
                "running": self.gate.running, "waiting": self.gate.waiting, "memo_entries": len(self.memo),
                "prefix_cache": self.prefix_cache.stats(), "passes": self.scheduler.tally.summary()}
        if reason:
            body["reason"] = reason
        return (503 if reason else 200), body

    # -- request -> job ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        # A request without "model" means the one model served here.
        if name is not None and name not in self.names:
            raise APIError(404, f"the model '{name}' does not exist here; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    async def prepare(self, req: ParsedRequest) -> Job:
        """The request's Job: its constraint checked and compiled, its prompt rendered and tokenized, its
        max_tokens resolved, off the event loop within render_timeout. A completion whose prompt is token
        ids (INLINE_PROMPT_IDS at most) has nothing to render, tokenize or compile: its ids are checked on
        the event loop, where the hop to a renderer thread and back waited for the interpreter behind the
        engine thread (small-k3 served on a 2-core CPU, eight clients: 3.6-4.4 ms of a first token)."""
        if req.kind == "completion" and isinstance(req.prompt, list) and len(req.prompt) <= INLINE_PROMPT_IDS:
            return self._prepare(req)
        job = next(self._render_ids)

        def run():
            self._renders[job] = time.monotonic()
            try:
                return self._prepare(req)
            finally:
                self._renders.pop(job, None)

        limit = self.settings.render_timeout
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.renderer, run), limit)
        except asyncio.TimeoutError:
            log.warning("rendering and tokenizing a prompt took longer than %g s; answered 503", limit)
            raise APIError(503, f"rendering and tokenizing the prompt took longer than {limit:g} s "
                           "(render_timeout)", code="render_timeout") from None

    def _prepare(self, req: ParsedRequest) -> Job:
        c = constraint(req)  # first: the tools are checked before the template sees them
        ids = self._encode(req)
        if c is not None:
            try:  # compiled here (then cached), so a generation never starts with a grammar that fails
                Matcher(c, self.tokenizer, self.model.config.vocab_size, self.model.config.eos_token_ids)
            except GrammarError as e:
                raise bad(f"'{e.param}': {e.message}", param=e.param) from None
        max_tokens = resolve_max_tokens(req, len(ids), self.context, self.settings.max_tokens_cap)
        params = req.sampling.replace(max_new_tokens=max_tokens, constraint=c).canonical()
        return Job(tuple(ids), params, req.n, special_text=req.kind == "chat")

    def _encode(self, req: ParsedRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise APIError(500, f"the model '{self.name}' was loaded without a tokenizer, so the text endpoints "
                           "cannot answer", code="no_tokenizer")
        if req.kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise bad(f"the model '{self.name}' has no chat template; use /v1/completions with a prompt",
                          param="messages", code="no_chat_template")
            try:
                ids = self.model.encode_chat(req.messages, tools=req.tools)
            except Exception as e:  # the template's own checks (role order, ...) raise here
                raise bad(f"the chat template cannot render these messages: {e}", param="messages") from None
        elif isinstance(req.prompt, list):
            vocab = self.model.config.vocab_size
            for i, t in enumerate(req.prompt):
                if not 0 <= t < vocab:
                    raise bad(f"'prompt[{i}]' is token id {t}, outside the vocabulary [0, {vocab})", param="prompt")
            ids = list(req.prompt)
        else:
            ids = self.model.encode(req.prompt)
        if not ids:
            raise bad("the prompt is empty: at least one token is needed", param=req.prompt_param)
        return list(ids)

    def describe(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes, as logprobs name it (a special token by its name)."""
        tok = self.tokenizer
        if hasattr(tok, "token_bytes"):
            raw = tok.token_bytes(token_id)
            return raw.decode("utf-8", "replace"), raw
        text = tok.decode([token_id])
        return text, text.encode()

    def memo_key(self, job: Job) -> tuple | None:
        return (self.name, job) if job.params.deterministic and self.memo.size > 0 else None

    # -- the engine ----------------------------------------------------------------------------
    def start(self, job: Job, emit, cancel: threading.Event) -> list[concurrent.futures.Future]:
        """Run ``job``'s choices on the engine thread, batched with the others (the caller holds a gate
        slot; it is released when every choice is done). ``emit(i, (text, logprob entry or None))`` is
        called from the engine thread for each token choice i returns (tokens whose text is still ""
        only when logprobs are asked for), and ``emit(i, None)`` once at its end, after its future
        is resolved; setting ``cancel`` stops them all. The futures resolve to the choices'
        ``Generation``s.

        The generations start from the longest cached prefix of the prompt and leave states for
        later requests: the one at the end (prompt + answer as fed), the one right after the prompt,
        and, while a long prompt is read in, one each time another ``prefix_cache_block`` tokens
        are in. A chat client's next turn starts with the first when the template renders the
        answer as it was generated, with the second otherwise; prompts that share only a beginning
        (a long system prompt) with the third. Several choices read the prompt once: all of it but
        the last token in one generation of its own, whose state each choice then continues from a
        copy of. ``stats["cached_tokens"]`` of a result counts the prompt tokens that were not
        prefilled."""
        loop = asyncio.get_running_loop()
        ids, cache, block = list(job.prompt_ids), self.prefix_cache, self.settings.prefix_cache_block
        cached, state = cache.lookup(ids) if cache.enabled else (0, None)
        if cache.enabled:
            self.metrics.prefix_lookups.inc(result="hit" if cached else "miss")
            self.metrics.cached_tokens.inc(cached)
        keep = cache.budget_bytes > 0
        kept_at = [cached]
        futures = [concurrent.futures.Future() for _ in range(job.choices)]
        running = [job.choices]

        def on_prefill(st) -> None:
            n = st.num_tokens
            if n == len(ids) or (block and n // block > kept_at[0] // block):
                cache.put(ids[:n], st)
                kept_at[0] = n

        def choice_done(i: int, inner: concurrent.futures.Future) -> None:
            error = inner.exception() if not inner.cancelled() else concurrent.futures.CancelledError()
            if error is None:
                gen = inner.result()
                gen.stats["cached_tokens"] = cached
                if keep and gen.generated:  # the state holds the prompt and every produced token but the last
                    cache.put(ids + gen.generated[:-1], gen.state, copy=False)
                futures[i].set_result(gen)
            else:
                futures[i].set_exception(error)
            running[0] -= 1
            # The slot is handed back before the last end is announced, so a client that has its
            # answer never finds the server still counting its request.
            if running[0] == 0:
                try:
                    loop.call_soon_threadsafe(self.gate.release)
                except RuntimeError:  # the loop is already closed: nobody is left to admit
                    return
            emit(i, None)

        def run_choice(i: int, prompt: list[int], start_state, held: int, prefill) -> None:
            entry = [None]

            def on_logprob(e) -> None:
                entry[0] = e

            def on_token(token_id: int, text: str) -> bool:
                if text or job.params.logprobs is not None:
                    emit(i, (text, entry[0]))
                return not cancel.is_set()

            extra = {"on_logprob": on_logprob} if job.params.logprobs is not None else {}
            inner = self.scheduler.submit(prompt, job.choice_params(i), on_token=on_token, cancel=cancel,
                                          state=start_state, held_ids=ids[:held] if held else None,
                                          on_prefill=prefill, special_text=job.special_text, **extra)
            inner.add_done_callback(lambda f: choice_done(i, f))

        def branch(shared: concurrent.futures.Future) -> None:
            """The shared prefill is done: every choice continues from a copy of its state."""
            error = shared.exception()
            if error is not None or shared.result().finish_reason == "cancelled":
                for i in range(job.choices):  # each choice ends as the prefill did
                    ended = concurrent.futures.Future()
                    if error is not None:
                        ended.set_exception(error)
                    else:
                        ended.set_result(Generation([], "", "cancelled", {}))
                    choice_done(i, ended)
                return
            prefilled = shared.result().state
            for i in range(job.choices):
                run_choice(i, ids[-1:], prefilled.snapshot(), len(ids) - 1, on_prefill if keep and i == 0 else None)

        try:
            if job.choices == 1:
                run_choice(0, ids[cached:], state, cached, on_prefill if keep else None)
            elif cached < len(ids) - 1:
                # One token after the prompt but its last: the state then holds exactly ids[:-1].
                shared = self.scheduler.submit(ids[cached:-1], SamplingParams(max_new_tokens=1), cancel=cancel,
                                               state=state, held_ids=ids[:cached] if cached else None,
                                               on_prefill=on_prefill if keep else None)
                shared.add_done_callback(branch)
            else:
                start = concurrent.futures.Future()
                start.set_result(Generation([], "", "length", {}, state=state if state is not None
                                            else self.model.new_state()))
                branch(start)
        except BaseException:
            self.gate.release()
            raise
        return futures
