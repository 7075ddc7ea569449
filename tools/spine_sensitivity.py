#!/usr/bin/env python3
"""Per spine role: bytes saved per token, and mean logit KL / top-1 agreement against the bf16 spine.

    spine_sensitivity.py MODEL [--policy NAME|FILE] [--codec int8|int6|int4] [--prompts N] [--length T] [--json]
    spine_sensitivity.py MODEL --bytes-only [--set KEY=VALUE ...]
    spine_sensitivity.py MODEL --experts [int8,int4,mxfp4] [--prompts N] [--length T] [--json]

MODEL is a Hugging Face folder or a store with a bf16 spine. --codec probes every unprotected role
at one codec instead of the policy's codecs. --bytes-only prints spine bytes per token for bf16 and
every named policy from the config alone (no weights read); there MODEL may also be preset:NAME
(a synthetic preset's config, e.g. preset:k3-slice, with --set overrides). --experts measures the
routed experts instead (a model whose experts are published in bf16): each listed codec, alone and
with the int8 spine, against bf16 spine + bf16 experts.
"""
import argparse
import json
import sys
from pathlib import Path

from deltafin.checkpoint.policy import NAMED
from deltafin.sensitivity import (EXPERT_PROBES, SPINE_PROBES, bytes_report, expert_sensitivity, format_bytes_report,
                                  format_expert_table, format_table, sensitivity, to_json)


def model_config(model: str, overrides: list[str]):
    from deltafin.config import parse_config
    if model.startswith("preset:"):
        from deltafin.checkpoint.synthetic import config_dict, parse_override
        return parse_config(config_dict(model[len("preset:"):], dict(map(parse_override, overrides))))
    from deltafin.io.sources import open_source
    source = open_source(model)
    try:
        return source.config
    finally:
        source.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--policy", default="moe4", help=f"named policy ({', '.join(NAMED)}) or JSON file")
    p.add_argument("--codec", choices=SPINE_PROBES, default=None,
                   help="probe every unprotected role at this codec instead of the policy's (int8-row: int8 "
                        "with one scale per output row, as stores before grouped int8)")
    p.add_argument("--prompts", type=int, default=8, help="prompts of seeded random token ids")
    p.add_argument("--length", type=int, default=32, help="tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--experts", nargs="?", const=",".join(EXPERT_PROBES), default=None, metavar="CODECS",
                   help=f"measure the routed experts re-encoded in these codecs (comma-separated; default "
                        f"{','.join(EXPERT_PROBES)}) instead of the spine roles")
    p.add_argument("--bytes-only", action="store_true", help="spine bytes per token per policy, no forward passes")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with preset:NAME, override a config field")
    a = p.parse_args(argv)
    if a.bytes_only:
        cfg = model_config(a.model, a.overrides)
        report = bytes_report(cfg, [a.policy] if a.policy not in NAMED else list(NAMED))
        title = (f"{a.model}: spine bytes per decode token ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                 f"{cfg.num_experts} experts per MoE layer)")
        print(json.dumps(report, indent=2) if a.json else format_bytes_report(report, title))
        return 0
    if not Path(a.model).exists():
        p.error(f"{a.model}: no such folder")
    if a.experts is not None:
        codecs = [c for c in a.experts.split(",") if c]
        bad = [c for c in codecs if c not in EXPERT_PROBES]
        if bad or not codecs:
            p.error(f"--experts takes codecs from {', '.join(EXPERT_PROBES)}, got {a.experts!r}")
        result = expert_sensitivity(a.model, codecs, a.prompts, a.length, a.seed, a.device)
        print(to_json(result) if a.json else format_expert_table(result))
        return 0
    result = sensitivity(a.model, a.policy, a.codec, a.prompts, a.length, a.seed, a.device)
    print(to_json(result) if a.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
