"""Cost constants for routing-aware expansion, and the start-up measurement that fits them.

Times plain steps, draft steps and verification batches of varied size and reuse on a runtime, plans how
many of them a measurement has time for, and times how a step's cost grows with its context. The model those
timings are fitted to, and the fits, are in cost_fits.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from ..events import CostConstants
from .cost_fits import fit_verify_cost

if TYPE_CHECKING:
    from ..decoding.runtime import LlamaRuntime
    from ..offload.native import NativePrefetch

T = TypeVar("T")
# A measurement run step by step: yields (done, total) as it goes, returns its result
Measurement: TypeAlias = Generator[tuple[int, int], None, T]
# (distinct experts over layers, tokens, seconds), with a miss counter also (misses, storage page faults)
Sample: TypeAlias = tuple[float, ...]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Stopped(Exception):
    """should_stop() asked a measurement to stop; the runtime's KV cache is left empty."""


def _prepare(
    rt: LlamaRuntime, seed: int, context: int, cap: int, repeated: bool = False
) -> tuple[np.random.Generator, int]:
    """A context of `context` random tokens prefilled; repeated: one random token repeated, whose positions all
    route alike (identical tokens attend to identical values), so that its prefill reads one token's experts
    rather than, under a budget, most of the model's from storage."""
    rng = np.random.default_rng(seed)
    rt.kv_clear()
    context = max(1, min(context, rt.n_ctx - cap - 4))
    prefix = (
        [int(rng.integers(rt.n_vocab))] * context if repeated else rng.integers(0, rt.n_vocab, size=context).tolist()
    )
    if rt.hook is not None:
        rt.hook.off()
    rt.prefill(prefix)
    return rng, context


def _step(
    rt: LlamaRuntime,
    base: int,
    tokens: Sequence[int],
    mode: str,
    k_draft: int,
    counter: NativePrefetch | None = None,
    allowed: npt.NDArray[np.bool_] | None = None,
) -> Sample:
    """Decode `tokens` after `base` positions as a plain/draft/verify step; time it; roll it back.
    allowed: a draft step reads only these experts ([n_layer, n_expert] bool, see RoutingHook.draft).

    Returns (seconds, distinct experts over layers), plus, when a miss `counter` (begin() / counted(), see
    Decoder.miss_counter) is given, the distinct experts that were not in memory as their layer routed
    and the page faults that read storage during the step."""
    hook = rt.hook
    if hook is None:
        raise ValueError("timing a step needs the routing hook (a mixture-of-experts model)")
    if mode == "draft":
        hook.draft(k_draft, allowed)
    else:
        hook.observe()
    if counter is not None:
        counter.begin()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    outputs: Literal["all", "last"] = "all" if mode == "verify" else "last"
    dt = _timed(lambda: rt.decode(tokens, base, outputs))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0
    routing = hook.snapshot(len(tokens))
    experts = float(routing.distinct_used(rt.info.n_expert).sum())
    rt.kv_remove_from(base)
    if counter is None:
        return dt, experts
    return dt, experts, float(counter.counted().sum()), float(faults)


