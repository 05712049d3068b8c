"""The fast tier's pure functions on hand-built looks: the admission limit and the queue target."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from proxy.control.fast_tier import (
    Pace,
    PaceInput,
    PaceSettings,
    batch_kv_limit,
    budget_evidence,
    budget_moved,
    budget_overrun,
    kv_peak,
    next_pace,
    output_budget,
    queue_target,
)

if TYPE_CHECKING:
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import LoadBoard

S = PaceSettings()
BAND = {"lo": 4, "hi": 64, "headroom": 4}  # base 8


def _look(t: float, **kw: object) -> PaceInput:
    base = {"running": 100, "queue": 8, "token_usage": 0.7, "retractions_total": 0.0, "in_flight": 108, "backlog": 0}
    base.update(kw)
    return PaceInput(time=t, **base)  # type: ignore[arg-type]


def _run(looks: list[PaceInput], pace: Pace | None = None) -> list[Pace]:
    pace = pace or Pace()
    out = []
    for look in looks:
        pace = next_pace(pace, look, settings=S, **BAND)
        out.append(pace)
    return out


def test_no_limit_until_over_commitment_then_multiplicative_back_off_at_most_once_per_hold():
    paces = _run([_look(0.0), _look(1.0, retractions_total=3.0), _look(2.0, retractions_total=9.0)])
    assert paces[0].limit is None
    assert paces[1].limit == int(108 * S.backoff)  # below what the worker held
    assert "retractions" in paces[1].reason
    assert paces[2].limit == paces[1].limit  # within hold_s: not again
    later = _run([_look(1.0 + S.hold_s, retractions_total=20.0, in_flight=86, running=80, queue=6)], paces[2])[0]
    assert later.limit == int(min(paces[1].limit, 108) * S.backoff)


def test_a_back_off_again_only_once_the_last_one_has_bitten():
    """Retractions go on while the requests above a new limit end by themselves: no further back-off
    until the worker holds no more than the limit (however many ``hold_s`` pass), then one."""
    first = _run([_look(0.0), _look(1.0, retractions_total=3.0)])[-1]
    assert first.limit == 86
    looks = [_look(1.0 + k * S.hold_s, retractions_total=3.0 + 5 * k, in_flight=108 - 4 * k, running=100 - 4 * k)
             for k in range(1, 6)]  # fmt: skip
    paces = _run(looks, first)
    assert [p.limit for p in paces] == [86, 86, 86, 86, 86]  # draining: 104, 100, ... 88 held, above 86
    bitten = _run([_look(1.0 + 6 * S.hold_s, retractions_total=40.0, in_flight=84, running=78, queue=6)], paces[-1])
    assert bitten[0].limit == int(84 * S.backoff) and "retractions" in bitten[0].reason


def test_a_counter_reset_is_not_a_retraction():
    paces = _run([_look(0.0, retractions_total=50.0), _look(1.0, retractions_total=0.0)])
    assert paces[1].limit is None


def test_grows_additively_only_when_binding_with_work_waiting_and_usage_low():
    start = Pace(limit=64, retractions_seen=0.0, backed_off_at=-100.0, looked_at=10.0 - S.hold_s)
    grown = _run([_look(10.0, in_flight=64, backlog=30, token_usage=0.5)], start)[0]
    assert grown.limit == 64 + 64 // S.grow_divisor  # a hold's worth of binding: one step
    for kw in ({"backlog": 0}, {"in_flight": 40}, {"token_usage": 0.95}):
        look = _look(10.0, **{"in_flight": 64, "backlog": 30, "token_usage": 0.5, **kw})
        assert _run([look], start)[0].limit == 64, kw
    held = replace(start, backed_off_at=8.0)
    assert _run([_look(10.0, in_flight=64, backlog=30, token_usage=0.5)], held)[0].limit == 64


def test_the_limit_grows_by_the_time_it_binds_not_by_the_looks():
    """A step (limit / grow_divisor) per ``hold_s`` of binding, whatever the scrape interval: looks
    every tenth of a hold grow it as much over a hold as one look at its end; a long gap between looks
    counts one hold's worth; growth owed is lost when the limit stops binding."""
    start = Pace(limit=64, retractions_seen=0.0, backed_off_at=-100.0, looked_at=0.0)
    binding = {"in_flight": 100, "backlog": 30, "token_usage": 0.5}
    often = _run([_look(k * S.hold_s / 10, **binding) for k in range(1, 11)], start)
    assert [p.limit for p in often] == [64, 64, 65, 65, 66, 66, 66, 67, 67, 68]  # 0.4 requests a look
    assert _run([_look(S.hold_s, **binding)], start)[0].limit == 68
    assert _run([_look(100 * S.hold_s, **binding)], start)[0].limit == 68  # a long gap: one hold's worth
    assert _run([_look(S.hold_s / 2, **binding)], start)[0].limit == 66  # half a hold: half a step
    fifth = _run([_look(S.hold_s / 5, **binding)], start)[0]
    assert fifth.limit == 64 and fifth.grow_carry == pytest.approx(0.8)  # not yet a whole request
    assert _run([_look(S.hold_s / 5 + 0.01, **{**binding, "backlog": 0})], fifth)[0].grow_carry == 0.0


