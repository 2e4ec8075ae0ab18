"""What `s2moe bench` prints and writes of its results: the tables that fit the terminal, their footnotes, the
markdown report and the lines on storage, batches, gating quality and the cost-model fits. Text only: the
figures come measured in an engine.measure.bench.BenchDone."""

from __future__ import annotations


def _fmt(v, spec=".2f", none="–"):
    return none if v is None else format(v, spec)


def _cells(done) -> tuple[list, list[dict]]:
    """The table's columns (by priority: what a speed-up claim needs first) and each row's cells."""
    from .columns import Column

    offloaded = any(r.fetched_per_token is not None for r in done.rows)
    repeated = any(r.repeats > 1 for r in done.rows)
    budgets = len({r.budget for r in done.rows}) > 1 or any(r.budget != "none" for r in done.rows)
    spec = [
        ("mode", "mode", 0),
        ("budget", "budget", 1 if budgets else 15),
        ("tok_s", "tok/s", 3),
        ("tok_s_range", "tok/s range", 5),
        ("x_ar", "× ar", 2),
        ("x_ar_range", "× ar range", 4),
        ("same", "= ar", 6),
        ("accept", "accept len", 7),
        ("draft", "draft len", 8),
        ("reuse", "reuse", 9),
        ("fetched", "fetched/tok", 10),
        ("bound", "bound tok/s", 11),
        ("rollbacks", "rollbacks", 12),
        ("verify", "verify experts", 13),
        ("eff", "eff. verify", 14),
        ("dv", "draft/verify s", 16),
    ]
    shown = (
        {key for key, _, _ in spec}
        - ({"tok_s_range", "x_ar_range"} if not repeated else set())
        - ({"fetched", "bound"} if not offloaded else set())
    )
    rows = []
    for r in done.rows:
        same = "–" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}" + ("" if r.identical_expected else "*")
        if r.near_tie_divergences:
            same += f" ({r.near_tie_divergences} tie)"
        rows.append(
            {
                "mode": r.mode,
                "budget": r.budget,
                "tok_s": f"{r.tok_per_s:.1f}",
                "tok_s_range": r.tok_per_s_range or "–",
                "x_ar": r.speedup_text,
                "x_ar_range": r.speedup_range or "–",
                "same": same,
                "accept": f"{r.accept_len:.2f}",
                "draft": f"{r.draft_len:.2f}",
                "reuse": _fmt(r.reuse_ratio, ".3f"),
                "fetched": _fmt(r.fetched_per_token, ".1f"),
                "bound": _fmt(r.bound_tok_per_s, ".1f"),
                "rollbacks": str(r.rollbacks),
                "verify": _fmt(r.verify_experts, ".1f"),
                "eff": _fmt(r.effective_verify_cost, ".2f"),
                "dv": f"{r.t_draft:.2f}/{r.t_verify:.2f}",
            }
        )
    # each column also takes the one cell of the border to its left: counted in its width here
    columns = [
        Column(key, label, max([len(label)] + [len(c[key]) for c in rows]) + 1, pri)
        for key, label, pri in spec
        if key in shown
    ]
    return columns, rows


def tables(done, width: int) -> list:
    """The results as Rich tables that fit `width` columns: the most important columns first; those that do
    not fit go on to further tables (each led by the mode) rather than being squeezed or cut."""
    from rich import box
    from rich.table import Table

    from .columns import columns_that_fit

    columns, rows = _cells(done)
    head = columns[0]
    title = (
        f"s2moe bench · {done.config.get('prompt_set')} × {done.config.get('n_prompts')} prompts · "
        f"{done.config.get('n_tokens')} tokens each"
    )
    repeats = done.config.get("repeats") or 1
    if repeats > 1:
        title += f" · median of {repeats} repeats"
    drafts = {r.draft_experts for r in done.rows if r.draft_experts}
    if drafts:
        title += " · drafts from " + " and ".join(f"{d} experts" for d in sorted(drafts))
    out = []
    left = columns
    while left:
        fitted = columns_that_fit(left, width - 1)
        t = Table(title=title if not out else None, box=box.SIMPLE_HEAD, title_justify="left")
        for col, w in fitted:
            t.add_column(
                col.label, justify="left" if col.key in ("mode", "budget") else "right", no_wrap=True, min_width=w - 1
            )
        for cells in rows:
            t.add_row(*(cells[col.key] for col, _ in fitted))
        out.append(t)
        taken = {col.key for col, _ in fitted}
        left = [c for c in left if c.key not in taken]
        if left:
            left = [head] + left
    return out


