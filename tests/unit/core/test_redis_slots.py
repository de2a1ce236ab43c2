"""Every Lua script and every multi-key call modeldock sends touches keys of one Redis Cluster hash slot,
and every key a script touches is declared in its KEYS (issue 30).

Two halves, each with a self-check that feeds it a violation and expects it caught:

- Static. Every Lua script text in modeldock is found without a list (module-level strings that call
  `redis.call`/`redis.pcall`, and the `Script`/`register_script` objects built from them); in each, every
  key argument of every `redis.call`/`redis.pcall` must be `KEYS[...]` or a name bound only from KEYS (a
  `local a, b = KEYS[..], KEYS[..]`, a `for _, key in ipairs(KEYS)`, a local function's parameter whose
  every call passes one). Which arguments are keys is the server's own answer (`COMMAND`: first key, last
  key, step), not a table here; so TIME (no arguments) and PUBLISH (its channel is not a key: on a
  cluster a PUBLISH reaches every node through the bus, whatever its channel) are keyless because Redis
  says so. SPUBLISH/SSUBSCRIBE are the exception the server's key specs mark `not_key` but a cluster
  still routes by: their shard channel is held to the same rule as a key. The Python side: no module
  that talks to Redis calls a multi-key command, a pipeline or a transaction (an allow-list, empty today).
- Dynamic. The real Redis-backed paths (admission's sliding window with a tenant and a per-model limit,
  token budgets with leases, a calendar period and a cost budget, reserve/settle/refund, the sharing
  store's exchange and leave) run against a real standalone Redis while MONITOR records every command it
  receives, the commands scripts run included (`[0 lua]`). Per EVALSHA/EVAL: numkeys and the declared keys
  hash to one slot (`redis.crc.key_slot`), and every key its inner commands touch is one it declared. Per
  other command (and per MULTI..EXEC), its keys (`COMMAND GETKEYS`) hash to one slot. Per tenant, the
  hash tag is the tenant's id, so two tenants are not one slot.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest
import pytest_asyncio
from redis.asyncio.connection import Connection
from redis.crc import key_slot
from redis.exceptions import ResponseError

import modeldock
from modeldock.admission.limits import Admission
from modeldock.budgets import redis_batch
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.pricing import model_price
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.config import PriceConfig
from modeldock.redis_client import make_redis_client
from modeldock.sharing.store import KEY as SHARE_KEY
from modeldock.sharing.store import RedisShareStore
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant, clocked

PACKAGE_DIR = Path(modeldock.__file__).parent
# The scripts found today: the sliding window (admission), reserve and settle (token budgets), exchange
# and leave (sharing). Discovery finding fewer means it broke, not that scripts went away unnoticed.
SCRIPTS_TODAY = 5
# Modules that administer a Redis rather than use one (a dev topology: CLUSTER SETSLOT, MIGRATE ... KEYS of
# one slot at a time). Not gateway code paths.
ADMIN_MODULES = ("modeldock/devstack/",)
# Commands the server's key specs call keyless (`not_key`) but a cluster routes by their shard channel.
SHARD_CHANNEL_COMMANDS = {"spublish": 1, "ssubscribe": None, "sunsubscribe": None}  # index, None: all args
SCRIPT_COMMANDS = {"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"}
# redis-py client methods that take several keys, or batch commands (pipeline, transaction).
MULTI_KEY_METHODS = {
    "pipeline", "transaction", "mget", "mset", "msetnx", "delete", "unlink", "exists", "touch", "rename",
    "renamenx", "copy", "sunion", "sunionstore", "sinter", "sinterstore", "sintercard", "sdiff", "sdiffstore",
    "smove", "zunion", "zunionstore", "zinter", "zinterstore", "zintercard", "zdiff", "zdiffstore",
    "zrangestore", "lmove", "blmove", "rpoplpush", "brpoplpush", "blpop", "brpop", "lmpop", "blmpop",
    "bzpopmin", "bzpopmax", "zmpop", "bzmpop", "pfcount", "pfmerge", "bitop", "watch", "eval", "evalsha",
    "eval_ro", "evalsha_ro", "fcall", "fcall_ro", "xread", "xreadgroup", "sort", "sort_ro", "georadius",
    "georadiusbymember", "geosearchstore", "object", "migrate",
}
# Names Python objects have too (a Path's exists/unlink/rename, a list's sort, a router's delete): counted
# only when called with two keys or more (or a `store`), which one Redis key never takes.
AMBIGUOUS_METHODS = {"exists", "delete", "unlink", "touch", "rename", "renamenx", "copy", "sort", "object", "watch"}
# The same as raw command names (execute_command("DEL", ...), a packed ("MSET", ...) tuple).
RAW_MULTI_KEY = MULTI_KEY_METHODS - {"delete", "pipeline", "transaction"} | {"del", "multi", "exec"}
MULTI_KEY_ALLOWED: set[tuple[str, str]] = set()  # (module path, method): none today


# ---------------------------------------------------------------------------------------------------
# The server's command table: which arguments are keys.


@dataclass(frozen=True)
class KeySpec:
    first: int  # argv index of the first key (0: none), as in COMMAND's reply
    last: int  # argv index of the last key; negative counts from the end
    step: int
    movable: bool  # keys found by reading arguments (numkeys, KEYS ...): ask COMMAND GETKEYS


def _spec_entries(entries: Any, into: dict[str, KeySpec]) -> None:
    """COMMAND's reply: per command [name, arity, flags, first key, last key, step, ..., subcommands]."""
    for entry in entries:
        name = bytes(entry[0]).decode().lower()
        flags = {bytes(f).decode() for f in entry[2]}
        first, last, step = (int(entry[i]) for i in (3, 4, 5))
        into[name] = KeySpec(first, last, step, "movablekeys" in flags)
        if len(entry) > 9 and entry[9]:
            _spec_entries(entry[9], into)


