"""The benchmark harness on a tiny model with two prompts."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.errors import ConfigError
from s2moe.engine.files import write_atomic
from s2moe.engine.measure.bench import run_bench
from s2moe.engine.measure.bench_results import BenchDone, BenchProgress
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.measure.quality_checks import ERROR_KEYS, batch_means_se, gating_quality, memory_gating_quality

MODES = ["ar", "naive", "conf", "cascade", "lookup", "s2moe"]


def _bench(decoder, modes, **kw):
    _, prompts = load_prompts("natural", 2)
    events = list(
        run_bench(
            str(decoder.info.path),
            prompts=prompts,
            modes=modes,
            n_tokens=24,
            decoder=decoder,
            prompt_set="natural",
            quality_texts=prompts,
            **kw,
        )
    )
    return events


def test_every_figure_is_present_and_finite(decoders):
    events = _bench(decoders["olmoe"], MODES, base=GenerationConfig(reuse_strength=1.0))
    done = events[-1]
    assert isinstance(done, BenchDone)
    assert [r.mode for r in done.rows] == MODES
    for r in done.rows:
        for name in ("tok_per_s", "accept_len", "draft_len", "t_draft", "t_verify", "seconds"):
            assert math.isfinite(getattr(r, name)), (r.mode, name)
        assert r.speedup_vs_ar is not None and r.speedup_vs_ar > 0
        assert r.n_tokens == 48
        if r.mode not in ("ar", "s2moe"):  # s2moe may decide drafting does not pay on this machine
            assert r.draft_len > 0 and 0 < r.reuse_ratio <= 1 and r.verify_experts > 0
            assert 0 < r.effective_verify_cost <= 1
        if r.mode != "ar":
            assert r.identical_to_ar is not None
    for r in done.rows:
        if r.identical_expected:
            assert r.identical_to_ar == 1.0, r.mode
    q = done.quality
    for key in ("ppl_ratio", "top1_agreement", "mean_kl", "reuse_ratio_plain", "reuse_ratio_gated", *ERROR_KEYS):
        assert math.isfinite(q[key])
    assert q["top1_se"] > 0 and q["log_ppl_ratio_se"] > 0  # gating moved some tokens, so the figures have noise
    assert q["reuse_ratio_gated"] < q["reuse_ratio_plain"]
    c = done.cost_model
    assert c["n"] > 0 and math.isfinite(c["r2"]) and math.isfinite(c["mape"])
    assert done.machine["cores"] >= 1
    json.dumps(done.as_dict())  # serialisable


def test_a_checks_error_grows_where_neighbouring_tokens_move_together():
    rng = np.random.default_rng(0)
    independent = (rng.random(720) < 0.9).astype(float)
    binomial = math.sqrt(0.9 * 0.1 / 720)
    assert 0.7 * binomial < batch_means_se(independent) < 1.3 * binomial
    # the same agreement rate, but whole passages agree or disagree together: the mean is far less certain
    together = np.repeat((rng.random(30) < 0.9).astype(float), 24)
    assert batch_means_se(together) > 2 * math.sqrt(together.mean() * (1 - together.mean()) / 720)
    assert batch_means_se([1.0, 0.0, 1.0]) is None  # too few tokens for two stretches


def test_checks_of_gating_toward_memory_need_a_decoder_that_knows_what_is_in_memory(decoders):
    # resident, nothing is in memory in the offloader's sense: no check says it measured a bias that cannot act
    dec = decoders["olmoe"]
    assert not dec.knows_memory
    texts = ["def add(a, b):\n    return a + b\n"]
    assert memory_gating_quality(dec, texts, 0.3) == {}
    assert gating_quality(dec, texts, 0.5, None, window=4, memory=0.3) == {}
    assert gating_quality(dec, texts, 0.5, None, window=4)["memory"] == 0.0


def test_no_cost_model_without_verifications_of_different_sizes(decoders):
    done = [e for e in _bench(decoders["olmoe"], ["ar"]) if isinstance(e, BenchDone)][0]
    assert done.cost_model == {}  # plain steps only: one token each, nothing to regress on


def test_modes_are_interleaved_per_prompt_in_a_balanced_order(decoders):
    events = _bench(decoders["olmoe"], ["ar", "conf", "lookup"], repeats=2)
    progress = [e for e in events if isinstance(e, BenchProgress)]
    # every mode is warmed up, untimed, before the first measured generation
    assert [(e.mode, e.done) for e in progress[:3]] == [("ar", 0), ("conf", 0), ("lookup", 0)]
    assert all(e.warmup for e in progress[:3]) and not any(e.warmup for e in progress[3:])
    # the order carries on into the second repeat (balanced_order), so no mode always runs first, nor always
    # after the same mode
    assert [(e.repeat, e.prompt_index, e.mode) for e in progress[3:]] == [
        (0, 0, "ar"),
        (0, 0, "conf"),
        (0, 0, "lookup"),
        (0, 1, "conf"),
        (0, 1, "lookup"),
        (0, 1, "ar"),
        (1, 0, "lookup"),
        (1, 0, "ar"),
        (1, 0, "conf"),
        (1, 1, "lookup"),
        (1, 1, "conf"),
        (1, 1, "ar"),
    ]
    assert [e.done for e in progress[3:]] == list(range(1, 13)) and {e.total for e in progress} == {12}


def test_repeats_give_each_mode_a_median_and_a_spread(decoders):
    import statistics

    done = _bench(decoders["olmoe"], ["ar", "lookup"], repeats=3)[-1]
    assert done.config["repeats"] == 3 and done.config["warmup"] is True
    ar, lookup = done.rows
    for r in done.rows:
        assert len(r.tok_per_s_repeats) == 3 and r.repeats == 3
        assert r.tok_per_s == statistics.median(r.tok_per_s_repeats)
        assert r.n_tokens == 3 * 2 * 24  # every repeat is counted in the totals
        lo, hi = min(r.tok_per_s_repeats), max(r.tok_per_s_repeats)
        assert r.tok_per_s_range == f"{lo:.1f}–{hi:.1f}"
    assert ar.speedup_repeats == [1.0, 1.0, 1.0] and ar.speedup_vs_ar == 1.0
    # each repeat's ratio is against ar's speed in the same repeat
    assert lookup.speedup_repeats == pytest.approx(
        [t / a for t, a in zip(lookup.tok_per_s_repeats, ar.tok_per_s_repeats)]
    )
    assert lookup.speedup_vs_ar == pytest.approx(statistics.median(lookup.speedup_repeats))
    # tokens are compared with ar's once per prompt, not once per repeat
    assert lookup.identical_to_ar == 1.0 and lookup.n_prompts == 2 and lookup.lossless_ok
    json.dumps(done.as_dict())


def test_a_single_repeat_without_warm_up_shows_no_spread(decoders):
    events = _bench(decoders["olmoe"], ["ar", "lookup"], warmup=False)
    assert not any(e.warmup for e in events if isinstance(e, BenchProgress))
    row = events[-1].rows[1]
    assert row.repeats == 1 and row.tok_per_s_range == "" and row.speedup_range == ""
    assert row.tok_per_s == pytest.approx(row.n_tokens / row.seconds)  # one repeat: the plain rate


def test_zero_repeats_are_refused(decoders):
    with pytest.raises(ConfigError, match="repeats"):
        _bench(decoders["olmoe"], ["ar"], repeats=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_identical_output_check_catches_a_broken_mode(decoders, monkeypatch, temperature):
    """Corrupt verification (accept every draft) in one mode: the harness must flag it, greedy or sampled —
    its divergences are not near-ties."""
    from s2moe.engine.decoding import decoder as decoder_module

    def lenient_accept(drafted, logits, sampling, noise, history):
        n = len(drafted)  # every draft accepted, then the target's token after them
        return n, sampling.token(logits[n], list(history) + list(drafted), noise)

    monkeypatch.setattr(decoder_module, "accept", lenient_accept)
    done = _bench(decoders["olmoe"], ["ar", "conf"], base=GenerationConfig(temperature=temperature))[-1]
    conf = next(r for r in done.rows if r.mode == "conf")
    assert conf.identical_expected and conf.identical_to_ar < 1.0 and not conf.lossless_ok


def test_reports_are_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    write_atomic(target, "first\n")
    assert target.read_text() == "first\n"

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ConfigError, match="cannot write file .*report.json: disk full"):
        write_atomic(target, "second, half-written\n")
    assert target.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_prompt_sets(tmp_path):
    name, prompts = load_prompts("humaneval", 3)
    assert name == "humaneval" and len(prompts) == 3 and all("def " in p for p in prompts)
    good = tmp_path / "mine.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_prompts(str(good)) == ("mine", ["a", "b"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        load_prompts(str(bad))
    with pytest.raises(ConfigError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_bench_cli_writes_json_and_markdown(tiny_models, tmp_path):
    import subprocess
    import sys

    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "bench",
            "--model",
            str(tiny_models["qwen3moe"]),
            "--prompts",
            "natural",
            "--n-prompts",
            "2",
            "-n",
            "16",
            "--threads",
            "1",
            "--modes",
            "ar,lookup,s2moe",
            "--json",
            str(out_json),
            "--md",
            str(out_md),
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80 and "…" not in done.stdout
    assert "median of 2 repeats" in done.stdout and "× ar range" in done.stdout
    data = json.loads(out_json.read_text())
    assert data["config"]["repeats"] == 2
    assert all(len(r["tok_per_s_repeats"]) == 2 for r in data["results"] if r["mode"] != "llama.cpp")
    assert [r["mode"] for r in data["results"]] == ["ar", "lookup", "s2moe", "llama.cpp"]
    # the reference row: llama.cpp's own plain decoding of the same prompts, beside our ar
    ref = data["results"][-1]
    assert ref["n_tokens"] == 2 * 16 and ref["tok_per_s"] > 0 and ref["speedup_vs_ar"] > 0
    # ar decoded greedy: its tokens are in its row, and llama.cpp's own are the same on both prompts
    assert [len(t) for t in data["results"][0]["tokens"]] == [16, 16]
    assert ref["identical_to_ar"] == 1.0 and ref["identical_expected"]
    assert "| llama.cpp |" in out_md.read_text()
    # the report says what the terminal said under the table
    assert "\n- fastest: " in out_md.read_text() and "\n- \\*: not lossless by design" in out_md.read_text()
    for key in (
        "mode",
        "budget",
        "prompt_set",
        "tok_per_s",
        "speedup_vs_ar",
        "accept_len",
        "draft_len",
        "reuse_ratio",
        "verify_experts",
        "effective_verify_cost",
        "rollbacks",
    ):
        assert key in data["results"][0]
    assert set(data) >= {"results", "quality", "cost_model", "machine"}
    assert "| lookup |" in out_md.read_text()
    # each generation's speed, paired by prompt and repeat, judges every mode against ar
    assert all(len(r["run_tok_per_s"]) == 4 for r in data["results"] if r["mode"] != "llama.cpp")
    assert data["config"]["load"]["cpus"] >= 1
    said = " ".join(done.stdout.split())
    assert "fastest: " in said and "× ar (4 paired runs): " in said
    assert "*: not lossless by design" in said  # s2moe's default gating: its = ar cell is marked


def test_bench_under_a_memory_budget_adds_rows_from_a_cgroup(tiny_models, tmp_path):
    import subprocess
    import sys

    from s2moe.app.bench_storage import STORAGE_PASSES
    from s2moe.engine.offload import MemoryCgroup

    reason = MemoryCgroup.unavailable_reason()
    if reason:
        pytest.skip(f"no memory cgroup here: {reason}")
    import shutil

    out_json = tmp_path / "b.json"
    # a copy that no decoder of this test session maps, so that its pages can be dropped for the storage reads
    model = shutil.copy(tiny_models["olmoe"], tmp_path / "model.gguf")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "bench",
            "--model",
            str(model),
            "--prompts",
            "natural",
            "--n-prompts",
            "1",
            "-n",
            "8",
            "--threads",
            "1",
            "--modes",
            "ar,naive,s2moe",
            "--budget",
            "none,auto",
            "--no-quality",
            "--json",
            str(out_json),
            "-b",
            "32",
            "--trace",
            str(tmp_path / "T"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())  # the report wraps at the console's width
    # no profile: no hot experts pinned under the budget, and the command that would give them
    assert f"calibrate once under this budget (s2moe calibrate -m {model} --budget auto" in done.stderr
    data = json.loads(out_json.read_text())
    rows = data["results"]
    budgets = [r["budget"] for r in rows]
    # ar, naive, s2moe and llama.cpp's own plain decoding resident, then the same under the auto budget
    assert [r["mode"] for r in rows] == ["ar", "naive", "s2moe", "llama.cpp"] * 2
    assert budgets[:4] == ["none"] * 4 and all(b.startswith("auto (") for b in budgets[4:])
    assert all(r["n_tokens"] == 8 for r in rows) and data["config"]["batch_size"] == 32
    # llama.cpp's own greedy tokens are ar's, resident and under the budget (its row unrepacked, in a cgroup)
    assert [r["identical_to_ar"] for r in rows if r["mode"] == "llama.cpp"] == [1.0, 1.0]
    # -b reaches the budget's process, which says what it ran
    assert data["config"]["batch_by_budget"] == {budgets[4]: 32}
    assert (
        f"llama.cpp's batch (a prompt's prefill chunk, its compute buffers sized for it): 32 tokens under {budgets[4]}"
    ) in said
    # the child's own cost-model fit comes back, keyed by its budget label (naive always drafts, so the
    # verifications vary in size)
    assert list(data["cost_model_by_budget"]) == [budgets[4]]
    fit = data["cost_model_by_budget"][budgets[4]]
    assert fit["n"] >= 3 and math.isfinite(fit["r2"]) and fit["r2"] <= 1.0
    assert f"cost model under budget {budgets[4]}: R²" in said
    # offloaded, each verification also says how many of its experts were fetched: the miss-aware fit
    miss = fit["miss_aware"]
    assert miss["n"] == fit["n"] and 0.0 <= miss["miss_share"] <= 1.0 and math.isfinite(miss["r2"])
    assert "counting fetched experts" in said
    given = miss["given_faults"]  # the diagnostic fit on the storage faults the verifications really took
    assert math.isfinite(given["r2"]) and given["faults_per_verification"] >= 0
    assert "given the storage faults taken" in said
    tracked = miss["disk_tracked"]  # the same fit with T_exp cold followed through the run
    assert math.isfinite(tracked["r2"]) and "weighing half; it went" in said
    assert len(miss["fetched"]) == len(miss["experts"]) == len(miss["tokens"]) == miss["n"]
    assert "bound_ratio" in miss  # the verifications against the storage bound (None where the fit prices none)
    assert (miss["bound_ratio"] is None) == ("their bound" not in said)
    # ar's plain steps and naive's drafted batches, each against its own bound
    assert set(miss["kinds"]) <= {"plain", "copy", "draft"} and len(miss["kinds"]) == miss["n"]
    if miss["bound_ratio"] is not None:
        assert {"plain", "draft"} <= set(miss["bound_ratio_by_kind"]) and "by batch: plain steps" in said
    assert "miss_aware" not in data["cost_model"]  # resident: nothing is fetched
    # the physical bound: storage read at queue depth 1 and 8, and each offloaded mode's fetches per token
    storage = data["config"]["storage"]
    assert storage["qd1_gb_s"] > 0 and storage["qd8_gb_s"] > 0 and storage["expert_bytes"] > 0
    assert set(storage["by_budget"]) == {rows[4]["budget"]}  # each budget's bound: the rate read around it
    assert storage["source"].startswith("read by this run") and storage["n_readings"] == 2 * STORAGE_PASSES
    span = miss.get("bound_ratio_range")
    assert miss["bound_ratio"] is None or span[0] <= miss["bound_ratio"] <= span[1]
    assert all(r["fetched_per_token"] is None and r["bound_tok_per_s"] is None for r in rows[:4])
    assert all(r["fetched_per_token"] >= 0 and r["bound_tok_per_s"] > 0 for r in rows[4:7])
    assert "storage, cold reads of whole experts" in said
    # the budget's traces carry the disk as read around it, for a replay that prices a fetch on that day's disk
    from s2moe.engine.measure.trace import read_trace

    budgeted = [read_trace(p) for p in sorted((tmp_path / "T").glob("budget-auto-*.jsonl"))]
    assert budgeted and all(t.header.budget["storage"]["readings"] == 2 * STORAGE_PASSES for t in budgeted)
    assert all(
        t.header.budget["storage"]["qd8_gb_s"] == pytest.approx(storage["by_budget"][rows[4]["budget"]]["qd8_gb_s"])
        for t in budgeted
    )
    assert all(read_trace(p).header.budget is None for p in (tmp_path / "T").glob("resident-*.jsonl"))


def test_a_mode_list_that_starts_with_a_dash_reaches_the_budget_s_child_whole(tiny_models, tmp_path):
    """The child process under a budget gets the modes as one word: `--modes -gating,ar` would read as an option
    there."""
    import shutil
    import subprocess
    import sys

    from s2moe.engine.offload import MemoryCgroup

    reason = MemoryCgroup.unavailable_reason()
    if reason:
        pytest.skip(f"no memory cgroup here: {reason}")
    out_json = tmp_path / "b.json"
    model = shutil.copy(tiny_models["olmoe"], tmp_path / "model.gguf")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "bench",
            "--model",
            str(model),
            "--prompts",
            "natural",
            "--n-prompts",
            "1",
            "-n",
            "4",
            "--threads",
            "1",
            "--modes=-gating,ar",
            "--budget",
            "auto",
            "--no-quality",
            "--no-reference",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [r["mode"] for r in json.loads(out_json.read_text())["results"]] == ["-gating", "ar"]


def test_the_bound_reads_the_disk_around_each_budget_and_falls_back_to_the_profile_s_rates_for_this_model(tiny_models):
    """The disk's rate drifts within a run: each budget's bound uses the passes read just before and after it.
    Where no pass could read cold, the profile's rates measured on this model's experts stand in, never the
    device rates another model's expert sizes gave."""
    from s2moe.app.bench_storage import STORAGE_PASSES, read_storage, storage_record
    from s2moe.engine.model_info import read_model_info
    from s2moe.engine.offload import expert_map

    fp = read_model_info(tiny_models["olmoe"]).fingerprint
    device = {"storage_bandwidth_gb_s": 0.14, "storage_bandwidth_qd8_gb_s": 0.29}
    own = {"storage_bandwidth_gb_s": 0.8, "storage_bandwidth_qd8_gb_s": 1.1}
    profile = {"name": "p", "device": device, "models": {fp: dict(own)}}
    around = {"auto": [(0.7e9, 1.0e9), (0.8e9, 1.6e9), (0.6e9, 1.2e9)], "350 MiB": [(0.5e9, 0.9e9)]}
    got = storage_record(around, 2e6, profile, fp)
    assert got["source"].startswith("read by this run") and got["n_readings"] == 4
    assert got["by_budget"]["auto"] == {
        "qd8_gb_s": pytest.approx(1.2),
        "qd8_range": [pytest.approx(1.0), pytest.approx(1.6)],
    }
    assert got["by_budget"]["350 MiB"]["qd8_gb_s"] == pytest.approx(0.9)
    assert got["qd8_range"] == [pytest.approx(0.9), pytest.approx(1.6)] and got["qd1_gb_s"] == pytest.approx(0.65)
    fallback = storage_record({"auto": []}, 2e6, profile, fp)
    assert (fallback["qd1_gb_s"], fallback["qd8_gb_s"], fallback["source"]) == (0.8, 1.1, "profile p")
    assert fallback["by_budget"]["auto"]["qd8_gb_s"] == 1.1
    other = {"name": "p", "device": device, "models": {"0" * 16: dict(own)}}
    assert storage_record({"auto": []}, 2e6, other, fp) is None
    assert storage_record({"auto": []}, 2e6, None, fp) is None
    # None where the file's pages cannot be dropped for cold reads (another test's model still maps them)
    read = read_storage(expert_map(tiny_models["olmoe"]))
    assert len(read) in (0, STORAGE_PASSES) and all(qd1 > 0 and qd8 > 0 for qd1, qd8 in read)


