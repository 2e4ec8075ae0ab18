"""`s2moe bench`: compare modes on a prompt set; print a table, write JSON/markdown reports."""

from __future__ import annotations

import argparse
import json
import sys

from ..engine.errors import ConfigError
from ..engine.modes import MODES

DEFAULT_MODES = "ar,naive,conf,cascade,lookup,s2moe"


def add_parser(sub) -> None:
    from .cli import nonempty

    p = sub.add_parser("bench", help="benchmark S²-MoE against plain decoding and the baselines")
    p.add_argument("--model", "-m", type=nonempty, help="GGUF model (default: the shipped model)")
    p.add_argument("--prompts", default="humaneval", help="humaneval | natural | a JSONL file with a \"prompt\" field")
    p.add_argument("--n-prompts", type=int, default=8, help="prompts to use from the set (default 8)")
    p.add_argument("-n", "--n-tokens", type=int, default=64, help="tokens generated per prompt and mode")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated modes (default {DEFAULT_MODES})")
    p.add_argument("--ablation", action="store_true",
                   help="run the ladder: base (independent draft) → +shared-kv → +utility → +gating")
    p.add_argument("--budget", default="none", help="memory budget(s): none (default), auto or SIZE[,SIZE…]")
    p.add_argument("--profile", type=nonempty, help="device profile for the cost constants (else measured at start-up)")
    p.add_argument("--draft-topk", type=int, default=None,
                   help="experts per token in draft passes, k_d (default: a quarter of the model's, at least 1)")
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--reuse-strength", type=float, default=0.5)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--no-quality", action="store_true", help="skip the teacher-forced gating quality check")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the reference row: llama.cpp's own plain decoding of the same prompts and budget")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the results as JSON")
    p.add_argument("--md", dest="md_out", metavar="OUT", help="write a markdown report with plots")
    p.add_argument("--overhead", action="store_true",
                   help="instead: measure the routing hook's overhead against llama-cpp-python's own decoding")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --overhead")
    p.set_defaults(run=run)


def _modes(args) -> list[str]:
    if args.ablation:
        return ["ar", "base", "+shared-kv", "+utility", "+gating"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"--modes: unknown mode {bad[0]!r} (choose from {', '.join(MODES)})")
    if not modes:
        raise ConfigError("--modes: give at least one mode")
    return modes


def _fmt(v, spec=".2f", none="–"):
    return none if v is None else format(v, spec)


def table(done):
    from rich.table import Table

    t = Table(title=f"s2moe bench · {done.config.get('prompt_set')} × {done.config.get('n_prompts')} prompts · "
                    f"{done.config.get('n_tokens')} tokens each")
    offloaded = any(r.fetched_per_token is not None for r in done.rows)
    cols = ["mode", "budget", "tok/s", "× ar", "accept len", "draft len", "reuse", "verify experts", "eff. verify",
            "rollbacks", "draft/verify s", "= ar"] + (["fetched/tok", "bound tok/s"] if offloaded else [])
    for col in cols:
        t.add_column(col, justify="left" if col in ("mode", "budget") else "right")
    for r in done.rows:
        same = "–" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}" + ("" if r.identical_expected else "*")
        if r.near_tie_divergences:
            same += f" ({r.near_tie_divergences} tie)"
        cells = [r.mode, r.budget, f"{r.tok_per_s:.1f}", r.speedup_text, f"{r.accept_len:.2f}",
                 f"{r.draft_len:.2f}", _fmt(r.reuse_ratio, ".3f"), _fmt(r.verify_experts, ".1f"),
                 _fmt(r.effective_verify_cost, ".2f"), str(r.rollbacks), f"{r.t_draft:.2f}/{r.t_verify:.2f}", same]
        if offloaded:
            cells += [_fmt(r.fetched_per_token, ".1f"), _fmt(r.bound_tok_per_s, ".1f")]
        t.add_row(*cells)
    return t


def storage_line(storage: dict) -> str:
    """How the bound column was computed, from the storage figures the run measured."""
    return (f"storage, cold reads of whole experts: {storage['qd1_gb_s']:.2f} GB/s at queue depth 1, "
            f"{storage['qd8_gb_s']:.2f} GB/s at depth 8 ({storage['source']}); bound = experts fetched per token × "
            f"{storage['expert_bytes'] / 2**20:.2f} MiB ÷ the depth-8 rate, plus the mode's resident compute "
            "where this run measured it")


