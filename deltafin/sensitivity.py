"""How much each spine role's quantization costs in output quality, and what it saves in bytes.

The model is loaded once with its bf16 spine in RAM. For each role, that role's projections
(in every layer) are replaced by ``QWeight``s of the codec the policy gives it — exactly the
tensors a converted store of that policy holds — while every other tensor stays bf16; then the
whole policy at once. Each variant is compared with the bf16 spine over a fixed prompt set
(token ids from a seeded generator; every position counts): mean KL(bf16 || variant) of the
next-token distributions, and the share of positions whose top-1 token is unchanged.

Bytes are per decode token of the spine: every layer and the head are read once per token
(the embedding table contributes one row and is never quantized).

``expert_sensitivity`` does the same for the routed experts (which ``deltafin convert --experts``
can re-encode): every expert of every MoE layer is replaced by the ``QWeight``s the converter
would store, alone and together with the int8 spine. Expert bytes per token are the top-k experts
of every MoE layer; the saving is given against the bytes a whole token reads (spine + experts).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import expert_codec
from .checkpoint.layout import (EXPERT_WEIGHTS, expert_tensors, global_tensors, layer_spine_tensors,
                                nbytes)
from .checkpoint.policy import (PLAIN, PROTECTED, ROLES, ROW_INT8, SpinePolicy, load_policy, tensor_codec,
                                tensor_roles)
from .checkpoint.source import GLOBAL_KEYS
from .kernels.linear import quantize
from .model.layers import sanitize


@dataclass
class RoleRow:
    role: str
    codec: str  # what the role's projections were stored as ("plain": untouched)
    tensors: int  # tensors of the role that were quantized
    plain_bytes: int  # the role's bytes per token as published
    bytes_saved: int  # per token, against the published bytes
    mean_kl: float  # nats, mean over every position of every prompt
    top1: float  # share of positions whose most likely next token is unchanged


def fixed_prompts(vocab_size: int, count: int = 8, length: int = 32, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from the vocabulary by a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()


def kl_and_top1(ref: list[torch.Tensor], test: list[torch.Tensor]) -> tuple[float, float]:
    """Mean KL(ref || test) over all positions (nats) and the top-1 agreement, from logits."""
    kls, agree = [], []
    for a, b in zip(ref, test):
        la, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
        kls.append((la.exp() * (la - lb)).sum(-1))
        agree.append(a.argmax(-1) == b.argmax(-1))
    kl = torch.cat(kls).mean().item()
    return max(kl, 0.0), torch.cat(agree).float().mean().item()  # KL >= 0; clip float rounding


@dataclass(frozen=True)
class _Slot:
    """Where one spine tensor lives in the loaded model: layer (None: globals) and slot name."""
    layer: int | None
    slot: str
    rel: str
    shape: tuple[int, ...]


def _role_slots(cfg) -> dict[str, list[_Slot]]:
    """{role: its tensors' slots} over the globals and every layer."""
    out: dict[str, list[_Slot]] = {}
    for layer in (None, *range(cfg.num_layers)):
        specs = global_tensors(cfg) if layer is None else layer_spine_tensors(cfg, layer)
        for rel, role in tensor_roles(cfg, layer).items():
            # sanitize maps names only; the placeholder tensor is for the few slots it reshapes
            slot = GLOBAL_KEYS[rel] if layer is None else sanitize(cfg, rel, torch.zeros(specs[rel].shape))[0]
            out.setdefault(role, []).append(_Slot(layer, slot, rel, specs[rel].shape))
    return out


def _plain_bytes(cfg, s: _Slot) -> int:
    spec = (global_tensors(cfg) if s.layer is None else layer_spine_tensors(cfg, s.layer))[s.rel]
    n = nbytes(spec)
    return n // cfg.vocab_size if s.rel == "model.embed_tokens.weight" else n


class Sensitivity:
    """A model loaded once (bf16 spine, in RAM), its reference logits, and role swaps on it."""

    def __init__(self, path: str | Path, prompts: int = 8, length: int = 32, seed: int = 0, device: str = "cpu"):
        import deltafin
        self.path = Path(path)
        self.model = deltafin.load(path, stream="off", spine="bf16", device=device)
        self.cfg = self.model.config
        globals_, spines, experts = self.model.engine.provider.held()  # a model in RAM: io.ram.RAMProvider
        self._weights = {None: globals_, **dict(enumerate(spines))}
        self._experts = experts  # per layer {expert id: (w1, w3, w2)}
        self.slots = _role_slots(self.cfg)
        self.prompts = fixed_prompts(self.cfg.vocab_size, prompts, length, seed)
        self.reference = self._logits()

    def _logits(self) -> list[torch.Tensor]:
        return [self.model.logits(ids) for ids in self.prompts]

    def spine_bytes(self) -> int:
        """bf16-spine bytes one decode token reads."""
        return sum(_plain_bytes(self.cfg, s) for slots in self.slots.values() for s in slots)

    def measure(self, role_codecs: dict[str, str], group_size: int) -> tuple[int, int, float, float]:
        """Quantize every role in role_codecs to its codec, run the prompts, restore.
        -> (tensors quantized, bytes saved per token, mean KL, top-1 agreement)."""
        swapped: list = []
        try:
            saved = self._swap_roles(role_codecs, group_size, swapped)
            if not swapped:
                return 0, 0, 0.0, 1.0
            kl, top1 = kl_and_top1(self.reference, self._logits())
            return len(swapped), saved, kl, top1
        finally:
            _restore(swapped)

    def _swap_roles(self, role_codecs: dict[str, str], group_size: int, swapped: list) -> int:
        """Put QWeights in place of the roles' projections (recorded in `swapped` for _restore);
        -> spine bytes saved per token."""
        saved = 0
        for role, codec in role_codecs.items():
            for s in self.slots[role]:
                c, g = tensor_codec(s.rel, s.shape, codec, group_size)
                if c == PLAIN:
                    continue
                weights = self._weights[s.layer]
                w = weights[s.slot]
                q = quantize(w, c, g)
                swapped.append((weights, s.slot, w))
                weights[s.slot] = q
                saved += w.numel() * w.element_size() - q.nbytes
        return saved

    def expert_bytes(self, codec: str = PLAIN) -> int:
        """Routed-expert bytes one decode token reads (top-k per MoE layer) with experts in `codec`."""
        cfg = self.cfg
        codec = expert_codec.stored(cfg, codec)
        return sum(cfg.experts_per_token * sum(nbytes(t) for t in expert_tensors(cfg, i, 0, codec).values())
                   for i in range(cfg.num_layers) if cfg.is_moe(i))

    def measure_experts(self, codec: str, spine: SpinePolicy | None = None) -> tuple[float, float]:
        """Every routed expert re-encoded in `codec` as convert --experts stores it (and the spine
        under `spine`, if given); run the prompts, restore. -> (mean KL, top-1 agreement)."""
        swapped: list = []
        try:
            if spine is not None:
                self._swap_roles({r: spine.role_codec(r) for r in self.slots}, spine.group_size, swapped)
            weight_codec, group = EXPERT_WEIGHTS[expert_codec.stored(self.cfg, codec)]
            for layer in self._experts:
                for e, ws in layer.items():
                    swapped.append((layer, e, ws))
                    layer[e] = tuple(quantize(w, weight_codec, group) for w in ws)
            return kl_and_top1(self.reference, self._logits())
        finally:
            _restore(swapped)


def _restore(swapped: list) -> None:
    """Put back what the swaps replaced, last first: (container, key, original)."""
    for where, key, original in reversed(swapped):
        where[key] = original


def role_codecs_of(policy: SpinePolicy, codec: str | None) -> dict[str, str]:
    """{role: codec} to measure: the policy's, or (a probe) `codec` for every role that is not protected."""
    if codec is None:
        return {r: policy.role_codec(r) for r in ROLES}
    return {r: (PLAIN if r in PROTECTED else codec) for r in ROLES}


SPINE_PROBES = ("int8", ROW_INT8, "int6", "int4")


def sensitivity(path: str | Path, policy: str | SpinePolicy = "moe4", codec: str | None = None, prompts: int = 8,
                length: int = 32, seed: int = 0, device: str = "cpu") -> dict:
    """Per role (and for all roles together) bytes saved per token, mean KL and top-1 vs the bf16 spine.

    codec: instead of the policy's codecs, probe every unprotected role at this codec (int8 | int6 |
    int4), floors included: a measurement, not a storable policy.
    """
    pol = load_policy(policy)
    if codec not in (None, *SPINE_PROBES):
        raise ValueError(f"probe codec must be one of {', '.join(SPINE_PROBES)}, got {codec!r}")
    s = Sensitivity(path, prompts, length, seed, device)
    wanted = role_codecs_of(pol, codec)
    rows = []
    for role in ROLES:
        if role not in s.slots:
            continue  # a role this model does not have (e.g. MLA q_a on a model without q_lora)
        n, saved, kl, top1 = s.measure({role: wanted[role]}, pol.group_size)
        plain = sum(_plain_bytes(s.cfg, x) for x in s.slots[role])
        rows.append(RoleRow(role, wanted[role] if n else PLAIN, n, plain, saved, kl, top1))
    present = {r: c for r, c in wanted.items() if r in s.slots}
    n, saved, kl, top1 = s.measure(present, pol.group_size)
    total = RoleRow("all" if codec is None else f"all at {codec}", "mixed", n, s.spine_bytes(), saved, kl, top1)
    return {
        "model": str(path), "architecture": s.cfg.architecture,
        "policy": pol.to_dict(), "probe_codec": codec, "group_size": pol.group_size,
        "prompts": len(s.prompts), "tokens_per_prompt": length, "positions": len(s.prompts) * length, "seed": seed,
        "bf16_spine_bytes_per_token": s.spine_bytes(),
        "rows": [asdict(r) for r in rows], "total": asdict(total),
    }


EXPERT_PROBES = ("int8", "int8-row", "int4", "mxfp4")  # as --experts names them


@dataclass
class ExpertRow:
    codec: str  # the experts' codec ("int8 + int8 spine": with the int8 spine as well)
    expert_bytes: int  # routed-expert bytes per decode token in that codec
    bytes_saved: int  # per token, against bf16 spine + bf16 experts
    share_saved: float  # bytes_saved / all bytes a token reads with bf16 spine and experts
    mean_kl: float
    top1: float


def expert_sensitivity(path: str | Path, codecs=EXPERT_PROBES, prompts: int = 8, length: int = 32, seed: int = 0,
                       device: str = "cpu", with_spine: str | None = "int8") -> dict:
    """Per expert codec: bytes saved per token, mean KL and top-1 against bf16 spine + bf16 experts;
    with_spine: also each codec together with that spine policy (None: experts alone)."""
    s = Sensitivity(path, prompts, length, seed, device)
    have = expert_codec.of(s.model.source)
    if have != PLAIN or s.cfg.expert_format == "mxfp4":
        raise ValueError(f"{path}: expert sensitivity needs experts stored as published in bf16 (these are "
                         f"{expert_codec.describe(s.cfg, have)})")
    bad = [c for c in codecs if c not in EXPERT_PROBES]
    if bad:
        raise ValueError(f"expert codecs to probe are {', '.join(EXPERT_PROBES)}, not {', '.join(bad)}")
    spine_policy = load_policy(with_spine) if with_spine else None
    base = s.expert_bytes()
    total = s.spine_bytes() + base
    spine_saved = 0
    if spine_policy:  # the spine's saving, counted once (measure_experts swaps it again)
        swapped: list = []
        spine_saved = s._swap_roles({r: spine_policy.role_codec(r) for r in s.slots}, spine_policy.group_size, swapped)
        _restore(swapped)
    rows = []
    for codec in codecs:
        stored = s.expert_bytes(codec)
        kl, top1 = s.measure_experts(codec)
        rows.append(ExpertRow(codec, stored, base - stored, (base - stored) / total, kl, top1))
        if spine_policy:
            kl, top1 = s.measure_experts(codec, spine_policy)
            saved = base - stored + spine_saved
            rows.append(ExpertRow(f"{codec} + {spine_policy.name} spine", stored, saved, saved / total, kl, top1))
    return {
        "model": str(path), "architecture": s.cfg.architecture, "experts_per_token": s.cfg.experts_per_token,
        "prompts": len(s.prompts), "tokens_per_prompt": length, "positions": len(s.prompts) * length, "seed": seed,
        "bf16_spine_bytes_per_token": s.spine_bytes(), "bf16_expert_bytes_per_token": base,
        "rows": [asdict(r) for r in rows],
    }


def format_expert_table(result: dict) -> str:
    lines = [f"{result['model']} ({result['architecture']}): routed experts re-encoded, against bf16 spine + bf16 "
             f"experts; {result['prompts']} prompts x {result['tokens_per_prompt']} tokens, seed {result['seed']}; "
             f"per token bf16 spine {_size(result['bf16_spine_bytes_per_token'])}, bf16 experts "
             f"{_size(result['bf16_expert_bytes_per_token'])} (top-{result['experts_per_token']} per MoE layer)",
             f"{'experts':<22} {'experts/token':>13} {'saved/token':>12} {'saved':>6} {'mean KL':>9} {'top-1':>6}"]
    for r in result["rows"]:
        lines.append(f"{r['codec']:<22} {_size(r['expert_bytes']):>13} {_size(r['bytes_saved']):>12} "
                     f"{r['share_saved']:>6.1%} {r['mean_kl']:>9.5f} {r['top1']:>6.3f}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f} {unit}"
    return f"{n} B"


def format_table(result: dict) -> str:
    what = f"probe {result['probe_codec']}" if result["probe_codec"] else f"policy {result['policy']['name']}"
    lines = [f"{result['model']} ({result['architecture']}): {what}, group {result['group_size']}; "
             f"{result['prompts']} prompts x {result['tokens_per_prompt']} tokens, seed {result['seed']}; "
             f"bf16 spine {_size(result['bf16_spine_bytes_per_token'])} per token",
             f"{'role':<16} {'codec':<6} {'tensors':>7} {'bf16/token':>12} {'saved/token':>12} {'mean KL':>9} "
             f"{'top-1':>6}"]
    for r in [*result["rows"], result["total"]]:
        lines.append(f"{r['role']:<16} {r['codec']:<6} {r['tensors']:>7} {_size(r['plain_bytes']):>12} "
                     f"{_size(r['bytes_saved']):>12} {r['mean_kl']:>9.5f} {r['top1']:>6.3f}")
    return "\n".join(lines)


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2)


def bytes_report(cfg, policies: list[str | SpinePolicy]) -> dict:
    """Spine bytes per decode token under each policy, from the layout alone (no weights needed):
    {"bf16": total, name: total, ..., "roles": {role: {"bf16": bytes, name: bytes, ...}}}."""
    from .checkpoint.policy import role_bytes
    out: dict = {"bf16": 0, "roles": {}}
    for role, b in role_bytes(cfg).items():
        out["roles"][role] = {"bf16": b["plain"]}
        out["bf16"] += b["plain"]
    for p in map(load_policy, policies):
        out[p.name] = 0
        for role, b in role_bytes(cfg, p).items():
            out["roles"][role][p.name] = b["stored"]
            out[p.name] += b["stored"]
    return out


def format_bytes_report(report: dict, title: str) -> str:
    names = [k for k in report if k != "roles"]
    lines = [title, f"{'role':<16}" + "".join(f"{n:>14}" for n in names)]
    for role, b in report["roles"].items():
        lines.append(f"{role:<16}" + "".join(f"{_size(b[n]):>14}" for n in names))
    lines.append(f"{'total':<16}" + "".join(f"{_size(report[n]):>14}" for n in names))
    return "\n".join(lines)
