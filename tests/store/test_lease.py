"""The leader lease (:mod:`proxy.store.lease`) on both backends: one holder at a time, each change of
holder a new term, and a holder that stops renewing loses it to another within the lease."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.store import Database, Lease, open_database
from tests.harness.clock import ManualClock

DURATION = 5.0


@pytest.fixture
def connections(tmp_path: Path, store_url: str) -> Iterator[list[Database]]:
    """Three connections to one store, as three replicas would have."""
    opened = [open_database(store_url, tmp_path, "lease.sqlite3") for _ in range(3)]
    yield opened
    for db in opened:
        db.close()


def test_two_contenders_hold_it_one_at_a_time(connections: list[Database]) -> None:
    clock = ManualClock()
    a, b = (
        Lease(db, "leader", name, duration_s=DURATION, clock=clock)
        for db, name in zip(connections[:2], "ab", strict=True)
    )
    first = a.acquire()
    assert (first.holder, first.term, first.expires_at) == ("a", 1, clock.now + DURATION)
    assert b.acquire().holder == "a" and not b.renew()
    clock.now += DURATION * 0.9
    assert a.renew()  # extended: b still cannot take it past the first expiry
    clock.now += DURATION * 0.5
    assert b.acquire().holder == "a"
    a.release()
    taken = b.acquire()
    assert (taken.holder, taken.term) == ("b", 2)
    assert not a.renew() and a.acquire().holder == "b"


def test_a_holder_that_stops_renewing_loses_it_within_the_lease(connections: list[Database]) -> None:
    clock = ManualClock()
    a, b, c = (
        Lease(db, "leader", name, duration_s=DURATION, clock=clock) for db, name in zip(connections, "abc", strict=True)
    )
    assert a.acquire().holder == "a"
    clock.now += 1.0
    assert a.renew()
    last_renewed = clock.now  # a stops here, as a replica that died
    while (state := b.acquire()).holder != "b":
        assert state.holder == "a"
        clock.now += 0.1
    assert clock.now <= last_renewed + DURATION + 0.1  # taken within the lease of the last renewal
    assert state.term == 2 and c.acquire().holder == "b"
    assert not a.renew()  # the old holder learns it was deposed
    assert a.current() == state


def test_contenders_racing_on_separate_connections_never_share_a_term(connections: list[Database]) -> None:
    """Three threads acquire and release as fast as they can: every term has one holder. (Whether it
    changes hands here is up to the locks' fairness, which SQLite does not give: the handover is the
    two tests above.)"""
    terms: dict[int, set[str]] = {}
    lock = threading.Lock()
    start = threading.Barrier(len(connections))

    failures: list[BaseException] = []

    def contend(db: Database, name: str) -> None:
        try:
            lease = Lease(db, "leader", name, duration_s=60.0)
            start.wait()
            for _ in range(150):
                state = lease.acquire()
                if state.holder == name:
                    with lock:
                        terms.setdefault(state.term, set()).add(name)
                    lease.release()
        except BaseException as exc:
            failures.append(exc)
            raise

    threads = [threading.Thread(target=contend, args=(db, name)) for db, name in zip(connections, "abc", strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert terms and all(len(holders) == 1 for holders in terms.values()), terms
