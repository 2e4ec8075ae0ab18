"""The app's hold on the engine: one model, one decoder, one job at a time.

Nothing here touches Textual. Workers call into an EngineSession from their threads; the screens get
plain data (segments of coloured text, per-iteration numbers; see segments) and never call the decoder
themselves. The chat's settings (chat_settings) become the engine's GenerationConfig here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...engine.errors import ConfigError, ModelError, S2MoEError
from .chat_settings import ChatSettings
from .segments import view_of


def shipped_default_model() -> Path | None:
    from ...engine import zoo

    try:
        path = zoo.default_model_path()
    except Exception:  # noqa: BLE001 - a missing packaged model must not stop the app
        return None
    return path if path.is_file() else None


def ui_default_threads() -> int:
    """All cores but one: llama.cpp's threads spin-wait at barriers, and a UI thread competing with them
    for the last core slows decoding several times over."""
    from ...engine.measure.device import default_threads

    return default_threads(spare=1)


@dataclass(frozen=True)
class ModelSummary:
    name: str
    arch: str
    n_layer: int
    n_expert: int
    k: int
    is_moe: bool
    fingerprint: str
    file_bytes: int

    @property
    def can_self_draft(self) -> bool:
        """Drafting with fewer experts per token than the model needs a model that routes to two or more."""
        return self.is_moe and self.k >= 2

    def short(self) -> str:
        if self.is_moe:
            return f"{self.name} · {self.n_layer}L {self.n_expert}E top-{self.k}"
        return f"{self.name} · dense"

    def describe(self) -> str:
        if self.is_moe and not self.can_self_draft:
            return (
                f"{self.name} · {self.arch} · {self.n_layer} layers · {self.n_expert} experts top-{self.k} "
                "(nothing drafts with fewer experts: ar and lookup apply)"
            )
        if self.is_moe:
            return f"{self.name} · {self.arch} · {self.n_layer} layers · {self.n_expert} experts top-{self.k}"
        return f"{self.name} · {self.arch} · {self.n_layer} layers · dense (only ar applies)"


@dataclass
class SessionStats:
    """What the session has learnt across generations: the AR speed, reuse with gating off/on."""

    ar_tok_per_s: float | None = None
    reuse_by_gating: dict = field(default_factory=dict)  # {True/False: per-layer mean reuse (list)}


class EngineSession:
    """Owns the decoder. One engine job (load, generation, calibration, bench) at a time."""

    def __init__(
        self,
        model_path: str | None,
        *,
        n_threads: int | None = None,
        n_ctx: int = 2048,
        profile: str | None = None,
        decoder_factory: Callable | None = None,
        budget: str | None = None,
        placement=None,
        n_batch: int | None = None,
        copy_cache: str | None = None,
    ):
        self.model_path = str(model_path) if model_path else None
        # s2moe's copies from earlier generations, kept across app runs (engine.drafting.copycache): a file, or a
        # directory with a file per model
        self.copy_cache = copy_cache
        self._copies_loaded = False  # the decoder holds the file's generations: written back when it closes
        self.placement = placement  # engine.decoding.gpu.Placement; None: everything in host memory
        # "auto" or a size: the app runs inside a memory cgroup (s2moe app --budget) and offloads experts
        self.budget = budget
        self.budget_bytes: int | None = None
        self.offloader = None
        self.n_threads = n_threads or ui_default_threads()
        self.n_ctx = n_ctx
        self.n_batch = n_batch  # llama.cpp's batch size (None: the engine's default)
        self.profile_name = profile
        self.decoder = None
        self.cpu_buffers = None  # engine.decoding.cpu_buffers.CpuBuffers: the path the loaded model's CPU weights took
        self.model: ModelSummary | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.stats = SessionStats()
        self._factory = decoder_factory
        # a model with a chat template llama.cpp applies: the turns so far (None: each prompt a completion)
        self.conversation = None
        self.template = None  # engine.decoding.chat.Template of the loaded model

    # -- model -------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def set_model(self, path: str) -> None:
        """Point at another model; it loads on the next job. Called with the lock free."""
        self._close_decoder()
        self.model = None
        self.model_path = str(path)
        self.stats = SessionStats()
        self.conversation = self.template = None

    def load(self, progress: Callable[[int, int, str], None] | None = None) -> ModelSummary:
        """Load the model if needed (call from a worker thread holding the lock). progress(step, steps, what)
        says what the load does as it goes: under a budget it warms up every mode and sizes the budget, which
        takes many times as long as loading."""
        say = progress or (lambda step, steps, what: None)
        if self.model_path is None:
            raise ModelError("no model: open one with Ctrl+P → “Open model…” (or start with --model PATH)")
        if self.decoder is None:
            steps = 1 if self.budget is None else 2 + len(self.warm_up_modes())
            say(1, steps, "loading the model")
            if self._factory is not None:
                self.decoder = self._factory(self.model_path)
            else:
                from ...engine.decoding.cpu_buffers import choose
                from ...engine.decoding.decoder import Decoder
                from ...engine.decoding.gpu import Placement
                from ...engine.model_info import read_model_info

                self.cpu_buffers = choose(read_model_info(self.model_path), self.budget is None)
                self.decoder = Decoder(
                    self.model_path,
                    n_ctx=self.n_ctx,
                    n_threads=self.n_threads,
                    max_draft=16,
                    use_extra_bufts=self.cpu_buffers.extra,
                    placement=self.placement or Placement(),
                    n_batch=self.n_batch,
                )
                if self.budget is not None:
                    try:
                        self._offload(say)
                    except BaseException:
                        self._close_decoder()
                        raise
            if self.copy_cache is not None:
                from ...engine.drafting.copycache import load_copy_cache

                try:
                    load_copy_cache(self.copy_cache, self.decoder.info, self.decoder.earlier)
                except BaseException:
                    self._close_decoder()
                    raise
                self._copies_loaded = True
            from ...engine.decoding.chat import Conversation

            self.template = self.decoder.chat_template
            self.conversation = Conversation(self.template) if self.template.usable else None
            info = self.decoder.info
            self.model = ModelSummary(
                info.name if getattr(info, "name", "") else Path(self.model_path).name,
                info.arch,
                info.n_layer,
                info.n_expert,
                info.n_expert_used,
                info.is_moe,
                info.fingerprint,
                info.file_bytes,
            )
        return self.model

    def warm_up_modes(self) -> tuple[str, ...]:
        """The modes a budgeted load warms up: plain decoding and one that drafts."""
        k = self.decoder.info.n_expert_used if self.decoder is not None else 2
        return ("ar", "s2moe" if k >= 2 else "lookup")

    def _offload(self, say: Callable[[int, int, str], None]) -> None:
        """Inside the app's memory cgroup: pin, prefetch, and size the budget (auto: after a warm-up)."""
        from ...engine import offload
        from ...engine.decoding.generation_config import GenerationConfig

        if offload.current_budget() is None:
            raise ConfigError(
                "this app is not running inside its memory cgroup (start it with s2moe app --budget SIZE)"
            )
        decoder = self.decoder
        hot = []
        if self.profile_name:
            from ...engine.profiles import hot_experts_for_model, load_profile

            hot = hot_experts_for_model(load_profile(self.profile_name), decoder.info.fingerprint)

        modes = self.warm_up_modes()
        steps = 2 + len(modes)

        def warm_up():
            for i, mode in enumerate(modes):
                say(2 + i, steps, f"warming up {mode}")
                for _ in decoder.generate(
                    "def add(a, b):\n    return", GenerationConfig(mode=mode, n_predict=8, stop_at_eos=False)
                ):
                    pass
            say(steps, steps, "sizing the budget")

        self.offloader = offload.offload_decoder(decoder, offload.Budget.parse(self.budget), hot, warm_up=warm_up)
        self.budget_bytes = self.offloader.budget_bytes

    def budget_label(self) -> str:
        if self.budget is None:
            return ""
        from ...engine.offload import Budget

        return "budget " + Budget.parse(self.budget).describe(self.budget_bytes)

    def _close_decoder(self) -> None:
        decoder, self.decoder = self.decoder, None
        loaded, self._copies_loaded = self._copies_loaded, False
        try:
            if decoder is not None and loaded:
                from ...engine.drafting.copycache import save_copy_cache

                save_copy_cache(self.copy_cache, decoder.info, decoder.earlier)
        finally:
            if self.offloader is not None:
                self.offloader.close()
                self.offloader = None
            if decoder is not None:
                decoder.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop any job and free the decoder (waits for the job to reach its next stop check)."""
        self.stop.set()
        if self.lock.acquire(timeout=timeout):
            try:
                self._close_decoder()
            finally:
                self.lock.release()

    # -- generation --------------------------------------------------------------------------------
    def cost(self):
        """Cost constants of the active profile for this model; None means measure at start-up.

        Raises ConfigError when the profile is missing or was calibrated for another model."""
        if not self.profile_name or self.decoder is None:
            return None
        from ...engine.profiles import cost_for_model, load_profile

        info = self.decoder.info
        return cost_for_model(
            load_profile(self.profile_name),
            info.fingerprint,
            info.path.name,
            offloaded=self.budget is not None,
            experts_in_host=self.placement is not None and self.placement.copies_experts,
        )

    def profile_problem(self) -> str | None:
        """Why the active profile gives the loaded model no cost constants, in the app's words (None: it gives
        them, or there is no profile or no model)."""
        if not self.profile_name or self.decoder is None:
            return None
        from ...engine.profiles import load_profile

        try:
            self.cost()
        except S2MoEError as e:
            try:
                load_profile(self.profile_name)
            except S2MoEError:
                return f"{e}: cost constants are measured at start-up instead"
            return (
                f"profile {self.profile_name} was not calibrated for this model: F3 (Calibrate) measures "
                "it; until then cost constants are measured at start-up"
            )
        return None

    def tuned(self) -> dict:
        """The active profile's tuned settings for the loaded model where it runs ({} if none; a profile that
        does not load is reported by cost())."""
        if not self.profile_name or self.decoder is None:
            return {}
        from ...engine.profiles import load_profile, tuned_settings

        try:
            return tuned_settings(
                load_profile(self.profile_name), self.decoder.info.fingerprint, offloaded=self.budget is not None
            )
        except S2MoEError:
            return {}

    def config(self, settings: ChatSettings, cost=None):
        from ...engine.decoding.generation_config import GenerationConfig

        tuned = self.tuned()
        settings = settings.resolved(self.model, tuned)
        cfg = GenerationConfig(
            reuse_cap=tuned.get("reuse_cap"),
            mode=settings.mode,
            n_predict=settings.n_predict,
            **settings.sampling_fields(),
            draft_topk=settings.draft_topk,
            draft_max=settings.draft_max,
            utility=settings.utility,
            lookup=settings.lookup,
            threshold=settings.threshold,
            reuse_strength=settings.reuse_strength if settings.gating else 0.0,
            memory_strength=settings.memory_strength,
            cost=cost,
        )
        if self.decoder is not None:
            cfg.validate(self.decoder.info)
        return cfg

    def new_conversation(self) -> None:
        """Forget the turns so far: the next prompt starts a conversation (its KV prefix, the template's
        opening, is still reused)."""
        if self.conversation is not None:
            self.conversation.clear()

    def generate(
        self,
        prompt: str,
        settings: ChatSettings,
        emit: Callable[[object, object], None],
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """Run one generation (worker thread): emit(event, view) for every engine event. With a chat
        template, the prompt is the user's next turn: the conversation is rendered whole, the KV of the
        turns before is kept, and the answer (what was generated, if stopped early) joins the history."""
        if not self.lock.acquire(blocking=False):
            raise ConfigError("the engine is busy with another job; wait for it or stop it (Esc)")
        try:
            self.stop.clear()
            self.load()
            cost = None
            try:
                cost = self.cost()
            except S2MoEError:
                if warn is not None:
                    warn(self.profile_problem())
            cfg = self.config(settings, cost)
            decoder = self.decoder
            conversation = self.conversation
            if conversation is None:
                events = decoder.generate(prompt, cfg, should_stop=self.stop.is_set)
            else:
                from ...engine.decoding.chat import chat_tokens

                events = decoder.generate(
                    chat_tokens(decoder, conversation, prompt), cfg, should_stop=self.stop.is_set, keep_context=True
                )
            from ...engine.events import Finished

            for event in events:
                emit(event, view_of(event, decoder))
                if conversation is not None and isinstance(event, Finished):
                    conversation.add_turn(prompt, event.text)
        finally:
            self.lock.release()

    def run_job(self, fn: Callable[[], None]) -> None:
        """Run another engine job (calibration, bench) under the session lock."""
        if not self.lock.acquire(blocking=False):
            raise ConfigError("the engine is busy with another job; wait for it or stop it")
        try:
            self.stop.clear()
            fn()
        finally:
            if self.decoder is not None:
                # a bench or calibration may have decoded into the cache behind the generations' back
                self.decoder.forget_context()
            self.lock.release()
