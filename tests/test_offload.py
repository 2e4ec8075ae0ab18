"""Offloading: expert byte ranges, residency (mincore), pinning, hot-expert selection, budgets."""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import re
from contextlib import contextmanager

import gguf
import numpy as np
import pytest
from s2moe.engine.errors import ConfigError, ModelError
from s2moe.engine.offload import (
    AUTO_MIN_SLACK,
    AUTO_START_LIMIT,
    PAGE,
    Budget,
    MemoryCgroup,
    ModelMapping,
    Offloader,
    code_ranges,
    current_budget,
    current_budget_cgroup,
    drop_file_cache,
    expert_map,
    fmt_bytes,
    parse_size,
    plan_budget,
    select_hot_experts,
)
from s2moe.engine.offload.libc import MADV_RANDOM
from tinygguf import TinySpec, write_tiny


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Experts of several pages each, so that residency per expert is meaningful."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return write_tiny(path, TinySpec(arch="qwen3moe", n_layer=2, n_expert=8, k=2, n_embd=128, n_ff=96, seed=1))


def test_expert_ranges_match_the_gguf_tensor_table(tiny_models):
    path = tiny_models["olmoe"]
    em = expert_map(path)
    reader = gguf.GGUFReader(str(path))
    exps = {t.name: t for t in reader.tensors if "_exps." in t.name}
    assert em.n_layer == 3 and em.n_expert == 8
    covered = 0
    for layer in range(em.n_layer):
        assert set(em.parts[layer]) == {f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
        for part, name in enumerate(em.parts[layer]):
            t = exps[name]
            slab = int(t.n_bytes) // 8
            for e in range(8):
                off, n = em.ranges[layer, e, part]
                assert off == int(t.data_offset) + e * slab and n == slab
                covered += n
            # the slab really is expert e's weights
            data = np.asarray(t.data)  # [n_expert, rows, cols]
            with open(path, "rb") as f:
                f.seek(int(em.ranges[layer, 3, part, 0]))
                raw = np.frombuffer(f.read(slab), dtype=np.float32).reshape(data[3].shape)
            assert np.array_equal(raw, data[3])
    assert covered == em.total_expert_bytes == sum(int(t.n_bytes) for t in exps.values())
    others = sum(int(t.n_bytes) for t in reader.tensors if "_exps." not in t.name)
    assert em.non_expert_bytes == others
    assert (em.expert_bytes == 3 * 48 * 64 * 4).all()


def test_dense_model_has_no_expert_map(tiny_models):
    with pytest.raises(ModelError, match="not a Mixture-of-Experts"):
        expert_map(tiny_models["llama"])


def test_mincore_residency_flips_after_dontneed_and_after_a_read(wide_model):
    em = expert_map(wide_model)
    m = ModelMapping(em)
    try:
        drop_file_cache(wide_model)
        res = m.expert_residency()
        if res.max() > 0:
            pytest.skip("the page cache keeps this file (mapped elsewhere); DONTNEED had no effect")
        assert res.shape == (2, 8) and (res == 0).all()
        # read one expert's slices with plain reads (no read-ahead): that expert becomes resident
        fd = os.open(str(wide_model), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for off, n in em.expert_ranges(1, 5):
                os.pread(fd, n, off)
        finally:
            os.close(fd)
        res = m.expert_residency()
        assert res[1, 5] == pytest.approx(1.0)
        assert res[0].max() < 1.0  # not everything came in
        drop_file_cache(wide_model)
        assert m.expert_residency()[1, 5] == 0.0
        # WILLNEED through our mapping brings an expert in
        m.willneed(0, 2)
        for _ in range(100):
            if m.expert_residency()[0, 2] == 1.0:
                break
            import time

            time.sleep(0.01)
        assert m.expert_residency()[0, 2] == pytest.approx(1.0)
    finally:
        m.close()


def test_pinned_pages_survive_dontneed(wide_model):
    off = Offloader(wide_model, prefetch=True)
    try:
        drop_file_cache(wide_model)
        split = off.pin(non_expert=True, code=False, hot=[(0, 4)])
        assert (
            split["non_expert"] >= sum(n for _, n in off.emap.pinnable())
            and split["hot_experts"] >= off.emap.expert_bytes[0]
        )
        drop_file_cache(wide_model)
        res = off.map.expert_residency()
        assert res[0, 4] == 1.0 and off.map.pinned[0, 4] and off.map.pinned.sum() == 1
        o, n = off.emap.pinnable()[0]
        assert off.map.range_resident(o, n) == 1.0
        # prefetch: predicted experts that are not resident are counted as misses and fetched
        predicted = np.zeros((2, 8), bool)
        predicted[0, [4, 6]] = True
        off.predicted(predicted)
        assert off.stats.lookups[0] == 2 and off.stats.hits[0] == 1 and off.stats.prefetched_bytes > 0
        r = off.residency()
        assert r.hit_rate[0] == 0.5 and np.isnan(r.hit_rate[1]) and r.locked_bytes > 0
    finally:
        off.close()


def test_library_code_ranges_are_found(decoders):
    names = {os.path.basename(p) for _, _, p in code_ranges()}
    assert any(n.startswith("libllama") for n in names) and any(n.startswith("libggml") for n in names)


def test_hot_expert_selection_obeys_the_budget():
    counts = np.array([[9, 0, 5, 1], [7, 8, 0, 2]])
    sizes = np.array([100, 150])
    assert select_hot_experts(counts, sizes, 0) == []
    assert select_hot_experts(counts, sizes, 100) == [(0, 0)]
    hot = select_hot_experts(counts, sizes, 400)
    assert hot == [(0, 0), (1, 1), (1, 0)]  # 100 + 150 + 150 = 400; next (0, 2) would exceed it
    hot = select_hot_experts(counts, sizes, 10_000)
    assert (0, 1) not in hot and (1, 2) not in hot and len(hot) == 6  # never-routed experts are skipped
    for budget in range(0, 1000, 37):
        chosen = select_hot_experts(counts, sizes, budget)
        assert sum(sizes[layer] for layer, _ in chosen) <= budget


def test_the_expert_cache_gets_one_token_s_experts_or_one_layer_s_and_the_hot_experts_the_rest(tiny_models):
    """An LRU smaller than a token's reads holds nothing that is read again (decoding reads its layers in a
    cycle): the cache gets half the room but at least one token's experts where the room allows, else only the
    one layer's that compute."""
    em = expert_map(tiny_models["olmoe"])
    per_token, one_layer = 4 * int(em.expert_bytes.sum()), 4 * int(em.expert_bytes.max())
    assert one_layer < per_token
    for room, cache in [
        (3 * per_token, 3 * per_token // 2),
        (3 * per_token // 2, per_token),
        (per_token, per_token),
        (per_token - 1, one_layer),
        (one_layer, one_layer),
        (one_layer - 1, one_layer - 1),
        (0, 0),
    ]:
        plan = plan_budget(64 << 20, anon_bytes=0, base_bytes=0, emap=em, k=4, expert_room=room)
        assert (plan.cache_bytes, plan.hot_bytes) == (cache, room - cache), room
    # sized from the budget: what the process, its pinned weights and the slack leave
    plan = plan_budget(10 << 20, anon_bytes=2 << 20, base_bytes=1 << 20, emap=em, k=4)
    assert plan.hot_bytes + plan.cache_bytes + plan.slack_bytes == (10 << 20) - (3 << 20)
    assert plan.cache_bytes >= per_token and plan.hot_bytes > 0 and "hot experts" in plan.describe()
    # nothing to pin: the cache gets the room
    bare = plan_budget(10 << 20, anon_bytes=2 << 20, base_bytes=1 << 20, emap=em, k=4, pin_hot=False)
    assert bare.hot_bytes == 0 and bare.cache_bytes == plan.hot_bytes + plan.cache_bytes
    tight = plan_budget(5 << 20, anon_bytes=4 << 20, base_bytes=1 << 20, emap=em, k=4)
    assert tight.hot_bytes == 0 and tight.cache_bytes == 0
    # fewer hot experts ranked than their room holds: the cache gets what they leave
    pinned = plan.with_pinned(plan.hot_bytes // 3)
    assert pinned.hot_bytes == plan.hot_bytes // 3
    assert pinned.cache_bytes + pinned.hot_bytes == plan.cache_bytes + plan.hot_bytes


@pytest.mark.parametrize(
    "text,value",
    [("800M", 800 << 20), ("1.5G", 3 << 29), ("300MiB", 300 << 20), ("2GB", 2_000_000_000), ("123456", 123456)],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "ten", "5x", "-1G", "10"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("text,size", [("auto", None), (" AUTO ", None), ("2G", 2 << 30), ("2GB", 2_000_000_000)])
def test_a_budget_is_auto_or_a_size_and_reads_back_its_own_form(text, size):
    budget = Budget.parse(text)
    assert budget.size == size and budget.auto == (size is None)
    assert Budget.parse(str(budget)) == budget  # what a process started inside the budget is handed
    assert budget.start_limit == (AUTO_START_LIMIT if size is None else size)
    assert budget.describe(80 << 20) == ("auto (80.0 MiB)" if size is None else fmt_bytes(size))


@pytest.mark.parametrize("text", ["", "100", "automatic", "-1G", "9" * 400, "9" * 30 + "T"])
def test_a_budget_that_is_neither_is_a_config_error(text):
    with pytest.raises(ConfigError):
        Budget.parse(text)


def test_a_cgroup_named_in_the_environment_must_be_this_process_own(tmp_path, monkeypatch):
    """A plain folder passed as the budget cgroup would take limits into plain files while the run went
    unlimited: only the cgroup /proc/self/cgroup names is trusted."""
    monkeypatch.setenv("S2MOE_BUDGET_CGROUP", str(tmp_path))
    (tmp_path / "memory.max").write_text("max\n")
    with pytest.raises(ConfigError, match="not the memory cgroup this process runs in"):
        current_budget_cgroup()
    monkeypatch.delenv("S2MOE_BUDGET_CGROUP")
    assert current_budget_cgroup() is None and current_budget() is None


def test_a_budget_cgroup_left_by_a_killed_run_is_removed_by_the_next(monkeypatch, tmp_path):
    """SIGKILL leaves no time to remove a run's cgroup: the next run removes those whose process is gone and
    that hold nothing, and leaves the others (a plain folder stands in for the hierarchy)."""
    import shutil
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tmp_path))
    stale = tmp_path / f"s2moe-bench-{gone.pid}-123"
    busy = tmp_path / f"s2moe-run-{gone.pid}-456"  # not empty: a cgroup that still holds a process
    alive = tmp_path / f"s2moe-run-{os.getppid()}-789"
    other = tmp_path / "someone-else-1-2"
    for d in (stale, busy, alive, other):
        d.mkdir()
    (busy / "cgroup.procs").write_text("1\n")
    cg = MemoryCgroup.create(200 << 20, tag="bench")
    try:
        assert not stale.exists() and busy.exists() and alive.exists() and other.exists()
    finally:
        shutil.rmtree(cg.path)  # the plain folder took the limits as plain files


def test_no_cgroup_gives_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tmp_path / "missing"))
    reason = MemoryCgroup.unavailable_reason()
    assert reason and "systemd-run" in reason and "\n" not in reason


def test_generate_budget_without_cgroups_is_a_clear_error(tiny_models, monkeypatch, capsys):
    from s2moe.app.cli import main

    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tiny_models["olmoe"].parent / "missing"))
    rc = main(["generate", "--model", str(tiny_models["olmoe"]), "-p", "hi", "-n", "2", "--budget", "200M"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: no memory cgroup") and "systemd-run" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "-p", "hi", "-n", "2"],
        ["calibrate", "--no-save"],
        ["bench", "-n", "2", "--n-prompts", "1", "--modes", "ar"],
    ],
)
def test_a_budget_beyond_the_machine_s_memory_is_refused_in_one_line_before_any_work(tiny_models, capsys, command):
    """A limit larger than the machine never binds: the run would look budgeted and be nothing of the kind (1T
    typed for 1G). Refused before any work: calibrate and bench would have measured for minutes first."""
    from s2moe.app.cli import main
    from s2moe.engine.offload.procfs import meminfo

    too_much = f"{-(-4 * meminfo()['MemTotal'] // (1 << 30))}G"
    rc = main([command[0], "--model", str(tiny_models["olmoe"]), *command[1:], "--budget", too_much])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "" and out.err.count("\n") == 1, out.err
    assert "more than this machine's memory" in out.err and "limits nothing" in out.err
    # a projection is not run here: its budget may be another device's
    from s2moe.app.cmd_project import _budget

    assert _budget(too_much) == too_much


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_the_least_budget_a_refusal_names_runs_and_a_little_less_is_refused(tiny_models, capfd):
    """`--budget 62M` named 68.2 MiB as the least while 66M ran: the size named is the least that runs."""
    from s2moe.app.cli import main

    argv = [
        "generate",
        "--model",
        str(tiny_models["olmoe"]),
        "-p",
        "hello",
        "-n",
        "4",
        "--threads",
        "1",
        "--ignore-eos",
        "--budget",
    ]
    assert main(argv + ["40M"]) == 2
    err = capfd.readouterr().err
    least = parse_size("".join(re.search(r"give at least (\S+) (\S+)", err).groups()))
    # a run measures its own process: the margins are for what one run's measure differs from another's
    assert main(argv + [str(least + (256 << 10))]) == 0, capfd.readouterr().err
    capfd.readouterr()
    assert main(argv + [str(least - (512 << 10))]) == 2
    assert "give at least" in capfd.readouterr().err


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_a_budget_cgroup_limit_goes_up_for_a_warm_up_and_down_again():
    """A run of a given size warms up under a raised limit, then lowers it to its budget. Where swap is
    accounted (cgroup v1's memsw) the kernel refuses a memory limit above the memory+swap one, so each
    direction must write the two in its own order."""
    cg = MemoryCgroup.create(256 << 20, "test-raise")
    try:
        cg.set_limit(1 << 30)
        assert cg.limit() == 1 << 30
        cg.set_limit(128 << 20)
        assert cg.limit() == 128 << 20
    finally:
        cg.remove()


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_generate_under_a_real_budget(tiny_models, capfd):
    from s2moe.app.cli import main

    rc = main(
        [
            "generate",
            "--model",
            str(tiny_models["olmoe"]),
            "-p",
            "hello",
            "-n",
            "4",
            "--threads",
            "1",
            "--budget",
            "400M",
            "--mode",
            "s2moe",
            "--ignore-eos",
        ]
    )
    out = capfd.readouterr()
    assert rc == 0
    assert "memory budget 400.0 MiB: peak" in out.err and "pinned: weights" in out.err
    assert re.search(r"expert cache kept here: [\d.]+ [KMG]iB of [\d.]+ [KMG]iB held, \d+ evicted", out.err)
    # no profile: nothing pinned as hot, and the way to a profile that would pin some, for this very budget
    assert f"calibrate once under this budget (s2moe calibrate -m {tiny_models['olmoe']} --budget 400M" in out.err
    # auto: the child sizes its own limit after a warm-up and reports it; same tokens as a resident run
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_models["olmoe"]),
            "-p",
            "hello",
            "-n",
            "6",
            "--threads",
            "1",
            "--budget",
            "auto",
            "--mode",
            "s2moe",
            "--ignore-eos",
            "--reuse-strength",
            "0",
            "--json",
        ]
    )
    out = capfd.readouterr()
    assert rc == 0, out.err
    assert "calibrate once" not in out.err  # --json: only the result
    offloaded = json.loads(out.out.strip().splitlines()[-1])
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_models["olmoe"]),
                "-p",
                "hello",
                "-n",
                "6",
                "--threads",
                "1",
                "--mode",
                "ar",
                "--ignore-eos",
                "--json",
            ]
        )
        == 0
    )
    resident = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert offloaded["tokens"] == resident["tokens"]
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_models["olmoe"]),
            "-p",
            "hello",
            "-n",
            "2",
            "--budget",
            "auto",
            "--threads",
            "1",
            "--events",
        ]
    )
    err = capfd.readouterr().err
    assert rc == 0 and "budget auto (" in err and "memory budget " in err
    assert re.search(r"experts \(\d+ fetched, \d+ storage faults\)", err)  # each offloaded verification says so


