"""Drafts copied from text rather than drafted by a model pass: prompt lookup (LookupDrafter) and s2moe's copies,
weighed whole by the utility rule (CopyPlanner) and otherwise the self-drafter's chain (LookupOrSelfDrafter).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..decoding.sampling import SeededSampler
from ..events import DraftCandidate, Iteration
from .drafters import Drafter, Proposal, SelfDrafter
from .ngrams import EarlierText, NgramIndex
from .stoprules import UtilityStop

if TYPE_CHECKING:  # the decoder builds its drafters: a run-time import would be circular
    from ..decoding.decoder import Decoder


class LookupDrafter(Drafter):
    """Prompt-lookup drafting: find the longest recent n-gram (n ≤ max_ngram) earlier in the context and
    propose the tokens that followed it. Costs no model pass; deterministic drafts."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.index = NgramIndex(max_ngram, min_ngram)

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        out = Proposal()
        if max_len <= 0:
            out.stop = "limit"
            return out
        t0 = time.perf_counter()
        _, found, _ = self.index.lookup(committed, max_len)
        n_layer = dec.info.n_layer
        for token in found:
            out.tokens.append(token)
            out.chain.append(1.0)
            out.candidates.append(
                DraftCandidate(token, dec.piece_text(token), 1.0, 1.0, None, np.zeros(n_layer, int), True)
            )
        out.stop = "lookup" if found else "no-match"
        out.seconds = time.perf_counter() - t0
        return out


# The copy rule's refinements (docs/method.md, "Copies: drafts without a draft pass"), by the names that switch
# one off (GenerationConfig.copy_without), so that an ablation can tell which of them pay. Off, each falls back
# to the plain rule:
# - loop: a copy stops at the context's end (prompt lookup's continuation), never goes round its loop;
# - whole: a copy is kept token by token, as the self-drafter's rule keeps a chain: a row while its own chained
#   acceptance times what it saves pays for what it adds to the verification's cost, up to the first that does not;
# - overlap: every row adds what a first draft token is expected to add (rows × that), and a verified copy
#   teaches that estimate its rows' mean;
# - timed-scaling: copies are priced at the constants whatever was timed (no scale, no floor on a row), and a
#   copied token saves T_AR, or the timed plain step under timed-plain;
# - timed-plain: before copies were timed, a copied token saves the constants' T_AR even where the cache
#   serves little;
# - hope: an acceptance estimate is its share as seen, never raised by its standard error;
# - probes: a copy the rule declines is never verified, nor a copy made where none could pay;
# - session: copies come from the generation's own context only;
# - voting: a session copy takes the latest entry's text that holds the n-gram, no vote (so no token stands as
#   agreed).
COPY_REFINEMENTS = ("loop", "whole", "overlap", "timed-scaling", "timed-plain", "hope", "probes", "session", "voting")


@dataclass
class CopyPlan:
    """A copy from the context as the utility rule weighed it: the tokens to verify, each token weighed (kept or
    the first declined) with its chained acceptance and the utility of the copy through it, and the numbers the
    rule decided with (for a probe, those of the best copy it declined)."""

    n: int  # the length of the n-gram that matched
    source: str  # where it matched: "context" or "session"
    probe: bool  # declined, verified anyway (its first token only)
    p: float  # the learned acceptance of its first token (its kind, after an n-gram of that length)
    rows: int  # the copy's length as the rule priced it
    expected: float  # the tokens the target is expected to accept of those rows
    experts: float  # the experts the rule expects the rows to add to the pending row's
    saved: float  # what a committed token saves (seconds)
    cost: float  # what verifying the rows costs
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # each token's, one of COPY_KINDS
    weighed: list[tuple[int, float, float, bool]] = field(default_factory=list)  # (token, survival, utility, kept)


