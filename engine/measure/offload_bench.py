"""Offloading benchmark: decoding speed under a memory budget, interleaved A/B runs.

    python -m s2moe.engine.measure.offload_bench --model M.gguf [--profile NAME] [--budget SIZE] [--rounds 3]
        [--prompts humaneval] [--n-prompts 3] [--tokens 32] [--threads 1] [--out results.json]

Each run decodes the first --n-prompts prompts of the set (bench's sets: humaneval, natural or a JSONL file),
--tokens tokens each, greedily: one prompt's greedy continuation of a small model soon repeats itself and
reuses a few experts, which would leave little to fetch.

Each run is a fresh process in a fresh memory cgroup, started after the model file was dropped from the
page cache, so every arm starts cold. Arms (run in rotating order each round, so slow drifts of a loaded
machine hit every arm alike):
    ar/none       plain decoding, nothing pinned
    ar/base       plain decoding, non-expert weights + llama/ggml code pinned
    ar/hot        ... + hot experts (from the profile) pinned
    ar/wts, ar/hot-code   (not run by default) as ar/base, ar/hot without pinning library code
    spec/hot      self-speculation (fixed draft length, gating off: lossless), base + hot pinned, no prefetch
    spec/hot+pf   ... + prefetch of the draft's predicted experts (madvise WILLNEED, pass by pass)
    ar/hot+jit, spec/hot+jit, spec/hot+jit+pf   the same with the routing hook's just-in-time prefetch
    spec/hot+jit+ahead   ... verification asking for layer L+1's predicted experts as layer L routes
    spec/hot+jit+fetch   ... 8 reader threads fetching each verification's predicted experts ahead of it
    ar/hot+jit-by-expert, spec/hot+jit-by-expert   as +jit, a layer's experts asked for expert by expert
                  instead of part by part in the order the matmuls use them (no staged reads then)
The default budget is `--budget auto` of bench and the app (offload.auto_budget_bytes), measured once in a
probe run with the non-expert weights and code pinned: everything its cgroup holds after decoding a few
tokens (anonymous memory, pinned weights, library and interpreter file pages) except expert pages, plus one
third of the expert bytes. Every arm then runs under that same budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from ..errors import ConfigError, S2MoEError
from ..files import write_atomic

ARMS = {
    "ar/none": dict(mode="ar", pin_base=False, pin_hot=False, prefetch=False),
    "ar/base": dict(mode="ar", pin_base=True, pin_hot=False, prefetch=False),
    "ar/hot": dict(mode="ar", pin_base=True, pin_hot=True, prefetch=False),
    "ar/wts": dict(mode="ar", pin_base=True, pin_hot=False, prefetch=False, pin_code=False),
    "ar/hot-code": dict(mode="ar", pin_base=True, pin_hot=True, prefetch=False, pin_code=False),
    "spec/hot": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=False),
    "spec/hot+pf": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=True),
    # just-in-time prefetch from the routing hook (the default of offload_decoder)
    "ar/hot+jit": dict(mode="ar", pin_base=True, pin_hot=True, prefetch=False, jit=True),
    "spec/hot+jit": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=False, jit=True),
    # ... + each draft pass's newly predicted experts asked for while the draft goes on
    "spec/hot+jit+pf": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=True, jit=True),
    # ... verification asking for layer L+1's predicted experts as layer L routes
    "spec/hot+jit+ahead": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=False, jit=True, ahead=True),
    # ... reader threads fetching each verification's predicted experts, 8 at a time, ahead of its layers
    "spec/hot+jit+fetch": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=False, jit=True, fetch=8),
    # ... a layer's experts asked for whole, one after another, not part by part in the matmuls' order
    "ar/hot+jit-by-expert": dict(mode="ar", pin_base=True, pin_hot=True, prefetch=False, jit=True, in_order=False),
    "spec/hot+jit-by-expert": dict(mode="s2moe", pin_base=True, pin_hot=True, prefetch=False, jit=True, in_order=False),
}


def _worker(cfg: dict[str, Any]) -> int:
    import numpy as np

    from ..decoding.decoder import Decoder
    from ..decoding.generation_config import GenerationConfig
    from ..events import Summary
    from ..offload import (
        Budget,
        Pinning,
        auto_budget_bytes,
        current_budget_cgroup,
        expert_map,
        offload_decoder,
        process_anon_bytes,
    )

    t0 = time.perf_counter()
    # a token takes at least a byte of the prompt: room for the longest and what is generated after it
    n_ctx = max(256, max(len(p.encode()) for p in cfg["prompts"]) + cfg["tokens"] + 8)
    dec = Decoder(cfg["model"], n_ctx=n_ctx, n_threads=cfg["threads"], max_draft=8, use_extra_bufts=False)
    pinning = Pinning(
        base=cfg["pin_base"],
        code=cfg.get("pin_code", True),
        hot=cfg["pin_hot"],
        jit_prefetch=cfg.get("jit", False),
        predicted_prefetch=cfg["prefetch"],
        lookahead=cfg.get("ahead", False),
        fetch_workers=cfg.get("fetch", 0),
        parts_in_order=cfg.get("in_order", True),
        fetch_room_share=cfg.get("fetch_room", 0.5),
    )
    budget = None if cfg.get("budget") is None else Budget(cfg["budget"])
    if budget is None:  # the probe: what it holds must include what a budget's plan counts (offload_decoder)
        dec.rt.touch_largest_batch()
    off = offload_decoder(dec, budget, [tuple(p) for p in cfg.get("hot", [])], pinning=pinning)
    load_s = time.perf_counter() - t0
    gc = GenerationConfig(
        mode=cfg["mode"],
        n_predict=cfg["tokens"],
        utility=False,
        draft_max=cfg["draft_max"],
        reuse_strength=0.0,
        stop_at_eos=False,
    )
    runs = []
    for prompt in cfg["prompts"]:
        s = Summary()
        for ev in dec.generate(prompt, gc):
            s.add(ev)
        runs.append(s)
    # decoding only, as bench times it: a prompt's prefill under a budget reads most of the experts
    n_tokens, seconds = sum(s.n_tokens for s in runs), sum(s.decode_seconds for s in runs)
    cg = current_budget_cgroup()
    hr = off.stats.hit_rate()
    out = {
        "tok_s": n_tokens / seconds if seconds > 0 else 0.0,
        "seconds": seconds,
        "n_tokens": n_tokens,
        "load_s": load_s,
        "accept_len": sum(s.accept_len * s.n_tokens for s in runs) / max(1, n_tokens),
        "pinned": off.pinned_split,
        "anon": process_anon_bytes(),
        "hit_rate": None if not np.isfinite(hr).any() else float(np.nanmean(hr)),
        "fault_readahead": off.fault_readahead,
        "prefetched_bytes": off.stats.prefetched_bytes,
        "fetched": off.fetch_stats(),
        "peak": cg.peak() if cg else None,
        "split": cg.split() if cg else None,
        "plan": off.plan.__dict__ if off.plan else None,
        "tokens": [list(s.tokens) for s in runs],
        "auto_budget": auto_budget_bytes(cg, expert_map(cfg["model"])) if cg else None,
    }
    print(json.dumps(out))
    off.close()
    dec.close()
    return 0


PROBE_PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _run_arm(model: str | os.PathLike[str], budget: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import subprocess

    from ..offload import Budget, run_in_budget

    argv = [sys.executable, "-m", "s2moe.engine.measure.offload_bench", "--worker", json.dumps(cfg)]
    with run_in_budget(
        argv, Budget(budget), model, tag="bench", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        out, err = run.proc.communicate()
        if run.proc.returncode != 0:
            return {
                "error": (err.strip().splitlines() or [f"exit {run.proc.returncode}"])[-1],
                "oom": run.cgroup.oom_kills(),
            }
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def auto_budget(model: str | os.PathLike[str], threads: int | None = None) -> int:
    """The offloaded regime's budget (offload.auto_budget_bytes), measured in a child that decoded a few
    tokens with the non-expert weights and library code pinned and no limit."""
    base = dict(model=str(model), threads=threads, tokens=4, draft_max=4, hot=[], prompts=[PROBE_PROMPT])
    probe = _run_arm(str(model), 64 << 30, dict(base, **ARMS["ar/base"], budget=None))
    if "error" in probe:
        raise RuntimeError(f"budget probe failed: {probe['error']}")
    return int(probe["auto_budget"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--model")
    ap.add_argument("--profile")
    ap.add_argument("--budget", help="a size, or auto (the default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default="humaneval", help='humaneval | natural | a JSONL file with a "prompt" field')
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--arms", default="ar/none,ar/base,ar/hot,spec/hot,spec/hot+pf")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(json.loads(a.worker))
    try:
        return _compare(a)
    except S2MoEError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _compare(a: argparse.Namespace) -> int:
    from ..model_info import read_model_info
    from ..offload import expert_map, fmt_bytes, parse_size
    from ..profiles import hot_experts_for_model, load_profile
    from .prompts import load_prompts

    unknown = [arm for arm in a.arms.split(",") if arm not in ARMS]
    if unknown:
        raise ConfigError(f"unknown arm {unknown[0]!r}: choose from {', '.join(ARMS)}")
    info = read_model_info(a.model)
    emap = expert_map(a.model)
    hot = hot_experts_for_model(load_profile(a.profile), info.fingerprint) if a.profile else []
    if a.n_prompts < 1 or a.tokens < 1:
        raise ConfigError("--n-prompts and --tokens take a positive number")
    _, prompts = load_prompts(a.prompts, a.n_prompts)
    base = dict(
        model=a.model,
        threads=a.threads,
        tokens=a.tokens,
        draft_max=a.draft_max,
        hot=[list(p) for p in hot],
        prompts=prompts,
    )
    if a.budget and a.budget.strip().lower() != "auto":
        budget = parse_size(a.budget)
    else:
        try:
            budget = auto_budget(a.model, a.threads)
        except RuntimeError as e:
            print(str(e), file=sys.stderr)
            return 1
    print(
        f"model {info.path.name}: experts {fmt_bytes(emap.total_expert_bytes)}, other weights "
        f"{fmt_bytes(emap.non_expert_bytes)}; budget {fmt_bytes(budget)}; hot experts in profile {len(hot)}",
        file=sys.stderr,
    )
    arms = a.arms.split(",")
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in arms}
    for r in range(a.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for arm in order:
            cfg = dict(base, **ARMS[arm], budget=budget)
            res = _run_arm(a.model, budget, cfg)
            results[arm].append(res)
            if "error" in res:
                print(f"round {r + 1} {arm:12s} failed: {res['error']} (oom kills {res.get('oom')})", file=sys.stderr)
            else:
                hr = f"{res['hit_rate']:.0%}" if res["hit_rate"] is not None else "-"
                print(
                    f"round {r + 1} {arm:12s} {res['tok_s']:7.2f} tok/s  accept {res['accept_len']:.2f}  hit {hr}  "
                    f"peak {fmt_bytes(res['peak'] or 0)}  load {res['load_s']:.1f}s"
                    + (f"  fetched {res['fetched']}" if res.get("fetched") else ""),
                    file=sys.stderr,
                )
    summary = {}
    for arm, runs in results.items():
        ok = [x["tok_s"] for x in runs if "error" not in x]
        summary[arm] = {"median_tok_s": statistics.median(ok) if ok else None, "runs": ok}

    def ratio(x: str, y: str) -> tuple[float | None, list[float]]:
        """Median over rounds of per-round ratios (each pair ran back to back)."""
        rs = [
            p["tok_s"] / q["tok_s"]
            for p, q in zip(results.get(x, []), results.get(y, []))
            if "error" not in p and "error" not in q and q["tok_s"] > 0
        ]
        return (statistics.median(rs), rs) if rs else (None, [])

    ratios = {
        f"{x} vs {y}": ratio(x, y)
        for x, y in (
            ("ar/hot", "ar/base"),
            ("ar/base", "ar/none"),
            ("ar/hot", "ar/none"),
            ("spec/hot+pf", "spec/hot"),
            ("spec/hot", "ar/hot"),
            ("spec/hot+pf", "ar/hot"),
            ("ar/hot+jit", "ar/hot"),
            ("spec/hot+jit", "spec/hot+pf"),
            ("spec/hot+jit", "ar/hot+jit"),
            ("spec/hot+jit+pf", "spec/hot+jit"),
            ("spec/hot+jit+pf", "ar/hot+jit"),
            ("spec/hot+jit+ahead", "spec/hot+jit"),
            ("spec/hot+jit+ahead", "ar/hot+jit"),
            ("spec/hot+jit+fetch", "spec/hot+jit"),
            ("spec/hot+jit+fetch", "ar/hot+jit"),
        )
    }
    for k, (m, rs) in ratios.items():
        if m is not None:
            print(f"{k:28s} {m:.2f}×  (rounds: {', '.join(f'{x:.2f}' for x in rs)})")
    for arm, s in summary.items():
        if s["median_tok_s"] is not None:
            print(f"{arm:12s} median {s['median_tok_s']:.2f} tok/s")
    if a.out:
        write_atomic(
            a.out,
            json.dumps(
                {
                    "budget": budget,
                    "results": results,
                    "summary": summary,
                    "ratios": {k: v[0] for k, v in ratios.items()},
                },
                indent=1,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
