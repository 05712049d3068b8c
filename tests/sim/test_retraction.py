"""Retraction when the next decode step does not fit: order, requeue, ratio, warning line."""

from __future__ import annotations

import re

import pytest

from proxy.sim.ratio import ratio_after_retract
from proxy.sim.request import Req, RequestSpec, State
from proxy.sim.running import RunningBatch
from proxy.sim.virtual import simulate
from tests.sim.helpers import config, engine, unique_prompt

RETRACT_RE = re.compile(
    r"^KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+), #new_tokens_gained: (-?\d+), "
    r"#new_token_ratio: (\d\.\d{4}) -> (\d\.\d{4})$"
)


def test_long_ignore_eos_outputs_past_the_clip_retract() -> None:
    """ignore_eos reserves min(max_new, 4096): outputs of 6000 tokens outgrow what was reserved."""
    cfg = config("--max-total-tokens", "20000")
    res = simulate(cfg, [RequestSpec(prompt_len=100, max_new_tokens=6000, ignore_eos=True) for _ in range(8)])
    assert res.retractions > 0
    assert res.finished == 8
    assert all(r.output_tokens == 6000 and r.finish_reason == "length" for r in res.requests)
    assert any(r.num_retractions > 0 for r in res.requests)


def _mixed(n: int) -> list[RequestSpec]:
    """One request in three stops early by EOS: finishes come staggered and re-open admission, at a
    ratio that has decayed meanwhile, while the long ones keep growing."""
    return [
        RequestSpec(arrival=i * 0.05, prompt_len=200, max_new_tokens=1500, output_len=100 if i % 3 == 0 else 1500)
        for i in range(n)
    ]


def test_small_pool_long_outputs_retract_and_recompute() -> None:
    logs: list[str] = []
    cfg = config("--max-total-tokens", "12000")
    wl = _mixed(60)
    res = simulate(cfg, wl, log=lambda level, msg: logs.append(msg))
    assert res.retractions > 0 and res.finished == 60
    lines = [m for m in logs if m.startswith("KV cache pool is full")]
    assert lines and all(RETRACT_RE.match(m) for m in lines)
    # every request still delivers its whole output, retracted ones after a recompute
    assert sum(r.output_tokens for r in res.requests) == sum(s.output_len for s in wl)
    # no decode step ran over the pool
    assert max(p.token_usage for p in res.trace) <= 1.0


def test_retraction_order_ratio_and_requeue() -> None:
    logs: list[str] = []
    eng = engine("--max-total-tokens", "3000", "--decode-log-interval", "1000", logs=logs)
    first = eng.add(prompt_ids=unique_prompt(100, 0), max_new_tokens=2000, output_len=2000)
    t = 0.0
    while eng.decode_steps < 50:
        step = eng.plan(t)
        t += step.duration
        eng.complete(step, t)
    # Both late requests are admitted together (the first's remaining tokens are discounted by the
    # decayed ratio), so at the retraction they have the same number of outputs.
    short_prompt = eng.add(prompt_ids=unique_prompt(100, 1), max_new_tokens=1200, output_len=1200)
    long_prompt = eng.add(prompt_ids=unique_prompt(300, 2), max_new_tokens=1200, output_len=1200)
    while True:
        step = eng.plan(t)  # a retraction happens while planning the decode step
        if eng.retracted_total:
            break
        t += step.duration
        eng.complete(step, t)
    line = next(m for m in logs if m.startswith("KV cache pool"))
    n, gained, old, new = RETRACT_RE.match(line).groups()
    # the two late requests have the fewest outputs; of those, the longest prompt goes first
    assert long_prompt.num_retractions == 1
    assert first.num_retractions == 0
    retracted = [r for r in (first, short_prompt, long_prompt) if r.num_retractions]
    assert retracted[0] is long_prompt and int(n) == len(retracted)
    assert all(r.state is State.WAITING and r in eng.waiting for r in retracted)
    assert all(
        r.fill_ids[: r.prompt_len] == r.prompt_ids and len(r.fill_ids) == r.prompt_len + r.out_base for r in retracted
    )
    remaining = eng.running
    expected = ratio_after_retract(
        sum(eng.output_len(r) for r in remaining), len(remaining), sum(r.max_new for r in remaining)
    )
    assert eng.ratio == pytest.approx(expected)
    assert float(new) == pytest.approx(expected, abs=1e-4)
    assert float(old) < 0.7
    assert int(gained) > 0


def test_higher_conservativeness_retracts_less() -> None:
    wl = _mixed(90)
    low = simulate(config("--max-total-tokens", "30000", "--schedule-conservativeness", "0.3"), wl)
    high = simulate(config("--max-total-tokens", "30000", "--schedule-conservativeness", "1.3"), wl)
    assert low.retractions > high.retractions


def test_a_replay_stops_at_its_step_bound_and_says_it_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that gets done takes about a step per output token at most; a replay past its bound stops
    there, ``stalled``. The retracting workload above ends well within the bound; with a bound of one
    step per request it stops."""
    import proxy.sim.virtual as virtual

    specs = _mixed(30)
    cfg = config("--max-total-tokens", "6000")
    done = simulate(cfg, specs)
    assert done.retractions > 0 and done.finished == 30 and not done.stalled
    assert done.steps < virtual.step_bound(specs) / 4
    monkeypatch.setattr(virtual, "STEPS_PER_OUTPUT_TOKEN", 0)
    monkeypatch.setattr(virtual, "STEPS_PER_REQUEST", 1)
    cut = simulate(cfg, specs)
    assert cut.stalled and "step bound" in cut.stalled and cut.steps == 30 and cut.finished < 30


def test_an_engine_stuck_on_empty_steps_stops_after_a_thousand(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose rounds run nothing (its batch retracted, the pool unable to take a prompt's next
    chunk) and never get unstuck: the replay stops after EMPTY_STEPS of them in a row, ``stalled``, not
    millions later (a planner's replay took 3.9 million such steps)."""
    import proxy.sim.virtual as virtual
    from proxy.sim.engine import Engine, Step

    class Stuck(Engine):
        def plan(self, now: float) -> Step | None:
            step = super().plan(now)
            return Step(kind="decode", duration=1e-6, batch_size=0) if self.retracted_total else step

    monkeypatch.setattr(virtual, "Engine", Stuck)
    res = simulate(config("--max-total-tokens", "6000"), _mixed(30))
    assert res.stalled and "ran nothing" in res.stalled and res.finished < 30
    assert virtual.EMPTY_STEPS <= res.steps < virtual.EMPTY_STEPS + 2000


def test_a_request_retracted_and_back_a_step_later_finishes_once() -> None:
    """Retracted at decode step g and in the batch again at g + 1 (its prefill samples one token), it
    finishes at the same step as before: two entries in the batch's finishing heap, one finish. Counted
    twice, the batch's count fell below its requests and the engine planned empty decode steps forever
    (prefix-shared's paced replay at memory fraction 0.5)."""
    batch = RunningBatch()
    r = Req(rid="r", seq=0, arrival=0.0, prompt_ids=(1, 2, 3), max_new=10, ignore_eos=False, target=10, token_seed=0)
    r.out_base = 1
    batch.join(r)  # finishes at step 9
    for _ in range(3):
        assert batch.advance() == []
    batch.leave(r)  # retracted at step 3 with 4 tokens written
    batch.drop({r})
    batch.advance()  # step 4 without it
    r.out_base += 1  # its prefill again samples one more token
    batch.join(r)  # finishes at 4 + (10 - 5) = 9: the same step
    done = [d for _ in range(5) for d in batch.advance()]
    assert done == [r] and batch.output_len(r) == 10
