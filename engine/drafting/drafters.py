"""Drafters: each decoding mode is a drafter over the same decoder.

A drafter proposes draft tokens for the pending token and leaves the shared KV cache as it found it
(the decoder removes draft entries before verification anyway): the target's own top-k_d experts stopped by a
rule (SelfDrafter), the layer-skip and independent-context baselines, and Cascade's tested draft lengths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..decoding.sampling import SeededSampler
from ..events import DraftCandidate, DraftDecision, ForcedDraft, Iteration
from .stoprules import FixedLength, StopRule, UtilityStop

if TYPE_CHECKING:  # the decoder builds its drafters: a run-time import would be circular
    from ..decoding.decoder import Decoder
    from ..decoding.hook import RoutingHook
    from ..decoding.runtime import LlamaRuntime
    from ..decoding.tree import DraftTree


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)  # p_i of each kept token
    candidates: list[DraftCandidate] = field(default_factory=list)
    stop: str = "no-draft"
    seconds: float = 0.0
    experts_read: npt.NDArray[np.int_] | None = None  # [n_layer] distinct experts the draft passes read
    predicted: npt.NDArray[np.bool_] | None = None  # [n_layer, n_expert] bool: target experts of the verify batch
    decision: DraftDecision | None = None  # the utility rule's decision, with its numbers
    tree: DraftTree | None = None  # the tokens are a tree's nodes, not a chain
    pending_predicted: npt.NDArray[np.integer[Any]] | None = (
        None  # [n_layer, k] the pending token's target experts, as drafted
    )
    forced: ForcedDraft | None = None  # drafted to the cap: what the rule would have done (RecordingStop)


class Drafter:
    """Proposes draft tokens for the pending token committed[-1] (at position len(committed) - 1)."""

    name = "none"
    drafts_in_context = False  # its draft passes run in the decoder's own context, through the routing hook

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        """sample(logits, history) -> (token, distribution): the generation's sampler (engine.decoding.sampling),
        given the tokens before the one it draws; sampled, it draws with the noise the target verifies with."""
        return Proposal()

    def feedback(self, iteration: Iteration) -> None:
        """Sees each finished Iteration event (adaptive policies learn from it)."""

    def file_mappings(self) -> list[tuple[int, int, int]]:
        """Mappings of the model file its own weights live in (a drafter that loaded them a second time)."""
        return []

    def close(self) -> None:
        """Releases resources of its own (e.g. a second context)."""


def last_logits(rt: LlamaRuntime, tokens: list[int], pos: int) -> npt.NDArray[np.float32]:
    """The logits of the last of `tokens` decoded at positions pos.. of the context."""
    rows = rt.decode(tokens, pos, "last")
    assert rows is not None  # asked for the last row's logits, decode returns them
    last: npt.NDArray[np.float32] = rows[0]
    return last


def routing_hook(dec: Decoder) -> RoutingHook:
    """The hook that routes a decoder's draft passes: installed in every context that drafts in itself."""
    hook = dec.rt.hook
    assert hook is not None  # only a second context (IndependentDrafter's) runs without one
    return hook


