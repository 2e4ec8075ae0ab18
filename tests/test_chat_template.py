"""Chat under the model's own chat template: llama.cpp renders it, a conversation's turns keep their KV,
a model without a template (or with one llama.cpp cannot apply) gets plain completion, and the app's chat
keeps turns, starts new conversations and exports roles."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import pytest
from s2moe.app.tui.app import S2MoEApp
from s2moe.app.tui.chat_settings import ChatSettings
from s2moe.app.tui.messages import EngineEvent, JobEnded
from s2moe.app.tui.segments import view_of
from s2moe.engine.decoding.chat import Conversation, Message, Template, chat_tokens
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.events import Finished, Iteration, Prefilled, Started

# the snapshots' fixed profile folders and scripted engine runs (autouse fixtures) hold here too
from test_app_snapshots import fixed_profile_folders, make_app, ready, scripted_engine_runs, settle  # noqa: F401
from test_app_support import FakeDecoder, scripted_events
from tinygguf import TinySpec, write_tiny

# ChatML as Qwen's and many instruct GGUFs ship it: llama.cpp recognises it by its turn markers
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a Jinja template with none of the markers llama.cpp knows templates by
UNKNOWN = "{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}\n{% endfor %}"
MARKERS = ("<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_tiny(
        tmp_path_factory.mktemp("chat") / "chat.gguf",
        TinySpec(n_layer=2, n_expert=8, k=4, seed=7, chat_template=CHATML, chat_specials=MARKERS),
    )


@pytest.fixture(scope="module")
def chat_decoder(chat_model):
    d = Decoder(str(chat_model), n_ctx=512, n_threads=1)
    yield d
    d.close()


def counting_decodes(decoder, monkeypatch) -> list[int]:
    """The sizes of the batches the decoder's own runtime decodes from now on."""
    sizes = []
    real = decoder.rt.decode

    def decode(tokens, pos0, outputs="last"):
        sizes.append(len(tokens))
        return real(tokens, pos0, outputs)

    monkeypatch.setattr(decoder.rt, "decode", decode)
    return sizes


def turn(decoder, conversation, user, cfg, **kw):
    events = list(decoder.generate(chat_tokens(decoder, conversation, user), cfg, **kw))
    finished = events[-1]
    assert isinstance(finished, Finished)
    conversation.add_turn(user, finished.text)
    return events


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_llama_cpp_renders_two_turns_with_the_models_template(chat_decoder):
    template = chat_decoder.chat_template
    assert template.name == "chatml" and template.usable and "chatml" in template.status
    conversation = Conversation(template, system="Be brief.")
    conversation.add_turn("Hi", "Hello!")
    assert conversation.prompt("And you?") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd you?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conversation.turns == 1
    # the markers are read as the template's control tokens, not as their characters; the end of a turn
    # is an end-of-generation token, where a reply stops
    start, end = (chat_decoder.tokenize(m, special=True)[-1] for m in MARKERS)
    tokens = chat_tokens(chat_decoder, conversation, "And you?")
    assert tokens.count(start) == 5 and tokens.count(end) == 4
    assert chat_decoder.rt.is_eog(end) and not chat_decoder.rt.is_eog(start)
    assert start not in chat_decoder.tokenize("<|im_start|>")  # plain completion reads the characters


def test_the_next_turn_decodes_only_its_new_tokens_and_speculates(chat_decoder, monkeypatch):
    cfg = GenerationConfig(mode="s2moe", n_predict=12, utility=False, draft_max=4)
    conversation = Conversation(chat_decoder.chat_template)
    first = turn(chat_decoder, conversation, "hello there", cfg, keep_context=True)
    assert first[1] == Prefilled(first[1].n_tokens, first[1].seconds, 0)
    context = list(first[0].prompt_tokens) + list(first[-1].tokens)
    if first[-1].stop_reason != "eos":
        context.pop()  # the newest token is pending: its KV entry is made by the pass that would follow
    sizes = counting_decodes(chat_decoder, monkeypatch)
    second = turn(chat_decoder, conversation, "and what next?", cfg, keep_context=True)
    prompt = list(second[0].prompt_tokens)
    prefilled = second[1]
    # what the KV held (the first prompt and its answer) up to where the new prompt's tokens differ
    kept = common_prefix(context, prompt[:-1])
    assert prefilled.reused == kept >= len(first[0].prompt_tokens)
    n_prefill = (
        len(sizes)
        - sum(isinstance(e, Iteration) for e in second)
        - sum(len(e.drafted) for e in second if isinstance(e, Iteration))
    )  # one decode per verification and draft token
    assert sum(sizes[:n_prefill]) == len(prompt) - 1 - kept  # only the new tokens, the pending one aside
    # speculation runs on chat turns as on completions
    assert any(e.drafted for e in second if isinstance(e, Iteration))
    # without keep_context the same prompt is prefilled whole
    sizes.clear()
    fresh = list(chat_decoder.generate(prompt, cfg))
    assert fresh[1].reused == 0