def measure_storage(model: str, profile: dict | None) -> dict | None:
    """Storage bandwidth at queue depth 1 and 8 for the bound column: the profile's, else read now."""
    from ..engine.calibrate import storage_bandwidth
    from ..engine.offload import expert_map

    emap = expert_map(model)
    expert_bytes = float(emap.expert_bytes[list(emap.moe_layers)].mean())
    device = (profile or {}).get("device") or {}
    if device.get("storage_bandwidth_gb_s") and device.get("storage_bandwidth_qd8_gb_s"):
        return {"qd1_gb_s": device["storage_bandwidth_gb_s"], "qd8_gb_s": device["storage_bandwidth_qd8_gb_s"],
                "expert_bytes": expert_bytes, "source": f"profile {profile.get('name')}"}
    gen = storage_bandwidth(emap, max_bytes=128 << 20)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            rates = stop.value[0]
            break
    if 1 not in rates or 8 not in rates:
        return None
    return {"qd1_gb_s": rates[1] / 1e9, "qd8_gb_s": rates[8] / 1e9, "expert_bytes": expert_bytes,
            "source": "measured by this run"}


def offloaded_fit_clauses(c: dict) -> list[str]:
    """What a budgeted run's fit adds: the miss-aware form and the storage-fault diagnostic, if present."""
    m = c.get("miss_aware")
    if not m:
        return []
    out = [f"counting fetched experts ({m['miss_share']:.0%} of those read): R² {m['r2']:.3f}, MAPE {m['mape']:.1%}, "
           f"T_exp cold {m['t_exp_cold_s'] * 1e3:.3f} ms, warm {m['t_exp_warm_s'] * 1e3:.3f} ms"]
    g = m.get("given_faults")
    if g:
        out.append(f"given the storage faults taken ({g['faults_per_verification']:.1f} per verification, known only "
                   f"afterwards, so a diagnostic rather than a predictor): R² {g['r2']:.3f}")
    return out


def markdown(done) -> str:
    import plotext as plt

    lines = [f"# s2moe bench — {done.config.get('prompt_set')}", "",
             f"Model `{done.config.get('model')}`, {done.config.get('n_prompts')} prompts × "
             f"{done.config.get('n_tokens')} tokens, modes interleaved per prompt, greedy={done.config.get('greedy')}.",
             f"Machine: {done.machine.get('cpu')} ({done.machine.get('cores')} cores, threads {done.machine.get('threads')}).",
             "", "| mode | budget | tok/s | × ar | accept len | draft len | reuse | verify experts | eff. verify | rollbacks | "
                 "= ar | fetched/tok | bound tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in done.rows:
        same = "–" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}"
        lines.append(f"| {r.mode} | {r.budget} | {r.tok_per_s:.1f} | {r.speedup_text} | {r.accept_len:.2f} | "
                     f"{r.draft_len:.2f} | {_fmt(r.reuse_ratio, '.3f')} | {_fmt(r.verify_experts, '.1f')} | "
                     f"{_fmt(r.effective_verify_cost)} | {r.rollbacks} | {same} | {_fmt(r.fetched_per_token, '.1f')} | "
                     f"{_fmt(r.bound_tok_per_s, '.1f')} |")
    if done.config.get("storage"):
        lines += ["", storage_line(done.config["storage"]) + "."]
    plt.clear_figure()
    plt.bar([r.mode for r in done.rows], [r.tok_per_s for r in done.rows])
    plt.title("tok/s by mode")
    plt.plotsize(80, 20)
    plt.theme("clear")
    lines += ["", "```", plt.build(), "```"]
    if done.quality.get("tokens"):
        q = done.quality
        lines += ["", "## Reuse gating quality (teacher-forced)", "",
                  f"α={q['alpha']}, |E*|={q['cap']}, {q['tokens']} tokens: perplexity ratio {q['ppl_ratio']:.4f}, "
                  f"top-1 agreement {q['top1_agreement']:.3f}, mean KL {q['mean_kl']:.4f}, reuse ratio "
                  f"{q['reuse_ratio_plain']:.3f} → {q['reuse_ratio_gated']:.3f} ({q['reuse_reduction']:.0%} lower)."]
    fits = ([("resident", done.cost_model)] if done.cost_model else []) + list(done.cost_model_by_budget.items())
    if fits:
        lines += ["", "## Verification cost model"]
    for label, c in fits:
        where = "fully resident" if label == "resident" else f"under budget {label}"
        lines += ["", f"{where}: latency ≈ {c['intercept_s'] * 1e3:.3f} ms + {c['t_exp_s'] * 1e3:.4f} ms·experts + "
                      f"{c['t_tok_s'] * 1e3:.3f} ms·tokens over {c['n']} verifications: R² {c['r2']:.3f}, "
                      f"MAPE {c['mape']:.1%}."]
        for clause in offloaded_fit_clauses(c):
            lines += ["", clause[0].upper() + clause[1:] + "."]
        plt.clear_figure()
        plt.scatter([x * 1e3 for x in c["measured_s"]], [x * 1e3 for x in c["predicted_s"]])
        plt.title(f"verification latency {where}: measured (x) vs predicted (y), ms")
        plt.plotsize(80, 20)
        plt.theme("clear")
        lines += ["", "```", plt.build(), "```"]
    return "\n".join(lines) + "\n"


