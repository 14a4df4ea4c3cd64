"""The `oases` command line: `oases plan` (oases.planner.cli) and `oases env` (oases.env).

oases plan --model llama-7b --world 16 --device-memory 24GB --link 25gbit
oases env [--probe-link]
python -m oases ...                                      # the same
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from oases import env as env_command
from oases.planner import cli as plan_command

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `oases COMMAND ...` (argv: sys.argv[1:] when None); returns the exit status."""
    parser = argparse.ArgumentParser(prog="oases", description="Oases command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser(
        "plan",
        help="choose (dp, pp, tp), schedule and per-layer TP degrees for a model",
        description=plan_command.DESCRIPTION,
    )
    plan_command.add_arguments(plan)
    env = sub.add_parser(
        "env",
        help="print versions, build, GPUs and link shaping for a bug report "
        "(--probe-link: measure the link inside a launch)",
        description=env_command.DESCRIPTION,
    )
    env_command.add_arguments(env)
    args = parser.parse_args(argv)
    return env_command.run(args) if args.command == "env" else plan_command.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
