"""The typed event stream of a generation. The CLI, the benchmark and the app consume only these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CostConstants:
    """Seconds. Verification of a batch costs intercept + t_exp·(distinct experts over layers) + t_tok·tokens."""

    t_ar: float
    c_draft: float
    t_exp: float
    t_tok: float
    intercept: float
    source: str  # "profile:NAME", "measured at start-up" or "not needed"
    r2: float | None = None
    mape: float | None = None
    n_samples: int = 0
    # a draft step that fetches nothing (its experts all in memory): what a draft from resident experts costs
    # under a memory budget, where c_draft is a draft step that fetches its experts (None: not measured)
    c_draft_resident: float | None = None

    def verify_cost(self, experts: float, tokens: int) -> float:
        return self.intercept + self.t_exp * experts + self.t_tok * tokens


@dataclass(frozen=True)
class MeasuringCosts:
    """The cost constants are being measured before a generation starts (under a memory budget, a model
    many times its size: about a minute): said once it has taken a few seconds, then as it goes."""

    fraction: float  # of the measurement done
    seconds: float  # since it began


@dataclass(frozen=True)
class Started:
    mode: str
    model: str
    prompt_tokens: tuple[int, ...]
    n_layer: int
    n_expert: int
    k: int
    config: dict[str, Any]  # the generation's settings as JSON writes them
    cost: CostConstants | None


@dataclass(frozen=True)
class Prefilled:
    n_tokens: int
    seconds: float
    reused: int = 0  # of n_tokens, those whose KV entries an earlier generation left (a conversation's turns)


@dataclass(frozen=True)
class DraftCandidate:
    """One token the drafter proposed, whether or not it went into the verification batch."""

    token: int
    text: str
    prob: float  # draft probability q of this token
    chain_prob: float  # product of draft probabilities up to this token (p_i)
    utility: float | None
    new_experts: np.ndarray  # per layer: experts it adds to the verification batch's set
    kept: bool
    predicted: np.ndarray | None = None  # [n_layer, k] target experts its draft pass routed it to (-1: no MoE)
    accept_chance: float | None = None  # p_i the rule priced it with: its learned acceptance through this token


@dataclass(frozen=True)
class DraftDecision:
    """The utility rule's decision before an iteration's first draft pass, with the numbers it rests on.

    A first token with draft probability p that adds E experts to the verification has utility
    p·T_AR / (C_draft + T_tok + T_exp·E). When even a certain token adding no expert stays below the
    threshold, drafting cannot pay under these constants (can_pay False) and only turning the rule off
    drafts. Otherwise the rule drafts when the first token's expected utility (running estimates of p and
    E) reaches the threshold, and probes now and then when it does not. Times in seconds.
    """

    drafting: bool
    can_pay: bool
    probing: bool  # a draft pass only to learn whether drafting pays again
    threshold: float
    utility: float  # the first token's expected utility (can_pay False: a certain token's)
    p_first: float  # expected draft probability of the first token (can_pay False: 1)
    new_experts: float  # experts it is expected to add to the verification, over layers
    t_ar: float  # what a committed draft token saves
    cost: float  # what it costs: C_draft + T_tok + T_exp·new_experts
    c_draft: float
    t_tok: float
    next_probe: int | None = None  # iterations until the next probe, when not drafting but drafting may pay
    # where the draft was copied from, no draft pass to pay: what followed the context's last n-gram earlier in
    # the context ("context") or in the session's earlier generations ("session"); None: not a copy
    copied: str | None = None
    # a copy is weighed whole: p_first is then the tokens the target is expected to accept of its `rows`,
    # new_experts and cost are the whole copy's
    rows: int = 1

    @property
    def text(self) -> str:
        """The decision in one sentence with its numbers (milliseconds)."""
        thr = f"threshold {self.threshold:g}"
        if not self.can_pay:
            out = (
                f"not drafting: a certain token saves T_AR {self.t_ar * 1e3:.2f} ms but costs "
                f"C_draft {self.c_draft * 1e3:.2f} + T_tok {self.t_tok * 1e3:.2f} ms"
            )
            return out if self.threshold == 1 else f"{out} (utility {self.utility:.2f} < {thr})"
        if self.copied:
            numbers = (
                f"({self.p_first:.2f} expected accepted × T_AR {self.t_ar * 1e3:.2f} ms / cost "
                f"{self.cost * 1e3:.2f} ms for {self.rows} rows with {self.new_experts:.1f} new experts)"
            )
            if self.probing:
                return (
                    f"probing: the best copy's expected utility {self.utility:.2f} < {thr} {numbers}; verifying "
                    "one copied token to see whether copies after this n-gram pay again"
                )
            where = "the context" if self.copied == "context" else "an earlier generation"
            return (
                f"copying {self.rows} tokens from {where}: the copy's expected utility {self.utility:.2f} "
                f"≥ {thr} {numbers}, no draft pass"
            )
        numbers = (
            f"(p {self.p_first:.2f} × T_AR {self.t_ar * 1e3:.2f} ms / cost {self.cost * 1e3:.2f} ms "
            f"with {self.new_experts:.1f} new experts)"
        )
        if self.drafting and not self.probing:
            return f"drafting: the first token's expected utility {self.utility:.2f} ≥ {thr} {numbers}"
        head = f"the first token's expected utility {self.utility:.2f} < {thr} {numbers}"
        if self.probing:
            return f"probing: {head}; one draft pass to see whether drafting pays"
        return f"not drafting: {head}; next probe in {self.next_probe} iterations"

    @property
    def wordings(self) -> tuple[str, ...]:
        """The decision from the full sentence down to a few words, for narrower places."""
        thr = f"{self.threshold:g}"
        if not self.can_pay and self.threshold == 1:
            t_ar, c_draft, t_tok = self.t_ar * 1e3, self.c_draft * 1e3, self.t_tok * 1e3
            return (
                self.text,
                f"no draft: T_AR {t_ar:.2f} < C_draft {c_draft:.2f} + T_tok {t_tok:.2f} ms",
                f"no draft: {t_ar:.2f}<{c_draft:.2f}+{t_tok:.2f} ms",
            )
        if not self.can_pay:
            return (
                self.text,
                f"no draft: even a certain token's utility {self.utility:.2f} < {thr}",
                f"no draft: utility {self.utility:.2f} < {thr}",
            )
        verb = "probing" if self.probing else "copying" if self.copied else "drafting" if self.drafting else "no draft"
        head = f"{verb}: utility {self.utility:.2f} {'≥' if self.utility >= self.threshold else '<'} {thr}"
        expected = f"{self.p_first:.2f} of {self.rows} accepted" if self.copied else f"p {self.p_first:.2f}"
        return self.text, f"{head} ({expected}, cost {self.cost * 1e3:.2f} ms)", head


@dataclass(frozen=True)
class ForcedDraft:
    """What a mode's stop rule would have decided on a draft that ran to the cap regardless (a trace)."""

    would_draft: bool  # the rule would have spent a first draft pass
    would_keep: int  # draft tokens it would have kept for verification


