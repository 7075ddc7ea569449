"""Per-sequence decode state: what each layer remembers between passes.

KDA layers keep their three conv tails and the recurrent state S per head; MLA layers keep the
normalized latent c_kv and the shared rope-part key per token (the absorbed-MLA cache).

Speculative decoding verifies several tokens in one pass and may keep only some of them. A pass
run with ``keep_states=True`` records, per KDA layer, the state before the pass and its conv inputs,
and either S after each new row (the torch recurrence: ``rollback(n)`` copies one back) or the rows'
inputs (the native CPU recurrence: ``rollback(n)`` steps the accepted rows again in one call). MLA
rolls back by length.

A state is a self-contained value: ``snapshot`` copies it, ``restore`` puts a copy back, and
``save`` / ``load`` write it to and read it from a safetensors file whose JSON header says what
the state belongs to (the caller's fields: model identity, the token ids it holds). Loading
checks every tensor's name, dtype and shape against a fresh state of the same model before
anything is allocated, so a truncated, foreign or hostile file is refused with a message. A KDA
state cannot be cut back to a shorter prefix: keep snapshots where they may be wanted.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .kda_recurrence import kda_rollback

STATE_FORMAT = "deltafin-decode-state"
STATE_VERSION = 1
_HEADER_KEY = "deltafin"


class StateFileError(ValueError):
    """A saved state that cannot be used here (unreadable, corrupt, or for something else)."""


@dataclass
class KDAState:
    conv: torch.Tensor  # [3, K-1, D] last K-1 pre-conv inputs of q, k, v
    S: torch.Tensor  # [heads, Dk, Dv] fp32
    # Set by a keep_states pass, cleared by rollback / the next pass:
    pending: dict | None = None
    # Set only while a decode graph is recorded (decode_graph.py): update conv and S in place, so
    # the recorded kernels keep writing to the same addresses.
    in_place: bool = False


@dataclass
class MLAState:
    ckv: torch.Tensor  # [capacity, kv_lora] normalized latents
    krot: torch.Tensor  # [capacity, rope] shared rope-part keys
    length: int = 0
    # Set only while a decode graph is recorded (decode_graph.py): the new rows' positions as a device
    # tensor. MLAttention writes the rows there and attends over the whole slot buffer, masked past
    # them, so the recorded kernels depend on no host-side length; the recorder advances `length`.
    at: torch.Tensor | None = None

    def reserve(self, n: int) -> None:
        """Room for n more rows after ``length`` (the buffers grow by doubling)."""
        need = self.length + n
        if need > self.ckv.shape[0]:
            cap = max(need, 2 * self.ckv.shape[0], 16)
            self.ckv = _grow(self.ckv, cap)
            self.krot = _grow(self.krot, cap)

    def append(self, ckv: torch.Tensor, krot: torch.Tensor) -> None:
        n = ckv.shape[0]
        need = self.length + n
        self.reserve(n)
        self.ckv[self.length:need] = ckv
        self.krot[self.length:need] = krot
        self.length = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ckv[: self.length], self.krot[: self.length]


def _copy_layer(st):
    """A layer state's own copy (``DecodeState.snapshot``): the tensors it holds, each alone."""
    if isinstance(st, KDAState):
        return KDAState(st.conv.clone(), st.S.clone(), _copied(st.pending))
    if isinstance(st, MLAState):
        ckv, krot = st.view()
        return MLAState(ckv.clone(), krot.clone(), st.length)
    raise TypeError(f"a decode state holds KDA and MLA layer states, not {type(st).__name__}")


def _copied(v):
    """Tensors in (nested dicts, lists and tuples of) a rollback record, each copied alone."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _copied(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copied(x) for x in v)
    return v


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    out = t.new_zeros((cap, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def stacked(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(ts)`` as a view, without a copy, when ts are contiguous and lie one after the
    other in one storage (consecutive entries of a decode graph's slot buffer, runtime/decode_graph.py);
    else None. (Views made under inference mode keep no ``_base``: the storage says it.)"""
    first = ts[0]
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype for t in ts):
        return None
    storage, step = first.untyped_storage().data_ptr(), first.numel()
    for b, t in enumerate(ts):
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != first.storage_offset() + b * step:
            return None
    return first.as_strided((len(ts), *first.shape), (step, *first.stride()), first.storage_offset())


