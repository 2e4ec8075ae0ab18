"""`s2moe generate -cnv`: a conversation in turns under the model's chat template, as llama-cli's -cnv.

The first turn is the prompt (-p or -f); each further line of standard input is the next turn, until its
end (Ctrl+D on a terminal). The KV cache keeps the turns before, so that each turn decodes only its own
tokens. A model without a chat template llama.cpp applies gets a plain completion per turn, said once. A
turn that cannot be sent (longer than the context holds, not UTF-8) is refused in a line and the
conversation goes on; the exit code then says that one was (2).
"""

from __future__ import annotations

import sys

from ..engine.errors import ConfigError


def add_options(g) -> None:
    """generate's conversation flags, spelled as llama-cli's."""
    g.add_argument(
        "-cnv",
        "--conversation",
        action="store_true",
        help="chat in turns under the model's chat template: the prompt is the first turn, each line "
        "of standard input the next (until its end); the turns before stay in the KV cache",
    )
    g.add_argument(
        "-sys", "--system-prompt", metavar="TEXT", default=None, help="with -cnv: the conversation's system message"
    )


def check_options(args) -> None:
    if args.system_prompt is not None and not args.conversation:
        raise ConfigError("-sys/--system-prompt is a conversation's system message: add -cnv")
    if args.conversation and (args.json or args.trace is not None):
        raise ConfigError("-cnv chats in turns on the terminal: --json and --trace record one generation")


# A line of standard input longer than this is no turn: no context holds it (a million bytes are hundreds of
# thousands of tokens), and reading it whole could take all the memory there is.
MAX_TURN_BYTES = 1 << 20


def user_turns(first: str):
    """The first turn, then one per line of standard input (blank lines skipped) until its end. A line that
    cannot be a turn (not UTF-8, longer than MAX_TURN_BYTES) comes as the ConfigError saying why, for the
    conversation to refuse that turn and go on."""
    yield first
    interactive = sys.stdin.isatty()
    stdin = sys.stdin.buffer
    while True:
        if interactive:
            sys.stderr.write("\n> ")
            sys.stderr.flush()
        line = stdin.readline(MAX_TURN_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_TURN_BYTES and not line.endswith(b"\n"):
            while (rest := stdin.readline(MAX_TURN_BYTES)) and not rest.endswith(b"\n"):
                pass  # the rest of the line, read past
            yield ConfigError(f"a line of more than {MAX_TURN_BYTES >> 20} MiB is no turn")
            continue
        try:
            text = line.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as e:
            yield ConfigError(f"the line is not UTF-8 text (an invalid byte at offset {e.start})")
            continue
        if text.strip():
            yield text


def run_conversation(args, decoder, cfg, out) -> int:
    """The turns of a conversation (out: the CLI's text and note streams)."""
    from ..engine.decoding.chat import Conversation, chat_tokens
    from ..engine.errors import ContextError
    from ..engine.events import Finished, Iteration, Prefilled, Summary
    from .cmd_generate import event_line
    from .model_runs import speed_text
    from .options import FLAGS

    template = decoder.chat_template
    conversation = Conversation(template, system=args.system_prompt) if template.usable else None
    out.line(("" if template.usable else "note: ") + template.status)
    if conversation is None and args.system_prompt is not None:
        out.line("note: -sys has no effect without a chat template")
    streaming = sys.stdout.isatty()
    refused = 0
    for user in user_turns(args.prompt):
        if isinstance(user, ConfigError):
            out.line(f"error: {user}: not sent; the conversation goes on")
            refused += 1
            continue
        if not sys.stdin.isatty():
            out.text(f"> {user}\n")  # the turn, as a terminal would have shown it
        summary, prefilled, last_iteration = Summary(), None, None
        try:
            if conversation is None:
                events = decoder.generate(user, cfg)
            else:
                events = decoder.generate(chat_tokens(decoder, conversation, user), cfg, keep_context=True)
            # a turn the context cannot hold is refused before anything of it is decoded: the turns before
            # stay as they were
            for event in events:
                summary.add(event)
                if isinstance(event, Prefilled):
                    prefilled = event
                elif isinstance(event, Iteration):
                    if args.events:
                        out.line(event_line(event, last_iteration))
                        last_iteration = event
                    if streaming:
                        out.text(event.committed_text)
                elif isinstance(event, Finished) and conversation is not None:
                    conversation.add_turn(user, event.text)
        except ContextError as e:
            out.line(f"error: {e.worded(FLAGS)}: not sent; the conversation goes on")
            refused += 1
            continue
        out.text(("" if streaming else summary.text) + "\n")
        kept = f" · {prefilled.reused} of {prefilled.n_tokens} prompt tokens kept" if prefilled.reused else ""
        out.line(
            f"-- {summary.n_tokens} tokens ({speed_text(summary)}) · accept length "
            f"{summary.accept_len:.2f}{kept} · stop: {summary.stop_reason}"
        )
    return 2 if refused else 0