def test_the_storage_bound_adds_fetch_time_to_the_same_modes_resident_compute():
    from s2moe.engine.measure.bench_results import BenchRow, storage_bound

    def row(mode, budget, seconds, fetched):
        return BenchRow(
            mode,
            budget,
            "natural",
            1,
            100,
            seconds,
            100 / seconds,
            None,
            1.0,
            0.0,
            0.0,
            None,
            None,
            None,
            None,
            0,
            0.0,
            0.0,
            None,
            fetched_per_token=fetched,
        )

    rows = [row("ar", "none", 1.0, None), row("ar", "auto", 5.0, 10.0), row("s2moe", "auto", 4.0, 20.0)]
    rows.append(row("ar", "350 MiB", 9.0, 10.0))
    storage_bound(rows, expert_bytes=1e6, bandwidth={"auto": 1e9, "350 MiB": 0.5e9})  # 1 and 2 ms per expert
    assert rows[0].bound_tok_per_s is None
    assert rows[1].bound_tok_per_s == pytest.approx(1 / (10e-3 + 10e-3))  # fetches + ar's resident 10 ms
    assert rows[2].bound_tok_per_s == pytest.approx(1 / 20e-3)  # no resident s2moe row: fetches only
    assert rows[3].bound_tok_per_s == pytest.approx(1 / (20e-3 + 10e-3))  # its own budget's rate


