"""Surviving llama.cpp's crashes in C: extra CPU buffer types off where the AMX path can kill the process, a
first decode checked in a child process, and a crash that could not be foreseen reported by the next run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from s2moe.engine.crashes import earlier_crashes
from s2moe.engine.decoding import cpu_buffers
from s2moe.engine.decoding.cpu_buffers import CpuBuffers, ProbeOutcome, build_has_amx, choose, probe_in_child
from s2moe.engine.model_info import read_model_info
from tinygguf import TinySpec, write_tiny

SHIPPED = Path(__file__).resolve().parent.parent / "engine" / "zoo" / "models" / "olmoe-64x8.gguf"
SEGFAULT = "import ctypes; ctypes.string_at(0)"


def _s2moe(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "s2moe.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _mixtral_style(path: Path) -> Path:
    """Attention and experts in Q8_0 and a d_model of 256: weights llama.cpp moves into its AMX buffer."""
    return write_tiny(
        path, TinySpec(arch="olmoe", n_layer=2, n_embd=256, n_head=4, n_ff=256, n_expert=8, k=4, seed=5, weights="q8_0")
    )


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """Outcomes remembered in a cache of the test's own, and none carried over in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_buffers, "_chosen", {})
    monkeypatch.delenv(cpu_buffers.AMX_ENV, raising=False)
    return tmp_path / "cache"


def _segfaulting_probe(calls: list):
    def probe(path, on_slow):
        calls.append(path)
        done = subprocess.run([sys.executable, "-c", SEGFAULT], capture_output=True)
        return ProbeOutcome(done.returncode)

    return probe


def _no_probe(path, on_slow):
    raise AssertionError(f"{path} was checked again")


def test_a_first_decode_that_dies_turns_the_extra_buffers_off_and_is_remembered(own_cache, tiny_models, monkeypatch):
    info = read_model_info(str(tiny_models["olmoe"]))
    calls = []
    chosen = choose(info, True, probe=_segfaulting_probe(calls))
    assert chosen.extra is False and chosen.reason == "crashed" and "SIGSEGV" in chosen.detail, chosen
    assert "died in llama.cpp" in chosen.line() and "SIGSEGV" in chosen.line()
    assert calls == [info.path]
    # a later process (no choice made in it yet) reads the outcome instead of dying again
    monkeypatch.setattr(cpu_buffers, "_chosen", {})
    assert choose(info, True, probe=_no_probe) == chosen
    # another model is checked on its own
    other = read_model_info(str(tiny_models["qwen3moe"]))
    assert choose(other, True, probe=_segfaulting_probe(calls)).reason == "crashed"
    assert calls == [info.path, other.path]


def test_the_real_first_decode_runs_cleanly_and_leaves_them_on(own_cache):
    outcome = probe_in_child(SHIPPED)
    assert outcome.clean, outcome.describe()
    chosen = choose(read_model_info(str(SHIPPED)), True)
    assert chosen == CpuBuffers(True, "checked")
    record = json.loads((own_cache / "s2moe" / "cpu-buffers.json").read_text())
    assert [r["clean"] for r in record.values()] == [True]


def test_a_child_that_refuses_the_model_in_words_teaches_nothing(own_cache, tiny_models):
    info = read_model_info(str(tiny_models["olmoe"]))
    assert choose(info, True, probe=lambda path, on_slow: ProbeOutcome(2, "error: bad")) == CpuBuffers(
        True, "unchecked"
    )
    assert not (own_cache / "s2moe" / "cpu-buffers.json").exists()


def test_under_a_budget_nothing_is_checked(own_cache, tiny_models):
    assert choose(read_model_info(str(tiny_models["olmoe"])), False, probe=_no_probe) == CpuBuffers(False, "budget")


def test_an_amx_build_keeps_them_off_unless_the_user_opts_in(own_cache, tiny_models, monkeypatch):
    monkeypatch.setattr(cpu_buffers, "build_has_amx", lambda: True)
    info = read_model_info(str(tiny_models["olmoe"]))
    off = choose(info, True, probe=_no_probe)
    assert off.extra is False and off.reason == "amx" and "--amx" in off.line()
    monkeypatch.setenv(cpu_buffers.AMX_ENV, "1")
    calls = []
    assert choose(info, True, probe=_segfaulting_probe(calls)).reason == "crashed" and calls == [info.path]


def test_generate_records_the_path_in_json_and_amx_reaches_the_environment(tmp_path, tiny_models):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = _s2moe("generate", "-m", str(tiny_models["olmoe"]), "-p", "hi", "-n", "2", "--mode", "ar", "--json", env=env)
    assert done.returncode == 0, done.stderr
    recorded = json.loads(done.stdout)["cpu_buffers"]
    assert recorded == {
        "extra_buffer_types": not build_has_amx(),
        "reason": "amx" if build_has_amx() else "checked",
        "amx_build": build_has_amx(),
    }
    opted = _s2moe(
        "generate", "-m", str(tiny_models["olmoe"]), "-p", "hi", "-n", "2", "--mode", "ar", "--json", "--amx", env=env
    )
    assert opted.returncode == 0, opted.stderr
    assert json.loads(opted.stdout)["cpu_buffers"]["reason"] == "checked"


