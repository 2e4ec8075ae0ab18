"""What /proc and /sys say about this process and the model file: memory, library and model mappings."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CODE_LIBS = ("libllama", "libggml", "libs2moe")


def process_anon_bytes(pid: int | str = "self") -> int:
    """Anonymous resident memory of a process (RssAnon)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def code_ranges(libs: Iterable[str] = CODE_LIBS) -> list[tuple[int, int, str]]:
    """(start, length, path) of this process's file mappings of the llama/ggml libraries."""
    out: list[tuple[int, int, str]] = []
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in maps:
        f = line.split(maxsplit=5)
        if len(f) < 6 or not any(name in os.path.basename(f[5]) for name in libs):
            continue
        if "r" not in f[1]:
            continue
        a, b = (int(x, 16) for x in f[0].split("-"))
        out.append((a, b - a, f[5]))
    return out


def read_ahead_bytes(path: str | os.PathLike[str]) -> int:
    """The read-around window of the block device holding `path` (what one page fault on an mmap'd file
    reads around the faulting page). 128 KiB when it cannot be found."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        for q in (dev / "queue" / "read_ahead_kb", dev.parent / "queue" / "read_ahead_kb"):
            if q.is_file():
                return int(q.read_text().strip()) * 1024
    except (OSError, ValueError):
        pass
    return 128 * 1024


def model_mappings(path: str | os.PathLike[str], exclude: tuple[int, int] = (0, 0)) -> list[tuple[int, int, int]]:
    """(address, length, file offset) of this process's mappings of the model file (llama.cpp's), those
    inside the span `exclude` (address, length: our own mapping, which mlock and madvise split into
    several areas) left out."""
    target = os.fsencode(os.path.realpath(path))  # bytes: a path need not decode
    out: list[tuple[int, int, int]] = []
    try:
        for line in Path("/proc/self/maps").read_bytes().splitlines():
            f = line.split(maxsplit=5)
            if len(f) < 6 or f[5] != target:
                continue
            a, b = (int(x, 16) for x in f[0].split(b"-"))
            if not exclude[0] <= a < exclude[0] + exclude[1]:
                out.append((a, b - a, int(f[2], 16)))
    except OSError:
        pass
    return out


def file_cached_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(bytes of the file in the page cache, file size): mincore over a fresh read-only mapping of it,
    which reads nothing and leaves the cache as it was."""
    import ctypes

    import numpy as np

    from .libc import MAP_SHARED, PROT_READ, libc
    from .sizes import PAGE

    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    c = libc()
    fd = os.open(str(path), os.O_RDONLY)
    try:
        addr = c.lib.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {path}: {os.strerror(e)}")
        try:
            n = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * n)()
            c.check(c.lib.mincore(addr, size, vec), "mincore")
            resident = int((np.frombuffer(memoryview(vec), dtype=np.uint8) & 1).sum())
        finally:
            c.lib.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE), size


def block_device(path: str | os.PathLike[str]) -> str | None:
    """The name of the whole disk holding `path` as /proc/diskstats lists it (nvme0n1, sda, mmcblk0), or
    None (a network or overlay file system without one)."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    except OSError:
        return None
    if not dev.exists():
        return None
    # a partition's folder sits inside its disk's folder
    return dev.parent.name if (dev / "partition").exists() else dev.name


def disk_read_bytes(name: str) -> int | None:
    """Bytes read from block device `name` since boot (/proc/diskstats counts 512-byte sectors)."""
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if len(f) > 5 and f[2] == name:
                return int(f[5]) * 512
    except (OSError, ValueError):
        pass
    return None


def process_read_bytes(pid: int | str = "self") -> int | None:
    """Bytes a process caused to be read from storage (/proc/PID/io read_bytes: page faults on mapped
    files included), or None where the kernel does not account it."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, by its own names (MemTotal, MemAvailable, Cached, SwapTotal, …)."""
    return _numbers("/proc/meminfo")


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's memory in bytes from /proc/PID/status, by its own names (VmRSS, RssAnon, RssFile, VmSwap, …)."""
    return {k: v for k, v in _numbers(f"/proc/{pid}/status").items() if k.startswith(("Vm", "Rss"))}


def _numbers(path: str) -> dict[str, int]:
    """The `Name: number [kB]` lines of a /proc file, in bytes where the unit is kB."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            f = rest.split()
            if f and f[0].isdigit():
                out[key] = int(f[0]) * (1024 if len(f) > 1 and f[1] == "kB" else 1)
    except OSError:
        pass
    return out


def cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core since boot, from /proc/stat (idle and iowait count as idle)."""
    out = []
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            f = line.split()
            if not f or not f[0].startswith("cpu") or f[0] == "cpu":
                continue
            ticks = [int(x) for x in f[1:]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total = sum(ticks[:8])  # guest time is already inside user and nice
            out.append((total - idle, total))
    except (OSError, ValueError):
        pass
    return out
