"""What a bench reports: its events (BenchProgress, BenchTrace, BenchDone), a BenchRow per mode and budget, the
row of llama.cpp's own decoding (reference_row), and the bounds a row is held against (storage_bound,
verification_bound_ratio) with the speed judgements across rows.

The CLI and the app read, judge and export these without running a bench; they live apart from the harness
(bench.run_bench) that fills them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..events import Iteration
from .speed import Judgement, Load, judge


@dataclass(frozen=True)
class BenchProgress:
    done: int
    total: int
    mode: str
    prompt_index: int
    budget: str = "none"
    repeat: int = 0
    warmup: bool = False  # an untimed warm-up generation: `done` does not count it


@dataclass(frozen=True)
class BenchTrace:
    """A prompt's decoding trace (engine.measure.trace), recorded after the prompt's timed generations."""

    prompt_index: int
    trace: object  # engine.measure.trace.Trace


@dataclass
class BenchRow:
    mode: str
    budget: str
    prompt_set: str
    n_prompts: int
    n_tokens: int
    seconds: float
    tok_per_s: float
    speedup_vs_ar: float | None
    accept_len: float
    draft_len: float
    acceptance_rate: float
    reuse_ratio: float | None
    reuse_ratio_per_layer: list[float] | None
    verify_experts: float | None  # mean distinct experts (summed over layers) per multi-token verification
    effective_verify_cost: float | None  # share of verified experts that committed tokens needed
    rollbacks: int
    t_draft: float
    t_verify: float
    identical_to_ar: float | None  # share of prompts whose tokens equal ar's (sampled: with the same seed)
    identical_expected: bool = False
    near_tie_divergences: int = 0  # prompts that diverged at a near-tie of ar's scores (near_tie)
    # offloaded: experts fetched from storage per generated token (draft passes and verifications), and the
    # storage-bound speed that implies (storage_bound)
    fetched_per_token: float | None = None
    bound_tok_per_s: float | None = None
    experts_per_token: float | None = None  # distinct experts (over layers) verifications read per committed token
    # one figure per repeat over the whole prompt set: tok/s, and the ratio to ar's tok/s in the same repeat
    tok_per_s_repeats: list[float] | None = None
    speedup_repeats: list[float] | None = None
    # self-drafting modes (chains, trees): what the draft passes read (resident | router)
    draft_experts: str | None = None
    # tok/s of each generation, in the order they ran (by repeat, then prompt): the same place in every mode's
    # list is the same prompt and repeat, run next to each other (speed.judge pairs them)
    run_tok_per_s: list[float] | None = None
    # the ratio to ar's two-standard-error range over those pairs (speed.compare; None: too few pairs)
    speedup_interval: list[float] | None = None
    # ar's row where it decoded by the argmax of the logits (greedy, no penalty): each prompt's tokens, which
    # llama.cpp's own greedy decoding (the reference row) must give too
    tokens: list[list[int]] | None = None

    @property
    def repeats(self) -> int:
        return len(self.tok_per_s_repeats or ()) or 1

    @property
    def tok_per_s_range(self) -> str:
        """min–max tok/s over the repeats ("" with a single repeat)."""
        return spread_text(self.tok_per_s_repeats, ".1f")

    @property
    def speedup_range(self) -> str:
        """min–max of the ratio to ar over the repeats ("" with a single repeat)."""
        return spread_text(self.speedup_repeats, ".2f")

    @property
    def decoded_as_ar(self) -> bool:
        """Drafted nothing and produced ar's tokens: it decoded as ar did, so its speed against ar is the
        machine's noise, not a speed-up."""
        return self.mode != "ar" and self.draft_len == 0 and self.identical_to_ar == 1.0

    @property
    def within_noise(self) -> bool:
        """Its speed cannot be told from ar's: it decoded as ar did, or its range against ar includes 1."""
        if self.decoded_as_ar:
            return True
        return self.speedup_interval is not None and self.speedup_interval[0] <= 1.0 <= self.speedup_interval[1]

    @property
    def speedup_text(self) -> str:
        """× ar as a table shows it: marked with ≈ where it is within the noise of ar's speed."""
        if self.speedup_vs_ar is None:
            return "–"
        return f"{self.speedup_vs_ar:.2f}" + ("≈" if self.mode != "ar" and self.within_noise else "")

    @property
    def lossless_ok(self) -> bool:
        """Every divergence from ar (if any) happened at a numerical near-tie."""
        if self.identical_to_ar is None:
            return True
        return round((1.0 - self.identical_to_ar) * self.n_prompts) <= self.near_tie_divergences


def judgements(
    rows: list[BenchRow], load: dict[str, Any] | None = None, load_by_budget: dict[str, dict[str, Any]] | None = None
) -> list[tuple[str, Judgement]]:
    """The rows' speeds judged against ar's (speed.judge): (budget, judgement) for each budget that has an ar
    row with its runs and another to compare with; `load`: what else used the CPUs meanwhile (speed.Load as a
    dict), by budget where each ran in a process of its own."""
    out = []
    for budget in dict.fromkeys(r.budget for r in rows):
        runs = {r.mode: r.run_tok_per_s for r in rows if r.budget == budget and r.run_tok_per_s}
        if "ar" in runs and len(runs) > 1:
            out.append((budget, judge(runs, "ar", Load.from_dict((load_by_budget or {}).get(budget, load)))))
    return out


