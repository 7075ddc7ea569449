#!/usr/bin/env python3
"""Add a mixed int4/int6/int8 spine to a store: `deltafin convert SRC DST --spine mixed --policy NAME`.

Usage: convert_spine_int4.py SRC DST [--policy NAME|FILE]   (default policy: moe4)
"""
import sys

from deltafin.cli import main

DEFAULT_POLICY = "moe4"

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--policy" or a.startswith("--policy=") for a in args):
        args += ["--policy", DEFAULT_POLICY]
    sys.exit(main(["convert", *args, "--spine", "mixed"]))
