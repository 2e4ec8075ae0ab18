"""What this machine offers to a run: the threads to use, the CPU's name, physical memory.

No llama.cpp here, so the CLI and the app can ask before a model is loaded.
"""

from __future__ import annotations

import os
import platform


def default_threads(spare: int = 0) -> int:
    """Threads for llama.cpp when none are given: one per core this process may run on (its CPU
    affinity where the OS has one: taskset, a container's cpuset), less `spare` left to other work."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, cores - spare)


def cpu_name() -> str:
    """The CPU's marketing name (/proc/cpuinfo's "model name"), else what Python knows of it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                    if name:
                        return name
    except OSError:  # not Linux, or /proc not mounted
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def memory_bytes() -> int | None:
    """Physical memory, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
