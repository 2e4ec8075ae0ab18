"""Trace replay: one mode walked over recorded decoding traces, its rule deciding at each pending token how many
of the recorded draft tokens it would verify, the recorded acceptance deciding what is committed, and every
iteration charged on a device's costs through a simulated expert cache. The whole method, copies from the
context included, is described in engine.measure.projection, which replays every mode this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..drafting.copies import CopyPlanner
from ..drafting.drafters import CascadeDrafter, Proposal, SelfDrafter
from ..drafting.ngrams import EarlierText
from ..drafting.stoprules import ConfidenceStop, FixedLength, StopRule, UtilityStop, rule_cost
from ..errors import ConfigError
from .cache_model import CachePlan, ExpertCache, ExpertIds, draft_pass_misses, with_cache
from .replay_costs import NO_TERMS, DeviceCosts, WorkloadTerms, distinct, verify_compute
from .trace import Drafted, Trace, TraceStep

# Two modes one cannot run, ceilings: oracle drafts exactly the tokens the target goes on to accept (a stopping
# rule that knows the outcome: the best any rule could do with the recorded drafter); perfect verifies the
# next draft-cap tokens in one batch as if a free draft had guessed them all (the best speculation could do
# with any drafter: what is left is what batching the tokens saves).
RUNNABLE_MODES = ("ar", "s2moe", "conf", "cascade")
PROJECT_MODES = RUNNABLE_MODES + ("oracle", "perfect")


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
    copied: int = 0  # tokens verified as copies (from the context or earlier generations)
    copies_accepted: int = 0  # ... and accepted
    copied_session: int = 0  # of those, copies from the session's earlier generations
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "iterations": self.iterations,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_passes": self.draft_passes,
            "seconds": self.seconds,
            "tok_per_s": self.tok_per_s,
            "speedup_vs_ar": self.speedup,
            "accept_len": self.accept_len,
            "t_draft_s": self.t_draft,
            "t_verify_s": self.t_verify,
            "t_fetch_s": self.t_fetch,
            "t_host_s": self.t_host,
            "fetched": self.fetched,
            "fetched_per_token": self.fetched_per_token,
            "copied": self.copied,
            "copies_accepted": self.copies_accepted,
            "copied_session": self.copied_session,
            "session_accepted": self.session_accepted,
        }


class _Source:
    """The recorded draft chain seen from pending position j of one trace step."""

    def __init__(self, step: TraceStep, j: int):
        self.step, self.j = step, j

    @property
    def pending(self) -> ExpertIds | None:
        return self.step.pending if self.j == 0 else self.step.drafted[self.j - 1].predicted

    def __len__(self) -> int:
        return len(self.step.drafted) - self.j if self.pending is not None else 0

    def __getitem__(self, i: int) -> Drafted:
        return self.step.drafted[self.j + i]


@dataclass
class _Draft(Proposal):
    passes: list[ExpertIds] = field(default_factory=list)  # per draft pass: the [n_layer, k_d] experts it read


def _mask(ids: ExpertIds, n_expert: int) -> npt.NDArray[np.bool_]:
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
    pending = src.pending
    assert pending is not None  # a source without its pending token's experts has no length
    in_batch = _mask(pending, n_expert)
    out.passes.append(pending[:, :k_d])
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


class _ChainFromTrace(SelfDrafter):
    """Cascade's inner drafter: a fixed length on the recorded chain (the source set before each call)."""

    def __init__(self, k_d: int, n_expert: int):
        super().__init__(k_d, FixedLength())
        self.k_d, self.n_expert = k_d, n_expert
        self.source: _Source | None = None

    def propose(self, dec: object, committed: object, max_len: int, sample: object) -> _Draft:
        assert self.source is not None  # the replay sets it before each proposal
        return propose(self.rule, self.source, max_len, self.k_d, self.n_expert)


def replay(
    traces: list[Trace],
    mode: str,
    costs: DeviceCosts,
    plan: CachePlan,
    threshold: float | None = None,
    policy: str = "lru",
    terms: WorkloadTerms = NO_TERMS,
    lookup: bool = False,
    session: bool = False,
) -> ModeProjection:
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
        rows = [s.rows[i] for s in tr.steps for i in range(min(s.accepted + 1, len(s.rows)))][: tr.n_tokens]
        for start in range(0, len(rows), h.draft_max + 1):
            batch = np.stack(rows[start : start + h.draft_max + 1])
            n = len(batch) - 1
            misses = cache.access(batch)
            beyond = terms.beyond(h.prompt_tokens - 1 + start)
            res.iterations += 1
            res.tokens += len(batch)
            res.drafted += n
            res.accepted += n
            res.t_verify += verify_compute(costs, batch) + (terms.ctx_step + terms.ctx_row * n) * beyond
            res.t_fetch += costs.t_fetch * misses
            res.t_host += terms.host_row * (n + 1)
            res.fetched += misses
    return res


def replays_copies(traces: list[Trace]) -> bool:
    """Whether s2moe's copies from the context can be replayed on the traces: they hold their prompts' ids."""
    return all(tr.header.prompt is not None for tr in traces)


