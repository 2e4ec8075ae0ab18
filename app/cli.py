"""The `s2moe` command line. Decoding logic lives in s2moe.engine; this module parses, runs, prints."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading

from ..engine.errors import (OPTION, ConfigError, S2MoEError, Terminated, held_signals, imports_held,
                             sigterm_raises_terminated)
from ..engine.modes import DRAFT_EXPERTS, MODES
from ..engine.slow import said_if_slow


# The engine's names for the settings its errors are about → the flags that set them.
FLAGS = {"n_predict": "-n", "temperature": "--temp", "draft_topk": "--draft-topk", "draft_max": "--draft-max",
         "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "repeat_penalty": "--repeat-penalty",
         "repeat_last_n": "--repeat-last-n",
         "reuse_strength": "--reuse-strength", "memory_strength": "--memory-strength", "threshold": "--threshold",
         "reuse_cap": "--reuse-cap",
         "n_ctx": "--ctx", "n_threads": "--threads", "seed": "--seed", "n_gpu_layers": "-ngl",
         "n_cpu_moe": "--n-cpu-moe", "op_offload_min_batch": "--op-offload-min-batch", "time_budget": "--time-budget",
         "tree_width": "--tree-width", "tree_max_nodes": "--tree-max-nodes", "draft_experts": "--draft-experts"}


# llama.cpp's multi-letter short option for GPU layers; argparse would read `-ngl…` as `-n gl…` where a
# command has `-n` but not this option, or where the value is glued on (`-ngl0`).
_NGL = re.compile(r"-ngl(=.*|-?\d+)?")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # Whole option names only: an abbreviation such as `--draft` silently picks one of several options
        # today and a different one when an option is added.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2, no usage dump
        if self.prog.endswith(" bench") and message == "argument --modes: expected one argument":
            # argparse reads a list that starts with bench's `-gating` and its kin as an option
            message += " (a list that starts with a '-' mode takes =: --modes=-gating,ar)"
        raise ConfigError(f"{self.prog}: {message}")

    def _get_option_tuples(self, option_string):
        # Reached only for a string that is not one of this parser's options. A parser with subcommands
        # sees its subcommand's options too, and leaves them to it.
        if self._subparsers is None and _NGL.fullmatch(option_string):
            if "-ngl" in self._option_string_actions:
                self.error(f"{option_string}: put a space or = between -ngl and its value (-ngl 0)")
            self.error(f"unknown option {option_string.split('=')[0]}: no -ngl/--n-gpu-layers here")
        return super()._get_option_tuples(option_string)


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    v = whole_number(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    v = whole_number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number ≥ 0, got {v}")
    return v


def _seed(text: str) -> int:
    from ..engine.decoding.sampling import MAX_SEED

    v = whole_number(text)
    if not -1 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be -1 (random) or a whole number from 0 to {MAX_SEED}, got {v}")
    return v


def _repeat_last_n(text: str) -> int:
    v = whole_number(text)
    if v < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the whole context), 0 (off) or a number of tokens, got {v}")
    return v


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def _fraction(text: str) -> float:
    v = _number(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


def _gpu_layers(text: str) -> int:
    v = whole_number(text)
    if not -1 <= v < 1 << 31:
        raise argparse.ArgumentTypeError(f"must be -1 (all layers), 0 or a number of layers, got {v}")
    return v


def nonempty(text: str) -> str:
    """A path or name: an empty one is a mistake, not a request for the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def no_hot_experts_note(profile_name: str | None, model, budget: str) -> str:
    """What a run under a budget pinning no hot experts misses, and the command that gives them: a profile of
    the model calibrated under the budget pins the experts routed most, and spares the start-up measurement
    (itself fetching experts under the budget)."""
    import shlex

    why = (f"profile {profile_name} has no hot experts for this model" if profile_name else
           "no profile: no hot experts are pinned and the cost constants are measured at start-up")
    return (f"note: {why}; calibrate once under this budget (s2moe calibrate -m {shlex.quote(str(model))} "
            f"--budget {shlex.quote(budget)} --name NAME) and pass --profile NAME")


def budget_text(text: str, *, to_run: bool = True) -> str:
    """`auto` or a size that Budget.parse reads, checked when parsing the command line; to_run: a budget to run
    under here, so none beyond this machine's memory (refused before any work rather than when it starts)."""
    from ..engine.offload import Budget

    try:
        budget = Budget.parse(nonempty(text))
        if to_run:
            budget.check_fits_machine()
    except S2MoEError as e:
        raise argparse.ArgumentTypeError(e.message) from None
    return text


