"""Lazy hub mode: run a Hugging Face repository without downloading it, fetching what is used.

``HubSource`` is a weight source (the protocol of ``checkpoint.source``) for ``owner/name``:

- At open it resolves the revision to a commit (and pins it), and fetches the small files
  (config, tokenizer, index) and each shard's safetensors header (two range requests per shard)
  into ``<cache_dir>/hub/<owner>--<name>/<commit>/``. That folder is what the rest of deltafin sees
  as the model folder; with ``metadata.json`` written last, a folder that has it is complete.
- Weights are fetched per *entry*, on first use: the globals (embeddings, norm, head), one layer's
  spine, one routed expert. An entry holds its tensors' byte runs from the shards, each placed at
  its offset modulo the page size (so tensors keep their alignment), followed by a trailer with the
  content's length and CRC-32. The streamer reads an entry as one run, like a converted store's
  group, so a cached model streams at disk speed through the same read pool.
- Fetching: the missing entries of one request (the experts a layer chose, a spine) become range
  requests over ``hub_connections`` connections; runs that touch in a shard (adjacent experts) are
  coalesced into one request, and long runs are split so one spine uses several connections.
  Bytes land in ``<entry>.part`` (locked, so two processes never write one entry) with a journal
  of the pieces that are durably written: a killed fetch resumes where it stopped. Complete, the
  part gets its trailer and is renamed into place: an entry exists whole or not at all.
- Each entry is checked once per process before first use (length, and CRC-32 of its content);
  a bad one is deleted and fetched again (or named, offline).
- ``hub_cache_gb`` bounds the experts kept: the least recently used ones not used by this
  process are deleted to make room. The spine and globals are needed every token and stay.
- Offline (``HF_HUB_OFFLINE=1``) nothing is fetched: cached entries serve, and a missing one is an
  error that names exactly which entries are missing and where the cache is.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ..files import CheckpointError, FileHandles, fsync_dir
from ..checkpoint.hf import TensorInfo, check_index, header_length, parse_safetensors_header, validate_infos, \
    weight_map_of
from ..checkpoint.layout import expert_tensors, full_name, global_tensors, layer_spine_tensors
from ..checkpoint.source import PublishedTensors
from ..config import ModelConfig, load_config
from ..settings import Settings
from ..units import GB, MB
from .fetch import HubError, NotOnHub, Remote, resolve_commit
from .reader import ALIGN, Files, merge_extents

TRAILER = struct.Struct("<4sIQ")  # magic, CRC-32 of the content, content length
MAGIC = b"DFE1"
REQUEST_MAX = 32 << 20  # longest range request: long runs are split to spread over connections
CRC_BLOCK = 8 << 20
METADATA_FILES = ("generation_config.json", "tokenizer_config.json", "tiktoken.model", "tokenizer.json",
                  "special_tokens_map.json", "chat_template.jinja")
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_repo_id(text: str) -> bool:
    return REPO_ID.fullmatch(text) is not None and ".." not in text


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class Piece:
    shard: str
    offset: int  # in the shard
    nbytes: int
    at: int  # in the entry's content


@dataclass(frozen=True)
class Entry:
    name: str  # file name in the entries folder
    label: str  # for messages: "layer 3 expert 17"
    pieces: tuple[Piece, ...]
    size: int  # content bytes (the file has a trailer after them)
    evictable: bool  # a routed expert: may be deleted to stay within the disk budget


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def entry_crc(fd: int, size: int) -> int:
    crc, pos = 0, 0
    while pos < size:
        block = os.pread(fd, min(CRC_BLOCK, size - pos), pos)
        if not block:
            break
        crc = zlib.crc32(block, crc)
        pos += len(block)
    return crc


def check_entry_file(path: str | Path) -> bool:
    """Whether a cached entry file is whole: its trailer's length and CRC-32 match its content."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        total = os.fstat(fd).st_size
        if total < TRAILER.size:
            return False
        magic, crc, size = TRAILER.unpack(os.pread(fd, TRAILER.size, total - TRAILER.size))
        return magic == MAGIC and size == total - TRAILER.size and entry_crc(fd, size) == crc
    finally:
        os.close(fd)