def _replay(
    traces: list[Trace],
    mode: str,
    costs: DeviceCosts,
    cache: ExpertCache,
    threshold: float | None,
    terms: WorkloadTerms,
    lookup: bool = False,
    session: bool = False,
) -> ModeProjection:
    h0 = traces[0].header
    res = ModeProjection(mode)
    rule: StopRule | None = None
    cascade: CascadeDrafter | None = None
    inner: _ChainFromTrace | None = None
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
        planner: CopyPlanner | None = None
        prompt: tuple[int, ...] = ()
        context: list[int] = []  # where copying: the prompt and the tokens committed so far
        if copying:
            # s2moe's rule and the oracle's; replay checked that every trace holds its prompt
            assert isinstance(rule, UtilityStop) and h.prompt is not None
            planner, prompt = CopyPlanner(rule, earlier, h.prompt), h.prompt
            context = list(prompt)
        generated = 0
        while generated < tr.n_tokens:
            si, j = where[generated]
            step = tr.steps[si]
            src = _Source(step, j)
            max_len = min(h.draft_max, h.n_predict - generated - 1)
            plan = planner.plan(context, max_len) if planner is not None else None
            if plan is not None and mode == "oracle":
                right = next(
                    (
                        i
                        for i, t in enumerate(plan.tokens)
                        if generated + i >= tr.n_tokens or t != tokens[generated + i]
                    ),
                    len(plan.tokens),
                )
                del plan.tokens[right:], plan.kinds[right:]
                if not right:
                    plan = None
            draft: Proposal
            if plan is not None:
                draft = _Draft(list(plan.tokens), stop="lookup")
            elif mode == "ar":
                draft = _Draft()
            elif cascade is not None and inner is not None:  # set together, for cascade
                inner.source = src
                # the cascade hands these only to its inner drafter, which replays the chain and reads none
                draft = cascade.propose(None, None, max_len, None)  # type: ignore[arg-type]
            elif mode == "oracle":
                draft = propose(FixedLength(), src, min(max_len, step.accepted - j), h.k_d, h.n_expert)
            else:
                assert rule is not None  # s2moe's and conf's
                draft = propose(rule, src, max_len, h.k_d, h.n_expert)
            n = len(draft.tokens)
            passes: list[ExpertIds] = getattr(draft, "passes", [])
            if plan is not None:
                # a copied token is accepted while it is the token the target went on to commit; a row past the
                # first rejected one read what the target's own row at that position read (the best record of it)
                accepted = next(
                    (
                        i
                        for i, t in enumerate(draft.tokens)
                        if generated + i >= tr.n_tokens or t != tokens[generated + i]
                    ),
                    n,
                )
                rows = np.stack(
                    [_row(tr, where, min(generated + i, tr.n_tokens - 1), gated_rows) for i in range(n + 1)]
                )
                committed = min(accepted + 1, tr.n_tokens - generated)
            else:
                accepted = min(n, step.accepted - j)
                if rule is not None and n:  # what SelfDrafter.feedback tells the rule of the verification
                    rule.observe_outcome([src[i].prob for i in range(n)], accepted)
                committed = min(accepted + 1, len(step.committed) - j)
                # reuse gating acts on a verification of drafted tokens only (a plain step reads the router's choice)
                rows = (step.gated if gated_rows and n else step.rows)[j : j + n + 1]
            beyond = terms.beyond(h.prompt_tokens - 1 + generated)  # context past the one the constants were timed at
            t_draft = len(passes) * terms.draft_pass(costs.c_draft, beyond)
            draft_misses = draft_pass_misses(cache, passes, h)
            verify_misses = cache.access(rows)
            plain = n == 0 and plain_unobserved
            if plain:  # the whole iteration, the loop's own work with it
                assert terms.t_plain is not None  # plain_unobserved
                t_verify = terms.t_plain + terms.ctx_plain * beyond
            else:
                t_verify = verify_compute(costs, rows) + (terms.ctx_step + terms.ctx_row * n) * beyond
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
                cascade.feedback(
                    SimpleNamespace(
                        committed=(0,) * committed,  # type: ignore[arg-type]
                        t_draft=t_draft + costs.t_fetch * draft_misses,
                        t_verify=t_verify + costs.t_fetch * verify_misses,
                    )
                )
            generated += committed
            if planner is not None:
                if plan is not None:
                    res.copied += n
                    res.copies_accepted += accepted
                    if plan.source == "session":
                        res.copied_session += n
                        res.session_accepted += accepted
                    planner.learn(plan, accepted, distinct(rows), int((rows[0] >= 0).sum()))
                elif n == 0 and cache.capacity is not None:
                    # what LookupOrSelfDrafter.feedback tells the planner of a plain step under a budget: where
                    # such steps fetch most of what they read, copies are hoped for and a copied token saves
                    # the plain step as timed
                    planner.learned.fetched(verify_misses, distinct(rows))
                # decoding times an iteration when the next one begins: a plain step, a copy, or a self-draft that
                # prices nothing (the last iteration of a generation is never timed)
                if generated < tr.n_tokens:
                    planner.learned.timed(
                        t_draft + t_verify + t_fetch + t_host, n if plan is not None or n == 0 else None, accepted
                    )
                context.extend(tokens[generated - committed : generated])
        if earlier is not None:
            earlier.add(prompt, context)
    return res


def _row(tr: Trace, where: list[tuple[int, int]], position: int, gated: bool) -> ExpertIds:
    """The experts the target read for the token at generated `position`: its recorded step's row of it."""
    si, i = where[position]
    step = tr.steps[si]
    row: ExpertIds = (step.gated if gated else step.rows)[i]
    return row