def _non_negative_float(text: str) -> float:
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text}")
    return v


def default_model() -> str:
    from ..engine.zoo import default_model_path

    path = default_model_path()
    if path is None or not path.is_file():
        raise ConfigError("no shipped default model in this install: pass --model PATH to a GGUF MoE model")
    return str(path)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampler options, its defaults. Applied as llama.cpp applies them, in every mode: the
    draft and the verification sample from the same processed distributions (engine.sampling)."""
    from ..engine.decoding import sampling as s

    p.add_argument("--temp", type=_non_negative_float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("-s", "--seed", type=_seed, default=0, help="random seed (default 0; -1: a random one, printed)")
    p.add_argument("--top-k", type=_non_negative_int, default=s.TOP_K,
                   help=f"sample among the k most likely tokens (default {s.TOP_K}, 0 = off)")
    p.add_argument("--top-p", type=_fraction, default=s.TOP_P,
                   help=f"nucleus sampling: the most likely tokens up to this mass (default {s.TOP_P}, 1 = off)")
    p.add_argument("--min-p", type=_fraction, default=s.MIN_P,
                   help=f"drop tokens below this share of the most likely one (default {s.MIN_P}, 0 = off)")
    p.add_argument("--repeat-penalty", type=_positive_float, default=s.REPEAT_PENALTY,
                   help=f"penalise the tokens of the last --repeat-last-n (default {s.REPEAT_PENALTY:g}, 1 = off); "
                        "greedy decoding too")
    p.add_argument("--repeat-last-n", type=_repeat_last_n, default=s.REPEAT_LAST_N,
                   help=f"tokens the repeat penalty looks back over (default {s.REPEAT_LAST_N}, 0 = off, "
                        "-1 = the whole context)")


def sampling_settings(args) -> dict:
    """The sampler options of parsed arguments, as GenerationConfig fields."""
    return dict(temperature=args.temp, seed=args.seed, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n)


# GenerationConfig's sampler fields → the flag that sets each and the reader of its value: the app's settings
# read what a user types as these flags do.
SAMPLING_VALUES = {"temperature": ("--temp", _non_negative_float), "seed": ("-s", _seed),
                   "top_k": ("--top-k", _non_negative_int), "top_p": ("--top-p", _fraction),
                   "min_p": ("--min-p", _fraction), "repeat_penalty": ("--repeat-penalty", _positive_float),
                   "repeat_last_n": ("--repeat-last-n", _repeat_last_n)}


def sampling_value(key: str, text: str):
    """One sampler setting typed as text, read and checked as its flag's value is (ConfigError naming it)."""
    try:
        return SAMPLING_VALUES[key][1](text.strip())
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{OPTION}: {e}", option=key) from None


def add_tree_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree", action="store_true",
                   help="draft a tree, not a chain: with mode s2moe, the cost-aware tree (mode tree)")
    add_tree_shape_options(p)


def add_tree_shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-width", type=positive_int, default=2,
                   help="tree modes: candidates drafted per expanded node (default 2)")
    p.add_argument("--tree-max-nodes", type=positive_int, default=8,
                   help="tree modes: draft nodes one verification takes at most (default 8)")


def tree_mode(args) -> str:
    """The mode the flags ask for: --tree turns s2moe's chain into its tree."""
    if not args.tree or args.mode in ("tree", "tree-prob"):
        return args.mode
    if args.mode != "s2moe":
        raise ConfigError(f"--tree drafts s2moe's tree; --mode {args.mode} drafts no tree (use --mode s2moe, or "
                          "--mode tree-prob for the probability-only tree)")
    return "tree"


def add_batch_option(p: argparse.ArgumentParser) -> None:
    """llama.cpp's batch size, for every command that decodes prompts through our engine."""
    p.add_argument("-b", "--batch-size", dest="batch_size", type=positive_int, default=None, metavar="N",
                   help="tokens per llama.cpp batch: a prompt is prefilled in chunks of N, and the compute buffers "
                        "are sized for one (default 512; under a --budget of a given size, the largest of 512, 256, "
                        "… down to 32 whose buffers take at most an eighth of it). Under --budget they count against "
                        "it: a smaller N needs less memory and prefills in more passes")


