"""Handing freed heap memory back to the OS, with whichever malloc runs this process.

Why: tcmalloc (the daemon's malloc where installed, peer/daemon/allocator.py) keeps freed pages for reuse, and a
one-off transient - the 8-bit probe, the dataset decode, the int8 step check's fp32 twin - would otherwise stay in
the resident set for the life of the process. Used by the daemon after its start-up stages and by lowp after its
step check; a light module (ctypes only) so both can import it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: jemalloc's mallctl name that purges every arena (MALLCTL_ARENAS_ALL = 4096).
_JEMALLOC_PURGE_ALL = b"arena.4096.purge"


def libc() -> ctypes.CDLL | None:
    """glibc's malloc controls (``mallopt``, ``malloc_trim``), or None under another C library."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None


def trim_heap() -> bool:
    """Return freed heap pages to the OS: tcmalloc's ReleaseFreeMemory, jemalloc's purge of all arenas, glibc's
    ``malloc_trim(0)``; True where a release was asked for and (glibc) memory was released."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return False
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return True
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        return mallctl(_JEMALLOC_PURGE_ALL, None, None, None, ctypes.c_size_t(0)) == 0
    lib = libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False
