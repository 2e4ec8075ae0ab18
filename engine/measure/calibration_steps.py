"""Calibration's steps 1 to 4 and 6: what each step measures, how it sums that up in one line and the data a
plot or the profile takes from it, on the state the steps share (Calibration).

run_calibration (calibrate) runs them in order with step 5, the cost under a budget (calibration_budget), and
adds the last step, the profile; the events they yield are in calibration_events, the measurements themselves
in calibration_measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..decoding.cpu_buffers import CpuBuffers
from ..decoding.gpu import Placement
from ..model_info import ModelInfo
from ..offload import Budget, ExpertMap, fmt_bytes, select_hot_experts
from .calibration_events import STEPS, StepEvents, StepProgress, StepResult, fit_data, fit_dict
from .calibration_measures import (
    STORAGE_DEPTHS,
    Measurement,
    memory_bandwidth,
    routing_counts,
    storage_bandwidth,
    verify_sizes,
)
from .cost_fits import Fit, fit_verify_cost, r2_text
from .costmodel import (
    Stopped,
    context_line,
    fit_context,
    iter_context_steps,
    iter_time_steps,
    iter_verify_samples,
)

if TYPE_CHECKING:  # loading llama.cpp is for the steps to do as they run, not for this module's import
    from ..decoding.decoder import Decoder
    from ..decoding.runtime import LlamaRuntime
    from .trace import Trace

T = TypeVar("T")


# -- the steps -------------------------------------------------------------------------------------------------
class Calibration:
    """What the steps share: the model, the settings, the runtime, and each step's results."""

    # each step's results, set as the steps run
    mem_bw: float
    sto_bw: float | None
    sto_bw_deep: float | None
    t_ar: float
    c_draft: float
    workload: dict[str, Any]
    fit: Fit
    hot: list[tuple[int, int]]
    cold: dict[str, Any] | None
    cache_fit: dict[str, Any] | None

    def __init__(
        self,
        info: ModelInfo,
        emap: ExpertMap,
        *,
        budget: Budget | None,
        prompts: list[str],
        threads: int,
        repeats: int,
        draft_topk: int,
        draft_cap: int,
        stop: Callable[[], bool],
        placement: Placement = Placement(),
        n_batch: int | None = None,
        cpu: CpuBuffers,
    ):
        self.info, self.emap, self.budget, self.prompts = info, emap, budget, prompts
        self.cpu = cpu  # the path the CPU weights take in every timing of this model
        self.placement = placement
        # the batch the budget step's process runs (a budget counts its compute buffers): -b, else chosen there
        self.n_batch = n_batch
        self.gpu: dict[str, Any] | None = None  # what the gpu step measured
        self.threads, self.repeats, self.draft_topk, self.draft_cap = threads, repeats, draft_topk, draft_cap
        self.stop = stop
        self.rt: LlamaRuntime | None = None
        self.budget_bytes = None if budget is None else budget.size  # auto: as the cold worker sized it

    def live(self, gen: Measurement[T], index: int) -> Generator[StepProgress, None, T]:
        """Pass a measurement's progress on as events; stop between measurements when asked."""
        while True:
            try:
                done, of = next(gen)
            except StopIteration as e:
                value: T = e.value
                return value
            yield StepProgress(index, int(done), int(of))
            if self.stop():
                gen.close()
                raise Stopped()

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None


def step_bandwidth(cal: Calibration, index: int) -> StepEvents:
    cal.mem_bw = yield from cal.live(memory_bandwidth(), index)
    rates, sto_bytes, note = yield from cal.live(storage_bandwidth(cal.emap), index)
    cal.sto_bw, cal.sto_bw_deep = rates.get(1), rates.get(STORAGE_DEPTHS[-1])
    if rates:
        sto_text = (
            " · ".join(f"{bw / 1e9:.2f} GB/s at queue depth {d}" for d, bw in sorted(rates.items()))
            + f" over {fmt_bytes(sto_bytes)} ({note})"
        )
    else:
        sto_text = f"not measured: {note}"
    yield StepResult(
        index,
        STEPS[index - 1][0],
        f"memory {cal.mem_bw / 1e9:.1f} GB/s · storage {sto_text}",
        {
            "memory_bandwidth_gb_s": cal.mem_bw / 1e9,
            "storage_bandwidth_gb_s": gb(cal.sto_bw),
            "storage_bandwidth_qd8_gb_s": gb(cal.sto_bw_deep),
            "storage_bytes_read": sto_bytes,
        },
    )


def gb(bytes_per_s: float | None, digits: int | None = None) -> float | None:
    if not bytes_per_s:
        return None
    return bytes_per_s / 1e9 if digits is None else round(bytes_per_s / 1e9, digits)


