"""Small numeric building blocks shared by every layer kind (K3_MODEL.md section 3)."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu_native
from ..kernels.linear import dense_kind, native_dense, qlinear


@dataclass(frozen=True)
class HalfMatmul:
    """A plain weight whose products run in a 16-bit dtype (opt-in, labeled). The input row is
    rounded to that dtype, the products are summed in fp32 and the result is rounded to that dtype
    before it comes back in the input's dtype; norms, states, softmax and the residual stream stay
    fp32. Where it runs is chosen by ``linear`` per device (see there)."""
    weight: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def plain(w) -> torch.Tensor:
    """The weight tensor itself, for the few places that use a weight other than as a product."""
    return w.weight if isinstance(w, HalfMatmul) else w


# Weights stored in another dtype than the compute dtype are converted this many elements at a
# time: converting a whole [163840, 7168] head to fp32 at once would need 4.7 GB.
CONVERT_BLOCK = 1 << 24


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for a plain weight tensor or a quantized weight (dequantized inside the product)."""
    if isinstance(w, HalfMatmul):
        return _half_linear(x, w)
    if x.dtype == torch.float32 and x.is_cpu and (y := _native_product(x, w)) is not None:
        return y
    if not isinstance(w, torch.Tensor):
        return qlinear(x, w)
    if w.dtype == x.dtype:
        return F.linear(x, w)
    if x.is_cuda and w.dtype == torch.bfloat16 and (gemv := triton_kernels("half_gemv_triton")) is not None \
            and gemv.applies(x, w, rounded=False):
        return gemv.float_gemv(x, w)
    if w.numel() <= CONVERT_BLOCK:
        return F.linear(x, w.to(x.dtype))
    rows = max(1, CONVERT_BLOCK // w.shape[1])
    return torch.cat([F.linear(x, w[r:r + rows].to(x.dtype)) for r in range(0, w.shape[0], rows)], dim=-1)


def _native_product(x: torch.Tensor, w) -> torch.Tensor | None:
    """x @ w.T by the native gemv for decode-sized float32 CPU rows against an int8 or bf16 weight, else
    None. It reads the stored weight once, widening each element as it reads it (converting a bf16 w
    to fp32 first runs at ~1 GB/s), and skips the general wrappers' per-call checks (~30 us a product,
    ~50 products a token)."""
    dense = native_dense(w)
    if dense is None or x.dim() == 0 or dense[0].shape[1] != x.shape[-1] or x.shape[-1] == 0 \
            or x.numel() // x.shape[-1] > cpu_native.GEMV_MAX_ROWS or not cpu_native.available():
        return None
    y = cpu_native.dense_gemv(x.reshape(-1, x.shape[-1]).contiguous(), *dense)
    return y.view(*x.shape[:-1], dense[0].shape[0])


def linears(x: torch.Tensor, ws: list) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws], the same values; decode-sized float32 rows on the CPU against int8
    or bf16 weights run as one native call for the weights of each kind: of one shape (a KDA layer's
    q, k and v; an MLP's gate and up) or of other output sizes (with them, a KDA layer's beta and
    low-rank projections)."""
    return products([x] * len(ws), ws)


def products(xs: list[torch.Tensor], ws: list) -> list[torch.Tensor]:
    """[linear(x, w) for x, w in zip(xs, ws)], the same values; decode-sized float32 rows on the CPU
    against int8 or bf16 weights of one input width run as one native call for the weights of each
    kind (and int8 group): inputs of one shape against weights of one shape (KDA's two low-rank
    halves, each on its own input), or one input against weights of other output sizes."""
    x = xs[0]
    if len(ws) > 1 and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 \
            and x.numel() // max(1, x.shape[-1]) <= cpu_native.GEMV_MAX_ROWS:
        dense = [native_dense(w) for w in ws]
        if (all(d is not None and d[0].shape[1] == x.shape[-1] for d in dense)
                and all(o.shape == x.shape and o.dtype == x.dtype and o.device == x.device for o in xs)
                and cpu_native.available()):
            kinds = [dense_kind(d) for d in dense]
            out: list = [None] * len(ws)
            for kind in dict.fromkeys(kinds):
                mine = [i for i, k in enumerate(kinds) if k == kind]
                ys = _native_products([xs[i] for i in mine], [dense[i] for i in mine])
                for j, i in enumerate(mine):
                    out[i] = ys[j] if ys is not None else linear(xs[i], ws[i])
            return out
    if len(ws) > 1 and x.is_cuda and all(o is x for o in xs) and (rounded := _rounded_once(x, ws)) is not None:
        return [F.linear(rounded, w.weight).to(x.dtype) for w in ws]
    return [linear(x, w) for x, w in zip(xs, ws)]


def _native_products(xs: list[torch.Tensor], dense: list) -> list[torch.Tensor] | None:
    """``products`` of weights of one native kind in one call, or None where one call cannot take them
    (a single weight, or several inputs against weights of other shapes)."""
    x = xs[0]
    if len(dense) > 1 and len({d[0].shape for d in dense}) == 1:
        rows = [o.reshape(-1, x.shape[-1]).contiguous() for o in xs]
        y = cpu_native.dense_gemv_items(rows, [d[0] for d in dense], [d[1] for d in dense])
        return list(y.view(len(dense), *x.shape[:-1], -1).unbind(0))
    if len(dense) > 1 and all(o is x for o in xs):
        ys = cpu_native.dense_gemv_outs(x.reshape(-1, x.shape[-1]).contiguous(), [d[0] for d in dense],
                                        [d[1] for d in dense])
        return [y.view(*x.shape[:-1], -1) for y in ys]
    return None


def _rounded_once(x: torch.Tensor, ws: list) -> torch.Tensor | None:
    """x rounded to the 16-bit dtype of CUDA products ``ws`` that all take torch's matmul from it
    (``_half_linear``'s path for them), so one rounding serves them all (a KDA layer's q, k and v
    of a prompt piece each rounded the same rows again); else None."""
    if not all(isinstance(w, HalfMatmul) and isinstance(w.weight, torch.Tensor) and w.weight.dtype == w.dtype
               and w.weight.is_cuda for w in ws) or len({w.dtype for w in ws}) != 1:
        return None
    gemv = triton_kernels("half_gemv_triton") if ws[0].dtype == torch.bfloat16 else None
    if gemv is not None and any(gemv.applies(x, w.weight) for w in ws):
        return None
    return x.to(ws[0].dtype)


def _half_linear(x: torch.Tensor, w: HalfMatmul) -> torch.Tensor:
    """x @ W^T with x rounded to w.dtype and the result rounded to it, on the fastest kernel here.

    On the CPU, for a bf16 weight:
    - decode-sized batches (at most GEMV_MAX_ROWS rows) send the rounded row through the float32
      path, the native gemv: bf16 * bf16 products are exact in fp32 and both sum in fp32, so it is
      the same product up to summation order. Torch's 16-bit matmul measured slower there, on an
      AVX2 EPYC (no 16-bit units) and on an AMX Xeon alike (e.g. [9216, 2304]: 2.96 against 1.81 ms);
    - larger batches use torch's 16-bit GEMM where oneDNN runs it on the CPU's own 16-bit
      instructions (AVX512-BF16 / AMX: 64 rows x [9216, 2304] in 6.0 ms against 61 ms), and the
      float32 path on the rounded rows elsewhere (AVX2 EPYC: 812 ms against 1779 ms).
    For float16 the stored bf16 weight is used as stored (converting it to fp16 changes only
    weights below fp16's normal range, ~6e-5, or above 65504). CUDA and MPS use torch's 16-bit
    matmul on their matrix units, except that on CUDA one row times a bf16 weight (a decode step's
    products) runs the same arithmetic in one Triton launch (half_gemv_triton).
    """
    if isinstance(w.weight, torch.Tensor):
        on_cpu = x.device.type == "cpu" and w.weight.device.type == "cpu" and w.weight.dtype == torch.bfloat16
        many_rows = x.numel() // max(1, x.shape[-1]) > cpu_native.GEMV_MAX_ROWS
        if on_cpu and not (many_rows and cpu_16bit_gemm(w.dtype)):
            rounded = x.to(w.dtype).to(torch.float32)
            return linear(rounded, w.weight).to(w.dtype).to(x.dtype)
        if x.is_cuda and w.dtype == torch.bfloat16 and (gemv := triton_kernels("half_gemv_triton")) is not None \
                and gemv.applies(x, w.weight):
            return gemv.half_gemv(x, w.weight)
        return F.linear(x.to(w.dtype), w.weight.to(w.dtype)).to(x.dtype)
    return qlinear(x.to(w.dtype), w.weight).to(x.dtype)


@functools.cache
def triton_kernels(name: str):
    """The Triton module ``deltafin.kernels.<name>`` (half_gemv_triton: the one-launch CUDA product of a
    row with a bf16 weight; row_ops_triton: a decode pass's small per-row steps), or None
    without Triton. Imported on the first CUDA input, so that CPU runs never import Triton."""
    try:
        return importlib.import_module(f"..kernels.{name}", __package__)
    except ImportError:
        return None


@functools.cache
def cpu_16bit_gemm(dtype: torch.dtype) -> bool:
    """True when torch's oneDNN runs `dtype` GEMMs with this CPU's 16-bit instructions."""
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    check = getattr(torch.ops.mkldnn, name, None) if name else None
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with the mean square taken in fp32; the result has x's dtype.

    On CUDA one Triton launch (row_ops_triton) computes the same formula, where torch's fused kernel
    takes four with its dtype casts (a decode step is bound by launches there); decode-sized float32
    rows on the CPU take the native kernel (one call instead of six ops); elsewhere the ops below
    (the reference)."""
    if x.is_cuda:
        if (row_ops := triton_kernels("row_ops_triton")) is not None and row_ops.rms_norm_applies(x, weight):
            return row_ops.rms_norm(x, weight, eps)
        w = weight.float() if weight is not None else None
        return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1]
            and x.numel() // x.shape[-1] <= cpu_native.GEMV_MAX_ROWS and cpu_native.available()
            and (weight is None or (weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
                                    and weight.device.type == "cpu" and tuple(weight.shape) == (x.shape[-1],)))):
        return cpu_native.rms_norm(x.contiguous(), weight, eps)  # a slice (MLA's latent keys): one copy
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the KDA q/k normalization)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: [beta*tanh(g/beta)*sigmoid(g)] * [linear_beta*tanh(u/linear_beta)], in fp32."""
    g, u = gate.float(), up.float()
    # In place on the first temporary of each factor (the same operations in the same order, so the
    # same bits): a prompt pass of small-k3 makes [1024, 512] of these per layer, and each new
    # 2 MB tensor costs page faults.
    act = torch.div(g, beta).tanh_().mul_(beta).mul_(torch.sigmoid(g)) if beta else g * torch.sigmoid(g)
    if linear_beta:
        u = torch.div(u, linear_beta).tanh_().mul_(linear_beta)
    return act.mul_(u).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. Decode-sized float32 rows on the CPU take the native activation, the one the
    native MoE call computes (``cpu_native.moe_silu``), so a layer's experts give the same bits in one
    call or apart."""
    if (gate.dtype == up.dtype == torch.float32 and gate.device.type == "cpu" and up.device == gate.device
            and gate.shape == up.shape and gate.dim() >= 1
            and gate.numel() // max(1, gate.shape[-1]) <= cpu_native.GEMV_MAX_ROWS
            and cpu_native.available()):
        return cpu_native.silu_glu(gate.contiguous(), up.contiguous())
    return F.silu(gate) * up
