"""All of a layer's routed experts in one place, and their MLPs for every chosen expert at once.

``ExpertStack`` holds a MoE layer's plain (bf16 / fp32) routed experts stacked: ``w13`` [E, 2I, H]
(gate rows, then up rows) and ``w2`` [E, H, I]; ``MXFP4Stack`` the same for MXFP4 experts (codes
and scales stacked alike). One is what a provider hands the MoE layer when every expert of that
layer is resident on one device. ``stack[e]`` gives expert e's (w1, w3, w2) as views, so the
per-expert path still works on it.

``grouped_mlp`` computes every (token, chosen expert) pair's ``w2 @ glu(w1 @ x, w3 @ x)`` and the
routing-weighted sum over each token's experts without reading the expert ids back to the host, by
one of three paths (which one, from its pairs per expert: ``Stacked.takes_sorted``):
- bf16 experts of a model with bf16 products on a CUDA device with grouped GEMMs (``sorted_mlp``),
  from a few pairs per expert on average: the pairs sorted by expert and two grouped matrix products
  over the sorted rows (gate and up, then down), so each chosen expert's weights are read once for
  all of its rows, whatever their number — a prompt's thousands of rows as a wide batch's. The
  products round their inputs to bf16 and sum in fp32, like every other bf16 product of the model
  (``ops.HalfMatmul``).
- MXFP4 experts on a CUDA device with Triton, likewise (``sorted_mlp`` too): the pairs sorted by
  expert and two Triton launches over tiles of one expert's rows on the tensor cores, the codes
  decoded in registers once for the tile's rows (``grouped_triton.sorted_mxfp4_mlp``), as exact as
  fp32 products; a tile holds about the pairs an expert has (``MXFP4Stack.sorted_tile_rows``).
- otherwise (a few pairs per expert, as in decoding), on CUDA two Triton launches (gate and up fused with the
  activation, then down) over the flattened expert index list, MXFP4 codes decoded inside them
  (each pair reads its expert's weights: made for a few rows); elsewhere a torch reference that
  gathers the chosen experts' weights. Products are fp32 sums of fp32 inputs times the stored
  weights, as in the per-expert path (the results differ from it only in summation order).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

# (token, expert) pairs up to which the Triton kernels are used; a long prefill chooses most experts
# for many tokens, where they would read each expert's weights once per pair.
GROUPED_MAX_PAIRS = 256
# Pairs of one expert in a tile of the sorted MXFP4 kernels (``sorted_tiles``): a power of two
# between these, from the layer's pairs per expert.
MIN_TILE_ROWS = 8
MAX_TILE_ROWS = 64


class Stacked:
    """All of a layer's experts in stacked tensors (see the subclasses)."""

    # Pairs per expert of the layer (pairs / E) from which ``sorted_mlp`` takes the layer: below, most
    # pairs are of distinct experts, so the pair kernels re-read few weights, and their two launches
    # cost less than the sort and the sorted products. bf16: kl_medium's layer (top-8 of 64 experts;
    # H200, graph-replayed) took 252 us at 128 pairs in the pair kernels against 355 us sorted, 441
    # against 427 us at 256 pairs. MXFP4Stack has its own.
    sorted_min_rows = 4

    def applies(self, pairs: int) -> bool:
        return pairs <= GROUPED_MAX_PAIRS or self.sorted_gemm()

    def takes_sorted(self, pairs: int) -> bool:
        """Whether a layer of `pairs` (token, expert) pairs goes through ``sorted_mlp``."""
        return pairs >= self.sorted_min_rows * len(self) and self.sorted_gemm()

    def sorted_gemm(self) -> bool:
        """Whether ``sorted_mlp`` takes these experts (any number of rows)."""
        return False


@dataclass(frozen=True)
class ExpertStack(Stacked):
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    # The model's products are bf16 (ops.HalfMatmul): only then may the grouped GEMMs, which round
    # their inputs to bf16, take these experts (float32 products multiply the stored bf16 weights by
    # float32 rows).
    bf16_products: bool = False

    @classmethod
    def from_experts(cls, experts: list[tuple]) -> "ExpertStack":
        """Stack [(w1, w3, w2), ...] (plain tensors of one dtype and device, expert order)."""
        w13 = torch.stack([torch.cat([w1, w3]) for w1, w3, _ in experts])
        return cls(w13, torch.stack([w2 for _, _, w2 in experts]))

    @property
    def nbytes(self) -> int:
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()

    def __len__(self) -> int:
        return self.w13.shape[0]

    def sorted_gemm(self) -> bool:
        return (self.bf16_products and self.w13.dtype == torch.bfloat16 and self.w13.is_cuda
                and _grouped_gemm_on(self.w13.device))

    def __getitem__(self, e: int) -> tuple:
        inter = self.w2.shape[2]
        return self.w13[e, :inter], self.w13[e, inter:], self.w2[e]



