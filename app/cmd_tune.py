"""`s2moe tune`: search the decoding settings that are fastest on this device, model, budget and workload
within the gating quality constraint, and record them in the device profile (engine/measure/tune.py)."""

from __future__ import annotations

import argparse
import sys

from .bench_report import check_words


def _minutes(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of minutes, got {text}") from None
    if not 0 < v <= 24 * 60:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1440 minutes, got {text}")
    return v


def add_parser(sub) -> None:
    from .options import add_batch_option, budget_text, nonempty, positive_int

    p = sub.add_parser(
        "tune",
        help="search k_d, the draft cap, the threshold, α, |E*|, copies from the context and "
        "(under --budget) α_m for this device and model; record the fastest in the "
        "profile",
    )
    p.add_argument("--model", "-m", type=nonempty, help="GGUF MoE model (default: the shipped model)")
    p.add_argument(
        "--budget",
        type=budget_text,
        help="memory budget, e.g. 800M or 2G, or auto (as generate --budget): tune the model offloaded "
        "under it; recorded apart from the resident tuning",
    )
    p.add_argument(
        "--prompts",
        type=nonempty,
        default="humaneval",
        help='the workload: humaneval (default), natural or a JSONL file with a "prompt" field',
    )
    p.add_argument(
        "--profile",
        type=nonempty,
        default=None,
        help="the profile to record the result in (default: local); it must hold this model's "
        "constants (s2moe calibrate)",
    )
    p.add_argument(
        "--time-budget",
        type=_minutes,
        default=10.0,
        metavar="MIN",
        help="minutes the search may take, start-up excluded (default 10)",
    )
    p.add_argument("-n", "--n-tokens", type=positive_int, default=48, help="tokens generated per run (default 48)")
    p.add_argument("--n-prompts", type=positive_int, default=32, help="prompts to draw from the set (default 32)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads (default: all available)")
    add_batch_option(p)
    p.add_argument(
        "--copy-cache",
        metavar="FILE|DIR",
        type=nonempty,
        help="s2moe: also copy drafts from the generations kept there (as generate --copy-cache and the "
        "app do), so that copies are measured as your sessions get them; read only: tune adds "
        "nothing to it",
    )
    p.add_argument("--seed", type=positive_int, default=1, help="seed of the random candidates (default 1)")
    p.add_argument("--no-save", action="store_true", help="search and print, write nothing")
    p.set_defaults(run=run)


def settings_text(s: dict, memory_shown: bool = False) -> str:
    """The settings `s2moe tune` searches, in words; memory_shown: with the strength toward the experts in
    memory (where it acts: under a budget, with gating on)."""
    gating = f"α {s['reuse_strength']:g}, |E*| {s['reuse_cap']}" if s["reuse_strength"] > 0 else "gating off"
    memory = (
        f", memory α {s['memory_strength']:g}"
        if memory_shown and s["reuse_strength"] > 0 and s.get("memory_strength") is not None
        else ""
    )
    copies = ", copies off" if s.get("lookup") is False else ""
    return f"k_d {s['draft_topk']}, draft cap {s['draft_max']}, threshold {s['threshold']:g}, {gating}{memory}{copies}"


def summary_lines(section: dict, path) -> list[str]:
    """What a tuning run found, in the words the profile records it."""
    sp, q, search = section["speed"], section["quality"], section["search"]
    budgeted = (section.get("measured") or {}).get("budget") not in (None, "none")

    ar = f" · ar {sp['ar_tok_s']:.2f} tok/s" if sp.get("ar_tok_s") else ""
    quality = (
        "lossless (no gating)"
        if q.get("lossless")
        else f"{check_words(q, kl=False)} over {q['tokens']} tokens (teacher-forced)"
    )
    ratios = sp.get("per_prompt_ratios") or []
    spread = f", per-prompt ratios {min(ratios):.3f}–{max(ratios):.3f}" if ratios else ""
    checks_s = search.get("quality_checks_s")  # recorded since the checks could take most of the time
    checks = "" if checks_s is None else f", {checks_s:.0f} s of it the quality checks"
    lines = [
        f"defaults: {settings_text(section['defaults'], budgeted)} → {sp['defaults_tok_s']:.2f} tok/s",
        f"tuned:    {settings_text(section['settings'], budgeted)} → {sp['tuned_tok_s']:.2f} tok/s"
        + (f" ({sp['gain']:.3f}× the defaults{spread})" if sp.get("gain") else "")
        + ar,
        f"verdict: {sp['verdict']}",
        *(f"against plain decoding: {line}" for line in sp.get("versus_ar") or []),
        *([f"warning: {sp['warning']}"] if sp.get("warning") else []),
        f"quality: {quality}",
        *([f"quality in memory: {memory_quality_words(q['memory'])}"] if q.get("memory") else []),
        *([f"quality of both biases: {both_quality_words(q['both'])}"] if q.get("both") else []),
        f"search: {search['method']} from {search['candidates']} of {search['pool']} candidates "
        f"({search['feasible']} within the quality constraint), {search['rungs']} rungs, {search['runs']} runs, "
        f"{search['seconds']:.0f} s of {search['time_budget_s']:.0f} s" + checks,
    ]
    if search.get("unchecked") and search.get("stopped_checking") == "time":
        lines.append(
            f"{search['unchecked']} of {search['pool']} candidates were not run: the quality checks had used "
            "their share of the time budget before reaching them. A longer time budget checks more (checks "
            "of reuse gating alone are kept in the profile for later runs; those under a budget are made "
            "anew each run)"
        )
    lines.append(f"profile written: {path}" if path else "not saved (--no-save)")
    return lines


def quality_check_text(ev) -> str:
    """One quality check of the search (TuneQuality, TuneMemoryQuality or TuneJointQuality), in a line."""
    from ..engine.measure.tune import TuneJointQuality, TuneQuality

    if isinstance(ev, TuneQuality):
        what, reused = f"quality α {ev.reuse_strength:g} |E*| {ev.reuse_cap}", ev.reused
    elif isinstance(ev, TuneJointQuality):  # as the memory checks, never reused
        what = f"quality of both, α {ev.reuse_strength:g} |E*| {ev.reuse_cap} α_m {ev.memory_strength:g}"
        reused = False
    else:  # memory checks are never reused: they depend on the device and the budget
        what, reused = f"quality in memory α_m {ev.memory_strength:g}", False
    verdict = ("ok" if ev.ok else "✖ fails the constraint") + (" (an earlier run's)" if reused else "")
    # the tokens say how much text settled it: twice the first texts' where those could not
    return f"{what}: {check_words(ev.figures, kl=False)} over {ev.figures.tokens} tokens: {verdict}"


def memory_quality_words(m: dict) -> str:
    return (
        f"α_m {m['memory_strength']:g}: {check_words(m, kl=False)} over {m['tokens']} tokens "
        "(teacher-forced, one a step under the budget)"
    )


def both_quality_words(m: dict) -> str:
    return (
        f"α_m {m['memory_strength']:g} with reuse gating: {check_words(m, kl=False)} over "
        f"{m['tokens']} tokens (teacher-forced, batches under the budget)"
    )


def earlier_quality(profile: dict, fingerprint: str, prompt_set: str) -> list[dict]:
    """The quality checks an earlier tuning of this model on the same prompt set recorded (either
    condition: the teacher-forced figures depend on neither device nor budget)."""
    from ..engine.profiles import model_block

    out = []
    for section in ((model_block(profile, fingerprint) or {}).get("tuned") or {}).values():
        if isinstance(section, dict) and (section.get("measured") or {}).get("prompts") == prompt_set:
            out += [e for e in section.get("quality_checked") or [] if isinstance(e, dict)]
    return out


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..engine import offload
    from ..engine.decoding.decoder import Decoder
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.decoding.runtime_settings import check_threads
    from ..engine.errors import ConfigError, held_signals
    from ..engine.measure.calibrate import DEFAULT_NAME
    from ..engine.measure.device import default_threads
    from ..engine.measure.prompts import load_prompts
    from ..engine.measure.tune import (
        TuneDone,
        TuneJointQuality,
        TuneMeasured,
        TuneMemoryQuality,
        TuneProgress,
        TuneQuality,
        TuneStarted,
        run_tune,
    )
    from ..engine.model_info import read_model_info
    from ..engine.profiles import (
        check_name,
        check_writable,
        cost_for_model,
        hot_experts_for_model,
        load_profile,
        model_block,
        save_profile,
        with_tuned,
    )
    from .model_runs import default_model, run_cli_in_budget

    model = args.model if args.model is not None else default_model()
    check_threads(args.threads)
    name = check_name(args.profile or DEFAULT_NAME)
    set_name, prompts = load_prompts(args.prompts, args.n_prompts)
    info = read_model_info(model)
    GenerationConfig(mode="s2moe").validate(info)  # a model nothing can draft on is refused before any work
    profile = load_profile(name)
    if model_block(profile, info.fingerprint) is None:
        raise ConfigError(
            f"profile {name} has no constants for {info.path.name} ({info.fingerprint}): run "
            f"`s2moe calibrate --model {model} --name {name}` first"
        )
    if not args.no_save:
        check_writable(name)
    budget = offload.Budget.parse(args.budget) if args.budget is not None else None
    if budget is not None and offload.current_budget() is None:
        return run_cli_in_budget(args._argv, budget, model, tag="tune")
    offloaded = budget is not None
    cost = cost_for_model(profile, info.fingerprint, info.path.name, offloaded=offloaded)
    console = Console(stderr=True, highlight=False)
    from .model_runs import cpu_buffers_for

    cpu = cpu_buffers_for(model, not offloaded)
    decoder = Decoder(model, n_threads=args.threads, max_draft=16, use_extra_bufts=cpu.extra, n_batch=args.batch_size)
    off = None
    try:
        kept = 0
        if args.copy_cache is not None:
            from ..engine.drafting.copycache import load_copy_cache

            kept = load_copy_cache(args.copy_cache, decoder.info, decoder.earlier, write_back=False)
        label = "none"
        if offloaded:

            def warm_up():  # the largest verification batch the search can ask for, so that auto counts it
                for cfg in (
                    GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False),
                    GenerationConfig(
                        mode="s2moe", utility=False, draft_max=16, n_predict=8, stop_at_eos=False, cost=cost
                    ),
                ):
                    for _ in decoder.generate(prompts[0], cfg):
                        pass

            off = offload.offload_decoder(
                decoder, budget, hot_experts_for_model(profile, info.fingerprint), warm_up=warm_up
            )
            label = budget.describe(off.budget_bytes)
        console.print(
            f"tuning {info.path.name} on {set_name} prompts, budget {label}, for at most "
            f"{args.time_budget:g} min; the result goes to profile {name}"
        )
        if args.copy_cache is not None:
            console.print(
                f"s2moe also copies from the {kept} earlier generation{'s' * (kept != 1)} kept in {args.copy_cache}"
            )
        context = {
            "budget": label,
            "budget_bytes": off.budget_bytes if off else None,
            "prompts": set_name,
            "threads": args.threads or default_threads(),
            **({"copy_cache_generations": kept} if args.copy_cache is not None else {}),
        }
        done = None
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task("warming up", total=None)
            for ev in run_tune(
                decoder,
                prompts,
                cost=cost,
                n_tokens=args.n_tokens,
                time_budget_s=args.time_budget * 60,
                seed=args.seed,
                context=context,
                known_quality=earlier_quality(profile, info.fingerprint, set_name),
            ):
                if isinstance(ev, TuneStarted):
                    progress.console.print(f"{ev.candidates} candidates; defaults {ev.defaults.label(offloaded)}")
                elif isinstance(ev, (TuneQuality, TuneMemoryQuality, TuneJointQuality)):
                    progress.console.print(quality_check_text(ev))
                elif isinstance(ev, TuneProgress):
                    progress.update(task, description=ev.phase, completed=ev.done, total=ev.total)
                elif isinstance(ev, TuneMeasured):
                    where = "final" if ev.rung < 0 else f"rung {ev.rung + 1}"
                    progress.console.print(
                        f"  {where}: {ev.settings.label(offloaded)}: {ev.tok_per_s:.2f} tok/s "
                        f"over {ev.n_prompts} prompt{'s' if ev.n_prompts > 1 else ''}"
                    )
                elif isinstance(ev, TuneDone):
                    done = ev
    finally:
        if off is not None:
            off.close()
        decoder.close()
    if done is None:
        print("tuning stopped: nothing written", file=sys.stderr)
        return 1
    path = None
    try:
        if not args.no_save:
            profile = with_tuned(load_profile(name), info.fingerprint, done.section, offloaded=offloaded)
            # a signal during the write waits for its end, so that `path` says whether the profile was written
            with held_signals():
                path = save_profile(profile, name)
        for line in summary_lines(done.section, path):
            print(line)
    except KeyboardInterrupt:
        print(f"profile written: {path}" if path else f"profile {name} left as it was", file=sys.stderr)
        raise
    return 0
