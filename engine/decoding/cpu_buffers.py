"""Whether llama.cpp may move a model's CPU weights into its extra buffer types (the AMX layout, the
repacked layouts) or must leave them mapped from the file.

llama.cpp's AMX matmul kills the process on some models (a segmentation fault at the first decode, an
upstream crash class without a fix), and a crash in C takes the user's session with it. So where the
llama.cpp build has AMX the extra buffer types are off unless the user opts in (`--amx`, or S2MOE_AMX=1
in the environment, which every child process inherits). Where they would be on, a model this machine has
not yet decoded that way is first decoded in a child process; a child killed by a signal turns them off for
that model, and the outcome is remembered per model and llama.cpp build, so the check runs once.

Under a memory budget they are always off: offloading pages weights in and out of the mapped file, and
a repacked copy lives in anonymous memory that cannot page.

    python -m s2moe.engine.decoding.cpu_buffers MODEL.gguf   # the child's first decode (exit 0, or dies)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import S2MoEError
from ..model_info import ModelInfo

AMX_ENV = "S2MOE_AMX"
# A first decode of a 25 MB model takes under a second; a 30 GB one that llama.cpp repacks reads the whole
# file first. Past this the child is stopped and the model runs with its weights mapped.
PROBE_TIMEOUT_S = 600.0
SLOW_S = 2.0  # a wait longer than this is said
# Tokens of the child's first decode: one batch of several rows, then single rows, the two shapes decoding uses.
PROBE_BATCH = 8
PROBE_STEPS = 2
_RECORDS_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class CpuBuffers:
    """The path a run's CPU weights take, and in a few words why."""

    extra: bool
    reason: str  # one of REASONS
    detail: str = ""

    def line(self) -> str:
        head = (
            "CPU weights: llama.cpp's extra buffer types (AMX, repacked layouts) on"
            if self.extra
            else "CPU weights: mapped from the file, llama.cpp's extra buffer types (AMX, repacked layouts) off"
        )
        return f"{head} — {REASONS[self.reason]}{f' ({self.detail})' if self.detail else ''}"

    def as_dict(self) -> dict[str, Any]:
        return {"extra_buffer_types": self.extra, "reason": self.reason, "amx_build": build_has_amx()}


REASONS = {
    "budget": "a memory budget pages weights from the file",
    "amx": f"this llama.cpp has AMX, whose matmul crashes on some models; --amx (or {AMX_ENV}=1) opts in",
    "crashed": "a first decode with them died in llama.cpp on this machine",
    "checked": "a first decode with them ran cleanly on this machine",
    "unchecked": "the check in a child refused the model before decoding: on, as in stock llama.cpp",
}