def test_verifications_are_held_against_fetches_at_the_storage_rate_plus_their_resident_cost():
    from s2moe.engine.measure.bench_results import verification_bound_ratio

    fit = {"experts": [40, 80], "fetched": [10, 30], "tokens": [2, 5]}

    def resident(experts, rows):
        return 1e-3 + 1e-4 * experts + 2e-3 * rows

    # bounds at 1 ms a fetch: 1 + 4 + 4 + 10 = 19 ms and 1 + 8 + 10 + 30 = 49 ms
    measured = [2 * 19e-3, 2 * 49e-3]
    assert verification_bound_ratio({"measured_s": measured, "miss_aware": fit}, resident, 1e6, 1e9) == pytest.approx(
        2.0
    )
    assert verification_bound_ratio({"measured_s": measured[:1], "miss_aware": fit}, resident, 1e6, 1e9) is None
    assert verification_bound_ratio({"measured_s": measured, "miss_aware": {}}, resident, 1e6, 1e9) is None
    # each kind of batch against its own bound: the first a plain step, the second a copy
    kinds = {"measured_s": [19e-3, 3 * 49e-3], "miss_aware": dict(fit, kinds=["plain", "copy"])}
    assert verification_bound_ratio(kinds, resident, 1e6, 1e9, "plain") == pytest.approx(1.0)
    assert verification_bound_ratio(kinds, resident, 1e6, 1e9, "copy") == pytest.approx(3.0)
    assert verification_bound_ratio(kinds, resident, 1e6, 1e9, "draft") is None
    assert verification_bound_ratio({"measured_s": measured, "miss_aware": fit}, resident, 1e6, 1e9, "plain") is None


