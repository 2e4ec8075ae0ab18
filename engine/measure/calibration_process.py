"""A calibration in a process of its own, started in a cgroup the caller names.

The app's wizard needs it when the app itself runs inside a budget's memory cgroup (`s2moe app --budget`):
calibration times its resident steps without a budget and its budget step in a cgroup of that budget of its
own (calibration_worker), as `s2moe calibrate` does from the command line. Run in a thread of the app, the
resident steps would read the whole model through the app's budget instead, and take many times as long
on a model larger than the budget. So the wizard starts this module in the cgroup the app's budget cgroup
was made in (MemoryCgroup.made_in), and reads back the events run_calibration yields there.

run_calibration_in(procs_file, model_path, **run_calibration's keywords) is that generator: the same typed
events, rebuilt from the JSON lines the process writes; should_stop is passed on as a line on the process's
standard input (it stops between two measurements, as run_calibration does), and a failure comes back as
the error it was, with its message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import errors
from ..decoding.gpu import Placement
from ..offload import Budget
from ..offload.cgroup import ENV_BUDGET, ENV_CGROUP, popen_in_cgroup
from ..offload.libc import end_process
from .calibration_events import CalibrationDone, CalibrationEvent, StepProgress, StepResult, StepStarted

EVENT_TYPES: dict[str, type[CalibrationEvent]] = {
    cls.__name__: cls for cls in (StepStarted, StepProgress, StepResult, CalibrationDone)
}
# errors that come back as themselves (anything else comes back as a RuntimeError with its message)
ERROR_TYPES: dict[str, type[errors.S2MoEError]] = {
    cls.__name__: cls for cls in (errors.S2MoEError, errors.ModelError, errors.ConfigError, errors.ContextError)
}
STOP_POLL_S = 0.2


def _plain(value: Any) -> Any:
    """What json cannot write by itself: numpy scalars and arrays, paths."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot send a {type(value).__name__} from the calibration process")


def encode(event: CalibrationEvent) -> str:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    return json.dumps({"event": type(event).__name__, "fields": fields}, default=_plain)


def decode(fields: dict[str, Any], name: str) -> CalibrationEvent:
    if name == "CalibrationDone":
        path = fields["path"]
        return CalibrationDone(fields["profile"], None if path is None else Path(path))
    return EVENT_TYPES[name](**fields)


def run_calibration_in(
    procs_file: Path,
    model_path: str | os.PathLike[str],
    *,
    should_stop: Callable[[], bool] | None = None,
    **settings: Any,
) -> Iterator[CalibrationEvent]:
    """run_calibration's events, from a process started in the cgroup of `procs_file` (see the module
    docstring); `settings` are run_calibration's other keywords. The process gets SIGTERM if the thread that
    iterates this dies, so that a budget cgroup of its own is removed on its way out."""
    budget, placement, prompts = settings.get("budget"), settings.get("placement"), settings.get("prompts")
    cfg = {"model": str(model_path)} | settings
    if budget is not None:
        cfg["budget"] = str(budget)  # Budget.parse reads it back
    if placement is not None:
        cfg["placement"] = placement.as_dict()
    if prompts is not None:
        cfg["prompts"] = list(prompts) if isinstance(prompts, (list, tuple)) else str(prompts)
    # the environment that says "you run inside a budget" is the caller's, not the process's
    env = {k: v for k, v in os.environ.items() if k not in (ENV_CGROUP, ENV_BUDGET)}
    argv = [sys.executable, "-m", "s2moe.engine.measure.calibration_process", json.dumps(cfg)]
    proc = popen_in_cgroup(
        procs_file,
        argv,
        death_signal=signal.SIGTERM,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # pipes (above)
    stdin = proc.stdin
    finished = threading.Event()

    def pass_stop_on() -> None:
        while not finished.wait(STOP_POLL_S):
            if should_stop is not None and should_stop():
                try:
                    stdin.write("stop\n")
                    stdin.flush()
                except OSError:  # the process has gone: nothing to stop
                    pass
                return

    last_lines: deque[str] = deque(maxlen=8)  # of stderr, for a process that dies without a word

    def drain_stderr() -> None:  # read as it comes: a full pipe would stall the process
        for line in stderr:
            if line.strip():
                last_lines.append(line.strip())

    stderr = proc.stderr
    helpers = [
        threading.Thread(target=pass_stop_on, name="calibration-stop", daemon=True),
        threading.Thread(target=drain_stderr, name="calibration-stderr", daemon=True),
    ]
    for helper in helpers:
        helper.start()
    failure: dict[str, Any] | None = None
    try:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's own line on stdout
            if "event" in msg:
                yield decode(msg["fields"], msg["event"])
            elif "error" in msg:
                failure = msg["error"]
        rc = proc.wait()
    finally:
        finished.set()
        end_process(proc, 10)  # still running where the caller stopped iterating
        for helper in helpers:
            helper.join()
        for pipe in (stdin, proc.stdout, stderr):
            pipe.close()
    if failure is not None:
        kind = ERROR_TYPES.get(failure["kind"])
        if kind is not None:
            raise kind(failure["message"], option=failure.get("option"))
        raise RuntimeError(failure["message"])
    if rc != 0:
        said = f": {last_lines[-1]}" if last_lines else ""
        raise RuntimeError(f"the calibration process ended with exit status {rc}{said}")


def run_calibration_beside_budget(model_path: str | os.PathLike[str], **kw: Any) -> Iterator[CalibrationEvent]:
    """run_calibration (same keywords) where its steps measure what they say: in this process when it runs
    under no budget, else in a process of its own in the cgroup this process's budget cgroup was made in."""
    from ..offload import current_budget_cgroup

    inside = current_budget_cgroup()
    if inside is None:
        from .calibrate import run_calibration

        return run_calibration(model_path, **kw)
    return run_calibration_in(inside.made_in.procs_file, model_path, **kw)


def _serve(cfg: dict[str, Any]) -> int:
    """This process's side: run_calibration with cfg's settings, each event a JSON line on stdout; a line
    "stop" (or the end) of stdin stops it between two measurements."""
    from .calibrate import run_calibration

    stop = threading.Event()

    def read_stop() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=read_stop, name="stop-reader", daemon=True).start()

    def emit(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    settings = dict(cfg)
    model = settings.pop("model")
    if settings.get("budget") is not None:
        settings["budget"] = Budget.parse(settings["budget"])
    if settings.get("placement") is not None:
        settings["placement"] = Placement(**settings["placement"])
    events = run_calibration(model, should_stop=stop.is_set, **settings)
    for event in events:
        emit(encode(event))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: s2moe calibrate --model PATH (this module's own entry point is internal)", file=sys.stderr)
        return 2
    try:
        with errors.sigterm_raises_terminated():
            return _serve(json.loads(argv[0]))
    except errors.Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 (the parent gets the reason as data, not a traceback's last line)
        failure: dict[str, str | None] = {"kind": type(e).__name__, "message": str(e) or type(e).__name__}
        if isinstance(e, errors.S2MoEError):
            failure |= {"message": e.message, "option": e.option}
        sys.stdout.write(json.dumps({"error": failure}) + "\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
