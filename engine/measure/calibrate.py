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
the reason when there is no budget or no cgroup can be made), (6) on a GPU: host→device bandwidth and the
batch size from which copying the experts a batch uses beats running them on the CPU (skipped without a
GPU backend), (7) the profile, written atomically.

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

from .costmodel import (Stopped, context_line, fault_explained_fit, fit_context, fit_miss_cost, fit_verify_cost,
                        iter_context_steps, iter_time_steps, iter_verify_samples, r2_text, time_steps,
                        verify_samples)
from ..decoding.cpu_buffers import CpuBuffers
from ..decoding.cpu_buffers import choose as choose_cpu_buffers
from ..decoding.decoder import defaults_for
from .device import cpu_name, default_threads, memory_bytes
from ..errors import ConfigError, ModelError, S2MoEError
from ..files import MAX_PROMPT_FILE_BYTES, read_bounded
from ..decoding.gpu import Placement
from ..model_info import read_model_info
from ..offload import (Budget, BudgetUnavailable, MemoryCgroup, ModelMapping, drop_file_cache, expert_map, fmt_bytes,
                      process_anon_bytes, run_in_budget, select_hot_experts)
from ..profiles import SCHEMA_VERSION, check_name, check_writable, find_profile, load_profile, save_profile
from ..decoding.runtime import DEFAULT_BATCH
from .trace import budget_record

DEFAULT_NAME = "local"
DRAFT_CAP = 8
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
    ("bandwidth", "memory bandwidth and storage bandwidth (cold reads of whole experts at queue depth 1 and 8)"),
    ("steps", "T_AR (median plain decoding step) and draft step cost; how steps grow with the context, and the "
              "engine's own host time per draft pass and verified row"),
    ("cost model", "T_exp and T_tok: regression of verification latency on distinct experts and tokens"),
    ("hot experts", "routing frequencies over calibration prompts; the most routed experts that fit the budget"),
    ("budget", "verification cost under the memory budget (experts paged from storage), in a memory cgroup"),
    ("gpu", "host→device bandwidth, and the batch size from which copying the experts a verification uses to the "
            "GPU beats running them on the CPU (experts in host memory)"),
    ("profile", "write the profile atomically"),
)


NAMED_PROMPT_SETS = ("humaneval", "natural")
NAMED_SET_PROMPTS = 32  # enough to rank the experts a workload uses; a few seconds on small models


