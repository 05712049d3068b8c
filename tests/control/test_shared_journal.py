"""The decision journal in a shared PostgreSQL store (:mod:`proxy.control.shared_journal`): each
replica's journal shows the fleet's decisions and their later states, and a replica started again
takes up its own rows as a restarted proxy takes up its file; decisions made while the store is
down reach it once it is back."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from proxy.console.decisions import format_decision
from proxy.control.decision import Decision, RuleKind
from proxy.control.evidence import Death
from proxy.control.journal import Journal, Status
from proxy.control.shared_journal import SharedJournal, close_journal, open_journal
from proxy.policy import ControlMode
from proxy.store import open_database
from tests.harness.postgres import PostgresServer
from tests.harness.wait import wait_until

pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")


def _decision(worker: str) -> Decision:
    return Decision(worker_id=worker, rule="revive", reason="r", time=1.0, kind=RuleKind.SAFETY,
                    evidence=Death(death="killed by SIGKILL", deaths_in_window=1))  # fmt: skip


async def _open(url: str, replica: str) -> SharedJournal:
    return await SharedJournal.open(partial(open_database, url, Path(), "unused"), replica, poll_s=0.02)


def _seen(journal: Journal) -> set[tuple[str, int, str]]:
    return {(e["replica"], e["id"], e["status"]) for e in journal.entries()}


async def test_each_replica_sees_the_fleets_decisions(postgres_url: str) -> None:
    a, b = await _open(postgres_url, "a"), await _open(postgres_url, "b")
    try:
        on_a = a.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.ACTING)
        on_b = b.record(_decision("w1"), mode=ControlMode.AUTO, status=Status.NOTED)
        both = {("a", on_a, "acting"), ("b", on_b, "noted")}
        await wait_until(lambda: _seen(a) == both and _seen(b) == both, "each replica's journal showing both")
        a.update(on_a, status=Status.APPLIED)
        await wait_until(lambda: ("a", on_a, "applied") in _seen(b), "the later state reaching the other replica")
        assert [e["worker"] for e in b.entries(worker="w0")] == ["w0"]
        assert len(b.entries()) == 2  # an entry's rows are one entry, at its last state
        assert format_decision(b.entries(worker="w0")[0]).startswith(f"a #{on_a} ")  # pacer decisions names it
    finally:
        await a.close()
        await b.close()


async def test_a_replica_started_again_takes_up_its_own_rows(postgres_url: str) -> None:
    a, b = await _open(postgres_url, "a"), await _open(postgres_url, "b")
    try:
        done = a.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.ACTING)
        a.update(done, status=Status.REVIVED)
        left = a.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.ACTING)
        b.record(_decision("w1"), mode=ControlMode.AUTO, status=Status.NOTED)
        await a.close()  # the replica stops with a decision under way

        again = await _open(postgres_url, "a")
        try:
            own = [(e["id"], e["status"]) for e in again.entries() if e["replica"] == "a"]
            assert own == [(done, "revived"), (left, "failed")]
            assert again.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.NOTED) == left + 1
            await wait_until(lambda: ("a", left, "failed") in _seen(b), "the other replica seeing it closed")
            await wait_until(lambda: ("b", 1, "noted") in _seen(again), "the replica seeing the other's again")
        finally:
            await again.close()
    finally:
        await b.close()


async def test_without_a_postgresql_store_the_journal_is_the_file(tmp_path: Path) -> None:
    journal = await open_journal(tmp_path / "decisions.jsonl", "", "a")
    assert type(journal) is Journal
    journal.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.NOTED)
    assert "replica" not in journal.entries()[0] and (tmp_path / "decisions.jsonl").exists()
    await close_journal(journal)


async def test_decisions_made_while_the_store_is_down_reach_it_once_it_is_back(own_postgres: PostgresServer) -> None:
    url = own_postgres.create_database("journal")
    a, b = await _open(url, "a"), await _open(url, "b")
    try:
        await asyncio.to_thread(own_postgres.stop)
        made = a.record(_decision("w0"), mode=ControlMode.AUTO, status=Status.NOTED)
        assert ("a", made, "noted") in _seen(a)  # this replica's own view goes on
        await asyncio.to_thread(own_postgres.start)
        await wait_until(lambda: ("a", made, "noted") in _seen(b), "the decision reaching the other replica")
    finally:
        await a.close()
        await b.close()
