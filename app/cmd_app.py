"""`s2moe app`: the terminal UI (chat with live speculation plots, calibration, profiles, bench)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    from .options import (
        add_batch_option,
        add_copy_cache_option,
        add_placement_options,
        add_sampling_options,
        budget_text,
        nonempty,
        positive_int,
    )

    p = subparsers.add_parser("app", help="open the terminal app (the default when s2moe has no arguments)")
    p.add_argument("--model", "-m", type=nonempty, help="GGUF model (default: the shipped model)")
    p.add_argument(
        "--profile",
        type=nonempty,
        help="device profile name or YAML path (cost constants); measured at start-up if absent",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for the engine (default: all cores but one, which the UI needs)",
    )
    p.add_argument(
        "-c", "--ctx-size", "--ctx", dest="ctx", type=positive_int, default=2048, help="context window in tokens"
    )
    p.add_argument(
        "--budget",
        type=budget_text,
        help="memory budget (SIZE such as 80M, or auto = what the app holds + a third of the expert "
        "bytes): run inside a memory cgroup of that size, experts offloaded",
    )
    add_batch_option(p)
    add_placement_options(p)
    add_sampling_options(p)
    add_copy_cache_option(p)
    # Given, a sampler flag overrides the chat's remembered setting; not given, the remembered one stands.
    p.set_defaults(
        run=run, temp=None, seed=None, top_k=None, top_p=None, min_p=None, repeat_penalty=None, repeat_last_n=None
    )


def build_app(args):
    """The app for these arguments (no model and none shipped: it opens and asks for a path)."""
    from pathlib import Path

    from ..engine.errors import ConfigError
    from .options import placement_from_args, sampling_settings
    from .tui.app import S2MoEApp
    from .tui.session import shipped_default_model

    model, message = args.model, None
    if model is not None:
        if not Path(model).expanduser().is_file():
            message = f"No model file at {model!r}. Type the path of a GGUF Mixture-of-Experts model."
            model = None
        else:
            model = str(Path(model).expanduser())
    else:
        default = shipped_default_model()
        model = str(default) if default is not None else None
    profile = args.profile
    if profile:
        from ..engine.profiles import load_profile

        load_profile(profile)  # a missing or invalid profile is a one-line error before the UI opens
    else:
        from .tui.state import remembered_profile

        profile = remembered_profile()
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    return S2MoEApp(
        model,
        profile=profile,
        n_threads=args.threads,
        n_ctx=getattr(args, "ctx", 2048),
        n_batch=getattr(args, "batch_size", None),
        model_message=message,
        budget=getattr(args, "budget", None),
        copy_cache=getattr(args, "copy_cache", None),
        placement=placement_from_args(args) if hasattr(args, "gpu_layers") else None,
        sampling={k: v for k, v in sampling_settings(args).items() if v is not None} if hasattr(args, "temp") else None,
    )


def run(args) -> int:
    budget = getattr(args, "budget", None)
    if budget is not None:
        from ..engine import offload
        from ..engine.errors import ConfigError
        from .model_runs import run_cli_in_budget

        parsed = offload.Budget.parse(budget)  # a bad size is a one-line error before anything starts
        if offload.current_budget() is None:
            app = build_app(args)  # validates the model path and profile in this process
            model = app.session.model_path
            if model is None:
                raise ConfigError("a memory budget needs a model file (--model PATH, or the shipped model)")
            return run_cli_in_budget(args._argv, parsed, model, tag="app")
    app = build_app(args)
    app.run()
    return app.return_code or 0
