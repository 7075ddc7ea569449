#!/usr/bin/env python3
"""Write a synthetic checkpoint: the same as `deltafin make-checkpoint ...`."""
import sys

from deltafin.cli import main

if __name__ == "__main__":
    sys.exit(main(["make-checkpoint", *sys.argv[1:]]))
