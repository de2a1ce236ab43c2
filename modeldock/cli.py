"""The `modeldock` command."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import sys
from pathlib import Path
from types import ModuleType

from modeldock import __version__
from modeldock.config import ConfigError, hash_key, load_config


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load(path: str):  # type: ignore[no-untyped-def]
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"modeldock: invalid config\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_xds(args: argparse.Namespace) -> int:
    from modeldock.xds.app import XdsOptions, serve

    config = _load(args.config)
    options = XdsOptions(Path(args.config), args.host, args.port, args.kubeconfig, metrics_host=args.metrics_host)
    asyncio.run(serve(config, options, args.metrics_port))
    return 0


def cmd_extproc(args: argparse.Namespace) -> int:
    from modeldock.epp import PickerOptions
    from modeldock.extproc.app import ExtProcOptions, serve

    if (args.tls_cert is None) != (args.tls_key is None):
        print("modeldock extproc: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.workers > 1:
        from modeldock.extproc.workers import run_workers

        _load(args.config)  # a bad config fails here once, not in N children
        return run_workers(args)
    config = _load(args.config)
    from modeldock.usage.writer import UsageSinkError

    options = ExtProcOptions(args.xds, args.host, args.port, config_path=Path(args.config),
                             drain_delay=args.drain_delay, metrics_host=args.metrics_host,
                             picker=PickerOptions(fallbacks=args.picker == "list") if args.picker else None,
                             tls_cert=Path(args.tls_cert) if args.tls_cert else None,
                             tls_key=Path(args.tls_key) if args.tls_key else None)
    try:
        asyncio.run(serve(config, options, args.metrics_port, args.grace))
    except UsageSinkError as exc:
        print(f"modeldock extproc: {exc}", file=sys.stderr)
        return 2
    return 0


def _worker_count(text: str) -> int:
    from modeldock.extproc.workers import worker_count

    return worker_count(text)


def cmd_up(args: argparse.Namespace) -> int:
    from modeldock.up import run_up

    return run_up(args)


def cmd_keys_hash(args: argparse.Namespace) -> int:
    key = args.key
    if key is None:
        # Read from the terminal or a pipe so the key stays out of shell history.
        key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
    if not key:
        print("modeldock: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    config = _load(args.path)
    print(f"{args.path}: OK ({len(config.models)} models, {len(config.tenants)} tenants)")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from modeldock.config import ListenerConfig
    from modeldock.envoy import BootstrapOptions, render_bootstrap

    # The config's `listener:` and `limits.max_body_bytes`, when a config is given.
    listener, max_body = ListenerConfig(), args.max_body_bytes
    if args.config:
        config = _load(args.config)
        listener = config.listener
        max_body = args.max_body_bytes if args.max_body_bytes is not None else config.limits.max_body_bytes
    host_x, _, port_x = args.xds.rpartition(":")
    extprocs = tuple(e.strip() for e in args.extproc.split(",") if e.strip())
    host_e, _, port_e = extprocs[0].rpartition(":")
    print(render_bootstrap(BootstrapOptions(
        listen_port=args.port, admin_port=args.admin_port, xds_port=int(port_x), extproc_port=int(port_e),
        listen_host=args.listen_host, xds_host=host_x, extproc_host=host_e.strip("[]"), node_id=args.node_id,
        extproc_endpoints=extprocs if len(extprocs) > 1 else (),
        buffer_limit=max_body or 4 * 1024 * 1024, listener=listener,
    )), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modeldock", description="An LLM inference gateway: a Python control plane for Envoy."
    )
    parser.add_argument("--version", action="version", version=f"modeldock {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole stack on this machine (demo backends included)",
                        description="Start simulated backends, the xDS server, ext_proc and Envoy on loopback.")
    up.add_argument("--config", help="config file (default: the built-in demo config)")
    up.add_argument("--port", type=int, default=8080, help="Envoy listener port (default 8080)")
    up.add_argument("--backends", type=int, default=2, help="simulated backends for the demo config (default 2)")
    up.add_argument("--speed", type=float, default=1.0, help="simulator speed factor (default 1.0 = real time)")
    up.add_argument("--run-dir", help="where generated files and logs go (default: a new temp dir)")
    up.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for Envoy (default 60)")
    up.add_argument("--workers", type=_worker_count, default=1, metavar="N",
                    help="ext_proc worker processes behind Envoy (1-64, default 1; see `extproc --workers`)")
    up.set_defaults(func=cmd_up)

    xds = sub.add_parser("xds", help="run the xDS (ADS) server", description="Serve EDS clusters per model over ADS.")
    xds.add_argument("--config", required=True, help="config file")
    xds.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    xds.add_argument("--port", type=int, default=18000, help="ADS port (default 18000)")
    xds.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    xds.add_argument("--metrics-host", help="metrics listen address (default: --host)")
    xds.add_argument("--kubeconfig",
                     help="kubeconfig for Kubernetes discovery (default: in-cluster, then ~/.kube/config)")
    xds.set_defaults(func=cmd_xds)

    ext = sub.add_parser("extproc", help="run the ext_proc service",
                         description="Authenticate, admit and pick endpoints for Envoy's ext_proc filter.")
    ext.add_argument("--config", required=True, help="config file")
    ext.add_argument("--xds", default="127.0.0.1:18000", help="xDS server host:port (default 127.0.0.1:18000)")
    ext.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    ext.add_argument("--port", type=int, default=18001, help="gRPC port (default 18001)")
    ext.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    ext.add_argument("--metrics-host", help="metrics listen address (default: --host)")
    ext.add_argument("--grace", type=float, default=30.0, help="seconds to drain streams on SIGTERM (default 30)")
    ext.add_argument("--drain-delay", type=float, default=0.0,
                     help="on SIGTERM, report NOT_SERVING to gRPC health checks and keep taking new streams this "
                          "many seconds before draining, so Envoy moves new requests to other replicas (default 0)")
    ext.add_argument("--picker", choices=["one", "list"],
                     help="picker mode: be the Endpoint Picker of a Gateway API gateway's InferencePool "
                          "(docs/mesh.md); answer one endpoint (an ORIGINAL_DST cluster: Envoy AI Gateway) or "
                          "the ranked list with fallbacks (override_host: Istio)")
    ext.add_argument("--tls-cert", help="serve gRPC over TLS with this PEM certificate (needs --tls-key)")
    ext.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    ext.add_argument("--workers", type=_worker_count, default=1, metavar="N",
                     help="run N ext_proc processes (1-64, default 1: this process serves) on ports "
                          "--port..--port+N-1 (metrics ports --metrics-port..+N-1), each its own replica "
                          "(MODELDOCK_REPLICA=<$MODELDOCK_REPLICA or host name>-w<i>), supervised by this "
                          "process: SIGTERM drains them all, one that dies is restarted. Envoy must list all N: "
                          "`modeldock envoy-config --extproc 127.0.0.1:18001,127.0.0.1:18002,...`. They share "
                          "load state only through Redis (limits.redis_url / $REDIS_URL)")
    ext.set_defaults(func=cmd_extproc)

    env = sub.add_parser("envoy-config", help="print an Envoy bootstrap for this control plane")
    env.add_argument("--port", type=int, default=8080, help="listener port")
    env.add_argument("--listen-host", default="0.0.0.0", help="listener address (default 0.0.0.0)")
    env.add_argument("--admin-port", type=int, default=9901, help="admin port (bound to 127.0.0.1)")
    env.add_argument("--xds", default="127.0.0.1:18000", help="xDS server host:port")
    env.add_argument("--extproc", default="127.0.0.1:18001",
                     help="ext_proc host:port, or a comma-separated list of replicas")
    env.add_argument("--config", help="take `listener:` (timeouts, HTTP/2 streams, heap limit, ext_proc "
                     "message timeout) and limits.max_body_bytes from this config file")
    env.add_argument("--max-body-bytes", type=int,
                     help="Envoy refuses larger bodies with a JSON 413 (default: the config's "
                          "limits.max_body_bytes, else 4194304)")
    env.add_argument("--node-id", default="modeldock-envoy", help="Envoy node id")
    env.set_defaults(func=cmd_envoy_config)

    keys = sub.add_parser("keys", help="API key tools")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kh = keys_sub.add_parser("hash", help="print the stored form (sha256:...) of an API key")
    kh.add_argument("key", nargs="?", help="the key (default: read from the terminal or stdin)")
    kh.set_defaults(func=cmd_keys_hash)

    cfg = sub.add_parser("config", help="config tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cc = cfg_sub.add_parser("check", help="validate a config file")
    cc.add_argument("path")
    cc.set_defaults(func=cmd_config_check)

    for name, load, text in (("sim", _sim_cli, "run a simulated vLLM backend"),
                             ("bench", _bench_cli, "benchmark an OpenAI-compatible endpoint"),
                             ("usage", _usage_cli, "per-tenant usage totals from usage record files")):
        try:
            mod = load()
        except ImportError:
            continue
        p = sub.add_parser(name, help=text, description=text)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


# Subcommands with modules of their own, imported by name (not from strings) so that the import-graph
# test sees them; one whose dependencies are missing is left out of the parser.
def _sim_cli() -> ModuleType:
    from modeldock.sim import cli

    return cli


def _bench_cli() -> ModuleType:
    from modeldock.bench import cli

    return cli


def _usage_cli() -> ModuleType:
    from modeldock.usage import cli

    return cli


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
