"""`s2moe calibrate`: measure this device's cost constants for a model and write a device profile."""

from __future__ import annotations

import itertools
import sys


def add_parser(sub) -> None:
    from .options import add_batch_option, add_placement_options, budget_text, nonempty, positive_int

    p = sub.add_parser("calibrate", help="measure cost constants and hot experts; write a device profile")
    p.add_argument("--model", "-m", type=nonempty, help="GGUF MoE model (default: the shipped model)")
    p.add_argument(
        "--budget",
        type=budget_text,
        help="memory budget, e.g. 800M or 2G, or auto (what the process holds plus a third of the expert "
        "bytes, as bench and app --budget auto): hot experts are chosen to fit it and the "
        "verification cost is also measured under it (needs a memory cgroup)",
    )
    p.add_argument(
        "--prompts",
        type=nonempty,
        help="calibration prompts for the hot experts: humaneval or natural (the sets bench uses; "
        "humaneval suits code models), or a file of prompts separated by blank lines (default: a "
        "built-in mix of prose and code)",
    )
    p.add_argument(
        "--name", type=nonempty, help="profile name (default: local); an existing user profile keeps its other models"
    )
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads (default: all available)")
    add_batch_option(p)
    p.add_argument("--repeats", type=positive_int, default=3, help="timings per measurement (default 3)")
    p.add_argument("--no-save", action="store_true", help="measure and print, write nothing")
    p.add_argument("--no-plot", action="store_true", help="no predicted-vs-measured plot")
    add_placement_options(p)
    p.set_defaults(run=run)


def _plot(data: dict, title: str) -> str:
    import plotext as plt

    measured, predicted = data["measured"], data["predicted"]
    plt.clear_figure()
    plt.plotsize(72, 18)
    plt.theme("clear")
    plt.scatter(measured, predicted, marker="dot", label="batches")
    lo, hi = min(measured + predicted), max(measured + predicted)
    plt.plot([lo, hi], [lo, hi], label="predicted = measured")
    plt.xlabel("measured verification latency (ms)")
    plt.ylabel("predicted (ms)")
    plt.title(title)
    return plt.build()


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from ..engine.decoding.runtime_settings import check_threads
    from ..engine.measure.calibrate import run_calibration
    from ..engine.measure.calibration_events import CalibrationDone, StepProgress, StepResult, StepStarted
    from ..engine.offload import Budget
    from .model_runs import default_model
    from .options import placement_from_args
    from .tui.calibrate_steps import step_outcome

    budget = Budget.parse(args.budget) if args.budget is not None else None
    model = args.model if args.model is not None else default_model()
    check_threads(args.threads)
    placement = placement_from_args(args)
    console = Console(stderr=True, highlight=False)
    out = Console(highlight=False)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = None
    done_event = None
    failed = []
    events = run_calibration(
        model,
        budget=budget,
        prompts=args.prompts,
        name=args.name,
        save=not args.no_save,
        n_threads=args.threads,
        repeats=args.repeats,
        placement=placement,
        n_batch=args.batch_size,
    )
    # The model, the prompts and the profile folder are checked before the first event: an error about
    # them is the only line printed.
    first = next(events)
    console.print(Text.assemble("calibrating ", (model, "bold"), f" under a budget of {args.budget}" if budget else ""))
    with progress:
        for ev in itertools.chain([first], events):
            if isinstance(ev, StepStarted):
                task = progress.add_task(f"[{ev.index}/{ev.total}] {ev.name}", total=None)
            elif isinstance(ev, StepProgress) and task is not None:
                progress.update(task, completed=ev.done, total=ev.total)
            elif isinstance(ev, StepResult):
                if task is not None:
                    progress.remove_task(task)
                    task = None
                outcome = step_outcome(ev)  # the CLI names its flags: no field names
                head = (f"[{ev.index}] {ev.name}", "bold red" if outcome.state == "failed" else "bold")
                if outcome.state == "failed":
                    failed.append(ev.name)
                    note = f" ({outcome.note})" if outcome.note else ""
                    progress.console.print(
                        Text.assemble(head, ": ", ("✖ failed", "bold red"), f": {outcome.reason}{note}")
                    )
                else:
                    progress.console.print(Text.assemble(head, f": {ev.summary}"))
                for flag in outcome.flags:
                    progress.console.print(Text.assemble("    ", ("⚠ " + flag, "yellow")))
                if "measured" in ev.data and not args.no_plot and len(ev.data["measured"]) >= 3:
                    label = "under the budget" if ev.name == "budget" else "resident"
                    plot = _plot(
                        ev.data,
                        f"verification cost model ({label}): R² {ev.data['r2']:.3f}, MAPE {ev.data['mape']:.1%}",
                    )
                    progress.console.print(Text.from_ansi(plot))
            elif isinstance(ev, CalibrationDone):
                done_event = ev
    if done_event is None:
        print("calibration stopped: no profile written", file=sys.stderr)
        return 1
    if done_event.path is not None:
        out.print(f"profile written: {done_event.path}  (use it with --profile {done_event.profile['name']})")
    if failed:
        print(
            f"warning: {len(failed)} step{'s' if len(failed) > 1 else ''} failed ({', '.join(failed)}): the profile "
            "lacks what they measure",
            file=sys.stderr,
        )
    return 0
