"""`specdec serve draft|target|coordinator`: run one service until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import time
from typing import Any

from specdec.config import CoordinatorConfig, DraftConfig, TargetConfig, add_arguments, from_sources


log = logging.getLogger(__name__)

# loggers whose start-up lines (the graph engine's K/V pool, its CUDA graphs captured and how
# long that took, the device memory after; the service's start-up time) are shown at INFO even
# under the default --log-level WARNING: a few lines per start, what an operator reads first
STARTUP_LOGGERS = ("specdec.runtime.graph", __name__)


def show_startup_lines() -> None:
    """Let STARTUP_LOGGERS' INFO lines through where the root logger's level would hide them."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        for name in STARTUP_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run one service")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    add_arguments(serve_sub.add_parser("draft", help="the draft service"), DraftConfig, "draft")
    add_arguments(serve_sub.add_parser("target", help="the target service"), TargetConfig, "target")
    add_arguments(serve_sub.add_parser("coordinator", help="the coordinator"), CoordinatorConfig, "coordinator")


def run(args: argparse.Namespace) -> int:
    if args.service == "coordinator":
        return serve_coordinator(args)
    return serve_model(args.service, args)


def serve_model(kind: str, args: argparse.Namespace) -> int:
    """The draft or target service: load the model, serve, stop on a signal."""
    from specdec.rpc.security import CredentialsError
    from specdec.runtime.heads import HeadsMismatch
    from specdec.tokenizer import ModelLoadError

    started = time.monotonic()
    show_startup_lines()
    if kind == "draft":
        from draft_service.server import start
        config = from_sources(DraftConfig, "draft", vars(args))
    else:
        from target_service.server import start
        config = from_sources(TargetConfig, "target", vars(args))
    if not config.model:
        raise SystemExit(f"specdec serve {kind}: --model is required (env SPECDEC_{kind.upper()}_MODEL)")
    try:
        server, port, servicer = start(config)
    except (ModelLoadError, CredentialsError, HeadsMismatch, OSError) as exc:
        raise SystemExit(f"specdec serve {kind}: {exc}")
    served = servicer.description  # what the engine loaded: a GGUF's own type, llama.cpp's device
    heads = f", {served.num_heads} heads" if served.num_heads else ""
    log.info("%s service ready in %.1f s (%s, %s, %s)", kind, time.monotonic() - started, config.model, served.dtype,
             served.device)
    print(f"{kind} service ready on {config.host}:{port} ({config.model}, {served.dtype}, {served.device}{heads})",
          flush=True)
    stopped = threading.Event()

    def stop(*_: Any) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stopped.wait()
    server.stop(grace=5).wait()
    return 0


def serve_coordinator(args: argparse.Namespace) -> int:
    """The coordinator: connect to draft and target, serve, stop on a signal."""
    from coordinator.server import StartupError, start

    config = from_sources(CoordinatorConfig, "coordinator", vars(args))

    async def main() -> None:
        try:
            running = await start(config)
        except StartupError as exc:
            raise SystemExit(f"specdec serve coordinator: {exc}")
        print(f"coordinator ready on {config.host}:{running.port} (draft {config.draft}, "
              f"target {config.target})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop(grace=5)

    asyncio.run(main())
    return 0
