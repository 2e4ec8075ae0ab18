"""A file of earlier generations for s2moe's copies, kept across runs (`--copy-cache FILE|DIR` of generate and app).

s2moe copies drafts from the session's earlier generations of other prompts (EarlierText): a model's
completions repeat its habits from one prompt to the next. Within one process the session is the decoder's
own; a one-shot `generate` has none. The file carries the session over: loaded before the run, and written
back (atomically) with this run's generations after it, merged with what other runs wrote there meanwhile. It
holds token ids, so it belongs to one model file; a directory holds one such file per model, named by the
model's fingerprint.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeGuard

from ..errors import ConfigError
from ..files import check_writable, read_json, write_atomic, write_target
from ..model_info import ModelInfo
from .ngrams import EarlierText

FORMAT = "s2moe-copy-cache"
VERSION = 1
# EarlierText keeps 16,384 tokens at most: about 100 KiB of JSON; anything far larger is not one of ours
MAX_FILE_BYTES = 16 << 20


class CopyCacheError(ConfigError):
    """A copy cache that cannot be used: the app says so in its own words, not as a model that failed to load."""


def copy_cache_file(path: str | os.PathLike[str], info: ModelInfo) -> Path:
    """The file `path` names for this model: the path itself, or in a directory the model's own file. A
    path written as a directory (a final slash) must be one: `nodir/` is no file named nodir."""
    text = os.fspath(path)
    path = Path(path).expanduser()
    if path.is_dir():
        return path / f"{info.fingerprint}.json"
    if text.endswith(os.sep) or (os.altsep and text.endswith(os.altsep)):
        raise CopyCacheError(f"copy cache {text}: there is no directory {path}")
    return path


def load_copy_cache(
    path: str | os.PathLike[str], info: ModelInfo, earlier: EarlierText, write_back: bool = True
) -> int:
    """Add the generations kept at `path` (copy_cache_file) to `earlier`, oldest first; how many. A file that
    does not exist yet holds none (the run creates it); one that is not a copy cache of this model is a
    CopyCacheError. write_back: the run will save_copy_cache there, so that its place is checked now (a
    folder that takes no new file, a link looping), not after the run has decoded everything it would keep."""
    path = copy_cache_file(path, info)
    if write_back:
        check_writable(path, "copy cache", CopyCacheError)
    if not path.exists():
        return 0
    generations = _read(path, info)
    for prompt, text in generations:
        earlier.add(prompt, text)
    return len(generations)


def save_copy_cache(path: str | os.PathLike[str], info: ModelInfo, earlier: EarlierText) -> None:
    """Write `earlier`'s generations to `path` (copy_cache_file) in one step (files.write_atomic: a run stopped
    while writing leaves the old file; a symbolic link is written through). Runs that share the file (two
    apps, generate in a loop beside a chat) each started from what it held then: what another wrote since is
    kept too, the file's generations first and this run's after them (this run's text where both hold a
    prompt), within EarlierText's caps. What this run holds as the file does (most of what it loaded) keeps
    the file's place: re-added as newest, a full cache's loaded entries would push out what another run added
    since."""
    path = copy_cache_file(path, info)
    target = write_target(path, "copy cache", CopyCacheError)
    with _locked(target.parent):
        merged = EarlierText(earlier.max_ngram, earlier.min_ngram, earlier.keep, earlier.max_tokens)
        kept = {tuple(prompt): text for prompt, text in (_read(path, info) if target.exists() else [])}
        for prompt, text in kept.items():
            merged.add(prompt, text)
        for prompt, text in earlier.generations():
            if kept.get(prompt) != text:
                merged.add(prompt, text)
        generations = [{"prompt": list(prompt), "text": text} for prompt, text in merged.generations()]
        data = {"format": FORMAT, "version": VERSION, "model": info.fingerprint, "generations": generations}
        write_atomic(path, json.dumps(data, separators=(",", ":")) + "\n", "copy cache", CopyCacheError)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Writers of one directory's copy caches one at a time, between reading the file and replacing it (a
    lock on the file itself would go with the inode the replacement unlinks)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CopyCacheError(f"cannot write copy cache in {directory}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read(path: Path, info: ModelInfo) -> list[tuple[list[int], list[int]]]:
    """The (prompt, text) generations of a copy cache of this model, oldest first; else a CopyCacheError."""
    data = read_json(path, "copy cache", MAX_FILE_BYTES, CopyCacheError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CopyCacheError(f"copy cache {path}: not an s2moe copy cache")
    if data.get("version") != VERSION:
        raise CopyCacheError(f"copy cache {path}: version {data.get('version')!r}, this s2moe reads {VERSION}")
    if data.get("model") != info.fingerprint:
        raise CopyCacheError(
            f"copy cache {path} holds another model's tokens (model {data.get('model')}, this one "
            f"{info.fingerprint}): give another file"
        )
    generations = data.get("generations")
    if not isinstance(generations, list):
        raise CopyCacheError(f"copy cache {path}: no list of generations")
    out = []
    for i, g in enumerate(generations):
        prompt, text = (g.get("prompt"), g.get("text")) if isinstance(g, dict) else (None, None)
        if _tokens(prompt, info.n_vocab) and _tokens(text, info.n_vocab):
            out.append((prompt, text))
        else:
            raise CopyCacheError(f"copy cache {path}: generation {i} is not two lists of this model's token ids")
    return out


def _tokens(value: object, n_vocab: int) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in value)
    )
