"""`s2moe generate -cnv`: a conversation in turns under the model's chat template, as llama-cli's -cnv.

The first turn is the prompt (-p or -f); each further line of standard input is the next turn, until its
end (Ctrl+D on a terminal). The KV cache keeps the turns before, so that each turn decodes only its own
tokens. A model without a chat template llama.cpp applies gets a plain completion per turn, said once.
"""

from __future__ import annotations

import sys

from ..engine.errors import ConfigError


def add_options(g) -> None:
    """generate's conversation flags, spelled as llama-cli's."""
    g.add_argument("-cnv", "--conversation", action="store_true",
                   help="chat in turns under the model's chat template: the prompt is the first turn, each line "
                        "of standard input the next (until its end); the turns before stay in the KV cache")
    g.add_argument("-sys", "--system-prompt", metavar="TEXT", default=None,
                   help="with -cnv: the conversation's system message")


def check_options(args) -> None:
    if args.system_prompt is not None and not args.conversation:
        raise ConfigError("-sys/--system-prompt is a conversation's system message: add -cnv")
    if args.conversation and (args.json or args.trace is not None):
        raise ConfigError("-cnv chats in turns on the terminal: --json and --trace record one generation")


def user_turns(first: str):
    """The first turn, then one per line of standard input (blank lines skipped) until its end."""
    yield first
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("\n> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


def run_conversation(args, decoder, cfg, out) -> int:
    """The turns of a conversation (out: the CLI's text and note streams)."""
    from ..engine.chat import Conversation, chat_tokens
    from ..engine.events import Finished, Iteration, Prefilled, Summary
    from .cli import event_line, speed_text

    template = decoder.chat_template
    conversation = Conversation(template, system=args.system_prompt) if template.usable else None
    out.line(("" if template.usable else "note: ") + template.status)
    if conversation is None and args.system_prompt is not None:
        out.line("note: -sys has no effect without a chat template")
    streaming = sys.stdout.isatty()
    for user in user_turns(args.prompt):
        if not sys.stdin.isatty():
            out.text(f"> {user}\n")  # the turn, as a terminal would have shown it
        if conversation is None:
            events = decoder.generate(user, cfg)
        else:
            events = decoder.generate(chat_tokens(decoder, conversation, user), cfg, keep_context=True)
        summary, prefilled, last_iteration = Summary(), None, None
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
        out.text(("" if streaming else summary.text) + "\n")
        kept = f" · {prefilled.reused} of {prefilled.n_tokens} prompt tokens kept" if prefilled.reused else ""
        out.line(f"-- {summary.n_tokens} tokens ({speed_text(summary)}) · accept length "
                 f"{summary.accept_len:.2f}{kept} · stop: {summary.stop_reason}")
    return 0
