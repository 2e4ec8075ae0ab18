"""Decoding traces: what one generation drafted, accepted and routed, for replay under another device's costs.

A trace is recorded with drafting forced to the cap (GenerationConfig.trace): every iteration holds the whole
draft chain the model's own experts proposed, so that any stopping rule (the utility rule under other
constants, a confidence threshold, a fixed length) can be replayed on it (engine.measure.projection). It is JSONL:

    {"s2moe_trace": 1, "model": ..., "n_layer": 6, "n_expert": 64, "k": 8, "k_d": 2, "expert_bytes": ...,
     "prompt": [token, ...], ...}
    {"committed": [..], "accepted": 3, "drafted": [[token, q, chain, IDS], ...], "pending": IDS,
     "rows": [IDS, ...], "gated": [IDS | null, ...], "t_draft": s, "t_verify": s, "t_host": s,
     "would": [true, 2] | null,
     "misses": [verify, draft] | null}
    ...
    {"end": {"n_tokens": 64, "seconds": 1.2, "prefill": 0.01, "stop": "length"}}

IDS is one token's experts, [n_layer, k] ids in the router's order (best first; -1 where a layer has no
experts), as base64 of little-endian uint8 (uint16 for models of 255 experts or more). `drafted[i]`'s ids are
the target experts its draft pass predicted; `pending` those of the pending token (the first draft pass);
`rows[j]` what the verification's router chose for row j (the pending token, then each drafted token),
`gated[j]` what the verification read after reuse gating (null: the router's choice). With 6 layers of top-8
a row is 64 characters; an iteration of a full 8-token chain is about 2 KB.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..decoding.hook import Routing
from ..errors import ConfigError
from ..events import Finished, ForcedDraft, Iteration, Prefilled, Started
from ..files import check_writable, parse_json, read_bounded, write_atomic
from ..modes import DRAFT_EXPERTS

if TYPE_CHECKING:
    from ..model_info import ModelInfo
    from ..offload import Offloader

# [n_layer, k] expert ids of one token (-1: none), or a stack of them
Ids = npt.NDArray[np.int64]

TRACE_VERSION = 1
OPTIONAL_HEADER_FIELDS = ("cost", "budget", "draft_experts", "prompt")  # absent: their defaults
# 10k tokens of a 48-layer, 128-expert model stay far below this; the bound keeps a wrong file from being read
# into memory whole
MAX_TRACE_BYTES = 1 << 30


@dataclass(frozen=True)
class TraceHeader:
    model: str
    fingerprint: str
    n_layer: int
    n_expert: int
    k: int  # experts per token
    k_d: int  # experts per token in a draft pass
    expert_bytes: float  # one expert of one MoE layer (mean over layers)
    non_expert_bytes: int  # every other tensor
    draft_max: int  # the cap the drafts ran to
    n_predict: int
    mode: str  # the mode whose rule `would` records
    threshold: float
    reuse_strength: float  # > 0: the verification rows were gated
    conf_p_min: float
    temperature: float
    prompt_tokens: int
    cost: dict[str, Any] | None = None  # the constants the rule decided with (CostConstants fields, seconds)
    # under a memory budget: {"auto": bool, "budget_bytes", "hot_bytes", "cache_bytes", "pinned": [[layer, expert]…]},
    # and where bench read the disk around that budget, "storage": {"qd1_gb_s", "qd8_gb_s", "readings"}
    budget: dict[str, Any] | None = None
    # what the draft passes read (GenerationConfig.draft_experts): "router", its top k_d, fetched where missing;
    # "resident", only experts in memory, so that they fetch nothing. Not recorded before the router's became
    # the default: such a trace reads as "router", though under a budget it drafted from resident experts.
    draft_experts: str = "router"
    # the prompt's token ids, so that a replay can find where the text repeats itself (copies from the context);
    # not recorded before copies were replayed
    prompt: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Drafted:
    token: int
    prob: float  # draft probability of the token
    chain: float  # product of draft probabilities up to it
    predicted: Ids  # [n_layer, k] the target experts its draft pass routed it to


@dataclass(frozen=True)
class TraceStep:
    committed: tuple[int, ...]
    accepted: int  # drafted tokens the target accepted
    drafted: tuple[Drafted, ...]  # the whole chain, to the cap
    pending: Ids | None  # [n_layer, k] the pending token's predicted experts (None: no draft)
    rows: Ids  # [rows, n_layer, k] the verification's router's choice per row
    gated: Ids  # [rows, n_layer, k] what the verification read (== rows without gating)
    t_draft: float
    t_verify: float
    would: ForcedDraft | None = None  # what the mode's own rule would have done
    verify_misses: int | None = None  # experts the verification found not in memory (under a budget)
    draft_misses: int | None = None
    t_host: float = 0.0  # the decoding loop's own time in the iteration, outside both


@dataclass
class Trace:
    header: TraceHeader
    steps: list[TraceStep] = field(default_factory=list)
    n_tokens: int = 0
    seconds: float = 0.0  # the whole generation, prefill included
    stop: str = "length"
    name: str = ""  # the file read, as given (a folder's file with the folder): what errors call it
    prefill: float = 0.0  # seconds of the prompt's prefill

    def with_budget(self, budget: dict[str, Any] | None) -> Trace:
        return replace(self, header=replace(self.header, budget=budget))


# -- recording -------------------------------------------------------------------------------------------
class TraceRecorder:
    """Builds a Trace from the events of a traced generation (GenerationConfig.trace) of the model `info`."""

    def __init__(self, info: ModelInfo):
        self.fingerprint = info.fingerprint
        self.expert_bytes, self.non_expert_bytes = model_sizes(info.path)
        self.trace: Trace | None = None
        self._left: float | None = None  # when the previous event's handling here ended

    def add(self, event: object) -> None:
        arrived = time.perf_counter()
        self._add(event, arrived)
        # the loop's own time per iteration is what passes between events outside this recorder, the draft
        # passes and the verification
        self._left = time.perf_counter()

    def _add(self, event: object, arrived: float) -> None:
        if isinstance(event, Started):
            c = event.config
            if not c.get("trace"):
                raise ValueError("a trace records a generation run with GenerationConfig.trace")
            self.trace = Trace(
                TraceHeader(
                    model=event.model,
                    fingerprint=self.fingerprint,
                    n_layer=event.n_layer,
                    n_expert=event.n_expert,
                    k=event.k,
                    k_d=int(c["draft_topk"]),
                    expert_bytes=self.expert_bytes,
                    non_expert_bytes=self.non_expert_bytes,
                    draft_max=int(c["draft_max"]),
                    n_predict=int(c["n_predict"]),
                    mode=c["mode"],
                    threshold=float(c["threshold"]),
                    reuse_strength=float(c["reuse_strength"]) if c["mode"] == "s2moe" else 0.0,
                    conf_p_min=float(c["conf_p_min"]),
                    temperature=float(c["temperature"]),
                    prompt_tokens=len(event.prompt_tokens),
                    cost=None if event.cost is None else {k: v for k, v in asdict(event.cost).items()},
                    draft_experts=c.get("draft_experts") or "router",
                    prompt=tuple(event.prompt_tokens),
                )
            )
            return
        if not isinstance(event, (Prefilled, Iteration, Finished)):
            return
        trace = self.trace
        if trace is None:
            raise ValueError("a trace starts with its generation's Started event")
        if isinstance(event, Prefilled):
            trace.prefill = event.seconds
        elif isinstance(event, Iteration):
            host = 0.0 if self._left is None else max(0.0, arrived - self._left - event.t_draft - event.t_verify)
            trace.steps.append(replace(_step(event, trace.header), t_host=host))
        else:
            trace.n_tokens, trace.seconds, trace.stop = event.n_tokens, event.seconds, event.stop_reason


def _step(ev: Iteration, h: TraceHeader) -> TraceStep:
    shape = (h.n_layer, h.k)
    drafted = tuple(Drafted(c.token, c.prob, c.chain_prob, _ids(c.predicted, shape)) for c in ev.candidates if c.kept)
    r = ev.verify_routing
    n_rows = ev.verify_tokens
    if r is None:  # only a model without the routing hook: nothing to replay but the tokens
        rows = np.full((n_rows,) + shape, -1, np.int64)
        gated = rows
    else:
        assert isinstance(r, Routing)  # what the decoder records there
        seen = np.arange(n_rows)[None, :] < r.rows[:, None]  # [n_layer, rows]
        rows = np.where(seen[:, :, None], r.orig[:, :n_rows], -1).transpose(1, 0, 2)
        gated = np.where(seen[:, :, None], r.used[:, :n_rows], -1).transpose(1, 0, 2)
    misses = (
        None if ev.verify_misses is None else int(np.sum(ev.verify_misses)),
        None if ev.draft_misses is None else int(np.sum(ev.draft_misses)),
    )
    return TraceStep(
        tuple(ev.committed),
        len(ev.accepted),
        drafted,
        None if ev.pending_predicted is None else _ids(ev.pending_predicted, shape),
        rows.astype(np.int64),
        gated.astype(np.int64),
        ev.t_draft,
        ev.t_verify,
        ev.forced,
        *misses,
    )


def _ids(a: npt.ArrayLike | None, shape: tuple[int, int]) -> Ids:
    if a is None:  # trace modes draft with the model's own experts, whose passes always route
        raise ValueError("a traced draft has no predicted experts")
    a = np.asarray(a, np.int64)
    return np.where(a >= 0, a, -1).reshape(shape)


def model_sizes(path: str | os.PathLike[str]) -> tuple[float, int]:
    """(bytes of one expert, mean over MoE layers; bytes of everything else) of a GGUF MoE model."""
    from ..offload import expert_map

    emap = expert_map(path)
    eb = emap.expert_bytes[list(emap.moe_layers)]
    return float(eb.mean()), int(emap.file_bytes - emap.total_expert_bytes)


# -- writing ---------------------------------------------------------------------------------------------
def _dtype(n_expert: int) -> np.dtype[np.unsignedinteger[Any]]:
    return np.dtype("<u1") if n_expert < 255 else np.dtype("<u2")


def _encode(ids: Ids, n_expert: int) -> str:
    dt = _dtype(n_expert)
    sentinel = np.iinfo(dt).max
    return base64.b64encode(np.where(ids >= 0, ids, sentinel).astype(dt).tobytes()).decode("ascii")


def dumps(trace: Trace) -> str:
    h = trace.header
    lines = [json.dumps({"s2moe_trace": TRACE_VERSION, **asdict(h)})]
    for s in trace.steps:

        def enc(a: Ids) -> str:
            return _encode(a, h.n_expert)

        gated = [None if np.array_equal(g, r) else enc(g) for r, g in zip(s.rows, s.gated)]
        lines.append(
            json.dumps(
                {
                    "committed": list(s.committed),
                    "accepted": s.accepted,
                    "drafted": [[d.token, d.prob, d.chain, enc(d.predicted)] for d in s.drafted],
                    "pending": None if s.pending is None else enc(s.pending),
                    "rows": [enc(r) for r in s.rows],
                    "gated": gated,
                    "t_draft": s.t_draft,
                    "t_verify": s.t_verify,
                    "t_host": s.t_host,
                    "would": None if s.would is None else [s.would.would_draft, s.would.would_keep],
                    "misses": None if s.verify_misses is None else [s.verify_misses, s.draft_misses],
                }
            )
        )
    lines.append(
        json.dumps(
            {
                "end": {
                    "n_tokens": trace.n_tokens,
                    "seconds": trace.seconds,
                    "prefill": trace.prefill,
                    "stop": trace.stop,
                }
            }
        )
    )
    return "\n".join(lines) + "\n"


def write_trace(path: str | os.PathLike[str], trace: Trace) -> None:
    """Write atomically (files.write_atomic): an interruption leaves the old file or the new one, never half of
    one."""
    write_atomic(path, dumps(trace), "trace")


# -- reading ---------------------------------------------------------------------------------------------
class _Bad(Exception):
    pass


def _int(v: object, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _Bad(f"{what} must be a whole number ≥ {lo}, got {_shown(v)}")
    return v


def _num(v: object, what: str, lo: float = 0.0, hi: float = math.inf) -> float:
    try:
        # an integer of a few thousand digits is JSON too: beyond a float, and math.isfinite cannot take it
        x = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:
        x = math.nan
    if not math.isfinite(x) or not lo <= x <= hi:
        raise _Bad(f"{what} must be a number in [{lo:g}, {hi:g}], got {_shown(v)}")
    return x


def _shown(v: object) -> str:
    """A value in an error's one line: a list or a number of thousands of characters, cut."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"a number of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _decode(text: object, h: TraceHeader, what: str) -> Ids:
    if not isinstance(text, str):
        raise _Bad(f"{what} must be base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _Bad(f"{what} is not base64") from None
    dt = _dtype(h.n_expert)
    if len(raw) != h.n_layer * h.k * dt.itemsize:
        raise _Bad(f"{what} holds {len(raw)} bytes, not {h.n_layer} layers × {h.k} experts")
    a = np.frombuffer(raw, dt).astype(np.int64).reshape(h.n_layer, h.k)
    a[a == np.iinfo(dt).max] = -1
    if (a >= h.n_expert).any():
        raise _Bad(f"{what} names an expert ≥ {h.n_expert}")
    return a


def _header(obj: object) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("s2moe_trace") != TRACE_VERSION:
        raise _Bad(f'not an s2moe trace (version {TRACE_VERSION}): the first line must carry "s2moe_trace"')
    names = [f for f in TraceHeader.__dataclass_fields__]
    missing = [n for n in names if n not in obj and n not in OPTIONAL_HEADER_FIELDS]
    if missing:
        raise _Bad(f"header: missing field {missing[0]}")
    for key in ("n_layer", "n_expert", "k", "k_d", "draft_max", "n_predict"):
        _int(obj[key], f"header field {key}", 1)
    _int(obj["non_expert_bytes"], "header field non_expert_bytes")
    _int(obj["prompt_tokens"], "header field prompt_tokens")
    _num(obj["expert_bytes"], "header field expert_bytes")
    for key in ("threshold", "reuse_strength", "conf_p_min", "temperature"):
        _num(obj[key], f"header field {key}")
    for key in ("model", "fingerprint", "mode"):
        if not isinstance(obj[key], str):
            raise _Bad(f"header field {key} must be text")
    if obj["k"] > obj["n_expert"] or obj["k_d"] > obj["k"]:
        raise _Bad("header: k_d ≤ k ≤ n_expert does not hold")
    for key in ("cost", "budget"):
        if obj.get(key) is not None and not isinstance(obj[key], dict):
            raise _Bad(f"header field {key} must be a mapping")
    cost = obj.get("cost")
    if cost is not None:
        for key in ("t_ar", "c_draft", "t_exp", "t_tok"):
            _num(cost.get(key), f"header cost field {key}")
    budget = obj.get("budget")
    if budget is not None:
        for key in ("budget_bytes", "hot_bytes", "cache_bytes"):
            _int(budget.get(key), f"header budget field {key}")
        if not isinstance(budget.get("auto"), bool):
            raise _Bad("header budget field auto must be true or false")
        pinned = budget.get("pinned")
        if not isinstance(pinned, list) or not all(
            isinstance(p, list)
            and len(p) == 2
            and 0 <= _int(p[0], "pinned layer") < obj["n_layer"]
            and 0 <= _int(p[1], "pinned expert") < obj["n_expert"]
            for p in pinned
        ):
            raise _Bad("header budget field pinned must be a list of [layer, expert] pairs inside the model")
        storage = budget.get("storage")
        if storage is not None:
            if not isinstance(storage, dict):
                raise _Bad("header budget field storage must be a mapping")
            for key in ("qd1_gb_s", "qd8_gb_s"):
                if _num(storage.get(key), f"header storage field {key}") <= 0:
                    raise _Bad(f"header storage field {key} must be above 0")
            _int(storage.get("readings"), "header storage field readings", 1)
    if obj.get("draft_experts", "router") not in DRAFT_EXPERTS:
        raise _Bad(f"header field draft_experts must be one of {', '.join(DRAFT_EXPERTS)}")
    prompt = obj.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, list) or len(prompt) != obj["prompt_tokens"]:
            raise _Bad(f"header field prompt must list the prompt's {obj['prompt_tokens']} token ids")
        for t in prompt:
            _int(t, "a prompt token id")
        prompt = tuple(prompt)
    fields = {n: obj.get(n, TraceHeader.__dataclass_fields__[n].default) for n in names}
    return TraceHeader(**{**fields, "prompt": prompt})