@pytest.mark.parametrize("mode", ["ar", "s2moe", "tree", "lookup"])
def test_kept_context_decodes_as_a_fresh_prefill_would(chat_decoder, mode):
    """Lossless decoding (gating off): the second turn's answer is the same whether the first turn's KV was
    kept, whatever drafted it (a draft tree's branches included)."""
    cfg = GenerationConfig(mode=mode, n_predict=10, reuse_strength=0.0, utility=False)
    conversation = Conversation(chat_decoder.chat_template)
    turn(chat_decoder, conversation, "one", cfg, keep_context=True)
    kept = turn(chat_decoder, conversation, "two", cfg, keep_context=True)
    assert kept[1].reused > 0
    chat_decoder.forget_context()
    fresh = list(chat_decoder.generate(list(kept[0].prompt_tokens), cfg, keep_context=True))
    assert fresh[1].reused == 0 and fresh[-1].tokens == kept[-1].tokens


def test_context_used_by_something_else_is_not_reused(chat_decoder):
    cfg = GenerationConfig(mode="ar", n_predict=4)
    tokens = chat_decoder.tokenize("the cat sat on the mat")
    list(chat_decoder.generate(tokens, cfg, keep_context=True))
    chat_decoder.rt.kv_clear()
    chat_decoder.rt.decode(tokens[:3], 0, "none")  # a benchmark's own decodes behind the decoder's back
    assert list(chat_decoder.generate(tokens, cfg, keep_context=True))[1].reused == 0
    list(chat_decoder.generate(tokens, cfg, keep_context=True))
    chat_decoder.forget_context()
    assert list(chat_decoder.generate(tokens, cfg, keep_context=True))[1].reused == 0


def test_without_a_template_llama_cpp_applies_each_prompt_is_a_completion(tiny_models, tmp_path):
    plain = Decoder(str(tiny_models["olmoe"]), n_ctx=256, n_threads=1)
    try:
        assert plain.chat_template == Template(None, None) and not plain.chat_template.usable
        assert "no chat template" in plain.chat_template.status
    finally:
        plain.close()
    unknown = write_tiny(tmp_path / "unknown.gguf", TinySpec(n_layer=2, seed=7, chat_template=UNKNOWN))
    d = Decoder(str(unknown), n_ctx=256, n_threads=1)
    try:
        template = d.chat_template
        assert template.text == UNKNOWN and template.name is None
        assert "llama.cpp does not know" in template.status and "\n" not in template.status
        with pytest.raises(ValueError):
            template.render([Message("user", "hi")])
    finally:
        d.close()

    async def go():
        app = S2MoEApp(str(unknown), n_threads=1, n_ctx=256)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            await pilot.pause(0.1)
            assert app.session.conversation is None
            assert any("does not know this model's chat template" in n.message for n in app._notifications)
            chat = app.screen
            chat.apply_settings(ChatSettings(mode="ar", n_predict=4))
            events = []
            await generate(pilot, chat, "hello", events)
            started = next(e for e in events if isinstance(e, Started))
            assert list(started.prompt_tokens) == app.session.decoder.tokenize("hello")  # the prompt as typed
            assert chat.transcript.turns[-1].template is None

    asyncio.run(go())


async def wait_for(pilot, cond, what, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def generate(pilot, chat, prompt, events):
    """Type a prompt, wait for its answer; the engine's events of it appended to events."""
    decoder = chat.app.session.decoder
    real = decoder.generate

    def record(*args, **kw):
        for event in real(*args, **kw):
            events.append(event)
            yield event

    decoder.generate = record
    before = len(chat.transcript.turns)
    try:
        await pilot.press(*prompt)
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: len(chat.transcript.turns) > before and not chat.generating and chat.transcript.turns[-1].summary,
            "the generation",
        )
    finally:
        del decoder.generate
    chat.flush()


