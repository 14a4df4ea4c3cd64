"""The `oases` command line: `oases plan` (oases.planner.cli), `oases env` (oases.env) and
`oases check-model` (oases.check_model).

oases plan --model llama-7b --world 16 --device-memory 24GB --link 25gbit
oases env [--probe-link]
oases check-model qwen3 [--tp 2 4]
python -m oases ...                                      # the same
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from oases import check_model as check_model_command
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
    check = sub.add_parser(
        "check-model",
        help="check on 2 and 4 local ranks that oases trains a model type (or config) exactly",
        description=check_model_command.DESCRIPTION,
    )
    check_model_command.add_arguments(check)
    args = parser.parse_args(argv)
    commands = {"env": env_command.run, "plan": plan_command.run, "check-model": check_model_command.run}
    return commands[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
