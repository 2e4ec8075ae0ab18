"""`s2moe bench`: compare modes on a prompt set; print a table, write JSON/markdown reports."""

from __future__ import annotations

import json
import os
import sys

from ..engine.errors import ConfigError
from .bench_budgets import budget_rows, record_storage_in_traces, run_reference_row, write_prompt_trace
from .bench_report import (
    batch_line,
    footnotes,
    gating_quality_text,
    markdown,
    memory_quality_text,
    offloaded_fit_clauses,
    sampled_note,
    storage_line,
    tables,
)
from .bench_storage import read_storage, resident_verify_cost, storage_record

DEFAULT_MODES = "ar,naive,conf,cascade,lookup,s2moe"


def add_parser(sub) -> None:
    from .options import (
        add_batch_option,
        add_draft_experts_option,
        add_memory_strength_option,
        add_placement_options,
        add_pregate_option,
        add_sampling_options,
        add_tree_shape_options,
        nonempty,
        positive_int,
    )

    p = sub.add_parser("bench", help="benchmark S²-MoE against plain decoding and the baselines")
    p.add_argument("--model", "-m", type=nonempty, help="GGUF model (default: the shipped model)")
    p.add_argument("--prompts", default="humaneval", help='humaneval | natural | a JSONL file with a "prompt" field')
    p.add_argument("--n-prompts", type=int, default=8, help="prompts to use from the set (default 8)")
    p.add_argument("-n", "--n-tokens", type=int, default=64, help="tokens generated per prompt and mode")
    p.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated modes or ladder rungs (default {DEFAULT_MODES}), or s2moe less one part: "
        "-gating (gating off, on ar's tokens), -memory (no bias toward the experts in memory), "
        "-periodic (copies stop at the context's end); a mode that drafts from "
        "the model's own experts takes :resident or :router (what its drafts read under --budget), "
        "so that both run interleaved: s2moe,s2moe:resident",
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="run the ladder: base (independent draft) → +shared-kv → +utility → +gating → "
        "+lookup → +session (= s2moe)",
    )
    p.add_argument("--budget", default="none", help="memory budget(s): none (default), auto or SIZE[,SIZE…]")
    p.add_argument("--profile", type=nonempty, help="device profile for the cost constants (else measured at start-up)")
    p.add_argument(
        "--draft-topk",
        type=int,
        default=None,
        help="experts per token in draft passes, k_d (default: a quarter of the model's, at least 1)",
    )
    # None: not given, the profile's tuned value (s2moe tune), else the default
    p.add_argument("--draft-max", type=int, default=None, help="cap on draft length (default 8)")
    p.add_argument("--reuse-strength", type=float, default=None, help="reuse-aware gating strength α (default 0.5)")
    add_memory_strength_option(p)
    p.add_argument(
        "--threshold", type=float, default=None, help="utility threshold of s2moe and the tree modes (default 1)"
    )
    p.add_argument(
        "--no-utility",
        action="store_true",
        help="s2moe and the tree modes without the utility rule: the chain drafts to --draft-max, a tree "
        "takes the fixed shape of --tree-width nodes per depth",
    )
    p.add_argument("-t", "--threads", type=int, default=None)
    # every mode samples a prompt with the same seed (-s, plus the prompt's index): modes that draw alike decode
    # alike, so a mode that drafted nothing is still seen to have decoded as ar did
    add_sampling_options(p)
    add_draft_experts_option(p)
    add_tree_shape_options(p)
    add_batch_option(p)
    add_placement_options(p)
    add_pregate_option(p)
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="times the whole prompt set is run, modes interleaved throughout; tok/s and × ar are the "
        "medians and the table shows their range (default 1)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed warm-up generation of every mode before the measured ones",
    )
    p.add_argument("--no-quality", action="store_true", help="skip the teacher-forced gating quality check")
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the reference row: llama.cpp's own plain decoding of the same prompts and budget",
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the results as JSON")
    p.add_argument(
        "--trace",
        metavar="DIR",
        type=nonempty,
        help="also record a decoding trace per prompt and budget into DIR (for `s2moe project`; untimed)",
    )
    p.add_argument("--md", dest="md_out", metavar="OUT", help="write a markdown report with plots")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="instead: measure the routing hook's overhead against llama-cpp-python's own decoding",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --overhead")
    p.set_defaults(run=run)


