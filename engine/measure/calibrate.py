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

This module runs the steps in order and builds the profile (step 7); the events are in calibration_events,
steps 1 to 4 and 6 in calibration_steps, step 5 in calibration_budget, the measurements they take in
calibration_measures, and the timings under a budget in calibration_worker (a process of their own).
calibration_process runs the whole generator in a process of its own, for a caller inside a budget's cgroup.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Callable, Iterator
from typing import Any

from ..decoding.cpu_buffers import choose as choose_cpu_buffers
from ..decoding.generation_config import defaults_for
from ..decoding.gpu import Placement
from ..errors import ConfigError, ModelError
from ..model_info import ModelInfo, read_model_info
from ..offload import Budget, expert_map
from ..profile_schema import SCHEMA_VERSION
from ..profiles import check_name, check_writable, find_profile, load_profile, save_profile
from .calibration_budget import step_under_budget
from .calibration_events import (
    STEPS,
    CalibrationDone,
    CalibrationEvent,
    StepProgress,
    StepResult,
    StepStarted,
    ceiling_field,
    fit_dict,
)
from .calibration_measures import read_prompts
from .calibration_steps import (
    Calibration,
    gb,
    step_bandwidth,
    step_cost_model,
    step_gpu,
    step_hot_experts,
    step_plain_and_draft,
)
from .costmodel import Stopped
from .device import cpu_name, default_threads, memory_bytes

DEFAULT_NAME = "local"
DRAFT_CAP = 8


def device_name(n_threads: int) -> str:
    return f"{cpu_name()} ({n_threads} threads)"


def _model_block(cal: Calibration) -> dict[str, Any]:
    """This model's block of the profile: the constants decoding uses, the fits, how they were measured."""
    info, emap, fit, cold = cal.info, cal.emap, cal.fit, cal.cold
    mean_eb = float(emap.expert_bytes[list(emap.moe_layers)].mean())
    if cold is not None:
        t_exp_cold, cold_how = cold["miss_fit"].t_miss * 1e3, "measured under the budget"
    elif cal.sto_bw:
        t_exp_cold, cold_how = mean_eb / cal.sto_bw * 1e3, "derived: expert bytes / storage bandwidth"
    else:
        t_exp_cold, cold_how = None, "unknown"
    block: dict[str, Any] = {
        "model": info.path.name,
        "arch": info.arch,
        "n_layer": info.n_layer,
        "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used,
        "expert_bytes": int(round(mean_eb)),
        "storage_bandwidth_gb_s": gb(cal.sto_bw, 3),  # reads of this model's experts: its own rates
        "storage_bandwidth_qd8_gb_s": gb(cal.sto_bw_deep, 3),
        "draft_topk": cal.draft_topk,
        "t_ar_ms": round(cal.t_ar * 1e3, 6),
        "c_draft_ms": round(cal.c_draft * 1e3, 6),
        "t_exp_ms": round(fit.t_exp * 1e3, 6),
        "t_exp_cold_ms": None if t_exp_cold is None else round(t_exp_cold, 6),
        "t_tok_ms": round(fit.t_tok * 1e3, 6),
        "intercept_ms": round(fit.intercept * 1e3, 6),
        "fit": fit_dict(fit),
    }
    if cold is not None:
        block["fit_cold"] = fit_dict(cold["fit"])  # per distinct expert, at this budget's hit rate
        m = cold["miss_fit"]
        block["fit_cold_misses"] = {
            "intercept_ms": round(m.intercept * 1e3, 6),
            "t_exp_warm_ms": round(m.t_hit * 1e3, 6),
            "t_exp_cold_ms": round(m.t_miss * 1e3, 6),
            "t_tok_ms": round(m.t_tok * 1e3, 6),
            "r2": round(m.r2, 6),
            "mape": round(m.mape, 6),
            "n": m.n,
            # what the same batches fit given the storage faults they actually
            # took (known only afterwards): the ceiling a residency snapshot faces
            "r2_given_faults": round(cold["given_faults"]["r2"], 6),
        } | ceiling_field(m)
        if cal.cache_fit:
            block["cache_fit"] = cal.cache_fit
        block["t_ar_cold_ms"] = round(cold["t_ar"] * 1e3, 6)
        block["c_draft_cold_ms"] = round(cold["c_draft"] * 1e3, 6)
    if cal.gpu is not None:
        # what decoding with the experts in host memory pays per distinct expert: its copy to the GPU
        gfit = cal.gpu["fit"]
        block["t_exp_copy_ms"] = round(gfit.t_exp * 1e3, 6)
        block["copy_min_batch"] = cal.gpu["mode"].crossover
        block["fit_copy"] = fit_dict(gfit)
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


