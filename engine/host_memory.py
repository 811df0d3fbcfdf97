"""What the process holds, by owner, and giving back what nobody uses.

    readings = memory_readings()   # {"rss", "mlx_active", "mlx_cache", "malloc_free", ...}
    release_idle_memory()          # MLX buffer cache -> allocator, free heap pages -> the OS

RSS is more than the arrays alive: MLX keeps freed buffers in its own cache (up to its cache
limit, `mx.set_cache_limit`) to reuse them, and glibc malloc keeps freed chunks in its heaps and
arenas instead of returning them to the kernel. A server whose load varies in shape (prompt
lengths, batch sizes) leaves holes of every size there; `malloc_trim(0)` hands the free pages
back (madvise), which is cheap enough to do whenever the engine goes idle.

Linux/glibc only for the malloc parts; elsewhere those readings are absent and trimming is a
no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from typing import Any

import mlx.core as mx


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
        return None  # not glibc (musl) or a glibc older than 2.33
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_readings() -> dict[str, int]:
    """Bytes by owner. mlx_*: MLX's allocator (arrays alive, freed buffers kept for reuse, the
    peak of arrays alive, the cache limit); malloc_*: glibc (in use, free but still mapped,
    in mmapped chunks); python_blocks: objects alive in Python's allocator (a count)."""
    out: dict[str, int] = {}
    rss = rss_bytes()
    if rss is not None:
        out["rss"] = rss
    out["mlx_active"] = int(mx.get_active_memory())
    out["mlx_cache"] = int(mx.get_cache_memory())
    out["mlx_peak"] = int(mx.get_peak_memory())
    if _LIBC is not None:
        mi = _LIBC.mallinfo2()
        out["malloc_in_use"] = int(mi.uordblks + mi.hblkhd)
        out["malloc_free"] = int(mi.fordblks)
        out["malloc_mmapped"] = int(mi.hblkhd)
    out["python_blocks"] = sys.getallocatedblocks()
    return out


def release_idle_memory(background: bool = False) -> None:
    """Empty MLX's buffer cache and return malloc's free pages to the OS.

    `background`: hand the malloc_trim to a helper thread and return at once. The engine uses
    it while busy: the trim walks every heap and took 40-90 ms on a loaded 2-core box, a stall
    of one decode step every `release_every_s`; ctypes drops the GIL for the call, so the
    engine thread keeps stepping. A trim already under way absorbs the request."""
    mx.clear_cache()
    if _LIBC is None:
        return
    if background:
        _TRIMMER.request()
    else:
        _LIBC.malloc_trim(0)


class _Trimmer:
    """One daemon thread that runs malloc_trim(0) when asked (requests coalesce)."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.num_trims = 0

    def request(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlxd-malloc-trim", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            _LIBC.malloc_trim(0)
            self.num_trims += 1


_TRIMMER = _Trimmer()


def background_trims() -> int:
    """How many trims the helper thread has run (tests, /health)."""
    return _TRIMMER.num_trims