def test_a_verification_s_kind_is_what_its_batch_held():
    from s2moe.engine.events import DraftDecision, Iteration
    from s2moe.engine.measure.bench_results import verification_kind

    def iteration(drafted, copied=None):
        decision = DraftDecision(
            drafting=bool(drafted),
            can_pay=True,
            probing=False,
            threshold=1.0,
            utility=1.0,
            p_first=1.0,
            new_experts=0.0,
            t_ar=1.0,
            cost=1.0,
            c_draft=0.0,
            t_tok=0.1,
            copied=copied,
        )
        fields = {f: None for f in Iteration.__dataclass_fields__}
        fields.update(drafted=tuple(drafted), draft_decision=decision)
        return Iteration(**fields)

    assert verification_kind(iteration([])) == "plain"
    assert verification_kind(iteration([5, 6], copied="session")) == "copy"
    assert verification_kind(iteration([5], copied="context")) == "copy"
    assert verification_kind(iteration([5])) == "draft"


def test_a_mode_that_decoded_as_ar_is_marked_so_its_ratio_reads_as_noise():
    from s2moe.engine.measure.bench_results import BenchRow

    def row(mode, draft_len, identical):
        return BenchRow(
            mode,
            "none",
            "natural",
            2,
            100,
            1.0,
            100.0,
            1.05,
            1.0,
            draft_len,
            0.0,
            None,
            None,
            None,
            None,
            0,
            0.0,
            0.0,
            identical,
        )

    assert row("s2moe", 0.0, 1.0).speedup_text == "1.05≈"  # no drafts, ar's tokens: the same decoding
    assert row("s2moe", 0.5, 1.0).speedup_text == "1.05"  # it drafted: a real comparison
    assert row("s2moe", 0.0, 0.5).speedup_text == "1.05"  # different tokens (gating): not the same decoding
    assert row("ar", 0.0, None).speedup_text == "1.05"


