"""SVG snapshots of every screen at 80×24 and 120×40 (pytest-textual-snapshot).

Deterministic by construction: a scripted decoder instead of a model, engine events injected with fixed
timestamps, scripted calibration and bench runs, a profile folder written by the test. Update after an
intended UI change with `pytest tests/test_app_snapshots.py --snapshot-update` and review the SVGs.
"""

from __future__ import annotations

import pytest
from s2moe.app.tui.app import S2MoEApp
from s2moe.app.tui.messages import EngineEvent, JobEnded
from s2moe.app.tui.segments import view_of
from test_app_support import FakeDecoder, fake_run_bench, fake_run_calibration, only_test_profiles, scripted_events

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((120, 40), id="120x40")]
SMALL = pytest.param((60, 20), id="60x20")  # the smallest terminal the layout is meant to work in


@pytest.fixture(autouse=True)
def fixed_profile_folders(tmp_path, monkeypatch):
    """Profiles come only from a folder this test writes (no user or shipped profiles leak in)."""
    only_test_profiles(tmp_path, monkeypatch)
    packaged = [
        {
            "name": "olmoe-64x8",
            "path": "olmoe-64x8.gguf",
            "arch": "olmoe",
            "n_expert": 64,
            "k": 8,
            "size_bytes": 21_900_000,
        }
    ]
    monkeypatch.setattr("s2moe.app.tui.dialogs.packaged_models", lambda: packaged)
    # the engine will grow more modes; the snapshots keep a fixed list
    for where in (
        "s2moe.app.tui.bench.engine_modes",
        "s2moe.app.tui.chat.engine_modes",
        "s2moe.app.tui.state.engine_modes",
    ):
        monkeypatch.setattr(where, lambda: ("ar", "s2moe", "conf"))
    monkeypatch.setattr("s2moe.engine.measure.bench.ABLATION", {})


@pytest.fixture(autouse=True)
def scripted_engine_runs(monkeypatch):
    """Calibration and bench yield fixed numbers instead of measuring this machine."""
    monkeypatch.setattr("s2moe.engine.measure.bench.run_bench", fake_run_bench)
    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", fake_run_calibration())


def make_app(**kw) -> S2MoEApp:
    return S2MoEApp("fake-moe.gguf", decoder_factory=lambda path: FakeDecoder(path), **kw)


async def ready(pilot) -> None:
    app = pilot.app
    for _ in range(500):
        if app.session.model is not None:
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def settle(pilot) -> None:
    """No toasts, no blinking cursors, no animation in flight: the same picture every time."""
    from textual.widgets import Input, TextArea

    app = pilot.app
    # focus moves first: a cursor stops blinking visible only in the widget that holds the focus by then
    await pilot.pause()
    for screen in app.screen_stack:
        for widget in list(screen.query(Input)) + list(screen.query(TextArea)):
            widget.cursor_blink = False
        # a TextArea's line cache keys the cursor only while it blinks: a line cached in the blink's off phase
        # would be drawn again without the cursor (seen under load); a style update empties that cache
        for area in screen.query(TextArea):
            area.notify_style_update()
            area.refresh()
    app.clear_notifications()
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def feed_generation(chat, prompt: str, mode: str = "s2moe") -> None:
    """Play a scripted generation into the chat with fixed timestamps (no worker, no clock)."""
    decoder = FakeDecoder()
    chat.begin_turn(prompt)
    for i, event in enumerate(scripted_events(mode)):
        chat.on_engine_event(EngineEvent(chat._turn_index, event, view_of(event, decoder), 1.0 + 0.05 * i))
    chat.on_job_ended(JobEnded("generate"))
    chat.flush()


