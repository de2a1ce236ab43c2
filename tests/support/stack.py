"""The real stack for end-to-end tests: modeldock/devstack/stack.py (shared with the benchmarks), plus what
only the tests use: the mesh configs (Envoy Gateway, Istio) and raw HTTP requests for malformed input.

Every process is a child of the test run (and dies with it); `Stack.stop` stops them all and the fixtures
call it in a finalizer.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeldock.devstack import stack as _dev
from modeldock.devstack.stack import (
    API_KEY,
    OTHER_KEY,
    PY,
    Sim,
    Stack,
    default_config,
    http_json,
    start_sims,
    wait_until,
)

__all__ = ["API_KEY", "OTHER_KEY", "PY", "RawResponse", "Sim", "Stack", "default_config", "http_json",
           "mesh_bootstrap", "raw_request", "running_stack", "start_sims", "wait_until"]


@contextmanager
def running_stack(run_dir: Path, *, mesh: str | None = None, extproc_args: Sequence[str] = (),
                  **options: Any) -> Iterator[Stack]:
    """`modeldock.devstack.stack.running_stack`, and `mesh` ("envoy-gateway" or "istio"): Envoy runs the
    config that gateway generates (tests/e2e/mesh/<mesh>.yaml) and ext_proc runs in picker mode as its
    endpoint picker (`--picker one` over TLS for Envoy Gateway, `--picker list` for Istio) instead of
    modeldock's bootstrap."""
    if mesh is None:
        with _dev.running_stack(run_dir, extproc_args=extproc_args, **options) as stack:
            yield stack
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    picker_args = _picker_args(run_dir, mesh)

    def envoy_config(stack: Stack) -> str:
        return mesh_bootstrap(mesh, stack.port, stack.admin_port, stack.extproc_ports[0], [s.port for s in stack.sims])

    with _dev.running_stack(run_dir, extproc_args=[*picker_args, *extproc_args], envoy_config=envoy_config,
                            **options) as stack:
        yield stack


MESH_BOOTSTRAPS = Path(__file__).resolve().parents[1] / "e2e" / "mesh"


def mesh_bootstrap(mesh: str, port: int, admin_port: int, epp_port: int, pool_ports: Sequence[int]) -> str:
    """The Envoy config `mesh` generates (tests/e2e/mesh/), pointed at this machine's picker and pool.
    "envoy-gateway-buffered": the pool annotated `aigateway.envoyproxy.io/processing-body-mode: buffered`."""
    from string import Template

    text = (MESH_BOOTSTRAPS / f"{mesh.removesuffix('-buffered')}.yaml").read_text()
    if mesh.endswith("-buffered"):
        text = text.replace("body_mode: FULL_DUPLEX_STREAMED", "body_mode: BUFFERED")
    pool = "[" + ", ".join(f"{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}}}"
                           for p in pool_ports) + "]"
    return Template(text).substitute(
        listen_port=port, admin_port=admin_port, epp_host="127.0.0.1", epp_port=epp_port, pool_lb_endpoints=pool)


def _picker_args(run_dir: Path, mesh: str) -> list[str]:
    """Envoy AI Gateway's picker cluster speaks only TLS (any certificate): a self-signed one."""
    if mesh == "istio":
        return ["--picker", "list"]
    cert, key = run_dir / "picker.crt", run_dir / "picker.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=modeldock-picker.llm.svc", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return ["--picker", "one", "--tls-cert", str(cert), "--tls-key", str(key)]


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(method: str, url: str, body: bytes | None = None, headers: Sequence[tuple[str, str]] = (),
                timeout: float = 10.0) -> RawResponse:
    """An HTTP request with exactly these headers (duplicates kept), for malformed-input tests."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.putrequest(method, parts.path + (f"?{parts.query}" if parts.query else ""))
        for key, value in headers:
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return RawResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()