def read_prompts(path: str | os.PathLike | None) -> list[str]:
    """Calibration prompts: the built-in mix (None), a named set bench also uses ('humaneval' for code
    models: hot experts ranked from the workload's own kind of text cover more of its routings, see
    docs/calibration.md), or a text file with prompts separated by blank lines (or one per line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if str(path) in NAMED_PROMPT_SETS and not Path(path).exists():
        from .prompts import load_prompts

        return list(load_prompts(str(path), NAMED_SET_PROMPTS)[1])
    p = Path(path)
    try:
        text = read_bounded(p, "prompts file", MAX_PROMPT_FILE_BYTES).decode("utf-8")
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


STORAGE_DEPTHS = (1, 8)  # plain decoding reads about one expert at a time; a verification batch can ask for all


def storage_bandwidth(emap, *, max_bytes: int = 256 << 20, seed: int = 0, depths=STORAGE_DEPTHS):
    """Generator (yields (done, total)); returns ({queue depth: bytes per second}, bytes read, note) of cold
    reads of whole experts at random, the file dropped from the page cache first. Each depth reads its own
    experts (none is read twice); at depth d, d threads each read one expert at a time, so that d reads
    are in flight as when a verification's predicted experts are fetched together."""
    from concurrent.futures import ThreadPoolExecutor

    drop_file_cache(emap.path)
    mapping = ModelMapping(emap)
    try:
        resident = mapping.expert_residency()
    finally:
        mapping.close()
    rng = np.random.default_rng(seed)
    pairs = [(l, e) for l in emap.moe_layers for e in range(emap.n_expert) if resident[l, e] < 0.01]
    if len(pairs) < len(depths):
        return {}, 0, ("the model file could not be dropped from memory (another program may hold it open), "
                       "so its reads would not reach storage")
    rng.shuffle(pairs)
    per_expert = int(emap.expert_bytes.max())
    n_each = max(1, min(len(pairs) // len(depths), max_bytes // len(depths) // max(per_expert, 1)))
    fd = os.open(str(emap.path), os.O_RDONLY)

    def read_expert(pair) -> int:
        return sum(len(os.pread(fd, n, off)) for off, n in emap.expert_ranges(*pair))

    rates, total, done = {}, 0, 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: count what we ask for
        for d, depth in enumerate(depths):
            batch = pairs[d * n_each:(d + 1) * n_each]
            got = 0
            with ThreadPoolExecutor(max_workers=depth) as pool:
                t0 = time.perf_counter()
                for n in pool.map(read_expert, batch):  # os.pread lets go of the GIL while it waits
                    got += n
                    done += 1
                    yield done, n_each * len(depths)
                elapsed = time.perf_counter() - t0
            total += got
            if elapsed > 0:
                rates[depth] = got / elapsed
    finally:
        os.close(fd)
    drop_file_cache(emap.path)
    if not rates:
        return {}, total, "reads took no measurable time"
    return rates, total, f"{n_each} experts at each depth"


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
            "n": int(fit.n)} | _ceiling_field(fit)


def _ceiling_field(fit) -> dict:
    return {} if fit.r2_ceiling is None else {"r2_ceiling": round(fit.r2_ceiling, 6)}


def _fit_data(samples, fit) -> dict:
    measured = [s[2] * 1e3 for s in samples]
    predicted = [float(fit.predict(s[0], s[1])) * 1e3 for s in samples]
    return {"measured": measured, "predicted": predicted, "experts": [s[0] for s in samples],
            "tokens": [s[1] for s in samples], "r2": fit.r2, "r2_ceiling": fit.r2_ceiling, "mape": fit.mape,
            "intercept_ms": fit.intercept * 1e3, "t_exp_ms": fit.t_exp * 1e3, "t_tok_ms": fit.t_tok * 1e3}


# -- the cold (budget) worker ----------------------------------------------------------------------------------
def _cold_worker(cfg: dict) -> int:
    """Runs inside the budget cgroup (python -m s2moe.engine.measure.calibrate --cold-worker JSON): loads the model
    mmap-backed, offloads it as decoding does (pinned weights, code and hot experts, the routing hook's
    just-in-time prefetch and miss count) and times plain and draft steps and verification batches."""
    from ..decoding.decoder import Decoder
    from ..offload import Budget, current_budget_cgroup, offload_decoder

    def emit(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # a context of at least one batch, so that llama.cpp does not cap the batch a budget is sized with
    n_batch = cfg.get("n_batch")  # None: llama.cpp's, or what fits the budget's prefill share
    decoder = Decoder(cfg["model"], n_ctx=max(256, n_batch or DEFAULT_BATCH), n_threads=cfg.get("threads"),
                      max_draft=cfg["cap"], use_extra_bufts=False, placement=Placement(**cfg.get("placement", {})),
                      n_batch=n_batch)
    rt = decoder.rt

    def warm_up():  # every graph shape this worker times, so that an auto budget counts them
        time_steps(rt, cfg["k_draft"], 1, seed=4)
        verify_samples(rt, cfg["cap"], seed=4, repeats=1, sizes=[cfg["cap"] + 1])

    off = offload_decoder(decoder, Budget.parse(cfg["budget"]), [tuple(p) for p in cfg.get("hot", [])],
                          warm_up=warm_up)
    emit({"budget": off.budget_bytes})
    pinned = dict(off.pinned_split)
    emit({"pinned": pinned})
    ar, draft = time_steps(rt, cfg["k_draft"], cfg["n_steps"], seed=5,
                           progress=lambda d, t: emit({"progress": [d, t + cfg["n_samples"]]}))
    samples = verify_samples(rt, cfg["cap"], seed=6, repeats=cfg["repeats"], sizes=_sizes(cfg["cap"]),
                             counter=off.native,
                             progress=lambda d, t: emit({"progress": [cfg["n_steps"] + d, cfg["n_steps"] + t]}))
    plain = _plain_fetches(rt, off.native, rt.tokenize(cfg["text"]) or [0], PLAIN_FETCH_TOKENS)
    cg = current_budget_cgroup()
    emit({"result": {"samples": samples, "t_ar": float(np.median(ar)), "c_draft": float(np.median(draft)),
                     "plain": plain, "record": budget_record(off, [tuple(p) for p in cfg.get("hot", [])],
                                                             Budget.parse(cfg["budget"]).auto),
                     "pinned": pinned, "plan": off.plan.__dict__ if off.plan else None,
                     "split": cg.split(), "peak": cg.peak(), "anon": process_anon_bytes(), "n_batch": rt.n_batch}})
    off.close()
    decoder.close()
    return 0


PLAIN_FETCH_TOKENS, PLAIN_FETCH_WARM, PLAIN_FETCH_CONTEXT = 96, 16, 8
PLAIN_FETCH_CHARS = 4096  # of the calibration text: several times the tokens needed, and a small argv


def _plain_fetches(rt, counter, text: list[int], n: int) -> dict:
    """Plain decoding under the budget, one token a step, through the calibration text after its first
    PLAIN_FETCH_CONTEXT tokens (the model's own greedy choices once the text runs out): per token the experts
    it routed to ([n_layer, k] ids), how many were not in memory as their layer routed (the prefetcher's count,
    as decoding counts fetches), the step's seconds (what those fetches cost as decoding pays them: faults
    and read-ins included) and the token it decoded. Not the model's greedy continuation: a small model's
    soon repeats itself, routing to the same few experts, and fetches far fewer than decoding varied text."""
    hook = rt.hook
    rt.kv_clear()
    hook.off()
    context, forced = text[:PLAIN_FETCH_CONTEXT], text[PLAIN_FETCH_CONTEXT:]
    if len(context) > 1:
        rt.prefill(context[:-1])
    t, pos, ids, misses, seconds, tokens = context[-1], len(context) - 1, [], [], [], []
    try:
        for i in range(n):
            tokens.append(int(t))
            hook.observe()
            counter.begin()
            t0 = time.perf_counter()
            logits = rt.decode([t], pos, "all")
            seconds.append(time.perf_counter() - t0)
            ids.append(hook.snapshot(1).orig[:, 0].tolist())
            misses.append(int(counter.counted().sum()))
            t, pos = (forced[i] if i < len(forced) else int(np.argmax(logits[-1]))), pos + 1
    finally:
        rt.kv_clear()
    return {"ids": ids, "misses": misses, "seconds": seconds, "tokens": tokens}


def _run_cold(model_path, budget: Budget, cfg: dict):
    """Generator (yields (done, total)): the cold worker in a fresh memory cgroup; returns its result,
    with the budget it ran under (for auto, as the worker sized it)."""
    argv = [sys.executable, "-m", "s2moe.engine.measure.calibrate", "--cold-worker", json.dumps(cfg)]
    with run_in_budget(argv, budget, model_path, tag="calibrate", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) as run:
        result, pinned, sized, failure = None, None, budget.size, None
        for line in run.proc.stdout:
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
                sized = int(msg["budget"])
            elif "error" in msg:
                failure = msg["error"]
        rc = run.proc.wait()
        if result is None:
            err = (run.proc.stderr.read() or "").strip().splitlines()
            why = failure["message"] if failure else err[-1] if err else f"exit status {rc}"
            if run.out_of_memory() or rc in (-9, 137):
                why = (f"out of memory at the budget of {budget.describe(sized)} (pinned "
                       f"{fmt_bytes(sum((pinned or {}).values()))}); raise the budget")
            raise RuntimeError(why)
    result["budget"] = sized
    return result


# -- the steps -------------------------------------------------------------------------------------------------
class _Calibration:
    """What the steps share: the model, the settings, the runtime, and each step's results."""

    def __init__(self, info, emap, *, budget, prompts, threads, repeats, draft_topk, draft_cap, stop,
                 placement=Placement(), n_batch: int | None = None, cpu: CpuBuffers):
        self.info, self.emap, self.budget, self.prompts = info, emap, budget, prompts
        self.cpu = cpu  # the path the CPU weights take in every timing of this model
        self.placement = placement
        # the batch the budget step's process runs (a budget counts its compute buffers): -b, else chosen there
        self.n_batch = n_batch
        self.gpu = None  # what the gpu step measured
        self.threads, self.repeats, self.draft_topk, self.draft_cap = threads, repeats, draft_topk, draft_cap
        self.stop = stop
        self.rt = None
        self.budget_bytes = None if budget is None else budget.size  # auto: as the cold worker sized it

    def live(self, gen, index: int):
        """Pass a measurement's progress on as events; stop between measurements when asked."""
        while True:
            try:
                done, of = next(gen)
            except StopIteration as e:
                return e.value
            yield StepProgress(index, int(done), int(of))
            if self.stop():
                gen.close()
                raise Stopped()

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None


def _step_bandwidth(cal: _Calibration, index: int):
    cal.mem_bw = yield from cal.live(memory_bandwidth(), index)
    rates, sto_bytes, note = yield from cal.live(storage_bandwidth(cal.emap), index)
    cal.sto_bw, cal.sto_bw_deep = rates.get(1), rates.get(STORAGE_DEPTHS[-1])
    if rates:
        sto_text = (" · ".join(f"{bw / 1e9:.2f} GB/s at queue depth {d}" for d, bw in sorted(rates.items()))
                    + f" over {fmt_bytes(sto_bytes)} ({note})")
    else:
        sto_text = f"not measured: {note}"
    yield StepResult(index, STEPS[index - 1][0], f"memory {cal.mem_bw / 1e9:.1f} GB/s · storage {sto_text}",
                     {"memory_bandwidth_gb_s": cal.mem_bw / 1e9,
                      "storage_bandwidth_gb_s": _gb(cal.sto_bw), "storage_bandwidth_qd8_gb_s": _gb(cal.sto_bw_deep),
                      "storage_bytes_read": sto_bytes})


def _gb(bytes_per_s: float | None, digits: int | None = None) -> float | None:
    if not bytes_per_s:
        return None
    return bytes_per_s / 1e9 if digits is None else round(bytes_per_s / 1e9, digits)


def _step_plain_and_draft(cal: _Calibration, index: int):
    from ..decoding.runtime import LlamaRuntime

    cal.rt = LlamaRuntime(cal.info, n_ctx=512, n_threads=cal.threads, max_verify_rows=max(16, cal.draft_cap + 1),
                          use_extra_bufts=cal.cpu.extra, placement=cal.placement)
    ar, draft = yield from cal.live(iter_time_steps(cal.rt, cal.draft_topk, 8 * cal.repeats), index)
    cal.t_ar, cal.c_draft = t_ar, c_draft = float(np.median(ar)), float(np.median(draft))
    cal.workload = w = yield from _workload_terms(cal, index)
    yield StepResult(index, STEPS[index - 1][0],
                     f"T_AR {t_ar * 1e3:.2f} ms · draft step (k_d={cal.draft_topk}) {c_draft * 1e3:.2f} ms "
                     f"({c_draft / t_ar:.2f}× T_AR) · in the engine: plain step {w['t_plain_ms']:.2f} ms + "
                     f"{w['ctx_plain_us']:.2f} µs per token of context beyond {w['context_tokens']}, draft pass "
                     f"+{w['ctx_draft_us']:.2f} µs, verification {w['ctx_step_us']:.2f} µs + "
                     f"{w['ctx_row_us']:.2f} µs "
                     f"a further row · host {w['host_draft_ms']:.3f} ms a draft pass, {w['host_row_ms']:.3f} ms a "
                     f"verified row",
                     {"t_ar_ms": t_ar * 1e3, "c_draft_ms": c_draft * 1e3, "draft_topk": cal.draft_topk,
                      "plain_ms": [x * 1e3 for x in ar], "draft_ms": [x * 1e3 for x in draft], "workload": w})


WORKLOAD_PROMPTS, WORKLOAD_TOKENS = 3, 32  # engine generations the host times are taken from


def _workload_terms(cal: _Calibration, index: int):
    """What a workload's steps cost beyond the constants timed at 32 tokens of context, in the engine's own
    runtime: every kind of step timed at several context lengths (before and after the generations, so that a
    drift of the machine lands on both), and this engine's host work per draft pass and per verified row from
    generations of the engine itself, drafting to the cap as a trace does, over the first calibration prompts,
    with the draft passes' decode as timed here taken out."""
    from ..decoding.decoder import Decoder, GenerationConfig
    from ..events import CostConstants
    from .projection import engine_host_times
    from .trace import TraceRecorder

    decoder = Decoder(str(cal.info.path), n_ctx=512, n_threads=cal.threads, max_draft=cal.draft_cap,
                      use_extra_bufts=cal.cpu.extra, placement=cal.placement)
    traces, n = [], 2 * cal.repeats
    try:
        timings = yield from cal.live(iter_context_steps(decoder.rt, cal.draft_topk, cal.draft_cap, n, seed=2), index)
        # the rule's constants do not matter: a trace drafts to the cap whatever it says
        cost = CostConstants(cal.t_ar, cal.c_draft, 0.0, 0.0, 0.0, "calibrating")
        cfg = GenerationConfig(mode="s2moe", n_predict=WORKLOAD_TOKENS, draft_topk=cal.draft_topk,
                               draft_max=cal.draft_cap, cost=cost, trace=True)
        prompts = cal.prompts[:WORKLOAD_PROMPTS]
        for i, prompt in enumerate(prompts):
            tokens = decoder.tokenize(prompt)[: 512 - WORKLOAD_TOKENS - cal.draft_cap - 2] or [0]
            rec = TraceRecorder(cal.info)
            for event in decoder.generate(tokens, cfg):
                rec.add(event)
            traces.append(rec.trace)
            yield StepProgress(index, i + 1, len(prompts))
            if cal.stop():
                raise Stopped()
        plain = yield from _plain_iterations(decoder, prompts[0], index)
        again = yield from cal.live(iter_context_steps(decoder.rt, cal.draft_topk, cal.draft_cap, n, seed=3), index)
    finally:
        decoder.close()
    for c, kinds in again.items():
        for kind, times in kinds.items():
            timings[c][kind] += times
    ctx = fit_context(timings, cal.draft_cap + 1, base=32)
    host_draft, host_row, iterations = engine_host_times(traces, ctx.level["draft"], ctx.slope["draft"], ctx.base)
    # medians over bins of context, so that an iteration a burst of other work delayed does not tilt the line
    bins = {}
    for c, seconds in plain:
        bins.setdefault(c // PLAIN_BIN, []).append(seconds)
    t_plain, ctx_plain = context_line([(b + 0.5) * PLAIN_BIN for b in bins], [np.median(v) for v in bins.values()],
                                      ctx.base)

    def ms(x):
        return round(x * 1e3, 6)

    def us(x):
        return round(x * 1e6, 6)

    return {"context_tokens": ctx.base,
            "t_plain_ms": ms(t_plain), "ctx_plain_us": us(ctx_plain),
            "t_draft_ms": ms(ctx.level["draft"]), "ctx_draft_us": us(ctx.slope["draft"]),
            "ctx_step_us": us(ctx.slope["observed"]), "ctx_row_us": us(ctx.row),
            "host_draft_ms": ms(host_draft), "host_row_ms": ms(host_row),
            "contexts": list(ctx.contexts), **{f"{k}_ms": [ms(x) for x in v] for k, v in ctx.medians.items()},
            "verify_rows": ctx.rows, "iterations": iterations, "plain_iterations": len(plain)}


PLAIN_BIN, PLAIN_TOKENS = 32, 360


def _plain_iterations(decoder, prompt: str, index: int):
    """Generator (yields StepProgress): [(tokens of context, seconds)] of each iteration of plain decoding (mode
    ar) through the engine, from one event to the next: the step and the loop's own work, as decoding runs them,
    over a long generation so that the context grows past what workloads run at."""
    from ..decoding.decoder import GenerationConfig
    from ..events import Iteration, Prefilled

    tokens = decoder.tokenize(prompt)[:64] or [0]
    n = min(PLAIN_TOKENS, decoder.n_ctx - len(tokens) - 2)
    out, last = [], None
    for event in decoder.generate(tokens, GenerationConfig(mode="ar", n_predict=n, stop_at_eos=False)):
        now = time.perf_counter()
        if isinstance(event, Iteration):
            out.append((event.n_committed - 2, now - last))
            if len(out) % 64 == 0:
                yield StepProgress(index, len(out), n)
        if isinstance(event, (Prefilled, Iteration)):
            last = now
    return out


def _step_cost_model(cal: _Calibration, index: int):
    samples = yield from cal.live(iter_verify_samples(cal.rt, cal.draft_cap, seed=1, repeats=cal.repeats,
                                                      sizes=_sizes(cal.draft_cap)), index)
    cal.fit = fit = fit_verify_cost([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])
    yield StepResult(index, STEPS[index - 1][0],
                     f"T_exp {fit.t_exp * 1e3:.4f} ms · T_tok {fit.t_tok * 1e3:.3f} ms · intercept "
                     f"{fit.intercept * 1e3:.2f} ms · {r2_text(fit.r2, fit.r2_ceiling)} · MAPE {fit.mape:.1%} "
                     f"({fit.n} batches)",
                     _fit_data(samples, fit))


def _step_hot_experts(cal: _Calibration, index: int):
    emap, info = cal.emap, cal.info
    counts, n_tok = yield from cal.live(routing_counts(cal.rt, cal.prompts), index)
    eb = emap.expert_bytes
    # The ranking: most routed first, up to half of the expert bytes. A decoding process under a budget
    # pins the longest prefix that fits its own plan (offload.offload_decoder).
    cal.hot = hot = select_hot_experts(counts, eb, emap.total_expert_bytes // 2)
    # How many of them fit is the budget process's to say (next step): its batch and buffers, not this
    # process's, decide the room its plan leaves the hot experts.
    fit_text = " · how many fit is decided under the budget, in the next step" if cal.budget is not None else ""
    routed = counts.sum()
    share = float(sum(counts[l, e] for l, e in hot) / routed) if routed else 0.0
    yield StepResult(index, STEPS[index - 1][0],
                     f"{len(hot)} most routed experts ({fmt_bytes(sum(int(eb[l]) for l, _ in hot))}, half of the "
                     f"expert bytes) take {share:.0%} of {int(routed)} routings over {n_tok} tokens{fit_text}",
                     {"hot_experts": [list(p) for p in hot], "counts": counts.tolist(), "routed_share": share,
                      "tokens": n_tok})


def _step_under_budget(cal: _Calibration, index: int):
    cal.cold = cal.cache_fit = None
    if cal.budget is None:
        skip = "skipped: no memory budget given"
    else:
        skip = MemoryCgroup.unavailable_reason()
    if skip is None:
        cal.close()  # the cold worker needs the memory
        n_steps = 4 * cal.repeats
        cfg = {"model": str(cal.info.path), "text": "\n\n".join(cal.prompts)[:PLAIN_FETCH_CHARS],
               "threads": cal.threads, "k_draft": cal.draft_topk, "cap": cal.draft_cap,
               "repeats": cal.repeats, "n_steps": n_steps, "n_samples": len(_sizes(cal.draft_cap)) * 3 * cal.repeats,
               "hot": [list(p) for p in cal.hot], "budget": str(cal.budget), "n_batch": cal.n_batch,
               "placement": cal.placement.as_dict()}  # the cold timings place the weights as the others do
        try:
            res = yield from cal.live(_run_cold(cal.info.path, cal.budget, cfg), index)
        except (BudgetUnavailable, RuntimeError) as e:
            skip = f"failed: {e}"
            res = None
        if res is not None:
            # The disk again, now that the batches have run: its rate moving under them shows as a poorer
            # fit that their storage faults do not explain, and the profile keeps the mean of both readings.
            after, _, _ = yield from cal.live(storage_bandwidth(cal.emap, seed=1), index)
            yield _cold_result(cal, index, res, after)
    if cal.cold is None:
        derived = "; cold T_exp derived from storage bandwidth" if cal.sto_bw else ""
        yield StepResult(index, STEPS[index - 1][0], f"{skip}{derived}", {"skipped": skip})


NO_GPU = "skipped: no GPU backend in this llama.cpp build"
NO_GPU_DEVICE = "skipped: no GPU among llama.cpp's devices"  # a backend of other devices (a remote one, say)


def _step_gpu(cal: _Calibration, index: int):
    from ..decoding.gpu import gpu_backend, gpu_device_type, measure_copy_mode, transfer_rate

    name = STEPS[index - 1][0]
    if not gpu_backend():
        yield StepResult(index, name, NO_GPU, {"skipped": NO_GPU})
        return
    kind = gpu_device_type()
    if kind is None:
        yield StepResult(index, name, NO_GPU_DEVICE, {"skipped": NO_GPU_DEVICE})
        return
    try:
        rate = transfer_rate(kind)
        cal.close()  # the timing processes load the model onto the GPU themselves
        layers = cal.placement.n_gpu_layers or -1
        mode = yield from cal.live(measure_copy_mode(cal.info.path, sizes=_sizes(cal.draft_cap), n_gpu_layers=layers,
                                                     threads=cal.threads, repeats=cal.repeats,
                                                     use_extra_bufts=cal.cpu.extra), index)
    except RuntimeError as e:
        why = f"failed: {e}"
        yield StepResult(index, name, why, {"skipped": why})
        return
    samples = mode.copy_samples
    fit = fit_verify_cost([x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
    cal.gpu = {"h2d": rate, "mode": mode, "fit": fit, "n_gpu_layers": layers}
    where = (f"copying wins from {mode.crossover} tokens" if mode.crossover is not None else
             f"copying never won up to {max(mode.sizes)} tokens")
    yield StepResult(index, name,
                     f"host→device {rate / 1e9:.1f} GB/s · {where} · T_exp copied {fit.t_exp * 1e3:.4f} ms "
                     f"(R² {fit.r2:.3f})",
                     {"host_to_device_gb_s": rate / 1e9, "copy_min_batch": mode.crossover, **mode.as_dict(),
                      "fit_copy": _fit_dict(fit)})


# Readings of the disk before and after the budgeted batches further apart than this say that its rate
# moved while they ran.
STORAGE_DRIFT = 1.25


def storage_drift_note(before: float | None, after: float | None) -> str:
    """What the reading after the budgeted batches adds to their result (rates at queue depth 8, bytes/s)."""
    if not before or not after:
        return ""
    note = f" · the disk read {before / 1e9:.2f} GB/s at depth 8 before these batches and {after / 1e9:.2f} after"
    if max(before, after) / min(before, after) > STORAGE_DRIFT:
        note += (": its rate moved while they ran, so the fit is noisier than this disk's usual (calibrate again "
                 "when it is quiet)")
    return note


def _cold_result(cal: _Calibration, index: int, res: dict, after: dict) -> StepResult:
    """Fit what the cold worker measured; keep it on cal.cold. after: the storage rates read once it was done
    ({queue depth: bytes/s}); the profile keeps the mean of those and the first step's."""
    from .projection import decoding_fetch_price

    cal.budget_bytes = res["budget"]
    cs = [tuple(s) for s in res["samples"]]
    experts, tokens, seconds, misses, faults = ([s[i] for s in cs] for i in range(5))
    cfit = fit_verify_cost(experts, tokens, seconds)
    mfit = fit_miss_cost(experts, misses, tokens, seconds)
    given = fault_explained_fit(experts, faults, tokens, seconds)
    cal.cache_fit = _cache_fit(res["plain"], res["record"], cal.info.n_expert,
                               float(cal.emap.expert_bytes[list(cal.emap.moe_layers)].mean()))
    cal.n_batch = res.get("n_batch", cal.n_batch)
    cal.cold = {"fit": cfit, "miss_fit": mfit, "given_faults": given, "t_ar": res["t_ar"],
                "c_draft": res["c_draft"], "split": res["split"], "peak": res["peak"], "pinned": res["pinned"],
                "samples": cs}
    # the plot and headline use the miss-aware model: under a budget what costs is a fetch
    data = {"measured": [x * 1e3 for x in seconds],
            "predicted": [float(mfit.predict(e, m, t)) * 1e3 for e, m, t in zip(experts, misses, tokens)],
            "experts": experts, "misses": misses, "tokens": tokens,
            "r2": mfit.r2, "r2_ceiling": mfit.r2_ceiling, "mape": mfit.mape, "t_exp_warm_ms": mfit.t_hit * 1e3,
            "t_exp_cold_ms": mfit.t_miss * 1e3, "t_tok_ms": mfit.t_tok * 1e3,
            "intercept_ms": mfit.intercept * 1e3, "paper_form": _fit_data(cs, cfit),
            "t_ar_ms": res["t_ar"] * 1e3, "c_draft_ms": res["c_draft"] * 1e3,
            "split": res["split"], "peak": res["peak"], "n_batch": res.get("n_batch"),
            "pinned": res["pinned"], "r2_given_faults": given["r2"], "faults": faults}
    miss_rate = sum(misses) / max(1.0, sum(experts))
    deep = STORAGE_DEPTHS[-1]
    drift = storage_drift_note(cal.sto_bw_deep, after.get(deep))
    if after:
        data["storage_after_gb_s"] = {str(d): bw / 1e9 for d, bw in after.items()}
        if cal.sto_bw and after.get(1):
            cal.sto_bw = (cal.sto_bw + after[1]) / 2
        if cal.sto_bw_deep and after.get(deep):
            cal.sto_bw_deep = (cal.sto_bw_deep + after[deep]) / 2
    pinned = (res.get("record") or {}).get("pinned") or []
    plain = ""
    if cal.cache_fit and cal.cache_fit.get("step_ms"):
        held = cal.cache_fit
        plain = f" · plain decoding {held['step_ms']:.1f} ms a token at {held['fetched_per_token']:.1f} fetched"
        paid = decoding_fetch_price(held["step_ms"], held["fetched_per_token"], cal.t_ar * 1e3)
        if paid is not None:
            plain += f" ({paid * 1e3:.2f} ms a fetch beyond the resident step)"
        data["plain_step_ms"] = held["step_ms"]
    return StepResult(index, STEPS[index - 1][0],
                      f"under {cal.budget.describe(cal.budget_bytes)}: T_AR {res['t_ar'] * 1e3:.1f} ms · draft step "
                      f"{res['c_draft'] * 1e3:.1f} ms · T_exp cold "
                      f"{mfit.t_miss * 1e3:.3f} ms, warm {mfit.t_hit * 1e3:.3f} ms · T_tok "
                      f"{mfit.t_tok * 1e3:.2f} ms · {r2_text(mfit.r2, mfit.r2_ceiling)} · MAPE {mfit.mape:.1%} · "
                      f"{miss_rate:.0%} of experts missed · per distinct expert {cfit.t_exp * 1e3:.3f} ms "
                      f"(R² {cfit.r2:.3f}) · given the storage faults taken, R² {given['r2']:.3f} · "
                      f"peak {fmt_bytes(res['peak'] or 0)} · {len(pinned)} of the {len(cal.hot)} hot experts pinned "
                      f"({fmt_bytes(res['pinned']['hot_experts'])}){plain}{drift}", data)


def _cache_fit(plain: dict, record: dict | None, n_expert: int, expert_bytes: float) -> dict | None:
    """How many experts the engine's offloading held in effect when plain decoding ran under the budget: the
    size of an LRU cache (beside the pinned hot experts) that fetches what decoding counted over the same tokens,
    the first PLAIN_FETCH_WARM tokens warming both up. None without a plan."""
    from .projection import CachePlan, capacity_fetching

    if record is None or not plain["ids"]:
        return None
    planned = int(record["cache_bytes"] // expert_bytes)
    ids = [np.asarray(x) for x in plain["ids"]]
    counted = sum(plain["misses"][PLAIN_FETCH_WARM:])
    pinned = tuple(tuple(p) for p in record["pinned"])
    effective = capacity_fetching(ids, counted, CachePlan(planned, pinned, ""), n_expert, PLAIN_FETCH_WARM)
    n = len(ids) - PLAIN_FETCH_WARM
    fit = {"planned_experts": planned, "effective_experts": effective, "tokens": n,
           "fetched_per_token": round(counted / max(1, n), 6), "pinned": len(pinned)}
    if plain.get("seconds"):
        fit["step_ms"] = round(float(np.mean(plain["seconds"][PLAIN_FETCH_WARM:])) * 1e3, 6)
    return fit


def _model_block(cal: _Calibration) -> dict:
    """This model's block of the profile: the constants decoding uses, the fits, how they were measured."""
    info, emap, fit, cold = cal.info, cal.emap, cal.fit, cal.cold
    mean_eb = float(emap.expert_bytes[list(emap.moe_layers)].mean())
    if cold is not None:
        t_exp_cold, cold_how = cold["miss_fit"].t_miss * 1e3, "measured under the budget"
    elif cal.sto_bw:
        t_exp_cold, cold_how = mean_eb / cal.sto_bw * 1e3, "derived: expert bytes / storage bandwidth"
    else:
        t_exp_cold, cold_how = None, "unknown"
    block = {
        "model": info.path.name,
        "arch": info.arch,
        "n_layer": info.n_layer,
        "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used,
        "expert_bytes": int(round(mean_eb)),
        "storage_bandwidth_gb_s": _gb(cal.sto_bw, 3),          # reads of this model's experts: its own rates
        "storage_bandwidth_qd8_gb_s": _gb(cal.sto_bw_deep, 3),
        "draft_topk": cal.draft_topk,
        "t_ar_ms": round(cal.t_ar * 1e3, 6),
        "c_draft_ms": round(cal.c_draft * 1e3, 6),
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
                                    "r2_given_faults": round(cold["given_faults"]["r2"], 6)} | _ceiling_field(m)
        if cal.cache_fit:
            block["cache_fit"] = cal.cache_fit
        block["t_ar_cold_ms"] = round(cold["t_ar"] * 1e3, 6)
        block["c_draft_cold_ms"] = round(cold["c_draft"] * 1e3, 6)
    if cal.gpu is not None:
        # what decoding with the experts in host memory pays per distinct expert: its copy to the GPU
        gfit = cal.gpu["fit"]
        block["t_exp_copy_ms"] = round(gfit.t_exp * 1e3, 6)
        block["copy_min_batch"] = cal.gpu["mode"].crossover
        block["fit_copy"] = _fit_dict(gfit)
    block["workload"] = cal.workload
    block["hot_experts"] = [list(p) for p in cal.hot]
    block["measured"] = {
        "at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "by": "s2moe calibrate",
        "threads": cal.threads,
        "budget_bytes": cal.budget_bytes,
        "budget_rule": None if cal.budget is None else ("auto" if cal.budget.auto else "given"),
        "batch_size": None if cal.budget is None else cal.n_batch,
        "load": "mmap, llama.cpp's extra CPU buffer types" if cal.cpu.extra else "mmap, no CPU repacking",
        "cpu_buffers": cal.cpu.as_dict(),
        "prompts": len(cal.prompts),
        "t_exp_cold": cold_how,
        "verify_batches": fit.n,
    }
    if cal.gpu is not None:
        block["measured"]["gpu"] = {"n_gpu_layers": cal.gpu["n_gpu_layers"], **cal.gpu["mode"].as_dict()}
    if cold is not None:
        # what decoding under a budget does too (offload_decoder's default): a fetched expert costs far
        # less with it than with a synchronous fault per page
        block["measured"]["prefetch"] = "just in time (routing hook)"
    return block


def _step_profile(cal: _Calibration, index: int, name: str, save: bool):
    profile = _merge_into_existing(name, {
        "schema": SCHEMA_VERSION,
        "name": name,
        "kind": "measured",
        "description": f"measured by s2moe calibrate on {platform.node() or 'this machine'}",
        "device": {
            "name": device_name(cal.threads),
            "kind": "cpu" if cal.gpu is None else "gpu",
            "host_to_device_gb_s": None if cal.gpu is None else _gb(cal.gpu["h2d"], 3),
            "memory_bytes": memory_bytes(),
            "budget_bytes": cal.budget_bytes,
            "memory_bandwidth_gb_s": round(cal.mem_bw / 1e9, 3),
            "storage_bandwidth_gb_s": _gb(cal.sto_bw, 3),          # queue depth 1
            "storage_bandwidth_qd8_gb_s": _gb(cal.sto_bw_deep, 3),  # queue depth 8
        },
    }, cal.info.fingerprint, _model_block(cal))
    path = save_profile(profile, name) if save else None
    where = f"wrote {path}" if path else "not written to a file yet"
    yield StepResult(index, STEPS[index - 1][0], f"{where} · model {cal.info.fingerprint}",
                     {"path": str(path) if path else None})
    yield CalibrationDone(profile, path)


# -- the generator ---------------------------------------------------------------------------------------------
def run_calibration(model_path, *, budget: Budget | None = None, prompts=None, name: str | None = None,
                    save: bool = True, n_threads: int | None = None,
                    should_stop: Callable[[], bool] | None = None, repeats: int = 3,
                    draft_topk: int | None = None, draft_cap: int = DRAFT_CAP,
                    placement: Placement = Placement(), n_batch: int | None = None) -> Iterator[object]:
    """Calibrate model_path on this device; yield StepStarted/StepProgress/StepResult…, CalibrationDone.

    budget: where to measure the cost of fetching experts (None: skip that step).
    prompts: list of strings, a path to a prompts file, or None for the built-in prompts.
    placement: where the weights go for the plain, draft and verification timings (-ngl, --cpu-moe…).
    n_batch: llama.cpp's batch of the process measured under the budget (its compute buffers count there;
    None: llama.cpp's default, or under a budget of a given size what fits its prefill share).
    should_stop: polled between measurements; when it returns True the generator returns without
    yielding anything more and without writing a profile (see the module docstring)."""
    name = check_name(DEFAULT_NAME if name is None else name)
    info = read_model_info(model_path)
    if not info.is_moe:
        raise ModelError(f"{info.path.name} is a dense model: calibration measures Mixture-of-Experts costs")
    if draft_topk is None or draft_topk >= info.n_expert_used:
        draft_topk = defaults_for(info).draft_topk  # what a generation with no flag drafts with
    placement.validate(info)
    if save:
        check_writable(name)  # before minutes of measurements, not after them
    _check_loads(info, n_threads, draft_cap, placement)
    cpu = choose_cpu_buffers(info, budget is None)
    cal = _Calibration(info, expert_map(info.path), budget=budget,
                       prompts=list(prompts) if isinstance(prompts, (list, tuple)) else read_prompts(prompts),
                       threads=n_threads or default_threads(), repeats=repeats, draft_topk=draft_topk,
                       draft_cap=draft_cap, stop=should_stop or (lambda: False), placement=placement,
                       n_batch=n_batch, cpu=cpu)
    steps = (_step_bandwidth, _step_plain_and_draft, _step_cost_model, _step_hot_experts, _step_under_budget,
             _step_gpu, lambda cal, index: _step_profile(cal, index, name, save))
    try:
        for index, step in enumerate(steps, 1):
            yield StepStarted(index, len(STEPS), *STEPS[index - 1])
            yield from step(cal, index)
            if index < len(steps) and cal.stop():
                return
    except Stopped:
        return
    finally:
        cal.close()


def _check_loads(info, n_threads: int | None, draft_cap: int, placement: Placement) -> None:
    """Load the model as step 2 will, and let go of it: a file llama.cpp refuses is one error before the
    first step prints anything, not one after step 1's output. The load reads the file into the page cache,
    which the bandwidth step drops again before it measures storage; it is not kept open for that reason."""
    from ..decoding.runtime import LlamaRuntime

    LlamaRuntime(info, n_ctx=512, n_threads=n_threads, max_verify_rows=max(16, draft_cap + 1), use_extra_bufts=False,
                 placement=placement, install_hook=False).close()


def _sizes(cap: int) -> list[int]:
    """Verification batch sizes the calibration times: every size from 1 to cap + 1."""
    return list(range(1, cap + 2))


def _merge_into_existing(name: str, fresh: dict, fingerprint: str, block: dict) -> dict:
    """Keep the other models of an existing user profile of the same name; replace this model's block."""
    models = {}
    try:
        path = find_profile(name)
        from ..profiles import user_profile_dir

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
        try:
            return _cold_worker(json.loads(argv[1]))
        except Exception as e:  # noqa: BLE001 (the parent gets the reason as data, not a traceback's last line)
            message = e.worded() if isinstance(e, S2MoEError) else str(e) or type(e).__name__
            sys.stdout.write(json.dumps({"error": {"kind": type(e).__name__, "message": message}}) + "\n")
            return 1
    print("usage: s2moe calibrate --model PATH (this module's own entry point is internal)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
