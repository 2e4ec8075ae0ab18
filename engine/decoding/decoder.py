"""The decoder: one llama.cpp context, one KV cache shared by draft and target, one loop for every mode.

Invariant between iterations: the KV cache holds target-computed entries for every committed token
except the newest one (the "pending" token, whose logits come from the next target pass). Draft passes
append temporary entries after it; they are removed before verification, and after verification only
the entries of accepted tokens remain.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..drafting.copies import LookupDrafter, LookupOrSelfDrafter
from ..drafting.drafters import CascadeDrafter, Drafter, IndependentDrafter, LayerSkipDrafter, Proposal, SelfDrafter
from ..drafting.ngrams import EarlierText
from ..drafting.stoprules import ConfidenceStop, FixedLength, RecordingStop, UtilityStop, rule_cost
from ..errors import OPTION, ConfigError, ContextError, ModelError, held_steps
from ..events import CostConstants, Finished, Iteration, Prefilled, Started
from ..model_info import read_model_info
from ..modes import TREE_MODES
from ..offload.budget import prefill_batch_room
from .acceptance import accept
from .cost_constants import CostConstantsMixin
from .generation_config import GenerationConfig, config_dict
from .gpu import Placement
from .hook import Routing, distinct_per_layer
from .observer import ResidencySampler, VerifyObserver
from .runtime import LlamaRuntime
from .runtime_settings import DEFAULT_BATCH
from .sampling import PositionNoise, SeededSampler
from .tree import TreeDrafter, verify_tree

if TYPE_CHECKING:
    from .chat import Template

TREE_SEQS = 256  # llama.cpp's LLAMA_MAX_SEQ


class Decoder(CostConstantsMixin):
    """Loads a model once; runs generations in any mode over the same context."""

    def __init__(
        self,
        model: str,
        *,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        max_draft: int = 16,
        use_extra_bufts: bool = True,
        placement: Placement = Placement(),
        n_batch: int | None = None,
    ) -> None:
        super().__init__()
        self.info = read_model_info(model)  # refuses what llama.cpp would assert on (expert counts among it)
        self.max_draft = max_draft
        # n_batch None: llama.cpp's default, or inside a budget of a given size the largest batch (halving from
        # it) whose compute buffers fit that budget's prefill share.
        # A draft tree takes a sequence id per drafted node (up to the verification batch times a width)
        self.rt = LlamaRuntime(
            self.info,
            n_ctx=n_ctx,
            n_batch=DEFAULT_BATCH if n_batch is None else n_batch,
            batch_room=prefill_batch_room() if n_batch is None else None,
            n_threads=n_threads,
            max_verify_rows=max_draft + 1,
            use_extra_bufts=use_extra_bufts,
            placement=placement,
            n_seq_max=min(TREE_SEQS, 4 * (max_draft + 1)),
        )
        self.placement = placement
        self._pieces: dict[int, str] = {}
        self._routing_checked = not self.info.is_moe
        self.n_threads = n_threads
        self._aux: dict[tuple[object, ...], Drafter] = {}  # drafters with their own context, kept across generations
        self._rules: dict[tuple[object, ...], UtilityStop] = {}  # utility rules and what they learned, ditto
        self.earlier = EarlierText()  # what this decoder's generations read and wrote, for s2moe's copies
        self._observer: VerifyObserver | None = None
        # Record routing on plain (single-token, undrafted) steps too; off by default because it costs a
        # graph stop per layer and a plain step's routing only matters to residency/prefetch consumers.
        self.observe_plain = False
        self._tracing = False  # a trace keeps the routing of plain steps too
        self._moe_layers: np.ndarray | None = None  # [n_layer] 1 where the hook saw routing
        # An observer's residency snapshot walks the whole mapping: sampled every `residency_every`
        # iterations, and less often where that walk would take more than `residency_share` of the
        # generation's time (on a model of tens of GiB one walk takes most of a second).
        self.residency_every = 8
        self.residency_share = 0.05
        # The tokens whose target entries sequence 0 of the KV holds at positions 0.. as the last
        # generation left them (None: unknown, something else used the cache since)
        self._context: list[int] | None = None
        self._template: Template | None = None

    def attach(self, observer: VerifyObserver) -> None:
        """Let observer see every verification (one at a time: offloading)."""
        if self._observer is not None and self._observer is not observer:
            raise RuntimeError("this decoder already has an observer")
        self._observer = observer

    def detach(self, observer: VerifyObserver) -> None:
        if self._observer is observer:
            self._observer = None

    @property
    def observer(self) -> VerifyObserver | None:
        return self._observer

    def moe_layers(self) -> np.ndarray:
        """Indices of the layers the hook has seen route (every layer until a verification said)."""
        layers = np.arange(self.info.n_layer)
        return layers if self._moe_layers is None else layers[self._moe_layers > 0]

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.rt.n_ctx

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return self.rt.tokenize(text, special=special)

    @property
    def chat_template(self) -> Template:
        """The model's chat template as llama.cpp applies it (engine.decoding.chat.Template)."""
        if self._template is None:
            from .chat import model_template

            self._template = model_template(self.rt.model)
        return self._template

    def forget_context(self) -> None:
        """The KV cache is about to be used for something else than generations (a benchmark, a
        measurement): the next generation prefills its whole prompt."""
        self._context = None

    @contextmanager
    def apart_from_session(self) -> Iterator[None]:
        """Generations inside copy only from each other's text, not from what the session generated before (a
        benchmark measures the same with whatever a chat or a copy cache left); the session's text is as it
        was afterwards."""
        session, self.earlier = self.earlier, EarlierText()
        try:
            yield
        finally:
            self.earlier = session

    def piece_text(self, token: int) -> str:
        text = self._pieces.get(token)
        if text is None:
            text = self.rt.piece(token).decode("utf-8", "replace")
            self._pieces[token] = text
        return text

    def detokenize(self, tokens: Iterable[int]) -> str:
        return self.rt.detokenize(tokens)

    def check_routing_hook(self) -> None:
        """Fail clearly if llama.cpp's graph for this architecture has no routing tensors we know."""
        if self._routing_checked:
            return
        assert self.rt.hook is not None  # a MoE model's runtime installs one
        before = self.rt.hook.hooked()
        self._context = None
        self.rt.kv_clear()
        self.rt.hook.observe()
        self.rt.decode([self.rt.bos if self.rt.bos >= 0 else 0], 0, "last")
        self.rt.kv_clear()
        if self.rt.hook.hooked() == before:
            raise ModelError(
                f"{self.info.arch}: llama.cpp's graph has no 'ffn_moe_weights-N' routing tensors the hook understands; "
                "only --mode ar works for this model"
            )
        self._routing_checked = True

    @property
    def knows_memory(self) -> bool:
        """Whether the routing hook can ask which experts are in memory: a prefetcher is routed to it (under
        a memory budget). Gating toward the experts in memory acts only then."""
        hook = self.rt.hook
        return hook is not None and hook.route is not None

    def draft_experts(self, cfg: GenerationConfig) -> str:
        """What cfg's self-drafts (chain or tree) read here: "resident" where cfg asks for it under a budget
        (an observer that knows what is in memory); the router's own top-k_d otherwise, by default too: drafts
        confined to memory are accepted less often, and each rejection costs a verification that fetches
        (docs/results.md, "Drafts from the router's experts or from memory")."""
        if self._observer is not None and cfg.draft_experts == "resident":
            return "resident"
        return "router"

    def _drafter(self, cfg: GenerationConfig, cost: CostConstants | None, prompt: list[int]) -> Drafter:
        assert cfg.draft_topk is not None and cfg.draft_max is not None  # generate resolved cfg
        observer = self._observer
        allowed = observer.draft_allowed if observer is not None and self.draft_experts(cfg) == "resident" else None
        if cfg.trace:
            rule = (
                ConfidenceStop(cfg.conf_p_min)
                if cfg.mode == "conf"
                else self._utility_rule(cfg, cost)
                if cfg.mode == "s2moe" and cfg.utility
                else FixedLength()
            )
            return SelfDrafter(cfg.draft_topk, RecordingStop(rule), allowed)
        if cfg.mode == "ar":
            return Drafter()
        if cfg.mode == "conf":
            return SelfDrafter(cfg.draft_topk, ConfidenceStop(cfg.conf_p_min), allowed)
        if cfg.mode == "naive":
            key: tuple[object, ...] = ("naive", cfg.draft_topk)
            if key not in self._aux:
                self._aux[key] = IndependentDrafter(self, cfg.draft_topk, self.n_threads)
            return self._aux[key]
        if cfg.mode == "cascade":
            return CascadeDrafter(cfg.draft_topk, cfg.draft_max, allowed=allowed)
        if cfg.mode == "lookup":
            return LookupDrafter()
        if cfg.mode == "ls":
            return LayerSkipDrafter(FixedLength())
        if cfg.mode in TREE_MODES:
            if not cfg.utility:  # the fixed shape of the paper's baselines: tree_width nodes per depth
                return TreeDrafter(cfg.draft_topk, None, cfg.tree_width, cfg.tree_max_nodes, allowed)
            # tree-prob: the same rule, blind to experts (T_exp = 0), a rule of its own
            assert cost is not None  # generate measures the constants of a utility rule's modes, or is given them
            base_cost = rule_cost(cost, self.draft_experts(cfg))
            tree_cost = base_cost if cfg.mode == "tree" else replace(base_cost, t_exp=0.0)
            key = ("tree", cfg.draft_topk, cfg.threshold, tree_cost, cfg.tree_width, cfg.tree_max_nodes)
            rule = self._kept_rule(key, tree_cost, cfg)
            return TreeDrafter(cfg.draft_topk, rule, cfg.tree_width, cfg.tree_max_nodes, allowed)
        if not cfg.utility:
            return SelfDrafter(cfg.draft_topk, FixedLength(), allowed)
        rule = self._utility_rule(cfg, cost)
        chain = SelfDrafter(cfg.draft_topk, rule, allowed)
        if not (cfg.lookup and cfg.mode == "s2moe"):
            return chain
        return LookupOrSelfDrafter(
            chain,
            rule,
            self.earlier if cfg.lookup_session else None,
            prompt,
            periodic=cfg.lookup_periodic,
            without=cfg.copy_without,
        )

    def _utility_rule(self, cfg: GenerationConfig, cost: CostConstants | None) -> UtilityStop:
        assert cost is not None  # generate measures the constants of a utility rule's modes, or is given them
        # A trace's rule learns apart: what it sees is not what the mode's own generations see.
        cost = rule_cost(cost, self.draft_experts(cfg))
        return self._kept_rule(("utility", cfg.draft_topk, cfg.threshold, cost, cfg.trace), cost, cfg)

    def _kept_rule(self, key: tuple[object, ...], cost: CostConstants, cfg: GenerationConfig) -> UtilityStop:
        """The utility rule for `key` with what it learned (the first draft token's usual probability and expert
        cost, how often a probe pays, how often the target accepts its drafts): that holds for this model and
        device, not for one request, so generations with the same constants and sampler settings (drafts are
        accepted less often at a higher temperature) share it and a prompt does not pay to learn it again.
        Generations that gate or copy differently (bench's ablation rows beside s2moe in one process, tune's
        trials) see other steps, timings and acceptance, so each keeps a rule of its own.
        What a rule drafts never changes which tokens a seed commits (engine.decoding.acceptance)."""
        key = key + (
            cfg.sampling(),
            cfg.reuse_strength,
            cfg.memory_strength,
            cfg.reuse_cap,
            cfg.draft_max,
            cfg.lookup,
            cfg.lookup_session,
            cfg.lookup_periodic,
            frozenset(cfg.copy_without),
            self._untimed,
        )
        rule = self._rules.get(key)
        if rule is None:
            rule = self._rules[key] = UtilityStop(cost, cfg.threshold)
        rule.start()
        return rule

    # -- generation -------------------------------------------------------------------------------
    # Ctrl-C held once per step (its drafts, verification and text), not once per llama.cpp call: swapping the
    # handlers for every call slowed a small model's decoding measurably
    @held_steps
    def generate(
        self,
        prompt: str | list[int],
        cfg: GenerationConfig | None = None,
        should_stop: Callable[[], bool] | None = None,
        keep_context: bool = False,
    ) -> Iterator[object]:
        """The events of one generation. keep_context: the prompt's first tokens that the previous
        generation's context (its prompt and what it generated) shares keep their KV entries, and only the
        rest is prefilled — a conversation's next turn. Off, every prompt starts from an empty cache."""
        cfg = (cfg or GenerationConfig()).resolved(self.info)
        cfg.validate(self.info)
        cfg = replace(cfg, draft_experts=self.draft_experts(cfg))  # what ran, in Started's config
        assert cfg.draft_topk is not None and cfg.draft_max is not None and cfg.reuse_cap is not None  # resolved
        if cfg.draft_max > self.max_draft:
            raise ConfigError(
                f"{OPTION} {cfg.draft_max} exceeds this decoder's limit {self.max_draft}", option="draft_max"
            )
        if cfg.mode in TREE_MODES:
            # a tree's verification batch and each drafting pass fit where a chain's of draft_max would
            for option in ("tree_max_nodes", "tree_width"):
                if getattr(cfg, option) > self.max_draft:
                    raise ConfigError(
                        f"{OPTION} {getattr(cfg, option)} exceeds this decoder's limit {self.max_draft}", option=option
                    )
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_tokens:
            raise ConfigError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise ContextError(
                f"prompt has {len(prompt_tokens)} tokens but the context holds {self.n_ctx}; "
                f"shorten it or raise {OPTION}",
                option="n_ctx",
            )
        if cfg.mode != "ar":
            self.check_routing_hook()
        needs_cost = cfg.mode in ("s2moe",) + TREE_MODES and cfg.utility and cfg.cost is None
        cost = (yield from self._cost_constants(cfg)) if needs_cost else cfg.cost
        drafter = self._drafter(cfg, cost, prompt_tokens)
        gating = cfg.mode in ("s2moe", "tree") and cfg.reuse_strength > 0 and self.info.is_moe
        reuse_cap = cfg.reuse_cap
        gate = Gating(cfg.reuse_strength, reuse_cap, cfg.memory_strength) if gating else None
        k = max(self.info.n_expert_used, 1)
        # one processing for the draft and the target, one noise per position: plain sampling's tokens
        sampler = cfg.sampling(self.n_ctx)
        noise = PositionNoise(cfg.seed)
        sample = SeededSampler(sampler, noise)

        yield Started(
            cfg.mode,
            self.info.name,
            tuple(prompt_tokens),
            self.info.n_layer,
            self.info.n_expert,
            k,
            config_dict(cfg, reuse_cap),
            cost,
        )

        rt = self.rt
        hook = rt.hook
        t_start = time.perf_counter()
        head = prompt_tokens[:-1]
        kept = self._kept_prefix(head) if keep_context else 0
        self._context = None  # until this generation ends
        if kept == 0:
            rt.kv_clear()
        if hook is not None:
            hook.off()
        rt.prefill(head[kept:], kept)
        yield Prefilled(len(prompt_tokens), time.perf_counter() - t_start, kept)

        committed_all = list(prompt_tokens)  # prompt + generated; the last one is pending
        generated: list[int] = []
        stop_reason = "length"
        iteration = 0
        residency = ResidencySampler(self, t_start)
        self._tracing = cfg.trace
        while len(generated) < cfg.n_predict:
            if should_stop is not None and should_stop():
                stop_reason = "interrupted"
                break
            m = len(committed_all)  # pending token sits at position m-1
            if m > self.n_ctx:
                stop_reason = "context"
                break
            room = self.n_ctx - m  # positions left after the pending token
            max_len = min(cfg.draft_max, room, cfg.n_predict - len(generated) - 1)
            counting_drafts = self._observer is not None and drafter.drafts_in_context
            if counting_drafts and self._observer is not None:
                self._observer.start_counting()
            proposal = drafter.propose(self, committed_all, max_len, sample)
            draft_misses = self._observer.misses() if counting_drafts and self._observer is not None else None
            elsewhere = drafter.file_mappings()
            if self._observer is not None and elsewhere:
                self._observer.drafted_elsewhere(elsewhere)
            drafted = proposal.tokens
            rt.kv_remove_from(m - 1)

            if proposal.tree is not None and drafted:
                v, path, target_token = verify_tree(
                    self, proposal, committed_all[-1], m - 1, gate, sampler, committed_all, noise
                )
                accepted = len(path)
            else:
                v = self._verify([committed_all[-1]] + drafted, m - 1, proposal, gate)
                accepted, target_token = accept(drafted, v.logits, sampler, noise, committed_all)
                path = list(range(accepted))  # indices into drafted
            committed = [drafted[i] for i in path] + [target_token]
            finished_eos = False
            if cfg.stop_at_eos:
                committed, finished_eos = _cut_at_end_of_generation(committed, rt.is_eog)
            # experts the rows of committed tokens needed (pending + accepted drafts)
            if v.routing is not None:
                rows = [0] + [i + 1 for i in path]
                useful = distinct_per_layer(
                    v.routing.used[:, rows], np.minimum(v.routing.rows, accepted + 1), self.info.n_expert
                )
            else:
                useful = v.experts.copy()
            rt.kv_remove_from(m + accepted)
            committed_all.extend(committed)
            generated.extend(committed)
            iteration += 1
            event = Iteration(
                index=iteration,
                candidates=tuple(proposal.candidates),
                drafted=tuple(drafted),
                accepted=tuple(drafted[i] for i in path),
                rejected=tuple(t for i, t in enumerate(drafted) if i not in path),
                target_token=target_token,
                committed=tuple(committed),
                committed_text=self.detokenize(committed),
                draft_stop=proposal.stop,
                rollback=len(drafted) - accepted,
                kv_end=rt.kv_end(),
                n_committed=len(committed_all),
                verify_tokens=len(drafted) + 1,
                verify_experts=v.experts,
                reuse_ratio=v.reuse,
                gated_moves=v.moves,
                t_draft=proposal.seconds,
                t_verify=v.seconds,
                draft_experts=proposal.experts_read,
                useful_experts=useful,
                verify_misses=v.misses,
                verify_major_faults=v.major_faults,
                draft_misses=draft_misses,
                draft_decision=proposal.decision,
                tree_parents=None if proposal.tree is None else tuple(proposal.tree.parents),
                accepted_path=tuple(path),
                forced=proposal.forced,
                pending_predicted=proposal.pending_predicted if cfg.trace else None,
                verify_routing=v.routing if cfg.trace else None,
            )
            drafter.feedback(event)
            yield event
            snapshot = residency.sample(iteration)
            if snapshot is not None:
                yield snapshot
            if finished_eos:
                stop_reason = "eos"
                break
            if len(committed_all) > self.n_ctx and len(generated) < cfg.n_predict:
                stop_reason = "context"
                break
        seconds = time.perf_counter() - t_start
        self._keep(committed_all)
        self.earlier.add(prompt_tokens, committed_all)
        yield Finished(tuple(generated), self.detokenize(generated), len(generated), seconds, stop_reason, iteration)

    def _kept_prefix(self, head: list[int]) -> int:
        """How many of head's first tokens the KV already holds from the last generation, the cache cut
        back to them (0: nothing kept; the caller clears it)."""
        context, rt = self._context, self.rt
        if not context or rt.kv_end() != len(context):
            return 0
        n = 0
        for a, b in zip(context, head):
            if a != b:
                break
            n += 1
        if n == 0:
            return 0
        for seq in range(1, rt.n_seq_max):  # a draft tree's branches (their cells on seq 0 stay)
            rt.seq_rm(seq)
        rt.kv_remove_from(n)
        # a cache that cannot cut a sequence short (recurrent, sliding-window) keeps it whole or drops it
        return n if rt.kv_end() == n else 0

    def _keep(self, committed_all: list[int]) -> None:
        """Note what the KV holds after a generation: committed tokens at their positions, the pending one
        not yet decoded; entries beyond them (a draft accepted after an end-of-generation token) dropped."""
        n = min(self.rt.kv_end(), len(committed_all))
        self.rt.kv_remove_from(n)
        self._context = committed_all[:n]

    def _verify(
        self,
        batch: list[int],
        pos: int,
        proposal: Proposal,
        gate: Gating | None,
        layout: tuple[list[int], list[list[int]]] | None = None,
    ) -> _Verified:
        """One target pass over the pending token and the drafted ones, with what its routing read.
        layout: the rows' positions and sequence ids where they form a tree (engine.decoding.tree), not a chain."""
        rt, hook, observer = self.rt, self.rt.hook, self._observer
        k = max(self.info.n_expert_used, 1)
        # A plain step needs no routing record: one token reads k experts in every MoE layer. Skipping
        # the hook there saves its per-layer graph stop, unless prefetching or a consumer needs ids.
        plain_unobserved = (
            hook is not None
            and len(batch) == 1
            and self._moe_layers is not None
            and not self.observe_plain
            and not self._tracing
            and hook.route is None
        )
        memory = gate is not None and gate.memory > 0 and self.knows_memory
        batch_gate = gate is not None and len(batch) > 1
        if hook is not None:
            if gate is not None and (batch_gate or memory):
                hook.gate(
                    gate.strength if batch_gate else 0.0,
                    gate.cap,
                    [1.0] + proposal.chain,
                    memory=gate.memory if memory else 0.0,
                )
            elif plain_unobserved:
                hook.off()
            else:
                hook.observe()
        counting = observer is not None and hook is not None and not plain_unobserved
        if observer is not None:
            observer.verifying(proposal.predicted if len(batch) > 1 else None, k if len(batch) > 1 else 0)
        if counting and observer is not None:
            observer.start_counting()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt if counting else 0
        t0 = time.perf_counter()
        try:
            logits = rt.decode(batch, pos, "all") if layout is None else rt.decode_tree(batch, *layout)
        finally:
            if observer is not None:
                observer.verified()
        seconds = time.perf_counter() - t0
        assert logits is not None  # the batch holds the pending token at least
        # Offloaded: the page faults that had to wait for storage. Not a predictor (known only after
        # the fact) but it tells how much of the latency the residency snapshot could not foresee.
        major_faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0 if counting else None
        if hook is None:
            n_layer = self.info.n_layer
            return _Verified(logits, seconds, None, np.zeros(n_layer, int), np.zeros(n_layer), 0, None, major_faults)
        if plain_unobserved and self._moe_layers is not None:
            return _Verified(
                logits, seconds, None, self._moe_layers * k, self._moe_layers.astype(float), 0, None, major_faults
            )
        routing = hook.snapshot(len(batch))
        if self._moe_layers is None:
            self._moe_layers = (routing.rows > 0).astype(int)
        experts = routing.used_mask(self.info.n_expert).sum(axis=1)
        rows = np.maximum(routing.rows, 1)
        reuse = np.where(routing.rows > 0, experts / (rows * k), 0.0)
        moves = _moves(routing) if hook.mode == "gate" else 0
        misses = observer.misses() if counting and observer is not None else None
        return _Verified(logits, seconds, routing, experts, reuse, moves, misses, major_faults)

    def close(self) -> None:
        for aux in self._aux.values():
            aux.close()
        self._aux.clear()
        self.rt.close()


