"""Whether one speed beats another on this machine: paired ratios, their spread, outliers among the runs, and
whether other programs were using the CPUs meanwhile. bench, tune and the app's Bench screen judge their speeds
here, so that they call the same difference noise.

Two settings are compared on runs made next to each other (the same prompt, one right after the other): each
pair gives a ratio of speeds, and the verdict rests on their geometric mean and its spread. A difference is
significant where the mean log ratio lies more than two standard errors from zero, that is where the ratio's
two-standard-error range (shown as ± half of it) leaves out 1; with fewer than three pairs nothing is
significant, since a spread cannot be told from so few.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIN_PAIRS = 3
# a run whose modified z-score (0.6745 × distance from the median ÷ median absolute deviation) passes this is an
# outlier (Iglewicz and Hoaglin's usual cut-off)
OUTLIER_Z = 3.5
# other programs' use of the CPUs, on average over the measurement, above which the machine counts as busy
BUSY_CPUS = 0.25
# where other processes' CPU time cannot be read: the 1-minute load average when the measurement began, as a
# share of the CPUs, above which the machine counts as busy
BUSY_LOAD_SHARE = 0.5


def separated(log_ratios: Sequence[float]) -> bool:
    """Whether paired log speed ratios tell two settings apart: their mean more than two standard errors from
    zero (at least MIN_PAIRS pairs)."""
    n = len(log_ratios)
    if n < MIN_PAIRS:
        return False
    mean = sum(log_ratios) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in log_ratios) / (n - 1))
    return abs(mean) > 2 * sd / math.sqrt(n)


@dataclass(frozen=True)
class Comparison:
    """`name`'s speed against `against`'s over paired runs."""

    name: str
    against: str
    ratio: float  # geometric mean of the paired ratios
    low: float  # the geometric mean's two-standard-error range (both `ratio` with under MIN_PAIRS pairs)
    high: float
    n: int
    significant: bool

    @property
    def outcome(self) -> str:
        if self.n < MIN_PAIRS:
            return f"too few paired runs ({self.n}) to tell from noise"
        if not self.significant:
            return "not significant: within the run-to-run spread"
        return "faster" if self.ratio > 1 else "slower"

    @property
    def ratio_text(self) -> str:
        """The ratio with its two standard errors, as hyperfine writes it: 1.20 ± 0.02× (half the range, which
        is not quite symmetric about a ratio)."""
        if self.n < MIN_PAIRS:
            return f"{self.ratio:.2f}×"
        return f"{self.ratio:.2f} ± {(self.high - self.low) / 2:.2f}×"

    def text(self) -> str:
        return f"{self.name} {self.ratio_text} {self.against} ({self.n} paired runs): {self.outcome}"


def compare(name: str, against: str, ratios: Sequence[float]) -> Comparison:
    """`name` against `against` from paired speed ratios (name's speed ÷ against's, one per pair of runs)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    n = len(logs)
    if not n:
        return Comparison(name, against, 1.0, 1.0, 1.0, 0, False)
    mean = sum(logs) / n
    if n < MIN_PAIRS:
        return Comparison(name, against, math.exp(mean), math.exp(mean), math.exp(mean), n, False)
    se = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1)) / math.sqrt(n)
    return Comparison(
        name, against, math.exp(mean), math.exp(mean - 2 * se), math.exp(mean + 2 * se), n, separated(logs)
    )


def outliers(values: Sequence[float]) -> int:
    """How many values lie far from the others (modified z-score above OUTLIER_Z)."""
    vs = sorted(v for v in values if math.isfinite(v))
    if len(vs) < MIN_PAIRS:
        return 0
    median = _median(vs)
    mad = _median(sorted(abs(v - median) for v in vs))
    if mad == 0:
        return 0  # most runs alike to the tick: nothing to measure a distance by
    return sum(0.6745 * abs(v - median) / mad > OUTLIER_Z for v in vs)


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