def test_the_footnotes_explain_the_marks_name_the_fastest_and_warn_of_a_busy_machine():
    from s2moe.app.bench_report import _cells, footnotes
    from s2moe.engine.measure.bench_results import BenchDone, BenchRow
    from s2moe.engine.measure.speed import Load

    def row(mode, runs, lossless=True, interval=None):
        return BenchRow(
            mode,
            "none",
            "natural",
            4,
            256,
            1.0,
            sum(runs) / 4,
            1.0,
            1.5,
            1.0,
            0.5,
            None,
            None,
            None,
            None,
            0,
            0.0,
            0.0,
            None if mode == "ar" else 1.0,
            lossless,
            run_tok_per_s=runs,
            speedup_interval=interval,
        )

    ar = [100.0, 101.0, 99.0, 100.0]
    noisy = [92.0, 121.0, 99.0, 95.0]
    rows = [
        row("ar", ar),
        row("lookup", noisy, interval=[0.9, 1.12]),
        row("s2moe", [130.0, 128.0, 131.0, 133.0], lossless=False, interval=[1.28, 1.33]),
    ]
    busy = Load(cpus=2, load_at_start=1.6, other_cpus=0.9, busiest=[("python", 0.9)], seconds=20.0)
    done = BenchDone(rows, {}, {}, {}, config={"load": busy.as_dict()})
    _, cells = _cells(done)
    assert cells[1]["x_ar"] == "1.00≈" and cells[2]["x_ar"] == "1.00"  # inside the noise, and outside it
    assert cells[2]["same"] == "100%*"
    notes = footnotes(done)
    assert any(n.startswith("≈: not significant") for n in notes)
    assert any(n.startswith("*: not lossless by design") for n in notes)
    assert notes[2] == "fastest: s2moe — 1.30 ± 0.03× ar; 1.29 ± 0.18× lookup"
    assert any(n.startswith("lookup ") and "not significant" in n for n in notes)
    assert notes[-1].startswith("warning: other processes used 0.9 of 2 CPUs")
    # a quiet machine, every mode lossless: no warning, no asterisk to explain
    quiet = BenchDone(
        [row("ar", ar), row("lookup", noisy, interval=[0.9, 1.12])],
        {},
        {},
        {},
        config={"load": Load(2, 0.1, 0.0).as_dict()},
    )
    notes = footnotes(quiet)
    assert not any(n.startswith(("*", "warning")) for n in notes)
    assert notes[-1] == "fastest: lookup — 1.01 ± 0.12× ar (not significant)"


