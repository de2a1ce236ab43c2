"""Prefix affinity: send a prompt where its beginning was sent before.

vLLM keeps the KV blocks of recent prompts (automatic prefix caching), so a prompt
that shares a long beginning with one an endpoint served recently skips most of its
prefill there. The gateway cannot see those caches; it remembers instead which
endpoints it sent each prompt prefix to, in fixed-size blocks of characters, each
block's hash chained to the one before it (so a block only ever matches after
the same beginning). An endpoint's miss fraction is 1 - (leading blocks it has
seen) / (the prompt's blocks): 0 when it saw the whole prompt's beginning, 1
when it saw none. This is an approximation: the server may have evicted blocks,
and characters are not tokens. Load still decides when the preferred endpoint is
busy, because the miss fraction is only one weighted term of the score.

Every replica of the gateway computes the first block's hash alike (blake2b, not
Python's `hash`, which PYTHONHASHSEED salts per process), and `home` ranks the
candidates for it by rendezvous (highest random weight) hashing: a prefix no
replica has a record of goes to the same endpoint whichever replica receives it,
and removing an endpoint moves only the prefixes homed there. The deeper blocks
chain from it with Python's `hash` (cheaper: a table is per process anyway).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from modeldock.types import Endpoint

BLOCK_CHARS = 256  # about 64 tokens of English text
MAX_BLOCKS = 64  # the first 16k characters decide; deeper matches add little
OWNERS_PER_BLOCK = 16  # endpoints remembered per block, most recent last


def _prompt_text(body: Mapping[str, object]) -> str:
    """The text a server would tokenize first: chat messages in order, or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # content parts: keep the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                      and isinstance(p.get("text"), str))
                parts.append(f"{m.get('role', '')}\x1f{content if isinstance(content, str) else ''}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""


def stable_hash(text: str) -> int:
    """64 bits of blake2b over the UTF-8 text: the same in every process and on every machine."""
    data = text.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates: never raise
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_blocks(body: Mapping[str, object]) -> tuple[int, ...]:
    """Chained hashes of the prompt's whole BLOCK_CHARS blocks (a partial last block is left out).
    The first is `stable_hash` of the first block (the prefix's home key, alike in every replica);
    the others chain with Python's hash, a fifth of blake2b's cost per block (measured)."""
    text = _prompt_text(body)
    end = min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1
    if end <= 0:
        return ()
    h = stable_hash(text[:BLOCK_CHARS])
    blocks = [h]
    for start in range(BLOCK_CHARS, end, BLOCK_CHARS):
        h = hash((h, text[start:start + BLOCK_CHARS]))
        blocks.append(h)
    return tuple(blocks)


def endpoint_key(endpoint: Endpoint) -> int:
    """The endpoint's rendezvous key: its address hashed stably (replicas see the same addresses)."""
    return stable_hash(endpoint.address)


_MASK = (1 << 64) - 1


def multipliers(candidates: Iterable[Endpoint], keys: dict[Endpoint, int]) -> list[int]:
    """The candidates' rendezvous multipliers, odd (a bijection of the key); `keys` caches them."""
    out = []
    for ep in candidates:
        k = keys.get(ep)
        if k is None:
            k = keys[ep] = endpoint_key(ep) | 1
        out.append(k)
    return out


def home_index(key: int, mults: Sequence[int]) -> int:
    """Index of the highest rendezvous weight for prefix `key` among `multipliers` (-1 for none)."""
    if not mults:
        return -1
    weights = [(key * m) & _MASK for m in mults]
    return weights.index(max(weights))


def home(key: int, candidates: Sequence[Endpoint], keys: dict[Endpoint, int]) -> Endpoint | None:
    """The candidate of highest rendezvous weight for prefix `key` (blocks[0]), None without candidates.
    `keys` caches each endpoint's multiplier. The weight depends on the key and the endpoint alone, so
    every replica with the same candidates chooses alike, whatever their order (a tie needs two weights
    equal in 64 bits), and removing one moves only its prefixes. The weight is multiplicative hashing,
    key x (endpoint key | 1) mod 2^64, both blake2b: one multiplication, 0.13 µs a candidate where a
    64-bit mixer (splitmix64) cost 0.3; each of 3, 8 or 64 endpoints is home to 0.97-1.05 of its fair
    share of random keys (measured). Python's hash of the pair would be as stable (ints and tuples are
    not salted) and cheap, but piles homes unevenly (0.05-3.5 of the fair share at 64)."""
    i = home_index(key, multipliers(candidates, keys))
    return candidates[i] if i >= 0 else None


class PrefixIndex:
    """Block hash -> the endpoints recently sent a prompt with that block; bounded LRU."""

    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._owners: OrderedDict[int, tuple[Endpoint, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def matched(self, blocks: Sequence[int], candidates: Iterable[Endpoint]) -> dict[Endpoint, int]:
        """How many leading blocks each candidate has seen (candidates with none are left out)."""
        if not blocks:
            return {}
        first = self._owners.get(blocks[0])
        if not first:
            return {}
        wanted = set(candidates)
        alive = {ep for ep in first if ep in wanted}
        counts: dict[Endpoint, int] = {}
        depth = 1
        for block in blocks[1:]:
            if not alive:
                break
            owners = self._owners.get(block, ())
            for ep in [ep for ep in alive if ep not in owners]:
                alive.discard(ep)
                counts[ep] = depth
            depth += 1
        for ep in alive:
            counts[ep] = depth
        return counts

    def record(self, blocks: Sequence[int], endpoint: Endpoint) -> None:
        """`endpoint` now holds (approximately) these blocks."""
        owners_by_block = self._owners
        for block in blocks:
            owners = owners_by_block.pop(block, ())
            if endpoint in owners:
                owners = tuple(ep for ep in owners if ep != endpoint)
            owners_by_block[block] = (*owners[-(OWNERS_PER_BLOCK - 1):], endpoint)
        while len(owners_by_block) > self._capacity:
            owners_by_block.popitem(last=False)

    def forget(self, endpoint: Endpoint) -> None:
        """The endpoint left the snapshot (its cache is gone or unreachable)."""
        for block in [b for b, owners in self._owners.items() if endpoint in owners]:
            kept = tuple(ep for ep in self._owners[block] if ep != endpoint)
            if kept:
                self._owners[block] = kept
            else:
                del self._owners[block]
