"""The settings of a generation: GenerationConfig (mode, sampler chain, drafting and gating), how it checks them
(validate) and fills in what it leaves to the model (resolved), and the defaults a model's routing decides.

Apart from the decoder so that what only builds or checks settings (the CLI, the app, bench, tune) need not read
the decode loop, and so that the settings read as one list.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..drafting.copies import COPY_REFINEMENTS
from ..errors import OPTION, ConfigError
from ..events import CostConstants
from ..model_info import GATING_SOFTMAX_WEIGHT, ModelInfo
from ..modes import DRAFT_EXPERTS, MODES, MOE_MODES
from .sampling import MIN_P, RANDOM_SEED, REPEAT_LAST_N, REPEAT_PENALTY, TOP_K, TOP_P, Sampling, check_seed, random_seed

# Modes whose drafts a trace can stand in for: the model's own experts, one chain, a stop rule per token.
TRACE_MODES = ("s2moe", "conf", "cascade")
DRAFT_CAP = 8  # no measurement ties the cap to the routing: the same for every model until a profile tunes it


@dataclass(frozen=True)
class RoutingDefaults:
    """The settings a model's routing decides when neither a flag nor a profile gives them."""

    draft_topk: int  # k_d
    draft_max: int  # draft cap
    reuse_cap: int  # |E*|


