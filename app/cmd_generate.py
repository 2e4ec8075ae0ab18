"""`s2moe generate`: text from a prompt, streamed, with the speculation statistics of the run; its flags, the
lines it prints as it decodes (--events) and the prompt file it reads."""

from __future__ import annotations

import json
import os
import sys

from ..engine.errors import ConfigError
from ..engine.slow import said_if_slow
from .model_runs import (
    cpu_buffers_for,
    default_model,
    generation_config,
    offload_under_budget,
    run_cli_in_budget,
    say,
    speed_text,
)
from .options import (
    add_copy_cache_option,
    add_generation_options,
    check_pregate,
    nonempty,
    placement_from_args,
    sampling_settings,
    tree_mode,
)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt and report speculation statistics")
    add_generation_options(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", "-p", help="prompt text")
    prompt.add_argument(
        "-f",
        "--file",
        type=nonempty,
        help="read the prompt from this UTF-8 text file (as llama.cpp: one final newline dropped)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text and summary")
    g.add_argument("--events", action="store_true", help="print one line per iteration to stderr")
    g.add_argument(
        "--trace",
        metavar="FILE",
        type=nonempty,
        help="write a decoding trace (JSONL) for `s2moe project`: drafts run to the cap, noting what the "
        "mode's rule would have kept",
    )
    add_copy_cache_option(g)
    g.add_argument(
        "--no-display-prompt",
        dest="display_prompt",
        action="store_false",
        help="print only the generated text, not the prompt before it",
    )
    from . import cmd_chat

    cmd_chat.add_options(g)
    g.set_defaults(run=run)


def draft_stop_text(event) -> str:
    """Why drafting stopped; when the utility rule did not draft, its reason with the numbers."""
    d = event.draft_decision
    if event.draft_stop != "no-draft" or d is None:
        return event.draft_stop
    return d.text if d.can_pay else f"{d.text}; --no-utility drafts anyway"


def _decision_kind(event) -> tuple | None:
    """What the utility rule decided at an iteration that drafted nothing, without its numbers (None: not
    such an iteration)."""
    d = event.draft_decision
    if event.draft_stop != "no-draft" or d is None:
        return None
    return d.can_pay, d.drafting, d.probing, d.copied


def event_line(event, before=None) -> str:
    """One iteration, as `generate --events` prints it; `before`: the iteration printed just before it. Why
    nothing was drafted is said in full where that reason starts; while the same reason goes on, its few
    words where its numbers moved, else "as above"."""
    fetched = (
        ""
        if event.verify_misses is None
        else f" ({int(event.verify_misses.sum())} fetched, {event.verify_major_faults} storage faults)"
    )
    why = draft_stop_text(event)
    kind = _decision_kind(event)
    if kind is not None and before is not None and _decision_kind(before) == kind:
        short = event.draft_decision.wordings[-1]
        why = "as above" if short == before.draft_decision.wordings[-1] else short
    return (
        f"[{event.index}] drafted {len(event.drafted)} accepted {len(event.accepted)} "
        f"({why}) rollback {event.rollback} verify {event.verify_tokens} tok "
        f"{int(event.verify_experts.sum())} experts{fetched}"
    )


def _same_terminal(out, err) -> bool:
    try:
        return out.isatty() and err.isatty() and os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno()))
    except (OSError, ValueError):  # a stream with no file descriptor is no terminal
        return False


