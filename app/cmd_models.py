"""`s2moe models` (the shipped models) and `s2moe make-synthetic` (random weights, real dimensions)."""

from __future__ import annotations

import re

from ..engine.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the models shipped with s2moe")
    p.set_defaults(run=run_models)
    s = sub.add_parser("make-synthetic", help="write a random-weight GGUF with a real model's dimensions")
    s.add_argument("--arch", choices=["olmoe", "qwen3moe"], default=None, help="architecture (default: the preset's)")
    s.add_argument("--preset", required=True, help="olmoe-1b-7b | qwen3-30b-a3b | tiny")
    s.add_argument("--out", required=True, help="output GGUF path (written atomically)")
    s.add_argument("--n-layer", type=int, default=None, help="keep only this many layers")
    s.add_argument("--n-expert", type=int, default=None)
    s.add_argument("--k", type=int, default=None, help="experts per token")
    s.add_argument("--dtype", default="f16", help="f16 (default), f32 or q8_0")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=run_make_synthetic)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..engine.zoo import list_models

    models = list_models()
    if not models:
        raise ConfigError("this install ships no models; pass --model PATH to your own GGUF")
    t = Table(title="shipped models")
    for col in ("name", "arch", "layers", "experts", "k", "params", "active", "size", "default", "path"):
        t.add_column(col)
    for m in models:
        t.add_row(m["name"], str(m.get("arch", "?")), str(m.get("n_layer", "?")), str(m.get("n_expert", "?")),
                  str(m.get("k", "?")), f"{m['params'] / 1e6:.1f}M" if m.get("params") else "?",
                  f"{m['params_active'] / 1e6:.1f}M" if m.get("params_active") else "?", _size(m["size_bytes"]),
                  "yes" if m.get("default") else "", str(m["path"]))
    Console(width=200 if not Console().is_terminal else None).print(t)
    return 0


def run_make_synthetic(args) -> int:
    from pathlib import Path

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from ..engine.zoo.synthetic import PRESETS, estimate_bytes, preset_hparams, write_synthetic

    if args.preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {args.preset!r} (choose from {', '.join(sorted(PRESETS))})")
    for name in ("n_layer", "n_expert", "k"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not re.fullmatch(r"f16|f32|q8_0", args.dtype):
        raise ConfigError("--dtype must be f16, f32 or q8_0")
    hp = preset_hparams(args.preset, args.arch, n_layer=args.n_layer, n_expert=args.n_expert, k=args.k)
    if hp["k"] > hp["n_expert"]:
        raise ConfigError("--k cannot exceed the number of experts")
    out = Path(args.out)
    if not out.parent.exists():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    total = estimate_bytes(hp, args.dtype)
    with Progress(TextColumn("writing {task.fields[name]}"), BarColumn(), DownloadColumn()) as progress:
        task = progress.add_task("write", total=total, name=out.name)
        write_synthetic(args.arch, args.preset, out, dtype=args.dtype, seed=args.seed, n_layer=args.n_layer,
                        n_expert=args.n_expert, k=args.k,
                        progress=lambda done, _total: progress.update(task, completed=done))
    print(f"wrote {out} ({_size(out.stat().st_size)}; {hp['arch']}, {hp['n_layer']} layers, "
          f"{hp['n_expert']} experts top-{hp['k']})")
    return 0
