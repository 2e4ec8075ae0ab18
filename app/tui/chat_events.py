"""What the engine's events do to the chat screen while it generates: the running turn's text and status, the live
panel's figures, and the redraws a few times a second whatever the token rate. Apart from the screen so that the
reading of events stays apart from starting and stopping a generation."""

from __future__ import annotations

from ..model_runs import speed_text
from .messages import EngineEvent, EngineFailed, EngineNotice, EngineStatus, JobEnded
from .widgets import TurnView, progress_bar


class ChatEventHandlers:
    """ChatScreen's handlers of the engine's messages. A part of the screen, not a widget of its own: it reads the
    screen's running turn and live panel."""

    def on_engine_event(self, message: EngineEvent) -> None:
        from ...engine.events import Finished, Iteration, MeasuringCosts, Prefilled, ResidencySnapshot, Started

        event = message.event
        turn = self._turn
        live = self.live.state
        session = self.app.session
        if isinstance(event, MeasuringCosts):
            # without a profile's constants the first generation measures them, under a budget for many seconds
            status = (
                f"measuring cost constants {progress_bar(round(event.fraction * 10), 10)} "
                f"{event.fraction:.0%} · {event.seconds:.0f} s (once for this model and k_d; a profile "
                "calibrated on F3 skips it)"
            )
            self.set_status(status)
            if turn is not None:
                turn.status = status
                turn.dirty = True
        elif isinstance(event, Started):
            live.start(event, message.t, session.stats)
            live.budget = session.budget_label()
            if turn is not None and "seed random" in turn.settings_text:
                # -1 draws a seed per answer: name the one drawn, which repeats this answer in a lossless mode
                # (the export keeps it)
                turn.settings_text = turn.settings_text.replace("seed random", f"seed {event.config['seed']}")
            self.app.model_changed()
            self.adapt_to_model()
            self.set_status("prefilling…")
        elif isinstance(event, Prefilled):
            self._prefilled = event
            live.prefilled(message.t)
            self.set_status("generating… (Esc stops)")
        elif isinstance(event, Iteration):
            # token texts for the draft tree: reading the vocabulary is safe beside the worker's decoding
            decoder = session.decoder
            live.add(event, message.view, message.t, decoder.piece_text if decoder is not None else None)
            if turn is not None and message.view is not None:
                turn.add(message.view.segments)
                turn.status = f"{live.summary.committed} tokens…"
        elif isinstance(event, ResidencySnapshot):
            live.residency(event)
        elif isinstance(event, Finished):
            live.finish(event)
            summary = live.summary
            if turn is not None:
                turn.summary = (
                    f"{summary.n_tokens} tokens · {speed_text(summary)} · "
                    f"accept len {summary.accept_len:.2f} · rollbacks {summary.rollbacks} · "
                    f"stop: {summary.stop_reason}"
                )
                prefilled = self._prefilled
                if prefilled is not None and prefilled.reused:
                    turn.summary += f" · {prefilled.reused} of {prefilled.n_tokens} prompt tokens kept in KV"
                turn.dirty = True
            if summary.mode == "ar" and summary.n_tokens >= 4 and summary.stop_reason != "interrupted":
                session.stats.ar_tok_per_s = summary.decode_tok_per_s  # as the live panel's figure
            mean = summary.reuse_per_layer
            if mean is not None and summary.mode == "s2moe":
                session.stats.reuse_by_gating[live.gating] = [float(x) for x in mean]

    def on_engine_status(self, message: EngineStatus) -> None:
        self.set_status(message.text)

    def on_engine_notice(self, message: EngineNotice) -> None:
        self.notify(message.text, severity=message.severity, timeout=8)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.notify(message.text, title="Generation failed", severity="error", timeout=10)
        if self._turn is not None and not self._turn.summary:
            self._turn.summary = f"failed: {message.text}"
            self._turn.dirty = True

    def on_job_ended(self, message: JobEnded) -> None:
        self.generating = False
        self.refresh_bindings()
        self.set_status("")
        if self._turn is not None and not self._turn.summary:
            self._turn.summary = "stopped"
            self._turn.dirty = True
        self.flush()
        self.app.model_changed()

    def flush(self) -> None:
        """Redraw what changed since the last redraw (a few times a second, whatever the token rate)."""
        self.flush_text()
        self.flush_live()

    def flush_live(self) -> None:
        if self.live.display:
            self.live.flush()

    def flush_text(self) -> None:
        scrolled = False
        for turn in self.query(TurnView):
            if turn.dirty:
                turn.redraw()
                scrolled = True
        if scrolled:
            self.transcript.scroll_end(animate=False)
