"""A fake Kubernetes API server for EndpointSlices, for tests.

It speaks enough of the real REST and watch wire protocol that the unchanged
official `kubernetes` client can list and watch EndpointSlices against it:

    with FakeKubeServer() as server:
        server.apply(make_slice("vllm-abc", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
        server.apply_many([...])        # many slices in one round trip (one event each)
        server.write_kubeconfig(path)   # or: client = server.api_client()
        server.send_bookmark()          # BOOKMARK to every watch that asked for them
        server.compact()                # forget history: the next watch resume gets 410
        server.pause(); server.resume() # requests and watch events hang, then flow again
        server.stop(); server.start()   # connections refused, then back on the same port
        server.requests                 # every request seen (RequestRecord.is_watch)
        server.open_watches             # watch connections open now
        server.connections              # connections accepted so far

It runs its own event loop in a daemon thread on a free loopback port, so it
serves both the test's worker threads and other processes (through the
kubeconfig). Every EndpointSlice it stores and every list or Status it serves is
validated against the official schema (strict) of `kubernetes_validate`; the
schemas are loaded once, so 1,000 slices cost about a second, not a minute.

HTTP/1.1 is written by hand on asyncio streams: that keeps full control over
connections, which `stop()` must cut and `pause()` must hold.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import functools
import itertools
import json
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import jsonschema
import kubernetes
import kubernetes_validate
import kubernetes_validate.utils
import yaml
from referencing import Registry, Resource

K8S_VERSION = "1.31"
API_VERSION = "discovery.k8s.io/v1"
SERVICE_LABEL = "kubernetes.io/service-name"
DEFAULT_WATCH_SECONDS = 1800  # what a real server picks (min-request-timeout) when none is asked for
_PATH_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"

Obj = dict[str, Any]
T = TypeVar("T")


def make_slice(
    name: str,
    namespace: str,
    service: str,
    addresses: list[tuple[str, bool | None, bool | None]],
    port_name: str | None,
    port: int | None,
    address_type: str = "IPv4",
) -> Obj:
    """A valid EndpointSlice: one endpoint per (ip, ready, terminating).

    A None condition is left out of the object (the API's "unknown"). A None
    port gives a slice with no ports; a None port_name gives an unnamed port.
    """
    endpoints: list[Obj] = []
    for ip, ready, terminating in addresses:
        conditions: Obj = {}
        if ready is not None:
            conditions["ready"] = ready
            conditions["serving"] = ready
        if terminating is not None:
            conditions["terminating"] = terminating
        endpoints.append({"addresses": [ip], "conditions": conditions})
    ports: list[Obj] = []
    if port is not None:
        entry: Obj = {"port": port, "protocol": "TCP"}
        if port_name is not None:
            entry["name"] = port_name
        ports.append(entry)
    obj: Obj = {
        "apiVersion": API_VERSION,
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {SERVICE_LABEL: service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }
    validate(obj)
    return obj


def validate(obj: Obj) -> None:
    """Raise kubernetes_validate.ValidationError unless `obj` matches the official schema.

    What `kubernetes_validate.validate(obj, K8S_VERSION, strict=True)` does, with
    the schema of each kind loaded once (that call re-reads 3 MB of definitions).
    """
    name = {"EndpointSlice": "endpointslice-discovery-v1", "EndpointSliceList": "endpointslicelist-discovery-v1"}
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") not in name:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    try:
        _validator(name[obj["kind"]]).validate(obj)
    except jsonschema.ValidationError as exc:
        raise kubernetes_validate.ValidationError(exc, version=K8S_VERSION) from None


def validate_status(obj: Obj) -> None:
    """Status is core `v1` on the wire, but its schema is filed under meta/v1,
    which `kubernetes_validate.validate` cannot find from the apiVersion."""
    _validator("status-meta-v1").validate(obj)


@functools.cache
def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    folder = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    schema = kubernetes_validate.utils.schema_contents(f"{folder}/{schema_name}.json", K8S_VERSION)
    registry = Resource.from_contents(_definitions()) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def _definitions() -> Obj:
    folder = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    definitions: Obj = kubernetes_validate.utils.schema_contents(f"{folder}/_definitions.json", K8S_VERSION)
    return definitions


def status(code: int, reason: str, message: str) -> Obj:
    obj: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    validate_status(obj)
    return obj


@dataclass
class RequestRecord:
    """One request as the server saw it; `sent` lists the watch event types written."""

    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    status: int | None = None
    sent: list[str] = field(default_factory=list)
    connection: int = 0  # which connection it came on: 1, 2, ... in the order they were accepted

    @property
    def is_watch(self) -> bool:
        return self.params.get("watch") in ("true", "1")


@dataclass
class _Change:
    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    obj: Obj
    old: Obj | None  # the object before a MODIFIED or DELETED


@dataclass
class _Watcher:
    namespace: str
    selector: Callable[[Obj], bool]
    bookmarks: bool
    queue: asyncio.Queue[tuple[str, Obj] | None]
    ended: bool = False


class _BadRequest(Exception):
    pass


def _parse_selector(text: str) -> Callable[[Obj], bool]:
    """Equality-based label selectors (`a=b,c!=d,e,!f`); set-based ones are refused."""
    terms: list[tuple[str, str, str]] = []  # (key, operator, value)
    for term in filter(None, (part.strip() for part in text.split(","))):
        if "(" in term or " " in term:
            raise _BadRequest(f"unsupported label selector term {term!r}")
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key, "!=", value))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append((key, "=", value))
        elif term.startswith("!"):
            terms.append((term[1:], "absent", ""))
        else:
            terms.append((term, "present", ""))

    def holds(labels: dict[str, str], key: str, operator: str, value: str) -> bool:
        if operator == "=":
            return labels.get(key) == value
        if operator == "!=":
            return labels.get(key) != value
        return (key in labels) == (operator == "present")

    def matches(obj: Obj) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return all(holds(labels, *term) for term in terms)

    return matches


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec(obj: Obj) -> Obj:
    """What an apply can change; a no-op apply makes no event, as on a real server."""
    meta = obj["metadata"]
    return {
        **{k: v for k, v in obj.items() if k != "metadata"},
        "labels": meta.get("labels"),
        "annotations": meta.get("annotations"),
    }


class FakeKubeServer:
    """EndpointSlice list/watch over HTTP on 127.0.0.1; see the module docstring."""

    def __init__(self, port: int = 0) -> None:
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kube", daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._watchers: list[_Watcher] = []
        self._objects: dict[tuple[str, str], Obj] = {}
        self._history: list[_Change] = []
        self._rv = 1000  # arbitrary start, so no test can confuse an rv with a count
        self._oldest_rv = self._rv  # watches from before this get 410 Expired
        self._running = asyncio.Event()  # cleared by pause(); only touched on the loop
        self._call(self._running.set)
        self._log_lock = threading.Lock()
        self._requests: list[RequestRecord] = []
        self._connections = 0
        self.start()

    # ---- lifecycle -------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        """Listen (again) on the same port."""
        self._run(self._start())

    def stop(self) -> None:
        """Stop listening and cut every open connection: clients get refused or reset."""
        self._run(self._stop())

    def pause(self) -> None:
        """Hang: new requests get no answer and open watches deliver nothing."""
        self._call(self._running.clear)

    def resume(self) -> None:
        self._call(self._running.set)

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self._stop())
            self._run(_cancel_other_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_closed() and not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FakeKubeServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---- state -----------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._call(lambda: self._rv)

    @property
    def requests(self) -> list[RequestRecord]:
        with self._log_lock:
            return list(self._requests)

    @property
    def connections(self) -> int:
        """Connections accepted so far (a keep-alive client reuses one for many requests)."""
        return self._call(lambda: self._connections)

    @property
    def open_watches(self) -> int:
        """Watch connections open now (answered, not yet ended)."""
        return self._call(lambda: len(self._watchers))

    def apply(self, obj: Obj) -> Obj:
        """Create or replace an EndpointSlice; returns the stored object. Invalid ones raise."""
        return self._call(self._apply, copy.deepcopy(obj))

    def apply_many(self, objs: Iterable[Obj]) -> None:
        """`apply` each, in order, in one round trip to the server's loop (one change and event each).

        An invalid one raises; those before it stay applied.
        """
        copies = [copy.deepcopy(obj) for obj in objs]
        self._call(lambda: [self._apply(obj) for obj in copies])

    def delete(self, namespace: str, name: str) -> None:
        self._call(self._delete, namespace, name)

    def send_bookmark(self) -> int:
        """Send BOOKMARK (current resourceVersion) to every watch that allowed them."""
        return self._call(self._bookmark)

    def compact(self) -> None:
        """Forget all history and end open watches, so every resume gets 410 Expired.

        Other writes in the cluster move the (cluster-wide) resourceVersion on;
        one such write is simulated so the newest rv a client holds is too old.
        """
        self._call(self._compact)

    def write_kubeconfig(self, path: str | Path) -> Path:
        path = Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client for this server that leaves the client's global defaults alone."""
        configuration = kubernetes.client.Configuration(host=self.url)
        configuration.api_key = {"BearerToken": "fake-token"}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return kubernetes.client.ApiClient(configuration)

    # ---- running things on the server loop --------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        async def call() -> T:
            return fn(*args)

        return self._run(call())

    async def _start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._connection, "127.0.0.1", self._port)
            self._port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for watcher in self._watchers:
            watcher.ended = True
            watcher.queue.put_nowait(None)
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        await asyncio.sleep(0)

    def _apply(self, obj: Obj) -> Obj:
        if obj.get("apiVersion") != API_VERSION or obj.get("kind") != "EndpointSlice":
            raise ValueError("only discovery.k8s.io/v1 EndpointSlice is served")
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        old = self._objects.get(key)
        if old is not None and _spec(old) == _spec(obj):
            validate(obj)
            return copy.deepcopy(old)
        if old is None:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        else:
            keep = old["metadata"]
            meta.update(uid=keep["uid"], creationTimestamp=keep["creationTimestamp"], generation=keep["generation"] + 1)
        meta["resourceVersion"] = str(self._rv + 1)
        validate(obj)  # once, in the stored form; nothing changed yet if it raises
        self._rv += 1
        self._objects[key] = obj
        self._record(_Change(self._rv, "MODIFIED" if old else "ADDED", obj, old))
        return copy.deepcopy(obj)

    def _delete(self, namespace: str, name: str) -> None:
        old = self._objects.pop((namespace, name))  # KeyError: like a 404
        self._rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._record(_Change(self._rv, "DELETED", gone, old))

    def _record(self, change: _Change) -> None:
        self._history.append(change)
        for watcher in self._watchers:
            event = _event_for(change, watcher)
            if event is not None:
                watcher.queue.put_nowait(event)

    def _bookmark(self) -> int:
        mark = {"kind": "EndpointSlice", "apiVersion": API_VERSION, "metadata": {"resourceVersion": str(self._rv)}}
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(("BOOKMARK", mark))
        return self._rv

    def _compact(self) -> None:
        self._rv += 1
        self._oldest_rv = self._rv
        self._history.clear()
        for watcher in self._watchers:
            watcher.ended = True
            watcher.queue.put_nowait(None)

    # ---- HTTP ---------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self._connections += 1
        connection = self._connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                record = _parse_head(head)
                record.connection = connection
                with self._log_lock:
                    self._requests.append(record)
                await self._running.wait()
                if not await self._respond(record, writer):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # close() cancels held connections; end quietly rather than log
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _respond(self, record: RequestRecord, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        try:
            if record.method != "GET" or not record.path.startswith(_PATH_PREFIX):
                raise LookupError
            namespace, _, rest = record.path[len(_PATH_PREFIX) :].partition("/")
            if rest != "endpointslices" or not namespace:
                raise LookupError
            selector = _parse_selector(record.params.get("labelSelector", ""))
            if record.is_watch:
                return await self._watch(record, namespace, selector, writer)
            return await self._list(record, namespace, selector, writer)
        except LookupError:
            return await _send_json(
                writer, record, 404, status(404, "NotFound", f"the server could not find {record.path}")
            )
        except _BadRequest as exc:
            return await _send_json(writer, record, 400, status(400, "BadRequest", str(exc)))
        except Exception as exc:  # a bug in the fake: answer 500 rather than hang the client
            await _send_json(writer, record, 500, status(500, "InternalError", repr(exc)))
            raise

    async def _list(
        self, record: RequestRecord, namespace: str, selector: Callable[[Obj], bool], writer: asyncio.StreamWriter
    ) -> bool:
        rv = _int_rv(record.params.get("resourceVersion", ""))
        if rv and rv < self._oldest_rv:
            body = status(410, "Expired", f"too old resource version: {rv} ({self._oldest_rv})")
            return await _send_json(writer, record, 410, body)
        items = []
        for (ns, _), obj in sorted(self._objects.items()):
            if ns == namespace and selector(obj):
                # Items of a typed list carry no kind/apiVersion on the wire.
                items.append({k: v for k, v in obj.items() if k not in ("kind", "apiVersion")})
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": API_VERSION,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }
        validate(body)
        return await _send_json(writer, record, 200, body)

    async def _watch(
        self, record: RequestRecord, namespace: str, selector: Callable[[Obj], bool], writer: asyncio.StreamWriter
    ) -> bool:
        params = record.params
        seconds = int(params.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
        watcher = _Watcher(namespace, selector, params.get("allowWatchBookmarks") == "true", asyncio.Queue())
        rv = _int_rv(params.get("resourceVersion", ""))
        # Backlog and registration happen with no await between: no change is lost or doubled.
        backlog: list[tuple[str, Obj]] = []
        if not rv:
            backlog = [
                ("ADDED", obj) for (ns, _), obj in sorted(self._objects.items()) if ns == namespace and selector(obj)
            ]
        elif rv < self._oldest_rv:
            # What a real server does on a watch: 200, then one ERROR event, then the end.
            backlog = [("ERROR", status(410, "Expired", f"too old resource version: {rv} ({self._oldest_rv})"))]
            watcher.ended = True
        else:
            backlog = [event for change in self._history if change.rv > rv if (event := _event_for(change, watcher))]
        for event in backlog:
            watcher.queue.put_nowait(event)
        if watcher.ended:
            watcher.queue.put_nowait(None)
        self._watchers.append(watcher)
        record.status = 200
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nCache-Control: no-cache, private\r\n\r\n"
        )
        deadline = asyncio.get_running_loop().time() + seconds
        try:
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                await self._running.wait()
                if event is None or (watcher.ended and event[0] != "ERROR"):
                    break
                kind, obj = event
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                record.sent.append(kind)
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
            await self._running.wait()  # a paused server does not even end a watch
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            self._watchers.remove(watcher)


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _event_for(change: _Change, watcher: _Watcher) -> tuple[str, Obj] | None:
    """The event a filtered watch sees: an object leaving the selector is DELETED to it."""
    if change.obj["metadata"]["namespace"] != watcher.namespace:
        return None
    now = change.type != "DELETED" and watcher.selector(change.obj)
    before = change.old is not None and watcher.selector(change.old)
    if change.type == "DELETED":
        return ("DELETED", change.obj) if before else None
    if now:
        return ("MODIFIED" if before else "ADDED", change.obj)
    if before:
        return ("DELETED", change.obj)
    return None


def _int_rv(text: str) -> int:
    if text == "":
        return 0
    if not text.isdigit():
        raise _BadRequest(f"invalid resourceVersion {text!r}")
    return int(text)


def _parse_head(head: bytes) -> RequestRecord:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in itertools.takewhile(bool, lines[1:]):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    parts = urlsplit(target)
    return RequestRecord(method, unquote(parts.path), dict(parse_qsl(parts.query, keep_blank_values=True)), headers)


async def _send_json(writer: asyncio.StreamWriter, record: RequestRecord, code: int, body: Obj) -> bool:
    reasons = {200: "OK", 400: "Bad Request", 404: "Not Found", 410: "Gone", 500: "Internal Server Error"}
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {code} {reasons[code]}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)
    await writer.drain()
    record.status = code
    return True
