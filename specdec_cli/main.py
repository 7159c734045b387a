"""The `specdec` command: serve, up, generate, models, distill.

Every flag has an environment equivalent: service flags are
SPECDEC_<SERVICE>_<FLAG> (e.g. SPECDEC_DRAFT_MODEL), the others
SPECDEC_<COMMAND>_<FLAG> (e.g. SPECDEC_GENERATE_ADDRESS).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Sequence

from specdec_cli import distill, generate, models, serve, up
from specdec_cli.env import env_default

COMMANDS = {"serve": serve.run, "up": up.run, "generate": generate.run, "models": models.run,
            "distill": distill.run}


def quiet_libraries() -> None:
    """No progress bars or fork warnings from the hub, tokenizers and transformers."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default (the environment's, where it sets one), unless its help
    already says it or there is none to show (unset, empty, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or (
            isinstance(default, (str, list)) and not default)
        if not action.option_strings or "default" in text or nothing:
            return text
        return f"{text} (default: %(default)s)"


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """DefaultsHelpFormatter for `parser` and every subcommand's parser under it."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env_default("cli", "log_level", "WARNING"),
                        help="logging level (env SPECDEC_CLI_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (serve, up, generate, models, distill):
        command.add_parser(sub)
    show_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    return COMMANDS[args.command](args)
