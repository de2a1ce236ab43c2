"""A vLLM V1-style engine with no GPU: continuous batching decided at every step.

`step()` runs one iteration: it schedules running sequences first (decodes and
unfinished chunked prefills), then admits waiting ones while the token budget, the
sequence limit and the KV cache allow, and returns the tokens produced and how long
the iteration would have taken on the GPU. Nothing here sleeps or reads a clock; the
driver (driver.py) turns durations into real time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from modeldock.sim.config import SimConfig
from modeldock.sim.kv import BlockPool


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...]
    finish_reason: str  # reported when max_tokens is reached: "length", or "stop" for a natural end
    num_output: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache
    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks already offered to the prefix cache
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output


@dataclass(frozen=True, slots=True)
class TokenOut:
    request_id: str
    index: int  # 0 for a request's first token
    finish_reason: str | None  # set on the request's last token


@dataclass(slots=True)
class StepResult:
    duration_s: float = 0.0  # GPU time of this iteration, before any speed-up
    outputs: list[TokenOut] = field(default_factory=list)
    num_scheduled: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    preempted: list[str] = field(default_factory=list)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    prompt_tokens: int = 0  # prompt tokens of requests that got their first token
    admitted: list[str] = field(default_factory=list)  # left the waiting queue this step
    finished: list[str] = field(default_factory=list)


class Engine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.kv = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.waiting: deque[Sequence] = deque()
        self._by_id: dict[str, Sequence] = {}
        self.sim_time = 0.0  # sum of step durations: the engine's own clock, in GPU seconds
        self.steps = 0
        self.completed = 0
        self.cancelled = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        block_hashes: Seq[int] = (),
        finish_reason: str = "length",
    ) -> None:
        if request_id in self._by_id:
            raise ValueError(f"request {request_id} is already in the engine")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        seq = Sequence(request_id, prompt_tokens, max_tokens, tuple(block_hashes), finish_reason)
        self._by_id[request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request at once and free its blocks; False if it is not in the engine."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.kv.release(seq.blocks)
        seq.blocks = []
        self.cancelled += 1
        return True

    def step(self) -> StepResult:
        result = StepResult()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []

        # 1. Running sequences first, in admission order, so decodes are never starved
        #    by new prefills (vLLM V1). When the cache is full, preempt from the end.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_tokens - seq.num_computed, budget)
            while not self._allocate(seq, count, ()):
                victim = self.running.pop()
                self._preempt(victim)
                result.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, count))
                budget -= count
                index += 1
                continue
            break

        # 2. Admit waiting sequences in FIFO order, but not in a step that had to preempt.
        if not result.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                # Keep at least one token to compute, so the step produces logits (as vLLM).
                usable = (seq.num_tokens - 1) // self.block_size
                hits = self.kv.cached_prefix(seq.block_hashes[:usable])
                computed = len(hits) * self.block_size
                count = min(seq.num_tokens - computed, budget)
                seq.num_computed = computed
                if not self._allocate(seq, count, hits):
                    seq.num_computed = 0
                    break
                self.waiting.popleft()
                self.running.append(seq)
                result.admitted.append(seq.request_id)
                scheduled.append((seq, count))
                budget -= count
                if self.config.enable_prefix_caching:
                    result.prefix_queries += seq.num_tokens
                    result.prefix_hits += computed

        self._run(scheduled, result)
        self.preemptions += len(result.preempted)
        self.prefix_queries += result.prefix_queries
        self.prefix_hits += result.prefix_hits
        return result

    def _allocate(self, seq: Sequence, count: int, hits: Seq[int]) -> bool:
        """Make room for `count` more tokens of `seq` (after its hit blocks, if any)."""
        end = seq.num_computed + count
        if not hits and end <= len(seq.blocks) * self.block_size and seq.num_hashed >= len(seq.block_hashes):
            return True  # the common decode step: room in the last block, nothing to cache
        needed = -(-end // self.block_size) - len(seq.blocks) - len(hits)
        needed = max(needed, 0)
        if not self.kv.can_take(hits, needed):
            return False
        fresh = self.kv.take(hits, needed)
        if hits:
            seq.blocks.extend(hits)
            seq.num_hashed = len(hits)  # already in the cache
        seq.blocks.extend(fresh)
        # Offer the blocks this step fills completely to the prefix cache now, like vLLM,
        # so a request admitted later in the same step can already share them.
        full = min(end // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_hashed, full):
            self.kv.cache(seq.blocks[i], seq.block_hashes[i])
        seq.num_hashed = max(seq.num_hashed, full)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute mode: drop the KV and start over from the front of the queue; the
        # tokens already produced are kept and become part of the prompt to recompute.
        self.kv.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_hashed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _run(self, scheduled: list[tuple[Sequence, int]], result: StepResult) -> None:
        if not scheduled:
            return
        cfg = self.config
        finished = False
        for seq, count in scheduled:
            if seq.num_output > 0 and count == 1 and seq.num_computed == seq.num_tokens - 1:
                result.decode_seqs += 1
            else:
                result.prefill_tokens += count
            seq.num_computed += count
            if seq.num_computed < seq.num_tokens:
                continue  # a chunk of a longer prefill: no token yet
            index = seq.num_output
            seq.num_output += 1
            if index == 0:
                result.prompt_tokens += seq.prompt_tokens
            if seq.num_output >= seq.max_tokens:
                result.outputs.append(TokenOut(seq.request_id, index, seq.finish_reason))
                result.finished.append(seq.request_id)
                self._finish(seq)
                finished = True
            else:
                result.outputs.append(TokenOut(seq.request_id, index, None))
        if finished:
            self.running = [s for s in self.running if s.request_id in self._by_id]
        result.num_scheduled = len(scheduled)
        result.duration_s = (
            cfg.step_base_ms + cfg.prefill_token_ms * result.prefill_tokens + cfg.decode_seq_ms * result.decode_seqs
        ) / 1000.0
        self.sim_time += result.duration_s
        self.steps += 1

    def _finish(self, seq: Sequence) -> None:
        del self._by_id[seq.request_id]
        self.kv.release(seq.blocks)
        seq.blocks = []
        self.completed += 1