async def _raw(conn: Connection, *args: Any) -> Any:
    await conn.send_command(*args)
    return await conn.read_response(disable_decoding=True)


async def _connect(server: RedisServer) -> Connection:
    conn = Connection(host="127.0.0.1", port=server.port, socket_timeout=10, protocol=2)
    await conn.connect()  # type: ignore[no-untyped-call]
    return conn


async def command_specs(server: RedisServer) -> dict[str, KeySpec]:
    conn = await _connect(server)
    try:
        reply = await _raw(conn, "COMMAND")
    finally:
        await conn.disconnect()
    specs: dict[str, KeySpec] = {}
    _spec_entries(reply, specs)
    return specs


@pytest.fixture(scope="module")
def specs() -> Iterator[dict[str, KeySpec]]:
    """The command table of the Redis the tests run on (one server of this module's own, then gone)."""
    with RedisServer() as server:
        if not server.running:
            server.start()
        yield asyncio.run(command_specs(server))


def spec_of(specs: dict[str, KeySpec], argv: Sequence[str]) -> KeySpec:
    name = argv[0].lower()
    if len(argv) > 1 and f"{name}|{argv[1].lower()}" in specs:
        return specs[f"{name}|{argv[1].lower()}"]
    if name not in specs:
        raise AssertionError(f"{argv[0]!r} is not a command this Redis knows")
    return specs[name]


def key_positions(spec: KeySpec, argc: int) -> list[int]:
    """argv indexes of the keys of a command of `argc` arguments (its name included)."""
    if spec.first == 0:
        return []
    last = spec.last if spec.last >= 0 else argc + spec.last
    return list(range(spec.first, min(last, argc - 1) + 1, spec.step))


# ---------------------------------------------------------------------------------------------------
# Static: the Lua scripts.


@dataclass
class LuaCall:
    text: str  # the whole `redis.call(...)`
    args: list[str]  # its argument expressions, the command's name first