def test_grown_past_the_ceiling_the_limit_is_lifted():
    start = Pace(limit=S.ceiling, retractions_seen=0.0, looked_at=10.0 - S.hold_s)
    assert _run([_look(10.0, in_flight=S.ceiling, backlog=1, token_usage=0.1)], start)[0].limit is None


def test_time_to_first_token_rising_with_a_server_queue_beside_a_batch_backs_off():
    paces = _run([_look(0.0, ttft_s=0.2, batch_in_flight=40), _look(1.0, ttft_s=0.25, batch_in_flight=40),
                  _look(2.0, ttft_s=1.0, batch_in_flight=40)])  # fmt: skip
    assert paces[1].limit is None and paces[2].limit is not None and "first token" in paces[2].reason
    no_queue = _run([_look(0.0, ttft_s=0.2, batch_in_flight=40), _look(2.0, ttft_s=1.0, queue=0, batch_in_flight=40)])
    assert no_queue[1].limit is None  # slow answers without a queue are the requests' own length


def test_interactive_work_alone_is_not_held_back_for_its_own_first_tokens():
    """Chat alone, in a burst: its first tokens rise far past their floor with a server queue. A limit
    would only move the wait from the worker's queue to the proxy's and shrink the running batch the
    burst is waiting to join, so nothing backs off; retractions still do, and a batch beside it."""
    rising = [0.05, 0.06, 0.5, 2.0, 8.0]
    burst = [_look(float(t), ttft_s=x, queue=60, running=90, in_flight=150, backlog=200, mean_output_tokens=300.0)
             for t, x in enumerate(rising)]  # fmt: skip
    assert all(p.limit is None for p in _run(burst))
    beside = [replace(look, batch_in_flight=20, interactive_waiting=130) for look in burst]
    assert _run(beside)[-1].limit is not None
    storm = _run([*burst, replace(burst[-1], time=5.0, retractions_total=6.0)])
    assert storm[-1].limit is not None and "retractions" in storm[-1].reason


def test_the_floor_follows_a_lasting_change_instead_of_backing_off_forever():
    looks = [_look(float(t), ttft_s=0.5, queue=0) for t in range(200)]
    floor = _run([_look(-1.0, ttft_s=0.1), *looks])[-1].ttft_floor
    assert floor is not None and floor == 0.5


def test_queue_target_moves_up_the_band_with_output_length():
    assert queue_target(4, 64, 4, None, S) == 8
    assert queue_target(4, 64, 4, 100.0, S) == 8  # short interactive answers: the band's base
    assert queue_target(4, 64, 4, 2000.0, S) == 64  # a batch of long outputs: the top
    mid = queue_target(4, 64, 4, (S.short_output_tokens + S.long_output_tokens) / 2, S)
    assert 8 < mid < 64
    assert queue_target(0, 0, 0, 2000.0, S) == 1
    assert _run([_look(0.0, mean_output_tokens=2000.0)])[0].queue_target == 64


def test_the_proxy_writes_each_scrape_s_pace_into_the_worker_s_load():
    from proxy.compose import _fast_tier
    from proxy.engines.base import Sample
    from proxy.policy import parse_policy
    from proxy.request.admission import AdmissionQueue
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard
    from proxy.workers.fleet import build_pool

    policy = parse_policy({"engine": {"kind": "external", "urls": ["http://127.0.0.1:9"]}}, "<t>")
    board, pumps = LoadBoard(), []
    dispatcher = Dispatcher(
        build_pool(policy, {}), board, AdmissionQueue(10), band=Band(lo=4, hi=64, headroom=4), stale_after_s=5.0
    )
    dispatcher.pump = lambda: pumps.append(1)  # type: ignore[method-assign]  # counts the gate's runs
    board.subscribe(_fast_tier(board, dispatcher))

    def scrape(t: float, retracted: float) -> None:
        board.publish("w0", Sample(time=t, queue=8, running=100, token_usage=0.7, retractions_total=retracted), None)

    scrape(1.0, 0.0)
    assert board.get("w0").limit is None and board.get("w0").queue_target == 8
    scrape(2.0, 4.0)
    load = board.get("w0")
    assert load.limit == int(108 * S.backoff) and pumps  # the gate runs again with the new values
    assert load.snapshot()["limit"] == load.limit


