"""`s2moe project`: replay recorded decoding traces under another device profile and budget."""

from __future__ import annotations

import json

from ..engine.errors import ConfigError


def add_parser(sub) -> None:
    from ..engine.measure.projection import CACHE_POLICIES, RUNNABLE_MODES
    from .options import nonempty, positive_int

    modes = ",".join(RUNNABLE_MODES)

    p = sub.add_parser("project", help="project recorded traces (generate/bench --trace) onto a device profile")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files, or folders of them (bench --trace DIR)")
    p.add_argument("--profile", required=True, type=nonempty, help="device profile name or YAML path")
    p.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="memory budget to simulate: none (default: every expert resident), auto or a size; "
        "the budget the traces ran under replays that run's plan, another leaves the process what "
        "the traces' run (or the profile's calibration under a budget) held beside its experts",
    )
    p.add_argument(
        "--modes",
        default=modes,
        help=f"comma-separated modes (default {modes}; ceilings: oracle drafts exactly what the "
        "target accepts, the best of any stopping rule; perfect verifies the next draft-cap tokens "
        "as if a free draft had guessed them, the best of any drafter)",
    )
    p.add_argument("--threshold", type=float, default=None, help="utility threshold (default: the trace's)")
    p.add_argument(
        "--cache",
        choices=CACHE_POLICIES,
        default="lru",
        help="how the simulated expert cache evicts (default lru: under a budget the engine keeps its "
        "expert cache as one, of the budget plan's size; opt: the expert read furthest ahead, "
        "the fewest fetches any cache could make: a ceiling, not a forecast)",
    )
    p.add_argument(
        "--cache-size",
        choices=("plan", "calibrated"),
        default="plan",
        help="the simulated expert cache: the budget plan's size (default), or that scaled by what "
        "calibrate --budget found the offloading held in effect there (see docs/calibration.md)",
    )
    p.add_argument(
        "--fit-cache",
        action="store_true",
        help="size the simulated cache to fetch what the traces' own run fetched (traces recorded under "
        "this budget) rather than by the budget's plan",
    )
    p.add_argument(
        "--terms",
        choices=("profile", "trace", "none"),
        default="profile",
        help="what is charged beyond the constants (context growth, the engine's host work): the "
        "profile's, as calibrate measured them (default; a profile from before it did: fitted from "
        "the traces, said so), fitted from the traces' own timings (in-sample, only where they "
        "were recorded), or none",
    )
    p.add_argument(
        "--disk",
        choices=("profile", "trace"),
        default="profile",
        help="price a fetch as calibrate measured it (default), or on the disk the traces' own run "
        "read around its budget (bench --trace records it): replaying on the device that recorded "
        "them, whose disk's rate moves from day to day",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="replay the traces this many times over in one process, as bench --repeats runs each "
        "prompt again with what the rules learned and the cache held (default 1)",
    )
    p.add_argument(
        "--no-lookup",
        dest="lookup",
        action="store_false",
        help="replay s2moe without its copies from the context (as generate --no-lookup decodes)",
    )
    p.add_argument(
        "--no-session-copies",
        dest="session",
        action="store_false",
        help="replay s2moe copying from each trace's own context only, not from the traces replayed "
        "before it (bench's +lookup rung)",
    )
    p.add_argument(
        "--against",
        metavar="BENCH_JSON",
        type=nonempty,
        help="a bench --json result of the same run: print measured tok/s and the projection's error",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _budget(text: str) -> str | None:
    from .options import budget_text

    # projected, not run: the profile's device may have more memory than this machine
    return None if text.strip().lower() == "none" else budget_text(text, to_run=False)


def _modes(text: str) -> list[str]:
    from ..engine.measure.projection import PROJECT_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in PROJECT_MODES]
    if bad:
        raise ConfigError(f"--modes: cannot project mode {bad[0]!r} (choose from {', '.join(PROJECT_MODES)})")
    if not modes:
        raise ConfigError("--modes: give at least one mode")
    return modes