@dataclass(frozen=True)
class Iteration:
    """One draft → verify → commit step (a plain step in `ar` mode has no drafts)."""

    index: int
    candidates: tuple[DraftCandidate, ...]
    drafted: tuple[int, ...]  # draft tokens that were verified
    accepted: tuple[int, ...]  # prefix of `drafted` the target accepted
    rejected: tuple[int, ...]  # rest of `drafted`
    target_token: int  # the target's own token (correction, or bonus after a full accept)
    committed: tuple[int, ...]  # accepted + (target_token,) minus anything cut by a stop
    committed_text: str
    draft_stop: str  # why drafting stopped: "utility", "cap", "no-draft", "confidence", "context", ...
    rollback: int  # KV positions removed after verification (rejected drafts)
    kv_end: int  # KV positions held after the iteration
    n_committed: int  # prompt + generated tokens so far (the last one has no KV yet)
    verify_tokens: int
    verify_experts: np.ndarray  # [n_layer] distinct experts read by the verification batch
    reuse_ratio: np.ndarray  # [n_layer] distinct / (tokens·k)
    gated_moves: int  # expert selections moved by reuse gating
    t_draft: float
    t_verify: float
    draft_experts: np.ndarray | None = None  # [n_layer] distinct experts read by the draft passes
    useful_experts: np.ndarray | None = None  # [n_layer] distinct experts of the committed rows only
    verify_misses: np.ndarray | None = None  # [n_layer] of verify_experts, those not in memory before it (offloading)
    verify_major_faults: int | None = None  # page faults of the verification that read storage (offloading)
    # [n_layer] experts the draft passes read that were not in memory (offloading)
    draft_misses: np.ndarray | None = None
    draft_decision: DraftDecision | None = None  # the utility rule's decision this iteration (s2moe with the rule)
    # a draft tree: each drafted token's parent (index into drafted; -1: the pending token); None: a chain
    tree_parents: tuple[int, ...] | None = None
    accepted_path: tuple[int, ...] = ()  # indices into drafted of the accepted tokens, in order
    # A trace's drafts (GenerationConfig.trace) run to the cap: what the mode's own rule would have done, the
    # pending token's predicted experts ([n_layer, k], from the first draft pass) and the verification's routing
    # (hook.Routing: orig and used ids of every row)
    forced: ForcedDraft | None = None
    pending_predicted: np.ndarray | None = None
    verify_routing: object | None = None