def step_plain_and_draft(cal: Calibration, index: int) -> StepEvents:
    from ..decoding.runtime import LlamaRuntime

    cal.rt = LlamaRuntime(
        cal.info,
        n_ctx=512,
        n_threads=cal.threads,
        max_verify_rows=max(16, cal.draft_cap + 1),
        use_extra_bufts=cal.cpu.extra,
        placement=cal.placement,
    )
    ar, draft = yield from cal.live(iter_time_steps(cal.rt, cal.draft_topk, 8 * cal.repeats), index)
    cal.t_ar, cal.c_draft = t_ar, c_draft = float(np.median(ar)), float(np.median(draft))
    cal.workload = w = yield from _workload_terms(cal, index)
    yield StepResult(
        index,
        STEPS[index - 1][0],
        f"T_AR {t_ar * 1e3:.2f} ms · draft step (k_d={cal.draft_topk}) {c_draft * 1e3:.2f} ms "
        f"({c_draft / t_ar:.2f}× T_AR) · in the engine: plain step {w['t_plain_ms']:.2f} ms + "
        f"{w['ctx_plain_us']:.2f} µs per token of context beyond {w['context_tokens']}, draft pass "
        f"+{w['ctx_draft_us']:.2f} µs, verification {w['ctx_step_us']:.2f} µs + "
        f"{w['ctx_row_us']:.2f} µs "
        f"a further row · host {w['host_draft_ms']:.3f} ms a draft pass, {w['host_row_ms']:.3f} ms a "
        f"verified row",
        {
            "t_ar_ms": t_ar * 1e3,
            "c_draft_ms": c_draft * 1e3,
            "draft_topk": cal.draft_topk,
            "plain_ms": [x * 1e3 for x in ar],
            "draft_ms": [x * 1e3 for x in draft],
            "workload": w,
        },
    )


WORKLOAD_PROMPTS, WORKLOAD_TOKENS = 3, 32  # engine generations the host times are taken from


