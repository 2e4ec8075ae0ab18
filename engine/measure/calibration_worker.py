"""The cold worker: calibration's timings under a memory budget, in a process of their own.

A budget is a memory cgroup, so what is timed under it must run in a separate process placed in one:
run_cold (the parent's side, which the budget step calls) starts this module as
`python -m s2moe.engine.measure.calibration_worker --cold-worker JSON` in a fresh cgroup and reads the JSON
lines it writes (progress, the budget it sized, the pinned bytes, then the result or the error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..decoding.gpu import Placement
from ..decoding.runtime_settings import DEFAULT_BATCH
from ..errors import S2MoEError
from ..offload import Budget, fmt_bytes, process_anon_bytes, run_in_budget
from .calibration_measures import Measurement, verify_sizes
from .costmodel import time_steps, verify_samples
from .trace import budget_record

if TYPE_CHECKING:  # loading llama.cpp is the worker's to do when it runs, not this module's import
    from ..decoding.runtime import LlamaRuntime
    from ..offload.native import NativePrefetch


def _cold_worker(cfg: dict[str, Any]) -> int:
    """Runs inside the budget cgroup (python -m s2moe.engine.measure.calibration_worker --cold-worker JSON): loads
    the model mmap-backed, offloads it as decoding does (pinned weights, code and hot experts, the routing hook's
    just-in-time prefetch and miss count) and times plain and draft steps and verification batches."""
    from ..decoding.decoder import Decoder
    from ..offload import Budget, current_budget_cgroup, offload_decoder

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # a context of at least one batch, so that llama.cpp does not cap the batch a budget is sized with
    n_batch = cfg.get("n_batch")  # None: llama.cpp's, or what fits the budget's prefill share
    decoder = Decoder(
        cfg["model"],
        n_ctx=max(256, n_batch or DEFAULT_BATCH),
        n_threads=cfg.get("threads"),
        max_draft=cfg["cap"],
        use_extra_bufts=False,
        placement=Placement(**cfg.get("placement", {})),
        n_batch=n_batch,
    )
    rt = decoder.rt

    def warm_up() -> None:  # every graph shape this worker times, so that an auto budget counts them
        time_steps(rt, cfg["k_draft"], 1, seed=4)
        verify_samples(rt, cfg["cap"], seed=4, repeats=1, sizes=[cfg["cap"] + 1])

    off = offload_decoder(decoder, Budget.parse(cfg["budget"]), [tuple(p) for p in cfg.get("hot", [])], warm_up=warm_up)
    emit({"budget": off.budget_bytes})
    pinned = dict(off.pinned_split)
    emit({"pinned": pinned})
    ar, draft = time_steps(
        rt, cfg["k_draft"], cfg["n_steps"], seed=5, progress=lambda d, t: emit({"progress": [d, t + cfg["n_samples"]]})
    )
    samples = verify_samples(
        rt,
        cfg["cap"],
        seed=6,
        repeats=cfg["repeats"],
        sizes=verify_sizes(cfg["cap"]),
        counter=off.native,
        progress=lambda d, t: emit({"progress": [cfg["n_steps"] + d, cfg["n_steps"] + t]}),
    )
    plain = _plain_fetches(rt, off.native, rt.tokenize(cfg["text"]) or [0], PLAIN_FETCH_TOKENS)
    cg = current_budget_cgroup()
    assert cg is not None  # run_cold starts this worker in the budget's cgroup
    emit(
        {
            "result": {
                "samples": samples,
                "t_ar": float(np.median(ar)),
                "c_draft": float(np.median(draft)),
                "plain": plain,
                "record": budget_record(off, [tuple(p) for p in cfg.get("hot", [])], Budget.parse(cfg["budget"]).auto),
                "pinned": pinned,
                "plan": off.plan.__dict__ if off.plan else None,
                "split": cg.split(),
                "peak": cg.peak(),
                "anon": process_anon_bytes(),
                "n_batch": rt.n_batch,
            }
        }
    )
    off.close()
    decoder.close()
    return 0


PLAIN_FETCH_TOKENS, PLAIN_FETCH_WARM, PLAIN_FETCH_CONTEXT = 96, 16, 8
PLAIN_FETCH_CHARS = 4096  # of the calibration text: several times the tokens needed, and a small argv


def _plain_fetches(rt: LlamaRuntime, counter: NativePrefetch, text: list[int], n: int) -> dict[str, list[Any]]:
    """Plain decoding under the budget, one token a step, through the calibration text after its first
    PLAIN_FETCH_CONTEXT tokens (the model's own greedy choices once the text runs out): per token the experts
    it routed to ([n_layer, k] ids), how many were not in memory as their layer routed (the prefetcher's count,
    as decoding counts fetches), the step's seconds (what those fetches cost as decoding pays them: faults
    and read-ins included) and the token it decoded. Not the model's greedy continuation: a small model's
    soon repeats itself, routing to the same few experts, and fetches far fewer than decoding varied text."""
    hook = rt.hook
    assert hook is not None  # the worker's runtime is of an MoE model, made with the routing hook
    rt.kv_clear()
    hook.off()
    context, forced = text[:PLAIN_FETCH_CONTEXT], text[PLAIN_FETCH_CONTEXT:]
    if len(context) > 1:
        rt.prefill(context[:-1])
    t, pos = context[-1], len(context) - 1
    ids: list[list[int]] = []
    misses: list[int] = []
    seconds: list[float] = []
    tokens: list[int] = []
    try:
        for i in range(n):
            tokens.append(int(t))
            hook.observe()
            counter.begin()
            t0 = time.perf_counter()
            logits = rt.decode([t], pos, "all")
            seconds.append(time.perf_counter() - t0)
            ids.append(hook.snapshot(1).orig[:, 0].tolist())
            misses.append(int(counter.counted().sum()))
            assert logits is not None  # one token, all logits asked for
            t, pos = (forced[i] if i < len(forced) else int(np.argmax(logits[-1]))), pos + 1
    finally:
        rt.kv_clear()
    return {"ids": ids, "misses": misses, "seconds": seconds, "tokens": tokens}


def run_cold(model_path: str | os.PathLike[str], budget: Budget, cfg: dict[str, Any]) -> Measurement[dict[str, Any]]:
    """Generator (yields (done, total)): the cold worker in a fresh memory cgroup; returns its result,
    with the budget it ran under (for auto, as the worker sized it)."""
    argv = [sys.executable, "-m", "s2moe.engine.measure.calibration_worker", "--cold-worker", json.dumps(cfg)]
    with run_in_budget(
        argv, budget, model_path, tag="calibrate", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        result: dict[str, Any] | None = None
        pinned: dict[str, int] | None = None
        failure: dict[str, str] | None = None
        sized = budget.size
        assert run.proc.stdout is not None and run.proc.stderr is not None  # both are pipes (above)
        for line in run.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "progress" in msg:
                yield tuple(msg["progress"])
            elif "result" in msg:
                result = msg["result"]
            elif "pinned" in msg:
                pinned = msg["pinned"]
            elif "budget" in msg:
                sized = int(msg["budget"])
            elif "error" in msg:
                failure = msg["error"]
        rc = run.proc.wait()
        if result is None:
            err = (run.proc.stderr.read() or "").strip().splitlines()
            why = failure["message"] if failure else err[-1] if err else f"exit status {rc}"
            if run.out_of_memory() or rc in (-9, 137):
                why = (
                    f"out of memory at the budget of {budget.describe(sized)} (pinned "
                    f"{fmt_bytes(sum((pinned or {}).values()))}); raise the budget"
                )
            raise RuntimeError(why)
    result["budget"] = sized
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--cold-worker":
        try:
            return _cold_worker(json.loads(argv[1]))
        except Exception as e:  # noqa: BLE001 (the parent gets the reason as data, not a traceback's last line)
            message = e.worded() if isinstance(e, S2MoEError) else str(e) or type(e).__name__
            sys.stdout.write(json.dumps({"error": {"kind": type(e).__name__, "message": message}}) + "\n")
            return 1
    print("usage: s2moe calibrate --model PATH (this module's own entry point is internal)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