def _strip_comments(lua: str) -> str:
    out, i, quote = [], 0, ""
    while i < len(lua):
        c = lua[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(lua[i + 1 : i + 2])
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            out.append(c)
        elif lua.startswith("--", i):
            end = lua.find("\n", i)
            i = len(lua) if end < 0 else end
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _outside_strings(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """(index, character, bracket depth after it) for each character from `start` not inside a string
    literal (quotes and escapes followed)."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        else:
            depth += 1 if c in "([{" else -1 if c in ")]}" else 0
            yield i, c, depth
        i += 1


def _balanced(lua: str, start: int) -> int:
    """The index just past the bracket closing the one at `start` (strings skipped)."""
    for i, c, depth in _outside_strings(lua, start):
        if c in ")]}" and depth == 0:
            return i + 1
    raise AssertionError(f"unbalanced brackets in Lua from: {lua[start:start + 60]!r}")


def _split_top(expr: str, sep: str = ",") -> list[str]:
    cuts = [i for i, c, depth in _outside_strings(expr) if c == sep and depth == 0]
    bounds = [-1, *cuts, len(expr)]
    parts = [expr[a + 1 : b].strip() for a, b in zip(bounds, bounds[1:], strict=False)]
    return parts if cuts or parts[-1] else []


def calls_of(lua: str, name: str) -> list[tuple[int, list[str]]]:
    """Every call `name(...)` in `lua` (its position, its argument expressions)."""
    out = []
    for m in re.finditer(rf"(?<![\w.:]){re.escape(name)}\s*\(", lua):
        open_at = m.end() - 1
        out.append((m.start(), _split_top(lua[open_at + 1 : _balanced(lua, open_at) - 1])))
    return out


_KEYWORDS = r"(?:end|then|do|else|elseif|if|for|while|local|return|until|repeat)"
_IDENT = r"[A-Za-z_]\w*"


def _cut_statement(rest: str) -> str:
    """An assignment's expression list: up to the line's end, a `;` or a keyword at bracket depth 0."""
    line = rest.split("\n", 1)[0]
    depth, quote = 0, ""
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = ""
            continue
        if c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and (c == ";" or re.match(rf"\s{_KEYWORDS}\b", line[i:])):
            return line[:i]
    return line


def bindings(lua: str) -> dict[str, list[str]]:
    """Every expression each name is bound to: assignments, generic-for values (`ipairs(X)` binds its
    value to `X[]`), numeric-for counters (an unknown value) and local functions' parameters (every
    call's argument there)."""
    bound: dict[str, list[str]] = {}
    functions: dict[str, list[str]] = {}
    for m in re.finditer(rf"\bfunction\s+({_IDENT})\s*\(([^)]*)\)", lua):
        functions[m.group(1)] = [p.strip() for p in m.group(2).split(",") if p.strip()]
    for fname, params in functions.items():
        for param in params:
            bound.setdefault(param, [])
        for start, args in calls_of(lua, fname):
            if re.search(r"function\s+$", lua[max(0, start - 20) : start]):
                continue  # the definition itself
            for param, arg in zip(params, args, strict=False):
                bound[param].append(arg)
    for m in re.finditer(rf"\bfor\s+({_IDENT}(?:\s*,\s*{_IDENT})*)\s+in\s+(.+?)\s+do\b", lua):
        names = [n.strip() for n in m.group(1).split(",")]
        source = m.group(2).strip()
        over = re.fullmatch(r"i?pairs\s*\(\s*(\w+)\s*\)", source)
        for i, name in enumerate(names):
            bound.setdefault(name, []).append(f"{over.group(1)}[]" if over and i == 1 else "<for>")
    for m in re.finditer(rf"\bfor\s+({_IDENT})\s*=", lua):
        bound.setdefault(m.group(1), []).append("<for>")
    for m in re.finditer(rf"(?:(?<=\n)|(?<=^)|(?<=[\s;]))(?:local\s+)?({_IDENT}(?:\s*,\s*{_IDENT})*)\s*=(?!=)", lua):
        if re.fullmatch(_KEYWORDS, m.group(1)) or lua[max(0, m.start() - 9) : m.start()].rstrip().endswith("function"):
            continue
        names = [n.strip() for n in m.group(1).split(",")]
        values = _split_top(_cut_statement(lua[m.end() :]))
        for i, name in enumerate(names):
            bound.setdefault(name, []).append(values[i] if i < len(values) else "<nil>")
    return bound


def _keys_derived(expr: str, names: set[str]) -> bool:
    expr = expr.strip()
    while expr.startswith("(") and _balanced(expr, 0) == len(expr):
        expr = expr[1:-1].strip()
    return bool(re.fullmatch(r"KEYS\s*\[[^\[\]]+\]|KEYS\[\]", expr)) or expr in names


def keys_bound_names(lua: str) -> set[str]:
    """Names bound only from KEYS (the least fixed point: a name is in when every binding of it is)."""
    # `x = x` (a caller's `z` passed to a parameter also named `z`: one name here) brings no new value in.
    bound = {n: [e for e in exprs if e.strip() != n] for n, exprs in bindings(lua).items()}
    names: set[str] = set()
    while True:
        more = {n for n, exprs in bound.items() if exprs and all(_keys_derived(e, names) for e in exprs)}
        if more == names:
            return names
        names = more


def script_violations(lua: str, specs: dict[str, KeySpec]) -> list[str]:
    """What in `lua` could touch a key it did not declare in KEYS (empty: nothing)."""
    lua = _strip_comments(lua)
    problems: list[str] = []
    if re.search(r"(?<![\w.])KEYS\s*(?:\[[^\]]*\]\s*)?=(?!=)", lua):
        problems.append("KEYS is assigned to")
    for m in re.finditer(r"redis\s*\.\s*p?call\b(?!\s*\()", lua):
        problems.append(f"redis.call used other than called at once (aliased?): {lua[m.start():m.start() + 40]!r}")
    for name in ("redis.call", "redis.pcall"):
        if re.search(rf"{re.escape(name)}\s*\(", lua) is None:
            continue
        keyed = keys_bound_names(lua)
        for _, args in calls_of(lua, name):
            call = f"{name}({', '.join(args)})"
            literal = re.fullmatch(r"""(['"])([A-Za-z|]+)\1""", args[0]) if args else None
            if literal is None:
                problems.append(f"{call}: the command is not a string literal")
                continue
            argv = [literal.group(2), *args[1:]]
            cmd = argv[0].lower()
            if cmd in SCRIPT_COMMANDS:
                problems.append(f"{call}: a script calling a script")
                continue
            spec = spec_of(specs, [a if i == 0 else "x" for i, a in enumerate(argv)])
            if spec.movable:
                problems.append(f"{call}: {argv[0]} finds its keys in its arguments; not checkable here")
                continue
            positions = key_positions(spec, len(argv))
            if cmd in SHARD_CHANNEL_COMMANDS:
                at = SHARD_CHANNEL_COMMANDS[cmd]
                positions = [at] if at is not None else list(range(1, len(argv)))
            spread = [i for i, a in enumerate(argv) if i and re.match(r"unpack\s*\(", a)]
            if spec.first and spread and (spec.last < 0 or max(positions, default=0) >= min(spread)):
                problems.append(f"{call}: keys spread from a table (unpack) cannot be checked")
                continue
            if spec.first and not positions:
                problems.append(f"{call}: no key argument where {argv[0]} takes one")
            for i in positions:
                if i < len(argv) and not _keys_derived(argv[i], keyed):
                    problems.append(f"{call}: key argument {argv[i]!r} is not from KEYS")
    return problems


# Discovery.


def _modeldock_sources() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR.parent).as_posix()


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)


