"""The measurements calibration takes, apart from the steps that run them: the calibration prompts, memory
and storage bandwidth, how often each expert is routed to, and the verification batch sizes timed.

Each measurement is a generator that yields (done, total) as it goes and returns its result, so that the
calibration steps (calibration_steps, calibration_budget) can pass its progress on as events and stop between
two readings; `s2moe bench` reads storage with the same function.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from ..files import MAX_PROMPT_FILE_BYTES, read_bounded
from ..offload import ExpertMap, ModelMapping, drop_file_cache

if TYPE_CHECKING:  # loading llama.cpp is for the runtime's user to do, not for this module's import
    from ..decoding.hook import Routing
    from ..decoding.runtime import LlamaRuntime

T = TypeVar("T")
# A measurement: yields (done, total) as it goes, returns what it measured.
Measurement = Generator[tuple[int, int], None, T]

DEFAULT_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: Why is the sky blue during the day and red at sunset?\nAnswer:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The mitochondria is an organelle found in most eukaryotic cells. Its main function is",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The crew",
    "import numpy as np\n\ndef normalize(x):\n",
    "Summary of the meeting: the team agreed to postpone the release because",
)


NAMED_PROMPT_SETS = ("humaneval", "natural")
NAMED_SET_PROMPTS = 32  # enough to rank the experts a workload uses; a few seconds on small models


def read_prompts(path: str | os.PathLike[str] | None) -> list[str]:
    """Calibration prompts: the built-in mix (None), a named set bench also uses ('humaneval' for code
    models: hot experts ranked from the workload's own kind of text cover more of its routings, see
    docs/calibration.md), or a text file with prompts separated by blank lines (or one per line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if str(path) in NAMED_PROMPT_SETS and not Path(path).exists():
        from .prompts import load_prompts

        return list(load_prompts(str(path), NAMED_SET_PROMPTS)[1])
    p = Path(path)
    try:
        text = read_bounded(p, "prompts file", MAX_PROMPT_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {p} is not UTF-8 text") from None
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    if len(blocks) == 1:
        blocks = [line.strip() for line in text.splitlines() if line.strip()]
    if not blocks:
        raise ConfigError(f"prompts file {p} has no prompts")
    return blocks


# -- measurements -------------------------------------------------------------------------------------------
def memory_bandwidth(size: int = 64 << 20, repeats: int = 5) -> Measurement[float]:
    """Generator (yields (done, total)); returns bytes per second of a large in-memory copy (read + write)."""
    src = np.ones(size // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
        yield i + 1, repeats
    return 2 * size / float(np.median(times))


STORAGE_DEPTHS = (1, 8)  # plain decoding reads about one expert at a time; a verification batch can ask for all


def storage_bandwidth(
    emap: ExpertMap, *, max_bytes: int = 256 << 20, seed: int = 0, depths: tuple[int, ...] = STORAGE_DEPTHS
) -> Measurement[tuple[dict[int, float], int, str]]:
    """Generator (yields (done, total)); returns ({queue depth: bytes per second}, bytes read, note) of cold
    reads of whole experts at random, the file dropped from the page cache first. Each depth reads its own
    experts (none is read twice); at depth d, d threads each read one expert at a time, so that d reads
    are in flight as when a verification's predicted experts are fetched together."""
    from concurrent.futures import ThreadPoolExecutor

    drop_file_cache(emap.path)
    mapping = ModelMapping(emap)
    try:
        resident = mapping.expert_residency()
    finally:
        mapping.close()
    rng = np.random.default_rng(seed)
    pairs = [(layer, e) for layer in emap.moe_layers for e in range(emap.n_expert) if resident[layer, e] < 0.01]
    if len(pairs) < len(depths):
        return (
            {},
            0,
            (
                "the model file could not be dropped from memory (another program may hold it open), "
                "so its reads would not reach storage"
            ),
        )
    rng.shuffle(pairs)
    per_expert = int(emap.expert_bytes.max())
    n_each = max(1, min(len(pairs) // len(depths), max_bytes // len(depths) // max(per_expert, 1)))
    fd = os.open(str(emap.path), os.O_RDONLY)

    def read_expert(pair: tuple[int, int]) -> int:
        return sum(len(os.pread(fd, n, off)) for off, n in emap.expert_ranges(*pair))

    rates: dict[int, float] = {}
    total, done = 0, 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: count what we ask for
        for d, depth in enumerate(depths):
            batch = pairs[d * n_each : (d + 1) * n_each]
            got = 0
            with ThreadPoolExecutor(max_workers=depth) as pool:
                t0 = time.perf_counter()
                for n in pool.map(read_expert, batch):  # os.pread lets go of the GIL while it waits
                    got += n
                    done += 1
                    yield done, n_each * len(depths)
                elapsed = time.perf_counter() - t0
            total += got
            if elapsed > 0:
                rates[depth] = got / elapsed
    finally:
        os.close(fd)
    drop_file_cache(emap.path)
    if not rates:
        return {}, total, "reads took no measurable time"
    return rates, total, f"{n_each} experts at each depth"


def routing_counts(
    rt: LlamaRuntime, prompts: list[str], *, gen_tokens: int = 16
) -> Measurement[tuple[npt.NDArray[np.int64], int]]:
    """Generator (yields (done, total)); returns ([n_layer, n_expert] how often each expert was routed to
    over the prompts and a short greedy continuation of each, tokens seen)."""
    info, hook = rt.info, rt.hook
    assert hook is not None  # the runtime calibration times is of an MoE model, made with the routing hook
    counts = np.zeros((info.n_layer, info.n_expert), np.int64)
    n_tokens = 0
    chunk = max(1, hook.max_rows)
    for i, prompt in enumerate(prompts):
        toks = rt.tokenize(prompt)[: max(1, rt.n_ctx - gen_tokens - 1)]
        rt.kv_clear()
        pos = 0
        logits = None
        hook.observe()
        for j in range(0, len(toks), chunk):
            part = toks[j : j + chunk]
            logits = rt.decode(part, pos, "all")
            _count(counts, hook.snapshot(len(part)), info.n_expert)
            pos += len(part)
        for _ in range(gen_tokens):
            assert logits is not None  # a prompt gives at least one token, and each decode here asks for all logits
            t = int(np.argmax(logits[-1]))
            if rt.is_eog(t):
                break
            logits = rt.decode([t], pos, "all")
            _count(counts, hook.snapshot(1), info.n_expert)
            pos += 1
        n_tokens += pos
        yield i + 1, len(prompts)
    rt.kv_clear()
    hook.off()
    return counts, n_tokens


def _count(counts: npt.NDArray[np.int64], routing: Routing, n_expert: int) -> None:
    ids = routing.orig.reshape(counts.shape[0], -1)
    for layer in range(counts.shape[0]):
        row = ids[layer]
        row = row[(row >= 0) & (row < n_expert)]
        counts[layer] += np.bincount(row, minlength=n_expert)[:n_expert]


# Readings of the disk before and after the budgeted batches further apart than this say that its rate
# moved while they ran.
STORAGE_DRIFT = 1.25


def storage_drift_note(before: float | None, after: float | None) -> str:
    """What the reading after the budgeted batches adds to their result (rates at queue depth 8, bytes/s)."""
    if not before or not after:
        return ""
    note = f" · the disk read {before / 1e9:.2f} GB/s at depth 8 before these batches and {after / 1e9:.2f} after"
    if max(before, after) / min(before, after) > STORAGE_DRIFT:
        note += (
            ": its rate moved while they ran, so the fit is noisier than this disk's usual (calibrate again "
            "when it is quiet)"
        )
    return note


def verify_sizes(cap: int) -> list[int]:
    """Verification batch sizes the calibration times: every size from 1 to cap + 1."""
    return list(range(1, cap + 2))