def routing_defaults(n_expert: int, k: int) -> RoutingDefaults:
    """k_d = max(1, k/4): a draft pass reads a quarter of the target's experts (2 of 8, 1 of 4, 1 of 2).
    |E*| = 2·k (inside the paper's 1.5–2.5·k sweet spot), below n_expert so that gating can act.
    A top-1 model gets k_d = 1 = k: nothing can draft with fewer experts (validate says so)."""
    k = max(k, 1)
    return RoutingDefaults(draft_topk=max(1, k // 4), draft_max=DRAFT_CAP, reuse_cap=max(k, min(2 * k, n_expert - 1)))


def defaults_for(info: ModelInfo) -> RoutingDefaults:
    return routing_defaults(info.n_expert, info.n_expert_used)


@dataclass
class GenerationConfig:
    mode: str = "s2moe"
    n_predict: int = 128
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # RANDOM_SEED (-1): drawn at random when resolved, as llama.cpp's -s -1
    # llama.cpp's sampler chain (engine.decoding.sampling), its defaults; repeat_last_n -1: the whole context
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N
    # None: not given, the model's routing decides (resolved(info), defaults_for)
    draft_topk: int | None = None  # k_d
    # not None by default: callers size a decoder's verification batch from it before reading a model
    draft_max: int | None = DRAFT_CAP  # cap on draft length
    utility: bool = True  # routing-aware expansion; False: fixed draft length
    threshold: float = 1.0  # utility threshold
    reuse_strength: float = 0.5  # α of reuse-aware gating; 0 turns gating off (lossless)
    # with gating on and under a memory budget, every verification's rows, a plain step's one row too, are also
    # biased toward the experts in memory by this strength (the same margin rule as α's): borderline choices move
    # onto experts that cost no fetch. 0: off.
    memory_strength: float = 0.3
    reuse_cap: int | None = None  # |E*|
    # s2moe with the utility rule: where the context repeats itself, draft the tokens that followed the
    # repeated n-gram (no draft pass) when the rule says they pay, else the model's own chain
    lookup: bool = True
    # ... and where it does not, copy from this decoder's earlier generations of other prompts (with lookup)
    lookup_session: bool = True
    # ... and where a copy from the context runs into the context's end (a loop), it goes on round the loop; False:
    # it stops there, as prompt lookup does
    lookup_periodic: bool = True
    # ... with these of the copy rule's refinements switched off (drafting.copies.COPY_REFINEMENTS), for an
    # ablation that measures what each one pays; empty: the whole rule
    copy_without: frozenset[str] = frozenset()
    conf_p_min: float = 0.5  # `conf` mode's stop probability
    tree_width: int = 2  # tree modes: candidates drafted per expanded node (top-b)
    tree_max_nodes: int = 8  # tree modes: nodes a verification takes at most
    # which experts self-drafting passes (chain or tree) read: "router", the router's top-k_d; "resident", its
    # best-ranked among the experts in memory (under a memory budget: drafts that fetch nothing, and are accepted
    # less often); None: the router's
    draft_experts: str | None = None
    stop_at_eos: bool = True
    cost: CostConstants | None = None  # from a device profile; measured at start-up when None
    # record a trace (engine.measure.trace): draft to the cap whatever the mode's rule says, noting what it would have
    # kept, and keep every verification's routing in its Iteration event
    trace: bool = False

    def sampling(self, n_ctx: int | None = None) -> Sampling:
        """The sampler chain of this config; with n_ctx, repeat_last_n -1 becomes the whole context."""
        return Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=n_ctx if self.repeat_last_n == -1 and n_ctx else self.repeat_last_n,
        )

    def resolved(self, info: ModelInfo) -> GenerationConfig:
        """This config with every setting it leaves to the model filled in from the model's routing."""
        d = defaults_for(info)
        return replace(
            self,
            seed=random_seed() if self.seed == RANDOM_SEED else self.seed,
            draft_topk=d.draft_topk if self.draft_topk is None else self.draft_topk,
            draft_max=d.draft_max if self.draft_max is None else self.draft_max,
            reuse_cap=d.reuse_cap if self.reuse_cap is None else self.reuse_cap,
        )

    def validate(self, info: ModelInfo | None = None) -> None:
        """Check the values given; with info, check them against that model once resolved."""
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.n_predict < 1:
            raise ConfigError(f"{OPTION} must be at least 1", option="n_predict")
        check_seed(self.seed)
        self.sampling().validate()
        if self.draft_max is not None and (self.draft_max < 1 or self.draft_max > 64):
            raise ConfigError(f"{OPTION} must be between 1 and 64", option="draft_max")
        if self.draft_topk is not None and self.draft_topk < 1:
            raise ConfigError(f"{OPTION} must be ≥ 1", option="draft_topk")
        if self.reuse_strength < 0:
            raise ConfigError(f"{OPTION} must be ≥ 0", option="reuse_strength")
        if self.memory_strength < 0:
            raise ConfigError(f"{OPTION} must be ≥ 0", option="memory_strength")
        if self.threshold < 0:
            raise ConfigError(f"{OPTION} must be ≥ 0", option="threshold")
        if self.reuse_cap is not None and self.reuse_cap < 1:
            raise ConfigError(f"{OPTION} must be ≥ 1", option="reuse_cap")
        if self.tree_width < 1:
            raise ConfigError(f"{OPTION} must be ≥ 1", option="tree_width")
        if self.draft_experts not in (None,) + DRAFT_EXPERTS:
            raise ConfigError(f"{OPTION} must be one of {', '.join(DRAFT_EXPERTS)}", option="draft_experts")
        if not 1 <= self.tree_max_nodes <= 64:
            raise ConfigError(f"{OPTION} must be between 1 and 64", option="tree_max_nodes")
        if isinstance(self.copy_without, str):  # a string is a set of its letters
            raise ConfigError(f"copy_without is a set of refinement names, not the string {self.copy_without!r}")
        unknown = sorted(set(self.copy_without) - set(COPY_REFINEMENTS))
        if unknown:
            raise ConfigError(f"unknown copy refinement {unknown[0]!r} (choose from {', '.join(COPY_REFINEMENTS)})")
        if self.trace and self.mode not in TRACE_MODES:
            raise ConfigError(
                f"a trace drafts with the model's own experts to the cap: mode {self.mode!r} cannot "
                f"record one (choose from {', '.join(TRACE_MODES)})"
            )
        if info is None:
            return
        if self.mode in MOE_MODES and not info.is_moe:
            raise ConfigError(
                f"mode {self.mode!r} needs a Mixture-of-Experts model; {info.path.name} is dense "
                "(only plain decoding, mode ar, applies)"
            )
        if self.mode == "ls" and info.gating == GATING_SOFTMAX_WEIGHT:
            raise ConfigError(
                f"mode ls cannot skip {info.path.name}'s experts: a softmax over the kept weights "
                "turns weight 0 into a share of the output"
            )
        if info.is_moe and self.mode in MOE_MODES:
            if info.n_expert_used < 2:
                raise ConfigError(
                    f"mode {self.mode!r} drafts with fewer experts per token than the model uses, and "
                    f"{info.path.name} routes each token to a single expert: self-speculation is "
                    "impossible on it (modes ar and lookup apply)"
                )
            cfg = self.resolved(info)
            assert cfg.draft_topk is not None and cfg.reuse_cap is not None  # resolved() filled them in
            if cfg.draft_topk >= info.n_expert_used:
                raise ConfigError(
                    f"{OPTION} {cfg.draft_topk} must be below the model's experts per token ({info.n_expert_used})",
                    option="draft_topk",
                )
            if cfg.reuse_cap < info.n_expert_used:
                raise ConfigError(
                    f"{OPTION} must be ≥ the model's experts per token ({info.n_expert_used})", option="reuse_cap"
                )


def default_reuse_cap(info: ModelInfo) -> int:
    return defaults_for(info).reuse_cap


def config_dict(cfg: GenerationConfig, reuse_cap: int) -> dict[str, object]:
    d = {k: v for k, v in cfg.__dict__.items() if k != "cost"}
    d["reuse_cap"] = reuse_cap
    return d