@pytest.mark.parametrize("size", SIZES)
def test_chat_before_generation(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES + [SMALL])
def test_chat_after_generation(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        chat = pilot.app.screen
        feed_generation(chat, "The cat")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


def feed_residency(chat) -> None:
    """A residency snapshot as an offloading decoder sends one: a quarter of each layer's experts in memory
    plus the pinned first expert, and the draft-predicted hit rate per layer."""
    import numpy as np
    from s2moe.engine.events import ResidencySnapshot

    shape = (4, 8)
    resident = np.full(shape, 0.25)
    resident[:, 0] = 1.0
    pinned = np.zeros(shape, bool)
    pinned[:, 0] = True
    snap = ResidencySnapshot(5, resident, pinned, np.array([0.5, 0.75, float("nan"), 1.0]))
    chat.on_engine_event(EngineEvent(chat._turn_index, snap, None, 2.0))
    chat.live.state.budget = "budget 1.5 GiB"
    chat.flush()


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24"), SMALL])
def test_live_tiles_with_a_budget_and_an_ar_reference(snap_compare, size):
    """Every figure at once: tok/s against an ar run, accept length, rollbacks, reuse and memory per layer,
    utility against its threshold."""

    async def run_before(pilot):
        await ready(pilot)
        chat = pilot.app.screen
        feed_generation(chat, "plain", mode="ar")
        pilot.app.session.stats.ar_tok_per_s = 20.0
        feed_generation(chat, "The cat")
        feed_residency(chat)
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


def as_tree(event):
    """A scripted chain step as the tree modes report it: the accepted drafts a path from the pending token,
    the rejected ones a branch of their own beside it."""
    from dataclasses import replace

    from s2moe.engine.events import Iteration

    if not isinstance(event, Iteration):
        return event
    n, m = len(event.accepted), len(event.rejected)
    parents = tuple(range(-1, n - 1)) + tuple([-1] + list(range(n, n + m - 1)))[:m]
    return replace(event, tree_parents=parents, accepted_path=tuple(range(n)))


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24")])
def test_live_panel_draws_the_draft_tree(snap_compare, size):
    """A tree mode: the tree of the last iteration under the tiles, its accepted path on the first line."""
    from dataclasses import replace

    async def run_before(pilot):
        await ready(pilot)
        chat = pilot.app.screen
        decoder = FakeDecoder()
        chat.begin_turn("The cat")
        events = [as_tree(e) for e in scripted_events("tree")]
        # the last step drafted " warm and soft" (all accepted), " ran away" beside " soft", " dog" beside it all
        events[-2] = replace(
            events[-2],
            drafted=(9, 10, 11, 13, 14, 12),
            rejected=(13, 14, 12),
            rollback=3,
            tree_parents=(-1, 0, 1, 1, 3, -1),
            accepted_path=(0, 1, 2),
        )
        for i, event in enumerate(events):
            chat.on_engine_event(EngineEvent(chat._turn_index, event, view_of(event, decoder), 1.0 + 0.05 * i))
        chat.on_job_ended(JobEnded("generate"))
        chat.flush()
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


def test_live_plots_full_screen(snap_compare):
    async def run_before(pilot):
        await ready(pilot)
        chat = pilot.app.screen
        pilot.app.session.stats.ar_tok_per_s = 20.0
        feed_generation(chat, "The cat")
        feed_residency(chat)
        await pilot.press("ctrl+g")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run_before)


def test_chat_light_theme(snap_compare):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f12")
        feed_generation(pilot.app.screen, "The cat")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=(100, 30), run_before=run_before)


@pytest.mark.parametrize("size", SIZES + [SMALL])
def test_calibrate_wizard_done(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f3")
        screen = pilot.app.screen
        screen.query_one("#cal-name").value = "my-box"
        await pilot.press("ctrl+r")
        for _ in range(500):
            if screen.result is not None and not screen.running:
                break
            await pilot.pause(0.01)
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES + [SMALL])
def test_profiles(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f4")
        screen = pilot.app.screen
        names = [e.name for e in screen.entries]
        screen.query_one("#prof-table").move_cursor(row=names.index("test-cpu"))
        await pilot.press("enter")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES + [SMALL])
