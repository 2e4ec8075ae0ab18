"""The device readings behind the app's device view: /proc, the page cache, the budget cgroup, jtop and
tegrastats."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
from s2moe.engine.measure.device import DeviceMonitor, parse_jtop_stats, parse_tegrastats
from s2moe.engine.offload import MemoryCgroup
from s2moe.engine.offload.libc import drop_file_cache
from s2moe.engine.offload.procfs import (
    block_device,
    cpu_times,
    disk_read_bytes,
    file_cached_bytes,
    meminfo,
    process_read_bytes,
)

ORIN = (
    "RAM 2848/30536MB (lfb 6590x4MB) SWAP 0/15268MB (cached 0MB) CPU [2%@729,1%@729,off,off] EMC_FREQ 0%@2133 "
    "GR3D_FREQ 37%@[305,305] VIC_FREQ 729 APE 174 CV0@-256C CPU@46.656C Tboard@36C GPU@41.5C tj@46.656C "
    "VDD_GPU_SOC 2400mW/2300mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 2619mW/2619mW"
)
XAVIER = (
    "RAM 1234/7764MB (lfb 1x4MB) CPU [5%@1190,3%@1190] EMC_FREQ 0% GR3D_FREQ 0%@114 APE 150 MTS fg 0% bg 0% "
    "AO@38.5C GPU@37C PMIC@100C POM_5V_IN 2557/2557 POM_5V_GPU 0/0 POM_5V_CPU 425/425"
)


def test_tegrastats_lines_of_two_jetson_generations():
    orin = parse_tegrastats(ORIN)
    assert orin["gpu_load"] == 37
    assert orin["temps"] == {"CPU": 46.656, "Tboard": 36.0, "GPU": 41.5, "tj": 46.656}  # CV0@-256C is off
    assert orin["power"] == {"VDD_GPU_SOC": 2400, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 2619}
    xavier = parse_tegrastats(XAVIER)
    assert xavier["gpu_load"] == 0 and xavier["temps"]["GPU"] == 37.0
    assert xavier["power"] == {"POM_5V_IN": 2557, "POM_5V_GPU": 0, "POM_5V_CPU": 425}
    assert parse_tegrastats("nothing here") == {"gpu_load": None, "temps": {}, "power": {}, "source": "tegrastats"}


# jtop's `stats` on a Jetson AGX Orin (jetson-stats 4): CPU and engine loads, memory shares, a fan, every thermal
# zone (-256: a sensor that is off) and every power rail in mW with the board's total
ORIN_JTOP_STATS = {
    "time": datetime.datetime(2024, 3, 1, 12, 0, 0),
    "uptime": datetime.timedelta(hours=2, minutes=3),
    "CPU1": 11,
    "CPU2": 7,
    "CPU3": 4,
    "CPU4": 9,
    "CPU5": "OFF",
    "CPU6": "OFF",
    "RAM": 0.31,
    "SWAP": 0.0,
    "EMC": 5,
    "GPU": 37.9,
    "APE": "OFF",
    "NVDEC": "OFF",
    "NVJPG": "OFF",
    "NVJPG1": "OFF",
    "OFA": "OFF",
    "SE": "OFF",
    "VIC": "OFF",
    "Fan pwmfan0": 34.9,
    "Temp CPU": 46.656,
    "Temp CV0": -256,
    "Temp CV1": -256,
    "Temp GPU": 41.5,
    "Temp SOC0": 43.843,
    "Temp tj": 46.656,
    "Power VDD_CPU_CV": 400,
    "Power VDD_GPU_SOC": 2400,
    "Power TOT": 5419,
    "jetson_clocks": "OFF",
    "nvp model": "MAXN",
}


def test_jtop_stats_of_an_orin():
    got = parse_jtop_stats(ORIN_JTOP_STATS)
    assert got["gpu_load"] == 38 and got["source"] == "jtop"
    assert got["temps"] == {"CPU": 46.656, "GPU": 41.5, "SOC0": 43.843, "tj": 46.656}
    assert got["power"] == {"VDD_CPU_CV": 400, "VDD_GPU_SOC": 2400, "TOT": 5419}
    assert parse_jtop_stats({"GPU": "OFF"}) == {"gpu_load": None, "temps": {}, "power": {}, "source": "jtop"}


# The `jtop` package as jetson-stats installs it, reduced to the client calls the device view makes: start()
# connects to the service (JtopException when it does not answer), ok(spin=True) says whether the client still
# runs without waiting, stats is the last reading, close() ends it.
FAKE_JTOP = """
import datetime, os


class JtopException(Exception):
    pass


class jtop:
    def __init__(self, interval=1.0):
        self.interval, self.running = interval, False

    def start(self):
        if os.environ.get("FAKE_JTOP_SERVICE") == "down":
            raise JtopException("The jtop.service is not active. Please run:\\nsudo systemctl restart jtop.service")
        self.running = True

    def ok(self, spin=False):
        return self.running

    @property
    def stats(self):
        return STATS

    def close(self):
        self.running = False


