"""Which codec a store's routed experts are kept in, and which re-encodings make sense.

Routed experts are most of a MoE model's bytes and, per decode token, most of what is read:
on a Kimi Linear checkpoint they are published in bf16, on K3 in MXFP4. ``deltafin convert
--experts`` can store them otherwise:

| --experts | stored as                                            | bytes per weight   |
|-----------|------------------------------------------------------|--------------------|
| keep      | as published (the default)                           | bf16 2, MXFP4 0.53 |
| bf16      | as published, said explicitly (bf16 checkpoints only)| 2                  |
| int8      | int8, fp16 scale per 128 inputs (kernels/int8; store | 1.016              |
|           | codec "int8g128"; older stores: "int8g", per 32, and | (32: 1.0625,       |
|           | "int8", fp32 per row); `--int8-group 32 / 64`: per   | 64: 1.031)         |
|           | 32 / 64 (int8g / int8g64)                            |                    |
| int8-row  | int8, fp32 scale per output row (store codec "int8") | ~1.0               |
| int4      | int4, fp16 scale per 32 inputs (kernels/intq)        | ~0.56              |
| mxfp4     | MXFP4, E8M0 scale per 32 inputs (kernels/mxfp4)      | ~0.53              |

Why 128 for experts, where the int8 spine keeps 32: the experts' groups buy no measurable error over
128 (a routed expert's error is one of k summed, and the router's choice, not the expert's rounding,
moves the logits), while the spine's do; and the experts are most of the bytes a machine whose RAM
holds less than the model reads from disk (docs/benchmarks.md, "Grouped int8").

Experts already in MXFP4 are kept as they are: decoding them to bf16 or int8 would only add
bytes (the values hold no more precision than MXFP4 gives), and int4 would round again what was
rounded once. Asking for that is refused with the reason.

The manifest records the codec once for all experts and once per MoE layer (the two must agree);
``layout.expert_tensors`` gives the tensors each codec stores, which the reader checks the
manifest against before any expert is read.
"""
from __future__ import annotations

from ..config import ModelConfig
from .layout import EXPERT_INT8_CODECS, EXPERT_WEIGHTS
from .policy import PolicyError

PLAIN = "plain"
CHOICES = ("keep", "bf16", "int8", "int8-row", "int4", "mxfp4")  # what --experts accepts
LOSSLESS = (PLAIN,)  # codecs that give the published weights back exactly


def published(cfg: ModelConfig) -> str:
    """The store name of the codec the checkpoint publishes its experts in."""
    return "mxfp4" if cfg.expert_format == "mxfp4" else PLAIN


def of(source) -> str:
    """The store codec of a weight source's experts (a Hugging Face folder or hub repository: as published)."""
    return getattr(source, "expert_codec", None) or published(source.config)


def describe(cfg: ModelConfig, codec: str) -> str:
    """A codec as people say it: "bf16" / "MXFP4" for the published experts, else the codec's name
    (grouped int8 of another group than the default with its group: "int8 (group 32)")."""
    if codec == PLAIN:
        return "MXFP4" if cfg.expert_format == "mxfp4" else "bf16"
    if codec in EXPERT_INT8_CODECS.values() and EXPERT_WEIGHTS[codec][1] != default_int8_group(cfg):
        return f"int8 (group {EXPERT_WEIGHTS[codec][1]})"
    return "MXFP4" if codec == "mxfp4" else asked_for(codec)


# --experts names whose store codec is named otherwise: int8 is grouped int8 (a float16 scale per
# DEFAULT_INT8_GROUP inputs, or per --int8-group inputs); int8-row is the per-row int8 older stores hold
# (store codec int8).
_STORED = {"bf16": PLAIN, "int8-row": "int8"}
INT8_GROUPS = tuple(EXPERT_INT8_CODECS)  # what --int8-group accepts
DEFAULT_INT8_GROUP = 128  # --experts int8 without --int8-group (the largest of INT8_GROUPS dividing the widths)


def default_int8_group(cfg: ModelConfig) -> int:
    """The group ``--experts int8`` takes without ``--int8-group``: DEFAULT_INT8_GROUP, or the largest
    smaller one dividing both expert widths (a model too narrow for 128)."""
    widths = (cfg.expert_width, cfg.moe_intermediate_size)
    return next((g for g in sorted(INT8_GROUPS, reverse=True) if g <= DEFAULT_INT8_GROUP
                 and not any(w % g for w in widths)), DEFAULT_INT8_GROUP)


def stored(cfg: ModelConfig, asked: str, int8_group: int | None = None) -> str:
    """The store codec ``--experts asked`` writes for `cfg` (``int8_group``: the inputs per scale of int8;
    None: ``default_int8_group``)."""
    if asked == "int8":
        return int8_codec(default_int8_group(cfg) if int8_group is None else int8_group)
    return _STORED.get(asked, asked)


def int8_codec(group: int) -> str:
    """The store codec of grouped int8 experts with `group` inputs per scale."""
    if group not in EXPERT_INT8_CODECS:
        raise PolicyError(f"--int8-group takes one of {', '.join(map(str, INT8_GROUPS))} (inputs per float16 scale), "
                          f"not {group!r}")
    return EXPERT_INT8_CODECS[group]


def asked_for(codec: str) -> str:
    """The ``--experts`` name that writes store codec `codec`."""
    if codec in EXPERT_INT8_CODECS.values():
        return "int8"
    return next((a for a, c in _STORED.items() if c == codec), codec)


def asked_flags(cfg: ModelConfig, codec: str) -> str:
    """The convert flags that write store codec `codec` ("--experts int8 --int8-group 32")."""
    default = default_int8_group(cfg)
    group = EXPERT_WEIGHTS[codec][1] if codec in EXPERT_INT8_CODECS.values() else default
    return f"--experts {asked_for(codec)}" + (f" --int8-group {group}" if group != default else "")


def resolve(cfg: ModelConfig, asked: str | None, int8_group: int | None = None) -> str:
    """The store codec of the experts for ``--experts asked`` (None or "keep": as published;
    int8_group None: ``default_int8_group``).

    Refuses, with the reason, a re-encoding that cannot help: anything but keeping MXFP4 experts,
    and a codec whose groups do not divide the expert widths."""
    have = published(cfg)
    if asked is None or asked == "keep":
        return have
    if asked not in CHOICES:
        raise PolicyError(f"unknown expert codec {asked!r}; --experts takes one of {', '.join(CHOICES)}")
    want = stored(cfg, asked, int8_group)
    if have == "mxfp4":
        if want == "mxfp4":
            return have
        why = ("would only add bytes: the MXFP4 values hold no more precision than MXFP4 gives"
               if want in (PLAIN, "int8", *EXPERT_INT8_CODECS.values())
               else "would round again what was already rounded once, for no fewer bytes")
        raise PolicyError(f"this checkpoint publishes its routed experts in MXFP4 (~0.53 bytes per weight); storing "
                          f"them as {asked} {why}. Leave --experts out (or say --experts keep) to keep them as "
                          "they are")
    group = EXPERT_WEIGHTS.get(want, (None, 0))[1]
    widths = (cfg.expert_width, cfg.moe_intermediate_size)
    if group and any(w % group for w in widths):
        raise PolicyError(f"--experts {asked} needs expert widths divisible by {group}; this model's are "
                          f"{widths[0]} (input of gate/up) and {widths[1]} (input of down)")
    return want
