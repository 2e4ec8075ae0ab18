"""Drafts copied from text rather than drafted by a model pass: prompt lookup (LookupDrafter) and s2moe's copies,
weighed token by token by the utility rule (CopyPlanner) and otherwise the self-drafter's chain (LookupOrSelfDrafter).
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
# - hope: an acceptance estimate is its share as seen, never raised by its standard error;
# - session: copies come from the generation's own context only.
COPY_REFINEMENTS = ("loop", "hope", "session")


@dataclass
class CopyPlan:
    """A copy from the context as the utility rule weighed it: the tokens to verify, each token weighed (kept or
    the first declined) with its chained acceptance and its own utility (what it saves over what it adds to the
    copy's cost), and the numbers of the copy verified."""

    n: int  # the length of the n-gram that matched
    source: str  # where it matched: "context" or "session"
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
    times (engine.measure.projection). It prices copies by its rule's constants and what the rule's CopyLearner
    learned of copies verified and plain steps' fetches."""

    # A single repeated token predicts the next one poorly (31-48% of first copies accepted on the shipped model's
    # greedy HumanEval and natural-text completions, against 73-96% after a repeated trigram): not worth copying.
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

    def plan(self, context: list[int], max_len: int) -> CopyPlan | None:
        """The copy to verify after `context` (prompt and generated tokens, the last one pending), or None: no
        n-gram found, or a copy whose first row does not pay.

        A copy is weighed token by token, as the self-drafter's rule weighs a chain: a row is kept while its
        chained acceptance times what it saves pays for what it adds to the copy's cost, up to the first that does
        not; declined where its first row does not pay."""
        rule, learned = self.rule, self.learned
        if max_len <= 0:
            return None
        saved = rule.cost.t_ar
        # each row adds what a first draft token is expected to add (UtilityStop.expected_first_experts)
        per_row = rule.expected_first_experts
        row_cost = rule.copy_cost(1, per_row)
        # where not even the first row of a copy of the likeliest kind pays, no n-gram is looked up (on a small
        # model in memory a lookup is a noticeable part of a step)
        if learned.likeliest(self.hope) * saved < rule.threshold * row_cost:
            return None
        source = "context"
        n, found, period = self.index.lookup(context, max_len)
        kinds = ["context, looped" if i >= period else "context" for i in range(len(found))]
        if self.earlier is not None and n < self.index.max_ngram:  # else the earlier text cannot match longer
            n2, found2 = self.earlier.lookup(self.prompt, context, max_len)
            if found2 and n2 > n:
                source, n, found = "session", n2, found2
                kinds = ["session"] * len(found2)
        if not found:
            return None
        rates = {kind: learned.estimate(n, kind, self.hope) for kind in set(kinds)}
        # each row weighed, up to the first declined: (survival, expected accepted through it)
        weighed: list[tuple[float, float]] = []
        survival, expected, declined = 1.0, 0.0, False
        for kind in kinds:
            survival *= rates[kind]
            expected += survival
            weighed.append((survival, expected))
            declined = survival * saved < rule.threshold * row_cost
            if declined:
                break
        keep = len(weighed) - declined
        if keep == 0:
            return None
        expected = weighed[keep - 1][1]
        out = CopyPlan(n, source, rates[kinds[0]], keep, expected, keep * per_row, saved, keep * row_cost)
        for i, (survival, _) in enumerate(weighed):  # a copy's tokens, and the first one declined after them
            kept = i < keep
            out.weighed.append((found[i], survival, rule.copy_utility(survival, saved, row_cost), kept))
            if kept:
                out.tokens.append(found[i])
                out.kinds.append(kinds[i])
        return out

    def learn(self, plan: CopyPlan, accepted: int, verify_experts: float, pending_experts: int) -> None:
        """The verification of `plan`: the target accepted `accepted` of its tokens, and the verification read
        `verify_experts` distinct experts summed over layers, `pending_experts` of them one row's."""
        self.learned.learn(plan.n, plan.kinds, accepted)
        rows = len(plan.tokens)
        if rows == 0:
            return
        # what the rule expects a self-draft's first token to add, and a copy's every row: its rows' mean
        self.rule.observe_first_experts(max(verify_experts - pending_experts, 0.0) / rows)


class LookupOrSelfDrafter(Drafter):
    """s2moe's drafts: where the context repeats itself, the tokens that followed the repeated n-gram, kept while
    the utility rule says they pay (CopyPlanner); otherwise the self-drafter's chain.

    A copied token needs no draft pass. Its row i is kept while p_i·T_AR ≥ threshold·(T_tok + T_exp·E), p_i the
    learned acceptance of copies after an n-gram of its length, chained over the copy (CopyLearner), and E the
    rule's running estimate of the experts a first draft token adds to the verification, which each verified
    copy teaches its rows' mean."""

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

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        now = time.perf_counter()
        self._copied = None
        plan = self.copies.plan(committed, max_len)
        if plan is None:
            return self.self_drafter.propose(dec, committed, max_len, sample)
        head = "lookup" if plan.source == "context" else "lookup: session"
        out = Proposal(stop=f"{head}: utility" if not plan.weighed[-1][3] else head)
        n_layer = dec.info.n_layer
        for token, survival, u, keep in plan.weighed:
            out.candidates.append(
                DraftCandidate(token, dec.piece_text(token), 1.0, 1.0, u, np.zeros(n_layer, int), keep, None, survival)
            )
        out.tokens = list(plan.tokens)
        out.chain = [1.0] * len(plan.tokens)
        out.decision = self.copies.rule.copy_decision(
            plan.expected, plan.experts, plan.saved, plan.cost, plan.rows, source=plan.source
        )
        out.seconds = time.perf_counter() - now
        self._copied = (plan, len(dec.moe_layers()) * max(dec.info.n_expert_used, 1))
        return out

    def feedback(self, it: Iteration) -> None:
        if it.verify_misses is not None and self._copied is None and not it.drafted:
            self.copies.learned.fetched(int(np.sum(it.verify_misses)), int(np.sum(it.verify_experts)))
        if self._copied is None:
            self.self_drafter.feedback(it)
            return
        plan, pending_experts = self._copied
        self.copies.learn(plan, len(it.accepted), float(it.verify_experts.sum()), pending_experts)