def _iteration(obj: object, h: TraceHeader) -> TraceStep:
    if not isinstance(obj, dict):
        raise _Bad("expected an object")
    for key in ("committed", "accepted", "drafted", "pending", "rows", "gated", "t_draft", "t_verify"):
        if key not in obj:
            raise _Bad(f"missing field {key}")
    committed = obj["committed"]
    if not isinstance(committed, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in committed
    ):
        raise _Bad("field committed must be a list of token ids")
    drafted_raw = obj["drafted"]
    if not isinstance(drafted_raw, list) or len(drafted_raw) > h.draft_max:
        raise _Bad(f"field drafted must be a list of at most {h.draft_max} drafted tokens")
    drafted = []
    for i, d in enumerate(drafted_raw):
        if not isinstance(d, list) or len(d) != 4:
            raise _Bad(f"drafted[{i}] must be [token, prob, chain, ids]")
        drafted.append(
            Drafted(
                _int(d[0], f"drafted[{i}] token"),
                _num(d[1], f"drafted[{i}] prob", 0, 1),
                _num(d[2], f"drafted[{i}] chain", 0, 1),
                _decode(d[3], h, f"drafted[{i}] ids"),
            )
        )
    accepted = _int(obj["accepted"], "field accepted")
    if accepted > len(drafted):
        raise _Bad(f"field accepted ({accepted}) exceeds the {len(drafted)} drafted tokens")
    if len(committed) > accepted + 1:
        raise _Bad(f"field committed holds {len(committed)} tokens, more than accepted + 1")
    rows_raw, gated_raw = obj["rows"], obj["gated"]
    if not isinstance(rows_raw, list) or len(rows_raw) != len(drafted) + 1:
        raise _Bad(f"field rows must hold one entry per verified token ({len(drafted) + 1})")
    if not isinstance(gated_raw, list) or len(gated_raw) != len(rows_raw):
        raise _Bad("field gated must hold one entry (or null) per row")
    rows = np.stack([_decode(r, h, f"rows[{j}]") for j, r in enumerate(rows_raw)])
    gated = np.stack([rows[j] if g is None else _decode(g, h, f"gated[{j}]") for j, g in enumerate(gated_raw)])
    pending = None if obj["pending"] is None else _decode(obj["pending"], h, "pending")
    if drafted and pending is None:
        raise _Bad("field pending is null but the iteration drafted")
    would = obj.get("would")
    if would is not None:
        if not (isinstance(would, list) and len(would) == 2 and isinstance(would[0], bool)):
            raise _Bad("field would must be [drafting, kept] or null")
        would = ForcedDraft(would[0], _int(would[1], "would kept"))
    misses = obj.get("misses")
    vm = dm = None
    if misses is not None:
        if not (isinstance(misses, list) and len(misses) == 2):
            raise _Bad("field misses must be [verification, draft] or null")
        vm = _int(misses[0], "misses of the verification")
        dm = None if misses[1] is None else _int(misses[1], "misses of the draft")
    return TraceStep(
        tuple(committed),
        accepted,
        tuple(drafted),
        pending,
        rows,
        gated,
        _num(obj["t_draft"], "field t_draft"),
        _num(obj["t_verify"], "field t_verify"),
        would,
        vm,
        dm,
        _num(obj.get("t_host", 0.0), "field t_host"),
    )


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """A trace file, checked line by line; ConfigError naming the file (as given: a folder's file with the
    folder) and line of the first problem."""
    path = Path(path)
    try:
        text = read_bounded(path, "trace", MAX_TRACE_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"trace {path}: not UTF-8 text (an invalid byte at offset {e.start})") from None
    lines = text.splitlines()
    trace = None
    ended = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {path} line {n}"
        if ended:
            raise ConfigError(f"{where}: text after the end record")
        obj = parse_json(line, where)
        try:
            if trace is None:
                trace = Trace(_header(obj), name=str(path))
            elif isinstance(obj, dict) and "end" in obj:
                end = obj["end"]
                if not isinstance(end, dict):
                    raise _Bad("field end must be a mapping")
                trace.n_tokens = _int(end.get("n_tokens"), "end field n_tokens")
                trace.seconds = _num(end.get("seconds"), "end field seconds")
                trace.prefill = _num(end.get("prefill", 0.0), "end field prefill")
                trace.stop = str(end.get("stop", ""))
                ended = True
            else:
                trace.steps.append(_iteration(obj, trace.header))
        except _Bad as e:
            raise ConfigError(f"{where}: {e}") from None
    if trace is None:
        raise ConfigError(f"trace {path}: empty")
    if not ended:
        raise ConfigError(f"trace {path}: no end record (cut short?)")
    if sum(len(s.committed) for s in trace.steps) != trace.n_tokens:
        raise ConfigError(
            f"trace {path}: its iterations commit {sum(len(s.committed) for s in trace.steps)} "
            f"tokens, its end record says {trace.n_tokens}"
        )
    return trace


