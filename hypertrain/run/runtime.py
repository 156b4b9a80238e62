"""Process-wide settings for fast CPU training: keep freed activation memory in the heap.

`keep_freed_memory()` raises glibc's mmap and trim thresholds, so a step's large freed activations
are reused instead of page-faulted in anew (docs/performance.md, "Freed activation memory"). A no-op
where the C library has no `mallopt` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's cap: 32 MiB on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed large blocks for reuse; True when the setting took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
