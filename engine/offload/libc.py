"""ctypes bindings to the libc calls offloading steers the page cache with (mmap, mlock, madvise, mincore), and
to prctl, with which a budget's worker dies with the process that started it; and ending a child that runs on."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

PROT_READ, MAP_SHARED = 0x1, 0x01
MADV_NORMAL, MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 0, 1, 3, 4
PR_SET_PDEATHSIG = 1


class _Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.mmap.restype = vp
        lib.mmap.argtypes = [vp, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [vp, sz]
        for name in ("mlock", "munlock"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [vp, sz]
        lib.madvise.restype = ctypes.c_int
        lib.madvise.argtypes = [vp, sz, ctypes.c_int]
        lib.mincore.restype = ctypes.c_int
        lib.mincore.argtypes = [vp, sz, ctypes.POINTER(ctypes.c_ubyte)]
        ul = ctypes.c_ulong
        lib.prctl.restype = ctypes.c_int
        lib.prctl.argtypes = [ctypes.c_int, ul, ul, ul, ul]
        self.lib = lib

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")


_libc: _Libc | None = None


def libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def dies_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A preexec_fn for a child of `parent_pid` (this process, recorded before the fork): the kernel sends the
    child `signum` when the thread that started it dies, however it dies (a SIGKILL leaves the parent no
    clean-up of its own), and a child whose parent died before it could ask that is killed at once. SIGKILL by
    default, not a signal the child could catch: a worker busy in llama.cpp would not see another for as long
    as a prefill runs, and a worker that outlives its parent decodes on for no one, holding its budget's
    cgroup. SIGTERM for a child with clean-up of its own to do (a budget cgroup of its own to remove).
    libc is loaded here, before the fork: the child must not dlopen between fork and exec."""
    prctl = libc().lib.prctl

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent_pid:
            # SIGKILL whatever signum is: a forked child keeps the parent's Python handlers until it execs, and
            # one of SIGTERM's would only note it; before its exec it has nothing of its own to clean up
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def end_process(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """End a child still running: SIGTERM, so that it can clean up after itself, then SIGKILL where it has
    not ended within grace_s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """posix_fadvise(DONTNEED) on the whole file: drops its pages that no process has mapped."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        try:
            os.fsync(fd)  # dirty pages (a file just written) cannot be dropped before write-back
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raise_memlock_limit() -> None:
    """Lift RLIMIT_MEMLOCK's soft limit to the hard one (root's hard limit can be raised further)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            if soft != hard:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    except Exception:
        pass
