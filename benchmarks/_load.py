"""The benchmarks' closed-loop client: a batch of chat completions through one or more front doors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from modeldock.devstack.stack import API_KEY


async def load(urls: str | Sequence[str], count: int, concurrency: int, *, token: str | None = API_KEY,
               stream_chunks: int = 0, deadline: float = 300) -> tuple[int, int]:
    """`count` chat completions, `concurrency` at a time; (completed, errors).

    `urls` are `.../v1` base URLs; with several, request i goes to `urls[i % len(urls)]` (round robin).
    Non-streaming requests ask for one token; with `stream_chunks`, each request streams that many
    content chunks (`ignore_eos`) and one that brings fewer counts as an error. Without `token`, no
    Authorization header (a bare Envoy). The batch fails (TimeoutError) after `deadline` seconds."""
    targets = [urls] if isinstance(urls, str) else list(urls)
    stream = stream_chunks > 0
    body: dict[str, object] = {"model": "demo-model", "messages": [{"role": "user", "content": "hello there"}],
                               "max_tokens": stream_chunks if stream else 1}
    if stream:
        body.update(stream=True, ignore_eos=True)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    done = errors = 0
    sent = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors, sent
        while sent < count:
            url = targets[sent % len(targets)]
            sent += 1
            try:
                async with session.post(f"{url}/chat/completions", json=body, headers=headers) as resp:
                    if resp.status != 200 or not stream:
                        await resp.read()
                    elif sum([1 async for line in resp.content if line.startswith(b"data: {")]) < stream_chunks:
                        errors += 1
                        continue
                    if resp.status == 200:
                        done += 1
                    else:
                        errors += 1
            except (TimeoutError, aiohttp.ClientError):
                errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.wait_for(asyncio.gather(*(worker(session) for _ in range(concurrency))), deadline)
    return done, errors
