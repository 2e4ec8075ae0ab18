"""The benchmark harness: every mode on the same prompts, interleaved, in one process.

Modes run one after another *per prompt* (ar, naive, …, s2moe for prompt 1, then again for prompt 2)
so that slow drifts of a shared machine hit all modes alike. Speed-ups are ratios within the run. A warm-up
pass runs every mode once before anything is timed, and repeats go over the whole prompt set again (still
interleaved), so that each mode's speed and its ratio to ar come with the spread across repeats.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig
from ..decoding.sampling import MAX_SEED
from ..errors import ConfigError
from ..events import Iteration, Summary, Totals
from ..modes import CHAIN_DRAFT_MODES, DRAFT_EXPERTS, LOSSLESS_MODES, MODES, TREE_MODES
from .bench_results import BenchDone, BenchProgress, BenchRow, BenchTrace, verification_kind
from .cost_fits import drift_tracked_fit, fault_explained_fit, fit_miss_cost, fit_verify_cost
from .quality_checks import MEMORY_CHECK_TOKENS, gating_quality, memory_gating_quality, near_tie
from .speed import MIN_PAIRS, LoadWatch, compare

# The paper's progressive ladder: independent-context draft → shared KV → adaptive expansion → gating; then
# drafts copied from the context where the rule says they pay, and the last rung, s2moe's defaults, copies from
# the session's earlier generations of other prompts where they match longer than the context.
ABLATION: dict[str, dict[str, Any]] = {
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
        raise ConfigError(
            f"unknown mode {name!r}: a mode that drafts from the model's own experts "
            f"({', '.join(SELF_DRAFTING)} and the ladder's shared-KV rungs) takes "
            f"{' or '.join(':' + d for d in DRAFT_EXPERTS)}"
        )
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
    return (
        stem in LOSSLESS_MODES or stem in LOSSLESS_LADDER or (cfg.mode in ("s2moe", "tree") and cfg.reuse_strength == 0)
    )


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The seed every mode samples prompt `prompt_index` with, in every repeat: modes that draw alike decode
    alike (a mode that drafts nothing decodes exactly as ar), so their speeds compare the same work."""
    return (seed + prompt_index) % (MAX_SEED + 1)


def machine_info(n_threads: int | None) -> dict[str, Any]:
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


# -- the harness ------------------------------------------------------------------------------------
WARMUP_TOKENS = 8


def sampling_record(cfg: GenerationConfig, n_prompts: int) -> dict[str, Any]:
    """The sampler settings a bench ran with, for its report: with a temperature, the seed of each prompt."""
    out = {
        key: getattr(cfg, key)
        for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
    }
    if not cfg.sampling().greedy:
        out["prompt_seeds"] = [prompt_seed(cfg.seed, i) for i in range(n_prompts)]
    return out