def test_a_back_off_is_judged_on_the_first_tokens_of_what_was_sent_after_it():
    """The time-to-first-token sign reads the interactive requests sent to the worker since the last
    back-off: first tokens that waited before it (mixed's chat behind the batch at the start) are what
    it answered, and read again every ``hold_s`` they backed the limit off below what the chat alone
    holds while the GPU went idle. A slow first token sent after it is a sign again."""
    from proxy.compose import _fast_tier
    from proxy.engines.base import Sample
    from proxy.policy import parse_policy
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.attempt import Attempt, Ticket
    from proxy.request.dispatch import Dispatcher
    from proxy.request.facts import RequestFact
    from proxy.request.pacing import Band, LoadBoard
    from proxy.workers.fleet import build_pool

    policy = parse_policy({"engine": {"kind": "external", "urls": ["http://127.0.0.1:9"]}}, "<t>")
    board = LoadBoard()
    dispatcher = Dispatcher(
        build_pool(policy, {}), board, AdmissionQueue(10), band=Band(lo=4, hi=64, headroom=4), stale_after_s=5.0
    )
    board.subscribe(_fast_tier(board, dispatcher))
    facts = board.get("w0").facts
    batch = Ticket(Priority.BATCH, 0.0, 1.0, None)  # type: ignore[arg-type]
    board.get("w0").reserve(Attempt(batch, "w0", 0.0), batch=True)  # the batch the chat waited behind

    def answered(sent: float, ttft: float, n: int = 1) -> None:
        for _ in range(n):
            facts.record(RequestFact(time=sent + ttft + 0.1, arrived=sent, prompt_tokens=300, output_tokens=50,
                                     max_tokens=4096, finish_reason="stop", ttft_s=ttft, queue_s=0.0))  # fmt: skip

    def scrape(t: float, running: int = 100) -> int | None:
        board.publish("w0", Sample(time=t, queue=8, running=running, token_usage=0.7), None)
        return board.get("w0").limit

    answered(0.5, 0.1, 3)
    assert scrape(1.0) is None  # the floor: 0.1 s
    answered(1.2, 2.0, 10)  # first tokens that waited
    backed = scrape(2.0)
    assert backed == int(108 * S.backoff)
    # the worker down to the limit: nothing sent since has answered, no sign, whatever waited before
    assert scrape(2.0 + S.hold_s + 1.0, running=backed - 8) == backed
    answered(3.0, 2.0)  # sent after the back-off, and slow: a sign
    assert scrape(2.0 + 2 * S.hold_s + 2.0, running=backed - 8) == int(backed * S.backoff)


def test_with_a_token_counter_a_steady_trickle_of_retractions_is_not_over_commitment():
    def looks(retracted_per_look: float) -> list[PaceInput]:
        return [_look(float(t), retractions_total=t * retracted_per_look, generation_tokens_total=t * 1600.0)
                for t in range(30)]  # fmt: skip

    trickle = _run(looks(0.3))  # 0.19 retracted requests per 1,000 tokens: a long batch's own cycle
    assert all(p.limit is None for p in trickle)
    storm = _run(looks(8.0) + [_look(float(t), retractions_total=t * 8.0, generation_tokens_total=t * 1600.0)
                               for t in range(30, 40)])  # fmt: skip
    assert storm[-1].limit is not None and "retractions" in storm[-1].reason  # 5 per 1,000 tokens, for 30 s