# -- the machine meanwhile ----------------------------------------------------------------------------------
@dataclass
class Load:
    """What else ran on the CPUs while something was measured."""

    cpus: int
    load_at_start: float | None  # the 1-minute load average when the measurement began
    other_cpus: float | None  # CPUs other processes kept busy, on average over the measurement
    busiest: list[tuple[str, float]] = field(default_factory=list)  # (command, CPUs), the largest first
    seconds: float = 0.0

    @property
    def busy(self) -> bool:
        """Other processes used the CPUs meanwhile; where that could not be read, the load average was high
        when the measurement began (a weaker sign: it lags by a minute, and counts a run that just ended)."""
        if self.other_cpus is not None:
            return self.other_cpus >= BUSY_CPUS
        return self.load_at_start is not None and self.load_at_start >= BUSY_LOAD_SHARE * self.cpus

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Load | None:
        if not d:
            return None
        return cls(
            int(d["cpus"]),
            d.get("load_at_start"),
            d.get("other_cpus"),
            [(str(c), float(u)) for c, u in d.get("busiest") or []],
            float(d.get("seconds") or 0.0),
        )

    def words(self) -> str:
        """Why the machine counts as busy, in a clause."""
        if self.other_cpus is None:
            return (
                f"the load average was {self.load_at_start:.1f} on {self.cpus} CPUs when it began"
                if self.load_at_start is not None
                else ""
            )
        who = ", ".join(f"{c} {u:.1f}" for c, u in self.busiest[:3])
        return f"other processes used {self.other_cpus:.1f} of {self.cpus} CPUs" + (f" ({who})" if who else "")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load_average(proc: Path) -> float | None:
    try:
        return float((proc / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _processes(proc: Path) -> dict[int, tuple[str, int, int, int]]:
    """pid → (command, parent pid, CPU ticks used so far, start time in ticks) of every process readable in
    `proc`."""
    out = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        head, _, rest = text.rpartition(")")
        fields = rest.split()
        try:
            out[int(entry.name)] = (
                head.partition("(")[2],
                int(fields[1]),
                int(fields[11]) + int(fields[12]),
                int(fields[19]),
            )
        except (IndexError, ValueError):
            continue
    return out


class LoadWatch:
    """Started before a measurement, stopped after it: what other processes (not this one, nor those it
    started) used of the CPUs meanwhile. `proc` is the proc file system (a folder of the same shape in tests)."""

    def __init__(self, proc: str | os.PathLike[str] = "/proc", clock: Callable[[], float] | None = None):
        import time

        self.proc = Path(proc)
        self.clock = clock or time.monotonic
        self.cpus = _cpu_count()
        self.load_at_start = _load_average(self.proc)
        self.before = _processes(self.proc)
        self.t0 = self.clock()

    def stop(self) -> Load:
        seconds = self.clock() - self.t0
        after = _processes(self.proc)
        if not after or seconds <= 0:
            return Load(self.cpus, self.load_at_start, None, [], seconds)
        ours = _descendants(os.getpid(), after) | _descendants(os.getpid(), self.before)
        try:
            hz = os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            hz = 100
        used: dict[str, float] = {}
        for pid, (command, _, ticks, started) in after.items():
            if pid in ours:
                continue
            earlier = self.before.get(pid)
            # a pid seen before with the same start time is the same process (a kernel thread renames itself)
            start = earlier[2] if earlier is not None and earlier[3] == started else 0
            if ticks > start:
                used[command] = used.get(command, 0.0) + (ticks - start) / hz / seconds
        busiest = sorted(((c, round(u, 2)) for c, u in used.items() if u >= 0.05), key=lambda cu: -cu[1])
        return Load(self.cpus, self.load_at_start, round(sum(used.values()), 3), busiest[:5], round(seconds, 3))


def _descendants(root: int, processes: Mapping[int, tuple[str, int, int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, parent, *_) in processes.items():
        children.setdefault(parent, []).append(pid)
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


# -- the verdict ---------------------------------------------------------------------------------------------
@dataclass
class Judgement:
    """Speeds of several settings measured in paired runs, judged: each against the baseline, the fastest
    against each other, and whether the machine or the runs themselves make the figures doubtful."""

    baseline: str
    versus_baseline: list[Comparison]
    fastest: str
    versus_fastest: list[Comparison]
    outliers: int
    runs: int
    load: Load | None = None

    def get(self, name: str) -> Comparison | None:
        return next((c for c in self.versus_baseline if c.name == name), None)

    @property
    def warning(self) -> str | None:
        """Why these figures may not hold on a quiet machine (None: no reason seen)."""
        reasons = []
        if self.load is not None and self.load.busy:
            reasons.append(self.load.words())
        if self.outliers:
            reasons.append(
                f"{self.outliers} of {self.runs} {self.baseline} runs lie far from the others (statistical outliers)"
            )
        if not reasons:
            return None
        return "; ".join(reasons) + " — differences may be noise; rerun on a quiet machine"

    def fastest_line(self) -> str:
        if not self.versus_fastest:
            return f"fastest: {self.fastest}"
        return f"fastest: {self.fastest} — " + "; ".join(
            f"{c.ratio_text} {c.against}{'' if c.significant else ' (not significant)'}" for c in self.versus_fastest
        )

    def lines(self) -> list[str]:
        """The fastest line, each other setting against the baseline (the fastest's own comparison with it is
        in the fastest line already), and the warning if there is one."""
        out = [self.fastest_line()]
        out += [c.text() for c in self.versus_baseline if c.name != self.fastest]
        if self.warning:
            out.append("warning: " + self.warning)
        return out


def judge(runs: Mapping[str, Sequence[float | None]], baseline: str, load: Load | None = None) -> Judgement:
    """Speeds (tok/s) of each setting, run by run: runs[name][i] was measured next to runs[other][i] (None
    where that setting did not run then). The baseline must be among them."""
    base = runs[baseline]

    def pairs(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
        return [x / y for x, y in zip(a, b) if x is not None and y is not None and x > 0 and y > 0]

    versus = [compare(name, baseline, pairs(speeds, base)) for name, speeds in runs.items() if name != baseline]
    ratio = {c.name: c.ratio for c in versus} | {baseline: 1.0}
    fastest = max(ratio, key=lambda name: ratio[name])
    versus_fastest = [compare(fastest, other, pairs(runs[fastest], runs[other])) for other in runs if other != fastest]
    base_runs = [v for v in base if v is not None]
    return Judgement(baseline, versus, fastest, versus_fastest, outliers(base_runs), len(base_runs), load)
