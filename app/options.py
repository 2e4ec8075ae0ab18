"""The command-line options that several `s2moe` commands share, and the readers of their values: each is added
to a command's parser by one function here, so that a flag is spelled, checked and explained the same way in
every command that takes it; the app's settings read typed values as these flags do (sampling_value)."""

from __future__ import annotations

import argparse

from ..engine.errors import OPTION, ConfigError, S2MoEError
from ..engine.modes import DRAFT_EXPERTS, MODES

# The engine's names for the settings its errors are about → the flags that set them.
FLAGS = {
    "n_predict": "-n",
    "temperature": "--temp",
    "draft_topk": "--draft-topk",
    "draft_max": "--draft-max",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "repeat_last_n": "--repeat-last-n",
    "reuse_strength": "--reuse-strength",
    "memory_strength": "--memory-strength",
    "threshold": "--threshold",
    "reuse_cap": "--reuse-cap",
    "n_ctx": "--ctx",
    "n_threads": "--threads",
    "seed": "--seed",
    "n_gpu_layers": "-ngl",
    "n_cpu_moe": "--n-cpu-moe",
    "op_offload_min_batch": "--op-offload-min-batch",
    "time_budget": "--time-budget",
    "tree_width": "--tree-width",
    "tree_max_nodes": "--tree-max-nodes",
    "draft_experts": "--draft-experts",
}


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


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampler options, its defaults. Applied as llama.cpp applies them, in every mode: the
    draft and the verification sample from the same processed distributions (engine.decoding.sampling)."""
    from ..engine.decoding import sampling as s

    p.add_argument("--temp", type=_non_negative_float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("-s", "--seed", type=_seed, default=0, help="random seed (default 0; -1: a random one, printed)")
    p.add_argument(
        "--top-k",
        type=_non_negative_int,
        default=s.TOP_K,
        help=f"sample among the k most likely tokens (default {s.TOP_K}, 0 = off)",
    )
    p.add_argument(
        "--top-p",
        type=_fraction,
        default=s.TOP_P,
        help=f"nucleus sampling: the most likely tokens up to this mass (default {s.TOP_P}, 1 = off)",
    )
    p.add_argument(
        "--min-p",
        type=_fraction,
        default=s.MIN_P,
        help=f"drop tokens below this share of the most likely one (default {s.MIN_P}, 0 = off)",
    )
    p.add_argument(
        "--repeat-penalty",
        type=_positive_float,
        default=s.REPEAT_PENALTY,
        help=f"penalise the tokens of the last --repeat-last-n (default {s.REPEAT_PENALTY:g}, 1 = off); "
        "greedy decoding too",
    )
    p.add_argument(
        "--repeat-last-n",
        type=_repeat_last_n,
        default=s.REPEAT_LAST_N,
        help=f"tokens the repeat penalty looks back over (default {s.REPEAT_LAST_N}, 0 = off, -1 = the whole context)",
    )


def sampling_settings(args) -> dict:
    """The sampler options of parsed arguments, as GenerationConfig fields."""
    return dict(
        temperature=args.temp,
        seed=args.seed,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
    )


# GenerationConfig's sampler fields → the flag that sets each and the reader of its value: the app's settings
# read what a user types as these flags do.
SAMPLING_VALUES = {
    "temperature": ("--temp", _non_negative_float),
    "seed": ("-s", _seed),
    "top_k": ("--top-k", _non_negative_int),
    "top_p": ("--top-p", _fraction),
    "min_p": ("--min-p", _fraction),
    "repeat_penalty": ("--repeat-penalty", _positive_float),
    "repeat_last_n": ("--repeat-last-n", _repeat_last_n),
}


def sampling_value(key: str, text: str):
    """One sampler setting typed as text, read and checked as its flag's value is (ConfigError naming it)."""
    try:
        return SAMPLING_VALUES[key][1](text.strip())
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{OPTION}: {e}", option=key) from None


def add_tree_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree",
        action="store_true",
        help="draft a tree, not a chain: with mode s2moe, the cost-aware tree (mode tree)",
    )
    add_tree_shape_options(p)


def add_tree_shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree-width",
        type=positive_int,
        default=2,
        help="tree modes: candidates drafted per expanded node (default 2)",
    )
    p.add_argument(
        "--tree-max-nodes",
        type=positive_int,
        default=8,
        help="tree modes: draft nodes one verification takes at most (default 8)",
    )


def tree_mode(args) -> str:
    """The mode the flags ask for: --tree turns s2moe's chain into its tree."""
    if not args.tree or args.mode in ("tree", "tree-prob"):
        return args.mode
    if args.mode != "s2moe":
        raise ConfigError(
            f"--tree drafts s2moe's tree; --mode {args.mode} drafts no tree (use --mode s2moe, or "
            "--mode tree-prob for the probability-only tree)"
        )
    return "tree"


def add_batch_option(p: argparse.ArgumentParser) -> None:
    """llama.cpp's batch size, for every command that decodes prompts through our engine."""
    p.add_argument(
        "-b",
        "--batch-size",
        dest="batch_size",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per llama.cpp batch: a prompt is prefilled in chunks of N, and the compute buffers "
        "are sized for one (default 512; under a --budget of a given size, the largest of 512, 256, "
        "… down to 32 whose buffers take at most an eighth of it). Under --budget they count against "
        "it: a smaller N needs less memory and prefills in more passes",
    )


def _pregate(text: str) -> tuple[int, int]:
    """N or N:M: layers ahead, and the best ranked experts read of each layer's predicted ones (0 or none: all)."""
    from ..engine.decoding.hook import PREGATE_MAX

    depth, _, width = text.partition(":")
    try:
        n, m = int(depth), int(width or 0)
    except ValueError:
        n = m = -1
    if not 0 <= n <= PREGATE_MAX or m < 0:
        raise argparse.ArgumentTypeError(
            f"N or N:M, N layers ahead (0 to {PREGATE_MAX}), M experts read of each "
            f"layer's predicted ones, not {text!r}"
        )
    return n, m


