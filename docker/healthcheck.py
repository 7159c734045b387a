#!/usr/bin/env python3
"""specdec-healthcheck: ask a specdec server's grpc.health.v1 whether it is SERVING.

Exit 0 when the answer is SERVING, 1 otherwise (unreachable, NOT_SERVING, unknown service,
wrong credentials), with one line saying why. Used as the images' HEALTHCHECK and as the
Kubernetes probe where a native gRPC probe cannot be used (TLS or an API key on the port).

Without ADDRESS it checks the server this container runs: it reads `serve <service>` and
`--port` from PID 1's command line (else SPECDEC_<SERVICE>_PORT, else the service's default
port) and connects to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

DEFAULT_PORTS = {"coordinator": 50051, "draft": 50052, "target": 50053}


def own_address(cmdline: Sequence[str], environ: dict[str, str]) -> str:
    """127.0.0.1:<port> of the `specdec serve <service>` in this command line."""
    service = next((cmdline[i + 1] for i, arg in enumerate(cmdline[:-1])
                    if arg == "serve" and cmdline[i + 1] in DEFAULT_PORTS), None)
    if service is None:
        raise SystemExit("specdec-healthcheck: PID 1 is not `specdec serve ...`; pass ADDRESS")
    port = environ.get(f"SPECDEC_{service.upper()}_PORT") or str(DEFAULT_PORTS[service])
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline):
            port = cmdline[i + 1]
        elif arg.startswith("--port="):
            port = arg.split("=", 1)[1]
    if port == "0":
        port = str(DEFAULT_PORTS[service])
    return f"127.0.0.1:{port}"


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def check(args: argparse.Namespace) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = args.address
    if not address:
        cmdline = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")
        address = own_address([a for a in cmdline if a], dict(os.environ))
    tls = args.ca_file or args.cert_file or args.server_name
    if tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(args.ca_file), private_key=_read(args.key_file),
            certificate_chain=_read(args.cert_file))
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address)
    metadata = []
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        metadata.append(("authorization", f"Bearer {key}"))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service),
                               timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {args.service or '(server)'}: {status}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdec-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?", default="", help="host:port (default: this container's server)")
    parser.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--ca-file", default="", help="PEM CA that signed the server's certificate (enables TLS)")
    parser.add_argument("--cert-file", default="", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--key-file", default="", help="PEM key of the client certificate")
    parser.add_argument("--server-name", default="", help="name to check in the server's certificate (enables TLS)")
    parser.add_argument("--api-key-file", default="", help="file holding an API key sent as a bearer token")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ok, message = check(parse_args(argv))
    except OSError as exc:  # an unreadable certificate, key or key file
        ok, message = False, f"specdec-healthcheck: {exc}"
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