def test_miss_aware_fit_recovers_known_costs():
    from s2moe.engine.measure.cost_fits import fit_miss_cost

    rng = np.random.default_rng(1)
    experts = rng.integers(16, 64, size=80)
    misses = (experts * rng.uniform(0, 1, size=80)).round()
    tokens = rng.integers(1, 10, size=80)
    seconds = 0.05 + 1e-4 * (experts - misses) + 8e-3 * misses + 2e-3 * tokens + rng.normal(0, 1e-4, size=80)
    fit = fit_miss_cost(experts, misses, tokens, seconds)
    assert fit.t_miss == pytest.approx(8e-3, rel=0.02) and fit.t_tok == pytest.approx(2e-3, rel=0.05)
    assert fit.intercept == pytest.approx(0.05, abs=2e-3) and fit.r2 > 0.99
    assert fit.t_hit >= 0


def test_fault_explained_fit_recovers_what_a_fault_costs():
    from s2moe.engine.measure.cost_fits import fault_explained_fit

    rng = np.random.default_rng(2)
    experts = rng.integers(16, 64, size=80)
    faults = rng.poisson(5, size=80)
    tokens = rng.integers(1, 10, size=80)
    seconds = 0.01 + 2e-4 * experts + 1e-3 * faults + 2e-3 * tokens + rng.normal(0, 1e-5, size=80)
    g = fault_explained_fit(experts, faults, tokens, seconds)
    assert g["t_fault_s"] == pytest.approx(1e-3, rel=0.02) and g["t_tok_s"] == pytest.approx(2e-3, rel=0.02)
    assert g["r2"] > 0.99 and g["faults_per_verification"] == pytest.approx(faults.mean())


def test_a_drifting_disk_is_followed_by_the_tracked_rate_and_a_steady_one_costs_little():
    from s2moe.engine.measure.cost_fits import drift_tracked_fit, fit_miss_cost

    rng = np.random.default_rng(3)
    n = 400
    experts = rng.integers(40, 140, size=n)
    misses = (experts * rng.uniform(0.5, 0.9, size=n)).astype(int)
    tokens = rng.integers(1, 10, size=n)
    noise = rng.normal(0, 2e-3, size=n)
    for rate, expect_gain in ((np.linspace(1.6e-3, 2.6e-3, n), True), (np.full(n, 2e-3), False)):
        seconds = 0.002 + 2e-4 * (experts - misses) + rate * misses + 1.5e-3 * tokens + noise
        fit = fit_miss_cost(experts, misses, tokens, seconds)
        tracked = drift_tracked_fit(fit, experts, misses, tokens, seconds)
        lo, hi = tracked["t_exp_cold_range_s"]
        if expect_gain:
            assert tracked["r2"] > fit.r2 + 0.03 and lo < 1.9e-3 and hi > 2.3e-3
        else:
            assert tracked["r2"] > fit.r2 - 0.01 and hi - lo < 4e-4


def test_the_tracked_rate_is_not_swung_by_verifications_that_fetched_little():
    """Under a roomier budget most verifications fetch a handful of experts, and their time beyond the fit's
    other terms is mostly noise: divided by one or two fetches it says nothing of the rate, and must not move
    it more than those fetches' share of the run."""
    from s2moe.engine.measure.cost_fits import drift_tracked_fit, fit_miss_cost

    rng = np.random.default_rng(4)
    n = 600
    experts = rng.integers(40, 70, size=n)
    misses = np.where(rng.random(n) < 0.7, rng.integers(0, 3, size=n), rng.integers(10, 40, size=n))
    tokens = rng.integers(1, 4, size=n)
    rate = np.linspace(0.7e-3, 1.1e-3, n)
    seconds = 0.003 + 2e-4 * (experts - misses) + rate * misses + 3.5e-3 * tokens + rng.normal(0, 1.5e-3, size=n)
    fit = fit_miss_cost(experts, misses, tokens, seconds)
    tracked = drift_tracked_fit(fit, experts, misses, tokens, seconds)
    lo, hi = tracked["t_exp_cold_range_s"]
    assert tracked["r2"] >= fit.r2 - 0.005 and lo > 0.4e-3 and hi < 1.5e-3


@contextmanager
def _cold_prefetcher(model, *, advise: bool):
    """(expert map, our mapping, native prefetcher) over `model`, with the file dropped from the page cache
    (skips where the page cache keeps it)."""
    from s2moe.engine.offload import NativePrefetch

    em = expert_map(model)
    m = ModelMapping(em)
    pf = NativePrefetch(m, advise=advise)
    try:
        drop_file_cache(model)
        if m.expert_residency().max() > 0:
            pytest.skip("the page cache keeps this file; DONTNEED had no effect")
        yield em, m, pf
    finally:
        pf.close()
        m.close()


def test_native_prefetch_reads_exactly_the_chosen_experts(wide_model):
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        assert pf.layer(1, [3, 3, -1, 99, 6]) == 2  # duplicates and bad ids are ignored
        mask = np.zeros((2, 8), bool)
        mask[0, 1] = True
        assert pf.mask(mask) == 1
        import time

        want = {(1, 3), (1, 6), (0, 1)}
        for i in range(1000):  # WILLNEED reads asynchronously; this shared disk sometimes takes seconds
            res = m.expert_residency()
            if all(res[p] == 1.0 for p in want):
                break
            if i % 100 == 99:
                # the kernel's read-ahead is best effort (its pages are allocated without retrying): a page it
                # skipped stays out until asked again, as the next routing of that expert would
                pf.layer(1, [3, 6])
                pf.mask(mask)
            time.sleep(0.01)
        assert all(res[p] == 1.0 for p in want)
        others = [(layer, e) for layer in range(2) for e in range(8) if (layer, e) not in want]

        # and nothing beside them: a neighbour holds at most the page it shares with a chosen expert's end
        def neighbour(p):
            return any(layer == p[0] and abs(e - p[1]) == 1 for layer, e in want)

        assert all(res[p] < 0.25 if neighbour(p) else res[p] == 0.0 for p in others)
        assert pf.bytes_advised >= 3 * int(em.expert_bytes[0]) and pf.layer_fn_address


def test_the_kept_expert_cache_evicts_the_least_recently_routed_expert_from_memory(wide_model):
    """Routed experts enter a least-recently-used list of `capacity` bytes (pinned ones aside); the one that
    falls off leaves the page cache at once; a layer's own experts are never evicted while it routes."""

    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)  # stands in for llama.cpp's mapping of the file
        try:
            one = int(em.expert_bytes[0])
            pinned = np.zeros((2, 8), np.uint8)
            pinned[0, 0] = 1
            pf.keep_cache(llama.addr, 0, llama.size, 3 * one, pinned)

            def resident():
                return m.expert_residency() >= 1.0

            pf.layer(0, [1, 2])
            # (reads in flight are not dropped: the kernel skips pages under I/O, and decoding never evicts
            # an expert it has just asked for)
            assert _wait_for(lambda: resident()[0, [1, 2]].all())
            pf.layer(1, [3, 4])  # four held: (0, 1), routed longest ago, goes
            assert pf.cache_stats() == {
                "held": 3 * one,
                "evicted": 1,
                "refused": 0,
                "lost": 0,
                "staged": 0,
                "streamed": 0,
                "behind": 0,
                "dropped_behind": 0,
            }
            assert _wait_for(lambda: resident()[0, 2] and resident()[1, 3] and resident()[1, 4])
            assert not resident()[0, 1]
            pf.layer(0, [0])  # pinned: never counted
            assert pf.cache_stats()["held"] == 3 * one
            pf.layer(1, [5, 6, 7, 3, 4])  # more than the cache: the layer keeps its own, (0, 2) goes
            assert pf.cache_stats()["held"] == 5 * one and pf.cache_stats()["evicted"] == 2
            assert not resident()[0, 2]
            assert _wait_for(lambda: resident()[1, [3, 4, 5, 6, 7]].all())
            pf.layer(0, [1])  # the next layer routes: down to three, layer 1's earliest routed gone first
            assert pf.cache_stats()["held"] == 3 * one
            assert _wait_for(lambda: resident()[0, 1])
            held = resident()[1]
            assert held.sum() == 2 and held[[6, 7]].all()  # ids 3, 4, 5 were stamped first, in that order
            drop_file_cache(wide_model)  # the kernel takes a held expert: counted when it is routed again
            pf.layer(1, [7])
            assert pf.cache_stats()["lost"] == 1
            pf.keep_cache(0, 0, 0, -1, pinned)
            assert pf.cache_stats() == {
                "held": 0,
                "evicted": 0,
                "refused": 0,
                "lost": 0,
                "staged": 0,
                "streamed": 0,
                "behind": 0,
                "dropped_behind": 0,
            }
        finally:
            llama.close()


