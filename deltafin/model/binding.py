"""Template modules whose weights are bound per layer.

A template declares its weight *slots* (name -> shape). Built once per layer kind, it holds
meta-device placeholders (no memory); ``bind`` points the slots at one layer's tensors (plain
or quantized) for a pass and ``unbind`` drops the references again, so the model never holds a
module per layer and never copies a weight it does not have to.
"""
from __future__ import annotations

import torch
from torch import nn


class BindError(ValueError):
    pass


class Bindable(nn.Module):
    def slots(self, **shapes: tuple[int, ...]) -> None:
        if "_slot_shapes" not in self.__dict__:
            self._slot_shapes = {}
            self._slot_placeholders = {}  # one meta tensor per slot, put back by every unbind
        for name, shape in shapes.items():
            self._slot_shapes[name] = tuple(shape)
            self._slot_placeholders[name] = torch.empty(shape, device="meta")
            object.__setattr__(self, name, self._slot_placeholders[name])


def _slot_owners(root: nn.Module) -> list[tuple[str, nn.Module, str, tuple[int, ...]]]:
    """(full name, owning module, slot name, shape) of every slot under root. Listed once per root and
    kept on it: a template's modules never change, and walking them for every bind and unbind (twice
    per layer and pass) cost more than the binding itself."""
    owners = root.__dict__.get("_slot_owner_list")
    if owners is None:
        owners = [((f"{prefix}.{name}" if prefix else name), mod, name, shape)
                  for prefix, mod in root.named_modules()
                  for name, shape in getattr(mod, "_slot_shapes", {}).items()]
        object.__setattr__(root, "_slot_owner_list", owners)
    return owners


def slot_names(root: nn.Module) -> dict[str, tuple[int, ...]]:
    return {full: shape for full, _, _, shape in _slot_owners(root)}


def bind(root: nn.Module, weights: dict) -> None:
    """Point every slot of `root` at weights[slot name]; all slots must be given, with their shapes."""
    for full, mod, name, shape in _slot_owners(root):
        w = weights.get(full)
        if w is None:
            raise BindError(f"no weight for '{full}'")
        if tuple(w.shape) != shape:
            raise BindError(f"weight '{full}' has shape {list(w.shape)}, the template expects {list(shape)}")
        object.__setattr__(mod, name, w)


def unbind(root: nn.Module) -> None:
    for _, mod, name, shape in _slot_owners(root):
        object.__setattr__(mod, name, mod._slot_placeholders[name])
