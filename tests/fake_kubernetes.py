"""A small fake of the Kubernetes API for discovery tests: EndpointSlices (discovery.k8s.io/v1)
of any namespace, list and watch (?watch=1 streams JSON lines, chunked, like the API server),
on 127.0.0.1 with an ephemeral port, plus a kubeconfig file that points at it."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
LABEL = "kubernetes.io/service-name"


class FakeKubernetes:
    def __init__(self) -> None:
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (version, namespace, type, object)
        self.version = 1
        self.compacted = 0  # a watch from an older version gets 410 Gone
        self.generation = 0  # bumped to end the open watches
        self.fail_lists: dict[str, int] = {}  # service -> answer this many of its lists with 500
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list"|"watch", query)
        self.cond = threading.Condition()
        self.closing = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeKubernetes":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # ---- changing the cluster ------------------------------------------------------------------

    def put(self, namespace: str, name: str, service: str, endpoints: list[tuple[str, bool | None]],
            address_type: str = "IPv4") -> None:
        """Create or replace an EndpointSlice; endpoints are (ip, ready) with ready None = unset."""
        with self.cond:
            self.version += 1
            kind = "MODIFIED" if (namespace, name) in self.slices else "ADDED"
            obj = {
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
                "metadata": {"name": name, "namespace": namespace, "labels": {LABEL: service},
                             "resourceVersion": str(self.version)},
                "endpoints": [{"addresses": [ip], **({} if ready is None else {"conditions": {"ready": ready}})}
                              for ip, ready in endpoints],
                "ports": [{"name": "grpc", "port": 1, "protocol": "TCP"}],
            }
            self.slices[(namespace, name)] = obj
            self.events.append((self.version, namespace, kind, obj))
            self.cond.notify_all()

    def delete(self, namespace: str, name: str) -> None:
        with self.cond:
            self.version += 1
            obj = dict(self.slices.pop((namespace, name)))
            obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.version)}
            self.events.append((self.version, namespace, "DELETED", obj))
            self.cond.notify_all()

    def expire(self) -> None:
        """End every watch and forget the history: resuming from an old version gets 410."""
        with self.cond:
            self.version += 1
            self.compacted = self.version
            self.generation += 1
            self.cond.notify_all()

    def lists(self, service: str) -> int:
        return sum(1 for kind, q in self.requests if kind == "list" and q.get("labelSelector") == f"{LABEL}={service}")

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester",
                                                      "namespace": namespace}}],
        }
        path.write_text(json.dumps(config))
        return path

    # ---- serving -------------------------------------------------------------------------------

    def _matching(self, namespace: str, selector: str, obj: dict[str, Any]) -> bool:
        key, _, value = selector.partition("=")
        return obj["metadata"]["namespace"] == namespace and obj["metadata"]["labels"].get(key) == value

    def list_body(self, namespace: str, selector: str) -> dict[str, Any]:
        with self.cond:
            items = [o for o in self.slices.values() if self._matching(namespace, selector, o)]
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}

    def watch_lines(self, namespace: str, selector: str, since: int, timeout_s: float):
        """JSON lines of the events after `since`, until the watch ends."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            if since < self.compacted:
                yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                   "reason": "Expired", "code": 410,
                                                   "message": f"too old resource version: {since}"}}
                return
            generation = self.generation
        sent = since
        while True:
            with self.cond:
                if self.closing or self.generation != generation or time.monotonic() >= deadline:
                    return
                pending = [(v, t, o) for v, ns, t, o in self.events
                           if v > sent and self._matching(namespace, selector, o) and ns == namespace]
                if not pending:
                    self.cond.wait(0.1)
                    continue
            for version, kind, obj in pending:
                sent = version
                yield {"type": kind, "object": obj}


def _handler(api: FakeKubernetes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            match = PATH.match(url.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if not match:
                return self._json(404, {"kind": "Status", "code": 404, "message": f"no route {url.path}"})
            namespace, selector = match.group(1), query.get("labelSelector", "")
            if query.get("watch", "").lower() not in ("1", "true"):
                api.requests.append(("list", query))
                service = selector.partition("=")[2]
                with api.cond:
                    failing = api.fail_lists.get(service, 0) > 0
                    api.fail_lists[service] = api.fail_lists.get(service, 0) - failing
                if failing:
                    return self._json(500, {"kind": "Status", "code": 500, "message": "injected failure"})
                return self._json(200, api.list_body(namespace, selector))
            api.requests.append(("watch", query))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            lines = api.watch_lines(namespace, selector, int(query.get("resourceVersion") or 0),
                                    float(query.get("timeoutSeconds") or 300))
            try:
                for event in lines:
                    data = (json.dumps(event) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:  # the client went away
                pass
            self.close_connection = True

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
