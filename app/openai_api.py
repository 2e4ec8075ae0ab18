"""The OpenAI API's side of `s2moe serve`: a request's JSON read and checked into what a generation needs, and the
responses, stream chunks and error objects in the shapes the `openai` client and llama-server's users expect.
Nothing here decodes or speaks HTTP: cmd_serve does both."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..engine.errors import ConfigError

# The request fields that set GenerationConfig's sampler, by their name there; llama-server takes these names too.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "seed")
MAX_STOPS = 16
# The penalties of OpenAI's API that llama.cpp's sampler chain here does not apply: refused unless 0, never ignored.
UNSUPPORTED_PENALTIES = ("presence_penalty", "frequency_penalty")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An answer that is an OpenAI error object: status, message, and the field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _given(body: dict, name: str):
    """A field's value, None where it is absent or null (a client's way of leaving it to the server)."""
    return body.get(name)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(body: dict, name: str) -> int | None:
    v = _given(body, name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"{name} must be a whole number, got {json.dumps(v)}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = _given(body, name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{name} must be true or false, got {json.dumps(v)}", name)
    return v


def _sampling(body: dict) -> dict:
    """The sampler fields given, each checked as its command-line flag is (options.sampling_value)."""
    from .options import sampling_value

    out = {}
    for name in SAMPLING_FIELDS:
        v = _given(body, name)
        if v is None:
            continue
        whole = name in ("top_k", "repeat_last_n", "seed")
        if not _is_number(v) or (whole and not float(v).is_integer()):
            raise _bad(f"{name} must be a {'whole number' if whole else 'number'}, got {json.dumps(v)}", name)
        try:
            out[name] = sampling_value(name, str(int(v) if whole else float(v)))
        except ConfigError as e:
            raise _bad(e.worded({name: name}), name) from None
    for name in UNSUPPORTED_PENALTIES:
        v = _given(body, name)
        if v is None:
            continue
        if not _is_number(v):
            raise _bad(f"{name} must be a number, got {json.dumps(v)}", name)
        if v != 0:
            raise _bad(f"{name} is not supported by this server (use repeat_penalty); leave it out or 0", name)
    return out


def _stops(body: dict) -> tuple[str, ...]:
    v = _given(body, "stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(v) > MAX_STOPS:
        raise _bad(f"stop takes at most {MAX_STOPS} strings, got {len(v)}", "stop")
    return tuple(s for s in v if s)


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = _whole(body, name)
        if v is None:
            continue
        if v < 1:
            raise _bad(f"{name} must be at least 1, got {v}", name)
        return v
    return None


def _one_choice(body: dict) -> None:
    n = _whole(body, "n")
    if n is not None and n != 1:
        raise _bad(f"this server generates one choice per request: n must be 1, got {n}", "n")
    if _given(body, "logprobs") or _given(body, "top_logprobs"):
        raise _bad("logprobs are not supported by this server", "logprobs")
    model = _given(body, "model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"model must be a string, got {json.dumps(model)}", "model")


@dataclass(frozen=True)
class Request:
    """What one request asks of a generation, checked."""

    chat: bool
    prompt: str | list[int] | None = None  # a completion's prompt: text, or token ids
    messages: tuple[tuple[str, str], ...] = ()  # a chat's (role, content), last the user's turn
    max_tokens: int | None = None  # None: the server's -n, else until the context is full
    sampling: dict = field(default_factory=dict)  # GenerationConfig sampler fields given
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _common(body: dict) -> dict:
    _one_choice(body)
    stream = _flag(body, "stream")
    options = _given(body, "stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = bool(options) and _flag(options, "include_usage")
    return dict(sampling=_sampling(body), stops=_stops(body), stream=stream, include_usage=include_usage)


def completion_request(body: dict) -> Request:
    prompt = _given(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str):
        raise _bad("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")
    for name in ("echo", "suffix", "best_of"):
        if name == "best_of" and _whole(body, name) in (None, 1):
            continue
        if name == "echo" and not _flag(body, name):
            continue
        if name == "suffix" and _given(body, name) is None:
            continue
        raise _bad(f"{name} is not supported by this server", name)
    return Request(
        chat=False, prompt=prompt, max_tokens=_max_tokens(body, ("max_tokens", "n_predict")), **_common(body)
    )


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: only text ones can be read here
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_request(body: dict) -> Request:
    messages = _given(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", "messages")
        turns.append((ROLES[role], _content(m, i)))
    if turns[-1][0] != "user":
        raise _bad("the last message must be the user's (the reply comes after it)", "messages")
    for name in ("tools", "functions", "response_format"):
        value = _given(body, name)
        if value and value != {"type": "text"}:  # plain text, the only format there is here, may be asked for
            raise _bad(f"{name} is not supported by this server", name)
    return Request(
        chat=True,
        messages=tuple(turns),
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens", "n_predict")),
        **_common(body),
    )


class TextOut:
    """A generation's text as it may be shown, from its tokens as they come: the bytes of a character split over
    tokens wait for the rest of it (the pieces shown make the text the engine's detokenize gives), and the text is
    cut before the first stop string, holding back any end of it that could be the start of one until the next
    text says."""

    def __init__(self, piece, stops: tuple[str, ...]):
        import codecs

        self.piece, self.stops = piece, stops  # piece: a token's bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""  # text that may be the start of a stop string
        self.stopped = False  # a stop string came: nothing after it is shown

    def add(self, tokens) -> str:
        """What can be shown now of the text so far."""
        return self._cut(self.utf8.decode(b"".join(self.piece(t) for t in tokens)))

    def flush(self) -> str:
        """The rest, once the generation has ended."""
        text = self._cut(self.utf8.decode(b"", final=True))
        held, self.held = self.held, ""
        return text + ("" if self.stopped else held)

    def _cut(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max(
            (n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), default=0
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]


def finish_reason(stop_reason: str, stopped_by_text: bool) -> str:
    """OpenAI's word for why a generation ended: "length" where it ran out of tokens or context."""
    if stopped_by_text:
        return "stop"
    return "length" if stop_reason in ("length", "context") else "stop"


def figures(summary, prefilled_reused: int, stop: str, seed: int) -> dict:
    """The decoding's own figures, every response's extension field; stop: why it ended, in words; seed: the one
    it sampled with (drawn where the request gave none), which repeats it."""
    offloaded = summary.offloaded_steps > 0
    return {
        "mode": summary.mode,
        "tokens": summary.n_tokens,
        "drafted": summary.drafted,
        "accepted": summary.accepted,
        "accept_length": round(summary.accept_len, 3),
        "experts_fetched": int(summary.experts_fetched + summary.draft_fetched) if offloaded else None,
        "tok_per_s": round(summary.tok_per_s, 2),
        "seconds": round(summary.seconds, 4),
        "prefill_seconds": round(summary.prefill_seconds, 4),
        "prompt_tokens_reused": prefilled_reused,
        "stop": stop,
        "seed": seed,
    }


@dataclass
class Reply:
    """The envelope of one request's response and stream chunks."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, reason: str, usage: dict, extra: dict) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            out = self._envelope("chat.completion", [choice])
        else:
            out = self._envelope(
                "text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            )
        out.update(usage=usage, s2moe=extra)
        return out

    def chunk(self, text: str | None, reason: str | None = None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": ""}
            return self._envelope(
                "chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            )
        return self._envelope(
            "text_completion", [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
        )

    def usage_chunk(self, usage: dict) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj) -> bytes:
    """One server-sent event as OpenAI streams them: a JSON object (or [DONE]) on a data line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()
