"""The distributed launch: read once from torchrun's environment, and joining the group.

torchrun (``--nproc-per-node N`` on one host, or ``--nnodes H --rdzv-backend c10d --rdzv-endpoint
HOST:PORT`` on each of H hosts) starts every rank with WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set; where its agent hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE), every
rank connects to it, else rank 0 hosts it. The group is gloo's (CPU tensors over TCP): its sockets
bind to the interface GLOO_SOCKET_IFNAME names (else the one the host name resolves to).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from ..errors import DeltafinError
from .transport import Group

# Every rank must have joined within this long (loading happens after joining).
JOIN_TIMEOUT_S = 600.0
# The group's own deadline, which only a wait without one of its own meets: a rank between passes
# waits for the next as long as it takes (every wait within a pass is bounded by dist_timeout).
NO_DEADLINE = datetime.timedelta(days=3650)

_joined: Group | None = None


class LaunchError(DeltafinError):
    pass


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the rendezvous store; rank 0 does otherwise
    local_rank: int = 0  # this rank's place among the ranks of its host (which GPU it takes)


def from_environment(env=None) -> Launch | None:
    """The launch torchrun describes in ``env`` (default the process's), or None: one process."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    try:
        launch = Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                        env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                        int(env.get("LOCAL_RANK") or env["RANK"]))
    except (KeyError, ValueError) as e:
        raise LaunchError(f"WORLD_SIZE is set, but the rest of the launch is not (RANK, MASTER_ADDR, MASTER_PORT, and "
                          f"LOCAL_RANK an integer where given): "
                          f"{e}; start deltafin on several ranks with torchrun") from None
    if not 0 <= launch.rank < launch.world_size:
        raise LaunchError(f"RANK {launch.rank} is outside WORLD_SIZE {launch.world_size}")
    if not 0 <= launch.local_rank < launch.world_size:
        raise LaunchError(f"LOCAL_RANK {launch.local_rank} is outside WORLD_SIZE {launch.world_size}")
    return launch


def join(launch: Launch, timeout: float) -> Group:
    """Join the group of ``launch`` (every rank calls it); `timeout`: the settings' dist_timeout."""
    global _joined
    import torch.distributed as dist
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0 and not launch.agent_store,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    store = dist.PrefixStore("deltafin", store)  # apart from the launcher's own keys
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=launch.rank,
                            world_size=launch.world_size, timeout=NO_DEADLINE)
    _joined = Group(launch.rank, launch.world_size, store, timeout, launch.local_rank)
    return _joined


def rank_device(device, local_rank: int, count: int):
    """The device a rank computes on: a CUDA device named without an index is the host's GPU
    ``local_rank`` (modulo the GPUs there: ranks beyond them share, which tests do on one GPU); any
    other device as named."""
    import torch
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", local_rank % max(1, count))


def joined() -> Group | None:
    """The group this process joined (torch.distributed's group is process-wide too), or None."""
    return _joined


def leave() -> None:
    """Rank 0 tells the others to stop (unless the group is down); every rank leaves the group."""
    global _joined
    import torch.distributed as dist
    group, _joined = _joined, None
    if group is None:
        return
    if group.rank == 0 and group.fault is None:
        for r in range(1, group.world_size):
            try:
                group.send_message(r, "stop")
            except Exception:  # a rank already gone ends anyway
                pass
    dist.destroy_process_group()
