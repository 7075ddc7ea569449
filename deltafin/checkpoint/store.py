"""deltafin's converted store: the format on disk, its reader, and its checker.

A store is a folder (written by ``checkpoint.convert``):

    deltafin-store.json          the manifest; written last, so a folder without it is unfinished
    config.json, tokenizer.json, ...   copied from the source, so the folder loads like the original
    spine/globals.bin            embed / final norm / lm_head (/ output attn-res) of the bf16 spine
    spine/layer-000.bin          layer 0's non-expert tensors: one page-aligned region, one read
    spine-int8/...               the same files for another spine (here int8), if converted
    experts/layer-001.bin        routed experts of MoE layer 1: expert e is `span` bytes at e * span

Manifest, version 1 (JSON):

    format "deltafin-store", version 1, checksum "crc32" (zlib, 8 hex digits), page_size, alignment,
    hf_config (the source config.json), model_config (ModelConfig.to_dict(), for people and tools;
        the reader re-parses hf_config, like a Hugging Face folder),
    files: {relative path: {nbytes[, checksum]}}  every file of the store (checksum: copied files),
    spines: {name: {codec, globals: REGION, layers: [REGION per layer]}},
    experts: {codec, layers: {"i": EXPERTS}}

    REGION  = {file, offset, nbytes, tensors: {name: TENSOR}, qweights: {weight name: {codec, tensors}}}
    TENSOR  = {file, offset (absolute), nbytes, shape, dtype (safetensors name), codec, checksum}
    EXPERTS = {file, span, num_experts, codec, tensors: {suffix: {offset (inside the span), nbytes,
               shape, dtype}}, checksums: [[checksum per tensor, in `tensors` order] per expert]}

Tensor names are the relative names ``HFSource`` uses. A tensor with codec "plain" is used as
stored; the tensors of a quantized weight carry its codec and are listed under ``qweights`` by
the weight's name (``self_attn.q_proj.weight`` -> ``self_attn.q_proj.weight`` int8 codes and
``self_attn.q_proj.weight_scale``), and the reader rebuilds a ``QWeight`` from them. Expert
tensors are described once per layer (every expert has the same layout) to keep the manifest of
a model with ~80k experts small.
"""
from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig, parse_config
from ..kernels.linear import QWeight
from . import source as hf_source
from ..files import CheckpointError, FileHandles, open_regular, pread_exact, read_json, regular_size
from .manifest import check_manifest
from .hf import TensorInfo
from .layout import expert_tensors, global_tensors, layer_spine_tensors

MANIFEST = "deltafin-store.json"
FORMAT = "deltafin-store"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
CHECKSUM = "crc32"
PAGE = 4096  # extents and expert spans are page-aligned, so O_DIRECT and mmap reads work
ALIGN = 64  # every tensor starts on a 64-byte boundary inside its region
PLAIN = "plain"  # codec of a tensor used exactly as stored
AUTO_ORDER = ("int8", "bf16")  # spine="auto": the first of these the store has
VERIFY_CHUNK = 64 << 20  # bytes hashed per read when checking a large tensor


class StoreError(CheckpointError):
    """A converted store is unfinished, corrupt, or of a format this deltafin cannot read."""


# -- format helpers (shared with the converter) ---------------------------------------------------
def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def checksum(data, crc: int = 0) -> int:
    """Running crc32 of bytes-like data (zlib releases the GIL, so threads can hash in parallel)."""
    return zlib.crc32(data, crc)


def hex_checksum(crc: int) -> str:
    return f"{crc:08x}"


def spine_dir(spine: str) -> str:
    return "spine" if spine == "bf16" else f"spine-{spine}"


def globals_file(spine: str) -> str:
    return f"{spine_dir(spine)}/globals.bin"


def layer_file(spine: str, i: int) -> str:
    return f"{spine_dir(spine)}/layer-{i:03d}.bin"


def expert_file(i: int) -> str:
    return f"experts/layer-{i:03d}.bin"


