"""s2moe model zoo: small MoE language models trained from scratch with our own recipe, shipped as GGUF.

Runtime API (numpy/gguf only, no torch):
    default_model_path() -> Path of the packaged default model
    list_models()        -> metadata dicts of the packaged models (from models/manifest.json)
    write_synthetic(...) -> random-weight GGUF with real model dimensions (see synthetic.py)

The training recipe (data.py, tokenizer.py, model.py, train.py, export.py, evaluate.py) needs the `train`
extra (torch, tokenizers); it is imported only on demand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).resolve().parent / "models"
MANIFEST = MODELS_DIR / "manifest.json"
DEFAULT_MODEL = "olmoe-64x8"

__all__ = ["default_model_path", "list_models", "model_path", "write_synthetic", "MODELS_DIR"]


def _manifest() -> dict[str, Any]:
    if MANIFEST.exists():
        manifest: dict[str, Any] = json.loads(MANIFEST.read_text(encoding="utf-8"))
        return manifest
    return {"models": []}


def list_models() -> list[dict[str, Any]]:
    """One dict per packaged model: name, path, arch, n_layer, n_expert, k, params, params_active,
    size_bytes, default, plus the manifest's shape/training/metrics fields."""
    out = []
    entries = {m["name"]: m for m in _manifest()["models"]}
    for f in sorted(MODELS_DIR.glob("*.gguf")):
        m = dict(entries.get(f.stem, {"name": f.stem}))
        m["path"] = f
        m["size_bytes"] = f.stat().st_size
        m.setdefault("default", f.stem == DEFAULT_MODEL)
        out.append(m)
    out.sort(key=lambda m: (not m["default"], m["name"]))
    return out


def model_path(name: str) -> Path:
    p = MODELS_DIR / f"{name}.gguf"
    if not p.exists():
        raise FileNotFoundError(f"no packaged model {name!r}; have {[m['name'] for m in list_models()]}")
    return p


def default_model_path() -> Path:
    """Path of the packaged default model (an OLMoE-style 64-expert top-8 MoE)."""
    for m in list_models():
        if m["default"]:
            path: Path = m["path"]
            return path
    return model_path(DEFAULT_MODEL)


def write_synthetic(*args: Any, **kwargs: Any) -> Path:
    """synthetic.write_synthetic, imported on the first call: numpy and gguf load only then."""
    from .synthetic import write_synthetic as _w

    return _w(*args, **kwargs)
