"""Expert-level offloading on stock llama.cpp: byte ranges, pinning, prefetch, residency, memory budgets.

llama.cpp loads the model with mmap (and `use_extra_bufts = false`, so no weights are copied into
anonymous memory): every weight is a page of the model file in the OS page cache, which the kernel
evicts and fetches on demand. We steer that cache from the outside through our OWN read-only mapping of
the same file (page-cache pages are shared between mappings):

- mlock pins what must never be evicted: the non-expert weights, the llama/ggml library code pages
  (their mappings in this process, from /proc/self/maps) and the hot experts;
- madvise(WILLNEED) before a verification starts reading the experts the draft pass predicted;
- mincore tells which experts are resident (hit rate per layer, a heatmap for the app);
- a memory cgroup (v2, or v1) limits what the decoding process may hold, so the rest pages in from
  storage, after posix_fadvise(DONTNEED) dropped the file from the page cache.

Everything is ctypes on libc; no native code is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import ConfigError, ModelError

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PROT_READ, MAP_SHARED = 0x1, 0x01
MADV_WILLNEED = 3
CODE_LIBS = ("libllama", "libggml", "libs2moe")
ENV_CGROUP = "S2MOE_BUDGET_CGROUP"     # set in a process started inside a budget cgroup
ENV_BUDGET = "S2MOE_BUDGET_BYTES"


# -- sizes ----------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40}


# --budget auto: the process starts under this limit (a guard against runaways only), then sizes its own
# budget once loaded and warmed up (offload_in_cgroup) and lowers the limit to it
AUTO_START_LIMIT = 64 << 30


def parse_budget(text: str) -> int | None:
    """--budget: 'auto' → None (sized by the decoding process itself), else parse_size."""
    return None if text.strip().lower() == "auto" else parse_size(text)


def parse_size(text: str | int) -> int:
    """'800M', '1.5G', '300MiB', '2GB', '123456' → bytes (K/M/G alone are binary, as in `free`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"invalid size {text!r}: use a number with an optional unit, e.g. 800M, 1.5G, 300MiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < PAGE:
        raise ConfigError(f"size {text!r} is too small (at least one page, {PAGE} bytes)")
    return value


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- libc -----------------------------------------------------------------------------------------------
class _Libc:
    def __init__(self):
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


def drop_file_cache(path: str | os.PathLike) -> None:
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


# -- the expert map --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertMap:
    """Byte ranges of every expert (gate/up/down slices of the *_exps tensors) and of everything else.

    ranges[layer, expert, part] = (file offset, length); part follows `parts[layer]` (tensor names).
    An expert tensor of ggml shape [..., n_expert] stores expert e as the contiguous slab
    [data_offset + e·n_bytes/n_expert, + n_bytes/n_expert).
    """

    path: Path
    file_bytes: int
    n_layer: int
    n_expert: int
    ranges: np.ndarray                     # [n_layer, n_expert, n_parts, 2] int64
    parts: tuple[tuple[str, ...], ...]     # per layer: names of its expert tensors
    non_expert: tuple[tuple[int, int], ...]  # (offset, length) of every other tensor
    moe_layers: tuple[int, ...]
    non_expert_names: tuple[str, ...] = ()

    def pinnable(self) -> list[tuple[int, int]]:
        """Non-expert ranges worth pinning: all but the token embedding table when the model has a separate
        output matrix (a decode reads one embedding row per token; pinning the table wastes the budget)."""
        names = self.non_expert_names or ("",) * len(self.non_expert)
        untied = "output.weight" in names
        return [r for r, n in zip(self.non_expert, names) if not (untied and n == "token_embd.weight")]

    @property
    def expert_bytes(self) -> np.ndarray:
        """[n_layer] bytes of one expert of each layer (0 for a layer without experts)."""
        return self.ranges[:, 0, :, 1].sum(axis=1)

    @property
    def total_expert_bytes(self) -> int:
        return int(self.ranges[..., 1].sum())

    @property
    def non_expert_bytes(self) -> int:
        return int(sum(n for _, n in self.non_expert))

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        return [(int(o), int(n)) for o, n in self.ranges[layer, expert] if n > 0]


def expert_map(path: str | os.PathLike) -> ExpertMap:
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception:
        raise ModelError(f"damaged or truncated GGUF: {path}") from None
    by_layer: dict[int, list] = {}
    non_expert = []
    names = []
    n_expert = 0
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if "_exps." in t.name and m:
            ne = int(t.shape[-1])
            n_expert = max(n_expert, ne)
            by_layer.setdefault(int(m.group(1)), []).append(t)
        else:
            non_expert.append((int(t.data_offset), int(t.n_bytes)))
            names.append(t.name)
    if not by_layer:
        raise ModelError(f"{path.name} has no expert tensors (*_exps): it is not a Mixture-of-Experts model")
    n_layer = max(by_layer) + 1
    n_parts = max(len(v) for v in by_layer.values())
    ranges = np.zeros((n_layer, n_expert, n_parts, 2), np.int64)
    parts = []
    for layer in range(n_layer):
        tensors = sorted(by_layer.get(layer, []), key=lambda t: int(t.data_offset))
        parts.append(tuple(t.name for t in tensors))
        for p, t in enumerate(tensors):
            ne = int(t.shape[-1])
            slab = int(t.n_bytes) // ne
            ranges[layer, :ne, p, 0] = int(t.data_offset) + np.arange(ne, dtype=np.int64) * slab
            ranges[layer, :ne, p, 1] = slab
    return ExpertMap(path, path.stat().st_size, n_layer, n_expert, ranges, tuple(parts), tuple(non_expert),
                     tuple(sorted(by_layer)), tuple(names))


# -- hot experts -----------------------------------------------------------------------------------------
def select_hot_experts(counts: np.ndarray, expert_bytes, budget_bytes: int) -> list[tuple[int, int]]:
    """Most-routed experts first, as many as fit in budget_bytes. counts: [n_layer, n_expert] routing
    frequencies; expert_bytes: bytes of one expert (scalar or per layer). Experts never routed are skipped."""
    counts = np.asarray(counts, dtype=np.float64)
    n_layer, n_expert = counts.shape
    size = np.broadcast_to(np.asarray(expert_bytes, dtype=np.int64).reshape(-1, 1) if np.ndim(expert_bytes)
                           else np.int64(expert_bytes), (n_layer, n_expert))
    order = sorted(((-counts[l, e], l, e) for l in range(n_layer) for e in range(n_expert) if counts[l, e] > 0))
    out, used = [], 0
    for _, layer, expert in order:
        b = int(size[layer, expert])
        if b <= 0 or used + b > budget_bytes:
            continue
        used += b
        out.append((int(layer), int(expert)))
    return out


@dataclass(frozen=True)
class BudgetPlan:
    """How a memory budget splits: what the process holds anyway, what is pinned, what caches experts."""

    budget_bytes: int
    anon_bytes: int          # the process's own memory (interpreter, llama.cpp buffers, KV cache)
    base_bytes: int          # pinned non-expert weights + library code
    hot_bytes: int           # room for pinned hot experts
    cache_bytes: int         # left for cold experts in the page cache
    slack_bytes: int = 0     # kept free for the process's memory to grow (buffers, Python objects)

    def describe(self) -> str:
        return (f"budget {fmt_bytes(self.budget_bytes)} = process {fmt_bytes(self.anon_bytes)} + slack "
                f"{fmt_bytes(self.slack_bytes)} + pinned weights {fmt_bytes(self.base_bytes)} + hot experts "
                f"{fmt_bytes(self.hot_bytes)} + expert cache {fmt_bytes(self.cache_bytes)}")


def plan_budget(budget_bytes: int, *, anon_bytes: int, base_bytes: int, emap: ExpertMap, k: int,
                hot_share: float = 0.5) -> BudgetPlan:
    """Split a budget: hot experts get `hot_share` of the room left for experts, but the cache for cold
    experts keeps at least half of one token's experts (k/2 per layer; the other half is likely hot)."""
    slack = min(32 << 20, max(4 << 20, budget_bytes // 20))
    room = max(0, budget_bytes - anon_bytes - base_bytes - slack)
    per_token = int(k * emap.expert_bytes.sum())
    reserve = min(room, max(int(room * (1 - hot_share)), per_token // 2))
    return BudgetPlan(budget_bytes, anon_bytes, base_bytes, room - reserve, reserve, slack)


AUTO_EXPERT_SHARE = 1 / 3


def auto_budget_bytes(cg: "MemoryCgroup", emap: ExpertMap, share: float = AUTO_EXPERT_SHARE) -> int:
    """`--budget auto` for a process already running inside `cg`, loaded and warmed up: everything the
    cgroup holds now except the model's expert pages (anonymous memory, pinned weights, library and
    Python file pages), plus `share` of the expert bytes as the expert cache, plus a little slack.

    Counting what the cgroup really holds matters: a budget built from the anonymous memory alone left
    the expert cache near zero (every expert missed on every token, measured) because the interpreter's
    and libraries' file pages are charged to the same cgroup."""
    mapping = ModelMapping(emap)
    try:
        resident = float((mapping.expert_residency() * emap.expert_bytes[:, None]).sum())
    finally:
        mapping.close()
    held = max(0, cg.usage() - int(resident))
    # the slack absorbs what the heap still grows by in the first real generations (measured: ~1 MiB on
    # the shipped model after a warm-up), so that the expert cache keeps its share
    return int(held + share * emap.total_expert_bytes + max(2 << 20, held // 50))


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


MADV_NORMAL, MADV_RANDOM = 0, 1


# -- residency metrics -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Residency:
    """A residency snapshot, e.g. for the app's heatmap."""

    resident: np.ndarray     # [n_layer, n_expert] fraction of each expert's pages in memory
    pinned: np.ndarray       # [n_layer, n_expert] bool
    hit_rate: np.ndarray     # [n_layer] predicted experts already resident when a verification started (nan: none)
    lookups: int
    prefetched_bytes: int
    locked_bytes: int


@dataclass
class OffloadStats:
    hits: np.ndarray
    lookups: np.ndarray
    prefetch_calls: int = 0
    prefetched_bytes: int = 0
    prefetch_seconds: float = 0.0

    def hit_rate(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.lookups > 0, self.hits / np.maximum(self.lookups, 1), np.nan)


class ModelMapping:
    """Our own read-only shared mapping of the model file: mlock / madvise / mincore on its pages."""

    def __init__(self, emap: ExpertMap):
        self.emap = emap
        self.size = emap.file_bytes
        self.c = libc()
        self.fd = os.open(str(emap.path), os.O_RDONLY)
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
            res = np.frombuffer(vec, dtype=np.uint8) & 1
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
                total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE
        return total

    def pin_experts(self, pairs) -> int:
        total = 0
        for layer, expert in pairs:
            for o, n in self.emap.expert_ranges(layer, expert):
                total += self.lock_range(o, n)
            self._pinned[layer, expert] = True
        return total

    def unpin_all(self) -> None:
        for a, n in self.locked:
            self.c.lib.munlock(a, n)
        self.locked.clear()
        self.locked_bytes = 0
        self._pinned[:] = False

    def willneed(self, layer: int, expert: int) -> int:
        total = 0
        for o, n in self.emap.expert_ranges(layer, expert):
            a, m = self._span(o, n)
            self.c.lib.madvise(a, m, MADV_WILLNEED)
            total += m
        return total

    def pages(self) -> np.ndarray:
        """Page-cache residency of every page of the file (1 = resident)."""
        rc = self.c.lib.mincore(self.addr, self.size, self._vec)
        self.c.check(rc, "mincore")
        return np.frombuffer(self._vec, dtype=np.uint8) & 1

    def expert_residency(self, pages: np.ndarray | None = None) -> np.ndarray:
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
    def pinned(self) -> np.ndarray:
        return self._pinned.copy()

    def close(self) -> None:
        if getattr(self, "addr", None):
            self.unpin_all()
            self.c.lib.munmap(self.addr, self.size)
            self.addr = 0
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
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
        return (f"cannot pin {fmt_bytes(n)} with mlock ({os.strerror(e)}; locked-memory limit {limit}): run as root, "
                f"or raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity under systemd)")
    return f"mlock failed: {os.strerror(e)}"


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


class Offloader:
    """Pinning, routing-driven prefetch and residency metrics for one decoder.

        off = Offloader(decoder.info.path, n_layer=..., prefetch=True)
        off.pin(hot=[(0, 3), ...])                 # non-expert weights + library code + hot experts
        decoder.before_verify = off.before_verify  # prefetch predicted experts, count hits
    """

    def __init__(self, model_path, *, prefetch: bool = True, emap: ExpertMap | None = None,
                 prefetch_bytes: int | None = None):
        self.emap = emap or expert_map(model_path)
        self.map = ModelMapping(self.emap)
        self.prefetch = prefetch
        # At most this many bytes are asked for per verification (None: no limit). Prefetching more than
        # the expert cache holds evicts what was fetched before it is used.
        self.prefetch_bytes = prefetch_bytes
        n = self.emap.n_layer
        self.stats = OffloadStats(np.zeros(n), np.zeros(n))
        self.pinned_split = {"non_expert": 0, "code": 0, "hot_experts": 0}
        self.fault_readahead = "default"
        # counts misses for the routing hook (and prefetches just in time when attach_offloading says so)
        self.native = NativePrefetch(self.map, advise=False)
        self._hook = None  # the routing hook that calls self.native, if attach_offloading set one
        self._decoder = None  # the decoder attach_offloading wired us into

    def pin(self, *, non_expert: bool = True, code: bool = True, hot=()) -> dict:
        raise_memlock_limit()
        if non_expert:
            self.pinned_split["non_expert"] += self.map.pin_non_expert()
        if code:
            self.pinned_split["code"] += self.map.pin_code()
        if hot:
            self.pinned_split["hot_experts"] += self.map.pin_experts(hot)
        return dict(self.pinned_split)

    def unpinned_non_expert(self) -> list[tuple[int, int]]:
        """File ranges of non-expert tensors that pinning leaves to the page cache (the token embedding
        table when a separate output matrix exists): read one row per token, at random."""
        pinned = set(self.emap.pinnable())
        return [r for r in self.emap.non_expert if r not in pinned and r[1] > 0]

    def advise_fault_readahead(self, random: bool) -> int:
        """madvise llama.cpp's mapping of the model so that a page fault reads only the faulting page
        (MADV_RANDOM) instead of a read-around window (read_ahead_kb, up to MiBs): on the unpinned
        embedding table always — one token's row is a few hundred bytes, and a window around it reads
        (and makes room for) MiBs of neighbouring experts every step; on the expert tensors when
        `random`, else they get MADV_NORMAL back. Returns the bytes advised RANDOM."""
        lo = int(self.emap.ranges[..., 0][self.emap.ranges[..., 1] > 0].min())
        hi = int((self.emap.ranges[..., 0] + self.emap.ranges[..., 1]).max())
        spans = [(o, o + n, MADV_RANDOM) for o, n in self.unpinned_non_expert()]
        spans.append((lo, hi, MADV_RANDOM if random else MADV_NORMAL))
        total = 0
        for addr, length, foff in model_mappings(self.emap.path, exclude=self.map.addr):
            for s_lo, s_hi, advice in spans:
                a, b = max(s_lo, foff), min(s_hi, foff + length)
                if b <= a:
                    continue
                # whole pages only, and only inside the span: a page shared with a pinned tensor is resident
                start_al = (addr + (a - foff) + PAGE - 1) // PAGE * PAGE
                end_al = (addr + (b - foff)) // PAGE * PAGE
                if end_al > start_al and self.map.c.lib.madvise(start_al, end_al - start_al, advice) == 0 \
                        and advice == MADV_RANDOM:
                    total += end_al - start_al
        self.fault_readahead = "off" if random else ("embeddings-off" if total else "default")
        return total

    def before_verify(self, predicted: np.ndarray) -> None:
        """Decoder.before_verify: count predicted experts already resident; WILLNEED the others."""
        t0 = time.perf_counter()
        predicted = np.asarray(predicted, bool)
        hit = self.native.resident(predicted)  # looks at the predicted experts' pages only
        self.stats.lookups += predicted.sum(axis=1)
        self.stats.hits += (predicted & hit).sum(axis=1)
        if self.prefetch:
            room = self.prefetch_bytes if self.prefetch_bytes is not None else 1 << 62
            eb = self.emap.expert_bytes
            for layer, expert in zip(*np.nonzero(predicted & ~hit)):  # layer order: earliest needed first
                if eb[layer] > room:
                    break
                room -= int(eb[layer])
                self.stats.prefetched_bytes += self.map.willneed(int(layer), int(expert))
            self.stats.prefetch_calls += 1
        self.stats.prefetch_seconds += time.perf_counter() - t0

    def residency(self) -> Residency:
        return Residency(self.map.expert_residency(), self.map.pinned, self.stats.hit_rate(),
                         int(self.stats.lookups.sum()), self.stats.prefetched_bytes, self.map.locked_bytes)

    def close(self) -> None:
        """Release the mapping and pins, and detach from the decoder attach_offloading wired us into: the
        C hook must not call into a freed prefetcher, nor the decoder into a closed offloader."""
        hook, self._hook = self._hook, None
        if hook is not None and hook._route is self.native:
            hook.clear_route()
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            for attr, ours in (("before_verify", self.before_verify), ("residency_probe", self.residency),
                               ("miss_counter", self.native)):
                if getattr(decoder, attr, None) == ours:
                    setattr(decoder, attr, None)
        self.native.close()
        self.map.close()


# -- memory cgroups --------------------------------------------------------------------------------------
class BudgetUnavailable(Exception):
    """No memory cgroup can be made here; the message says why and what to do instead."""


def _how(limit_hint: str = "SIZE") -> str:
    return (f"run as root, or under a delegated cgroup, e.g. `systemd-run --user --scope -p MemoryMax={limit_hint} "
            f"-p MemorySwapMax=0 s2moe ...` (then leave out --budget)")


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
        for mnt, fs, opts in mounts:
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
    def create(cls, limit_bytes: int, tag: str = "run") -> "MemoryCgroup":
        version, parent = cls.locate()
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
            (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
            try:  # no swapping either (when swap accounting is on)
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

    def limit(self) -> int:
        text = self._read("memory.max" if self.version == 2 else "memory.limit_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def split(self) -> dict[str, int]:
        """What the cgroup holds now: anonymous, file pages (page cache), locked (unevictable)."""
        s = self.stat()
        if self.version == 2:
            return {"anon": s.get("anon", 0), "file": s.get("file", 0), "locked": s.get("unevictable", 0),
                    "total": self.usage()}
        return {"anon": s.get("rss", 0), "file": s.get("cache", 0), "locked": s.get("unevictable", 0),
                "total": self.usage()}

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

    def popen(self, argv, **kw) -> subprocess.Popen:
        """Start argv inside this cgroup (the shell joins it, then execs argv: all its memory counts)."""
        env = dict(kw.pop("env", None) or os.environ)
        env[ENV_CGROUP] = str(self.path)
        env[ENV_BUDGET] = str(self.limit())
        script = 'echo $$ > "$0" && exec "$@"'
        return subprocess.Popen(["/bin/sh", "-c", script, str(self.procs_file), *argv], env=env, **kw)

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # the last process may still be exiting


def current_budget_cgroup() -> MemoryCgroup | None:
    """The budget cgroup this process was started in (by MemoryCgroup.popen), if any."""
    p = os.environ.get(ENV_CGROUP)
    if not p or not Path(p).is_dir():
        return None
    return MemoryCgroup(2 if (Path(p) / "memory.max").exists() else 1, Path(p))


def split_line(cg: MemoryCgroup, offloader: Offloader | None = None) -> str:
    s = cg.split()
    parts = [f"memory budget {fmt_bytes(cg.limit())}: peak {fmt_bytes(cg.peak())}, now anonymous "
             f"{fmt_bytes(s['anon'])} · file pages {fmt_bytes(s['file'])} (locked {fmt_bytes(s['locked'])})"]
    if offloader is not None:
        p = offloader.pinned_split
        parts.append(f"pinned: weights {fmt_bytes(p['non_expert'])}, code {fmt_bytes(p['code'])}, "
                     f"hot experts {fmt_bytes(p['hot_experts'])}")
        hr = offloader.stats.hit_rate()
        if np.isfinite(hr).any():
            parts.append(f"predicted-expert hit rate {np.nanmean(hr):.0%}")
    return " · ".join(parts)


def _sigterm_as_interrupt():
    """SIGTERM → KeyboardInterrupt in the main thread, so that clean-up (the cgroup) runs."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def run_under_budget(argv: list[str], budget_bytes: int, model_path, *, tag: str = "run",
                     described: str | None = "") -> int:
    """Run argv (a python command line) in a fresh memory cgroup limited to budget_bytes, after dropping
    the model file from the page cache. Returns its exit status. Raises BudgetUnavailable."""
    cg = MemoryCgroup.create(budget_bytes, tag)
    try:
        drop_file_cache(model_path)
        proc = cg.popen(argv)
        previous = _sigterm_as_interrupt()
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        finally:
            _restore_sigterm(previous)
        if rc < 0 and cg.oom_kills() > 0:
            # described=None: the child sized its own limit (bench --budget auto)
            what = fmt_bytes(budget_bytes) if described == "" else (described or "set by the run itself")
            print(f"error: the budget ({what}) is too small: the decoding process was killed "
                  f"when out of memory (peak {fmt_bytes(cg.peak())}); raise --budget", file=sys.stderr)
            return 2
        return rc
    finally:
        cg.remove()


def attach_offloading(decoder, budget_bytes: int | None, hot_ranked=(), *, prefetch: bool = False,
                      jit_prefetch: bool = True, pin_hot: bool = True, pin_base: bool = True,
                      pin_code: bool = True) -> tuple[Offloader, BudgetPlan | None]:
    """Pin non-expert weights + library code, then the longest prefix of the ranked hot experts that the
    budget's plan allows. The plan counts the process's anonymous memory and everything pinned.

    Prefetch: `jit_prefetch` has the routing hook ask for each layer's experts the moment its ids are
    final, before that layer's expert matmuls (measured: 1.98x plain decoding, 1.24x self-speculation on
    OLMoE-sized experts under a budget). `prefetch` asks for the draft-predicted experts before each
    verification instead (decoder.before_verify; measured 0.93x: too late to overlap), off by default."""
    off = Offloader(decoder.info.path, prefetch=prefetch)
    if pin_base:
        off.pin(code=pin_code, hot=())
    plan = None
    hot = []
    if pin_hot and hot_ranked:
        eb = off.emap.expert_bytes
        if budget_bytes is not None:
            plan = plan_budget(budget_bytes, anon_bytes=process_anon_bytes(),
                               base_bytes=off.map.locked_bytes, emap=off.emap, k=decoder.info.n_expert_used)
            room = plan.hot_bytes
        else:
            room = off.emap.total_expert_bytes
        hot = select_hot_experts(_rank_counts(hot_ranked, off.emap), eb, room)
        off.pin(non_expert=False, code=False, hot=hot)
    elif budget_bytes is not None:
        plan = plan_budget(budget_bytes, anon_bytes=process_anon_bytes(), base_bytes=off.map.locked_bytes,
                           emap=off.emap, k=decoder.info.n_expert_used, hot_share=0.0)
    if plan is not None:
        off.prefetch_bytes = plan.cache_bytes
        # A fault reads a whole read-around window. Where that window dwarfs an expert's slices, each
        # fault drags in many unrelated experts and, in a small cache, evicts the ones in use: fault
        # page by page there instead (prefetch still reads exact ranges ahead).
        slab = int(off.emap.ranges[..., 1].max())
        window = read_ahead_bytes(off.emap.path)
        choice = os.environ.get("S2MOE_FAULT_READAHEAD", "auto")  # auto | off | default (experiments)
        if choice != "default":
            off.advise_fault_readahead(random=choice == "off" or slab * 4 <= window)
    decoder.before_verify = off.before_verify  # counts predicted-expert hits; madvises only if prefetch
    off._decoder = decoder
    if hasattr(decoder, "residency_probe"):
        decoder.residency_probe = off.residency
    # The hook hands every layer's final ids to the native prefetcher, which counts the experts not in
    # memory at that moment (a verification's misses) and, with jit_prefetch, asks the OS for them.
    hook = getattr(getattr(decoder, "rt", None), "hook", None)
    if hook is not None:
        off.native.advise = jit_prefetch
        hook.set_route(off.native)
        off._hook = hook
        if hasattr(decoder, "miss_counter"):
            decoder.miss_counter = off.native
    return off, plan


def offload_in_cgroup(decoder, cg: "MemoryCgroup", budget: int | None, hot_ranked=(),
                      warm_up: Callable[[], None] | None = None) -> tuple[Offloader, int]:
    """Offload a decoder running inside its memory cgroup `cg`. budget None means auto: run `warm_up`
    (every graph shape and buffer the run will need), size the budget from what the cgroup then holds
    (auto_budget_bytes), and lower the limit to it once pinning is in place. Returns the offloader and
    the budget in bytes."""
    auto = budget is None
    if auto:
        if warm_up is not None:
            warm_up()
        emap = expert_map(decoder.info.path)
        budget = auto_budget_bytes(cg, emap)  # provisional: sizes the hot-expert plan
    off, _ = attach_offloading(decoder, budget, hot_ranked)
    if auto:
        # Measured again now that the offloader exists: its own memory (the GGUF tensor table, residency
        # buffers: about 5 MiB on the shipped model) would otherwise come out of the expert cache.
        budget = auto_budget_bytes(cg, emap)
        try:
            cg.set_limit(budget)  # reclaims the warm-up's expert pages down to the budget
        except OSError as e:  # EBUSY: the kernel could not reclaim down to it
            off.close()
            raise ConfigError(f"cannot lower the memory limit to the auto budget {fmt_bytes(budget)}: the process "
                              f"holds {fmt_bytes(cg.usage())} it cannot give back ({e.strerror}); give --budget "
                              "a size instead") from None
        decoder._measured.clear()  # the warm-up measured resident costs; measure again under the budget
    return off, budget


def _rank_counts(ranked, emap: ExpertMap) -> np.ndarray:
    """Pseudo-counts that keep a ranked [layer, expert] list's order (most routed first)."""
    counts = np.zeros((emap.n_layer, emap.n_expert))
    n = len(ranked)
    for i, (layer, expert) in enumerate(ranked):
        if 0 <= layer < emap.n_layer and 0 <= expert < emap.n_expert:
            counts[layer, expert] = n - i
    return counts


class NativePrefetch:
    """The C prefetcher (native/s2moe_offload.c) over a ModelMapping: madvise(WILLNEED) of exact expert
    ranges without Python in the loop. `handle` and `layer_fn_address` let native code (the routing hook)
    call s2_prefetch_layer(handle, layer, ids, n) the moment a layer's top-k ids are known.

    The same call counts, per layer, the experts that are not wholly in memory at that moment (mincore on
    their own ranges): begin() / counted() bracket a decode. With advise=False it only counts. Every
    residency question here costs in proportion to the experts asked about, never to the file's size."""

    def __init__(self, mapping: ModelMapping, *, advise: bool = True):
        from .. import native

        lib = native.library()
        vp, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
        u8p = ctypes.POINTER(ctypes.c_uint8)
        sigs = {
            "s2_prefetch_new": (vp, [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64p]),
            "s2_prefetch_free": (None, [vp]),
            "s2_prefetch_configure": (None, [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]),
            "s2_prefetch_resident": (ctypes.c_int, [vp, u8p, u8p]),
            "s2_prefetch_layer": (ctypes.c_int, [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32), ctypes.c_int]),
            "s2_prefetch_mask": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_uint8)]),
            "s2_prefetch_bytes": (ctypes.c_int64, [vp]),
            "s2_prefetch_calls": (ctypes.c_int64, [vp]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib, self.mapping = lib, mapping
        em = mapping.emap
        self._ranges = np.ascontiguousarray(em.ranges, dtype=np.int64)
        self.handle = lib.s2_prefetch_new(mapping.addr, mapping.size, em.n_layer, em.n_expert,
                                          self._ranges.shape[2], self._ranges.ctypes.data_as(i64p))
        if not self.handle:
            raise MemoryError("native prefetcher: allocation failed")
        self.misses = np.zeros(em.n_layer, np.int32)
        self._shape = (em.n_layer, em.n_expert)
        self.advise = advise

    @property
    def advise(self) -> bool:
        return self._advise

    @advise.setter
    def advise(self, on: bool) -> None:
        self._advise = bool(on)
        self.lib.s2_prefetch_configure(self.handle, int(on), self.misses.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))

    def begin(self) -> None:
        """Start counting misses for the next decode (Decoder.miss_counter)."""
        self.misses[:] = 0

    def counted(self) -> np.ndarray:
        """[n_layer] experts the decode since begin() read that were not wholly in memory as it routed."""
        return self.misses.copy()

    def resident(self, mask: np.ndarray) -> np.ndarray:
        """[n_layer, n_expert] bool: of the experts set in mask, those whose every page is in memory."""
        m = np.ascontiguousarray(mask, dtype=np.uint8)
        out = np.zeros(self._shape, np.uint8)
        u8p = ctypes.POINTER(ctypes.c_uint8)
        self.lib.s2_prefetch_resident(self.handle, m.ctypes.data_as(u8p), out.ctypes.data_as(u8p))
        return out.astype(bool)

    @property
    def layer_fn_address(self) -> int:
        return ctypes.cast(self.lib.s2_prefetch_layer, ctypes.c_void_p).value

    def layer(self, layer: int, ids) -> int:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        return int(self.lib.s2_prefetch_layer(self.handle, int(layer), ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                              len(ids)))

    def mask(self, mask: np.ndarray) -> int:
        m = np.ascontiguousarray(mask, dtype=np.uint8)
        return int(self.lib.s2_prefetch_mask(self.handle, m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))))

    @property
    def bytes_advised(self) -> int:
        return int(self.lib.s2_prefetch_bytes(self.handle))

    def close(self) -> None:
        if getattr(self, "handle", None):
            self.lib.s2_prefetch_free(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