def expert_prefix(e: int) -> str:
    return f"block_sparse_moe.experts.{e}."


# -- reading the manifest ------------------------------------------------------------------------
def read_manifest(path: str | Path) -> dict:
    """The manifest of the store at `path`, after checking that this deltafin can read it."""
    file = Path(path) / MANIFEST
    if not file.exists():
        raise StoreError(f"{path}: not a finished deltafin store (no {MANIFEST}; an interrupted "
                         "conversion resumes when `deltafin convert` is run again)")
    try:
        m = read_json(file, "the store manifest")
    except CheckpointError as e:
        raise StoreError(str(e)) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        found = m.get("format") if isinstance(m, dict) else None
        raise StoreError(f"{file}: not a deltafin store manifest (format {found!r}, expected {FORMAT!r})")
    if m.get("version") not in SUPPORTED_VERSIONS:
        raise StoreError(f"{file}: store format version {m.get('version')!r} is not supported by this deltafin "
                         f"(it reads version {', '.join(map(str, SUPPORTED_VERSIONS))}); convert the checkpoint again "
                         "or use a matching deltafin")
    for key in ("checksum", "hf_config", "files", "spines", "experts"):
        if key not in m:
            raise StoreError(f"{file}: the manifest lacks '{key}'")
    if m["checksum"] != CHECKSUM:
        raise StoreError(f"{file}: unknown checksum kind {m['checksum']!r} (expected {CHECKSUM!r})")
    try:
        check_manifest(Path(path), m, str(file))
    except CheckpointError as e:  # one error type for everything wrong with a store
        raise StoreError(str(e)) from None
    return m


def check_files(path: str | Path, manifest: dict) -> list[str]:
    """Cheap checks: every file the manifest lists exists with the size it records."""
    problems = []
    for rel, meta in manifest["files"].items():
        file = Path(path) / rel
        if not os.path.lexists(file):
            problems.append(f"{file}: missing (the store manifest lists it)")
            continue
        try:
            size = regular_size(file)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if size != meta["nbytes"]:
            kind = "truncated" if size < meta["nbytes"] else "wrong size"
            problems.append(f"{file}: {kind}: {size} bytes, the store manifest says {meta['nbytes']}")
    return problems


def convert_command(src, dst, spine: str) -> str:
    """The command that makes (or adds) a spine, for error messages and hints."""
    return f"deltafin convert {src} {dst} --spine {spine}" + (" --policy moe4" if spine == "mixed" else "")


def choose_spine(path: str | Path, available, spine: str) -> str:
    available = list(available)
    if spine == "auto":
        for name in AUTO_ORDER:
            if name in available:
                return name
        if available:
            return available[0]
        raise StoreError(f"{path}: the store holds no spine")
    if spine not in available:
        raise StoreError(f"{path}: this store has no {spine} spine (it has: {', '.join(available) or 'none'}); "
                         f"add one with `{convert_command('SRC', path, spine)}`")
    return spine


# -- regions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    """One spine file: its extent, its tensors, and which of them form quantized weights."""
    file: str  # absolute
    offset: int
    nbytes: int
    infos: dict[str, TensorInfo]
    qweights: dict[str, str]  # weight name -> codec
    parts: frozenset[str]  # names of tensors that belong to a quantized weight

    @classmethod
    def from_manifest(cls, root: Path, r: dict) -> "Region":
        file = str(root / r["file"])
        infos = {name: TensorInfo(name, file, t["offset"], t["nbytes"], tuple(t["shape"]), t["dtype"])
                 for name, t in r["tensors"].items()}
        qweights = {w: q["codec"] for w, q in r["qweights"].items()}
        parts = frozenset(n for q in r["qweights"].values() for n in q["tensors"])
        return cls(file, r["offset"], r["nbytes"], infos, qweights, parts)

    def weight_names(self) -> set[str]:
        """Names of the weights the region stores (a quantized weight counts once)."""
        return {n for n in self.infos if n not in self.parts} | set(self.qweights)

    def group(self, tensors: dict) -> dict:
        """Raw tensors as read -> {weight name: plain tensor or QWeight}."""
        out = {n: t for n, t in tensors.items() if n not in self.parts}
        for w, codec in self.qweights.items():
            out[w] = QWeight.from_tensors(tensors, w[: -len("weight")], codec)
        return out