@dataclass(frozen=True)
class ResidencySnapshot:
    """Expert residency while offloading (emitted every few iterations when a probe is attached)."""

    iteration: int
    resident: np.ndarray  # [n_layer, n_expert] fraction of each expert's pages in memory
    pinned: np.ndarray  # [n_layer, n_expert] bool
    hit_rate: np.ndarray  # [n_layer] predicted experts already resident at verification (nan: no lookups)


@dataclass(frozen=True)
class Finished:
    tokens: tuple[int, ...]
    text: str
    n_tokens: int
    seconds: float
    stop_reason: str  # "length", "eos", "context", "interrupted"
    iterations: int


@dataclass
class Totals:
    """What a run of iterations did, summed: one generation's, or several merged (the benchmark's per mode).

    The CLI summary, the benchmark table and the app's live panel all read these numbers; each iteration is
    counted here and nowhere else.
    """

    iterations: int = 0
    verifications: int = 0  # iterations that verified drafts
    committed: int = 0  # tokens committed
    committed_per_iter: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    gated_moves: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0
    # multi-token verifications (reuse is undefined for one token): how many, their reuse ratio per layer
    # summed, and the distinct experts they read (summed over layers)
    reuse_n: int = 0
    reuse_sum: np.ndarray | None = None
    verify_experts_sum: float = 0.0
    # of those that said which experts the committed tokens' rows needed: that many, out of this many read
    useful_experts_sum: float = 0.0
    useful_of_sum: float = 0.0
    # offloading: verifications that said how many of their experts were not in memory as their layer routed,
    # the distinct experts they read, how many of those were fetched, and page faults that waited for storage
    offloaded_steps: int = 0
    experts_read: float = 0.0
    experts_fetched: float = 0.0
    storage_faults: int = 0
    draft_fetched: float = 0.0  # experts the draft passes fetched (offloading, self-drafting)
    experts_verified: float = 0.0  # distinct experts every verification read, summed over layers

    def add_iteration(self, it: Iteration) -> None:
        self.iterations += 1
        self.committed += len(it.committed)
        self.committed_per_iter.append(len(it.committed))
        self.drafted += len(it.drafted)
        self.accepted += len(it.accepted)
        self.rollbacks += it.rollback
        self.gated_moves += it.gated_moves
        self.t_draft += it.t_draft
        self.t_verify += it.t_verify
        if it.drafted:
            self.verifications += 1
        if it.verify_tokens >= 2:
            self.reuse_sum = it.reuse_ratio.copy() if self.reuse_sum is None else self.reuse_sum + it.reuse_ratio
            self.reuse_n += 1
            self.verify_experts_sum += float(it.verify_experts.sum())
            if it.useful_experts is not None:
                self.useful_experts_sum += float(it.useful_experts.sum())
                self.useful_of_sum += float(it.verify_experts.sum())
        self.experts_verified += float(it.verify_experts.sum())
        if it.verify_misses is not None:
            self.offloaded_steps += 1
            self.experts_read += float(it.verify_experts.sum())
            self.experts_fetched += float(it.verify_misses.sum())
            self.storage_faults += it.verify_major_faults or 0
        if it.draft_misses is not None:
            self.draft_fetched += float(it.draft_misses.sum())

    def merge(self, other: Totals) -> None:
        """Add another run's totals to these (the benchmark sums one mode's generations over its prompts)."""
        self.iterations += other.iterations
        self.verifications += other.verifications
        self.committed += other.committed
        self.committed_per_iter.extend(other.committed_per_iter)
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rollbacks += other.rollbacks
        self.gated_moves += other.gated_moves
        self.t_draft += other.t_draft
        self.t_verify += other.t_verify
        if other.reuse_sum is not None:
            self.reuse_sum = other.reuse_sum.copy() if self.reuse_sum is None else self.reuse_sum + other.reuse_sum
        self.reuse_n += other.reuse_n
        self.verify_experts_sum += other.verify_experts_sum
        self.useful_experts_sum += other.useful_experts_sum
        self.useful_of_sum += other.useful_of_sum
        self.offloaded_steps += other.offloaded_steps
        self.experts_read += other.experts_read
        self.experts_fetched += other.experts_fetched
        self.storage_faults += other.storage_faults
        self.draft_fetched += other.draft_fetched
        self.experts_verified += other.experts_verified

    @property
    def accept_len(self) -> float:
        """Mean tokens committed per target pass (1.0 for plain decoding)."""
        return self.committed / self.iterations if self.iterations else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft_len(self) -> float:
        return self.drafted / self.iterations if self.iterations else 0.0

    @property
    def reuse_per_layer(self) -> np.ndarray | None:
        return None if self.reuse_sum is None else self.reuse_sum / self.reuse_n

    @property
    def reuse_ratio(self) -> float | None:
        """Mean over layers and multi-token verifications; None if no verification had ≥ 2 tokens."""
        per_layer = self.reuse_per_layer
        return None if per_layer is None else float(per_layer.mean())

    @property
    def mean_verify_experts(self) -> float | None:
        """Distinct experts (summed over layers) per multi-token verification."""
        return self.verify_experts_sum / self.reuse_n if self.reuse_n else None

    @property
    def experts_per_token(self) -> float | None:
        """Distinct experts (summed over layers) the verifications read per committed token."""
        return self.experts_verified / self.committed if self.committed else None

    @property
    def useful_share(self) -> float | None:
        """Share of the experts multi-token verifications read that the committed tokens needed."""
        return self.useful_experts_sum / self.useful_of_sum if self.useful_of_sum else None


