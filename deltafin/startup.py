"""What every front end (run, chat, serve, bench) does at start: find the built-in default model
(made on first use), load the model with the start-up lines that say what runs, from where, with
which numerics (``load_announced``), and read a prompt argument."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .api import Model, load
from .checkpoint import expert_codec
from .checkpoint.synthetic import make_checkpoint
from .files import writer_lock
from .settings import Settings
from .units import MiB

DEFAULT_PRESET = "small-k3"


def default_model_path(settings: Settings) -> Path:
    """The built-in default model, made on first use under the cache directory."""
    path = settings.cache_path / DEFAULT_PRESET
    if (path / "config.json").exists():
        return path
    def waiting(holder: str) -> None:
        print(f"deltafin: waiting for {holder}, which is making the built-in default model in {path}",
              file=sys.stderr)

    # Two first runs at once: one makes the model, the other waits for it and then uses it.
    with writer_lock(path, "making the default model", wait=True, on_wait=waiting):
        if not (path / "config.json").exists():
            print(f"deltafin: making the built-in default model ({DEFAULT_PRESET}, synthetic weights) in {path}",
                  file=sys.stderr)
            make_checkpoint(DEFAULT_PRESET, path, seed=0)
    return path


def spine_message(source, path, chosen: str = "auto") -> str:
    """Which spine this run reads: whether it is exact, and how to get the exact (or a faster) one."""
    if source.kind == "hub":
        return (f"bf16 spine (exact); weights fetched from the hub as they are first used ({source.where}), "
                f"cached in {source.path}")
    if source.kind == "hf":
        return (f"bf16 spine (exact) read from the Hugging Face folder (faster: deltafin convert {path} STORE "
                "--spine int8, then --model STORE)")
    codec = source.spine_codec
    if codec == "bf16":
        if "int8" in source.spines:
            return "bf16 spine (exact)"
        return f"bf16 spine (exact; faster: deltafin convert SRC {path} --spine int8 adds an int8 spine)"
    what = f"{codec} spine" + (f" (policy {source.manifest['spines']['mixed']['policy']['name']})"
                               if codec == "mixed" else "")
    why = " chosen by --spine auto because the store has one;" if chosen == "auto" else ""
    exact = ("--spine bf16 (or DELTAFIN_SPINE=bf16)" if "bf16" in source.spines
             else f"deltafin convert SRC {path} --spine bf16 adds it")
    return f"{what}: LOSSY,{why} outputs differ from the bf16 reference; for the exact spine: {exact}"


def experts_message(source) -> str:
    """What the routed experts are stored as, and whether that is exact."""
    cfg, codec = source.config, expert_codec.of(source)
    name = expert_codec.describe(cfg, codec)
    if codec == expert_codec.published(cfg):
        return f"{name} experts (as published)"
    return (f"{name} experts: LOSSY (converted with {expert_codec.asked_flags(cfg, codec)}; the source's are "
            f"{expert_codec.describe(cfg, expert_codec.PLAIN)})")


def products_message(settings: Settings) -> str:
    if settings.dtype == "float32":
        return "float32 products (reference)"
    return f"{settings.dtype} products (lossy; --dtype float32 is the reference)"


def threads_message(model) -> str:
    if model.settings.threads:
        return f"{model.threads} compute threads (set)"
    if not model.host_computes:
        return (f"1 compute thread (auto, the device holds the whole model: the host only feeds it; "
                f"{model.engine.gather_threads} for a long prompt's embedding rows)")
    why = "model in RAM: every core" if not model.streaming else "streaming: one core left to the readers"
    rows = model.row_threads
    if rows is not None and rows != model.threads:
        why += (f"; {rows} for the products of a pass of several rows, and of one-token passes once they "
                "stop reading from disk as they compute")
    return f"{model.threads} compute thread{'s' if model.threads != 1 else ''} (auto, {why})"


def startup_message(model, path) -> str:
    """The start-up line: what runs, from where, with which numerics."""
    return (f"deltafin: {model.name}: {model.config.architecture}, {model.config.num_layers} layers, "
            f"{'streaming from disk' if model.streaming else 'in RAM'}, {threads_message(model)}; "
            f"{spine_message(model.source, path, model.settings.spine)}; {experts_message(model.source)}; "
            f"{products_message(model.settings)}"
            + (f"\ndeltafin: {model.residency}" if model.residency else "")
            + (f"\n{model.placement.table()}\ndeltafin: {pipeline_message(model)}" if model.placement is not None
               else ""))


def pipeline_message(model) -> str:
    """How many passes a split model keeps in flight, and why."""
    depth = model.pipeline_depth
    if model.settings.pipeline:
        why = "--pipeline"
    elif depth == 1:
        why = "auto: ranks share this host's cores or a GPU, so one pass at a time batches every request into it"
    else:
        why = "auto: one per rank"
    return f"{depth} pass{'es' if depth != 1 else ''} of different sequences in flight at once ({why})"


def load_announced(model: str | None, settings: Settings) -> tuple[Model, str | Path]:
    """The model a command names (or the built-in default), loaded with ``settings``, the settings'
    line and the start-up line printed to stderr first and after; (model, the path it was named by)."""
    path = model or default_model_path(settings)
    print(f"deltafin: {settings.summary()}", file=sys.stderr)
    loaded = load(path, settings=settings)
    print(startup_message(loaded, path), file=sys.stderr)
    return loaded, path


MAX_PROMPT_FILE = 64 * MiB


def record_passes_announced(model, params, reach: int) -> None:
    """Where passes replay recorded graphs, records the ones a generation with these sampling parameters
    will replay (sequences of up to `reach` tokens) before it starts, their kernels compiled and tuned,
    so that its tokens come at the replayed pace; says how long that took."""
    if not model.replays_passes:
        return
    t0 = time.perf_counter()
    n = model.record_passes(min(reach, model.config.max_position_embeddings),
                            model.settings.draft_len if params.speculates(model.settings.speculate) else 0)
    if n:
        print(f"deltafin: recorded {n} decode graph(s) in {time.perf_counter() - t0:.2f} s", file=sys.stderr)


def read_text_arg(value: str) -> str:
    """A prompt argument: ``-`` reads standard input, ``@FILE`` reads a UTF-8 file, ``@@text`` is the
    literal ``@text``, anything else is the text itself."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@@"):
        return value[1:]
    if not value.startswith("@"):
        return value
    path = Path(value[1:]).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE:
            raise ValueError(f"{path}: {size} bytes; a prompt file may be at most {MAX_PROMPT_FILE} bytes")
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such prompt file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompt file ({e.strerror or e})") from None
