"""What this machine offers to a run: the threads to use, the CPU's name, physical memory; and live
readings of it (memory, page cache, storage reads, CPU per core, the budget cgroup, a Jetson's GPU) for
the app's device view.

No llama.cpp here, so the CLI and the app can ask before a model is loaded.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess


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


# -- live readings for the app's device view --------------------------------------------------------
@dataclass(frozen=True)
class DeviceSample:
    """One reading of what explains offloading's behaviour: memory and swap, the model file in the page
    cache, storage reads, CPU per core, the memory cgroup against its budget and, on a Jetson, the GPU.
    Rates and CPU shares are since the previous reading (None / empty on the first)."""

    t: float
    memory: dict[str, int]  # /proc/meminfo in bytes
    cpu: list[float]  # busy share of each core
    read_bytes_per_s: float | None  # this process's reads from storage
    disk: str | None  # the block device holding the model
    disk_read_bytes_per_s: float | None  # everything read from that device
    model_cached: tuple[int, int] | None  # (bytes of the model file in the page cache, its size)
    cgroup: dict[str, int] | None  # the budget cgroup: total, anon, file, locked, limit
    jetson: dict[str, Any] | None  # jtop or tegrastats: gpu_load (%), temps (°C), power (mW), source
    process: dict[str, int] | None = None  # this process's memory (/proc/self/status: VmRSS, RssAnon, RssFile, …)
    temps: dict[str, float] | None = None  # °C by thermal zone, where no Jetson source gives temperatures


class DeviceMonitor:
    """Takes DeviceSamples; keeps the previous counters for rates. Reading /proc costs milliseconds, the
    model file's page-cache residency one mincore over its pages."""

    def __init__(self, model_path: str | None = None):
        from ..offload.procfs import block_device

        self.model_path = model_path
        self.disk = block_device(model_path) if model_path else None
        self._prev: tuple[float, list[tuple[int, int]], int | None, int | None] | None = None
        # a Jetson's GPU: jtop's service where jetson-stats runs one (it also reads what tegrastats needs root
        # for), else tegrastats itself
        self.jetson = JtopStats.start() or (TegraStats.start() if TegraStats.available() else None)

    def sample(self) -> DeviceSample:
        import time

        from ..errors import ConfigError
        from ..offload.cgroup import current_budget_cgroup
        from ..offload.procfs import (
            cpu_times,
            disk_read_bytes,
            file_cached_bytes,
            meminfo,
            process_memory,
            process_read_bytes,
        )

        t = time.monotonic()
        cpu = cpu_times()
        io = process_read_bytes()
        disk = disk_read_bytes(self.disk) if self.disk else None
        shares: list[float] = []
        rate = disk_rate = None
        if self._prev is not None:
            t0, cpu0, io0, disk0 = self._prev
            dt = max(t - t0, 1e-6)
            shares = [(b - b0) / (n - n0) if n > n0 else 0.0 for (b, n), (b0, n0) in zip(cpu, cpu0)]
            rate = (io - io0) / dt if io is not None and io0 is not None else None
            disk_rate = (disk - disk0) / dt if disk is not None and disk0 is not None else None
        self._prev = (t, cpu, io, disk)
        cached = None
        if self.model_path:
            try:
                cached = file_cached_bytes(self.model_path)
            except OSError:
                cached = None  # the file went away or cannot be mapped: nothing to show, not an error
        try:
            cg = current_budget_cgroup()
        except ConfigError:
            cg = None
        group = None
        if cg is not None:
            group = dict(cg.split(), limit=cg.limit())
        jetson = self.jetson.latest() if self.jetson is not None else None
        return DeviceSample(
            t,
            meminfo(),
            shares,
            rate,
            self.disk,
            disk_rate,
            cached,
            group,
            jetson,
            process_memory() or None,
            None if jetson is not None else thermal_zones() or None,
        )

    def close(self) -> None:
        if self.jetson is not None:
            self.jetson.stop()
            self.jetson = None