def _pregate(text: str) -> tuple[int, int]:
    """N or N:M: layers ahead, and the best ranked experts read of each layer's predicted ones (0 or none: all)."""
    from ..engine.decoding.hook import PREGATE_MAX

    depth, _, width = text.partition(":")
    try:
        n, m = int(depth), int(width or 0)
    except ValueError:
        n = m = -1
    if not 0 <= n <= PREGATE_MAX or m < 0:
        raise argparse.ArgumentTypeError(f"N or N:M, N layers ahead (0 to {PREGATE_MAX}), M experts read of each "
                                         f"layer's predicted ones, not {text!r}")
    return n, m


def add_pregate_option(p: argparse.ArgumentParser) -> None:
    """Pre-gating under a budget: every command that decodes plainly under --budget for a user to time."""
    p.add_argument("--pregate", type=_pregate, default=(0, 0), metavar="N[:M]",
                   help="under --budget: as each layer of a one-token step routes, apply the next N layers' routers "
                        "to its hidden state and read the experts they predict (the best ranked M of each layer's, "
                        "default all) while it computes (pre-gating; reads ahead only, the tokens stay the same; "
                        "default 0: off)")


def pregate_pinning(args):
    from ..engine.offload import Pinning

    return Pinning(pregate=args.pregate[0], pregate_width=args.pregate[1])


def check_pregate(args) -> None:
    if args.pregate[0] and args.budget in (None, "none"):
        raise ConfigError("--pregate reads experts ahead of their layers under a memory budget: give --budget too")


def add_placement_options(p: argparse.ArgumentParser) -> None:
    """Where llama.cpp keeps the weights (engine.gpu.Placement): every command that loads a model."""
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="gpu_layers", type=_gpu_layers, default=0,
                   help="layers to offload to the GPU in a CUDA/Metal/Vulkan build of llama.cpp (-1: all)")
    p.add_argument("--cpu-moe", action="store_true",
                   help="keep every layer's expert tensors in host memory (with -ngl: the rest on the GPU)")
    p.add_argument("--n-cpu-moe", type=_non_negative_int, default=0, metavar="N",
                   help="keep the first N layers' expert tensors in host memory")
    p.add_argument("--op-offload-min-batch", type=positive_int, default=None, metavar="N",
                   help="batch size from which an op on host weights (experts in host memory) runs on the GPU, "
                        "copying the experts it uses (sets GGML_OP_OFFLOAD_MIN_BATCH; llama.cpp's default 32)")


def placement_from_args(args):
    """The Placement the flags of add_placement_options ask for, checked (no model needed)."""
    from ..engine.decoding.gpu import Placement

    placement = Placement(n_gpu_layers=args.gpu_layers, cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe,
                          op_offload_min_batch=args.op_offload_min_batch)
    placement.validate()
    return placement


def placement_flags(placement) -> list[str]:
    """The flags of add_placement_options that ask for `placement` (what a child process is given)."""
    flags = []
    if placement.n_gpu_layers:
        flags += ["-ngl", str(placement.n_gpu_layers)]
    if placement.cpu_moe:
        flags.append("--cpu-moe")
    if placement.n_cpu_moe:
        flags += ["--n-cpu-moe", str(placement.n_cpu_moe)]
    if placement.op_offload_min_batch is not None:
        flags += ["--op-offload-min-batch", str(placement.op_offload_min_batch)]
    return flags


def add_draft_experts_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-experts", choices=DRAFT_EXPERTS, default=None,
                   help="what draft passes (chains and trees) read under --budget: router, its own top k_d "
                        "(fetched where missing; the default), or resident, the router's best among the experts in "
                        "memory (drafts fetch nothing, and are accepted less often); without a budget every draft "
                        "reads the router's top k_d")


def add_copy_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--copy-cache", metavar="FILE|DIR", type=nonempty,
                   help="s2moe: also copy drafts from the generations kept in FILE (earlier runs on this model), "
                        "and keep this run's there (created if missing); a directory keeps a file per model")


def add_memory_strength_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-strength", type=_non_negative_float, default=None,
                   help="under --budget, with gating on: strength of every step's bias toward the experts in memory "
                        "(borderline choices move onto experts that need no fetch; 0 = off; default: the profile's "
                        "tuned value under a budget, else 0.3)")