def _done_with_rows(offloaded: bool, repeats: int):
    from s2moe.engine.measure.bench_results import BenchDone, BenchRow

    rows = []
    for i, mode in enumerate(["ar", "naive", "cascade", "s2moe", "llama.cpp"]):
        tps = [100.0 + 10 * i + j for j in range(repeats)]
        rows.append(
            BenchRow(
                mode,
                "none" if not offloaded else "1.5GiB",
                "natural",
                8,
                512,
                12.345,
                tps[0],
                1.0 + i / 10,
                1.5,
                2.25,
                0.5,
                0.123,
                None,
                123.4,
                0.75,
                1000 + i,
                12.34,
                56.78,
                1.0 if mode != "ar" else None,
                True,
                fetched_per_token=12.5 if offloaded else None,
                bound_tok_per_s=33.3 if offloaded else None,
                tok_per_s_repeats=tps,
                speedup_repeats=[1.0 + i / 10 + j / 100 for j in range(repeats)],
            )
        )
    return BenchDone(
        rows, {}, {}, {}, config={"prompt_set": "natural", "n_prompts": 8, "n_tokens": 64, "repeats": repeats}
    )


@pytest.mark.parametrize("offloaded,repeats", [(False, 1), (True, 3)])
def test_the_bench_table_fits_80_columns_and_wraps_what_does_not_fit(offloaded, repeats):
    from rich.console import Console
    from s2moe.app.bench_report import _cells, tables

    done = _done_with_rows(offloaded, repeats)
    console = Console(width=80, record=True)
    parts = tables(done, 80)
    for t in parts:
        console.print(t)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    columns, cells = _cells(done)
    for col in columns:  # every column appears whole, in one of the tables
        assert col.label in text, col.label
    for row in cells:
        for value in row.values():
            assert value in text, value
    assert len(parts) > 1  # more than 80 columns' worth: the rest goes on, led by the mode
    for t in parts:
        assert t.columns[0].header == "mode" and len(t.rows) == len(done.rows)
    first = [c.header for c in parts[0].columns]
    assert first[:3] == ["mode", "budget", "tok/s"] if offloaded else first[:2] == ["mode", "tok/s"]
    assert "× ar" in first and "= ar" in first  # the speed-up and whether it decoded the same come first
    if repeats > 1:
        assert "× ar range" in first and "1.30–1.32" in text and "median of 3 repeats" in text
    else:
        assert "range" not in text
    assert len(tables(done, 200)) == 1


