"""What a replayed iteration costs on a device: the profile's constants for the trace's model (DeviceCosts) and
what those leave out of a real workload (WorkloadTerms: attention growing with the context, the engine's host
work), as calibrate measured them on the device or as fitted from the traces' own timings. The projection
(engine.measure.projection) charges each replayed iteration with these; calibrate shares the fetch price and
the host-time fit, so that both price a fetch and a draft pass alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from ..events import CostConstants
from ..profiles import cost_for_model, model_block, storage_rates
from .cache_model import ExpertIds
from .trace import Trace, TraceHeader, TraceStep

FETCH_FIT_R2_MIN = 0.8


@dataclass(frozen=True)
class DeviceCosts:
    """Seconds. What the replay charges; `rule` is what the utility rule decides with on that device."""

    profile: str
    t_ar: float
    c_draft: float
    t_tok: float
    t_exp: float  # one more distinct resident expert in a verification
    t_fetch: float  # one expert fetched from storage, beyond its resident cost
    expert_bytes: float
    rule: CostConstants
    basis: str  # where the constants come from, in words
    calibrated: bool  # the profile measured these constants for the trace's own model
    terms: WorkloadTerms | None = None  # what calibrate measured beyond them (None: a profile from before it did)


def device_costs(
    profile: dict[str, Any], header: TraceHeader, *, offloaded: bool, disk_gb_s: float | None = None
) -> DeviceCosts:
    """The profile's constants for the trace's model (its calibration for that model, else its reference
    constants: then the trace stands in for the profile's model, whose expert size and costs apply).
    disk_gb_s: the depth-8 rate the traces' own run read; a fetch is then priced on that disk rather than on
    the one calibrate read (the same device on another day: a fetch's time scales with the rate)."""
    name = profile.get("name", "?")
    rule = cost_for_model(profile, header.fingerprint, header.model, offloaded=offloaded)
    found = model_block(profile, header.fingerprint)
    measured = found is not None
    block: dict[str, Any] = found if found is not None else profile["reference"]
    device = profile.get("device") or {}

    def ms(key: str, source: object = block) -> float | None:
        v = source.get(key) if isinstance(source, dict) else None
        return None if v is None else float(v) / 1e3

    fit = block.get("fit") or {}
    t_exp = ms("t_exp_ms", fit) if fit else ms("t_exp_ms")
    t_tok = (ms("t_tok_ms", fit) if fit else ms("t_tok_ms")) or 0.0
    expert_bytes = float(block.get("expert_bytes") or header.expert_bytes)
    # the offloader asks for a layer's experts together (madvise WILLNEED on each), so they are read at a queue
    # depth of several: the rate at depth 8 where measured, the model's own first (a rate depends on the size
    # of the reads)
    own = storage_rates(profile, header.fingerprint)
    storage = own[1] if own else device.get("storage_bandwidth_qd8_gb_s") or device.get("storage_bandwidth_gb_s")
    by_bandwidth = expert_bytes / (storage * 1e9) if storage else None
    misses = block.get("fit_cold_misses") or {}
    cold, warm = ms("t_exp_cold_ms", misses), ms("t_exp_warm_ms", misses)
    t_exp_cold = ms("t_exp_cold_ms")
    # a fit under the budget that explains little of the time it was fitted on (calibrate warns below this R²)
    # says little about a fetch either: the storage bandwidth does
    weak = measured and misses.get("r2") is not None and misses["r2"] < FETCH_FIT_R2_MIN
    held = block.get("cache_fit") or {}
    paid = (
        decoding_fetch_price(held.get("step_ms"), held.get("fetched_per_token"), float(block["t_ar_ms"]))
        if measured
        else None
    )
    if paid is not None:
        # A fetch's price as plain decoding paid it under the budget, its stalls on faults included, which
        # no read rate and no per-batch fit captures; the replay charges it per counted fetch, as measured.
        t_fetch, how = (
            paid,
            (
                f"fetch: {paid * 1e3:.2f} ms, what plain decoding under the profile's budget paid "
                f"per fetch beyond its resident step"
            ),
        )
    elif weak and by_bandwidth is not None:
        t_fetch, how = (
            by_bandwidth,
            (
                f"fetch: expert bytes over the profile's storage bandwidth (its fit under the "
                f"budget has R² {misses['r2']:.2f})"
            ),
        )
    elif measured and cold is not None and warm is not None and cold > warm:
        t_fetch, how = cold - warm, "fetch: the profile's cold − warm expert cost"
    elif measured and t_exp_cold is not None and t_exp_cold > (t_exp or 0.0):
        t_fetch, how = t_exp_cold - (t_exp or 0.0), "fetch: the profile's cold − resident T_exp"
    elif not measured and t_exp_cold is not None:
        t_fetch, how = t_exp_cold, "fetch: the reference T_exp (expert bytes over storage bandwidth)"
    elif by_bandwidth is not None:
        t_fetch, how = by_bandwidth, "fetch: expert bytes over the profile's storage bandwidth"
    else:
        t_fetch, how = 0.0, "fetch: free (the profile gives no cold cost or storage bandwidth)"
    if disk_gb_s is not None:
        if not measured:
            raise ConfigError(
                f"profile {name} was not calibrated for model {header.model}: pricing fetches on the "
                f"disk the traces were recorded on needs a profile of that device and model"
            )
        if not storage:
            raise ConfigError(
                f"profile {name} records no storage rate to price the traces' disk against: calibrate again"
            )
        scale = storage / disk_gb_s
        t_fetch *= scale
        how += (
            f"; on the traces' disk, {disk_gb_s:.2f} GB/s at depth 8 against the profile's {storage:.2f} (×{scale:.2f})"
        )
    if not measured:
        # A reference profile's T_exp is the paper's: the cost of fetching an expert. Resident, an expert costs
        # its bytes over the memory bandwidth, where the profile gives one.
        memory = device.get("memory_bandwidth_gb_s")
        t_exp = expert_bytes / (memory * 1e9) if memory else 0.0
    whose = "calibrated for this model" if measured else "reference constants, the trace standing in for its model"
    basis = f"profile {name}: {whose}; " + how
    t_ar, c_draft = ms("t_ar_ms"), ms("c_draft_ms")
    assert t_ar is not None and c_draft is not None  # cost_for_model validated this block, which requires both
    return DeviceCosts(
        name, t_ar, c_draft, t_tok, t_exp or 0.0, t_fetch, expert_bytes, rule, basis, measured, profile_terms(block)
    )


def traces_disk(traces: list[Trace]) -> float:
    """GB/s at depth 8: the median of the disk readings the traces carry (bench reads the disk around each
    budget); ConfigError where one carries none."""
    rates = []
    for tr in traces:
        storage = (tr.header.budget or {}).get("storage")
        if not storage:
            raise ConfigError(
                f"trace {tr.name} carries no reading of its disk (recorded by generate, resident, or "
                f"by a bench before bench read the disk around each budget)"
            )
        rates.append(float(storage["qd8_gb_s"]))
    return float(np.median(rates))


def decoding_fetch_price(step_ms: float | None, fetched_per_token: float | None, t_ar_ms: float) -> float | None:
    """Seconds per fetch: calibrate's plain decoding under its budget, its mean step beyond the resident step
    (t_ar_ms), over the fetches it counted a token. None where that decoding was not timed or fetched nothing."""
    if not step_ms or not fetched_per_token or fetched_per_token <= 0:
        return None
    return max(0.0, step_ms - t_ar_ms) / 1e3 / fetched_per_token


# engine.measure.costmodel times its steps and batches after this many tokens of context (its `context` default)
CALIBRATION_CONTEXT = 32


@dataclass(frozen=True)
class WorkloadTerms:
    """Seconds. What a profile's constants, timed at one context on llama.cpp's decode alone, leave out:
    attention growing with the context a workload runs at, and the engine's own work around each decode."""

    ctx_step: float  # per token of context beyond `context`: a verification's first row
    ctx_row: float  # ... and each further row of it
    host_draft: float  # per draft pass, outside llama.cpp's decode: sampling over the vocabulary, the rule
    host_row: float  # per verified row, the decoding loop's own work (acceptance samples each row's logits)
    context: int = CALIBRATION_CONTEXT
    how: str = "none"
    clip: bool = False  # the context below `context` counts as none (how the trace's fit was made)
    ctx_draft: float | None = None  # a draft pass, per token of context (None: as ctx_step)
    t_draft: float | None = None  # a draft pass's decode at `context` in the engine (None: the profile's C_draft)
    # an iteration of resident plain decoding through the engine, its loop's work included (no routing recorded,
    # which makes it cheaper than a verification's first row); None: T_AR + host_row
    t_plain: float | None = None
    ctx_plain: float = 0.0  # ... per token of context

    def beyond(self, ctx: int) -> int:
        return max(0, ctx - self.context) if self.clip else ctx - self.context

    def draft_pass(self, c_draft: float, beyond: int) -> float:
        return (
            (c_draft if self.t_draft is None else self.t_draft)
            + self.host_draft
            + (self.ctx_step if self.ctx_draft is None else self.ctx_draft) * beyond
        )

    def describe(self) -> str:
        plain = (
            "" if self.t_plain is None else f"plain step {self.t_plain * 1e3:.3f} ms + {self.ctx_plain * 1e6:.2f} µs, "
        )
        ctx_draft = self.ctx_step if self.ctx_draft is None else self.ctx_draft
        draft = "" if self.t_draft is None else f"draft pass {self.t_draft * 1e3:.3f} ms + {ctx_draft * 1e6:.2f} µs, "
        return (
            f"{self.how}: {plain}{draft}verification + {self.ctx_step * 1e6:.2f} µs and "
            f"{self.ctx_row * 1e6:.2f} µs per further row, per token of context beyond {self.context}; "
            f"host {self.host_draft * 1e3:.3f} ms per draft pass and {self.host_row * 1e3:.3f} ms per "
            f"verified row"
        )


NO_TERMS = WorkloadTerms(0.0, 0.0, 0.0, 0.0)


def profile_terms(block: dict[str, Any] | None) -> WorkloadTerms | None:
    """The terms `s2moe calibrate` measured on the device (a model block's `workload`), or None for a profile
    written before it measured them."""
    w = (block or {}).get("workload")
    if not w:
        return None
    return WorkloadTerms(
        float(w["ctx_step_us"]) / 1e6,
        float(w["ctx_row_us"]) / 1e6,
        float(w["host_draft_ms"]) / 1e3,
        float(w["host_row_ms"]) / 1e3,
        int(w["context_tokens"]),
        "the profile's workload terms (measured by calibrate)",
        ctx_draft=float(w["ctx_draft_us"]) / 1e6,
        t_draft=float(w["t_draft_ms"]) / 1e3,
        t_plain=float(w["t_plain_ms"]) / 1e3,
        ctx_plain=float(w["ctx_plain_us"]) / 1e6,
    )


def _context(tr: Trace) -> Iterator[tuple[TraceStep, int]]:
    """(step, tokens of context before its verification batch) for every step of a trace."""
    ctx = tr.header.prompt_tokens - 1
    for s in tr.steps:
        yield s, ctx
        ctx += len(s.committed)


def engine_host_times(traces: list[Trace], c_draft: float, ctx_step: float, context: int) -> tuple[float, float, int]:
    """(seconds per draft pass outside its decode, seconds per verified row of the loop's own work, iterations
    they come from) of generations recorded on this machine: a draft pass's decode is `c_draft` at `context`
    tokens of context plus `ctx_step` per further token, the rest of its recorded time is the engine's; the loop's
    time per row is what the recording took outside the draft passes and the verification. Medians over
    iterations, as the step constants are."""
    per_pass: list[float] = []
    per_row: list[float] = []
    for tr in traces:
        for s, ctx in _context(tr):
            per_row.append(s.t_host / len(s.rows))
            if s.drafted:  # a pass for the pending token, then one per drafted token
                passes = 1 + len(s.drafted)
                decode = c_draft + ctx_step * (ctx + len(s.drafted) / 2 - context)
                per_pass.append(s.t_draft / passes - decode)
    if not per_row:
        raise ValueError("no iterations to time the engine's host work on")
    draft = max(0.0, float(np.median(per_pass))) if per_pass else 0.0
    return draft, max(0.0, float(np.median(per_row))), len(per_row)


FITTED = "fitted from the traces' own timings (in-sample)"


def _nnls(X: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Least squares with every coefficient ≥ 0, over the few unknowns here: the best of the subsets whose
    unconstrained solution is non-negative."""
    best, best_res = np.zeros(X.shape[1]), float(y @ y)
    for mask in range(1, 1 << X.shape[1]):
        cols = [j for j in range(X.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        res = y - X[:, cols] @ coef
        if float(res @ res) < best_res:
            best_res, best = float(res @ res), np.zeros(X.shape[1])
            best[cols] = coef
    return best


def recording_terms(traces: list[Trace], costs: DeviceCosts) -> WorkloadTerms:
    """The terms fitted from the traces' own timings (in-sample: only on the machine that recorded them): what
    the recorded draft passes and verifications took beyond the profile's prediction for them, least squares
    (both ≥ 0) on [rows × context, host per draft pass]; the loop's own time per verified row is the median
    over iterations. A term per pass, reading the KV cache, came out unstable from run to run and is left out."""
    loop = float(np.median([s.t_host / len(s.rows) for tr in traces for s in tr.steps]))
    if any(s.verify_misses is not None for tr in traces for s in tr.steps):
        # under a budget what a pass took is mostly its fetches, whose count the recording knows only roughly:
        # the leftovers would be fetch noise, not attention or host time
        return WorkloadTerms(0.0, 0.0, 0.0, loop, how=FITTED + " (under a budget only the loop's time)", clip=True)
    X: list[tuple[float, float]] = []
    y: list[float] = []
    for tr in traces:
        for s, ctx in _context(tr):
            beyond = max(0, ctx - CALIBRATION_CONTEXT)
            n = len(s.rows)
            predicted = verify_compute(costs, s.gated) + costs.t_fetch * (s.verify_misses or 0)
            X.append((n * beyond, 0.0))
            y.append(s.t_verify - predicted)
            if s.drafted:  # per pass: the pending token's, then one per drafted token
                passes = 1 + len(s.drafted)
                X.append((beyond, 1.0))
                y.append((s.t_draft - passes * costs.c_draft - costs.t_fetch * (s.draft_misses or 0)) / passes)
    if len(y) < 4:
        return replace(NO_TERMS, how=FITTED + " (too few iterations: none)")
    t_ctx, host = _nnls(np.asarray(X, float), np.asarray(y, float))
    return WorkloadTerms(float(t_ctx), float(t_ctx), float(host), loop, how=FITTED, clip=True)


def distinct(ids: ExpertIds) -> int:
    """Distinct experts over layers of rows [rows, n_layer, k]."""
    return sum(len(set(ids[:, layer].ravel().tolist()) - {-1}) for layer in range(ids.shape[1]))


def verify_compute(costs: DeviceCosts, rows: ExpertIds) -> float:
    """A verification of `rows` ([rows, n_layer, k]) on the profile's resident constants, anchored at the plain
    step: T_AR, T_tok per further row, T_exp per distinct expert beyond one row's."""
    extra = max(0, distinct(rows) - distinct(rows[:1]))
    return costs.t_ar + costs.t_tok * (len(rows) - 1) + costs.t_exp * extra
