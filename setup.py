"""Declares deltafin's one optional native extension; all other metadata is in pyproject.toml.

The CPU kernels (MXFP4, int8, int4/int6 and bf16 products) are plain C. ``optional=True`` lets the
install finish without them (no compiler, unsupported platform); deltafin then uses its torch
code on the CPU. AVX-512 code paths are selected at run time, so no -march flag is passed.
"""
import platform
import sys

from setuptools import Extension, setup

compile_args = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-pthread"]
# Scheduled for the building machine's own x86 core (the instruction set stays the baseline's; the wide
# code is chosen at run time): on a Zen 4 core the grouped int8 product read 28 GB/s of DRAM-resident
# weights against 22.6 with the generic schedule (docs/benchmarks.md).
if sys.platform != "win32" and platform.machine().lower() in ("x86_64", "amd64"):
    compile_args.append("-mtune=native")
link_args = [] if sys.platform == "win32" else ["-pthread", "-lm"]

setup(ext_modules=[Extension("deltafin.kernels._cpu_kernels", ["deltafin/kernels/_cpu_kernels.c"],
                             extra_compile_args=compile_args, extra_link_args=link_args,
                             optional=True)])
