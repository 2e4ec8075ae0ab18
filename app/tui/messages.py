"""Messages that workers post to screens (Textual's post_message is thread-safe)."""

from __future__ import annotations

import time

from textual.message import Message

from ...engine.errors import S2MoEError

clock = time.monotonic  # how long the screens say things took (tests pass their own)

# The engine's names for the settings its errors are about → what the app calls them (the settings bar).
SETTING_NAMES = {
    "draft_topk": "k_d",
    "draft_max": "the draft cap",
    "reuse_strength": "gating α",
    "memory_strength": "memory α_m",
    "threshold": "the utility threshold",
    "n_predict": "n (tokens per reply)",
    "temperature": "T",
    "reuse_cap": "|E*|",
    "n_ctx": "the context (s2moe app --ctx)",
    "seed": "the seed",
    "time_budget": "the tuning time (Tuning minutes)",
}


def failure_text(e: BaseException) -> str:
    """What a failed job tells the user: an engine error in the app's words, anything else with its type."""
    if isinstance(e, S2MoEError):
        return e.worded(SETTING_NAMES)
    return f"{type(e).__name__}: {e}"


class EngineEvent(Message, bubble=False):
    """One event of a generation, with its view data and the wall time it reached the worker."""

    def __init__(self, turn: int, event: object, view: object, t: float) -> None:
        super().__init__()
        self.turn = turn
        self.event = event
        self.view = view
        self.t = t


class EngineStatus(Message, bubble=False):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class EngineNotice(Message, bubble=False):
    """Something the user should read (a notification), e.g. a profile that does not fit the model."""

    def __init__(self, text: str, severity: str = "warning") -> None:
        super().__init__()
        self.text = text
        self.severity = severity


class EngineFailed(Message, bubble=False):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class JobEnded(Message, bubble=False):
    """A worker's engine job is over (normally, stopped or failed)."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job


class ModelFailed(Message, bubble=False):
    """The model could not be loaded (copy_cache: its copy cache stopped the load)."""

    def __init__(self, text: str, copy_cache: bool = False) -> None:
        super().__init__()
        self.text = text
        self.copy_cache = copy_cache


class ModelReady(Message, bubble=False):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model


class LoadProgress(Message, bubble=False):
    """What the model's load is doing: step of steps (EngineSession.load)."""

    def __init__(self, step: int, steps: int, what: str) -> None:
        super().__init__()
        self.step = step
        self.steps = steps
        self.what = what


class JobEvent(Message, bubble=False):
    """An event of a calibration or bench run."""

    def __init__(self, event: object) -> None:
        super().__init__()
        self.event = event


def post(target, message: Message) -> bool:
    """post_message that tolerates an app that has already shut down (workers outlive it briefly)."""
    try:
        return target.post_message(message)
    except RuntimeError:  # event loop closed
        return False


def run_engine_job(screen, session, name: str, events) -> None:
    """From a worker thread: run `events()` (a generator of engine events) as a session job, posting
    each event to `screen` as JobEvent; a failure becomes EngineFailed, and JobEnded(name) always ends it."""

    def job():
        for event in events():
            post(screen, JobEvent(event))

    try:
        session.run_job(job)
    except Exception as e:  # noqa: BLE001 (a worker reports every failure to its screen instead of dying)
        post(screen, EngineFailed(failure_text(e)))
    finally:
        post(screen, JobEnded(name))


def engine_ready(screen) -> bool:
    """The checks a screen makes before starting an engine job; tells the user and returns False if it
    cannot start."""
    session = screen.app.session
    if session.model_path is None:
        screen.app.action_open_model()
        return False
    if screen.running or session.busy:
        screen.notify("the engine is busy with another job", severity="warning")
        return False
    return True