def test_experts_only_a_verifications_drafted_rows_read_are_the_first_the_kept_cache_evicts(wide_model):
    """In a verification only the first row's experts become the cache's most recent: an expert only the
    drafted rows read enters at the least recent end, and one already held keeps its place, so that the
    experts the plain steps around it read stay."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)
        try:
            one = int(em.expert_bytes[0])
            pf.keep_cache(llama.addr, 0, llama.size, 3 * one, np.zeros((2, 8), np.uint8))

            def resident():
                return m.expert_residency() >= 1.0

            pf.lead(2)  # two rows of two ids: experts 1 and 2 the first row's, 3 and 4 the drafted row's
            pf.layer(0, [1, 2, 3, 4])  # past the capacity, but a layer keeps its own while it routes
            assert pf.cache_stats()["held"] == 4 * one and pf.cache_stats()["behind"] == 2
            assert _wait_for(lambda: resident()[0, [1, 2, 3, 4]].all())
            pf.lead(0)  # a plain step
            pf.layer(1, [5])  # the drafted row's experts go first, though stamped after the first row's
            assert pf.cache_stats()["held"] == 3 * one and pf.cache_stats()["evicted"] == 2
            assert _wait_for(lambda: resident()[0, [1, 2]].all() and resident()[1, 5])
            assert not resident()[0, 3] and not resident()[0, 4]
            pf.lead(1)
            pf.layer(0, [2, 1])  # (0, 2) the first row's, made the most recent; (0, 1) the drafted row's stays last
            pf.lead(0)
            pf.layer(1, [6])
            assert not resident()[0, 1] and resident()[0, 2] and resident()[1, 5]
            assert pf.cache_stats()["behind"] == 2  # (0, 1) was held: it kept its place, it did not enter
        finally:
            llama.close()


def test_an_evicted_expert_takes_the_pages_it_shares_with_experts_the_cache_does_not_hold(wide_model):
    """Expert slices rarely start on a page boundary, so each shares its first and last page with the expert
    beside it. Evicted, an expert takes those pages too, unless that neighbour is held (or pinned): else they
    stay in memory, counted nowhere, and fill the budget's slack."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        if (em.ranges[0, :, :, 0] % os.sysconf("SC_PAGE_SIZE") == 0).all():
            pytest.skip("this file's expert slices start on page boundaries")
        llama = ModelMapping(em)
        try:
            one = int(em.expert_bytes[0])
            pf.keep_cache(llama.addr, 0, llama.size, 2 * one, np.zeros((2, 8), np.uint8))
            pf.layer(0, [3, 4])  # reads their shared pages, and those shared with experts 2 and 5
            assert _wait_for(lambda: (m.expert_residency()[0, [3, 4]] >= 1.0).all())
            pf.layer(1, [0])  # (0, 3) goes; the pages it shares with (0, 4), held, stay
            res = m.expert_residency()
            assert res[0, 4] == 1.0 and 0 < res[0, 3] < 0.5
            pf.layer(1, [1])  # (0, 4) goes, and with it the pages it shared with (0, 3)
            res = m.expert_residency()
            assert res[0, 3] == res[0, 4] == 0.0
            assert res[0, [2, 5]].max() == 0.0  # their pages shared with 3 and 4 went with them
        finally:
            llama.close()


def test_a_layer_that_does_not_fit_is_read_one_part_at_a_time_in_the_order_its_matmuls_run(wide_model):
    """Asked for all at once, a layer's experts that do not fit are reclaimed before their matmul reads them.
    Past the stage room, the routed layer's fetched experts are read one part at a time: the part of the
    matmul that runs first, then, as each matmul's stage call comes, the next part, the used one dropped;
    after the last, the cache no longer holds them. The order is learned from the first layer's calls."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)
        try:
            names = em.parts[0]
            part = {
                kind: next(j for j, n in enumerate(names) if f"ffn_{kind}_exps" in n) for kind in ("up", "gate", "down")
            }
            one = int(em.expert_bytes[0])
            pf.keep_cache(llama.addr, 0, llama.size, 8 * one, np.zeros((2, 8), np.uint8))
            pf.set_stages((part["up"], part["gate"], part["down"]), room=2 * one)
            assert pf.wants_stage(1, 1)  # every call, while the order is learned
            for kind in (1, 0, 2, 1):  # the gate's matmul first, then up, then down (as llama.cpp runs them)
                pf.stage(1, kind)
            assert pf.stage_order == (1, 0, 2)
            assert not pf.wants_stage(1, 1)  # then only a staged layer's: the graph stops for nothing else

            def parts_resident(layer, experts, kind):
                return [m.range_resident(*(int(x) for x in em.ranges[layer, e, part[kind]])) for e in experts]

            def gone(layer, experts, kind):  # not a page of them left
                return max(parts_resident(layer, experts, kind)) == 0.0

            def read(layer, experts, kind):
                return _wait_for(lambda: min(parts_resident(layer, experts, kind)) == 1.0)

            pf.layer(0, [1])  # one expert to fetch: within the room, every part asked for at once
            assert read(0, [1], "gate") and read(0, [1], "up") and read(0, [1], "down")
            pf.layer(1, [2, 3, 4])  # three: past the room, the gate's part only
            assert pf.cache_stats()["staged"] == 1
            assert pf.wants_stage(1, 0) and not pf.wants_stage(0, 0)
            assert read(1, [2, 3, 4], "gate")
            assert gone(1, [2, 3, 4], "up") and gone(1, [2, 3, 4], "down")
            assert pf.stage(1, 1) == 3  # the gate's matmul ran: its part goes, up's comes
            assert read(1, [2, 3, 4], "up") and gone(1, [2, 3, 4], "gate")
            pf.stage(1, 0)
            assert read(1, [2, 3, 4], "down") and gone(1, [2, 3, 4], "up")
            held = pf.cache_stats()["held"]
            pf.stage(1, 2)  # the last: nothing of them stays, and the cache forgets them
            assert gone(1, [2, 3, 4], "down")
            assert pf.cache_stats()["held"] == held - 3 * one
            assert pf.stage(1, 1) == 0  # the layer is done; stray calls change nothing
            assert not pf.wants_stage(1, 1)
            pf.layer(1, [5, 6, 7])  # staged again, and the decode stops before its last matmul
            assert pf.wants_stage(1, 1)
            pf.stage(1, 1)
            pf.layer(0, [2])  # the next decode: a layer routing ends that staging
            assert not pf.wants_stage(1, 0) and pf.stage(1, 0) == 0
        finally:
            llama.close()


def test_the_kept_cache_gives_way_to_what_the_process_grows_past_its_plan(wide_model):
    """A budget is fixed, and a process grows past what its plan counted: the kept cache gives up as many whole
    MiBs as the process grew (its least recent experts leave memory at once), the stage room with it, and takes
    them back once the process shrinks. Decoding looks at most every `fit_every_s` (here: every step)."""
    from s2moe.engine.offload import BudgetPlan, process_anon_bytes

    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        off = Offloader(wide_model, emap=em)
        llama = ModelMapping(em)  # stands in for llama.cpp's mapping of the file
        try:
            mib, one = 1 << 20, int(em.expert_bytes[0])
            assert off.keep_expert_cache(6 * mib, (), [(llama.addr, llama.size, 0)])
            assert off.read_parts_in_order(4 * mib)
            off.fit_every_s = 0.0
            off.native.advise = True  # as attach(jit_prefetch=True) sets it
            off.native.layer(0, list(range(8)))
            off.native.layer(1, list(range(8)))
            assert off.native.cache_stats()["held"] == 16 * one and 16 * one > 2 * mib
            assert _wait_for(lambda: m.expert_residency().min() == 1.0)
            gc.collect()  # what the tests before left settles before the plan counts the process
            off.plan = BudgetPlan(
                64 * mib, anon_bytes=process_anon_bytes(), base_bytes=0, hot_bytes=0, cache_bytes=6 * mib
            )
            off.verifying(None, 0)
            assert off.native.cache_capacity == 6 * mib  # nothing grown yet (less than a MiB)

            # private and anonymous (shared would count as shmem), a mapping of its own that no allocator keeps
            grown = mmap.mmap(-1, 4 * mib + mib // 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for page in range(0, len(grown), 4096):
                grown[page] = 1  # written: resident
            off.verifying(None, 0)
            capacity = off.native.cache_capacity
            assert mib <= capacity <= 2 * mib and capacity % mib == 0
            assert off.native.stage_room == 4 * mib - (6 * mib - capacity)
            held, evicted = off.native.cache_stats()["held"], off.native.cache_stats()["evicted"]
            assert held <= capacity and evicted == 16 - held // one
            res = m.expert_residency()
            assert res[0, :evicted].max() < 0.5 and res[1].min() == 1.0  # the least recent went: layer 0's first
            grown.close()
            off.verifying(None, 0)
            assert off.native.cache_capacity == 6 * mib and off.native.stage_room == 4 * mib
        finally:
            off.close()
            llama.close()


def test_past_the_kept_cache_the_pinned_hot_experts_give_way_the_least_routed_first(wide_model):
    """Where the process grows past all the kept cache can give up, the pinned hot experts give way next: as
    many whole experts as the rest of the growth takes, the least routed first. Unlocked, they leave memory
    at once; the others stay pinned and resident. Once the process shrinks they are read and pinned again."""
    from s2moe.engine.offload import BudgetPlan, process_anon_bytes

    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        off = Offloader(wide_model, emap=em)
        llama = ModelMapping(em)  # stands in for llama.cpp's mapping of the file
        try:
            mib, one = 1 << 20, int(em.expert_bytes[0])
            hot = [(layer, e) for e in range(6) for layer in range(2)]  # most routed first
            off.pin(non_expert=False, code=False, hot=hot)
            pinned_bytes = off.pinned_split["hot_experts"]
            assert off.keep_expert_cache(mib, hot, [(llama.addr, llama.size, 0)])
            off.fit_every_s = 0.0
            gc.collect()  # what the tests before left settles before the plan counts the process
            off.plan = BudgetPlan(
                64 * mib, anon_bytes=process_anon_bytes(), base_bytes=0, hot_bytes=len(hot) * one, cache_bytes=mib
            )
            off.verifying(None, 0)
            assert off.hot_given == 0 and m.expert_residency()[tuple(np.array(hot).T)].min() == 1.0

            # private and anonymous (shared would count as shmem), a mapping of its own that no allocator keeps
            grown = mmap.mmap(-1, 2 * mib + mib // 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for page in range(0, len(grown), 4096):
                grown[page] = 1  # written: resident
            off.verifying(None, 0)
            assert off.native.cache_capacity == 0
            beyond = 2 * mib - mib  # what the cache could not give
            given = -(-beyond // one)
            assert off.hot_given == given < len(hot)
            gone, kept = hot[len(hot) - given :], hot[: len(hot) - given]
            res, pinned = m.expert_residency(), off.map.pinned
            assert max(res[p] for p in gone) < 0.5 and min(res[p] for p in kept) == 1.0
            assert not any(pinned[p] for p in gone) and all(pinned[p] for p in kept)
            assert off.pinned_split["hot_experts"] < pinned_bytes
            grown.close()
            off.verifying(None, 0)
            assert off.hot_given == 0 and off.native.cache_capacity == mib
            assert _wait_for(lambda: min(m.expert_residency()[p] for p in hot) == 1.0)
            assert off.map.pinned[tuple(np.array(hot).T)].all() and off.pinned_split["hot_experts"] == pinned_bytes
        finally:
            off.close()
            llama.close()


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `addr`: "sr" where sequential reads were advised, "rr"
    random."""
    for start, end, _, _, flags in _vmas():
        if start <= addr < end:
            return flags
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("stream", [True, False])
def test_parts_that_alone_outgrow_the_stage_room_are_streamed_behind_the_matmul(wide_model, stream):
    """A prompt's prefill routes nearly every expert of a layer, and then one part of its fetched experts alone
    outgrows the stage room: asked for all at once, the first would be reclaimed before the matmul reached
    them. Where faults read single pages (stream), a thread streams that part instead: it keeps a quarter of
    the room asked for past the furthest page the matmul has mapped (it reads its experts in id order), and
    drops the experts' parts the matmul has gone past. Here the test is the matmul: it reads the pages
    through the mapping llama.cpp would. While the matmuls' order is still being learned the whole layer is
    streamed, nothing dropped. Without stream every part is asked for whole, as before."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)
        try:
            assert llama.c.lib.madvise(llama.addr, llama.size, MADV_RANDOM) == 0  # what offloading sets
            part = {
                kind: next(j for j, n in enumerate(em.parts[0]) if f"ffn_{kind}_exps" in n)
                for kind in ("up", "gate", "down")
            }
            one = int(em.expert_bytes[0])
            pf.keep_cache(llama.addr, 0, llama.size, 8 * one, np.zeros((2, 8), np.uint8))
            pf.set_stages((part["up"], part["gate"], part["down"]), room=2 * one, stream=stream)
            assert 2 * one // 4 < 2 * int(em.ranges[0, 0, part["gate"], 1])  # a quarter room: under two parts

            def resident(layer, experts, kind):
                return [m.range_resident(*(int(x) for x in em.ranges[layer, e, part[kind]])) for e in experts]

            def read(layer, experts, kind):
                return _wait_for(lambda: min(resident(layer, experts, kind)) == 1.0)

            def matmul_reads(layer, experts, kind):
                for e in experts:
                    offset, length = (int(x) for x in em.ranges[layer, e, part[kind]])
                    ctypes.string_at(llama.addr + offset, length)

            first = min(part, key=part.get)  # the layer's parts in file order, each in expert id order
            pf.layer(1, list(range(8)))  # the order is not known yet: past the room, the whole layer
            if stream:
                assert read(1, [0], first)
                assert max(resident(1, [7], "down") + resident(1, [7], "gate") + resident(1, [7], "up")) < 0.5
                matmul_reads(1, range(7), first)
                assert read(1, [7], first)  # asked for as the matmul went
                assert min(resident(1, range(7), first)) == 1.0  # nothing dropped while the order is unknown
            else:
                assert read(1, range(8), "gate") and read(1, range(8), "up") and read(1, range(8), "down")
            for kind in (1, 0, 2):  # gate, up, down: the order learned on layer 1
                pf.stage(1, kind)
            pf.layer(0, [0])
            assert all(read(0, [0], kind) for kind in part)  # in memory before the next layer counts it
            assert pf.cache_stats()["streamed"] == (1 if stream else 0)

            pf.layer(0, list(range(8)))  # seven to fetch: their gate parts alone outgrow the room
            assert pf.cache_stats()["staged"] == 1
            if stream:
                assert read(0, [1], "gate") and resident(0, [7], "gate")[0] < 0.5
                assert max(resident(0, [1], "up")) < 0.5  # the next stage's part waits for it
                matmul_reads(0, range(1, 7), "gate")
                assert read(0, [7], "gate")
                assert _wait_for(lambda: pf.cache_stats()["dropped_behind"] >= 4)
                assert max(resident(0, range(1, 5), "gate")) < 0.5  # gone behind the matmul
                assert min(resident(0, [6], "gate")) == 1.0
            else:
                assert read(0, range(1, 8), "gate")
            pf.stage(0, 1)  # the gate's matmul ran: its parts go, up's is streamed
            assert max(resident(0, range(1, 8), "gate")) < 0.5
            if stream:
                assert read(0, [1], "up") and resident(0, [7], "up")[0] < 0.5
            pf.stage(0, 0)
            pf.stage(0, 2)
            assert pf.cache_stats()["streamed"] == (4 if stream else 0)
            assert "sr" not in _vm_flags(llama.addr + int(em.ranges[0, 7, part["up"], 0]))
        finally:
            llama.close()


@pytest.mark.parametrize("stage_room, single_pages", [(0, False), (0, True), (None, False)])
def test_decoding_learns_llama_cpp_s_matmul_order_and_reads_parts_in_it(wide_model, stage_room, single_pages):
    """The routing hook calls the prefetcher as each expert matmul of a layer completes; the order it learns
    is the one parts are asked for in, and staged reads follow (only past a stage room: None, never), streamed
    where faults read single pages."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig

    d = Decoder(str(wide_model), n_ctx=128, n_threads=1, use_extra_bufts=False)
    off = Offloader(wide_model)
    llama = ModelMapping(off.emap)
    try:
        assert off.keep_expert_cache(4 * int(off.emap.expert_bytes.max()), (), d.rt.file_mappings)
        drop_file_cache(wide_model)
        if single_pages:
            off.advise_fault_readahead(random=True)
        assert off.read_parts_in_order(stage_room)
        off.attach(d, jit_prefetch=True)
        cfg = GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False)
        tokens = run(d, "hello", cfg)[-1].tokens
        assert off.native.bytes_advised > 0  # the file was out of memory: the routed experts were asked for
        assert off.native.stage_order == (1, 0, 2)  # gate, up, down
        stats = off.native.cache_stats()
        assert stats["staged"] > 0 if stage_room == 0 else stats["staged"] == 0
        assert stats["streamed"] > 0 if single_pages else stats["streamed"] == 0
        off.close()
        plain = run(d, "hello", cfg)[-1].tokens
        assert len(tokens) == 8 and tokens == plain  # stages change what is in memory, not what is computed
    finally:
        llama.close()
        d.close()


