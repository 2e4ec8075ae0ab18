"""Fakes for the app tests: a scripted decoder (deterministic events, optional delay per iteration) and
scripted calibration and bench runs that yield the engine's own event types. No tests here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from inspect import signature
from pathlib import Path

import numpy as np
from s2moe.engine.decoding.chat import Template
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import (
    CostConstants,
    DraftCandidate,
    Finished,
    Iteration,
    Prefilled,
    ResidencySnapshot,
    Started,
)
from s2moe.engine.measure.bench import run_bench as REAL_RUN_BENCH
from s2moe.engine.measure.bench_results import BenchDone, BenchProgress, BenchRow
from s2moe.engine.measure.calibrate import run_calibration as REAL_RUN_CALIBRATION
from s2moe.engine.measure.calibration_events import CalibrationDone, StepProgress, StepResult, StepStarted
from s2moe.engine.measure.speed import MIN_PAIRS, Load, compare

VOCAB = {
    i: w
    for i, w in enumerate(
        [
            " The",
            " cat",
            " sat",
            " on",
            " the",
            " mat",
            ".",
            " It",
            " was",
            " warm",
            " and",
            " soft",
            " dog",
            " ran",
            " away",
            " home",
        ]
    )
}


@dataclass(frozen=True)
class FakeInfo:
    path: Path = Path("fake-moe.gguf")
    name: str = "fake-moe"
    arch: str = "olmoe"
    n_layer: int = 4
    n_expert: int = 8
    n_expert_used: int = 4
    fingerprint: str = "0123456789abcdef"
    file_bytes: int = 1 << 20

    @property
    def is_moe(self) -> bool:
        return True


# (accepted drafts, rejected drafts, target token): a bonus, two corrections, a plain step, ...
SCRIPT = [
    ((0, 1), (), 2),
    ((3,), (12, 13), 4),
    ((5, 6), (), 7),
    ((), (14,), 8),
    ((9, 10, 11), (), 6),
]


def scripted_iterations(mode: str = "s2moe", n_layer: int = 4, repeat: int = 1):
    """Deterministic Iteration events (plain steps in ar mode)."""
    index = 0
    for _ in range(repeat):
        for accepted, rejected, target in SCRIPT:
            index += 1
            if mode == "ar":
                accepted, rejected = (), ()
            drafted = accepted + rejected
            committed = accepted + (target,)
            cands = tuple(
                DraftCandidate(t, VOCAB[t], 0.9 - 0.1 * j, 0.9 ** (j + 1), 3.0 - 0.6 * j, np.ones(n_layer, int), True)
                for j, t in enumerate(drafted)
            )
            if mode != "ar":
                cands += (DraftCandidate(15, VOCAB[15], 0.2, 0.05, 0.4, np.ones(n_layer, int), False),)
            reuse = np.array([0.4 + 0.1 * (layer % 3) for layer in range(n_layer)]) if drafted else np.zeros(n_layer)
            yield Iteration(
                index=index,
                candidates=cands,
                drafted=drafted,
                accepted=accepted,
                rejected=rejected,
                target_token=target,
                committed=committed,
                committed_text="".join(VOCAB[t] for t in committed),
                draft_stop="utility" if drafted else "no-draft",
                rollback=len(rejected),
                kv_end=10 + index,
                n_committed=10 + index,
                verify_tokens=len(drafted) + 1,
                verify_experts=np.full(n_layer, 4 + len(drafted)),
                reuse_ratio=reuse,
                gated_moves=1 if rejected else 0,
                t_draft=0.001,
                t_verify=0.002,
            )


COST = CostConstants(t_ar=0.01, c_draft=0.004, t_exp=0.0001, t_tok=0.001, intercept=0.002, source="profile:test")


def scripted_events(mode: str = "s2moe", repeat: int = 1, utility: bool = True, reuse_strength: float = 0.5):
    """A whole generation: Started, Prefilled, iterations, Finished, with fixed numbers."""
    its = list(scripted_iterations(mode, repeat=repeat))
    config = {"mode": mode, "threshold": 1.0, "utility": utility, "reuse_strength": reuse_strength}
    events = [
        Started(mode, "fake-moe", (1, 2, 3), 4, 8, 4, config, COST if mode == "s2moe" else None),
        Prefilled(3, 0.01),
    ]
    events += its
    tokens = tuple(t for it in its for t in it.committed)
    events.append(Finished(tokens, "".join(VOCAB[t] for t in tokens), len(tokens), 0.5, "length", len(its)))
    return events


class FakeDecoder:
    """Stands in for engine.decoding.decoder.Decoder: the scripted iterations, forever if `endless`."""

    def __init__(
        self, path: str = "fake-moe.gguf", *, delay: float = 0.0, endless: bool = False, residency: bool = False
    ):
        self.info = FakeInfo()
        self.residency = residency  # emit ResidencySnapshot events, as an offloading decoder does
        self.delay = delay
        self.endless = endless
        self.closed = False
        self.last_stop_reason = None
        self.configs = []

    chat_template = Template(None, None)  # a base model: each prompt a completion

    def forget_context(self) -> None:
        pass  # no KV cache to forget

    def detokenize(self, tokens) -> str:
        return "".join(VOCAB[t] for t in tokens)

    def piece_text(self, token: int) -> str:
        return VOCAB[token]

    def generate(self, prompt, cfg=None, should_stop=None, keep_context=False):
        cfg = cfg or GenerationConfig()
        self.configs.append(cfg)
        cfg.validate(self.info)
        t0 = time.perf_counter()
        yield Started(
            cfg.mode,
            "fake-moe",
            (1, 2, 3),
            4,
            8,
            4,
            {
                "mode": cfg.mode,
                "threshold": cfg.threshold,
                "utility": cfg.utility,
                "reuse_strength": cfg.reuse_strength,
            },
            COST,
        )
        yield Prefilled(3, 0.001)
        tokens, n, reason = [], 0, "length"
        while True:
            for it in scripted_iterations(cfg.mode):
                if should_stop is not None and should_stop():
                    reason = "interrupted"
                    break
                if self.delay:
                    time.sleep(self.delay)
                tokens.extend(it.committed)
                n += 1
                yield it
                if self.residency and n % 2 == 1:
                    shape = (self.info.n_layer, self.info.n_expert)
                    resident = np.full(shape, 0.25)
                    resident[:, 0] = 1.0
                    pinned = np.zeros(shape, bool)
                    pinned[:, 0] = True
                    hit = np.array([0.5, 0.75, float("nan"), 1.0])
                    yield ResidencySnapshot(n, resident, pinned, hit)
            else:
                if self.endless:
                    continue
            break
        self.last_stop_reason = reason
        yield Finished(tuple(tokens), self.detokenize(tokens), len(tokens), time.perf_counter() - t0, reason, n)

    def close(self) -> None:
        self.closed = True


def fake_run_calibration(calls: list | None = None):
    """Stands in for engine.measure.calibrate.run_calibration (called as the real one would be): its events with fixed
    numbers. `calls` collects the arguments of each call."""
    calls = [] if calls is None else calls
    steps = [
        ("bandwidth", "memory and storage bandwidth"),
        ("steps", "T_AR and draft step cost"),
        ("cost model", "regression of verification latency on experts and tokens"),
    ]

    def run_calibration(model_path, **kw):
        call = signature(REAL_RUN_CALIBRATION).bind(model_path, **kw)
        calls.append(call.arguments)
        name = call.arguments.get("name")
        for i, (step, desc) in enumerate(steps, 1):
            yield StepStarted(i, len(steps), step, desc)
            for d in range(1, 4):
                yield StepProgress(i, d, 3)
            data = {}
            if step == "cost model":
                measured = [1.0, 1.5, 2.0, 2.6, 3.1, 3.4]
                data = {"measured": measured, "predicted": [m * 1.02 for m in measured], "r2": 0.987, "mape": 0.021}
            yield StepResult(i, step, f"{step} measured", data)
        profile = {
            "schema": 1,
            "name": name or "local",
            "kind": "measured",
            "device": {"name": "test cpu", "kind": "cpu"},
            "models": {
                "0123456789abcdef": {
                    "model": "fake-moe.gguf",
                    "t_ar_ms": 10.0,
                    "c_draft_ms": 4.0,
                    "t_exp_ms": 0.1,
                    "t_tok_ms": 1.0,
                    "intercept_ms": 2.0,
                }
            },
        }
        yield CalibrationDone(profile, None)

    return run_calibration


def fake_run_bench(model, **kw):
    """Stands in for engine.measure.bench.run_bench (called as the real one would be): its events with fixed numbers."""
    call = signature(REAL_RUN_BENCH).bind(model, **kw)
    call.apply_defaults()
    args = call.arguments
    prompts, modes, n_tokens, prompt_set = args["prompts"], args["modes"], args["n_tokens"], args["prompt_set"]
    modes = ["ar"] + [m for m in modes if m != "ar"]
    repeats = args["repeats"]
    total = repeats * len(prompts) * len(modes)
    done = 0
    if args["warmup"]:
        for m in modes:
            yield BenchProgress(0, total, m, 0, warmup=True)
    for rep in range(repeats):
        for pi, _ in enumerate(prompts):
            for m in modes:
                done += 1
                yield BenchProgress(done, total, m, pi, repeat=rep)
    n_runs = repeats * len(prompts)
    # each generation's tok/s, a little apart from run to run: s2moe clearly ahead of ar
    runs = {
        m: [(100.0 + 20 * i) * (1 + 0.01 * ((k * 7 + i * 3) % 5 - 2)) for k in range(n_runs)]
        for i, m in enumerate(modes)
    }
    interval = {m: compare(m, "ar", [a / b for a, b in zip(runs[m], runs["ar"])]) for m in modes}
    rows = [
        BenchRow(
            mode=m,
            budget="none",
            prompt_set=prompt_set,
            n_prompts=len(prompts),
            n_tokens=n_tokens,
            seconds=n_tokens / (100.0 + 20 * i),
            tok_per_s=100.0 + 20 * i,
            speedup_vs_ar=1.0 + 0.2 * i,
            accept_len=1.0 + i,
            draft_len=float(i),
            acceptance_rate=0.0 if m == "ar" else 0.8,
            reuse_ratio=None if m == "ar" else 0.5,
            reuse_ratio_per_layer=None,
            verify_experts=None,
            effective_verify_cost=None,
            rollbacks=3 * i,
            t_draft=0.0,
            t_verify=0.0,
            identical_to_ar=None if m == "ar" else 1.0,
            tokens=[[1, 2]] * len(prompts) if m == "ar" else None,
            tok_per_s_repeats=[100.0 + 20 * i + d for d in (-4.0, 0.0, 6.0)[:repeats]],
            speedup_repeats=[1.0 + (0.2 * i + d if m != "ar" else 0.0) for d in (-0.05, 0.0, 0.1)[:repeats]],
            run_tok_per_s=runs[m],
            speedup_interval=None if m == "ar" or interval[m].n < MIN_PAIRS else [interval[m].low, interval[m].high],
        )
        for i, m in enumerate(modes)
    ]
    yield BenchDone(rows, {}, {"r2": 0.95}, {}, config={"load": FAKE_LOAD.as_dict()})


# what the fake bench says else ran on the CPUs meanwhile: enough to warn
FAKE_LOAD = Load(cpus=4, load_at_start=1.0, other_cpus=1.2, busiest=[("cc1", 0.9), ("make", 0.3)], seconds=30.0)


VALID_PROFILE = """\
schema: 1
name: test-cpu
kind: measured
description: a test profile
device: {name: test cpu, kind: cpu}
models:
  0123456789abcdef: {model: fake-moe.gguf, t_ar_ms: 10.0, c_draft_ms: 4.0, t_exp_ms: 0.1, t_tok_ms: 1.0,
                     intercept_ms: 2.0, fit: {r2: 0.98, mape: 0.03}}
reference: {t_ar_ms: 100, c_draft_ms: 7.5, t_exp_ms: 0.156}
"""

REFERENCE_PROFILE = """\
schema: 1
name: orin-paper
kind: reference
device: {name: Jetson Orin (published), kind: jetson}
reference: {t_ar_ms: 100, c_draft_ms: 7.5, t_exp_ms: 0.156}
"""


def write_profiles(folder: Path) -> Path:
    """A user profile folder with one measured (for the fake model) and one reference profile."""
    d = folder / "s2moe" / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    (d / "test-cpu.yaml").write_text(VALID_PROFILE)
    (d / "orin-paper.yaml").write_text(REFERENCE_PROFILE)
    return d


def only_test_profiles(tmp_path: Path, monkeypatch) -> None:
    """Profiles come only from a folder the test writes (write_profiles): no user or shipped profile leaks in."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    write_profiles(tmp_path / "config")
    empty = tmp_path / "shipped"
    empty.mkdir()
    monkeypatch.setattr("s2moe.engine.profiles.shipped_profile_dir", lambda: empty)