def test_a_healthy_batch_s_retraction_bursts_do_not_bind_it():
    """A batch of long outputs as SGLang serves it: a scrape every 0.5 s at 1,600 tokens/s, and every
    15 s it retracts 5 requests at once (0.21 per 1,000 tokens over time; 6 per 1,000 over the half
    second of the burst). Smoothed over its window that is the trickle it is, not a storm."""
    looks = [_look(k * 0.5, retractions_total=5.0 * (k // 30), generation_tokens_total=k * 800.0,
                   mean_output_tokens=1600.0, token_usage=0.95) for k in range(1200)]  # fmt: skip
    assert all(p.limit is None for p in _run(looks))


def test_a_batch_of_long_outputs_waiting_for_kv_is_not_slowed_by_its_time_to_first_token():
    """A backlogged batch's first tokens wait behind the longer server queue this tier gives it and for
    KV to free: that is its design, judged on throughput; chat's wait is its figure."""
    rising = [0.2, 0.3, 1.0, 3.0, 8.0]
    batch = _run([_look(float(t), ttft_s=x, queue=60, mean_output_tokens=1600.0, batch_in_flight=100)
                  for t, x in enumerate(rising)])  # fmt: skip
    assert all(p.limit is None for p in batch)
    chat = _run([_look(float(t), ttft_s=x, queue=8, mean_output_tokens=300.0, batch_in_flight=100)
                 for t, x in enumerate(rising)])  # fmt: skip
    assert chat[-1].limit is not None and "first token" in chat[-1].reason


def test_the_first_token_sign_reads_the_interactive_class_not_the_worker_s_mix():
    """Chat beside a batch of long outputs: the worker's mean output (the mix) is long, the chat's own is
    short, and the sign reads the chat's. A class sent as interactive whose own outputs are long is
    judged on throughput, like a batch."""
    rising = [0.2, 0.3, 1.0, 3.0, 8.0]
    mixed = [_look(float(t), ttft_s=x, queue=8, mean_output_tokens=1100.0, interactive_output_tokens=300.0,
                   interactive_waiting=5, batch_in_flight=100) for t, x in enumerate(rising)]  # fmt: skip
    paces = _run(mixed)
    assert paces[-1].limit is not None and "first token" in paces[-1].reason
    long_chat = [replace(look, interactive_output_tokens=1600.0, mean_output_tokens=300.0) for look in mixed]
    assert all(p.limit is None for p in _run(long_chat))


def test_batch_keeps_a_short_server_queue_beside_interactive_work_and_the_band_again_after_the_hold():
    beside = _run([_look(0.0, mean_output_tokens=1100.0, interactive_output_tokens=200.0, interactive_waiting=3)])[0]
    assert beside.batch_queue_target == S.batch_queue_beside_interactive
    assert beside.queue_target == 8  # the chat's own short outputs: the band's base, not the mix's upper part
    still = _run([_look(S.interactive_hold_s - 1.0, mean_output_tokens=1600.0)], beside)[0]
    assert still.batch_queue_target == S.batch_queue_beside_interactive  # within the hold: still stepped back
    alone = _run([_look(S.interactive_hold_s + 0.5, mean_output_tokens=1600.0)], still)[0]
    assert alone.batch_queue_target is None and alone.queue_target == 64  # a batch alone: the band's top
    tiny = Pace()
    small_band = next_pace(tiny, _look(0.0, interactive_waiting=1), lo=0, hi=0, headroom=0, settings=S)
    assert small_band.batch_queue_target == 1  # never past the interactive target, never 0


def test_the_kv_peak_is_what_the_open_requests_hold_before_the_next_one_ends():
    assert kv_peak([]) == 0
    assert kv_peak([(100, 0), (50, 0)]) == 150  # nothing left to write: what they hold now
    # two grow: 100 + 10 and 50 + 10 just before the first ends, then 50 + 30 alone
    assert kv_peak([(100, 10), (50, 30)]) == 170
    # a long one outlives a crowd of short ones: the crowd's end frees more than the long one ever writes
    assert kv_peak([(1000, 5)] * 10 + [(10, 200)]) == 10 * 1005 + 15
    assert kv_peak([(1000, 5)] * 10 + [(10, 20000)]) == 20010


def test_beside_interactive_work_the_batch_is_sized_by_the_kv_the_open_requests_head_for():
    """The batch requests open, plus those (each its prompt and expected output) that fit under
    grow_below_usage once the open ones have written theirs; past the pool, the newest beyond it are
    taken back. Not today's usage: a batch sent at low usage fills the pool as it writes. A batch alone,
    or one whose size is not known yet, is not sized (retractions and usage pace it, as before)."""
    chat = {"interactive_waiting": 5, "backlog": 40, "token_usage": 0.6, "in_flight": 150, "batch_in_flight": 100}
    over = _run([_look(0.0, kv_peak_share=1.3, batch_request_share=0.02, **chat)])[0]
    # back to 0.9 of the pool, where the sizing keeps it; the AIMD limit is apart
    assert (over.batch_limit, over.take_back_batch) == (80, 20) and over.limit is None
    assert batch_kv_limit(_look(0.0, kv_peak_share=1.0, batch_request_share=0.02, **chat), S) == (100, 0)
    room = _run([_look(1.0, kv_peak_share=0.75, batch_request_share=0.02, **{**chat, "batch_in_flight": 80})], over)[0]
    assert (room.batch_limit, room.take_back_batch) == (80 + 7, 0)  # (0.9 - 0.75) / 0.02
    unknown = _run([_look(2.0, kv_peak_share=0.75, **chat)], room)[0]
    assert unknown.batch_limit is None  # nothing of the batch open (no size): its first request goes
    # interactive work alone past the pool: the batch keeps its one request going, nothing more
    crowded = {**chat, "batch_in_flight": 3}
    assert batch_kv_limit(_look(5.0, kv_peak_share=1.5, batch_request_share=0.02, **crowded), S) == (1, 2)
    assert batch_kv_limit(
        _look(5.0, kv_peak_share=1.5, batch_request_share=0.02, **{**chat, "batch_in_flight": 1}), S
    ) == (1, 0)
    alone = _run([_look(100.0, kv_peak_share=1.3, batch_request_share=0.02, **{**chat, "interactive_waiting": 0})])
    assert alone[0].batch_limit is None and alone[0].take_back_batch == 0


def test_beside_interactive_work_the_batch_grows_no_further_than_the_next_chat_s_admission_allows():
    """Where the engine's admission counts what requests may still write, the batch stops growing where
    the next interactive request would no longer fit beside it, however little KV is in use; past it the
    limit falls below what is open (no take-back: the first token's watch does that)."""
    chat = {"interactive_waiting": 5, "backlog": 40, "token_usage": 0.4, "in_flight": 150, "batch_in_flight": 100}
    kv = {"kv_peak_share": 0.5, "batch_request_share": 0.02}  # the KV sizing alone: 100 + 20
    assert batch_kv_limit(_look(0.0, **kv, **chat), S) == (120, 0)
    room = {"admission_share": 0.9, "batch_admission_share": 0.03}  # 3 more fit: (1 - 0.9) / 0.03
    assert batch_kv_limit(_look(0.0, **kv, **room, **chat), S) == (103, 0)
    full = {"admission_share": 1.05, "batch_admission_share": 0.03}
    assert batch_kv_limit(_look(0.0, **kv, **full, **chat), S) == (98, 0)
    assert batch_kv_limit(_look(0.0, **kv, admission_share=0.9, **chat), S) == (120, 0)  # no batch count: not sized


def test_beside_interactive_work_a_first_token_may_wait_a_few_decode_steps_before_batch_refills_stop():
    beside = _run([_look(0.0, interactive_waiting=3, step_s=0.03)])[0]
    assert beside.first_token_wait_s == S.first_token_steps * 0.03
    assert _run([_look(0.0, interactive_waiting=3)])[0].first_token_wait_s is None  # no step time yet: no hold
    alone = _run([_look(S.interactive_hold_s + 0.5, step_s=0.03)], beside)[0]
    assert alone.first_token_wait_s is None  # a batch alone: nothing to wait for


class _ReadyPool:
    """One ready worker (what the dispatcher reads of a pool)."""

    def __init__(self) -> None:
        from proxy.workers.base import WorkerInfo, WorkerState

        self.ws = [WorkerInfo(id="w0", url="http://w0", state=WorkerState.READY, managed=True)]

    def workers(self):  # type: ignore[no-untyped-def]
        return self.ws

    def get(self, wid):  # type: ignore[no-untyped-def]
        return self.ws[0]


async def test_the_proxy_takes_back_batch_requests_waiting_at_the_worker_when_interactive_work_arrives():
    """The composition: a scrape with interactive work waiting sets the batch target and takes the batch
    requests waiting beyond it back to the proxy's queue, through the dispatcher."""
    from proxy.compose import _fast_tier
    from proxy.engines.base import Sample
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board, clock = LoadBoard(), [10.0]
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: clock[0])  # fmt: skip
    board.subscribe(_fast_tier(board, d))
    board.publish("w0", Sample(time=1.0, queue=0, running=0, token_usage=0.1), None)
    batch = []
    for _ in range(8):
        batch.append(d.submit(Priority.BATCH, 100))
        clock[0] += 0.01
    assert all(t.future.done() for t in batch)  # the band's base (8): no interactive work yet
    load = board.get("w0")
    load.scrape_started()
    board.publish("w0", Sample(time=2.0, queue=6, running=2, token_usage=0.5), None)
    assert load.batch_queue_target is None
    chat = d.submit(Priority.INTERACTIVE, 100)
    assert chat.future.done()  # est_queue 6 < the band's base 8; it waits at the worker behind six batch requests
    load.scrape_started()
    board.publish("w0", Sample(time=2.5, queue=6, running=2, token_usage=0.5), None)
    assert load.batch_queue_target == S.batch_queue_beside_interactive
    taken = [t for t in batch if t.future.result().taken_back]
    # the six the scrape shows waiting are the newest sent: the chat request and five batch ones, of which
    # the two oldest stay (next to be admitted)
    assert S.batch_queue_beside_interactive == 2 and taken == batch[5:]
    assert not chat.future.result().taken_back
    later = d.submit(Priority.BATCH, 100)
    assert not later.future.done()  # the worker's queue is past the batch target
    for t in (*batch, chat, later):
        t.future.cancel()


