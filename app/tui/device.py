"""The device screen, in the manner of jtop: memory and swap, the model file in the page cache, storage
reads, CPU per core, the memory cgroup against its budget and, on a Jetson, the GPU. What it shows comes
from engine.measure.device's readings once a second; this module only draws them."""

from __future__ import annotations

import textwrap
from collections import deque

from rich.cells import cell_len
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from ...engine.measure.device import DeviceMonitor, DeviceSample
from ...engine.offload import fmt_bytes
from .live_tiles import spark
from .widgets import NavBar

HISTORY = 120  # readings kept for the history graphs (one a second)
LABEL = 9
EIGHTHS = " ▁▂▃▄▅▆▇█"


def meter(share: float, width: int) -> str:
    """A bar of `width` cells, filled to `share`: █ for the part used, ░ for the rest (legible without colour)."""
    share = min(1.0, max(0.0, share))
    full = int(round(share * width))
    return "█" * full + "░" * (width - full)


def graph(values, width: int, height: int, top: float) -> list[str]:
    """The last `width` values as columns `height` cells high, scaled to `top`, the newest on the right;
    eighth blocks give the column's top its height within a cell. Lines from the top down."""
    levels = [0.0 if top <= 0 else min(1.0, max(0.0, v / top)) * height * 8 for v in list(values)[-width:]]
    rows = []
    for row in range(height - 1, -1, -1):
        cells = []
        for level in levels:
            part = level - row * 8
            cells.append(
                EIGHTHS[8]
                if part >= 8
                else EIGHTHS[max(1 if row == 0 and level > 0 else 0, int(part))]
                if part > 0
                else " "
            )
        rows.append("".join(cells).rjust(width))
    return rows


def _mb_s(rate: float | None) -> str:
    return "—" if rate is None else f"{rate / 1e6:.1f} MB/s"


