"""The device readings behind the app's device view: /proc, the page cache, the budget cgroup, tegrastats."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from s2moe.engine.device import DeviceMonitor, parse_tegrastats
from s2moe.engine.offload import MemoryCgroup
from s2moe.engine.offload.libc import drop_file_cache
from s2moe.engine.offload.procfs import (block_device, cpu_times, disk_read_bytes, file_cached_bytes, meminfo,
                                         process_read_bytes)

ORIN = ("RAM 2848/30536MB (lfb 6590x4MB) SWAP 0/15268MB (cached 0MB) CPU [2%@729,1%@729,off,off] EMC_FREQ 0%@2133 "
        "GR3D_FREQ 37%@[305,305] VIC_FREQ 729 APE 174 CV0@-256C CPU@46.656C Tboard@36C GPU@41.5C tj@46.656C "
        "VDD_GPU_SOC 2400mW/2300mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 2619mW/2619mW")
XAVIER = ("RAM 1234/7764MB (lfb 1x4MB) CPU [5%@1190,3%@1190] EMC_FREQ 0% GR3D_FREQ 0%@114 APE 150 MTS fg 0% bg 0% "
          "AO@38.5C GPU@37C PMIC@100C POM_5V_IN 2557/2557 POM_5V_GPU 0/0 POM_5V_CPU 425/425")


def test_tegrastats_lines_of_two_jetson_generations():
    orin = parse_tegrastats(ORIN)
    assert orin["gpu_load"] == 37
    assert orin["temps"] == {"CPU": 46.656, "Tboard": 36.0, "GPU": 41.5, "tj": 46.656}  # CV0@-256C is off
    assert orin["power"] == {"VDD_GPU_SOC": 2400, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 2619}
    xavier = parse_tegrastats(XAVIER)
    assert xavier["gpu_load"] == 0 and xavier["temps"]["GPU"] == 37.0
    assert xavier["power"] == {"POM_5V_IN": 2557, "POM_5V_GPU": 0, "POM_5V_CPU": 425}
    assert parse_tegrastats("nothing here") == {"gpu_load": None, "temps": {}, "power": {}}


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
    before = process_read_bytes()
    if before is not None:
        assert before >= 0
    disk = block_device(tmp_path)
    if disk is not None:  # a file system on a block device: its counter exists and only grows
        first = disk_read_bytes(disk)
        assert first is not None and first >= 0 and disk_read_bytes(disk) >= first
    assert disk_read_bytes("no-such-disk") is None


def test_a_monitor_gives_rates_from_the_second_reading_on(tiny_models):
    monitor = DeviceMonitor(str(tiny_models["olmoe"]))
    first = monitor.sample()
    assert first.cpu == [] and first.read_bytes_per_s is None and first.disk_read_bytes_per_s is None
    assert first.model_cached[1] == os.path.getsize(tiny_models["olmoe"])
    second = monitor.sample()
    assert len(second.cpu) == len(cpu_times()) and all(0 <= x <= 1 for x in second.cpu)
    if second.disk is not None:
        assert second.disk_read_bytes_per_s >= 0
    assert second.cgroup is None and second.jetson is None  # no budget here; not a Jetson
    monitor.close()
    assert DeviceMonitor(str(tiny_models["olmoe"].parent / "missing.gguf")).sample().model_cached is None


INSIDE = """
from s2moe.engine.device import DeviceMonitor
g = DeviceMonitor(None).sample().cgroup
print(g["limit"], g["total"] > 0, sorted(g))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_inside_a_budget_cgroup_the_monitor_reads_its_usage_and_limit():
    cg = MemoryCgroup.create(512 << 20, "test-device")
    try:
        proc = cg.popen([sys.executable, "-c", INSIDE], "512M", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
        out, err = proc.communicate(timeout=60)
    finally:
        cg.remove()
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == [str(512 << 20), "True", "['anon',", "'file',", "'limit',", "'locked',", "'total']"]
