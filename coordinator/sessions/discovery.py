"""Where the draft and target replicas are: a static list, or Kubernetes EndpointSlices.

A discovery calls `on_change(tier, addresses)` on the asyncio loop whenever the set of ready
"host:port" addresses of a tier ("draft" or "target") changes (at least once per tier).

Kubernetes: for each tier, a thread lists the EndpointSlices of the tier's Service
(discovery.k8s.io/v1, label kubernetes.io/service-name=NAME), then watches them from the
list's resourceVersion; an expired watch (410) or any error re-lists, with backoff on errors.
The ready endpoints (conditions.ready, unset = ready) make the tier's addresses. Needs
get/list/watch on endpointslices in the namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from specdec.types import DiscoveryKind

from coordinator.sessions.model_tiers import Tier

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this long; we resume it
REQUEST_TIMEOUT_S = 30.0
BACKOFF_S = (0.5, 30.0)  # first and largest wait before re-listing after an error

OnChange = Callable[[str, frozenset], None]


class DiscoveryError(ValueError):
    """Discovery is misconfigured; the message says what to set."""


class Discovery(Protocol):
    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange) -> None:
        """Begin reporting each tier's ready addresses to on_change, on loop."""

    def describe(self) -> str: ...

    async def close(self) -> None: ...


def parse_addresses(text: str, flag: str) -> frozenset:
    """A comma-separated list of host:port (one address is a list of one)."""
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise DiscoveryError(f"{flag} lists no address: give host:port, or several separated by commas")
    for address in addresses:
        if ":" not in address:
            raise DiscoveryError(f"{flag}: {address!r} is not host:port")
    return frozenset(addresses)


class StaticDiscovery:
    """Fixed lists (--draft A1,A2 --target B1,B2)."""

    def __init__(self, addresses: Mapping[str, Iterable[str]]):
        self.addresses = {tier: frozenset(addresses[tier]) for tier in Tier}

    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange) -> None:
        for tier in Tier:
            on_change(tier, self.addresses[tier])

    def describe(self) -> str:
        return ", ".join(f"{tier} {','.join(sorted(self.addresses[tier]))}" for tier in Tier)

    async def close(self) -> None:
        return None


def ready_addresses(slices: Iterable[Mapping[str, Any]], port: int) -> frozenset:
    """host:port of every ready endpoint (the first of its fungible addresses) in the slices."""
    out = set()
    for item in slices:
        ipv6 = item.get("addressType") == "IPv6"
        for endpoint in item.get("endpoints") or ():
            ready = (endpoint.get("conditions") or {}).get("ready")
            addresses = endpoint.get("addresses") or ()
            if ready is False or not addresses:
                continue
            host = f"[{addresses[0]}]" if ipv6 else addresses[0]
            out.add(f"{host}:{port}")
    return frozenset(out)


@dataclass(frozen=True)
class ServiceRef:
    tier: str
    name: str
    port: int


