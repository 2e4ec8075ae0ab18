"""The `s2moe` argument parser: its one-line errors, and the subcommands registered in the order `s2moe --help`
lists them. Building it imports no heavy dependency, so that `--help` and bad flags answer at once."""

from __future__ import annotations

import argparse
import re

from ..engine.errors import ConfigError

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


# The subcommands live in their own modules (s2moe.app.cmd_*), each with add_parser(sub) and
# run(args) -> int, registered here in the order `s2moe --help` lists them. Modules import heavy
# dependencies inside run(), so building the parser stays fast.
SUBCOMMAND_MODULES = (
    "cmd_generate",
    "cmd_app",
    "cmd_serve",
    "cmd_models",
    "cmd_profiles",
    "cmd_calibrate",
    "cmd_tune",
    "cmd_bench",
    "cmd_project",
)


# The commands that run llama.cpp: a failed check inside it ends them with one line (cli._abort_line).
LLAMA_COMMANDS = ("generate", "calibrate", "tune", "bench", "app", "serve")


def _subcommand_modules():
    import importlib

    for name in SUBCOMMAND_MODULES:
        yield importlib.import_module(f"{__package__}.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="s2moe", description="S²-MoE self-speculative decoding for MoE models on llama.cpp")
    parser.add_argument("--version", action="store_true", help="print the installed version of s2moe and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for module in _subcommand_modules():
        module.add_parser(sub)
    for name in LLAMA_COMMANDS:
        sub.choices[name].add_argument(
            "--amx",
            action="store_true",
            help="let llama.cpp use its AMX kernels where it has them (off by default: they crash on some models)",
        )
    return parser
