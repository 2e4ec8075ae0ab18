"""Drafting and stopping policies. Each decoding mode is a drafter over the same decoder.

A drafter proposes draft tokens for the pending token and leaves the shared KV cache as it found it
(the decoder removes draft entries before verification anyway). Stop rules decide, token by token,
how far a self-drafter goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .events import CostConstants, DraftCandidate


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    dists: list[np.ndarray] = field(default_factory=list)  # draft distribution each token was drawn from
    chain: list[float] = field(default_factory=list)       # p_i of each kept token
    candidates: list[DraftCandidate] = field(default_factory=list)
    stop: str = "no-draft"
    seconds: float = 0.0
    experts_read: np.ndarray | None = None  # [n_layer] distinct experts the draft passes read
    predicted: np.ndarray | None = None     # [n_layer, n_expert] bool: target experts of the verify batch


class StopRule:
    """Decides whether the self-drafter keeps a candidate token."""

    needs_routing = False

    def worth_drafting(self) -> bool:
        return True

    def pre_reject(self, chain: float, prob: float) -> tuple[bool, float | None]:
        """Reject before spending a draft pass on the candidate (its routing unknown)."""
        return False, None

    def keep(self, chain: float, prob: float, new_experts: int) -> tuple[bool, float | None]:
        return True, None


class FixedLength(StopRule):
    """Draft up to the cap, whatever it costs (`--no-utility`)."""


class ConfidenceStop(StopRule):
    """Stop when the draft's own probability of its token falls below p_min (llama.cpp draft-simple)."""

    def __init__(self, p_min: float = 0.5):
        self.p_min = p_min

    def pre_reject(self, chain, prob):
        return prob < self.p_min, None


class UtilityStop(StopRule):
    """Routing-aware expansion: keep token i while U_i = p_i·T_AR / (ΔC_ver(i|S) + C_draft) ≥ threshold.

    ΔC_ver = T_exp·(experts token i adds to the verification set, summed over layers) + T_tok.
    """

    needs_routing = True

    def __init__(self, cost: CostConstants, threshold: float = 1.0):
        self.cost = cost
        self.threshold = threshold

    def utility(self, chain: float, new_experts: float) -> float:
        c = self.cost
        return chain * c.t_ar / max(c.t_exp * new_experts + c.t_tok + c.c_draft, 1e-12)

    def worth_drafting(self) -> bool:
        # Even a certain token that adds no expert must pay for its draft pass and its verify row.
        return self.utility(1.0, 0.0) >= self.threshold

    def pre_reject(self, chain, prob):
        bound = self.utility(chain, 0.0)
        return bound < self.threshold, bound

    def keep(self, chain, prob, new_experts):
        u = self.utility(chain, new_experts)
        return u >= self.threshold, u


class Drafter:
    name = "none"

    def propose(self, dec, pending: int, pos: int, max_len: int, sample) -> Proposal:
        return Proposal()


class SelfDrafter(Drafter):
    """The target model with top-k_d experts, drafting in the target's own KV cache."""

    name = "self"

    def __init__(self, k_draft: int, rule: StopRule):
        self.k_draft = k_draft
        self.rule = rule

    def propose(self, dec, pending, pos, max_len, sample) -> Proposal:
        out = Proposal()
        if max_len <= 0:
            out.stop = "limit"
            return out
        if not self.rule.worth_drafting():
            out.stop = "no-draft"
            return out
        rt, hook = dec.rt, dec.rt.hook
        n_layer, n_expert = rt.info.n_layer, rt.info.n_expert
        t0 = time.perf_counter()
        hook.draft(self.k_draft)
        logits = rt.decode([pending], pos, "last")[0]
        routing = hook.snapshot(1)
        in_batch = np.zeros((n_layer, n_expert + 1), bool)   # predicted target experts of the batch
        read = np.zeros((n_layer, n_expert + 1), bool)       # experts the draft passes read
        layers = np.arange(n_layer)[:, None]
        in_batch[layers, routing.orig[:, 0, :]] = True
        read[layers, routing.used[:, 0, :]] = True
        chain = 1.0
        out.stop = "cap"
        for i in range(max_len):
            token, q = sample(logits)
            prob = float(q[token])
            chain *= prob
            text = dec.piece_text(token)
            reject, bound = self.rule.pre_reject(chain, prob)
            if reject:
                out.candidates.append(DraftCandidate(token, text, prob, chain, bound, np.zeros(n_layer, int), False))
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
            else:
                predicted = None
            keep, utility = self.rule.keep(chain, prob, int(new.sum()))
            out.candidates.append(DraftCandidate(token, text, prob, chain, utility, new, keep))
            if not keep:
                out.stop = "utility"
                break
            if predicted is not None:
                in_batch |= predicted
            out.tokens.append(token)
            out.dists.append(q)
            out.chain.append(chain)
        out.seconds = time.perf_counter() - t0
        out.experts_read = read[:, :n_expert].sum(axis=1)
        out.predicted = in_batch[:, :n_expert]
        return out
