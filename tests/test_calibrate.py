"""Calibration end to end on a tiny model: the event contract, stopping, the profile it writes, the CLI."""

from __future__ import annotations

import pytest
from s2moe.engine.errors import ConfigError, ModelError
from s2moe.engine.measure.calibrate import run_calibration
from s2moe.engine.measure.calibration_events import CalibrationDone, StepProgress, StepResult, StepStarted
from s2moe.engine.measure.calibration_measures import read_prompts
from s2moe.engine.measure.cost_fits import r2_ceiling
from s2moe.engine.model_info import read_model_info
from s2moe.engine.offload import Budget
from s2moe.engine.profiles import cost_for_model, load_profile, save_profile

PROMPTS = ["hello there, how are you", "the cat sat on the mat"]


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "s2moe" / "profiles"


def _run(model, **kw):
    kw.setdefault("prompts", PROMPTS)
    kw.setdefault("n_threads", 1)
    kw.setdefault("repeats", 1)
    return list(run_calibration(str(model), **kw))


def test_calibrate_end_to_end_without_cgroups(tiny_models, xdg, monkeypatch):
    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(xdg / "no-cgroups-here"))
    events = _run(tiny_models["olmoe"], budget=Budget(4 << 30), name="tiny")
    started = [e for e in events if isinstance(e, StepStarted)]
    results = [e for e in events if isinstance(e, StepResult)]
    assert [e.index for e in started] == [1, 2, 3, 4, 5, 6, 7] and all(e.total == 7 for e in started)
    assert [e.index for e in results] == [1, 2, 3, 4, 5, 6, 7]
    # events come in order: a step's progress and result between its start and the next start
    current = 0
    for e in events:
        if isinstance(e, StepStarted):
            current = e.index
        elif isinstance(e, (StepProgress, StepResult)):
            assert e.index == current
    assert any(isinstance(e, StepProgress) for e in events)
    reg = results[2].data
    assert len(reg["measured"]) == len(reg["predicted"]) >= 9 and "r2" in reg and "mape" in reg
    budget = results[4]
    assert budget.data.get("skipped") and "no memory cgroup" in budget.summary and "systemd-run" in budget.summary
    done = events[-1]
    assert isinstance(done, CalibrationDone) and done.path == xdg / "tiny.yaml" and done.path.is_file()
    prof = load_profile("tiny")
    fp = read_model_info(tiny_models["olmoe"]).fingerprint
    block = prof["models"][fp]
    assert block["t_ar_ms"] > 0 and block["fit"]["n"] == len(reg["measured"])
    assert block["measured"]["budget_bytes"] == 4 << 30 and block["measured"]["at"]
    # the storage rates read this model's experts: the model keeps its own, the device the last model's (None
    # where the file's pages could not be dropped for cold reads)
    assert block["storage_bandwidth_gb_s"] == prof["device"]["storage_bandwidth_gb_s"]
    assert block["storage_bandwidth_qd8_gb_s"] == prof["device"]["storage_bandwidth_qd8_gb_s"]
    assert "storage_bandwidth_gb_s" in block
    hot = block["hot_experts"]
    assert hot and all(0 <= layer < 3 and 0 <= e < 8 for layer, e in hot)
    c = cost_for_model(prof, fp)
    assert c.t_ar == pytest.approx(block["t_ar_ms"] / 1e3) and c.source == "profile:tiny"


def test_stop_between_measurements_writes_nothing(tiny_models, xdg):
    seen = []

    def should_stop():
        return any(isinstance(e, StepResult) and e.index == 2 for e in seen)

    for e in run_calibration(
        str(tiny_models["olmoe"]), prompts=PROMPTS, n_threads=1, repeats=1, name="stopped", should_stop=should_stop
    ):
        seen.append(e)
    assert not any(isinstance(e, CalibrationDone) for e in seen)
    assert max(e.index for e in seen if isinstance(e, StepStarted)) == 2
    assert not (xdg / "stopped.yaml").exists()
    assert not xdg.exists() or not any(xdg.iterdir())


def test_interrupt_leaves_no_file(tiny_models, xdg):
    gen = run_calibration(str(tiny_models["olmoe"]), prompts=PROMPTS, n_threads=1, repeats=1, name="ctrlc")
    for e in gen:
        if isinstance(e, StepStarted) and e.index == 3:
            with pytest.raises(KeyboardInterrupt):
                gen.throw(KeyboardInterrupt)
            break
    assert not (xdg / "ctrlc.yaml").exists()


def test_recalibrating_keeps_other_models(tiny_models, xdg):
    _run(tiny_models["olmoe"], name="both", save=True)
    _run(tiny_models["qwen3moe"], name="both", save=True)
    prof = load_profile("both")
    fps = {read_model_info(tiny_models[a]).fingerprint for a in ("olmoe", "qwen3moe")}
    assert set(prof["models"]) == fps