def test_the_app_chats_in_turns_and_starts_new_conversations(chat_model, tmp_path):
    async def go():
        app = S2MoEApp(str(chat_model), n_threads=1, n_ctx=512)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            chat = app.screen
            chat.apply_settings(ChatSettings(mode="s2moe", utility=False, n_predict=8))
            session = app.session
            assert any("chatml" in n.message for n in app._notifications)
            first, second = [], []
            await generate(pilot, chat, "hi", first)
            await generate(pilot, chat, "more", second)
            assert session.conversation.turns == 2
            turns = chat.transcript.turns
            assert [t.prompt for t in turns] == ["hi", "more"] and {t.template for t in turns} == {"chatml"}
            assert [m.role for m in session.conversation.messages] == ["user", "assistant"] * 2
            assert session.conversation.messages[1].content == turns[0].answer_text
            reused = next(e for e in second if isinstance(e, Prefilled)).reused
            assert reused > 0 and f"{reused} of" in turns[1].summary and "kept in KV" in turns[1].summary
            # the help says what Enter does with this model, and how to start over
            from s2moe.app.tui.dialogs import binding_sections

            prompt_help = dict(dict(binding_sections(chat, app))["Prompt"])
            assert "chatml" in prompt_help["Enter"] and "new conversation" in prompt_help["Ctrl+N"]

            # the export names the roles
            from s2moe.app.tui.export import export_transcript

            export_transcript(str(tmp_path / "chat.jsonl"), turns)
            records = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
            assert records[1]["messages"] == [
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": turns[1].answer_text},
            ]
            assert records[0]["template"] == "chatml"
            export_transcript(str(tmp_path / "chat.md"), turns)
            assert "## 2. user\n\nmore\n\n### assistant" in (tmp_path / "chat.md").read_text()

            # a new conversation (the palette's “New chat”, Ctrl+N): the next prompt carries no history
            await pilot.press("ctrl+n")
            assert not chat.transcript.turns and session.conversation.turns == 0
            third = []
            await generate(pilot, chat, "hi", third)
            started = next(e for e in third if isinstance(e, Started))
            assert list(started.prompt_tokens) == list(first[0].prompt_tokens)  # the same prompt as the first turn
            assert chat.transcript.turns[0].index == 1 and session.conversation.turns == 1

    asyncio.run(go())


def test_a_two_turn_chat_at_80x24(snap_compare):
    """Two turns of a conversation under a chat template: the second one's KV kept from the first."""

    async def run_before(pilot):
        await ready(pilot)
        session = pilot.app.session
        session.template = Template(CHATML, "chatml")
        session.conversation = Conversation(session.template)
        chat = pilot.app.screen
        chat.adapt_to_model()  # says which template, once: a toast that settle() clears
        await pilot.pause()
        decoder = FakeDecoder()
        for prompt, kept in (("Name a cat.", 0), ("And a dog?", 31)):
            chat.begin_turn(prompt)
            for i, event in enumerate(scripted_events()):
                if isinstance(event, Prefilled):
                    event = replace(event, n_tokens=40, reused=kept)
                chat.on_engine_event(EngineEvent(chat._turn_index, event, view_of(event, decoder), 1.0 + 0.05 * i))
            chat.on_job_ended(JobEnded("generate"))
        chat.flush()
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run_before)


