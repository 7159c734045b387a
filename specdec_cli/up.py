"""`specdec up`: the three services as child processes on loopback (Ctrl-C stops all)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from specdec.config import DTYPES, CoordinatorConfig, TargetConfig, choices_of, help_of
from specdec.types import Backend, CudaGraphs, Quantization

from specdec_cli import generate, ports
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
    up.add_argument("--cuda-graphs", default=env_default("up", "cuda_graphs", "auto"),
                    choices=choices_of(CudaGraphs),
                    help="both services' --cuda-graphs: " + help_of(TargetConfig, "cuda_graphs")
                         + " (env SPECDEC_UP_CUDA_GRAPHS)")
    up.add_argument("--dtype", default=env_default("up", "dtype", "bfloat16"), choices=DTYPES,
                    help="weight dtype of both models (env SPECDEC_UP_DTYPE)")
    up.add_argument("--device", default=env_default("up", "device", "cpu"),
                    help="torch device of both models (env SPECDEC_UP_DEVICE)")
    up.add_argument("--draft-quantize", default=env_default("up", "draft_quantize", "auto"),
                    choices=choices_of(Quantization),
                    help="the draft's linear layers in weight-only int8: faster draft steps on a CPU, "
                         "same output; auto = int8 on a CPU unless float64 (env SPECDEC_UP_DRAFT_QUANTIZE)")
    up.add_argument("--target-heads", default=env_default("up", "target_heads", ""),
                    help=f"the target's --heads: {help_of(TargetConfig, 'heads')} (env SPECDEC_UP_TARGET_HEADS)")
    up.add_argument("--tensor-parallel-size", type=int, default=env_default("up", "tensor_parallel_size", 1),
                    help="the target's --tensor-parallel-size: split it over N rank processes (--backend "
                         "graph; cuda:0..N-1, or N CPU processes with --device cpu); the draft stays on one "
                         "(env SPECDEC_UP_TENSOR_PARALLEL_SIZE)")
    up.add_argument("--kv-store", default=env_default("up", "kv_store", ""),
                    help="the draft's and the target's --kv-store: redis://[:PASSWORD@]HOST:PORT/DB "
                         "(rediss:// for TLS) where they keep K/V chunks of sessions' history; "
                         "empty = off (env SPECDEC_UP_KV_STORE)")
    up.add_argument("--port", type=int, default=env_default("up", "port", DEFAULT_PORT),
                    help="coordinator port; draft and target take the next two unless --draft-port / "
                         "--target-port say otherwise (env SPECDEC_UP_PORT)")
    up.add_argument("--draft-port", type=int, default=env_default("up", "draft_port", 0),
                    help="the draft service's port; 0 = --port + 1 (env SPECDEC_UP_DRAFT_PORT)")
    up.add_argument("--target-port", type=int, default=env_default("up", "target_port", 0),
                    help="the target service's port; 0 = --port + 2 (env SPECDEC_UP_TARGET_PORT)")
    up.add_argument("--http-port", type=int, default=env_default("up", "http_port", DEFAULT_HTTP_PORT),
                    help="the coordinator's OpenAI-compatible HTTP API port (/v1/completions, "
                         "/v1/chat/completions, /v1/models); 0 = off; not bound with --prompt "
                         "(env SPECDEC_UP_HTTP_PORT)")
    up.add_argument("--served-model-name", nargs="+", default=env_default("up", "served_model_name", None),
                    help=f"the coordinator's: {help_of(CoordinatorConfig, 'served_model_name')} "
                         "(env SPECDEC_UP_SERVED_MODEL_NAME, comma-separated)")
    up.add_argument("--metrics-port", type=int, default=env_default("up", "metrics_port", 0),
                    help="Prometheus /metrics of the coordinator on this port, of the draft and the target "
                         "on the next two (docs/operations.md#metrics); 0 = off (env SPECDEC_UP_METRICS_PORT)")
    up.add_argument("--session-store", default=env_default("up", "session_store", "memory"),
                    help=f"the coordinator's {help_of(CoordinatorConfig, 'session_store')} "
                         "(env SPECDEC_UP_SESSION_STORE)")
    up.add_argument("--api-key-file", default=env_default("up", "api_key_file", ""),
                    help=f"the coordinator's {help_of(CoordinatorConfig, 'api_key_file')}, on the gRPC and "
                         "the HTTP API; --prompt sends it (env SPECDEC_UP_API_KEY_FILE)")
    for flag in ("record_dir", "record_max_bytes", "record_stream", "record_max_len"):
        up.add_argument("--" + flag.replace("_", "-"), default=env_default("up", flag, None),
                        help=f"the coordinator's: {help_of(CoordinatorConfig, flag)} "
                             f"(env SPECDEC_UP_{flag.upper()}; default: the coordinator's)")
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
    check_model_paths({"--draft-model": draft_model, "--target-model": target_model})
    return draft_model, target_model


def check_model_paths(models: dict[str, str]) -> None:
    """A model named by a path that is not there fails now, naming its flag, before any child
    starts or the hub is asked (specdec.tokenizer.resolve_model's rule)."""
    from specdec.tokenizer import ModelLoadError, resolve_model

    for flag, model in models.items():
        try:
            resolve_model(model)
        except ModelLoadError as exc:
            raise SystemExit(f"specdec up: {flag}: {exc}")


SERVICES = ("coordinator", "draft", "target")


def service_ports(args: argparse.Namespace) -> dict[str, int]:
    """The gRPC port of each service."""
    return {"coordinator": args.port, "draft": args.draft_port or args.port + 1,
            "target": args.target_port or args.port + 2}


def http_port(args: argparse.Namespace) -> int:
    """The HTTP API's port; 0 (off) for a one-shot --prompt run, which serves nobody."""
    return 0 if args.prompt is not None else args.http_port


def metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    """Each service's /metrics port: --metrics-port and the next two (0: off)."""
    return {name: args.metrics_port + i if args.metrics_port else 0 for i, name in enumerate(SERVICES)}


def bindings(args: argparse.Namespace) -> list[ports.Binding]:
    """Every port the services will listen on, with the flag that moves it."""
    grpc_ports = service_ports(args)
    out = [ports.Binding(grpc_ports["coordinator"], "the coordinator's gRPC API", "--port"),
           ports.Binding(grpc_ports["draft"], "the draft service's gRPC API", "--draft-port"),
           ports.Binding(grpc_ports["target"], "the target service's gRPC API", "--target-port")]
    if http_port(args) > 0:
        out.append(ports.Binding(http_port(args), "the OpenAI-compatible HTTP API", "--http-port"))
    for i, (name, port) in enumerate(metrics_ports(args).items()):
        if port:
            plus = f" (--metrics-port + {i})" if i else ""
            out.append(ports.Binding(port, f"the {name}'s /metrics{plus}", "--metrics-port"))
    return out


def commands(args: argparse.Namespace, draft_model: str, target_model: str,
             addresses: dict[str, str]) -> dict[str, list[str]]:
    """The `specdec serve ...` command line of each child."""
    grpc_ports, metrics = service_ports(args), metrics_ports(args)
    kv_store = ["--kv-store", args.kv_store] if args.kv_store else []
    heads = ["--heads", args.target_heads] if args.target_heads else []
    parallel = ["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size != 1 else []
    names = ["--served-model-name", *served_names(args)] if served_names(args) else []
    api_key = ["--api-key-file", args.api_key_file] if args.api_key_file else []
    recording = [argument for flag in ("record_dir", "record_max_bytes", "record_stream", "record_max_len")
                 if getattr(args, flag) not in (None, "")
                 for argument in ("--" + flag.replace("_", "-"), str(getattr(args, flag)))]
    return {
        "draft": SERVE + ["draft", "--model", draft_model, "--backend", args.backend, "--dtype", args.dtype,
                          "--device", args.device, "--cuda-graphs", args.cuda_graphs,
                          "--port", str(grpc_ports["draft"]), "--quantize",
                          args.draft_quantize, "--metrics-port", str(metrics["draft"]), *kv_store],
        "target": SERVE + ["target", "--model", target_model, "--backend", args.backend, "--dtype", args.dtype,
                           "--device", args.device, "--cuda-graphs", args.cuda_graphs,
                           "--port", str(grpc_ports["target"]),
                           "--metrics-port", str(metrics["target"]), *kv_store, *heads, *parallel],
        "coordinator": SERVE + ["coordinator", "--draft", addresses["draft"], "--target", addresses["target"],
                                "--port", str(grpc_ports["coordinator"]), "--http-port", str(http_port(args)),
                                "--metrics-port", str(metrics["coordinator"]),
                                "--session-store", args.session_store, *api_key, *names, *recording],
    }


def served_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name's names (the environment's comma-separated list)."""
    value = args.served_model_name or []
    return value.split(",") if isinstance(value, str) else value


def wait_healthy(address: str, timeout_s: float, procs: Sequence[subprocess.Popen]) -> None:
    """specdec.rpc.health.wait_healthy, its failure the command's exit message."""
    from specdec.rpc.health import NotHealthy, wait_healthy as wait

    try:
        wait(address, timeout_s, procs)
    except NotHealthy as exc:
        raise SystemExit(str(exc))


def generate_once(args: argparse.Namespace, address: str, api_key: str) -> int:
    """`specdec generate` of --prompt against the coordinator at `address`, with its API key."""
    parser = argparse.ArgumentParser(prog="specdec generate")
    generate.add_arguments(parser)
    gen_argv = ["--address", address, "--max-new-tokens", str(args.max_new_tokens),
                *(["--chat"] if args.chat else []), args.prompt]
    gen_args = parser.parse_args(gen_argv)
    gen_args.api_key = api_key  # not through an argument list
    return generate.run(gen_args)


def api_key_of(args: argparse.Namespace) -> str:
    """The key of --api-key-file ("" without one), read as the coordinator reads it."""
    from specdec.rpc.security import CredentialsError, read_api_key

    if not args.api_key_file:
        return ""
    try:
        return read_api_key(args.api_key_file)
    except CredentialsError as exc:
        raise SystemExit(f"specdec up: {exc}")


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every child still running, SIGKILL any that lingers 10 s: the last started (the
    coordinator) first and alone, so its calls and streams to the model services end before
    they stop (no call is cut by a server going away), then the rest together."""
    for group in (procs[-1:], procs[:-1]):
        for proc in group:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in group:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args: argparse.Namespace) -> int:
    try:  # before any model loads: a taken port fails now, naming its flag
        ports.check(bindings(args))
    except SystemExit as exc:
        raise SystemExit(f"specdec up: {exc}")
    api_key = api_key_of(args)
    draft_model, target_model = models_of(args)
    addresses = {name: f"127.0.0.1:{port}" for name, port in service_ports(args).items()}
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
        http = ""
        if http_port(args):
            from coordinator.api.openai_protocol import served_model_names

            names = served_model_names(",".join(served_names(args)), target_model)
            http = (f"; OpenAI-compatible API on http://127.0.0.1:{http_port(args)}/v1 "
                    f"(model {' or '.join(map(repr, names))})")
        print(f"specdec up: coordinator on {addresses['coordinator']} (draft {draft_model}, "
              f"target {target_model}){http}; Ctrl-C stops all", flush=True)
        if args.prompt is not None:
            return generate_once(args, addresses["coordinator"], api_key)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(procs)
