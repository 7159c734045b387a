"""`specdec up`: the three services as child processes on loopback (Ctrl-C stops all)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from specdec.config import DTYPES, choices_of
from specdec.types import Backend, Quantization

from specdec_cli import generate
from specdec_cli.env import DEFAULT_HTTP_PORT, DEFAULT_PORT, env_default

SERVE = [sys.executable, "-m", "specdec_cli", "serve"]  # how a child runs its service


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run all three services on loopback (Ctrl-C stops all)")
    up.add_argument("--draft-model", default=env_default("up", "draft_model", ""),
                    help="draft model (default: the fetched pair; env SPECDEC_UP_DRAFT_MODEL)")
    up.add_argument("--target-model", default=env_default("up", "target_model", ""),
                    help="target model (default: the fetched pair; env SPECDEC_UP_TARGET_MODEL)")
    up.add_argument("--backend", default=env_default("up", "backend", "auto"), choices=choices_of(Backend),
                    help="engine of both models; auto serves the fetched pair's Q4_K_M GGUF files on "
                         "llama.cpp when llama-cpp-python is installed, else its converted directories "
                         "on torch (env SPECDEC_UP_BACKEND)")
    up.add_argument("--dtype", default=env_default("up", "dtype", "bfloat16"), choices=DTYPES,
                    help="weight dtype of both models (env SPECDEC_UP_DTYPE)")
    up.add_argument("--device", default=env_default("up", "device", "cpu"),
                    help="torch device of both models (env SPECDEC_UP_DEVICE)")
    up.add_argument("--draft-quantize", default=env_default("up", "draft_quantize", "auto"),
                    choices=choices_of(Quantization),
                    help="the draft's linear layers in weight-only int8: faster draft steps on a CPU, "
                         "same output; auto = int8 on a CPU unless float64 (env SPECDEC_UP_DRAFT_QUANTIZE)")
    up.add_argument("--kv-store", default=env_default("up", "kv_store", ""),
                    help="the draft's and the target's --kv-store: redis://[:PASSWORD@]HOST:PORT/DB "
                         "(rediss:// for TLS) where they keep K/V chunks of sessions' history; "
                         "empty = off (env SPECDEC_UP_KV_STORE)")
    up.add_argument("--port", type=int, default=env_default("up", "port", DEFAULT_PORT),
                    help="coordinator port; draft and target take the next two (env SPECDEC_UP_PORT)")
    up.add_argument("--http-port", type=int, default=env_default("up", "http_port", DEFAULT_HTTP_PORT),
                    help="the coordinator's OpenAI-compatible HTTP API port (/v1/completions, "
                         "/v1/chat/completions, /v1/models); 0 = off (env SPECDEC_UP_HTTP_PORT)")
    up.add_argument("--startup-timeout", type=float, default=env_default("up", "startup_timeout", 600.0),
                    help="seconds to wait for each service (env SPECDEC_UP_STARTUP_TIMEOUT)")
    up.add_argument("--prompt", default=env_default("up", "prompt", None),
                    help="generate for this prompt, print it, then stop everything (env SPECDEC_UP_PROMPT)")
    up.add_argument("--chat", action="store_true", help="with --prompt: send it as a user chat message")
    up.add_argument("--max-new-tokens", type=int, default=env_default("up", "max_new_tokens", 64),
                    help="with --prompt: tokens to generate (env SPECDEC_UP_MAX_NEW_TOKENS)")


def models_of(args: argparse.Namespace) -> tuple[str, str]:
    """(draft, target): the flags', else the fetched default pair's: its GGUF files where the
    backend is llama.cpp (or auto with llama-cpp-python installed and the files fetched), else
    its directories."""
    from specdec_cli.model_pair import PAIR, FetchError, default_gguf_pair, default_pair, gguf_verified
    from specdec.runtime.engines import llama_cpp_installed

    draft_model, target_model = args.draft_model, args.target_model
    if not (draft_model and target_model):
        native = args.backend == Backend.LLAMA_CPP or (
            args.backend == Backend.AUTO and llama_cpp_installed() and all(gguf_verified(a) for a in PAIR))
        try:
            pair = default_gguf_pair() if native else default_pair()
        except FetchError as exc:
            raise SystemExit(f"specdec up: {exc}")
        draft_model = draft_model or str(pair["draft"])
        target_model = target_model or str(pair["target"])
    return draft_model, target_model


def commands(args: argparse.Namespace, draft_model: str, target_model: str,
             addresses: dict[str, str]) -> dict[str, list[str]]:
    """The `specdec serve ...` command line of each child."""
    port = args.port
    kv_store = ["--kv-store", args.kv_store] if args.kv_store else []
    return {
        "draft": SERVE + ["draft", "--model", draft_model, "--backend", args.backend, "--dtype", args.dtype,
                          "--device", args.device, "--port", str(port + 1), "--quantize", args.draft_quantize,
                          *kv_store],
        "target": SERVE + ["target", "--model", target_model, "--backend", args.backend, "--dtype", args.dtype,
                           "--device", args.device, "--port", str(port + 2), *kv_store],
        "coordinator": SERVE + ["coordinator", "--draft", addresses["draft"], "--target",
                                addresses["target"], "--port", str(port), "--http-port", str(args.http_port)],
    }


def wait_healthy(address: str, timeout_s: float, procs: Sequence[subprocess.Popen]) -> None:
    """specdec.rpc.health.wait_healthy, its failure the command's exit message."""
    from specdec.rpc.health import NotHealthy, wait_healthy as wait

    try:
        wait(address, timeout_s, procs)
    except NotHealthy as exc:
        raise SystemExit(str(exc))


def generate_once(args: argparse.Namespace, address: str) -> int:
    """`specdec generate` of --prompt against the coordinator at `address`."""
    parser = argparse.ArgumentParser(prog="specdec generate")
    generate.add_arguments(parser)
    gen_argv = ["--address", address, "--max-new-tokens", str(args.max_new_tokens),
                *(["--chat"] if args.chat else []), args.prompt]
    return generate.run(parser.parse_args(gen_argv))


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every child still running, last started first; SIGKILL any that lingers 10 s."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(args: argparse.Namespace) -> int:
    draft_model, target_model = models_of(args)
    port = args.port
    addresses = {"draft": f"127.0.0.1:{port + 1}", "target": f"127.0.0.1:{port + 2}",
                 "coordinator": f"127.0.0.1:{port}"}
    argvs = commands(args, draft_model, target_model, addresses)
    procs: list[subprocess.Popen] = []

    def terminate(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # stop the children on SIGTERM as on Ctrl-C
    try:
        for name in ("draft", "target", "coordinator"):
            procs.append(subprocess.Popen(argvs[name]))
            if name == "target":
                wait_healthy(addresses["draft"], args.startup_timeout, procs)
                wait_healthy(addresses["target"], args.startup_timeout, procs)
        wait_healthy(addresses["coordinator"], args.startup_timeout, procs)
        http = f"; OpenAI-compatible API on http://127.0.0.1:{args.http_port}/v1" if args.http_port else ""
        print(f"specdec up: coordinator on {addresses['coordinator']} (draft {draft_model}, "
              f"target {target_model}){http}; Ctrl-C stops all", flush=True)
        if args.prompt is not None:
            return generate_once(args, addresses["coordinator"])
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(procs)