def test_no_save_and_bad_inputs(tiny_models, xdg, tmp_path):
    events = _run(tiny_models["qwen3moe"], save=False, name="x")
    assert isinstance(events[-1], CalibrationDone) and events[-1].path is None and not (xdg / "x.yaml").exists()
    with pytest.raises(ModelError, match="dense"):
        _run(tiny_models["llama"])
    with pytest.raises(ConfigError, match="invalid profile name"):
        _run(tiny_models["olmoe"], name="a/b")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts(empty)
    two = tmp_path / "two.txt"
    two.write_text("first prompt\nstill first\n\nsecond prompt\n")
    assert read_prompts(two) == ["first prompt\nstill first", "second prompt"]
    # the named sets bench uses: HumanEval's code prompts for code models
    code = read_prompts("humaneval")
    assert len(code) == 32 and all("def " in c for c in code)
    assert len(read_prompts("natural")) >= 8 and read_prompts(None)
    with pytest.raises(ConfigError, match="cannot read prompts file"):
        read_prompts("humaneva1")
    p = save_profile(events[-1].profile, "saved")
    assert p == xdg / "saved.yaml" and load_profile("saved")["models"]


@pytest.mark.skipif(
    __import__("s2moe.engine.offload", fromlist=["x"]).MemoryCgroup.unavailable_reason() is not None,
    reason="no memory cgroup here",
)
def test_budget_step_runs_in_a_cgroup(tiny_models, xdg):
    events = _run(tiny_models["olmoe"], budget=Budget(400 << 20), name="cold", n_batch=64, repeats=2)
    budget = [e for e in events if isinstance(e, StepResult) and e.index == 5][0]
    assert "skipped" not in budget.data, budget.summary
    assert budget.data["n_batch"] == 64  # the measured process runs the batch asked for (-b)
    assert len(budget.data["measured"]) >= 9 and budget.data["peak"] > 0
    block = load_profile("cold")["models"][read_model_info(tiny_models["olmoe"]).fingerprint]
    assert block["fit_cold"]["n"] >= 9 and block["measured"]["t_exp_cold"] == "measured under the budget"
    assert block["measured"]["batch_size"] == 64
    # the storage faults each batch took come back with it, and the diagnostic refit on them is recorded
    faults = budget.data["faults"]
    assert len(faults) == len(budget.data["measured"]) and all(f >= 0 and f == int(f) for f in faults)
    assert block["fit_cold_misses"]["r2_given_faults"] <= 1.0 and "given the storage faults taken" in budget.summary
    assert block["measured"]["prefetch"] == "just in time (routing hook)"
    # each batch timed twice: beside R², the most any model of the batches' counts could explain, where the
    # repeats' counts agree (their fetches may not), recorded in the profile too
    d = budget.data
    ceiling = r2_ceiling(zip(d["experts"], d["misses"], d["tokens"]), d["measured"])
    assert d["r2_ceiling"] == (None if ceiling is None else pytest.approx(ceiling))
    assert ("for any model of these counts" in budget.summary) == (ceiling is not None)
    assert block["fit_cold_misses"].get("r2_ceiling") == (None if ceiling is None else pytest.approx(ceiling, abs=1e-6))
    if ceiling is not None:
        assert d["r2"] <= ceiling + 1e-9
    # plain decoding under the budget is timed beside its fetch count: what a projection charges a fetch from
    held = block["cache_fit"]
    assert held["step_ms"] > 0 and held["tokens"] > 0
    assert f"plain decoding {held['step_ms']:.1f} ms a token" in budget.summary
    # how many hot experts fit is said by the process that pins them, not guessed from the parent's size
    hot = [e for e in events if isinstance(e, StepResult) and e.index == 4][0]
    assert "decided under the budget, in the next step" in hot.summary
    assert f" · {held['pinned']} of the {len(block['hot_experts'])} hot experts pinned (" in budget.summary
    # the disk is read again once the batches ran (where the file can be read cold): the profile keeps the mean
    first = [e for e in events if isinstance(e, StepResult) and e.index == 1][0].data
    after = budget.data.get("storage_after_gb_s") or {}
    if first["storage_bandwidth_qd8_gb_s"] and after.get("8"):
        mean = (first["storage_bandwidth_qd8_gb_s"] + after["8"]) / 2
        assert block["storage_bandwidth_qd8_gb_s"] == pytest.approx(mean, abs=1e-3)
        assert "before these batches" in budget.summary


def test_a_disk_whose_rate_moved_during_the_budgeted_batches_is_named_as_the_fit_s_noise():
    from s2moe.engine.measure.calibration_measures import storage_drift_note

    steady = storage_drift_note(1.2e9, 1.1e9)
    assert steady == " · the disk read 1.20 GB/s at depth 8 before these batches and 1.10 after"
    moved = storage_drift_note(0.7e9, 1.2e9)
    assert moved.startswith(" · the disk read 0.70 GB/s") and "calibrate again" in moved
    assert "calibrate again" in storage_drift_note(1.2e9, 0.7e9)
    assert storage_drift_note(None, 1e9) == storage_drift_note(1e9, None) == ""


