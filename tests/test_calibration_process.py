"""A calibration in a process of its own (what the app's wizard runs when the app runs inside a budget): the
same events as in this process, a stop passed on, failures coming back as themselves, and the process
started in the cgroup it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from s2moe.engine.decoding.gpu import Placement
from s2moe.engine.errors import ModelError
from s2moe.engine.measure.calibrate import run_calibration
from s2moe.engine.measure.calibration_events import CalibrationDone, StepProgress, StepResult, StepStarted
from s2moe.engine.measure.calibration_process import run_calibration_beside_budget, run_calibration_in
from s2moe.engine.offload import Budget, MemoryCgroup

PROMPTS = ["hello there, how are you", "the cat sat on the mat"]
SETTINGS = {"prompts": PROMPTS, "n_threads": 1, "repeats": 1, "save": False}


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "s2moe" / "profiles"


def test_the_process_yields_what_run_calibration_yields_here(tiny_models, xdg, tmp_path, monkeypatch):
    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tmp_path / "no-cgroups-here"))  # the budget step says why not
    procs = tmp_path / "procs"  # a plain file stands in for a cgroup's: the process writes its pid there
    settings = SETTINGS | {"name": "tiny", "budget": Budget(4 << 30), "placement": Placement(), "n_batch": 64}
    events = list(run_calibration_in(procs, str(tiny_models["olmoe"]), **settings))
    here = list(run_calibration(str(tiny_models["olmoe"]), **settings))
    kinds = [type(e) for e in events if not isinstance(e, StepProgress)]
    assert kinds == [type(e) for e in here if not isinstance(e, StepProgress)]
    assert [(e.index, e.name) for e in events if isinstance(e, StepStarted)] == [
        (e.index, e.name) for e in here if isinstance(e, StepStarted)
    ]
    for there, mine in zip(
        (e for e in events if isinstance(e, StepResult)), (e for e in here if isinstance(e, StepResult))
    ):
        assert there.name == mine.name and sorted(there.data) == sorted(mine.data)
    done = events[-1]
    assert isinstance(done, CalibrationDone) and done.path is None and not (xdg / "tiny.yaml").exists()
    assert sorted(done.profile["models"]) == sorted(here[-1].profile["models"])
    assert done.profile["name"] == "tiny"
    budget_step = [e for e in events if isinstance(e, StepResult) and e.name == "budget"][0]
    assert "no-cgroups-here" in budget_step.summary  # the budget reached the process and was tried there
    # the process started where it was told to (the file kept the pid the shell wrote before its exec)
    assert int(procs.read_text()) > 0


def test_a_stop_is_passed_on_and_nothing_is_made(tiny_models, xdg, tmp_path):
    asked = threading.Event()
    events = []
    for e in run_calibration_in(
        tmp_path / "procs", str(tiny_models["olmoe"]), name="stopped", should_stop=asked.is_set, **SETTINGS
    ):
        events.append(e)
        if isinstance(e, StepResult):
            asked.set()
    assert [e.index for e in events if isinstance(e, StepResult)][:1] == [1]
    assert not any(isinstance(e, CalibrationDone) for e in events)
    assert len([e for e in events if isinstance(e, StepStarted)]) < 7


def test_a_failure_comes_back_as_the_error_it_was(tiny_models, xdg, tmp_path):
    with pytest.raises(ModelError, match="dense"):
        list(run_calibration_in(tmp_path / "procs", str(tiny_models["llama"]), **SETTINGS))
    with pytest.raises(ModelError):
        list(run_calibration_in(tmp_path / "procs", str(tmp_path / "missing.gguf"), **SETTINGS))


def test_outside_a_budget_the_calibration_runs_here(tiny_models, xdg, monkeypatch):
    calls = []

    def fake(model_path, **kw):
        calls.append(model_path)
        yield from ()

    monkeypatch.delenv("S2MOE_BUDGET_CGROUP", raising=False)
    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", fake)
    assert list(run_calibration_beside_budget("m.gguf", **SETTINGS)) == [] and calls == ["m.gguf"]


def _memory_cgroup_of(text: str) -> str:
    """The memory cgroup a /proc/PID/cgroup names: v1's memory line, which comes before v2's "0::" line."""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or not controllers:
            return path
    raise AssertionError(f"no memory cgroup in {text!r}")


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_a_process_inside_a_budget_starts_the_calibration_in_the_cgroup_it_was_made_in(tmp_path):
    cg = MemoryCgroup.create(512 << 20, "test")
    script = (
        "import subprocess, json\n"
        "from s2moe.engine.offload import current_budget_cgroup\n"
        "from s2moe.engine.offload.cgroup import popen_in_cgroup\n"
        "inside = current_budget_cgroup()\n"
        "cat = ['cat', '/proc/self/cgroup']\n"
        "out = popen_in_cgroup(inside.made_in.procs_file, cat, stdout=subprocess.PIPE, text=True)\n"
        "beside = out.communicate()[0]\n"
        "print(json.dumps({'inside': open('/proc/self/cgroup').read(), 'beside': beside}))\n"
    )
    try:
        proc = cg.popen([sys.executable, "-c", script], str(512 << 20), stdout=subprocess.PIPE, text=True)
        out = json.loads(proc.communicate(timeout=60)[0])
    finally:
        cg.remove()
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        mine = _memory_cgroup_of(f.read())
    assert _memory_cgroup_of(out["inside"]).endswith(cg.path.name)
    assert _memory_cgroup_of(out["beside"]) == mine
