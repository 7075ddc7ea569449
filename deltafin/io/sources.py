"""Which weight source a path names: a converted store, a Hugging Face checkpoint folder, or a hub
repository fetched lazily."""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.source import HFSource
from ..checkpoint.store import StoreSource, convert_command
from ..settings import Settings
from .fetch import HubError
from .hub import HubSource, is_repo_id


def open_source(path: str | Path, spine: str = "auto", settings: Settings | None = None):
    """A weight source for a converted store, a Hugging Face checkpoint folder, or a hub repository
    id ("owner/name", when no such local folder exists), which is fetched lazily as it is used."""
    p = Path(path)
    if not p.exists():
        if not is_repo_id(str(path)):
            raise FileNotFoundError(f"{path}: no such checkpoint folder or store (nor a hub id owner/name)")
        if spine not in ("auto", "bf16"):
            raise ValueError(f"{path}: spine {spine!r} needs a converted store; a hub repository is read as published")
        try:
            return HubSource(str(path), settings or Settings.resolve())
        except HubError as e:  # a mistyped local path reads as a repository id: say both
            raise HubError(f"{e}; nor is there a local folder {str(path)!r}") from None
    if (p / "deltafin-store.json").exists():
        return StoreSource(p, spine=spine)
    if spine not in ("auto", "bf16"):
        raise ValueError(f"{p}: spine {spine!r} needs a converted store; this is a Hugging Face folder "
                         f"(make one with: {convert_command(p, 'STORE', spine)})")
    return HFSource(p)
