"""Admission of waiting requests into a prefill batch, after SGLang's ``PrefillAdder``.

Budget: ``rem_total = free + evictable - offset``, the offset starting with what the running batch
is expected still to need (each request's remaining ``max_new_tokens``, clipped at 4096, times
``new_token_ratio``; times 1 with ``ignore_eos``). In queue order:

* the chunked request (if any) continues first; while it has chunks left nothing else is added;
* a request needs ``extend + clipped max_new_tokens + 1 < rem_total``, else the batch is *full*
  (no new prefill until a request leaves the running batch);
* ``max_running_requests`` slots; ``--max-prefill-tokens`` input per batch (the first request
  always allowed); with chunked prefill a request larger than the chunk budget left is cut to it
  and becomes the one chunked request, reserving no output tokens yet;
* on admission it reserves ``extend + clipped max_new_tokens + 1`` and locks its cached prefix.

One guard of our own: with nothing running, the head of the queue is admitted if its prompt fits
the pool at all, so an oversized ``max_new_tokens`` cannot stall an idle server.

:func:`admit` only decides (the prefix locks aside); the scheduler takes the admitted requests off
the queue and the engine starts their prefill (:class:`AdmitItem` says where each starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.sim.config import SimConfig
from proxy.sim.kv_pool import KvPool
from proxy.sim.radix import Node
from proxy.sim.ratio import CLIP_MAX_NEW_TOKENS
from proxy.sim.request import Req


@dataclass(frozen=True, slots=True)
class AdmitItem:
    req: Req
    take: int  # tokens computed in this step
    prefix_len: int  # tokens already in KV before this step
    last: bool  # the prefill of this request completes with this step
    hit: int = 0  # cached prefix tokens found at admission (0 for a continuing chunk)
    new: bool = True  # taken from the waiting queue this round
    node: Node | None = None  # the cached prefix it locked (new requests only)


@dataclass(slots=True)
class AdmitResult:
    items: list[AdmitItem] = field(default_factory=list)
    batch_full: bool = False


def clipped_max_new(r: Req) -> int:
    return min(max(r.max_new - r.out_base, 0), CLIP_MAX_NEW_TOKENS)


def admit(
    cfg: SimConfig, kv: KvPool, reservation: float, chunked: Req | None, waiting: Sequence[Req], allocatable: int
) -> AdmitResult:
    """The next prefill batch: ``chunked`` continues, then ``waiting`` in order, within ``allocatable``
    slots; ``reservation`` is what the running batch is expected still to need."""
    cache = kv.cache
    res = AdmitResult()
    items = res.items
    offset = reservation
    rem_input = cfg.max_prefill_tokens
    rem_chunk = cfg.chunked_prefill_size  # None: chunked prefill disabled

    c = chunked
    if c is not None:
        extend = len(c.fill_ids) - c.prefilled
        take = extend if rem_chunk is None else min(extend, rem_chunk)
        last = take == extend
        items.append(AdmitItem(c, take, c.prefilled, last, hit=0, new=False))
        offset += take + 1 + (clipped_max_new(c) if last else 0)
        rem_input -= take
        if rem_chunk is not None:
            rem_chunk -= take
        if not last:
            return res

    idle_batch = kv.running.n == 0 and chunked is None
    for r in waiting:
        if len(items) >= allocatable:
            res.batch_full = True
            break
        fill = r.fill_ids
        prefix_len, node = cache.match(fill[:-1]) if len(fill) > 1 else (0, None)
        extend = len(fill) - prefix_len
        max_new = clipped_max_new(r)
        free = kv.free
        if extend + max_new + 1 >= free - offset:
            idle = not items and idle_batch and extend + 1 <= free
            if not idle:
                res.batch_full = True
                break
        if extend >= rem_input and items:
            break
        if rem_chunk is None or extend <= rem_chunk:
            take, last = extend, True
        else:
            take, last = rem_chunk, False
            if take <= 0:
                break
        if node is not None:
            cache.lock(node)
        items.append(AdmitItem(r, take, prefix_len, last, hit=prefix_len, node=node))
        offset += take + 1 + (max_new if last else 0)
        rem_input -= take
        if rem_chunk is not None:
            rem_chunk -= take
        if not last or rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
            break
    return res