def _warm_up(decoder, base, prompt: str, modes) -> None:
    """Run every mode briefly so that what `--budget auto` measures includes all of it (start-up cost
    measurement, the naive drafter's second context, every graph shape)."""
    from dataclasses import replace

    from ..engine.bench import mode_config

    for mode in modes:
        for _ in decoder.generate(prompt, replace(mode_config(mode, base), n_predict=8, stop_at_eos=False)):
            pass


def _budget_rows(args, model: str, budget_text: str) -> tuple[list, str, dict, int]:
    """Run this benchmark for one budget in a child process inside a memory cgroup; return its rows,
    the budget's label, its verification cost-model fit and the budget in bytes (auto: as sized)."""
    import tempfile
    from pathlib import Path

    from ..engine import offload
    from ..engine.bench import BenchRow

    with tempfile.TemporaryDirectory(prefix="s2moe-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "s2moe.app.cli", "bench", "--model", model, "--prompts", args.prompts,
                "--n-prompts", str(args.n_prompts), "-n", str(args.n_tokens), "--budget", budget_text,
                "--draft-topk", str(args.draft_topk), "--draft-max", str(args.draft_max),
                "--reuse-strength", str(args.reuse_strength), "--no-quality", "--json", str(out)]
        argv += ["--modes", ",".join(_modes(args))] if not args.ablation else ["--ablation"]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if args.profile:
            argv += ["--profile", args.profile]
        with offload.run_in_budget(argv, offload.Budget.parse(budget_text), model, tag="bench") as run:
            rc = run.wait()
        if rc != 0 or not out.exists():
            raise ConfigError(f"the benchmark under budget {budget_text} failed (exit {rc})")
        data = json.loads(out.read_text())
    rows = [BenchRow(**r) for r in data["results"]]
    return rows, (rows[0].budget if rows else budget_text), data.get("cost_model") or {}, data["config"]["budget_bytes"]


