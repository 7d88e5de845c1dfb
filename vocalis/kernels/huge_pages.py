"""Move long-lived tensors (the decoder's weights, the KV cache) onto 2 MiB transparent huge pages.

Batch-1 decode streams every weight once per token; on 4 KiB pages it reads measurably slower than on huge pages
(TLB misses; README, "bench"). Asking torch's allocator for huge pages everywhere (THP_MEM_ALLOC_ENABLE=1) does
not pay: it puts every short-lived 2+ MiB temporary on huge pages too, and glibc unmaps such blocks on free, so each
token2wav step faults and zeroes them afresh, many times slower than on glibc's defaults. So only the tensors
that live as long as the engine are moved, once, after they are built: MADV_COLLAPSE (Linux 6.1+) copies the pages under
a range into huge pages in place, at the same addresses, so views, packed layouts and pointers a native kernel already
holds stay valid.

Where the kernel cannot (THP mode `never`, an older kernel, not Linux) nothing changes. Whether to move them at
all is the caller's choice (the LLM engine's `EngineConfig.huge_pages`, VOCALIS_HUGE_PAGES=0). Untouched pages cannot be
collapsed (the KV cache before use); MADV_HUGEPAGE makes them fault in as huge pages later.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise, or None where collapsing cannot apply (not Linux, THP mode `never`)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if "[never]" in _THP_MODE.read_text():
            return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 2 MiB frames under the tensors' storages, as merged [start, end) address ranges."""
    frames = []
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type != "cpu" or storage.nbytes() == 0:
            continue
        ptr = storage.data_ptr()
        frames.append((ptr // HUGE_PAGE * HUGE_PAGE, -(-(ptr + storage.nbytes()) // HUGE_PAGE) * HUGE_PAGE))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(frames):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Collapse the memory under these CPU tensors' storages into huge pages, in place; returns the bytes now on
    huge pages (0 where the kernel cannot).

    Whole 2 MiB frames are collapsed, so a small tensor (a layer's 1 MiB int8 q/k/v weight) gets its huge page
    too, shared with whatever else lies in the frame (other weights, the heap); a frame the kernel refuses (it
    crosses into another mapping) is left on small pages frame by frame."""
    madvise = _madvise()
    if madvise is None:
        return 0
    moved = 0
    for start, end in _ranges(tensors):
        madvise(start, end - start, _MADV_HUGEPAGE)  # pages not yet touched (KV cache) fault in as huge pages
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            moved += end - start
            continue
        # e.g. EINVAL or ENOMEM: the range crosses mappings the kernel will not collapse (or THP is off)
        log.debug("madvise(%d MiB): %s; frame by frame", (end - start) >> 20, os.strerror(ctypes.get_errno()))
        for frame in range(start, end, HUGE_PAGE):
            if madvise(frame, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                moved += HUGE_PAGE
            elif ctypes.get_errno() in (errno.EPERM, errno.ENOSYS):  # not allowed or no MADV_COLLAPSE here
                return moved
    return moved
