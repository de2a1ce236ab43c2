"""Two whole gateway replicas (each its own xDS, ext_proc and Envoy) in front of one backend, sharing
load state through a real Redis, with the openai SDK as the client: together they never run the
backend past its declared slots; a replica SIGKILLed mid-request is forgotten within the TTL and the
survivor uses the room it held; with Redis stopped every request is still served on the local view,
and the shared view comes back when Redis does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeldock.devstack.stack import Replicas, Stack, replica_stacks, wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e

SLOTS = 2
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Replicas]:
    def edit(data: dict[str, Any], _sims: object) -> None:
        data["tenants"][0]["max_in_flight"] = 32
        data["queue"] = {"ttl_seconds": 20, "retry_after_seconds": 1}
        # Pages far apart (stale after 4 s): between two pages only the shared holdings tell a replica
        # what the other sent.
        data["routing"] = {"scrape": {"interval_seconds": 3.0}, "stale_after_seconds": 4.0}
        data["models"][0]["max_num_seqs"] = SLOTS
        data["sharing"] = {"interval_ms": 100, "ttl_ms": 2000}

    run_dir: Path = tmp_path_factory.mktemp("replicas")
    # One backend with 256 tokens of KV at half speed (~12 ms a token).
    sim_args = ("--speed", "0.5", "--num-gpu-blocks", "16", "--block-size", "16", "--max-model-len", "256")
    with replica_stacks(run_dir, replicas=2, backends=1, sim_args=sim_args, edit_config=edit,
                        redis_url=redis.url) as replicas:
        for s in replicas.stacks:
            wait_until(lambda s=s: s.metric("modeldock_sharing_peers") == 1, 20, what="each replica sees its peer")
        yield replicas


class Stream(threading.Thread):
    def __init__(self, stack: Stack, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = stack.openai(timeout=30)
        self.max_tokens = max_tokens
        self.chunks = 0
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(model="demo-model", messages=MSG, stream=True,
                                                         max_tokens=self.max_tokens)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.chunks += 1
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            self.error = exc


class Peak(threading.Thread):
    """The most sequences the backend ran, and had waiting, at once (its own stats, every 20 ms)."""

    def __init__(self, replicas: Replicas) -> None:
        super().__init__(daemon=True)
        self.sim = replicas.sims[0]
        self.running = self.waiting = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            stats = self.sim.stats()
            self.running = max(self.running, int(stats["running"]))
            self.waiting = max(self.waiting, int(stats["waiting"]))
            time.sleep(0.02)


def _idle(replicas: Replicas) -> bool:
    return all(s.in_flight() == 0 and s.metric("modeldock_sharing_peer_in_flight") == 0 for s in replicas.stacks
               if s.sup.exited() is None)


def test_two_replicas_together_never_run_the_backend_past_its_slots(pool: Replicas) -> None:
    peak = Peak(pool)
    peak.start()
    streams = []
    try:
        for i in range(8):  # alternating replicas, 0.3 s apart: more than one exchange, less than a page
            stream = Stream(pool.stacks[i % 2], max_tokens=60)
            stream.start()
            streams.append(stream)
            time.sleep(0.3)
        for stream in streams:
            stream.join(60)
    finally:
        peak.done.set()
        peak.join(5)
    assert [s.error for s in streams] == [None] * 8 and all(s.chunks == 60 for s in streams)
    assert peak.running <= SLOTS, (peak.running, peak.waiting)
    # Both replicas queued some of them: the room was the pool's, not each replica's.
    assert all(s.metric("modeldock_queue_dispatched_total") > 0 for s in pool.stacks)
    wait_until(lambda: _idle(pool), 10, what="every count back to 0 on both replicas")


def test_redis_stopped_serves_on_the_local_view_and_shares_again_when_it_returns(pool: Replicas,
                                                                                redis: RedisServer) -> None:
    redis.stop()
    try:
        wait_until(lambda: all(s.metric("modeldock_sharing_shared") == 0 for s in pool.stacks), 10,
                   what="both replicas on the local view")
        for stack in pool.stacks:  # no request fails for Redis (limits.redis_fail_open decides the windows)
            reply = stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=5)
            assert reply.choices[0].message.content
    finally:
        redis.start()
    started = time.monotonic()
    wait_until(lambda: all(s.metric("modeldock_sharing_shared") == 1 and s.metric("modeldock_sharing_peers") == 1
                           for s in pool.stacks), 10, what="shared again")
    assert time.monotonic() - started < 2.5
    wait_until(lambda: _idle(pool), 10, what="every count back to 0")


def test_a_replica_killed_mid_request_is_forgotten_and_the_survivor_uses_its_room(pool: Replicas) -> None:
    survivor, doomed = pool.stacks
    held = Stream(doomed, max_tokens=180)  # most of the backend's 256 tokens of KV
    held.start()
    wait_until(lambda: survivor.metric("modeldock_sharing_peer_committed_tokens") > 150, 10,
               what="the survivor counts the doomed replica's request")
    waiting = Stream(survivor, max_tokens=120)  # does not fit beside it: queued on the survivor
    waiting.start()
    wait_until(lambda: survivor.metric("modeldock_queue_length") == 1, 5, what="queued behind the peer's request")
    doomed.kill()  # SIGKILL: ext_proc and Envoy; the held request's stream is cut, nobody releases it
    killed_at = time.monotonic()
    waiting.join(30)
    assert waiting.error is None and waiting.chunks == 120
    wait_until(lambda: survivor.metric("modeldock_sharing_peers") == 0, 5, what="the dead replica forgotten")
    assert time.monotonic() - killed_at < 5
    assert held.error is not None  # its client saw the replica die
    wait_until(lambda: survivor.in_flight() == 0 and survivor.metric("modeldock_sharing_peer_in_flight") == 0, 10,
               what="nothing left counted on the survivor")