def add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", type=nonempty, help="GGUF model (default: the shipped model)")
    p.add_argument("--mode", default="s2moe", choices=list(MODES), help="decoding mode (default s2moe)")
    p.add_argument("-n", "--n-predict", type=positive_int, default=128, help="tokens to generate")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    add_sampling_options(p)
    p.add_argument("--profile", type=nonempty,
                   help="device profile name or YAML path (cost constants, tuned settings); default: the app's "
                        "active profile where it holds this model's constants; none: no profile, the constants "
                        "measured at start-up")
    p.add_argument("--draft-topk", type=positive_int, default=None,
                   help="experts per token in draft passes, k_d (default: a quarter of the model's, at least 1)")
    # the settings `s2moe tune` searches default to None, "not given": the profile's tuned value, else the model's
    p.add_argument("--draft-max", type=positive_int, default=None, help="cap on draft length (default 8)")
    p.add_argument("--no-utility", action="store_true", help="fixed draft length instead of utility expansion")
    p.add_argument("--no-lookup", dest="lookup", action="store_const", const=False, default=None,
                   help="s2moe: never draft the tokens that followed a repeated n-gram of the context (drafted "
                        "where the utility rule says they pay, unless the profile's tuned settings turn them off)")
    add_draft_experts_option(p)
    add_tree_options(p)
    p.add_argument("--threshold", type=_non_negative_float, default=None, help="utility threshold (default 1)")
    p.add_argument("--reuse-strength", type=_non_negative_float, default=None,
                   help="reuse-aware gating strength α (0 = off, lossless; default 0.5)")
    p.add_argument("--reuse-cap", type=positive_int, default=None,
                   help="preferred experts |E*| (default: twice the model's experts per token, below its expert count)")
    add_memory_strength_option(p)
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=positive_int, default=2048,
                   help="context window in tokens")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads (default: all available)")
    add_batch_option(p)
    add_placement_options(p)
    add_pregate_option(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--budget", type=budget_text,
                   help="memory budget, e.g. 800M or 2G, or auto (what the process holds + a third of the expert "
                        "bytes): decode in a memory cgroup of that size with experts offloaded to storage (pinned "
                        "weights, hot experts, prefetch)")


# Other subcommands live in their own modules (s2moe.app.cmd_*), each with add_parser(sub) and
# run(args) -> int, registered here in the order `s2moe --help` lists them. Modules import heavy
# dependencies inside run(), so building the parser stays fast.
SUBCOMMAND_MODULES = ("cmd_app", "cmd_serve", "cmd_models", "cmd_profiles", "cmd_calibrate", "cmd_tune", "cmd_bench",
                      "cmd_project")


def cpu_buffers_for(model: str, wanted: bool, *, quiet: bool = False):
    """The path `model`'s CPU weights take (engine.cpu_buffers.choose; `wanted`: not under a memory budget),
    said on stderr in one line where it is not the usual one, and before a first decode checked in a child."""
    from ..engine.decoding.cpu_buffers import choose
    from ..engine.model_info import read_model_info

    cpu = choose(read_model_info(model), wanted, on_probe=None if quiet else _say)
    if not quiet and cpu.reason in ("amx", "crashed"):
        _say(cpu.line())
    return cpu


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def say_child_death(returncode: int) -> None:
    """A child that a signal killed (a crash in native code, say) has its report said here at once."""
    if returncode < 0:
        from ..engine.crashes import earlier_crashes

        for line in earlier_crashes():
            _say(line)


def _subcommand_modules():
    import importlib

    for name in SUBCOMMAND_MODULES:
        yield importlib.import_module(f"{__package__}.{name}")


