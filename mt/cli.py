"""The ``mt`` command line: one entry point, one subcommand per job.

Each subcommand's module is imported only when it runs, so ``mt --help``
stays fast. Expected failures (bad config, missing files, bad input) are
raised as :class:`mt.errors.MTError` subclasses and printed as one line.
"""

from __future__ import annotations

import argparse
import sys

from mt import __version__
from mt.errors import MTError


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a parallel corpus with sentencepiece")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("--data-dir", help="local directory of <split>.<lang>[.gz] files (overrides data.local_dir)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _run_prepare(args) -> None:
    from mt.config import load_config
    from mt.data import prepare

    cfg = load_config(args.config, args.overrides)
    if args.data_dir:
        cfg.data.local_dir = args.data_dir
        cfg.data.source = "local"
    prepare(cfg.data)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (Lightning) into a run directory")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")


def _run_train(args) -> None:
    from mt.config import load_config
    from mt.train import train

    train(load_config(args.config, args.overrides))


COMMANDS = {"prepare": (_add_prepare, _run_prepare), "train": (_add_train, _run_train)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mt", description="Train, run and inspect Transformer translation models.")
    parser.add_argument("--version", action="version", version=f"mt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        COMMANDS[args.command][1](args)
    except MTError as e:
        print(f"mt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mt {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