def lua_literals() -> dict[str, list[str]]:
    """Every string literal in modeldock that calls redis.call/pcall, by module path (from the source)."""
    out: dict[str, list[str]] = {}
    for path in _modeldock_sources():
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue  # prose about scripts, not a script
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                    r"redis\s*\.\s*p?call", node.value):
                out.setdefault(_rel(path), []).append(node.value)
    return out


@dataclass(frozen=True)
class FoundScript:
    where: str  # module:name
    text: str


def discover_scripts() -> list[FoundScript]:
    """Every whole script: each module whose source holds a Lua literal is imported, and its module-level
    strings that call redis.call and its Script objects taken; a string inside another (a shared
    prefix) is covered by the larger one."""
    found: dict[str, str] = {}
    for rel in lua_literals():
        module: ModuleType = importlib.import_module(_module_name(PACKAGE_DIR.parent / rel))
        for name, value in vars(module).items():
            if name == "__doc__":
                continue
            text = value if isinstance(value, str) else getattr(value, "text", None) or getattr(value, "script", None)
            if isinstance(text, str) and re.search(r"redis\s*\.\s*p?call", text):
                found.setdefault(text, f"{module.__name__}:{name}")
    whole = [t for t in found if not any(t != other and t in other for other in found)]
    return [FoundScript(found[t], t) for t in whole]


@pytest.mark.timeout(60)
def test_every_script_touches_only_keys_it_declares(specs: dict[str, KeySpec]) -> None:
    scripts = discover_scripts()
    assert len(scripts) >= SCRIPTS_TODAY, [s.where for s in scripts]
    # Every Lua literal anywhere in modeldock (a script inlined in a function too) is in a checked script.
    for rel, literals in lua_literals().items():
        for literal in literals:
            assert any(literal in s.text for s in scripts), f"{rel}: a Lua literal no discovered script holds"
    problems = {s.where: script_violations(s.text, specs) for s in scripts}
    assert {where: p for where, p in problems.items() if p} == {}
    # Every redis.call in them was looked at: each script runs at least one keyed command.
    for s in scripts:
        assert calls_of(_strip_comments(s.text), "redis.call"), s.where


@pytest.mark.timeout(60)
def test_the_exempt_commands_are_keyless_by_the_servers_own_table(specs: dict[str, KeySpec]) -> None:
    # The scripts' keyless commands: TIME, and PUBLISH, whose channel a cluster does not hash (it fans a
    # PUBLISH out to every node). SPUBLISH would be held to KEYS (its shard channel has a slot).
    assert key_positions(spec_of(specs, ["TIME"]), 1) == []
    assert key_positions(spec_of(specs, ["PUBLISH", "ch", "m"]), 3) == []
    assert key_positions(spec_of(specs, ["HMGET", "h", "a", "b"]), 4) == [1]
    assert key_positions(spec_of(specs, ["MSET", "a", "1", "b", "2"]), 5) == [1, 3]
    used = {args[0].strip("'\"").lower() for s in discover_scripts()
            for name in ("redis.call", "redis.pcall") for _, args in calls_of(_strip_comments(s.text), name)}
    keyless = {cmd for cmd in used if spec_of(specs, [cmd]).first == 0}
    assert keyless <= {"time", "publish"}, keyless  # any other keyless command: say here why it is exempt


@pytest.mark.timeout(60)
def test_the_static_checker_catches_undeclared_and_built_keys(specs: dict[str, KeySpec]) -> None:
    good = """
local function prune(z, h) redis.call('ZREM', z, ARGV[1]); return redis.call('HGET', h, '~total') end
for i, key in ipairs(KEYS) do redis.call('ZCARD', key) end
local z, h = KEYS[1], KEYS[2]
prune(z, h)
prune(KEYS[3], KEYS[4])
redis.call('HMGET', KEYS[2], unpack(ARGV))
redis.call('PUBLISH', ARGV[1] .. 'x', 'm')
return redis.call('TIME')
"""
    assert script_violations(good, specs) == []
    bad = {
        "redis.call('GET', ARGV[1])": "not from KEYS",
        "redis.call('GET', 'modeldock:{' .. ARGV[1] .. '}:x')": "not from KEYS",
        "redis.call('GET', KEYS[1] .. ':amt')": "not from KEYS",  # a derived key: undeclared, maybe another slot
        "local k = KEYS[1]\nk = ARGV[1]\nredis.call('GET', k)": "not from KEYS",
        "local function f(k) return redis.call('GET', k) end\nf(KEYS[1])\nf(ARGV[2])": "not from KEYS",
        "for _, k in ipairs(ARGV) do redis.call('DEL', k) end": "not from KEYS",
        "redis.call('MSET', KEYS[1], 1, ARGV[1], 2)": "not from KEYS",
        "redis.call('DEL', unpack(ARGV))": "unpack",
        "redis.call('SPUBLISH', ARGV[1], 'm')": "not from KEYS",
        "local call = redis.call\ncall('GET', ARGV[1])": "aliased",
        "redis.call(ARGV[1], KEYS[1])": "not a string literal",
        "KEYS[1] = ARGV[1]\nredis.call('GET', KEYS[1])": "KEYS is assigned",
        "redis.pcall('SET', ARGV[1], 1)": "not from KEYS",
        "redis.call('EVAL', 'return 1', 0)": "a script calling a script",
    }
    for text, why in bad.items():
        found = script_violations(text, specs)
        assert any(why in p for p in found), (text, found)