def add_pregate_option(p: argparse.ArgumentParser) -> None:
    """Pre-gating under a budget: every command that decodes plainly under --budget for a user to time."""
    p.add_argument(
        "--pregate",
        type=_pregate,
        default=(0, 0),
        metavar="N[:M]",
        help="under --budget: as each layer of a one-token step routes, apply the next N layers' routers "
        "to its hidden state and read the experts they predict (the best ranked M of each layer's, "
        "default all) while it computes (pre-gating; reads ahead only, the tokens stay the same; "
        "default 0: off)",
    )


def pregate_pinning(args):
    from ..engine.offload import Pinning

    return Pinning(pregate=args.pregate[0], pregate_width=args.pregate[1])


def check_pregate(args) -> None:
    if args.pregate[0] and args.budget in (None, "none"):
        raise ConfigError("--pregate reads experts ahead of their layers under a memory budget: give --budget too")


def add_placement_options(p: argparse.ArgumentParser) -> None:
    """Where llama.cpp keeps the weights (engine.decoding.gpu.Placement): every command that loads a model."""
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        dest="gpu_layers",
        type=_gpu_layers,
        default=0,
        help="layers to offload to the GPU in a CUDA/Metal/Vulkan build of llama.cpp (-1: all)",
    )
    p.add_argument(
        "--cpu-moe",
        action="store_true",
        help="keep every layer's expert tensors in host memory (with -ngl: the rest on the GPU)",
    )
    p.add_argument(
        "--n-cpu-moe",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="keep the first N layers' expert tensors in host memory",
    )
    p.add_argument(
        "--op-offload-min-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="batch size from which an op on host weights (experts in host memory) runs on the GPU, "
        "copying the experts it uses (sets GGML_OP_OFFLOAD_MIN_BATCH; llama.cpp's default 32)",
    )


def placement_from_args(args):
    """The Placement the flags of add_placement_options ask for, checked (no model needed)."""
    from ..engine.decoding.gpu import Placement

    placement = Placement(
        n_gpu_layers=args.gpu_layers,
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
        op_offload_min_batch=args.op_offload_min_batch,
    )
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
    p.add_argument(
        "--draft-experts",
        choices=DRAFT_EXPERTS,
        default=None,
        help="what draft passes (chains and trees) read under --budget: router, its own top k_d "
        "(fetched where missing; the default), or resident, the router's best among the experts in "
        "memory (drafts fetch nothing, and are accepted less often); without a budget every draft "
        "reads the router's top k_d",
    )


def add_copy_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--copy-cache",
        metavar="FILE|DIR",
        type=nonempty,
        help="s2moe: also copy drafts from the generations kept in FILE (earlier runs on this model), "
        "and keep this run's there (created if missing); a directory keeps a file per model",
    )


def add_memory_strength_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-strength",
        type=_non_negative_float,
        default=None,
        help="under --budget, with gating on: strength of every step's bias toward the experts in memory "
        "(borderline choices move onto experts that need no fetch; 0 = off; default: the profile's "
        "tuned value under a budget, else 0.3)",
    )


def add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", type=nonempty, help="GGUF model (default: the shipped model)")
    p.add_argument("--mode", default="s2moe", choices=list(MODES), help="decoding mode (default s2moe)")
    p.add_argument("-n", "--n-predict", type=positive_int, default=128, help="tokens to generate")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    add_sampling_options(p)
    p.add_argument(
        "--profile",
        type=nonempty,
        help="device profile name or YAML path (cost constants, tuned settings); default: the app's "
        "active profile where it holds this model's constants; none: no profile, the constants "
        "measured at start-up",
    )
    p.add_argument(
        "--draft-topk",
        type=positive_int,
        default=None,
        help="experts per token in draft passes, k_d (default: a quarter of the model's, at least 1)",
    )
    # the settings `s2moe tune` searches default to None, "not given": the profile's tuned value, else the model's
    p.add_argument("--draft-max", type=positive_int, default=None, help="cap on draft length (default 8)")
    p.add_argument("--no-utility", action="store_true", help="fixed draft length instead of utility expansion")
    p.add_argument(
        "--no-lookup",
        dest="lookup",
        action="store_const",
        const=False,
        default=None,
        help="s2moe: never draft the tokens that followed a repeated n-gram of the context (drafted "
        "where the utility rule says they pay, unless the profile's tuned settings turn them off)",
    )
    add_draft_experts_option(p)
    add_tree_options(p)
    p.add_argument("--threshold", type=_non_negative_float, default=None, help="utility threshold (default 1)")
    p.add_argument(
        "--reuse-strength",
        type=_non_negative_float,
        default=None,
        help="reuse-aware gating strength α (0 = off, lossless; default 0.5)",
    )
    p.add_argument(
        "--reuse-cap",
        type=positive_int,
        default=None,
        help="preferred experts |E*| (default: twice the model's experts per token, below its expert count)",
    )
    add_memory_strength_option(p)
    p.add_argument(
        "-c", "--ctx-size", "--ctx", dest="ctx", type=positive_int, default=2048, help="context window in tokens"
    )
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads (default: all available)")
    add_batch_option(p)
    add_placement_options(p)
    add_pregate_option(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument(
        "--budget",
        type=budget_text,
        help="memory budget, e.g. 800M or 2G, or auto (what the process holds + a third of the expert "
        "bytes): decode in a memory cgroup of that size with experts offloaded to storage (pinned "
        "weights, hot experts, prefetch)",
    )