async def test_the_first_interactive_request_of_a_spell_steps_the_batch_back_before_the_next_scrape():
    """The composition: batch work sent to a quiet worker since its last scrape waits in its queue; the
    first interactive request after a quiet ``interactive_window_s`` has the fast tier look again at once
    on that scrape, so the batch beyond the target goes back to the proxy's queue before the chat request
    is placed (at the next scrape it would wait behind it). Later interactive requests do not look again
    until a quiet window has passed."""
    from proxy.compose import _fast_tier, _look_again
    from proxy.engines.base import Sample
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.attempt import Ticket
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board, clock = LoadBoard(), [10.0]
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: clock[0], interactive_window_s=5.0)  # fmt: skip
    observer = _fast_tier(board, d)
    board.subscribe(observer)
    looks: list[str] = []

    def counted(worker_id: str, sample: Sample | None, error: str | None) -> None:
        looks.append(worker_id)
        observer(worker_id, sample, error)

    d.on_interactive_spell = _look_again(board, d, counted)
    board.publish("w0", Sample(time=1.0, queue=0, running=0, token_usage=0.1), None)

    async def held(ticket: Ticket) -> None:  # a request open on the worker until taken back or cancelled
        async with d.attempt(ticket):
            await asyncio.sleep(3600)

    batch = [d.submit(Priority.BATCH, 100) for _ in range(8)]
    tasks = [asyncio.create_task(held(t)) for t in batch]
    await asyncio.sleep(0)
    assert all(t.future.done() for t in batch) and not looks  # the band's base (8); a batch is no spell
    first = [t.future.result() for t in batch]
    chat = d.submit(Priority.INTERACTIVE, 100)
    assert looks == ["w0"] and board.get("w0").batch_queue_target == S.batch_queue_beside_interactive
    # the eight sent since the scrape wait at the worker: all but the two oldest come back
    assert [a.taken_back for a in first] == [False] * 2 + [True] * 6
    for _ in range(3):
        await asyncio.sleep(0)
    assert chat.future.done() and not chat.future.result().taken_back  # placed once they left the worker
    assert board.get("w0").batch_in_flight == 2  # the six wait at the front of the proxy's batch class
    clock[0] += 1.0
    again = d.submit(Priority.INTERACTIVE, 100)
    assert looks == ["w0"]  # within the window: the same spell
    clock[0] += 10.0
    after = d.submit(Priority.INTERACTIVE, 100)
    assert looks == ["w0", "w0"]  # a quiet window later: a new spell
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in (chat, again, after):
        t.future.cancel()


