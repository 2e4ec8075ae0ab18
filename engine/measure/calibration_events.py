"""What a calibration tells its caller as it runs: the events, the steps' names and descriptions (STEPS), and
the form a fit takes in a step's result data and in the profile.

run_calibration (calibrate) yields these events; `s2moe calibrate` and the app's wizard consume them, and the
steps (calibration_steps, calibration_budget) build them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cost_fits import Fit, MissFit


@dataclass(frozen=True)
class StepStarted:
    index: int
    total: int
    name: str
    description: str


@dataclass(frozen=True)
class StepProgress:
    index: int
    done: int
    total: int


@dataclass(frozen=True)
class StepResult:
    index: int
    name: str
    summary: str
    data: dict[str, Any]


@dataclass(frozen=True)
class CalibrationDone:
    profile: dict[str, Any]
    path: Path | None


# What a step yields as it runs (run_calibration adds StepStarted before each step), and all a calibration yields.
StepEvents = Iterator[StepProgress | StepResult]
CalibrationEvent = StepStarted | StepProgress | StepResult | CalibrationDone


STEPS = (
    ("bandwidth", "memory bandwidth and storage bandwidth (cold reads of whole experts at queue depth 1 and 8)"),
    (
        "steps",
        "T_AR (median plain decoding step) and draft step cost; how steps grow with the context, and the "
        "engine's own host time per draft pass and verified row",
    ),
    ("cost model", "T_exp and T_tok: regression of verification latency on distinct experts and tokens"),
    ("hot experts", "routing frequencies over calibration prompts; the most routed experts that fit the budget"),
    ("budget", "verification cost under the memory budget (experts paged from storage), in a memory cgroup"),
    (
        "gpu",
        "host→device bandwidth, and the batch size from which copying the experts a verification uses to the "
        "GPU beats running them on the CPU (experts in host memory)",
    ),
    ("profile", "write the profile atomically"),
)


def fit_dict(fit: Fit) -> dict[str, Any]:
    return {
        "intercept_ms": round(fit.intercept * 1e3, 6),
        "t_exp_ms": round(fit.t_exp * 1e3, 6),
        "t_tok_ms": round(fit.t_tok * 1e3, 6),
        "r2": round(float(fit.r2), 6),
        "mape": round(float(fit.mape), 6),
        "n": int(fit.n),
    } | ceiling_field(fit)


def ceiling_field(fit: Fit | MissFit) -> dict[str, float]:
    return {} if fit.r2_ceiling is None else {"r2_ceiling": round(fit.r2_ceiling, 6)}


def fit_data(samples: Sequence[Sequence[float]], fit: Fit) -> dict[str, Any]:
    measured = [s[2] * 1e3 for s in samples]
    predicted = [float(fit.predict(s[0], s[1])) * 1e3 for s in samples]
    return {
        "measured": measured,
        "predicted": predicted,
        "experts": [s[0] for s in samples],
        "tokens": [s[1] for s in samples],
        "r2": fit.r2,
        "r2_ceiling": fit.r2_ceiling,
        "mape": fit.mape,
        "intercept_ms": fit.intercept * 1e3,
        "t_exp_ms": fit.t_exp * 1e3,
        "t_tok_ms": fit.t_tok * 1e3,
    }