# The Python side: which modules talk to Redis, and what they call.


REDIS_USING_MODULES = ("modeldock.redis_client", "modeldock.budgets.redis_batch")


def _talks_to_redis(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("redis", "hiredis") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("redis", "hiredis"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module in REDIS_USING_MODULES:
            return True
    return False


def python_multi_key_calls(sources: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """(module path, method) of every multi-key, pipeline or transaction call in modules that talk to
    Redis, and every `execute_command`/raw command tuple naming such a command."""
    found: set[tuple[str, str]] = set()
    for rel, text in sources:
        if rel.startswith(ADMIN_MODULES):
            continue
        tree = ast.parse(text, rel)
        if not _talks_to_redis(tree):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method = node.func.attr.lower()
                several = len(node.args) >= 2 or any(isinstance(a, ast.Starred) for a in node.args) or any(
                    k.arg in ("store", "dest") for k in node.keywords)
                if method in MULTI_KEY_METHODS and (method not in AMBIGUOUS_METHODS or several):
                    found.add((rel, method))
                if method in ("execute_command", "send_command") and node.args:
                    first = node.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str) and (
                            first.value.lower() in RAW_MULTI_KEY):
                        found.add((rel, first.value.lower()))
            if isinstance(node, ast.Tuple) and node.elts:
                first = node.elts[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and (
                        first.value.lower() in RAW_MULTI_KEY - SCRIPT_COMMANDS):
                    found.add((rel, first.value.lower()))
    return found


@pytest.mark.timeout(60)
def test_no_python_code_sends_a_multi_key_command_or_a_pipeline() -> None:
    sources = [(_rel(p), p.read_text()) for p in _modeldock_sources()]
    assert sum(_talks_to_redis(ast.parse(t)) for r, t in sources if not r.startswith(ADMIN_MODULES)) >= 5
    # The scripts' own calls (evalsha with keys) go through Script objects checked above and below;
    # redis_batch writes raw ("EVALSHA", sha, numkeys, *keys, ...) tuples, checked by the dynamic half.
    found = {(r, m) for r, m in python_multi_key_calls(sources) if m not in SCRIPT_COMMANDS}
    assert found == MULTI_KEY_ALLOWED
    # Self-check: the scan sees them.
    planted = ("modeldock/x.py", "import redis\nasync def f(c):\n    await c.mget('a', 'b')\n    c.delete('a')\n"
               "    p = c.pipeline()\n    await c.execute_command('DEL', 'a', 'b')\n    w = ('MSET', 'a', 1)\n")
    got = python_multi_key_calls([planted])
    assert got == {("modeldock/x.py", m) for m in ("mget", "pipeline", "del", "mset")}
    # A module that does not talk to Redis (pathlib's unlink, a web router's delete) is not scanned.
    assert python_multi_key_calls([("modeldock/y.py", "def f(p):\n    p.unlink()\n")]) == set()
    assert python_multi_key_calls([("modeldock/z.py", "import redis\ndef f(p, c):\n    p.exists()\n"
                                   "    c.delete(*keys)\n")]) == {("modeldock/z.py", "delete")}


# ---------------------------------------------------------------------------------------------------
# Dynamic: what the server receives.


@dataclass
class Command:
    source: str  # "lua", or the client's address
    argv: list[str]
    inner: list[Command] = field(default_factory=list)  # a script's: the commands it ran


_LINE = re.compile(rb"^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$", re.S)
_ESCAPES = {ord("n"): "\n", ord("r"): "\r", ord("t"): "\t", ord("a"): "\a", ord("b"): "\b",
            ord('"'): '"', ord("\\"): "\\"}


def parse_monitor_line(line: bytes) -> tuple[str, list[str]]:
    """A MONITOR line's source and arguments (Redis quotes each with sdscatrepr: \\" \\\\ \\n \\xHH ...).
    Non-UTF-8 bytes come back as surrogates, so the keys' bytes are kept."""
    m = _LINE.match(line)
    assert m, line
    source, rest = m.group(1).decode(), m.group(2)
    args: list[str] = []
    i = 0
    while i < len(rest):
        if rest[i : i + 1] == b" ":
            i += 1
            continue
        assert rest[i : i + 1] == b'"', rest[i:]
        i += 1
        buf = bytearray()
        while rest[i : i + 1] != b'"':
            c = rest[i]
            if c == ord("\\"):
                nxt = rest[i + 1]
                if nxt == ord("x"):
                    buf.append(int(rest[i + 2 : i + 4], 16))
                    i += 4
                    continue
                buf.extend(_ESCAPES.get(nxt, chr(nxt)).encode())
                i += 2
                continue
            buf.append(c)
            i += 1
        i += 1
        args.append(buf.decode("utf-8", "surrogateescape"))
    return source, args


class Recorder:
    """MONITOR on a connection of its own; `stop` returns what the server received, each script's inner
    commands attached to it. It knows the end without waiting on a clock: it sends a marker ECHO and
    reads up to it. Which side of its script a server logs inner commands on (Redis 7.0: after) is
    learned from a probe script at the start."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self._marker = f"modeldock-slots-{uuid.uuid4().hex}"
        self._lines: list[bytes] = []
        self._monitor: Connection | None = None
        self._control: Connection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._done = asyncio.Event()

    async def start(self) -> None:
        self._monitor = await _connect(self.server)
        assert await _raw(self._monitor, "MONITOR") == b"OK"
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._control = await _connect(self.server)
        await _raw(self._control, "EVAL", "return redis.call('EXISTS', KEYS[1])", 1, self._marker + ":probe")

    async def _read(self) -> None:
        assert self._monitor is not None
        while True:
            line = await self._monitor.read_response(disable_decoding=True, timeout=None)
            assert isinstance(line, bytes), line
            self._lines.append(line)
            if self._marker.encode() + b':end"' in line:
                self._done.set()
                return

    async def stop(self) -> list[Command]:
        assert self._control is not None and self._monitor is not None and self._reader is not None
        try:
            await _raw(self._control, "ECHO", self._marker + ":end")
            async with asyncio.timeout(10):
                await self._done.wait()
                await self._reader
        finally:
            self._reader.cancel()
            await self._monitor.disconnect()
            await self._control.disconnect()
        return self._group([parse_monitor_line(line) for line in self._lines])

    def _group(self, lines: list[tuple[str, list[str]]]) -> list[Command]:
        probe = next(i for i, (_, argv) in enumerate(lines) if argv[:1] == ["EVAL"] and self._marker in argv[-1])
        after = lines[probe + 1][0] == "lua"
        assert after or lines[probe - 1][0] == "lua", "the probe script's EXISTS is not next to it"
        commands: list[Command] = []
        pending: list[Command] = []  # inner commands logged before their script
        for source, argv in lines:
            if any(self._marker in a for a in argv):
                continue  # the recorder's own probe and marker
            cmd = Command(source, argv)
            if source == "lua":
                if after:
                    assert commands and commands[-1].argv[0].lower() in SCRIPT_COMMANDS, argv
                    commands[-1].inner.append(cmd)
                else:
                    pending.append(cmd)
                continue
            if cmd.argv[0].lower() in SCRIPT_COMMANDS and not after:
                cmd.inner, pending = pending, []
            assert not pending, f"script commands with no script: {pending}"
            commands.append(cmd)
        return commands


async def keys_of(conn: Connection, specs: dict[str, KeySpec], argv: Sequence[str]) -> list[str]:
    """The keys of one command, by the server's own reckoning (COMMAND GETKEYS when they are found by
    reading the arguments)."""
    spec = spec_of(specs, argv)
    cmd = argv[0].lower()
    if cmd in SHARD_CHANNEL_COMMANDS:
        at = SHARD_CHANNEL_COMMANDS[cmd]
        return [argv[at]] if at is not None else list(argv[1:])
    if spec.first == 0 and not spec.movable:
        return []
    if not spec.movable:
        return [argv[i] for i in key_positions(spec, len(argv))]
    try:
        reply = await _raw(conn, "COMMAND", "GETKEYS", *(a.encode("utf-8", "surrogateescape") for a in argv))
    except ResponseError as exc:
        if "no key arguments" in str(exc):
            return []
        raise
    return [bytes(k).decode("utf-8", "surrogateescape") for k in reply]


def slot(key: str) -> int:
    return key_slot(key.encode("utf-8", "surrogateescape"))


def hash_tag(key: str) -> str | None:
    """The part of `key` Redis Cluster hashes when it has one ({...}, first brace, non-empty), else None."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if start >= 0 and end > start + 1 else None


@dataclass
class SlotReport:
    violations: list[str] = field(default_factory=list)
    scripts: int = 0  # EVAL/EVALSHA runs checked
    keyed: int = 0  # other commands with keys checked
    tags: dict[str, set[str]] = field(default_factory=dict)  # hash tag -> keys seen with it


async def check_slots(conn: Connection, specs: dict[str, KeySpec], commands: Sequence[Command]) -> SlotReport:
    report = SlotReport()
    transactions: dict[str, list[str]] = {}  # client -> keys since its MULTI

    def note(keys: Iterable[str]) -> None:
        for key in keys:
            report.tags.setdefault(hash_tag(key) or "", set()).add(key)

    for cmd in commands:
        name = cmd.argv[0].lower()
        keys = await keys_of(conn, specs, cmd.argv)
        note(keys)
        if name in SCRIPT_COMMANDS:
            report.scripts += 1
            declared = set(keys)
            touched: list[str] = []
            for inner in cmd.inner:
                inner_keys = await keys_of(conn, specs, inner.argv)
                touched.extend(inner_keys)
                note(inner_keys)
                undeclared = [k for k in inner_keys if k not in declared]
                if undeclared:
                    report.violations.append(f"{cmd.argv[:2]} ran {inner.argv[:3]}: keys not in KEYS {undeclared}")
            if len({slot(k) for k in keys}) > 1:
                report.violations.append(f"{cmd.argv[0]} declares keys of several slots: {keys}")
        elif name == "multi":
            transactions[cmd.source] = []
        elif name in ("exec", "discard"):
            keys = transactions.pop(cmd.source, [])
            if len({slot(k) for k in keys}) > 1:
                report.violations.append(f"a MULTI..EXEC of {cmd.source} crosses slots: {keys}")
        else:
            if cmd.inner:
                report.violations.append(f"{cmd.argv[0]} has inner commands")
            if keys:
                report.keyed += 1
            if cmd.source in transactions:
                transactions[cmd.source].extend(keys)
            if len({slot(k) for k in keys}) > 1:
                report.violations.append(f"{cmd.argv[0]} crosses slots: {keys}")
    return report


@pytest_asyncio.fixture
async def control(redis_server: RedisServer) -> AsyncIterator[Connection]:
    conn = await _connect(redis_server)
    try:
        yield conn
    finally:
        await conn.disconnect()


@pytest_asyncio.fixture
async def recorded(redis_server: RedisServer) -> AsyncIterator[Recorder]:
    recorder = Recorder(redis_server)
    await recorder.start()
    try:
        yield recorder
    finally:
        if recorder._reader is not None and not recorder._reader.done():
            await recorder.stop()


TENANTS = ("acme", "globex")  # hash to different slots: two tenants, two nodes' worth of keys
PRICE = PriceConfig(input=2.0, cached_input=0.5, output=8.0)


async def run_admission(server: RedisServer) -> None:
    """Both tenants through the shared sliding window: a tenant limit and a per-model limit, in one script."""
    tenants = [tenant(t, rpm=5, per_model={"m": 3, "big": 4}, max_in_flight=0) for t in TENANTS]
    cfg = config(*tenants, redis_url=server.url, redis_timeout_ms=3000)
    replicas = [Admission(cfg, FakeClock()), Admission(cfg, FakeClock(start=5000.0))]
    try:
        for t in tenants:
            for model in ("m", "big", "big-alias", "other", "m", "m"):
                for replica in replicas:
                    try:
                        (await replica.admit(t, model)).release()
                    except Exception as exc:  # refused when a window is full: still a script call
                        assert type(exc).__name__ == "RateLimited", exc
    finally:
        for replica in replicas:
            await replica.close()


async def run_budgets(server: RedisServer) -> None:
    """Both tenants' token budgets: a minute, a per-model minute, a day and a month, a cost budget; one
    replica with leases and one reserving every request; reserve, settle, finish, refund, charge, close."""
    tenants = [budget_tenant(t, tpm=50_000, tpd=200_000, per_model={"m": 20_000}, tokens_per_month=1_000_000,
                             cost_per_month=5.0) for t in TENANTS]
    clock = FakeClock()
    leased = TokenBudgets(budget_config(*tenants, price=PRICE, redis_url=server.url, redis_timeout_ms=3000),
                          clock, redis_now_us=clocked(clock))
    direct = TokenBudgets(budget_config(*tenants, price=PRICE, redis_url=server.url, redis_timeout_ms=3000,
                                        token_lease_ms=0), clock, redis_now_us=clocked(clock))
    price = model_price(budget_config(*tenants, price=PRICE).models[0])
    try:
        for t in tenants:
            for budgets in (leased, direct):
                n = id(budgets)
                a = await budgets.reserve(t, "m", f"{t.id}-{n}-a", prompt=100, output=200)
                b = await budgets.reserve(t, "llama-8b", f"{t.id}-{n}-b", prompt=50, output=50)
                c = await budgets.reserve(t, "m", f"{t.id}-{n}-c", prompt=10, output=10, price=price)
                d = await budgets.reserve(t, "m", 30, f"{t.id}-{n}-d")
                await a.settle(Usage(90, 120))
                b.finish_nowait(sent=True, usage=None)
                await c.refund()
                await d.charge_reserved()
                e = await budgets.reserve(t, "m", f"{t.id}-{n}-e", prompt=5, output=5)
                e.refund_nowait()
                clock.advance(61)  # a minute later: the windows prune
                await budgets.flush()
    finally:
        await leased.close()
        await direct.close()


async def run_sharing(server: RedisServer) -> None:
    """Three replicas exchange, one listens to its pushes, one leaves."""
    stores = [RedisShareStore(make_redis_client(server.url, 2.0)) for _ in range(3)]
    pushes = cast(AsyncGenerator[tuple[str, bytes], None], stores[0].pushes("r0"))  # an async generator
    try:
        await stores[0].exchange("r0", b"zero", 60_000)
        listening = asyncio.ensure_future(anext(pushes))
        await stores[1].exchange("r1", b"one", 60_000)
        await stores[2].exchange("r2", b"two\x00|binary", 60_000, read=False)
        async with asyncio.timeout(10):
            assert (await listening)[0] in ("r1", "r2")
        await stores[1].leave("r1")
        await stores[0].exchange("r0", b"zero again", 60_000)
    finally:
        await pushes.aclose()
        for store in stores:
            await store.close()


@pytest.mark.timeout(90)
async def test_every_call_the_gateway_makes_stays_in_one_slot(
    redis_server: RedisServer, recorded: Recorder, control: Connection, specs: dict[str, KeySpec],
) -> None:
    await run_admission(redis_server)
    await run_budgets(redis_server)
    await run_sharing(redis_server)
    commands = await recorded.stop()
    report = await check_slots(control, specs, commands)
    assert report.violations == []
    scripts = {c.argv[1] for c in commands if c.argv[0].lower() == "evalsha"}
    shas = {redis_batch.Script(s.text).sha for s in discover_scripts()}
    assert scripts == shas, "every discovered script ran (and nothing else)"  # all five: the window, reserve,
    assert report.scripts >= 50  # settle, exchange, leave
    # Every script run declared keys and ran commands (checked above against them). One that ran none
    # is an EVALSHA refused NOSCRIPT (the server logs it too): its script is loaded after it, then sent again.
    for i, cmd in enumerate(commands):
        if cmd.argv[0].lower() in SCRIPT_COMMANDS:
            assert int(cmd.argv[2]) >= 1, cmd.argv[:3]
            assert cmd.inner or any(
                later.argv[:2] == ["SCRIPT", "LOAD"] and redis_batch.Script(later.argv[2]).sha == cmd.argv[1]
                for later in commands[i + 1 :]), cmd.argv[:3]
    # The hash tag of every tenant key is the tenant, so two tenants are two slots; the sharing store's
    # one hash is tagged {load}: every replica's exchange lands on the one node holding that slot.
    assert set(report.tags) == {*TENANTS, "load"}, set(report.tags)
    assert slot("{acme}") != slot("{globex}")
    for t in TENANTS:
        assert report.tags[t] >= {f"modeldock:rl:{{{t}}}:all", f"modeldock:tb:{{{t}}}:minute"}
        assert all(f"{{{t}}}" in key for key in report.tags[t])
    assert report.tags["load"] == {SHARE_KEY}
    assert hash_tag(SHARE_KEY) == "load"


@pytest.mark.timeout(60)
async def test_the_dynamic_checker_catches_cross_slot_and_undeclared_keys(
    recorded: Recorder, control: Connection, specs: dict[str, KeySpec],
) -> None:
    async def send(*args: object) -> None:
        await _raw(control, *args)

    # Run through the recorder like the gateway's calls: a script whose keys span two slots, one that
    # writes a key it did not declare, a cross-slot DEL, and a MULTI..EXEC across tenants.
    await send("EVAL", "return redis.call('SET', KEYS[2], 1)", 2, "a:{acme}", "a:{globex}")
    await send("EVAL", "return redis.call('SET', ARGV[1], 1)", 1, "b:{acme}", "b:{acme}:other")
    await send("EVAL", "return redis.call('SET', KEYS[1] .. ':amt', 1)", 1, "c:{acme}")
    await send("DEL", "d:{acme}", "d:{globex}")
    await send("MULTI")
    await send("SET", "e:{acme}", 1)
    await send("SET", "e:{globex}", 1)
    await send("EXEC")
    await send("EVAL", "return redis.call('SET', KEYS[1], ARGV[1])", 1, "ok:{acme}", "fine")  # clean
    report = await check_slots(control, specs, await recorded.stop())
    found = "\n".join(report.violations)
    assert len(report.violations) == 5, found
    assert "declares keys of several slots" in found
    assert "b:{acme}:other" in found and "c:{acme}:amt" in found
    assert "DEL crosses slots" in found
    assert "MULTI..EXEC" in found
    assert report.scripts == 4


@pytest.mark.timeout(30)
def test_monitor_lines_parse_back_to_their_bytes() -> None:
    line = b'1.5 [0 127.0.0.1:5] "EVALSHA" "ab" "1" "k:{t}" "a b\\"\\\\\\x00\\xff\\n"'
    last = 'a b"\\\x00' + b"\xff".decode("utf-8", "surrogateescape") + "\n"
    assert parse_monitor_line(line) == ("127.0.0.1:5", ["EVALSHA", "ab", "1", "k:{t}", last])
    assert parse_monitor_line(b'2.0 [0 lua] "TIME"') == ("lua", ["TIME"])
    assert hash_tag("modeldock:{load}:replicas") == "load"
    assert hash_tag("a{}b{c}") is None and hash_tag("a{b}{c}") == "b"
    assert slot("x{acme}y") == slot("{acme}")
