"""llama.cpp's own plain decoding of a model: what a user gets without s2moe, as bench's reference row.

The model is loaded and decoded through llama-cpp-python's low-level API with nothing of ours in the
way: no routing hook, no pinning, no prefetch. Greedy (argmax of the last logits, as llama.cpp's greedy
sampler picks). Under a memory budget it maps the model without CPU weight repacking (llama.cpp's
`--no-repack`), since repacking copies every weight into anonymous memory and cannot page.

    python -m s2moe.engine.measure.reference --model M.gguf --prompts humaneval --n-prompts 8 -n 64 [--threads N]
        [--no-repack] --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from ..decoding.gpu import Placement
from ..decoding.runtime import LlamaRuntime
from ..decoding.runtime_settings import DEFAULT_BATCH
from ..model_info import read_model_info


def plain_decoding(
    model: str,
    prompts: list[str],
    n_tokens: int,
    *,
    n_threads: int | None = None,
    n_ctx: int = 2048,
    repack: bool = True,
    placement: Placement = Placement(),
    n_batch: int = DEFAULT_BATCH,
) -> dict[str, Any]:
    """Greedy decoding of n_tokens per prompt; the decode time (without prefill) and the tokens."""
    rt = LlamaRuntime(
        read_model_info(model),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_threads=n_threads,
        install_hook=False,
        use_extra_bufts=repack,
        placement=placement,
    )
    seconds = 0.0
    tokens: list[list[int]] = []
    try:
        for prompt in prompts:
            ids = rt.tokenize(prompt)
            head = ids[:-1]
            rt.kv_clear()
            for i in range(0, len(head), rt.n_batch):
                rt.decode(head[i : i + rt.n_batch], i, "none")
            out: list[int] = []
            pending, pos = ids[-1], len(ids) - 1
            t0 = time.perf_counter()
            for _ in range(n_tokens):
                logits = rt.decode([pending], pos, "last")[0]
                pending = int(np.argmax(logits))
                out.append(pending)
                pos += 1
            seconds += time.perf_counter() - t0
            tokens.append(out)
    finally:
        rt.close()
    n = sum(len(t) for t in tokens)
    return {"n_tokens": n, "seconds": seconds, "tok_per_s": n / seconds if seconds > 0 else 0.0, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    from ..files import write_atomic
    from .prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("-n", "--n-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("-b", "--batch-size", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--placement", type=json.loads, default={}, help="engine.decoding.gpu.Placement's fields as JSON")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    _, prompts = load_prompts(a.prompts, a.n_prompts)
    result = plain_decoding(
        a.model,
        prompts,
        a.n_tokens,
        n_threads=a.threads,
        repack=not a.no_repack,
        placement=Placement(**a.placement),
        n_batch=a.batch_size,
    )
    write_atomic(a.json, json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