def thermal_zones(root: str = "/sys/class/thermal") -> dict[str, float]:
    """°C of each thermal zone the kernel exposes, by its type (x86_pkg_temp, acpitz, …); a zone that cannot
    be read (some fail while their device sleeps) is left out."""
    from pathlib import Path

    out = {}
    for zone in sorted(Path(root).glob("thermal_zone*")):
        try:
            name = (zone / "type").read_text().strip() or zone.name
            value = int((zone / "temp").read_text().strip()) / 1000
        except (OSError, ValueError):
            continue
        if -50 < value < 200:  # outside: a sensor that is off or unplugged reports nonsense
            out[name if name not in out else f"{name} {zone.name[12:]}"] = value
    return out


def parse_jtop_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """GPU load (%), temperatures (°C; -256 is a sensor that is off) and power rails (mW, the current reading,
    TOT the board's total) from jtop's `stats` dictionary (jetson-stats 4: "GPU", "Temp <sensor>",
    "Power <rail>", "Power TOT"), in parse_tegrastats's shape."""
    out: dict[str, Any] = {"gpu_load": None, "temps": {}, "power": {}, "source": "jtop"}
    gpu = stats.get("GPU")
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        out["gpu_load"] = round(gpu)
    for key, value in stats.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue  # "OFF" for an idle engine, a datetime, …
        if key.startswith("Temp ") and value > -200:
            out["temps"][key[5:]] = float(value)
        elif key.startswith("Power "):
            out["power"][key[6:]] = int(value)
    return out


class JtopStats:
    """jetson-stats' jtop service, read through its Python client (the `jtop` package, installed with
    jetson-stats on the Jetson itself, not by s2moe); latest() is its last reading."""

    def __init__(self, client: Any):  # jtop's client: the package has no type information
        self.client = client

    @classmethod
    def start(cls) -> JtopStats | None:
        """A client of the running service; None where jetson-stats is not installed or its service does not
        answer (not running, or this user not in its group)."""
        try:
            from jtop import JtopException, jtop  # type: ignore[import-not-found]  # only on a Jetson, untyped
        except ImportError:
            return None
        client = jtop(interval=1.0)
        try:
            client.start()
        except (JtopException, OSError):
            return None
        return cls(client)

    def latest(self) -> dict[str, Any] | None:
        try:
            if not self.client.ok(spin=True):
                return None
            return parse_jtop_stats(self.client.stats)
        except Exception:  # noqa: BLE001 - ok() re-raises whatever ended the client's thread: no reading
            return None

    def stop(self) -> None:
        self.client.close()


_GR3D = re.compile(r"GR3D_FREQ (\d+)%")
_TEMP = re.compile(r"(\w+)@(-?\d+(?:\.\d+)?)C\b")
_POWER = re.compile(r"\b((?:VDD|POM|VIN)_\w+) (\d+)(?:mW)?/(\d+)(?:mW)?")


def parse_tegrastats(line: str) -> dict[str, Any]:
    """GPU load (%), temperatures (°C, sensors that read -256 are off) and power rails (mW, the current
    reading) from one line of Jetson's tegrastats."""
    out: dict[str, Any] = {"gpu_load": None, "temps": {}, "power": {}, "source": "tegrastats"}
    m = _GR3D.search(line)
    if m:
        out["gpu_load"] = int(m.group(1))
    for name, value in _TEMP.findall(line):
        if float(value) > -200:
            out["temps"][name] = float(value)
    for name, now, _avg in _POWER.findall(line):
        out["power"][name] = int(now)
    return out


class TegraStats:
    """Jetson's tegrastats, run in the background at one line a second; latest() is the last line read."""

    def __init__(self, proc: subprocess.Popen[str]):
        import threading

        self.proc = proc
        self._latest: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    @staticmethod
    def available() -> bool:
        import shutil

        return shutil.which("tegrastats") is not None

    @classmethod
    def start(cls) -> TegraStats | None:
        import subprocess

        try:
            proc = subprocess.Popen(
                ["tegrastats", "--interval", "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return None
        return cls(proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None  # started with its output piped here
        for line in self.proc.stdout:
            self._latest = parse_tegrastats(line)

    def latest(self) -> dict[str, Any] | None:
        return self._latest

    def stop(self) -> None:
        from ..offload.libc import end_process

        end_process(self.proc, 2)