def warm_up(decoder: Decoder, base: GenerationConfig, prompt: str, modes: Iterable[str]) -> Iterator[str]:
    """Run every mode briefly, untimed: start-up cost measurement, the naive drafter's second context, every
    graph shape and the first touch of the weights happen here rather than in whichever mode is timed first.
    Yields each mode as it starts."""
    for mode in modes:
        yield mode
        for _ in decoder.generate(prompt, replace(mode_config(mode, base), n_predict=WARMUP_TOKENS, stop_at_eos=False)):
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
) -> Iterator[BenchProgress | BenchTrace | BenchDone]:
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
    assert base.draft_max is not None  # resolved() fills it from the model's routing defaults
    configs = {name: mode_config(name, base) for name in modes}
    for cfg in configs.values():
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
                            cost_samples.append(
                                (
                                    float(ev.verify_experts.sum()),
                                    ev.verify_tokens,
                                    ev.t_verify,
                                    misses,
                                    ev.verify_major_faults,
                                    verification_kind(ev),
                                )
                            )
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
                        runs.near_ties += near_tie(
                            dec,
                            prompt,
                            reference,
                            tokens_of[(name, pi)],
                            replace(base, seed=prompt_seed(base.seed, pi)),
                        )
            load = watch.stop()  # the timed runs are over: what the checks below take is not theirs
            rows = []
            ar_repeats = per["ar"].repeat_tok_per_s
            for name in modes:
                runs = per[name]
                totals = runs.totals
                reuse_layers = totals.reuse_per_layer
                tps = runs.repeat_tok_per_s
                ratios = [t / a for t, a in zip(tps, ar_repeats) if a > 0]
                versus_ar = compare(
                    name, "ar", [t / a for t, a in zip(runs.run_tok_per_s, per["ar"].run_tok_per_s) if a > 0]
                )
                rows.append(
                    BenchRow(
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
                        fetched_per_token=(
                            (totals.experts_fetched + totals.draft_fetched) / runs.n_tokens
                            if totals.offloaded_steps and runs.n_tokens
                            else None
                        ),
                        identical_expected=expected_lossless(name, configs[name]) and name != "ar",
                        tok_per_s_repeats=[float(t) for t in tps],
                        speedup_repeats=[float(x) for x in ratios] if len(ratios) == len(tps) else None,
                        run_tok_per_s=[float(t) for t in runs.run_tok_per_s],
                        speedup_interval=[versus_ar.low, versus_ar.high]
                        if name != "ar" and versus_ar.n >= MIN_PAIRS
                        else None,
                        draft_experts=dec.draft_experts(configs[name]) if configs[name].mode in SELF_DRAFTING else None,
                        tokens=[list(tokens_of[("ar", pi)]) for pi in range(len(prompts))]
                        if name == "ar" and configs[name].sampling(dec.n_ctx).argmax_of_logits
                        else None,
                    )
                )
            quality: dict[str, Any] = {}
            if dec.info.is_moe and quality_texts and dec.knows_memory:
                # under a budget: what a batch's gating costs is the same as without one (measured there), what
                # moving choices onto the experts in memory costs is measured only here
                memory = base.memory_strength or GenerationConfig.memory_strength
                quality = memory_gating_quality(dec, quality_texts, memory)
                if quality.get("tokens") and base.reuse_strength > 0:
                    # a drafted batch's verification meets both biases: checked together, on the same text
                    quality["batches"] = gating_quality(
                        dec,
                        quality_texts,
                        base.reuse_strength,
                        base.reuse_cap,
                        window=base.draft_max + 1,
                        max_tokens=MEMORY_CHECK_TOKENS,
                        memory=memory,
                    )
            elif dec.info.is_moe and quality_texts:
                quality = gating_quality(
                    dec, quality_texts, base.reuse_strength or 0.5, base.reuse_cap, window=base.draft_max + 1
                )
            cost_model: dict[str, Any] = {}
            # a fit needs verifications of different sizes: with plain steps only (nothing drafted) the
            # token count never varies and the regression would report a meaningless R² of 0
            if len(cost_samples) >= 3 and len({smp[1] for smp in cost_samples}) >= 2:
                fit = fit_verify_cost(*list(zip(*cost_samples))[:3])
                measured = [s[2] for s in cost_samples]
                predicted = [float(x) for x in fit.predict([s[0] for s in cost_samples], [s[1] for s in cost_samples])]
                cost_model = {
                    "intercept_s": fit.intercept,
                    "t_exp_s": fit.t_exp,
                    "t_tok_s": fit.t_tok,
                    "r2": fit.r2,
                    "r2_ceiling": fit.r2_ceiling,
                    "mape": fit.mape,
                    "n": fit.n,
                    "measured_s": measured[:2000],
                    "predicted_s": predicted[:2000],
                }
                startup = dec.measured_cost_constants(base.draft_topk, base.draft_max)
                if startup is not None:
                    pred0 = np.array([startup.verify_cost(s[0], s[1]) for s in cost_samples])
                    y = np.array(measured)
                    cost_model["startup_constants_mape"] = float(np.mean(np.abs(y - pred0) / np.maximum(y, 1e-12)))
                if all(smp[3] is not None for smp in cost_samples) and len(cost_samples) >= 4:
                    # offloaded: what a verification costs depends on how many of its experts had to be fetched
                    e, t, y, m = (np.array(v, float) for v in list(zip(*cost_samples))[:4])
                    mfit = fit_miss_cost(e, m, t, y)
                    cost_model["miss_aware"] = {
                        "intercept_s": mfit.intercept,
                        "t_exp_warm_s": mfit.t_hit,
                        "t_exp_cold_s": mfit.t_miss,
                        "t_tok_s": mfit.t_tok,
                        "r2": mfit.r2,
                        "r2_ceiling": mfit.r2_ceiling,
                        "mape": mfit.mape,
                        "n": mfit.n,
                        "miss_share": float(m.sum() / max(1.0, e.sum())),
                        "predicted_s": [float(x) for x in mfit.predict(e, m, t)][:2000],
                        "experts": e.tolist()[:2000],
                        "fetched": m.tolist()[:2000],
                        "tokens": t.tolist()[:2000],
                        "kinds": [smp[5] for smp in cost_samples][:2000],
                        "disk_tracked": drift_tracked_fit(mfit, e, m, t, y),
                    }
                    if all(smp[4] is not None for smp in cost_samples):
                        faults = np.array([smp[4] for smp in cost_samples], float)
                        cost_model["miss_aware"]["given_faults"] = fault_explained_fit(e, faults, t, y)
            yield BenchDone(
                rows,
                quality,
                cost_model,
                machine_info(n_threads),
                config={
                    "model": str(dec.info.path),
                    "n_tokens": n_tokens,
                    "modes": list(modes),
                    "budget": budget,
                    "prompt_set": prompt_set,
                    "n_prompts": len(prompts),
                    "greedy": base.sampling().greedy,
                    **sampling_record(base, len(prompts)),
                    "draft_topk": base.draft_topk,
                    "draft_max": base.draft_max,
                    "reuse_strength": base.reuse_strength,
                    "repeats": repeats,
                    "warmup": warmup,
                    "draft_experts": dec.draft_experts(base),
                    "load": load.as_dict(),
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
            )
        finally:
            if own_decoder:
                dec.close()


def measure_hook_overhead(
    model: str, prompt: str, n_tokens: int = 64, rounds: int = 5, n_threads: int | None = None, n_ctx: int = 2048
) -> dict[str, Any]:
    """Plain decoding through our engine (routing hook observing every layer) vs llama-cpp-python's own
    greedy completion of the same model and prompt, in interleaved rounds. Returns tok/s and the ratio."""
    import llama_cpp

    dec = Decoder(model, n_ctx=n_ctx, n_threads=n_threads)
    # Any: llama_cpp leaves reset() untyped and types create_completion's result as a union with its stream form
    ref: Any = llama_cpp.Llama(
        model_path=model, n_ctx=n_ctx, n_threads=n_threads or None, n_threads_batch=n_threads or None, verbose=False
    )
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
    return {
        "engine_ar_tok_per_s": float(np.median(ours)),
        "llama_cpp_python_tok_per_s": float(np.median(theirs)),
        "ratio_median": float(np.median(ratios)),
        "ratios": [float(x) for x in ratios],
        "rounds": rounds,
        "n_tokens": n_tokens,
        "threads": n_threads,
    }