@dataclass(frozen=True)
class ExpertFile:
    file: str  # absolute
    span: int
    num_experts: int
    layout: tuple[tuple[str, int, int, tuple[int, ...], str], ...]  # (suffix, offset in span, nbytes, shape, dtype)
    checksums: list

    @classmethod
    def from_manifest(cls, root: Path, x: dict) -> "ExpertFile":
        layout = tuple((s, t["offset"], t["nbytes"], tuple(t["shape"]), t["dtype"]) for s, t in x["tensors"].items())
        return cls(str(root / x["file"]), x["span"], x["num_experts"], layout, x["checksums"])

    def infos(self, e: int) -> dict[str, TensorInfo]:
        p, base = expert_prefix(e), e * self.span
        return {p + s: TensorInfo(p + s, self.file, base + off, n, shape, dtype)
                for s, off, n, shape, dtype in self.layout}


# -- the weight source ---------------------------------------------------------------------------
class StoreSource:
    """Tensors from a converted store; offers what ``HFSource`` offers, plus one-read extents."""

    kind = "store"

    def __init__(self, path: str | Path, spine: str = "auto"):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        problems = check_files(self.path, self.manifest)
        if problems:
            raise StoreError(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
        self.config: ModelConfig = parse_config(self.manifest["hf_config"], str(self.path / MANIFEST))
        self.spines: tuple[str, ...] = tuple(self.manifest["spines"])
        self.spine_codec = choose_spine(self.path, self.spines, spine)
        self.expert_codec: str = self.manifest["experts"]["codec"]  # one of layout.EXPERT_CODECS (checked)
        sp = self.manifest["spines"][self.spine_codec]
        try:
            self._globals = Region.from_manifest(self.path, sp["globals"])
            self._layers = [Region.from_manifest(self.path, r) for r in sp["layers"]]
            self._experts = {int(i): ExpertFile.from_manifest(self.path, x)
                             for i, x in self.manifest["experts"]["layers"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{self.path / MANIFEST}: malformed store manifest ({type(e).__name__}: {e})") from None
        self._check_layout()
        self._files = FileHandles()

    def _check_layout(self) -> None:
        """The manifest holds exactly the tensors the config implies (names, plain shapes)."""
        cfg, where = self.config, self.path / MANIFEST

        def same(region: Region, specs: dict, what: str) -> None:
            names = region.weight_names()
            if names != set(specs):
                missing, extra = sorted(set(specs) - names), sorted(names - set(specs))
                raise StoreError(f"{where}: {what} of the {self.spine_codec} spine does not match the config "
                                 f"(missing {missing}, unexpected {extra})")
            for n, spec in specs.items():
                if n in region.infos and n not in region.parts and not spec.accepts(region.infos[n].shape):
                    raise StoreError(f"{where}: {what}: tensor '{n}' has shape {list(region.infos[n].shape)}, "
                                     f"the config implies {list(spec.shape)}")

        if len(self._layers) != cfg.num_layers:
            raise StoreError(f"{where}: the {self.spine_codec} spine has {len(self._layers)} layers, "
                             f"the config has {cfg.num_layers}")
        same(self._globals, global_tensors(cfg), "the globals")
        for i, region in enumerate(self._layers):
            same(region, layer_spine_tensors(cfg, i), f"layer {i}")
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
        if sorted(self._experts) != moe:
            raise StoreError(f"{where}: experts are stored for layers {sorted(self._experts)}, "
                             f"the config has MoE layers {moe}")
        codec = self.expert_codec
        for i, x in self._experts.items():
            want = {n[len(expert_prefix(0)):]: s for n, s in expert_tensors(cfg, i, 0, codec).items()}
            got = {s: (shape, dtype) for s, _, _, shape, dtype in x.layout}
            if x.num_experts != cfg.num_experts or set(got) != set(want):
                raise StoreError(f"{where}: the experts of layer {i} do not match the config (stored as {codec}: "
                                 f"{x.num_experts} experts of {sorted(got)}; the config implies {cfg.num_experts} of "
                                 f"{sorted(want)})")
            for s, (shape, dtype) in got.items():
                # As published, the dtype is the checkpoint's own; re-encoded, it is the codec's.
                if not want[s].accepts(shape) or (codec != PLAIN and dtype != want[s].dtype):
                    raise StoreError(f"{where}: the experts of layer {i}, stored as {codec}: tensor '{s}' is {dtype} "
                                     f"{list(shape)}, the config implies {want[s].dtype} {list(want[s].shape)}")

    # -- what HFSource offers ----------------------------------------------------------------
    def global_infos(self) -> dict[str, TensorInfo]:
        return dict(self._globals.infos)

    def spine_infos(self, i: int) -> dict[str, TensorInfo]:
        return dict(self._layers[i].infos)

    def expert_infos(self, i: int, e: int) -> dict[str, TensorInfo]:
        return self._expert_file(i, e).infos(e)

    def decode_spine(self, i: int, tensors: dict) -> dict:
        return hf_source.decode_spine(self.config, self._layers[i].group(tensors))

    def decode_expert(self, i: int, e: int, tensors: dict) -> tuple:
        return hf_source.decode_expert(self.config, e, tensors, self.expert_codec)

    def decode_globals(self, tensors: dict) -> dict:
        return hf_source.decode_globals(self._globals.group(tensors))

    def fd(self, file: str) -> int:
        return self._files.get(file)

    def read_globals(self) -> dict:
        return self.decode_globals(hf_source.read_infos(self.global_infos(), self.fd))

    def read_spine(self, i: int) -> dict:
        return self.decode_spine(i, hf_source.read_infos(self.spine_infos(i), self.fd))

    def read_expert(self, i: int, e: int) -> tuple:
        return self.decode_expert(i, e, hf_source.read_infos(self.expert_infos(i, e), self.fd))

    def close(self) -> None:
        self._files.close()

    # -- one-read access -----------------------------------------------------------------------
    def globals_extent(self) -> tuple[str, int, int]:
        g = self._globals
        return g.file, g.offset, g.nbytes

    def spine_extent(self, i: int) -> tuple[str, int, int]:
        """(file, offset, nbytes) of layer i's whole spine: page-aligned, one read."""
        r = self._layers[i]
        return r.file, r.offset, r.nbytes

    def expert_span(self, i: int) -> int:
        return self._expert_file(i, 0).span

    def expert_extent(self, i: int, e: int) -> tuple[str, int, int]:
        """(file, offset, nbytes) of routed expert e of layer i: page-aligned, one read."""
        x = self._expert_file(i, e)
        return x.file, e * x.span, x.span

    def _expert_file(self, i: int, e: int) -> ExpertFile:
        x = self._experts.get(i)
        if x is None:
            raise StoreError(f"{self.path}: layer {i} has no routed experts")
        if not 0 <= e < x.num_experts:
            raise StoreError(f"{self.path}: layer {i} has experts 0..{x.num_experts - 1}, not {e}")
        return x


# -- verification --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Check:
    """Tensors of one file to hash with one read: (label, offset in the read, nbytes, expected)."""
    file: Path
    offset: int
    nbytes: int
    tensors: tuple[tuple[str, int, int, str], ...]


def _checks(root: Path, m: dict) -> Iterator[_Check]:
    for rel, meta in m["files"].items():
        if "checksum" in meta:
            yield _Check(root / rel, 0, meta["nbytes"], ((f"file '{rel}'", 0, meta["nbytes"], meta["checksum"]),))
    for spine, sp in m["spines"].items():
        regions = [("globals", sp["globals"])] + [(f"layer {i}", r) for i, r in enumerate(sp["layers"])]
        for where, r in regions:
            for name, t in r["tensors"].items():
                yield _Check(root / r["file"], t["offset"], t["nbytes"],
                             ((f"tensor '{name}' ({where}, {spine} spine)", 0, t["nbytes"], t["checksum"]),))
    for i, x in m["experts"]["layers"].items():
        layout = [(s, t["offset"], t["nbytes"]) for s, t in x["tensors"].items()]
        for e, sums in enumerate(x["checksums"]):
            yield _Check(root / x["file"], e * x["span"], x["span"], tuple(
                (f"tensor '{expert_prefix(e)}{s}' (layer {i})", off, n, want)
                for (s, off, n), want in zip(layout, sums)))


def _run_check(c: _Check) -> tuple[int, list[str]]:
    fd = open_regular(c.file)
    try:
        problems = []
        if len(c.tensors) == 1:
            # One (possibly multi-GB) tensor: hash it a chunk at a time.
            label, off, size, want = c.tensors[0]
            crc, done = 0, 0
            while done < size:
                n = min(VERIFY_CHUNK, size - done)
                crc = checksum(pread_exact(fd, n, c.offset + off + done, str(c.file)), crc)
                done += n
            if hex_checksum(crc) != want:
                problems.append(f"{c.file}: checksum mismatch in {label} at byte {c.offset + off}: "
                                f"{CHECKSUM} {hex_checksum(crc)}, the manifest says {want}")
        else:
            view = memoryview(pread_exact(fd, c.nbytes, c.offset, str(c.file)))
            for label, off, n, want in c.tensors:
                got = hex_checksum(checksum(view[off: off + n]))
                if got != want:
                    problems.append(f"{c.file}: checksum mismatch in {label} at byte {c.offset + off}: "
                                    f"{CHECKSUM} {got}, the manifest says {want}")
        return c.nbytes, problems
    finally:
        os.close(fd)


def verify(path: str | Path, stop_at_first: bool = False, workers: int = 4,
           on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of the store at `path` (empty: it is intact), recomputing every checksum.

    Structural problems (manifest, missing or wrongly sized files) are reported without hashing.
    stop_at_first: return as soon as one checksum mismatch is found (in store order).
    """
    root = Path(path)
    try:
        m = read_manifest(root)
    except StoreError as e:
        return [str(e)]
    problems = check_files(root, m)
    if problems:
        return problems
    try:
        for spine in m["spines"]:  # the tensor lists must match the config, for every spine
            StoreSource(root, spine).close()
    except (StoreError, ValueError) as e:
        return [str(e)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        try:
            for nbytes, found in pool.map(_run_check, _checks(root, m)):
                problems += found
                if on_bytes:
                    on_bytes(nbytes)
                if found and stop_at_first:
                    break
        finally:
            pool.shutdown(cancel_futures=True)
    return problems


def verify_command(path: str | Path, progress: bool = True, out=None) -> int:
    """`deltafin verify STORE`: 0 when every checksum matches, else print the first problem and return 1."""
    from tqdm import tqdm
    out = out or sys.stdout
    try:
        m = read_manifest(path)
    except StoreError as e:
        print(f"deltafin verify: {e}", file=out)
        return 1
    total = sum(c.nbytes for c in _checks(Path(path), m))
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        problems = verify(path, stop_at_first=True, on_bytes=bar.update)
    if problems:
        print(f"deltafin verify: {problems[0]}", file=out)
        return 1
    print(f"deltafin verify: {path}: ok ({len(m['files'])} files, {total / 1e9:.3f} GB checked, "
          f"spines: {', '.join(m['spines'])})", file=out)
    return 0

