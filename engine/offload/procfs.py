"""What /proc and /sys say about this process and the model file: memory, library and model mappings."""

from __future__ import annotations

import os
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


def code_ranges(libs=CODE_LIBS) -> list[tuple[int, int, str]]:
    """(start, length, path) of this process's file mappings of the llama/ggml libraries."""
    out = []
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


def read_ahead_bytes(path) -> int:
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


def model_mappings(path, exclude: int = 0) -> list[tuple[int, int, int]]:
    """(address, length, file offset) of this process's mappings of the model file (llama.cpp's)."""
    target = os.path.realpath(path)
    out = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            f = line.split(maxsplit=5)
            if len(f) < 6 or f[5] != target:
                continue
            a, b = (int(x, 16) for x in f[0].split("-"))
            if a != exclude:
                out.append((a, b - a, int(f[2], 16)))
    except OSError:
        pass
    return out

