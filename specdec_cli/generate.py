"""`specdec generate`: generate text through a running coordinator and print it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdec.fields import CLI, reword
from specdec.types import Source

from specdec_cli.env import DEFAULT_PORT, env_default


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_arguments(sub.add_parser("generate", help="generate text through a running coordinator"))


def add_arguments(gen: argparse.ArgumentParser) -> None:
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
                     choices=tuple(p.value for p in Source),
                     help="where proposed tokens come from: auto (per round, prompt lookup, the draft "
                          "model or the target's heads), draft, ngram (prompt lookup), none, heads (the "
                          "target's Medusa-style heads); unset = the coordinator's default "
                          "(env SPECDEC_GENERATE_PROPOSER)")
    gen.add_argument("--tree-nodes", type=int, default=env_default("generate", "tree_nodes", 0),
                     help="draft-model rounds propose a tree of at most this many tokens, --gamma deep; "
                          "0 = the coordinator decides (--trees), 1 = chains only (env SPECDEC_GENERATE_TREE_NODES)")
    gen.add_argument("--session", default=env_default("generate", "session", ""),
                     help="continue this session (env SPECDEC_GENERATE_SESSION)")
    gen.add_argument("--cache-salt", default=env_default("generate", "cache_salt", ""),
                     help="mixed into the keys of the K/V chunks kept of this request's history: "
                          "requests with other salts never reuse them (env SPECDEC_GENERATE_CACHE_SALT)")
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


def client_security(args: argparse.Namespace) -> tuple[Any, list[tuple[str, str]]]:
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


def build_request(args: argparse.Namespace) -> Any:
    """The coordinator_pb2.GenerateRequest the flags describe."""
    from specdec.v1 import common_pb2, coordinator_pb2

    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = coordinator_pb2.GenerateRequest(session_id=args.session, sampling=sampling,
                                              max_new_tokens=args.max_new_tokens, stop=args.stop,
                                              ignore_eos=args.ignore_eos, cache_salt=args.cache_salt,
                                              tree_nodes=args.tree_nodes)
    if args.chat:
        request.messages.messages.append(coordinator_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        request.prompt = args.prompt
    if args.gamma is not None:
        request.num_speculative_tokens = args.gamma
    if args.proposer:
        request.proposer = coordinator_pb2.Proposer.Value(f"PROPOSER_{args.proposer.upper()}")
    return request


def run(args: argparse.Namespace) -> int:
    """Stream the text to stdout (or collect it for --json), then print the outcome."""
    import grpc

    from specdec.rpc.health import open_channel
    from specdec.v1 import coordinator_pb2_grpc

    request = build_request(args)
    credentials, metadata = client_security(args)
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
            # the coordinator names the gRPC API's fields (session_id); this command, its flags (--session)
            print(f"\nspecdec generate: {exc.code().name}: {reword(exc.details() or '', CLI)}", file=sys.stderr)
            return 2
    print_outcome(args, last, token_ids, "".join(text))
    return 0


def print_outcome(args: argparse.Namespace, last: Any, token_ids: list[int], text: str) -> None:
    """--json: one JSON object on stdout; else a summary line of the last chunk's stats on stderr."""
    from google.protobuf.json_format import MessageToDict

    from specdec.v1 import common_pb2

    stats = MessageToDict(last.stats, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    finish = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    if args.json:
        print(json.dumps({"session_id": last.session_id, "token_ids": token_ids, "text": text,
                          "finish_reason": finish, "stats": stats}))
    else:
        print(f"\n[{finish}] rounds={stats['rounds']} acceptance={stats['acceptance_rate']:.3f} "
              f"tokens/round={stats['tokens_per_round']:.2f} generated={stats['generated_tokens']} "
              f"session={last.session_id}", file=sys.stderr)
