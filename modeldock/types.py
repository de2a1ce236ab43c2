"""Types shared by several packages: the ground floor, importing nothing of modeldock's.

Discovery produces endpoints, xDS serves them, picking scores them and ext_proc
routes to them; each imports `Endpoint` from here, never from a sibling package. So too the
name of a model's Envoy cluster, which xDS serves and the director routes to (`cluster_name`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str  # an IPv4 or IPv6 literal, never a name
    port: int

    @property
    def address(self) -> str:
        """`ip:port`, with brackets around IPv6, as Envoy's override_host wants it."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse `ip:port` or `[v6]:port`; raises ValueError with the reason."""
        text = text.strip()
        if text.startswith("["):
            host, sep, port = text[1:].partition("]:")
            if not sep:
                raise ValueError(f"{text!r} is not [ipv6]:port")
        else:
            host, sep, port = text.rpartition(":")
            if not sep:
                raise ValueError(f"{text!r} is not ip:port")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{host!r} in {text!r} is not an IP address") from None
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"port {port!r} in {text!r} is not 1-65535")
        return cls(ip.compressed, int(port))


def cluster_name(model: str) -> str:
    """The Envoy cluster of a model (CDS), which the director's route metadata names."""
    return f"model:{model}"


def model_of_cluster(name: str) -> str | None:
    return name.removeprefix("model:") if name.startswith("model:") else None
