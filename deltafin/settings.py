"""Every knob deltafin has, in one typed object.

Priority: explicit value (CLI flag or keyword argument) > ``DELTAFIN_<NAME>`` environment
variable > default. Settings are resolved once, at start, and passed explicitly; nothing
reads the environment anywhere else.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import DeltafinError
from .units import GB


class SettingsError(DeltafinError):
    pass


def _knob(default, help: str, choices=None, group: str = "engine"):
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deltafin")


@dataclass
class Settings:
    device: str = _knob("auto", "compute device: auto (cuda, then mps, then cpu) | cpu | cuda[:N] | mps")
    dtype: str = _knob("float32", "dtype of the spine's matrix products (states, norms and the residual stream "
                       "stay float32). float32 is the exact reference. bfloat16 / float16 round each product's "
                       "input row and result (their distance from float32 is measured in the tests) and are "
                       "faster on CUDA / MPS (16-bit matrix units) and, for prefill, on CPUs with 16-bit "
                       "instructions (AVX512-BF16, AMX). On the CPU decoding runs the same native kernels "
                       "for every dtype, at the same speed (it is bound by reading the stored weights), "
                       "so there float32 costs nothing when decoding",
                       choices=("float32", "bfloat16", "float16"))
    stream: str = _knob("auto", "stream weights from disk per layer (on), keep them in RAM (off), "
                        "or decide from the model size and free RAM (auto)", choices=("auto", "on", "off"))
    spine: str = _knob("auto", "which spine of a converted store to use: auto (int8 if present, else bf16) "
                       "| bf16 (exact) | int8 | mixed (int8 and mixed are lossy: smaller and faster to read, "
                       "logits measurably off the bf16 reference)", choices=("auto", "bf16", "int8", "mixed"))
    gpu_budget: str = _knob("auto", "device memory in GB (10^9 bytes) the weights may take on a CUDA / MPS "
                            "device: the globals, then the spines of a fixed set of layers, then in every MoE "
                            "layer the experts routed most often; the rest streams. auto = the device's free "
                            "memory minus headroom for states and activations (printed at start). With --stream "
                            "off the whole model must fit in it")
    cuda_graphs: bool = _knob(True, "with the whole model resident on a CUDA device, replay decode passes (one token "
                              "of each sequence, or one and its drafts) as recorded CUDA graphs (one launch per "
                              "pass instead of about a hundred kernel launches per layer and sequence); off = "
                              "launch every kernel of every pass")
    cpu_replay: bool = _knob(True, "with the whole model resident in RAM on the CPU, run a one-token pass as the native "
                             "calls the first pass of its shape made (one per layer half, two for the head), made "
                             "again without the model's Python between them; off = every pass through the Python")
    pin_layers: int = _knob(0, "number of leading layers whose spine stays in RAM when streaming, whatever the "
                            "RAM budget")
    ram_budget: str = _knob("auto", "host memory in GB (10^9 bytes) a streamed model may hold: its streaming "
                            "buffers, then the spines of a fixed set of layers, then in every MoE layer the "
                            "experts routed most often lately; the rest is read from disk per token. auto = grow "
                            "only into genuinely free memory (page cache is not counted; a cgroup's limit is "
                            "respected), keep headroom, and give memory back as soon as free memory falls or "
                            "memory pressure appears (a set budget does the same below its ceiling). 0 = no "
                            "cache. Printed at start")
    cpu_experts: str = _knob("auto", "with a CUDA / MPS device that streams: compute the routed experts the host serves "
                             "(its RAM cache, or the disk) on the host's cores, so their weights never cross to the "
                             "device (on), or copy them to the device (off); auto = per MoE layer, from its first pass "
                             "with such experts: the host's products of all of them against the time the copy "
                             "stream would be busy meanwhile (their copies and the spine it copies ahead). Only "
                             "passes of up to 8 rows: a prompt's experts are always copied",
                             choices=("auto", "on", "off"))
    prefetch: str = _knob("off", "when streaming, read a MoE layer's likely experts before its router runs, at the "
                          "lowest read priority (demand reads go first; a guess the router confirms while it "
                          "is still being read is waited for, not read again): early = the layer's router "
                          "applied one layer ahead to the residual stream; prev = the experts the previous "
                          "token chose at that layer; off = none",
                          choices=("off", "early", "prev"))
    io_workers: int = _knob(8, "parallel pread workers for routed experts")
    read_mode: str = _knob("nocache", "how expert and spine bytes are read: nocache (O_DIRECT, else drop pages "
                           "after use; fastest when streaming), buffered (page cache), mmap",
                           choices=("nocache", "buffered", "mmap"))
    threads: int = _knob(0, "compute threads; 0 = auto: every core when the model is in RAM; when streaming, "
                         "one fewer than the cores (at least 1), because the pread workers need a core and "
                         "compute threads that share one with them stall on every small op (2 cores, "
                         "streaming: 1 thread measured faster than 2); passes of several rows (a batch, "
                         "drafts, a prompt piece) run their products on every core, and one-token passes too "
                         "once they stop reading from disk while they compute (the RAM cache serves their "
                         "spines); one where a GPU holds the whole model (the host only feeds it)")
    kda_chunk: int = _knob(64, "chunk length of the chunked KDA prefill (deltafin's own form; "
                           "flash-linear-attention's kernel, used on CUDA with bf16 products where installed, "
                           "picks its own)")
    placement: str = _knob("", "a model split across ranks (torchrun): each rank's layers, in rank order, as "
                           "contiguous ranges covering every layer, e.g. 0-3,4-7; empty = sized by each rank's "
                           "--ram-budget when every rank sets one above 0, else equal weight bytes per rank")
    dist_timeout: float = _knob(60.0, "a model split across ranks (torchrun): seconds a rank waits for another "
                                "within a pass before the request fails naming that rank; must exceed the "
                                "slowest pass")
    pipeline: int = _knob(0, "a model split across ranks (torchrun): passes of different sequences in flight at "
                          "once, so that while rank 1 runs one group's layers rank 0 runs the next group's; 0 = one "
                          "per rank, or one in all where two ranks share a host's cores (they gain nothing from it)")
    speculate: bool = _knob(True, "n-gram speculation for greedy decoding (output is unchanged)", group="generate")
    ngram: int = _knob(4, "longest n-gram matched when drafting", group="generate")
    draft_len: int = _knob(8, "maximum drafted tokens verified per pass (a draft is cut shorter as its match "
                           "length's drafts have fared)", group="generate")
    max_new_tokens: int = _knob(128, "default number of tokens to generate", group="generate")
    profile: bool = _knob(False, "print where time and bytes went, per token and in total", group="generate")
    prompt_cache: str = _knob("", "file holding the decode state after a fixed prompt prefix (run, chat: restored "
                              "when it matches this model and prefix, else made; serve: restored into the prefix "
                              "cache); empty = none", group="generate")
    cache_dir: str = _knob(_default_cache_dir(), "where the built-in default model is made and kept, and where "
                           "hub repositories (--model owner/name) are cached")
    revision: str = _knob("main", "branch, tag or commit of a hub repository (--model owner/name); it is "
                          "resolved to a commit once and that commit is used throughout")
    hub_connections: int = _knob(8, "parallel HTTP range requests when fetching from the hub")
    hub_retries: int = _knob(5, "retries of a failed hub request (429, 5xx, broken connection, short body)")
    hub_backoff: float = _knob(0.5, "seconds before the first retry of a hub request; doubled each time "
                               "(a Retry-After from the server wins)")
    hub_cache_gb: float = _knob(0.0, "disk budget in GB (10^9 bytes) for routed experts fetched from the hub "
                                "(least recently used ones are deleted); 0 = no limit")
    host: str = _knob("127.0.0.1", "address the server listens on", group="serve")
    port: int = _knob(8000, "port the server listens on", group="serve")
    queue_size: int = _knob(8, "requests that may wait for the engine before 429", group="serve")
    queue_timeout: float = _knob(60.0, "seconds a request may wait for the engine before 429", group="serve")
    memo_size: int = _knob(64, "deterministic-response memo entries (0 disables)", group="serve")
    max_tokens_cap: int = _knob(4096, "server-side cap on max_tokens per request", group="serve")
    max_batch: int = _knob(8, "generations the server runs together, sharing every weight pass (1 = one at a "
                           "time)", group="serve")
    prefill_chunk: int = _knob(256, "prompt tokens fed per pass while no other request is decoding (while "
                               "others decode, a newcomer's pieces shrink to keep their pace)", group="serve")
    prefix_cache_mb: int = _knob(2048, "memory budget in MiB (2^20 bytes) for decode states kept between "
                                 "requests, reused when a new prompt starts with the same tokens (0 disables)",
                                 group="serve")
    prefix_cache_block: int = _knob(1024, "while a long prompt is read in, also keep its state each time another "
                                    "this many tokens are in (at the end of that prefill piece), so prompts that "
                                    "share only a beginning reuse it; 0 = only at the end of the prompt",
                                    group="serve")
    max_model_len: int = _knob(0, "longest prompt + reply the server accepts, in tokens; 0 = the model's context",
                               group="serve")
    api_key: str = _knob("", "require 'Authorization: Bearer KEY' on every /v1 route; empty = no key",
                         group="serve")
    served_model_name: str = _knob("", "comma-separated names the server answers to in the 'model' field "
                                   "(the first is the one it reports); empty = the model folder's name",
                                   group="serve")
    header_timeout: float = _knob(10.0, "seconds a client may take to send a request's headers", group="serve")
    body_timeout: float = _knob(30.0, "seconds a client may take to send a request's body", group="serve")
    render_timeout: float = _knob(10.0, "seconds the chat template and tokenizer may take for one request",
                                  group="serve")
    debug: bool = _knob(False, "on an error, print the full traceback instead of one line", group="cli")

    @classmethod
    def resolve(cls, explicit: dict | None = None, env: dict | None = None) -> "Settings":
        """explicit (non-None values win) > DELTAFIN_* in env > defaults."""
        env = os.environ if env is None else env
        explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
        names = {f.name for f in fields(cls)}
        unknown = set(explicit) - names
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))} "
                                f"(known: {', '.join(sorted(names))})")
        values = {}
        for f in fields(cls):
            var = "DELTAFIN_" + f.name.upper()
            if f.name in explicit:
                raw, source = explicit[f.name], f"setting '{f.name}'"
            elif var in env:
                raw, source = env[var], f"environment variable {var}"
            else:
                continue
            values[f.name] = _coerce(f, raw, source)
        s = cls(**values)
        s._check()
        return s

    def _check(self) -> None:
        parse_device(self.device)  # raises with a message
        parse_gpu_budget(self.gpu_budget)
        parse_ram_budget(self.ram_budget)
        parse_placement(self.placement)
        if not self.revision.strip():
            raise SettingsError("setting 'revision' must not be empty")
        for f in fields(self):
            lo, hi = RANGES.get(f.name, (None, None))
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise SettingsError(f"setting '{f.name}' must be a finite number, got {v}")
            if lo is not None and v < lo:
                raise SettingsError(f"setting '{f.name}' must be >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise SettingsError(f"setting '{f.name}' must be <= {hi}, got {v}")

    def gpu_budget_bytes(self) -> int | None:
        """The budget in bytes, or None for auto."""
        return parse_gpu_budget(self.gpu_budget)

    def ram_budget_bytes(self) -> int | None:
        """The RAM budget in bytes, or None for auto."""
        return parse_ram_budget(self.ram_budget)

    def torch_device(self):
        import torch
        return torch.device(resolve_device(self.device))

    def torch_dtype(self):
        import torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def summary(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if f.metadata.get("group") in ("engine", "generate"))

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir)


# (lowest, highest) of numeric settings; None: unbounded on that side. The upper bounds keep a
# typo from asking for more threads, workers or buffers than any machine has (100000 compute
# threads crash the tokenizer's thread pool).
MAX_THREADS = 1024
RANGES = {
    "pin_layers": (0, None), "io_workers": (1, 256), "threads": (0, MAX_THREADS), "kda_chunk": (1, 4096),
    "ngram": (1, 64), "draft_len": (1, 64), "max_new_tokens": (0, None), "port": (0, 65535),
    "queue_size": (0, None), "queue_timeout": (0, None), "memo_size": (0, None), "max_tokens_cap": (0, None),
    "max_model_len": (0, None), "header_timeout": (0.1, None), "body_timeout": (0.1, None),
    "render_timeout": (0.1, None), "max_batch": (1, 256), "prefill_chunk": (1, None),
    "hub_connections": (1, 256), "hub_retries": (0, 100), "hub_backoff": (0, 600), "hub_cache_gb": (0, None),
    "prefix_cache_mb": (0, None), "prefix_cache_block": (0, None), "dist_timeout": (0.1, None),
    "pipeline": (0, 64),
}


def _coerce(f, raw, source: str):
    typ = f.type if not isinstance(f.type, str) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    try:
        if typ is bool:
            if isinstance(raw, bool):
                val = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                val = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                val = False
            else:
                raise ValueError
        else:
            val = typ(raw)
    except (TypeError, ValueError):
        allowed = "true/false/1/0/on/off" if typ is bool else f"a {typ.__name__}"
        raise SettingsError(f"{source}: invalid value {raw!r} (allowed: {allowed})") from None
    choices = f.metadata.get("choices")
    if choices and val not in choices:
        raise SettingsError(f"{source}: invalid value {raw!r} (allowed: {', '.join(choices)})")
    return val


def parse_device(spec: str) -> str:
    spec = str(spec).strip().lower()
    if spec in ("auto", "cpu", "mps", "cuda"):
        return spec
    if spec.startswith("cuda:") and spec[5:].isdigit():
        return spec
    raise SettingsError(f"setting 'device' (DELTAFIN_DEVICE): invalid value {spec!r} "
                        "(allowed: auto, cpu, cuda, cuda:N, mps)")


def _parse_budget(name: str, spec: str, zero_ok: bool, allowed: str) -> int | None:
    """'auto' -> None; a finite number of GB (above 0, or also 0 when `zero_ok`) -> bytes."""
    text = str(spec).strip().lower()
    if text == "auto":
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = float("nan")
    if not (gb >= 0 if zero_ok else gb > 0) or gb == float("inf"):
        raise SettingsError(f"setting '{name}' (DELTAFIN_{name.upper()}): invalid value {spec!r} (allowed: {allowed})")
    return int(gb * GB)


def parse_gpu_budget(spec: str) -> int | None:
    return _parse_budget("gpu_budget", spec, False, "auto, or a number of GB above 0")


def parse_ram_budget(spec: str) -> int | None:
    return _parse_budget("ram_budget", spec, True, "auto, 0 = no cache, or a number of GB above 0")


def parse_placement(spec: str) -> list[range] | None:
    """'' -> None; '0-3,4-7' (each range FIRST-LAST, or one layer N) -> [range(0, 4), range(4, 8)],
    checked to be contiguous from layer 0 (the model's layer count is checked where it is known)."""
    text = str(spec).strip()
    if not text:
        return None
    ranges = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        last = last or first
        if not (first.strip().isdigit() and last.strip().isdigit()):
            raise SettingsError(f"setting 'placement' (DELTAFIN_PLACEMENT): {part.strip()!r} is not a layer "
                                "range FIRST-LAST (e.g. 0-3,4-7)")
        ranges.append(range(int(first), int(last) + 1))
    start = 0
    for r in ranges:
        if r.start != start or not r:
            raise SettingsError(f"setting 'placement' (DELTAFIN_PLACEMENT): {spec!r} must list contiguous, "
                                f"non-empty layer ranges from layer 0 in rank order (expected one starting "
                                f"at {start}, got {r.start}-{r.stop - 1})")
        start = r.stop
    return ranges


def resolve_device(spec: str) -> str:
    import torch
    spec = parse_device(spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise SettingsError(f"device {spec!r} was asked for but CUDA is not available here")
    if spec == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise SettingsError("device 'mps' was asked for but MPS is not available here")
    return spec


def add_arguments(parser: argparse.ArgumentParser, groups=("engine", "generate"), only=None) -> None:
    """Add a --flag for every knob in the given groups, or only for the knobs named in `only`
    (default None = not given)."""
    for f in fields(Settings):
        if (f.name not in only) if only is not None else (f.metadata.get("group") not in groups):
            continue
        flag = "--" + f.name.replace("_", "-")
        env = "DELTAFIN_" + f.name.upper()
        help_ = f"{f.metadata['help']} [env {env}, default {f.default!r}]"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_)


def from_args(args: argparse.Namespace) -> Settings:
    names = {f.name for f in fields(Settings)}
    return Settings.resolve({k: v for k, v in vars(args).items() if k in names})


def settings_markdown() -> str:
    """docs/settings.md: every knob of ``Settings``, one table per group, in declaration order.
    tools/settings_doc.py writes it; tests/test_docs.py fails when the file differs from this."""
    titles = {
        "engine": "Engine: how the model runs (run, chat, serve, bench; inspect takes `--spine`)",
        "generate": "Generation (run, chat, serve)",
        "serve": "Server (serve)",
        "cli": "Command line (every command)",
    }
    kinds = {int: "integer", float: "number", str: "text"}
    lines = [
        "# Settings",
        "",
        "<!-- Generated from deltafin/settings.py by `python tools/settings_doc.py`; edit the help texts there. -->",
        "",
        "Every knob is a command-line flag, a `DELTAFIN_<NAME>` environment variable, or a default, in that",
        "order of priority (the Python API takes them as keyword arguments of `deltafin.load`). They are",
        "resolved once, at start. An invalid value is refused with a message naming the flag or variable and",
        "the allowed values; numbers are also range-checked (the *values* column). `deltafin COMMAND --help`",
        "lists the same with their defaults. Sampling (`--temperature`, `--top-p`, `--top-k`, `--seed`,",
        "`--stop`) is per generation, not a setting: see `deltafin run --help`.",
    ]
    groups = dict.fromkeys(f.metadata["group"] for f in fields(Settings))
    for group in groups:
        lines += ["", f"## {titles.get(group, group)}", "",
                  "| setting | flag | environment | default | values | help |", "|---|---|---|---|---|---|"]
        for f in fields(Settings):
            if f.metadata["group"] != group:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = type(f.default)
            if kind is bool:
                flag, values = f"`{flag}` / `--no-{flag[2:]}`", "`true` \\| `false`"
                default = f"`{str(f.default).lower()}`"
            else:
                flag, values = f"`{flag}`", kinds[kind]
                default = f"`{f.default}`" if f.default != "" else "(empty)"
            if f.name == "cache_dir":  # computed from this machine's environment; the page must not be
                default = "`$XDG_CACHE_HOME/deltafin`, else `~/.cache/deltafin`"
            lo, hi = RANGES.get(f.name, (None, None))
            if f.metadata["choices"]:
                values = " \\| ".join(f"`{c}`" for c in f.metadata["choices"])
            elif lo is not None and hi is not None:
                values += f", {lo} to {hi}"
            elif lo is not None:
                values += f", >= {lo}"
            elif hi is not None:
                values += f", <= {hi}"
            help_ = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{f.name}` | {flag} | `DELTAFIN_{f.name.upper()}` | {default} | {values} | {help_} |")
    return "\n".join(lines) + "\n"
