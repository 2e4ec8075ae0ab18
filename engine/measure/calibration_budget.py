"""Calibration's step 5: the verification cost under the memory budget. The timings run in the cold worker
(calibration_worker, a process in a memory cgroup); this step starts it, reads the disk again once it is done,
and fits what it measured: the cost per distinct expert, the miss-aware cost with experts resident and
fetched apart, what the storage faults taken explain, and how many experts offloading held in effect while
plain decoding ran under the budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..offload import BudgetUnavailable, MemoryCgroup, fmt_bytes
from .calibration_events import STEPS, StepEvents, StepResult, fit_data
from .calibration_measures import STORAGE_DEPTHS, storage_bandwidth, storage_drift_note, verify_sizes
from .calibration_steps import Calibration
from .calibration_worker import PLAIN_FETCH_CHARS, PLAIN_FETCH_WARM, run_cold
from .cost_fits import fault_explained_fit, fit_miss_cost, fit_verify_cost, r2_text


def step_under_budget(cal: Calibration, index: int) -> StepEvents:
    cal.cold = cal.cache_fit = None
    skip: str | None
    if cal.budget is None:
        skip = "skipped: no memory budget given"
    else:
        skip = MemoryCgroup.unavailable_reason()
    if skip is None:
        assert cal.budget is not None  # a step with no budget is skipped (above)
        cal.close()  # the cold worker needs the memory
        n_steps = 4 * cal.repeats
        cfg = {
            "model": str(cal.info.path),
            "text": "\n\n".join(cal.prompts)[:PLAIN_FETCH_CHARS],
            "threads": cal.threads,
            "k_draft": cal.draft_topk,
            "cap": cal.draft_cap,
            "repeats": cal.repeats,
            "n_steps": n_steps,
            "n_samples": len(verify_sizes(cal.draft_cap)) * 3 * cal.repeats,
            "hot": [list(p) for p in cal.hot],
            "budget": str(cal.budget),
            "n_batch": cal.n_batch,
            "placement": cal.placement.as_dict(),
        }  # the cold timings place the weights as the others do
        try:
            res = yield from cal.live(run_cold(cal.info.path, cal.budget, cfg), index)
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


def _cold_result(cal: Calibration, index: int, res: dict[str, Any], after: dict[int, float]) -> StepResult:
    """Fit what the cold worker measured; keep it on cal.cold. after: the storage rates read once it was done
    ({queue depth: bytes/s}); the profile keeps the mean of those and the first step's."""
    from .replay_costs import decoding_fetch_price

    assert cal.budget is not None  # the cold worker ran under it
    cal.budget_bytes = res["budget"]
    cs = [tuple(s) for s in res["samples"]]
    experts, tokens, seconds, misses, faults = ([s[i] for s in cs] for i in range(5))
    cfit = fit_verify_cost(experts, tokens, seconds)
    mfit = fit_miss_cost(experts, misses, tokens, seconds)
    given = fault_explained_fit(experts, faults, tokens, seconds)
    cal.cache_fit = _cache_fit(
        res["plain"], res["record"], cal.info.n_expert, float(cal.emap.expert_bytes[list(cal.emap.moe_layers)].mean())
    )
    cal.n_batch = res.get("n_batch", cal.n_batch)
    cal.cold = {
        "fit": cfit,
        "miss_fit": mfit,
        "given_faults": given,
        "t_ar": res["t_ar"],
        "c_draft": res["c_draft"],
        "split": res["split"],
        "peak": res["peak"],
        "pinned": res["pinned"],
        "samples": cs,
    }
    # the plot and headline use the miss-aware model: under a budget what costs is a fetch
    data = {
        "measured": [x * 1e3 for x in seconds],
        "predicted": [float(mfit.predict(e, m, t)) * 1e3 for e, m, t in zip(experts, misses, tokens)],
        "experts": experts,
        "misses": misses,
        "tokens": tokens,
        "r2": mfit.r2,
        "r2_ceiling": mfit.r2_ceiling,
        "mape": mfit.mape,
        "t_exp_warm_ms": mfit.t_hit * 1e3,
        "t_exp_cold_ms": mfit.t_miss * 1e3,
        "t_tok_ms": mfit.t_tok * 1e3,
        "intercept_ms": mfit.intercept * 1e3,
        "paper_form": fit_data(cs, cfit),
        "t_ar_ms": res["t_ar"] * 1e3,
        "c_draft_ms": res["c_draft"] * 1e3,
        "split": res["split"],
        "peak": res["peak"],
        "n_batch": res.get("n_batch"),
        "pinned": res["pinned"],
        "r2_given_faults": given["r2"],
        "faults": faults,
    }
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
    return StepResult(
        index,
        STEPS[index - 1][0],
        f"under {cal.budget.describe(cal.budget_bytes)}: T_AR {res['t_ar'] * 1e3:.1f} ms · draft step "
        f"{res['c_draft'] * 1e3:.1f} ms · T_exp cold "
        f"{mfit.t_miss * 1e3:.3f} ms, warm {mfit.t_hit * 1e3:.3f} ms · T_tok "
        f"{mfit.t_tok * 1e3:.2f} ms · {r2_text(mfit.r2, mfit.r2_ceiling)} · MAPE {mfit.mape:.1%} · "
        f"{miss_rate:.0%} of experts missed · per distinct expert {cfit.t_exp * 1e3:.3f} ms "
        f"(R² {cfit.r2:.3f}) · given the storage faults taken, R² {given['r2']:.3f} · "
        f"peak {fmt_bytes(res['peak'] or 0)} · {len(pinned)} of the {len(cal.hot)} hot experts pinned "
        f"({fmt_bytes(res['pinned']['hot_experts'])}){plain}{drift}",
        data,
    )


def _cache_fit(
    plain: dict[str, Any], record: dict[str, Any] | None, n_expert: int, expert_bytes: float
) -> dict[str, Any] | None:
    """How many experts the engine's offloading held in effect when plain decoding ran under the budget: the
    size of an LRU cache (beside the pinned hot experts) that fetches what decoding counted over the same tokens,
    the first PLAIN_FETCH_WARM tokens warming both up. None without a plan."""
    from .cache_model import CachePlan, capacity_fetching

    if record is None or not plain["ids"]:
        return None
    planned = int(record["cache_bytes"] // expert_bytes)
    ids = [np.asarray(x) for x in plain["ids"]]
    counted = sum(plain["misses"][PLAIN_FETCH_WARM:])
    pinned = tuple(tuple(p) for p in record["pinned"])
    effective = capacity_fetching(ids, counted, CachePlan(planned, pinned, ""), n_expert, PLAIN_FETCH_WARM)
    n = len(ids) - PLAIN_FETCH_WARM
    fit = {
        "planned_experts": planned,
        "effective_experts": effective,
        "tokens": n,
        "fetched_per_token": round(counted / max(1, n), 6),
        "pinned": len(pinned),
    }
    if plain.get("seconds"):
        fit["step_ms"] = round(float(np.mean(plain["seconds"][PLAIN_FETCH_WARM:])) * 1e3, 6)
    return fit
