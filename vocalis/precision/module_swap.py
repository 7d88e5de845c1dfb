"""Swapping submodules in place: how every precision backend puts its layers into a loaded model."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(module: nn.Module, match: Callable[[nn.Module], bool],
                 make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule below `module` for which `match` holds by `make(submodule)` (in place; a replaced
    submodule's own children are not visited); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if match(child):
            setattr(module, name, make(child))
            count += 1
        else:
            count += swap_modules(child, match, make)
    return count
