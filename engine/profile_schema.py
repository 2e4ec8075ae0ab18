"""The device profile's schema and its validation: what a profile file holds, field by field, and the
checks that refuse one that does not hold it, naming the file and the failing field.

A profile is a YAML file, validated on load; an invalid one fails with the file and the failing field
named. Constants for a model are keyed by the model's fingerprint (model_info.fingerprint) so that a
profile calibrated for one model is never silently applied to another. A `kind: reference` profile
carries published figures and may hold `reference` constants that apply to any model, reported as such.
Finding, loading, saving and reading constants from a profile are in profiles.

    schema: 1
    name: cpu-generic
    kind: measured                 # measured | reference
    description: free text
    device:
      name: x86-64 CPU, 2 threads
      kind: cpu                    # cpu | gpu | jetson | other
      memory_bytes: 25283485696    # physical memory
      budget_bytes: null           # memory budget the profile was measured under (null: none)
      memory_bandwidth_gb_s: 26.1  # GB = 1e9 bytes
      storage_bandwidth_gb_s: 0.75 # cold reads of whole experts, one at a time (the model calibrated last's:
      storage_bandwidth_qd8_gb_s: 1.0  # ... eight in flight                    each model's own are in its block)
      host_to_device_gb_s: 25.0    # optional (a GPU): copies from host memory into the GPU's
    models:
      <fingerprint>:               # 16 hex digits
        model: olmoe-64x8.gguf     # file name when measured (informative)
        arch: olmoe
        n_layer: 6
        n_expert: 64
        n_expert_used: 8
        expert_bytes: 52224        # one expert of one layer: gate + up + down slices
        storage_bandwidth_gb_s: 0.75     # optional: cold reads of this model's whole experts, one at a time
        storage_bandwidth_qd8_gb_s: 1.0  # ... eight in flight (a rate depends on the size of the reads)
        t_ar_ms: 10.0              # median plain decoding step
        c_draft_ms: 7.7            # median draft step (k_d experts)
        t_exp_ms: 0.05             # one more distinct expert in a verification batch, resident
        t_exp_cold_ms: 0.9         # ... fetched from storage (measured under a budget, or derived)
        t_ar_cold_ms: 120.0        # optional: plain and draft steps measured under the budget
        c_draft_cold_ms: 60.0
        t_tok_ms: 4.0              # one more token in a verification batch
        intercept_ms: 1.0
        fit: {intercept_ms: 1.0, t_exp_ms: 0.05, t_tok_ms: 4.0, r2: 0.97, mape: 0.04, n: 60}
        t_exp_copy_ms: 0.07        # optional (a GPU): one more distinct expert, experts in host memory copied
        copy_min_batch: 2          # ... from this verification batch size copying beats the CPU (null: never)
        fit_copy: {...}            # ... the fit T_exp_copy comes from, same fields as fit
        fit_cold: {...}            # optional, same fields, under the budget (per distinct expert)
        fit_cold_misses: {intercept_ms, t_exp_warm_ms, t_exp_cold_ms, t_tok_ms, r2, mape, n, r2_given_faults,
                          r2_ceiling}
                                   # optional: the same batches by resident vs fetched experts;
                                   # r2_given_faults: refitted on the storage faults they took;
                                   # r2_ceiling (here and in any fit, optional): the most any model of the
                                   # batches' counts reaches, given how the same counts' timings spread
        workload:                  # optional: what the constants above leave out at a workload's context,
                                   # timed in the engine's own runtime (s2moe calibrate, step 2)
          context_tokens: 32       # the context t_ar_ms, c_draft_ms and the fit were timed after
          t_plain_ms: 0.45         # an iteration of plain decoding (mode ar) through the engine at that
          ctx_plain_us: 1.8        # context (its step and the loop's own work), and what each further token adds
          t_draft_ms: 0.42         # a draft pass's decode at that context
          ctx_draft_us: 2.4        # ... per further token of context
          ctx_step_us: 3.3         # a verification's first row (routing recorded), per token of context
          ctx_row_us: 1.7          # ... each further row of it
          host_draft_ms: 0.18      # the engine's own time per draft pass beyond its decode (sampling, the rule)
          host_row_ms: 0.05        # the decoding loop's own time per verified row (acceptance, bookkeeping)
          contexts: [32, 128, 256, 384]            # optional: what the slopes were fitted on: medians per
          observed_ms: [..], draft_ms: [..], verify_ms: [..]   # context (verify: cap + 1 rows)
          verify_rows: 9
          iterations: 60           # the engine iterations the host times are medians of
          plain_iterations: 350    # ... and the plain ones the plain step's line is fitted on
        cache_fit:                 # optional (calibrate --budget): what the offloading held in effect there
          planned_experts: 64      # the plan's expert cache beside the pinned hot experts
          effective_experts: 30    # the LRU cache that fetches what greedy plain decoding counted
          tokens: 80
          fetched_per_token: 24.1
          pinned: 64
          step_ms: 61.0            # optional: the mean step of that decoding (its fetches as decoding pays them)
        hot_experts: [[0, 12], [0, 3], ...]   # [layer, expert], most routed first (up to half the
                                   # expert bytes); a run under a budget pins the prefix that fits
        measured: {at: 2026-01-01T00:00:00+00:00, by: s2moe calibrate, threads: 2, ...}
        tuned:                     # optional, written by s2moe tune (engine/measure/tune.py), per condition
          resident:                # or budget: the model under a memory budget
            settings: {draft_topk: 2, draft_max: 8, threshold: 1.0, reuse_strength: 0.5, reuse_cap: 16, lookup: true,
                       memory_strength: 0.3}   # searched under a budget only
            memory_quality_checked: [{memory_strength, ppl_ratio, top1_agreement, top1_se, log_ppl_ratio_se,
                                      tokens, ok, extended}, ...]  # budget; the errors: bench.batch_means_se
            joint_quality_checked: [{reuse_strength, reuse_cap, memory_strength, ppl_ratio, ...}, ...]  # budget
            defaults: {...}        # the model's defaults, measured in the same run
            speed: {tuned_tok_s, defaults_tok_s, ar_tok_s, gain, per_prompt_ratios, separated, verdict, ...}
            quality: {ppl_ratio, top1_agreement, tokens}   # or {lossless: true}; + memory, both: {...} under a budget
            search: {method, candidates, rungs, seconds, time_budget_s, quality_checks_s, unchecked,
                    stopped_checking, ...}
            log: [{rung, draft_topk, ..., tok_s, prompts, kept}, ...]
            measured: {at, by: s2moe tune, budget, prompts, threads}  # + copy_cache_generations with --copy-cache
    reference:                     # optional: constants for any model (reference profiles)
      t_ar_ms: 100
      c_draft_ms: 7.5
      t_exp_ms: 0.15625
      expert_bytes: 599654
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import ConfigError

SCHEMA_VERSION = 1
PROFILE_KINDS = ("measured", "reference")
DEVICE_KINDS = ("cpu", "gpu", "jetson", "other")
_CONST_KEYS = ("t_ar_ms", "c_draft_ms", "t_exp_ms")
_OPTIONAL_KEYS = ("t_tok_ms", "intercept_ms", "t_exp_cold_ms", "t_ar_cold_ms", "c_draft_cold_ms", "t_exp_copy_ms")
STORAGE_KEYS = ("storage_bandwidth_gb_s", "storage_bandwidth_qd8_gb_s")
_FIT_KEYS = ("intercept_ms", "t_exp_ms", "t_tok_ms", "r2", "mape", "n")
# `s2moe tune`'s result per model, by where the model runs: fully resident, or under a memory budget
TUNED_CONDITIONS = ("resident", "budget")
TUNED_KEYS = ("draft_topk", "draft_max", "threshold", "reuse_strength", "reuse_cap", "lookup", "memory_strength")
TUNED_DRAFT_MAX = 16  # a decoder's verification batch is sized for at most this many drafted tokens


# YAML 1.1, which PyYAML reads, takes a number with an exponent but no dot (1e-3) for text.
_EXPONENT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")
# Whole numbers in a profile are counts and bytes; anything wider than 64 bits is a typo that would
# overflow where it is used.
_MAX_WHOLE = (1 << 63) - 1


def _number(
    block: dict[str, Any],
    key: str,
    where: str,
    *,
    required: bool = False,
    positive: bool = False,
    allow_none: bool = True,
    integer: bool = False,
    signed: bool = False,
) -> float | None:
    if key not in block or (block[key] is None and allow_none and not required):
        if required:
            raise ConfigError(f"{where}: missing field {key}")
        return None
    v = block[key]
    if isinstance(v, str) and not integer and _EXPONENT.fullmatch(v.strip()):
        v = block[key] = float(v)
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _MAX_WHOLE:
        raise ConfigError(f"{where}: field {key} is too large ({len(str(abs(v)))} digits)")
    kind = "whole number" if integer else "number"
    if signed:  # a regression intercept may come out below zero
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{where}: field {key} must be a number, got {v!r}")
        return v
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (integer and not isinstance(v, int))
        or (isinstance(v, float) and not math.isfinite(v))
        or v < 0
        or (positive and v == 0)
    ):
        sign = "positive" if positive else "non-negative"
        raise ConfigError(f"{where}: field {key} must be a {sign} {kind}, got {v!r}")
    return v


def _mapping(value: object, where: str, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: field {field} must be a mapping, got {type(value).__name__}")
    return value


def _r2(block: dict[str, Any], key: str, where: str) -> None:
    v = _number(block, key, where, signed=True)
    if v is not None and v > 1:
        raise ConfigError(f"{where}: field {key} must be a number ≤ 1, got {v!r}")


def _validate_fit(block: object, where: str) -> None:
    block = _mapping(block, where, "fit")
    for key in _FIT_KEYS:
        if key == "r2":
            _r2(block, key, where)
        else:
            _number(block, key, where, integer=(key == "n"), signed=(key == "intercept_ms"))
    _r2(block, "r2_ceiling", where)


def validate_constants(block: object, where: str, n_layer: int | None = None, n_expert: int | None = None) -> None:
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: expected a mapping of constants")
    for key in _CONST_KEYS:
        _number(block, key, where, required=True, positive=(key == "t_ar_ms"))
    for key in _OPTIONAL_KEYS:
        _number(block, key, where, signed=(key == "intercept_ms"))
    for key in STORAGE_KEYS:
        _number(block, key, where, positive=True)
    for key in ("expert_bytes", "n_layer", "n_expert", "n_expert_used"):
        _number(block, key, where, integer=True)
    _number(block, "copy_min_batch", where, positive=True, integer=True)
    for key in ("fit", "fit_cold", "fit_copy"):
        if block.get(key) is not None:
            _validate_fit(block[key], f"{where}.{key}")
    misses = block.get("fit_cold_misses")
    if misses is not None:
        misses = _mapping(misses, where, "fit_cold_misses")
        mw = f"{where}.fit_cold_misses"
        for key in ("t_exp_warm_ms", "t_exp_cold_ms", "t_tok_ms", "mape"):
            _number(misses, key, mw)
        _number(misses, "intercept_ms", mw, signed=True)
        _number(misses, "n", mw, integer=True)
        for key in ("r2", "r2_given_faults", "r2_ceiling"):
            _r2(misses, key, mw)
    if block.get("workload") is not None:
        _validate_workload(block["workload"], f"{where}.workload")
    if block.get("cache_fit") is not None:
        fit = _mapping(block["cache_fit"], where, "cache_fit")
        for key in ("planned_experts", "effective_experts", "tokens", "pinned"):
            _number(fit, key, f"{where}.cache_fit", required=key != "pinned", integer=True)
        _number(fit, "fetched_per_token", f"{where}.cache_fit")
        _number(fit, "step_ms", f"{where}.cache_fit", positive=True)
    hot = block.get("hot_experts")
    if hot is not None:
        if not isinstance(hot, list):
            raise ConfigError(f"{where}: field hot_experts must be a list of [layer, expert] pairs")
        n_layer = block.get("n_layer", n_layer)
        n_expert = block.get("n_expert", n_expert)
        seen = set()
        for i, pair in enumerate(hot):
            ok = (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
            )
            if not ok:
                raise ConfigError(
                    f"{where}: field hot_experts[{i}] must be a [layer, expert] pair of whole numbers, got {pair!r}"
                )
            if (n_layer is not None and pair[0] >= n_layer) or (n_expert is not None and pair[1] >= n_expert):
                raise ConfigError(
                    f"{where}: field hot_experts[{i}] = {list(pair)} is outside the model "
                    f"({n_layer} layers × {n_expert} experts)"
                )
            if tuple(pair) in seen:
                raise ConfigError(f"{where}: field hot_experts[{i}] = {list(pair)} is listed twice")
            seen.add(tuple(pair))
    measured = block.get("measured")
    if measured is not None and not isinstance(measured, dict):
        raise ConfigError(f"{where}: field measured must be a mapping (when, how)")
    if measured is not None:  # a projection sizes the process from it (with cache_fit)
        _number(measured, "budget_bytes", f"{where}.measured", integer=True, positive=True)
    if block.get("tuned") is not None:
        _validate_tuned(block["tuned"], where)


WORKLOAD_TERMS = (
    "t_plain_ms",
    "ctx_plain_us",
    "t_draft_ms",
    "ctx_draft_us",
    "ctx_step_us",
    "ctx_row_us",
    "host_draft_ms",
    "host_row_ms",
)


def _validate_workload(w: object, where: str) -> None:
    w = _mapping(w, where, "workload")
    _number(w, "context_tokens", where, required=True, positive=True, integer=True)
    for key in WORKLOAD_TERMS:
        _number(w, key, where, required=True, positive=key in ("t_plain_ms", "t_draft_ms"))
    for key in ("verify_rows", "iterations", "plain_iterations"):
        _number(w, key, where, positive=True, integer=True)
    contexts = w.get("contexts")
    if contexts is None:
        return
    if not isinstance(contexts, list) or not contexts:
        raise ConfigError(f"{where}: field contexts must be a list of context lengths")
    for i, c in enumerate(contexts):
        _number({"contexts": c}, "contexts", f"{where}, contexts[{i}]", required=True, positive=True, integer=True)
    for key in ("observed_ms", "draft_ms", "verify_ms"):
        times = w.get(key)
        if times is None:
            continue
        if not isinstance(times, list) or len(times) != len(contexts):
            raise ConfigError(f"{where}: field {key} must be a list of {len(contexts)} times, one per context")
        for i, t in enumerate(times):
            _number({key: t}, key, f"{where}, {key}[{i}]", required=True)


def _validate_tuned(tuned: object, where: str) -> None:
    tuned = _mapping(tuned, where, "tuned")
    for condition, section in tuned.items():
        if condition not in TUNED_CONDITIONS:
            raise ConfigError(f"{where}: field tuned.{condition} must be one of {', '.join(TUNED_CONDITIONS)}")
        tw = f"{where}, tuned.{condition}"
        section = _mapping(section, tw, "tuned." + condition)
        settings = _mapping(section.get("settings"), tw, "settings")
        sw = f"{tw}.settings"
        for key in ("draft_topk", "reuse_cap"):
            _number(settings, key, sw, required=True, positive=True, integer=True)
        _number(settings, "draft_max", sw, required=True, positive=True, integer=True)
        if settings["draft_max"] > TUNED_DRAFT_MAX:
            raise ConfigError(f"{sw}: field draft_max must be at most {TUNED_DRAFT_MAX}, got {settings['draft_max']!r}")
        for key in ("threshold", "reuse_strength"):
            _number(settings, key, sw, required=True)
        if not isinstance(settings.get("lookup", True), bool):  # absent: tuned before tune searched copies
            raise ConfigError(f"{sw}: field lookup must be true or false, got {settings['lookup']!r}")
        _number(settings, "memory_strength", sw)  # absent: tuned before tune searched it


def validate_profile(data: object, where: str = "profile") -> dict[str, Any]:
    """Check a profile's structure; raise ConfigError naming the failing field. Returns data."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at top level")
    schema = data.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise ConfigError(f"{where}: field schema must be {SCHEMA_VERSION}, got {schema!r}")
    if "name" in data and not isinstance(data["name"], str):
        raise ConfigError(f"{where}: field name must be text")
    kind = data.get("kind", "measured")
    if kind not in PROFILE_KINDS:
        raise ConfigError(f"{where}: field kind must be one of {', '.join(PROFILE_KINDS)}, got {kind!r}")
    device = data.get("device")
    if device is not None:
        device = _mapping(device, where, "device")
        dw = f"{where}, device"
        if "name" in device and not isinstance(device["name"], str):
            raise ConfigError(f"{dw}: field name must be text")
        dkind = device.get("kind", "other")
        if dkind not in DEVICE_KINDS:
            raise ConfigError(f"{dw}: field kind must be one of {', '.join(DEVICE_KINDS)}, got {dkind!r}")
        for key in ("memory_bytes", "budget_bytes"):
            _number(device, key, dw, positive=True, integer=True)
        for key in ("memory_bandwidth_gb_s", "host_to_device_gb_s") + STORAGE_KEYS:
            _number(device, key, dw, positive=True)
    models = data.get("models")
    if models is not None:
        if not isinstance(models, dict):
            raise ConfigError(f"{where}: field models must be a mapping of fingerprint → constants")
        for fp, block in models.items():
            validate_constants(block, f"{where}, model {fp}")
    if data.get("reference") is not None:
        validate_constants(data["reference"], f"{where}, reference")
    if models is None and data.get("reference") is None:
        raise ConfigError(f"{where}: needs a field models (per model constants) or reference")
    return data