STATS = %r
"""


@pytest.fixture
def installed_jtop(tmp_path, monkeypatch):
    package = tmp_path / "site" / "jtop"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_JTOP % (ORIN_JTOP_STATS,))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "jtop", raising=False)
    yield
    sys.modules.pop("jtop", None)


@pytest.fixture
def installed_tegrastats(tmp_path, monkeypatch):
    """A tegrastats on PATH that prints an Orin's line, as the real one does at each interval."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "tegrastats"
    script.write_text(
        f"#!{sys.executable}\nimport sys, time\nwhile True:\n    print({ORIN!r}, flush=True)\n    time.sleep(0.05)\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def _jetson_reading(monitor, timeout=10.0):
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        jetson = monitor.sample().jetson
        if jetson is not None:
            return jetson
        time.sleep(0.05)
    raise AssertionError("no Jetson reading")


def test_the_monitor_reads_jtop_where_its_service_answers(installed_jtop, installed_tegrastats):
    monitor = DeviceMonitor(None)
    try:
        jetson = _jetson_reading(monitor)
        assert jetson["source"] == "jtop" and jetson["gpu_load"] == 38 and jetson["power"]["TOT"] == 5419
    finally:
        monitor.close()
    assert monitor.jetson is None


def test_without_the_jtop_service_the_monitor_runs_tegrastats(installed_jtop, installed_tegrastats, monkeypatch):
    monkeypatch.setenv("FAKE_JTOP_SERVICE", "down")
    monitor = DeviceMonitor(None)
    proc = monitor.jetson.proc
    try:
        jetson = _jetson_reading(monitor)
        assert jetson == parse_tegrastats(ORIN)
    finally:
        monitor.close()
    assert proc.poll() is not None  # the tegrastats it started is ended with it


def test_no_jetson_reading_without_jtop_or_tegrastats(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no tegrastats
    monkeypatch.setitem(sys.modules, "jtop", None)  # and `import jtop` fails, as without jetson-stats
    monitor = DeviceMonitor(None)
    assert monitor.jetson is None and monitor.sample().jetson is None


def test_page_cache_residency_of_a_file_follows_what_is_dropped(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(os.urandom(1 << 20))
    cached, size = file_cached_bytes(path)
    assert size == 1 << 20 and cached == size  # just written: every page is in memory
    drop_file_cache(path)
    assert file_cached_bytes(path)[0] < size // 4
    path.read_bytes()
    assert file_cached_bytes(path)[0] == size
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_cached_bytes(empty) == (0, 0)


def test_proc_readers_give_consistent_figures(tmp_path):
    m = meminfo()
    assert 0 < m["MemAvailable"] <= m["MemTotal"]
    cores = cpu_times()
    assert len(cores) >= 1 and all(0 <= busy <= total for busy, total in cores)
    disk = block_device(tmp_path)
    if disk is not None:  # a file system on a block device: reading a file from it counts there and here
        path = tmp_path / "cold"
        size = 1 << 20
        path.write_bytes(os.urandom(size))
        drop_file_cache(path)
        assert file_cached_bytes(path)[0] < size // 4
        first, mine = disk_read_bytes(disk), process_read_bytes()
        path.read_bytes()
        assert disk_read_bytes(disk) - first >= size // 2
        assert mine is None or process_read_bytes() - mine >= size // 2  # None: the kernel does not account it
    assert disk_read_bytes("no-such-disk") is None


def test_a_monitor_gives_rates_from_the_second_reading_on(tiny_models):
    monitor = DeviceMonitor(str(tiny_models["olmoe"]))
    first = monitor.sample()
    assert first.cpu == [] and first.read_bytes_per_s is None and first.disk_read_bytes_per_s is None
    assert first.model_cached[1] == os.path.getsize(tiny_models["olmoe"])
    cold = tiny_models["olmoe"].parent / "cold"  # read from the model's disk between the two readings
    cold.write_bytes(os.urandom(1 << 20))
    drop_file_cache(cold)
    cold.read_bytes()
    cold.unlink()
    second = monitor.sample()
    assert len(second.cpu) == len(cpu_times()) and all(0 <= x <= 1 for x in second.cpu)
    if second.disk is not None:
        assert second.disk_read_bytes_per_s > 0
    assert second.cgroup is None and second.jetson is None  # no budget here; not a Jetson
    monitor.close()
    assert DeviceMonitor(str(tiny_models["olmoe"].parent / "missing.gguf")).sample().model_cached is None


def test_this_process_memory_grows_with_what_it_touches():
    from s2moe.engine.offload.procfs import process_memory

    before = process_memory()
    assert 0 < before["RssAnon"] <= before["VmRSS"]
    block = bytearray(64 << 20)  # zero-filled: every page written, so resident
    after = process_memory()
    assert after["RssAnon"] - before["RssAnon"] >= (48 << 20)
    del block
    assert DeviceMonitor(None).sample().process["VmRSS"] > 0


def test_thermal_zones_by_type_leave_out_what_cannot_be_read(tmp_path):
    from s2moe.engine.measure.device import thermal_zones

    for i, (kind, milli) in enumerate(
        [
            ("x86_pkg_temp", "47000"),
            ("acpitz", "27800"),
            ("acpitz", "30000"),
            ("iwlwifi_1", "-274000"),
            ("broken", "n/a"),
        ]
    ):
        zone = tmp_path / f"thermal_zone{i}"
        zone.mkdir()
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(milli + "\n")
    (tmp_path / "thermal_zone9").mkdir()  # no files: a zone whose driver went away
    assert thermal_zones(str(tmp_path)) == {"x86_pkg_temp": 47.0, "acpitz": 27.8, "acpitz 2": 30.0}
    assert thermal_zones(str(tmp_path / "none")) == {}


INSIDE = """
from s2moe.engine.measure.device import DeviceMonitor
g = DeviceMonitor(None).sample().cgroup
print(g["limit"], g["total"] > 0, sorted(g))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_inside_a_budget_cgroup_the_monitor_reads_its_usage_and_limit():
    cg = MemoryCgroup.create(512 << 20, "test-device")
    try:
        proc = cg.popen(
            [sys.executable, "-c", INSIDE], "512M", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out, err = proc.communicate(timeout=60)
    finally:
        cg.remove()
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == [str(512 << 20), "True", "['anon',", "'file',", "'limit',", "'locked',", "'total']"]
