"""The `deltafin` command line. Each subcommand only translates arguments and prints."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from . import bench, chat
from .checkpoint import convert
from .dist import launch as dist_launch
from .dist.transport import RankFault
from .errors import DeltafinError
from .profile import PassRecorder, format_pass, format_summary
from .runtime import sampling
from .runtime.generate import generate
from .serve import cli as serve_cli
from .settings import Settings, SettingsError, add_arguments, from_args
from .startup import default_model_path, load_announced, read_text_arg, record_passes_announced


# -- run ---------------------------------------------------------------------------------------
def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt",
                       description="Generate text. Without --model, runs the built-in default model.")
    p.add_argument("prompt", nargs="?", default="The quick brown fox",
                   help="prompt text; - reads it from standard input, @FILE from a file (@@ for a literal "
                        "leading @) (default: %(default)r)")
    p.add_argument("--model", help="checkpoint folder, converted store, or hub repository owner/name (fetched "
                   "lazily) (default: built-in synthetic model)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the checkpoint's chat template")
    sampling.add_arguments(p)
    add_arguments(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    settings = from_args(args)
    model, _ = load_announced(args.model, settings)
    text = read_text_arg(args.prompt)
    ids = model.encode_chat([{"role": "user", "content": text}]) if args.chat else model.encode(text)
    if not ids:
        raise ValueError("the prompt is empty")
    state, held = None, []
    if settings.prompt_cache:
        # The fixed part: everything but the last token, so that the same prompt (or one that
        # extends it) starts from the saved state and still feeds one token to get logits.
        from .runtime.saved_state import restore_or_build
        held = ids[:-1]
        state = restore_or_build(model, settings.prompt_cache, held, lambda m: print(f"deltafin: {m}", file=sys.stderr))
    params = sampling.from_args(args, settings.max_new_tokens)
    record_passes_announced(model, params, len(ids) + params.max_new_tokens)
    # With --profile every pass prints a line as it ends.
    recorder = PassRecorder(report=lambda i, s: print(format_pass(i, s), file=sys.stderr))

    def on_token(token_id: int, text: str):
        sys.stdout.write(text)
        sys.stdout.flush()

    with model.observe(recorder) if settings.profile else contextlib.nullcontext():
        g = generate(model, ids[len(held):], params, on_token=on_token, state=state, held_ids=held)
    sys.stdout.write("\n")
    s = g.stats
    print(f"deltafin: {s['tokens']} tokens in {s['decode_seconds']:.2f} s ({s['decode_tok_s']:.2f} tok/s), "
          f"prefill {s['prefill_tokens']} tokens in {s['prefill_seconds']:.2f} s, "
          f"{s['passes']} passes ({s['tokens_per_pass']:.2f} tokens/pass), finish: {g.finish_reason}",
          file=sys.stderr)
    if settings.profile:
        print(format_summary(recorder.passes, made=max(s["generated_tokens"] - 1, 0)), file=sys.stderr)
        residency = model.residency_now()
        if residency is not None:
            print(f"  residency now: {residency}", file=sys.stderr)
    return 0


# -- inspect / make-checkpoint ------------------------------------------------------------------
def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: layers, parameters, bytes per token")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_arguments(p, only=("spine",))
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from .inspect import inspect_path
    print(inspect_path(args.path, args.json, spine=from_args(args).spine))
    return 0


def _add_make_checkpoint(sub) -> None:
    from .checkpoint.synthetic import PRESETS
    p = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the published format",
                       description="Random weights (fixed seed) in the exact published K3 / Kimi Linear layout.")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="folder to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (value read as JSON), e.g. --set num_hidden_layers=6")
    p.add_argument("--shard-size", type=int, default=None, help="largest shard in bytes")
    p.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="expert popularity per MoE layer ~ rank^-S (Zipf), built into the router's "
                        "correction bias; 0 = uniform. Without it the bias is plain random")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_make_checkpoint)


def cmd_make_checkpoint(args) -> int:
    from .checkpoint.synthetic import make_checkpoint, parse_override
    try:
        overrides = dict(parse_override(item) for item in args.overrides)
        out = make_checkpoint(args.preset, args.out, seed=args.seed, overrides=overrides,
                              progress=not args.quiet, shard_size=args.shard_size, overwrite=args.overwrite,
                              routing_skew=args.routing_skew)
    except (KeyError, FileExistsError) as e:
        raise ValueError(e.args[0] if e.args else str(e)) from None
    print(out)
    return 0


# -- a model split across ranks (torchrun) ------------------------------------------------------
DIST_COMMANDS = ("run", "chat", "bench", "serve")


def run_launched(args, launch: dist_launch.Launch) -> int:
    """One rank of a model split across processes: rank 0 runs the command (serve: the HTTP server
    is on rank 0 only), the others serve its passes (printing nothing to stdout) until it stops."""
    if args.command not in DIST_COMMANDS:
        raise ValueError(f"deltafin {args.command} does not run across ranks (these do: {', '.join(DIST_COMMANDS)})")
    settings = from_args(args)
    group = dist_launch.join(launch, settings.dist_timeout)
    try:
        if group.rank == 0:
            # A SIGTERM (a service manager, torchrun's agent ending the group) ends rank 0 through its
            # finally blocks, so that the others are told to stop instead of finding it gone; the
            # server stops gracefully first, then hands the signal on.
            signal.signal(signal.SIGTERM, _terminated)
            return args.func(args)
        import deltafin
        from .dist.worker import serve_passes
        model = deltafin.load(args.model or default_model_path(settings), settings=settings)
        return serve_passes(group, model.engine)
    finally:
        dist_launch.leave()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # what a shell reports for a process ended by the signal


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltafin",
        description="Run Kimi K3 / Kimi Linear MoE models larger than RAM by streaming weights from disk. "
                    "Every engine setting is also a DELTAFIN_<NAME> environment variable.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_inspect(sub)
    _add_make_checkpoint(sub)
    for add_cli in (chat.add_cli, serve_cli.add_cli, bench.add_cli, convert.add_cli):
        add_cli(sub)
    for command in sub.choices.values():  # every command takes --debug
        add_arguments(command, groups=("cli",))
    return parser


def _debug(args) -> bool:
    if getattr(args, "debug", None) is not None:
        return bool(args.debug)
    try:
        return Settings.resolve().debug  # DELTAFIN_DEBUG
    except SettingsError:
        return False


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        launch = dist_launch.from_environment()
        rc = (args.func(args) if launch is None else run_launched(args, launch)) or 0
        sys.stdout.flush()  # a pipe buffers: a closed reader shows up here, not at exit
        return rc
    except BrokenPipeError:
        # The reader went away (`deltafin inspect ... | head`): stop quietly, like other Unix tools.
        # stdout is pointed at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if _debug(args):
            raise
        # DeltafinError: bad input or a fault deltafin named; OSError: what the system refused
        # (permission, disk full); ValueError: a refused argument. Anything else is a bug.
        if isinstance(e, (DeltafinError, OSError, ValueError)):
            print(f"deltafin: error: {e}", file=sys.stderr)
            if isinstance(e, RankFault):  # a rank of the group failed, not the input
                return 1
        else:
            print(f"deltafin: error: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
                  file=sys.stderr)
        return 2
