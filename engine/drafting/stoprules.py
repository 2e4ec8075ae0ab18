"""Stopping rules: how far a self-drafter goes, token by token.

A stop rule decides, before and after each draft pass, whether the self-drafter keeps a candidate token: to the
cap (FixedLength), by the draft's own confidence (ConfidenceStop), or by S²-MoE's utility, what a token is
expected to save over what verifying it costs given the experts it adds (UtilityStop, with the acceptance it
learns, AcceptanceMap). RecordingStop drafts to the cap while noting what another rule would have done.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..events import CostConstants, DraftDecision, ForcedDraft
from .copylearner import CopyLearner


class StopRule:
    """Decides whether the self-drafter keeps a candidate token."""

    needs_routing = False
    decision: DraftDecision | None = None  # why the last worth_drafting said what it said (utility rule only)
    forced: ForcedDraft | None = None  # RecordingStop only

    def worth_drafting(self) -> bool:
        return True

    def pre_reject(self, chain: float, prob: float) -> tuple[bool, float | None]:
        """Reject before spending a draft pass on the candidate (its routing unknown). chain: p_i, the product
        of acceptance() over the chain through this candidate; prob: the draft's probability of it."""
        return False, None

    def keep(self, chain: float, prob: float, new_experts: int) -> tuple[bool, float | None]:
        return True, None

    def observe_first(self, prob: float) -> None:
        """Sees the draft probability of each first draft token."""

    def observe_first_experts(self, new_experts: int) -> None:
        """Sees how many experts each first draft token adds to the verification (when routed)."""

    def observe_outcome(self, probs: list[float], accepted: int) -> None:
        """Sees a verified chain: the draft probability of each token it kept, and how many the target
        accepted."""

    def acceptance(self, prob: float) -> float:
        """The chance that the target accepts a draft token the draft gave probability `prob` (its
        predecessors accepted): a chain's p_i is the product of these."""
        return prob


class FixedLength(StopRule):
    """Draft up to the cap, whatever it costs (`--no-utility`)."""


class ConfidenceStop(StopRule):
    """Stop when the draft's own probability of its token falls below p_min (llama.cpp draft-simple)."""

    def __init__(self, p_min: float = 0.5) -> None:
        self.p_min = p_min

    def pre_reject(self, chain: float, prob: float) -> tuple[bool, float | None]:
        return prob < self.p_min, None


class RecordingStop(StopRule):
    """Drafts to the cap whatever `rule` says, routing every candidate, and notes what `rule` would have done:
    a trace of such drafts lets any other rule be replayed on it. `rule` sees what it would have seen
    running on its own (nothing past the token where it would have stopped), so it learns as it would have."""

    needs_routing = True

    def __init__(self, rule: StopRule) -> None:
        self.rule = rule
        self._open = False

    def worth_drafting(self) -> bool:
        self._open = self.rule.worth_drafting()
        self.decision = self.rule.decision
        self.forced = ForcedDraft(self._open, 0)
        return True

    def observe_first(self, prob: float) -> None:
        if self._open:
            self.rule.observe_first(prob)

    def observe_first_experts(self, new_experts: int) -> None:
        if self._open:
            self.rule.observe_first_experts(new_experts)

    def acceptance(self, prob: float) -> float:
        return self.rule.acceptance(prob)

    def observe_outcome(self, probs: list[float], accepted: int) -> None:
        kept = self.forced.would_keep if self.forced is not None else 0
        if kept:
            self.rule.observe_outcome(probs[:kept], min(accepted, kept))

    def pre_reject(self, chain: float, prob: float) -> tuple[bool, float | None]:
        if self._open and self.rule.pre_reject(chain, prob)[0]:
            self._open = False
        return False, None

    def keep(self, chain: float, prob: float, new_experts: int) -> tuple[bool, float | None]:
        if self._open:
            if self.rule.keep(chain, prob, new_experts)[0]:
                assert self.forced is not None  # worth_drafting set it when it opened the draft
                self.forced = ForcedDraft(True, self.forced.would_keep + 1)
            else:
                self._open = False
        return True, None