def footnotes(done) -> list[str]:
    """What the table's marks mean, the fastest mode and each mode's verdict against ar (engine.measure.speed), and a
    warning where the machine was busy or the runs unsteady."""
    from ..engine.measure.bench_results import judgements

    out = []
    if any(r.decoded_as_ar for r in done.rows):
        out.append(
            "≈: drafted nothing and decoded ar's tokens — what separates it from ar is the machine's noise and "
            "the mode's own work a step (the verdict below says whether it is significant)"
        )
    if any(r.within_noise and not r.decoded_as_ar and r.mode != "ar" for r in done.rows):
        out.append(
            "≈: not significant — within the run-to-run spread: the ratio to ar give or take two standard "
            "errors over the paired runs (each prompt in each repeat) includes 1"
        )
    if any(r.identical_to_ar is not None and not r.identical_expected for r in done.rows):
        out.append(
            "*: not lossless by design (its gating changes which experts verify a draft), so = ar may be "
            "under 100%; without * a mode must match ar token for token"
        )
    judged = judgements(done.rows, done.config.get("load"), done.config.get("load_by_budget"))
    for budget, judgement in judged:
        where = f"budget {budget}: " if len(judged) > 1 else ""
        out += [where + line for line in judgement.lines()]
    return out


def sampled_note(config: dict, reference: bool) -> str:
    """What a sampled bench's figures mean: the settings, the seeds, and what = ar compares."""
    text = (
        f"sampled at T={config['temperature']:g} (top-k {config['top_k']}, top-p {config['top_p']:g}, min-p "
        f"{config['min_p']:g}, repeat penalty {config['repeat_penalty']:g}); prompt i uses seed "
        f"{config['seed']} + i in every mode and repeat; = ar: the same tokens as ar drew with that seed "
        "(a draft is accepted only where it is ar's draw there, so a lossless mode matches ar token for token)"
    )
    return text + ("; the llama.cpp row decodes greedily" if reference else "")


def batch_line(batches: dict) -> str:
    """The prefill batch each budget's process ran: where -b is not given, a budget of a given size chooses it."""
    each = ", ".join(f"{n} tokens under {label}" for label, n in batches.items())
    return f"llama.cpp's batch (a prompt's prefill chunk, its compute buffers sized for it): {each}"


def storage_line(storage: dict) -> str:
    """How the bound column was computed, from the storage figures the run measured."""
    if storage.get("qd8_range"):
        lo1, hi1 = storage["qd1_range"]
        lo8, hi8 = storage["qd8_range"]
        rates = (
            f"{lo1:.2f}–{hi1:.2f} GB/s at queue depth 1, {lo8:.2f}–{hi8:.2f} GB/s at depth 8 "
            f"({storage['source']}, {storage['n_readings']} readings)"
        )
        which = "the median depth-8 rate read around that budget"
    else:
        rates = (
            f"{storage['qd1_gb_s']:.2f} GB/s at queue depth 1, {storage['qd8_gb_s']:.2f} GB/s at depth 8 "
            f"({storage['source']})"
        )
        which = "the depth-8 rate"
    return (
        f"storage, cold reads of whole experts: {rates}; bound = experts fetched per token × "
        f"{storage['expert_bytes'] / 2**20:.2f} MiB ÷ {which}, plus the mode's resident compute "
        "where this run measured it"
    )