STOCK_DECODE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
llm.eval(llm.tokenize(b"def merge(a, b):"))
"""


@pytest.mark.skipif(
    not build_has_amx(),
    reason="needs a CPU with AMX and a llama.cpp built for it (its system "
    "line shows AMX_INT8 = 1): this one has none, and llama.cpp's AMX path is not in its build",
)
def test_a_model_stock_llama_cpp_s_amx_path_crashes_on_decodes_on_every_path(tmp_path):
    model = _mixtral_style(tmp_path / "mixtral-style.gguf")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop(cpu_buffers.AMX_ENV, None)
    stock = subprocess.run([sys.executable, "-c", STOCK_DECODE, str(model)], capture_output=True, timeout=120)
    plain = _s2moe(
        "generate", "-m", str(model), "-p", "def merge(a, b):", "-n", "8", "--mode", "ar", "--greedy", env=env
    )
    assert plain.returncode == 0, plain.stderr
    assert "AMX" in plain.stderr and "--amx" in plain.stderr
    drafted = _s2moe("generate", "-m", str(model), "-p", "def merge(a, b):", "-n", "8", "--json", env=env)
    assert drafted.returncode == 0 and json.loads(drafted.stdout)["cpu_buffers"]["reason"] == "amx", drafted.stderr
    # opted in: a first decode in a child finds the crash, and the run goes on with the weights mapped
    opted = _s2moe("generate", "-m", str(model), "-p", "def merge(a, b):", "-n", "8", "--amx", "--json", env=env)
    assert opted.returncode == 0, opted.stderr
    if stock.returncode < 0:
        assert json.loads(opted.stdout)["cpu_buffers"]["reason"] == "crashed", opted.stderr
        assert f"killed by {signal.Signals(-stock.returncode).name}" in opted.stderr


def _crash_in_watched_run(env: dict, model: str = "some/where/mixtral-style.gguf") -> int:
    child = (
        f"from s2moe.engine.crashes import watched\nimport ctypes\n"
        f"with watched('generate', {model!r}):\n    ctypes.string_at(0)\n"
    )
    return subprocess.run([sys.executable, "-c", child], capture_output=True, env=env, timeout=60).returncode


def test_a_crash_in_native_code_is_reported_by_the_next_run_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert _crash_in_watched_run(dict(os.environ)) == -signal.SIGSEGV
    lines = earlier_crashes()
    assert len(lines) == 1, lines
    assert "generate on mixtral-style.gguf" in lines[0] and "Segmentation fault" in lines[0], lines
    kept = list((tmp_path / "state" / "s2moe" / "runs").glob("crash-*.log"))
    assert len(kept) == 1 and "Fatal Python error: Segmentation fault" in kept[0].read_text()
    assert str(kept[0]) in lines[0]
    assert earlier_crashes() == []


def test_a_run_killed_without_a_crash_leaves_no_report(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    child = (
        "from s2moe.engine.crashes import watched\nimport os, signal\n"
        "with watched('bench', None):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", child], env=dict(os.environ), timeout=60).returncode == -9
    assert len(list((tmp_path / "state" / "s2moe" / "runs").glob("run-*.log"))) == 1
    assert earlier_crashes() == []
    assert not list((tmp_path / "state" / "s2moe" / "runs").iterdir())


def test_the_cli_says_what_happened_last_time_and_cleans_up_after_itself(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    assert _crash_in_watched_run(env) == -signal.SIGSEGV
    done = _s2moe("generate", "-p", "hi", "-n", "1", "--mode", "ar", env=env)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "died inside native code" in line]
    assert len(notes) == 1 and "Segmentation fault" in notes[0], done.stderr
    again = _s2moe("generate", "-p", "hi", "-n", "1", "--mode", "ar", env=env)
    assert "died inside native code" not in again.stderr
    # the run's own record went with its clean exit: only the kept report is left
    assert [p.name.split("-")[0] for p in (tmp_path / "state" / "s2moe" / "runs").iterdir()] == ["crash"]


def test_a_budgeted_run_whose_worker_dies_of_a_signal_says_so_at_once(tmp_path, tiny_models):
    from s2moe.engine.offload import MemoryCgroup

    why = MemoryCgroup.unavailable_reason()
    if why is not None:
        pytest.skip(f"no memory cgroup here: {why}")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    runs = tmp_path / "state" / "s2moe" / "runs"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "generate",
            "-m",
            str(tiny_models["olmoe"]),
            "-p",
            "hi",
            "-n",
            "100000",
            "--ignore-eos",
            "--mode",
            "ar",
            "--budget",
            "400M",
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        import time

        deadline, worker = time.monotonic() + 60, None
        while worker is None and time.monotonic() < deadline and parent.poll() is None:
            # the worker's record of its run, written as it starts: ready to be killed as a crash would
            records = [int(p.stem.split("-")[1]) for p in runs.glob("run-*.log")] if runs.exists() else []
            worker = next((pid for pid in records if pid != parent.pid), None)
            time.sleep(0.05)
        assert worker is not None, "the budget's worker never started"
        os.kill(worker, signal.SIGSEGV)
        _, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
        parent.wait()
    assert parent.returncode == 128 + signal.SIGSEGV, err
    assert "died inside native code: Segmentation fault" in err, err