def test_a_draft_on_a_second_mapping_of_the_file_leaves_memory_the_cache_s_experts_aside(wide_model):
    """A drafter with weights of its own maps the file again and reads outside the routing hook: after its
    draft, what only that mapping holds goes; the cache's experts (mapped by llama.cpp's) stay."""
    import ctypes

    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama, other = ModelMapping(em), ModelMapping(em)  # llama.cpp's mapping, and the drafter's

        def touch(mapping, layer, e):  # a matmul's reads: the pages fault in, mapped
            for off, length in em.ranges[layer, e]:
                if length > 0:
                    ctypes.string_at(mapping.addr + int(off), int(length))

        try:
            pf.keep_cache(llama.addr, 0, llama.size, 3 * int(em.expert_bytes[0]), np.zeros((2, 8), np.uint8))
            pf.layer(0, [1])
            touch(llama, 0, 1)
            touch(other, 1, 5)
            touch(other, 1, 6)
            res = m.expert_residency()
            assert res[0, 1] == res[1, 5] == res[1, 6] == 1.0
            pf.drop_mapping(other.addr, 0, other.size)
            res = m.expert_residency()
            assert res[0, 1] == 1.0 and res[1, 5] < 0.1 and res[1, 6] < 0.1
        finally:
            llama.close()
            other.close()


def test_the_offloader_lets_go_of_what_other_mappings_of_the_file_read(wide_model):
    """When the cache starts, and after each draft on weights of their own, every mapping of the file but the
    decoder's own (and ours) is unmapped: what only it held leaves memory."""
    import ctypes

    off = Offloader(wide_model)
    llama, other = ModelMapping(off.emap), ModelMapping(off.emap)
    try:
        drop_file_cache(wide_model)
        if off.map.expert_residency()[1, [5, 6]].max() > 0:
            pytest.skip("the page cache keeps this file; DONTNEED had no effect")

        def read(mapping, layer, e):
            for o, length in off.emap.ranges[layer, e]:
                if length > 0:
                    ctypes.string_at(mapping.addr + int(o), int(length))

        read(other, 1, 5)
        assert off.map.expert_residency()[1, 5] == 1.0
        assert off.keep_expert_cache(2 * int(off.emap.expert_bytes.max()), (), [(llama.addr, llama.size, 0)])
        assert off.map.expert_residency()[1, 5] < 0.1
        read(llama, 0, 2)
        read(other, 1, 6)
        off.drafted_elsewhere([(other.addr, other.size, 0)])
        res = off.map.expert_residency()
        assert res[1, 6] < 0.1 and res[0, 2] == 1.0  # llama.cpp's own mapping keeps what it maps
    finally:
        other.close()
        llama.close()
        off.close()


def test_each_runtime_knows_the_mapping_its_own_load_made(wide_model):
    """The kept cache manages the decoder's own mapping of the file: with a second load of the same weights
    in the process (bench's base rung), taking the first mapping that covers the experts could pick the
    other one."""
    from s2moe.engine.decoding.runtime import LlamaRuntime
    from s2moe.engine.model_info import read_model_info

    info = read_model_info(wide_model)
    first = LlamaRuntime(info, n_ctx=128, n_threads=1, install_hook=False)
    second = LlamaRuntime(info, n_ctx=128, n_threads=1, install_hook=False)
    try:
        em = expert_map(wide_model)
        lo = int(em.ranges[..., 0][em.ranges[..., 1] > 0].min())
        hi = int((em.ranges[..., 0] + em.ranges[..., 1]).max())
        assert len(first.file_mappings) == len(second.file_mappings) == 1
        (a, la, fa), (b, lb, fb) = first.file_mappings[0], second.file_mappings[0]
        assert a != b and fa <= lo and hi <= fa + la and fb <= lo and hi <= fb + lb
    finally:
        second.close()
        first.close()


def test_keeping_the_cache_starts_it_empty(wide_model):
    """Whatever a warm-up left in memory goes when the cache starts, except what is pinned (mapped)."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)
        try:
            for layer in range(2):
                for e in range(8):
                    m.willneed(layer, e)
            assert _wait_for(lambda: (m.expert_residency() >= 1.0).all())
            m.pin_experts([(1, 2)])
            pinned = np.zeros((2, 8), np.uint8)
            pinned[1, 2] = 1
            pf.keep_cache(llama.addr, 0, llama.size, int(em.expert_bytes[0]), pinned)
            res = m.expert_residency()
            others = np.delete(res.ravel(), 8 + 2)
            # only the pages an expert shares with a kept neighbour or the tensor's edge stay
            assert res[1, 2] == 1.0 and others.max() < 0.1 and (others > 0).sum() <= 4
        finally:
            llama.close()


def _wait_for(condition, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reader_threads_fetch_the_predicted_experts_in_layer_order_within_their_room(wide_model):
    """The verification fetcher reads what the draft predicted, and never more than its room ahead of the
    layer the verification has reached (reported by the routing hook's callback): with room for one
    expert, layer 1's expert is read only once the verification has passed layer 0."""
    with _cold_prefetcher(wide_model, advise=False) as (em, m, pf):
        # one expert, its parts rounded out to whole pages
        pf.start_fetching(workers=4, room_bytes=int(em.expert_bytes.max()) + em.ranges.shape[2] * 2 * 4096)
        mask = np.zeros((2, 8), bool)
        mask[0, 2] = mask[1, 5] = True
        pf.want(mask)
        assert _wait_for(lambda: pf.fetch_stats()["read"] == 1)
        res = m.expert_residency()
        assert res[0, 2] == 1.0 and res[1, 5] == 0.0  # the room holds one expert: layer 0's, first
        pf.verification_starts()
        pf.layer(0, [2])
        pf.layer(1, [5])  # layer 0 is done: its expert's room is free
        assert _wait_for(lambda: pf.fetch_stats()["read"] == 2)
        assert m.expert_residency()[1, 5] == 1.0
        taken = pf.fetch_taken_at()  # when each was taken, whatever the timing: layer 1's once two layers routed
        assert taken[0, 2] == -1 and taken[1, 5] == 2 and (taken == -2).sum() == taken.size - 2
        res = m.expert_residency()
        # exact ranges, no read-ahead: a neighbour has at most the pages it shares with the expert read
        assert max(res[0, 1], res[0, 3], res[1, 4], res[1, 6]) <= 2 / 13
        again = np.zeros((2, 8), bool)
        again[0, 2] = again[1, 7] = True
        pf.want(again)  # the next proposal: layer 0's expert is found in memory, not read again
        assert _wait_for(lambda: pf.fetch_stats()["resident"] == 1)
        stats = pf.fetch_stats()
        assert stats["read"] == 2 and stats["bytes"] >= 2 * int(em.expert_bytes.min()) and stats["seconds"] > 0


def test_residency_snapshots_thin_out_when_the_walk_is_slow(tiny_models):
    """A residency snapshot walks the whole mapping; where that is slow next to decoding (a big model)
    snapshots come less often, so that they never take more than residency_share of the time."""
    import time

    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import ResidencySnapshot
    from s2moe.engine.offload import Pinning, offload_decoder

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, use_extra_bufts=False)
    try:
        off = offload_decoder(d, None, pinning=Pinning(base=False, hot=False))
        calls = []

        residency = off.residency

        def slow_residency():
            t0 = time.perf_counter()
            r = residency()
            while time.perf_counter() - t0 < 0.05:  # a 50 ms walk, much longer than a tiny decode
                pass
            calls.append(1)
            return r

        off.residency, d.residency_every = slow_residency, 2
        t0 = time.perf_counter()
        events = run(d, "hello", GenerationConfig(mode="ar", n_predict=40, stop_at_eos=False))
        elapsed = time.perf_counter() - t0
        snaps = [e for e in events if isinstance(e, ResidencySnapshot)]
        assert snaps and snaps[0].iteration == 1 and len(snaps) == len(calls)
        assert len(snaps) < 20 / 2  # every second iteration would give 20
        assert len(calls) * 0.05 <= d.residency_share * elapsed + 0.05  # the first walk is always taken
        off.close()
    finally:
        d.close()


def test_a_warm_up_before_offloading_times_nothing_and_the_run_measures_under_the_budget(tiny_models):
    """Constants timed before the offloader is in place are not what a step costs under the budget (resident,
    or faulting without its cache): the warm-up times none and drafts to the cap, building the longest graphs,
    and whatever was measured before is measured again once offloading is in place. Nor does its text join
    the session's earlier generations, which copies draw on and a copy cache keeps."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import Iteration, Started
    from s2moe.engine.offload import Budget, offload_decoder

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, max_draft=8, use_extra_bufts=False)
    try:
        cfg = GenerationConfig(mode="s2moe", n_predict=12, stop_at_eos=False, draft_max=4)
        resident = next(e for e in run(d, "hello", cfg) if isinstance(e, Started)).cost
        assert resident.source == "measured at start-up" and d.measured_cost_constants(None, 4) is resident
        warm = []
        session_text = d.earlier.generations()
        off = offload_decoder(d, Budget.parse("1G"), [], warm_up=lambda: warm.extend(run(d, "hello there", cfg)))
        assert d.earlier.generations() == session_text  # the warm-up's text is not the session's
        (started,) = [e for e in warm if isinstance(e, Started)]
        assert started.cost.source.startswith("warm-up")
        assert [e.draft_stop for e in warm if isinstance(e, Iteration)][0] == "cap"  # the longest drafts
        assert d.measured_cost_constants(None, 4) is None  # nothing timed since the resident run was forgotten
        again = next(e for e in run(d, "hello", cfg) if isinstance(e, Started)).cost
        assert again.source == "measured at start-up" and again is not resident
        off.close()
    finally:
        d.close()


def test_closing_the_offloader_detaches_it_from_the_routing_hook(tiny_models):
    """The C hook calls the offloader's native prefetcher on every decode; once the offloader is closed
    (its prefetcher freed) the decoder must keep working without calling into freed memory."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.offload import Pinning, offload_decoder

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, use_extra_bufts=False)
    try:
        off = offload_decoder(d, None, pinning=Pinning(base=False, hot=False))
        assert d.rt.hook.route is off.native and d.observer is off
        cfg = GenerationConfig(mode="s2moe", n_predict=6, utility=False, draft_max=3, stop_at_eos=False)
        before = run(d, "hello", cfg)
        off.close()
        assert d.rt.hook.route is None and off.native.handle is None and d.observer is None
        after = run(d, "hello", cfg)
        assert [e.committed for e in before if hasattr(e, "committed")] == [
            e.committed for e in after if hasattr(e, "committed")
        ]
    finally:
        d.close()


