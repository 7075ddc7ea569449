"""Running ``deltafin serve``: the command's arguments, binding the port, and uvicorn over the app.

``run_cli`` binds the port before the model loads (a busy port is reported at once, not after a
long load), loads the model and serves it until interrupted; ``serve`` does the same for a model
already loaded. The app itself is ``app.create_app``; listening and the header time limit are in
``http``. What it trusts: the command line and settings, checked by ``settings`` as they are read.
"""
from __future__ import annotations

import argparse
import json
import logging

from .. import settings as settings_mod
from ..settings import Settings
from .http import bind, header_timeout_protocol


def _url_host(host: str) -> str:
    # A wildcard address is not something to curl; the loopback of the same family is.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def serve(model, host: str | None = None, port: int | None = None, sock=None) -> None:
    """Serve ``model`` until interrupted. host/port default to the model's settings; ``sock``, a
    socket already listening (see ``http.bind``), replaces them."""
    settings = model.settings
    host = settings.host if host is None else host
    port = settings.port if port is None else int(port)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The web stack (fastapi, pydantic, uvicorn) loads only for serving: every other command starts
    # without it.
    import uvicorn

    from .app import create_app
    app = create_app(model)
    sock = bind(host, port) if sock is None else sock
    bound = sock.getsockname()[1]
    base = f"http://{_url_host(host)}:{bound}"
    name = app.state.service.name
    print(f"deltafin serving '{name}' at {base}/v1 (max_batch={settings.max_batch}, "
          f"prefill_chunk={settings.prefill_chunk}, queue_size={settings.queue_size}, "
          f"queue_timeout={settings.queue_timeout:g}s, memo_size={settings.memo_size}, "
          f"max_tokens_cap={settings.max_tokens_cap}, api key {'required' if settings.api_key else 'not required'})",
          flush=True)
    example = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    auth = " -H 'Authorization: Bearer $KEY'" if settings.api_key else ""
    print(f"try: curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{example}'",
          flush=True)
    uvicorn.Server(uvicorn_config(app, settings)).run(sockets=[sock])


def uvicorn_config(app, settings: Settings):
    """How uvicorn runs the app: h11 with the header time limit."""
    import uvicorn
    return uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(settings.header_timeout))


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to the CLI's subparsers (it runs ``run_cli``)."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                          "/v1/completions, /v1/models, /health). Without --model, serves the "
                                          "built-in default model.")
    p.add_argument("--model", metavar="PATH",
                   help="checkpoint folder, converted store, or hub repository owner/name (fetched lazily) "
                        "(default: built-in synthetic model)")
    settings_mod.add_arguments(p, groups=("engine", "generate", "serve"))
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from deltafin.startup import load_announced

    settings = settings_mod.from_args(args)
    sock = bind(settings.host, settings.port)  # a busy port is reported before the model loads, not after
    try:
        model, _ = load_announced(args.model, settings)
        serve(model, sock=sock)
    finally:
        sock.close()
    return 0