def _modes(args) -> list[str]:
    if args.ablation:
        return ["ar", "base", "+shared-kv", "+utility", "+gating", "+lookup", "+session"]
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.measure.bench import mode_config

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        try:
            mode_config(m, GenerationConfig())
        except ConfigError as e:
            raise ConfigError(f"--modes: {e}") from None
    if not modes:
        raise ConfigError("--modes: give at least one mode")
    return modes


class _ChangedLine:
    """A progress line on stderr, said when its key changes (a prompt, a repeat, a budget)."""

    def __init__(self):
        self.last = None

    def say(self, key, line: str) -> None:
        if key != self.last:
            print(line, file=sys.stderr, flush=True)
            self.last = key


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..engine.decoding.cpu_buffers import REASONS
    from ..engine.decoding.decoder import Decoder
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.files import write_atomic
    from ..engine.measure.bench import measure_hook_overhead, run_bench, warm_up
    from ..engine.measure.bench_results import (
        VERIFY_KINDS,
        BenchDone,
        BenchProgress,
        BenchTrace,
        storage_bound,
        verification_bound_ratio,
    )
    from ..engine.measure.prompts import load_prompts
    from .model_runs import default_model
    from .options import check_pregate, placement_from_args, pregate_pinning

    model = args.model or default_model()
    console = Console(stderr=True)
    if args.n_tokens < 1 or args.n_prompts < 1:
        raise ConfigError("-n and --n-prompts must be at least 1")
    check_pregate(args)
    placement = placement_from_args(args)
    if args.trace is not None:
        from pathlib import Path

        try:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot make trace folder {args.trace}: {e.strerror}") from None
    if args.overhead:
        from .model_runs import cpu_buffers_for

        cpu = cpu_buffers_for(model, True)
        if not cpu.extra:
            raise ConfigError(
                "--overhead times llama-cpp-python's own Llama, which loads with llama.cpp's extra CPU "
                f"buffer types and cannot turn them off: here they are off ({REASONS[cpu.reason]})"
            )
        set_name, prompts = load_prompts(args.prompts, 1)
        result = measure_hook_overhead(model, prompts[0], args.n_tokens, args.rounds, args.threads)
        print(json.dumps(result, indent=2))
        if args.json_out:
            write_atomic(args.json_out, json.dumps(result, indent=2) + "\n", "bench result")
        return 0
    modes = _modes(args)
    budgets = [b.strip() for b in args.budget.split(",") if b.strip()] or ["none"]
    from ..engine.offload import Budget

    for text in budgets:  # each checked before the first runs: a bad one would otherwise fail only in its turn
        if text.lower() != "none":
            Budget.parse(text).check_fits_machine()
    set_name, prompts = load_prompts(args.prompts, args.n_prompts)
    from ..engine.decoding.sampling import RANDOM_SEED, random_seed
    from ..engine.model_info import read_model_info
    from ..engine.offload import current_budget
    from .model_runs import cpu_buffers_for, resolve_tuned
    from .options import sampling_settings

    # the flags given, checked before a model is read (those not given are checked once resolved)
    GenerationConfig(
        **resolve_tuned(args, {}),
        tree_width=args.tree_width,
        tree_max_nodes=args.tree_max_nodes,
        **sampling_settings(args),
    ).validate()
    if args.seed == RANDOM_SEED:  # drawn once here: every budget's run and the report share it
        args.seed = random_seed()
        if args.temp > 0:
            console.print(f"seed {args.seed} (random; -s {args.seed} repeats this bench)", highlight=False)

    info = read_model_info(model)
    hot, tuned = [], {}
    if args.profile:
        from ..engine.profiles import cost_for_model, hot_experts_for_model, load_profile, tuned_settings

        profile = load_profile(args.profile)
        # this process measures resident unless it is a budget's child
        tuned = tuned_settings(profile, info.fingerprint, offloaded=current_budget() is not None)
    base = GenerationConfig(
        **resolve_tuned(args, tuned),
        tree_width=args.tree_width,
        tree_max_nodes=args.tree_max_nodes,
        utility=not args.no_utility,
        draft_experts=args.draft_experts,
        **sampling_settings(args),
    ).resolved(info)
    if args.profile:
        base.cost = cost_for_model(
            profile,
            info.fingerprint,
            info.path.name,
            offloaded=budgets != ["none"],
            experts_in_host=placement.copies_experts,
        )
        hot = hot_experts_for_model(profile, info.fingerprint)

    from ..engine import offload

    for b in budgets:
        if b != "none":
            offload.Budget.parse(b)  # a bad size is a one-line error before anything runs
    inside = offload.current_budget()
    extra_rows, budget_fits, budget_quality, storage, around, batches, loads = [], {}, {}, None, {}, {}, {}
    budgeted = [b for b in budgets if b != "none"]
    if inside is None and budgeted and not hot:
        from .model_runs import no_hot_experts_note

        console.print(
            no_hot_experts_note(args.profile, model, budgeted[0]), highlight=False, markup=False, soft_wrap=True
        )
    if inside is None:
        # the parent: each budget runs in its own cgroup, "none" resident in this process
        emap = offload.expert_map(model) if budgeted else None
        for b in budgets:
            if b != "none":
                before = read_storage(emap)
                rows, label, fit, size, memory_quality, batch, load = budget_rows(args, model, b, modes)
                batches[label] = batch
                loads[label] = load
                if memory_quality.get("tokens"):
                    budget_quality[label] = memory_quality
                around[label] = before + read_storage(emap)
                if args.trace is not None:
                    record_storage_in_traces(args.trace, b, around[label])
                extra_rows += rows
                if args.reference:
                    extra_rows.append(run_reference_row(args, model, set_name, label, size, rows))
                if fit:
                    budget_fits[label] = fit
        here = "none" if "none" in budgets else None
    else:
        if len(budgets) != 1:
            raise ConfigError("a benchmark inside a memory budget measures that one budget")
        here = budgets[0]

    done = None
    if here is not None:
        cpu = cpu_buffers_for(model, inside is None)
        decoder = Decoder(
            model,
            n_threads=args.threads,
            max_draft=max(16, base.draft_max),
            n_batch=args.batch_size,
            use_extra_bufts=cpu.extra,
            placement=placement,
        )
        if inside is not None:
            budget = inside[1]
            off = offload.offload_decoder(
                decoder,
                budget,
                hot,
                warm_up=lambda: list(warm_up(decoder, base, prompts[0], modes)),
                pinning=pregate_pinning(args),
            )
            here = budget.describe(off.budget_bytes)
        else:
            off = None
        quality_texts = None if args.no_quality else prompts
        prompt_line = _ChangedLine()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task("bench", total=None)
            for ev in run_bench(
                model,
                prompts=prompts,
                modes=modes,
                n_tokens=args.n_tokens,
                budget=here,
                prompt_set=set_name,
                base=base,
                n_threads=args.threads,
                quality_texts=quality_texts,
                decoder=decoder,
                repeats=args.repeats,
                warmup=args.warmup,
                trace=args.trace is not None,
            ):
                if isinstance(ev, BenchTrace):
                    write_prompt_trace(args.trace, budgets[0] if inside is not None else "none", ev, off, hot)
                elif isinstance(ev, BenchProgress):
                    where = "warm-up" if ev.warmup else f"prompt {ev.prompt_index + 1}"
                    if args.repeats > 1 and not ev.warmup:
                        where += f" · repeat {ev.repeat + 1}/{args.repeats}"
                    progress.update(
                        task, total=ev.total, completed=ev.done, description=f"{ev.mode} · {where} · budget {ev.budget}"
                    )
                    if not console.is_terminal:  # piped or in a log: a line per prompt, not minutes of silence
                        prompt_line.say(
                            (where, ev.budget),
                            f"bench: {where} of {len(prompts)} · budget {ev.budget} "
                            f"· {ev.done}/{ev.total} generations done",
                        )
                elif isinstance(ev, BenchDone):
                    done = ev
        if off is not None:
            off.close()
        batch = decoder.rt.n_batch
        decoder.close()
        if done is None:
            return 1
        done.config["batch_size"] = batch  # what a budget counted for llama.cpp's compute buffers
        done.config["cpu_buffers"] = cpu.as_dict()
        if off is not None:
            done.config["budget_bytes"] = off.budget_bytes
    else:
        from ..engine.measure.bench import machine_info

        done = BenchDone(
            [],
            {},
            {},
            machine_info(args.threads),
            config={"prompt_set": set_name, "n_prompts": len(prompts), "n_tokens": args.n_tokens},
        )
    if inside is None:
        if loads:
            done.config["load_by_budget"] = loads
        if here == "none" and args.reference:
            done.rows.append(run_reference_row(args, model, set_name, "none", None, done.rows))
        done.rows.extend(extra_rows)
        if around:
            storage = storage_record(
                around,
                float(emap.expert_bytes[list(emap.moe_layers)].mean()),
                profile if args.profile else None,
                info.fingerprint,
            )
        if storage is not None:
            rates = storage["by_budget"]
            storage_bound(done.rows, storage["expert_bytes"], {k: v["qd8_gb_s"] * 1e9 for k, v in rates.items()})
            done.config["storage"] = storage
            resident_cost = resident_verify_cost(done.cost_model, profile if args.profile else None, info)
            for label, c in budget_fits.items():
                if c.get("miss_aware") and resident_cost is not None:

                    def ratio(gb_s, kind=None, fit=c):
                        return verification_bound_ratio(fit, resident_cost, storage["expert_bytes"], gb_s * 1e9, kind)

                    lo, hi = rates[label]["qd8_range"]
                    c["miss_aware"]["bound_ratio"] = ratio(rates[label]["qd8_gb_s"])
                    by_kind = {kind: ratio(rates[label]["qd8_gb_s"], kind) for kind in VERIFY_KINDS}
                    c["miss_aware"]["bound_ratio_by_kind"] = {k: r for k, r in by_kind.items() if r is not None}
                    # the slowest pass read around the budget gives the smallest ratio
                    c["miss_aware"]["bound_ratio_range"] = [ratio(lo), ratio(hi)]
        done.cost_model_by_budget.update(budget_fits)
        done.memory_quality_by_budget.update(budget_quality)
    done.config["placement"] = placement.as_dict()  # where the weights were: the report says what ran
    if batches:
        done.config["batch_by_budget"] = batches
    if args.json_out:
        write_atomic(args.json_out, json.dumps(done.as_dict(), indent=2) + "\n", "bench result")
    if inside is not None:
        return 0  # the parent prints
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=160)  # a file or a pipe gets one wide table unless COLUMNS says otherwise

    def say(text: str) -> None:  # wrapped at the console's width, like the tables
        out.print(text, highlight=False, markup=False)

    for t in tables(done, out.width):
        out.print(t)
    for line in footnotes(done):
        say(line)
    if not done.config.get("greedy", True):
        say(sampled_note(done.config, any(r.mode == "llama.cpp" for r in done.rows)))
    if done.config.get("storage"):
        say(storage_line(done.config["storage"]))
    if done.config.get("batch_by_budget"):
        say(batch_line(done.config["batch_by_budget"]))
    if done.quality.get("tokens"):
        say("gating quality: " + gating_quality_text(done.quality))
    for label, mq in done.memory_quality_by_budget.items():
        say(memory_quality_text(label, mq))
    from ..engine.measure.cost_fits import r2_text

    if done.cost_model:
        c = done.cost_model
        say(f"cost model: {r2_text(c['r2'], c.get('r2_ceiling'))}, MAPE {c['mape']:.1%} over {c['n']} verifications")
    for label, c in done.cost_model_by_budget.items():
        line = (
            f"cost model under budget {label}: {r2_text(c['r2'], c.get('r2_ceiling'))}, MAPE {c['mape']:.1%} "
            f"over {c['n']} verifications"
        )
        say("; ".join([line] + offloaded_fit_clauses(c)))
    broken = [r.mode for r in done.rows if r.identical_expected and not r.lossless_ok]
    ties = sum(r.near_tie_divergences for r in done.rows if r.identical_expected)
    if ties:
        say(f"note: {ties} divergence(s) from ar at numerical near-ties (ar's top-2 logits within 1e-3)")
    if args.md_out:
        write_atomic(args.md_out, markdown(done), "bench table")
    if broken:
        print(f"warning: lossless modes differ from ar on some prompts: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0
