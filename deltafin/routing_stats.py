"""What a model's routers choose on a decode, and how predictable it is.

``trace_routing`` runs a prompt and a greedy decode through a model and records, for every MoE
layer and every token, the experts the router chose and the router's input. From a trace:

- ``skew_stats``: how skewed expert popularity is (share of routings that hit the top 10% of a
  layer's experts; the exponent of a Zipf fit to the popularity by rank) and how local routing
  is in time (share of a token's experts that the previous token chose too);
- ``predictor_recall``: how well a layer's experts can be known before its router runs, from the
  previous token's choice at the same layer (``prev``), or from that layer's router applied to
  the input of the previous layer's router (``early``): recall@k, the share of the experts
  actually chosen that are among the predictor's k best guesses.

These are measurements for judging caches and prefetch (and synthetic ``--routing-skew``
checkpoints against trained ones); nothing on the decode path uses this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .runtime.pass_stats import PassObserver


@dataclass
class RoutingTrace:
    num_experts: int
    k: int
    activation: str  # the router's score function: "sigmoid" | "softmax"
    ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [tokens, k] chosen experts
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [tokens, H] router input
    routers: dict[int, tuple] = field(default_factory=dict)  # layer -> (gate, bias, post-attention norm)


def trace_routing(model, prompt: list[int], new_tokens: int) -> RoutingTrace:
    """Prefill `prompt` and decode `new_tokens` greedily, recording every MoE layer's routing.

    An engine observer watches the call's passes only (the model computes exactly as it would
    without the trace)."""
    cfg = model.config
    trace = RoutingTrace(cfg.num_experts, cfg.experts_per_token, cfg.router_activation)
    rows: dict[int, list] = {}
    xs: dict[int, list] = {}

    class Tracer(PassObserver):
        def on_route(self, layer, ids, x):
            rows.setdefault(layer, []).append(ids.detach().cpu().clone())
            xs.setdefault(layer, []).append(x.detach().float().cpu().clone())
            if layer not in trace.routers:
                w = model.layer_weights(layer)
                trace.routers[layer] = tuple(w[k].float().cpu().clone() for k in
                                             ("mlp.gate", "mlp.e_score_correction_bias", "post_attention_layernorm"))

    with model.observe(Tracer()):
        model.generate(prompt, max_new_tokens=new_tokens, speculate=False)  # drafts would add rejected rows
    trace.ids = {i: torch.cat(r) for i, r in sorted(rows.items())}
    trace.inputs = {i: torch.cat(x) for i, x in sorted(xs.items())}
    return trace


def skew_stats(trace: RoutingTrace) -> dict:
    """Popularity skew and time locality, per layer and averaged over the MoE layers."""
    E, k = trace.num_experts, trace.k
    top = max(1, math.ceil(0.1 * E))
    per_layer = {}
    for i, ids in trace.ids.items():
        counts = torch.bincount(ids.flatten(), minlength=E).double()
        ranked = counts.sort(descending=True).values
        repeat = _overlap(ids[1:], ids[:-1]) if ids.shape[0] > 1 else float("nan")
        share = counts / ids.shape[0]  # of tokens choosing each expert
        per_layer[i] = {"top10_share": float(ranked[:top].sum() / ranked.sum()),
                        "zipf_exponent": _zipf_fit(ranked), "repeat_rate": repeat,
                        # what the repeat rate would be with this popularity but no memory of the
                        # previous token: the excess over it is locality in time
                        "independent_repeat_rate": float((share * share).sum() / k)}
    mean = {key: sum(v[key] for v in per_layer.values()) / len(per_layer) for key in next(iter(per_layer.values()))}
    return {"experts": E, "top_k": k, "tokens": int(next(iter(trace.ids.values())).shape[0]),
            "uniform_top10_share": top / E, "uniform_repeat_rate": k / E, **mean, "layers": per_layer}


def predictor_recall(trace: RoutingTrace, guesses: int | None = None) -> dict:
    """recall@guesses (default: top-k) of the `prev` and `early` predictors, per layer and mean."""
    g = guesses or trace.k
    layers = sorted(trace.ids)
    out = {"guesses": g, "prev": {}, "early": {}}
    for i in layers:
        ids = trace.ids[i]
        out["prev"][i] = _overlap(ids[1:], ids[:-1][:, :g]) if g <= trace.k else float("nan")
        if i - 1 in trace.inputs:
            gate_w, bias, norm = trace.routers[i]
            _, _, prev_norm = trace.routers[i - 1]
            # the previous layer's router input, re-normalized with this layer's norm weight
            x = trace.inputs[i - 1] / prev_norm
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
            logits = x @ gate_w.T
            scores = (torch.sigmoid(logits) if trace.activation == "sigmoid" else torch.softmax(logits, -1)) + bias
            out["early"][i] = _overlap(ids, scores.topk(g, dim=-1).indices)
    for name in ("prev", "early"):
        vals = [v for v in out[name].values() if not math.isnan(v)]
        out[name]["mean"] = sum(vals) / len(vals) if vals else float("nan")
    return out


def _overlap(actual: torch.Tensor, guess: torch.Tensor) -> float:
    """Mean over rows of |actual ∩ guess| / |actual|."""
    hit = (actual.unsqueeze(-1) == guess.unsqueeze(-2)).any(-1)
    return float(hit.float().mean())


def _zipf_fit(ranked_counts: torch.Tensor) -> float:
    """Least-squares slope of log(count) against log(rank), negated (0 = uniform)."""
    used = ranked_counts[ranked_counts > 0]
    if used.numel() < 2:
        return float("nan")
    x = torch.arange(1, used.numel() + 1, dtype=torch.float64).log()
    y = used.log()
    x, y = x - x.mean(), y - y.mean()
    return float(-(x * y).sum() / (x * x).sum())
