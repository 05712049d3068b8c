"""The worker's queue at or past its engine's prefix limit, priced by the planner's twin: unique
prompts under lpm write more past the limit (no prefix matching, as fcfs); prompts that share system
prompts write more at it (ordered by prefix). Recorded as the simulator served them."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from proxy.control.planner import Observed, Prediction, Twin, continued, replay
from proxy.control.queue_side import QueuePrice, may_share, price_queue
from proxy.sim.virtual import simulate

SIDES = (128, 256)  # SGLang's lpm limit, and the gate's queue past it


def _priced(gpu: str, model: str, shared: bool, count: int, error: float | None = None, sharing: bool = True):
    args = {"model_path": "m", "schedule_policy": "lpm", "sim_gpu": gpu, "sim_model": model}
    rng = random.Random(5)
    if shared:  # 48 system prompts of 3,000 tokens (more than the KV pool keeps) behind short questions
        sent = [Observed(arrived=0.0, prompt_tokens=3000 + rng.randint(50, 200), output_tokens=rng.randint(50, 200),
                         max_tokens=512, prefix_key=rng.randrange(48), cached_tokens=3000) for _ in range(count)]  # fmt: skip
    else:  # unique prompts of 2,000-4,000 tokens
        sent = [Observed(arrived=0.0, prompt_tokens=rng.randint(2000, 4000), output_tokens=rng.randint(100, 400),
                         max_tokens=512, cached_tokens=0) for _ in range(count)]  # fmt: skip
    twin = replace(Twin(gpu, model), queue_cap=SIDES[0], gate_period_s=0.5)
    specs = [replace(o.here, shared=(o.prefix_key, 3000) if o.prefix_key is not None else None) for o in sent]
    res = simulate(twin.config(args), specs, queue_cap=SIDES[0], gate_period_s=0.5)
    served = [replace(o, finished=r.finish_time) for o, r in zip(sent, res.requests, strict=True)]
    loaded = continued(replay(served, served), 600.0)
    current = twin.predict(args, loaded)
    return current, price_queue(twin, args, loaded, current, SIDES, 0.03, error=error, backlog=True, sharing=sharing)


def test_unique_prompts_under_lpm_write_more_with_the_queue_past_its_limit():
    current, price = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=1200)
    assert price is not None and price.pays and not price.loses, price
    assert price.at_limit is current  # the gate's queue now: not replayed again
    assert price.past_limit.output_tok_per_s > 1.03 * current.output_tok_per_s


def test_the_queue_goes_past_the_limit_only_on_a_gain_beyond_the_twins_error_and_comes_back_on_any_loss():
    _, trusted = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=1200, error=0.1)
    _, doubted = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=1200, error=0.5)
    assert trusted is not None and trusted.pays
    assert doubted is not None and not doubted.pays and not doubted.loses
    _, shared = _priced("a100-40gb", "llama-3.1-8b", shared=True, count=1200, error=0.5)
    assert shared is not None and shared.loses


def test_where_nothing_is_shared_the_queue_goes_past_the_limit_unless_the_twin_prices_a_loss():
    """lpm has nothing to order by: past its limit only saves the matching, whatever the twin's error,
    and a replay whose queue never reaches the limit (both sides alike) does not hold it back."""
    _, unshared = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=1200, error=0.5, sharing=False)
    assert unshared is not None and unshared.pays
    _, few = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=30, sharing=False)
    _, few_doubted = _priced("h200-141gb", "llama-3.2-1b", shared=False, count=30)
    assert few is not None and few_doubted is not None
    assert few.past_limit.output_tok_per_s == few.at_limit.output_tok_per_s
    assert few.pays and not few_doubted.pays and not few.loses


@dataclass(frozen=True)
class _Sides:
    """A twin whose two sides are given: past the limit more tokens, answered later."""

    queue_cap: int | None = SIDES[0]

    def predict(self, args, loaded) -> Prediction:
        past = self.queue_cap == SIDES[1]
        return Prediction(args={}, output_tok_per_s=130.0 if past else 100.0, mean_queue_s=None, makespan_s=1.0,
                          retractions=0, mean_answer_s=12.0 if past else 10.0)  # fmt: skip


def test_where_nothing_is_shared_only_fewer_tokens_keep_the_queue_at_the_limit():
    twin = _Sides()
    current = twin.predict({}, None)
    shared = price_queue(twin, {}, replay([]), current, SIDES, 0.03)  # type: ignore[arg-type]
    unshared = price_queue(twin, {}, replay([]), current, SIDES, 0.03, sharing=False)  # type: ignore[arg-type]
    assert shared is not None and shared.loses  # answered later, outside a backlog
    assert unshared is not None and unshared.pays and not unshared.loses


def test_a_look_may_share_prefixes_where_its_replay_carries_a_shared_head_or_no_cached_tokens_are_reported():
    own = [Observed(arrived=0.0, prompt_tokens=3000, output_tokens=100, max_tokens=512, cached_tokens=0,
                    finished=1.0, prefix_key=k) for k in range(4)]  # fmt: skip
    assert not may_share(replay(own), own)
    unreported = [replace(o, cached_tokens=None) for o in own]
    assert may_share(replay(unreported), unreported)
    pair = [replace(o, prefix_key=7, cached_tokens=2000 * (i % 2)) for i, o in enumerate(own)]
    assert may_share(replay(pair), pair)


def test_shared_system_prompts_write_more_at_the_limit_where_lpm_orders_them():
    current, price = _priced("a100-40gb", "llama-3.1-8b", shared=True, count=1200)
    assert price is not None and price.loses and not price.pays, price
    assert price.past_limit.output_tok_per_s < current.output_tok_per_s


def test_an_engine_without_a_prefix_limit_is_not_priced():
    twin = Twin("a100-40gb", "llama-3.1-8b")
    sent = [Observed(arrived=0.1 * i, prompt_tokens=300, output_tokens=100, max_tokens=512, finished=0.1 * i + 2)
            for i in range(50)]  # fmt: skip
    args = {"model_path": "m", "sim_gpu": "a100-40gb", "sim_model": "llama-3.1-8b"}
    current = twin.predict(args, replay(sent))
    assert price_queue(twin, args, replay(sent), current, None, 0.03) is None


def test_the_side_the_gate_keeps_after_a_look_is_the_one_the_look_priced_else_the_one_it_keeps_now():
    """The hold at the graphs is priced against it (a hold leaves next to nothing waiting at the engine)."""
    twin = replace(Twin("h200-141gb", "llama-3.2-1b"), queue_cap=SIDES[0])
    at, past = (Prediction(args={}, output_tok_per_s=tp, mean_queue_s=None, makespan_s=1.0, retractions=0)
                for tp in (100.0, 110.0))  # fmt: skip
    pays = QueuePrice(at=SIDES[0], past=SIDES[1], at_limit=at, past_limit=past, pays=True, loses=False)
    loses, neither = replace(pays, pays=False, loses=True), replace(pays, pays=False)
    deep = replace(twin, queue_cap=SIDES[1])
    assert pays.kept(twin) == (deep, past) and pays.kept(deep) == (deep, past)
    assert loses.kept(deep) == (twin, at)
    assert neither.kept(twin) == (twin, at) and neither.kept(deep) == (deep, past)
