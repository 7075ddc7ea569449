#!/usr/bin/env bash
# ./run.sh            set up (virtualenv + install, first time only) and run the built-in default model
# ./run.sh test       run the whole test suite
# ./run.sh ARGS...    any other arguments go to `deltafin run` (e.g. ./run.sh "Once upon a time")
set -euo pipefail
cd "$(dirname "$0")"
VENV="${DELTAFIN_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# Install again whenever what the install depends on changed (dependencies, the native kernels'
# source), not only when an import fails: an existing venv then picks up new packages and kernels.
STAMP="$VENV/.deltafin-install"
WANT=$(cat pyproject.toml setup.py deltafin/kernels/_cpu_kernels.c | cksum)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || \
   ! "$VENV/bin/python" -c "import deltafin, torch, transformers, tiktoken, fastapi, uvicorn, openai, pytest" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned: on machines that carry a local CPU build of 2.13.0 this takes it instead of
  # pulling a multi-GB CUDA build; elsewhere it falls back to the platform's default build.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q torch
  fi
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  echo "$WANT" > "$STAMP"
fi

if [ "${1:-}" = "test" ]; then
  shift
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
exec "$VENV/bin/deltafin" run "$@"
