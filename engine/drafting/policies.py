"""Drafting and stopping policies. Each decoding mode is a drafter over the same decoder.

A drafter proposes draft tokens for the pending token and leaves the shared KV cache as it found it
(the decoder removes draft entries before verification anyway). Stop rules decide, token by token,
how far a self-drafter goes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ..events import CostConstants, DraftCandidate, DraftDecision, ForcedDraft
from ..decoding.sampling import SeededSampler


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)       # p_i of each kept token
    candidates: list[DraftCandidate] = field(default_factory=list)
    stop: str = "no-draft"
    seconds: float = 0.0
    experts_read: np.ndarray | None = None  # [n_layer] distinct experts the draft passes read
    predicted: np.ndarray | None = None     # [n_layer, n_expert] bool: target experts of the verify batch
    decision: DraftDecision | None = None   # the utility rule's decision, with its numbers
    tree: object | None = None              # engine.tree.DraftTree: the tokens are a tree's nodes, not a chain
    pending_predicted: np.ndarray | None = None  # [n_layer, k] the pending token's target experts, as drafted
    forced: ForcedDraft | None = None       # drafted to the cap: what the rule would have done (RecordingStop)


class StopRule:
    """Decides whether the self-drafter keeps a candidate token."""

    needs_routing = False
    decision: DraftDecision | None = None  # why the last worth_drafting said what it said (utility rule only)
    forced: ForcedDraft | None = None      # RecordingStop only

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

    def __init__(self, p_min: float = 0.5):
        self.p_min = p_min

    def pre_reject(self, chain, prob):
        return prob < self.p_min, None


class RecordingStop(StopRule):
    """Drafts to the cap whatever `rule` says, routing every candidate, and notes what `rule` would have done:
    a trace of such drafts lets any other rule be replayed on it. `rule` sees what it would have seen
    running on its own (nothing past the token where it would have stopped), so it learns as it would have."""

    needs_routing = True

    def __init__(self, rule: StopRule):
        self.rule = rule
        self._open = False

    def worth_drafting(self) -> bool:
        self._open = self.rule.worth_drafting()
        self.decision = self.rule.decision
        self.forced = ForcedDraft(self._open, 0)
        return True

    def observe_first(self, prob):
        if self._open:
            self.rule.observe_first(prob)

    def observe_first_experts(self, new_experts):
        if self._open:
            self.rule.observe_first_experts(new_experts)

    def acceptance(self, prob):
        return self.rule.acceptance(prob)

    def observe_outcome(self, probs, accepted):
        kept = self.forced.would_keep if self.forced is not None else 0
        if kept:
            self.rule.observe_outcome(probs[:kept], min(accepted, kept))

    def pre_reject(self, chain, prob):
        if self._open and self.rule.pre_reject(chain, prob)[0]:
            self._open = False
        return False, None

    def keep(self, chain, prob, new_experts):
        if self._open:
            if self.rule.keep(chain, prob, new_experts)[0]:
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
        for i, q in enumerate(probs[:accepted + 1]):
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
        self.decision = self._decision(False, True, expected, p, experts,
                                       next_probe=self.probe_interval - self._skipped)
        return False

    def _decision(self, drafting: bool, can_pay: bool, utility: float, p: float, experts: float, *,
                  probing: bool = False, next_probe: int | None = None) -> DraftDecision:
        c = self.cost
        return DraftDecision(drafting=drafting, can_pay=can_pay, probing=probing, threshold=self.threshold,
                             utility=utility, p_first=p, new_experts=experts, t_ar=c.t_ar,
                             cost=c.t_exp * experts + c.t_tok + c.c_draft, c_draft=c.c_draft, t_tok=c.t_tok,
                             next_probe=next_probe)

    def copies(self, max_ngram: int) -> "CopyLearner":
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

    def copy_decision(self, expected: float, experts: float, saved: float, cost: float, rows: int,
                      probing: bool = False, source: str = "context") -> DraftDecision:
        return DraftDecision(drafting=True, can_pay=True, probing=probing, threshold=self.threshold,
                             utility=self.copy_utility(expected, saved, cost), p_first=expected, new_experts=experts,
                             t_ar=saved, cost=cost, c_draft=0.0, t_tok=self.cost.t_tok, copied=source, rows=rows)

    def _probe_outcome(self, paid: bool) -> None:
        if self._probing:
            self._probing = False
            self.probe_interval = self.probe_every if paid else min(2 * self.probe_interval,
                                                                   self.max_probe_interval)

    def observe_first(self, prob: float) -> None:
        self.expected_first += self.smoothing * (self.acceptance(prob) - self.expected_first)

    def observe_first_experts(self, new_experts: int) -> None:
        self.expected_first_experts += self.smoothing * (new_experts - self.expected_first_experts)

    def pre_reject(self, chain, prob):
        bound = self.utility(chain, 0.0)
        if bound < self.threshold:
            self._probe_outcome(False)
        return bound < self.threshold, bound

    def keep(self, chain, prob, new_experts):
        u = self.utility(chain, new_experts)
        self._probe_outcome(u >= self.threshold)
        return u >= self.threshold, u

    def acceptance(self, prob):
        return self.learned.estimate(prob)

    def observe_outcome(self, probs, accepted):
        self.learned.learn(probs, accepted)


def rule_cost(cost: CostConstants, draft_experts: str) -> CostConstants:
    """The constants the utility rule prices a chain's drafts with: a draft from resident experts fetches
    nothing, so its step costs what a draft step costs with the model in memory (where measured)."""
    if draft_experts == "resident" and cost.c_draft_resident is not None:
        return replace(cost, c_draft=cost.c_draft_resident)
    return cost


class Drafter:
    """Proposes draft tokens for the pending token committed[-1] (at position len(committed) - 1)."""

    name = "none"
    drafts_in_context = False  # its draft passes run in the decoder's own context, through the routing hook

    def propose(self, dec, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        """sample(logits, history) -> (token, distribution): the generation's sampler (engine.sampling),
        given the tokens before the one it draws; sampled, it draws with the noise the target verifies with."""
        return Proposal()

    def feedback(self, iteration) -> None:
        """Sees each finished Iteration event (adaptive policies learn from it)."""

    def file_mappings(self) -> list[tuple[int, int, int]]:
        """Mappings of the model file its own weights live in (a drafter that loaded them a second time)."""
        return []

    def close(self) -> None:
        """Releases resources of its own (e.g. a second context)."""


class SelfDrafter(Drafter):
    """The target model with top-k_d experts, drafting in the target's own KV cache.

    allowed: None, the router's top-k_d; or a function returning the experts [n_layer, n_expert] (bool) the
    draft passes may read, asked once per proposal: under a memory budget, the experts in memory, so that a
    draft is a guess that fetches nothing (its cost is its compute) while its routing still predicts the
    target experts the verification will fetch."""

    name = "self"
    drafts_in_context = True

    def __init__(self, k_draft: int, rule: StopRule, allowed: Callable[[], np.ndarray] | None = None):
        self.k_draft = k_draft
        self.rule = rule
        self.allowed = allowed

    def route_drafts(self, dec) -> None:
        """Set the hook for the draft passes."""
        dec.rt.hook.draft(self.k_draft, None if self.allowed is None else self.allowed())

    def feedback(self, it) -> None:
        if it.drafted:
            self.rule.observe_outcome([c.prob for c in it.candidates if c.kept], len(it.accepted))

    def propose(self, dec, committed, max_len, sample) -> Proposal:
        pending, pos = committed[-1], len(committed) - 1
        out = Proposal()
        if max_len <= 0:
            out.stop = "limit"
            return out
        drafting = self.rule.worth_drafting()
        out.decision = self.rule.decision
        if not drafting:
            out.stop = "no-draft"
            return out
        rt, hook = dec.rt, dec.rt.hook
        n_layer, n_expert = rt.info.n_layer, rt.info.n_expert
        t0 = time.perf_counter()
        self.route_drafts(dec)
        logits = rt.decode([pending], pos, "last")[0]
        routing = hook.snapshot(1)
        in_batch = np.zeros((n_layer, n_expert + 1), bool)   # predicted target experts of the batch
        read = np.zeros((n_layer, n_expert + 1), bool)       # experts the draft passes read
        layers = np.arange(n_layer)[:, None]
        in_batch[layers, routing.orig[:, 0, :]] = True
        read[layers, routing.used[:, 0, :]] = True
        out.pending_predicted = routing.orig[:, 0, :]
        observer = dec.observer  # told each newly predicted expert as soon as it is known (prefetch)
        if observer is not None:
            observer.predicted(in_batch[:, :n_expert])
        chain = survival = 1.0  # the product of draft probabilities; of the rule's acceptance (its p_i)
        out.stop = "cap"
        for i in range(max_len):
            token, q = sample(logits, committed + out.tokens)
            prob = float(q[token])
            chain *= prob
            survival *= self.rule.acceptance(prob)
            if i == 0:
                self.rule.observe_first(prob)
            text = dec.piece_text(token)
            reject, bound = self.rule.pre_reject(survival, prob)
            if reject:
                out.candidates.append(DraftCandidate(token, text, prob, chain, bound, np.zeros(n_layer, int), False,
                                                     accept_chance=survival))
                out.stop = "utility" if isinstance(self.rule, UtilityStop) else "confidence"
                break
            new = np.zeros(n_layer, int)
            last = i == max_len - 1
            if self.rule.needs_routing or not last:
                logits = rt.decode([token], pos + 1 + i, "last")[0]
                r = hook.snapshot(1)
                predicted = np.zeros((n_layer, n_expert + 1), bool)
                predicted[layers, r.orig[:, 0, :]] = True
                new = (predicted & ~in_batch)[:, :n_expert].sum(axis=1)
                read[layers, r.used[:, 0, :]] = True
                if i == 0:
                    self.rule.observe_first_experts(int(new.sum()))
            else:
                predicted = None
            keep, utility = self.rule.keep(survival, prob, int(new.sum()))
            out.candidates.append(DraftCandidate(token, text, prob, chain, utility, new, keep,
                                                 None if predicted is None else r.orig[:, 0, :], survival))
            if not keep:
                out.stop = "utility"
                break
            if predicted is not None:
                if observer is not None:
                    observer.predicted((predicted & ~in_batch)[:, :n_expert])
                in_batch |= predicted
            out.tokens.append(token)
            out.chain.append(chain)
        out.seconds = time.perf_counter() - t0
        out.experts_read = read[:, :n_expert].sum(axis=1)
        out.predicted = in_batch[:, :n_expert]
        out.forced = self.rule.forced
        return out


class LayerSkipDrafter(SelfDrafter):
    """The paper's LS baseline on stock llama.cpp: the target drafting with the routed experts of every other
    MoE layer skipped (the graph cannot drop those layers' expert matmuls; each slot there reads one expert
    with weight 0, so that the layer adds only attention and any shared expert and reads nothing new)."""

    name = "ls"

    def __init__(self, rule: StopRule):
        super().__init__(0, rule)

    def route_drafts(self, dec) -> None:
        dec.rt.hook.skip(dec.moe_layers()[1::2])


class IndependentDrafter(Drafter):
    """The paper's naive ES baseline: the same weights loaded a second time with expert_used_count = k_d,
    drafting a fixed length in its own KV cache. Draft-computed KV of accepted tokens is kept, so draft
    error accumulates across iterations (what context alignment removes)."""

    name = "naive"

    def __init__(self, dec, k_draft: int, n_threads: int | None = None):
        from ..decoding.runtime import LlamaRuntime

        info = dec.info
        self.rt = LlamaRuntime(info, n_ctx=dec.n_ctx, n_threads=n_threads, install_hook=False,
                               max_verify_rows=dec.max_draft + 1, placement=dec.placement,
                               use_extra_bufts=dec.rt.use_extra_bufts,
                               int_overrides={f"{info.arch}.expert_used_count": k_draft})
        self.tokens: list[int] = []  # what this context's KV holds

    def file_mappings(self) -> list[tuple[int, int, int]]:
        return self.rt.file_mappings

    def _sync(self, committed: list[int]) -> None:
        """Make the draft KV hold committed[:-1]: drop what diverged, decode what is missing."""
        want = committed[:-1]
        same = 0
        for a, b in zip(self.tokens, want):
            if a != b:
                break
            same += 1
        if same < len(self.tokens):
            self.rt.kv_remove_from(same)
            del self.tokens[same:]
        missing = want[same:]
        self.rt.prefill(missing, len(self.tokens))
        self.tokens.extend(missing)

    def propose(self, dec, committed, max_len, sample) -> Proposal:
        out = Proposal()
        if max_len <= 0:
            out.stop = "limit"
            return out
        t0 = time.perf_counter()
        if not committed[:-1] or (self.tokens and self.tokens[0] != committed[0]):
            self.rt.kv_clear()
            self.tokens = []
        self._sync(committed)
        token = committed[-1]
        chain = 1.0
        n_layer = dec.info.n_layer
        for i in range(max_len):
            logits = self.rt.decode([token], len(self.tokens), "last")[0]
            self.tokens.append(token)
            token, q = sample(logits, committed + out.tokens)
            prob = float(q[token])
            chain *= prob
            out.candidates.append(DraftCandidate(token, dec.piece_text(token), prob, chain, None,
                                                 np.zeros(n_layer, int), True))
            out.tokens.append(token)
            out.chain.append(chain)
        out.stop = "cap"
        out.seconds = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.rt.close()


class CascadeDrafter(Drafter):
    """Cascade-style per-request adaptation: a test phase tries each draft length K in {0, 1, cap/2, cap}
    for a few iterations and measures utility (committed tokens per second of draft + verify); the set
    phase then uses the best K until the next test phase."""

    name = "cascade"
    drafts_in_context = True

    def __init__(self, k_draft: int, cap: int, trials_per_k: int = 2, set_iterations: int = 16,
                 allowed: Callable[[], np.ndarray] | None = None):
        self.choices = sorted({0, 1, max(1, cap // 2), cap})
        self.inner = SelfDrafter(k_draft, FixedLength(), allowed)
        self.trials_per_k = trials_per_k
        self.set_iterations = set_iterations
        self._schedule: list[int] = []
        self._scores: dict[int, list[float]] = {}
        self._current = 0
        self._phase = "test"
        self._start_test()

    def _start_test(self):
        self._phase = "test"
        self._scores = {k: [] for k in self.choices}
        self._schedule = [k for k in self.choices for _ in range(self.trials_per_k)]

    def propose(self, dec, committed, max_len, sample) -> Proposal:
        if self._schedule:
            self._current = self._schedule.pop(0)
        out = self.inner.propose(dec, committed, min(max_len, self._current), sample) if self._current else Proposal()
        if not self._current:
            out.stop = "no-draft"
        out.stop = f"{self._phase}:K={self._current}" if out.stop in ("cap", "no-draft") else out.stop
        return out

    def feedback(self, it) -> None:
        seconds = it.t_draft + it.t_verify
        if self._phase == "test":
            self._scores[self._current].append(len(it.committed) / max(seconds, 1e-9))
            if not self._schedule:
                best = max(self.choices, key=lambda k: np.mean(self._scores[k]) if self._scores[k] else -1)
                self._current = best
                self._phase = "set"
                self._schedule = [best] * self.set_iterations
        elif not self._schedule:
            self._start_test()


class NgramIndex:
    """Where each n-gram (n ≤ max_ngram) of one growing token sequence (a generation's context) last occurred,
    for prompt lookup: the longest n-gram ending the sequence that occurred earlier in it, and what followed its
    most recent earlier occurrence. Kept up to date as the sequence grows, so that a lookup costs a few
    dictionary reads rather than a scan of the context on every step."""

    def __init__(self, max_ngram: int, min_ngram: int = 1, periodic: bool = False):
        self.max_ngram, self.min_ngram, self.periodic = max_ngram, min_ngram, periodic
        self.indexed = 1  # n-grams ending before this index are in `last`
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest indexed occurrence

    def extend(self, seq: list[int]) -> None:
        """Index the n-grams of seq not yet indexed: every one ending before its last token (the one ending it
        must not find itself, and nothing follows it yet)."""
        for end in range(self.indexed, len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.last[tuple(seq[end - n : end])] = end
        self.indexed = max(self.indexed, len(seq))

    def lookup(self, seq: list[int], max_len: int) -> tuple[int, list[int], int]:
        """(n, continuation, period): up to max_len tokens that followed the latest earlier occurrence of the
        longest n-gram ending seq, and how far back that occurrence ends; (0, [], 0) when none of its n-grams
        occurred before. Periodic: where the continuation runs into the end of seq, the context is in a loop of
        that period, and the continuation goes on round it (its tokens from index `period` on)."""
        self.extend(seq)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            end = self.last.get(tuple(seq[-n:]))
            if end is not None:
                period = len(seq) - end
                reach = max_len if self.periodic else min(max_len, period)
                return n, [seq[end + i % period] for i in range(reach)], period
        return 0, [], 0


class EarlierText:
    """The text of this session's earlier generations, prompt and output, for copies where a generation's own
    context has no repeated n-gram (or a shorter one): a model's completions repeat its habits from one prompt to
    the next.

    One entry per prompt, the latest, and a generation never copies from an entry of its own prompt: a second
    run of the same prompt (bench's interleaved modes and repeats, a retry) would copy its own answer. The longest
    n-gram ending the context found in any entry wins; where several entries hold it, what followed it in each
    (its latest occurrence there) votes token by token, ties going to the latest entry: once a session holds
    dozens of generations a common n-gram is followed by several habits, and the latest entry's is often not the
    commonest (`vote` holders at most, the latest, so that a step's lookup stays a few dozen reads). A token every
    one of two or more voters agreed on is far likelier to be the target's (on the shipped model's greedy
    HumanEval completions, 91% of such copied tokens were accepted against 50% where one entry voted and 55%
    where the vote split), so each copied token comes with that standing, for the rule to learn apart. At most
    `keep` entries and `max_tokens` tokens in all (a long chat's every turn holds the whole conversation), the
    oldest dropped first. The indexes take about 500 bytes a token, and under a memory budget that memory comes
    out of the expert cache: the token cap holds 64 prompts of a few hundred tokens, where copies found stop
    growing with more generations kept, in under 10 MiB."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, keep: int = 64, max_tokens: int = 1 << 14,
                 vote: int = 16):
        self.max_ngram, self.min_ngram, self.keep, self.max_tokens = max_ngram, min_ngram, keep, max_tokens
        self.vote = vote
        self.tokens = 0
        # prompt -> (prompt and output, n-gram -> the index just past its latest occurrence there)
        self.entries: OrderedDict[tuple[int, ...], tuple[list[int], dict[tuple[int, ...], int]]] = OrderedDict()
        # n-gram -> the entries holding it, oldest first: a lookup on every decoding step reads one list rather
        # than every entry's index
        self.holders: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def add(self, prompt: Sequence[int], text: Sequence[int]) -> None:
        """A generation ended: `text` is its prompt and what it committed."""
        seq = list(text)
        index = NgramIndex(self.max_ngram, self.min_ngram)
        index.extend(seq)
        key = tuple(prompt)
        if key in self.entries:
            self._drop(key)
        self.entries[key] = (seq, index.last)
        for gram in index.last:
            self.holders.setdefault(gram, []).append(key)
        self.tokens += len(seq)
        while len(self.entries) > 1 and (len(self.entries) > self.keep or self.tokens > self.max_tokens):
            self._drop(next(iter(self.entries)))

    def generations(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """(prompt, prompt and output) of every entry kept, oldest first: add() them in this order to rebuild."""
        return [(key, seq) for key, (seq, _) in self.entries.items()]

    def _drop(self, key: tuple[int, ...]) -> None:
        seq, last = self.entries.pop(key)
        self.tokens -= len(seq)
        for gram in last:
            holders = self.holders[gram]
            holders.remove(key)
            if not holders:
                del self.holders[gram]

    def lookup(self, prompt: Sequence[int], seq: list[int], max_len: int) -> tuple[int, list[int], list[bool]]:
        """(n, continuation, agreed) for a generation of `prompt` whose context is `seq`: up to max_len tokens
        that followed the longest n-gram ending seq in other prompts' entries, voted among them, and for each
        token whether two or more voters were left and all agreed on it; (0, [], []) where none holds one."""
        own = tuple(prompt)
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            gram = tuple(seq[-n:])
            followed = []  # latest entry first
            for key in reversed(self.holders.get(gram, ())):
                if key != own:
                    text, last = self.entries[key]
                    end = last[gram]
                    followed.append(text[end: end + max_len])
                    if len(followed) == self.vote:
                        break
            if followed:
                return (n, *_vote(followed))
        return 0, [], []


def _vote(followed: list[list[int]]) -> tuple[list[int], list[bool]]:
    """The continuation most of `followed` agree on, token by token: at each position the commonest next token
    among those that agreed so far (ties to the earliest listed), until none has a next token; and for each
    token whether two or more were left and all had it."""
    if len(followed) == 1:
        return list(followed[0]), [False] * len(followed[0])
    out: list[int] = []
    agreed: list[bool] = []
    while True:
        at = len(out)
        counts: dict[int, int] = {}
        for f in followed:
            if len(f) > at:
                counts[f[at]] = counts.get(f[at], 0) + 1
        if not counts:
            return out, agreed
        token = max(counts, key=counts.__getitem__)  # the first listed among the commonest
        voters = sum(counts.values())
        out.append(token)
        agreed.append(voters >= 2 and counts[token] == voters)
        followed = [f for f in followed if len(f) > at and f[at] == token]


class LookupDrafter(Drafter):
    """Prompt-lookup drafting: find the longest recent n-gram (n ≤ max_ngram) earlier in the context and
    propose the tokens that followed it. Costs no model pass; deterministic drafts."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.index = NgramIndex(max_ngram, min_ngram)

    def propose(self, dec, committed, max_len, sample) -> Proposal:
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
            out.candidates.append(DraftCandidate(token, dec.piece_text(token), 1.0, 1.0, None,
                                                 np.zeros(n_layer, int), True))
        out.stop = "lookup" if found else "no-match"
        out.seconds = time.perf_counter() - t0
        return out


# what the rule learns a copied token's acceptance by, beside n: where it was copied from (the generation's own
# context, or the session's earlier generations, EarlierText); for the context's, whether it was taken round the
# loop the context is in, past the context's end (once the target has accepted a whole period it nearly always
# goes on: on the shipped model's greedy HumanEval completions 96-99.6% of such tokens against 77-88% of the
# other copied tokens after the first); and for the session's whether two or more of its entries voted and all
# agreed on it
COPY_KINDS = ("context", "context, looped", "session", "session, agreed")


class CopyLearner:
    """What s2moe learns of copied drafts.

    How often the target accepts a copied token after an n-gram match, per n and per kind (COPY_KINDS: from the
    generation's own context, those taken round its loop apart, or from the session's earlier generations, those all
    voters agreed on apart): the accepted share of the copied tokens of that kind verified there (each judged only
    if those before it were accepted) plus `prior` pseudo-tokens at `rate`. A copy's tokens are priced by the chain
    of their estimates, and the prior's rate chained over a long copy expects little of it: a rule that had seen few
    copies made short ones only, and so never learned that the long ones were accepted. So where plain steps fetch
    most of the experts they read (`cache_serves_little`), an estimate is raised by its share's standard error: seen
    little, it hopes for more, and it comes down to the share as copies are verified. Not where the cache serves
    plain steps most of theirs: there the copies that hope buys evict what the plain steps between them would have
    found, a cost no timing of the copies shows (below). A copy the rule declines is verified anyway now and then
    (its first token only), so that an n the estimate has written off is seen again when the text starts repeating
    itself; a rejected probe doubles the wait before the next (up to 16×), an accepted one resets it. Probes are
    counted by the kind of a copy's first token.

    What a copy's rows add to the verification's experts, by their number (`added`): consecutive tokens share
    experts, so a verification's distinct experts grow ever more slowly with its rows, and a copy of eight rows
    adds far less than eight times what a copy of one adds. The rows are modelled as drawing their experts from a
    pool, each repeating a share q of the one before's (over layers, the pending row's K experts): r rows add
    (K/q)(1 − (1 − q)^(r+1)) − K. Every verified copy, whatever its length, gives an estimate of q, and the
    running mean prices copies of every length. Priced by a mean row instead, what a copy teaches would depend
    on its length: long copies would make rows look cheap, short ones (a probe is one row) dear.

    And what copies cost, timed from one proposal to the next (drafting, verification, acceptance, the event's
    consumer): a plain step, and what a copy costs beyond it, timed on copies the target rejected whole. An
    accepted copy's row reads what the next step would have read anyway, so it looks nearly free; a rejected
    one shows what its rows cost on their own (and they evict experts plain steps would have kept: under `auto`,
    pricing rows by every copy's timing left s2moe 3-4% behind plain decoding on HumanEval). The constants
    price a copy by T_tok per row and T_exp per expert it adds, which leaves out what makes a verification with
    drafts dearer than a plain step (the routing hook's stops, the acceptance of each row): a timed copy's cost
    over the constants' price of the same copy (its own rows and experts) is a factor, and once `min_copies`
    rejected copies were timed its running mean scales the constants' prices. Before that the constants price a
    copy, but what a copied token saves is already the plain step as timed here (CopyPlanner).

    Under a memory budget copies also change which experts stay in memory, and the steps timed around them
    show the cache as copies leave it, not as plain decoding would keep it: where the kept cache serves plain
    steps most of their experts, copies leave the plain steps between them fetching more, and both the copies
    and their neighbours then look as if they paid while the session runs slower than without copies. What
    copies can disturb is what plain steps find in memory, so the experts a plain step reads and fetches are
    counted too (`fetched`), and the plain step as timed prices a copied token before copies were timed only
    where plain steps fetch most of what they read (`cache_serves_little`; docs/results.md, "Copies priced where
    the cache serves little", has the measurements at three budgets).

    llama.cpp reuses its last compute graph only for a batch of the same shape, so the step after a batch of
    another shape (a prefill, a copy's verification, a draft) builds its graph anew; on a small model in memory
    that rebuild is a sizeable part of a step, and it belongs to what came before. So a plain step is timed as
    such only after a plain step, and a copy rejected whole is charged, beyond its own time, what the plain step
    after it paid over a plain step's."""

    def __init__(self, max_ngram: int, rate: float = 0.6, prior: float = 2.0, probe_every: int = 32,
                 smoothing: float = 0.1, min_copies: int = 3):
        self.rate, self.prior = rate, prior
        shape = (len(COPY_KINDS), max_ngram + 1)
        self.seen = np.zeros(shape)
        self.accepted = np.zeros(shape)
        self.probe_every = probe_every
        self.probe_interval = np.full(shape, probe_every)
        self._declined = np.zeros(shape, int)
        self._likeliest = (rate, float(self._raised(rate, 0.0)))  # of any n and kind: as seen, and raised
        self._hopeless_steps = 0
        self.smoothing, self.min_copies = smoothing, min_copies
        self.plain_s: float | None = None  # running means: a plain step's wall time
        self.scale: float | None = None    # … and a copy's timed cost over the constants' price of it
        self.copies_timed = 0
        self.overlap: float | None = None  # running mean of q, the share of a row's experts the next repeats
        self.pending_experts = 0.0          # K: the experts a verification's pending row reads, over layers
        self._priced: float | None = None   # the constants' price of the copy verified last, until it is timed
        self._after_plain = False  # the iteration timed last was a plain step
        self._rejected: tuple[float, float] | None = None  # a copy rejected whole (seconds, price), until the step
        # after it is timed
        self._plain_fetched = np.zeros(2)  # decayed sums over plain steps: experts fetched, experts read

    def estimate(self, n: int, kind: str = "context") -> float:
        at = COPY_KINDS.index(kind), n
        share = self._share(self.accepted[at], self.seen[at])
        return float(self._raised(share, self.seen[at]) if self.cache_serves_little() else share)

    @property
    def likeliest(self) -> float:
        """The highest estimate of any n and kind."""
        return self._likeliest[self.cache_serves_little()]

    def _share(self, accepted, seen):
        return (self.prior * self.rate + accepted) / (self.prior + seen)

    def _raised(self, share, seen):
        return np.minimum(1.0, share + np.sqrt(share * (1 - share) / (self.prior + seen)))

    def probe(self, n: int, kind: str = "context") -> bool:
        """A copy after an n-gram, its first token of this kind, was declined: whether to verify that token anyway."""
        at = COPY_KINDS.index(kind), n
        self._declined[at] += 1
        if self._declined[at] < self.probe_interval[at]:
            return False
        self._declined[at] = 0
        return True

    def rare_probe_due(self) -> bool:
        """A step at prices where not even a certain copy pays: whether the longest wait is over, so that a copy
        is verified to find out whether the prices changed. Counted in steps, not declined copies: no n-gram
        is looked up while it lasts (on a small model in memory a lookup is a noticeable part of a step)."""
        self._hopeless_steps += 1
        return self._hopeless_steps >= 16 * self.probe_every

    def rare_probe_made(self) -> None:
        self._hopeless_steps = 0

    def learn(self, n: int, kinds: Sequence[str], accepted: int, probe: bool = False) -> None:
        """A copy after an n-gram, its tokens of `kinds`, verified: the target accepted `accepted` of them."""
        for k, kind in enumerate(kinds[:accepted + 1]):
            at = COPY_KINDS.index(kind), n
            self.seen[at] += 1
            self.accepted[at] += k < accepted
        share = self._share(self.accepted, self.seen)
        self._likeliest = (float(share.max()), float(self._raised(share, self.seen).max()))
        if probe and kinds:
            at = COPY_KINDS.index(kinds[0]), n
            self.probe_interval[at] = (self.probe_every if accepted else
                                       min(2 * self.probe_interval[at], 16 * self.probe_every))

    def began(self) -> None:
        """A generation begins: its first step follows the prefill, a batch of another shape."""
        self._after_plain, self._rejected, self._priced = False, None, None

    def verified(self, rows: int, added: float, pending: float, priced: float) -> float:
        """A copy of `rows` rows was verified: they added `added` experts (over layers) to the `pending` ones of
        its pending row, and the constants price such a copy at `priced` seconds. Returns what its first row
        added, as the pool it teaches has it (without a pending row's count, the rows' mean)."""
        self._priced = priced
        if pending <= 0:
            return added / rows
        q = copy_overlap(rows, added, pending)
        self.overlap = q if self.overlap is None else self.overlap + self.smoothing * (q - self.overlap)
        self.pending_experts = float(pending)
        return copy_added(q, 1, pending)

    def added(self, rows: int, per_row: float) -> float:
        """The experts a copy of `rows` rows is expected to add to its pending row's, over layers: by the pool
        of experts the verified copies share; before any was verified, `per_row` each."""
        if self.overlap is None:
            return rows * per_row
        return copy_added(self.overlap, rows, self.pending_experts)

    def timed(self, seconds: float, rows: int | None, accepted: int = 0) -> None:
        """An iteration's wall time: a plain step (rows 0), a verification of `rows` copied tokens of which the
        target accepted `accepted`, or (rows None) a step of another kind, whose time says nothing of copies."""
        rejected, self._rejected = self._rejected, None
        priced, self._priced = self._priced, None
        if rows == 0:
            if rejected is not None and self.plain_s is not None:
                copy_s, copy_priced = rejected
                self._time_copy((copy_s + seconds - 2 * self.plain_s) / copy_priced)
            elif self._after_plain:
                self.plain_s = (seconds if self.plain_s is None
                                else self.plain_s + self.smoothing * (seconds - self.plain_s))
        elif rows is not None and accepted == 0 and priced:
            self._rejected = (seconds, priced)
        self._after_plain = rows == 0

    def _time_copy(self, factor: float) -> None:
        self.scale = factor if self.scale is None else self.scale + self.smoothing * (factor - self.scale)
        self.copies_timed += 1

    def fetched(self, fetched: int, read: int) -> None:
        """A plain step under a memory budget fetched `fetched` of the `read` experts it read."""
        self._plain_fetched *= 1.0 - self.smoothing
        self._plain_fetched += (fetched, read)

    def cache_serves_little(self) -> bool:
        """Whether plain steps fetched at least half the experts they read (False where nothing was counted:
        without a memory budget, or before a plain step)."""
        fetched, read = self._plain_fetched
        return bool(read > 0 and fetched >= read / 2)

    def price(self) -> tuple[float, float] | None:
        """(a plain step, the factor on the constants' price of a copy) as measured; None until enough copies
        were timed."""
        if self.copies_timed < self.min_copies or self.plain_s is None or self.scale is None:
            return None
        return self.plain_s, self.scale


def copy_added(overlap: float, rows: int, pending: float) -> float:
    """The experts `rows` rows add to a pending row's `pending` ones, each row repeating a share `overlap` of
    the one before's experts from a pool they share (CopyLearner)."""
    if overlap < 1e-9:
        return rows * pending
    return pending / overlap * (1.0 - (1.0 - overlap) ** (rows + 1)) - pending


def copy_overlap(rows: int, added: float, pending: float) -> float:
    """The share q for which `rows` rows add `added` experts to the pending row's (copy_added's inverse: it
    falls from rows·pending at q = 0 to 0 at q = 1)."""
    if added >= rows * pending:
        return 0.0
    if added <= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if copy_added(mid, rows, pending) > added:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class CopyPlan:
    """A copy from the context as the utility rule weighed it: the tokens to verify, each token weighed (kept or
    the first declined) with its chained acceptance and the utility of the copy through it, and the numbers the
    rule decided with (for a probe, those of the best copy it declined)."""

    n: int                      # the length of the n-gram that matched
    source: str                 # where it matched: "context" or "session"
    probe: bool                 # declined, verified anyway (its first token only)
    p: float                    # the learned acceptance of its first token (its kind, after an n-gram of that length)
    rows: int                   # the copy's length as the rule priced it
    expected: float             # the tokens the target is expected to accept of those rows
    experts: float              # the experts the rule expects the rows to add to the pending row's
    saved: float                # what a committed token saves (seconds)
    cost: float                 # what verifying the rows costs
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # each token's, one of COPY_KINDS
    weighed: list[tuple[int, float, float, bool]] = field(default_factory=list)  # (token, survival, utility, kept)


class CopyPlanner:
    """What s2moe decides about drafts copied from the context, apart from any model: decoding asks it before
    each step (LookupOrSelfDrafter), and a projection replays it on a recorded generation's tokens with projected
    times (engine.projection). The prices it decides with come from its rule's CopyLearner, whose clock is the
    caller's: wall time in decoding, projected seconds in a replay."""

    # A single repeated token predicts the next one poorly (31-48% of first copies accepted on the shipped model's
    # greedy HumanEval and natural-text completions, against 73-96% after a repeated trigram): not worth probing.
    def __init__(self, rule: UtilityStop, earlier: EarlierText | None = None, prompt: Sequence[int] = (),
                 max_ngram: int = 3, min_ngram: int = 2, periodic: bool = True):
        """earlier: the session's earlier generations, copied from where they match a longer n-gram than the
        context (None: the context only); prompt: this generation's, whose own earlier runs are not copied."""
        self.rule = rule
        self.index = NgramIndex(max_ngram, min_ngram, periodic=periodic)
        self.earlier, self.prompt = earlier, tuple(prompt)
        self.learned = rule.copies(max_ngram)
        self.learned.began()
        self._costs_key: tuple | None = None
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
        timed = learned.price()
        saved, scale = timed or (rule.cost.t_ar, 1.0)
        if timed is None and learned.plain_s is not None and learned.cache_serves_little():
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
        chain, expected, hopeless, likeliest = 1.0, 0.0, True, learned.likeliest
        for rows, (_, cost) in enumerate(costs, 1):
            chain *= likeliest
            expected += chain
            if expected * saved >= rule.threshold * max(cost, rows * least_row):
                hopeless = False
                break
        if hopeless and not learned.rare_probe_due():
            return None
        source = "context"
        n, found, period = self.index.lookup(context, max_len)
        kinds = ["context, looped" if i >= period else "context" for i in range(len(found))]
        if self.earlier is not None and n < self.index.max_ngram:  # else the earlier text cannot match longer
            n2, found2, agreed2 = self.earlier.lookup(self.prompt, context, max_len)
            if found2 and n2 > n:
                source, n, found = "session", n2, found2
                kinds = ["session, agreed" if a else "session" for a in agreed2]
        if not found:
            return None
        rates = {kind: learned.estimate(n, kind) for kind in set(kinds)}
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
        if hopeless:
            learned.rare_probe_made()
        elif probe and not learned.probe(n, kinds[0]):
            return None
        _, expected, added, cost = weighed[best - 1]
        out = CopyPlan(n, source, probe, rates[kinds[0]], best, expected, added, saved, cost)
        keep = 1 if probe else best
        shown = keep if probe else keep + 1  # a copy's tokens, and the first one declined after them
        for i, (survival, expected, added, cost) in enumerate(weighed[:shown]):
            kept = i < keep
            out.weighed.append((found[i], survival, rule.copy_utility(expected, saved, cost), kept))
            if kept:
                out.tokens.append(found[i])
                out.kinds.append(kinds[i])
        return out

    def _costs(self, scale: float, max_len: int) -> list[tuple[float, float]]:
        """(experts added, cost before the least row's floor) of copies of 1..max_len rows at these prices. Kept
        while the prices stay: every step asks, and they change only as copies and drafts are verified or timed."""
        rule, learned = self.rule, self.learned
        per_row = rule.expected_first_experts
        key = (scale, max_len, per_row, learned.overlap, learned.pending_experts)
        if key != self._costs_key:
            added = [learned.added(rows, per_row) for rows in range(1, max_len + 1)]
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
        self.rule.observe_first_experts(self.learned.verified(rows, added, pending_experts,
                                                              self.rule.copy_cost(rows, added)))


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

    def __init__(self, self_drafter: SelfDrafter, rule: UtilityStop, earlier: EarlierText | None = None,
                 prompt: Sequence[int] = (), periodic: bool = True):
        self.self_drafter = self_drafter
        self.copies = CopyPlanner(rule, earlier, prompt, periodic=periodic)
        # the last proposal's copy, and the experts of its pending token's row
        self._copied: tuple[CopyPlan, int] | None = None
        # when the last proposal began, its rows when it was plain (0) or copied, and how many of those the
        # target accepted: what its iteration's time says
        self._started: float | None = None
        self._rows: int | None = None
        self._accepted = 0

    def propose(self, dec, committed, max_len, sample) -> Proposal:
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
        out = Proposal(stop=f"{head}: probe" if plan.probe else
                       f"{head}: utility" if not plan.weighed[-1][3] else head)
        n_layer = dec.info.n_layer
        for token, survival, u, keep in plan.weighed:
            out.candidates.append(DraftCandidate(token, dec.piece_text(token), 1.0, 1.0, u, np.zeros(n_layer, int),
                                                 keep, None, survival))
        out.tokens = list(plan.tokens)
        out.chain = [1.0] * len(plan.tokens)
        out.decision = self.copies.rule.copy_decision(plan.expected, plan.experts, plan.saved, plan.cost, plan.rows,
                                                      probing=plan.probe, source=plan.source)
        out.seconds = time.perf_counter() - now
        self._copied = (plan, len(dec.moe_layers()) * max(dec.info.n_expert_used, 1))
        self._rows = len(plan.tokens)
        return out

    def feedback(self, it) -> None:
        if it.verify_misses is not None and self._copied is None and not it.drafted:
            self.copies.learned.fetched(int(np.sum(it.verify_misses)), int(np.sum(it.verify_experts)))
        if self._copied is None:
            self.self_drafter.feedback(it)
            return
        plan, pending_experts = self._copied
        self._accepted = len(it.accepted)
        self.copies.learn(plan, len(it.accepted), float(it.verify_experts.sum()), pending_experts)
