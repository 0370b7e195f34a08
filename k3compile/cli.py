"""The `k3compile` command: one subcommand per tool (`k3compile diff ...`, `k3compile generate ...`)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# subcommand -> (module with `add_arguments(parser)` setting `run`, one-line help)
COMMANDS = {
    "diff": ("k3compile.tools.diff.cli",
             "what the k3 backend did to a model's graph, per layer template"),
    "generate": ("k3compile.tools.generate",
                 "greedy decode from a prompt, tokens/s under eager, Inductor and k3 side by side"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        # modules import lazily: `k3compile --help` should not pay for torch
        sub.add_parser(name, help=help_, description=help_, add_help=False)
    known, rest = parser.parse_known_args(argv)
    module, help_ = COMMANDS[known.command]
    tool = argparse.ArgumentParser(prog=f"k3compile {known.command}", description=help_)
    importlib.import_module(module).add_arguments(tool)
    args = tool.parse_args(rest)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