@pytest.mark.skipif(
    __import__("s2moe.engine.offload", fromlist=["x"]).MemoryCgroup.unavailable_reason() is not None,
    reason="no memory cgroup here",
)
def test_auto_budget_is_sized_by_the_cold_worker(tiny_models, xdg):
    from s2moe.engine.offload import expert_map

    model = tiny_models["qwen3moe"]
    events = _run(model, budget=Budget.parse("auto"), name="auto")
    step = [e for e in events if isinstance(e, StepResult) and e.index == 5][0]
    assert "skipped" not in step.data and "failed" not in step.summary, step.summary
    block = load_profile("auto")["models"][read_model_info(model).fingerprint]
    budget = load_profile("auto")["device"]["budget_bytes"]
    assert block["measured"]["budget_rule"] == "auto" and block["measured"]["budget_bytes"] == budget
    # what the worker held (far more than the tiny model's experts) plus a third of the expert bytes,
    # and the run stayed under it
    assert budget > expert_map(model).total_expert_bytes and step.data["peak"] <= budget
    assert "under auto (" in step.summary


def test_cli_calibrate(tiny_models, xdg, capsys, monkeypatch, tmp_path):
    from s2moe.app.cli import main

    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tmp_path / "none"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS))
    rc = main(
        [
            "calibrate",
            "--model",
            str(tiny_models["olmoe"]),
            "--name",
            "cli",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--prompts",
            str(prompts),
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "[3] cost model" in out.err and "R²" in out.err and "[5] budget: skipped" in out.err
    assert "profile written" in out.out and (xdg / "cli.yaml").is_file()
    assert main(["calibrate", "--model", str(tiny_models["olmoe"]), "--budget", "lots"]) == 2
    assert "invalid size" in capsys.readouterr().err
    # auto without a cgroup: the budget step says why it was skipped, the rest is still measured
    rc = main(
        [
            "calibrate",
            "--model",
            str(tiny_models["olmoe"]),
            "--budget",
            "auto",
            "--no-save",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--prompts",
            str(prompts),
            "--no-plot",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0 and "[5] budget: " in err and "[5] budget: skipped: no memory budget" not in err


def test_storage_is_read_cold_at_each_queue_depth_once_per_expert(tiny_models, tmp_path):
    """Storage bandwidth is measured at queue depth 1 and 8 on disjoint sets of whole experts."""
    import shutil

    from s2moe.engine.measure.calibration_measures import STORAGE_DEPTHS, storage_bandwidth
    from s2moe.engine.offload import expert_map

    # a copy no decoder of this test session maps, so that its pages can be dropped
    model = shutil.copy(tiny_models["olmoe"], tmp_path / "cold.gguf")
    emap = expert_map(model)
    gen = storage_bandwidth(emap)
    progress = []
    while True:
        try:
            progress.append(next(gen))
        except StopIteration as stop:
            rates, total, note = stop.value
            break
    n_each = progress[-1][1] // len(STORAGE_DEPTHS)
    assert progress[-1][0] == progress[-1][1] == n_each * len(STORAGE_DEPTHS)
    assert rates, note
    assert sorted(rates) == list(STORAGE_DEPTHS) and all(r > 0 for r in rates.values())
    assert total == n_each * len(STORAGE_DEPTHS) * int(emap.expert_bytes.max())


def test_an_empty_profile_name_is_refused_not_taken_for_the_default(tiny_models):
    with pytest.raises(ConfigError, match="invalid profile name ''"):
        next(run_calibration(str(tiny_models["olmoe"]), name="", save=False))


def test_plain_decoding_under_the_budget_runs_through_the_calibration_text(decoders, tiny_models):
    """Calibrate prices a fetch from plain decoding under the budget. A small model's greedy continuation soon
    repeats itself and reuses the same experts, so the steps decode the calibration text itself, one token a
    step, and the model's own greedy choices only once the text runs out."""
    from s2moe.engine.measure.calibration_worker import PLAIN_FETCH_CONTEXT, _plain_fetches
    from s2moe.engine.offload import Offloader

    d = decoders["olmoe"]
    off = Offloader(tiny_models["olmoe"])
    try:
        off.attach(d, jit_prefetch=True)
        text = d.rt.tokenize("the cat sat on the mat")
        context, n = text[:PLAIN_FETCH_CONTEXT], len(text) - PLAIN_FETCH_CONTEXT + 3  # past the text's end
        greedy = _plain_fetches(d.rt, off.native, context, n)
        assert greedy["tokens"][0] == context[-1] and len(greedy["ids"]) == len(greedy["misses"]) == n
        # forcing the model's own choices is the greedy run again
        again = _plain_fetches(d.rt, off.native, context + greedy["tokens"][1:], n)
        assert again["tokens"] == greedy["tokens"] and again["ids"] == greedy["ids"]
        forced = _plain_fetches(d.rt, off.native, text, n)
        assert forced["tokens"][1 : n - 2] == text[PLAIN_FETCH_CONTEXT:] and len(forced["tokens"]) == n
        assert forced["tokens"] != greedy["tokens"] and forced["ids"] != greedy["ids"]
    finally:
        off.close()
