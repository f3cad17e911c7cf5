"""How much memory a process holds that no other process shares: ``Private_Dirty`` of its mappings.

RSS is the wrong figure for a worker: it counts the safetensors pages a worker maps from the page
cache, which every process of the host serving that directory shares (the prefill role runs on
them in place). Private_Dirty is what the process alone costs the host: its heap, its packed
weights, its KV pool. Read from ``/proc/PID/smaps_rollup`` (Linux); None where that is unreadable.
"""

from __future__ import annotations


def private_bytes(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return sum(int(line.split()[1]) for line in rollup if line.startswith("Private_Dirty:")) * 1024
    except (OSError, ValueError, IndexError):
        return None


def release_freed_heap() -> None:
    """Hand the heap's freed pages back to the kernel (glibc's ``malloc_trim``), once after a model
    loads: the temporaries of loading and packing weights (fused copies, casts) are freed, but glibc
    keeps freed heap pages for reuse, and they count as the worker's private memory for its whole
    life (~100 MB at the 0.5B geometry). A no-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