class SelfDrafter(Drafter):
    """The target model with top-k_d experts, drafting in the target's own KV cache.

    allowed: None, the router's top-k_d; or a function returning the experts [n_layer, n_expert] (bool) the
    draft passes may read, asked once per proposal: under a memory budget, the experts in memory, so that a
    draft is a guess that fetches nothing (its cost is its compute) while its routing still predicts the
    target experts the verification will fetch."""

    name = "self"
    drafts_in_context = True

    def __init__(self, k_draft: int, rule: StopRule, allowed: Callable[[], npt.NDArray[np.bool_]] | None = None):
        self.k_draft = k_draft
        self.rule = rule
        self.allowed = allowed

    def route_drafts(self, dec: Decoder) -> None:
        """Set the hook for the draft passes."""
        routing_hook(dec).draft(self.k_draft, None if self.allowed is None else self.allowed())

    def feedback(self, it: Iteration) -> None:
        if it.drafted:
            self.rule.observe_outcome([c.prob for c in it.candidates if c.kept], len(it.accepted))

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
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
        rt, hook = dec.rt, routing_hook(dec)
        n_layer, n_expert = rt.info.n_layer, rt.info.n_expert
        t0 = time.perf_counter()
        self.route_drafts(dec)
        logits = last_logits(rt, [pending], pos)
        routing = hook.snapshot(1)
        in_batch = np.zeros((n_layer, n_expert + 1), bool)  # predicted target experts of the batch
        read = np.zeros((n_layer, n_expert + 1), bool)  # experts the draft passes read
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
                out.candidates.append(
                    DraftCandidate(
                        token, text, prob, chain, bound, np.zeros(n_layer, int), False, accept_chance=survival
                    )
                )
                out.stop = "utility" if isinstance(self.rule, UtilityStop) else "confidence"
                break
            new = np.zeros(n_layer, int)
            last = i == max_len - 1
            if self.rule.needs_routing or not last:
                logits = last_logits(rt, [token], pos + 1 + i)
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
            out.candidates.append(
                DraftCandidate(
                    token,
                    text,
                    prob,
                    chain,
                    utility,
                    new,
                    keep,
                    None if predicted is None else r.orig[:, 0, :],
                    survival,
                )
            )
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

    def route_drafts(self, dec: Decoder) -> None:
        routing_hook(dec).skip(dec.moe_layers()[1::2])


class IndependentDrafter(Drafter):
    """The paper's naive ES baseline: the same weights loaded a second time with expert_used_count = k_d,
    drafting a fixed length in its own KV cache. Draft-computed KV of accepted tokens is kept, so draft
    error accumulates across iterations (what context alignment removes)."""

    name = "naive"

    def __init__(self, dec: Decoder, k_draft: int, n_threads: int | None = None):
        from ..decoding.runtime import LlamaRuntime

        info = dec.info
        self.rt = LlamaRuntime(
            info,
            n_ctx=dec.n_ctx,
            n_threads=n_threads,
            install_hook=False,
            max_verify_rows=dec.max_draft + 1,
            placement=dec.placement,
            use_extra_bufts=dec.rt.use_extra_bufts,
            int_overrides={f"{info.arch}.expert_used_count": k_draft},
        )
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

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
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
        for _ in range(max_len):
            logits = last_logits(self.rt, [token], len(self.tokens))
            self.tokens.append(token)
            token, q = sample(logits, committed + out.tokens)
            prob = float(q[token])
            chain *= prob
            out.candidates.append(
                DraftCandidate(token, dec.piece_text(token), prob, chain, None, np.zeros(n_layer, int), True)
            )
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

    def __init__(
        self,
        k_draft: int,
        cap: int,
        trials_per_k: int = 2,
        set_iterations: int = 16,
        allowed: Callable[[], npt.NDArray[np.bool_]] | None = None,
    ):
        self.choices = sorted({0, 1, max(1, cap // 2), cap})
        self.inner = SelfDrafter(k_draft, FixedLength(), allowed)
        self.trials_per_k = trials_per_k
        self.set_iterations = set_iterations
        self._schedule: list[int] = []
        self._scores: dict[int, list[float]] = {}
        self._current = 0
        self._phase = "test"
        self._start_test()

    def _start_test(self) -> None:
        self._phase = "test"
        self._scores = {k: [] for k in self.choices}
        self._schedule = [k for k in self.choices for _ in range(self.trials_per_k)]

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        if self._schedule:
            self._current = self._schedule.pop(0)
        out = self.inner.propose(dec, committed, min(max_len, self._current), sample) if self._current else Proposal()
        if not self._current:
            out.stop = "no-draft"
        out.stop = f"{self._phase}:K={self._current}" if out.stop in ("cap", "no-draft") else out.stop
        return out

    def feedback(self, it: Iteration) -> None:
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
