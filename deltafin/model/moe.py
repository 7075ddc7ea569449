"""Dense MLP and (Latent)MoE with a sigmoid router (K3_MODEL.md section 3.3)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from ..kernels import cpu_native, experts_cpu
from ..kernels.grouped import Stacked, grouped_mlp
from .binding import Bindable
from .ops import linear, linears, rms_norm, silu_glu, situ_glu


def glu(cfg, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_glu(gate, up)


def mlp(cfg, x, w_gate, w_up, w_down) -> torch.Tensor:
    return linear(glu(cfg, *linears(x, [w_gate, w_up])), w_down)


class DenseMLP(Bindable):
    def __init__(self, cfg, intermediate: int):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.slots(gate_proj=(intermediate, H), up_proj=(intermediate, H), down_proj=(H, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp(self.cfg, x, self.gate_proj, self.up_proj, self.down_proj)

    def block(self, p: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor | None:
        """p + forward(rms_norm(p) * norm) in one native call (cpu_native.mlp_block_silu: the norm, the
        gate and up products, the SiLU-GLU, the down product, the sum) for decode-sized float32 rows on the
        CPU with a SiLU-GLU whose weights the native products read (int8 or bf16, one kind); else None.
        The same bits as the separate calls."""
        if not (p.dtype == torch.float32 and p.device.type == "cpu" and p.dim() == 2
                and p.shape[0] <= cpu_native.GEMV_MAX_ROWS and self.cfg.hidden_act != "situ"
                and isinstance(norm, torch.Tensor) and cpu_native.available()):
            return None
        checked = experts_cpu.moe_expert_of((self.gate_proj, self.up_proj, self.down_proj))
        if checked is None:
            return None
        return cpu_native.mlp_block_silu(p.contiguous(), norm.contiguous(), eps, checked)


def route(cfg, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [T, k] and their weights [T, k] (fp32) for rows x [T, H]. Decode-sized float32
    rows on the CPU with a sigmoid router and no expert groups take one native call
    (cpu_native.route_sigmoid, the same formula up to float32 rounding)."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= cpu_native.GEMV_MAX_ROWS
            and cfg.router_activation == "sigmoid" and cfg.num_expert_group <= cfg.topk_group
            and gate_w.device.type == "cpu" and gate_w.dtype in (torch.float32, torch.bfloat16)
            and cpu_native.available()):
        return cpu_native.route_sigmoid(x.contiguous(), gate_w.contiguous(), bias.float().contiguous(),
                                        cfg.experts_per_token, cfg.renormalize, cfg.routed_scaling_factor)
    logits = torch.nn.functional.linear(x.float(), gate_w.float())
    scores = torch.sigmoid(logits) if cfg.router_activation == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias.float()  # the correction bias steers selection only
    G = cfg.num_expert_group
    if G > cfg.topk_group:
        T, E = choice.shape
        grouped = choice.view(T, G, E // G)
        group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(cfg.experts_per_token, dim=-1).indices
    w = scores.gather(1, ids)
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


# fetch(ids [T, k], x [T, H] (the router's input), residual [T, H] (the stream it came from)) -> a handle
# whose .result() is {expert_id: (w1, w3, w2)} for the
# chosen experts, or an ExpertStack of all of them (every expert resident on the device); the handle
# lets the caller compute the shared expert while the routed experts are being read. The engine's fetch
# (runtime.engine.LayerExperts) may also offer every expert at once (``held()``, then ``count(ids)``).
ExpertFetch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "object"]


def chosen_experts(ids) -> list[int]:
    """The distinct expert ids of a routing result (a tensor, read back to the host) or a list, sorted."""
    return sorted(set(ids.flatten().tolist() if isinstance(ids, torch.Tensor) else ids))


class ExpertRows:
    """Each chosen expert's rows and top-k slots of a pass routed on a device, found once on the host
    from the routing read back (the provider read it back to choose what to fetch): the experts'
    products are then queued without a read-back each. One per expert (``nonzero`` on device ids)
    waited, from the first expert on, for every copy of the layer's experts, so the host queued the
    next layer only once they had all crossed and the copy stream stood idle meanwhile."""

    def __init__(self, ids: torch.Tensor):
        self.host_ids = ids.cpu()
        flat = self.host_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, rows in order within each
        chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
        k = ids.shape[1]
        starts = counts.cumsum(0) - counts
        self._where = {e: (s, s + n) for e, s, n in zip(chosen.tolist(), starts.tolist(), counts.tolist())}
        self._rows_slots = torch.stack([order // k, order % k]).to(ids.device)

    def chosen(self) -> list[int]:
        """The chosen experts, sorted."""
        return sorted(self._where)

    def of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of expert e, on the device."""
        a, b = self._where.get(e, (0, 0))
        return self._rows_slots[0, a:b], self._rows_slots[1, a:b]


