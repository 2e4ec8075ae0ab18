"""`s2moe models` (the shipped models) and `s2moe make-synthetic` (random weights with real dimensions, or a
model widened N times with inert expert neurons)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

from ..engine.errors import ConfigError


def add_parser(sub) -> None:
    from .options import nonempty, whole_number

    p = sub.add_parser("models", help="list the models shipped with s2moe")
    p.add_argument("--json", action="store_true", help="print the list as JSON (one object per model)")
    p.set_defaults(run=run_models)
    s = sub.add_parser(
        "make-synthetic",
        help="write a random-weight GGUF with a real model's dimensions (--preset), "
        "or a model with N times wider experts (--from … --widen N)",
    )
    s.add_argument("--preset", help="olmoe-1b-7b | qwen3-30b-a3b | tiny: random weights, real dimensions")
    s.add_argument(
        "--from",
        dest="source",
        metavar="NAME|PATH",
        help="a shipped model's name or a GGUF MoE file to widen (with --widen)",
    )
    s.add_argument(
        "--widen",
        type=whole_number,
        default=None,
        metavar="N",
        help="with --from: every expert FFN N times as wide, the new neurons inert (same output, N× the "
        "bytes and FLOPs per expert)",
    )
    s.add_argument("--out", required=True, type=nonempty, help="output GGUF path (written atomically)")
    s.add_argument(
        "--arch",
        choices=["olmoe", "qwen3moe"],
        default=None,
        help="--preset only: architecture (default: the preset's)",
    )
    s.add_argument("--n-layer", type=int, default=None, help="--preset only: keep only this many layers")
    s.add_argument("--n-expert", type=int, default=None, help="--preset only")
    s.add_argument("--k", type=int, default=None, help="--preset only: experts per token")
    s.add_argument("--dtype", default=None, help="--preset only: f16 (default), f32 or q8_0")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights (or of the new neurons)")
    s.set_defaults(run=run_make_synthetic)


def _writable_out(text: str) -> Path:
    """--out, checked before anything is written: not a folder, in a folder that exists and takes a new
    file (tried, since root ignores permission bits and a read-only mount does not)."""
    out = Path(text)
    if out.is_dir():
        raise ConfigError(f"--out: {out} is a folder; give the path of the file to write")
    if not out.parent.is_dir():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise ConfigError(f"--out: cannot write into {out.parent} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return out


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class WriteProgress:
    """What has been written so far, on stderr: a line as soon as the writing starts (what, where, how much),
    then a bar on a terminal, or a line at each tenth elsewhere (a log, a pipe). Called as the engine's
    progress(done_bytes, total_bytes)."""

    def __init__(self, what: str):
        from rich.console import Console

        self.what = what
        self.console = Console(stderr=True, highlight=False)
        self.started = False
        self.bar = None
        self.next_tenth = 1  # off a terminal: the tenth of the total whose passing is said next

    def __enter__(self) -> WriteProgress:
        return self

    def __call__(self, done: int, total: int | None) -> None:
        if not self.started:
            self.started = True
            print(f"{self.what}{f' ({_size(total)})' if total else ''}…", file=sys.stderr, flush=True)
            if self.console.is_terminal:
                from rich.progress import BarColumn, DownloadColumn, Progress

                # transient: an error while writing is then the only line left after this one
                self.bar = Progress(BarColumn(), DownloadColumn(), console=self.console, transient=True)
                self.bar.start()
                self.task = self.bar.add_task("write", total=total)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        elif total and done * 10 >= self.next_tenth * total:
            self.next_tenth = done * 10 // total + 1
            print(f"  {done * 100 // total}% ({_size(done)} of {_size(total)})", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..engine.zoo import list_models

    models = list_models()
    if not models:
        raise ConfigError("this install ships no models; pass --model PATH to your own GGUF")
    if args.json:
        import json

        print(json.dumps([{**m, "path": str(m["path"])} for m in models], indent=1))
        return 0
    t = Table(title="shipped models", box=None, pad_edge=False, header_style="bold underline")
    for col in ("name", "arch", "layers", "experts", "k", "params", "active", "size", "default"):
        t.add_column(col, no_wrap=True)
    for m in models:
        t.add_row(
            m["name"],
            str(m.get("arch", "?")),
            str(m.get("n_layer", "?")),
            str(m.get("n_expert", "?")),
            str(m.get("k", "?")),
            f"{m['params'] / 1e6:.1f}M" if m.get("params") else "?",
            f"{m['params_active'] / 1e6:.1f}M" if m.get("params_active") else "?",
            _size(m["size_bytes"]),
            "yes" if m.get("default") else "",
        )
    console = Console(width=200 if not Console().is_terminal else None, highlight=False)
    console.print(t)
    # the paths are what users copy: one per line, whole, outside the table that narrow terminals squeeze
    width = max(len(m["name"]) for m in models)
    print()
    for m in models:
        print(f"{m['name']:<{width}}  {m['path']}")
    return 0


def run_make_synthetic(args) -> int:
    if (args.source is None) == (args.preset is None):
        raise ConfigError("make-synthetic needs exactly one of --preset NAME and --from NAME|PATH")
    if args.source is not None:
        return _run_widen(args)
    if args.widen is not None:
        raise ConfigError("--widen applies to --from NAME|PATH, not to --preset")

    from ..engine.zoo.synthetic import PRESETS, preset_hparams, write_synthetic

    args.dtype = args.dtype or "f16"
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
    out = _writable_out(args.out)
    with WriteProgress(f"writing {out.name}: random {args.dtype} weights, preset {args.preset}") as progress:
        try:
            write_synthetic(
                args.arch,
                args.preset,
                out,
                dtype=args.dtype,
                seed=args.seed,
                n_layer=args.n_layer,
                n_expert=args.n_expert,
                k=args.k,
                progress=progress,
            )
        except OSError as e:  # the disk filled up, the folder went away
            raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    print(
        f"wrote {out} ({_size(out.stat().st_size)}; {hp['arch']}, {hp['n_layer']} layers, "
        f"{hp['n_expert']} experts top-{hp['k']})"
    )
    return 0


def _run_widen(args) -> int:
    from ..engine.model_info import read_model_info
    from ..engine.zoo import list_models, model_path
    from ..engine.zoo.widen import widen

    preset_only = [
        flag
        for flag, value in (
            ("--arch", args.arch),
            ("--n-layer", args.n_layer),
            ("--n-expert", args.n_expert),
            ("--k", args.k),
            ("--dtype", args.dtype),
        )
        if value is not None
    ]
    if preset_only:
        raise ConfigError(f"{', '.join(preset_only)} apply to --preset only; --from keeps the source's dimensions")
    if args.widen is None:
        raise ConfigError("--from needs --widen N (N ≥ 2): how many times wider each expert becomes")
    if args.widen < 2:
        raise ConfigError(f"--widen must be at least 2, got {args.widen}")
    source = Path(args.source)
    shipped = [m["name"] for m in list_models()]
    if not source.exists() and args.source in shipped:
        source = model_path(args.source)
    elif not source.exists() and source.suffix != ".gguf" and len(source.parts) == 1:
        raise ConfigError(
            f"--from: no file {args.source!r} and no shipped model of that name "
            f"(shipped: {', '.join(shipped) or 'none'})"
        )
    out = _writable_out(args.out)
    with WriteProgress(f"widening {source.name} {args.widen}× into {out.name}") as progress:
        widen(source, out, args.widen, seed=args.seed, progress=progress)
    before, after = read_model_info(source), read_model_info(out)
    print(
        f"wrote {out} ({_size(after.file_bytes)}; {after.arch}, {after.n_layer} layers, {after.n_expert} experts "
        f"top-{after.n_expert_used}; one expert {_size(before.expert_bytes)} → {_size(after.expert_bytes)})"
    )
    return 0
