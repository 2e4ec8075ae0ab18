"""The typed event stream of a generation. The CLI, the benchmark and the app consume only these."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def verify_cost(self, experts: float, tokens: int) -> float:
        return self.intercept + self.t_exp * experts + self.t_tok * tokens


@dataclass(frozen=True)
class Started:
    mode: str
    model: str
    prompt_tokens: tuple[int, ...]
    n_layer: int
    n_expert: int
    k: int
    config: dict
    cost: CostConstants | None


@dataclass(frozen=True)
class Prefilled:
    n_tokens: int
    seconds: float


@dataclass(frozen=True)
class DraftCandidate:
    """One token the drafter proposed, whether or not it went into the verification batch."""

    token: int
    text: str
    prob: float          # draft probability q of this token
    chain_prob: float    # product of draft probabilities up to this token (p_i)
    utility: float | None
    new_experts: np.ndarray  # per layer: experts it adds to the verification batch's set
    kept: bool


@dataclass(frozen=True)
class Iteration:
    """One draft → verify → commit step (a plain step in `ar` mode has no drafts)."""

    index: int
    candidates: tuple[DraftCandidate, ...]
    drafted: tuple[int, ...]      # draft tokens that were verified
    accepted: tuple[int, ...]     # prefix of `drafted` the target accepted
    rejected: tuple[int, ...]     # rest of `drafted`
    target_token: int             # the target's own token (correction, or bonus after a full accept)
    committed: tuple[int, ...]    # accepted + (target_token,) minus anything cut by a stop
    committed_text: str
    draft_stop: str               # why drafting stopped: "utility", "cap", "no-draft", "confidence", "context", ...
    rollback: int                 # KV positions removed after verification (rejected drafts)
    kv_end: int                   # KV positions held after the iteration
    n_committed: int              # prompt + generated tokens so far (the last one has no KV yet)
    verify_tokens: int
    verify_experts: np.ndarray    # [n_layer] distinct experts read by the verification batch
    reuse_ratio: np.ndarray       # [n_layer] distinct / (tokens·k)
    gated_moves: int              # expert selections moved by reuse gating
    t_draft: float
    t_verify: float
    draft_experts: np.ndarray | None = None  # [n_layer] distinct experts read by the draft passes
    useful_experts: np.ndarray | None = None  # [n_layer] distinct experts of the committed rows only
    verify_misses: np.ndarray | None = None   # [n_layer] of verify_experts, those not in memory before it (offloading)
    verify_major_faults: int | None = None    # page faults of the verification that read storage (offloading)


@dataclass(frozen=True)
class ResidencySnapshot:
    """Expert residency while offloading (emitted every few iterations when a probe is attached)."""

    iteration: int
    resident: np.ndarray  # [n_layer, n_expert] fraction of each expert's pages in memory
    pinned: np.ndarray    # [n_layer, n_expert] bool
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
class Summary:
    """Running totals over an event stream."""

    mode: str = ""
    n_tokens: int = 0
    seconds: float = 0.0
    iterations: int = 0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0
    reuse_sum: np.ndarray | None = None
    reuse_n: int = 0
    verify_experts_sum: float = 0.0
    committed_per_iter: list[int] = field(default_factory=list)
    cost: CostConstants | None = None
    stop_reason: str = ""
    text: str = ""
    tokens: tuple[int, ...] = ()
    prefill_seconds: float = 0.0

    def add(self, event) -> None:
        if isinstance(event, Started):
            self.mode = event.mode
            self.cost = event.cost
        elif isinstance(event, Prefilled):
            self.prefill_seconds = event.seconds
        elif isinstance(event, Iteration):
            self.iterations += 1
            self.drafted += len(event.drafted)
            self.accepted += len(event.accepted)
            self.rollbacks += event.rollback
            self.t_draft += event.t_draft
            self.t_verify += event.t_verify
            self.committed_per_iter.append(len(event.committed))
            if event.drafted:
                self.verifications += 1
            if event.verify_tokens >= 2:
                self.reuse_sum = event.reuse_ratio.copy() if self.reuse_sum is None else self.reuse_sum + event.reuse_ratio
                self.reuse_n += 1
                self.verify_experts_sum += float(event.verify_experts.sum())
        elif isinstance(event, Finished):
            self.n_tokens = event.n_tokens
            self.seconds = event.seconds
            self.stop_reason = event.stop_reason
            self.text = event.text
            self.tokens = event.tokens

    @property
    def tok_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_len(self) -> float:
        """Mean tokens committed per target pass (1.0 for plain decoding)."""
        return float(np.mean(self.committed_per_iter)) if self.committed_per_iter else 0.0

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

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "n_tokens": self.n_tokens,
            "seconds": self.seconds,
            "tok_per_s": self.tok_per_s,
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
