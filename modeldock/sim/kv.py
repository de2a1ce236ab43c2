"""The paged KV cache: fixed-size blocks, reference counts and a prefix cache, as in vLLM V1.

A block whose reference count drops to zero goes to the back of the free queue but keeps
its hash, so a later request with the same prefix can take it back (a cache hit).
Allocation takes blocks from the front of the free queue, which makes the free queue
the LRU order for eviction of cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Blocks nobody references, oldest-freed first; values unused. Popping the front
        # and deleting from the middle are both O(1).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out, including cached blocks nobody references."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, as vllm:kv_cache_usage_perc."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes`."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def can_take(self, hit_blocks: Sequence[int], new_blocks: int) -> bool:
        # Hit blocks nobody references sit in the free queue; taking them shrinks it.
        idle_hits = sum(1 for b in hit_blocks if self._refs[b] == 0)
        return new_blocks <= len(self._free) - idle_hits

    def take(self, hit_blocks: Sequence[int], new_blocks: int) -> list[int]:
        """Reference the hit blocks and allocate new ones; call can_take first."""
        for block in hit_blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        fresh: list[int] = []
        for _ in range(new_blocks):
            block, _unused = self._free.popitem(last=False)
            evicted = self._hash_of[block]
            if evicted is not None:
                # Evict: this block's old contents are about to be overwritten.
                self._hash_of[block] = None
                if self._cached.get(evicted) == block:
                    del self._cached[evicted]
            self._refs[block] = 1
            fresh.append(block)
        return fresh

    def cache(self, block: int, block_hash: int) -> None:
        """Record that `block` now holds the full block whose chained hash is `block_hash`."""
        if not self.enable_caching or block_hash in self._cached:
            # Another sequence computed the same block first; this copy stays uncached.
            return
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash

    def release(self, blocks: Sequence[int]) -> None:
        # In reverse, so a sequence's tail blocks are evicted before its head (its prefix
        # is the part most likely shared), as vLLM does.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