@dataclass(frozen=True)
class MXFP4Stack(Stacked):
    """MXFP4 experts stacked: codes uint8 [E, 2I, H/2] / [E, H, I/2], E8M0 scales [E, 2I, H/32] / [E, H, I/32]."""
    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    # A K3-shaped layer (top-16 of 32 experts, 3,584 x 3,072; H200, graph-replayed, the sort included),
    # by pairs per expert, pair kernels against tiles (rows): at 0.5, 168 against 337 us (4); at 1, 312
    # against 460 (4); at 2, 580 against 493 (4) in one call and 524 against 520 in another, so the pair
    # kernels keep it; at 4 (batch 8), 1,113 against 609 (8; 664 in 4-row tiles); at 8, 2,142 against 823
    # (8); at 16, 4,194 against 1,037 (16); at 64, 16,235 against 7,287 (64).
    sorted_min_rows = 4

    def sorted_tile_rows(self, pairs: int) -> int:
        """Pairs a tile of the sorted kernels holds for a layer of `pairs` pairs: the layer's pairs per
        expert, rounded up to a power of two within [MIN_TILE_ROWS, MAX_TILE_ROWS]."""
        per = -(-pairs // len(self))
        return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, 1 << (per - 1).bit_length()))

    @classmethod
    def from_experts(cls, experts: list[tuple]) -> "MXFP4Stack":
        """Stack [(w1, w3, w2), ...] of MXFP4 QWeights (one device, expert order)."""
        def cat(name, a, b):
            return torch.cat([a.tensors[name], b.tensors[name]])
        return cls(torch.stack([cat("weight_packed", w1, w3) for w1, w3, _ in experts]),
                   torch.stack([cat("weight_scale", w1, w3) for w1, w3, _ in experts]),
                   torch.stack([w2.tensors["weight_packed"] for _, _, w2 in experts]),
                   torch.stack([w2.tensors["weight_scale"] for _, _, w2 in experts]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13_packed, self.w13_scale, self.w2_packed,
                                                          self.w2_scale))

    def __len__(self) -> int:
        return self.w13_packed.shape[0]

    def sorted_gemm(self) -> bool:
        # the sorted kernels' bf16 tensor-core products need compute capability 8.0 or later
        return self.w13_packed.is_cuda and _bf16_dot_on(self.w13_packed.device) and _triton_kernels() is not None

    def __getitem__(self, e: int) -> tuple:
        from .linear import QWeight
        inter = self.w13_packed.shape[1] // 2

        def q(packed, scale):
            return QWeight("mxfp4", (packed.shape[0], 2 * packed.shape[1]), 32,
                           {"weight_packed": packed, "weight_scale": scale})
        return (q(self.w13_packed[e, :inter], self.w13_scale[e, :inter]),
                q(self.w13_packed[e, inter:], self.w13_scale[e, inter:]),
                q(self.w2_packed[e], self.w2_scale[e]))


def grouped_mlp(cfg, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stack: Stacked,
                glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) for rows z [T, H] -> fp32 [T, H]. ``glu(gate, up)``
    is the activation of the torch paths; the Triton kernels apply cfg's own (hidden_act, SiTU betas)."""
    if stack.takes_sorted(ids.numel()):
        return sorted_mlp(cfg, z, ids, weights, stack, glu)
    T, k = ids.shape
    flat = ids.reshape(-1).to(torch.int32)
    x = z.float().contiguous()
    kernels = _triton_kernels() if z.device.type == "cuda" else None
    if isinstance(stack, MXFP4Stack) and kernels is not None:
        act = kernels.mxfp4_gate_up(x, flat, k, stack.w13_packed, stack.w13_scale, cfg)
        out = kernels.mxfp4_down(act, flat, stack.w2_packed, stack.w2_scale)
    elif isinstance(stack, MXFP4Stack):
        out = _grouped_mxfp4(glu, x, flat, k, stack)
    elif kernels is not None:
        out = kernels.grouped_down(kernels.grouped_gate_up(x, flat, k, stack.w13, cfg), flat, stack.w2)
    else:
        out = _grouped_reference(glu, x, flat, k, stack)
    return (out.view(T, k, -1) * weights.float().unsqueeze(-1)).sum(1)


