"""engine.measure.speed: when a difference in speed is noise, and when the machine was too busy to tell."""

from __future__ import annotations

import os

import pytest
from s2moe.engine.measure.speed import Load, LoadWatch, compare, judge, outliers, separated


def test_separated_needs_a_consistent_difference():
    assert not separated([0.1, 0.2])  # too few pairs
    assert not separated([0.3, -0.3, 0.25, -0.2])  # differences either way
    assert separated([0.2, 0.25, 0.22, 0.18])
    assert not separated([0.0, 0.0, 0.0])


def test_a_difference_inside_the_run_to_run_spread_is_not_significant():
    # the case: 0.99× ar with repeats from 0.92 to 1.21
    c = compare("s2moe", "ar", [0.92, 1.21, 0.99, 0.95, 1.02])
    assert not c.significant and c.low < 1 < c.high
    assert c.outcome.startswith("not significant")
    assert c.text().startswith("s2moe 1.01 ± 0.10× ar (5 paired runs): not significant")


def test_a_consistent_loss_is_called_slower_and_a_gain_faster():
    slower = compare("naive", "ar", [0.80, 0.82, 0.79, 0.81])
    assert slower.significant and slower.high < 1 and slower.outcome == "slower"
    faster = compare("s2moe", "ar", [1.30, 1.32, 1.29, 1.31])
    assert faster.significant and faster.low > 1 and faster.outcome == "faster"


def test_too_few_pairs_are_never_significant_and_say_so():
    c = compare("s2moe", "ar", [1.5, 1.6])
    assert not c.significant and "too few paired runs (2)" in c.outcome and c.ratio_text == "1.55×"


def test_outliers_are_runs_far_from_the_others():
    assert outliers([100, 101, 99, 100, 102, 98, 101]) == 0
    assert outliers([100, 101, 99, 100, 102, 98, 27]) == 1
    assert outliers([100, 27]) == 0  # two runs: no way to tell which one is off


def test_the_verdict_names_the_fastest_and_each_mode_against_plain_decoding():
    runs = {
        "ar": [100, 101, 99, 100],
        "s2moe": [130, 128, 131, 133],
        "naive": [80, 81, 79, 82],
        "lookup": [99, 104, 97, 101],
    }
    j = judge(runs, "ar")
    assert j.fastest == "s2moe"
    assert j.get("naive").outcome == "slower" and j.get("s2moe").outcome == "faster"
    assert j.get("lookup").outcome.startswith("not significant")
    lines = j.lines()
    assert lines[0].startswith("fastest: s2moe — 1.30 ± 0.03× ar; ") and "× lookup" in lines[0]
    assert any(line.startswith("naive 0.80 ± 0.01× ar") and line.endswith("slower") for line in lines)
    assert not any(line.startswith("s2moe ") for line in lines)  # said in the fastest line already
    assert j.warning is None and not any(line.startswith("warning:") for line in lines)


def test_plain_decoding_can_be_the_fastest():
    j = judge({"ar": [100, 101, 99], "naive": [80, 81, 79]}, "ar")
    assert j.fastest == "ar" and j.lines()[0].startswith("fastest: ar — 1.25 ± 0.00× naive")
    assert j.lines()[1].startswith("naive 0.80 ± 0.00× ar (3 paired runs): slower")


def test_runs_that_did_not_happen_are_left_out_of_the_pairs():
    j = judge({"ar": [100, 100, 100, 100], "tuned": [None, 120, 121, 119]}, "ar")
    assert j.get("tuned").n == 3


def test_a_busy_machine_or_outlying_runs_are_warned_about():
    busy = Load(cpus=4, load_at_start=0.2, other_cpus=1.5, busiest=[("cc1", 1.2), ("make", 0.3)], seconds=10)
    j = judge({"ar": [100, 101, 99, 100], "s2moe": [130, 128, 131, 133]}, "ar", busy)
    assert "other processes used 1.5 of 4 CPUs (cc1 1.2, make 0.3)" in j.warning
    assert j.lines()[-1].startswith("warning: other processes used")
    # the load average alone decides only where other processes' CPU time could not be read: it lags by a
    # minute, and a run that has just ended (the last bench) raises it without competing for the CPUs
    assert not Load(cpus=2, load_at_start=1.5, other_cpus=0.0).busy
    unread = Load(cpus=2, load_at_start=1.5, other_cpus=None)
    assert unread.busy and unread.words() == "the load average was 1.5 on 2 CPUs when it began"
    assert not Load(cpus=2, load_at_start=0.5, other_cpus=None).busy
    assert not Load(cpus=4, load_at_start=0.3, other_cpus=0.1).busy
    # the back-to-back runs: one ar run far from the rest
    j = judge({"ar": [1317, 1320, 1310, 362, 1315], "s2moe": [1400, 1390, 1410, 400, 1405]}, "ar")
    assert "1 of 5 ar runs lie far from the others" in j.warning
    assert Load.from_dict(busy.as_dict()) == busy


def _fake_proc(root, processes: dict[int, tuple[str, int, int, int]], load: float) -> None:
    """A proc folder of the shape LoadWatch reads: pid → (command, parent, CPU ticks, start time)."""
    (root / "loadavg").write_text(f"{load:.2f} 0.50 0.40 1/200 12345\n")
    for pid, (command, parent, ticks, started) in processes.items():
        d = root / str(pid)
        d.mkdir(exist_ok=True)
        rest = ["S", str(parent)] + ["0"] * 9 + [str(ticks), "0"] + ["0"] * 6 + [str(started)] + ["0"] * 20
        (d / "stat").write_text(f"{pid} ({command}) " + " ".join(rest) + "\n")


def test_the_watch_counts_other_processes_cpu_time_but_not_this_one_s_or_its_children(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    clock = iter([0.0, 2.0])
    before = {
        me: ("python", 1, 0, 5),
        me + 1: ("child worker", me, 0, 6),
        4242: ("cc1 (x)", 1, 10, 7),
        4343: ("kworker/0:1-events", 2, 0, 8),
        4444: ("reused", 1, 500, 9),
    }
    _fake_proc(tmp_path, before, 3.0)
    watch = LoadWatch(tmp_path, clock=lambda: next(clock))
    after = {
        me: ("python", 1, 10 * hz, 5),
        me + 1: ("child worker", me, 10 * hz, 6),
        4242: ("cc1 (x)", 1, 10 + 2 * hz, 7),  # a whole CPU for the two seconds
        4343: ("kworker/0:1-other", 2, hz // 2, 8),  # renamed itself: the same thread still
        4444: ("reused", 1, hz // 2, 99),
    }  # a new process under an old pid
    _fake_proc(tmp_path, after, 3.0)
    load = watch.stop()
    assert load.seconds == 2.0 and load.load_at_start == 3.0
    assert load.other_cpus == pytest.approx(1.0 + 0.25 + 0.25, abs=0.01)
    assert load.busiest[0] == ("cc1 (x)", 1.0)
    assert load.busy


def test_the_watch_on_this_machine_gives_a_figure():
    load = LoadWatch().stop()
    assert load.cpus >= 1 and load.other_cpus is None or load.other_cpus >= 0