def _reference_row(args, model: str, set_name: str, label: str, budget_bytes: int | None, rows):
    """llama.cpp's own plain decoding of the same prompts (s2moe.engine.reference) in a process of its own:
    under the same budget in bytes, in a fresh cgroup with nothing pinned or prefetched; resident
    otherwise."""
    import subprocess
    import tempfile
    from pathlib import Path

    from ..engine import offload
    from ..engine.bench import reference_row

    with tempfile.TemporaryDirectory(prefix="s2moe-ref-") as tmp:
        out = Path(tmp) / "ref.json"
        argv = [sys.executable, "-m", "s2moe.engine.reference", "--model", model, "--prompts", args.prompts,
                "--n-prompts", str(args.n_prompts), "-n", str(args.n_tokens), "--json", str(out)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if budget_bytes is None:
            rc = subprocess.run(argv).returncode
        else:
            with offload.run_in_budget(argv + ["--no-repack"], offload.Budget(budget_bytes), model, tag="ref") as run:
                rc = run.wait()
        if rc != 0 or not out.exists():
            raise ConfigError(f"llama.cpp's plain decoding under budget {label} failed (exit {rc})")
        result = json.loads(out.read_text())
    ar = next((r for r in rows if r.mode == "ar" and r.budget == label), None)
    return reference_row(result, label, ar, set_name, args.n_prompts)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..engine.bench import (BenchDone, BenchProgress, load_prompts, measure_hook_overhead, run_bench, storage_bound,
                                write_atomic)
    from ..engine.decoder import Decoder, GenerationConfig
    from .cli import default_model

    model = args.model or default_model()
    console = Console(stderr=True)
    if args.n_tokens < 1 or args.n_prompts < 1:
        raise ConfigError("-n and --n-prompts must be at least 1")
    if args.overhead:
        set_name, prompts = load_prompts(args.prompts, 1)
        result = measure_hook_overhead(model, prompts[0], args.n_tokens, args.rounds, args.threads)
        print(json.dumps(result, indent=2))
        if args.json_out:
            write_atomic(args.json_out, json.dumps(result, indent=2) + "\n")
        return 0
    modes = _modes(args)
    budgets = [b.strip() for b in args.budget.split(",") if b.strip()] or ["none"]
    set_name, prompts = load_prompts(args.prompts, args.n_prompts)
    base = GenerationConfig(draft_topk=args.draft_topk, draft_max=args.draft_max, reuse_strength=args.reuse_strength)
    base.validate()
    from ..engine.model_info import read_model_info

    info = read_model_info(model)
    base = base.resolved(info)
    # a budget's child process measures these same settings
    args.draft_topk, args.draft_max = base.draft_topk, base.draft_max
    hot = []
    if args.profile:
        from ..engine.profiles import cost_for_model, hot_experts_for_model, load_profile

        profile = load_profile(args.profile)
        base.cost = cost_for_model(profile, info.fingerprint, info.path.name, offloaded=budgets != ["none"])
        hot = hot_experts_for_model(profile, info.fingerprint)

    from ..engine import offload

    for b in budgets:
        if b != "none":
            offload.Budget.parse(b)  # a bad size is a one-line error before anything runs
    inside = offload.current_budget()
    extra_rows, budget_fits, storage = [], {}, None
    if inside is None and budgets != ["none"]:
        storage = measure_storage(model, profile if args.profile else None)
    if inside is None:
        # the parent: each budget runs in its own cgroup, "none" resident in this process
        for b in budgets:
            if b != "none":
                rows, label, fit, size = _budget_rows(args, model, b)
                extra_rows += rows
                if args.reference:
                    extra_rows.append(_reference_row(args, model, set_name, label, size, rows))
                if fit:
                    budget_fits[label] = fit
        here = "none" if "none" in budgets else None
    else:
        if len(budgets) != 1:
            raise ConfigError("a benchmark inside a memory budget measures that one budget")
        here = budgets[0]

    done = None
    if here is not None:
        decoder = Decoder(model, n_threads=args.threads, max_draft=max(16, args.draft_max),
                          use_extra_bufts=inside is None)
        if inside is not None:
            budget = inside[1]
            off = offload.offload_decoder(decoder, budget, hot,
                                          warm_up=lambda: _warm_up(decoder, base, prompts[0], modes))
            here = budget.describe(off.budget_bytes)
        else:
            off = None
        quality_texts = None if args.no_quality else prompts
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task("bench", total=None)
            for ev in run_bench(model, prompts=prompts, modes=modes, n_tokens=args.n_tokens, budget=here,
                                prompt_set=set_name, base=base, n_threads=args.threads, quality_texts=quality_texts,
                                decoder=decoder):
                if isinstance(ev, BenchProgress):
                    progress.update(task, total=ev.total, completed=ev.done,
                                    description=f"{ev.mode} · prompt {ev.prompt_index + 1} · budget {ev.budget}")
                elif isinstance(ev, BenchDone):
                    done = ev
        if off is not None:
            off.close()
        decoder.close()
        if done is None:
            return 1
        if off is not None:
            done.config["budget_bytes"] = off.budget_bytes
    else:
        from ..engine.bench import machine_info

        done = BenchDone([], {}, {}, machine_info(args.threads), config={"prompt_set": set_name,
                                                                         "n_prompts": len(prompts),
                                                                         "n_tokens": args.n_tokens})
    if inside is None:
        if here == "none" and args.reference:
            done.rows.append(_reference_row(args, model, set_name, "none", None, done.rows))
        done.rows.extend(extra_rows)
        if storage is not None:
            storage_bound(done.rows, storage["expert_bytes"], storage["qd8_gb_s"] * 1e9)
            done.config["storage"] = storage
        done.cost_model_by_budget.update(budget_fits)
    if args.json_out:
        write_atomic(args.json_out, json.dumps(done.as_dict(), indent=2) + "\n")
    if inside is not None:
        return 0  # the parent prints
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    out.print(table(done))
    if any(r.decoded_as_ar for r in done.rows):
        print("≈: drafted nothing and decoded ar's tokens — the same decoding as ar, so the ratio is noise")
    if done.config.get("storage"):
        print(storage_line(done.config["storage"]))
    q = done.quality
    if q.get("tokens"):
        print(f"gating quality: perplexity ratio {q['ppl_ratio']:.4f}, top-1 agreement {q['top1_agreement']:.3f}, "
              f"mean KL {q['mean_kl']:.4f}, reuse ratio {q['reuse_ratio_plain']:.3f} → {q['reuse_ratio_gated']:.3f}")
    if done.cost_model:
        c = done.cost_model
        print(f"cost model: R² {c['r2']:.3f}, MAPE {c['mape']:.1%} over {c['n']} verifications")
    for label, c in done.cost_model_by_budget.items():
        line = f"cost model under budget {label}: R² {c['r2']:.3f}, MAPE {c['mape']:.1%} over {c['n']} verifications"
        print("; ".join([line] + offloaded_fit_clauses(c)))
    broken = [r.mode for r in done.rows if r.identical_expected and not r.lossless_ok]
    ties = sum(r.near_tie_divergences for r in done.rows if r.identical_expected)
    if ties:
        print(f"note: {ties} divergence(s) from ar at numerical near-ties (ar's top-2 logits within 1e-3)")
    if args.md_out:
        write_atomic(args.md_out, markdown(done))
    if broken:
        print(f"warning: lossless modes differ from ar on some prompts: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0
