"""Convert a Hugging Face checkpoint folder into a deltafin store (the format is in store.py).

The work is a list of output files: the copied metadata files, one spine file for the globals
and one per layer, one expert file per MoE layer. Each file is written to NAME.tmp, fsynced and
renamed, and only then recorded in the journal DST/.progress together with its manifest entries
(offsets, shapes, checksums). A rerun after a kill skips the recorded files and redoes the rest;
the manifest is assembled from those entries in a fixed order and written last, so a resumed
store is byte-identical to an uninterrupted one and a folder without a manifest is unfinished.

Memory stays bounded whatever the model size: tensors are copied or quantized a block of rows
at a time, and experts are copied one expert at a time through one reused buffer.

Running convert on a finished store with another --spine adds that spine (``spine-int8/...``)
next to the existing one; the experts and copied files are shared.

Which codec each spine tensor gets is decided by a policy over tensor roles (policy.py): the
bf16 spine keeps every tensor as published, the int8 spine is the ``int8`` policy, and the
``mixed`` spine is any policy (named or a JSON file), recorded in the manifest next to it.
The routed experts are kept as published unless ``--experts`` re-encodes them (expert_codec.py);
one expert at a time is quantized, whichever codec, so memory stays bounded there too.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig, parse_config
from ..kernels.linear import quantize
from . import expert_codec
from ..files import CheckpointError, confine, fsync_dir, pread_exact, writer_lock
from .hf import DTYPES, TensorInfo
from .layout import EXPERT_INT8_GROUP as INT8_DEFAULT_GROUP
from .layout import EXPERT_WEIGHTS, expert_tensors, nbytes
from .policy import NAMED, PolicyError, SpinePolicy, load_policy, stored_nbytes, tensor_roles
from .source import HFSource
from .store import (ALIGN, CHECKSUM, FORMAT, MANIFEST, PAGE, PLAIN, VERSION, StoreError, check_files,
                    checksum, expert_file, expert_prefix, globals_file, hex_checksum, layer_file,
                    read_manifest, round_up, verify_command)

SPINE_MODES = ("bf16", "int8", "mixed")
JOURNAL = ".progress"
JOURNAL_VERSION = 1
CHUNK_BYTES = 32 << 20  # source bytes copied or quantized at once
# Files of a Hugging Face folder that are weights (the store replaces them) rather than metadata.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
TORCH_DTYPE_NAMES = {torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16",
                     torch.bfloat16: "BF16"}


# -- which codec each spine tensor gets ----------------------------------------------------------
def spine_policy(spine: str, policy: str | Path | SpinePolicy | None = None,
                 int8_group: int = INT8_DEFAULT_GROUP) -> SpinePolicy | None:
    """The policy a spine is written with: None for bf16 (every tensor as published), the ``int8``
    policy for int8 (a float16 scale per `int8_group` inputs), and `policy` (a name, a JSON file or a
    SpinePolicy) for mixed."""
    if spine not in SPINE_MODES:
        raise ValueError(f"unknown spine {spine!r}; expected one of {SPINE_MODES}")
    if spine == "mixed":
        if policy is None:
            raise PolicyError(f"--spine mixed needs --policy: one of {', '.join(NAMED)} or a JSON policy file")
        return load_policy(policy)
    if policy is not None:
        raise PolicyError(f"--policy applies to --spine mixed only (the {spine} spine has a fixed codec choice)")
    if spine != "int8":
        return None
    return NAMED["int8"] if int8_group == INT8_DEFAULT_GROUP else replace(NAMED["int8"], group_size=int8_group)


def spine_codecs(cfg: ModelConfig, layer: int | None, infos: dict[str, TensorInfo],
                 policy: SpinePolicy | None) -> dict[str, tuple[str, int]]:
    """{name: (codec, group size)} for the spine tensors of `layer` (None: the globals)."""
    if policy is None:
        return {rel: (PLAIN, 0) for rel in infos}
    roles = tensor_roles(cfg, layer)
    return {rel: policy.tensor_codec(rel, roles[rel], info.shape) for rel, info in infos.items()}


def _estimated_parts(codec: str, group: int, info: TensorInfo) -> list[int]:
    """Bytes of each tensor a weight becomes (alignment padding not included)."""
    if codec == PLAIN:
        return [info.nbytes]
    rows, cols = info.shape
    if codec == "int8" and not group:
        return [rows * cols, rows * 4]
    scales = rows * (cols // group) * 2
    return [stored_nbytes(codec, rows, cols, group) - scales, scales]


# -- writing one file atomically -----------------------------------------------------------------
def _pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of `data` at `offset` (the single point every store byte goes through)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class AtomicFile:
    """NAME.tmp, filled front to back; renamed to NAME only by commit() after an fsync."""

    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.with_name(final.name + ".tmp")
        final.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0  # bytes laid out so far (every byte below it is written)
        self.committed = False

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.committed:  # leave nothing behind that could look finished
            self.tmp.unlink(missing_ok=True)

    def write_at(self, data, offset: int) -> None:
        _pwrite_all(self.fd, data, offset)

    def reserve(self, nbytes: int, align: int = ALIGN) -> int:
        """Lay out `nbytes` at the next aligned offset (zero-filling the gap); return that offset."""
        start = self.pad_to(align)
        self.size = start + nbytes
        return start

    def pad_to(self, multiple: int) -> int:
        end = round_up(self.size, multiple)
        if end > self.size:
            self.write_at(bytes(end - self.size), self.size)
            self.size = end
        return end

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.final)
        self.committed = True
        fsync_dir(self.final.parent)


def _tensor_bytes(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- the jobs: one per output file ---------------------------------------------------------------
@dataclass
class Job:
    rel: str  # output file, relative to DST
    kind: str  # "copy" | "globals" | "layer" | "experts"
    index: int  # layer number for "layer" / "experts"
    src_bytes: int  # source bytes it reads (the progress bar counts these)
    est_bytes: int  # bytes it will occupy (the free-space check adds these up)
    write: Callable[[AtomicFile, Callable[[int], None]], dict]  # fills the file, returns its manifest entry


def _copy_file(src: Path):
    def write(out: AtomicFile, tick) -> dict:
        fd, crc, size = os.open(src, os.O_RDONLY), 0, src.stat().st_size
        try:
            for off in range(0, size, CHUNK_BYTES):
                data = pread_exact(fd, min(CHUNK_BYTES, size - off), off, str(src))
                crc = checksum(data, crc)
                out.write_at(data, out.reserve(len(data), 1))
                tick(len(data))
        finally:
            os.close(fd)
        return {"checksum": hex_checksum(crc)}
    return write


def _write_plain(out: AtomicFile, fd: int, info: TensorInfo, rel_file: str, tick) -> dict:
    start, crc = out.reserve(info.nbytes), 0
    for off in range(0, info.nbytes, CHUNK_BYTES):
        data = pread_exact(fd, min(CHUNK_BYTES, info.nbytes - off), info.offset + off, info.file)
        crc = checksum(data, crc)
        out.write_at(data, start + off)
        tick(len(data))
    return {"file": rel_file, "offset": start, "nbytes": info.nbytes, "shape": list(info.shape),
            "dtype": info.dtype, "codec": PLAIN, "checksum": hex_checksum(crc)}


def _write_quantized(out: AtomicFile, fd: int, rel: str, info: TensorInfo, codec: str, group: int,
                     rel_file: str, tick) -> dict[str, dict]:
    """Quantize a 2-D weight a block of rows at a time (every codec is row-wise, so the result is the
    same as quantizing it whole) into its codec's tensors, laid out back to back."""
    if len(info.shape) != 2:
        raise CheckpointError(f"{info.file}: '{info.name}' is not 2-D ({list(info.shape)}); cannot store it as {codec}")
    rows, cols = info.shape
    row_bytes = info.nbytes // rows
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    prefix = rel[: -len("weight")]
    parts: dict[str, dict] = {}
    crcs: dict[str, int] = {}
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        raw = pread_exact(fd, (r1 - r0) * row_bytes, info.offset + r0 * row_bytes, info.file)
        w = torch.frombuffer(raw, dtype=DTYPES[info.dtype][0]).reshape(r1 - r0, cols)
        pieces = quantize(w, codec, group).to_tensors(prefix)
        if not parts:  # the first block fixes each part's row size, so the whole layout is known
            for name, t in pieces.items():
                per_row = t[0].numel() * t.element_size()
                parts[name] = {"file": rel_file, "offset": out.reserve(rows * per_row), "nbytes": rows * per_row,
                               "shape": [rows, *t.shape[1:]], "dtype": TORCH_DTYPE_NAMES[t.dtype], "codec": codec}
                crcs[name] = 0
        for name, t in pieces.items():
            data = _tensor_bytes(t)
            p = parts[name]
            out.write_at(data, p["offset"] + r0 * (p["nbytes"] // rows))
            crcs[name] = checksum(data, crcs[name])
        tick(len(raw))
    for name, p in parts.items():
        p["checksum"] = hex_checksum(crcs[name])
    return parts


def _spine_job(source: HFSource, kind: str, index: int, infos: dict[str, TensorInfo], rel_file: str,
               policy: SpinePolicy | None) -> Job:
    codecs = spine_codecs(source.config, index if kind == "layer" else None, infos, policy)
    est = 0
    for rel, info in infos.items():
        for n in _estimated_parts(*codecs[rel], info):
            est = round_up(est, ALIGN) + n

    def write(out: AtomicFile, tick) -> dict:
        tensors: dict[str, dict] = {}
        qweights: dict[str, dict] = {}
        for rel, info in infos.items():
            codec, group = codecs[rel]
            fd = source.fd(info.file)
            if codec == PLAIN:
                tensors[rel] = _write_plain(out, fd, info, rel_file, tick)
            else:
                parts = _write_quantized(out, fd, rel, info, codec, group, rel_file, tick)
                tensors.update(parts)
                qweights[rel] = {"codec": codec, "tensors": list(parts)}
        end = out.pad_to(PAGE)
        return {"file": rel_file, "offset": 0, "nbytes": end, "tensors": tensors, "qweights": qweights}

    return Job(rel_file, kind, index, sum(i.nbytes for i in infos.values()), round_up(est, PAGE), write)


def _expert_job(source: HFSource, i: int, codec: str) -> Job:
    """The expert file of MoE layer i: every expert `span` bytes, its tensors at fixed offsets in
    the span, as published (the bytes copied) or re-encoded in `codec`."""
    cfg = source.config
    E = cfg.num_experts
    first = source.expert_infos(i, 0)
    copy = codec == expert_codec.published(cfg)
    if copy:
        stored = [(name[len(expert_prefix(0)):], info.nbytes, list(info.shape), info.dtype)
                  for name, info in first.items()]
    else:
        stored = [(name[len(expert_prefix(0)):], nbytes(spec), list(spec.shape), spec.dtype)
                  for name, spec in expert_tensors(cfg, i, 0, codec).items()]
    layout, cursor = [], 0  # (suffix, offset in the span, nbytes, shape, dtype)
    for suffix, n, shape, dtype in stored:
        off = round_up(cursor, ALIGN)
        layout.append((suffix, off, n, shape, dtype))
        cursor = off + n
    span = round_up(cursor, PAGE)
    rel_file = expert_file(i)
    weight_codec, group = EXPERT_WEIGHTS.get(codec, (codec, 0))

    def expert_bytes(e: int, view: memoryview) -> int:
        """Put expert e's stored tensors at their places in `view`; return the source bytes read."""
        infos = source.expert_infos(i, e)
        if copy:
            for suffix, off, n, shape, dtype in layout:
                info = infos[expert_prefix(e) + suffix]
                if info.nbytes != n or list(info.shape) != shape or info.dtype != dtype:
                    raise CheckpointError(f"{info.file}: tensor '{info.name}' is {info.dtype} {list(info.shape)}, "
                                          f"but expert 0 of layer {i} has {dtype} {shape}")
                view[off: off + n] = pread_exact(source.fd(info.file), n, info.offset, info.file)
            return sum(x[2] for x in layout)
        places = {suffix: (off, n) for suffix, off, n, _, _ in layout}
        read = 0
        for w in ("w1", "w3", "w2"):
            info = infos[f"{expert_prefix(e)}{w}.weight"]
            raw = pread_exact(source.fd(info.file), info.nbytes, info.offset, info.file)
            weight = torch.frombuffer(raw, dtype=DTYPES[info.dtype][0]).reshape(info.shape)
            for suffix, t in quantize(weight, weight_codec, group).to_tensors(f"{w}.").items():
                off, n = places[suffix]
                data = _tensor_bytes(t)
                if data.nbytes != n:  # the layout and the quantizer disagree: a bug, never a bad file
                    raise AssertionError(f"{codec} {suffix}: {data.nbytes} bytes, the layout says {n}")
                view[off: off + n] = data
            read += info.nbytes
        return read

    def write(out: AtomicFile, tick) -> dict:
        buf = bytearray(span)  # reused: tensor bytes land at fixed places, the gaps stay zero
        view = memoryview(buf)
        sums = []
        for e in range(E):
            read = expert_bytes(e, view)
            sums.append([hex_checksum(checksum(view[off: off + n])) for _, off, n, _, _ in layout])
            out.write_at(buf, out.reserve(span, PAGE))
            tick(read)
        return {"file": rel_file, "span": span, "num_experts": E, "codec": codec,
                "tensors": {s: {"offset": off, "nbytes": n, "shape": shape, "dtype": dtype}
                            for s, off, n, shape, dtype in layout},
                "checksums": sums}

    src_bytes = sum(info.nbytes for e in range(E) for info in source.expert_infos(i, e).values())
    return Job(rel_file, "experts", i, src_bytes, span * E, write)


def metadata_files(src: Path) -> list[str]:
    """Top-level files of the source that are not weights: config, tokenizer, templates, docs."""
    return sorted(f.name for f in src.iterdir()
                  if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES))


def plan(source: HFSource, spine: str, shared: bool, policy: SpinePolicy | None = None,
         experts: str | None = None) -> list[Job]:
    """Every file to write, in the order they are written. shared: also the files spines share
    (copied metadata and experts), i.e. this is a new store rather than a spine added to one.
    policy: the codec choice of the spine (see spine_policy); experts: the experts' store codec
    (None: as published)."""
    cfg = source.config
    experts = experts or expert_codec.published(cfg)
    jobs = []
    if shared:
        for name in metadata_files(source.path):
            size = (source.path / name).stat().st_size
            # file systems allocate whole blocks: count a small file as a page
            jobs.append(Job(name, "copy", 0, size, round_up(size, PAGE), _copy_file(source.path / name)))
    jobs.append(_spine_job(source, "globals", 0, source.global_infos(), globals_file(spine), policy))
    for i in range(cfg.num_layers):
        jobs.append(_spine_job(source, "layer", i, source.spine_infos(i), layer_file(spine, i), policy))
    if shared:
        jobs += [_expert_job(source, i, experts) for i in range(cfg.num_layers) if cfg.is_moe(i)]
    return jobs


# -- the journal ---------------------------------------------------------------------------------
def _source_id(hf_config: dict) -> str:
    return hex_checksum(checksum(json.dumps(hf_config, sort_keys=True).encode()))


def _journal_header(hf_config: dict, spine: str, policy: dict | None = None, experts: str | None = None) -> dict:
    """experts: the store codec of the experts a new store writes (no entry: as published, which is
    also how a journal written before the entry existed reads)."""
    header = {"journal": "deltafin-convert", "version": JOURNAL_VERSION, "spine": spine,
              "source": _source_id(hf_config)}
    if policy is not None:
        header["policy"] = policy
    if experts is not None:
        header["experts"] = experts
    return header


def read_journal(dst: Path) -> tuple[dict | None, dict[str, dict]]:
    """(header, {file: entry}) of an unfinished conversion; a torn last line is ignored."""
    try:
        lines = (dst / JOURNAL).read_bytes().split(b"\n")
    except FileNotFoundError:
        return None, {}
    try:
        header = json.loads(lines[0])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, {}
    entries = {}
    for line in lines[1:]:
        try:
            e = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break  # the line being written when the run was killed, and nothing after it
        if not (isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("nbytes"), int)):
            break  # not a line this deltafin wrote: nothing from here on is trusted
        entries[e["file"]] = e
    return header, entries