# Edges of the draft-probability bins in which the utility rule learns how often the target accepts a token.
ACCEPTANCE_BINS = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9])


class AcceptanceMap:
    """How often the target accepts a draft token the draft gave probability q, learned from verifications:
    per bin of q, the accepted share of the tokens verified there plus `prior` pseudo-tokens accepted at rate q
    itself. With nothing seen the estimate is q; each bin moves to what the target does as its tokens are
    verified. q understates it for the model's own drafts (docs/method.md: q < 0.3 accepted 71% of
    the time on the shipped model), and by how much depends on the model and on what the drafts read."""

    def __init__(self, prior: float = 4.0):
        self.prior = prior
        self.seen = np.zeros(len(ACCEPTANCE_BINS) + 1)
        self.accepted = np.zeros(len(ACCEPTANCE_BINS) + 1)

    @staticmethod
    def _bin(q: float) -> int:
        return int(np.searchsorted(ACCEPTANCE_BINS, q, side="right"))

    def estimate(self, q: float) -> float:
        b = self._bin(q)
        return float((self.prior * q + self.accepted[b]) / (self.prior + self.seen[b]))

    def learn(self, probs: list[float], accepted: int) -> None:
        """A verified chain: its tokens up to the first the target rejected (the rest were never judged)."""
        for i, q in enumerate(probs[: accepted + 1]):
            b = self._bin(q)
            self.seen[b] += 1
            self.accepted[b] += i < accepted


