"""Move long-lived tensors (the decoder's weights, the KV cache) onto 2 MiB transparent huge pages.

Batch-1 decode streams every weight once per token; on 4 KiB pages it reads measurably slower than on huge pages
(TLB misses; README, "bench"). Asking torch's allocator for huge pages everywhere (THP_MEM_ALLOC_ENABLE=1) does
not pay: it puts every short-lived 2+ MiB temporary on huge pages too, and glibc unmaps such blocks on free, so each
token2wav step faulted and zeroed them afresh (`x + 1` on a (16, 100, 1024) fp32 tensor: 1.3-1.5 ms against 0.08
ms on glibc's defaults). So only the tensors that live as long as the engine are moved, once, after they are
built: MADV_COLLAPSE (Linux 6.1+) copies the pages under a range into huge pages in place, at the same addresses,
so views, packed layouts and pointers a native kernel already holds stay valid.

Only the 2 MiB-aligned interior of each storage can be collapsed; storages under 4 MiB are left alone. Where the
kernel cannot (THP mode `never`, an older kernel, not Linux) nothing changes. `VOCALIS_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # linux/mman.h


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or os.environ.get("VOCALIS_HUGE_PAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Collapse the memory under these CPU tensors' storages (each storage once) into huge pages, in place;
    returns the bytes now on huge pages (0 where the kernel cannot)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    seen: set[int] = set()
    moved = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        start = -(-ptr // HUGE_PAGE) * HUGE_PAGE
        end = (ptr + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        if madvise(start, end - start, _MADV_COLLAPSE) != 0:
            err = ctypes.get_errno()
            log.debug("huge pages unavailable (madvise: %s)", os.strerror(err))
            return moved
        moved += end - start
    return moved
