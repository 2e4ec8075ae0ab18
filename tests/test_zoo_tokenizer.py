"""llama.cpp tokenises exactly like the reference (HF `tokenizers`) BPE and detokenises losslessly.
The reference ids are a stored fixture, so `tokenizers` is not needed here."""

import ctypes
import json
from pathlib import Path

import pytest
from s2moe.engine import zoo

llama_cpp = pytest.importorskip("llama_cpp")
FIXTURE = Path(zoo.__file__).parent / "data" / "tokenizer_fixture.json"
ITEMS = json.loads(FIXTURE.read_text(encoding="utf-8"))["items"]


@pytest.fixture(scope="module")
def vocab_model():
    return llama_cpp.Llama(model_path=str(zoo.default_model_path()), vocab_only=True, verbose=False)


def _detokenize(llm, ids, nbytes):
    buf = ctypes.create_string_buffer(nbytes * 2 + 64)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, len(buf), False, False)
    assert n >= 0
    return buf.raw[:n]


@pytest.mark.parametrize("item", ITEMS, ids=lambda it: it["text"][:20])
def test_tokenization_matches_reference(vocab_model, item):
    got = vocab_model.tokenize(item["text"].encode("utf-8"), add_bos=False, special=False)
    assert got == item["ids"]


@pytest.mark.parametrize("item", ITEMS, ids=lambda it: it["text"][:20])
def test_detokenization_round_trips(vocab_model, item):
    raw = item["text"].encode("utf-8")
    assert _detokenize(vocab_model, item["ids"], len(raw)) == raw
    assert vocab_model.detokenize(item["ids"]) == raw


def test_special_tokens(vocab_model):
    bos = vocab_model.token_bos()
    assert bos == vocab_model.token_eos() == 0
    ids = vocab_model.tokenize(b"x = 1", add_bos=True)
    assert ids[0] == bos and ids[1:] == vocab_model.tokenize(b"x = 1", add_bos=False)
    assert vocab_model.tokenize(b"<|endoftext|>", add_bos=False, special=True) == [0]
