"""Building a network one piece at a time, so a model meant for a reduced precision never holds its whole fp32
form: the module tree is made on the meta device (no memory), then each piece (a decoder layer, a table, a head)
is materialised, filled (random init, or its tensors from a checkpoint's state dict), handed to `convert` (the
precision's conversion,
`precision.llm_precision.LLMConverter.convert`) and its fp32 tensors freed before the next piece.
Peak memory is then the converted model plus one fp32 piece.

Random init replays the module constructors' own initialisation piece by piece in construction order (modules
register their children in the order they make them), so for a given seed the weights equal those of building
the whole module at once (`tests/test_load_precision.py` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from vocalis.checkpoint import check_state_dict, load_strict
from vocalis.kernels.heap import release_free_heap

Convert = Callable[[nn.Module, str], None]  # (parent, child name): convert that child in place
Fill = Callable[[str, nn.Module], None]  # (child's qualified name, child materialised on the CPU): its values

PIECE_ELEMENTS = 1 << 22  # a module larger than this (4 M elements, 16 MB fp32) is built child by child


class _NoMetaDraws(TorchFunctionMode):
    """`normal_` on a meta tensor returns it untouched: a meta tensor has no values to draw, and torch's meta
    `normal_` (what `nn.Embedding` initialises with) imports torch._dynamo on its first call, about a second of
    a process's start. Meta tensors draw nothing from any generator, so skipping it changes no later draw."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "normal_":  # `nn.init.normal_` passes its tensor by keyword
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_build() -> Iterator[None]:
    """Modules made inside are on the meta device (shapes, no memory, no initial values)."""
    with torch.device("meta"), _NoMetaDraws():
        yield


def pieces(module: nn.Module, prefix: str = "") -> Iterator[tuple[nn.Module, str, str]]:
    """(parent, child name, qualified name) of each piece below `module`, in registration order: a child with
    children and more than PIECE_ELEMENTS parameter elements is split further. Parameters held by `module` itself
    (not by a child) are not pieces: the caller materialises them."""
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        size = sum(p.numel() for p in child.parameters())
        if size > PIECE_ELEMENTS and any(True for _ in child.children()):
            yield from pieces(child, qualified + ".")
        else:
            yield module, name, qualified


def random_fill(_: str, piece: nn.Module) -> None:
    """The piece's own initialisation, replayed: `reset_parameters` of each module below it, in registration
    order. A module holding parameters without `reset_parameters` cannot be replayed: ValueError."""
    for m in piece.modules():
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        reset = getattr(m, "reset_parameters", None)
        if reset is None:
            raise ValueError(f"{type(m).__name__} has parameters but no reset_parameters: cannot be built layer-wise")
        reset()


class SafetensorsState(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors by name, each read from the file when asked for (nothing kept): a state dict
    for `load_layerwise` that never holds the whole fp32 file. Shapes come from the header."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(str(path), framework="pt", device="cpu")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def state_fill(state: Mapping[str, torch.Tensor]) -> Fill:
    """Fill each piece from `state` (keys `<qualified name>.<name in the piece>`), strictly; dtypes converted to the
    piece's. Check the whole state against the module first (`load_layerwise`)."""
    def fill(qualified: str, piece: nn.Module) -> None:
        head = qualified + "."
        piece.load_state_dict({k[len(head):]: state[k] for k in state if k.startswith(head)}, strict=True)
    return fill


def load_layerwise(make: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], what: str,
                   convert: Convert | None) -> nn.Module:
    """`make()` with `state`'s weights: built whole then loaded when `convert` is None, else piece by piece, each
    converted as it is loaded. Names and shapes are checked before anything is built (`ModelLoadError`)."""
    if convert is None:
        module = make()
        load_strict(module, state, what)
        return module.eval().requires_grad_(False)
    with meta_build():
        check_state_dict(make(), state, what)
    return build_layerwise(make, state_fill(state), convert)


def build_layerwise(make: Callable[[], nn.Module], fill: Fill, convert: Convert | None) -> nn.Module:
    """`make()` built piece by piece on the CPU (see the module doc), each piece filled by `fill` then converted by
    `convert` (None: kept fp32); eval mode, no gradients."""
    with meta_build():
        module = make()
    for parent, name, qualified in list(pieces(module)):
        piece = getattr(parent, name).to_empty(device="cpu")
        setattr(parent, name, piece)
        with torch.no_grad():
            fill(qualified, piece)
        if convert is not None:
            convert(parent, name)
            # the fp32 piece was freed into the heap's holes between the converted ones: hand them back now, or
            # the resident size ends where the whole fp32 build would have
            release_free_heap()
    for p in module.parameters():
        if p.device.type == "meta":  # parameters of a split module itself: none in the speech LMs
            raise ValueError(f"{type(module).__name__}: a parameter outside every piece cannot be built layer-wise")
    for b_name, b in module.named_buffers():
        if b.device.type == "meta":
            raise ValueError(f"{type(module).__name__}: buffer {b_name} is computed at construction; build it whole")
    return module.eval().requires_grad_(False)