async def test_batch_work_arriving_just_after_a_spell_s_first_request_is_held_to_the_batch_target():
    """The composition: the chat's first request comes before the batch (they arrive together, the chat a
    moment first): its look sets the batch's target beside interactive work at once, so the batch that
    follows does not fill the worker's queue until the next scrape."""
    from proxy.compose import _fast_tier, _look_again
    from proxy.engines.base import Sample
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board = LoadBoard()
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: 10.0)  # fmt: skip
    observer = _fast_tier(board, d)
    board.subscribe(observer)
    d.on_interactive_spell = _look_again(board, d, observer)
    board.publish("w0", Sample(time=9.8, queue=0, running=0, token_usage=0.0), None)
    chat = d.submit(Priority.INTERACTIVE, 100)
    batch = [d.submit(Priority.BATCH, 100) for _ in range(8)]
    sent = [t for t in batch if t.future.done()]
    assert board.get("w0").batch_queue_target == S.batch_queue_beside_interactive
    # the worker's queue (the chat request in it) at the target: the rest wait in the proxy, not at the worker
    assert len(sent) == S.batch_queue_beside_interactive - 1
    for t in (chat, *batch):
        t.future.cancel()


async def test_an_interactive_request_held_up_at_the_worker_has_no_batch_request_queued_beside_it():
    """The composition: a streamed interactive request without its first token while the scrape shows
    requests waiting at the worker takes back every batch request waiting there, before its first token
    is due (a batch request waits there for the same room, and an engine that orders its queue by cached
    prefix admits one going on from its text first); with nothing waiting there, none."""
    from proxy.compose import _fast_tier
    from proxy.engines.base import Sample
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board, clock = LoadBoard(), [10.0]
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: clock[0])  # fmt: skip
    board.subscribe(_fast_tier(board, d))
    load = board.get("w0")
    load.scrape_started()
    board.publish("w0", Sample(time=9.0, queue=0, running=4, token_usage=0.5, generation_tokens_total=0.0), None)
    batch = [d.submit(Priority.BATCH, 100) for _ in range(4)]
    chat = d.submit(Priority.INTERACTIVE, 100)
    chat.future.result().streamed = True
    load.scrape_started()  # four tokens a step at 100 tokens/s: 0.04 s steps
    board.publish("w0", Sample(time=10.0, queue=0, running=4, token_usage=0.9, generation_tokens_total=100.0), None)
    assert load.first_token_wait_s == S.first_token_steps * 0.04
    assert not any(t.future.result().taken_back for t in batch)  # nothing waits at the worker
    assert load.has_room(clock[0], batch=True)  # and the batch may go on
    clock[0] = 10.05  # before its first token is due
    load.scrape_started()
    board.publish("w0", Sample(time=10.05, queue=3, running=4, token_usage=0.9, generation_tokens_total=105.0), None)
    # the scrape's three waiting are the newest sent: the chat request and two batch ones, both taken back
    assert [t for t in batch if t.future.result().taken_back] == batch[2:]
    assert not chat.future.result().taken_back
    assert not load.has_room(clock[0], batch=True)  # no refill while it waits there
    chat.future.result().mark_started()
    assert load.has_room(clock[0], batch=True)  # its first token came
    for t in (*batch, chat):
        t.future.cancel()


def test_output_budget_is_a_margin_over_a_high_quantile_of_what_answers_wrote():
    assert output_budget([300] * (S.budget_min_answers - 1), S) is None  # too few answers to say
    written = list(range(1, 101))  # 1..100 tokens
    assert output_budget(written, S) == 256  # p99 99 x 1.5 = 149: the floor
    long = [400 + 16 * i for i in range(100)]  # 400..1984
    budget = output_budget(long, S)
    assert budget == 3008  # p99 1968 x 1.5 = 2952, up to a multiple of 64
    assert output_budget(long, replace(S, output_budget=False)) is None
    # the newest budget_answers only: an old regime of long answers is forgotten
    assert output_budget([5000] * 300 + [100] * S.budget_answers, S) == 256


def test_a_budget_is_journaled_when_set_lifted_or_moved_by_a_quarter():
    assert budget_moved(None, 512, S) and budget_moved(512, None, S) and not budget_moved(None, None, S)
    assert not budget_moved(512, 576, S) and budget_moved(512, 640, S) and budget_moved(512, 384, S)
    ev = budget_evidence([100] * 60, True, 4096, None, 256, S)
    assert (ev.request_class, ev.max_tokens, ev.budget_tokens, ev.previous_tokens, ev.answers, ev.high_tokens) == (
        "interactive", 4096, 256, None, 60, 100)  # fmt: skip


