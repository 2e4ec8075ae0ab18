"""Byte-level BPE tokenizer (GPT-2 style), trained with the `tokenizers` library on the train split only.

Pre-tokenisation is the GPT-2 regex (ByteLevel, use_regex=True, no prefix space), which is exactly the regex
llama.cpp applies for the GGUF pre-tokenizer names of the GPT-2 family. We export with the name "trillion":
same GPT-2 regex, but `clean_spaces` off, so llama.cpp's detokeniser does not rewrite " ." / " ' " and code
round-trips byte for byte (with "gpt-2" llama_detokenize would drop the space in `from . import x`).

Special tokens: id 0 = <|endoftext|> (BOS = EOS = document separator), id 1 = <|pad|>.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]
GGUF_PRE = "trillion"
# Tokens are capped at 16 byte-level characters (= bytes): llama-cpp-python's Llama.detokenize reads every
# piece through a 32-byte buffer and silently truncates longer ones (e.g. a 64-'#' comment rule).
MAX_TOKEN_CHARS = 16


class _GGUFVocabRead(TypedDict):
    tokens: list[str]  # byte-level unicode strings, by id
    merges: list[str]  # "a b"
    types: list[int]  # llama.cpp token types
    bos: int
    eos: int
    pad: int


class GGUFVocab(_GGUFVocabRead, total=False):
    """A tokenizer as GGUF stores it: what gguf_vocab reads, and the pre-tokenizer name a writer adds."""

    pre: str


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: Path) -> Tokenizer:
    """Train and save tokenizer.json. `texts` is an iterable of strings (train split only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        max_token_length=MAX_TOKEN_CHARS,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def load_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def gguf_vocab(tokenizer_json: Path) -> GGUFVocab:
    """What GGUF needs, read straight from tokenizer.json (no `tokenizers` import):
    tokens (byte-level unicode strings, by id), merges ("a b"), token types, bos/eos/pad ids."""
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    n = max(vocab.values()) + 1
    tokens: list[str | None] = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens), "vocabulary ids must be dense"
    dense = [t for t in tokens if t is not None]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    # llama.cpp token types: 1 = normal, 3 = control
    types = [3 if t in special else 1 for t in dense]
    return {
        "tokens": dense,
        "merges": merges,
        "types": types,
        "bos": vocab[EOT],
        "eos": vocab[EOT],
        "pad": vocab[PAD],
    }


FIXTURE_TEXTS = [
    'def moving_average(values, width=3):\n    """Mean of each run of `width` items."""\n'
    "    out = []\n    for i in range(len(values) - width + 1):\n"
    "        out.append(sum(values[i:i + width]) / width)\n    return out\n",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    "        self._items.append(item)\n\n    def pop(self):\n        if not self._items:\n"
    "            raise IndexError('pop from empty stack')\n        return self._items.pop()\n",
    "from . import util\nx = {'a': 1, \"b\": [2, 3.5e-7, 0x1F]}  # it's a dict ,  isn't it ?\n\n\n\t\ttabs\n",
    "The library opens at nine o'clock; we'll meet there, won't we? Prices rose 12% in 2023.",
    "Unicode: caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, emoji \U0001f600 and \u00a9 2024 \u2014 done.",
    "    " * 6 + "deeply_indented = True\n" + "#" * 70 + "\n",
]


def write_fixture(tokenizer_json: Path, out_path: Path, extra_texts: Iterable[str] = ()) -> None:
    """Reference token ids from HF `tokenizers` (tests compare llama.cpp's tokenisation against them)."""
    tok = load_tokenizer(tokenizer_json)
    items = [{"text": t, "ids": tok.encode(t).ids} for t in list(FIXTURE_TEXTS) + list(extra_texts)]
    Path(out_path).write_text(
        json.dumps({"tokenizer": "tokenizer.json", "items": items}, ensure_ascii=False, indent=0) + "\n",
        encoding="utf-8",
    )