# what each kind of verification batch (engine.measure.bench_results.VERIFY_KINDS) is called in the report
KIND_WORDS = {"plain": "plain steps", "copy": "copied drafts", "draft": "self-drafted (experts predicted)"}


def offloaded_fit_clauses(c: dict) -> list[str]:
    """What a budgeted run's fit adds: the miss-aware form and the storage-fault diagnostic, if present."""
    from ..engine.measure.cost_fits import r2_text

    m = c.get("miss_aware")
    if not m:
        return []
    out = [
        f"counting fetched experts ({m['miss_share']:.0%} of those read): {r2_text(m['r2'], m.get('r2_ceiling'))}, "
        f"MAPE {m['mape']:.1%}, "
        f"T_exp cold {m['t_exp_cold_s'] * 1e3:.3f} ms, warm {m['t_exp_warm_s'] * 1e3:.3f} ms"
    ]
    if m.get("bound_ratio"):
        span = m.get("bound_ratio_range") or [None, None]
        spread = (
            f"; {span[0]:.2f}–{span[1]:.2f}× at the slowest and fastest pass read around it"
            if None not in span and span[0] != span[1]
            else ""
        )
        out.append(
            f"verifications took {m['bound_ratio']:.2f}× their bound (fetched experts at the depth-8 rate, "
            f"the rest as resident{spread})"
        )
        kinds = m.get("bound_ratio_by_kind") or {}
        if len(kinds) > 1:
            out.append("by batch: " + ", ".join(f"{KIND_WORDS[k]} {r:.2f}×" for k, r in kinds.items()))
    d = m.get("disk_tracked")
    if d:
        lo, hi = d["t_exp_cold_range_s"]
        out.append(
            f"with T_exp cold followed through the run (each verification at the rate the fetches before it "
            f"took, the latest {d['half_life_fetches']:.0f} weighing half; it went {lo * 1e3:.2f}–"
            f"{hi * 1e3:.2f} ms): R² {d['r2']:.3f}"
        )
    g = m.get("given_faults")
    if g:
        out.append(
            f"given the storage faults taken ({g['faults_per_verification']:.1f} per verification, known only "
            f"afterwards, so a diagnostic rather than a predictor): R² {g['r2']:.3f}"
        )
    return out


