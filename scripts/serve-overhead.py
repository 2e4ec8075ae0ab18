"""What the HTTP API costs: tok/s streamed through `s2moe serve` over tok/s of `s2moe generate`, the same model,
prompts and settings, interleaved round by round on one machine.

    .venv/bin/python scripts/serve-overhead.py [-m MODEL.gguf] [--rounds 5] [-n 128] [-t THREADS] [-- FLAG ...]

Each round takes the next prompt through `s2moe generate --json` (its own tok/s: from its prefill to its last
token, the model's load left out) and then streamed through one server started at the beginning (the tokens over
the seconds from sending the request to its last event, as a client sees them). Both run to -n tokens
(--ignore-eos) and draft without copies (--no-lookup): the server's decoder would otherwise copy from the rounds
before it, which a fresh `generate` cannot. FLAGs after -- go to both (--mode ar, --budget 1G, ...).
Prints each round's tok/s both ways, the server's own decoding tok/s beside them (what it measured, HTTP left out),
and the median ratio API / generate with its range (the aim: at least 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.zoo import default_model_path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "s2moe.app.cli", *args]


def start_server(argv: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    found: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)/v1", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
            elif not m and not line.startswith(("POST ", "GET ")):
                sys.stderr.write(f"  server: {line}")
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout=600) or not found:
        proc.kill()
        sys.exit(f"the server did not start (exit {proc.poll()})")
    return proc, found[0]


def through_api(http: httpx.Client, prompt: str, n: int) -> tuple[float, float]:
    """(tok/s a streaming client sees, the server's own decoding tok/s) for one prompt."""
    figures = None
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": n, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                sys.exit(f"the server answered an error: {chunk['error']['message']}")
            figures = chunk.get("s2moe", figures)
    seconds = time.perf_counter() - t0
    return figures["tokens"] / seconds, figures["tok_per_s"]


def through_generate(model: str, prompt: str, n: int, flags: list[str], env: dict) -> float:
    done = subprocess.run(
        cli("generate", "-m", model, "-p", prompt, "-n", str(n), "--json", *flags),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        sys.exit(f"generate failed: {done.stderr.strip()}")
    return json.loads(done.stdout)["tok_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF model (default: the shipped one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", "--n-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("flags", nargs="*", help="after --: flags for both generate and serve")
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    flags = ["--ignore-eos", "--no-lookup", *(["-t", str(a.threads)] if a.threads else []), *a.flags]
    _, prompts = load_prompts("humaneval", a.rounds)
    state = tempfile.TemporaryDirectory(prefix="serve-overhead-")
    env = {**os.environ, "XDG_STATE_HOME": state.name}
    proc, url = start_server(cli("serve", "-m", model, "--port", "0", *flags), env)
    # one connection kept open, as a client that sends request after request keeps it
    http = httpx.Client(base_url=url, timeout=600)
    try:
        through_api(http, prompts[0], 8)  # the server's first request pays for its start-up measurement
        rows = []
        print(f"{'round':>5} {'generate':>10} {'API':>10} {'server':>10} {'API/generate':>13}")
        for i, prompt in enumerate(prompts):
            gen = through_generate(model, prompt, a.n_tokens, flags, env)
            api, own = through_api(http, prompt, a.n_tokens)
            rows.append(api / gen)
            print(f"{i + 1:>5} {gen:>10.1f} {api:>10.1f} {own:>10.1f} {api / gen:>13.3f}")
        print(
            f"API / generate: median {statistics.median(rows):.3f} (range {min(rows):.3f}–{max(rows):.3f}, "
            f"{len(rows)} rounds of {a.n_tokens} tokens, streamed)"
        )
    finally:
        http.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        state.cleanup()


if __name__ == "__main__":
    main()