@dataclass(frozen=True)
class Gating:
    """Reuse-aware gating of a generation's verifications: toward the batch's E* (strength α, cap experts)
    where tokens were drafted and, with memory > 0 (its strength), toward the experts in memory in every one."""

    strength: float
    cap: int
    memory: float


@dataclass
class _Verified:
    logits: np.ndarray
    seconds: float
    routing: Routing | None  # when the hook recorded this pass
    experts: np.ndarray  # [n_layer] distinct experts read
    reuse: np.ndarray  # [n_layer] reuse ratio
    moves: int  # selections gating moved
    misses: np.ndarray | None  # [n_layer] experts read that were not in memory (offloaded)
    major_faults: int | None  # page faults that waited for storage (offloaded)


def _cut_at_end_of_generation(tokens: list[int], is_eog: Callable[[int], bool]) -> tuple[list[int], bool]:
    """The tokens before the first end-of-generation token, and whether there was one."""
    for i, t in enumerate(tokens):
        if is_eog(t):
            return tokens[:i], True
    return tokens, False


def _moves(routing: Routing) -> int:
    """Expert selections that gating moved away from the router's own choice."""
    used, orig = routing.used, routing.orig
    same = (used[..., :, None] == orig[..., None, :]).any(axis=-1)
    return int((~same & (used >= 0)).sum())


def run(decoder: Decoder, prompt: str | list[int], cfg: GenerationConfig, **kw: Any) -> list[object]:
    """Run a generation to the end and return its events (a convenience for tests and scripts)."""
    return list(decoder.generate(prompt, replace(cfg), **kw))
