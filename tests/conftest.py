"""Shared fixtures: tiny synthetic checkpoints made once per test session."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread avoids oversubscription on small machines


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
def tiny_k3_model(tiny_k3_path):
    import deltafin
    return deltafin.load(tiny_k3_path, device="cpu", stream="off")