@contextmanager
def cold_prefetcher(path, *, advise: bool):
    """A native prefetcher over a mapping of `path`, with the file dropped from the page cache (skips where
    the cache keeps it)."""
    from s2moe.engine.offload import NativePrefetch

    m = ModelMapping(expert_map(path))
    pf = NativePrefetch(m, advise=advise)
    try:
        drop_file_cache(path)
        if m.expert_residency().max() > 0:
            pytest.skip("the page cache keeps this file; DONTNEED had no effect")
        yield pf
    finally:
        pf.close()
        m.close()


def test_a_layer_routing_asks_for_the_next_layers_predicted_experts(wide_model):
    """With a verification's predictions set, the callback for layer L also asks for layer L+1's predicted
    experts that are not in memory (their reads overlap layer L's matmuls); without them, only L's."""
    with cold_prefetcher(wide_model, advise=True) as pf:
        pf.layer(0, [1])
        alone = pf.bytes_advised
        ahead = np.zeros((2, 8), bool)
        ahead[1, [2, 5]] = True
        pf.set_ahead(ahead)
        pf.layer(0, [7])
        with_ahead = pf.bytes_advised - alone
        assert with_ahead >= 3 * alone  # layer 0's expert 7, then layer 1's experts 2 and 5
        pf.set_ahead(None)
        before = pf.bytes_advised
        pf.layer(0, [6])
        assert pf.bytes_advised - before == alone


def test_native_counter_counts_the_routed_experts_not_in_memory(wide_model):
    """The routing hook's callback counts, per layer, the distinct experts that are not wholly resident
    as the layer routes; counting alone reads nothing, and resident() answers for the asked experts."""
    import time

    with _cold_prefetcher(wide_model, advise=False) as (em, m, pf):
        pf.begin()
        assert pf.layer(1, [3, 3, 6, -1]) == 2
        assert pf.counted().tolist() == [0, 2]
        time.sleep(0.05)
        assert m.expert_residency().max() == 0  # counting only: nothing was asked for
        m.willneed(1, 3)
        for _ in range(1000):  # WILLNEED reads asynchronously
            if m.expert_residency()[1, 3] == 1.0:
                break
            time.sleep(0.01)
        pf.begin()
        pf.layer(1, [3, 6])
        pf.layer(0, [3])
        assert pf.counted().tolist() == [1, 1]
        ask = np.zeros((2, 8), bool)
        ask[1, [3, 6]] = True
        ask[0, 3] = True
        got = pf.resident(ask)
        assert got.tolist() == (m.expert_residency() >= 1.0).__and__(ask).tolist() and got[1, 3] and got.sum() == 1
        pf.mask(ask)  # an explicit prefetch is not a routed decode: it counts nothing
        assert pf.counted().tolist() == [1, 1]


def test_predictions_look_only_at_the_predicted_experts(tiny_models, monkeypatch):
    """A verification's bookkeeping must not cost in proportion to the model file: `predicted` asks
    the native prefetcher about the predicted experts and never walks the whole mapping."""
    from s2moe.engine.offload import Offloader

    off = Offloader(tiny_models["olmoe"], prefetch=False)
    try:
        expected = off.map.expert_residency() >= 0.999

        def whole_walk(*a):
            raise AssertionError("predicted walked the whole mapping")

        monkeypatch.setattr(off.map, "expert_residency", whole_walk)
        monkeypatch.setattr(off.map, "pages", whole_walk)
        predicted = np.zeros((off.emap.n_layer, off.emap.n_expert), bool)
        predicted[:, :3] = True
        off.predicted(predicted)
        assert off.stats.lookups.tolist() == [3] * off.emap.n_layer
        assert off.stats.hits.tolist() == (expected & predicted).sum(axis=1).tolist()
    finally:
        off.close()


def test_pinning_skips_the_embedding_table_when_the_output_matrix_is_separate(tiny_models):
    em = expert_map(tiny_models["olmoe"])
    names = dict(zip(em.non_expert_names, em.non_expert))
    pinnable = em.pinnable()
    assert names["output.weight"] in pinnable and names["token_embd.weight"] not in pinnable
    assert len(pinnable) == len(em.non_expert) - 1


def test_fault_read_around_can_be_turned_off_on_llamas_mapping(decoders, tiny_models):
    from s2moe.engine.decoding.decoder import run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.offload import model_mappings, read_ahead_bytes

    cfg = GenerationConfig(mode="ar", n_predict=3, stop_at_eos=False)
    before = run(decoders["olmoe"], "hello", cfg)[-1].tokens
    assert read_ahead_bytes(tiny_models["olmoe"]) >= 4096
    off = Offloader(tiny_models["olmoe"])
    try:
        assert model_mappings(tiny_models["olmoe"], exclude=(off.map.addr, off.map.size))  # llama.cpp's own mapping
        # mlock splits our mapping into several areas: none of them is taken for llama.cpp's
        off.pin(non_expert=True, code=False, hot=[(0, 1)])
        ours = [m for m in model_mappings(tiny_models["olmoe"]) if off.map.addr <= m[0] < off.map.addr + off.map.size]
        assert len(ours) >= 2
        assert not set(ours) & set(model_mappings(tiny_models["olmoe"], exclude=(off.map.addr, off.map.size)))
        assert off.advise_fault_readahead(random=True) > 0 and off.fault_readahead == "off"
        assert off.advise_fault_readahead(random=False) > 0 and off.fault_readahead == "embeddings-off"
    finally:
        off.close()
    # the advice changes how llama.cpp's mapping faults, not what the decoder reads from it
    assert len(before) == 3 and run(decoders["olmoe"], "hello", cfg)[-1].tokens == before


def test_routing_hook_prefetches_each_layers_experts_just_in_time(tiny_models):
    """With jit prefetch attached, every decode hands the prefetcher the experts the routing chose; those in
    memory are not asked for (a cold decode's are: test_decoding_learns_llama_cpp_s_matmul_order...)."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.offload import Pinning, offload_decoder

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, use_extra_bufts=False)
    try:
        off = offload_decoder(d, None, pinning=Pinning(base=False, hot=False))
        route = d.rt.hook.route
        assert route is not None and route.bytes_advised == 0
        cfg = GenerationConfig(mode="ar", n_predict=3, stop_at_eos=False)
        run(d, "hello", cfg)
        assert route.bytes_advised == 0  # llama.cpp's load read the whole file: every expert was in memory
        calls = int(route.lib.s2_prefetch_calls(route.handle))
        assert calls >= 3 * d.info.n_layer  # one per layer per decode
        # a batch the hook does not act on still routes through the prefetcher: the hook off, or more rows
        # than it records (a prompt's prefill), so that every expert read is asked for and kept count of
        d.rt.hook.off()
        d.rt.kv_clear()
        d.rt.decode([5, 6], 0, "last")
        assert int(route.lib.s2_prefetch_calls(route.handle)) == calls + d.info.n_layer
        d.rt.hook.observe()
        rows = d.rt.hook.max_rows + 3
        d.rt.decode(list(range(10, 10 + rows)), 2, "last")
        assert int(route.lib.s2_prefetch_calls(route.handle)) == calls + 2 * d.info.n_layer
        d.rt.kv_clear()
        off.close()
    finally:
        d.close()


def test_offloading_adds_residency_snapshots_to_the_event_stream(tiny_models):
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import ResidencySnapshot
    from s2moe.engine.offload import Pinning, offload_decoder

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, use_extra_bufts=False)
    try:
        off = offload_decoder(d, None, pinning=Pinning(base=False, hot=False))
        d.residency_every = 2
        d.residency_share = 1.0  # every second iteration, however long the walk takes next to decoding
        events = run(d, "hello", GenerationConfig(mode="ar", n_predict=5, stop_at_eos=False))
        snaps = [e for e in events if isinstance(e, ResidencySnapshot)]
        assert [s.iteration for s in snaps] == [1, 3, 5]
        shape = (d.info.n_layer, d.info.n_expert)
        assert snaps[-1].resident.shape == shape and snaps[-1].pinned.shape == shape
        assert ((snaps[-1].resident >= 0) & (snaps[-1].resident <= 1)).all()
        assert snaps[-1].resident.max() > 0  # the experts just used are in memory
        off.close()
    finally:
        d.close()


def _vmas() -> list[tuple[int, int, int, str, set[str]]]:
    """This process's mappings (/proc/self/smaps): start, end, file offset, the file's path ("" for none), and
    VmFlags."""
    from pathlib import Path

    vmas = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            a, b = (int(x, 16) for x in head[0].split("-"))
            vmas.append((a, b, int(head[2], 16), " ".join(head[5:]), set()))
        elif head[0] == "VmFlags:" and vmas:
            vmas[-1][4].update(head[1:])
    return vmas


def _random_read_flags(path, offsets):
    """For each file offset: does llama.cpp's mapping of `path` carry MADV_RANDOM ("rr") there?"""
    import os

    target = os.path.realpath(path)
    mine = [v for v in _vmas() if v[3] == target]
    return [
        any("rr" in flags for start, end, foff, _, flags in mine if foff <= off < foff + (end - start))
        for off in offsets
    ]


def test_a_fault_in_the_embedding_table_reads_one_page_not_a_window(decoders, tiny_models):
    """A token's embedding row is a few hundred bytes; the kernel's read-around window (up to MiBs)
    around a fault there read neighbouring experts every step and thrashed the expert cache (measured:
    4× slower plain decoding under a budget). The unpinned table is advised MADV_RANDOM; the experts
    only when asked."""
    path = tiny_models["olmoe"]
    off = Offloader(path)
    try:
        names = dict(zip(off.emap.non_expert_names, off.emap.non_expert))
        assert off.unpinned_non_expert() == [names["token_embd.weight"]]
        o, n = names["token_embd.weight"]
        embd_page = (o + 4095) // 4096 * 4096
        assert embd_page + 4096 <= o + n
        e_off, e_len = (int(x) for x in off.emap.ranges[0, 0, 0])
        expert_page = (e_off + 4095) // 4096 * 4096
        assert expert_page + 4096 <= e_off + e_len

        assert off.advise_fault_readahead(random=False) >= 4096
        assert _random_read_flags(path, [embd_page, expert_page]) == [True, False]
        assert off.fault_readahead == "embeddings-off"
        off.advise_fault_readahead(random=True)
        assert _random_read_flags(path, [embd_page, expert_page]) == [True, True]
    finally:
        off.advise_fault_readahead(random=False)
        off.close()


def test_auto_budget_counts_what_the_cgroup_holds_except_expert_pages(tiny_models):
    class FakeCgroup:  # only usage() is read
        def __init__(self, usage):
            self._usage = usage

        def usage(self):
            return self._usage

    from s2moe.engine.offload import ModelMapping, auto_budget_bytes

    em = expert_map(tiny_models["olmoe"])
    with open(tiny_models["olmoe"], "rb") as f:  # every expert page resident
        f.read()
    mapping = ModelMapping(em)
    try:
        resident = float((mapping.expert_residency() * em.expert_bytes[:, None]).sum())
    finally:
        mapping.close()
    assert resident == pytest.approx(em.total_expert_bytes, rel=0.05)
    usage = 50 << 20
    budget = auto_budget_bytes(FakeCgroup(usage), em, share=1 / 3)
    held = usage - resident
    assert (
        held + em.total_expert_bytes / 3
        < budget
        <= held + em.total_expert_bytes / 3 + max(AUTO_MIN_SLACK, held / 50) + 4096
    )
    # once the kept cache has dropped what it could, the expert pages left in memory stay: they are held
    stay = auto_budget_bytes(FakeCgroup(usage), em, share=1 / 3, experts_stay=True)
    assert (
        usage + em.total_expert_bytes / 3
        < stay
        <= usage + em.total_expert_bytes / 3 + max(AUTO_MIN_SLACK, usage / 50) + 4096
    )


