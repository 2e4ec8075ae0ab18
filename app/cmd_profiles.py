"""`s2moe profiles list|show NAME`: the device profiles shipped and the user's own (XDG config dir)."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("profiles", help="list device profiles or show one")
    ps = p.add_subparsers(dest="profiles_command", parser_class=type(p))
    ps.add_parser("list", help="list shipped and user profiles")
    show = ps.add_parser("show", help="print a profile")
    show.add_argument("name", help="profile name or YAML path")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ..engine.errors import ConfigError
    from ..engine.profiles import list_profiles, load_profile, profile_text, shipped_profile_dir, user_profile_dir

    console = Console(highlight=False)
    command = getattr(args, "profiles_command", None) or "list"
    if command == "list":
        table = Table(title="device profiles", title_justify="left")
        for col in ("name", "kind", "device", "models", "origin", "status"):
            table.add_column(col)
        for e in list_profiles():
            # names and device names come from files: shown as written, never read as markup
            table.add_row(
                Text(e.name),
                e.kind,
                Text(e.device),
                str(e.n_models),
                e.where,
                "ok" if e.error is None else Text(e.error, style="red"),
            )
        console.print(table)
        console.print(f"user profiles: {user_profile_dir()}\nshipped profiles: {shipped_profile_dir()}")
        return 0
    if command == "show":
        path = Path(load_profile(args.name)["_path"])
        print(f"# {path}")
        print(profile_text(path).rstrip())
        return 0
    raise ConfigError(f"unknown profiles command {command!r} (list, show NAME)")
