"""Chat with an instruct model: its GGUF's chat template, applied by llama.cpp, over a conversation of turns.

llama.cpp applies a template it recognises (ChatML, Llama 3, Mistral, Gemma, … : the built-in ones it
detects in the GGUF's Jinja text), as llama-cli does without --jinja. A template it does not recognise is
not run as Jinja here: its text is code shipped with the model, and a second renderer would turn the same
model's prompt into other tokens than llama.cpp's own tools do. Such a model, and one without a template,
gets plain completion (Template.status says which, in one line).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llama_cpp

from ..errors import ConfigError, ContextError

if TYPE_CHECKING:
    from .decoder import Decoder

ROLES = ("system", "user", "assistant")
# A conversation every built-in template renders, to tell which one llama.cpp picked for a model (no system
# message: a template may refuse one, and the model's template is no less known for it).
_PROBE = (("user", "U"), ("assistant", "A"), ("user", "V"))


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str


def _apply(template: bytes, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str | None:
    """The conversation rendered by llama.cpp with `template` (its Jinja text or a built-in name); None
    where llama.cpp does not know the template."""
    keep = [(r.encode("utf-8"), c.encode("utf-8")) for r, c in messages]
    chat = (llama_cpp.llama_chat_message * max(1, len(keep)))()
    for slot, (role, content) in zip(chat, keep):
        slot.role, slot.content = role, content
    size = 256 + 2 * sum(len(r) + len(c) for r, c in keep)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template, chat, len(keep), add_assistant, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n  # the buffer was too small: n is what it needs
    return None


def builtin_templates() -> list[str]:
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * max(n, 1))()
    n = llama_cpp.llama_chat_builtin_templates(names, n)
    return [names[i].decode() for i in range(max(n, 0))]


@dataclass(frozen=True)
class Template:
    """A model's chat template as llama.cpp applies it; `name` is None where there is none to apply."""

    text: str | None  # the GGUF's tokenizer.chat_template (None: the model has none)
    name: str | None  # the built-in llama.cpp renders it as (None: it cannot apply it)

    @property
    def usable(self) -> bool:
        return self.name is not None

    @property
    def status(self) -> str:
        if self.text is None:
            return "no chat template in the model: each prompt is a plain completion"
        if self.name is None:
            return (
                "llama.cpp does not know this model's chat template (a Jinja template it cannot apply): "
                "each prompt is a plain completion"
            )
        return f"chat with the model's template ({self.name}, applied by llama.cpp)"

    def render(self, messages: list[Message], add_assistant: bool = True) -> str:
        """The conversation as the model reads it; with add_assistant, ending where the reply starts."""
        if self.text is None or not self.usable:
            raise ValueError("this model has no chat template llama.cpp can apply")
        text = _apply(self.text.encode("utf-8"), [(m.role, m.content) for m in messages], add_assistant)
        if text is None:  # it rendered the probe: what it refuses is in this conversation (a system message)
            raise ConfigError(
                f"llama.cpp could not apply the model's {self.name} template to this conversation "
                "(does the template take a system message?)"
            )
        return text


def model_template(model: llama_cpp.llama_model_p) -> Template:
    """The chat template of a loaded llama.cpp model (llama_model_p)."""
    raw = llama_cpp.llama_model_chat_template(model, None)
    if not raw:
        return Template(None, None)
    text = raw.decode("utf-8", "replace")
    probe = _apply(raw, _PROBE, True)
    if probe is None:
        return Template(text, None)
    # The built-in whose rendering is the model's: a name for what llama.cpp detected (it says none)
    name = next((b for b in builtin_templates() if _apply(b.encode(), _PROBE, True) == probe), "built-in")
    return Template(text, name)


@dataclass
class Conversation:
    """The turns so far of a chat under a model's template, and the prompt of the next one."""

    template: Template
    system: str | None = None
    messages: list[Message] = field(default_factory=list)

    def history(self) -> list[Message]:
        return ([Message("system", self.system)] if self.system else []) + self.messages

    def prompt(self, user: str) -> str:
        """The whole conversation with `user`'s message, ending where the assistant's reply starts."""
        return self.template.render(self.history() + [Message("user", user)])

    def add_turn(self, user: str, answer: str) -> None:
        self.messages += [Message("user", user), Message("assistant", answer)]

    def clear(self) -> None:
        self.messages.clear()

    @property
    def turns(self) -> int:
        return len(self.messages) // 2


def chat_tokens(decoder: Decoder, conversation: Conversation, user: str) -> list[int]:
    """The tokens of the next turn's prompt: the rendered conversation with its special tokens (the
    template's turn markers) read as such, and BOS where the model adds one, as llama-cli tokenizes it."""
    tokens: list[int] = decoder.tokenize(conversation.prompt(user), special=True)
    if len(tokens) >= decoder.n_ctx:
        raise ContextError(
            f"the conversation with this turn comes to {len(tokens)} tokens and the context holds "
            f"{decoder.n_ctx}: send a shorter turn or start a new conversation"
        )
    return tokens
