from __future__ import annotations

import signal
import sys
from pathlib import Path

import llama_cpp  # noqa: F401  (before gguf, as the engine's model readers do: see model_info.gguf_reader)
import pytest

sys.path.insert(0, str(Path(__file__).parent))

# A shell without job control starts a background command (`pytest … &`) with SIGINT ignored, Python then
# installs no KeyboardInterrupt handler, and every child inherits the ignored signal: each Ctrl-C test would
# fail. The suite tests what a user's Ctrl-C does, so it takes the disposition a foreground run has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tinygguf import TinySpec, write_tiny  # noqa: E402

# The routing variants the hook must handle, each a tiny model: softmax without / with weight norm, and
# sigmoid gating with weight norm with / without a per-expert selection bias (DeepSeek-V3-style routing).
VARIANTS = {"olmoe": {}, "qwen3moe": {}, "dots1": {}, "dots1-nobias": {"arch": "dots1", "selection_bias": False}}
ARCHS = tuple(VARIANTS)


@pytest.fixture(autouse=True)
def _own_app_state(tmp_path_factory, monkeypatch):
    """The app remembers its active profile in XDG state: never the user's own, never another test's. And it
    draws as it does for a user without NO_COLOR, whatever the runner's environment says: with it set (some
    CI images set it) every SVG snapshot differs."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.delenv("NO_COLOR", raising=False)


def variant_spec(name: str, **kw) -> TinySpec:
    return TinySpec(**{"arch": name, **VARIANTS[name], **kw})


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random MoE models, one per routing variant (VARIANTS), and a dense one."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ARCHS:
        out[arch] = write_tiny(root / f"{arch}.gguf", variant_spec(arch, n_layer=3, n_expert=8, k=4, seed=7))
    out["llama"] = write_tiny(root / "dense.gguf", TinySpec(arch="llama", n_layer=2, seed=3))
    return out


@pytest.fixture(scope="session")
def decoders(tiny_models):
    from s2moe.engine.decoding.decoder import Decoder

    made = {arch: Decoder(str(tiny_models[arch]), n_ctx=512, n_threads=1) for arch in ARCHS}
    yield made
    for d in made.values():
        d.close()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param