def test_a_budget_overruns_when_a_real_share_of_the_answers_under_it_reach_it():
    """A rare answer reaching it is what the margin over the high quantile allows; a tenth of them, at
    least eight, say the answers got longer (every one reaches it then)."""
    assert not budget_overrun(0, 500, S) and not budget_overrun(7, 0, S)  # too few to say
    assert budget_overrun(8, 0, S) and budget_overrun(8, 72, S)  # eight: a tenth of 80
    assert not budget_overrun(8, 73, S)
    assert not budget_overrun(5, 495, S)  # 1 %: the quantile's own
    ev = budget_evidence([40] * 60, True, 2000, 256, None, S, overrun=(12, 3))
    assert (ev.budget_tokens, ev.previous_tokens, ev.reached, ev.ended_within) == (None, 256, 12, 3)
    assert budget_evidence([40] * 60, True, 2000, None, 256, S).reached is None


def test_the_budgets_count_what_reached_each_since_it_took_its_value():
    from proxy.request.budgets import OutputBudgets

    b, key = OutputBudgets(), (True, 2000)
    b.note_reached(key, 1.0)  # no budget: nothing to reach
    b.set(key, 256, 2.0)
    assert (b.get(key), b.set_at(key), b.reached(key), b.read_from(key)) == (256, 2.0, 0, float("-inf"))
    b.note_reached(key, 3.0)
    b.note_reached(key, 3.5)
    b.set(key, 256, 4.0)  # the same value: it stands, and so does what reached it
    assert (b.set_at(key), b.reached(key), b.reached(key, since=3.2)) == (2.0, 2, 1)  # over a window too
    b.set(key, 320, 5.0)  # another value: counted afresh
    assert (b.set_at(key), b.reached(key)) == (5.0, 0)
    b.note_reached(key, 6.0)
    b.lift_as_overrun(key, 7.0)
    assert (b.get(key), b.reached(key), b.read_from(key), b.asked(interactive=True)) == (None, 0, 7.0, [])
    assert b.read_from_of(interactive=True)(2000) == 7.0 and b.read_from_of(interactive=False)(2000) == float("-inf")


async def test_beside_interactive_work_the_newest_batch_requests_past_the_pool_s_kv_are_taken_back():
    """The composition: the scrape's pool size and step time and the open requests' prompts and
    max_tokens (no answers yet) give the KV ahead; past the pool, the newest batch requests go back."""
    from proxy.compose import _fast_tier
    from proxy.engines.base import Sample
    from proxy.request.admission import AdmissionQueue, Priority
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board, clock = LoadBoard(), [10.0]
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=20, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: clock[0])  # fmt: skip
    board.subscribe(_fast_tier(board, d))
    load = board.get("w0")

    def scrape(t: float, tokens: float) -> None:
        load.scrape_started()
        board.publish("w0", Sample(time=t, queue=0, running=11, token_usage=0.3, max_total_tokens=12_000,
                                   generation_tokens_total=tokens), None)  # fmt: skip

    scrape(9.0, 0.0)
    batch = [d.submit(Priority.BATCH, 100, prompt_tokens=400, max_tokens=800) for _ in range(10)]
    chat = d.submit(Priority.INTERACTIVE, 100, prompt_tokens=500, max_tokens=300)
    assert all(t.future.done() for t in (*batch, chat))
    scrape(10.0, 1100.0)  # 11 running at 1,100 tokens/s: 0.01 s steps; each has 800 of 800 (or 300) to write
    # ten batch requests head for 1,200 each at their end, and the chat class holds its 800 all along (the
    # next chat requests hold what this one does): 12,800 of 12,000, past the pool, and 0.167 of it past
    # the 0.9 the sizing keeps, which two batch requests' shares (0.1 each) cover: the two newest go back,
    # the batch's limit keeps them out
    taken = [t for t in batch if t.future.result().taken_back]
    assert taken == batch[-2:] and not chat.future.result().taken_back
    assert load.batch_limit == 8
    later = d.submit(Priority.BATCH, 100, prompt_tokens=400, max_tokens=800)
    assert not later.future.done()
    for t in (*batch, chat, later):
        t.future.cancel()


def test_the_fast_tier_s_timings_are_the_constants_on_the_workers_clock():
    """The output budget is the policy's; the timings are the controller's constants, in the engine's
    seconds: a worker whose clock runs 10 x the wall's gets them 10 x shorter, the threshold per token
    as it is."""
    from proxy.control.constants import CONSTANTS
    from proxy.policy import parse_policy

    policy = parse_policy({"control": {"output_budget": False}}, "<t>")
    s = PaceSettings.of(policy.control, clock_rate=10.0, interactive_window_s=7.0)
    k = CONSTANTS
    assert (s.hold_s, s.rate_window_s, s.facts_window_s) == pytest.approx(
        (k.backoff_hold_s / 10, k.rate_window_s / 10, k.facts_window_s / 10)
    )
    assert s.retractions_per_1k_tokens == k.retractions_per_1k_tokens
    assert (s.interactive_hold_s, s.output_budget) == (pytest.approx(0.7), False)
    short = replace(CONSTANTS, backoff_hold_s=0.5)
    assert PaceSettings.of(policy.control, constants=short, interactive_window_s=5.0).hold_s == 0.5
    assert PaceSettings.of(parse_policy({}, "<t>").control, interactive_window_s=5.0) == PaceSettings()


