"""Teacher-forced checks of what our arithmetic does to the model's own scores: whether a mode that left ar's
tokens did so at a near-tie that any two ways of computing the logits could decide (near_tie), and what gating
costs in quality (gating_quality, memory_gating_quality: perplexity ratio, top-1 agreement and KL, with their
standard errors).

bench reports them beside its speeds and tune holds every candidate setting to them; they time nothing, so they
live apart from the harness that does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig, default_reuse_cap
from ..decoding.runtime import LlamaRuntime
from ..decoding.sampling import PositionNoise

NEAR_TIE = 1e-3  # a score gap under which any two ways of computing the logits may pick differently


def logits_of(rt: LlamaRuntime, tokens: list[int], pos: int, outputs: Literal["last", "all"]) -> npt.NDArray[Any]:
    """rt.decode's logits, for a batch of at least one token that asks for them ('last' or 'all')."""
    return rt.decode(tokens, pos, outputs)


def near_tie(
    dec: Decoder, prompt: str | list[int], reference: Sequence[int], other: Sequence[int], cfg: GenerationConfig
) -> bool:
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
    batched = logits_of(rt, history[-tail:], len(history) - tail, "last")[0]
    rt.kv_clear()
    head = len(prompt_tokens) - 1
    rt.prefill(history[:head])
    for i in range(head, len(history)):
        stepwise = logits_of(rt, [history[i]], i, "last")[0]
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


def log_softmax(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Log-probabilities of each row of logits (the last axis), in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


def batch_means_se(values: npt.ArrayLike, n_batches: int = ERROR_BATCHES) -> float | None:
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


def _error_bars(agreements: list[bool], log_ratios: list[float]) -> dict[str, float | None]:
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
    def of(cls, q: dict[str, Any]) -> CheckFigures:
        tokens = int(q.get("tokens") or 0)
        if not tokens:
            return cls(0)
        return cls(
            tokens, q.get("ppl_ratio"), q.get("top1_agreement"), q.get("mean_kl"), *(q.get(k) for k in ERROR_KEYS)
        )


def gating_quality(
    dec: Decoder,
    texts: list[str],
    alpha: float,
    cap: int | None,
    window: int = 9,
    max_tokens: int = 512,
    memory: float = 0.0,
) -> dict[str, Any]:
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
    hook = rt.hook
    assert hook is not None  # its callers check MoE models only, which all have the routing hook
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
        hook.off()
        rt.decode(tokens[:1], 0, "none")
        pos = 1
        while pos + window < len(tokens):
            batch = tokens[pos : pos + window]
            targets = tokens[pos + 1 : pos + window + 1]
            hook.gate(alpha, cap, np.ones(window), memory=memory)
            gated = logits_of(rt, batch, pos, "all")
            rg = hook.snapshot(window)
            rt.kv_remove_from(pos)
            hook.observe()
            plain = logits_of(rt, batch, pos, "all")
            rp = hook.snapshot(window)
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


def memory_gating_quality(
    dec: Decoder, texts: list[str], alpha: float, max_tokens: int = MEMORY_CHECK_TOKENS
) -> dict[str, Any]:
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
    hook = rt.hook
    assert hook is not None  # knows_memory: a prefetcher is routed to the hook
    k = dec.info.n_expert_used

    def step(token: int, pos: int, gated: bool) -> np.ndarray:
        if gated:
            hook.gate(0.0, k, [1.0], memory=alpha)
        else:
            hook.observe()
        return log_softmax(logits_of(rt, [token], pos, "last")[0])

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
    hook.observe()
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