def _sampled_bench(tmp_path, seed: int, name: str) -> dict:
    """`s2moe bench` sampling on the shipped model: ar, lookup (drafts n-grams of the context) and s2moe with
    a utility threshold it never reaches (so it drafts nothing)."""
    import subprocess
    import sys

    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "bench",
            "--prompts",
            "natural",
            "--n-prompts",
            "2",
            "-n",
            "24",
            "-t",
            "2",
            "--modes",
            "ar,lookup,s2moe",
            "--threshold",
            "1000000",
            "--temp",
            "0.9",
            "-s",
            str(seed),
            "--top-k",
            "30",
            "--top-p",
            "0.9",
            "--min-p",
            "0.02",
            "--repeat-penalty",
            "1.1",
            "--repeat-last-n",
            "32",
            "--no-quality",
            "--no-reference",
            "--no-warmup",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    data["stdout"] = done.stdout
    return data


def _decoded(data: dict) -> list[tuple]:
    """What each row's tokens decided: counts that differ when a single drawn token does."""
    return [
        (
            r["mode"],
            r["n_tokens"],
            r["accept_len"],
            r["draft_len"],
            r["rollbacks"],
            r["identical_to_ar"],
            r["verify_experts"],
        )
        for r in data["results"]
    ]


def test_llama_cpp_s_row_is_held_to_ar_s_greedy_tokens():
    """The reference row counts the prompts on which llama.cpp's tokens are ar's, and expects all of them,
    where ar's row holds its greedy tokens; with none there (ar sampled, or penalised), nothing to compare."""
    from dataclasses import replace

    from s2moe.engine.measure.bench_results import BenchRow, reference_row

    ar = BenchRow(
        mode="ar",
        budget="none",
        prompt_set="natural",
        n_prompts=2,
        n_tokens=6,
        seconds=1.0,
        tok_per_s=6.0,
        speedup_vs_ar=1.0,
        accept_len=1.0,
        draft_len=0.0,
        acceptance_rate=0.0,
        reuse_ratio=None,
        reuse_ratio_per_layer=None,
        verify_experts=None,
        effective_verify_cost=None,
        rollbacks=0,
        t_draft=0.0,
        t_verify=1.0,
        identical_to_ar=None,
        tokens=[[1, 2, 3], [4, 5, 6]],
    )
    result = {"tok_per_s": 5.0, "n_tokens": 6, "seconds": 1.2, "tokens": [[1, 2, 3], [4, 5, 6]]}
    same = reference_row(result, "none", ar, "natural", 2)
    assert same.identical_to_ar == 1.0 and same.identical_expected and same.lossless_ok
    left = reference_row({**result, "tokens": [[1, 2, 3], [4, 5, 7]]}, "none", ar, "natural", 2)
    assert left.identical_to_ar == 0.5 and left.identical_expected and not left.lossless_ok
    unheld = reference_row(result, "none", replace(ar, tokens=None), "natural", 2)
    assert unheld.identical_to_ar is None and not unheld.identical_expected


def test_the_ar_row_holds_its_tokens_only_where_it_took_the_argmax(decoders):
    """ar's row keeps each prompt's tokens where it decoded greedy without a penalty (what llama.cpp's greedy
    sampler does), and the other rows never."""
    d = decoders["olmoe"]
    _, prompts = load_prompts("natural", 2)

    def rows(modes, base):
        return list(
            run_bench(
                str(d.info.path),
                prompts=prompts,
                modes=modes,
                n_tokens=8,
                decoder=d,
                base=base,
                prompt_set="natural",
                quality_texts=None,
                warmup=False,
            )
        )[-1].rows

    greedy = rows(["ar", "lookup"], GenerationConfig())
    assert [len(t) for t in greedy[0].tokens] == [8, 8] and greedy[1].tokens is None
    assert rows(["ar"], GenerationConfig(repeat_penalty=1.2))[0].tokens is None


