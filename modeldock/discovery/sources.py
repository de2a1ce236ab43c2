"""Discovery sources: what publishes each model's endpoints into the snapshot store.

A source is anything with the `DiscoverySource` shape; `sources_from_config` is
the one place that decides which source serves which model (a model lists
`endpoints:` -> static, `kubernetes:` -> Kubernetes; config.py checks that a
model has exactly one). The Kubernetes client library is imported only when a
model needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from modeldock.discovery.snapshot import SnapshotStore
from modeldock.discovery.static import StaticDiscovery

if TYPE_CHECKING:
    from modeldock.config import Config


class DiscoverySource(Protocol):
    """Publishes (`store.update`) and vouches for (`store.confirm`) its models' endpoints,
    on the event loop, until cancelled."""

    kind: str  # "static" | "kubernetes"
    models: frozenset[str]  # the model names it publishes

    async def run(self) -> None: ...


def kube_watch_timeout(stale_after: float) -> int:
    """A quiet, healthy namespace is confirmed when its watch times out cleanly:
    renew it well within the staleness cutoff (a third of it, at least 1 s)."""
    return max(1, int(stale_after / 3))


def sources_from_config(config: Config, store: SnapshotStore, *, config_path: str | Path,
                        kubeconfig: str | None = None, poll_interval: float = 1.0,
                        api_client: Callable[[str | None], Any] | None = None) -> list[DiscoverySource]:
    """The sources `config` needs. `api_client(kubeconfig)` makes the Kubernetes client
    (default: kubernetes.load_api_client)."""
    sources: list[DiscoverySource] = []
    static = [m for m in config.models if m.source == "static"]
    if static:
        sources.append(StaticDiscovery(config_path, static, store, poll_interval=poll_interval))
    kube = [m for m in config.models if m.source == "kubernetes"]
    if kube:
        from modeldock.discovery.kubernetes import KubernetesDiscovery, load_api_client

        make_client = api_client if api_client is not None else load_api_client
        sources.append(KubernetesDiscovery(kube, store, make_client(kubeconfig),
                                           watch_timeout_seconds=kube_watch_timeout(
                                               config.discovery.stale_after_seconds)))
    return sources