class DeviceView:
    """A DeviceSample (and the history of the previous ones) as lines of text for a given width."""

    def __init__(
        self, sample: DeviceSample | None, history: dict[str, deque], budget_text: str = "", height: int | None = None
    ):
        self.sample = sample
        self.history = history
        self.budget_text = budget_text
        self.height = height  # lines the view may fill: the history graphs grow into what the rest leaves

    def _rows(self, width: int, label: str, bar: str | None, parts: list[str]) -> list[Text]:
        """The label, the bar, then the parts joined by " · " as far as the width goes; the rest continues
        on further lines under the bar rather than being cut (a part longer than a line, at its spaces)."""
        lines = [Text(no_wrap=True, overflow="fold")]
        lines[0].append(f"{label:<{LABEL}}", style="bold")
        if bar is not None:
            lines[0].append(bar + " ")
        room = max(8, width - LABEL)
        first = True
        for part in parts:
            pieces = textwrap.wrap(part, room) if cell_len(part) > room else [part]
            for i, piece in enumerate(pieces):
                line = lines[-1]
                sep = "" if first else " · "
                if i > 0 or (not first and cell_len(line.plain) + len(sep) + cell_len(piece) > width):
                    lines.append(Text(" " * LABEL, no_wrap=True, overflow="fold"))
                    line, sep = lines[-1], ""
                line.append(sep + piece)
                first = False
        return lines

    def lines(self, width: int) -> list[Text]:
        s = self.sample
        if s is None:
            return [Text("reading…")]
        bar = max(8, min(24, width // 4))
        out = []
        m = s.memory
        total, avail = m.get("MemTotal", 0), m.get("MemAvailable", 0)
        if total:
            used = total - avail
            out += self._rows(
                width,
                "Memory",
                meter(used / total, bar),
                [f"{fmt_bytes(used)} used of {fmt_bytes(total)}", f"{fmt_bytes(avail)} available"],
            )
        swap_total = m.get("SwapTotal", 0)
        if swap_total:
            swap_used = swap_total - m.get("SwapFree", 0)
            out += self._rows(
                width,
                "Swap",
                meter(swap_used / swap_total, bar),
                [f"{fmt_bytes(swap_used)} used of {fmt_bytes(swap_total)}"],
            )
        else:
            out += self._rows(width, "Swap", None, ["none"])
        cache = f"page cache {fmt_bytes(m.get('Cached', 0))}"
        if s.model_cached is not None and s.model_cached[1]:
            have, size = s.model_cached
            out += self._rows(
                width,
                "Model",
                meter(have / size, bar),
                [f"{have / size:.0%} of the file cached", f"{fmt_bytes(have)} of {fmt_bytes(size)}", cache],
            )
        else:
            out += self._rows(width, "Cache", None, [cache])
        out += self._process(width, s, bar)
        if s.cgroup is not None and s.cgroup.get("limit"):
            g = s.cgroup
            out += self._rows(
                width,
                "Budget",
                meter(g["total"] / g["limit"], bar),
                [
                    f"{fmt_bytes(g['total'])} of {fmt_bytes(g['limit'])}",
                    f"anon {fmt_bytes(g['anon'])}",
                    f"file {fmt_bytes(g['file'])}",
                    f"locked {fmt_bytes(g['locked'])}",
                ],
            )
        else:
            out += self._rows(
                width, "Budget", None, [self.budget_text or "none: the whole model may stay in memory (--budget SIZE)"]
            )
        disk = self.history.get("disk", ())
        out += self._rows(
            width,
            "Reads",
            spark(list(disk)[-bar:]) if disk else None,
            [f"{s.disk or 'storage'} {_mb_s(s.disk_read_bytes_per_s)}", f"this process {_mb_s(s.read_bytes_per_s)}"],
        )
        out += self._cpu(width, s.cpu)
        if s.jetson is not None:
            out += self._jetson(width, s.jetson)
        elif s.temps:
            out += self._rows(
                width,
                "Temp",
                None,
                [f"{name} {value:.1f}°C" for name, value in s.temps.items()] + ["from /sys/class/thermal"],
            )
            out += self._rows(
                width,
                "GPU",
                None,
                ["no GPU or power source here: they come from a Jetson's jtop service or tegrastats"],
            )
        else:
            out += self._rows(
                width,
                "GPU",
                None,
                [
                    "no GPU, temperature or power source here: they come from a "
                    "Jetson's jtop service or tegrastats, temperatures also from "
                    "/sys/class/thermal"
                ],
            )
        return out + self._history(width, s, len(out))

    def _process(self, width: int, s: DeviceSample, bar: int) -> list[Text]:
        p = s.process or {}
        rss, total = p.get("VmRSS"), s.memory.get("MemTotal", 0)
        if rss is None:
            return []
        parts = [
            f"{fmt_bytes(rss)} resident",
            f"anon {fmt_bytes(p.get('RssAnon', 0))}",
            f"model file pages {fmt_bytes(p.get('RssFile', 0))}",
        ]
        if p.get("VmSwap"):
            parts.append(f"swapped {fmt_bytes(p['VmSwap'])}")
        return self._rows(width, "This app", meter(rss / total, bar) if total else None, parts)

    def series(self, s: DeviceSample) -> list[tuple[str, str, float, str]]:
        """The history graphs this device has a source for: (history key, label, scale top, current value)."""
        out = []
        if s.cpu:
            out.append(("cpu", "CPU", 1.0, f"{sum(s.cpu) / len(s.cpu):.0%} mean"))
        total = s.memory.get("MemTotal", 0)
        if total:
            out.append(
                ("memory", "Memory", float(total), f"{(total - s.memory.get('MemAvailable', 0)) / total:.0%} used")
            )
        j = s.jetson or {}
        if j.get("gpu_load") is not None:
            out.append(("gpu", "GPU", 100.0, f"{j['gpu_load']}% load"))
        temps = j.get("temps") or s.temps
        if temps:
            out.append(("temp", "Temp", 100.0, f"{max(temps.values()):.0f}°C max"))
        if j.get("power"):
            power = self.history.get("power") or [0.0]
            out.append(("power", "Power", max(power), f"{total_mw(j['power']) / 1000:.1f} W"))
        return out

    def _history(self, width: int, s: DeviceSample, used: int) -> list[Text]:
        series = [x for x in self.series(s) if self.history.get(x[0])]
        if not series:
            return []
        room = (self.height or 0) - used - 1
        rows = max(1, min(6, room // len(series))) if room > 0 else 2
        value_width = max(cell_len(x[3]) for x in series) + 1
        cols = max(8, width - LABEL - value_width)
        out = [Text(f"History, last {min(cols, len(self.history[series[0][0]]))} s (one column a second)", style="dim")]
        for key, label, top, value in series:
            for i, line in enumerate(graph(self.history[key], cols, rows, top)):
                text = Text(no_wrap=True, overflow="ellipsis")
                text.append(f"{label if i == 0 else '':<{LABEL}}", style="bold")
                text.append(line, style="cyan")
                text.append(" " + value if i == 0 else "")
                out.append(text)
        return out

    def _cpu(self, width: int, shares: list[float]) -> list[Text]:
        if not shares:
            return self._rows(width, "CPU", None, ["measuring…"])
        cell = 15  # "NN ████░░░░ 45%"
        per_line = max(1, (width - LABEL) // (cell + 1))
        rows = []
        for start in range(0, len(shares), per_line):
            row = Text(no_wrap=True, overflow="ellipsis")
            row.append(f"{'CPU' if start == 0 else '':<{LABEL}}", style="bold")
            for i, share in enumerate(shares[start : start + per_line], start):
                row.append(f"{i:>2} {meter(share, 7)} {share:>4.0%} ")
            rows.append(row)
        return rows

    def _jetson(self, width: int, j: dict) -> list[Text]:
        parts = []
        if j.get("gpu_load") is not None:
            parts.append(f"GPU load {j['gpu_load']}%")
        parts += [f"{name} {value:.1f}°C" for name, value in j.get("temps", {}).items()]
        parts += [f"{name} {value} mW" for name, value in j.get("power", {}).items()]
        source = j.get("source", "tegrastats")
        return self._rows(
            width, "Jetson", None, parts + [f"from {source}"] if parts else [f"{source} gave no readings yet"]
        )

    def __rich_console__(self, console, options):
        yield from self.lines(options.max_width)


class DeviceScreen(Screen):
    HELP_TITLE = "Device"
    HELP_EXTRA = [
        (
            "Device",
            [
                ("Memory / Swap", "used of total, from /proc/meminfo"),
                ("Model", "share of the model file in the page cache (mincore: nothing is read)"),
                (
                    "Budget",
                    "the memory cgroup's usage against its limit, split into anonymous memory, "
                    "file pages and locked pages (s2moe app --budget)",
                ),
                ("Reads", "storage reads: the model's block device, and this process (page faults included)"),
                ("This app", "this process's resident memory (anonymous, and the model file's pages it maps)"),
                ("CPU", "busy share of each core over the last second"),
                (
                    "History",
                    "CPU (mean of the cores), memory used and, where a source exists, GPU load, the "
                    "hottest temperature and total power: one column a second",
                ),
                ("Temp", "where no Jetson source runs: each thermal zone of /sys/class/thermal"),
                (
                    "Jetson",
                    "GPU load, temperatures and power rails from jtop's service (jetson-stats) where "
                    "it runs, else from tegrastats",
                ),
            ],
        ),
    ]
    INTERVAL = 1.0

    def __init__(self, **kw):
        super().__init__(**kw)
        self.monitor: DeviceMonitor | None = None
        self.sample: DeviceSample | None = None
        self.history: dict[str, deque] = {
            key: deque(maxlen=HISTORY) for key in ("disk", "cpu", "memory", "gpu", "temp", "power")
        }
        self.samples = 0  # readings shown (tests read it)

    def compose(self) -> ComposeResult:
        yield NavBar("device", id="navbar")
        with VerticalScroll(id="device-body"):
            yield Static(id="device-view")
        yield Footer()

    def on_mount(self) -> None:
        self.app.register_view(self)
        self.adapt_to_model()
        self.set_interval(self.INTERVAL, self.read)
        self.read()

    def adapt_to_model(self) -> None:
        """A monitor for the loaded model's file (a new one when the model changes)."""
        path = self.app.session.model_path
        if self.monitor is not None and self.monitor.model_path == path:
            return
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = DeviceMonitor(path)

    def on_unmount(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    @work(thread=True, exclusive=True, group="device", exit_on_error=False)
    def read(self) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        sample = monitor.sample()
        self.app.call_from_thread(self.show, sample)

    def show(self, sample: DeviceSample) -> None:
        self.sample = sample
        record(self.history, sample)
        self.samples += 1
        self._redraw()

    def on_resize(self) -> None:
        if self.sample is not None:  # the graphs take the height there is
            self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        body = self.query_one("#device-body")
        self.query_one("#device-view", Static).update(
            DeviceView(self.sample, self.history, self.app.session.budget_label(), body.content_size.height or None)
        )


def record(history: dict[str, deque], s: DeviceSample) -> None:
    """Add a reading's figures to the histories the graphs draw."""
    if s.disk_read_bytes_per_s is not None:
        history["disk"].append(s.disk_read_bytes_per_s)
    if s.cpu:
        history["cpu"].append(sum(s.cpu) / len(s.cpu))
    if s.memory.get("MemTotal"):
        history["memory"].append(s.memory["MemTotal"] - s.memory.get("MemAvailable", 0))
    j = s.jetson or {}
    if j.get("gpu_load") is not None:
        history["gpu"].append(float(j["gpu_load"]))
    temps = j.get("temps") or s.temps
    if temps:
        history["temp"].append(max(temps.values()))
    if j.get("power"):
        history["power"].append(total_mw(j["power"]))


def total_mw(rails: dict) -> float:
    """The board's power: jtop's total where it gives one, else the sum of the rails."""
    return float(rails["TOT"]) if "TOT" in rails else float(sum(rails.values()))