@pytest.mark.parametrize(
    "args, said",
    [
        (["--budget", "12Q"], "invalid size '12Q'"),
        (["--arms", "ar/hot,ar/x"], "unknown arm 'ar/x'"),
        (["--model", "missing.gguf"], "cannot read model file"),
        (["--n-prompts", "0"], "--n-prompts and --tokens take a positive number"),
    ],
)
def test_offload_bench_refuses_bad_input_in_one_line(tiny_models, tmp_path, capsys, args, said):
    from s2moe.engine.measure import offload_bench

    out = tmp_path / "ab.json"
    argv = ["--model", str(tiny_models["olmoe"]), "--rounds", "1", "--out", str(out)] + args
    assert offload_bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_offload_bench_runs_every_arm_under_the_probed_auto_budget(tiny_models, tmp_path, capfd):
    from s2moe.engine.measure import offload_bench
    from s2moe.engine.offload import expert_map

    model = str(tiny_models["olmoe"])
    budget = offload_bench.auto_budget(model, threads=1)
    emap = expert_map(model)
    # the expert cache share is inside it, on top of what the probe's process held
    assert budget > emap.total_expert_bytes / 3
    out = tmp_path / "ab.json"
    rc = offload_bench.main(
        [
            "--model",
            model,
            "--rounds",
            "1",
            "--tokens",
            "6",
            "--arms",
            "ar/base,spec/hot",
            "--budget",
            str(budget),
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capfd.readouterr().err[-2000:]
    res = json.loads(out.read_text())
    assert res["budget"] == budget
    for arm in ("ar/base", "spec/hot"):
        (run,) = res["results"][arm]
        assert "error" not in run, run
        assert run["tok_s"] > 0 and run["peak"] <= budget, (arm, run["tok_s"], run["peak"], budget)
        assert run["n_tokens"] == 3 * 6 and len(run["tokens"]) == 3  # the first three HumanEval prompts, 6 each
    # lossless speculation (gating off): the same tokens as plain decoding
    assert res["results"]["spec/hot"][0]["tokens"] == res["results"]["ar/base"][0]["tokens"]


def _run_under_budget(script_text: str, model, tmp_path, budget: str = "auto") -> dict:
    """Run a script in a memory cgroup as `--budget` would (auto, or a size), with the model's path and the
    budget as its arguments, and read the JSON line it prints last."""
    import subprocess
    import sys

    from s2moe import native

    script = tmp_path / "script.py"
    script.write_text(script_text)
    native.build()  # as run_in_budget does: a build inside the cgroup would be counted in its auto budget
    drop_file_cache(model)  # ditto: pages another cgroup holds (a file just written) are not the process's
    limit = 1 << 30 if budget == "auto" else Budget.parse(budget).size
    cg = MemoryCgroup.create(limit, "test-budget")
    try:
        proc = cg.popen(
            [sys.executable, str(script), str(model), budget],
            budget,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        cg.remove()
    assert proc.returncode == 0, stderr[-2000:]
    return json.loads(stdout.strip().splitlines()[-1])


# An auto budget sized on a machine whose /proc/meminfo says MEMINFO: the error it gives, or None.
AUTO_ON_A_FAKED_MACHINE = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.errors import ConfigError
from s2moe.engine.offload import budget
budget.meminfo = lambda: MEMINFO
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=128, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="ar", n_predict=2, stop_at_eos=False)))
try:
    offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
    print(json.dumps({"error": None}))
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_an_auto_budget_beyond_the_machine_s_memory_says_what_it_saw(tiny_models, tmp_path):
    """Where the process and its share of the experts do not fit the machine, no auto budget works there: one
    line says what it counted, rather than a limit that binds nothing."""
    # a machine smaller than what the process holds
    script = AUTO_ON_A_FAKED_MACHINE.replace("MEMINFO", '{"MemTotal": 16 << 20}')
    error = _run_under_budget(script, tiny_models["olmoe"], tmp_path)["error"]
    assert error and "\n" not in error
    assert re.match(
        r"an auto budget here comes to [\d.]+ MiB \(the process holds [\d.]+ MiB, pinned .*, the cgroup "
        r".*, a third of the experts .*\) is more than this machine's memory \(16.0 MiB\)",
        error,
    ), error


AUTO_HEADROOM = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
cg = offload.current_budget_cgroup()
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=128, max_draft=8, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="s2moe", n_predict=8, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
budget = off.budget_bytes
list(dec.generate("hello there", GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False)))
resident = float((off.map.expert_residency() * off.emap.expert_bytes[:, None]).sum())
print(json.dumps({"budget": budget, "limit": cg.limit(), "usage": cg.usage(), "resident": resident,
                  "experts": off.emap.total_expert_bytes, "peak": cg.peak(), "version": cg.version,
                  "line": offload.split_line(cg, off)}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_auto_budget_leaves_the_expert_cache_its_share_after_offloading(tiny_models, tmp_path):
    """What the offloader itself allocates (the GGUF tensor table, residency buffers) is measured into
    `held`, so it does not come out of the third of the expert bytes reserved as the cache."""
    r = _run_under_budget(AUTO_HEADROOM, tiny_models["olmoe"], tmp_path)
    assert r["limit"] == r["budget"]
    held_now = r["usage"] - r["resident"]  # everything but expert pages, after a real generation
    assert r["budget"] - held_now >= r["experts"] / 3


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_the_peak_reported_under_an_auto_budget_is_not_the_warm_up_s(tiny_models, tmp_path):
    """The warm-up reads the whole model before the limit comes down to the auto budget; experts of some
    size (widened ×16: the warm-up then holds far more than the budget) make that peak exceed the limit."""
    from s2moe.engine.zoo.widen import widen

    model = widen(tiny_models["olmoe"], tmp_path / "wide.gguf", 16)
    r = _run_under_budget(AUTO_HEADROOM, model, tmp_path)
    # cgroup v1 starts the peak afresh; where the kernel keeps the warm-up's (v2), the line says whose it is
    if r["version"] == 1:
        assert r["peak"] <= r["limit"], r
    assert ("the warm-up's, before the limit came down" in r["line"]) == (r["peak"] > r["limit"]), r["line"]


SIZED_WARM_UP = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
cg = offload.current_budget_cgroup()
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=128, max_draft=8, use_extra_bufts=False)
limits = []
def warm():
    limits.append(cg.limit())
    list(dec.generate("hello", GenerationConfig(mode="s2moe", n_predict=8, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget.parse(sys.argv[2]), [], warm_up=warm)
list(dec.generate("hello there", GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False)))
print(json.dumps({"warm_up": limits, "limit": cg.limit(), "budget": off.budget_bytes}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_a_budget_of_a_given_size_warms_up_under_a_raised_limit_then_runs_under_its_own(tiny_models, tmp_path):
    """Under its own limit, with nothing pinned or cached yet, a warm-up decodes as llama.cpp alone would
    (slowly, on a model larger than the budget): it runs under the limit an auto budget starts with, and the
    run after it under the budget."""
    r = _run_under_budget(SIZED_WARM_UP, tiny_models["olmoe"], tmp_path, "512M")
    assert r["warm_up"] == [AUTO_START_LIMIT]
    assert r["limit"] == r["budget"] == 512 << 20


AUTO_HOT = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
cg = offload.current_budget_cgroup()
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=128, max_draft=8, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="s2moe", n_predict=8, stop_at_eos=False)))
hot = [(layer, expert) for expert in range(dec.info.n_expert) for layer in range(dec.info.n_layer)]
off = offload.offload_decoder(dec, offload.Budget(None), hot, warm_up=warm)
pinned = off.map.expert_residency()[off.map.pinned]
print(json.dumps({"budget": off.budget_bytes, "limit": cg.limit(), "hot": off.pinned_split["hot_experts"],
                  "eb": int(off.emap.expert_bytes.max()),
                  "plan_hot": off.plan.hot_bytes, "pinned_resident": [float(x) for x in pinned]}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_an_auto_budget_pins_the_hot_experts_its_plan_has_room_for_under_the_lowered_limit(tiny_models, tmp_path):
    """Hot experts are pinned once the limit is lowered (pinned before, while the warm-up's whole model
    was cached, the kernel could not reclaim down to the limit): they are pinned, in memory, and within
    the plan."""
    r = _run_under_budget(AUTO_HOT, tiny_models["olmoe"], tmp_path)
    assert r["limit"] == r["budget"]
    n_pinned = len(r["pinned_resident"])
    assert r["hot"] > 0 and 0 < n_pinned * r["eb"] <= r["plan_hot"]  # pinned bytes are rounded to pages
    assert min(r["pinned_resident"]) == 1.0


def test_a_drafts_prefetch_is_capped_at_the_expert_cache_for_each_verification(wide_model):
    """Predictions arrive pass by pass while the draft goes on; together they may ask for no more than the
    expert cache holds, and the allowance starts again with the next iteration's counting."""
    off = Offloader(wide_model, prefetch=True, prefetch_bytes=0)
    try:
        eb = int(off.emap.expert_bytes[0])
        off.prefetch_bytes = 2 * eb
        drop_file_cache(wide_model)
        off.start_counting()
        asked = []
        for expert in range(4):  # one newly predicted expert per draft pass
            mask = np.zeros((2, 8), bool)
            mask[0, expert] = True
            off.predicted(mask)
            asked.append(off.stats.prefetched_bytes)
        assert 0 < asked[0] < asked[1] == asked[2] == asked[3]  # two experts' worth, then nothing more
        off.start_counting()
        mask = np.zeros((2, 8), bool)
        mask[0, 5] = True
        off.predicted(mask)
        assert off.stats.prefetched_bytes > asked[-1]
    finally:
        off.close()


AUTO_RESIDENT_DRAFTS = """
import json, sys
import numpy as np
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import Iteration, Started
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=256, max_draft=8, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="s2moe", n_predict=8, stop_at_eos=False)))
hot = [(layer, 1) for layer in range(dec.info.n_layer)]
off = offload.offload_decoder(dec, offload.Budget(None), hot, warm_up=warm)
masks, ask = [], off.draft_allowed
def recorded():
    masks.append(ask())
    return masks[-1]
off.draft_allowed = recorded
out = {"pinned": off.map.pinned.tolist()}
for which in ("resident", "router"):
    masks.clear()
    cfg = GenerationConfig(mode="s2moe", n_predict=24, utility=False, reuse_strength=0.0, stop_at_eos=False,
                           draft_experts="resident" if which == "resident" else None)  # the router's: the default
    fallbacks, evicted = dec.rt.hook.mask_fallbacks(), dec.rt.hook.mask_evicted()
    events = list(dec.generate("the quick brown fox jumps over the lazy dog", cfg))
    its = [e for e in events if isinstance(e, Iteration) and e.drafted]
    out[which] = {"config": next(e for e in events if isinstance(e, Started)).config["draft_experts"],
                  "masks": len(masks), "iterations": len(its),
                  "draft_misses": float(sum(e.draft_misses.sum() for e in its)),
                  "fallbacks": dec.rt.hook.mask_fallbacks() - fallbacks,
                  "refused": dec.rt.hook.mask_evicted() - evicted,
                  "tokens": [t for e in events if isinstance(e, Iteration) for t in e.committed]}
masks.clear()
fallbacks, evicted = dec.rt.hook.mask_fallbacks(), dec.rt.hook.mask_evicted()
events = list(dec.generate("the quick brown fox jumps over the lazy dog",
                           GenerationConfig(mode="tree", n_predict=24, utility=False, reuse_strength=0.0,
                                            stop_at_eos=False, draft_experts="resident")))
its = [e for e in events if isinstance(e, Iteration) and e.drafted]
out["tree"] = {"config": next(e for e in events if isinstance(e, Started)).config["draft_experts"],
               "masks": len(masks), "iterations": len(its),
               "draft_misses": float(sum(e.draft_misses.sum() for e in its)),
               "fallbacks": dec.rt.hook.mask_fallbacks() - fallbacks, "refused": dec.rt.hook.mask_evicted() - evicted,
               "tokens": [t for e in events if isinstance(e, Iteration) for t in e.committed]}
out["plain"] = list(dec.generate("the quick brown fox jumps over the lazy dog",
                                 GenerationConfig(mode="ar", n_predict=24, stop_at_eos=False)))[-1].tokens
print(json.dumps(out))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_under_a_budget_drafts_read_only_the_experts_in_memory(tmp_path):
    """Under an auto budget the draft passes read only experts in memory (where a layer has at least k_d of
    them): the routing hook asks about each candidate as its layer routes, so the native counter finds
    hardly any draft expert missing from memory. By default they read the router's choice, and fetch."""
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=3, n_expert=32, k=4, n_embd=128, n_ff=256, seed=2)
    )
    drop_file_cache(model)  # pages the writer left cached count against no budget: as run_in_budget does
    r = _run_under_budget(AUTO_RESIDENT_DRAFTS, model, tmp_path)
    res, router = r["resident"], r["router"]
    assert res["config"] == "resident" and router["config"] == "router"
    assert res["masks"] == res["iterations"] > 0 and router["masks"] == 0
    assert np.asarray(r["pinned"]).sum() == 3
    assert res["refused"] > 0 and router["refused"] == 0  # the budget keeps experts out of memory: a real restriction
    # Only a page evicted between the hook's question and the layer's matmuls is fetched: far fewer misses
    # than the router's drafts take.
    assert router["draft_misses"] > 20
    assert res["draft_misses"] <= res["fallbacks"] + router["draft_misses"] / 10
    tree = r["tree"]  # a tree's draft passes (several rows each) read from memory the same way
    assert tree["config"] == "resident" and tree["masks"] == tree["iterations"] > 0 and tree["refused"] > 0
    assert tree["draft_misses"] <= tree["fallbacks"] + router["draft_misses"] / 10
    # what the mask restricts is the drafts alone: every verification reads the router's experts, so the
    # committed tokens are plain decoding's whichever experts the drafts read
    assert len(r["plain"]) == 24 and res["tokens"] == router["tokens"] == tree["tokens"] == r["plain"]


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_the_native_library_is_built_before_a_budget_run_starts(tmp_path, monkeypatch, tiny_models):
    """A compiler run inside the budget's cgroup would leave its files' pages charged there, and an auto
    budget sized from what the cgroup holds would grow by them (measured: the router's drafts under the
    tiny model's auto budget missed 1–14 experts instead of 64–99). The child finds the library built."""
    import subprocess
    import sys

    from s2moe.engine.offload import run_in_budget

    monkeypatch.setenv("S2MOE_NATIVE_DIR", str(tmp_path / "native"))
    argv = [sys.executable, "-c", "import os, sys; print(sorted(os.listdir(sys.argv[1])))", str(tmp_path / "native")]
    with run_in_budget(
        argv, Budget(None), tiny_models["olmoe"], tag="test-build", stdout=subprocess.PIPE, text=True
    ) as run:
        out, _ = run.proc.communicate(timeout=60)
    assert run.proc.returncode == 0 and ".so'" in out and "libs2moe-" in out


AUTO_FETCH = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import Iteration
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=256, max_draft=8, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="s2moe", n_predict=8, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm,
                              pinning=offload.Pinning(fetch_workers=4, fetch_room_share=0.5))
