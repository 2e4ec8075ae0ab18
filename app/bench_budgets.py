"""The bench under memory budgets: each budget's run in a child process inside its own memory cgroup, llama.cpp's
plain decoding of the same prompts as the reference row beside it, and the trace files named per budget. `s2moe
bench` (cmd_bench) reads its arguments and prints the tables; what runs apart from its own process lives here."""

from __future__ import annotations

import json
import sys

from ..engine.errors import ConfigError
from .bench_storage import storage_reading


def budget_rows(
    args, model: str, budget_text: str, modes: list[str]
) -> tuple[list, str, dict, int, dict, int, dict | None]:
    """Run this benchmark (its modes as cmd_bench checked them) for one budget in a child process inside a memory
    cgroup; return its rows, the budget's label, its verification cost-model fit, the budget in bytes (auto: as
    sized), what gating toward the experts in memory cost there (quality_checks.memory_gating_quality; {} with
    --no-quality) and the prefill batch its process ran (-b, else chosen there), and what else used the CPUs while it
    measured (speed.Load)."""
    import tempfile
    from pathlib import Path

    from ..engine import offload
    from ..engine.crashes import exit_text
    from ..engine.measure.bench_results import BenchRow
    from .model_runs import say_child_death
    from .options import SAMPLING_VALUES, placement_flags, placement_from_args, sampling_settings

    with tempfile.TemporaryDirectory(prefix="s2moe-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "bench",
            "--model",
            model,
            "--prompts",
            args.prompts,
            "--n-prompts",
            str(args.n_prompts),
            "-n",
            str(args.n_tokens),
            "--budget",
            budget_text,
            "--repeats",
            str(args.repeats),
            "--json",
            str(out),
        ]
        if args.no_quality:
            argv.append("--no-quality")
        if args.pregate[0]:
            argv += ["--pregate", "{}:{}".format(*args.pregate)]
        # settings not given are resolved there: the profile's tuning under a budget, not the resident one
        for flag, value in (
            ("--draft-topk", args.draft_topk),
            ("--draft-max", args.draft_max),
            ("--reuse-strength", args.reuse_strength),
            ("--threshold", args.threshold),
            ("--memory-strength", args.memory_strength),
            ("--tree-width", args.tree_width),
            ("--draft-experts", args.draft_experts),
            ("--tree-max-nodes", args.tree_max_nodes),
        ):
            if value is not None:
                argv += [flag, str(value)]
        # one word: a list that starts with `-gating` or its kin would read as an option
        argv.append("--modes=" + ",".join(modes) if not args.ablation else "--ablation")
        if args.no_utility:
            argv.append("--no-utility")
        for key, value in sampling_settings(args).items():  # the seed drawn already where it was -1
            argv += [SAMPLING_VALUES[key][0], str(value)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if args.batch_size is not None:  # else the budget's process chooses its own (engine.decoding.decoder.Decoder)
            argv += ["--batch-size", str(args.batch_size)]
        argv += placement_flags(placement_from_args(args))
        if not args.warmup:
            argv.append("--no-warmup")
        if args.profile:
            argv += ["--profile", args.profile]
        if args.trace:
            argv += ["--trace", args.trace]
        with offload.run_in_budget(argv, offload.Budget.parse(budget_text), model, tag="bench") as run:
            rc = run.wait()
        if rc != 0 or not out.exists():
            say_child_death(rc)
            raise ConfigError(f"the benchmark under budget {budget_text} failed ({exit_text(rc)})")
        data = json.loads(out.read_text())
    rows = [BenchRow(**r) for r in data["results"]]
    return (
        rows,
        (rows[0].budget if rows else budget_text),
        data.get("cost_model") or {},
        data["config"]["budget_bytes"],
        data.get("quality") or {},
        data["config"]["batch_size"],
        data["config"].get("load"),
    )


def run_reference_row(args, model: str, set_name: str, label: str, budget_bytes: int | None, rows):
    """llama.cpp's own plain decoding of the same prompts (s2moe.engine.measure.reference) in a process of its own:
    under the same budget in bytes, in a fresh cgroup with nothing pinned or prefetched; resident
    otherwise."""
    import subprocess
    import tempfile
    from pathlib import Path

    from ..engine import offload
    from ..engine.crashes import exit_text
    from ..engine.measure.bench_results import reference_row
    from .model_runs import cpu_buffers_for, say_child_death
    from .options import placement_from_args

    with tempfile.TemporaryDirectory(prefix="s2moe-ref-") as tmp:
        out = Path(tmp) / "ref.json"
        argv = [
            sys.executable,
            "-m",
            "s2moe.engine.measure.reference",
            "--model",
            model,
            "--prompts",
            args.prompts,
            "--n-prompts",
            str(args.n_prompts),
            "-n",
            str(args.n_tokens),
            "--json",
            str(out),
            "--placement",
            json.dumps(placement_from_args(args).as_dict()),
        ]
        if args.batch_size is not None:  # else llama.cpp's default, as its users get it
            argv += ["--batch-size", str(args.batch_size)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if budget_bytes is None:
            # llama.cpp as its users get it, but not into a crash that stock llama.cpp has (AMX, say)
            rc = subprocess.run(argv + ([] if cpu_buffers_for(model, True).extra else ["--no-repack"])).returncode
        else:
            with offload.run_in_budget(argv + ["--no-repack"], offload.Budget(budget_bytes), model, tag="ref") as run:
                rc = run.wait()
        if rc != 0 or not out.exists():
            say_child_death(rc)
            raise ConfigError(f"llama.cpp's plain decoding under budget {label} failed ({exit_text(rc)})")
        result = json.loads(out.read_text())
    ar = next((r for r in rows if r.mode == "ar" and r.budget == label), None)
    return reference_row(result, label, ar, set_name, args.n_prompts)


def _trace_tag(budget_text: str) -> str:
    """The name a budget's trace files start with: resident-000.jsonl, budget-auto-000.jsonl, …"""
    import re

    return "resident" if budget_text == "none" else "budget-" + re.sub(r"[^A-Za-z0-9.]+", "_", budget_text)


def write_prompt_trace(folder: str, budget_text: str, ev, off, hot) -> None:
    """DIR/resident-000.jsonl, DIR/budget-auto-000.jsonl, …: one file per prompt and budget."""
    from pathlib import Path

    from ..engine.measure.trace import budget_record, write_trace
    from ..engine.offload import Budget

    trace = ev.trace
    if off is not None:
        trace = trace.with_budget(budget_record(off, hot, Budget.parse(budget_text).auto))
    write_trace(Path(folder) / f"{_trace_tag(budget_text)}-{ev.prompt_index:03d}.jsonl", trace)


def record_storage_in_traces(folder: str, budget_text: str, passes: list[tuple[float, float]]) -> None:
    """Give the budget's traces the disk as read around their run (the median pass), for `project --disk trace`."""
    from pathlib import Path

    from ..engine.measure.trace import record_storage

    if passes:
        reading = storage_reading(passes)
        record_storage(
            sorted(Path(folder).glob(f"{_trace_tag(budget_text)}-*.jsonl")),
            {key: reading[key] for key in ("qd1_gb_s", "qd8_gb_s", "readings")},
        )