def trace_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The trace files named: files as given, folders as their *.jsonl files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise ConfigError(f"trace folder {p} holds no *.jsonl files")
            out += found
        else:
            out.append(p)
    return out


def check_trace_path(path: str | os.PathLike[str]) -> Path:
    """Where a trace will be written, checked before minutes of decoding: its folder exists and takes a new
    file (files.check_writable), it is no folder."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"trace {path} is a folder: name a file")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write trace {path}: folder {path.parent} does not exist")
    check_writable(path, "trace")
    return path


def record_storage(paths: Iterable[str | os.PathLike[str]], storage: dict[str, Any]) -> None:
    """Add to traces recorded under a budget the disk as read around their run ({"qd1_gb_s", "qd8_gb_s",
    "readings"}), so that a replay on the same device can price a fetch at the disk of that day."""
    for path in paths:
        trace = read_trace(path)
        if trace.header.budget is not None:
            write_trace(path, trace.with_budget({**trace.header.budget, "storage": storage}))


def budget_record(offloader: Offloader, hot_ranked: Sequence[Sequence[int]], auto: bool) -> dict[str, Any] | None:
    """What a trace recorded under a memory budget keeps of it: the plan and the hot experts pinned (the same
    selection offload_decoder pins)."""
    from ..offload import rank_counts, select_hot_experts

    plan = offloader.plan
    if plan is None:
        return None
    pinned: list[list[int]] = []
    if hot_ranked and plan.hot_bytes > 0:
        emap = offloader.emap
        pinned = [list(p) for p in select_hot_experts(rank_counts(hot_ranked, emap), emap.expert_bytes, plan.hot_bytes)]
    return {
        "auto": auto,
        "budget_bytes": int(offloader.budget_bytes or plan.budget_bytes),
        "hot_bytes": int(plan.hot_bytes),
        "cache_bytes": int(plan.cache_bytes),
        "pinned": pinned,
    }