def joined(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(ts)`` of 1-D contiguous tensors as a view, when each starts where the one before
    ends in one storage (a decode graph's position slices); else None."""
    first, at = ts[0], ts[0].storage_offset()
    for t in ts:
        if t.dim() != 1 or t.stride(0) != 1 or t.dtype != first.dtype \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != at:
            return None
        at += t.shape[0]
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def runs(counts: list[int]) -> list[tuple[slice, slice, int]]:
    """Runs of consecutive sequences that feed the same number n of rows (`counts`: each one's, in the
    pass's order): per run, (its sequences, its rows of the pass, n). A recorded pass's sequences sit
    in such runs (decode rows, then prompt pieces by size), each run one block of slots and rows."""
    out, i, start = [], 0, 0
    while i < len(counts):
        n, j = counts[i], i
        while j < len(counts) and counts[j] == n:
            j += 1
        out.append((slice(i, j), slice(start, start + (j - i) * n), n))
        i, start = j, start + (j - i) * n
    return out


class Rows(NamedTuple):
    """One sequence's share of a layer's rows in a batched pass: its layer state and row count."""
    state: "KDAState | MLAState"
    n: int
    keep_states: bool


@dataclass
class DecodeState:
    layers: list  # KDAState | MLAState per layer
    num_tokens: int = 0
    _pass_start: int | None = field(default=None, repr=False)

    def rollback(self, num_tokens: int) -> None:
        """Return to the state after ``num_tokens`` tokens, within the last keep_states pass."""
        if self._pass_start is None:
            raise RuntimeError("rollback() is only possible right after a forward(..., keep_states=True)")
        if not self._pass_start <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens: must be within [{self._pass_start}, "
                             f"{self.num_tokens}]")
        keep = num_tokens - self._pass_start
        for st in self.layers:
            if isinstance(st, KDAState):
                kda_rollback(st, keep)
            else:
                st.length -= self.num_tokens - num_tokens
        self.num_tokens = num_tokens
        self._pass_start = None

    def begin_pass(self, keep_states: bool) -> None:
        for st in self.layers:
            if isinstance(st, KDAState):
                st.pending = None
        self._pass_start = self.num_tokens if keep_states else None

    def snapshot(self) -> "DecodeState":
        """A copy that shares no memory with this state: each of its tensors copied alone, MLA caches cut
        to their length. (A deep copy copies a view's whole storage: every slot of a decode graph's
        stacked buffers for a state living in one, the whole pass's rows for a check pass's rollback
        records, so a kept snapshot held several times the memory it counted.)"""
        return DecodeState([_copy_layer(st) for st in self.layers], self.num_tokens, self._pass_start)

    def restore(self, snap: "DecodeState") -> None:
        fresh = DecodeState.snapshot(snap)
        self.layers, self.num_tokens, self._pass_start = fresh.layers, fresh.num_tokens, fresh._pass_start

    def nbytes(self) -> int:
        """Bytes the state's tensors hold (what keeping it in memory costs)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self, first: int = 0) -> dict[str, torch.Tensor]:
        """Every state tensor by a stable name (MLA caches cut to their length); `first`: the model
        layer this state's first layer is (a rank of a split model holds a range of them)."""
        out = {}
        for i, st in enumerate(self.layers, first):
            if isinstance(st, KDAState):
                out[f"layers.{i}.conv"], out[f"layers.{i}.S"] = st.conv, st.S
            else:
                out[f"layers.{i}.ckv"], out[f"layers.{i}.krot"] = st.view()
        return out

    def save(self, path: str | Path, header: dict) -> None:
        """Write the state and ``header`` (JSON-serializable) atomically to a safetensors file."""
        self.check_savable()
        write_state_file(path, self.tensors(), self.num_tokens, header)

    def check_savable(self) -> None:
        if self._pass_start is not None:
            raise RuntimeError("save() right after a keep_states pass: roll back (or run a plain pass) first")

    def expected(self, num_tokens: int, first: int = 0) -> dict[str, torch.Tensor]:
        """For a fresh state of this layout: the tensors (name -> an empty tensor of the dtype, shape
        and device) a saved state of `num_tokens` tokens holds for these layers."""
        expect = {}
        for i, st in enumerate(self.layers, first):
            if isinstance(st, KDAState):
                expect[f"layers.{i}.conv"], expect[f"layers.{i}.S"] = st.conv, st.S
            else:
                expect[f"layers.{i}.ckv"] = st.ckv.new_empty((num_tokens, *st.ckv.shape[1:]))
                expect[f"layers.{i}.krot"] = st.krot.new_empty((num_tokens, *st.krot.shape[1:]))
        return expect

    def assembled(self, got: dict[str, torch.Tensor], num_tokens: int, first: int = 0) -> "DecodeState":
        """A state of this layout from tensors named as ``expected`` names them (checked there)."""
        layers = []
        for i, st in enumerate(self.layers, first):
            if isinstance(st, KDAState):
                layers.append(KDAState(conv=got[f"layers.{i}.conv"], S=got[f"layers.{i}.S"]))
            else:
                layers.append(MLAState(ckv=got[f"layers.{i}.ckv"], krot=got[f"layers.{i}.krot"], length=num_tokens))
        return DecodeState(layers=layers, num_tokens=num_tokens)

    def loaded(self, path: str | Path) -> "DecodeState":
        """The state saved in `path`, read into this (fresh) state's layout (see ``load``); a split
        model's state reads its own layers and hands the others theirs."""
        return DecodeState.load(path, like=self)

    @staticmethod
    def read_header(path: str | Path) -> dict:
        """The JSON header of a saved state, checked for format and version (no tensor is read)."""
        from safetensors import safe_open
        path = Path(path)
        if not path.is_file():
            raise StateFileError(f"{path}: no such state file")
        try:
            with safe_open(str(path), "pt") as f:
                raw = (f.metadata() or {}).get(_HEADER_KEY)
        except Exception as e:  # safetensors reports truncation and bad headers with its own types
            raise StateFileError(f"{path}: not a readable state file ({type(e).__name__}: {e})") from None
        try:
            meta = json.loads(raw) if raw is not None else None
        except json.JSONDecodeError:
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
            raise StateFileError(f"{path}: a safetensors file, but not a saved deltafin decode state")
        if meta.get("version") != STATE_VERSION:
            raise StateFileError(f"{path}: state file version {meta.get('version')!r}; this deltafin reads "
                                 f"version {STATE_VERSION}")
        if not isinstance(meta.get("num_tokens"), int) or meta["num_tokens"] < 0:
            raise StateFileError(f"{path}: malformed header (num_tokens)")
        return meta

    @classmethod
    def load(cls, path: str | Path, like: "DecodeState") -> "DecodeState":
        """Read a saved state into the layout of ``like`` (a fresh state of the model it is for).

        Every tensor's name, dtype and shape is checked from the header before any is read; the
        tensors land on the device and in the dtype of ``like``. Check the header's own fields
        (``read_header``) before calling this.
        """
        n = cls.read_header(path)["num_tokens"]
        expect = like.expected(n)
        return like.assembled(read_state_tensors(path, expect, set(expect)), n)

    def max_abs_diff(self, other: "DecodeState") -> float:
        """Largest difference over every state tensor (inf when the shapes do not match)."""
        if self.num_tokens != other.num_tokens or len(self.layers) != len(other.layers):
            return float("inf")
        worst = 0.0
        for a, b in zip(self.layers, other.layers):
            pairs = ([(a.conv, b.conv), (a.S, b.S)] if isinstance(a, KDAState)
                     else list(zip(a.view(), b.view())))
            for x, y in pairs:
                if x.shape != y.shape:
                    return float("inf")
                if x.numel():
                    worst = max(worst, (x.float() - y.float()).abs().max().item())
        return worst


# The dtypes a state's tensors may have, by their safetensors names (also the names a split model's
# ranks announce a state's parts by).
STATE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def state_tensor_names(kda_layers, layers: range) -> set[str]:
    """The tensor names a saved state holds for `layers` (``DecodeState.tensors`` names them so), given
    which layers of the model are KDA layers (the others are MLA layers)."""
    return {f"layers.{i}.{part}" for i in layers for part in (("conv", "S") if i in kda_layers else ("ckv", "krot"))}


def write_state_file(path: str | Path, tensors: dict[str, torch.Tensor], num_tokens: int, header: dict) -> None:
    """A saved state: `tensors` (named as ``DecodeState.tensors`` names them) and ``header``
    (JSON-serializable), written atomically to a safetensors file."""
    from safetensors.torch import save_file
    meta = {**header, "format": STATE_FORMAT, "version": STATE_VERSION, "num_tokens": num_tokens}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(tmp),
              metadata={_HEADER_KEY: json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state_tensors(path: str | Path, expect: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `expect` names from a saved state (each checked for dtype and shape against
    `expect` before any is read, landing on its device and dtype); `names`: every tensor the file
    must hold (a state of a whole model: more than `expect` when the caller holds only some layers)."""
    from safetensors import safe_open
    path = Path(path)
    got = {}
    try:
        with safe_open(str(path), "pt") as f:
            have = set(f.keys())
            if have != names:
                missing, extra = sorted(names - have)[:3], sorted(have - names)[:3]
                raise StateFileError(f"{path}: the state's layers do not match this model "
                                     f"(missing {missing}, unexpected {extra})")
            for name, ref in expect.items():
                sl = f.get_slice(name)
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                want = STATE_DTYPES.get(ref.dtype)
                if shape != list(ref.shape) or dtype != want:
                    raise StateFileError(f"{path}: tensor '{name}' is {dtype}{shape}; this model's state "
                                         f"needs {want}{list(ref.shape)}")
            for name, ref in expect.items():
                got[name] = f.get_tensor(name).to(ref.device, ref.dtype)
    except StateFileError:
        raise
    except Exception as e:
        raise StateFileError(f"{path}: cannot read the state ({type(e).__name__}: {e})") from None
    return got