def run_cli_in_budget(cli_argv: list[str], budget, model: str, *, tag: str) -> int:
    """Run `s2moe CLI_ARGV…` again inside a memory cgroup of the budget (offload.run_in_budget); the
    command, finding itself inside, offloads its decoder there (offload.offload_decoder)."""
    from ..engine import offload

    with offload.run_in_budget([sys.executable, "-m", "s2moe.app.cli", *cli_argv], budget, model, tag=tag) as run:
        try:
            rc = run.wait()
            say_child_death(rc)
            return 128 - rc if rc < 0 else rc
        except KeyboardInterrupt as e:
            # Ctrl-C at the terminal reaches the child too (one process group); SIGTERM, or a signal to
            # this pid alone, does not: make sure it has the same, and let it say so itself.
            sig, code = (signal.SIGTERM, 143) if isinstance(e, Terminated) else (signal.SIGINT, 130)
            try:
                run.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                run.proc.send_signal(sig)
            try:
                if run.proc.wait(timeout=5) == code:
                    return code
            except subprocess.TimeoutExpired:
                pass
            raise


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="s2moe", description="S²-MoE self-speculative decoding for MoE models on llama.cpp")
    parser.add_argument("--version", action="store_true", help="print the installed version of s2moe and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text from a prompt and report speculation statistics")
    add_generation_options(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", "-p", help="prompt text")
    prompt.add_argument("-f", "--file", type=nonempty,
                        help="read the prompt from this UTF-8 text file (as llama.cpp: one final newline dropped)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text and summary")
    g.add_argument("--events", action="store_true", help="print one line per iteration to stderr")
    g.add_argument("--trace", metavar="FILE", type=nonempty,
                   help="write a decoding trace (JSONL) for `s2moe project`: drafts run to the cap, noting what the "
                        "mode's rule would have kept")
    add_copy_cache_option(g)
    g.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                   help="print only the generated text, not the prompt before it")
    from . import cmd_chat

    cmd_chat.add_options(g)
    g.set_defaults(run=cmd_generate)
    for module in _subcommand_modules():
        module.add_parser(sub)
    for name in LLAMA_COMMANDS:
        sub.choices[name].add_argument(
            "--amx", action="store_true",
            help="let llama.cpp use its AMX kernels where it has them (off by default: they crash on some models)")
    return parser


def resolve_tuned(args, tuned: dict) -> dict:
    """The settings `s2moe tune` searches: a flag given wins, then the profile's tuned value, then the
    GenerationConfig default (None there: the model's routing decides)."""
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.profiles import TUNED_KEYS

    default = GenerationConfig()
    out = {}
    for key in TUNED_KEYS:
        flag = getattr(args, key, None)
        out[key] = flag if flag is not None else tuned.get(key, getattr(default, key))
    return out


def generation_config(args, decoder):
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.profiles import cost_for_model, load_profile, tuned_settings

    if args.greedy and args.temp > 0:
        raise ConfigError("--greedy and --temp > 0 contradict each other")
    cost, tuned = None, {}
    offloaded = bool(getattr(args, "budget", None))
    if args.profile:
        profile = load_profile(args.profile)
        cost = cost_for_model(profile, decoder.info.fingerprint, decoder.info.path.name,
                              offloaded=offloaded,  # budget: cold expert cost
                              experts_in_host=decoder.placement.copies_experts)
        tuned = tuned_settings(profile, decoder.info.fingerprint, offloaded=offloaded)
    cfg = GenerationConfig(**resolve_tuned(args, tuned),
        mode=tree_mode(args),
        tree_width=args.tree_width,
        tree_max_nodes=args.tree_max_nodes,
        n_predict=args.n_predict,
        **sampling_settings(args),
        utility=not args.no_utility,
        stop_at_eos=not args.ignore_eos,
        cost=cost,
        draft_experts=args.draft_experts,
    )
    cfg.validate(decoder.info)
    return cfg


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
    fetched = ("" if event.verify_misses is None else
               f" ({int(event.verify_misses.sum())} fetched, {event.verify_major_faults} storage faults)")
    why = draft_stop_text(event)
    kind = _decision_kind(event)
    if kind is not None and before is not None and _decision_kind(before) == kind:
        short = event.draft_decision.wordings[-1]
        why = "as above" if short == before.draft_decision.wordings[-1] else short
    return (f"[{event.index}] drafted {len(event.drafted)} accepted {len(event.accepted)} "
            f"({why}) rollback {event.rollback} verify {event.verify_tokens} tok "
            f"{int(event.verify_experts.sum())} experts{fetched}")


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
            print(f"profile: none — the app's active profile {name} has no constants for {info.path.name}, so they "
                  "are measured at start-up", file=sys.stderr)
        return
    args.profile = name
    if not quiet:
        print(f"profile {name}: the app's active one (--profile none: no profile, the constants measured at start-up)",
              file=sys.stderr)


def _keep_copies(args, decoder) -> None:
    if args.copy_cache is not None:
        from ..engine.drafting.copycache import save_copy_cache

        save_copy_cache(args.copy_cache, decoder.info, decoder.earlier)


