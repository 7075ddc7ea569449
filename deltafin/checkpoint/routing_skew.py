"""Skewed expert popularity for synthetic checkpoints, carried by the weights themselves.

A trained MoE does not use its experts evenly: in every layer a few experts take a large share of
the routings. Caches and prefetchers have to be judged on routing like that, and random weights
route uniformly (the worst case), so ``make-checkpoint --routing-skew S`` builds the skew into the
weights, in the published format and nothing beside it.

The mechanism is the router's score-correction bias (``e_score_correction_bias``). In the
checkpoints' top-k routing it is added to the expert scores only to choose experts, never to weigh
them: it is exactly what trained models use to steer expert load (there: towards balance). Here
it is calibrated so that the expert of popularity rank r is chosen by a share of tokens
proportional to r^-S (Zipf with exponent S), capped at every token when the top ranks would need
more; each MoE layer ranks its experts in its own random order. The calibration runs the router's
selection on logits distributed as the synthetic router produces them (``ROUTER_GAIN``: N(0, 1)
for a unit-rms input) and nudges the bias towards the target shares, the update of loss-free load
balancing with the target swapped.

S = 0 sets the bias to zero: every expert has the same share, the worst case for a cache. Without
a routing skew a checkpoint keeps its plain random bias (N(0, 0.1^2), CORRECTION_BIAS_STD), which
is not uniform: half the spread of the router's scores, it alone makes a mild, unplanned skew.
"""
from __future__ import annotations

import functools
import math

import torch

MAX_ROUTING_SKEW = 4.0  # beyond this almost every token picks the same top-k: no longer Zipf-like
CALIBRATION_STEPS = 100
CALIBRATION_SEED = 20_000_117  # fixed: the calibrated bias depends only on (experts, top-k, S, activation)


def check_routing_skew(value) -> float | None:
    """The routing skew as a float in [0, MAX_ROUTING_SKEW] (None: not asked for), or a ValueError
    that says why not."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"routing skew must be a number, got {value!r}")
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"routing skew must be a number, got {value!r}") from None
    if not math.isfinite(s) or not 0.0 <= s <= MAX_ROUTING_SKEW:
        raise ValueError(f"routing skew must be between 0 (uniform) and {MAX_ROUTING_SKEW:g}, got {value!r}")
    return s


def target_shares(num_experts: int, k: int, skew: float) -> torch.Tensor:
    """Share of tokens choosing the expert of each popularity rank: c * r^-skew capped at 1, with c
    such that the shares sum to k (each token chooses k distinct experts)."""
    rank_w = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-skew)
    lo, hi = 0.0, float(k) / float(rank_w[-1])  # at hi every share is capped: the sum is num_experts >= k
    for _ in range(100):
        c = (lo + hi) / 2
        if (c * rank_w).clamp(max=1.0).sum() < k:
            lo = c
        else:
            hi = c
    return (hi * rank_w).clamp(max=1.0).float()


def calibration_tokens(num_experts: int, k: int) -> int:
    """Simulated router inputs: enough that an expert of share k / (8 * num_experts) is chosen ~20 times."""
    return max(2048, min(16384, 160 * num_experts // k))


@functools.lru_cache(maxsize=8)
def calibrated_bias(num_experts: int, k: int, skew: float, activation: str) -> torch.Tensor:
    """Correction bias by popularity rank (rank 1 first) that gives ``target_shares`` under the
    router's selection (top-k of activation(logits) + bias) on N(0, 1) logits."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    tokens = calibration_tokens(num_experts, k)
    logits = torch.randn(tokens, num_experts, generator=gen)
    scores = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=-1)
    target = target_shares(num_experts, k, skew)
    spread = float(scores.std())
    bias = spread * 4.0 * (target.log() - target.log().mean())  # a start with the right ordering
    for step in range(CALIBRATION_STEPS):
        chosen = (scores + bias).topk(k, dim=-1).indices
        share = torch.bincount(chosen.flatten(), minlength=num_experts).float() / tokens
        rate = spread * (0.5 if step < CALIBRATION_STEPS // 2 else 0.1)
        # log-ratio steps: rare experts need the same relative correction as popular ones
        bias += rate * ((target + 1e-4).log() - (share + 1e-4).log()).clamp(-1.0, 1.0)
    return bias - bias.mean()


def skewed_correction_bias(cfg, skew: float, gen: torch.Generator) -> torch.Tensor:
    """One MoE layer's e_score_correction_bias: the calibrated bias, ranks in a random order drawn
    from `gen` (the tensor's own seeded generator, so every layer has its own order)."""
    if cfg.num_expert_group > cfg.topk_group:
        raise ValueError("routing skew is not implemented for grouped top-k routing "
                         f"(num_expert_group {cfg.num_expert_group} > topk_group {cfg.topk_group})")
    E = cfg.num_experts
    if skew == 0:
        return torch.zeros(E)
    by_rank = calibrated_bias(E, cfg.experts_per_token, skew, cfg.router_activation)
    order = torch.randperm(E, generator=gen)  # order[r] = the expert with popularity rank r + 1
    bias = torch.empty(E)
    bias[order] = by_rank
    return bias
