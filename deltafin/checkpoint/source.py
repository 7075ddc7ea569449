"""A weight source: where each tensor of a model lives on disk and how to turn its bytes into
what the model binds.

Both a Hugging Face folder (``HFSource``) and a converted store (``checkpoint.store``) offer the
same four things, so the RAM and streaming providers work with either:

- ``global_infos()``    -> {key: TensorInfo} for embed / norm / lm_head (/ output attn-res)
- ``spine_infos(i)``    -> {relative name: TensorInfo} for layer i's non-expert tensors
- ``expert_infos(i, e)``-> {relative name: TensorInfo} for routed expert e of layer i
- ``decode_spine(i, tensors)`` / ``decode_expert(i, tensors)`` / ``decode_globals(tensors)``
  turn raw tensors (as read) into template slots, (w1, w3, w2), and the global dict.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..kernels.linear import QWeight
from ..model.layers import sanitize
from .hf import HFCheckpoint, TensorInfo, bytes_to_tensor, pread_exact
from .layout import EXPERT_WEIGHTS, expert_tensors, full_name, global_tensors, layer_spine_tensors

GLOBAL_KEYS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.output_attn_res_norm.weight": "out_res_norm",
    "model.output_attn_res_proj.weight": "out_res_proj",
}


def decode_spine(cfg: ModelConfig, tensors: dict) -> dict:
    out = {}
    for rel, t in tensors.items():
        slot, t = sanitize(cfg, rel, t)
        out[slot] = t
    return out


def decode_expert(cfg: ModelConfig, e: int, tensors: dict, codec: str = "plain") -> tuple:
    """{relative name: tensor} of one expert -> (w1, w3, w2): plain tensors, or QWeights of the
    experts' codec (layout.EXPERT_CODECS; "plain" is as published: bf16, or MXFP4 for K3)."""
    if codec == "plain" and cfg.expert_format == "mxfp4":
        codec = "mxfp4"
    p = f"block_sparse_moe.experts.{e}."
    if codec == "plain":
        return tuple(tensors[p + w + ".weight"] for w in ("w1", "w3", "w2"))
    weight_codec = EXPERT_WEIGHTS.get(codec, (codec, 0))[0]
    return tuple(QWeight.from_tensors(tensors, p + w + ".", weight_codec) for w in ("w1", "w3", "w2"))


def decode_globals(tensors: dict) -> dict:
    return {GLOBAL_KEYS[k]: t for k, t in tensors.items()}


def read_infos(infos: dict[str, TensorInfo], fd_of) -> dict[str, torch.Tensor]:
    """Read each tensor with one pread (the simple path; the streamer batches and reuses buffers)."""
    return {k: bytes_to_tensor(pread_exact(fd_of(i.file), i.nbytes, i.offset, i.file), i) for k, i in infos.items()}


class PublishedTensors:
    """What sources of tensors stored as published (a Hugging Face folder, a hub repository) share:
    decoding raw tensors into template slots, and whole-group reads through ``self.fd``."""

    config: ModelConfig

    def decode_spine(self, i: int, tensors: dict) -> dict:
        return decode_spine(self.config, tensors)

    def decode_expert(self, i: int, e: int, tensors: dict) -> tuple:
        return decode_expert(self.config, e, tensors)

    def decode_globals(self, tensors: dict) -> dict:
        return decode_globals(tensors)

    # conveniences for the in-RAM provider and tools
    def read_globals(self) -> dict:
        return self.decode_globals(read_infos(self.global_infos(), self.fd))

    def read_spine(self, i: int) -> dict:
        return self.decode_spine(i, read_infos(self.spine_infos(i), self.fd))

    def read_expert(self, i: int, e: int) -> tuple:
        return self.decode_expert(i, e, read_infos(self.expert_infos(i, e), self.fd))


class HFSource(PublishedTensors):
    """Tensors straight from a Hugging Face checkpoint, at their safetensors offsets."""

    kind = "hf"

    def __init__(self, path: str | Path):
        self.ckpt = HFCheckpoint(path)
        self.config: ModelConfig = self.ckpt.config
        self.path = self.ckpt.path
        self.spine_codec = "bf16"

    def global_infos(self) -> dict[str, TensorInfo]:
        return {rel: self.ckpt.info(full_name(self.config, rel)) for rel in global_tensors(self.config)}

    def spine_infos(self, i: int) -> dict[str, TensorInfo]:
        return {rel: self.ckpt.info(full_name(self.config, rel, i)) for rel in layer_spine_tensors(self.config, i)}

    def expert_infos(self, i: int, e: int) -> dict[str, TensorInfo]:
        return {rel: self.ckpt.info(full_name(self.config, rel, i)) for rel in expert_tensors(self.config, i, e)}

    def fd(self, file: str) -> int:
        return self.ckpt._fd(file)

    def close(self) -> None:
        self.ckpt.close()