def test_bench_done(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f5")
        screen = pilot.app.screen
        await pilot.press("ctrl+r")
        for _ in range(500):
            if screen.done is not None and not screen.running:
                break
            await pilot.pause(0.01)
        # the picture is of the prompts being edited, wherever the run's end left the focus
        screen.query_one("#bench-prompts").focus()
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24"), SMALL])
def test_settings_dialog_sampling_options(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("ctrl+o")
        dialog = pilot.app.screen
        dialog.query_one("#sample-temperature").value = "0.8"
        dialog.query_one("#sample-seed").value = "-1"
        dialog.query_one("#sample-top_p").focus()  # scrolled to the sampler's fields
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_help(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f1")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_no_model_dialog(snap_compare, size):
    async def run_before(pilot):
        await settle(pilot)

    assert snap_compare(S2MoEApp(None), terminal_size=size, run_before=run_before)


def device_samples():
    """Readings of a Jetson Orin under a 1.5 GiB budget, as engine.measure.device would take them."""
    from s2moe.engine.measure.device import DeviceSample, parse_tegrastats

    gib = 1 << 30
    memory = {
        "MemTotal": 30 * gib,
        "MemAvailable": 12 * gib,
        "Cached": 9 * gib,
        "SwapTotal": 15 * gib,
        "SwapFree": 14 * gib,
    }
    jetson = parse_tegrastats(
        "GR3D_FREQ 37%@[305,305] CPU@46.6C GPU@41.5C tj@46.7C VDD_GPU_SOC 2400mW/2300mW VDD_CPU_CV 400mW/400mW"
    )
    cgroup = {
        "total": int(1.4 * gib),
        "limit": int(1.5 * gib),
        "anon": int(0.3 * gib),
        "file": int(1.0 * gib),
        "locked": int(0.1 * gib),
    }
    process = {"VmRSS": int(1.2 * gib), "RssAnon": int(0.4 * gib), "RssFile": int(0.8 * gib), "VmSwap": 0}
    return [
        DeviceSample(
            float(i),
            memory,
            [((i + c) % 10) / 10 for c in range(12)] if i else [],
            None if i == 0 else 1e6 * (40 + 20 * (i % 3)),
            "nvme0n1",
            None if i == 0 else 1e6 * (50 + 30 * (i % 4)),
            (int(8.1 * gib), 13 * gib),
            cgroup,
            dict(jetson, gpu_load=20 + 9 * i),
            process,
        )
        for i in range(8)
    ]


def plain_pc_samples():
    """Readings of a PC with no Jetson: no GPU, temperature or power source."""
    from dataclasses import replace

    return [replace(s, jetson=None, cgroup=None) for s in device_samples()]


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24"), SMALL])
@pytest.mark.parametrize(
    "readings", [pytest.param(device_samples, id="jetson"), pytest.param(plain_pc_samples, id="pc")]
)
def test_device(snap_compare, size, readings, monkeypatch):
    samples = readings()
    monkeypatch.setattr("s2moe.app.tui.device.DeviceScreen.INTERVAL", 3600.0)  # no reading of this machine
    monkeypatch.setattr("s2moe.engine.measure.device.DeviceMonitor.sample", lambda self: samples[0])

    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f10")
        screen = pilot.app.screen
        for _ in range(200):
            if screen.samples:
                break
            await pilot.pause(0.01)
        for sample in samples[1:]:
            screen.show(sample)
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", [pytest.param((80, 24), id="80x24"), SMALL])
def test_save_transcript_dialog(snap_compare, size):
    async def run_before(pilot):
        await ready(pilot)
        feed_generation(pilot.app.screen, "The cat")
        await pilot.press("ctrl+s")
        await pilot.pause()
        pilot.app.screen.query_one("#export-path").value = "/home/user/s2moe-chat.md"  # not this run's clock
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)
