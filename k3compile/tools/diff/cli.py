"""`k3compile diff` / `python -m k3compile.tools.diff`: the command line.

Every bad argument is an argparse error (one line after the usage, exit status 2), found before
anything compiles: sizes must be positive, the dtype a floating-point torch dtype, `--option` a
known backend option with a value that `Options.make` accepts (a bucket list included), the
config one the models know and `--layers` at most its layer count. Exit status 1: a bucket's
fusion contract is not met; 0: met.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from typing import Any

from k3compile.settings import Options
from k3compile.tools.args import option, positive_int
from k3compile.tools.diff.text import NEAR_MISSES

DTYPES = ("bfloat16", "float16", "float32")
EXECUTORS = ("aten", "inductor")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="tiny", help="built-in config (tiny, small, k3_tp16, ...)")
    src.add_argument("--model", help="module:factory returning (model, example_inputs)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[2],
                   help="batch size(s), one bucket each")
    p.add_argument("--T", type=positive_int, default=1,
                   help="verify rows per request (1: plain decode)")
    p.add_argument("--world-size", type=positive_int, default=1,
                   help=">1: tensor parallel, one process per rank under gloo on CPU")
    p.add_argument("--layers", type=positive_int,
                   help="cut the built-in config to its first N layers")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default="cpu", help="where the built-in model lives (cpu, cuda)")
    p.add_argument("--executor", choices=EXECUTORS,
                   help="what runs the graph the patterns leave (default: aten)")
    p.add_argument("--disable", action="append", default=[], metavar="PATTERN",
                   help="disable a pattern (name or prefix); repeatable")
    p.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                   help="any backend option (JSON value, e.g. buckets=[1,2,4]); repeatable")
    p.add_argument("--stages", nargs=2, metavar=("A", "B"), help="diff two stages ('input': the "
                   "graph the pipeline receives)")
    p.add_argument("--near-misses", choices=NEAR_MISSES, default="missing",
                   help="list near misses for templates short of their plan (default) or all")
    p.add_argument("--html", metavar="DIR", help="also write an HTML report (every near miss)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--max-diff-lines", type=positive_int, default=120)
    p.set_defaults(run=functools.partial(_run_cli, p))
    return p


def _options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    options = dict(args.option)
    given = options.get("executor")
    if given is not None and args.executor is not None and given != args.executor:
        parser.error(f"--executor {args.executor} contradicts --option executor={given}")
    options["executor"] = args.executor or given or "aten"
    if args.disable:
        options["disabled_patterns"] = [*options.get("disabled_patterns", []), *args.disable]
    buckets = Options.make({"buckets": options["buckets"]} if "buckets" in options else {}).buckets
    if max(args.batch) > max(buckets):
        parser.error(f"--batch {max(args.batch)} is above the largest bucket {max(buckets)} "
                     "(it would run uncompiled): add a bucket with --option buckets=[...]")
    return options


def _check_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from k3compile.models import get_config

    if args.model:
        from k3compile.tools.diff.run import load_factory

        if args.layers:
            parser.error("--layers cuts a built-in config; a --model factory builds its own")
        try:
            load_factory(args.model)
        except (ValueError, ImportError, AttributeError) as e:
            parser.error(f"--model {args.model}: {str(e).splitlines()[0]}")
        return
    try:
        cfg = get_config(args.config, args.world_size if args.world_size > 1 else None)
    except (ValueError, KeyError) as e:
        parser.error(f"--config {args.config}: {str(e).splitlines()[0]}")
    if args.layers and args.layers > cfg.num_hidden_layers:
        parser.error(f"--layers {args.layers}: config {args.config} has "
                     f"{cfg.num_hidden_layers} layers")


def _run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from k3compile.pipeline import STAGES
    from k3compile.tools.diff.html import write_html
    from k3compile.tools.diff.run import run
    from k3compile.tools.diff.text import format_text

    known = ["input", *(name for name, _ in STAGES)]
    if args.stages and not set(args.stages) <= set(known):
        unknown = ", ".join(s for s in args.stages if s not in known)
        parser.error(f"--stages: unknown stage {unknown}; the stages: {', '.join(known)}")
    options = _options(parser, args)
    _check_source(parser, args)
    report = run(None if args.model else args.config, args.model, args.batch, args.T,
                 args.world_size, args.layers, args.dtype, options, args.stages, args.device)
    color = {"auto": None, "always": True, "never": False}[args.color]
    print(format_text(report, color, args.max_diff_lines, args.near_misses))
    if args.html:
        print(f"HTML report: {write_html(report, args.html)}")
    return report.exit_code


def main(argv: Sequence[str] | None = None, prog: str = "python -m k3compile.tools.diff") -> int:
    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
