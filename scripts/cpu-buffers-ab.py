"""What turning llama.cpp's extra CPU buffer types off costs: its own plain decoding of a model with them on
(AMX, repacked layouts) and off (weights mapped from the file), loaded afresh and interleaved round by round.

    .venv/bin/python scripts/cpu-buffers-ab.py MODEL.gguf [--rounds 5] [-n 64] [--n-prompts 4] [-t THREADS]

Prints each round's tok/s both ways and the median ratio off/on with its range.
"""

from __future__ import annotations

import argparse
import statistics

from s2moe.engine.decoding.cpu_buffers import build_has_amx
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.measure.reference import plain_decoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", "--n-tokens", type=int, default=64)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    _, prompts = load_prompts(a.prompts, a.n_prompts)
    print(f"llama.cpp built with AMX: {build_has_amx()}")
    plain_decoding(a.model, prompts[:1], 8, n_threads=a.threads, repack=False)  # page the file in once
    ratios = []
    for r in range(a.rounds):
        tok_s = {}
        for extra in (True, False) if r % 2 == 0 else (False, True):
            tok_s[extra] = plain_decoding(a.model, prompts, a.n_tokens, n_threads=a.threads, repack=extra)["tok_per_s"]
        ratios.append(tok_s[False] / tok_s[True])
        print(f"round {r + 1}: on {tok_s[True]:.1f} tok/s · off {tok_s[False]:.1f} tok/s · off/on {ratios[-1]:.3f}")
    print(
        f"off/on median {statistics.median(ratios):.3f} (range {min(ratios):.3f}–{max(ratios):.3f}, {a.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