def offload_under_budget(args, decoder, budget, warm_up, *, quiet: bool = False):
    """Offload `decoder` under `budget` (this process inside its cgroup) with the hot experts of --profile, said
    on stderr in a line or two unless quiet: the budget's split and batch size, and what a profile would add.
    Returns the offloader and the hot experts it was given."""
    from ..engine import offload
    from ..engine.profiles import hot_experts_for_model, load_profile

    hot = hot_experts_for_model(load_profile(args.profile), decoder.info.fingerprint) if args.profile else []
    offloader = offload.offload_decoder(decoder, budget, hot, warm_up=warm_up, pinning=pregate_pinning(args),
                                        say=None if quiet else _say)
    if not quiet:
        from ..engine.offload.sizes import fmt_bytes

        plan = offloader.plan
        rt = decoder.rt
        print((plan.describe() if plan is not None and not budget.auto else
               f"budget {budget.describe(offloader.budget_bytes)}")
              + (f", {offloader.budget_note}" if offloader.budget_note else "")
              + f" · prefill in batches of {rt.n_batch} ({fmt_bytes(rt.compute_buffer_bytes)} of compute buffers)",
              file=sys.stderr)
        if not hot:
            print(no_hot_experts_note(args.profile, decoder.info.path, args.budget), file=sys.stderr)
    return offloader, hot


def cmd_generate(args) -> int:
    from ..engine.decoding.decoder import Decoder
    from ..engine.decoding.generation_config import GenerationConfig
    import numpy as np

    from ..engine import offload
    from ..engine.events import Finished, Iteration, MeasuringCosts, ResidencySnapshot, Started, Summary
    from ..engine.decoding.sampling import RANDOM_SEED, random_seed

    model = args.model if args.model is not None else default_model()
    if args.file is not None:
        args.prompt = prompt_file_text(args.file)
    from . import cmd_chat

    cmd_chat.check_options(args)
    check_pregate(args)
    # Validate flags that need no model before loading one.
    GenerationConfig(mode=tree_mode(args), n_predict=args.n_predict, draft_topk=args.draft_topk,
                     draft_max=args.draft_max, tree_width=args.tree_width, tree_max_nodes=args.tree_max_nodes,
                     **sampling_settings(args)).validate()
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
    with said_if_slow(None if args.json else _say, f"loading {os.path.basename(model)}…"):
        decoder = Decoder(model, n_ctx=args.ctx, n_threads=args.threads, max_draft=max(16, args.draft_max or 0),
                          use_extra_bufts=cpu.extra, placement=placement, n_batch=args.batch_size)
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
        print(f"note: {decoder.info.path.name} is a dense model: only plain decoding (--mode ar) applies",
              file=sys.stderr)
    cfg = generation_config(args, decoder)
    if args.profile and not args.json and cfg.mode == "s2moe":
        from ..engine.profiles import TUNED_KEYS, load_profile, tuned_settings
        from .cmd_tune import settings_text

        if tuned_settings(load_profile(args.profile), decoder.info.fingerprint, offloaded=budget is not None):
            shown = cfg.resolved(decoder.info)
            print(f"settings (profile {args.profile}'s tuned ones where no flag is given): "
                  f"{settings_text({k: getattr(shown, k) for k in TUNED_KEYS}, budget is not None)}",
                  file=sys.stderr)
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
            out.line(f"cost constants ({c.source}): T_AR {c.t_ar * 1e3:.2f} ms, C_draft {c.c_draft * 1e3:.2f} ms, "
                     f"T_exp {c.t_exp * 1e3:.4f} ms, T_tok {c.t_tok * 1e3:.3f} ms{fit}")
        elif isinstance(event, Iteration):
            if args.events:
                out.line(event_line(event, last_iteration))
                last_iteration = event
            if streaming:
                out.text(prompt_echo + event.committed_text)
                prompt_echo = ""
        elif isinstance(event, ResidencySnapshot) and args.events:
            hit = ", ".join("–" if np.isnan(h) else f"{h:.2f}" for h in event.hit_rate)
            out.line(f"[{event.iteration}] experts resident per layer "
                     f"{', '.join(f'{x:.2f}' for x in event.resident.mean(axis=1))}; hit rate {hit}")
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
        out.update(tokens=list(summary.tokens), text=summary.text, model=str(decoder.info.path), seed=cfg.seed,
                   cpu_buffers=cpu.as_dict())
        if summary.cost is not None:
            out["cost"] = {k: v for k, v in summary.cost.__dict__.items()}
        print(json.dumps(out))
        return 0
    out.text(prompt_echo if streaming else prompt_echo + summary.text)
    reuse = f"{summary.reuse_ratio:.3f}" if summary.reuse_ratio is not None else "n/a"
    print(f"\n--\n{summary.n_tokens} tokens in {summary.seconds:.2f} s ({speed_text(summary)})"
          f" · mode {summary.mode} · accept length {summary.accept_len:.2f} · reuse ratio {reuse}"
          f" · rollbacks {summary.rollbacks} · stop: {summary.stop_reason}")
    return 0


