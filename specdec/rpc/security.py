"""Transport security: TLS / mutual-TLS credentials from PEM files, and the API-key check.

Every file is checked when a service starts, so a missing, unreadable or mismatched file is a
one-line start-up error naming the flag and the path (`CredentialsError`), never a failed
handshake later. The API key is never logged or echoed.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from typing import Any, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

# Kubernetes probes and grpcurl carry no key: these stay open.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
AUTH_METADATA_KEY = "authorization"
HOW_TO_SEND = ("send the key as metadata 'authorization: Bearer <key>' "
               "(specdec generate --api-key KEY, or env SPECDEC_GENERATE_API_KEY)")


class CredentialsError(ValueError):
    """A TLS or API-key file cannot be used; the message names the flag and the path."""


# ---- PEM files --------------------------------------------------------------------------------

def read_file(path: str, flag: str) -> bytes:
    """The bytes of `path`, or a CredentialsError naming `flag`."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise CredentialsError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise CredentialsError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def read_certificates(path: str, flag: str) -> bytes:
    """One or more PEM certificates (a chain, or a CA bundle), checked with OpenSSL."""
    data = read_file(path, flag)
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise CredentialsError(f"{flag} {path}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise CredentialsError(f"{flag} {path}: not a valid PEM certificate ({_reason(exc)})") from None
    return data


def read_private_key(path: str, flag: str) -> bytes:
    data = read_file(path, flag)
    if b"PRIVATE KEY-----" not in data:
        raise CredentialsError(f"{flag} {path}: holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    if b"ENCRYPTED" in data:
        raise CredentialsError(f"{flag} {path}: the private key is encrypted; give an unencrypted one "
                               "(openssl pkey -in KEY -out PLAIN_KEY)")
    return data


def read_key_pair(cert_path: str, key_path: str, cert_flag: str, key_flag: str) -> tuple[bytes, bytes]:
    """(certificate chain, private key) after checking that the key belongs to the certificate."""
    cert = read_certificates(cert_path, cert_flag)
    key = read_private_key(key_path, key_flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise CredentialsError(f"{key_flag} {key_path} is not the private key of the certificate in "
                                   f"{cert_flag} {cert_path}") from None
        raise CredentialsError(f"{cert_flag} {cert_path} with {key_flag} {key_path}: cannot be loaded "
                               f"({_reason(exc)})") from None
    return cert, key


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or str(exc)


def _need_both(a: str, a_flag: str, b: str, b_flag: str) -> None:
    if bool(a) != bool(b):
        given, missing = (a_flag, b_flag) if a else (b_flag, a_flag)
        raise CredentialsError(f"{given} needs {missing} as well")


# ---- credentials ------------------------------------------------------------------------------

def server_credentials(config: Any) -> grpc.ServerCredentials | None:
    """TLS for a server from its tls_* fields (None: plaintext). With tls_client_ca_file the
    server requires client certificates signed by that CA (mutual TLS)."""
    cert_file, key_file, ca_file = config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    _need_both(cert_file, "--tls-cert-file", key_file, "--tls-key-file")
    if not cert_file:
        if ca_file:
            raise CredentialsError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    cert, key = read_key_pair(cert_file, key_file, "--tls-cert-file", "--tls-key-file")
    client_ca = read_certificates(ca_file, "--tls-client-ca-file") if ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "", flag_prefix: str = "--upstream"
                        ) -> grpc.ChannelCredentials | None:
    """TLS for a client (None: plaintext): trust `ca_file`; present cert/key for mutual TLS."""
    ca_flag, cert_flag, key_flag = (f"{flag_prefix}-{n}-file" for n in ("ca", "cert", "key"))
    _need_both(cert_file, cert_flag, key_file, key_flag)
    if not ca_file:
        if cert_file:
            raise CredentialsError(f"{cert_flag} needs {ca_flag} (the CA that signed "
                                   "the servers' certificates)")
        return None
    ca = read_certificates(ca_file, ca_flag)
    cert = key = None
    if cert_file:
        cert, key = read_key_pair(cert_file, key_file, cert_flag, key_flag)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def name_override_options(server_name: str) -> list[tuple[str, str]]:
    """Channel options checking `server_name` in the server's certificate instead of the address."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def upstream_credentials(config: Any) -> grpc.ChannelCredentials | None:
    """The coordinator's credentials for its calls to draft and target (None: plaintext)."""
    if config.upstream_server_name and not config.upstream_ca_file:
        raise CredentialsError("--upstream-server-name needs --upstream-ca-file (it names the TLS "
                               "certificate the tiers present)")
    return channel_credentials(config.upstream_ca_file, config.upstream_cert_file, config.upstream_key_file)


# ---- API key ----------------------------------------------------------------------------------

def read_api_key(path: str, flag: str = "--api-key-file") -> str:
    """The key in `path`, surrounding whitespace stripped; never part of an error message."""
    try:
        key = read_file(path, flag).decode("ascii").strip()
    except UnicodeDecodeError:
        raise CredentialsError(f"{flag} {path}: the key must be printable ASCII") from None
    if not key:
        raise CredentialsError(f"{flag} {path}: the file is empty")
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise CredentialsError(f"{flag} {path}: the key must be printable ASCII without spaces")
    return key


def bearer_token(metadata: Any) -> str | None:
    """The token of an 'authorization: Bearer <token>' metadata entry (None when absent)."""
    for key, value in metadata or ():
        if key.lower() == AUTH_METADATA_KEY:
            if isinstance(value, bytes):
                value = value.decode("ascii", "replace")
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right 'authorization: Bearer <key>' with UNAUTHENTICATED;
    health checks and reflection stay open."""

    def __init__(self, key: str):
        self._key = key.encode("ascii")

    def authorized(self, metadata: Any) -> str | None:
        """None when the metadata carries the key, else why not (no key in the text)."""
        token = bearer_token(metadata)
        if token is None:
            return f"missing API key: {HOW_TO_SEND}"
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self._key):
            return f"invalid API key: {HOW_TO_SEND} with the key from the coordinator's --api-key-file"
        return None

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        refusal = self.authorized(handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        log.info("refused %s: %s", method, refusal.split(":", 1)[0])
        return _refusing_handler(handler, refusal)


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
