"""Training corpus for the model zoo: the running interpreter's own standard library.

Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-/dist-packages excluded) is one document.
The split is by FILE and deterministic: a file is held out when the first bytes of the SHA-256 of its
POSIX relative path, read as an integer, fall in the held-out bucket. Held-out files are never trained on
(not by the tokenizer either). The same interpreter version therefore always gives the same split.

A small natural-language text written for this project (``data/natural.txt``) is used for quality checks
only (held-out perplexity on prose, a generation sample); it is never trained on.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_PERCENT = 5  # share of files held out (by hash bucket)
DATA_DIR = Path(__file__).resolve().parent / "data"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'heldout' or 'train' for a POSIX relative path; stable across machines and runs."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted (relative posix path, absolute path) of the stdlib's .py files."""
    root = root or stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        out.append((rel.as_posix(), f))
    out.sort()
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few test files are deliberately not valid UTF-8


def documents(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) for every readable stdlib file in `split` ('train' or 'heldout')."""
    docs = []
    for rel, path in stdlib_files(root):
        if split_of(rel) != split:
            continue
        text = read_text(path)
        if text:
            docs.append((rel, text))
    return docs


def natural_text() -> str:
    """The project's own English prose (quality checks only, never trained on)."""
    return (DATA_DIR / "natural.txt").read_text(encoding="utf-8")
