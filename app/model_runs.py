"""What the commands that load and run a model share: the default model, the path its CPU weights take, a
rerun inside a memory cgroup, offloading under a budget, the GenerationConfig the flags and a profile ask for,
and the wording of a run's speed. One function for each job, so that generate, serve, bench, tune and the
app do it alike."""

from __future__ import annotations

import signal
import subprocess
import sys

from ..engine.errors import ConfigError, Terminated
from .options import pregate_pinning, sampling_settings, tree_mode


def no_hot_experts_note(profile_name: str | None, model, budget: str) -> str:
    """What a run under a budget pinning no hot experts misses, and the command that gives them: a profile of
    the model calibrated under the budget pins the experts routed most, and spares the start-up measurement
    (itself fetching experts under the budget)."""
    import shlex

    why = (
        f"profile {profile_name} has no hot experts for this model"
        if profile_name
        else "no profile: no hot experts are pinned and the cost constants are measured at start-up"
    )
    return (
        f"note: {why}; calibrate once under this budget (s2moe calibrate -m {shlex.quote(str(model))} "
        f"--budget {shlex.quote(budget)} --name NAME) and pass --profile NAME"
    )


def default_model() -> str:
    from ..engine.zoo import default_model_path

    path = default_model_path()
    if path is None or not path.is_file():
        raise ConfigError("no shipped default model in this install: pass --model PATH to a GGUF MoE model")
    return str(path)


def cpu_buffers_for(model: str, wanted: bool, *, quiet: bool = False):
    """The path `model`'s CPU weights take (engine.decoding.cpu_buffers.choose; `wanted`: not under a memory budget),
    said on stderr in one line where it is not the usual one, and before a first decode checked in a child."""
    from ..engine.decoding.cpu_buffers import choose
    from ..engine.model_info import read_model_info

    cpu = choose(read_model_info(model), wanted, on_probe=None if quiet else say)
    if not quiet and cpu.reason in ("amx", "crashed"):
        say(cpu.line())
    return cpu


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def say_child_death(returncode: int) -> None:
    """A child that a signal killed (a crash in native code, say) has its report said here at once."""
    if returncode < 0:
        from ..engine.crashes import earlier_crashes

        for line in earlier_crashes():
            say(line)


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


def resolve_tuned(args, tuned: dict) -> dict:
    """The settings `s2moe tune` searches: a flag given wins, then the profile's tuned value, then the
    GenerationConfig default (None there: the model's routing decides)."""
    from ..engine.decoding.generation_config import GenerationConfig
    from ..engine.profile_schema import TUNED_KEYS

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
        cost = cost_for_model(
            profile,
            decoder.info.fingerprint,
            decoder.info.path.name,
            offloaded=offloaded,  # budget: cold expert cost
            experts_in_host=decoder.placement.copies_experts,
        )
        tuned = tuned_settings(profile, decoder.info.fingerprint, offloaded=offloaded)
    cfg = GenerationConfig(
        **resolve_tuned(args, tuned),
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


def offload_under_budget(args, decoder, budget, warm_up, *, quiet: bool = False):
    """Offload `decoder` under `budget` (this process inside its cgroup) with the hot experts of --profile, said
    on stderr in a line or two unless quiet: the budget's split and batch size, and what a profile would add.
    Returns the offloader and the hot experts it was given."""
    from ..engine import offload
    from ..engine.profiles import hot_experts_for_model, load_profile

    hot = hot_experts_for_model(load_profile(args.profile), decoder.info.fingerprint) if args.profile else []
    offloader = offload.offload_decoder(
        decoder, budget, hot, warm_up=warm_up, pinning=pregate_pinning(args), say=None if quiet else say
    )
    if not quiet:
        from ..engine.offload import fmt_bytes

        plan = offloader.plan
        rt = decoder.rt
        print(
            (
                plan.describe()
                if plan is not None and not budget.auto
                else f"budget {budget.describe(offloader.budget_bytes)}"
            )
            + (f", {offloader.budget_note}" if offloader.budget_note else "")
            + f" · prefill in batches of {rt.n_batch} ({fmt_bytes(rt.compute_buffer_bytes)} of compute buffers)",
            file=sys.stderr,
        )
        if not hot:
            print(no_hot_experts_note(args.profile, decoder.info.path, args.budget), file=sys.stderr)
    return offloader, hot


def speed_text(summary) -> str:
    """A generation's speed as every command words it: decoding first, counted as bench and tune count it
    (from the step that makes the first token to the last, the prompt's prefill left out, wall time), then
    overall, the prefill included (what a long prompt makes the user wait)."""
    return (
        f"{summary.decode_tok_per_s:.1f} tok/s decoding, {summary.tok_per_s:.1f} with the "
        f"{summary.prefill_seconds:.2f} s prefill"
    )
