"""What each refinement of s2moe's copy rule pays: s2moe with each one switched off (GenerationConfig.copy_without),
beside the whole rule and plain decoding, on one model, interleaved prompt by prompt.

    .venv/bin/python scripts/copy-ablation.py [-m MODEL.gguf] [--budget SIZE] [--temp T --top-p P --seed S]
        [--prompts humaneval|natural|FILE.jsonl] [--n-prompts N] [-n TOKENS] [--rounds R] [--json OUT.json]
        [--without NAME+NAME ...]

The model is loaded once (under --budget, in a memory cgroup of that size, offloaded as bench offloads it) and
every prompt runs ar, s2moe and s2moe without each refinement (or, with --without, without each named group of
refinements: parts that each pay nothing alone may still pay together), in an order that changes from prompt
to prompt (bench's balanced order), so that drift on the machine reaches every row alike; --rounds repeats the
whole set. One row per variant: decoding tok/s over every run, its ratio to the whole rule and to ar paired
round by round (geometric mean, ± two standard errors over the rounds: engine.measure.speed), and the mean
accepted length.
Each run's tokens are compared with ar's: copies are lossless, so without gating (--reuse-strength 0) every
variant must commit ar's tokens (else the exit status is 1); with gating on, a verification's batch moves
borderline choices, and how many runs differ is only reported.

Under a budget the variants share one expert cache: a prompt's copies find experts that the variant before
them on the same prompt fetched, so a refinement switched off costs less here than in a process of its own
(docs/results.md, "The copy rule, part by part"). Resident, or to find which rows to measure, one process is
enough; a decision to remove a part under a budget is measured with bench, one process per variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from s2moe.engine import offload
from s2moe.engine.decoding.cpu_buffers import choose
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.drafting.copies import COPY_REFINEMENTS
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Summary
from s2moe.engine.files import check_writable, write_atomic
from s2moe.engine.measure.bench import balanced_order, expected_lossless, prompt_seed, warm_up
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.measure.speed import compare
from s2moe.engine.model_info import read_model_info
from s2moe.engine.zoo import default_model_path


def variants(groups: list[frozenset[str]]) -> dict[str, frozenset[str] | None]:
    """Row name → the refinements it switches off (None: plain decoding)."""
    out: dict[str, frozenset[str] | None] = {"ar": None, "s2moe": frozenset()}
    for group in groups:
        out["s2moe -" + "-".join(name for name in COPY_REFINEMENTS if name in group)] = group
    return out


def parse_group(text: str) -> frozenset[str]:
    names = frozenset(part.strip() for part in text.split("+") if part.strip())
    unknown = sorted(names - set(COPY_REFINEMENTS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a group is refinement names joined by '+' ({', '.join(COPY_REFINEMENTS)})"
        )
    return names


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the shipped one)")
    p.add_argument("--budget", default=None, help="memory budget (e.g. 150M, auto); default: resident")
    p.add_argument("--profile", default=None, help="device profile: cost constants and hot experts (else measured)")
    p.add_argument("--prompts", default="humaneval", help="humaneval, natural or a JSONL file (bench's sets)")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("-n", "--n-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=GenerationConfig.top_p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reuse-strength",
        type=float,
        default=GenerationConfig.reuse_strength,
        help="gating's α (default: as shipped; 0 makes every variant lossless)",
    )
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument(
        "--without",
        action="append",
        type=parse_group,
        default=None,
        metavar="NAME+NAME",
        help="a row without this group of refinements (repeatable; default: a row per refinement)",
    )
    return p.parse_args(argv)


def configs(args: argparse.Namespace, dec: Decoder) -> dict[str, GenerationConfig]:
    base = GenerationConfig(
        n_predict=args.n_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        seed=args.seed,
        reuse_strength=args.reuse_strength,
        stop_at_eos=False,
    )
    if args.profile:
        from s2moe.engine.profiles import cost_for_model, load_profile

        base.cost = cost_for_model(
            load_profile(args.profile), dec.info.fingerprint, dec.info.path.name, offloaded=args.budget is not None
        )
    base = base.resolved(dec.info)
    out = {
        name: replace(base, mode="ar") if off is None else replace(base, mode="s2moe", copy_without=off)
        for name, off in args.variants.items()
    }
    for cfg in out.values():
        cfg.validate(dec.info)
    return out


def measure(args: argparse.Namespace, model: str) -> dict:
    _, prompts = load_prompts(args.prompts, args.n_prompts)
    inside = offload.current_budget()
    # the CPU weights' path bench takes: repacked buffers only resident (under a budget they would copy the experts)
    cpu = choose(read_model_info(model), inside is None, on_probe=lambda line: print(line, file=sys.stderr))
    dec = Decoder(model, n_threads=args.threads, max_draft=16, use_extra_bufts=cpu.extra)
    try:
        cfgs = configs(args, dec)
        if inside is not None:
            hot = []
            if args.profile:
                from s2moe.engine.profiles import hot_experts_for_model, load_profile

                hot = hot_experts_for_model(load_profile(args.profile), dec.info.fingerprint)
            offload.offload_decoder(
                dec, inside[1], hot, warm_up=lambda: list(warm_up(dec, cfgs["s2moe"], prompts[0], ["ar", "s2moe"]))
            )
        else:
            list(warm_up(dec, cfgs["s2moe"], prompts[0], ["ar", "s2moe"]))
        names = list(cfgs)
        runs: dict[str, list[Summary]] = {name: [] for name in names}
        with dec.apart_from_session():
            for r in range(args.rounds):
                for pi, prompt in enumerate(prompts):
                    for name in (names[i] for i in balanced_order(len(names), r * len(prompts) + pi)):
                        summary = Summary()
                        for ev in dec.generate(prompt, replace(cfgs[name], seed=prompt_seed(args.seed, pi))):
                            summary.add(ev)
                        runs[name].append(summary)
                    print(f"round {r + 1}/{args.rounds}, prompt {pi + 1}/{len(prompts)} done", file=sys.stderr)
    finally:
        dec.close()
    return figures(runs, cfgs, args, len(prompts))


def figures(
    runs: dict[str, list[Summary]], cfgs: dict[str, GenerationConfig], args: argparse.Namespace, n_prompts: int
) -> dict:
    # a round's speed: its tokens over its decoding seconds, all prompts together; ratios are paired by round
    speed = {
        name: [tok_per_s(summaries[i : i + n_prompts]) for i in range(0, len(summaries), n_prompts)]
        for name, summaries in runs.items()
    }
    rows = []
    for name, summaries in runs.items():
        tokens = sum(s.n_tokens for s in summaries)
        vs_full = compare(name, "s2moe", [a / b for a, b in zip(speed[name], speed["s2moe"]) if b > 0])
        vs_ar = compare(name, "ar", [a / b for a, b in zip(speed[name], speed["ar"]) if b > 0])
        differ = sum(s.tokens != a.tokens for s, a in zip(summaries, runs["ar"]))
        rows.append(
            {
                "variant": name,
                "tok_per_s": tok_per_s(summaries),
                "round_tok_per_s": speed[name],
                "vs_s2moe": [vs_full.ratio, vs_full.low, vs_full.high],
                "vs_s2moe_text": vs_full.ratio_text,
                "vs_ar": [vs_ar.ratio, vs_ar.low, vs_ar.high],
                "vs_ar_text": vs_ar.ratio_text,
                "accept_len": sum(s.accept_len * s.n_tokens for s in summaries) / max(tokens, 1),
                "runs": len(summaries),
                "runs_differing_from_ar": differ,
                "lossless_expected": expected_lossless(cfgs[name].mode, cfgs[name]),
            }
        )
    return {
        "model": str(args.model),
        "budget": args.budget or "none",
        "prompts": args.prompts,
        "n_prompts": n_prompts,
        "n_tokens": args.n_tokens,
        "rounds": args.rounds,
        "temp": args.temp,
        "top_p": args.top_p,
        "seed": args.seed,
        "reuse_strength": args.reuse_strength,
        "rows": rows,
    }


def tok_per_s(summaries: list[Summary]) -> float:
    seconds = sum(s.decode_seconds for s in summaries)
    return sum(s.n_tokens for s in summaries) / seconds if seconds > 0 else 0.0


def report(data: dict) -> None:
    print(
        f"{data['model']} · budget {data['budget']} · temp {data['temp']} · {data['n_prompts']} prompts × "
        f"{data['rounds']} rounds · {data['n_tokens']} tokens"
    )
    width = max(len(row["variant"]) for row in data["rows"]) + 2
    print(f"{'variant':<{width}}{'tok/s':>8}  {'vs s2moe':>14}  {'vs ar':>14}  {'accept':>6}  tokens vs ar")
    for row in data["rows"]:
        differ, n = row["runs_differing_from_ar"], row["runs"]
        check = (
            f"{differ}/{n} differ"
            if not row["lossless_expected"] or row["variant"] == "ar"
            else f"all {n} equal"
            if not differ
            else f"{differ}/{n} DIFFER (copies must be lossless)"
        )
        print(
            f"{row['variant']:<{width}}{row['tok_per_s']:>8.2f}  {row['vs_s2moe_text']:>14}  {row['vs_ar_text']:>14}  "
            f"{row['accept_len']:>6.2f}  {check}"
        )


def main(argv: list[str]) -> int:
    args = parse(argv)
    args.variants = variants(args.without or [frozenset({name}) for name in COPY_REFINEMENTS])
    args.model = str(args.model or default_model_path())
    try:
        if args.rounds < 1 or args.n_prompts < 1 or args.n_tokens < 1:
            raise ConfigError("--rounds, --n-prompts and -n must each be at least 1")
        if args.json:
            check_writable(args.json, "figures")  # before the run, not after it
        if args.budget is not None and offload.current_budget() is None:
            # this script again, inside a memory cgroup of the budget: it finds itself there and offloads
            with offload.run_in_budget(
                [sys.executable, __file__, *argv], offload.Budget.parse(args.budget), args.model, tag="ablation"
            ) as run:
                return run.wait()
        data = measure(args, args.model)
        report(data)
        if args.json:
            write_atomic(args.json, json.dumps(data, indent=1) + "\n", "figures")
    except ConfigError as e:
        print(f"copy-ablation: {e}", file=sys.stderr)
        return 2
    lossy = [row["variant"] for row in data["rows"] if row["lossless_expected"] and row["runs_differing_from_ar"]]
    return 1 if lossy else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