def _batch(rng: np.random.Generator, n_vocab: int, s: int, variant: str) -> list[int]:
    """A verification batch of s tokens with little (random), full (repeat) or partial (mixed) reuse."""
    if variant == "random":
        tokens: list[int] = rng.integers(0, n_vocab, size=s).tolist()
        return tokens
    if variant == "repeat":
        return [int(rng.integers(n_vocab))] * s
    pool = rng.integers(0, n_vocab, size=max(1, s // 2)).tolist()
    return [pool[i % len(pool)] for i in range(s)]


VARIANTS = ("random", "repeat", "mixed")


def batch_sizes(cap: int) -> list[int]:
    return sorted(set([1, 2, 3] + list(range(2, cap + 2, max(1, cap // 4))) + [cap + 1]))


def iter_time_steps(
    rt: LlamaRuntime,
    k_draft: int,
    n: int,
    *,
    seed: int = 0,
    context: int = 32,
    warm: int = 2,
    repeated_context: bool = False,
) -> Measurement[tuple[list[float], list[float]]]:
    """Generator: yields (done, n) after each pair of steps; returns (plain seconds, draft seconds) of n
    plain steps and n draft steps (k_draft experts), after `warm` untimed pairs (the first builds the graphs).
    Leaves the KV cache empty."""
    rng, base = _prepare(rt, seed, context, 2, repeated_context)
    try:
        for _ in range(warm):
            _step(rt, base, [int(rng.integers(rt.n_vocab))], "verify", k_draft)
            _step(rt, base, [int(rng.integers(rt.n_vocab))], "draft", k_draft)
        ar: list[float] = []
        draft: list[float] = []
        for i in range(n):
            ar.append(_step(rt, base, [int(rng.integers(rt.n_vocab))], "verify", k_draft)[0])
            draft.append(_step(rt, base, [int(rng.integers(rt.n_vocab))], "draft", k_draft)[0])
            yield i + 1, n
        return ar, draft
    finally:
        rt.kv_clear()


def iter_resident_draft_steps(
    rt: LlamaRuntime,
    k_draft: int,
    n: int,
    allowed: Callable[[], npt.NDArray[np.bool_]],
    *,
    seed: int = 0,
    context: int = 32,
    warm: int = 2,
    repeated_context: bool = False,
) -> Measurement[list[float]]:
    """Generator like iter_time_steps: returns the seconds of n draft steps (k_draft experts) that read only
    the experts allowed() returns, asked before each step (under a budget: those in memory, so that no step
    fetches). Leaves the KV cache empty."""
    rng, base = _prepare(rt, seed, context, 2, repeated_context)
    try:
        for _ in range(warm):
            _step(rt, base, [int(rng.integers(rt.n_vocab))], "draft", k_draft, allowed=allowed())
        seconds: list[float] = []
        for i in range(n):
            seconds.append(_step(rt, base, [int(rng.integers(rt.n_vocab))], "draft", k_draft, allowed=allowed())[0])
            yield i + 1, n
        return seconds
    finally:
        rt.kv_clear()


def iter_verify_samples(
    rt: LlamaRuntime,
    cap: int,
    *,
    seed: int = 0,
    repeats: int = 3,
    context: int = 32,
    sizes: Iterable[int] | None = None,
    variants: Sequence[str] = VARIANTS,
    shapes: Sequence[tuple[int, str]] | None = None,
    warm: int = 2,
    repeated_context: bool = False,
    counter: NativePrefetch | None = None,
) -> Measurement[list[Sample]]:
    """Generator: yields (done, total) per batch configuration; returns [(distinct experts over layers,
    tokens, median seconds)] of verification batches of varied size and reuse: every size with every variant,
    or the (size, variant) `shapes` given. The `warm` untimed rounds first build the graphs of the largest
    batch (with random tokens where a random batch of that size is timed: a resident model's pages fault in).
    Leaves the KV cache empty.

    With a miss `counter` (offloading's native prefetcher, see _step) each sample also carries the number
    of its distinct experts that were not in memory (misses) and the storage page faults the batch took
    (a diagnostic known only afterwards), and every run is returned on its own (the misses of repeats
    differ) instead of the median per configuration."""
    rng, base = _prepare(rt, seed, context, cap, repeated_context)
    if shapes is None:
        shapes = [(s, v) for s in (sizes or batch_sizes(cap)) for v in variants]
    largest = max(s for s, _ in shapes)
    warm_variant = "random" if (largest, "random") in shapes else "repeat"
    try:
        for _ in range(warm):  # first decodes of a shape allocate graphs and fault pages in
            _step(rt, base, [int(rng.integers(rt.n_vocab))], "verify", 1)
            _step(rt, base, _batch(rng, rt.n_vocab, largest, warm_variant), "verify", 1)
        configs = [(s, _batch(rng, rt.n_vocab, s, v)) for s, v in shapes]
        times: list[list[float]] = [[] for _ in configs]
        misses: list[list[Sample]] = [[] for _ in configs]
        experts = [0.0] * len(configs)
        total, done = len(configs) * repeats, 0
        # Round-robin over the configurations, so that a burst of load from other processes on a busy
        # machine spreads over all of them instead of skewing one configuration's median.
        for _ in range(repeats):
            for i, (_size, toks) in enumerate(configs):
                dt, experts[i], *miss = _step(rt, base, toks, "verify", 1, counter)
                times[i].append(dt)
                if miss:
                    misses[i].append(tuple(miss))
                done += 1
                yield done, total
        if counter is not None:  # every run on its own: its misses depend on what the cache held then
            return [(experts[i], s, t, *m) for i, (s, _) in enumerate(configs) for t, m in zip(times[i], misses[i])]
        samples: list[Sample] = [(experts[i], s, float(np.median(times[i]))) for i, (s, _) in enumerate(configs)]
        return samples
    finally:
        rt.kv_clear()


def drive(
    gen: Measurement[T],
    progress: Callable[[int, int], object] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Run a measurement generator to its end; report progress; raise Stopped when asked to stop."""
    while True:
        try:
            done, total = next(gen)
        except StopIteration as e:
            result: T = e.value
            return result
        if progress:
            progress(done, total)
        if should_stop is not None and should_stop():
            gen.close()
            raise Stopped()


def time_steps(
    rt: LlamaRuntime,
    k_draft: int,
    n: int,
    *,
    progress: Callable[[int, int], object] | None = None,
    should_stop: Callable[[], bool] | None = None,
    **kw: Any,
) -> tuple[list[float], list[float]]:
    return drive(iter_time_steps(rt, k_draft, n, **kw), progress, should_stop)


def verify_samples(
    rt: LlamaRuntime,
    cap: int,
    *,
    progress: Callable[[int, int], object] | None = None,
    should_stop: Callable[[], bool] | None = None,
    **kw: Any,
) -> list[Sample]:
    return drive(iter_verify_samples(rt, cap, **kw), progress, should_stop)


def measure_cost_constants(rt: LlamaRuntime, k_draft: int, cap: int, **kw: Any) -> tuple[CostConstants, list[Sample]]:
    """iter_cost_constants run to its end: (CostConstants, samples)."""
    gen = iter_cost_constants(rt, k_draft, cap, **kw)
    while True:
        try:
            next(gen)
        except StopIteration as e:
            measured: tuple[CostConstants, list[Sample]] = e.value
            return measured


def _share(gen: Measurement[T], start: float, share: float) -> Generator[float, None, T]:
    """A measurement part's (done, of) as the fraction done of the whole, the part being `share` of it."""
    while True:
        try:
            done, of = next(gen)
        except StopIteration as e:
            result: T = e.value
            return result
        yield start + share * done / of


def iter_cost_constants(
    rt: LlamaRuntime,
    k_draft: int,
    cap: int,
    *,
    seed: int = 0,
    repeats: int = 3,
    context: int = 32,
    draft_allowed: Callable[[], npt.NDArray[np.bool_]] | None = None,
    seconds: float | None = None,
) -> Generator[float, None, tuple[CostConstants, list[Sample]]]:
    """Generator: yields the fraction done; returns (CostConstants, samples) where samples are (experts,
    tokens, s). Times plain steps, draft steps and verification batches of varied size and reuse on `rt`.
    draft_allowed: under a memory budget, a function returning the experts in memory; draft steps that read
    only those are timed too (c_draft_resident). Without it the model is in memory and a draft step fetches
    nothing anyway.
    seconds: about as long as the measurement may take. Under a memory budget a step of a model many times
    the budget reads its experts from storage (seconds a step for gigabytes of experts): the measurement
    then takes fewer repeats and fewer batch shapes (sample_plan), priced from a first plain step.
    Leaves the KV cache empty."""
    plan = SamplePlan.full(cap, repeats)
    if seconds is not None:
        plan = sample_plan(_first_plain_step(rt, k_draft, seed, context), cap, seconds, repeats)
    verify_share = 0.6 if draft_allowed is None else 0.4
    each: dict[str, Any] = {"context": context, "warm": plan.warm, "repeated_context": plan.repeated_context}
    ar, draft = yield from _share(iter_time_steps(rt, k_draft, plan.steps, seed=seed, **each), 0.0, 0.4)
    if draft_allowed is not None:
        resident = float(
            np.median(
                (
                    yield from _share(
                        iter_resident_draft_steps(rt, k_draft, plan.steps, draft_allowed, seed=seed, **each), 0.4, 0.2
                    )
                )
            )
        )
    else:
        resident = float(np.median(draft))
    samples = yield from _share(
        iter_verify_samples(rt, cap, seed=seed + 1, repeats=plan.repeats, shapes=plan.shapes, **each),
        1.0 - verify_share,
        verify_share,
    )
    fit = fit_verify_cost([x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
    cost = CostConstants(
        t_ar=float(np.median(ar)),
        c_draft=float(np.median(draft)),
        t_exp=fit.t_exp,
        t_tok=fit.t_tok,
        intercept=fit.intercept,
        source="measured at start-up",
        r2=fit.r2,
        mape=fit.mape,
        n_samples=fit.n,
        c_draft_resident=resident,
    )
    return cost, samples


@dataclass(frozen=True)
class SamplePlan:
    """What a start-up measurement times: `steps` plain, draft and resident draft steps each, `repeats`
    rounds of the verification batches `shapes` ((tokens, variant)), after `warm` untimed rounds of each, each
    part after a context of random tokens or of one token repeated (_prepare)."""

    repeats: int
    steps: int
    warm: int
    shapes: tuple[tuple[int, str], ...]
    repeated_context: bool = False

    @classmethod
    def full(cls, cap: int, repeats: int = 3) -> SamplePlan:
        return cls(repeats, 4 * repeats, 2, tuple((s, v) for s in batch_sizes(cap) for v in VARIANTS))

    @classmethod
    def shortest(cls, cap: int) -> SamplePlan:
        """For a step that reads gigabytes from storage: no random batch of many tokens (its union is most of
        the model's experts, read from storage), yet the counts still vary apart — experts with the tokens
        fixed (one random token against two), tokens with the experts fixed (one token repeated twice and
        cap + 1 times); and each part's context one token repeated (a random one would read most of them too)."""
        return cls(1, 2, 1, ((1, "random"), (2, "random"), (2, "repeat"), (cap + 1, "repeat")), True)


def sample_plan(step_s: float, cap: int, seconds: float, repeats: int = 3) -> SamplePlan:
    """The measurement that takes about `seconds` where a plain step takes `step_s`: all `repeats` where they
    fit (a repeat costs about 12 steps and each batch shape about two), else fewer, else the shortest plan."""
    for n in range(repeats, 0, -1):
        plan = SamplePlan.full(cap, n)
        if n * (12 + 2 * len(plan.shapes)) * step_s <= seconds:
            return plan
    return SamplePlan.shortest(cap)


def _first_plain_step(rt: LlamaRuntime, k_draft: int, seed: int, context: int) -> float:
    """The seconds of one plain step after the measurement's context (the second of two: the first builds
    the graph); the context one token repeated, as the step may be one that reads gigabytes."""
    rng, base = _prepare(rt, seed + 7, context, 2, repeated=True)
    try:
        _step(rt, base, [int(rng.integers(rt.n_vocab))], "verify", k_draft)
        return _step(rt, base, [int(rng.integers(rt.n_vocab))], "verify", k_draft)[0]
    finally:
        rt.kv_clear()


# -- context: how a step's cost grows with the tokens it attends to --------------------------------------
WORKLOAD_CONTEXTS = (32, 128, 256, 384)  # calibration's steps run at the first; prompts of a workload run longer
# what a step is timed as: one that records routing (a verification's single row), a draft pass, a verification
# of cap + 1 rows (a plain step as decoding runs it is timed in decoding itself: engine.measure.calibrate)
CONTEXT_KINDS = ("observed", "draft", "verify")


@dataclass(frozen=True)
class ContextFit:
    """Seconds, per kind of step (CONTEXT_KINDS): its cost at `base` tokens of context (`level`) and its growth
    per further token (`slope`), fitted on the medians at `contexts`; `rows` rows in a verification."""

    base: int
    contexts: tuple[int, ...]
    medians: dict[str, tuple[float, ...]]  # kind → (seconds per context)
    level: dict[str, float]  # kind → seconds at base
    slope: dict[str, float]  # kind → seconds per token of context
    rows: int

    @property
    def row(self) -> float:
        """What each further verified row adds per token of context."""
        return max(0.0, (self.slope["verify"] - self.slope["observed"]) / max(1, self.rows - 1))


def iter_context_steps(
    rt: LlamaRuntime, k_draft: int, cap: int, n: int, *, contexts: Iterable[int] = WORKLOAD_CONTEXTS, seed: int = 0
) -> Measurement[dict[int, dict[str, list[float]]]]:
    """Generator: yields (done, total); returns {context: {kind: [seconds]}} of n steps of each kind
    (CONTEXT_KINDS) after each context length, longer contexts made by extending the shorter one's prefix.
    Leaves the KV cache empty."""
    rng = np.random.default_rng(seed)
    limit = rt.n_ctx - cap - 4
    lengths = sorted({max(1, min(c, limit)) for c in contexts})
    out: dict[int, dict[str, list[float]]] = {}
    done, total = 0, len(lengths) * n
    try:
        rt.kv_clear()
        have = 0
        for c in lengths:
            if c > have:
                if rt.hook is not None:
                    rt.hook.off()
                rt.prefill(rng.integers(0, rt.n_vocab, size=c - have).tolist(), have)
                have = c
            times: dict[str, list[float]] = {}
            for kind in CONTEXT_KINDS:
                # in a row, as decoding runs a kind of step after the same kind (what the cache holds differs
                # after a verification of many rows), the first one untimed
                size = cap + 1 if kind == "verify" else 1
                mode = "draft" if kind == "draft" else "verify"
                times[kind] = [
                    _step(rt, c, rng.integers(0, rt.n_vocab, size=size).tolist(), mode, k_draft)[0]
                    for _ in range(n + 1)
                ][1:]
            done += n
            yield done, total
            out[c] = times
        return out
    finally:
        rt.kv_clear()


def context_line(x: npt.ArrayLike, y: npt.ArrayLike, base: int) -> tuple[float, float]:
    """(value at `base`, slope ≥ 0: a falling one is noise) of a least-squares line through (x, y)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    slope = max(0.0, float(np.polyfit(xs, ys, 1)[0])) if len(set(xs.tolist())) > 1 else 0.0
    return float(np.mean(ys - slope * (xs - base))), slope


def fit_context(timings: Mapping[int, Mapping[str, Sequence[float]]], rows: int, base: int) -> ContextFit:
    """Per kind of step, a line through its medians over the contexts, read at `base`."""
    contexts = sorted(timings)
    medians: dict[str, tuple[float, ...]] = {}
    level: dict[str, float] = {}
    slope: dict[str, float] = {}
    for kind in CONTEXT_KINDS:
        medians[kind] = tuple(float(np.median(timings[c][kind])) for c in contexts)
        level[kind], slope[kind] = context_line(contexts, medians[kind], base)
    return ContextFit(base, tuple(contexts), medians, level, slope, rows)