class EntryCache:
    """Entries on disk, fetched on demand (see the module docstring)."""

    def __init__(self, folder: Path, remote: Remote | None, connections: int, budget_bytes: int,
                 shard_sizes: dict[str, int], where: str):
        self.folder = folder
        self.remote = remote
        self.budget = budget_bytes
        self.shard_sizes = shard_sizes
        self.where = where  # "owner/name@commit", for messages
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._ready: set[str] = set()  # present and verified in this process
        self._pool = ThreadPoolExecutor(connections, thread_name_prefix="deltafin-fetch") if remote else None
        # Two, so that the experts a layer waits for never queue behind the next layer's spine.
        self._ahead = ThreadPoolExecutor(2, thread_name_prefix="deltafin-prefetch") if remote else None
        self._expert_bytes = sum(e.stat().st_size for e in os.scandir(folder)
                                 if e.name.startswith("expert-") and e.name.endswith(".bin"))
        self._warned_budget = False
        self._bar = None
        self._group: list[Entry] = []  # offline: the entries last asked for together

    def path(self, entry: Entry) -> Path:
        return self.folder / (entry.name + ".bin")

    def present(self, entry: Entry) -> bool:
        if entry.name in self._ready:  # checked in this process, and what it uses is never evicted
            return True
        try:
            return os.stat(self.path(entry)).st_size == entry.size + TRAILER.size
        except FileNotFoundError:
            return False

    # -- use ---------------------------------------------------------------------------------
    def ensure(self, entries: list[Entry]) -> None:
        """Every entry whole on disk and checked, fetching the missing ones (coalesced)."""
        todo, waits = self._claim(entries)
        self._run(todo)
        for e, ev in waits:
            ev.wait()
            if e.name not in self._ready:  # the thread fetching it failed: try once more here
                self.ensure([e])

    def prefetch(self, entries: list[Entry]) -> None:
        """Start fetching the entries that are missing, without waiting (readers that need one of
        them wait for this fetch instead of starting their own)."""
        if self._ahead is None:  # offline: remember the group, so that a miss names all of its misses
            self._group = list(entries)
            return
        todo, _ = self._claim(entries)
        if todo:
            self._ahead.submit(self._quiet_run, todo)

    def _claim(self, entries: list[Entry]) -> tuple[list[Entry], list]:
        """(entries this thread must settle, (entry, event) pairs other threads are settling)."""
        todo, waits = [], []
        with self._lock:
            for e in entries:
                if e.name in self._ready:
                    continue
                ev = self._inflight.get(e.name)
                if ev is not None:
                    waits.append((e, ev))
                else:
                    self._inflight[e.name] = threading.Event()
                    todo.append(e)
        return todo, waits

    def _run(self, todo: list[Entry]) -> None:
        if not todo:
            return
        try:
            self._settle(todo)
        finally:
            with self._lock:
                for e in todo:
                    self._inflight.pop(e.name).set()

    def _quiet_run(self, todo: list[Entry]) -> None:
        try:
            self._run(todo)
        except Exception:  # a reader that needs the entry fetches again and reports the error
            pass

    def _settle(self, entries: list[Entry]) -> None:
        """Check present entries (once per process) and fetch the others."""
        fetch = []
        for e in entries:
            if self.present(e) and self._check(e):
                self._mark_ready(e)
            else:
                fetch.append(e)
        if fetch:
            self._fetch(fetch)
            for e in fetch:
                self._mark_ready(e)

    def _mark_ready(self, e: Entry) -> None:
        try:
            os.utime(self.path(e))  # recency, for the disk budget
        except OSError:
            pass
        with self._lock:
            self._ready.add(e.name)

    def _check(self, e: Entry) -> bool:
        if check_entry_file(self.path(e)):
            return True
        print(f"deltafin: cached {e.label} of {self.where} is damaged ({self.path(e)}); fetching it again",
              file=sys.stderr)
        self.path(e).unlink(missing_ok=True)
        return False

    # -- fetch -------------------------------------------------------------------------------
    def _fetch(self, entries: list[Entry]) -> None:
        if self.remote is None:
            entries = [e for e in dict.fromkeys(entries + self._group) if not self.present(e)]
            total = sum(e.size for e in entries)
            raise HubError(f"{self.where}: offline (HF_HUB_OFFLINE is set) and not in the cache {self.folder}: "
                           + ", ".join(e.label for e in entries) + f" ({total / MB:.1f} MB); run once online "
                           "to fetch them")
        self._make_room(sum(e.size for e in entries if e.evictable))
        parts = [_Part(self.folder, e) for e in entries]
        try:
            todo = [p for p in parts if p.open()]  # not open(): another process finished it meanwhile
            futures = [self._pool.submit(self._request, *r) for r in _plan(todo)]
            wait(futures)  # all of them, even after an error: none may write into a closed part
            for fut in futures:
                fut.result()
            for p in todo:
                p.finish()
                if p.entry.evictable:
                    with self._lock:
                        self._expert_bytes += p.entry.size + TRAILER.size
            if todo:
                fsync_dir(self.folder)
        finally:
            for p in parts:
                p.close()

    def _request(self, shard: str, start: int, end: int, pieces: list[tuple["_Part", Piece]]) -> None:
        data, total = self.remote.get_range(shard, start, end)
        if self.shard_sizes.get(shard, total) != total:
            raise HubError(f"{self.where}/{shard}: the file is {total} bytes now, its header said "
                           f"{self.shard_sizes[shard]}: the repository changed under this commit?")
        for part in dict.fromkeys(p for p, _ in pieces):
            part.write([(pc, data[pc.offset - start:pc.offset - start + pc.nbytes]) for q, pc in pieces if q is part])
        self._progress(len(data))

    def _progress(self, n: int) -> None:
        from tqdm import tqdm
        with self._lock:
            if self._bar is None:
                self._bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"fetching {self.where}",
                                 disable=None, leave=False)
            self._bar.update(n)

    def _make_room(self, need: int) -> None:
        """Delete least recently used experts (not used by this process) to stay within the budget."""
        if not self.budget or not need:
            return
        with self._lock:
            if self._expert_bytes + need <= self.budget:
                return
            ready = {n + ".bin" for n in self._ready}
            old = []
            for d in os.scandir(self.folder):
                if d.name.startswith("expert-") and d.name.endswith(".bin") and d.name not in ready:
                    st = d.stat()
                    old.append((st.st_mtime, d.path, st.st_size))
            for _, path, size in sorted(old):
                if self._expert_bytes + need <= self.budget:
                    break
                try:
                    os.unlink(path)
                    self._expert_bytes -= size
                except FileNotFoundError:
                    pass
            if self._expert_bytes + need > self.budget and not self._warned_budget:
                self._warned_budget = True
                print(f"deltafin: the hub cache holds {(self._expert_bytes + need) / GB:.2f} GB of experts, over its "
                      f"budget of {self.budget / GB:.2f} GB, because this run uses them all", file=sys.stderr)

    def close(self) -> None:
        for pool in (self._ahead, self._pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if self._bar is not None:
            self._bar.close()


class _Part:
    """One entry being fetched: ``<name>.part`` (locked) and its journal ``<name>.part.log`` of
    content ranges already written and synced."""

    def __init__(self, folder: Path, entry: Entry):
        self.entry = entry
        self.final = folder / (entry.name + ".bin")
        self.file = folder / (entry.name + ".part")
        self.log = folder / (entry.name + ".part.log")
        self.fd: int | None = None
        self.done: set[tuple[int, int]] = set()  # (at, nbytes) of written pieces
        self._lock = threading.Lock()

    def open(self) -> bool:
        """Lock the part file (waiting for another process that holds it); False if the entry is
        complete by now."""
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            if os.stat(self.final).st_size == self.entry.size + TRAILER.size:
                return False
        except FileNotFoundError:
            pass
        if self.log.exists():  # a fetch that was killed: keep what it durably wrote
            for line in self.log.read_text().splitlines():
                fields = line.split()
                if len(fields) == 2 and all(f.isdigit() for f in fields):
                    self.done.add((int(fields[0]), int(fields[1])))
        return True

    def missing(self) -> list[Piece]:
        return [p for p in _split(self.entry.pieces) if (p.at, p.nbytes) not in self.done]

    def write(self, pieces: list[tuple[Piece, bytes]]) -> None:
        for p, data in pieces:
            os.pwrite(self.fd, data, p.at)
        os.fsync(self.fd)  # the journal must never claim bytes that are not on disk
        with self._lock:
            with open(self.log, "a") as f:
                f.write("".join(f"{p.at} {p.nbytes}\n" for p, _ in pieces))
            self.done.update((p.at, p.nbytes) for p, _ in pieces)

    def finish(self) -> None:
        left = self.missing()
        if left:
            raise HubError(f"{self.entry.label}: {len(left)} pieces were not fetched")
        size = self.entry.size
        os.ftruncate(self.fd, size)
        os.pwrite(self.fd, TRAILER.pack(MAGIC, entry_crc(self.fd, size), size), size)
        os.fsync(self.fd)
        os.rename(self.file, self.final)
        self.log.unlink(missing_ok=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _split(pieces) -> list[Piece]:
    """Pieces cut at REQUEST_MAX boundaries of their shard offsets (so long runs span requests)."""
    out = []
    for p in pieces:
        a, end = p.offset, p.offset + p.nbytes
        while a < end:
            b = min(end, (a // REQUEST_MAX + 1) * REQUEST_MAX)
            out.append(Piece(p.shard, a, b - a, p.at + a - p.offset))
            a = b
    return out


def _plan(parts: list[_Part]) -> list[tuple[str, int, int, list]]:
    """Range requests for the missing pieces: pieces that touch in a shard share one request
    (up to REQUEST_MAX bytes)."""
    pieces = sorted(((part, p) for part in parts for p in part.missing()), key=lambda t: (t[1].shard, t[1].offset))
    requests: list[tuple[str, int, int, list]] = []
    for part, p in pieces:
        last = requests[-1] if requests else None
        if (last is not None and last[0] == p.shard and last[2] == p.offset
                and p.offset + p.nbytes - last[1] <= REQUEST_MAX):
            requests[-1] = (last[0], last[1], p.offset + p.nbytes, last[3] + [(part, p)])
        else:
            requests.append((p.shard, p.offset, p.offset + p.nbytes, [(part, p)]))
    return requests


class CachedFiles(Files):
    """Files of the entry cache: a read first makes sure its entry is there (fetching it if not)."""

    def __init__(self, mode: str, source: "HubSource"):
        super().__init__(mode)
        self.source = source

    def read(self, run, buf, start) -> None:
        self.source.ensure_files([run.file])
        super().read(run, buf, start)

    def prefetch(self, files: list[str]) -> None:
        self.source.prefetch_files(files)


class HubSource(PublishedTensors):
    """A weight source over a hub repository, fetched lazily into the entry cache."""

    kind = "hub"
    spine_codec = "bf16"

    def __init__(self, repo_id: str, settings: Settings, endpoint: str | None = None):
        if not is_repo_id(repo_id):
            raise HubError(f"{repo_id!r} is not a hub repository id (owner/name)")
        self.repo_id = repo_id
        offline = hub_offline()
        root = settings.cache_path / "hub" / repo_id.replace("/", "--")
        commit = self._commit(root, settings.revision, endpoint, offline)
        self.commit = commit
        self.path = root / commit
        self.path.mkdir(parents=True, exist_ok=True)
        self.where = f"{repo_id}@{commit[:12]}"
        remote = None if offline else Remote(repo_id, commit, endpoint, settings.hub_retries, settings.hub_backoff)
        self.remote = remote
        meta = self._metadata(remote)
        self.config: ModelConfig = load_config(self.path)
        infos: dict[str, TensorInfo] = {}
        for shard, m in meta["shards"].items():
            infos.update(parse_safetensors_header(m["header"].encode(), m["size"], shard))
        if meta.get("weight_map") is not None:
            check_index(meta["weight_map"], infos, lambda shard: shard)
        validate_infos(self.config, infos, self.where)
        self.infos = infos
        self.cache = EntryCache(self.path / "entries", remote, settings.hub_connections,
                                int(settings.hub_cache_gb * GB), {s: m["size"] for s, m in meta["shards"].items()},
                                self.where)
        self._files = FileHandles()
        self._groups: dict[tuple, tuple[Entry, dict[str, TensorInfo]]] = {}
        self._by_path: dict[str, Entry] = {}
        self._lock = threading.Lock()

    # -- opening -----------------------------------------------------------------------------
    @staticmethod
    def _commit(root: Path, revision: str, endpoint: str | None, offline: bool) -> str:
        """The commit to use (and pin): resolved online, remembered for offline runs."""
        ref = root / "refs" / re.sub(r"[^A-Za-z0-9_.-]", "_", revision)
        if offline:
            if re.fullmatch(r"[0-9a-f]{40}", revision) and (root / revision / "metadata.json").exists():
                return revision
            if ref.exists():
                return ref.read_text().strip()
            raise HubError(f"{root.name.replace('--', '/')} (revision {revision}): offline (HF_HUB_OFFLINE is set) "
                           f"and never fetched from the Hugging Face hub into {root}; run once online first")
        commit = resolve_commit(root.name.replace("--", "/"), revision, endpoint)
        ref.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(ref, commit.encode())
        return commit

    def _metadata(self, remote: Remote | None) -> dict:
        """config, tokenizer files, index and shard headers: fetched once, kept in metadata.json."""
        marker = self.path / "metadata.json"
        if marker.exists():
            return json.loads(marker.read_text())
        if remote is None:
            raise HubError(f"{self.where}: offline (HF_HUB_OFFLINE is set) and its metadata was never fetched "
                           f"into {self.path}; run once online first")
        _write_atomic(self.path / "config.json", remote.get_file("config.json"))
        present = ["config.json"]
        for name in METADATA_FILES:
            data = _optional(remote, name)
            if data is not None:
                _write_atomic(self.path / name, data)
                present.append(name)
        index = _optional(remote, "model.safetensors.index.json")
        if index is not None:
            where = f"{self.where}/model.safetensors.index.json"
            try:
                weight_map = weight_map_of(json.loads(index), where)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise CheckpointError(f"{where}: not valid JSON ({e})") from None
            shards = sorted(set(weight_map.values()))
            for shard in shards:  # names become URL paths in this repository: nothing may climb out
                if shard.startswith("/") or "\\" in shard or any(p in ("", ".", "..") for p in shard.split("/")):
                    raise CheckpointError(f"{where}: shard {shard!r} is not a path inside the repository")
        else:
            weight_map, shards = None, ["model.safetensors"]
        headers = {}
        for shard in shards:
            head, size = remote.get_range(shard, 0, 8)
            hlen = header_length(head, size, f"{self.where}/{shard}")
            raw, _ = remote.get_range(shard, 8, 8 + hlen)
            headers[shard] = {"size": size, "header": raw.decode("utf-8", "replace")}
        meta = {"repo_id": self.repo_id, "commit": self.commit, "files": present, "weight_map": weight_map,
                "shards": headers}
        _write_atomic(marker, json.dumps(meta).encode())
        return meta

    # -- groups ------------------------------------------------------------------------------
    def _group(self, key: tuple, names: dict[str, str]) -> tuple[Entry, dict[str, TensorInfo]]:
        """The entry of a group of tensors ({relative name: checkpoint name}) and their infos in it."""
        got = self._groups.get(key)
        if got is not None:
            return got
        remote = {rel: self.infos[name] for rel, name in names.items()}
        pieces, pos, placed = [], 0, {}
        for run in merge_extents(remote.values()):
            at = pos + (run.offset - pos) % ALIGN  # keep the shard's alignment within a page
            pieces.append(Piece(run.file, run.offset, run.nbytes, at))
            pos = at + run.nbytes
        kind = key[0]
        label = {"globals": "the embeddings and head", "spine": f"layer {key[-1]} spine"}.get(
            kind, f"layer {key[1]} expert {key[-1]}" if len(key) == 3 else "")
        name = "-".join(str(k) for k in key)
        entry = Entry(name, label, tuple(pieces), pos, evictable=kind == "expert")
        path = str(self.cache.path(entry))
        for rel, t in remote.items():
            p = next(p for p in pieces if p.shard == t.file and p.offset <= t.offset < p.offset + p.nbytes)
            placed[rel] = TensorInfo(t.name, path, p.at + t.offset - p.offset, t.nbytes, t.shape, t.dtype)
        with self._lock:
            self._groups[key] = (entry, placed)
            self._by_path[path] = entry
        return entry, placed

    def _globals_group(self):
        return self._group(("globals",), {rel: full_name(self.config, rel) for rel in global_tensors(self.config)})

    def _spine_group(self, i: int):
        return self._group(("spine", i), {rel: full_name(self.config, rel, i)
                                          for rel in layer_spine_tensors(self.config, i)})

    def _expert_group(self, i: int, e: int):
        return self._group(("expert", i, e), {rel: full_name(self.config, rel, i)
                                              for rel in expert_tensors(self.config, i, e)})

    # -- the source protocol -----------------------------------------------------------------
    def global_infos(self) -> dict[str, TensorInfo]:
        return self._globals_group()[1]

    def spine_infos(self, i: int) -> dict[str, TensorInfo]:
        return self._spine_group(i)[1]

    def expert_infos(self, i: int, e: int) -> dict[str, TensorInfo]:
        return self._expert_group(i, e)[1]

    def globals_extent(self):
        return self._extent(self._globals_group()[0])

    def spine_extent(self, i: int):
        return self._extent(self._spine_group(i)[0])

    def expert_extent(self, i: int, e: int):
        return self._extent(self._expert_group(i, e)[0])

    def _extent(self, entry: Entry):
        return str(self.cache.path(entry)), 0, entry.size

    def make_files(self, mode: str) -> CachedFiles:
        return CachedFiles(mode, self)

    def origin(self, file: str) -> str:
        """Where a read of this entry file gets its bytes: "cache" if it is on disk, else "network"."""
        entry = self._by_path.get(file)
        return "cache" if entry is None or self.cache.present(entry) else "network"

    def ensure_files(self, files: list[str]) -> None:
        self.cache.ensure([self._by_path[f] for f in files if f in self._by_path])

    def prefetch_files(self, files: list[str]) -> None:
        self.cache.prefetch([self._by_path[f] for f in files if f in self._by_path])

    def fd(self, file: str) -> int:
        self.ensure_files([file])
        return self._files.get(file)

    @property
    def bytes_received(self) -> int:
        return self.remote.bytes_received if self.remote is not None else 0

    def close(self) -> None:
        self.cache.close()
        self._files.close()


def _optional(remote: Remote, name: str) -> bytes | None:
    try:
        return remote.get_file(name)
    except NotOnHub:
        return None
