"""Shared fixtures: tiny synthetic checkpoints made once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny models: one compute thread avoids oversubscription on small machines (and deltafin.load
# applies the setting, so set it there too).
os.environ.setdefault("DELTAFIN_THREADS", "1")
torch.set_num_threads(1)
# Streamed models keep no host-RAM cache unless a test asks for one (with a memory tree it writes):
# what an automatic cache holds follows the machine's free memory, which byte counts cannot.
os.environ.setdefault("DELTAFIN_RAM_BUDGET", "0")

# A small Kimi Linear trained on Python source (what random weights cannot show: prefix-consistent chat
# renders, real tokenizer.json files). It lives beside the repository, not in it; tests that need it
# skip where it is absent. DELTAFIN_KL_CODE_TINY points elsewhere.
KL_CODE_TINY = Path(os.environ.get("DELTAFIN_KL_CODE_TINY",
                                   Path(__file__).resolve().parents[2] / "shared" / "data" / "kl-code-tiny"))


@pytest.fixture(scope="session")
def tiny_k3_path(tmp_path_factory):
    from deltafin.checkpoint.synthetic import make_checkpoint
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("ckpt") / "tiny-k3", seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_kl_path(tmp_path_factory):
    from deltafin.checkpoint.synthetic import make_checkpoint
    return make_checkpoint("tiny-kimi-linear", tmp_path_factory.mktemp("ckpt") / "tiny-kl", seed=0,
                           progress=False)


@pytest.fixture(scope="session")
def wide_q8_path(tmp_path_factory):
    """A tiny Kimi Linear 512 wide (one whole block of interleaved int8, kernels/int8.py) as a grouped
    int8 store: what the CPU holds interleaved in RAM."""
    from deltafin.checkpoint.convert import convert
    from deltafin.checkpoint.synthetic import make_checkpoint
    from deltafin.kernels import cpu_native
    if not cpu_native.available():
        pytest.skip("native CPU kernels not built")
    root = tmp_path_factory.mktemp("wide")
    src = make_checkpoint("tiny-kimi-linear", root / "wide", seed=1, progress=False,
                          overrides={"hidden_size": 512, "moe_intermediate_size": 512})
    return convert(src, root / "q8", spine="int8", experts="int8", progress=False)


@pytest.fixture(scope="session")
def tiny_k3_model(tiny_k3_path):
    import deltafin
    return deltafin.load(tiny_k3_path, device="cpu", stream="off")