class CopyPlanner:
    """What s2moe decides about drafts copied from the context, apart from any model: decoding asks it before
    each step (LookupOrSelfDrafter), and a projection replays it on a recorded generation's tokens with projected
    times (engine.measure.projection). The prices it decides with come from its rule's CopyLearner, whose clock is the
    caller's: wall time in decoding, projected seconds in a replay."""

    # A single repeated token predicts the next one poorly (31-48% of first copies accepted on the shipped model's
    # greedy HumanEval and natural-text completions, against 73-96% after a repeated trigram): not worth probing.
    def __init__(
        self,
        rule: UtilityStop,
        earlier: EarlierText | None = None,
        prompt: Sequence[int] = (),
        max_ngram: int = 3,
        min_ngram: int = 2,
        periodic: bool = True,
        without: frozenset[str] = frozenset(),
    ):
        """earlier: the session's earlier generations, copied from where they match a longer n-gram than the
        context (None: the context only); prompt: this generation's, whose own earlier runs are not copied;
        without: the refinements switched off (COPY_REFINEMENTS)."""
        self.rule = rule
        self.without = without
        self.hope = "hope" not in without
        self.index = NgramIndex(max_ngram, min_ngram, periodic=periodic and "loop" not in without)
        self.earlier = None if "session" in without else earlier
        self.prompt = tuple(prompt)
        self.learned = rule.copies(max_ngram)
        self.learned.began()
        self._costs_key: tuple[float, int, float, float | None, float] | None = None
        self._cost_table: list[tuple[float, float]] = []

    def plan(self, context: list[int], max_len: int) -> CopyPlan | None:
        """The copy to verify after `context` (prompt and generated tokens, the last one pending), or None: no
        n-gram found, or a copy the rule declines and does not probe.

        A copy is weighed whole: of the lengths its match allows, the one that saves most, its expected accepted
        tokens times what each saves less the threshold times its cost; declined where none saves anything.
        Its first row adds the most experts and each further one fewer (CopyLearner), so a copy can pay
        where its first token alone would not."""
        rule, learned = self.rule, self.learned
        # where even a certain copy that adds no expert cannot pay for its row, copies are not even probed
        if max_len <= 0 or rule.cost.t_ar < rule.threshold * rule.copy_cost(1, 0.0):
            return None
        timed = None if "timed-scaling" in self.without else learned.price()
        saved, scale = timed or (rule.cost.t_ar, 1.0)
        if (
            timed is None
            and "timed-plain" not in self.without
            and learned.plain_s is not None
            and learned.cache_serves_little()
        ):
            # what a copied token saves is a plain step, timed here on every one of them, where the constants
            # were measured on another day of the disk or at another split of the budget; only a copy's cost
            # waits for copies to be timed. Not where the cache serves plain steps most of their experts: copies
            # would disturb it, and the steps timed around them would show it disturbed (CopyLearner)
            saved = learned.plain_s
        # timing noise must not make copies look free: a row is never priced under a twentieth of a plain step
        least_row = timed[0] / 20 if timed else 0.0
        costs = self._costs(scale, max_len)
        # where not even a copy of the likeliest kind pays at the prices timed, whatever its length, a probe could
        # only re-time them, and rarely
        chain, expected, hopeless, likeliest = 1.0, 0.0, True, learned.likeliest(self.hope)
        for rows, (_, cost) in enumerate(costs, 1):
            chain *= likeliest
            expected += chain
            if expected * saved >= rule.threshold * max(cost, rows * least_row):
                hopeless = False
                break
        if hopeless and ("probes" in self.without or not learned.rare_probe_due()):
            return None
        source = "context"
        n, found, period = self.index.lookup(context, max_len)
        kinds = ["context, looped" if i >= period else "context" for i in range(len(found))]
        if self.earlier is not None and n < self.index.max_ngram:  # else the earlier text cannot match longer
            n2, found2, agreed2 = self.earlier.lookup(
                self.prompt, context, max_len, voters=1 if "voting" in self.without else None
            )
            if found2 and n2 > n:
                source, n, found = "session", n2, found2
                kinds = ["session, agreed" if a else "session" for a in agreed2]
        if not found:
            return None
        rates = {kind: learned.estimate(n, kind, self.hope) for kind in set(kinds)}
        weighed, survival, expected = [], 1.0, 0.0
        best, best_gain = 0, -np.inf
        for rows, kind in enumerate(kinds, 1):
            survival *= rates[kind]
            expected += survival
            added, cost = costs[rows - 1]
            cost = max(cost, rows * least_row)
            weighed.append((survival, expected, added, cost))
            gain = expected * saved - rule.threshold * cost
            if gain > best_gain:
                best, best_gain = rows, gain
        probe = best_gain < 0
        if "whole" in self.without:
            best = self._token_by_token(weighed, saved)
            probe, best = best == 0, max(best, 1)
        if hopeless:
            learned.rare_probe_made()
        elif probe and ("probes" in self.without or not learned.probe(n, kinds[0])):
            return None
        _, expected, added, cost = weighed[best - 1]
        out = CopyPlan(n, source, probe, rates[kinds[0]], best, expected, added, saved, cost)
        keep = 1 if probe else best
        shown = keep if probe else keep + 1  # a copy's tokens, and the first one declined after them
        for i, (survival, expected, _added, cost) in enumerate(weighed[:shown]):
            kept = i < keep
            out.weighed.append((found[i], survival, rule.copy_utility(expected, saved, cost), kept))
            if kept:
                out.tokens.append(found[i])
                out.kinds.append(kinds[i])
        return out

    def _token_by_token(self, weighed: list[tuple[float, float, float, float]], saved: float) -> int:
        """How many rows a copy keeps weighed token by token (the rule without `whole`): each while its chained
        acceptance times what it saves pays for what it adds to the copy's cost."""
        kept, before = 0, 0.0
        for survival, _, _, cost in weighed:
            if survival * saved < self.rule.threshold * (cost - before):
                break
            kept, before = kept + 1, cost
        return kept

    def _costs(self, scale: float, max_len: int) -> list[tuple[float, float]]:
        """(experts added, cost before the least row's floor) of copies of 1..max_len rows at these prices. Kept
        while the prices stay: every step asks, and they change only as copies and drafts are verified or timed."""
        rule, learned = self.rule, self.learned
        per_row = rule.expected_first_experts
        key = (scale, max_len, per_row, learned.overlap, learned.pending_experts)
        if key != self._costs_key:
            added = [
                learned.added(rows, per_row) if "overlap" not in self.without else rows * per_row
                for rows in range(1, max_len + 1)
            ]
            self._costs_key = key
            self._cost_table = [(a, scale * rule.copy_cost(rows, a)) for rows, a in enumerate(added, 1)]
        return self._cost_table

    def learn(self, plan: CopyPlan, accepted: int, verify_experts: float, pending_experts: int) -> None:
        """The verification of `plan`: the target accepted `accepted` of its tokens, and the verification read
        `verify_experts` distinct experts summed over layers, `pending_experts` of them one row's."""
        self.learned.learn(plan.n, plan.kinds, accepted, plan.probe)
        rows = len(plan.tokens)
        if rows == 0:
            return
        added = max(verify_experts - pending_experts, 0.0)
        # what the rule expects a self-draft's first token to add: a copy's first row
        first = self.learned.verified(rows, added, pending_experts, self.rule.copy_cost(rows, added))
        self.rule.observe_first_experts(added / rows if "overlap" in self.without else first)


