"""The fleet's roster (:mod:`proxy.store.roster`) on both backends: only the lease's holder in its
current term publishes, never over a later term's rows; the replicas alive are those seen lately."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.store import Database, Lease, open_database
from proxy.store.roster import LEADER, Roster
from tests.harness.clock import ManualClock

DURATION = 5.0


@pytest.fixture
def connections(tmp_path: Path, store_url: str) -> Iterator[list[Database]]:
    opened = [open_database(store_url, tmp_path, "fleet.sqlite3") for _ in range(2)]
    yield opened
    for db in opened:
        db.close()


def worker(state: str, pid: int) -> dict[str, object]:
    return {"id": "w0", "url": "http://127.0.0.1:1", "state": state, "pid": pid}


def test_only_the_current_terms_holder_publishes(connections: list[Database]) -> None:
    clock = ManualClock()
    leases = [
        Lease(db, LEADER, name, duration_s=DURATION, clock=clock) for db, name in zip(connections, "ab", strict=True)
    ]
    rosters = [Roster(db, clock=clock) for db in connections]
    a = leases[0].acquire()
    assert rosters[0].publish("a", a.term, [worker("ready", 10)])
    assert not rosters[1].publish("b", a.term, [worker("down", 11)])  # not the holder
    clock.now += DURATION  # a stops renewing: its lease runs out
    assert not rosters[0].publish("a", a.term, [worker("down", 12)])  # ran out: fenced
    b = leases[1].acquire()
    assert (b.holder, b.term) == ("b", a.term + 1)
    assert not rosters[0].publish("a", a.term, [worker("down", 13)])  # deposed
    assert rosters[1].publish("b", b.term, [worker("ready", 10)])
    (entry,) = rosters[0].read()
    assert (entry.id, entry.term, entry.record["pid"], entry.record["state"]) == ("w0", b.term, 10, "ready")


def test_a_publish_never_lands_over_a_later_terms_row(connections: list[Database]) -> None:
    """A row written in a later term stays, should an earlier term's holder pass the lease check."""
    clock = ManualClock()
    lease = Lease(connections[0], LEADER, "a", duration_s=DURATION, clock=clock)
    roster = Roster(connections[0], clock=clock)
    first = lease.acquire()
    lease.release()
    second = Lease(connections[1], LEADER, "b", duration_s=DURATION, clock=clock).acquire()
    assert Roster(connections[1], clock=clock).publish("b", second.term, [worker("ready", 20)])
    with connections[0].transaction() as db:  # a's term back in the lease row, as a stale holder would see it
        db.execute("UPDATE leases SET holder='a', term=? WHERE name=?", (first.term, LEADER))
    assert roster.publish("a", first.term, [worker("down", 21)])  # its check passes...
    assert roster.read()[0].record["pid"] == 20  # ...but the later term's row stands


def test_the_live_replicas_are_those_seen_within_the_span(connections: list[Database]) -> None:
    clock = ManualClock()
    roster = Roster(connections[0], clock=clock)
    for name in "abc":
        roster.beat(name, {"pid": 1})
    assert roster.live(DURATION) == 3
    clock.now += DURATION / 2
    roster.beat("a", {"pid": 1})
    roster.beat("b", {"pid": 1})
    clock.now += DURATION * 0.75  # c was last seen 1.25 leases ago
    assert roster.live(DURATION) == 2
    roster.leave("b")
    assert Roster(connections[1], clock=clock).live(DURATION) == 1
