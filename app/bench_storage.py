"""The storage figures `s2moe bench` bounds a budgeted run's speed with: cold reads of the model's experts
taken just before and after each budget runs, their medians and ranges (or a profile's rates where none
could be read), and what a verification costs with the model in memory, for the bound's compute part."""

from __future__ import annotations

import statistics

# A disk's rate moves from one pass to the next and drifts over minutes (docs/offloading.md, "What bench
# measures under a budget"), so the bound is read from passes just before and just after each budget ran, not from a
# calibration made hours earlier.
STORAGE_PASSES = 3


def read_storage(emap) -> list[tuple[float, float]]:
    """Cold reads of this model's experts now, STORAGE_PASSES passes: [(bytes/s at queue depth 1, at depth 8)];
    none where the file's pages stay in memory (another process maps them)."""
    from ..engine.measure.calibration_measures import storage_bandwidth
    from ..engine.measure.costmodel import drive

    out = []
    for seed in range(STORAGE_PASSES):
        rates = drive(storage_bandwidth(emap, max_bytes=128 << 20, seed=seed))[0]
        if 1 in rates and 8 in rates:
            out.append((rates[1], rates[8]))
    return out


def storage_reading(passes: list[tuple[float, float]]) -> dict:
    """Passes read_storage read (bytes/s at depth 1 and 8): their medians and ranges in GB/s, and how many."""

    def gb(values):
        return statistics.median(values) / 1e9, [min(values) / 1e9, max(values) / 1e9]

    (qd1, qd1_range), (qd8, qd8_range) = gb([r[0] for r in passes]), gb([r[1] for r in passes])
    return {"qd1_gb_s": qd1, "qd8_gb_s": qd8, "qd1_range": qd1_range, "qd8_range": qd8_range, "readings": len(passes)}


def storage_record(
    around: dict[str, list[tuple[float, float]]], expert_bytes: float, profile: dict | None, fingerprint: str
) -> dict | None:
    """The bound's storage figures: for each budget label, the passes read around it (`around`); where none
    could be read cold, the profile's rates for this model (a rate read on another model's experts, reads of
    another size, does not apply); else None."""
    from ..engine.profiles import storage_rates

    every = [r for rs in around.values() for r in rs]
    if every:
        whole = storage_reading(every)
        readings = {label: storage_reading(rs) if rs else whole for label, rs in around.items()}
        by_budget = {label: {key: r[key] for key in ("qd8_gb_s", "qd8_range")} for label, r in readings.items()}
        return {
            "qd1_gb_s": whole["qd1_gb_s"],
            "qd8_gb_s": whole["qd8_gb_s"],
            "qd1_range": whole["qd1_range"],
            "qd8_range": whole["qd8_range"],
            "n_readings": len(every),
            "by_budget": by_budget,
            "expert_bytes": expert_bytes,
            "source": "read by this run before and after each budget",
        }
    rates = storage_rates(profile, fingerprint) if profile else None
    if not rates:
        return None
    return {
        "qd1_gb_s": rates[0],
        "qd8_gb_s": rates[1],
        "expert_bytes": expert_bytes,
        "by_budget": {label: {"qd8_gb_s": rates[1], "qd8_range": [rates[1], rates[1]]} for label in around},
        "source": f"profile {profile.get('name')}",
    }


def resident_verify_cost(resident_fit: dict, profile: dict | None, info):
    """What a verification of (experts, rows) costs with the model in memory: this run's resident fit, else
    the profile's constants for the model, else None."""
    if resident_fit:
        from ..engine.measure.cost_fits import Fit

        c = resident_fit
        return Fit(c["intercept_s"], c["t_exp_s"], c["t_tok_s"], c["r2"], c["mape"], c["n"]).predict
    if profile is not None:
        from ..engine.profiles import cost_for_model

        return cost_for_model(profile, info.fingerprint, info.path.name).verify_cost
    return None
