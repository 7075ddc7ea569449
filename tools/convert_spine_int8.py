#!/usr/bin/env python3
"""Add an int8 spine to a store: the same as `deltafin convert SRC DST --spine int8`.

Usage: convert_spine_int8.py SRC DST
"""
import sys

from deltafin.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:], "--spine", "int8"]))