class _Output:
    """The streamed text on stdout and the notes and event lines on stderr. On one terminal a line on stderr
    would otherwise start in the middle of the text: end the text's line first."""

    def __init__(self):
        self.shared = _same_terminal(sys.stdout, sys.stderr)
        self.mid_line = False

    def text(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.mid_line = not text.endswith("\n")

    def line(self, line: str) -> None:
        if self.shared and self.mid_line:
            line = "\n" + line
            self.mid_line = False
        print(line, file=sys.stderr)


class MeasuringLine:
    """What a slow start-up measurement of the cost constants has done: one line, rewritten in place on a
    terminal, said once elsewhere."""

    TEXT = "measuring what a step costs under this budget (once per model and budget, then remembered)"

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.shown = False

    def show(self, event) -> None:
        if self.tty:
            sys.stderr.write(f"\r{self.TEXT}: {event.fraction:.0%} · {event.seconds:.0f} s")
        elif not self.shown:
            sys.stderr.write(f"{self.TEXT}…\n")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown and self.tty:
            sys.stderr.write("\n")
        self.shown = False


def prompt_file_text(path: str) -> str:
    """A prompt from a file, as llama.cpp's -f reads it: the whole file but one final newline. A regular
    UTF-8 file of at most the prompt-file limit; anything else is one line."""
    from ..engine.files import MAX_PROMPT_FILE_BYTES, read_bounded

    data = read_bounded(path, "prompt file", MAX_PROMPT_FILE_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt file {path} is not UTF-8 text (an invalid byte at offset {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


NO_PROFILE = "none"


def choose_profile(args, model: str, quiet: bool = False) -> None:
    """generate's profile, into args.profile: --profile as given; --profile none: none, the constants measured
    at start-up (a word rather than an empty value, as --budget none: a script that must not depend on what
    the app last chose says so); not given: the app's active profile (the one its Profiles screen set), said in
    a line, where it holds this model's constants: another model's would only be an error here."""
    if args.profile == NO_PROFILE:
        args.profile = None
        return
    if args.profile is not None:
        return
    from ..engine.model_info import read_model_info
    from ..engine.profiles import load_profile, model_block
    from .tui.state import remembered_profile

    name = remembered_profile()
    if name is None:
        return
    info = read_model_info(model)
    if model_block(load_profile(name), info.fingerprint) is None:
        if not quiet:
            print(
                f"profile: none — the app's active profile {name} has no constants for {info.path.name}, so they "
                "are measured at start-up",
                file=sys.stderr,
            )
        return
    args.profile = name
    if not quiet:
        print(
            f"profile {name}: the app's active one (--profile none: no profile, the constants measured at start-up)",
            file=sys.stderr,
        )


def _keep_copies(args, decoder) -> None:
    if args.copy_cache is not None:
        from ..engine.drafting.copycache import save_copy_cache

        save_copy_cache(args.copy_cache, decoder.info, decoder.earlier)


def run(args) -> int:
    import numpy as np

    from ..engine import offload
    from ..engine.decoding.decoder import Decoder
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.decoding.sampling import RANDOM_SEED, random_seed
    from ..engine.events import Finished, Iteration, MeasuringCosts, ResidencySnapshot, Started, Summary

    model = args.model if args.model is not None else default_model()
    if args.file is not None:
        args.prompt = prompt_file_text(args.file)
    from . import cmd_chat

    cmd_chat.check_options(args)
    check_pregate(args)
    # Validate flags that need no model before loading one.
    GenerationConfig(
        mode=tree_mode(args),
        n_predict=args.n_predict,
        draft_topk=args.draft_topk,
        draft_max=args.draft_max,
        tree_width=args.tree_width,
        tree_max_nodes=args.tree_max_nodes,
        **sampling_settings(args),
    ).validate()
    if args.trace is not None:
        from ..engine.measure.trace import check_trace_path

        GenerationConfig(mode=tree_mode(args), trace=True).validate()
        check_trace_path(args.trace)
    placement = placement_from_args(args)
    budget = offload.Budget.parse(args.budget) if args.budget is not None else None
    if budget is not None and offload.current_budget() is None:
        return run_cli_in_budget(args._argv, budget, model, tag="run")
    choose_profile(args, model, quiet=args.json)
    if args.seed == RANDOM_SEED:  # drawn here, so that the warm-up under a budget and the run share it
        args.seed = random_seed()
        if not args.json:
            print(f"seed {args.seed} (random; -s {args.seed} repeats this run)", file=sys.stderr)
    cpu = cpu_buffers_for(model, budget is None, quiet=args.json)
    with said_if_slow(None if args.json else say, f"loading {os.path.basename(model)}…"):
        decoder = Decoder(
            model,
            n_ctx=args.ctx,
            n_threads=args.threads,
            max_draft=max(16, args.draft_max or 0),
            use_extra_bufts=cpu.extra,
            placement=placement,
            n_batch=args.batch_size,
        )
    if args.copy_cache is not None:
        from ..engine.drafting.copycache import load_copy_cache

        load_copy_cache(args.copy_cache, decoder.info, decoder.earlier)
    offloader = None
    if budget is not None:
        from dataclasses import replace

        def warm_up():  # every graph shape of this run, so that an auto budget counts them
            short = replace(generation_config(args, decoder), n_predict=8, stop_at_eos=False)
            for _ in decoder.generate(args.prompt, short):
                pass

        offloader, hot = offload_under_budget(args, decoder, budget, warm_up, quiet=args.json)
    if not decoder.info.is_moe and args.mode == "ar":
        print(
            f"note: {decoder.info.path.name} is a dense model: only plain decoding (--mode ar) applies", file=sys.stderr
        )
    cfg = generation_config(args, decoder)
    if args.profile and not args.json and cfg.mode == "s2moe":
        from ..engine.profile_schema import TUNED_KEYS
        from ..engine.profiles import load_profile, tuned_settings
        from .cmd_tune import settings_text

        if tuned_settings(load_profile(args.profile), decoder.info.fingerprint, offloaded=budget is not None):
            shown = cfg.resolved(decoder.info)
            print(
                f"settings (profile {args.profile}'s tuned ones where no flag is given): "
                f"{settings_text({k: getattr(shown, k) for k in TUNED_KEYS}, budget is not None)}",
                file=sys.stderr,
            )
    recorder = None
    if args.trace is not None:
        from dataclasses import replace

        from ..engine.measure.trace import TraceRecorder

        cfg = replace(cfg, trace=True)
        recorder = TraceRecorder(decoder.info)
    if args.conversation:
        rc = cmd_chat.run_conversation(args, decoder, cfg, _Output())
        _keep_copies(args, decoder)
        return rc
    summary = Summary()
    streaming = not args.json and sys.stdout.isatty()
    out = _Output()
    # As llama-cli does, the prompt comes before the text; with the first of it, so that on a terminal the
    # lines printed before any text do not split the prompt from its continuation.
    prompt_echo = args.prompt if args.display_prompt and not args.json else ""
    measuring = MeasuringLine()
    last_iteration = None
    for event in decoder.generate(args.prompt, cfg):
        summary.add(event)
        if recorder is not None:
            recorder.add(event)
        if isinstance(event, MeasuringCosts):
            if not args.json:
                measuring.show(event)
            continue
        measuring.done()
        if isinstance(event, Started) and event.cost is not None and not args.json:
            c = event.cost
            fit = f", fit R² {c.r2:.2f}" if c.r2 is not None else ""
            out.line(
                f"cost constants ({c.source}): T_AR {c.t_ar * 1e3:.2f} ms, C_draft {c.c_draft * 1e3:.2f} ms, "
                f"T_exp {c.t_exp * 1e3:.4f} ms, T_tok {c.t_tok * 1e3:.3f} ms{fit}"
            )
        elif isinstance(event, Iteration):
            if args.events:
                out.line(event_line(event, last_iteration))
                last_iteration = event
            if streaming:
                out.text(prompt_echo + event.committed_text)
                prompt_echo = ""
        elif isinstance(event, ResidencySnapshot) and args.events:
            hit = ", ".join("–" if np.isnan(h) else f"{h:.2f}" for h in event.hit_rate)
            out.line(
                f"[{event.iteration}] experts resident per layer "
                f"{', '.join(f'{x:.2f}' for x in event.resident.mean(axis=1))}; hit rate {hit}"
            )
        elif isinstance(event, Finished) and event.stop_reason == "context":
            out.line(f"note: the context window ({decoder.n_ctx} tokens) filled up after {event.n_tokens} tokens")
    _keep_copies(args, decoder)
    if offloader is not None:
        out.line(offload.split_line(offload.current_budget_cgroup(), offloader))
    if recorder is not None:
        from ..engine.measure.trace import budget_record, write_trace

        trace = recorder.trace
        if offloader is not None:
            trace = trace.with_budget(budget_record(offloader, hot, budget.auto))
        write_trace(args.trace, trace)
    if args.json:
        out = summary.as_dict()
        out.update(
            tokens=list(summary.tokens),
            text=summary.text,
            model=str(decoder.info.path),
            seed=cfg.seed,
            cpu_buffers=cpu.as_dict(),
        )
        if summary.cost is not None:
            out["cost"] = {k: v for k, v in summary.cost.__dict__.items()}
        print(json.dumps(out))
        return 0
    out.text(prompt_echo if streaming else prompt_echo + summary.text)
    reuse = f"{summary.reuse_ratio:.3f}" if summary.reuse_ratio is not None else "n/a"
    print(
        f"\n--\n{summary.n_tokens} tokens in {summary.seconds:.2f} s ({speed_text(summary)})"
        f" · mode {summary.mode} · accept length {summary.accept_len:.2f} · reuse ratio {reuse}"
        f" · rollbacks {summary.rollbacks} · stop: {summary.stop_reason}"
    )
    return 0
