"""Read a Hugging Face checkpoint folder tensor by tensor, at the tensors' byte offsets.

Only the safetensors headers are parsed up front; a tensor is one ``os.pread`` of exactly its
byte range, so a 2.8 T-parameter checkpoint opens in milliseconds and reading one expert reads
only that expert. Every tensor the config implies is checked for presence and shape, and every
shard for truncation, before anything runs.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig, load_config
from ..files import CheckpointError, FileHandles, confine, confinement_root, open_regular, pread_exact, read_json
from .layout import all_tensors, check_config_fits

# safetensors dtype names -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    # E8M0 scales are read as their raw bits: the decoder wants the exponent byte itself.
    "F8_E8M0": (torch.uint8, 1),
    "F8_E4M3": (torch.uint8, 1),
}
FLOAT_DTYPES = {"BF16", "F16", "F32"}
BYTE_DTYPES = {"U8", "I8", "F8_E8M0"}
MAX_HEADER = 100 * 1024 * 1024
MAX_RANK = 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # absolute path of the shard
    offset: int  # absolute byte offset in the file
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_safetensors_header(file: str | Path) -> dict[str, TensorInfo]:
    """Parse one shard's header; check that the file holds every byte the header promises."""
    file = str(file)
    fd = open_regular(file)
    try:
        size = os.fstat(fd).st_size
        hlen = header_length(pread_exact(fd, min(8, size), 0, file), size, file)
        raw = pread_exact(fd, hlen, 8, file)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    return parse_safetensors_header(bytes(raw), size, file)


def header_length(head: bytes, size: int, file: str) -> int:
    """The JSON header's length from a shard's first 8 bytes (checked against the file size)."""
    if len(head) < 8:
        raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise CheckpointError(f"{file}: bad safetensors header (header length {hlen}, file {size} bytes)")
    return hlen


def parse_safetensors_header(raw: bytes, size: int, file: str) -> dict[str, TensorInfo]:
    """TensorInfos from a shard's JSON header `raw` (the file, `size` bytes, is named `file`)."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: bad safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: bad safetensors header (not an object)")
    base = 8 + len(raw)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{file}: safetensors header entry for tensor '{name}'"
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where} is not an object")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor '{name}' has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: 'shape' must be a list of at most {MAX_RANK} non-negative integers, "
                                  f"got {str(shape)[:80]}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: 'data_offsets' must be two integers [begin, end] with "
                                  f"0 <= begin <= end, got {str(offsets)[:80]}")
        start, end = offsets
        n = DTYPES[dtype][1]
        for d in shape:
            n *= d
        if end - start != n:
            raise CheckpointError(f"{file}: tensor '{name}' header says {end - start} bytes, shape {shape} "
                                  f"{dtype} needs {n}")
        if base + end > size:
            raise CheckpointError(f"{file}: truncated: tensor '{name}' ends at byte {base + end} "
                                  f"but the file has {size} bytes")
        out[name] = TensorInfo(name, file, base + start, n, tuple(shape), dtype)
    return out


def weight_map_of(index, where) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of a parsed model.safetensors.index.json."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: not a valid safetensors index (no 'weight_map' object)")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: weight_map['{bad}'] must be a shard file name, "
                              f"got {str(weight_map[bad])[:80]}")
    return weight_map


def check_index(weight_map: dict, infos: dict[str, TensorInfo], file_of) -> None:
    """Every tensor the index lists is in the shard it names (`file_of(shard)`: the shard's
    TensorInfo.file)."""
    for name, shard in weight_map.items():
        info = infos.get(name)
        if info is None or info.file != file_of(shard):
            raise CheckpointError(f"{file_of(shard)}: the index says tensor '{name}' is in this shard, "
                                  "but it is not")


def validate_infos(cfg: ModelConfig, infos: dict[str, TensorInfo], where) -> None:
    """Every tensor the config implies exists with the right shape and a plausible dtype."""
    for name, spec in all_tensors(cfg).items():
        info = infos.get(name)
        if info is None:
            raise CheckpointError(f"{where}: tensor '{name}' is missing (the config implies it)")
        if not spec.accepts(info.shape):
            raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, "
                                  f"the config implies {list(spec.shape)}")
        ok = info.dtype in (BYTE_DTYPES if spec.dtype == "U8" else FLOAT_DTYPES)
        if not ok:
            raise CheckpointError(f"{info.file}: tensor '{name}' has dtype {info.dtype}, expected {spec.dtype}")


def bytes_to_tensor(buf, info: TensorInfo) -> torch.Tensor:
    torch_dtype = DTYPES[info.dtype][0]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=torch_dtype)
    return torch.frombuffer(buf, dtype=torch_dtype).reshape(info.shape)


class HFCheckpoint:
    """A Hugging Face checkpoint folder: config + safetensors shards, read by byte range."""

    def __init__(self, path: str | Path, validate: bool = True):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.config: ModelConfig = load_config(self.path)
        self.raw_config = read_json(self.path / "config.json", "config.json")
        self.infos: dict[str, TensorInfo] = self._read_index()
        self._files = FileHandles()
        check_config_fits(self.config, len(self.infos), sum(i.nbytes for i in self.infos.values()),
                          str(self.path / "config.json"))
        if validate:
            self.validate()

    # -- discovery -------------------------------------------------------------------------
    def _read_index(self) -> dict[str, TensorInfo]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = weight_map_of(read_json(index, "the safetensors index"), index)
            shards = sorted(set(weight_map.values()))
        elif (self.path / "model.safetensors").exists():
            weight_map, shards = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors.index.json or model.safetensors")
        infos: dict[str, TensorInfo] = {}
        root = confinement_root(self.path)
        for shard in shards:
            file = confine(self.path, shard, f"{index}: weight_map", root)
            if not file.exists():
                raise CheckpointError(f"{index}: lists shard {shard}, which does not exist")
            infos.update(read_safetensors_header(file))
        if weight_map is not None:
            check_index(weight_map, infos, lambda shard: str(self.path / shard))
        return infos

    def validate(self) -> None:
        validate_infos(self.config, self.infos, self.path)

    # -- reading ---------------------------------------------------------------------------
    def _fd(self, file: str) -> int:
        return self._files.get(file)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named '{name}'") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Read exactly one tensor's bytes."""
        info = self.info(name)
        return bytes_to_tensor(pread_exact(self._fd(info.file), info.nbytes, info.offset, info.file), info)

    def close(self) -> None:
        self._files.close()