def _composed_on_virtual_time() -> tuple[LoadBoard, Dispatcher]:
    """A board and a dispatcher on the running loop's clock, the fast tier observing the board and the
    chat's first request looking at once, as the composition root wires them."""
    from proxy.compose import _fast_tier, _look_again
    from proxy.request.admission import AdmissionQueue
    from proxy.request.dispatch import Dispatcher
    from proxy.request.pacing import Band, LoadBoard

    board = LoadBoard()
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=asyncio.get_running_loop().time)  # fmt: skip
    observer = _fast_tier(board, d)
    board.subscribe(observer)
    d.on_interactive_spell = _look_again(board, d, observer)
    return board, d


@pytest.mark.looptime
async def test_a_streamed_chat_request_still_waiting_when_its_first_token_is_due_has_a_batch_request_make_room():
    """The composition, on virtual time: chat requests sent to a worker the batch fills are watched; when
    their first token is due (the fast tier's first_token_wait_s), the scrape shows requests waiting at
    the worker and no batch request waits there, the newest batch request running there is taken back
    (they wait for KV room): one per due time for all of them, until the first tokens come; then none.
    With nothing waiting at the worker, nothing is taken back."""
    from proxy.engines.base import Sample
    from proxy.request.admission import Priority

    loop = asyncio.get_running_loop()
    board, d = _composed_on_virtual_time()
    load = board.get("w0")
    batch = [d.submit(Priority.BATCH, 100) for _ in range(4)]
    for t, tokens in ((loop.time() - 1.0, 0.0), (loop.time(), 100.0)):  # four running, 0.04 s steps
        load.scrape_started()
        board.publish("w0", Sample(time=t, queue=0, running=4, token_usage=0.9, generation_tokens_total=tokens), None)
    assert load.first_token_wait_s is None  # no interactive work yet
    chats = [d.submit(Priority.INTERACTIVE, 100) for _ in range(2)]
    wait = load.first_token_wait_s
    assert wait == pytest.approx(S.first_token_steps * 0.04)
    attempts = [c.future.result() for c in chats]
    for a in attempts:
        a.streamed = True
    taken = lambda: [t for t in batch if t.future.result().taken_back]  # noqa: E731
    await asyncio.sleep(wait * 1.1)
    assert taken() == []  # due, but the scrape shows nothing waiting at the worker: not waiting there
    load.scrape_started()  # the two chat requests wait there (the newest sent)
    board.publish(
        "w0", Sample(time=loop.time(), queue=2, running=4, token_usage=0.9, generation_tokens_total=125.0), None
    )
    await asyncio.sleep(wait)
    assert taken() == batch[3:]  # due: the newest batch request makes room, one for both
    await asyncio.sleep(wait)
    assert taken() == batch[2:]  # still waiting: one more
    for a in attempts:
        a.mark_started()
    await asyncio.sleep(wait * 3)
    assert taken() == batch[2:]  # their first tokens came: none more
    for t in (*batch, *chats):
        t.future.cancel()


@pytest.mark.looptime
@pytest.mark.parametrize(("chat_max_tokens", "taken_back"), [(4096, 2), (768, 1), (None, 1)])
async def test_an_overdue_first_token_has_as_many_batch_requests_make_room_as_its_own_size_needs(
    chat_max_tokens: int | None, taken_back: int
) -> None:
    """A chat request waits at the worker for room: at its due time the newest batch requests whose
    prompt and max_tokens cover its own are taken back at once (an engine that reserves a request's
    output admits it only then), at least one; a size not known counts as one request."""
    from proxy.engines.base import Sample
    from proxy.request.admission import Priority

    loop = asyncio.get_running_loop()
    board, d = _composed_on_virtual_time()
    load = board.get("w0")
    batch = [d.submit(Priority.BATCH, 100, prompt_tokens=400, max_tokens=2000) for _ in range(4)]
    for t, tokens in ((loop.time() - 1.0, 0.0), (loop.time(), 100.0)):  # four running, 0.04 s steps
        load.scrape_started()
        board.publish("w0", Sample(time=t, queue=0, running=4, token_usage=0.5, generation_tokens_total=tokens), None)
    chat = d.submit(Priority.INTERACTIVE, 100, prompt_tokens=None if chat_max_tokens is None else 600,
                    max_tokens=chat_max_tokens)  # fmt: skip
    attempt = chat.future.result()
    attempt.streamed = True
    wait = load.first_token_wait_s
    assert wait is not None
    await asyncio.sleep(wait / 2)
    load.scrape_started()  # the chat request waits there
    board.publish(
        "w0", Sample(time=loop.time(), queue=1, running=4, token_usage=0.5, generation_tokens_total=102.0), None
    )
    await asyncio.sleep(wait * 0.6)
    assert [t for t in batch if t.future.result().taken_back] == batch[4 - taken_back :]
    for t in (*batch, chat):
        t.future.cancel()