def speed_text(summary) -> str:
    """A generation's speed as every command words it: decoding first, counted as bench and tune count it
    (from the step that makes the first token to the last, the prompt's prefill left out, wall time), then
    overall, the prefill included (what a long prompt makes the user wait)."""
    return (f"{summary.decode_tok_per_s:.1f} tok/s decoding, {summary.tok_per_s:.1f} with the "
            f"{summary.prefill_seconds:.2f} s prefill")


def one_line(text: str) -> str:
    """text with its control characters (a line break or carriage return in a file name, say) written as
    escapes: an error stays one line, and cannot move the terminal's cursor."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# The commands that run llama.cpp: a failed check inside it ends them with one line (_abort_line).
LLAMA_COMMANDS = ("generate", "calibrate", "tune", "bench", "app", "serve")


def _abort_line(message: str) -> None:
    """llama.cpp stopped on a failed internal check: the process cannot go on, but it can say so in one line
    (ggml would print a debugger backtrace, on stdout) and exit as for bad input."""
    sys.stderr.write(f"error: llama.cpp stopped on a failed check ({one_line(message)}): the model file or a "
                     "setting is not one it supports\n")
    sys.stderr.flush()
    os._exit(2)


def _say_interrupted(word: str = "interrupted") -> None:
    """'interrupted' (or 'terminated'), once: a second signal while saying it (or one a budget's parent
    passes on) is ignored rather than raised in the middle of the handler as a traceback."""
    if threading.current_thread() is not threading.main_thread():
        print(word, file=sys.stderr)
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(word, file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)



def main(argv=None, *, watch: bool = False) -> int:
    """The CLI; `watch`: record the run so that a crash in native code is reported by the next one
    (engine.crashes), for a process of its own (the console script), not a caller's."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Inside an import CPython can drop a Ctrl-C (engine.errors.held_signals): every import is held, and
        # the command modules, which are imported by name, are held by hand.
        with sigterm_raises_terminated(), imports_held():
            with held_signals():
                parser = build_parser()
                if not argv:
                    argv = ["app"]  # the main job
                args = parser.parse_args(argv)
                args._argv = list(argv)  # `generate --budget` reruns the command inside a memory cgroup
                if args.version:
                    from importlib.metadata import version

                    print(f"s2moe {version('s2moe')}")
                    return 0
                if getattr(args, "run", None) is None:
                    parser.print_help()
                    return 2
                if args.command in LLAMA_COMMANDS:
                    from ..engine.decoding.cpu_buffers import AMX_ENV
                    from ..engine.crashes import earlier_crashes
                    from ..engine.decoding.runtime import on_llama_abort

                    on_llama_abort(_abort_line)
                    if args.amx:
                        os.environ[AMX_ENV] = "1"  # the budget's and bench's child processes inherit it
                    for line in earlier_crashes():
                        _say(line)
            if watch and args.command in LLAMA_COMMANDS:
                from ..engine.crashes import watched

                with watched(args.command, getattr(args, "model", None)):
                    return args.run(args)
            return args.run(args)
    except S2MoEError as e:
        print(f"error: {one_line(e.worded(FLAGS))}", file=sys.stderr)
        return 2
    except Terminated:
        _say_interrupted("terminated")
        return 143
    except KeyboardInterrupt:
        _say_interrupted()
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """The console script: main's exit code, which a Ctrl-C that Python gets round to only while the
    interpreter shuts down must not turn into death by SIGINT."""
    code = main(watch=True)
    if code in (130, 143):
        # A KeyboardInterrupt that passed through a module run from C (an import in the middle of a Ctrl-C)
        # leaves CPython marked as interrupted even though main caught it: its shutdown would then end the
        # process by SIGINT, after "interrupted" was said. Every clean-up has run by now (finally blocks).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
