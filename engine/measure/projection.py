"""Projection: what a recorded decoding trace would run at on another device, budget and stopping rule.

A trace (engine.trace) holds, per iteration, the whole draft chain to the cap with each token's draft
probability and predicted target experts, how much of it the target accepted, and the experts every verified
row read. Replaying a mode walks the same token sequence: at each pending token the mode's own rule (the
utility rule under the target device's constants, a confidence threshold, cascade's trials) decides how many
of the recorded draft tokens it would verify; the accepted prefix and the committed tokens follow from the
recorded acceptance, and the next iteration starts where they end (inside a recorded chain: that chain's tail,
its probabilities and routing, stands in for the draft that would have been made there).

s2moe also copies from the context, as decoding does (CopyPlanner, the same decisions): before each step it
looks up the prompt and the tokens committed so far, and the traces of other prompts replayed before it
(decoding: its earlier generations), which it copies from where they match a longer n-gram. A copied token is
accepted while it is the token the recording went on to commit (greedy, and sampled too: a seed commits the same
tokens whatever was drafted). Its rows read what the recording's target read for those tokens; a row past the
first rejected token (whose input the recording never saw) is charged the target's row at that position. The
rule prices copies by the replay's own clock once it timed some, as decoding does by the wall clock, and learns
what plain steps fetch of what they read, as decoding does. Traces recorded before they held their prompts'
token ids replay s2moe without copies.

Time per iteration, from the device profile:
    draft   = passes · C_draft
    verify  = T_AR + T_tok·(tokens − 1) + T_exp·(distinct experts − one token's experts)
    fetch   = T_fetch · (experts the draft passes and the verification found outside the expert cache)
(A trace whose drafts read only experts in memory, `draft_experts: resident`, charges its draft passes no fetch
and reads nothing through the cache for them: which experts they read is not recorded, only that they were in
memory.)
T_AR, C_draft, T_tok and T_exp are the profile's resident constants (its fit's slopes, anchored at the
measured plain step, so that an undrafted step costs exactly what a plain one does). Those are timed at one
short context on llama.cpp's decode alone; what they leave out (WorkloadTerms: attention growing with the
context, the engine's host work per draft pass and verified row, a plain iteration as decoding runs it) comes
from the profile, where `s2moe calibrate` measured it on the device, and is added to each pass. T_fetch is what
an expert fetched from storage costs beyond a resident one: where calibrate timed plain decoding under the
profile's budget, what that decoding paid per fetch (its mean step beyond the resident one, over its fetches a
token: page faults and stalls included, which a read rate leaves out); else the profile's cold-minus-warm cost
where it measured both, else the expert's bytes over its storage bandwidth. The expert cache is simulated for the
budget: the plan engine.offload makes (pinned hot experts from the profile, the rest an LRU of experts); no
budget: all resident.

Two replays are ceilings rather than forecasts: the cache policy `opt` (Belady's: evict what is read
furthest ahead, the fewest fetches any cache of that size could make) and the mode `oracle` (draft exactly
the tokens the target goes on to accept, what no stopping rule can better for the recorded drafter; with
copies, s2moe's drafter: a copy wherever one is found and the target accepts its first token, cut where the
target rejects it, the recorded chain elsewhere).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np

from ..errors import ConfigError
from ..events import CostConstants
from ..offload import Budget, fmt_bytes, plan_budget, rank_counts, select_hot_experts
from ..offload.budget import AUTO_EXPERT_SHARE, plan_slack
from ..drafting.copies import CopyPlanner
from ..drafting.drafters import CascadeDrafter, Proposal
from ..drafting.ngrams import EarlierText
from ..drafting.stoprules import ConfidenceStop, FixedLength, StopRule, UtilityStop, rule_cost
from ..profiles import cost_for_model, model_block, storage_rates
from .trace import Trace, TraceHeader

# Two modes one cannot run, ceilings: oracle drafts exactly the tokens the target goes on to accept (a stopping
# rule that knows the outcome: the best any rule could do with the recorded drafter); perfect verifies the
# next draft-cap tokens in one batch as if a free draft had guessed them all (the best speculation could do
# with any drafter: what is left is what batching the tokens saves).
RUNNABLE_MODES = ("ar", "s2moe", "conf", "cascade")
PROJECT_MODES = RUNNABLE_MODES + ("oracle", "perfect")


# -- the device ------------------------------------------------------------------------------------------
FETCH_FIT_R2_MIN = 0.8
@dataclass(frozen=True)
class DeviceCosts:
    """Seconds. What the replay charges; `rule` is what the utility rule decides with on that device."""

    profile: str
    t_ar: float
    c_draft: float
    t_tok: float
    t_exp: float      # one more distinct resident expert in a verification
    t_fetch: float    # one expert fetched from storage, beyond its resident cost
    expert_bytes: float
    rule: CostConstants
    basis: str        # where the constants come from, in words
    calibrated: bool  # the profile measured these constants for the trace's own model
    terms: WorkloadTerms | None = None  # what calibrate measured beyond them (None: a profile from before it did)


def device_costs(profile: dict, header: TraceHeader, *, offloaded: bool, disk_gb_s: float | None = None) -> DeviceCosts:
    """The profile's constants for the trace's model (its calibration for that model, else its reference
    constants: then the trace stands in for the profile's model, whose expert size and costs apply).
    disk_gb_s: the depth-8 rate the traces' own run read; a fetch is then priced on that disk rather than on
    the one calibrate read (the same device on another day: a fetch's time scales with the rate)."""
    name = profile.get("name", "?")
    rule = cost_for_model(profile, header.fingerprint, header.model, offloaded=offloaded)
    block = model_block(profile, header.fingerprint)
    measured = block is not None
    block = block if measured else profile["reference"]
    device = profile.get("device") or {}

    def ms(key, source=block):
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
    # a fit under the budget that explains little of the time it was fitted on (calibrate warns below this R²)
    # says little about a fetch either: the storage bandwidth does
    weak = measured and misses.get("r2") is not None and misses["r2"] < FETCH_FIT_R2_MIN
    held = block.get("cache_fit") or {}
    paid = (decoding_fetch_price(held.get("step_ms"), held.get("fetched_per_token"), float(block["t_ar_ms"]))
            if measured else None)
    if paid is not None:
        # A fetch's price as plain decoding paid it under the budget, its stalls on faults included, which
        # no read rate and no per-batch fit captures; the replay charges it per counted fetch, as measured.
        t_fetch, how = paid, (f"fetch: {paid * 1e3:.2f} ms, what plain decoding under the profile's budget paid "
                              f"per fetch beyond its resident step")
    elif weak and by_bandwidth is not None:
        t_fetch, how = by_bandwidth, (f"fetch: expert bytes over the profile's storage bandwidth (its fit under the "
                                      f"budget has R² {misses['r2']:.2f})")
    elif measured and cold is not None and warm is not None and cold > warm:
        t_fetch, how = cold - warm, "fetch: the profile's cold − warm expert cost"
    elif measured and ms("t_exp_cold_ms") is not None and ms("t_exp_cold_ms") > (t_exp or 0.0):
        t_fetch, how = ms("t_exp_cold_ms") - (t_exp or 0.0), "fetch: the profile's cold − resident T_exp"
    elif not measured and ms("t_exp_cold_ms") is not None:
        t_fetch, how = ms("t_exp_cold_ms"), "fetch: the reference T_exp (expert bytes over storage bandwidth)"
    elif by_bandwidth is not None:
        t_fetch, how = by_bandwidth, "fetch: expert bytes over the profile's storage bandwidth"
    else:
        t_fetch, how = 0.0, "fetch: free (the profile gives no cold cost or storage bandwidth)"
    if disk_gb_s is not None:
        if not measured:
            raise ConfigError(f"profile {name} was not calibrated for model {header.model}: pricing fetches on the "
                              f"disk the traces were recorded on needs a profile of that device and model")
        if not storage:
            raise ConfigError(f"profile {name} records no storage rate to price the traces' disk against: "
                              f"calibrate again")
        scale = storage / disk_gb_s
        t_fetch *= scale
        how += (f"; on the traces' disk, {disk_gb_s:.2f} GB/s at depth 8 against the profile's {storage:.2f} "
                f"(×{scale:.2f})")
    if not measured:
        # A reference profile's T_exp is the paper's: the cost of fetching an expert. Resident, an expert costs
        # its bytes over the memory bandwidth, where the profile gives one.
        memory = device.get("memory_bandwidth_gb_s")
        t_exp = expert_bytes / (memory * 1e9) if memory else 0.0
    whose = "calibrated for this model" if measured else "reference constants, the trace standing in for its model"
    basis = f"profile {name}: {whose}; " + how
    return DeviceCosts(name, ms("t_ar_ms"), ms("c_draft_ms"), t_tok, t_exp or 0.0, t_fetch, expert_bytes, rule, basis,
                       measured, profile_terms(block))


DISK_SOURCES = ("profile", "trace")


def traces_disk(traces: list[Trace]) -> float:
    """GB/s at depth 8: the median of the disk readings the traces carry (bench reads the disk around each
    budget); ConfigError where one carries none."""
    rates = []
    for tr in traces:
        storage = (tr.header.budget or {}).get("storage")
        if not storage:
            raise ConfigError(f"trace {tr.name} carries no reading of its disk (recorded by generate, resident, or "
                              f"by a bench before bench read the disk around each budget)")
        rates.append(float(storage["qd8_gb_s"]))
    return float(np.median(rates))


def decoding_fetch_price(step_ms: float | None, fetched_per_token: float | None, t_ar_ms: float) -> float | None:
    """Seconds per fetch: calibrate's plain decoding under its budget, its mean step beyond the resident step
    (t_ar_ms), over the fetches it counted a token. None where that decoding was not timed or fetched nothing."""
    if not step_ms or not fetched_per_token or fetched_per_token <= 0:
        return None
    return max(0.0, step_ms - t_ar_ms) / 1e3 / fetched_per_token


# engine.costmodel times its steps and batches after this many tokens of context (its `context` default)
CALIBRATION_CONTEXT = 32
TERM_SOURCES = ("profile", "trace", "none")


@dataclass(frozen=True)
class WorkloadTerms:
    """Seconds. What a profile's constants, timed at one context on llama.cpp's decode alone, leave out:
    attention growing with the context a workload runs at, and the engine's own work around each decode."""

    ctx_step: float      # per token of context beyond `context`: a verification's first row
    ctx_row: float       # ... and each further row of it
    host_draft: float    # per draft pass, outside llama.cpp's decode: sampling over the vocabulary, the rule
    host_row: float      # per verified row, the decoding loop's own work (acceptance samples each row's logits)
    context: int = CALIBRATION_CONTEXT
    how: str = "none"
    clip: bool = False   # the context below `context` counts as none (how the trace's fit was made)
    ctx_draft: float | None = None  # a draft pass, per token of context (None: as ctx_step)
    t_draft: float | None = None    # a draft pass's decode at `context` in the engine (None: the profile's C_draft)
    # an iteration of resident plain decoding through the engine, its loop's work included (no routing recorded,
    # which makes it cheaper than a verification's first row); None: T_AR + host_row
    t_plain: float | None = None
    ctx_plain: float = 0.0          # ... per token of context

    def beyond(self, ctx: int) -> int:
        return max(0, ctx - self.context) if self.clip else ctx - self.context

    def draft_pass(self, c_draft: float, beyond: int) -> float:
        return ((c_draft if self.t_draft is None else self.t_draft) + self.host_draft
                + (self.ctx_step if self.ctx_draft is None else self.ctx_draft) * beyond)

    def describe(self) -> str:
        plain = ("" if self.t_plain is None else
                 f"plain step {self.t_plain * 1e3:.3f} ms + {self.ctx_plain * 1e6:.2f} µs, ")
        draft = ("" if self.t_draft is None else
                 f"draft pass {self.t_draft * 1e3:.3f} ms + {self.ctx_draft * 1e6:.2f} µs, ")
        return (f"{self.how}: {plain}{draft}verification + {self.ctx_step * 1e6:.2f} µs and "
                f"{self.ctx_row * 1e6:.2f} µs per further row, per token of context beyond {self.context}; "
                f"host {self.host_draft * 1e3:.3f} ms per draft pass and {self.host_row * 1e3:.3f} ms per "
                f"verified row")


NO_TERMS = WorkloadTerms(0.0, 0.0, 0.0, 0.0)


def profile_terms(block: dict | None) -> WorkloadTerms | None:
    """The terms `s2moe calibrate` measured on the device (a model block's `workload`), or None for a profile
    written before it measured them."""
    w = (block or {}).get("workload")
    if not w:
        return None
    return WorkloadTerms(float(w["ctx_step_us"]) / 1e6, float(w["ctx_row_us"]) / 1e6, float(w["host_draft_ms"]) / 1e3,
                         float(w["host_row_ms"]) / 1e3, int(w["context_tokens"]),
                         "the profile's workload terms (measured by calibrate)",
                         ctx_draft=float(w["ctx_draft_us"]) / 1e6, t_draft=float(w["t_draft_ms"]) / 1e3,
                         t_plain=float(w["t_plain_ms"]) / 1e3, ctx_plain=float(w["ctx_plain_us"]) / 1e6)


def _context(tr: Trace):
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
    per_pass, per_row = [], []
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


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
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
    X, y = [], []
    for tr in traces:
        for s, ctx in _context(tr):
            beyond = max(0, ctx - CALIBRATION_CONTEXT)
            n = len(s.rows)
            predicted = _verify_compute(costs, s.gated) + costs.t_fetch * (s.verify_misses or 0)
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


# -- the expert cache ------------------------------------------------------------------------------------
# opt: Belady's rule, evicting the expert whose next read lies furthest ahead. No cache can fetch less for the
# same reads, so a projection under it is the ceiling of any eviction policy, not a forecast of the engine's.
CACHE_POLICIES = ("lru", "fifo", "opt")


class ExpertCache:
    """Experts in memory under a budget: the pinned ones always, the rest `capacity` experts evicted least
    recently used first (lru), first in, first out (fifo), or by what is read next (opt, which needs `future`:
    the reads to come, as `seen` lists them after a pass over the same accesses). capacity None: everything
    resident (no budget). Reads come a layer at a time, as the engine routes them: a layer's own experts are
    never evicted to make room for each other."""

    def __init__(self, n_expert: int, capacity: int | None, pinned=(), policy: str = "lru",
                 future: list[frozenset] | None = None):
        if policy == "opt" and future is None:
            raise ValueError("the opt policy needs the reads to come")
        self.n_expert = n_expert
        self.capacity = capacity
        self.policy = policy
        self.pinned = {int(l) * n_expert + int(e) for l, e in pinned}
        self.held: OrderedDict[int, int] = OrderedDict()  # expert -> its next read (opt) or 0
        self.seen: list[frozenset] = []                   # every layer's group of non-pinned reads, in order
        self._reads_at: dict[int, list[int]] = {}
        for i, group in enumerate(future or ()):
            for key in group:
                self._reads_at.setdefault(key, []).append(i)

    def _next_read(self, key: int, after: int) -> int:
        at = self._reads_at.get(key, ())
        i = bisect_right(at, after)
        return at[i] if i < len(at) else 1 << 62

    def access(self, ids: np.ndarray) -> int:
        """Read the experts `ids` ([..., n_layer, k] ids, -1 none; each distinct one once); how many missed."""
        if self.capacity is None:
            return 0
        ids = np.asarray(ids)
        misses = 0
        for layer in range(ids.shape[-2]):
            col = ids[..., layer, :]
            group = frozenset((layer * self.n_expert + np.unique(col[col >= 0])).tolist()) - self.pinned
            misses += self._read_layer(group)
        return misses

    def _read_layer(self, group: frozenset) -> int:
        now = len(self.seen)
        self.seen.append(group)
        misses = 0
        for key in sorted(group):
            if key in self.held:
                if self.policy == "lru":
                    self.held.move_to_end(key)
                elif self.policy == "opt":
                    self.held[key] = self._next_read(key, now)
                continue
            misses += 1
            if self.capacity > 0:
                self.held[key] = self._next_read(key, now) if self.policy == "opt" else 0
        while len(self.held) > self.capacity:
            others = (k for k in self.held if k not in group)
            victim = (max(others, key=self.held.__getitem__, default=None) if self.policy == "opt"
                      else next(others, None))
            if victim is None:
                break
            del self.held[victim]
        return misses


def with_cache(run, plan: "CachePlan", n_expert: int, policy: str, rounds: int = 4):
    """run(cache) under the plan's cache. For opt, `run` goes once under LRU to learn its reads and again under
    Belady's rule over them; where the reads follow the fetches (cascade's trials follow its timings) it goes on
    until a pass reads what the one before it did, or `rounds` passes, the last standing."""
    if policy != "opt" or plan.capacity is None:
        return run(plan.cache(n_expert, policy))
    seen = plan.cache(n_expert, "lru")
    run(seen)
    for _ in range(rounds):
        cache = plan.cache(n_expert, "opt", seen.seen)
        out = run(cache)
        if cache.seen == seen.seen:
            break
        seen = cache
    return out


@dataclass(frozen=True)
class CachePlan:
    capacity: int | None          # LRU experts (None: no budget, all resident)
    pinned: tuple                 # (layer, expert) pinned hot experts
    label: str

    def cache(self, n_expert: int, policy: str = "lru", future: list[frozenset] | None = None) -> ExpertCache:
        return ExpertCache(n_expert, self.capacity, self.pinned, policy, future)


def cache_plan(budget: str | None, header: TraceHeader, profile: dict, expert_bytes: float) -> CachePlan:
    """How a budget splits between pinned hot experts and the expert cache, as engine.offload plans it
    (plan_budget, select_hot_experts). The budget a trace was recorded under (auto, or the same size): the plan
    that run made. Another budget: the room the process would leave for experts, with what a run under a budget
    held beside its experts (heap, llama.cpp's buffers, pinned weights: process_held) held again; without such
    a run, the budget less the non-expert weights. `auto` gives the experts a third of their bytes
    (AUTO_EXPERT_SHARE), as `--budget auto` gives the expert cache."""
    if budget is None or budget == "none":
        return CachePlan(None, (), "none (all resident)")
    b = Budget.parse(budget)
    n_moe = header.n_layer  # layers without experts are never read: their share of the plan stays unused
    total = header.n_expert * n_moe * expert_bytes
    recorded = header.budget
    if recorded is not None and (recorded.get("auto") if b.auto else recorded["budget_bytes"] == b.size):
        # the budget the trace ran under: the plan that run made (for the process it measured, not a model of it)
        cap = int(recorded["cache_bytes"] // header.expert_bytes)
        return CachePlan(cap, tuple(tuple(p) for p in recorded["pinned"]),
                         f"{'auto' if b.auto else fmt_bytes(b.size)} as recorded "
                         f"({fmt_bytes(recorded['budget_bytes'])}: "
                         f"{len(recorded['pinned'])} hot experts pinned, cache of {cap} experts)")
    block = model_block(profile, header.fingerprint) or {}
    hot_ranked = list(block.get("hot_experts") or [])
    sizes = SimpleNamespace(expert_bytes=np.full(header.n_layer, expert_bytes))  # all plan_budget reads of a map
    measured = process_held(header, block, expert_bytes)
    if measured is not None:
        held, whose = measured
        room = int(AUTO_EXPERT_SHARE * total) if b.auto else None  # else plan_budget's: what held and slack leave
        size = held + room + plan_slack(held + room) if b.auto else b.size
        plan = plan_budget(size, anon_bytes=held, base_bytes=0, emap=sizes, k=header.k, pin_hot=bool(hot_ranked),
                           expert_room=room)
        plan.check_room(int(header.k * expert_bytes))  # a budget the process would not run in, as decoding says
        besides = f", the process holding {fmt_bytes(held)} beside its experts as {whose} did"
    else:
        size = int(header.non_expert_bytes + AUTO_EXPERT_SHARE * total) if b.auto else b.size
        plan = plan_budget(size, anon_bytes=0, base_bytes=header.non_expert_bytes, emap=sizes, k=header.k,
                           pin_hot=bool(hot_ranked))
        besides = ", the process's own memory not counted (no run under a budget measured it)"
    pinned = ()
    if hot_ranked:
        counts = rank_counts(hot_ranked, SimpleNamespace(n_layer=header.n_layer, n_expert=header.n_expert))
        pinned = tuple(select_hot_experts(counts, expert_bytes, plan.hot_bytes))
    plan = plan.with_pinned(int(len(pinned) * expert_bytes))
    cap = int(plan.cache_bytes // expert_bytes)
    label = (f"{'auto' if b.auto else fmt_bytes(size)}: {len(pinned)} hot experts pinned, cache of {cap} experts"
             f" ({fmt_bytes(cap * expert_bytes)}){besides}")
    priced_staged = (block.get("cache_fit") or {}).get("planned_experts", header.k) < header.k
    if cap < header.k and not priced_staged:
        # the fetches are still counted right; their price, measured where a layer fit, is not (docs/calibration.md)
        label += (f"; a layer's {header.k} experts do not fit the cache, so decoding reads every layer in stages,"
                  f" each fetch dearer than where a layer fits (calibrate under this budget to price it)")
    return CachePlan(cap, pinned, label)


def process_held(header: TraceHeader, block: dict, expert_bytes: float) -> tuple[int, str] | None:
    """What a decoding process held under a budget beside its experts, and whose run measured it: the trace's
    own run where it was recorded under a budget, else the profile's calibration under one (its cold
    worker's plan: pinned and cached experts at the budget it measured). None where neither ran."""
    recorded = header.budget
    if recorded is not None:
        experts = recorded["hot_bytes"] + recorded["cache_bytes"]
        budget, whose = recorded["budget_bytes"], "the recorded run"
    else:
        fit, budget = block.get("cache_fit"), (block.get("measured") or {}).get("budget_bytes")
        if not fit or not budget:
            return None
        experts, whose = (fit["planned_experts"] + (fit.get("pinned") or 0)) * expert_bytes, "the calibrated run"
    return max(0, int(budget - plan_slack(budget) - experts)), whose


# -- replay ----------------------------------------------------------------------------------------------
@dataclass
class ModeProjection:
    mode: str
    tokens: int = 0
    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_passes: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_fetch: float = 0.0
    t_host: float = 0.0
    fetched: int = 0
    speedup: float | None = None
    copied: int = 0            # tokens verified as copies (from the context or earlier generations)
    copies_accepted: int = 0   # ... and accepted
    copied_session: int = 0    # of those, copies from the session's earlier generations
    session_accepted: int = 0  # ... and accepted

    @property
    def seconds(self) -> float:
        return self.t_draft + self.t_verify + self.t_fetch + self.t_host

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_len(self) -> float:
        return self.tokens / self.iterations if self.iterations else 0.0

    @property
    def fetched_per_token(self) -> float:
        return self.fetched / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {"mode": self.mode, "tokens": self.tokens, "iterations": self.iterations, "drafted": self.drafted,
                "accepted": self.accepted, "draft_passes": self.draft_passes, "seconds": self.seconds,
                "tok_per_s": self.tok_per_s, "speedup_vs_ar": self.speedup, "accept_len": self.accept_len,
                "t_draft_s": self.t_draft, "t_verify_s": self.t_verify, "t_fetch_s": self.t_fetch,
                "t_host_s": self.t_host, "fetched": self.fetched, "fetched_per_token": self.fetched_per_token,
                "copied": self.copied,
                "copies_accepted": self.copies_accepted, "copied_session": self.copied_session,
                "session_accepted": self.session_accepted}


@dataclass
class Projection:
    profile: str
    budget: str
    basis: str
    traces: int
    terms: str = "none"   # where the terms beyond the constants came from (WorkloadTerms.how)
    repeats: int = 1      # times the traces were replayed over
    modes: dict[str, ModeProjection] = field(default_factory=dict)
    # under a budget, traces recorded under one: {policy: (fetched as the recording counted, as simulated)}
    cache_fit: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"profile": self.profile, "budget": self.budget, "basis": self.basis, "traces": self.traces,
                "repeats": self.repeats, "terms": self.terms,
                "modes": {m: r.as_dict() for m, r in self.modes.items()},
                "cache_fit": {k: {"recorded": r, "simulated": s} for k, (r, s) in self.cache_fit.items()}}


class _Source:
    """The recorded draft chain seen from pending position j of one trace step."""

    def __init__(self, step, j: int):
        self.step, self.j = step, j

    @property
    def pending(self) -> np.ndarray | None:
        return self.step.pending if self.j == 0 else self.step.drafted[self.j - 1].predicted

    def __len__(self) -> int:
        return len(self.step.drafted) - self.j if self.pending is not None else 0

    def __getitem__(self, i: int):
        return self.step.drafted[self.j + i]


@dataclass
class _Draft(Proposal):
    passes: list = field(default_factory=list)  # per draft pass: the [n_layer, k_d] experts it read


def _mask(ids: np.ndarray, n_expert: int) -> np.ndarray:
    m = np.zeros((ids.shape[0], n_expert + 1), bool)
    m[np.arange(ids.shape[0])[:, None], np.where(ids >= 0, ids, n_expert)] = True
    return m


def propose(rule: StopRule, src: _Source, max_len: int, k_d: int, n_expert: int) -> _Draft:
    """What SelfDrafter.propose does with `rule`, on the recorded chain instead of draft passes: the same calls
    into the rule, in the same order, with the same numbers."""
    out = _Draft()
    max_len = min(max_len, len(src))
    if max_len <= 0:
        out.stop = "limit"
        return out
    if not rule.worth_drafting():
        out.stop = "no-draft"
        return out
    in_batch = _mask(src.pending, n_expert)
    out.passes.append(src.pending[:, :k_d])
    chain = 1.0  # p_i: the rule's acceptance of each token, multiplied
    out.stop = "cap"
    for i in range(max_len):
        d = src[i]
        chain *= rule.acceptance(d.prob)
        if i == 0:
            rule.observe_first(d.prob)
        if rule.pre_reject(chain, d.prob)[0]:
            out.stop = "rule"
            break
        new = 0
        routed = rule.needs_routing or i < max_len - 1
        if routed:
            out.passes.append(d.predicted[:, :k_d])
            predicted = _mask(d.predicted, n_expert)
            new = int((predicted & ~in_batch)[:, :n_expert].sum())
            if i == 0:
                rule.observe_first_experts(new)
        if not rule.keep(chain, d.prob, new)[0]:
            out.stop = "rule"
            break
        if routed:
            in_batch |= predicted
        out.tokens.append(d.token)
    return out


class _ChainFromTrace:
    """Cascade's inner drafter: a fixed length on the recorded chain (the source set before each call)."""

    def __init__(self, k_d: int, n_expert: int):
        self.rule = FixedLength()
        self.k_d, self.n_expert = k_d, n_expert
        self.source: _Source | None = None

    def propose(self, dec, committed, max_len, sample) -> _Draft:
        return propose(self.rule, self.source, max_len, self.k_d, self.n_expert)


def _distinct(ids: np.ndarray) -> int:
    """Distinct experts over layers of rows [rows, n_layer, k]."""
    return sum(len(set(ids[:, l].ravel().tolist()) - {-1}) for l in range(ids.shape[1]))


def _verify_compute(costs: DeviceCosts, rows: np.ndarray) -> float:
    """A verification of `rows` ([rows, n_layer, k]) on the profile's resident constants, anchored at the plain
    step: T_AR, T_tok per further row, T_exp per distinct expert beyond one row's."""
    extra = max(0, _distinct(rows) - _distinct(rows[:1]))
    return costs.t_ar + costs.t_tok * (len(rows) - 1) + costs.t_exp * extra


def replay(traces: list[Trace], mode: str, costs: DeviceCosts, plan: CachePlan,
           threshold: float | None = None, policy: str = "lru", terms: WorkloadTerms = NO_TERMS,
           lookup: bool = False, session: bool = False) -> ModeProjection:
    """Replay `mode` over the traces in order (one process: the rule's learning and the cache carry over).
    lookup: s2moe copies from the context where its rule says they pay, as decoding does (the traces must hold
    their prompts' ids: replays_copies); session: and from the traces of other prompts replayed before, where they
    match a longer n-gram than the context, as decoding copies from its earlier generations."""
    if mode not in PROJECT_MODES:
        raise ConfigError(f"cannot project mode {mode!r} (choose from {', '.join(PROJECT_MODES)})")
    if lookup and not replays_copies(traces):
        raise ConfigError("replaying copies from the context needs traces that hold their prompts' token ids")

    def run(cache: ExpertCache) -> ModeProjection:
        if mode == "perfect":
            return _perfect(traces, costs, cache, terms)
        return _replay(traces, mode, costs, cache, threshold, terms, lookup, session)

    return with_cache(run, plan, traces[0].header.n_expert, policy)


def _perfect(traces: list[Trace], costs: DeviceCosts, cache: ExpertCache, terms: WorkloadTerms) -> ModeProjection:
    """Every draft right and free: the committed tokens verified draft-cap + 1 at a time, each batch reading
    the union of its tokens' own experts and costing a verification of that many rows."""
    res = ModeProjection("perfect")
    for tr in traces:
        h = tr.header
        # the experts each committed token was computed with: a step's pending token and its accepted drafts
        rows = [s.rows[i] for s in tr.steps for i in range(min(s.accepted + 1, len(s.rows)))][:tr.n_tokens]
        for start in range(0, len(rows), h.draft_max + 1):
            batch = np.stack(rows[start: start + h.draft_max + 1])
            n = len(batch) - 1
            misses = cache.access(batch)
            beyond = terms.beyond(h.prompt_tokens - 1 + start)
            res.iterations += 1
            res.tokens += len(batch)
            res.drafted += n
            res.accepted += n
            res.t_verify += _verify_compute(costs, batch) + (terms.ctx_step + terms.ctx_row * n) * beyond
            res.t_fetch += costs.t_fetch * misses
            res.t_host += terms.host_row * (n + 1)
            res.fetched += misses
    return res


def replays_copies(traces: list[Trace]) -> bool:
    """Whether s2moe's copies from the context can be replayed on the traces: they hold their prompts' ids."""
    return all(tr.header.prompt is not None for tr in traces)


def _replay(traces: list[Trace], mode: str, costs: DeviceCosts, cache: ExpertCache, threshold: float | None,
            terms: WorkloadTerms, lookup: bool = False, session: bool = False) -> ModeProjection:
    h0 = traces[0].header
    res = ModeProjection(mode)
    rule: StopRule | None = None
    cascade = inner = None
    if mode == "s2moe":
        rule = UtilityStop(rule_cost(costs.rule, h0.draft_experts), h0.threshold if threshold is None else threshold)
    elif mode == "conf":
        rule = ConfidenceStop(h0.conf_p_min)
    elif mode == "cascade":
        cascade = CascadeDrafter(h0.k_d, h0.draft_max)
        inner = cascade.inner = _ChainFromTrace(h0.k_d, h0.n_expert)
    elif mode == "oracle" and lookup:
        # the oracle's drafter is s2moe's: copies where the context (or an earlier trace) holds one, the
        # recorded chain elsewhere; its rule copies whatever is found (threshold 0), each copy cut below where
        # the target rejects it
        rule = UtilityStop(rule_cost(costs.rule, h0.draft_experts), 0.0)
    copying = lookup and mode in ("s2moe", "oracle")
    earlier = EarlierText() if copying and session else None
    gated_rows = mode in ("s2moe", "oracle")  # the oracle's acceptance is the recording's, gated where it was
    # resident, a step without drafts is a plain one (under a budget the prefetcher needs its routing)
    plain_unobserved = terms.t_plain is not None and cache.capacity is None
    for tr in traces:
        h = tr.header
        if isinstance(rule, UtilityStop):
            rule.start()
        # per generated position: the recorded step that committed it and its index there (that step's row of
        # the same index is the target's pass that produced it), and the token
        where = [(si, i) for si, s in enumerate(tr.steps) for i in range(len(s.committed))]
        tokens = [s.committed[i] for s in tr.steps for i in range(len(s.committed))]
        # as in decoding, a generation's copies look up its own context, then the earlier generations, with what
        # the rule learned of them
        planner = CopyPlanner(rule, earlier, h.prompt) if copying else None
        context = list(h.prompt) if copying else None
        generated = 0
        while generated < tr.n_tokens:
            si, j = where[generated]
            step = tr.steps[si]
            src = _Source(step, j)
            max_len = min(h.draft_max, h.n_predict - generated - 1)
            plan = planner.plan(context, max_len) if planner is not None else None
            if plan is not None and mode == "oracle":
                right = next((i for i, t in enumerate(plan.tokens)
                              if generated + i >= tr.n_tokens or t != tokens[generated + i]), len(plan.tokens))
                del plan.tokens[right:], plan.kinds[right:]
                if not right:
                    plan = None
            if plan is not None:
                draft = _Draft(list(plan.tokens), stop="lookup")
            elif mode == "ar":
                draft = _Draft()
            elif cascade is not None:
                inner.source = src
                draft = cascade.propose(None, None, max_len, None)
            elif mode == "oracle":
                draft = propose(FixedLength(), src, min(max_len, step.accepted - j), h.k_d, h.n_expert)
            else:
                draft = propose(rule, src, max_len, h.k_d, h.n_expert)
            n = len(draft.tokens)
            passes = getattr(draft, "passes", [])
            if plan is not None:
                # a copied token is accepted while it is the token the target went on to commit; a row past the
                # first rejected one read what the target's own row at that position read (the best record of it)
                accepted = next((i for i, t in enumerate(draft.tokens)
                                 if generated + i >= tr.n_tokens or t != tokens[generated + i]), n)
                rows = np.stack([_row(tr, where, min(generated + i, tr.n_tokens - 1), gated_rows)
                                 for i in range(n + 1)])
                committed = min(accepted + 1, tr.n_tokens - generated)
            else:
                accepted = min(n, step.accepted - j)
                if rule is not None and n:  # what SelfDrafter.feedback tells the rule of the verification
                    rule.observe_outcome([src[i].prob for i in range(n)], accepted)
                committed = min(accepted + 1, len(step.committed) - j)
                # reuse gating acts on a verification of drafted tokens only (a plain step reads the router's choice)
                rows = (step.gated if gated_rows and n else step.rows)[j: j + n + 1]
            beyond = terms.beyond(h.prompt_tokens - 1 + generated)  # context past the one the constants were timed at
            t_draft = len(passes) * terms.draft_pass(costs.c_draft, beyond)
            draft_misses = _draft_misses(cache, passes, h)
            verify_misses = cache.access(rows)
            plain = n == 0 and plain_unobserved
            if plain:  # the whole iteration, the loop's own work with it
                t_verify = terms.t_plain + terms.ctx_plain * beyond
            else:
                t_verify = _verify_compute(costs, rows) + (terms.ctx_step + terms.ctx_row * n) * beyond
            t_fetch = costs.t_fetch * (draft_misses + verify_misses)
            t_host = 0.0 if plain else terms.host_row * (n + 1)
            res.iterations += 1
            res.tokens += committed
            res.drafted += n
            res.accepted += accepted
            res.draft_passes += len(passes)
            res.t_draft += t_draft
            res.t_verify += t_verify
            res.t_fetch += t_fetch
            res.t_host += t_host
            res.fetched += draft_misses + verify_misses
            if cascade is not None:
                # what CascadeDrafter.feedback reads of an Iteration event: its tokens and its seconds
                cascade.feedback(SimpleNamespace(committed=(0,) * committed,
                                                 t_draft=t_draft + costs.t_fetch * draft_misses,
                                                 t_verify=t_verify + costs.t_fetch * verify_misses))
            generated += committed
            if planner is not None:
                if plan is not None:
                    res.copied += n
                    res.copies_accepted += accepted
                    if plan.source == "session":
                        res.copied_session += n
                        res.session_accepted += accepted
                    planner.learn(plan, accepted, _distinct(rows), int((rows[0] >= 0).sum()))
                elif n == 0 and cache.capacity is not None:
                    # what LookupOrSelfDrafter.feedback tells the planner of a plain step under a budget: where
                    # such steps fetch most of what they read, copies are hoped for and a copied token saves
                    # the plain step as timed
                    planner.learned.fetched(verify_misses, _distinct(rows))
                # decoding times an iteration when the next one begins: a plain step, a copy, or a self-draft that
                # prices nothing (the last iteration of a generation is never timed)
                if generated < tr.n_tokens:
                    planner.learned.timed(t_draft + t_verify + t_fetch + t_host,
                                          n if plan is not None or n == 0 else None, accepted)
                context.extend(tokens[generated - committed: generated])
        if earlier is not None:
            earlier.add(h.prompt, context)
    return res


def _row(tr: Trace, where: list[tuple[int, int]], position: int, gated: bool) -> np.ndarray:
    """The experts the target read for the token at generated `position`: its recorded step's row of it."""
    si, i = where[position]
    step = tr.steps[si]
    return (step.gated if gated else step.rows)[i]


def _draft_misses(cache: ExpertCache, passes: list, header: TraceHeader) -> int:
    """Experts the draft passes fetch: those of each pass outside the cache, where the drafts read the router's
    choice; none where they read only experts in memory."""
    if header.draft_experts == "resident":
        return 0
    return sum(cache.access(p) for p in passes)


def cache_check(traces: list[Trace], plan: CachePlan, policy: str) -> tuple[int, int] | None:
    """(experts the recording run fetched, by its own count; the same run's reads through the simulated cache):
    how well the cache model stands for the engine's offloading. None: the traces were not recorded under a
    budget."""
    if any(s.verify_misses is None or s.draft_misses is None for tr in traces for s in tr.steps):
        return None
    recorded = sum(s.verify_misses + s.draft_misses for tr in traces for s in tr.steps)

    def simulated(cache: ExpertCache) -> int:
        fetched = 0
        for tr in traces:
            kd = tr.header.k_d
            for s in tr.steps:
                if s.drafted:  # the recording drafted to the cap: a pass for the pending token and each drafted one
                    passes = [s.pending[:, :kd]] + [d.predicted[:, :kd] for d in s.drafted]
                    fetched += _draft_misses(cache, passes, tr.header)
                fetched += cache.access(s.gated)
        return fetched

    return recorded, with_cache(simulated, plan, traces[0].header.n_expert, policy)


def _smallest_capacity(fetched, target: int, most: int) -> int:
    """The smallest cache size in 0..most at which fetched(size) is at most `target` (fetches fall as the cache
    grows, for LRU and here for FIFO alike: bisection)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        if fetched(mid) > target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def capacity_fetching(ids: list[np.ndarray], counted: int, plan: CachePlan, n_expert: int, warm: int = 0,
                      policy: str = "lru") -> int:
    """The cache size (beside the plan's pinned experts) at which the steps `ids` (each [n_layer, k]) fetch
    `counted` experts after the first `warm`."""
    def fetched(capacity: int) -> int:
        return with_cache(lambda cache: sum(cache.access(x) * (i >= warm) for i, x in enumerate(ids)),
                          CachePlan(capacity, plan.pinned, plan.label), n_expert, policy)

    return _smallest_capacity(fetched, counted, ids[0].shape[0] * n_expert if ids else 0)


def fitted_capacity(traces: list[Trace], plan: CachePlan, policy: str) -> int | None:
    """The cache size at which the simulated cache fetches what the recording counted for its own reads. None
    without a recorded count."""
    check = cache_check(traces, plan, policy)
    if check is None:
        return None
    h = traces[0].header
    return _smallest_capacity(lambda size: cache_check(traces, CachePlan(size, plan.pinned, plan.label), policy)[1],
                              check[0], h.n_layer * h.n_expert)


def _terms(traces: list[Trace], costs: DeviceCosts, source: str) -> tuple[WorkloadTerms, str]:
    """The terms a projection charges beyond the constants, and what they are in words."""
    if source == "none":
        return NO_TERMS, "the profile's constants only (--terms none: context growth and host work left out)"
    if source == "trace":
        if not costs.calibrated:
            raise ConfigError(f"fitting terms from the traces needs a profile calibrated for their model on the "
                              f"machine that recorded them; {costs.profile} is not")
        t = recording_terms(traces, costs)
        return t, t.describe()
    if costs.terms is not None:
        return costs.terms, costs.terms.describe()
    if costs.calibrated:
        t = recording_terms(traces, costs)
        return t, (f"this profile has no workload terms (calibrated before calibrate measured them; calibrate again "
                   f"to project from the profile alone): {t.describe()}")
    return NO_TERMS, "the profile's constants only (it has no workload terms: context growth and host work left out)"


def project(traces: list[Trace], profile: dict, *, budget: str | None = None, modes=RUNNABLE_MODES,
            threshold: float | None = None, policy: str = "lru", fit_cache: bool = False,
            terms: str = "profile", cache_size: str = "plan", disk: str = "profile",
            lookup: bool = True, session: bool = True, repeats: int = 1) -> Projection:
    """Every mode's projected speed on `profile` under `budget` (None: all resident), the expert cache
    evicting by `policy`. fit_cache: size the cache so that it fetches what the recording counted for its own
    reads (traces recorded under this same budget), instead of the budget plan's size. terms: what is charged
    beyond the profile's constants (context growth, the engine's host work): the profile's own measurement
    (a profile without one: fitted from the traces where the profile was calibrated for their model, as before
    calibrate measured them, and said so), fitted from the traces (in-sample), or none. cache_size: "plan" keeps the
    plan's size; "calibrated" scales it by what the profile's calibration found the offloading held in effect
    under its budget, where it measured that (not the default: it did not predict another budget's fetches).
    disk: "profile" prices a fetch as calibrate measured it; "trace" scales that price to the disk the traces'
    own run read around its budget (bench --trace records it): a replay on the device that recorded them.
    lookup: s2moe copies from the context as decoding does (`generate --no-lookup` turns them off there), where
    the traces hold their prompts' ids; traces recorded before they did replay s2moe without copies, and the
    basis says so. session: with lookup, s2moe also copies from the traces of other prompts replayed before, where
    they match a longer n-gram than the context, as decoding does from its earlier generations (off: `bench`'s
    `+lookup` rung). repeats: the traces replayed that many times over, one process, as bench --repeats runs
    each prompt again with the rules and the cache as the earlier runs left them."""
    if disk not in DISK_SOURCES:
        raise ConfigError(f"unknown disk {disk!r} (choose from {', '.join(DISK_SOURCES)})")
    if terms not in TERM_SOURCES:
        raise ConfigError(f"unknown source of terms {terms!r} (choose from {', '.join(TERM_SOURCES)})")
    if policy not in CACHE_POLICIES:
        raise ConfigError(f"unknown cache policy {policy!r} (choose from {', '.join(CACHE_POLICIES)})")
    if not traces:
        raise ConfigError("no traces to project")
    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {repeats}")
    h0 = traces[0].header
    for tr in traces[1:]:
        h = tr.header
        shape = (h.fingerprint, h.n_layer, h.n_expert, h.k, h.k_d)
        if shape != (h0.fingerprint, h0.n_layer, h0.n_expert, h0.k, h0.k_d):
            raise ConfigError(f"trace {tr.name} was recorded on another model or k_d than {traces[0].name}: "
                              "project one model's traces at a time")
        if h.draft_experts != h0.draft_experts:
            raise ConfigError(f"trace {tr.name} drafted from {h.draft_experts} experts and {traces[0].name} from "
                              f"{h0.draft_experts} ones: project one kind of draft at a time")
    offloaded = budget not in (None, "none")
    costs = device_costs(profile, h0, offloaded=offloaded, disk_gb_s=traces_disk(traces) if disk == "trace" else None)
    plan = cache_plan(budget, h0, profile, costs.expert_bytes)
    charged, why = _terms(traces, costs, terms)
    copies = lookup and replays_copies(traces)
    if lookup and not copies and "s2moe" in modes:
        why += ("; s2moe without copies from the context: the traces do not hold their prompts' token ids "
                "(recorded before traces did)")
    out = Projection(costs.profile, plan.label, f"{costs.basis}; {why}", len(traces), charged.how, repeats)
    held = (model_block(profile, h0.fingerprint) or {}).get("cache_fit")
    if cache_size == "calibrated" and plan.capacity is not None and held and held["planned_experts"] > 0:
        cap = round(plan.capacity * held["effective_experts"] / held["planned_experts"])
        plan = CachePlan(cap, plan.pinned, f"{plan.label}; in effect {cap} (calibrate: plain decoding under its "
                                           f"budget fetched as a cache of {held['effective_experts']} of its plan's "
                                           f"{held['planned_experts']})")
        out.budget = plan.label
    elif cache_size not in ("calibrated", "plan"):
        raise ConfigError(f"unknown cache size {cache_size!r} (choose from calibrated, plan)")
    if plan.capacity is not None:
        for name in ("lru", "fifo"):  # the policies that stand for an engine's cache (opt is a ceiling)
            fit = cache_check(traces, plan, name)
            if fit is not None:
                out.cache_fit[name] = fit
        if fit_cache:
            size = fitted_capacity(traces, plan, policy)
            if size is None:
                raise ConfigError("fitting the cache needs traces recorded under a budget (they count their fetches)")
            plan = CachePlan(size, plan.pinned, f"{plan.label}; fitted to the recording's own fetches: "
                                                f"{size} experts")
            out.budget = plan.label
    for mode in (["ar"] + [m for m in modes if m != "ar"]):
        out.modes[mode] = replay(traces * repeats, mode, costs, plan, threshold, policy, charged,
                                 copies and mode in ("s2moe", "oracle"), session)
    ar = out.modes["ar"].tok_per_s
    for r in out.modes.values():
        r.speedup = r.tok_per_s / ar if ar > 0 else None
    if "ar" not in modes:
        del out.modes["ar"]
    return out