def markdown(done) -> str:
    import plotext as plt

    from ..engine.measure.cost_fits import r2_text

    lines = [
        f"# s2moe bench — {done.config.get('prompt_set')}",
        "",
        f"Model `{done.config.get('model')}`, {done.config.get('n_prompts')} prompts × "
        f"{done.config.get('n_tokens')} tokens, modes interleaved per prompt, greedy={done.config.get('greedy')}"
        + (
            f", median (min–max) of {done.config['repeats']} repeats." if (done.config.get("repeats") or 1) > 1 else "."
        ),
        f"Machine: {done.machine.get('cpu')} ({done.machine.get('cores')} cores, "
        f"threads {done.machine.get('threads')}).",
        "",
        "| mode | budget | tok/s | × ar | accept len | draft len | reuse | verify experts | eff. verify "
        "| rollbacks | = ar | fetched/tok | bound tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in done.rows:
        same = (
            "–" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}" + ("" if r.identical_expected else "\\*")
        )
        tps = f"{r.tok_per_s:.1f}" + (f" ({r.tok_per_s_range})" if r.tok_per_s_range else "")
        ratio = r.speedup_text + (f" ({r.speedup_range})" if r.speedup_range else "")
        lines.append(
            f"| {r.mode} | {r.budget} | {tps} | {ratio} | {r.accept_len:.2f} | "
            f"{r.draft_len:.2f} | {_fmt(r.reuse_ratio, '.3f')} | {_fmt(r.verify_experts, '.1f')} | "
            f"{_fmt(r.effective_verify_cost)} | {r.rollbacks} | {same} | {_fmt(r.fetched_per_token, '.1f')} | "
            f"{_fmt(r.bound_tok_per_s, '.1f')} |"
        )
    lines.append("")
    for note in footnotes(done):
        lines.append("- " + ("\\" + note if note.startswith("*") else note))  # a bare * would start emphasis
    if not done.config.get("greedy", True):
        lines += ["", sampled_note(done.config, any(r.mode == "llama.cpp" for r in done.rows)) + "."]
    if done.config.get("storage"):
        lines += ["", storage_line(done.config["storage"]) + "."]
    plt.clear_figure()
    plt.bar([r.mode for r in done.rows], [r.tok_per_s for r in done.rows])
    plt.title("tok/s by mode")
    plt.plotsize(80, 20)
    plt.theme("clear")
    lines += ["", "```", plt.build(), "```"]
    if done.quality.get("tokens"):
        lines += ["", "## Reuse gating quality (teacher-forced)", "", gating_quality_text(done.quality) + "."]
    for label, mq in done.memory_quality_by_budget.items():
        lines += ["", memory_quality_text(label, mq) + "."]
    fits = ([("resident", done.cost_model)] if done.cost_model else []) + list(done.cost_model_by_budget.items())
    if fits:
        lines += ["", "## Verification cost model"]
    for label, c in fits:
        where = "fully resident" if label == "resident" else f"under budget {label}"
        lines += [
            "",
            f"{where}: latency ≈ {c['intercept_s'] * 1e3:.3f} ms + {c['t_exp_s'] * 1e3:.4f} ms·experts + "
            f"{c['t_tok_s'] * 1e3:.3f} ms·tokens over {c['n']} verifications: "
            f"{r2_text(c['r2'], c.get('r2_ceiling'))}, MAPE {c['mape']:.1%}.",
        ]
        for clause in offloaded_fit_clauses(c):
            lines += ["", clause[0].upper() + clause[1:] + "."]
        plt.clear_figure()
        plt.scatter([x * 1e3 for x in c["measured_s"]], [x * 1e3 for x in c["predicted_s"]])
        plt.title(f"verification latency {where}: measured (x) vs predicted (y), ms")
        plt.plotsize(80, 20)
        plt.theme("clear")
        lines += ["", "```", plt.build(), "```"]
    return "\n".join(lines) + "\n"


def check_words(f, kl: bool = True) -> str:
    """A quality check's figures (bench.CheckFigures, or a check's dict as bench and profiles hold it) in words,
    each ± its standard error where the check has one (batch means over its tokens; the perplexity ratio's from
    that of its log)."""
    if isinstance(f, dict):
        from ..engine.measure.quality_checks import CheckFigures

        f = CheckFigures.of(f)

    def with_error(value, se, digits: int) -> str:
        if value is None:
            return "–"
        return f"{value:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")

    ppl_se = None if f.ppl_ratio is None or f.log_ppl_ratio_se is None else f.ppl_ratio * f.log_ppl_ratio_se
    text = (
        f"perplexity ratio {with_error(f.ppl_ratio, ppl_se, 4)}, "
        f"top-1 agreement {with_error(f.top1_agreement, f.top1_se, 3)}"
    )
    return text + (f", mean KL {f.mean_kl:.4f}" if kl and f.mean_kl is not None else "")


def gating_quality_text(q: dict) -> str:
    return (
        f"α {q['alpha']:g} |E*| {q['cap']}, {q['tokens']} tokens: {check_words(q)}, reuse ratio "
        f"{q['reuse_ratio_plain']:.3f} → {q['reuse_ratio_gated']:.3f} ({q['reuse_reduction']:.0%} lower)"
    )


def memory_quality_text(label: str, q: dict) -> str:
    text = (
        f"gating toward the experts in memory under budget {label} (α {q['alpha']:g}, teacher-forced, "
        f"{q['tokens']} tokens one a step): {check_words(q)}"
    )
    b = q.get("batches") or {}
    if b.get("tokens"):
        text += (
            f"; with reuse gating too (α {b['alpha']:g} |E*| {b['cap']}, batches of {b['window']}, "
            f"{b['tokens']} tokens): {check_words(b)}"
        )
    return text