class LookupOrSelfDrafter(Drafter):
    """s2moe's drafts: where the context repeats itself, the tokens that followed the repeated n-gram, kept while
    the utility rule says they pay (CopyPlanner); otherwise the self-drafter's chain.

    A copied token needs no draft pass. A copy of r rows pays when (Σ p_i)·T_AR ≥ threshold·(T_tok·r +
    T_exp·E(r)), p_i the learned acceptance of copies after an n-gram of its length, chained over the copy, and
    E(r) the experts r rows add to the verification, by the pool the verified copies share (before any, r times
    the rule's running estimate of what a first draft token adds). Once copies were rejected whole and timed
    here, the cost is scaled by what they took over their constants' price, and T_AR is the plain step as timed
    here; before that, so is T_AR where plain steps under a memory budget fetch most of the experts they read
    (CopyLearner)."""

    name = "s2moe"
    drafts_in_context = True

    def __init__(
        self,
        self_drafter: SelfDrafter,
        rule: UtilityStop,
        earlier: EarlierText | None = None,
        prompt: Sequence[int] = (),
        periodic: bool = True,
        without: frozenset[str] = frozenset(),
    ):
        self.self_drafter = self_drafter
        self.copies = CopyPlanner(rule, earlier, prompt, periodic=periodic, without=without)
        # the last proposal's copy, and the experts of its pending token's row
        self._copied: tuple[CopyPlan, int] | None = None
        # when the last proposal began, its rows when it was plain (0) or copied, and how many of those the
        # target accepted: what its iteration's time says
        self._started: float | None = None
        self._rows: int | None = None
        self._accepted = 0

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        now = time.perf_counter()
        if self._started is not None:
            self.copies.learned.timed(now - self._started, self._rows, self._accepted)
        self._started, self._copied, self._accepted = now, None, 0
        plan = self.copies.plan(committed, max_len)
        if plan is None:
            out = self.self_drafter.propose(dec, committed, max_len, sample)
            self._rows = None if out.tokens else 0
            return out
        head = "lookup" if plan.source == "context" else "lookup: session"
        out = Proposal(stop=f"{head}: probe" if plan.probe else f"{head}: utility" if not plan.weighed[-1][3] else head)
        n_layer = dec.info.n_layer
        for token, survival, u, keep in plan.weighed:
            out.candidates.append(
                DraftCandidate(token, dec.piece_text(token), 1.0, 1.0, u, np.zeros(n_layer, int), keep, None, survival)
            )
        out.tokens = list(plan.tokens)
        out.chain = [1.0] * len(plan.tokens)
        out.decision = self.copies.rule.copy_decision(
            plan.expected, plan.experts, plan.saved, plan.cost, plan.rows, probing=plan.probe, source=plan.source
        )
        out.seconds = time.perf_counter() - now
        self._copied = (plan, len(dec.moe_layers()) * max(dec.info.n_expert_used, 1))
        self._rows = len(plan.tokens)
        return out

    def feedback(self, it: Iteration) -> None:
        if it.verify_misses is not None and self._copied is None and not it.drafted:
            self.copies.learned.fetched(int(np.sum(it.verify_misses)), int(np.sum(it.verify_experts)))
        if self._copied is None:
            self.self_drafter.feedback(it)
            return
        plan, pending_experts = self._copied
        self._accepted = len(it.accepted)
        self.copies.learn(plan, len(it.accepted), float(it.verify_experts.sum()), pending_experts)