class UtilityStop(StopRule):
    """Routing-aware expansion: keep token i while U_i = p_i·T_AR / (ΔC_ver(i|S) + C_draft) ≥ threshold.

    ΔC_ver = T_exp·(experts token i adds to the verification set, summed over layers) + T_tok. p_i, the chance
    that the target accepts a chain through token i, is the product of each token's learned acceptance
    (AcceptanceMap: the draft's own probability until verifications say otherwise). A tree's nodes are priced
    by the product of their draft probabilities: only chains feed the map.
    """

    needs_routing = True

    def __init__(self, cost: CostConstants, threshold: float = 1.0, probe_every: int = 16, smoothing: float = 0.3):
        self.cost = cost
        self.threshold = threshold
        self.learned = AcceptanceMap()
        # Before drafting, the first token's probability and the experts it adds are unknown; running
        # estimates of both decide whether even one draft pass is likely to pay (judging by the
        # probability alone, an offloaded run drafted and discarded a first token on every iteration:
        # each new expert is a fetch there). Skipped iterations probe again now and then.
        self.expected_first = 1.0
        self.expected_first_experts = 0.0
        self.smoothing = smoothing
        # A probe that does not pay doubles the wait before the next one (up to 16×): where drafting never
        # pays, fixed probes would cost a draft pass each, forever.
        self.probe_every = probe_every
        self.probe_interval = probe_every
        self.max_probe_interval = 16 * probe_every
        self._skipped = 0
        self._probing = False
        self._copies: CopyLearner | None = None
        self._cannot_pay: DraftDecision | None = None

    def start(self) -> None:
        """A new generation: keep the learned estimates and probe interval, drop a probe in flight."""
        self._probing = False

    def utility(self, chain: float, new_experts: float) -> float:
        c = self.cost
        return chain * c.t_ar / max(c.t_exp * new_experts + c.t_tok + c.c_draft, 1e-12)

    def worth_drafting(self) -> bool:
        # Even a certain token that adds no expert must pay for its draft pass and its verify row.
        certain = self.utility(1.0, 0.0)
        if certain < self.threshold:
            # the same every step (the constants and threshold are the rule's own), and a decision is not free
            if self._cannot_pay is None:
                self._cannot_pay = self._decision(False, False, certain, 1.0, 0.0)
            self.decision = self._cannot_pay
            return False
        p, experts = self.expected_first, self.expected_first_experts
        expected = self.utility(p, experts)
        if expected >= self.threshold:
            self.decision = self._decision(True, True, expected, p, experts)
            return True
        self._skipped += 1
        if self._skipped >= self.probe_interval:
            self._skipped = 0
            self._probing = True
            self.decision = self._decision(True, True, expected, p, experts, probing=True)
            return True
        self.decision = self._decision(
            False, True, expected, p, experts, next_probe=self.probe_interval - self._skipped
        )
        return False

    def _decision(
        self,
        drafting: bool,
        can_pay: bool,
        utility: float,
        p: float,
        experts: float,
        *,
        probing: bool = False,
        next_probe: int | None = None,
    ) -> DraftDecision:
        c = self.cost
        return DraftDecision(
            drafting=drafting,
            can_pay=can_pay,
            probing=probing,
            threshold=self.threshold,
            utility=utility,
            p_first=p,
            new_experts=experts,
            t_ar=c.t_ar,
            cost=c.t_exp * experts + c.t_tok + c.c_draft,
            c_draft=c.c_draft,
            t_tok=c.t_tok,
            next_probe=next_probe,
        )

    def copies(self, max_ngram: int) -> CopyLearner:
        """What this rule has learned of drafts copied from the context (LookupOrSelfDrafter), kept with its
        other estimates across generations."""
        if self._copies is None:
            self._copies = CopyLearner(max_ngram)
        return self._copies

    def copy_cost(self, rows: int, added_experts: float) -> float:
        """What verifying `rows` copied rows costs under the constants, given the experts they add to the
        pending row's: no draft pass to pay."""
        c = self.cost
        return c.t_exp * added_experts + c.t_tok * rows

    @staticmethod
    def copy_utility(expected: float, saved: float, cost: float) -> float:
        """A copy's utility: the tokens the target is expected to accept of it, each saving a plain step, over
        what it costs (rows free only under the warm-up's constants)."""
        return expected * saved / max(cost, 1e-12)

    def copy_decision(
        self,
        expected: float,
        experts: float,
        saved: float,
        cost: float,
        rows: int,
        probing: bool = False,
        source: str = "context",
    ) -> DraftDecision:
        return DraftDecision(
            drafting=True,
            can_pay=True,
            probing=probing,
            threshold=self.threshold,
            utility=self.copy_utility(expected, saved, cost),
            p_first=expected,
            new_experts=experts,
            t_ar=saved,
            cost=cost,
            c_draft=0.0,
            t_tok=self.cost.t_tok,
            copied=source,
            rows=rows,
        )

    def _probe_outcome(self, paid: bool) -> None:
        if self._probing:
            self._probing = False
            self.probe_interval = self.probe_every if paid else min(2 * self.probe_interval, self.max_probe_interval)

    def observe_first(self, prob: float) -> None:
        self.expected_first += self.smoothing * (self.acceptance(prob) - self.expected_first)

    def observe_first_experts(self, new_experts: float) -> None:
        self.expected_first_experts += self.smoothing * (new_experts - self.expected_first_experts)

    def pre_reject(self, chain: float, prob: float) -> tuple[bool, float | None]:
        bound = self.utility(chain, 0.0)
        if bound < self.threshold:
            self._probe_outcome(False)
        return bound < self.threshold, bound

    def keep(self, chain: float, prob: float, new_experts: int) -> tuple[bool, float | None]:
        u = self.utility(chain, new_experts)
        self._probe_outcome(u >= self.threshold)
        return u >= self.threshold, u

    def acceptance(self, prob: float) -> float:
        return self.learned.estimate(prob)

    def observe_outcome(self, probs: list[float], accepted: int) -> None:
        self.learned.learn(probs, accepted)


def rule_cost(cost: CostConstants, draft_experts: str) -> CostConstants:
    """The constants the utility rule prices a chain's drafts with: a draft from resident experts fetches
    nothing, so its step costs what a draft step costs with the model in memory (where measured)."""
    if draft_experts == "resident" and cost.c_draft_resident is not None:
        return replace(cost, c_draft=cost.c_draft_resident)
    return cost
