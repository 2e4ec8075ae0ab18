"""What the calibration wizard's steps mean, apart from how they are shown: a step's result read as done,
failed or skipped (with doubts about what it measured), a failure put in the words of the wizard's fields, the
tuning step's state and its best candidate so far, the tuning time asked for, and how long a stop will take."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...engine.measure.calibration_events import StepResult
from ...engine.measure.calibration_steps import NO_GPU, NO_GPU_DEVICE

TUNE_PROMPTS = "humaneval"  # the workload `s2moe tune` tunes for by default
TUNE_MINUTES = 3.0  # the wizard's default: a first tuning, shorter than the command's 10 minutes …
TUNE_MINUTES_BUDGETED = 10.0  # … but under a budget a quality check alone takes a minute or two
FIT_R2_MIN = 0.8  # a cost-model fit below this explains too little of the measured time to decide with
# The wizard's fields, for engine messages that name the flag setting the same thing.
FIELDS = {"--budget": "the Memory budget field", "--name": "the Profile name field"}
_CLASS_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Unavailable|Exit|Interrupt)\w*: ")
_CONSTANTS = (
    ("t_ar_ms", "T_AR"),
    ("c_draft_ms", "C_draft"),
    ("t_exp_ms", "T_exp"),
    ("t_tok_ms", "T_tok"),
    ("t_exp_cold_ms", "T_exp cold"),
)


def tune_minutes(raw: str, offloaded: bool) -> float | None:
    """The Tuning minutes field's value: what was typed, else the default for the session (more under a budget,
    where each quality check reads its experts from storage); None where it is no number of minutes."""
    try:
        minutes = float(raw) if raw.strip() else (TUNE_MINUTES_BUDGETED if offloaded else TUNE_MINUTES)
    except ValueError:
        return None
    return minutes if 0 < minutes <= 24 * 60 else None


def plain_words(text: str, fields: dict[str, str] | None = None) -> str:
    """A failure as its reader should read it: without exception class names (a worker process reports its
    traceback's last line), with the fields the reader fills in instead of the flags named by `fields`."""
    text = text.strip()
    while _CLASS_PREFIX.match(text):
        text = _CLASS_PREFIX.sub("", text, count=1)
    for flag, name in (fields or {}).items():
        text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", name, text)
    return text


@dataclass(frozen=True)
class Outcome:
    """What a calibration step's result means: measured, failed (with the reason) or skipped, and any doubt
    about what it measured."""

    state: str  # done | failed | skipped
    reason: str = ""  # why it failed or was skipped
    note: str = ""  # what the step still did (e.g. a value derived instead)
    flags: tuple[str, ...] = ()  # doubts about a measured value


def step_outcome(result: StepResult, fields: dict[str, str] | None = None) -> Outcome:
    data = result.data or {}
    skipped = data.get("skipped")
    if skipped:
        note = result.summary[len(skipped) :].lstrip("; ") if result.summary.startswith(skipped) else ""
        # nothing to measure (no budget asked for, no GPU): a skip, not a failure
        if skipped.startswith(("skipped: no memory budget given", NO_GPU, NO_GPU_DEVICE)):
            return Outcome("skipped", skipped[len("skipped: ") :], note)
        # a budget was given but could not be measured under: its figures are missing from the profile
        reason = skipped[len("failed: ") :] if skipped.startswith("failed: ") else skipped
        return Outcome("failed", plain_words(reason, fields), note)
    flags = []
    r2 = data.get("r2")
    if r2 is not None and r2 < FIT_R2_MIN:
        flag = f"fit R² {r2:.2f} is below {FIT_R2_MIN}: the cost model explains little of the measured time"
        ceiling = data.get("r2_ceiling")
        if ceiling is not None and ceiling < FIT_R2_MIN:
            flag += (
                f"; the same batches timed again spread so far that no model of their counts gets past "
                f"{ceiling:.2f}: the device was noisy, measure again when it is quiet"
            )
        elif ceiling is not None:
            flag += (
                f"; a model of the batches' counts could reach {ceiling:.2f}, so the time follows something "
                f"they do not count"
            )
        flags.append(flag)
    for key, label in _CONSTANTS:
        v = data.get(key)
        if v is not None and v <= 0:
            flags.append(f"{label} {v:.4f} ms is not positive: the measurement could not tell it from noise")
    return Outcome("done", flags=tuple(flags))


@dataclass
class StepState:
    index: int
    name: str
    description: str = ""
    state: str = "running"  # running | done | failed | skipped
    done: int = 0
    total: int = 0
    summary: str = ""
    reason: str = ""  # failed or skipped: why
    flags: list[str] = field(default_factory=list)


@dataclass
class TuneState:
    """The wizard's tuning step: what it is doing and what it found."""

    state: str = "running"  # running | done | failed | stopped
    lines: list[str] = field(default_factory=list)
    reason: str = ""
    done: int = 0
    total: int = 0
    phase: str = ""
    points: dict = field(default_factory=dict)  # candidate index → (rung, tok/s)
    settings: dict = field(default_factory=dict)  # candidate index → engine.measure.tune_space.Settings
    defaults_tok_s: float | None = None
    section: dict | None = None  # TuneDone's, recorded in the saved profile

    def best_so_far(self) -> tuple | None:
        """(settings, tok/s, the defaults' tok/s, rung) of the fastest candidate of the last rung measured, or
        None before a rung has ended. A rung runs every candidate in it on the same prompts, so only its own
        figures compare; the final comparison, which would confirm the lead, has not run."""
        rungs = [rung for index, (rung, _) in self.points.items() if index != 0 and rung >= 0]
        if not rungs:
            return None
        last = max(rungs)
        index, (_, tok_s) = max(
            ((i, p) for i, p in self.points.items() if i != 0 and p[0] == last), key=lambda item: item[1][1]
        )
        defaults = self.points.get(0, (last, None))[1]
        return self.settings[index], tok_s, defaults, last


def stopping_text(longest_s: float | None, running_s: float) -> str:
    """How long a stop will take, honestly: the job stops only between two measurements, and the longest one so
    far is the best guess at how long the current one lasts."""
    if longest_s is None:
        return f"stopping after the current measurement (running for {running_s:.0f} s)…"
    left = max(0.0, longest_s - running_s)
    return (
        f"stopping after the current measurement: up to ~{left:.0f} s more (the longest so far took "
        f"{longest_s:.0f} s; this one began {running_s:.0f} s ago)…"
    )
