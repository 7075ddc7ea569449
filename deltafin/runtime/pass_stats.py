"""What a pass reports: the ``PassStats`` the engine owns and fills (with its providers), and the
``PassObserver`` interface through which anything outside the engine watches passes.

Front ends never wrap the model or the providers to see what a pass did: they give the engine an
observer (``Engine.observe``), which it calls from its own thread: ``on_route`` for every MoE
layer's routing as it happens (what the router chose, and its input), ``on_pass`` with every pass's
stats once the pass has ended.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PassStats:
    tokens: int = 0
    seconds: float = 0.0
    compute_seconds: float = 0.0
    spine_wait_seconds: float = 0.0
    expert_wait_seconds: float = 0.0
    bytes_read: int = 0  # from the model's files on disk
    bytes_from_cache: int = 0  # from the local cache of a hub repository
    bytes_from_network: int = 0  # fetched from the hub for this pass
    bytes_from_ram: int = 0
    bytes_on_device: int = 0  # read from weights resident on the compute device
    bytes_to_device: int = 0  # copied host -> device
    bytes_host_compute: int = 0  # of the host's bytes, experts a device run computed on the host's cores
    experts_loaded: int = 0
    spines_loaded: int = 0  # layers whose spine the host streamer served (from its RAM or the disk)
    spines_cached: int = 0  # of them, those from host RAM (pinned or cached)
    experts_streamed: int = 0  # of experts_loaded, those the host streamer served (from its RAM cache or the disk)
    experts_cached: int = 0  # of experts_loaded, those a host-RAM cache served
    prefetch_bytes: int = 0  # read ahead of the router on a guess (also in bytes_read)
    prefetch_used_bytes: int = 0  # of them, experts the router then chose

    def add(self, other: "PassStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


class PassObserver:
    """Watches the engine's passes; override what you need. An observer with ``on_route`` sees every
    routing, so the passes it watches run eagerly (a replayed CUDA graph routes without the host)."""

    on_route = None  # (layer, ids [rows, k], router input x [rows, H]) -> None, during the pass
    # (layer, ids [rows, k]) -> None: what a MoE layer chose, told once it did (ids are valid during the
    # call only). Unlike on_route it lets a CPU layer route inside its one native call, and a CPU pass
    # replay (runtime/cpu_replay.py); CUDA graphs still give way to it.
    on_choice = None

    def on_pass(self, stats: PassStats) -> None:
        """After each pass, with its stats (also the engine's ``last_pass``)."""
