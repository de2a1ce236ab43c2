"""What `modeldock bench` talks to: the API base URL and endpoint from what the user typed, and
the model to use when none was given (the first one the server lists)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp

DEFAULT_URL = "http://127.0.0.1:8080/v1"  # where `modeldock up` listens
_SUFFIXES: tuple[tuple[str, Literal["chat", "completions"]], ...] = (
    ("/chat/completions", "chat"),
    ("/completions", "completions"),
)


def resolve_url(url: str, endpoint: str | None) -> tuple[str, Literal["chat", "completions"]]:
    """(base URL, endpoint) from a base URL (`http://h:8080/v1`), a bare server (`http://h:8080`,
    `/v1` is added) or a full endpoint URL (`http://h:8080/v1/chat/completions`)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must be an http(s) URL such as {DEFAULT_URL}, got {url!r}")
    path = parts.path.rstrip("/")
    found: Literal["chat", "completions"] | None = None
    for suffix, kind in _SUFFIXES:
        if path.endswith(suffix):
            path, found = path[: -len(suffix)], kind
            break
    if found is not None and endpoint is not None and endpoint != found:
        raise ValueError(f"--url names the {found} endpoint but --endpoint is {endpoint}")
    if not path:
        path = "/v1"
    chosen: Literal["chat", "completions"] = found or ("completions" if endpoint == "completions" else "chat")
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), chosen


async def first_model(base_url: str, token: str | None, timeout: float) -> tuple[str, int]:
    """The first model `GET {base_url}/models` lists, and how many it lists. ValueError says why not."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = base_url.rstrip("/") + "/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url, headers=headers) as response:
                text = await response.text()
                if response.status != 200:
                    raise ValueError(f"GET {url} answered {response.status}: {text[:200]}; pass --model")
                data = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ValueError(f"cannot list models at {url} ({type(exc).__name__}: {exc}); pass --model") from None
    models = data.get("data") if isinstance(data, dict) else None
    ids = [m["id"] for m in models or () if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not ids:
        raise ValueError(f"GET {url} lists no models; pass --model")
    return ids[0], len(ids)
