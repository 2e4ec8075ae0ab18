"""`s2moe serve` end to end: the real server in a process of its own on 127.0.0.1, driven by the official `openai`
client (completions, chat, streaming, seeded sampling that gives `s2moe generate`'s text, a wrong key, a client that
goes away) and by raw HTTP for what a client library would never send; every wait bounded, nothing left running."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from s2moe.engine.offload import MemoryCgroup
from test_chat_template import CHATML, MARKERS
from tinygguf import TinySpec, write_tiny

KEY = "test-key"
N_CTX = 4096
# a generation that outlasts every step a test takes while it runs (the tiny model decodes a few thousand
# tokens a second): the test ends it itself, by going away or by a signal
LONG = N_CTX - 64
START_SECONDS = 120
STOP_SECONDS = 30
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=11)
SAMPLED_EXTRA = {"top_k": 20, "min_p": 0.02, "repeat_penalty": 1.1}
SAMPLED_FLAGS = [
    "--temp",
    "0.9",
    "--top-p",
    "0.95",
    "-s",
    "11",
    "--top-k",
    "20",
    "--min-p",
    "0.02",
    "--repeat-penalty",
    "1.1",
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny MoE model with ChatML, the chat template llama.cpp recognises, whose context holds LONG tokens."""
    return write_tiny(
        tmp_path_factory.mktemp("serve") / "chat.gguf",
        TinySpec(n_layer=2, n_expert=8, k=4, seed=7, n_ctx=N_CTX, chat_template=CHATML, chat_specials=MARKERS),
    )


@pytest.fixture(scope="module")
def own_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xdg")
    return {"XDG_STATE_HOME": str(root / "state"), "XDG_CONFIG_HOME": str(root / "config")}


def cli_env(own_dirs) -> dict:
    env = {**os.environ, **own_dirs}
    env.pop("S2MOE_API_KEY", None)
    return env


