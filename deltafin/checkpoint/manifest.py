"""The store manifest's schema, and the one pass that checks a manifest before anything uses it.

``check_manifest`` runs before a store is opened or verified. It checks, naming the field and
the file of the first problem:

- types and ranges of every field (pydantic, strict: a size is a JSON integer >= 0, a checksum
  is 8 hex digits, a list is a list);
- every file path against the confinement rule of ``files.confine`` (inside the store);
- every extent against the real sizes: a region lies inside its file, a tensor inside its
  region, its bytes match its shape and dtype, an expert file holds exactly ``span`` bytes per
  expert and one checksum per expert tensor;
- the experts' codec is one this deltafin reads, the same in every layer (which tensors that
  codec stores, with which shapes, the reader then checks against the config).

Only then may a reader allocate a buffer of a region's size or walk the experts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..files import CheckpointError, confine, confinement_root
from .hf import DTYPES
from .layout import EXPERT_CODECS

Size = Annotated[int, Field(ge=0, le=1 << 50)]  # a petabyte: larger is not a real file
Count = Annotated[int, Field(ge=0, le=1 << 16)]
ExpertCodec = Literal[EXPERT_CODECS]  # type: ignore[valid-type]
Checksum = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8}$")]
Shape = Annotated[list[Annotated[int, Field(ge=0, le=1 << 32)]], Field(max_length=8)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class FileEntry(_Strict):
    nbytes: Size
    checksum: Checksum | None = None


class TensorEntry(_Strict):
    file: str
    offset: Size
    nbytes: Size
    shape: Shape
    dtype: str
    codec: str
    checksum: Checksum


class QWeightEntry(_Strict):
    codec: str
    tensors: list[str]


class RegionEntry(_Strict):
    file: str
    offset: Size
    nbytes: Size
    tensors: dict[str, TensorEntry]
    qweights: dict[str, QWeightEntry]


class SpineEntry(_Strict):
    codec: str
    globals: RegionEntry
    layers: Annotated[list[RegionEntry], Field(max_length=1024)]


class ExpertTensor(_Strict):
    offset: Size
    nbytes: Size
    shape: Shape
    dtype: str


class ExpertLayer(_Strict):
    file: str
    span: Annotated[int, Field(ge=1, le=1 << 40)]
    num_experts: Count
    codec: ExpertCodec
    tensors: dict[str, ExpertTensor]
    checksums: list[list[Checksum]]


class ExpertsEntry(_Strict):
    codec: ExpertCodec
    layers: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,4}$")], ExpertLayer]


class Manifest(_Strict):
    format: str
    version: int
    checksum: str
    hf_config: dict
    files: dict[str, FileEntry]
    spines: dict[str, SpineEntry]
    experts: ExpertsEntry


def check_manifest(root: Path, m: dict, where: str) -> Manifest:
    """The manifest `m` of the store at `root`, checked as the module docstring says; `where`
    names the manifest file in messages."""
    try:
        man = Manifest.model_validate(m)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise CheckpointError(f"{where}: malformed store manifest: field '{field}': {first['msg']}") from None
    fence = confinement_root(root)
    for rel in man.files:  # their presence and sizes are checked by store.check_files, all at once
        confine(root, rel, f"{where}: files", fence)
    for name, sp in man.spines.items():
        _region(root, fence, man, sp.globals, f"{where}: spines.{name}.globals")
        for i, r in enumerate(sp.layers):
            _region(root, fence, man, r, f"{where}: spines.{name}.layers.{i}")
    for i, x in man.experts.layers.items():
        at = f"{where}: experts.layers.{i}"
        if x.codec != man.experts.codec:
            raise CheckpointError(f"{at}.codec: {x.codec!r} differs from experts.codec {man.experts.codec!r} "
                                  "(a store keeps all its experts in one codec)")
        nbytes = _listed(root, fence, man, x.file, at)
        if x.span * x.num_experts != nbytes:
            raise CheckpointError(f"{at}: {x.num_experts} experts of {x.span} bytes do not fill '{x.file}' "
                                  f"({nbytes} bytes)")
        for s, t in x.tensors.items():
            _tensor_bytes(t, f"{at}.tensors.{s}")
            if t.offset + t.nbytes > x.span:
                raise CheckpointError(f"{at}.tensors.{s}: bytes {t.offset}..{t.offset + t.nbytes} lie outside the "
                                      f"expert span of {x.span} bytes")
        if len(x.checksums) != x.num_experts or any(len(c) != len(x.tensors) for c in x.checksums):
            raise CheckpointError(f"{at}.checksums: needs one list of {len(x.tensors)} checksums for each of the "
                                  f"{x.num_experts} experts (got {len(x.checksums)} lists)")
    return man


def _listed(root: Path, fence: Path, man: Manifest, rel: str, at: str) -> int:
    """The size the manifest records for `rel`, which must be one of its files."""
    confine(root, rel, at, fence)
    if rel not in man.files:
        raise CheckpointError(f"{at}: file '{rel}' is not listed under 'files'")
    return man.files[rel].nbytes


def _tensor_bytes(t, at: str) -> None:
    if t.dtype not in DTYPES:
        raise CheckpointError(f"{at}: unsupported dtype {t.dtype!r}")
    n = DTYPES[t.dtype][1]
    for d in t.shape:
        n *= d
    if n != t.nbytes:
        raise CheckpointError(f"{at}: nbytes {t.nbytes} does not match shape {t.shape} {t.dtype} ({n} bytes)")


def _region(root: Path, fence: Path, man: Manifest, r: RegionEntry, at: str) -> None:
    size = _listed(root, fence, man, r.file, at)
    if r.offset + r.nbytes > size:
        raise CheckpointError(f"{at}: bytes {r.offset}..{r.offset + r.nbytes} lie outside '{r.file}' ({size} bytes)")
    for name, t in r.tensors.items():
        tat = f"{at}.tensors.{name}"
        _tensor_bytes(t, tat)
        if t.file != r.file or t.offset < r.offset or t.offset + t.nbytes > r.offset + r.nbytes:
            raise CheckpointError(f"{tat}: bytes {t.offset}..{t.offset + t.nbytes} of '{t.file}' lie outside the "
                                  f"region {r.offset}..{r.offset + r.nbytes} of '{r.file}'")
    for w, q in r.qweights.items():
        unknown = [n for n in q.tensors if n not in r.tensors]
        if unknown:
            raise CheckpointError(f"{at}.qweights.{w}: names tensors not in the region: {unknown[:3]}")
