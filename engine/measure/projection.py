"""Projection: what a recorded decoding trace would run at on another device, budget and stopping rule.

A trace (engine.measure.trace) holds, per iteration, the whole draft chain to the cap with each token's draft
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

The parts live beside this module: the replay in engine.measure.trace_replay, what it charges in
engine.measure.replay_costs, the simulated expert cache in engine.measure.cache_model. This one puts them
together for a set of traces, a profile and a budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..profiles import model_block
from .cache_model import CACHE_POLICIES, CachePlan, cache_check, cache_plan, fitted_capacity
from .replay_costs import NO_TERMS, DeviceCosts, WorkloadTerms, device_costs, recording_terms, traces_disk
from .trace import Trace
from .trace_replay import PROJECT_MODES, RUNNABLE_MODES, ModeProjection, replay, replays_copies

# what a front end asks of a projection: the call, its result and the choices its flags take
__all__ = ["CACHE_POLICIES", "PROJECT_MODES", "RUNNABLE_MODES", "ModeProjection", "Projection", "project"]

DISK_SOURCES = ("profile", "trace")
TERM_SOURCES = ("profile", "trace", "none")


@dataclass
class Projection:
    profile: str
    budget: str
    basis: str
    traces: int
    terms: str = "none"  # where the terms beyond the constants came from (WorkloadTerms.how)
    repeats: int = 1  # times the traces were replayed over
    modes: dict[str, ModeProjection] = field(default_factory=dict)
    # under a budget, traces recorded under one: {policy: (fetched as the recording counted, as simulated)}
    cache_fit: dict[str, tuple[int, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "budget": self.budget,
            "basis": self.basis,
            "traces": self.traces,
            "repeats": self.repeats,
            "terms": self.terms,
            "modes": {m: r.as_dict() for m, r in self.modes.items()},
            "cache_fit": {k: {"recorded": r, "simulated": s} for k, (r, s) in self.cache_fit.items()},
        }


def _terms(traces: list[Trace], costs: DeviceCosts, source: str) -> tuple[WorkloadTerms, str]:
    """The terms a projection charges beyond the constants, and what they are in words."""
    if source == "none":
        return NO_TERMS, "the profile's constants only (--terms none: context growth and host work left out)"
    if source == "trace":
        if not costs.calibrated:
            raise ConfigError(
                f"fitting terms from the traces needs a profile calibrated for their model on the "
                f"machine that recorded them; {costs.profile} is not"
            )
        t = recording_terms(traces, costs)
        return t, t.describe()
    if costs.terms is not None:
        return costs.terms, costs.terms.describe()
    if costs.calibrated:
        t = recording_terms(traces, costs)
        return t, (
            f"this profile has no workload terms (calibrated before calibrate measured them; calibrate again "
            f"to project from the profile alone): {t.describe()}"
        )
    return NO_TERMS, "the profile's constants only (it has no workload terms: context growth and host work left out)"


def project(
    traces: list[Trace],
    profile: dict[str, Any],
    *,
    budget: str | None = None,
    modes: Sequence[str] = RUNNABLE_MODES,
    threshold: float | None = None,
    policy: str = "lru",
    fit_cache: bool = False,
    terms: str = "profile",
    cache_size: str = "plan",
    disk: str = "profile",
    lookup: bool = True,
    session: bool = True,
    repeats: int = 1,
) -> Projection:
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
            raise ConfigError(
                f"trace {tr.name} was recorded on another model or k_d than {traces[0].name}: "
                "project one model's traces at a time"
            )
        if h.draft_experts != h0.draft_experts:
            raise ConfigError(
                f"trace {tr.name} drafted from {h.draft_experts} experts and {traces[0].name} from "
                f"{h0.draft_experts} ones: project one kind of draft at a time"
            )
    offloaded = budget not in (None, "none")
    costs = device_costs(profile, h0, offloaded=offloaded, disk_gb_s=traces_disk(traces) if disk == "trace" else None)
    plan = cache_plan(budget, h0, profile, costs.expert_bytes)
    charged, why = _terms(traces, costs, terms)
    copies = lookup and replays_copies(traces)
    if lookup and not copies and "s2moe" in modes:
        why += (
            "; s2moe without copies from the context: the traces do not hold their prompts' token ids "
            "(recorded before traces did)"
        )
    out = Projection(costs.profile, plan.label, f"{costs.basis}; {why}", len(traces), charged.how, repeats)
    held = (model_block(profile, h0.fingerprint) or {}).get("cache_fit")
    if cache_size == "calibrated" and plan.capacity is not None and held and held["planned_experts"] > 0:
        cap = round(plan.capacity * held["effective_experts"] / held["planned_experts"])
        plan = CachePlan(
            cap,
            plan.pinned,
            f"{plan.label}; in effect {cap} (calibrate: plain decoding under its "
            f"budget fetched as a cache of {held['effective_experts']} of its plan's "
            f"{held['planned_experts']})",
        )
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
            plan = CachePlan(size, plan.pinned, f"{plan.label}; fitted to the recording's own fetches: {size} experts")
            out.budget = plan.label
    for mode in ["ar"] + [m for m in modes if m != "ar"]:
        out.modes[mode] = replay(
            traces * repeats,
            mode,
            costs,
            plan,
            threshold,
            policy,
            charged,
            copies and mode in ("s2moe", "oracle"),
            session,
        )
    ar = out.modes["ar"].tok_per_s
    for r in out.modes.values():
        r.speedup = r.tok_per_s / ar if ar > 0 else None
    if "ar" not in modes:
        del out.modes["ar"]
    return out