def _step_profile(cal: Calibration, index: int, name: str, save: bool) -> Iterator[StepResult | CalibrationDone]:
    profile = _merge_into_existing(
        name,
        {
            "schema": SCHEMA_VERSION,
            "name": name,
            "kind": "measured",
            "description": f"measured by s2moe calibrate on {platform.node() or 'this machine'}",
            "device": {
                "name": device_name(cal.threads),
                "kind": "cpu" if cal.gpu is None else "gpu",
                "host_to_device_gb_s": None if cal.gpu is None else gb(cal.gpu["h2d"], 3),
                "memory_bytes": memory_bytes(),
                "budget_bytes": cal.budget_bytes,
                "memory_bandwidth_gb_s": round(cal.mem_bw / 1e9, 3),
                "storage_bandwidth_gb_s": gb(cal.sto_bw, 3),  # queue depth 1
                "storage_bandwidth_qd8_gb_s": gb(cal.sto_bw_deep, 3),  # queue depth 8
            },
        },
        cal.info.fingerprint,
        _model_block(cal),
    )
    path = save_profile(profile, name) if save else None
    where = f"wrote {path}" if path else "not written to a file yet"
    yield StepResult(
        index, STEPS[index - 1][0], f"{where} · model {cal.info.fingerprint}", {"path": str(path) if path else None}
    )
    yield CalibrationDone(profile, path)


# -- the generator ---------------------------------------------------------------------------------------------
def run_calibration(
    model_path: str | os.PathLike[str],
    *,
    budget: Budget | None = None,
    prompts: list[str] | tuple[str, ...] | str | os.PathLike[str] | None = None,
    name: str | None = None,
    save: bool = True,
    n_threads: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    repeats: int = 3,
    draft_topk: int | None = None,
    draft_cap: int = DRAFT_CAP,
    placement: Placement = Placement(),
    n_batch: int | None = None,
) -> Iterator[CalibrationEvent]:
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
    cal = Calibration(
        info,
        expert_map(info.path),
        budget=budget,
        prompts=list(prompts) if isinstance(prompts, (list, tuple)) else read_prompts(prompts),
        threads=n_threads or default_threads(),
        repeats=repeats,
        draft_topk=draft_topk,
        draft_cap=draft_cap,
        stop=should_stop or (lambda: False),
        placement=placement,
        n_batch=n_batch,
        cpu=cpu,
    )
    steps: tuple[Callable[[Calibration, int], Iterator[StepProgress | StepResult | CalibrationDone]], ...] = (
        step_bandwidth,
        step_plain_and_draft,
        step_cost_model,
        step_hot_experts,
        step_under_budget,
        step_gpu,
        lambda cal, index: _step_profile(cal, index, name, save),
    )
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


def _check_loads(info: ModelInfo, n_threads: int | None, draft_cap: int, placement: Placement) -> None:
    """Load the model as step 2 will, and let go of it: a file llama.cpp refuses is one error before the
    first step prints anything, not one after step 1's output. The load reads the file into the page cache,
    which the bandwidth step drops again before it measures storage; it is not kept open for that reason."""
    from ..decoding.runtime import LlamaRuntime

    LlamaRuntime(
        info,
        n_ctx=512,
        n_threads=n_threads,
        max_verify_rows=max(16, draft_cap + 1),
        use_extra_bufts=False,
        placement=placement,
        install_hook=False,
    ).close()


def _merge_into_existing(name: str, fresh: dict[str, Any], fingerprint: str, block: dict[str, Any]) -> dict[str, Any]:
    """Keep the other models of an existing user profile of the same name; replace this model's block."""
    models: dict[str, Any] = {}
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