@dataclass
class Summary(Totals):
    """One generation: its iterations' totals, and what its start and end events said."""

    mode: str = ""
    n_tokens: int = 0
    seconds: float = 0.0
    cost: CostConstants | None = None
    stop_reason: str = ""
    text: str = ""
    tokens: tuple[int, ...] = ()
    prefill_seconds: float = 0.0

    def add(self, event: object) -> None:
        if isinstance(event, Started):
            self.mode = event.mode
            self.cost = event.cost
        elif isinstance(event, Prefilled):
            self.prefill_seconds = event.seconds
        elif isinstance(event, Iteration):
            self.add_iteration(event)
        elif isinstance(event, Finished):
            self.n_tokens = event.n_tokens
            self.seconds = event.seconds
            self.stop_reason = event.stop_reason
            self.text = event.text
            self.tokens = event.tokens

    @property
    def tok_per_s(self) -> float:
        """Tokens generated over the whole generation's wall time, the prompt's prefill included: what a user
        waited for."""
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        """The generation's wall time without its prefill: from the step that makes the first token to the end."""
        return self.seconds - self.prefill_seconds

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens generated over the decoding time, the prefill left out (the first token counted): the speed
        bench and tune measure, which a prompt's length does not move."""
        return self.n_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "n_tokens": self.n_tokens,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tok_per_s": self.tok_per_s,
            "decode_tok_per_s": self.decode_tok_per_s,
            "accept_len": self.accept_len,
            "acceptance_rate": self.acceptance_rate,
            "draft_len": self.mean_draft_len,
            "reuse_ratio": self.reuse_ratio,
            "reuse_ratio_per_layer": None if self.reuse_per_layer is None else [float(x) for x in self.reuse_per_layer],
            "rollbacks": self.rollbacks,
            "iterations": self.iterations,
            "verifications": self.verifications,
            "t_draft": self.t_draft,
            "t_verify": self.t_verify,
            "stop_reason": self.stop_reason,
        }
