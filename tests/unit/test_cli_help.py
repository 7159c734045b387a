"""`specdec ... --help` shows each flag's default, for every command."""

from __future__ import annotations

import argparse


from specdec_cli.main import build_parser


def parsers(parser: argparse.ArgumentParser, name: str = "specdec"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_every_flag_with_a_default_shows_it_in_help(monkeypatch):
    for variable in [v for v in __import__("os").environ if v.startswith("SPECDEC_")]:
        monkeypatch.delenv(variable)
    checked = 0
    for name, parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())  # argparse wraps lines
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or default is None or default is False or default is argparse.SUPPRESS
                    or (isinstance(default, (str, list)) and not default)):
                continue
            said = " ".join((action.help or "").split())
            assert "default" in said or f"(default: {default})" in text, (name, action.option_strings, default)
            checked += 1
    assert checked > 40  # generate, up, models, distill: their flags with defaults
