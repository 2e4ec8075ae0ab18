"""Our own read-only shared mapping of the model file: mlock, madvise and mincore on its pages.

llama.cpp maps the same file; page-cache pages are shared between mappings, so pinning or prefetching
through ours steers what llama.cpp's reads find in memory.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from .experts import ExpertMap
from .libc import MADV_DONTNEED, MADV_RANDOM, MADV_WILLNEED, MAP_SHARED, PROT_READ, libc
from .procfs import code_ranges
from .sizes import PAGE, fmt_bytes


class ModelMapping:
    """Our own read-only shared mapping of the model file: mlock / madvise / mincore on its pages."""

    def __init__(self, emap: ExpertMap):
        self.emap = emap
        self.size = emap.file_bytes
        self.c = libc()
        self.fd: int | None = os.open(str(emap.path), os.O_RDONLY)
        addr = self.c.lib.mmap(None, self.size, PROT_READ, MAP_SHARED, self.fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            e = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(e, f"mmap of {emap.path}: {os.strerror(e)}")
        self.addr = int(addr)
        self.locked: list[tuple[int, int]] = []  # (address, length) we mlocked (ours or library code)
        self.locked_bytes = 0
        self._vec = (ctypes.c_ubyte * ((self.size + PAGE - 1) // PAGE))()
        self._pinned = np.zeros((emap.n_layer, emap.n_expert), bool)
        # page index ranges of every expert part, for residency by cumulative sums
        r = emap.ranges
        self._p0 = r[..., 0] // PAGE
        self._p1 = np.where(r[..., 1] > 0, (r[..., 0] + r[..., 1] + PAGE - 1) // PAGE, self._p0)

    # page-aligned span of a file range in our mapping
    def _span(self, offset: int, length: int) -> tuple[int, int]:
        a = (offset // PAGE) * PAGE
        b = min(self.size, ((offset + length + PAGE - 1) // PAGE) * PAGE)
        return self.addr + a, b - a

    def lock_address(self, addr: int, length: int) -> int:
        a = (addr // PAGE) * PAGE
        n = ((addr + length + PAGE - 1) // PAGE) * PAGE - a
        rc = self.c.lib.mlock(a, n)
        if rc != 0:
            e = ctypes.get_errno()
            raise PinError(e, _mlock_hint(e, n))
        self.locked.append((a, n))
        self.locked_bytes += n
        return n

    def lock_range(self, offset: int, length: int) -> int:
        a, n = self._span(offset, length)
        return self.lock_address(a, n)

    def pin_non_expert(self) -> int:
        """mlock the non-expert tensors (attention, norms, routers, output; the embedding table only when
        it doubles as the output matrix)."""
        spans = sorted(self._span(o, n) for o, n in self.emap.pinnable() if n > 0)
        merged: list[list[int]] = []
        for a, n in spans:
            if merged and a <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], a + n - merged[-1][0])
            else:
                merged.append([a, n])
        return sum(self.lock_address(a, n) for a, n in merged)

    def pin_code(self) -> int:
        """mlock the resident pages of this process's llama/ggml library mappings (the code in use stays
        resident; pages never touched are not read in just to be locked, which would cost budget)."""
        total = 0
        for a, n, _ in code_ranges():
            pages = (n + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if self.c.lib.mincore(a, n, vec) != 0:
                continue
            res = np.frombuffer(memoryview(vec), dtype=np.uint8) & 1
            edges = np.flatnonzero(np.diff(np.concatenate([[0], res, [0]])))
            for start, stop in zip(edges[::2], edges[1::2]):
                total += self.lock_address(a + int(start) * PAGE, int(stop - start) * PAGE)
        return total

    @staticmethod
    def resident_code_bytes() -> int:
        """Bytes of the llama/ggml library pages in memory now (what pin_code would lock)."""
        c, total = libc(), 0
        for a, n, _ in code_ranges():
            pages = (n + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if c.lib.mincore(a, n, vec) == 0:
                total += int((np.frombuffer(memoryview(vec), dtype=np.uint8) & 1).sum()) * PAGE
        return total

    def pin_experts(self, pairs: Iterable[tuple[int, int]]) -> int:
        """mlock these experts' ranges. Read in exactly (WILLNEED), then locked with read-around off: a
        fault in ours would otherwise read the device's whole window (MiBs) of neighbouring experts in
        large folios, which stay in memory beside the expert cache, uncounted, and which no expert's
        eviction can drop (the page cache drops only whole folios)."""
        pairs = list(pairs)
        for layer, expert in pairs:
            for o, n in self.emap.expert_ranges(layer, expert):
                a, m = self._span(o, n)
                self.c.lib.madvise(a, m, MADV_RANDOM)
                self.c.lib.madvise(a, m, MADV_WILLNEED)
        total = 0
        for layer, expert in pairs:
            for o, n in self.emap.expert_ranges(layer, expert):
                total += self.lock_range(o, n)
            self._pinned[layer, expert] = True
        return total

    def unpin_expert(self, layer: int, expert: int) -> int:
        """Unlock one pinned expert and unmap it here, so that it can leave memory; returns the bytes unlocked.
        Its parts share their first and last pages with the experts beside them in each tensor: those still
        pinned are locked again."""
        spans = [self._span(o, n) for o, n in self.emap.expert_ranges(layer, expert)]
        for a, n in spans:
            self.c.lib.munlock(a, n)
            self.c.lib.madvise(a, n, MADV_DONTNEED)
            if (a, n) in self.locked:
                self.locked.remove((a, n))
                self.locked_bytes -= n
        self._pinned[layer, expert] = False
        for e in (expert - 1, expert + 1):
            if 0 <= e < self.emap.n_expert and self._pinned[layer, e]:
                for o, n in self.emap.expert_ranges(layer, e):
                    self.c.lib.mlock(*self._span(o, n))
        return sum(n for _, n in spans)

    def unpin_all(self) -> None:
        for a, n in self.locked:
            self.c.lib.munlock(a, n)
        self.locked.clear()
        self.locked_bytes = 0
        self._pinned[:] = False

    def willneed_non_expert(self) -> int:
        """Ask the kernel to read the non-expert tensors (those pin_non_expert locks) now, in large requests:
        a first decode would otherwise fault them in a read-around window at a time (1.4 GiB of the 8.2 GB
        olmoe-1b-7b preset took ~10 s that way). Returns the bytes asked for."""
        total = 0
        for o, n in self.emap.pinnable():
            if n > 0:
                a, m = self._span(o, n)
                self.c.lib.madvise(a, m, MADV_WILLNEED)
                total += m
        return total

    def willneed(self, layer: int, expert: int) -> int:
        total = 0
        for o, n in self.emap.expert_ranges(layer, expert):
            a, m = self._span(o, n)
            self.c.lib.madvise(a, m, MADV_WILLNEED)
            total += m
        return total

    def pages(self) -> npt.NDArray[np.uint8]:
        """Page-cache residency of every page of the file (1 = resident)."""
        rc = self.c.lib.mincore(self.addr, self.size, self._vec)
        self.c.check(rc, "mincore")
        return np.frombuffer(memoryview(self._vec), dtype=np.uint8) & np.uint8(1)

    def expert_residency(self, pages: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.float64]:
        """[n_layer, n_expert] fraction of each expert's pages that are resident."""
        pages = self.pages() if pages is None else pages
        cs = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)])
        res = (cs[self._p1] - cs[self._p0]).sum(axis=-1)
        tot = (self._p1 - self._p0).sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tot > 0, res / np.maximum(tot, 1), 0.0)

    def range_resident(self, offset: int, length: int) -> float:
        pages = self.pages()
        p0, p1 = offset // PAGE, (offset + length + PAGE - 1) // PAGE
        return float(pages[p0:p1].mean()) if p1 > p0 else 0.0

    @property
    def pinned(self) -> npt.NDArray[np.bool_]:
        return self._pinned.copy()

    def close(self) -> None:
        if getattr(self, "addr", None):
            self.unpin_all()
            self.c.lib.munmap(self.addr, self.size)
            self.addr = 0
        fd = getattr(self, "fd", None)  # absent where __init__ failed before opening the file
        if fd is not None:
            os.close(fd)
            self.fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class PinError(OSError):
    pass


def _mlock_hint(e: int, n: int) -> str:
    if e in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
        try:
            import resource

            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else fmt_bytes(soft)
        except Exception:
            limit = "?"
        return (
            f"cannot pin {fmt_bytes(n)} with mlock ({os.strerror(e)}; locked-memory limit {limit}): run as root, "
            f"or raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity under systemd)"
        )
    return f"mlock failed: {os.strerror(e)}"