cfg = GenerationConfig(mode="s2moe", n_predict=24, utility=False, reuse_strength=0.0, stop_at_eos=False,
                       draft_experts="router")
tokens = [t for e in dec.generate("the quick brown fox jumps over the lazy dog", cfg) if isinstance(e, Iteration)
          for t in e.committed]
plain_cfg = GenerationConfig(mode="ar", n_predict=24, stop_at_eos=False)
plain = [t for e in dec.generate("the quick brown fox jumps over the lazy dog", plain_cfg)
         if isinstance(e, Iteration) for t in e.committed]
print(json.dumps({"fetched": off.fetch_stats(), "same": tokens == plain}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_under_a_budget_reader_threads_fetch_for_verifications_and_change_no_token(tmp_path):
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=3, n_expert=32, k=4, n_embd=128, n_ff=256, seed=2)
    )
    drop_file_cache(model)
    r = _run_under_budget(AUTO_FETCH, model, tmp_path)
    assert r["same"]
    assert r["fetched"]["read"] + r["fetched"]["resident"] > 0 and r["fetched"]["bytes"] > 0


AUTO_LONG_PROMPT = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=1024, max_draft=8, use_extra_bufts=False)
tokens = [int(t) for t in (list(range(3, 200)) * 4)[:700]]
warm_prompt = tokens if LONG_WARM_UP else "hello"
warm = lambda: list(dec.generate(warm_prompt, GenerationConfig(mode="ar", n_predict=4, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
before = offload.process_anon_bytes()
list(dec.generate(tokens, GenerationConfig(mode="ar", n_predict=4, stop_at_eos=False)))
print(json.dumps({"grew": offload.process_anon_bytes() - before, "held": offload.process_anon_bytes(),
                  "counted": off.plan.anon_bytes, "compute": dec.rt.compute_buffer_bytes, "n_batch": dec.rt.n_batch}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_an_auto_budget_is_sized_with_the_largest_batch_a_prompt_will_run(tmp_path):
    """llama.cpp touches its compute buffers' pages only as batches that large run: sized after a short
    warm-up, a process grew by the difference at its first long prompt (the widened model's 617-token
    prompt: killed by the cgroup). The plan counts the buffers before they are touched: after a long
    prompt the process holds no more than the plan counted, although the prompt did grow it."""
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=2, n_expert=8, k=2, n_embd=256, n_ff=512, seed=3)
    )
    drop_file_cache(model)
    r = _run_under_budget(AUTO_LONG_PROMPT.replace("LONG_WARM_UP", "False"), model, tmp_path)
    assert r["n_batch"] >= 512 and r["grew"] > r["compute"] // 2  # the buffers were not touched before
    assert r["held"] <= r["counted"]
    # a warm-up that ran a full batch touched them: they are measured as held, not counted a second time
    (tmp_path / "long").mkdir()
    r = _run_under_budget(AUTO_LONG_PROMPT.replace("LONG_WARM_UP", "True"), model, tmp_path / "long")
    assert r["grew"] < 1 << 20 and r["counted"] < r["held"] + r["compute"] // 2


def test_a_budget_without_room_for_one_layers_experts_is_refused_with_the_least_size_that_has_it(tiny_models):
    """A budget that cannot hold the process, its pinned weights and one layer's k experts would have the
    cgroup kill the process at its first decode: refused, naming the least budget accepted (as printed: never
    a hair below it), and the one that keeps the slack free besides. The least once named one with the slack,
    and a budget below that was accepted all the same."""
    emap = expert_map(tiny_models["olmoe"])
    one_layer = int(4 * emap.expert_bytes.max())
    kw = dict(anon_bytes=200 << 20, base_bytes=10 << 20, emap=emap, k=4)
    tight = plan_budget(210 << 20, **kw)
    with pytest.raises(ConfigError, match=r"leaves .* for experts .* give at least") as e:
        tight.check_room(one_layer)
    named = re.search(r"give at least (\S+ \S+) \((\S+ \S+) keeps", str(e.value))
    least, roomy = (parse_size(named.group(i).replace(" ", "")) for i in (1, 2))
    plan_budget(least, **kw).check_room(one_layer)
    with pytest.raises(ConfigError):
        plan_budget(least - (100 << 10), **kw).check_room(one_layer)  # one step of the printed size below it
    with pytest.raises(ConfigError):
        plan_budget((200 << 20) + (10 << 20) + one_layer - 1, **kw).check_room(one_layer)
    kept = plan_budget(roomy, **kw)
    assert kept.cache_bytes + kept.hot_bytes >= one_layer  # with the slack kept


@pytest.mark.parametrize("n", [1023.96 * 1024, 45.04 * (1 << 20), 45 << 20, 1.01 * (1 << 30), 4095])
def test_a_size_printed_rounded_up_is_never_less(n):
    assert parse_size(fmt_bytes(n, round_up=True).replace(" ", "")) >= int(n)


AUTO_BATCH = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=1024, max_draft=8, use_extra_bufts=False, n_batch=int(sys.argv[2]))
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="ar", n_predict=4, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
tokens = [int(t) for t in (list(range(3, 200)) * 4)[:700]]
out = [t for e in dec.generate(tokens, GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False))
       for t in getattr(e, "committed", ())]
print(json.dumps({"budget": off.budget_bytes, "n_batch": dec.rt.n_batch, "tokens": out}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_a_smaller_batch_needs_a_smaller_budget_and_decodes_the_same(tmp_path):
    """-b: llama.cpp's compute buffers are sized for one batch, and a budget counts them; a long prompt is
    prefilled in more, smaller chunks, to the same tokens."""
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=2, n_expert=8, k=2, n_embd=256, n_ff=512, seed=3)
    )
    runs = {}
    for n_batch in (512, 32):
        drop_file_cache(model)
        script = AUTO_BATCH.replace("int(sys.argv[2])", str(n_batch))
        runs[n_batch] = _run_under_budget(script, model, tmp_path)
    assert runs[512]["n_batch"] == 512 and runs[32]["n_batch"] == 32
    assert runs[32]["budget"] < runs[512]["budget"] - (4 << 20)
    assert runs[32]["tokens"] == runs[512]["tokens"] and len(runs[32]["tokens"]) == 8


def test_a_batch_room_halves_the_batch_until_llama_s_compute_buffers_fit(tmp_path):
    """llama.cpp sizes its compute buffers for one batch (here ~24 MiB at 512 tokens, a wide expert FFN): with
    room for fewer bytes the runtime halves the batch until they fit, down to 32 tokens, and reports them."""
    from s2moe.engine.decoding.runtime import LlamaRuntime
    from s2moe.engine.model_info import read_model_info

    model = write_tiny(tmp_path / "wide.gguf", TinySpec(arch="olmoe", n_layer=1, n_expert=4, k=4, n_ff=1024, seed=1))
    info = read_model_info(model)

    def made(**kw):
        rt = LlamaRuntime(info, n_ctx=512, n_batch=512, n_threads=1, max_verify_rows=9, **kw)
        rt.close()
        return rt.n_batch, rt.compute_buffer_bytes

    full, at_64 = made(), made(batch_room=4 << 20)
    assert full[0] == 512 and full[1] > 16 << 20
    assert at_64[0] == 64 and 0 < at_64[1] <= 4 << 20 and at_64[1] < full[1] / 4
    assert made(batch_room=1)[0] == 32  # the floor: a room no batch fits still decodes


FIXED_BATCH = """
import json, sys
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.offload.budget import prefill_batch_room
chosen = Decoder(sys.argv[1], n_threads=1, n_ctx=1024, max_draft=8, use_extra_bufts=False)
asked = Decoder(sys.argv[1], n_threads=1, n_ctx=1024, max_draft=8, use_extra_bufts=False, n_batch=512)
print(json.dumps({"room": prefill_batch_room(), "chosen": [chosen.rt.n_batch, chosen.rt.compute_buffer_bytes],
                  "asked": [asked.rt.n_batch, asked.rt.compute_buffer_bytes]}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_inside_a_budget_of_a_given_size_llama_s_batch_fits_an_eighth_of_it(tmp_path):
    """Without -b, a process inside a budget of a given size takes the largest batch whose compute buffers
    fit an eighth of the budget (the rest stays for experts); -b is taken as given, and under auto, which
    is sized around the process, llama.cpp's 512 stays."""
    import subprocess
    import sys

    model = write_tiny(tmp_path / "wide.gguf", TinySpec(arch="olmoe", n_layer=1, n_expert=4, k=4, n_ff=4096, seed=1))
    script = tmp_path / "script.py"
    script.write_text(FIXED_BATCH)
    out = {}
    for budget in (300 << 20, None):
        cg = MemoryCgroup.create(1 << 30 if budget is None else budget, "test-batch")
        try:
            proc = cg.popen(
                [sys.executable, str(script), str(model)],
                "auto" if budget is None else str(budget),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            cg.remove()
        assert proc.returncode == 0, stderr[-2000:]
        out[budget] = json.loads(stdout.strip().splitlines()[-1])
    fixed = out[300 << 20]
    assert fixed["room"] == (300 << 20) // 8
    assert fixed["asked"][0] == 512 and fixed["asked"][1] > fixed["room"]
    assert 32 <= fixed["chosen"][0] < 512 and fixed["chosen"][1] <= fixed["room"]
    assert out[None]["room"] is None and out[None]["chosen"][0] == 512


AUTO_MEMORY_GATING = """
import json, sys
import numpy as np
from s2moe.engine import offload
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import Iteration
dec = Decoder(sys.argv[1], n_threads=1, n_ctx=256, max_draft=8, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="ar", n_predict=8, stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
out = {0.3: [0, 0.0, 0], 0.0: [0, 0.0, 0]}
for memory in (0.0, 0.3, 0.0, 0.3):
    # a threshold no draft reaches: plain steps, one row each
    cfg = GenerationConfig(mode="s2moe", n_predict=32, threshold=1e9, lookup=False, stop_at_eos=False,
                           memory_strength=memory)
    for e in dec.generate("the quick brown fox jumps over the lazy dog", cfg):
        if isinstance(e, Iteration) and not e.drafted and e.verify_misses is not None:
            out[memory][0] += 1
            out[memory][1] += float(np.sum(e.verify_misses))
            out[memory][2] += e.gated_moves
from s2moe.engine.measure.quality_checks import gating_quality, memory_gating_quality
texts = ["the quick brown fox jumps over the lazy dog and the cat", "hello there world"]
quality = {a: memory_gating_quality(dec, texts, a) for a in (0.3, 0.0)}
batches = {a: gating_quality(dec, texts, 0.5, 8, window=4, memory=a) for a in (0.3, 0.0)}
print(json.dumps({"on": out[0.3], "off": out[0.0], "quality": quality[0.3], "quality_off": quality[0.0],
                  "batches": batches[0.3], "batches_off": batches[0.0]}))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_under_a_budget_memory_gating_moves_plain_steps_onto_experts_in_memory(tmp_path):
    """Under a budget s2moe's gating also acts on a plain step's one row: borderline choices move onto experts
    in memory (the prefetcher asked as each layer routes), and fewer of the experts read are fetched."""
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=3, n_expert=32, k=4, n_embd=128, n_ff=256, seed=2)
    )
    r = _run_under_budget(AUTO_MEMORY_GATING, model, tmp_path)
    (steps_on, misses_on, moves_on), (steps_off, misses_off, moves_off) = r["on"], r["off"]
    assert steps_on > 20 and steps_off > 20
    assert moves_off == 0 and moves_on > 0
    assert misses_on / steps_on < 0.8 * misses_off / steps_off
    # bench's teacher-forced check of the same, one token a step under the budget: moved choices change the
    # distributions; with strength 0 the gated pass is the plain one
    q, q0 = r["quality"], r["quality_off"]
    assert q["tokens"] > 10 and np.isfinite(q["ppl_ratio"]) and 0 < q["top1_agreement"] <= 1 and q["mean_kl"] > 0
    assert q0["tokens"] == q["tokens"] and q0["ppl_ratio"] == 1.0 and q0["mean_kl"] == 0.0
    # the batch check with both biases: the memory bias moves choices reuse gating alone leaves
    b, b0 = r["batches"], r["batches_off"]
    assert b["tokens"] == b0["tokens"] > 10 and b["memory"] == 0.3 and b0["memory"] == 0.0
    assert b["mean_kl"] != b0["mean_kl"]


AUTO_TUNE = """
import json, sys
from s2moe.engine import offload
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import CostConstants
from s2moe.engine.measure.tune import (TuneDone, TuneJointQuality, TuneMeasured, TuneMemoryQuality, TuneQuality,
                                       TuneStarted, run_tune)

class IterationClock:  # as tests/test_tune.py's: a run's time is its iteration count
    t = 0.0
    def now(self):
        self.t += 1.0
        return self.t

dec = Decoder(sys.argv[1], n_threads=1, n_ctx=512, max_draft=16, use_extra_bufts=False)
warm = lambda: list(dec.generate("hello", GenerationConfig(mode="s2moe", utility=False, draft_max=16, n_predict=8,
                                                           stop_at_eos=False)))
off = offload.offload_decoder(dec, offload.Budget(None), [], warm_up=warm)
cost = CostConstants(t_ar=0.01, c_draft=0.0005, t_exp=1e-6, t_tok=1e-5, intercept=0.0, source="test")
out = {"knows_memory": dec.knows_memory, "checked": [], "measured": [], "pairs": [], "joint": []}
for ev in run_tune(dec, load_prompts("natural", 12)[1], cost=cost, n_tokens=16, time_budget_s=3000,
                   clock=IterationClock()):
    if isinstance(ev, TuneStarted):
        out["space"] = list(ev.space["memory_strength"])
        out["defaults"] = ev.defaults.memory_strength
    elif isinstance(ev, TuneMemoryQuality):
        out["checked"].append([ev.memory_strength, ev.ok, ev.figures.tokens, ev.figures.ppl_ratio,
                               ev.figures.top1_agreement])
    elif isinstance(ev, TuneQuality):
        out["pairs"].append([ev.reuse_strength, ev.reuse_cap, ev.ok])
    elif isinstance(ev, TuneJointQuality):
        out["joint"].append([ev.reuse_strength, ev.reuse_cap, ev.memory_strength, ev.ok, ev.figures.tokens,
                             ev.figures.ppl_ratio, ev.figures.top1_agreement])
    elif isinstance(ev, TuneMeasured):
        out["measured"].append([ev.settings.reuse_strength, ev.settings.reuse_cap, ev.settings.memory])
    elif isinstance(ev, TuneDone):
        out["section"] = ev.section
print(json.dumps(out))
"""


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_under_a_budget_tune_searches_the_memory_strength_within_its_quality_check(tmp_path):
    """Under a budget `s2moe tune` also searches α_m: each strength is checked teacher-forced one token a step in
    the budget's process before any speed is measured, and a strength that fails the check is never timed."""
    model = write_tiny(
        tmp_path / "wide.gguf", TinySpec(arch="qwen3moe", n_layer=3, n_expert=32, k=4, n_embd=128, n_ff=256, seed=2)
    )
    r = _run_under_budget(AUTO_TUNE, model, tmp_path)
    assert r["knows_memory"] and r["space"] == [0.0, 0.15, 0.3, 0.5] and r["defaults"] == 0.3
    checked = {strength: (ok, tokens, ppl, top1) for strength, ok, tokens, ppl, top1 in r["checked"]}
    assert sorted(checked) == [0.15, 0.3, 0.5]  # each strength the pool holds, once; 0 needs no check
    assert all(tokens > 50 for _, tokens, _, _ in checked.values())
    for ok, _, ppl, top1 in checked.values():
        assert ok == (ppl <= 1.02 and top1 >= 0.9)
    # both biases together, on batches in the same process: every pair and strength that passed alone, once
    pairs_ok = {(a, c) for a, c, ok in r["pairs"] if ok}
    joint = {(a, c, m): (ok, tokens, ppl, top1) for a, c, m, ok, tokens, ppl, top1 in r["joint"]}
    assert len(joint) == len(r["joint"]) and joint
    assert all((a, c) in pairs_ok and checked[m][0] for a, c, m in joint)
    for ok, tokens, ppl, top1 in joint.values():
        assert tokens > 50 and ok == (ppl <= 1.02 and top1 >= 0.9)
    section = r["section"]
    defaults = section["defaults"]

    def is_defaults(a, c, m):
        return (a, c, m) == (defaults["reuse_strength"], defaults["reuse_cap"], defaults["memory_strength"])

    for alpha, cap, memory in r["measured"]:
        assert memory == 0 or checked[memory][0] or is_defaults(alpha, cap, memory)
        assert alpha == 0 or memory == 0 or joint[(alpha, cap, memory)][0] or is_defaults(alpha, cap, memory)
    assert [e["memory_strength"] for e in section["memory_quality_checked"]] == [0.15, 0.3, 0.5]
    assert len(section["joint_quality_checked"]) == len(joint)
    tuned = section["settings"]
    if tuned["reuse_strength"] > 0 and tuned["memory_strength"] > 0:
        assert section["quality"]["memory"]["memory_strength"] == tuned["memory_strength"]
        assert section["quality"]["both"]["memory_strength"] == tuned["memory_strength"]
        key = (tuned["reuse_strength"], tuned["reuse_cap"], tuned["memory_strength"])
        assert (checked[tuned["memory_strength"]][0] and joint[key][0]) or not section["constraint"]["defaults_meet_it"]


def test_an_auto_budget_is_fitted_to_the_memory_available(monkeypatch):
    """On a device smaller than a third of the file's experts, auto takes what the machine has (less what
    the rest keeps), out of the expert room; where everything fits it is left alone."""
    from s2moe.engine.offload import budget

    gib = 1 << 30
    monkeypatch.setattr(budget, "meminfo", lambda: {"MemTotal": 8 * gib, "MemAvailable": 6 * gib})
    keep = max(budget.AUTO_KEEP_FREE, 8 * gib // 20)
    # the process holds 1.5 GiB anonymous; a third of a 17 GB file's experts is ~5.3 GiB
    size, room, seen = budget.fit_to_available(9 * gib, int(5.3 * gib), int(1.5 * gib))
    assert seen == 6 * gib and size == 6 * gib + int(1.5 * gib) - keep
    assert room == int(5.3 * gib) - (9 * gib - size)
    assert budget.fit_to_available(4 * gib, gib, gib) == (4 * gib, gib, None)
    monkeypatch.setattr(budget, "meminfo", lambda: {"MemTotal": 8 * gib})  # no MemAvailable (old kernels)
    assert budget.fit_to_available(70 * gib, gib, 0) == (70 * gib, gib, None)


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_an_auto_budget_with_no_room_for_a_layer_s_experts_says_so(tiny_models, tmp_path):
    script = AUTO_ON_A_FAKED_MACHINE.replace("MEMINFO", '{"MemTotal": 64 << 30, "MemAvailable": 1 << 20}')
    error = _run_under_budget(script, tiny_models["olmoe"], tmp_path)["error"]
    assert error and "\n" not in error
    assert re.match(
        r"an auto budget does not fit here: the memory available \(1.0 MiB\) holds what this process "
        r"needs but not [\d.]+ [KM]iB of experts beside it",
        error,
    ), error


def test_the_non_expert_weights_are_asked_for_before_a_first_decode(tiny_models, tmp_path):
    """Out of the page cache, the tensors every step reads come back in on one request (no decode needed)."""
    import shutil
    import time

    from s2moe.engine.offload import ModelMapping, drop_file_cache, expert_map

    model = shutil.copy(tiny_models["olmoe"], tmp_path / "m.gguf")
    emap = expert_map(model)
    mapping = ModelMapping(emap)
    try:
        drop_file_cache(model)
        spans = [(o, n) for o, n in emap.pinnable() if n > 0]
        assert min(mapping.range_resident(o, n) for o, n in spans) < 1.0  # dropped: the test can fail
        assert mapping.willneed_non_expert() >= sum(n for _, n in spans)
        deadline = time.monotonic() + 5
        while min(mapping.range_resident(o, n) for o, n in spans) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert min(mapping.range_resident(o, n) for o, n in spans) == 1.0
    finally:
        mapping.close()


def _page_span_bytes(em, layer: int, e: int) -> int:
    """An expert's bytes as a read brings them in: its parts' whole pages."""
    total = 0
    for off, length in em.ranges[layer, e]:
        if length > 0:
            total += -(-(int(off) + int(length)) // PAGE) * PAGE - int(off) // PAGE * PAGE
    return total


def test_a_wrong_pregate_guess_is_read_for_nothing_and_the_first_expert_the_kept_cache_evicts(wide_model):
    """Pre-gating reads the experts a later layer's router predicts for it, those not in memory only. When that
    layer routes, those it reads count as used and the others as read for nothing; these enter the kept cache at
    its least recent end, so that they leave memory before any expert a layer did read."""
    with _cold_prefetcher(wide_model, advise=True) as (em, m, pf):
        llama = ModelMapping(em)
        try:
            one = int(em.expert_bytes[0])
            pf.keep_cache(llama.addr, 0, llama.size, 3 * one, np.zeros((2, 8), np.uint8))

            def resident():
                return m.expert_residency() >= 1.0

            pf.layer(0, [1, 2])
            assert pf.predicted(0, [2, 3]) == 1  # (0, 2) is held: only (0, 3) is read
            assert pf.predicted(1, [5, 6]) == 2
            assert pf.predicted(1, [6, 5]) == 0  # asked for already
            assert _wait_for(lambda: resident()[1, [5, 6]].all() and resident()[0, 3])
            pf.layer(1, [5, 7])  # (1, 5) used, (1, 6) read for nothing
            assert pf.pregate_stats() == {
                "read": 3,
                "read_bytes": sum(_page_span_bytes(em, *x) for x in [(0, 3), (1, 5), (1, 6)]),
                "used": 1,
                "used_bytes": _page_span_bytes(em, 1, 5),
                "wasted": 1,
                "wasted_bytes": _page_span_bytes(em, 1, 6),
            }
            # held: (1, 7), (1, 5), (0, 2), (0, 1) and, last, (1, 6): the two least recent leave
            assert pf.cache_stats()["held"] == 3 * one and pf.cache_stats()["evicted"] == 2
            assert not resident()[1, 6] and not resident()[0, 1]
            assert _wait_for(lambda: resident()[1, [5, 7]].all() and resident()[0, 2])
            pf.layer(0, [3])  # its layer routes it: used, though read before its layer's previous routing
            assert pf.pregate_stats()["used"] == 2 and pf.pregate_stats()["wasted"] == 1
        finally:
            llama.close()


def test_pregating_changes_no_token_and_says_what_it_predicted(tiny_models):
    """Pre-gating only reads ahead: a generation decodes the same tokens with it, and the offloader's line
    says its recall and what it read. It reads at most the experts a layer routes to."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import Finished
    from s2moe.engine.offload import Pinning, offload_decoder

    cfg = GenerationConfig(mode="ar", n_predict=12, stop_at_eos=False)
    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1, use_extra_bufts=False)
    try:
        plain = [e for e in run(d, "hello there", cfg) if isinstance(e, Finished)][0].tokens
        with pytest.raises(ConfigError, match="at most the 4 experts"):
            offload_decoder(d, None, pinning=Pinning(base=False, hot=False, pregate=2, pregate_width=5))
        off = offload_decoder(d, None, pinning=Pinning(base=False, hot=False, pregate=2, pregate_width=3))
        try:
            pregated = [e for e in run(d, "hello there", cfg) if isinstance(e, Finished)][0].tokens
            stats = d.rt.hook.pregate_stats()
            text = off.pregate_text()
        finally:
            off.close()
        assert d.rt.hook.pregate_depth == 0  # an offloader's pre-gating ends with it
    finally:
        d.close()
    assert pregated == plain
    assert (
        stats.decodes == cfg.n_predict and stats.total[1] > 0 and stats.total[2] > 0
    )  # the prompt's last token, then each generated one but the last
    assert text.startswith("pre-gating 2 layers ahead, the best 3 of 4 read: recall 1 ahead ") and ", 2 ahead " in text
    assert "a token" in text
