"""The app's hold on the engine: one model, one decoder, one job at a time, and the view data of events.

Nothing here touches Textual. Workers call into an EngineSession from their threads; the screens get
plain data (segments of coloured text, per-iteration numbers) and never call the decoder themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ...engine.decoding.sampling import MIN_P, RANDOM_SEED, REPEAT_LAST_N, REPEAT_PENALTY, TOP_K, TOP_P
from ...engine.errors import ConfigError, ModelError, S2MoEError

# How a piece of the answer was produced. The chat colours each kind differently.
DRAFT = "draft"  # a draft token the target accepted
BONUS = "bonus"  # the target's token after every draft was accepted
CORRECTION = "correction"  # the target's token replacing the first rejected draft
TARGET = "target"  # a plain decoding step (no draft)
REJECTED = "rejected"  # a draft token the target rejected (shown struck through, or hidden)


MODE_HELP = {
    "ar": "plain decoding, one token per pass (the reference)",
    "s2moe": "S²-MoE: shared KV + routing-aware expansion (utility) + reuse-aware gating",
    "naive": "draft in an independent context with k_d experts (no shared KV; the paper's baseline)",
    "conf": "shared-KV self-draft that stops when the draft's confidence drops",
    "cascade": "shared-KV self-draft whose length adapts per request",
    "lookup": "prompt-lookup drafting: copy n-grams from the context, no draft model",
    "tree": "S²-MoE drafting a tree: best-first by utility, siblings priced by the experts they add",
    "tree-prob": "a draft tree expanded by draft probability alone (EAGLE-style; the tree baseline)",
    "ls": "layer-skipping self-draft: every other MoE layer's experts skipped (the paper's LS baseline)",
}


def mode_help(mode: str) -> str:
    return MODE_HELP.get(mode, "")


def engine_modes() -> tuple[str, ...]:
    """The decoding modes the installed engine accepts (the UI's mode selector is built from these)."""
    from ...engine import modes

    return tuple(modes.MODES)


def moe_modes() -> tuple[str, ...]:
    from ...engine import modes

    return tuple(getattr(modes, "MOE_MODES", tuple(m for m in modes.MODES if m != "ar")))


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


# What ChatSettings leaves open comes to without a tuned profile: GenerationConfig's defaults.
DEFAULTS = {"reuse_strength": 0.5, "draft_max": 8, "threshold": 1.0, "lookup": True, "memory_strength": 0.3}
# The settings a profile's tuning may fill in: left open (None) in ChatSettings unless the user sets them.
OPEN_KEYS = ("draft_topk", "draft_max", "threshold", "reuse_strength", "memory_strength", "lookup")
SHORT_NAMES = {
    "draft_topk": "k_d",
    "draft_max": "cap",
    "threshold": "threshold",
    "reuse_strength": "α",
    "memory_strength": "α_m",
    "lookup": "copies",
}
# Where a setting's value comes from, as the settings dialog and the settings bar name it.
FROM_FLAG, FROM_USER, FROM_PROFILE, FROM_DEFAULT = "flag", "yours", "profile", "default"


def value_text(value) -> str:
    """A setting's value in a few characters (on/off for a switch)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


@dataclass
class ChatSettings:
    """What the user switches from the chat: the mode and the method's components."""

    mode: str = "s2moe"
    utility: bool = True
    gating: bool = True
    # None: not set here — the active profile's tuned value (s2moe tune), else the default (DEFAULTS)
    # s2moe: draft the tokens that followed a repeated n-gram of the context where the utility rule says they pay
    lookup: bool | None = None
    reuse_strength: float | None = None  # α used when gating is on
    memory_strength: float | None = None  # α_m toward the experts in memory: under a budget, when gating is on
    draft_topk: int | None = (
        None  # None also: the model's default (see engine.decoding.generation_config.routing_defaults)
    )
    draft_max: int | None = None
    threshold: float | None = None
    n_predict: int = 128
    # llama.cpp's sampler chain, as generate's flags set it and with their defaults (app.options.SAMPLING_VALUES)
    temperature: float = 0.0
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N
    seed: int = 0

    def sampling_fields(self) -> dict:
        """The sampler settings, as GenerationConfig fields."""
        from ..options import SAMPLING_VALUES

        return {key: getattr(self, key) for key in SAMPLING_VALUES}

    def sampling_text(self) -> str:
        """The sampler settings in a few characters ("" for greedy with no penalty): temperature and seed,
        then only what differs from the defaults."""
        parts = []
        if self.temperature > 0:
            parts.append(f"T={self.temperature:g}")
            parts.append("seed " + ("random" if self.seed == RANDOM_SEED else str(self.seed)))
            for key, name, default in (("top_k", "top-k", TOP_K), ("top_p", "top-p", TOP_P), ("min_p", "min-p", MIN_P)):
                if getattr(self, key) != default:
                    parts.append(f"{name}={getattr(self, key):g}")
        if self.repeat_penalty != REPEAT_PENALTY:
            parts.append(
                f"rep={self.repeat_penalty:g}"
                + (f"/{self.repeat_last_n}" if self.repeat_last_n != REPEAT_LAST_N else "")
            )
        return " ".join(parts)

    def resolved(self, model: ModelSummary | None, tuned: dict | None = None) -> ChatSettings:
        """These settings with what they leave open filled in: from `tuned` (the active profile's tuned
        settings), else the defaults; k_d from the model's routing (left open while no model is loaded)."""
        tuned = tuned or {}
        s = replace(
            self, **{key: tuned.get(key, default) for key, default in DEFAULTS.items() if getattr(self, key) is None}
        )
        if s.draft_topk is None and "draft_topk" in tuned:
            s = replace(s, draft_topk=tuned["draft_topk"])
        if model is None or s.draft_topk is not None:
            return s
        from ...engine.decoding.generation_config import routing_defaults

        return replace(s, draft_topk=routing_defaults(model.n_expert, model.k).draft_topk)

    def sources(self, tuned: dict | None = None, flags: dict | None = None) -> dict[str, str]:
        """Where each value comes from: the command line (flags: the fields it set), the user (set in the app
        and remembered), the active profile's tuning (`tuned`), or the default."""
        tuned, flags = tuned or {}, flags or {}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in flags and flags[f.name] == value:
                out[f.name] = FROM_FLAG
            elif f.name in OPEN_KEYS:
                out[f.name] = FROM_USER if value is not None else FROM_PROFILE if f.name in tuned else FROM_DEFAULT
            else:
                out[f.name] = FROM_USER if value != f.default else FROM_DEFAULT
        return out

    def overrides(self, tuned: dict | None) -> dict[str, tuple]:
        """The user's values that differ from what the active profile tuned: {key: (yours, the profile's)}."""
        tuned = tuned or {}
        return {
            key: (getattr(self, key), tuned[key])
            for key in OPEN_KEYS
            if key in tuned and getattr(self, key) is not None and getattr(self, key) != tuned[key]
        }

    def left_to_profile(self, keys=OPEN_KEYS) -> ChatSettings:
        """These settings with `keys` left open again: the active profile's tuned values (else the defaults)
        decide them."""
        return replace(self, **{key: None for key in keys})

    def describe(
        self,
        model: ModelSummary | None = None,
        tuned: dict | None = None,
        budgeted: bool = False,
        overrides: dict | None = None,
    ) -> str:
        """The settings in a line; budgeted: under a memory budget, where α_m acts (shown with gating);
        overrides (see overrides()): the user's values where the profile tuned others, each marked as such."""
        overrides = dict(overrides or {})

        def mark(key: str) -> str:
            if key not in overrides:
                return ""
            return f" (yours; profile {value_text(overrides.pop(key)[1])})"

        r = self.resolved(model, tuned)
        parts = [self.mode]
        if self.mode != "ar":
            parts.append(f"k_d={'auto' if r.draft_topk is None else r.draft_topk}" + mark("draft_topk"))
        if self.mode == "s2moe":
            parts.append("utility " + ("on" if self.utility else "off"))
            # gating changes which experts a token uses, so its answers can differ from plain decoding's
            parts.append(
                f"gating {r.reuse_strength:g} (lossy)" + mark("reuse_strength")
                if self.gating and r.reuse_strength
                else "gating off (lossless)"
            )
            if self.gating and budgeted:
                parts.append(f"memory {r.memory_strength:g}" + mark("memory_strength"))
            if not r.lookup:
                parts.append("copies off" + mark("lookup"))
        parts.append(f"n={self.n_predict}")
        if self.sampling_text():
            parts.append(self.sampling_text())
        # the user's values the line above does not show, where they differ from the profile's
        parts += [
            f"{SHORT_NAMES[key]} {value_text(mine)}{mark(key)}"
            for key, (mine, _) in list(overrides.items())
            if key in ("draft_max", "threshold") and self.mode != "ar"
        ]
        return " · ".join(parts)


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
        # s2moe's copies from earlier generations, kept across app runs (engine.copycache): a file, or a
        # directory with a file per model
        self.copy_cache = copy_cache
        self._copies_loaded = False  # the decoder holds the file's generations: written back when it closes
        self.placement = placement  # engine.gpu.Placement; None: everything in host memory
        # "auto" or a size: the app runs inside a memory cgroup (s2moe app --budget) and offloads experts
        self.budget = budget
        self.budget_bytes: int | None = None
        self.offloader = None
        self.n_threads = n_threads or ui_default_threads()
        self.n_ctx = n_ctx
        self.n_batch = n_batch  # llama.cpp's batch size (None: the engine's default)
        self.profile_name = profile
        self.decoder = None
        self.cpu_buffers = None  # engine.cpu_buffers.CpuBuffers: the path the loaded model's CPU weights took
        self.model: ModelSummary | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.stats = SessionStats()
        self._factory = decoder_factory
        # a model with a chat template llama.cpp applies: the turns so far (None: each prompt a completion)
        self.conversation = None
        self.template = None  # engine.chat.Template of the loaded model

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


# -- view data of events ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    text: str
    kind: str


@dataclass(frozen=True)
class IterationView:
    segments: tuple[Segment, ...]
    utilities: tuple[tuple[float | None, bool, float], ...]  # (utility, kept, chain prob) of the candidates


def _pieces(tokens, text: str, piece: Callable[[int], str]) -> list[str]:
    """Per-token text when it adds up to the span's text (multi-byte characters may not), else one piece."""
    if not tokens:
        return []
    pieces = [piece(t) for t in tokens]
    return pieces if "".join(pieces) == text else [text]


def segments_of(event, detokenize: Callable[[list[int]], str], piece: Callable[[int], str]) -> list[Segment]:
    """How each part of an iteration's committed text was produced, with the rejected drafts in place."""
    accepted = list(event.accepted)
    rejected = list(event.rejected)
    committed = list(event.committed)
    has_target = len(committed) == len(accepted) + 1
    accepted = accepted[: len(committed)]
    accepted_text = detokenize(accepted) if accepted else ""
    text = event.committed_text
    if not text.startswith(accepted_text):
        # Byte-level pieces that only make characters together: colour the whole step by its last token.
        accepted_text = ""
        accepted = []
    target_text = text[len(accepted_text) :] if has_target else ""
    out = [Segment(p, DRAFT) for p in _pieces(accepted, accepted_text, piece)]
    if rejected:
        out.append(Segment(detokenize(rejected), REJECTED))
    if has_target and target_text:
        if not event.drafted:
            kind = TARGET
        elif rejected:
            kind = CORRECTION
        else:
            kind = BONUS
        out.append(Segment(target_text, kind))
    elif not has_target and not accepted and text:
        out.append(Segment(text, DRAFT))
    return out


def view_of(event, decoder) -> IterationView | None:
    from ...engine.events import Iteration

    if not isinstance(event, Iteration):
        return None
    segs = segments_of(event, decoder.detokenize, decoder.piece_text)
    utils = tuple((c.utility, bool(c.kept), float(c.chain_prob)) for c in event.candidates)
    return IterationView(tuple(segs), utils)
