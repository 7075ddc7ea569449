"""Decode states on disk: what a saved state belongs to, and checks before one is reused.

A saved state is only valid for the exact model weights, spine codec and product dtype that
computed it, and for the exact token ids it holds. ``model_identity`` names the first three:
a hash of the parsed config, a fingerprint of the weights (4 KiB from the middle of every
global and spine tensor as stored, so different weights of one shape differ), the spine codec
and the dtype products run in (and the experts' codec when ``convert --experts`` re-encoded them).
The file itself is ``DecodeState.save``'s safetensors file; its JSON header carries the identity and
the token ids.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ..checkpoint import expert_codec
from ..files import pread_exact
from ..model.state import DecodeState, StateFileError

_SAMPLE = 4096  # bytes fingerprinted per tensor


def model_identity(source, dtype: str) -> dict:
    """Everything a decode state depends on, as short strings (compared field by field)."""
    cfg = json.dumps(dataclasses.asdict(source.config), sort_keys=True, default=str)
    spine = source.spine_codec
    if spine == "mixed":
        spine += ":" + str(source.manifest["spines"]["mixed"]["policy"]["name"])
    h = hashlib.sha256()
    infos = [source.global_infos()] + [source.spine_infos(i) for i in range(source.config.num_layers)]
    for group in infos:
        for name in sorted(group):
            info = group[name]
            take = min(_SAMPLE, info.nbytes)
            start = info.offset + (info.nbytes - take) // 2
            h.update(f"{name}:{info.shape}:{info.dtype}:".encode())
            h.update(pread_exact(source.fd(info.file), take, start, info.file))
    identity = {"architecture": source.config.architecture,
                "config_sha256": hashlib.sha256(cfg.encode()).hexdigest()[:16],
                "weights_sha256": h.hexdigest()[:16], "spine": spine, "dtype": dtype}
    # Re-encoded experts (convert --experts) compute other states; experts as published add no
    # field, so states saved before the field existed still match their model.
    experts = expert_codec.of(source)
    return identity | ({"experts": experts} if experts != expert_codec.published(source.config) else {})


def save_state(model, path: str | Path, ids: list[int], state: DecodeState, extra: dict | None = None) -> None:
    """Write ``state`` (which holds exactly ``ids``) for this model; ``extra`` goes into the header."""
    if state.num_tokens != len(ids):
        raise ValueError(f"the state holds {state.num_tokens} tokens, but {len(ids)} token ids were given")
    state.save(path, {**(extra or {}), "model": model.identity, "token_ids": [int(t) for t in ids]})


def load_state(model, path: str | Path) -> tuple[list[int], DecodeState, dict]:
    """Read a saved state after checking it was made by this model, codec and dtype.

    Returns (the token ids it holds, the state, the whole header). Raises StateFileError with the
    first mismatch.
    """
    path = Path(path)
    meta = DecodeState.read_header(path)
    theirs, ours = meta.get("model"), model.identity
    if not isinstance(theirs, dict):
        raise StateFileError(f"{path}: malformed header (no model identity)")
    for key, mine in ours.items():
        if theirs.get(key) != mine:
            raise StateFileError(f"{path}: this state was made with a different {_WHAT[key]} "
                                 f"({theirs.get(key)!r}, this run has {mine!r}); it cannot be reused here")
    ids = meta.get("token_ids")
    if (not isinstance(ids, list) or len(ids) != meta["num_tokens"]
            or not all(type(t) is int and 0 <= t < model.config.vocab_size for t in ids)):
        raise StateFileError(f"{path}: malformed header (token_ids do not match num_tokens or the vocabulary)")
    return ids, model.new_state().loaded(path), meta


def restore_or_build(model, path: str | Path, prefix: list[int], say) -> DecodeState:
    """The state after ``prefix``: read from ``path`` when it holds exactly ``prefix`` (or a shorter
    prefix of it, which is extended), else prefilled; written back whenever it changed.

    A file made by another model, codec or dtype is refused (StateFileError), never overwritten.
    ``say(message)`` reports what happened.
    """
    path = Path(path)
    state, held = None, 0
    if path.exists():
        ids, loaded, _ = load_state(model, path)
        if ids == prefix[:len(ids)]:
            state, held = loaded, len(ids)
        else:
            say(f"prompt cache {path} holds a different prefix ({len(ids)} tokens); prefilling "
                f"{len(prefix)} tokens and replacing it")
    if state is not None and held == len(prefix):
        say(f"prompt cache {path}: restored the state after {held} tokens")
        return state
    state = model.new_state() if state is None else state
    if len(prefix) > held:
        model.forward(prefix[held:], state, last_only=True)
    if prefix:
        save_state(model, path, prefix, state)
        say(f"prompt cache {path}: " + (f"reused {held} tokens, " if held else "")
            + f"prefilled {len(prefix) - held} and saved the state after {len(prefix)} tokens")
    return state


_WHAT = {"architecture": "architecture", "config_sha256": "model configuration",
         "weights_sha256": "model (its weights differ)", "spine": "spine codec", "experts": "expert codec",
         "dtype": "product dtype (--dtype)"}