@lru_cache(maxsize=1)
def build_has_amx() -> bool:
    """Whether this llama.cpp was built with AMX kernels (its system line says AMX_INT8 = 1). ggml compiles
    them only for a CPU that has AMX (a native build on one), so this is also whether the CPU runs them."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def amx_opted_in() -> bool:
    return os.environ.get(AMX_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class ProbeOutcome:
    returncode: int | None  # None: stopped after PROBE_TIMEOUT_S
    tail: str = ""  # the child's last line of stderr

    @property
    def clean(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        from ..crashes import exit_text

        if self.returncode is None:
            return f"no first decode within {PROBE_TIMEOUT_S:.0f} s"
        return exit_text(self.returncode) + (f": {self.tail}" if self.tail and self.returncode > 0 else "")


Probe = Callable[[Path, Callable[[str], None] | None], ProbeOutcome]


def probe_in_child(path: Path, on_slow: Callable[[str], None] | None = None) -> ProbeOutcome:
    """The first decode with extra buffer types, in a process of its own; `on_slow` hears one line if it
    takes longer than SLOW_S (a large model's load)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            _, err = proc.communicate(timeout=SLOW_S)
        except subprocess.TimeoutExpired:
            if on_slow is not None:
                on_slow(
                    f"checking that llama.cpp decodes {path.name} with its extra CPU buffer types "
                    "(once per model on this machine)…"
                )
            _, err = proc.communicate(timeout=PROBE_TIMEOUT_S - SLOW_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return ProbeOutcome(None)
    finally:
        if proc.poll() is None:  # Ctrl-C while waiting: the child goes too
            proc.kill()
            proc.wait()
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return ProbeOutcome(proc.returncode, lines[-1] if lines else "")


def _records_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "s2moe" / "cpu-buffers.json"


def _load_records() -> dict[str, Any]:
    # A cache of outcomes: one unreadable is checked again rather than trusted or reported.
    from ..files import read_json

    try:
        records = read_json(_records_file(), "record", _RECORDS_MAX_BYTES)
    except S2MoEError:
        return {}
    return records if isinstance(records, dict) else {}


def _save_record(key: str, record: dict[str, Any]) -> None:
    from ..files import write_atomic

    records = _load_records()
    records[key] = record
    try:
        _records_file().parent.mkdir(parents=True, exist_ok=True)
        write_atomic(_records_file(), json.dumps(records, indent=1, sort_keys=True) + "\n", "record")
    except (OSError, S2MoEError):
        pass  # a read-only cache only means the next run checks again


_chosen: dict[tuple[str, bool], CpuBuffers] = {}  # this process's choices: a model is checked once per process


def choose(
    info: ModelInfo, wanted: bool, *, probe: Probe = probe_in_child, on_probe: Callable[[str], None] | None = None
) -> CpuBuffers:
    """The path `info`'s weights take when the caller would like extra buffer types (`wanted`: not under a
    memory budget). `on_probe` hears one line when a first decode in a child takes a while."""
    if not wanted:
        return CpuBuffers(False, "budget")
    opted = amx_opted_in()
    if build_has_amx() and not opted:
        return CpuBuffers(False, "amx")
    key = (info.fingerprint, opted)
    if key in _chosen:
        return _chosen[key]
    from .llama_process import llama_build_id

    record_key = f"{info.fingerprint}|{llama_build_id()}"
    record = _load_records().get(record_key)
    if not isinstance(record, dict) or not isinstance(record.get("clean"), bool):
        outcome = probe(info.path, on_probe)
        if outcome.returncode is not None and outcome.returncode > 0:
            # The child refused the model or a setting in words: the run below will say the same, and
            # nothing was learnt about the buffer types.
            return CpuBuffers(True, "unchecked")
        record = {
            "clean": outcome.clean,
            "outcome": outcome.describe(),
            "model": info.path.name,
            "when": time.strftime("%Y-%m-%d %H:%M"),
        }
        _save_record(record_key, record)
    chosen = (
        CpuBuffers(True, "checked")
        if record["clean"]
        else CpuBuffers(False, "crashed", f"{record.get('outcome', '?')}, {record.get('when', '?')}")
    )
    _chosen[key] = chosen
    return chosen


def first_decode(path: str) -> None:
    """What the child runs: the model loaded with extra buffer types, a batch and single steps decoded."""
    from ..model_info import read_model_info
    from .runtime import LlamaRuntime

    info = read_model_info(path)
    rt = LlamaRuntime(
        info,
        n_ctx=64,
        n_batch=32,
        n_threads=None,
        max_verify_rows=PROBE_BATCH,
        use_extra_bufts=True,
        install_hook=False,
    )
    try:
        tokens = (rt.tokenize("def merge(a, b):\n    return") * PROBE_BATCH)[:PROBE_BATCH]
        logits = rt.decode(tokens, 0, "last")
        pos = len(tokens)
        for _ in range(PROBE_STEPS):
            nxt = int(logits[0].argmax())
            logits = rt.decode([nxt], pos, "last")
            pos += 1
    finally:
        rt.close()


if __name__ == "__main__":
    try:
        first_decode(sys.argv[1])
    except S2MoEError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