class Server:
    """`s2moe serve` on a free port of 127.0.0.1, its stderr read line by line as it comes."""

    def __init__(self, model, env, *flags):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "s2moe.app.cli",
                "serve",
                "-m",
                str(model),
                "--port",
                "0",
                "-t",
                "1",
                "-c",
                str(N_CTX),
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.url = self.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", START_SECONDS).group(1)
            deadline = time.monotonic() + START_SECONDS
            while True:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"no answer on /health: {self.text()}"
                time.sleep(0.05)
        except BaseException:
            self.kill()
            raise

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def text(self) -> str:
        while not self.lines.empty():
            line = self.lines.get_nowait()
            if line is not None:
                self.log.append(line)
        return "\n".join(self.log)

    def mark(self) -> int:
        """Where the log stands now: wait_for(after=mark()) sees only the lines said after it."""
        self.text()
        return len(self.log)

    def wait_for(self, pattern: str, seconds: float, after: int = 0) -> re.Match:
        """The first line said after line `after` that matches, waiting at most `seconds` for it."""
        deadline = time.monotonic() + seconds
        for line in self.log[after:]:
            if m := re.search(pattern, line):
                return m
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {seconds} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(
                    f"the server ended ({self.proc.wait()}) before a line matching {pattern!r}:\n{self.text()}"
                )
            self.log.append(line)
            if m := re.search(pattern, line):
                return m

    def client(self, key=KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=60, max_retries=0)

    def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_SECONDS)
        finally:
            self.kill()

    def kill(self):
        """Ends the server whatever state it is in: SIGTERM first, which a budget's parent passes on to the server
        in its cgroup (SIGKILL would leave that one running), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_SECONDS)


@pytest.fixture(scope="module")
def server(chat_model, own_dirs):
    s = Server(chat_model, cli_env(own_dirs), "--api-key", KEY, "--queue", "1", "--ignore-eos", "-a", "tiny-chat")
    yield s
    rc = s.stop()
    assert rc == 143, s.text()
    assert "Traceback" not in s.text()


def generate(model, env, prompt: str, n: int, *flags) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "generate",
            "-m",
            str(model),
            "-p",
            prompt,
            "-n",
            str(n),
            "-t",
            "1",
            "-c",
            str(N_CTX),
            "--ignore-eos",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def stream_text(chunks, chat: bool) -> tuple[str, list]:
    chunks = list(chunks)
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    return "".join(pieces), chunks


def test_health_is_public_and_models_names_the_alias(server):
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]


def test_a_seeded_sampled_completion_is_the_text_generate_gives(server, chat_model, own_dirs):
    prompt = "def add(a, b):"
    mark = server.mark()
    done = server.client().completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=40, **SAMPLED, extra_body=SAMPLED_EXTRA
    )
    expected = generate(chat_model, cli_env(own_dirs), prompt, 40, *SAMPLED_FLAGS)
    assert done.choices[0].text == expected["text"]
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 40 == len(expected["tokens"]) and done.usage.prompt_tokens > 0
    figures = done.model_extra["s2moe"]
    assert figures["mode"] == "s2moe" and figures["tokens"] == 40
    assert 0 <= figures["accepted"] <= figures["drafted"] and figures["accept_length"] >= 1
    assert figures["tok_per_s"] > 0 and figures["experts_fetched"] is None  # nothing offloaded without a budget
    assert figures["seed"] == 11
    other = server.client().completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=40, **{**SAMPLED, "seed": 12}, extra_body=SAMPLED_EXTRA
    )
    assert other.choices[0].text != done.choices[0].text  # the seed reaches the sampler
    # as llama-server's: a request without a seed samples with one of its own, said so that it can be repeated
    unseeded = [
        server.client().completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0.9) for _ in range(2)
    ]
    seeds = [u.model_extra["s2moe"]["seed"] for u in unseeded]
    assert seeds[0] != seeds[1]
    again = server.client().completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0.9, seed=seeds[0])
    assert again.choices[0].text == unseeded[0].choices[0].text
    server.wait_for(r"POST /v1/completions 200 .* \d+ prompt \+ 40 tokens .* mode s2moe .* stop: length", 10, mark)


def test_a_stream_is_the_same_text_in_server_sent_events(server):
    client = server.client()
    whole = client.completions.create(model="m", prompt="import os\n", max_tokens=48, **SAMPLED)
    text, chunks = stream_text(
        client.completions.create(
            model="m",
            prompt="import os\n",
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        ),
        chat=False,
    )
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["s2moe"]["tokens"] == 48
    assert chunks[-1].usage.completion_tokens == 48 and not chunks[-1].choices


def test_chat_renders_the_models_template(server, chat_model):
    """A chat answers the conversation as the GGUF's ChatML renders it: the same text as a completion of those
    tokens, whole and streamed."""
    from s2moe.engine.decoding.chat import Message
    from s2moe.engine.decoding.decoder import Decoder

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "add two numbers"},
    ]
    decoder = Decoder(str(chat_model), n_ctx=N_CTX, n_threads=1)
    try:
        rendered = decoder.chat_template.render([Message(m["role"], m["content"]) for m in messages])
        tokens = decoder.tokenize(rendered, special=True)
    finally:
        decoder.close()
    assert "<|im_start|>assistant" in rendered
    client = server.client()
    chat = client.chat.completions.create(
        model="m", messages=messages, max_tokens=32, response_format={"type": "text"}, **SAMPLED
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokens)
    plain = client.completions.create(model="m", prompt=tokens, max_tokens=32, **SAMPLED)
    assert chat.choices[0].message.content == plain.choices[0].text
    text, chunks = stream_text(
        client.chat.completions.create(model="m", messages=messages, max_tokens=32, stream=True, **SAMPLED), chat=True
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_before_them(server):
    client = server.client()
    whole = client.completions.create(model="m", prompt="class A:\n", max_tokens=64, **SAMPLED).choices[0].text
    stop = whole[20:23]
    cut = whole[: whole.index(stop)]
    done = client.completions.create(
        model="m", prompt="class A:\n", max_tokens=64, stop=[stop, "\u2603never"], **SAMPLED
    )
    assert done.choices[0].text == cut and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens < 64  # the generation stopped there, it did not run on
    text, chunks = stream_text(
        client.completions.create(model="m", prompt="class A:\n", max_tokens=64, stop=stop, stream=True, **SAMPLED),
        chat=False,
    )
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_a_wrong_or_missing_key_gets_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="not-the-key").completions.create(model="m", prompt="hi", max_tokens=4)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    bare = httpx.post(
        f"{server.url}/v1/chat/completions", timeout=10, json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens"),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": "x", "top_p": 2}', 400, "top_p"),
    (b'{"prompt": "x", "seed": -7}', 400, "seed"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": "x", "stop": 3}', 400, "stop"),
    (b'{"prompt": "x", "n": 2}', 400, "n"),
    (b'{"prompt": [1, 999999]}', 400, "prompt"),
    (b'{"prompt": ""}', 400, None),
    (json.dumps({"prompt": [5] * (N_CTX + 10)}).encode(), 413, None),
]
BAD_CHAT = [
    (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": 7}]}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools"),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}',
        400,
        "response_format",
    ),
    (json.dumps({"messages": [{"role": "user", "content": "hello " * N_CTX}]}).encode(), 413, None),
]


def test_malformed_requests_get_openai_error_objects_and_the_server_goes_on(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        for path, cases in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
            for body, status, param in cases:
                r = http.post(path, content=body)
                assert r.status_code == status, (body[:80], r.text)
                error = r.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error", error
                if param is not None:
                    assert error["param"] == param, (body[:80], error)
                if status == 413:
                    assert error["code"] == "context_length_exceeded"
        assert http.get("/v1/no-such-thing").json()["error"]["code"] == "not_found"
        assert http.get("/health").json()["status"] == "ok"
    assert "Traceback" not in server.text()


def _wait_health(server, seconds: float, **want) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        if all(health[k] == v for k, v in want.items()):
            return health
        assert time.monotonic() < deadline, f"/health never said {want}: {health}"
        time.sleep(0.02)


def test_requests_queue_in_order_up_to_the_bound_and_a_client_that_leaves_stops_its_generation(server):
    """One generation runs, one request (--queue 1) waits, the next gets 503 with Retry-After; the streaming client
    that goes away stops its generation at once, and the waiting request then runs."""
    client = server.client()
    mark = server.mark()
    stream = client.completions.create(model="m", prompt="while True:", max_tokens=LONG, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text is not None
    waiting: dict = {}

    def wait_in_queue():
        try:
            waiting["done"] = client.completions.create(model="m", prompt="x = 1", max_tokens=8)
        except Exception as e:  # noqa: BLE001 — the test thread's failure, asserted below
            waiting["error"] = e

    behind = threading.Thread(target=wait_in_queue, daemon=True)
    behind.start()
    _wait_health(server, 10, generating=True, waiting=1)
    over = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
        json={"prompt": "y", "max_tokens": 4},
    )
    assert over.status_code == 503, over.text
    assert int(over.headers["Retry-After"]) >= 1 and over.json()["error"]["type"] == "unavailable_error"
    stream.close()  # the client goes away mid-stream
    behind.join(timeout=60)
    assert not behind.is_alive() and "error" not in waiting, waiting
    assert waiting["done"].usage.completion_tokens == 8
    gone = server.wait_for(r"POST /v1/completions 499 .* (\d+) tokens .* stop: client gone", 10, mark)
    assert int(gone.group(1)) < LONG


def test_a_client_that_leaves_before_a_whole_answer_stops_its_generation(server):
    mark = server.mark()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes its connection
        httpx.post(
            f"{server.url}/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
            json={"prompt": "if x:", "max_tokens": LONG},
        )
    gone = server.wait_for(r"POST /v1/completions 499 .* (\d+) tokens .* stop: client gone", 10, mark)
    assert int(gone.group(1)) < LONG
    _wait_health(server, 10, generating=False)


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_answers_the_request_in_flight_and_exits(chat_model, own_dirs, sig, code, word):
    """The generation in flight stops at its next step and is answered; one waiting behind it gets 503."""
    s = Server(chat_model, cli_env(own_dirs), "--ignore-eos")
    try:
        client = s.client()
        stream = iter(client.completions.create(model="m", prompt="for i in", max_tokens=LONG, stream=True))
        next(stream)
        waiting: dict = {}
        behind = threading.Thread(
            target=lambda: waiting.setdefault(
                "answer", httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
            ),
            daemon=True,
        )
        behind.start()
        _wait_health(s, 10, generating=True, waiting=1)
        s.proc.send_signal(sig)
        text, chunks = stream_text(stream, chat=False)  # the stream ends, answered, with its figures
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].model_extra["s2moe"]["stop"] == "server stopping"
        assert chunks[-1].model_extra["s2moe"]["tokens"] < LONG
        behind.join(timeout=STOP_SECONDS)
        assert waiting["answer"].status_code == 503 and "shutting down" in waiting["answer"].json()["error"]["message"]
        assert s.proc.wait(timeout=STOP_SECONDS) == code
        assert s.wait_for(r"stop: server stopping", 5)
        assert s.wait_for(rf"^{word}$", 5)
        assert "Traceback" not in s.text()
    finally:
        s.kill()


def test_a_port_in_use_is_one_line(chat_model, own_dirs, server):
    port = server.url.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "s2moe.app.cli", "serve", "-m", str(chat_model), "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(own_dirs),
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.skipif(MemoryCgroup.unavailable_reason() is not None, reason="no memory cgroup here")
def test_under_a_budget_the_server_runs_in_its_cgroup_and_counts_fetched_experts(chat_model, own_dirs):
    s = Server(chat_model, cli_env(own_dirs), "--budget", "auto")
    try:
        done = s.client().completions.create(model="m", prompt="def f():", max_tokens=16)
        assert isinstance(done.model_extra["s2moe"]["experts_fetched"], int)
        assert s.stop() == 143
    finally:
        s.kill()


def test_the_slot_takes_requests_in_order_and_a_place_given_up_goes_to_the_next():
    from s2moe.app.server import ServerClosing, Slot

    async def scenario():
        slot = Slot(bound=3)
        running = slot.reserve()
        first, second, third = slot.reserve(), slot.reserve(), slot.reserve()
        assert running.done() and not any(t.done() for t in (first, second, third))
        assert slot.reserve() is None  # over the bound
        slot.give_up(first)  # its client went away while it waited
        assert len(slot.waiting) == 2
        slot.leave()
        assert second.done() and not third.done()
        slot.give_up(second)  # its turn came, and its handler did not take it: the next one's
        assert third.done()
        late = slot.reserve()
        slot.close()  # the server stops: those still waiting are told so
        with pytest.raises(ServerClosing):
            late.result()
        slot.leave()
        assert not slot.busy

    asyncio.run(scenario())


def test_text_out_joins_split_characters_and_cuts_at_a_stop_string_split_over_tokens():
    from s2moe.app.openai_api import TextOut

    euro = "€".encode()
    out = TextOut(lambda token: token, ("</s", "END"))
    shown = [
        out.add([b"a <"]),
        out.add([b"/"]),
        out.add([b"x", euro[:1]]),
        out.add([euro[1:2]]),
        out.add([euro[2:]]),
        out.add([b" E"]),
        out.add([b"N"]),
        out.add([b"D tail"]),
    ]
    assert shown == ["a ", "", "</x", "", "€", " ", "", ""]
    assert out.stopped and out.flush() == ""
    unfinished = TextOut(lambda token: token, ("END",))
    assert unfinished.add([b"xEN"]) == "x" and unfinished.flush() == "EN"  # no stop came: the held text is shown
