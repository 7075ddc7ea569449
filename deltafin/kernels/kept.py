"""What a native call derives from weights (checks passed, pointer arrays), kept while those very weights live.

A resident model's weights are the same objects every token, and checking them again before each native
call cost tens of microseconds a layer. An entry is found by the id of its first weight and holds weak
references to all of them: it keeps no weight alive, is made again when any of them was swapped for
another object, and leaves with its first weight (an attribute on a tensor would travel with it through
``torch.save``, raw pointers included). What is kept must not refer to the weights itself.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class KeptByWeights:
    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, ws: tuple, make: Callable[[], T]) -> T:
        """``make()`` for the weights ws, made once while ws are the same objects (QWeights and tensors
        alike; a weight no weak reference can follow is checked again every time)."""
        first = ws[0]
        kept = self._entries.get(id(first))
        if kept is not None and len(kept[0]) == len(ws) and all(ref() is w for ref, w in zip(kept[0], ws)):
            return kept[1]
        value = make()
        try:
            refs = tuple(weakref.ref(w) for w in ws)
        except TypeError:
            return value
        if kept is None or kept[0][0]() is not first:  # one finalizer a weight, however often its entry changes
            weakref.finalize(first, self._entries.pop, id(first), None)
        self._entries[id(first)] = (refs, value)
        return value
