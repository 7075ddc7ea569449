"""The public Python API: ``deltafin.load(path, **settings)`` -> ``Model``."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch

from .checkpoint.sizes import model_bytes
from .dist.launch import joined
from .errors import DeltafinError
from .io.sources import open_source
from .model.state import DecodeState
from .runtime.decode_graph import piece_size
from .runtime.engine import Engine
from .runtime.generate import generate
from .runtime.grammar import Constraint
from .runtime.pass_stats import PassObserver, PassStats
from .runtime.prompt_piece import activation_bytes, prompt_piece
from .runtime.sampling import SamplingParams
from .runtime.thread_policy import ThreadPolicy
from .settings import Settings
from .tokenizer import load_tokenizer


class NoTokenizerError(DeltafinError):
    pass


def _with_generation_eos(cfg, path: Path):
    """Chat models end turns with tokens listed only in generation_config.json: stop on those too."""
    from .files import read_json
    file = path / "generation_config.json"
    if not file.exists():
        return cfg
    raw = read_json(file, "generation_config.json", max_bytes=1 << 20)
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    extra = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    extra = [e for e in extra if isinstance(e, int) and not isinstance(e, bool)]
    ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return dataclasses.replace(cfg, eos_token_ids=ids)


def compute_threads(settings: Settings, streaming: bool, host_computes: bool = True) -> int:
    """Threads of torch's host ops (auto unless --threads): every core for a model in RAM, one fewer
    while streaming, one where a device holds the whole model (``host_computes`` False)."""
    if settings.threads:
        return settings.threads
    if not host_computes:
        # The host only feeds the device a pass's token rows and positions, ops too small to share
        # out; torch's idle workers spin on the cores the server's event loop and the clients need
        # (small-k3 served on an H100, eight clients: 15-20 % more tok/s on one thread, and the first
        # token written 0.2-0.5 ms after it was made in place of 1.1-1.6; docs/benchmarks.md#compute-threads).
        return 1
    cores = os.cpu_count() or 1
    # Oversubscribed intra-op threads stall on every small op (measured on 2 cores while streaming:
    # 42 s per token with 2 threads, 11 s with 1), so streaming leaves a core to the readers.
    return max(1, cores - 1) if streaming else cores


def row_threads(settings: Settings, streaming: bool) -> int | None:
    """The native products' threads in a CPU pass of several rows, where compute_threads' count
    does not apply: streaming with automatic threads, every core. Such a pass (a batch, drafts, a
    prompt piece) is compute-bound where a one-token pass waits on the disk, and its torch ops run
    on one thread (cpu_native.decode_threads). One-token passes alone were not faster on every
    core, so they keep one for the readers (measured: docs/benchmarks.md#compute-threads)."""
    if settings.threads or not streaming:
        return None
    return compute_threads(settings, streaming=False)  # every core


def _shape_order(shape: tuple) -> tuple:
    """A recorded pass's shape (decode_graph: B, rows each or each one's, keep_states, base) for sorting."""
    b, rows, keep, base = shape
    return b, rows if isinstance(rows, tuple) else (rows,), keep, base


def _want_stream(settings: Settings, source, need: int) -> bool:
    """need: the bytes this process would hold in RAM (a rank of a split model: its share)."""
    if settings.stream != "auto":
        return settings.stream == "on"
    if source.kind == "hub":  # in RAM would mean fetching every expert up front
        return True
    import psutil
    from .io.memory import read_memory
    available = psutil.virtual_memory().available
    inside = read_memory()
    if inside.where != "host":  # a memory cgroup's limit binds tighter than the machine's RAM
        available = min(available, inside.free)
    # Keep the model in RAM only when it fits with plenty of room to spare.
    return need > 0.5 * available


class Model:
    def __init__(self, path: str | Path, settings: Settings):
        self.settings = settings
        self.source = open_source(path, settings.spine, settings)
        self.path = Path(self.source.path)  # for a hub repository: its cached metadata folder
        self.config = _with_generation_eos(self.source.config, self.path)
        self.name = self.source.repo_id if self.source.kind == "hub" else self.path.name
        self.residency = ""  # what a device or host RAM holds, and its budget (a start-up line)
        device = settings.torch_device()
        # A rank of a model split across processes (deltafin.dist) holds its layers only, and only
        # rank 0 the embedding and head; rank 0's engine runs every pass through the other ranks.
        group = joined()
        self.placement = None  # dist.placement.RankPlacement of a split model
        layers, with_globals, need = None, True, None
        if group is not None:
            from .dist.placement import agree
            if device.type not in ("cpu", "cuda"):
                raise DeltafinError(f"a model split across ranks runs on the CPU or CUDA GPUs, not {device.type}")
            if device.type == "cuda":
                settings = self.settings = _on_rank_gpu(settings, device, group.local_rank)
                device = settings.torch_device()
            self.placement = agree(group, self.source, settings)
            layers, with_globals = self.placement.ranges[group.rank], group.rank == 0
            need = self.placement.weight_bytes[group.rank]
        if device.type != "cpu":
            from .io.device import DeviceProvider, device_placement
            placement, held = device_placement(self.source, settings, device, settings.stream, layers, with_globals)
            self.residency = f"device holds {held}"
            provider = DeviceProvider(self.source, settings, placement, layers, with_globals)
            self.streaming = provider.streaming
        elif _want_stream(settings, self.source, model_bytes(self.source) if need is None else need):
            self.streaming = True
            from .io.stream import StreamProvider
            provider = StreamProvider(self.source, settings, layers=layers, with_globals=with_globals, cpu_layout=True)
            self.residency = provider.budget_line
        else:
            self.streaming = False
            from .io.ram import RAMProvider
            provider = RAMProvider(self.source, layers=layers, with_globals=with_globals)
        # A device holding every weight leaves the host nothing of the model to compute.
        self.host_computes = device.type == "cpu" or self.streaming
        self.threads = compute_threads(settings, self.streaming, self.host_computes)
        # Process-wide, like the device: the user's setting (or its auto value) for this run.
        torch.set_num_threads(self.threads)
        self.row_threads = row_threads(settings, self.streaming)
        if group is not None and group.rank == 0:
            from .dist.pipeline import FrontEngine
            self.engine = FrontEngine(group, self.config, provider, settings, self.row_threads, layers,
                                      self.placement.ranges)
        else:
            self.engine = Engine(self.config, provider, settings, self.row_threads, layers)
        if self.row_threads is not None and self.row_threads > self.threads:
            # Streaming with automatic threads: one-token passes leave the readers a core while they
            # wait on the disk, and take every core once the RAM tiers serve them.
            self.engine.thread_policy = ThreadPolicy(self.threads, self.row_threads)
        if not self.host_computes and not settings.threads:
            self.engine.gather_threads = os.cpu_count() or 1
        self.device = self.engine.device
        self.tokenizer = load_tokenizer(self.path)
        self.last_generation_stats: dict = {}

    # -- low level -------------------------------------------------------------------------
    def new_state(self) -> DecodeState:
        return self.engine.new_state()

    def forward(self, ids, state: DecodeState, keep_states: bool = False, last_only: bool = False) -> torch.Tensor:
        """Consume ids after what state holds; float32 logits for every position (or the last)."""
        return self.engine.forward(ids, state, keep_states, last_only)

    def forward_batch(self, seqs: list) -> list:
        """One pass over several sequences (``engine.Seq``), each with its own state; their logits."""
        return self.engine.forward_batch(seqs)

    def start_batch(self, seqs: list):
        """``forward_batch`` begun: its ``result()`` waits for the logits (see Engine.start_batch)."""
        return self.engine.start_batch(seqs)

    @property
    def pipeline_depth(self) -> int:
        """Passes (of different sequences) worth keeping in flight at once: ``--pipeline``, or for a
        model split across ranks one per rank unless two ranks compute on the same cores
        (``RankPlacement.shares_compute``: the same cores or the same GPU); else 1."""
        if self.placement is None:
            return 1
        if self.settings.pipeline:
            return self.settings.pipeline
        return 1 if self.placement.shares_compute else len(self.placement.ranges)

    def logits(self, token_ids) -> torch.Tensor:
        """float32 [len(ids), vocab]: a full prefill from a fresh state."""
        return self.forward(list(token_ids), self.new_state())

    @functools.cached_property
    def identity(self) -> dict:
        """What a saved decode state must match to be reused here (see saved_state)."""
        from .runtime.saved_state import model_identity
        return model_identity(self.source, self.settings.dtype)

    # -- text ------------------------------------------------------------------------------
    def require_tokenizer(self):
        if self.tokenizer is None:
            raise NoTokenizerError(f"{self.path}: this checkpoint has no tokenizer files "
                                   "(tiktoken.model or tokenizer.json); use the token-id API instead")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.require_tokenizer().encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt of a chat: ``messages`` (and OpenAI function ``tools``) through the chat template."""
        tok = self.require_tokenizer()
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, tools=tools or None)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def decode(self, ids) -> str:
        return self.require_tokenizer().decode(list(ids), skip_special_tokens=True)

    def generate(self, token_ids, params: SamplingParams | None = None, *, on_token=None, response_format=None,
                 tools=None, tool_choice=None, parallel_tool_calls=True, **sampling) -> list[int]:
        """The new token ids after ``token_ids``: as ``params`` says, or as the keyword arguments name a
        ``SamplingParams`` (``max_new_tokens=32, temperature=0.7, seed=1``; default greedy, which
        speculates with the same output). ``response_format``, ``tools``, ``tool_choice`` and
        ``parallel_tool_calls`` take OpenAI's forms and constrain the output (runtime.grammar: JSON, or
        Kimi tool calls whose arguments satisfy their tool's schema). Statistics land in
        last_generation_stats, with the finish reason ("tool_calls" after a tool-call section) and,
        when ``logprobs`` was asked for, the tokens' logprobs."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise TypeError(f"give the sampling parameters as params or as keywords, not both ({sorted(sampling)})")
        constraint = Constraint.from_request(response_format, tools, tool_choice, parallel_tool_calls)
        if constraint is not None:
            if params.constraint is not None:
                raise TypeError("give the constraint as params.constraint or as response_format / tools, not both")
            params = params.replace(constraint=constraint)
        g = generate(self, list(token_ids), params, on_token=on_token)
        self.last_generation_stats = dict(g.stats, finish_reason=g.finish_reason)
        if g.logprobs is not None:
            self.last_generation_stats["logprobs"] = g.logprobs
        return g.tokens

    # -- what front ends may watch and report -----------------------------------------------
    def observe(self, observer: PassObserver):
        """``with model.observe(obs):`` calls ``obs`` for every pass inside the block
        (runtime.pass_stats.PassObserver: on_pass, on_route)."""
        return self.engine.observe(observer)

    @property
    def last_pass(self) -> PassStats:
        return self.engine.last_pass

    def prompt_piece(self, prompt_tokens: int, context: int) -> int:
        """Prompt rows per pass for a prompt of `prompt_tokens` after which the state holds `context`
        tokens: as many as the free memory holds the pass's activations for (runtime.prompt_piece);
        says so on stderr when a prompt goes in pieces."""
        room = self._activation_room()
        piece = prompt_piece(self.config, prompt_tokens, context, room)
        if piece < prompt_tokens:
            need = activation_bytes(self.config, prompt_tokens, context)
            print(f"deltafin: a prompt of {prompt_tokens} tokens goes in passes of {piece} (in one pass its "
                  f"activations would take ~{need / 1e9:.1f} GB; {room / 1e9:.1f} GB free for them)", file=sys.stderr)
        return piece

    def _activation_room(self) -> int | None:
        """Free memory where a pass's activations live, less headroom (None: unknown)."""
        if self.device.type == "cuda":
            from .io.device import device_headroom
            free, total = torch.cuda.mem_get_info(self.device)
            return max(0, free - device_headroom(total))
        if self.device.type != "cpu":
            return None
        from .io.memory import MemoryBudget, read_memory
        r = read_memory()
        return None if r.free is None else max(0, r.free - MemoryBudget(None).headroom(r))

    def residency_now(self) -> dict | None:
        """What the RAM cache or the device holds at this moment (None: a model wholly in RAM)."""
        report = getattr(self.engine.provider, "residency", None)
        return report() if report is not None else None

    def resident_bytes(self) -> int | None:
        """Bytes of weights the device holds (None off a device)."""
        held = getattr(self.engine.provider, "resident_bytes", None)
        return held()["total"] if held is not None else None

    @property
    def replays_passes(self) -> bool:
        """Whether decode passes replay recorded CUDA graphs (one per pass shape: a scheduler keeps the
        shapes few)."""
        return self.engine.graphs is not None

    def replayed_piece(self, left: int) -> int:
        """The prompt piece a replayed pass reads from a prompt with `left` tokens to go
        (decode_graph.piece_size); 0 where passes replay no graphs."""
        return piece_size(left) if self.engine.graphs is not None and left > 0 else 0

    @property
    def replayed_rows(self) -> int:
        """Rows a replayed pass takes at most (0: passes replay no graphs)."""
        return self.engine.graphs.max_rows if self.engine.graphs is not None else 0

    def record_passes(self, reach: int, drafts: int = 0, sequences: int = 1) -> int:
        """Records ahead the decode graphs a greedy generation of `sequences` sequences will replay: a
        decode step, and a check of a token and d drafts for every d up to `drafts` (the speculation's
        draft_len; 0 when it does not speculate), with state buffers for `reach` tokens a sequence.
        Returns how many were recorded (0 where passes replay no graphs, or all were recorded; shapes past
        the largest pass a graph takes are left to run plainly)."""
        if sequences < 1 or drafts < 0 or reach < 0:
            raise ValueError(f"record_passes needs sequences >= 1, drafts >= 0 and reach >= 0, got {sequences}, "
                             f"{drafts} and {reach}")
        shapes = [(sequences, 1 + d) for d in range(drafts + 1)]
        return self.engine.record_passes(shapes, reach)

    @property
    def layers(self) -> range:
        """The layers this process holds: all of them, or its range of a model split across ranks."""
        return self.engine.layers

    def one_token_threads(self) -> dict | None:
        """A streamed model's one-token passes: the products' threads now, the two counts the thread
        policy moves between, and how often it did (None: a fixed count)."""
        policy = self.engine.thread_policy
        return policy.summary() if policy is not None else None

    def ranks_report(self) -> list[dict] | None:
        """Every rank's running totals of a model split across processes, rank 0 first (None: one
        process, or a rank other than 0)."""
        report = getattr(self.engine, "ranks_report", None)
        return report() if report is not None else None

    def graph_stats(self) -> dict | None:
        """One-token passes replayed as a recorded CUDA graph (None: every kernel launched per pass)."""
        g = self.engine.graphs
        if g is None:
            return None
        return {"recorded": g.recorded, "replayed": g.replayed, "replayed_by_kind": dict(g.replayed_by_kind),
                "shapes": [list(shape) for shape in sorted(g.graphs, key=_shape_order)], "failed": g.failed,
                "record_seconds": g.record_seconds, "states_moved_in": g.moved_in}

    def cpu_replay_stats(self) -> dict | None:
        """One-token CPU passes replayed as the native calls they make (runtime/cpu_replay.py): how many
        were, how many recorded, and the shapes that cannot be and why (None: not on this model)."""
        r = self.engine.cpu_replay
        if r is None:
            return None
        return {"recorded": r.recorded, "replayed": r.replayed, "failed": {str(k): v for k, v in r.failed.items()}}

    def global_weights(self) -> dict:
        """The weights outside the layers (embedding, head, final norm) as the provider holds them."""
        return self.engine.provider.globals()

    def layer_weights(self, i: int, stats: PassStats | None = None) -> dict:
        """Layer i's spine as the provider hands it to a pass (for measurements; streamed models read it)."""
        return self.engine.provider.spine(i, PassStats() if stats is None else stats)

    def expert_weights(self, i: int, experts: list[int], stats: PassStats | None = None) -> dict:
        """Experts of layer i as the provider hands them to a pass: {expert id: (w1, w3, w2)}."""
        return self.engine.provider.experts(i, experts, PassStats() if stats is None else stats).result()


def _on_rank_gpu(settings: Settings, device: torch.device, local_rank: int) -> Settings:
    """A rank's settings on its own GPU (``dist.launch.rank_device``), made the process's current one."""
    from .dist.launch import rank_device
    mine = rank_device(device, local_rank, torch.cuda.device_count())
    torch.cuda.set_device(mine)
    return dataclasses.replace(settings, device=str(mine))


def load(path: str | Path, **settings) -> Model:
    """Open a checkpoint folder or converted store. Keyword arguments are settings (see Settings)."""
    s = settings.pop("settings", None) or Settings.resolve(settings)
    return Model(path, s)
