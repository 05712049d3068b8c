"""PrefillAdder-like admission: reservations, slots, prefill and chunk budgets."""

from __future__ import annotations

from proxy.sim.request import RequestSpec, State
from proxy.sim.virtual import simulate
from tests.sim.helpers import config, engine, run_until, unique_prompt


def _add(
    eng,
    n: int,
    *,
    prompt: int = 100,
    max_new: int = 3000,
    out: int | None = None,
    ignore_eos: bool = False,
    salt: int = 0,
):
    return [
        eng.add(
            prompt_ids=unique_prompt(prompt, salt + i),
            max_new_tokens=max_new,
            output_len=out if out is not None else max_new,
            ignore_eos=ignore_eos,
        )
        for i in range(n)
    ]


def test_new_requests_reserve_full_max_new_running_ones_ratio_times_remaining() -> None:
    eng = engine("--max-total-tokens", "10000")
    reqs = _add(eng, 4)
    step = eng.plan(0.0)
    # each new request needs 100 + 3000 + 1: three fit in 10000, the fourth does not
    assert step is not None and step.kind == "prefill"
    assert [it.req for it in step.items] == reqs[:3]
    assert eng.batch_is_full and reqs[3].state is State.WAITING
    eng.complete(step, step.duration)
    # running: 3 x (3000 - 1) x 0.7 = 6297.9 reserved; free 9700 -> 3402 left >= 3101: admitted
    assert eng.running_reservation() == 3 * 2999 * 0.7
    eng.batch_is_full = False  # SGLang clears it when the batch changes; here: the next round
    step = eng.plan(step.duration)
    assert step is not None and [it.req for it in step.items] == [reqs[3]]


def test_ignore_eos_reserves_at_ratio_one() -> None:
    eng = engine("--max-total-tokens", "10000")
    _add(eng, 3, ignore_eos=True)
    step = eng.plan(0.0)
    eng.complete(step, step.duration)
    assert eng.running_reservation() == 3 * 2999


def test_lower_conservativeness_admits_more() -> None:
    """Requests that stop early (EOS at 5% of max_new_tokens): 0.3 packs the pool fuller than 1.3."""

    def peak(c: str) -> tuple[int, float]:
        cfg = config("--max-total-tokens", "40000", "--schedule-conservativeness", c)
        wl = [RequestSpec(arrival=i * 0.01, prompt_len=200, max_new_tokens=2000, output_len=100) for i in range(400)]
        res = simulate(cfg, wl)
        assert res.finished == 400
        return max(p.running for p in res.trace), res.makespan_s

    low, high = peak("0.3"), peak("1.3")
    assert low[0] > high[0] * 1.5
    assert low[1] < high[1]


def test_max_running_requests_slots() -> None:
    eng = engine("--max-running-requests", "5", "--max-total-tokens", "100000")
    _add(eng, 20, max_new=50)
    run_until(eng, lambda: eng.decode_steps >= 3)
    assert eng.n_run == 5 and len(eng.waiting) == 15


def test_max_prefill_tokens_without_chunking_first_request_always_allowed() -> None:
    eng = engine("--chunked-prefill-size", "-1", "--max-prefill-tokens", "1000", "--max-total-tokens", "100000")
    _add(eng, 3, prompt=400, max_new=10)
    step = eng.plan(0.0)
    assert [it.take for it in step.items] == [400, 400]  # the third (400 >= 200 left) waits
    eng2 = engine("--chunked-prefill-size", "-1", "--max-prefill-tokens", "1000", "--max-total-tokens", "100000")
    _add(eng2, 2, prompt=3000, max_new=10)
    step = eng2.plan(0.0)
    assert [it.take for it in step.items] == [3000]  # larger than the budget, but first


def test_chunked_prefill_one_chunked_request_at_a_time() -> None:
    eng = engine("--chunked-prefill-size", "8192", "--max-total-tokens", "200000")
    big = eng.add(prompt_ids=unique_prompt(20000, 1), max_new_tokens=10, output_len=10)
    small = eng.add(prompt_ids=unique_prompt(100, 2), max_new_tokens=10, output_len=10)
    takes = []
    t = 0.0
    for _ in range(3):
        step = eng.plan(t)
        takes.append([(it.req, it.take, it.last) for it in step.items])
        t += step.duration
        eng.complete(step, t)
    assert takes[0] == [(big, 8192, False)]
    assert takes[1] == [(big, 8192, False)]
    # the last chunk (3616) leaves budget: the small request joins the same batch
    assert takes[2] == [(big, 3616, True), (small, 100, True)]
    assert big.state is State.RUNNING and big.first_token_time == t


def test_chunk_reserves_no_output_tokens_until_its_last_chunk() -> None:
    eng = engine("--chunked-prefill-size", "1000", "--max-total-tokens", "10000")
    r = eng.add(prompt_ids=unique_prompt(2500, 3), max_new_tokens=2000, output_len=2000)
    step = eng.plan(0.0)
    assert step.items[0].take == 1000 and not step.items[0].last
    assert eng.chunked is r
    eng.complete(step, step.duration)
    assert eng.private_tokens == 1000 or eng.cache.total_size == 1000
