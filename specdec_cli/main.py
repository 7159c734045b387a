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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env_default("cli", "log_level", "WARNING"),
                        help="logging level (env SPECDEC_CLI_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (serve, up, generate, models, distill):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    return COMMANDS[args.command](args)