def sorted_mlp(cfg, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stack: Stacked,
               glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``grouped_mlp`` over the pairs sorted by expert (see the module docstring): fp32 [T, H].
    Everything stays on the device (the group offsets are counted there), so a recorded decode graph
    can hold it."""
    T, k = ids.shape
    by_expert, order = ids.reshape(-1).sort(stable=True)  # pairs by expert, rows in order within each
    # where each expert's pairs end (bincount would read its maximum back to the host)
    ends = torch.searchsorted(by_expert, torch.arange(len(stack), device=ids.device), right=True).to(torch.int32)
    if isinstance(stack, MXFP4Stack):
        codes = (stack.w13_packed, stack.w13_scale, stack.w2_packed, stack.w2_scale)
        rows = stack.sorted_tile_rows(order.numel())
        out = _triton_kernels().sorted_mxfp4_mlp(z.float().contiguous(), order.to(torch.int32), ends,
                                                 sorted_tiles(ends, order.numel(), rows), rows, k, *codes, cfg)
    else:
        inter = stack.w2.shape[2]
        x = z.to(torch.bfloat16)[order // k]  # rounded before the gather: k times fewer rows to round
        gu = F.grouped_mm(x, stack.w13.transpose(1, 2), offs=ends).float()  # [P, 2I]
        act = glu(gu[:, :inter], gu[:, inter:]).to(torch.bfloat16)
        by_place = F.grouped_mm(act, stack.w2.transpose(1, 2), offs=ends)  # [P, H], pairs in expert order
        # back in pair order by a scatter (one small launch; the inverse permutation by argsort was a
        # second sort, ~26 us a layer on an H200)
        out = torch.empty_like(by_place).index_copy_(0, order, by_place)
    # [T, k, H] (pair j is token j // k): each token's k outputs summed with their routing weights in
    # one batched product (no atomic scatter)
    return torch.bmm(weights.float().unsqueeze(1), out.view(T, k, -1).float()).squeeze(1)


def sorted_tiles(ends: torch.Tensor, pairs: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of at most `rows` pairs of one expert over pairs sorted by expert (``ends``: int32 [E],
    where each expert's pairs end): each tile's expert and first sorted pair, int32 [cdiv(pairs, rows)
    + E] each (a count fixed by the shapes, enough for any routing); the tiles past the last
    expert's have expert -1. Made on the device from ``ends``, nothing read back."""
    E = ends.numel()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    per = (counts + rows - 1) // rows
    tile_ends = torch.cumsum(per, 0)
    t = torch.arange(-(-pairs // rows) + E, device=ends.device, dtype=tile_ends.dtype)
    e = torch.searchsorted(tile_ends, t, right=True).clamp_(max=E - 1)
    first = ends[e] - counts[e] + (t - (tile_ends[e] - per[e])) * rows
    return torch.where(t < tile_ends[-1], e, -1).to(torch.int32), first.to(torch.int32)


@functools.cache
def _bf16_dot_on(device: torch.device) -> bool:
    """Whether this CUDA device multiplies bf16 on its tensor cores (compute capability 8.0 or later)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _grouped_gemm_on(device: torch.device) -> bool:
    """Whether torch runs bf16 grouped GEMMs on this CUDA device (its kernels need bf16 tensor cores)."""
    return hasattr(F, "grouped_mm") and _bf16_dot_on(device)


def _grouped_reference(glu, x, flat, k, stack):
    inter = stack.w2.shape[2]
    rows = x.repeat_interleave(k, dim=0)  # [T*k, H]: pair j is token j // k
    w13 = stack.w13[flat.long()].float()  # [T*k, 2I, H]
    gu = torch.bmm(w13, rows.unsqueeze(-1)).squeeze(-1)
    act = glu(gu[:, :inter], gu[:, inter:])
    return torch.bmm(stack.w2[flat.long()].float(), act.unsqueeze(-1)).squeeze(-1)


def _grouped_mxfp4(glu, x, flat, k, stack: MXFP4Stack):
    """The reference (and the path without Triton): the chosen experts' codes gathered and decoded
    (the torch dequantization, exact) and multiplied in fp32."""
    from .mxfp4 import mxfp4_dequantize
    idx = flat.long()
    inter = stack.w13_packed.shape[1] // 2
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)
    gu = torch.bmm(_decode(stack.w13_packed[idx], stack.w13_scale[idx], mxfp4_dequantize), rows).squeeze(-1)
    act = glu(gu[:, :inter], gu[:, inter:])
    return torch.bmm(_decode(stack.w2_packed[idx], stack.w2_scale[idx], mxfp4_dequantize),
                     act.unsqueeze(-1)).squeeze(-1)


def _decode(packed, scale, dequantize):
    P, N, half = packed.shape
    return dequantize(packed.reshape(P * N, half), scale.reshape(P * N, -1)).view(P, N, 2 * half)


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The grouped Triton kernels, or None without Triton (imported once: this runs per MoE layer)."""
    try:
        from . import grouped_triton
    except ImportError:
        return None
    return grouped_triton
