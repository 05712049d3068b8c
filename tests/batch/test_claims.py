"""Claims on batch lines (:meth:`BatchStore.claim_lines`): on a shared store two runners never take
the same line, a claim that runs out goes to the next runner, and a runner that stops hands its
lines back at once."""

from __future__ import annotations

from pathlib import Path

from proxy.batch import BatchStore, owner_of
from proxy.batch.runner import CLAIM_S, POLL_S
from proxy.workers import replicas
from tests.batch.conftest import CHAT, jsonl, request_line

OWNER = owner_of("key-a")
NOW = 1_000_000.0  # the store's clock, as the runner passes it: the claims' own time, no wall clock


def test_a_dead_replicas_lines_move_within_the_failover_target_and_a_live_one_rides_out_the_lease() -> None:
    """Issue 45: what a dead replica held moves within 15 s; a live one loses its lines to no store outage
    its leader lease rides out (the claim renewed every third of its life: two renewals may fail)."""
    assert CLAIM_S + POLL_S <= 15.0
    assert CLAIM_S * 2 / 3 >= replicas.LEADER_LEASE_S - replicas.POLL_S


def _batch(store: BatchStore, lines: int) -> str:
    staged = store.staging_dir / "in.part"
    staged.write_bytes(jsonl(*(request_line(f"line-{n}") for n in range(lines))))
    file_id = store.add_file(OWNER, staged=staged, filename="in.jsonl", purpose="batch", now=0)["id"]
    batch_id = str(
        store.create_batch(OWNER, input_file_id=file_id, endpoint=CHAT, metadata=None, now=0, window_s=86400)["id"]
    )
    assert store.validate(batch_id, accepts_model=lambda _m: True, now=0) == "in_progress"
    return batch_id


def _claim(store: BatchStore, batch_id: str, *, now: float = NOW, limit: int = 100) -> list[int]:
    return [line.idx for line in store.claim_lines(batch_id, after=0, limit=limit, now=now, claim_s=CLAIM_S)]


def test_two_runners_take_disjoint_lines_and_a_lapsed_claim_moves(tmp_path: Path, postgres_url: str) -> None:
    with BatchStore.open(tmp_path / "a", postgres_url) as a, BatchStore.open(tmp_path / "b", postgres_url) as b:
        batch_id = _batch(a, 6)
        assert _claim(a, batch_id, limit=4) == [1, 2, 3, 4]
        assert _claim(b, batch_id) == [5, 6]  # a's lines are taken
        assert _claim(b, batch_id) == [5, 6]  # its own claims are its to run again (a driver restarted)
        assert b.renew_claims(now=NOW + CLAIM_S - 1, claim_s=CLAIM_S) == 2
        assert _claim(a, batch_id, now=NOW + CLAIM_S + 1) == [1, 2, 3, 4]  # b renewed; a's own again
        assert a.record(batch_id, 1, "output", b"{}")
        assert _claim(b, batch_id, now=NOW + 2 * CLAIM_S + 2) == [2, 3, 4, 5, 6]  # a stopped renewing: lapsed
        assert _claim(a, batch_id, now=NOW + 2 * CLAIM_S + 3) == []
        b.release_claims()
        assert _claim(a, batch_id, now=NOW + 2 * CLAIM_S + 3) == [2, 3, 4, 5, 6]
        assert a.unanswered(batch_id) == 5


def test_a_new_process_on_the_sqlite_file_takes_the_lines_left_claimed(tmp_path: Path) -> None:
    with BatchStore.open(tmp_path) as first:
        batch_id = _batch(first, 3)
        assert _claim(first, batch_id) == [1, 2, 3]
    with BatchStore.open(tmp_path) as second:  # the first died holding them: one process owns the file
        assert _claim(second, batch_id) == [1, 2, 3]