def spread_text(values: list[float] | None, spec: str) -> str:
    if not values or len(values) < 2:
        return ""
    return f"{format(min(values), spec)}–{format(max(values), spec)}"


@dataclass
class BenchDone:
    rows: list[BenchRow]
    quality: dict[str, Any]
    cost_model: dict[str, Any]
    machine: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    # the verification cost model fitted in each budgeted child run, by budget label
    cost_model_by_budget: dict[str, dict[str, Any]] = field(default_factory=dict)
    # what gating toward the experts in memory cost in each budgeted child run (memory_gating_quality)
    memory_quality_by_budget: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "results": [asdict(r) for r in self.rows],
            "quality": self.quality,
            "cost_model": self.cost_model,
            "cost_model_by_budget": self.cost_model_by_budget,
            "memory_quality_by_budget": self.memory_quality_by_budget,
            "machine": self.machine,
            "config": self.config,
        }


def reference_row(
    result: dict[str, Any], budget: str, ar: BenchRow | None, prompt_set: str, n_prompts: int
) -> BenchRow:
    """The bench row of llama.cpp's own plain decoding (s2moe.engine.measure.reference.plain_decoding's result). Where
    ar decoded by the argmax too (its row holds its tokens), the share of prompts on which llama.cpp's tokens are
    ar's: all of them, or our ar is not llama.cpp's decoding."""
    tps = result["tok_per_s"]
    same = None
    if ar is not None and ar.tokens is not None:
        same = float(np.mean([list(a) == list(b) for a, b in zip(ar.tokens, result["tokens"])]))
    return BenchRow(
        mode="llama.cpp",
        budget=budget,
        prompt_set=prompt_set,
        n_prompts=n_prompts,
        n_tokens=result["n_tokens"],
        seconds=result["seconds"],
        tok_per_s=tps,
        speedup_vs_ar=tps / ar.tok_per_s if ar is not None and ar.tok_per_s > 0 else None,
        accept_len=1.0,
        draft_len=0.0,
        acceptance_rate=0.0,
        reuse_ratio=None,
        reuse_ratio_per_layer=None,
        verify_experts=None,
        effective_verify_cost=None,
        rollbacks=0,
        t_draft=0.0,
        t_verify=result["seconds"],
        identical_to_ar=same,
        identical_expected=same is not None,
    )


def storage_bound(rows: list[BenchRow], expert_bytes: float, bandwidth: dict[str, float]) -> None:
    """Fill each offloaded row's physical bound: the speed at which storage at its budget's `bandwidth`
    (budget label → bytes/s) delivers the experts the mode fetched per token, plus the compute the same mode
    spends per token fully resident where this run measured it (a row with budget "none")."""
    resident = {r.mode: r.seconds / r.n_tokens for r in rows if r.budget == "none" and r.n_tokens}
    for r in rows:
        rate = bandwidth.get(r.budget, 0.0)
        if r.fetched_per_token is None or rate <= 0:
            continue
        per_token = r.fetched_per_token * expert_bytes / rate + resident.get(r.mode, 0.0)
        r.bound_tok_per_s = 1.0 / per_token if per_token > 0 else None


# What a verification batch held, for its bound: a plain step (no draft: its experts known a layer ahead at
# most), copied tokens (no draft pass, so no prediction of the batch's experts), or self-drafted tokens (their
# draft passes predicted the union, fetched while they ran).
VERIFY_KINDS = ("plain", "copy", "draft")


def verification_kind(it: Iteration) -> str:
    if not it.drafted:
        return "plain"
    return "copy" if it.draft_decision is not None and it.draft_decision.copied else "draft"


def verification_bound_ratio(
    cost_model: dict[str, Any],
    resident_cost: Callable[[float, int], float],
    expert_bytes: float,
    bandwidth: float,
    kind: str | None = None,
) -> float | None:
    """How many times their bound a budget's verifications took (cost_model: the run's fit with its
    miss-aware form): measured seconds over the seconds they would take with every fetched expert read at
    `bandwidth` (bytes/s) and everything else as with the model in memory, resident_cost(experts, rows)
    (a resident fit: the profile's, or this run's). kind: only the verifications of that kind
    (VERIFY_KINDS). None without the per-verification counts, or without a verification of that kind."""
    f = cost_model.get("miss_aware") or {}
    e, m, t = (np.asarray(f.get(k) or [], float) for k in ("experts", "fetched", "tokens"))
    measured = np.asarray(cost_model.get("measured_s") or [], float)
    if not len(m) or len(measured) != len(m) or bandwidth <= 0:
        return None
    if kind is not None:
        kinds = np.asarray(f.get("kinds") or [])
        if len(kinds) != len(m):
            return None
        chosen = kinds == kind
        if not chosen.any():
            return None
        e, m, t, measured = e[chosen], m[chosen], t[chosen], measured[chosen]
    bound = sum(resident_cost(float(x), int(n)) for x, n in zip(e, t)) + float(m.sum()) * expert_bytes / bandwidth
    return float(measured.sum() / bound) if bound > 0 else None
