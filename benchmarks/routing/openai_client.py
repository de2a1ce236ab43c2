"""An independent client for the cross-check: the `openai` SDK's streaming API, in its own process.

It shares no code with modeldock.bench (no SSE parser, no record type, no aiohttp): the SDK sends
with httpx and parses the stream itself. It reads a plan (JSON) and writes the results (JSON):

    python benchmarks/routing/openai_client.py PLAN.json OUT.json

PLAN: {"url", "model", "token", "start_unix", "speed", "timeout", "requests": [{"index", "at",
"messages", "max_tokens"}, ...]}. OUT: {"results": [{"index", "ttft", "e2e", "error", "late"}, ...],
"cpu_s": CPU seconds after the imports, "chunks": stream chunks received}. Request i is sent at
start_unix + at / speed (wall clock, so two processes can share one schedule). TTFT = first
chunk whose `choices[0].delta.content` is non-empty − the moment just before `create()` is
called; E2E = the end of the stream (the SDK stops at `[DONE]`) − the same moment. Both are
perf_counter() readings. A request that raised is reported by kind (HTTP status, timeout,
transport, or the exception's type), with no times.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from time import perf_counter
from typing import Any

import openai

CHUNKS = 0  # stream chunks received, for the CPU-per-chunk figure


async def one(
    client: openai.AsyncOpenAI, model: str, req: dict[str, Any], start: float, speed: float
) -> dict[str, Any]:
    global CHUNKS
    delay = start + req["at"] / speed - perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    out: dict[str, Any] = {"index": req["index"], "ttft": None, "e2e": None, "error": None}
    sent = perf_counter()
    out["late"] = sent - (start + req["at"] / speed)
    try:
        stream = await client.chat.completions.create(model=model, messages=req["messages"],
                                                      max_tokens=req["max_tokens"], stream=True)
        first = None
        async for chunk in stream:
            CHUNKS += 1
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = perf_counter()
        end = perf_counter()
        if first is None:
            out["error"] = "empty"
        else:
            out["ttft"], out["e2e"] = first - sent, end - sent
    except openai.APIStatusError as exc:
        out["error"] = str(exc.status_code)
    except openai.APITimeoutError:
        out["error"] = "timeout"
    except openai.APIConnectionError:
        out["error"] = "transport"
    except Exception as exc:  # noqa: BLE001 - report anything else by its type
        out["error"] = type(exc).__name__
    return out


async def main(plan: dict[str, Any]) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=plan["url"], api_key=plan["token"] or "none", max_retries=0,
                                timeout=plan["timeout"])
    # Convert the shared wall-clock start into this process's perf_counter() scale.
    start = perf_counter() + (plan["start_unix"] - time.time())
    async with client:
        return list(await asyncio.gather(*(one(client, plan["model"], r, start, plan["speed"])
                                           for r in plan["requests"])))


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        plan = json.load(handle)
    cpu = time.process_time()  # after the imports
    results = asyncio.run(main(plan))
    cpu = time.process_time() - cpu
    with open(sys.argv[2], "w") as handle:
        json.dump({"results": results, "cpu_s": cpu, "chunks": CHUNKS}, handle)