class Journal:
    def __init__(self, dst: Path, header: dict, entries: dict[str, dict]):
        """Start the journal afresh with the entries still valid (rewritten atomically)."""
        self.file = dst / JOURNAL
        with AtomicFile(self.file) as out:
            text = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in [header, *entries.values()])
            out.write_at(text.encode(), out.reserve(len(text.encode()), 1))
            out.commit()
        self.fd = os.open(self.file, os.O_WRONLY | os.O_APPEND)

    def record(self, entry: dict) -> None:
        _pwrite_all_append(self.fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        os.fsync(self.fd)

    def remove(self) -> None:
        self.close()
        self.file.unlink(missing_ok=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pwrite_all_append(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- the destination -----------------------------------------------------------------------------
def inspect_destination(dst: Path, hf_config: dict, spine: str, policy: dict | None, *,
                        experts: str, keep: bool) -> tuple[dict | None, dict[str, dict]]:
    """-> (the finished store's manifest or None, files a killed run finished). Refuses any DST
    that is neither new, empty, a store of this model, nor an unfinished conversion of it.
    policy: the mixed spine's policy (a spine of that name made with another policy is refused).
    experts: the experts' store codec a new store gets; keep: --experts was not given, so a store
    there keeps the experts it has. A store with other experts than asked, or an unfinished
    conversion with other experts, is refused."""
    if dst.exists() and not dst.is_dir():
        raise StoreError(f"{dst}: exists and is not a folder")
    present = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    present = [n for n in present if n != JOURNAL + ".tmp"]
    if not present:
        return None, {}
    header, entries = read_journal(dst)
    existing = None
    if MANIFEST in present:
        try:
            existing = read_manifest(dst)
        except StoreError as e:
            raise StoreError(f"{dst}: holds a store that cannot be updated: {e}") from None
        if header is not None and header.get("spine") in existing["spines"]:
            header = None  # left by a run killed after writing its manifest: nothing to resume
        if existing["hf_config"] != hf_config:
            raise StoreError(f"{dst}: holds a store of a different model (its config.json differs from the "
                             "source's); choose a new folder")
        problems = check_files(dst, existing)
        if problems:
            raise StoreError(f"{dst}: the store there is damaged ({problems[0]}); remove it and convert again")
        have = existing["experts"]["codec"]
        if not keep and experts != have:
            raise StoreError(f"{dst}: the store there keeps its experts as {have}, not {experts}; its spines share "
                             "them, so convert into a new folder for other experts (or leave --experts out to add "
                             "a spine to this store)")
        if spine in existing["spines"]:
            had = existing["spines"][spine].get("policy")
            if had != policy:
                raise StoreError(f"{dst}: already has a {spine} spine made with policy "
                                 f"'{(had or {}).get('name')}', not '{(policy or {}).get('name')}'; convert into "
                                 "a new folder to compare policies")
            return existing, {}
        if header is None:
            return existing, {}
    elif header is None:
        raise StoreError(f"{dst}: is not empty and is neither a deltafin store nor an unfinished conversion; "
                         "choose an empty or new folder")
    if header.get("journal") != "deltafin-convert" or header.get("version") != JOURNAL_VERSION:
        raise StoreError(f"{dst / JOURNAL}: not a conversion journal this deltafin can resume; remove {dst} "
                         "and convert again")
    if header.get("source") != _source_id(hf_config):
        raise StoreError(f"{dst}: holds an unfinished conversion of a different checkpoint; choose a new folder "
                         "or remove it")
    if header.get("spine") != spine:
        raise StoreError(f"{dst}: holds an unfinished conversion with --spine {header.get('spine')}; run that "
                         f"command again to finish it first, or remove {dst}")
    if header.get("policy") != policy:
        raise StoreError(f"{dst}: holds an unfinished conversion with policy "
                         f"'{(header.get('policy') or {}).get('name')}'; run that command again to finish it "
                         f"first, or remove {dst}")
    began = header.get("experts", expert_codec.published(parse_config(hf_config)))
    if existing is None and began != experts:
        raise StoreError(f"{dst}: holds an unfinished conversion whose experts are stored as {began}, not {experts}; "
                         f"run that command again to finish it first, or remove {dst}")
    # Keep only files that are there in full (a file is renamed into place before it is journaled).
    kept = {rel: e for rel, e in entries.items()
            if _inside(dst, rel) and (dst / rel).is_file() and (dst / rel).stat().st_size == e["nbytes"]}
    return existing, kept


def _inside(dst: Path, rel) -> bool:
    """Whether a journaled file name stays inside DST (the one confinement rule; others are ignored)."""
    try:
        confine(dst, rel, str(dst / JOURNAL))
    except CheckpointError:
        return False
    return True


def check_free_space(dst: Path, need: int) -> None:
    """Fail before writing anything when DST's file system cannot hold what is left to write."""
    probe = dst
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise StoreError(f"{dst}: not enough free disk space: the conversion needs {need / 1e9:.3f} GB more "
                         f"({need} bytes), the file system has {free / 1e9:.3f} GB ({free} bytes) free")


def _manifest_estimate(jobs: list[Job], source: HFSource) -> int:
    experts = sum(source.config.num_experts * len(source.expert_infos(j.index, 0)) for j in jobs if j.kind == "experts")
    tensors = sum(len(source.spine_infos(j.index)) for j in jobs if j.kind == "layer")
    return 64 * 1024 + 12 * experts + 400 * tensors


def assemble_manifest(base: dict | None, hf_config: dict, source: HFSource, spine: str, jobs: list[Job],
                      done: dict[str, dict], policy: dict | None = None, experts: str | None = None) -> dict:
    """The manifest, from the journaled entries, in a fixed order (the same however the run went)."""
    m = base or {
        "format": FORMAT, "version": VERSION, "checksum": CHECKSUM, "page_size": PAGE, "alignment": ALIGN,
        "hf_config": hf_config, "model_config": source.config.to_dict(),
        "files": {}, "spines": {},
        "experts": {"codec": experts or expert_codec.published(source.config), "layers": {}},
    }
    files = dict(m["files"])
    sp = {"codec": spine, **({"policy": policy} if policy is not None else {}), "globals": None, "layers": []}
    for job in jobs:
        entry = done[job.rel]
        frag = entry["fragment"]
        files[job.rel] = {"nbytes": entry["nbytes"], **({"checksum": frag["checksum"]} if job.kind == "copy" else {})}
        if job.kind == "globals":
            sp["globals"] = frag
        elif job.kind == "layer":
            sp["layers"].append(frag)
        elif job.kind == "experts":
            m["experts"]["layers"][str(job.index)] = frag
    m["files"] = dict(sorted(files.items()))
    m["spines"] = dict(sorted({**m["spines"], spine: sp}.items()))
    return m


# -- convert -------------------------------------------------------------------------------------
def _write_error(dst: Path, rel: str, e: OSError) -> StoreError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(f"{dst}: disk full while writing {rel} ({e.strerror}); the unfinished file was removed "
                          "and the finished ones are kept: free some space and run the same command again to "
                          "continue")
    return StoreError(f"{dst}: failed while writing {rel}: {e}")


def convert(src: str | Path, dst: str | Path, spine: str = "bf16", progress: bool = True,
            policy: str | Path | SpinePolicy | None = None, experts: str | None = None,
            int8_group: int | None = None) -> Path:
    """Convert the Hugging Face checkpoint folder `src` into a store at `dst` (or add a spine to it).

    spine: bf16 | int8 | mixed; policy (mixed only): a policy name, JSON policy file or SpinePolicy.
    experts: None or "keep" (as published; adding a spine: as the store has them), or bf16 | int8 |
    int4 | mxfp4 (expert_codec.py says which make sense). int8_group: the inputs per float16 scale
    of an int8 spine and int8 experts (expert_codec.INT8_GROUPS; None: 32 for the spine,
    expert_codec.default_int8_group for the experts).
    Resumes a killed conversion into the same `dst`; refuses a `dst` holding anything else.
    """
    if int8_group is not None and spine != "int8" and experts != "int8":
        raise PolicyError("--int8-group applies to --spine int8 and --experts int8 (a --spine mixed policy "
                          "gives its own group_size)")
    group = INT8_DEFAULT_GROUP if int8_group is None else int8_group
    expert_codec.int8_codec(group)  # one of the groups the store knows, else a clear error
    pol = spine_policy(spine, policy, group)
    recorded = pol.to_dict() if spine == "mixed" else None  # the manifest and journal record it
    src, dst = Path(src), Path(dst)
    if (src / MANIFEST).exists():
        raise StoreError(f"{src}: is already a deltafin store; convert from the Hugging Face checkpoint folder")
    source = HFSource(src)  # validates every tensor before anything is written
    try:
        codec = expert_codec.resolve(source.config, experts, int8_group)
        keep = experts in (None, "keep")
        with writer_lock(dst, "a conversion into this folder"):
            return _convert_locked(dst, spine, progress, pol, recorded, source, codec, keep)
    finally:
        source.close()


def _convert_locked(dst: Path, spine: str, progress: bool, pol: SpinePolicy | None,
                    recorded: dict | None, source: HFSource, experts: str, keep: bool) -> Path:
    """convert() once it holds the destination's lock (no other writer can be in DST).
    experts: the experts' store codec; keep: as a store already there has them."""
    hf_config = source.ckpt.raw_config
    existing, done = inspect_destination(dst, hf_config, spine, recorded, experts=experts, keep=keep)
    if existing is not None and spine in existing["spines"]:
        header, _ = read_journal(dst)
        if header is not None and header.get("spine") in existing["spines"]:
            (dst / JOURNAL).unlink()  # left by a run killed after its manifest was written
        return dst
    if existing is not None:
        experts = existing["experts"]["codec"]  # shared by its spines (a different ask was refused)
    jobs = plan(source, spine, shared=existing is None, policy=pol, experts=experts)
    done = {rel: e for rel, e in done.items() if rel in {j.rel for j in jobs}}
    todo = [j for j in jobs if j.rel not in done]
    check_free_space(dst, sum(j.est_bytes for j in todo) + _manifest_estimate(jobs, source))
    dst.mkdir(parents=True, exist_ok=True)
    for name in [j.rel for j in jobs] + [MANIFEST]:
        (dst / (name + ".tmp")).unlink(missing_ok=True)  # left by a killed run
    current = JOURNAL
    journal = None
    try:
        journal = Journal(dst, _journal_header(hf_config, spine, recorded, experts), done)
        with _progress_bar(sum(j.src_bytes for j in todo), spine, progress) as bar:
            for job in todo:
                current = job.rel
                with AtomicFile(dst / job.rel) as out:
                    frag = job.write(out, bar.update)
                    out.commit()
                entry = {"file": job.rel, "nbytes": out.size, "fragment": frag}
                journal.record(entry)
                done[job.rel] = json.loads(json.dumps(entry))  # exactly what a resumed run would read back
        current = MANIFEST
        manifest = assemble_manifest(existing, hf_config, source, spine, jobs, done, recorded, experts)
        with AtomicFile(dst / MANIFEST) as out:
            data = json.dumps(manifest, separators=(",", ":")).encode()
            out.write_at(data, out.reserve(len(data), 1))
            out.commit()
        journal.remove()
    except OSError as e:
        raise _write_error(dst, current, e) from None
    finally:
        if journal is not None:
            journal.close()
    return dst


def _progress_bar(total: int, spine: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"convert ({spine} spine)",
                disable=not enabled, file=sys.stderr)


# -- command line --------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    out = convert(args.src, args.dst, spine=args.spine, policy=args.policy, experts=args.experts,
                  int8_group=args.int8_group)
    m = read_manifest(out)
    total = sum(f["nbytes"] for f in m["files"].values())
    pol = m["spines"][args.spine].get("policy")
    experts = expert_codec.describe(parse_config(m["hf_config"]), m["experts"]["codec"])
    print(f"deltafin convert: {out}: {total / 1e9:.3f} GB, spines: {', '.join(m['spines'])}"
          + (f" ({args.spine}: policy {pol['name']})" if pol else "") + f", experts: {experts}")
    return 0


def cmd_verify(args) -> int:
    return verify_command(args.store)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a Hugging Face checkpoint folder into a deltafin store",
        description="Write a deltafin store: the spine as one page-aligned region per layer, experts at a fixed "
                    "span per expert, a checksummed manifest. A killed conversion resumes when run again; run "
                    "it on a finished store with another --spine to add that spine.")
    p.add_argument("src", help="Hugging Face checkpoint folder")
    p.add_argument("dst", help="store folder to write (new or empty, or an unfinished/finished store of SRC)")
    p.add_argument("--spine", choices=SPINE_MODES, default="bf16",
                   help="spine codec: bf16 (as published, lossless), int8 (projections with a float16 scale per "
                        "32 inputs) or mixed (per tensor role, as --policy says; --policy int8-row: int8 with one "
                        "scale per output row)")
    p.add_argument("--policy", default=None, metavar="NAME|FILE",
                   help=f"with --spine mixed: a named policy ({', '.join(NAMED)}) or a JSON file "
                        '{"name": ..., "group_size": 32, "roles": {role: codec}}')
    p.add_argument("--experts", choices=expert_codec.CHOICES, default="keep",
                   help="routed experts: keep (as published, the default; adding a spine: as the store has "
                        "them), bf16, int8 (fp16 scale per 128 inputs), int8-row (one scale per output row: ~1.5%% "
                        "fewer bytes, less exact), int4 (fp16 scale per 32 inputs) or mxfp4. int8/int4/mxfp4 are "
                        "lossy and read ~1.9x/3.6x/3.8x fewer expert bytes than bf16; experts published in MXFP4 "
                        "(K3) are kept as they are")
    p.add_argument("--int8-group", type=int, default=None, choices=expert_codec.INT8_GROUPS, metavar="N",
                   help="inputs per float16 scale of --spine int8 and --experts int8, both: 32 (the most exact; "
                        "the spine's default), 64 or 128 (~3%% / ~4.5%% fewer bytes than 32, a little less exact; "
                        "128 is the experts' default, where it costs no measurable error)")
    p.set_defaults(func=cmd_convert)
    v = subparsers.add_parser("verify", help="recompute every checksum of a deltafin store",
                              description="Check a store: files, sizes, and every tensor's checksum; prints the "
                                          "first mismatch (file and tensor) and exits 1 if there is one.")
    v.add_argument("store", help="store folder")
    v.set_defaults(func=cmd_verify)
