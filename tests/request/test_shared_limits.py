"""Per-key limits across three replicas on one PostgreSQL (:mod:`proxy.request.shared_limits`): the
fleet admits within 5 % of what one replica alone would, most requests touch no store, the fleet
never runs more than the concurrency limit, a dead replica's slots come back, and a store that
cannot be reached leaves each replica its own limit until it is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from proxy.request.limits import KeyLimiter, KeyLimits, Lease, RateLimited
from proxy.request.shared_limits import SharedKeyLimiter, key_limiter
from proxy.store import open_database
from proxy.store.budgets import Budgets
from tests.harness.clock import ManualClock
from tests.harness.postgres import PostgresServer
from tests.harness.wait import wait_until

pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")

REPLICAS = 3


class CountedBudgets(Budgets):
    """Budgets that count the store calls that take from them."""

    takes = 0

    def take(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        CountedBudgets.takes += 1
        return super().take(*args, **kwargs)


@contextlib.asynccontextmanager
async def replicas(
    url: str, tmp_path: Path, limits: KeyLimits, clock: Callable[[], float], hold_s: float = 15.0
) -> AsyncIterator[list[SharedKeyLimiter]]:
    """Three limiters, each with its own connection to the store (three replicas, as the store sees them)."""
    CountedBudgets.takes = 0
    made = []
    for n in range(REPLICAS):

        def opened(n: int = n) -> Budgets:
            return CountedBudgets(open_database(url, tmp_path, "unused"), f"replica-{n}", hold_s=hold_s)

        # slots go back 50 ms after no request needs them (1 s by default): the same, sooner
        limiter = SharedKeyLimiter({"k": limits}, opened, idle_s=3600, linger_s=0.05, clock=clock)
        await limiter.start()
        made.append(limiter)
    try:
        yield made
    finally:
        for limiter in made:
            await limiter.close()


async def _admitted(limiter: KeyLimiter, cost: int, now: float) -> int:
    try:
        lease = await limiter.admit("k", cost, now)
    except RateLimited:
        return 0
    lease.release()
    return 1


async def _overload(limiters: list[KeyLimiter], clock: ManualClock, *, cost: int, seconds: float, step: float) -> int:
    """Each limiter asked at once, every ``step`` seconds of ``clock`` for ``seconds``: how many admitted."""
    admitted = 0
    for _ in range(round(seconds / step)):
        admitted += sum(await asyncio.gather(*(_admitted(lim, cost, clock.now) for lim in limiters)))
        clock.now += step
    return admitted


async def test_requests_per_minute_hold_within_5_percent_across_three_replicas(
    postgres_url: str, tmp_path: Path
) -> None:
    limits = KeyLimits(requests_per_minute=600)
    clock = ManualClock()
    alone = await _overload([KeyLimiter({"k": limits})] * REPLICAS, clock, cost=1, seconds=60, step=0.05)
    clock = ManualClock()
    async with replicas(postgres_url, tmp_path, limits, clock) as fleet:
        together = await _overload(list(fleet), clock, cost=1, seconds=60, step=0.05)
    assert alone == pytest.approx(600 + 600, abs=2)  # a full bucket, then a minute's refill
    assert abs(together - alone) <= 0.05 * alone
    assert together <= alone + 3  # never over the limit (the units in flight: a rounding)


async def test_under_the_limit_most_requests_touch_no_store(postgres_url: str, tmp_path: Path) -> None:
    clock = ManualClock()
    async with replicas(postgres_url, tmp_path, KeyLimits(requests_per_minute=1200), clock) as fleet:
        admitted = await _overload(list(fleet), clock, cost=1, seconds=60, step=0.5)  # 360 a minute
        takes = CountedBudgets.takes
    assert admitted == 360  # none refused
    assert takes <= 0.15 * admitted  # a store call a chunk (1 % of the limit) or so, not a request


async def test_tokens_per_minute_hold_within_5_percent_across_three_replicas(postgres_url: str, tmp_path: Path) -> None:
    limits = KeyLimits(tokens_per_minute=60_000)
    clock = ManualClock()
    alone = await _overload([KeyLimiter({"k": limits})] * REPLICAS, clock, cost=150, seconds=30, step=0.05)
    clock = ManualClock()
    async with replicas(postgres_url, tmp_path, limits, clock) as fleet:
        together = await _overload(list(fleet), clock, cost=150, seconds=30, step=0.05)
    assert abs(together - alone) <= 0.05 * alone
    assert together <= alone + 1


async def test_the_fleet_never_runs_more_than_the_concurrency_limit(postgres_url: str, tmp_path: Path) -> None:
    limit = 12
    clock = ManualClock()
    async with replicas(postgres_url, tmp_path, KeyLimits(max_concurrent=limit), clock) as fleet:
        held: list[tuple[int, Lease]] = []

        async def try_on(n: int) -> None:
            with contextlib.suppress(RateLimited):
                held.append((n, await fleet[n].admit("k", 1, 0.0)))

        for _ in range(40):  # far more than the limit, spread over the replicas
            for n in range(REPLICAS):
                await try_on(n)
        assert len(held) == limit  # all of it, and no more
        with pytest.raises(RateLimited):
            await fleet[0].admit("k", 1, 0.0)
        first = [lease for n, lease in held if n == 0]
        assert first
        for lease in first:  # the first replica's requests end
            lease.release()
        held = [(n, lease) for n, lease in held if n != 0]

        async def full_again() -> bool:  # the slots freed on the first replica reach the others
            await try_on(1 + len(held) % 2)
            return len(held) == limit

        await wait_until(full_again, "the other replicas running the limit again")
        with pytest.raises(RateLimited):
            await fleet[2].admit("k", 1, 0.0)
        assert sum(lim._held["k"].running for lim in fleet) == limit


async def test_a_dead_replicas_slots_come_back_within_its_hold(postgres_url: str, tmp_path: Path) -> None:
    clock = ManualClock()
    limit, hold_s = 4, 10.0
    db = open_database(postgres_url, tmp_path, "unused")
    try:
        dead = Budgets(db, "dead", hold_s=hold_s)
        from proxy.store.budgets import SlotAsk

        assert dead.take("k", [], SlotAsk(limit, limit, limit), clock.now)[1] == limit  # then it dies
        async with replicas(postgres_url, tmp_path, KeyLimits(max_concurrent=limit), clock, hold_s) as fleet:
            with pytest.raises(RateLimited):
                await fleet[0].admit("k", 1, 0.0)
            clock.now += hold_s + 0.01
            lease = await fleet[0].admit("k", 1, 0.0)
            lease.release()
    finally:
        db.close()


async def test_an_unreachable_store_leaves_each_replica_the_whole_limit_until_it_is_back(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    url = own_postgres.create_database("limits")
    clock = ManualClock()
    async with replicas(url, tmp_path, KeyLimits(requests_per_minute=60), clock) as fleet:
        assert await _admitted(fleet[0], 1, clock.now) == 1
        await asyncio.to_thread(own_postgres.stop)
        during = sum([await _admitted(fleet[0], 1, clock.now) for _ in range(70)])
        assert 60 <= during <= 62  # its own bucket (and what it held from the store): no error, no wait
        await asyncio.to_thread(own_postgres.start)
        clock.now += 5.0  # the store is tried again after retry_s
        takes = CountedBudgets.takes
        assert await _admitted(fleet[1], 1, clock.now) == 1
        assert CountedBudgets.takes > takes  # through the store again, on a new connection


def test_without_a_postgresql_store_the_limiter_is_this_replicas_own() -> None:
    limits = {"k": KeyLimits(requests_per_minute=60)}
    assert type(key_limiter(limits, "", concurrent_retry_after_s=1.0)) is KeyLimiter
    assert type(key_limiter({}, "postgresql://db/p", concurrent_retry_after_s=1.0)) is KeyLimiter  # no key limited
    assert type(key_limiter(limits, "postgresql://db/p", concurrent_retry_after_s=1.0)) is SharedKeyLimiter