def _rows_of(budget: str | None, label: str) -> bool:
    """Whether a bench row labelled `label` ran under the budget projected."""
    from ..engine.offload import Budget, fmt_bytes

    if budget in (None, "none"):
        return label == "none"
    b = Budget.parse(budget)
    return label.startswith("auto") if b.auto else label == fmt_bytes(b.size)


def measured_rows(path: str, budget: str | None) -> dict[str, float]:
    """tok/s by mode from a bench --json result, the rows of the budget projected (none: resident; auto: the
    auto rows; a size: the rows of that size), as bench labels them."""
    from pathlib import Path

    from ..engine.files import read_json

    data = read_json(Path(path), "bench result", 64 << 20)
    try:
        return {
            r["mode"]: float(r["tok_per_s"])
            for r in data["results"]
            if _rows_of(budget, r["budget"]) and r["mode"] != "llama.cpp"
        }
    except (KeyError, TypeError, ValueError, OverflowError):
        raise ConfigError(f"--against {path}: not a bench --json result") from None


def table_lines(p, measured: dict[str, float] | None = None) -> list[str]:
    """The projection as an 80-column table."""
    head = (
        f"{'mode':<8} {'tok/s':>8} {'× ar':>5} {'draft s':>8} {'verify s':>8} {'fetch s':>8} {'host s':>7} "
        f"{'fetch/tok':>9} {'acc len':>7}"
    )
    if measured:
        head += f" {'measured':>9} {'error':>7}"
    lines = [head]
    for m, r in p.modes.items():
        line = (
            f"{m:<8} {r.tok_per_s:>8.1f} {r.speedup if r.speedup is not None else float('nan'):>5.2f} "
            f"{r.t_draft:>8.3f} {r.t_verify:>8.3f} {r.t_fetch:>8.3f} {r.t_host:>7.3f} {r.fetched_per_token:>9.1f} "
            f"{r.accept_len:>7.2f}"
        )
        if measured:
            got = measured.get(m)
            line += f" {got:>9.1f} {r.tok_per_s / got - 1:>+7.1%}" if got else f" {'–':>9} {'–':>7}"
        lines.append(line)
    return lines


def run(args) -> int:
    from ..engine.measure.projection import project
    from ..engine.measure.trace import read_trace, trace_files
    from ..engine.profiles import load_profile

    modes = _modes(args.modes)
    profile = load_profile(args.profile)
    traces = [read_trace(f) for f in trace_files(args.traces)]
    p = project(
        traces,
        profile,
        budget=args.budget,
        modes=modes,
        threshold=args.threshold,
        policy=args.cache,
        fit_cache=args.fit_cache,
        terms=args.terms,
        cache_size=args.cache_size,
        disk=args.disk,
        lookup=args.lookup,
        session=args.session,
        repeats=args.repeats,
    )
    measured = measured_rows(args.against, args.budget) if args.against else None
    if args.json:
        out = p.as_dict()
        if measured:
            out["measured_tok_per_s"] = measured
        print(json.dumps(out))
        return 0
    tokens = next(iter(p.modes.values())).tokens
    times = f" × {p.repeats}" if p.repeats > 1 else ""
    print(
        f"PROJECTION (not a measurement): {p.traces} trace(s){times}, {tokens} tokens, on profile {p.profile}, "
        f"budget {p.budget}"
    )
    print(p.basis)
    print("\n".join(table_lines(p, measured)))
    s = p.modes.get("s2moe")
    if s is not None and s.copied:
        parts = [
            (s.copied - s.copied_session, "the context", s.copies_accepted - s.session_accepted),
            (s.copied_session, "earlier traces", s.session_accepted),
        ]
        where = [
            f"{n} token{'s' if n != 1 else ''} from {source} ({accepted} accepted)"
            for n, source, accepted in parts
            if n
        ]
        print(f"s2moe copied {' and '.join(where)} of the {s.drafted} it drafted")
    if p.cache_fit:
        print(
            "the recording's own fetches, counted by it vs through the simulated cache: "
            + ", ".join(
                f"{name} {sim} for {rec} ({sim / rec - 1:+.0%})" if rec else f"{name} {sim} for {rec}"
                for name, (rec, sim) in p.cache_fit.items()
            )
        )
    return 0