def test_a_sampled_bench_records_its_options_and_repeats_with_its_seed(tmp_path):
    first = _sampled_bench(tmp_path, 7, "first")
    config = first["config"]
    assert config["greedy"] is False
    assert {
        k: config[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
    } == dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.1, repeat_last_n=32, seed=7)
    assert config["prompt_seeds"] == [7, 8]
    assert "prompt i uses seed 7 + i" in " ".join(first["stdout"].split())
    rows = {r["mode"]: r for r in first["results"]}
    # every mode samples a prompt with the same seed: a mode that drafted nothing drew ar's tokens, and is
    # marked as having decoded as ar did rather than counted as sampled speculation
    assert rows["s2moe"]["draft_len"] == 0 and rows["s2moe"]["identical_to_ar"] == 1.0
    assert "≈" in first["stdout"]
    # one that drafted drew them too, and is held to it: a draft is accepted only as the token ar draws
    assert rows["lookup"]["draft_len"] > 0 and rows["lookup"]["identical_expected"]
    assert rows["lookup"]["identical_to_ar"] == 1.0
    assert rows["ar"]["tokens"] is None  # sampled: nothing llama.cpp's greedy row could be held to
    again = _sampled_bench(tmp_path, 7, "again")
    assert _decoded(again) == _decoded(first)
    other = _sampled_bench(tmp_path, 12345, "other")
    assert _decoded(other) != _decoded(first)


def test_bench_orders_its_modes_so_that_each_follows_each_other_equally_often():
    """Over a cycle of prompts every mode runs in every place and right after every other mode equally often:
    a mode that always followed one that churns the expert cache would be measured under conditions of its own."""
    from collections import Counter

    from s2moe.engine.measure.bench import balanced_order

    for n in range(2, 8):
        cycle = n * (2 if n % 2 else 1)
        rows = [balanced_order(n, i) for i in range(cycle)]
        assert all(sorted(r) == list(range(n)) for r in rows)
        places = Counter((m, p) for r in rows for p, m in enumerate(r))
        follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
        assert len(places) == n * n and len(set(places.values())) == 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
        assert balanced_order(n, cycle) == rows[0]


def test_a_bench_on_a_session_s_decoder_neither_copies_from_nor_adds_to_its_earlier_text(decoders):
    """The app benches on its chat's decoder: its generations copy only from each other's (the same figures
    whatever a chat or a copy cache left), and the session's earlier text is as it was afterwards."""
    from s2moe.engine.drafting.ngrams import EarlierText

    d = decoders["olmoe"]
    kept = d.earlier
    session = EarlierText()
    session.add((1, 2, 3), [1, 2, 3, 4, 5])
    seen = []
    try:
        d.earlier = session
        _bench(d, ["ar", "s2moe"], should_stop=lambda: seen.append(d.earlier) or False)
        assert seen and all(e is not session for e in seen)
        assert max(len(e.entries) for e in seen) >= 2  # the bench's own prompts, copied from each other
        assert d.earlier is session and session.generations() == [((1, 2, 3), [1, 2, 3, 4, 5])]
    finally:
        d.earlier = kept


def test_the_near_tie_check_reads_a_context_longer_than_one_batch(tiny_models, monkeypatch):
    """A mode that left ar's tokens is checked by decoding the context batched and token by token; with a
    small -b the context outgrows one batch, and the batched side prefills what comes before its last batch
    (it raised ValueError, and bench under a budget at -b 64 died on HumanEval's prompts). The answer is ar's
    own top-2 gap at the divergence against the threshold: a tie below it, none above it."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.measure import quality_checks

    dec = Decoder(str(tiny_models["olmoe"]), n_ctx=256, n_threads=1, max_draft=8, n_batch=32)
    try:
        prompt = " ".join(f"word{i}" for i in range(12))
        assert len(dec.tokenize(prompt)) > dec.rt.n_batch
        cfg = GenerationConfig(mode="ar", n_predict=6, stop_at_eos=False)
        reference = run(dec, prompt, cfg)[-1].tokens
        assert len(reference) == 6
        other = reference[:3] + ((reference[3] + 1) % dec.rt.n_vocab,) + reference[4:]
        history = dec.tokenize(prompt) + list(reference[:3])
        dec.rt.kv_clear()
        dec.rt.hook.off()
        dec.rt.prefill(history[:-1])
        top2 = np.sort(dec.rt.decode(history[-1:], len(history) - 1, "last")[0])[-2:]
        dec.rt.kv_clear()
        gap = float(top2[1] - top2[0])
        assert gap > 10 * quality_checks.NEAR_TIE  # no tie on this model: the threshold decides below
        assert quality_checks.near_tie(dec, prompt, reference, other, cfg) is False
        monkeypatch.setattr(quality_checks, "NEAR_TIE", 1.01 * gap)
        assert quality_checks.near_tie(dec, prompt, reference, other, cfg) is True
        monkeypatch.setattr(quality_checks, "NEAR_TIE", 0.99 * gap)
        assert quality_checks.near_tie(dec, prompt, reference, other, cfg) is False
        # no divergence: nothing to excuse
        assert quality_checks.near_tie(dec, prompt, reference, reference, cfg) is False
    finally:
        dec.close()