class KubernetesDiscovery:
    """Watches the EndpointSlices of the draft and target Services (see the module docstring)."""

    def __init__(self, services: Iterable[ServiceRef], namespace: str = "", kubeconfig: str | None = None):
        self.services = list(services)
        self._configuration, default_namespace = _client_configuration(kubeconfig)
        self.namespace = namespace or default_namespace
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: dict[str, Any] = {}

    def describe(self) -> str:
        return ", ".join(f"{s.tier} service {self.namespace}/{s.name}:{s.port}" for s in self.services)

    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange) -> None:
        for service in self.services:
            thread = threading.Thread(target=self._run, args=(service, loop, on_change),
                                      name=f"discovery-{service.tier}", daemon=True)
            thread.start()
            self._threads.append(thread)

    async def close(self) -> None:
        self._stop.set()
        for watch in list(self._watches.values()):
            watch.stop()
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join(5)

    # ---- one thread per tier: list, watch, re-list -------------------------------------------

    def _run(self, service: ServiceRef, loop: asyncio.AbstractEventLoop, on_change: OnChange) -> None:
        from kubernetes import client

        api = client.DiscoveryV1Api(client.ApiClient(self._configuration))
        selector = f"{SERVICE_LABEL}={service.name}"
        published: frozenset | None = None

        def publish(slices: dict[str, Mapping[str, Any]]) -> None:
            nonlocal published
            addresses = ready_addresses(slices.values(), service.port)
            if addresses != published:
                published = addresses
                log.info("%s replicas (service %s/%s): %s", service.tier, self.namespace, service.name,
                         ", ".join(sorted(addresses)) or "none ready")
                loop.call_soon_threadsafe(on_change, service.tier, addresses)

        backoff = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                slices, version = self._list(api, selector)
                publish(slices)
                backoff = BACKOFF_S[0]
                while not self._stop.is_set():  # each watch ends after WATCH_TIMEOUT_S: resume it
                    version = self._watch(api, selector, service.tier, slices, version, publish)
            except Exception as exc:  # noqa: BLE001 -- any API or connection failure: re-list
                if self._stop.is_set() or loop.is_closed():
                    break
                if getattr(exc, "status", None) == 410:
                    log.info("%s endpointslice watch expired; re-listing", service.tier)
                    continue
                log.warning("watching endpointslices of %s/%s failed (%s); re-listing in %.1fs",
                            self.namespace, service.name, _brief(exc), backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])

    def _list(self, api: Any, selector: str) -> tuple[dict[str, Mapping[str, Any]], str]:
        response = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                      _preload_content=False,
                                                      _request_timeout=REQUEST_TIMEOUT_S)
        body = json.loads(response.data)
        slices = {item["metadata"]["name"]: item for item in body.get("items") or ()}
        return slices, body["metadata"]["resourceVersion"]

    def _watch(self, api: Any, selector: str, tier: str, slices: dict[str, Mapping[str, Any]],
               version: str, publish: Callable[[dict], None]) -> str:
        """Apply watch events to slices until the server ends the watch; the last version seen.
        An expired version raises ApiException(410)."""
        from kubernetes import watch

        watcher = watch.Watch()
        self._watches[tier] = watcher
        try:
            if self._stop.is_set():
                return version
            for event in watcher.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                        label_selector=selector, resource_version=version,
                                        allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_S,
                                        _request_timeout=WATCH_TIMEOUT_S + REQUEST_TIMEOUT_S):
                obj = event["raw_object"]
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if event["type"] in ("ADDED", "MODIFIED"):
                    slices[obj["metadata"]["name"]] = obj
                elif event["type"] == "DELETED":
                    slices.pop(obj["metadata"]["name"], None)
                else:
                    continue  # BOOKMARK
                publish(slices)
        finally:
            self._watches.pop(tier, None)
        return version


def _brief(exc: Exception) -> str:
    """One line about a failed API call (an ApiException's str carries headers and body)."""
    status = getattr(exc, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{exc.__class__.__name__}: {exc}"


def _client_configuration(kubeconfig: str | None) -> tuple[Any, str]:
    """(API client configuration, default namespace): in-cluster, else the kubeconfig."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
        try:
            with open(IN_CLUSTER_NAMESPACE_FILE) as handle:
                return configuration, handle.read().strip() or "default"
        except OSError:
            return configuration, "default"
    except config.ConfigException:
        pass
    path = kubeconfig or os.path.expanduser("~/.kube/config")
    try:
        config.load_kube_config(config_file=path, client_configuration=configuration)
        _, current = config.list_kube_config_contexts(config_file=path)
    except (config.ConfigException, OSError) as exc:
        raise DiscoveryError(
            f"--discovery kubernetes: not running in a cluster and no usable kubeconfig at {path} "
            f"({exc}); run inside Kubernetes or set KUBECONFIG") from exc
    return configuration, (current or {}).get("context", {}).get("namespace") or "default"


def from_config(config: Any) -> Discovery:
    """The discovery that CoordinatorConfig asks for (DiscoveryError when it is incomplete)."""
    if config.discovery == DiscoveryKind.STATIC:
        return StaticDiscovery({Tier.DRAFT: parse_addresses(config.draft, "--draft"),
                                Tier.TARGET: parse_addresses(config.target, "--target")})
    if config.discovery == DiscoveryKind.KUBERNETES:
        missing = [flag for flag, value in (("--draft-service", config.draft_service),
                                            ("--target-service", config.target_service)) if not value]
        if missing:
            raise DiscoveryError(f"--discovery kubernetes needs {' and '.join(missing)} (the Services "
                                 "of the draft and target Deployments)")
        services = [ServiceRef(Tier.DRAFT, config.draft_service, config.draft_port),
                    ServiceRef(Tier.TARGET, config.target_service, config.target_port)]
        return KubernetesDiscovery(services, config.namespace, os.environ.get("KUBECONFIG"))
    raise DiscoveryError(f"unknown --discovery {config.discovery!r}: use static or kubernetes")
