"""A crash in native code (llama.cpp, ggml, our hook) ends the process before Python can say anything
useful. Each run keeps a small file in the state folder that Python's faulthandler writes the fatal
signal and the Python stack into; a clean exit deletes it. The next run finds the files of processes that
are gone and says, in one line each, what happened and how to avoid it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .files import state_dir

_FATAL = re.compile(r"Fatal Python error: (.+)")
_MAX_REPORT_BYTES = 1 << 20


def _crash_dir() -> Path:
    return state_dir() / "runs"


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (so that a pid reused by another process is not taken for ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


@contextmanager
def watched(command: str, model: str | None) -> Iterator[None]:
    """Record this process's run so that a fatal signal inside it is reported by the next run."""
    folder = _crash_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"run-{os.getpid()}.log"
        f = open(path, "w", encoding="utf-8")
    except OSError:
        yield  # no state folder to write to: the run goes on unwatched
        return
    header = {
        "command": command,
        "model": model,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "start_time": _start_time(os.getpid()),
    }
    f.write(json.dumps(header) + "\n")
    f.flush()
    was_enabled = faulthandler.is_enabled()
    faulthandler.enable(file=f, all_threads=True)
    try:
        yield
    finally:
        faulthandler.disable()
        if was_enabled:
            faulthandler.enable()
        f.close()
        try:
            path.unlink()
        except OSError:
            pass


def _alive(pid: int, start_time: str | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def earlier_crashes() -> list[str]:
    """One line for each earlier run that died of a fatal signal (its report kept as crash-*.log beside);
    the records of runs that ended otherwise (killed, say) are removed without a word."""
    folder = _crash_dir()
    try:
        paths = sorted(folder.glob("run-*.log"))
    except OSError:
        return []
    lines = []
    for path in paths:
        try:
            pid = int(path.stem.split("-", 1)[1])
            with open(path, "rb") as f:
                text = f.read(_MAX_REPORT_BYTES).decode("utf-8", "replace")
            header = json.loads(text.split("\n", 1)[0])
            if not isinstance(header, dict):
                raise ValueError
        except (OSError, ValueError, IndexError, RecursionError):
            continue
        if _alive(pid, header.get("start_time")):
            continue
        fatal = _FATAL.search(text)
        try:
            if fatal is None:
                path.unlink()
                continue
            kept = path.with_name(f"crash-{pid}.log")
            os.replace(path, kept)
        except OSError:
            continue
        model = Path(str(header.get("model"))).name if header.get("model") else "the default model"
        lines.append(
            f"note: an earlier run (s2moe {header.get('command', '?')} on {model}, started "
            f"{header.get('started', '?')}) died inside native code: {fatal[1].strip()}. Its report is in "
            f"{kept}. If it happens again with this model: without --amx, or under --budget (weights "
            "stay mapped from the file), llama.cpp takes other code paths."
        )
    return lines


def exit_text(returncode: int) -> str:
    """A child process's exit status in words: `exit 2`, or `killed by SIGSEGV`."""
    if returncode >= 0:
        return f"exit {returncode}"
    import signal

    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"