def _workload_terms(cal: Calibration, index: int) -> Generator[StepProgress, None, dict[str, Any]]:
    """What a workload's steps cost beyond the constants timed at 32 tokens of context, in the engine's own
    runtime: every kind of step timed at several context lengths (before and after the generations, so that a
    drift of the machine lands on both), and this engine's host work per draft pass and per verified row from
    generations of the engine itself, drafting to the cap as a trace does, over the first calibration prompts,
    with the draft passes' decode as timed here taken out."""
    from ..decoding.decoder import Decoder
    from ..decoding.generation_config import GenerationConfig
    from ..events import CostConstants
    from .replay_costs import engine_host_times
    from .trace import TraceRecorder

    decoder = Decoder(
        str(cal.info.path),
        n_ctx=512,
        n_threads=cal.threads,
        max_draft=cal.draft_cap,
        use_extra_bufts=cal.cpu.extra,
        placement=cal.placement,
    )
    traces: list[Trace] = []
    n = 2 * cal.repeats
    try:
        timings = yield from cal.live(iter_context_steps(decoder.rt, cal.draft_topk, cal.draft_cap, n, seed=2), index)
        # the rule's constants do not matter: a trace drafts to the cap whatever it says
        cost = CostConstants(cal.t_ar, cal.c_draft, 0.0, 0.0, 0.0, "calibrating")
        cfg = GenerationConfig(
            mode="s2moe",
            n_predict=WORKLOAD_TOKENS,
            draft_topk=cal.draft_topk,
            draft_max=cal.draft_cap,
            cost=cost,
            trace=True,
        )
        prompts = cal.prompts[:WORKLOAD_PROMPTS]
        for i, prompt in enumerate(prompts):
            tokens = decoder.tokenize(prompt)[: 512 - WORKLOAD_TOKENS - cal.draft_cap - 2] or [0]
            rec = TraceRecorder(cal.info)
            for event in decoder.generate(tokens, cfg):
                rec.add(event)
            assert rec.trace is not None  # a traced generation ends with its trace
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
    bins: dict[int, list[float]] = {}
    for c, seconds in plain:
        bins.setdefault(c // PLAIN_BIN, []).append(seconds)
    t_plain, ctx_plain = context_line(
        [(b + 0.5) * PLAIN_BIN for b in bins], [np.median(v) for v in bins.values()], ctx.base
    )

    def ms(x: float) -> float:
        return round(x * 1e3, 6)

    def us(x: float) -> float:
        return round(x * 1e6, 6)

    return {
        "context_tokens": ctx.base,
        "t_plain_ms": ms(t_plain),
        "ctx_plain_us": us(ctx_plain),
        "t_draft_ms": ms(ctx.level["draft"]),
        "ctx_draft_us": us(ctx.slope["draft"]),
        "ctx_step_us": us(ctx.slope["observed"]),
        "ctx_row_us": us(ctx.row),
        "host_draft_ms": ms(host_draft),
        "host_row_ms": ms(host_row),
        "contexts": list(ctx.contexts),
        **{f"{k}_ms": [ms(x) for x in v] for k, v in ctx.medians.items()},
        "verify_rows": ctx.rows,
        "iterations": iterations,
        "plain_iterations": len(plain),
    }


PLAIN_BIN, PLAIN_TOKENS = 32, 360


def _plain_iterations(
    decoder: Decoder, prompt: str, index: int
) -> Generator[StepProgress, None, list[tuple[int, float]]]:
    """Generator (yields StepProgress): [(tokens of context, seconds)] of each iteration of plain decoding (mode
    ar) through the engine, from one event to the next: the step and the loop's own work, as decoding runs them,
    over a long generation so that the context grows past what workloads run at."""
    from ..decoding.generation_config import GenerationConfig
    from ..events import Iteration, Prefilled

    tokens = decoder.tokenize(prompt)[:64] or [0]
    n = min(PLAIN_TOKENS, decoder.n_ctx - len(tokens) - 2)
    out: list[tuple[int, float]] = []
    last: float | None = None
    for event in decoder.generate(tokens, GenerationConfig(mode="ar", n_predict=n, stop_at_eos=False)):
        now = time.perf_counter()
        if isinstance(event, Iteration):
            assert last is not None  # the prefill's event comes before the first iteration's
            out.append((event.n_committed - 2, now - last))
            if len(out) % 64 == 0:
                yield StepProgress(index, len(out), n)
        if isinstance(event, (Prefilled, Iteration)):
            last = now
    return out


def step_cost_model(cal: Calibration, index: int) -> StepEvents:
    assert cal.rt is not None  # step 2 loaded it, and the steps after it run only where it did
    samples = yield from cal.live(
        iter_verify_samples(cal.rt, cal.draft_cap, seed=1, repeats=cal.repeats, sizes=verify_sizes(cal.draft_cap)),
        index,
    )
    cal.fit = fit = fit_verify_cost([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])
    yield StepResult(
        index,
        STEPS[index - 1][0],
        f"T_exp {fit.t_exp * 1e3:.4f} ms · T_tok {fit.t_tok * 1e3:.3f} ms · intercept "
        f"{fit.intercept * 1e3:.2f} ms · {r2_text(fit.r2, fit.r2_ceiling)} · MAPE {fit.mape:.1%} "
        f"({fit.n} batches)",
        fit_data(samples, fit),
    )


def step_hot_experts(cal: Calibration, index: int) -> StepEvents:
    emap = cal.emap
    assert cal.rt is not None  # step 2 made it
    counts, n_tok = yield from cal.live(routing_counts(cal.rt, cal.prompts), index)
    eb = emap.expert_bytes
    # The ranking: most routed first, up to half of the expert bytes. A decoding process under a budget
    # pins the longest prefix that fits its own plan (offload.offload_decoder).
    cal.hot = hot = select_hot_experts(counts, eb, emap.total_expert_bytes // 2)
    # How many of them fit is the budget process's to say (next step): its batch and buffers, not this
    # process's, decide the room its plan leaves the hot experts.
    fit_text = " · how many fit is decided under the budget, in the next step" if cal.budget is not None else ""
    routed = counts.sum()
    share = float(sum(counts[layer, e] for layer, e in hot) / routed) if routed else 0.0
    yield StepResult(
        index,
        STEPS[index - 1][0],
        f"{len(hot)} most routed experts ({fmt_bytes(sum(int(eb[layer]) for layer, _ in hot))}, half of the "
        f"expert bytes) take {share:.0%} of {int(routed)} routings over {n_tok} tokens{fit_text}",
        {"hot_experts": [list(p) for p in hot], "counts": counts.tolist(), "routed_share": share, "tokens": n_tok},
    )


NO_GPU = "skipped: no GPU backend in this llama.cpp build"
NO_GPU_DEVICE = "skipped: no GPU among llama.cpp's devices"  # a backend of other devices (a remote one, say)


def step_gpu(cal: Calibration, index: int) -> StepEvents:
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
        mode = yield from cal.live(
            measure_copy_mode(
                str(cal.info.path),
                sizes=verify_sizes(cal.draft_cap),
                n_gpu_layers=layers,
                threads=cal.threads,
                repeats=cal.repeats,
                use_extra_bufts=cal.cpu.extra,
            ),
            index,
        )
    except RuntimeError as e:
        why = f"failed: {e}"
        yield StepResult(index, name, why, {"skipped": why})
        return
    samples = mode.copy_samples
    fit = fit_verify_cost([x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
    cal.gpu = {"h2d": rate, "mode": mode, "fit": fit, "n_gpu_layers": layers}
    where = (
        f"copying wins from {mode.crossover} tokens"
        if mode.crossover is not None
        else f"copying never won up to {max(mode.sizes)} tokens"
    )
    yield StepResult(
        index,
        name,
        f"host→device {rate / 1e9:.1f} GB/s · {where} · T_exp copied {fit.t_exp * 1e3:.4f} ms (R² {fit.r2:.3f})",
        {
            "host_to_device_gb_s": rate / 1e9,
            "copy_min_batch": mode.crossover,
            **mode.as_dict(),
            "fit_copy": fit_dict(fit),
        },
    )