def test_generate_cnv_chats_in_turns_from_standard_input(chat_model, tiny_models, monkeypatch, capsys):
    import io

    from s2moe.app import cmd_generate
    from s2moe.app.cli import main
    from s2moe.app.parser import build_parser
    from s2moe.engine.errors import ConfigError

    common = ["generate", "-n", "6", "-t", "1", "-c", "256", "--mode", "s2moe", "--no-utility", "-cnv"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"and then?\n\nwhat else\n")))
    assert main([*common, "-m", str(chat_model), "-sys", "Be brief.", "-p", "hello"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("> ")] == ["> hello", "> and then?", "> what else"]
    lines = [line for line in err.splitlines() if line.startswith("-- ")]
    assert len(lines) == 3 and "kept" not in lines[0] and all("prompt tokens kept" in x for x in lines[1:])
    assert "chatml" in err
    # a base model: a completion per turn, said once
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"more\n")))
    assert main([*common, "-m", str(tiny_models["olmoe"]), "-p", "hello"]) == 0
    out, err = capsys.readouterr()
    assert err.count("note: no chat template") == 1 and "kept" not in err and out.count("> ") == 2
    with pytest.raises(ConfigError, match="add -cnv"):
        cmd_generate.run(build_parser().parse_args(["generate", "-m", str(chat_model), "-sys", "x", "-p", "hi"]))
    assert main(["generate", "-m", str(chat_model), "-cnv", "--json", "-p", "hi"]) == 2
    assert "--json and --trace record one generation" in capsys.readouterr().err


def test_a_turn_that_cannot_be_sent_is_refused_and_the_chat_goes_on(chat_model, tiny_models, monkeypatch, capsys):
    """A line of bytes that are not UTF-8, one longer than the context holds and one longer than any turn may
    be: each refused in a line, the turns around them answered, exit code 2 for what was refused."""
    import io

    from s2moe.app.cli import main
    from s2moe.app.cmd_chat import MAX_TURN_BYTES

    lines = [b"caf\xe9 au lait", b"word " * 2000, b"x" * (MAX_TURN_BYTES + 10), b"and then?"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n".join(lines) + b"\n")))
    assert main(["generate", "-m", str(chat_model), "-n", "4", "-t", "1", "-c", "256", "-cnv", "-p", "hello"]) == 2
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("> ")][0::2] == ["> hello", "> and then?"]
    refused = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(refused) == 3 and all(line.endswith(": not sent; the conversation goes on") for line in refused)
    assert refused[0].startswith("error: the line is not UTF-8 text (an invalid byte at offset 3)")
    assert refused[1].startswith("error: the conversation with this turn comes to ")
    assert "the context holds 256: send a shorter turn" in refused[1]
    assert refused[2].startswith("error: a line of more than 1 MiB is no turn")
    assert len([line for line in err.splitlines() if line.startswith("-- ")]) == 2 and "Traceback" not in err
    # a base model's completion per turn: a prompt longer than the context is refused as well
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"word " * 2000 + b"\nmore\n")))
    assert (
        main(["generate", "-m", str(tiny_models["olmoe"]), "-n", "4", "-t", "1", "-c", "256", "-cnv", "-p", "hello"])
        == 2
    )
    out, err = capsys.readouterr()
    assert out.count("> ") == 3 and err.count("-- ") == 2
    (refused,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "but the context holds 256; shorten it or raise --ctx: not sent" in refused


@pytest.mark.parametrize("seed", [1, 81])  # the turn ends on an accepted draft (1), on the target's token (81)
def test_a_sampled_answer_stops_at_the_end_of_turn_token(chat_model, seed):
    """Sampled from a flat distribution until <|im_end|> comes: the answer stops there, without it, and the
    next turn still finds the conversation in the KV."""
    chat_decoder = Decoder(str(chat_model), n_ctx=2048, n_threads=1)  # room for a long random answer re-read
    try:
        end = chat_decoder.tokenize("<|im_end|>", special=True)[-1]
        cfg = GenerationConfig(
            mode="s2moe", n_predict=400, utility=False, temperature=3.0, seed=seed, top_k=0, top_p=1.0, min_p=0.0
        )
        conversation = Conversation(chat_decoder.chat_template)
        events = turn(chat_decoder, conversation, "hi", cfg, keep_context=True)
        finished, last = events[-1], [e for e in events if isinstance(e, Iteration)][-1]
        assert finished.stop_reason == "eos" and finished.n_tokens < cfg.n_predict
        assert end in last.accepted + (last.target_token,) and end not in finished.tokens
        assert not any(chat_decoder.rt.is_eog(t) for t in finished.tokens)
        assert conversation.messages[-1] == Message("assistant", finished.text)
        again = turn(chat_decoder, conversation, "go on", replace(cfg, n_predict=4), keep_context=True)
        assert again[1].reused >= len(events[0].prompt_tokens)
    finally:
        chat_decoder.close()
