"""What the live panel draws from: the figures of the current generation, collected from engine events.

Nothing here touches Textual. LiveState takes each event as it comes (cheap: a few appends and sums) and
counts its changes in `version`, so that the panel redraws only when something moved and at most a few
times a second; the draft tree of the latest iteration is kept as IterationTree for the tree view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...engine.events import DraftDecision, Finished, Iteration, Summary

MAX_POINTS = 120  # iterations kept for the per-iteration plots


@dataclass(frozen=True)
class IterationTree:
    """The draft tree of one iteration as the panel draws it: the text of each drafted token, its parent
    (index into the drafted tokens; -1: the pending token) and the accepted path, read off the event."""

    index: int
    pieces: tuple[str, ...]
    parents: tuple[int, ...]
    accepted_path: tuple[int, ...]
    target: str | None  # the target's own token after the path (None: cut by a stop)
    draft_stop: str

    @classmethod
    def of(cls, it: Iteration, piece) -> IterationTree:
        has_target = len(it.committed) == len(it.accepted) + 1
        return cls(
            it.index,
            tuple(piece(t) for t in it.drafted),
            tuple(it.tree_parents or ()),
            tuple(it.accepted_path),
            piece(it.target_token) if has_target else None,
            it.draft_stop,
        )


@dataclass
class LiveState:
    summary: Summary = field(default_factory=Summary)  # the generation so far: its totals, mode and cost
    n_layer: int = 0
    k: int = 0
    threshold: float = 1.0
    gating: bool = False
    utility: bool = False
    ar_reference: float | None = None  # tok/s of a plain run in this session
    reuse_last: list[float] = field(default_factory=list)
    reuse_other: list[float] | None = None  # session mean with the other gating setting
    reuse_other_label: str = ""
    utilities: list[tuple[float | None, bool, float]] = field(default_factory=list)
    draft_stop: str = ""
    decision: DraftDecision | None = None  # the utility rule's latest decision
    rollbacks: list[int] = field(default_factory=list)
    accept: list[int] = field(default_factory=list)
    speed: list[tuple[float, float]] = field(default_factory=list)  # (seconds since prefill, tok/s)
    # expert offloading (s2moe app --budget): per layer, share of expert bytes in memory, share pinned,
    # and the hit rate of the draft-predicted experts at verification (None: no lookups yet)
    resident: list[float] | None = None
    pinned: list[float] | None = None
    hit_rate: list[float | None] | None = None
    budget: str = ""  # the memory budget as the session words it ("" fully resident)
    tree: IterationTree | None = None  # the latest iteration's draft tree, once the generation drafts trees
    t0: float | None = None
    version: int = 0  # bumped on every change; the panel redraws when it moved

    def start(self, started, t: float, session_stats=None) -> None:
        cfg = started.config or {}
        ar_ref, version = self.ar_reference, self.version
        residency = self.resident, self.pinned, self.hit_rate, self.budget
        self.__init__()  # type: ignore[misc]
        self.ar_reference, self.version = ar_ref, version  # the version only ever grows
        self.resident, self.pinned, self.hit_rate, self.budget = residency  # memory outlives one generation
        self.summary.add(started)
        self.n_layer = started.n_layer
        self.k = started.k
        self.threshold = float(cfg.get("threshold", 1.0))
        self.gating = started.mode == "s2moe" and float(cfg.get("reuse_strength", 0) or 0) > 0
        self.utility = started.mode == "s2moe" and bool(cfg.get("utility", False))
        if session_stats is not None:
            if session_stats.ar_tok_per_s:
                self.ar_reference = session_stats.ar_tok_per_s
            other = session_stats.reuse_by_gating.get(not self.gating)
            if other is not None and len(other) == self.n_layer:
                self.reuse_other = list(other)
                self.reuse_other_label = "gating on (mean)" if not self.gating else "gating off (mean)"
        self.t0 = t
        self.version += 1

    def prefilled(self, t: float) -> None:
        self.t0 = t
        self.version += 1

    def add(self, it: Iteration, view, t: float, piece=None) -> None:
        """`piece` gives a token's text (the decoder's); without it the draft tree is not kept."""
        s = self.summary
        s.add(it)
        self.draft_stop = it.draft_stop
        # an iteration of a tree mode that drafted nothing is an empty tree, not a chain
        if piece is not None and (it.tree_parents is not None or self.tree is not None):
            self.tree = IterationTree.of(it, piece)
        if it.draft_decision is not None:
            self.decision = it.draft_decision
        if it.verify_tokens >= 2:
            self.reuse_last = [float(x) for x in it.reuse_ratio]
        if view is not None and it.candidates:
            self.utilities = list(view.utilities)
        self.rollbacks.append(it.rollback)
        self.accept.append(len(it.committed))
        if self.t0 is not None and t > self.t0:
            self.speed.append((t - self.t0, s.committed / (t - self.t0)))
        del self.rollbacks[:-MAX_POINTS], self.accept[:-MAX_POINTS], self.speed[:-MAX_POINTS]
        self.version += 1

    def residency(self, snap) -> None:
        import math

        self.resident = [float(x) for x in snap.resident.mean(axis=1)]
        self.pinned = [float(x) for x in snap.pinned.mean(axis=1)]
        self.hit_rate = [None if math.isnan(h) else float(h) for h in snap.hit_rate]
        self.version += 1

    def finish(self, finished: Finished) -> None:
        self.summary.add(finished)
        self.version += 1

    @property
    def tok_per_s(self) -> float:
        """The finished generation's decoding speed (as bench and tune count it: the prefill left out), or the
        latest measured while it runs."""
        if self.summary.seconds > 0:
            return self.summary.decode_tok_per_s
        return self.speed[-1][1] if self.speed else 0.0

    def stats_text(self) -> str:
        """What the tiles have no line for: the useful share of verified experts, offloading's fetches and
        faults, and where the cost constants came from."""
        s = self.summary
        if not s.mode:
            return "No generation yet. Type a prompt and press Enter."
        lines = []
        if s.useful_share is not None:
            lines.append(f"useful {s.useful_share:.0%} of the verified experts")
        if s.offloaded_steps:
            n = s.offloaded_steps
            # per verification, over all layers (so more than a layer's expert count): experts read, those not
            # in memory when their layer routed, and page faults that waited for storage
            lines.append(
                f"per step: {s.experts_read / n:.0f} experts read (all layers), "
                f"{s.experts_fetched / n:.1f} fetched from storage, {s.storage_faults / n:.1f} faults"
            )
        if s.cost is not None and s.cost.source:
            lines.append(f"cost: {s.cost.source}")
        return "\n".join(lines)

    def why(self) -> list[str]:
        """The utility rule's current decision in one line, most detailed wording first: the panel shows the
        first that fits its width. Where drafting cannot pay, it says how to draft anyway."""
        d = self.decision
        if d is None:
            return []
        if d.can_pay:
            return list(d.wordings)
        hints = (" · F7 turns the rule off and drafts anyway", " · F7 forces it")
        return [w + hint for w in d.wordings for hint in hints] + [f"{d.wordings[-1]} (F7)"]
