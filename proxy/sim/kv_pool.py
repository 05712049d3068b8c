"""The KV pool (page size 1): who holds its tokens, and what is free.

    used      = prefix-cache tokens + private tokens
    available = pool - used                 (never counting the cache's unlocked part as free)
    free      = available + evictable       (what admission and retraction may count on)

Private tokens are the KV a request owns outside the prefix cache: its computed-but-not-inserted
chunks while it prefills (*held* here), and, once it runs, its decode tokens and any uncached
prefill (summed lazily by the :class:`~proxy.sim.running.RunningBatch`). A finished prefill chunk
moves into the cache (:meth:`KvPool.cache_chunk`), locked by its request until it is released;
what is allocated beyond ``available`` evicts least recently used cache leaves.
"""

from __future__ import annotations

from proxy.sim.radix import NoPrefixCache, RadixCache
from proxy.sim.request import Req
from proxy.sim.running import RunningBatch


class KvPool:
    __slots__ = ("cache", "held", "running", "size")

    def __init__(self, size: int, cache: RadixCache | NoPrefixCache, running: RunningBatch) -> None:
        self.size = size
        self.cache = cache
        self.running = running
        self.held = 0  # private KV of requests not running: prefills in flight, chunks between steps

    @property
    def private_tokens(self) -> int:
        return self.held + self.running.private_tokens

    @property
    def available(self) -> int:
        return self.size - self.cache.total_size - self.held - self.running.private_tokens  # hot: inlined

    @property
    def free(self) -> int:
        cache = self.cache  # hot (every decode step): the sums inlined
        return self.size - cache.total_size - self.held - self.running.private_tokens + cache.evictable_size

    @property
    def num_used(self) -> int:
        cache = self.cache  # = size - available - evictable, inlined
        return cache.total_size + self.held + self.running.private_tokens - cache.evictable_size

    @property
    def usage(self) -> float:
        return self.num_used / self.size

    def allocate(self, tokens: int) -> None:
        """Make room for ``tokens`` more: evict from the cache what ``available`` lacks."""
        short = tokens - self.available
        if short > 0:
            self.cache.evict(short)

    def hold(self, r: Req, tokens: int) -> None:
        """``tokens`` allocated KV become ``r``'s private KV (a prefill chunk in flight)."""
        r.private_base += tokens
        self.held += tokens

    def cache_chunk(self, r: Req, take: int) -> None:
        """``r``'s computed prefix (``take`` tokens of it new) goes into the prefix cache, locked by ``r``
        (its previous node unlocked)."""
        cache = self.cache
        if not isinstance(cache, RadixCache):
            return  # --disable-radix-cache: the chunk stays private
        _, node = cache.insert(r.fill_ids[: r.prefilled])
        cache.lock(node)
        if r.node is not None:
            cache.unlock(r.node)
        r.node = node
        r.private_base -= take
        self.held -= take

    def start_running(self, r: Req) -> None:
        """``r`` joins the running batch: its private KV is counted there from now on."""
        self.held -= r.private_base
        self.running.join(r)

    def stop_running(self, r: Req) -> None:
        """``r`` leaves the running batch: its private KV (decode tokens included) is held here until released."""
        self.running.leave(r)
        self.held += r.private_base

    def release(self, r: Req) -> None:
        """Free ``r``'s private KV and unlock its cached prefix."""
        self.held -= r.private_base
        r.private_base = 0
        if r.node is not None:
            self.cache.unlock(r.node)
            r.node = None
