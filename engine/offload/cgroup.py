"""Memory cgroups (v2, or v1): a child of our own cgroup with a hard limit, in which a command runs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .libc import dies_with_parent

ENV_CGROUP = "S2MOE_BUDGET_CGROUP"  # set in a process started inside a budget cgroup
ENV_BUDGET = "S2MOE_BUDGET"  # the budget it was started with: "auto" or bytes


class BudgetUnavailable(ConfigError):
    """No memory cgroup can be made here; the message says why and what to do instead."""


def _how(limit_hint: str = "SIZE") -> str:
    return (
        f"run as root, or under a delegated cgroup, e.g. `systemd-run --user --scope -p MemoryMax={limit_hint} "
        f"-p MemorySwapMax=0 s2moe ...` (then run without a budget)"
    )


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of cgroup file systems."""
    out = []
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            f, r = left.split(), right.split()
            if len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
                out.append((f[4], r[0], r[2]))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """controller list ('' for v2) → path of this process's cgroup."""
    out = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            out[ctrls] = path
    except OSError:
        pass
    return out


class MemoryCgroup:
    """A child memory cgroup of our own cgroup with a hard limit; processes run in it via run()."""

    def __init__(self, version: int, path: Path):
        self.version, self.path = version, path

    # discovery ----------------------------------------------------------------------------------------
    @staticmethod
    def locate() -> tuple[int, Path]:
        """(version, parent folder in which we may create a child), or raise BudgetUnavailable."""
        root_override = os.environ.get("S2MOE_CGROUP_ROOT")  # tests: point at a folder to try instead
        if root_override is not None:
            p = Path(root_override)
            if not p.is_dir():
                raise BudgetUnavailable(f"no memory cgroup: {root_override} does not exist; {_how()}")
            return (2 if (p / "cgroup.controllers").exists() else 1), p
        mounts, own = _mounts(), _own_cgroups()
        reasons = []
        for mnt, fs, _opts in mounts:
            if fs == "cgroup2":
                base = Path(mnt) / own.get("", "/").lstrip("/")
                try:
                    ctrls = (base / "cgroup.controllers").read_text().split()
                except OSError:
                    continue
                if "memory" not in ctrls:
                    reasons.append("cgroup v2 has no memory controller here")
                    continue
                try:
                    sub = (base / "cgroup.subtree_control").read_text().split()
                except OSError:
                    sub = []
                if "memory" not in sub:
                    try:
                        (base / "cgroup.subtree_control").write_text("+memory")
                    except OSError as e:
                        reasons.append(f"cannot enable the memory controller below {base} ({e.strerror})")
                        continue
                return 2, base
        for mnt, fs, opts in mounts:
            if fs == "cgroup" and "memory" in opts.split(","):
                own_path = next((p for c, p in own.items() if "memory" in c.split(",")), "/")
                return 1, Path(mnt) / own_path.lstrip("/")
        if not reasons:
            reasons.append("no memory cgroup hierarchy is mounted")
        raise BudgetUnavailable(f"cannot set a memory budget: {'; '.join(reasons)}; {_how()}")

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            version, parent = MemoryCgroup.locate()
        except BudgetUnavailable as e:
            return str(e)
        if not os.access(parent, os.W_OK):
            return f"cannot set a memory budget: no permission to create a cgroup in {parent}; {_how()}"
        return None

    @classmethod
    def create(cls, limit_bytes: int, tag: str = "run") -> MemoryCgroup:
        version, parent = cls.locate()
        _remove_stale(parent)
        path = parent / f"s2moe-{tag}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        try:
            path.mkdir()
        except OSError as e:
            raise BudgetUnavailable(f"cannot create a memory cgroup in {parent} ({e.strerror}); {_how()}") from None
        cg = cls(version, path)
        try:
            cg.set_limit(limit_bytes)
        except OSError as e:
            cg.remove()
            raise BudgetUnavailable(f"cannot set the memory limit of {path} ({e.strerror}); {_how()}") from None
        return cg

    # control ------------------------------------------------------------------------------------------
    def set_limit(self, limit_bytes: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(int(limit_bytes)))
            try:
                (self.path / "memory.swap.max").write_text("0")
            except OSError:
                pass
        else:
            # No swapping either (memsw, where swap accounting is on). v1 refuses a memory limit above the
            # memsw one, so a raise writes memsw first and a cut writes it last.
            raising = limit_bytes > self.limit()
            if raising:
                self._set_memsw(limit_bytes)
            (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
            if not raising:
                self._set_memsw(limit_bytes)

    def _set_memsw(self, limit_bytes: int) -> None:
        try:
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(int(limit_bytes)))
        except OSError:
            pass

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def stat(self) -> dict[str, int]:
        out = {}
        for line in self._read("memory.stat").splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def usage(self) -> int:
        text = self._read("memory.current" if self.version == 2 else "memory.usage_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def peak(self) -> int:
        text = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def reset_peak(self) -> bool:
        """Start the peak afresh from what is held now; False where the kernel keeps no such reset for later
        reads (cgroup v2 resets memory.peak only for the file descriptor written to)."""
        if self.version == 2:
            return False
        try:
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        except OSError:
            return False
        return True

    def limit(self) -> int:
        text = self._read("memory.max" if self.version == 2 else "memory.limit_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def split(self) -> dict[str, int]:
        """What the cgroup holds now: anonymous, file pages (page cache), locked (unevictable)."""
        s = self.stat()
        if self.version == 2:
            return {
                "anon": s.get("anon", 0),
                "file": s.get("file", 0),
                "locked": s.get("unevictable", 0),
                "total": self.usage(),
            }
        return {
            "anon": s.get("rss", 0),
            "file": s.get("cache", 0),
            "locked": s.get("unevictable", 0),
            "total": self.usage(),
        }

    def oom_kills(self) -> int:
        if self.version == 2:
            for line in self._read("memory.events").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def popen(self, argv: Sequence[str], budget: str, **kw: Any) -> subprocess.Popen[Any]:  # text or bytes: kw
        """Start argv inside this cgroup (all its memory counts there). `budget` ("auto" or bytes) tells the
        process what it was started with (current_budget). The process dies with the thread that calls this
        (libc.dies_with_parent), which must therefore wait for it, as run_in_budget does."""
        env = dict(kw.pop("env", None) or os.environ)
        env[ENV_CGROUP] = str(self.path)
        env[ENV_BUDGET] = budget
        return popen_in_cgroup(self.procs_file, argv, env=env, **kw)

    @property
    def made_in(self) -> MemoryCgroup:
        """The cgroup this one was made in: the creating process's own (create makes a child of it)."""
        return MemoryCgroup(self.version, self.path.parent)

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # the last process may still be exiting


def popen_in_cgroup(
    procs_file: Path, argv: Sequence[str], *, death_signal: int = signal.SIGKILL, **kw: Any
) -> subprocess.Popen[Any]:
    """Start argv in the cgroup of `procs_file`: a shell joins it, then execs argv, so that all of argv's
    memory counts there. The process gets `death_signal` when the thread that calls this dies
    (libc.dies_with_parent)."""
    script = 'echo $$ > "$0" && exec "$@"'
    return subprocess.Popen(
        ["/bin/sh", "-c", script, str(procs_file), *argv],
        preexec_fn=dies_with_parent(os.getpid(), death_signal),
        **kw,
    )


def _remove_stale(parent: Path) -> None:
    """Remove the budget cgroups that processes now gone left behind (SIGKILL leaves no time to remove them):
    only an empty cgroup can be removed, so one that still holds a process stays whatever its name says."""
    for child in parent.glob("s2moe-*-*-*"):
        try:
            pid = int(child.name.rsplit("-", 2)[-2])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or reused by another process): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            child.rmdir()
        except OSError:
            pass


def current_budget_cgroup() -> MemoryCgroup | None:
    """The budget cgroup this process was started in (by MemoryCgroup.popen), if any. The environment
    alone is not trusted: the folder must be the cgroup /proc/self/cgroup names, or limits would be
    written into plain files while the run went unlimited."""
    p = os.environ.get(ENV_CGROUP)
    if not p:
        return None
    path = Path(p)
    own = {"/" + q.strip("/") for q in _own_cgroups().values()}
    if not path.is_dir() or not any(str(path).endswith(q) and q != "/" for q in own):
        raise ConfigError(f"{ENV_CGROUP}={p} is not the memory cgroup this process runs in")
    return MemoryCgroup(2 if (path / "memory.max").exists() else 1, path)