def _grouped(pending, pairs: int) -> bool:
    """Whether the fetch gave every expert stacked and in place (nothing to wait for or copy) and the
    grouped kernels take the pass's `pairs` (token, expert) pairs."""
    return (isinstance(pending, Future) and pending.done() and isinstance(pending.result(), Stacked)
            and pending.result().applies(pairs))


def _device(w) -> torch.device:
    """Where an expert's weights (w1, w3, w2: tensors or stored QWeights) lie."""
    first = w[0]
    return first.device if isinstance(first, torch.Tensor) else next(iter(first.tensors.values())).device


class MoE(Bindable):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, E = cfg.hidden_size, cfg.num_experts
        self.slots(gate=(E, H), e_score_correction_bias=(E,))
        if cfg.num_shared_experts:
            Is = cfg.moe_intermediate_size * cfg.num_shared_experts
            self.slots(shared_gate_proj=(Is, H), shared_up_proj=(Is, H), shared_down_proj=(H, Is))
        if cfg.latent_size:
            L = cfg.latent_size
            self.slots(routed_expert_down_proj=(L, H), routed_expert_up_proj=(H, L))
            if cfg.latent_norm:
                self.slots(routed_expert_norm=(L,))

    def block(self, p: torch.Tensor, norm: torch.Tensor, eps: float, fetch: ExpertFetch) -> torch.Tensor | None:
        """p + forward(rms_norm(p) * norm) in one native call (cpu_native.moe_block_silu: the norm, the
        router, the chosen and the shared experts, the sums) where the fetch holds every expert of the
        layer in memory (a resident model on the CPU, no observer of the routing), the layer is Kimi
        Linear's kind (sigmoid router without expert groups, SiLU-GLU experts read by the native products,
        no latent projection) and p is decode-sized float32 rows; else None. The same bits as the
        separate calls: what goes is the time between them."""
        c = self.cfg
        held = getattr(fetch, "held", None)
        if not (p.dtype == torch.float32 and p.device.type == "cpu" and p.dim() == 2
                and p.shape[0] <= cpu_native.GEMV_MAX_ROWS and held is not None and not c.latent_size
                and c.hidden_act != "situ" and c.router_activation == "sigmoid"
                and c.num_expert_group <= c.topk_group and cpu_native.available()):
            return None
        experts = held()
        table = experts_cpu.held_table(experts) if experts else None
        shared = (experts_cpu.moe_expert_of((self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj))
                  if c.num_shared_experts else None)
        if table is None or (c.num_shared_experts and not (shared and cpu_native.shared_fits(shared, table.signature))) \
                or not all(isinstance(t, torch.Tensor) for t in (self.gate, norm)):
            return None  # the layer's other paths decide (and say why)
        out, ids = cpu_native.moe_block_silu(p.contiguous(), norm.contiguous(), eps, self.gate.contiguous(),
                                             self.e_score_correction_bias.float().contiguous(), c.experts_per_token,
                                             c.renormalize, c.routed_scaling_factor, table, shared)
        fetch.count(ids)
        return out

    def forward(self, x: torch.Tensor, fetch: ExpertFetch, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: the router's input (normalized); residual: the residual stream it came from (a
        provider may guess the next layer's experts from it; None: x stands for it)."""
        c = self.cfg
        ids, weights = route(c, x, self.gate, self.e_score_correction_bias)
        pending = fetch(ids, x, x if residual is None else residual)  # reads start now ...
        # On a device every pass but one the grouped kernels take finds its experts' rows on the host now
        rows = ExpertRows(ids) if ids.device.type != "cpu" and not _grouped(pending, ids.numel()) else None
        both = self._routed_and_shared(x, ids, weights, pending)
        if both is not None:
            return both[0].to(x.dtype) + both[1]
        shared = (mlp(c, x, self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj)
                  if c.num_shared_experts else 0.0)  # ... while the shared expert computes
        z = linear(x, self.routed_expert_down_proj) if c.latent_size else x
        experts = pending.result()
        if isinstance(experts, Stacked) and experts.applies(ids.numel()):
            y = grouped_mlp(c, z, ids, weights, experts, lambda g, u: glu(c, g, u))
        else:
            y = self._per_expert(z, ids, weights, experts, rows)
        y = y.to(x.dtype)
        if c.latent_size:
            if c.latent_norm:
                y = rms_norm(y, self.routed_expert_norm, c.rms_norm_eps)
            y = linear(y, self.routed_expert_up_proj)
        return y + shared

    def _routed_and_shared(self, x, ids, weights, pending) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed sum and the shared expert's output in the same two native calls, when the routed
        experts are already in memory (a resident model: nothing to overlap the shared expert with),
        the routed experts read x itself (no latent projection) and the native CPU path takes them
        all; else None (the layer computes them apart)."""
        c = self.cfg
        if not (c.num_shared_experts and not c.latent_size and isinstance(pending, Future) and pending.done()):
            return None
        experts = pending.result()
        if not experts_cpu.applies(x, experts):
            return None
        return experts_cpu.routed_and_shared(lambda g, u: glu(c, g, u), x, ids, weights, experts,
                                             (self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj),
                                             silu=c.hidden_act != "situ")

    def _per_expert(self, z, ids, weights, experts, rows: ExpertRows | None) -> torch.Tensor:
        c = self.cfg
        if experts_cpu.applies(z, experts):
            y = experts_cpu.routed(lambda g, u: glu(c, g, u), z, ids, weights, experts, silu=c.hidden_act != "situ")
            if y is not None:
                return y
        host = {} if isinstance(experts, Stacked) else {e: w for e, w in experts.items() if _device(w) != z.device}
        if host:
            return self._split(z, ids, weights, experts, host, rows)
        y = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        stacked = isinstance(experts, Stacked)
        for e in (rows.chosen() if rows is not None else chosen_experts(ids)) if stacked else sorted(experts):
            self._add(y, z, *(rows.of(e) if rows is not None else (ids == e).nonzero(as_tuple=True)),
                      weights, experts[e])
        return y

    def _add(self, y, z, rows, slot, weights, w) -> None:
        """y[rows] += the expert's output for z[rows], times its routing weight (slot: its place in the top-k)."""
        w1, w3, w2 = w
        out = mlp(self.cfg, z[rows], w1, w3, w2)
        # each token picks an expert at most once, so `rows` has no repeats
        y[rows] += out.float() * weights[rows, slot].unsqueeze(-1)

    def _split(self, z, ids, weights, experts, host: dict, rows: ExpertRows) -> torch.Tensor:
        """The routed sum with the experts in `host` computed where their weights lie (host memory, see
        io.device ``cpu_experts``): the rows go down, the host's sum comes back and is added; the
        device's experts are queued first, so the device computes them while the host computes."""
        c = self.cfg
        z_h = z.to("cpu", torch.float32)  # waits for z; the routing was read back already
        ids_h, weights_h = rows.host_ids, weights.to("cpu", torch.float32)
        y = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        for e in sorted(experts):
            if e not in host:
                self._add(y, z, *rows.of(e), weights, experts[e])
        mask = torch.isin(ids_h, torch.tensor(sorted(host)))
        t, k = mask.nonzero(as_tuple=True)
        pair_ids, pair_w = ids_h[t, k].unsqueeze(1), weights_h[t, k].unsqueeze(1)
        glu_ = lambda g, u: glu(c, g, u)  # noqa: E731
        out = experts_cpu.routed(glu_, z_h[t], pair_ids, pair_w, host) if experts_cpu.applies(z_h, host) else None
        if out is None:
            out = torch.zeros(len(t), z.shape[1], dtype=torch.float32)
            for e in sorted(host):
                self._add(out, z_h[t], *(pair_ids == e).nonzero(as_tuple=True), pair_w, host[e])
        y_h = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32).index_add_(0, t, out)
        return y + y_h.to(z.device, non_blocking=True)
