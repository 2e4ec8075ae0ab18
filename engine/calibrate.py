"""Device calibration: measure the constants S²-MoE decides with, and write them as a device profile.

run_calibration() is a generator of typed events; `s2moe calibrate` and the app's wizard both consume it:

    StepStarted(index, total, name, description)
    StepProgress(index, done, total)            # any number, per step
    StepResult(index, name, summary, data)      # one per step; summary is one line
    ...
    CalibrationDone(profile, path)              # path None when save=False

Steps: (1) memory and storage bandwidth, (2) plain and draft step cost, (3) verification cost model
(T_exp, T_tok by regression; data has measured/predicted/r2/mape), (4) hot experts from routing
frequencies over calibration prompts, (5) cost under the memory budget (in a memory cgroup; skipped with
the reason when there is no --budget or no cgroup can be made), (6) the profile, written atomically.

Stopping: when should_stop() returns True the generator stops between two measurements and simply
returns: it yields nothing more (no CalibrationDone) and writes nothing. Ctrl-C (KeyboardInterrupt)
propagates after the same clean-up. In both cases no profile file is created or changed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .costmodel import (Stopped, fault_explained_fit, fit_miss_cost, fit_verify_cost, iter_time_steps, iter_verify_samples, time_steps,
                        verify_samples)
from .device import cpu_name, memory_bytes
from .errors import ConfigError, ModelError
from .model_info import read_model_info
from .offload import (AUTO_START_LIMIT, BudgetUnavailable, MemoryCgroup, ModelMapping, _rank_counts,
                      drop_file_cache, expert_map, fmt_bytes, plan_budget, process_anon_bytes, select_hot_experts)
from .profiles import SCHEMA_VERSION, check_name, find_profile, load_profile, save_profile

DEFAULT_NAME = "local"
DRAFT_TOPK = 2
DRAFT_CAP = 8
# budget_bytes="auto": the cold worker sizes the budget the way bench and the app do
# (offload.offload_in_cgroup)
AUTO = "auto"
DEFAULT_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Why is the sky blue during the day and red at sunset?\nAnswer:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The mitochondria is an organelle found in most eukaryotic cells. Its main function is",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The crew",
    "import numpy as np\n\ndef normalize(x):\n",
    "Summary of the meeting: the team agreed to postpone the release because",
)


@dataclass(frozen=True)
class StepStarted:
    index: int
    total: int
    name: str
    description: str


@dataclass(frozen=True)
class StepProgress:
    index: int
    done: int
    total: int


@dataclass(frozen=True)
class StepResult:
    index: int
    name: str
    summary: str
    data: dict


@dataclass(frozen=True)
class CalibrationDone:
    profile: dict
    path: Path | None


STEPS = (
    ("bandwidth", "memory bandwidth and storage bandwidth (cold reads of expert slices)"),
    ("steps", "T_AR (median plain decoding step) and draft step cost"),
    ("cost model", "T_exp and T_tok: regression of verification latency on distinct experts and tokens"),
    ("hot experts", "routing frequencies over calibration prompts; the most routed experts that fit the budget"),
    ("budget", "verification cost under the memory budget (experts paged from storage), in a memory cgroup"),
    ("profile", "write the profile atomically"),
)


NAMED_PROMPT_SETS = ("humaneval", "natural")
NAMED_SET_PROMPTS = 32  # enough to rank the experts a workload uses; a few seconds on small models


def read_prompts(path: str | os.PathLike | None) -> list[str]:
    """Calibration prompts: the built-in mix (None), a named set bench also uses ('humaneval' for code
    models: measured on the shipped model, hot experts chosen from code cover 68% of a HumanEval
    workload's routings against 65% from the built-in prompts), or a text file with prompts separated by
    blank lines (or one per line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if str(path) in NAMED_PROMPT_SETS and not Path(path).exists():
        from .bench import load_prompts

        return list(load_prompts(str(path), NAMED_SET_PROMPTS)[1])
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {p} is not UTF-8 text") from None
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    if len(blocks) == 1:
        blocks = [line.strip() for line in text.splitlines() if line.strip()]
    if not blocks:
        raise ConfigError(f"prompts file {p} has no prompts")
    return blocks


def device_name(n_threads: int) -> str:
    return f"{cpu_name()} ({n_threads} threads)"


# -- measurements -------------------------------------------------------------------------------------------
def memory_bandwidth(size: int = 64 << 20, repeats: int = 5):
    """Generator (yields (done, total)); returns bytes per second of a large in-memory copy (read + write)."""
    src = np.ones(size // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
        yield i + 1, repeats
    return 2 * size / float(np.median(times))


def storage_bandwidth(emap, *, max_bytes: int = 256 << 20, seed: int = 0):
    """Generator (yields (done, total)); returns (bytes per second or None, bytes read, note) of cold
    reads of expert slices, the file dropped from the page cache first."""
    drop_file_cache(emap.path)
    mapping = ModelMapping(emap)
    try:
        resident = mapping.expert_residency()
    finally:
        mapping.close()
    rng = np.random.default_rng(seed)
    pairs = [(l, e) for l in emap.moe_layers for e in range(emap.n_expert) if resident[l, e] < 0.01]
    if not pairs:
        return None, 0, "the model file stays in the page cache (mapped by another process?)"
    rng.shuffle(pairs)
    per_expert = int(emap.expert_bytes.max())
    pairs = pairs[: max(1, min(len(pairs), max_bytes // max(per_expert, 1)))]
    fd = os.open(str(emap.path), os.O_RDONLY)
    total, elapsed = 0, 0.0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: count what we ask for
        for i, (layer, expert) in enumerate(pairs):
            for off, n in emap.expert_ranges(layer, expert):
                t0 = time.perf_counter()
                got = len(os.pread(fd, n, off))
                elapsed += time.perf_counter() - t0
                total += got
            yield i + 1, len(pairs)
    finally:
        os.close(fd)
    drop_file_cache(emap.path)
    if elapsed <= 0:
        return None, total, "reads took no measurable time"
    return total / elapsed, total, f"{len(pairs)} experts"


def routing_counts(rt, prompts: list[str], *, gen_tokens: int = 16):
    """Generator (yields (done, total)); returns ([n_layer, n_expert] how often each expert was routed to
    over the prompts and a short greedy continuation of each, tokens seen)."""
    info, hook = rt.info, rt.hook
    counts = np.zeros((info.n_layer, info.n_expert), np.int64)
    n_tokens = 0
    chunk = max(1, hook.max_rows)
    for i, prompt in enumerate(prompts):
        toks = rt.tokenize(prompt)[: max(1, rt.n_ctx - gen_tokens - 1)]
        rt.kv_clear()
        pos = 0
        logits = None
        hook.observe()
        for j in range(0, len(toks), chunk):
            part = toks[j : j + chunk]
            logits = rt.decode(part, pos, "all")
            _count(counts, hook.snapshot(len(part)), info.n_expert)
            pos += len(part)
        for _ in range(gen_tokens):
            t = int(np.argmax(logits[-1]))
            if rt.is_eog(t):
                break
            logits = rt.decode([t], pos, "all")
            _count(counts, hook.snapshot(1), info.n_expert)
            pos += 1
        n_tokens += pos
        yield i + 1, len(prompts)
    rt.kv_clear()
    hook.off()
    return counts, n_tokens


def _count(counts: np.ndarray, routing, n_expert: int) -> None:
    ids = routing.orig.reshape(counts.shape[0], -1)
    for layer in range(counts.shape[0]):
        row = ids[layer]
        row = row[(row >= 0) & (row < n_expert)]
        counts[layer] += np.bincount(row, minlength=n_expert)[:n_expert]


def _fit_dict(fit) -> dict:
    return {"intercept_ms": round(fit.intercept * 1e3, 6), "t_exp_ms": round(fit.t_exp * 1e3, 6),
            "t_tok_ms": round(fit.t_tok * 1e3, 6), "r2": round(float(fit.r2), 6), "mape": round(float(fit.mape), 6),
            "n": int(fit.n)}


def _fit_data(samples, fit) -> dict:
    measured = [s[2] * 1e3 for s in samples]
    predicted = [float(fit.predict(s[0], s[1])) * 1e3 for s in samples]
    return {"measured": measured, "predicted": predicted, "experts": [s[0] for s in samples],
            "tokens": [s[1] for s in samples], "r2": fit.r2, "mape": fit.mape,
            "intercept_ms": fit.intercept * 1e3, "t_exp_ms": fit.t_exp * 1e3, "t_tok_ms": fit.t_tok * 1e3}


# -- the cold (budget) worker ----------------------------------------------------------------------------------
def _cold_worker(cfg: dict) -> int:
    """Runs inside the budget cgroup (python -m s2moe.engine.calibrate --cold-worker JSON): loads the model
    mmap-backed, pins non-expert weights, code and hot experts, and times verification batches."""
    from types import SimpleNamespace

    from .offload import attach_offloading, current_budget_cgroup, offload_in_cgroup
    from .runtime import LlamaRuntime

    def emit(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    info = read_model_info(cfg["model"])
    rt = LlamaRuntime(info, n_ctx=256, n_threads=cfg.get("threads"), max_verify_rows=cfg["cap"] + 1,
                      use_extra_bufts=False)
    # what offloading needs of a decoder; with rt its routing hook prefetches just in time and counts
    # misses, as it does when decoding
    holder = SimpleNamespace(info=info, rt=rt, before_verify=None, _measured={})
    hot = [tuple(p) for p in cfg.get("hot", [])]
    plan = None
    if cfg.get("budget") is None:
        # --budget auto: sized from what this process holds once every graph shape it will time has run
        def warm_up():
            time_steps(rt, cfg["k_draft"], 1, seed=4)
            verify_samples(rt, cfg["cap"], seed=4, repeats=1, sizes=[cfg["cap"] + 1])

        off, budget = offload_in_cgroup(holder, current_budget_cgroup(), None, hot, warm_up)
        emit({"budget": budget})
    else:
        off, plan = attach_offloading(holder, cfg["budget"], hot, prefetch=False)
    pinned = dict(off.pinned_split)
    emit({"pinned": pinned})
    ar, draft = time_steps(rt, cfg["k_draft"], cfg["n_steps"], seed=5,
                       progress=lambda d, t: emit({"progress": [d, t + cfg["n_samples"]]}))
    samples = verify_samples(rt, cfg["cap"], seed=6, repeats=cfg["repeats"], sizes=_sizes(cfg["cap"]),
                             counter=off.native,
                             progress=lambda d, t: emit({"progress": [cfg["n_steps"] + d, cfg["n_steps"] + t]}))
    cg = current_budget_cgroup()
    emit({"result": {"samples": samples, "t_ar": float(np.median(ar)), "c_draft": float(np.median(draft)),
                     "pinned": pinned,
                     "plan": plan.__dict__ if plan else None,
                     "split": cg.split() if cg else None, "peak": cg.peak() if cg else None,
                     "anon": process_anon_bytes()}})
    off.close()
    rt.close()
    return 0


def _run_cold(model_path, budget: int, cfg: dict):
    """Generator (yields (done, total)): the cold worker in a fresh memory cgroup; returns its result,
    with the budget it ran under (cfg budget None: the worker sized it, and `budget` is only the start
    limit)."""
    cg = MemoryCgroup.create(budget, "calibrate")
    proc = None
    try:
        drop_file_cache(model_path)
        argv = [sys.executable, "-m", "s2moe.engine.calibrate", "--cold-worker", json.dumps(cfg)]
        proc = cg.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        result, pinned, sized = None, None, None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "progress" in msg:
                yield tuple(msg["progress"])
            elif "result" in msg:
                result = msg["result"]
            elif "pinned" in msg:
                pinned = msg["pinned"]
            elif "budget" in msg:
                sized = budget = int(msg["budget"])
        rc = proc.wait()
        if result is None:
            err = (proc.stderr.read() or "").strip().splitlines()
            why = err[-1] if err else f"exit status {rc}"
            if cg.oom_kills() > 0 or rc in (-9, 137):
                why = (f"out of memory at the budget of {fmt_bytes(budget)} (pinned {fmt_bytes(sum((pinned or {}).values()))}); "
                       "raise --budget")
            raise RuntimeError(why)
        result["budget"] = sized if sized is not None else budget
        return result
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cg.remove()


# -- the generator ---------------------------------------------------------------------------------------------
def run_calibration(model_path, *, budget_bytes: int | None = None, prompts=None, name: str | None = None,
                    save: bool = True, n_threads: int | None = None,
                    should_stop: Callable[[], bool] | None = None, repeats: int = 3,
                    draft_topk: int = DRAFT_TOPK, draft_cap: int = DRAFT_CAP) -> Iterator[object]:
    """Calibrate model_path on this device; yield StepStarted/StepProgress/StepResult…, CalibrationDone.

    prompts: list of strings, a path to a prompts file, or None for the built-in prompts.
    should_stop: polled between measurements; when it returns True the generator returns without
    yielding anything more and without writing a profile (see the module docstring)."""
    from .runtime import LlamaRuntime, default_threads

    name = check_name(name or DEFAULT_NAME)
    auto = budget_bytes == AUTO
    if budget_bytes is not None and not auto and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ConfigError("--budget must be a positive size or auto")
    info = read_model_info(model_path)
    if not info.is_moe:
        raise ModelError(f"{info.path.name} is a dense model: calibration measures Mixture-of-Experts costs")
    if draft_topk >= info.n_expert_used:
        draft_topk = max(1, info.n_expert_used // 2)
    prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else read_prompts(prompts)
    threads = n_threads or default_threads()
    emap = expert_map(info.path)
    total = len(STEPS)
    stop = should_stop or (lambda: False)

    def live(gen, index):
        """Pass a measurement's progress on as events; stop between measurements when asked."""
        while True:
            try:
                done, of = next(gen)
            except StopIteration as e:
                return e.value
            yield StepProgress(index, int(done), int(of))
            if stop():
                gen.close()
                raise Stopped()

    rt = None
    try:
        # 1 -- bandwidth --------------------------------------------------------------------------------
        yield StepStarted(1, total, *STEPS[0])
        mem_bw = yield from live(memory_bandwidth(), 1)
        sto_bw, sto_bytes, note = yield from live(storage_bandwidth(emap), 1)
        sto_text = f"{sto_bw / 1e9:.2f} GB/s over {fmt_bytes(sto_bytes)} ({note})" if sto_bw else f"not measured: {note}"
        yield StepResult(1, STEPS[0][0], f"memory {mem_bw / 1e9:.1f} GB/s · storage {sto_text}",
                         {"memory_bandwidth_gb_s": mem_bw / 1e9, "storage_bandwidth_gb_s": sto_bw / 1e9 if sto_bw else None,
                          "storage_bytes_read": sto_bytes})
        if stop():
            return

        # 2 -- plain and draft steps ----------------------------------------------------------------------
        yield StepStarted(2, total, *STEPS[1])
        rt = LlamaRuntime(info, n_ctx=512, n_threads=threads, max_verify_rows=max(16, draft_cap + 1),
                          use_extra_bufts=budget_bytes is None)
        n_steps = 8 * repeats
        ar, draft = yield from live(iter_time_steps(rt, draft_topk, n_steps), 2)
        t_ar, c_draft = float(np.median(ar)), float(np.median(draft))
        yield StepResult(2, STEPS[1][0], f"T_AR {t_ar * 1e3:.2f} ms · draft step (k_d={draft_topk}) {c_draft * 1e3:.2f} ms "
                         f"({c_draft / t_ar:.2f}× T_AR)",
                         {"t_ar_ms": t_ar * 1e3, "c_draft_ms": c_draft * 1e3, "draft_topk": draft_topk,
                          "plain_ms": [x * 1e3 for x in ar], "draft_ms": [x * 1e3 for x in draft]})
        if stop():
            return

        # 3 -- verification cost model -------------------------------------------------------------------
        yield StepStarted(3, total, *STEPS[2])
        samples = yield from live(iter_verify_samples(rt, draft_cap, seed=1, repeats=repeats,
                                                      sizes=_sizes(draft_cap)), 3)
        fit = fit_verify_cost([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])
        yield StepResult(3, STEPS[2][0],
                         f"T_exp {fit.t_exp * 1e3:.4f} ms · T_tok {fit.t_tok * 1e3:.3f} ms · intercept "
                         f"{fit.intercept * 1e3:.2f} ms · R² {fit.r2:.3f} · MAPE {fit.mape:.1%} ({fit.n} batches)",
                         _fit_data(samples, fit))
        if stop():
            return

        # 4 -- hot experts -------------------------------------------------------------------------------
        yield StepStarted(4, total, *STEPS[3])
        counts, n_tok = yield from live(routing_counts(rt, prompt_list), 4)
        eb = emap.expert_bytes
        # The ranking: most routed first, up to half of the expert bytes. A decoding process under a budget
        # pins the longest prefix that fits its own plan (offload.attach_offloading).
        hot = select_hot_experts(counts, eb, emap.total_expert_bytes // 2)
        plan = None
        fit_text = ""
        if auto:
            fit_text = " · how many fit is decided in step 5, once the budget is sized"
        elif budget_bytes is not None:
            code = ModelMapping.resident_code_bytes()
            plan = plan_budget(budget_bytes, anon_bytes=process_anon_bytes(),
                               base_bytes=sum(n for _, n in emap.pinnable()) + code, emap=emap, k=info.n_expert_used)
            n_fit = len(select_hot_experts(_rank_counts(hot, emap), eb, plan.hot_bytes))
            fit_text = f" · {n_fit} of them fit {plan.describe()} (this process)"
        routed = counts.sum()
        share = float(sum(counts[l, e] for l, e in hot) / routed) if routed else 0.0
        yield StepResult(4, STEPS[3][0],
                         f"{len(hot)} most routed experts ({fmt_bytes(sum(int(eb[l]) for l, _ in hot))}, half of the "
                         f"expert bytes) take {share:.0%} of {int(routed)} routings over {n_tok} tokens{fit_text}",
                         {"hot_experts": [list(p) for p in hot], "counts": counts.tolist(), "routed_share": share,
                          "plan": plan.__dict__ if plan else None, "tokens": n_tok})
        if stop():
            return

        # 5 -- under the budget ------------------------------------------------------------------------
        yield StepStarted(5, total, *STEPS[4])
        cold = None
        if budget_bytes is None:
            skip = "skipped: no --budget given"
        else:
            skip = MemoryCgroup.unavailable_reason()
        if skip is None:
            rt.close()
            rt = None
            cfg = {"model": str(info.path), "threads": threads, "k_draft": draft_topk, "cap": draft_cap,
                   "repeats": repeats, "n_steps": 4 * repeats, "n_samples": 0,
                   "hot": [list(p) for p in hot], "budget": None if auto else budget_bytes}
            cfg["n_samples"] = len(_sizes(draft_cap)) * 3 * repeats
            try:
                res = yield from live(_run_cold(info.path, AUTO_START_LIMIT if auto else budget_bytes, cfg), 5)
            except (BudgetUnavailable, RuntimeError) as e:
                skip = f"failed: {e}"
                res = None
            if res is not None:
                budget_bytes = res["budget"]
                cs = [tuple(s) for s in res["samples"]]
                cfit = fit_verify_cost([s[0] for s in cs], [s[1] for s in cs], [s[2] for s in cs])
                mfit = fit_miss_cost([s[0] for s in cs], [s[3] for s in cs], [s[1] for s in cs], [s[2] for s in cs])
                given = fault_explained_fit([s[0] for s in cs], [s[4] for s in cs], [s[1] for s in cs],
                                            [s[2] for s in cs])
                cold = {"fit": cfit, "miss_fit": mfit, "given_faults": given, "t_ar": res["t_ar"],
                        "c_draft": res["c_draft"],
                        "split": res["split"],
                        "peak": res["peak"], "pinned": res["pinned"], "samples": cs}
                # the plot and headline use the miss-aware model: under a budget what costs is a fetch
                data = {"measured": [s[2] * 1e3 for s in cs],
                        "predicted": [float(mfit.predict(s[0], s[3], s[1])) * 1e3 for s in cs],
                        "experts": [s[0] for s in cs], "misses": [s[3] for s in cs], "tokens": [s[1] for s in cs],
                        "r2": mfit.r2, "mape": mfit.mape, "t_exp_warm_ms": mfit.t_hit * 1e3,
                        "t_exp_cold_ms": mfit.t_miss * 1e3, "t_tok_ms": mfit.t_tok * 1e3,
                        "intercept_ms": mfit.intercept * 1e3, "paper_form": _fit_data(cs, cfit),
                        "t_ar_ms": res["t_ar"] * 1e3, "c_draft_ms": res["c_draft"] * 1e3,
                        "split": res["split"], "peak": res["peak"],
                        "pinned": res["pinned"], "r2_given_faults": given["r2"],
                        "faults": [s[4] for s in cs]}
                miss_rate = sum(s[3] for s in cs) / max(1.0, sum(s[0] for s in cs))
                yield StepResult(5, STEPS[4][0],
                                 f"under {fmt_bytes(budget_bytes)}{' (auto)' if auto else ''}: T_AR {res['t_ar'] * 1e3:.1f} ms · draft step "
                                 f"{res['c_draft'] * 1e3:.1f} ms · T_exp cold "
                                 f"{mfit.t_miss * 1e3:.3f} ms, warm {mfit.t_hit * 1e3:.3f} ms · T_tok "
                                 f"{mfit.t_tok * 1e3:.2f} ms · R² {mfit.r2:.3f} · MAPE {mfit.mape:.1%} · "
                                 f"{miss_rate:.0%} of experts missed · per distinct expert {cfit.t_exp * 1e3:.3f} ms "
                                 f"(R² {cfit.r2:.3f}) · given the storage faults taken, R² {given['r2']:.3f} · "
                                 f"peak {fmt_bytes(res['peak'] or 0)}", data)
        if cold is None:
            derived = "; cold T_exp derived from storage bandwidth" if sto_bw else ""
            yield StepResult(5, STEPS[4][0], f"{skip}{derived}", {"skipped": skip})
        if stop():
            return

        # 6 -- the profile -------------------------------------------------------------------------
        yield StepStarted(6, total, *STEPS[5])
        mean_eb = float(eb[list(emap.moe_layers)].mean())
        if cold is not None:
            t_exp_cold, cold_how = cold["miss_fit"].t_miss * 1e3, "measured under the budget"
        elif sto_bw:
            t_exp_cold, cold_how = mean_eb / sto_bw * 1e3, "derived: expert bytes / storage bandwidth"
        else:
            t_exp_cold, cold_how = None, "unknown"
        block = {
            "model": info.path.name,
            "arch": info.arch,
            "n_layer": info.n_layer,
            "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used,
            "expert_bytes": int(round(mean_eb)),
            "draft_topk": draft_topk,
            "t_ar_ms": round(t_ar * 1e3, 6),
            "c_draft_ms": round(c_draft * 1e3, 6),
            "t_exp_ms": round(fit.t_exp * 1e3, 6),
            "t_exp_cold_ms": None if t_exp_cold is None else round(t_exp_cold, 6),
            "t_tok_ms": round(fit.t_tok * 1e3, 6),
            "intercept_ms": round(fit.intercept * 1e3, 6),
            "fit": _fit_dict(fit),
        }
        if cold is not None:
            block["fit_cold"] = _fit_dict(cold["fit"])  # per distinct expert, at this budget's hit rate
            m = cold["miss_fit"]
            block["fit_cold_misses"] = {"intercept_ms": round(m.intercept * 1e3, 6),
                                        "t_exp_warm_ms": round(m.t_hit * 1e3, 6),
                                        "t_exp_cold_ms": round(m.t_miss * 1e3, 6),
                                        "t_tok_ms": round(m.t_tok * 1e3, 6), "r2": round(m.r2, 6),
                                        "mape": round(m.mape, 6), "n": m.n,
                                        # what the same batches fit given the storage faults they actually
                                        # took (known only afterwards): the ceiling a residency snapshot faces
                                        "r2_given_faults": round(cold["given_faults"]["r2"], 6)}
            block["t_ar_cold_ms"] = round(cold["t_ar"] * 1e3, 6)
            block["c_draft_cold_ms"] = round(cold["c_draft"] * 1e3, 6)
        block["hot_experts"] = [list(p) for p in hot]
        block["measured"] = {
            "at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "by": "s2moe calibrate",
            "threads": threads,
            "budget_bytes": None if budget_bytes == AUTO else budget_bytes,
            "budget_rule": "auto" if auto else ("given" if budget_bytes is not None else None),
            "load": "mmap, no CPU repacking" if budget_bytes is not None else "mmap, default buffers",
            "prompts": len(prompt_list),
            "t_exp_cold": cold_how,
            "verify_batches": fit.n,
        }
        if cold is not None:
            # what decoding under a budget does too (attach_offloading's default): a fetched expert costs
            # far less with it than with a synchronous fault per page
            block["measured"]["prefetch"] = "just in time (routing hook)"
        profile = _merge_into_existing(name, {
            "schema": SCHEMA_VERSION,
            "name": name,
            "kind": "measured",
            "description": f"measured by s2moe calibrate on {platform.node() or 'this machine'}",
            "device": {
                "name": device_name(threads),
                "kind": "cpu",
                "memory_bytes": memory_bytes(),
                "budget_bytes": None if budget_bytes == AUTO else budget_bytes,
                "memory_bandwidth_gb_s": round(mem_bw / 1e9, 3),
                "storage_bandwidth_gb_s": round(sto_bw / 1e9, 3) if sto_bw else None,
            },
        }, info.fingerprint, block)
        path = save_profile(profile, name) if save else None
        where = f"wrote {path}" if path else "not saved (save=False)"
        yield StepResult(6, STEPS[5][0], f"{where} · model {info.fingerprint}", {"path": str(path) if path else None})
        yield CalibrationDone(profile, path)
    except Stopped:
        return
    finally:
        if rt is not None:
            rt.close()


def _sizes(cap: int) -> list[int]:
    """Verification batch sizes the calibration times: every size from 1 to cap + 1."""
    return list(range(1, cap + 2))


def _merge_into_existing(name: str, fresh: dict, fingerprint: str, block: dict) -> dict:
    """Keep the other models of an existing user profile of the same name; replace this model's block."""
    models = {}
    try:
        path = find_profile(name)
        from .profiles import user_profile_dir

        if path.parent == user_profile_dir():
            old = load_profile(name)
            if old.get("kind") == "measured":
                models = dict(old.get("models") or {})
    except ConfigError:
        pass
    models[fingerprint] = block
    fresh["models"] = models
    return fresh


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--cold-worker":
        return _cold_worker(json.loads(argv[1]))
    print("usage: s2moe calibrate --model PATH (this module's own entry point is internal)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
