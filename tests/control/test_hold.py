"""The hold at the CUDA graphs, priced by the planner's twin: a worker whose engine admits past its
graphs near its capacity answers sooner held at their batch; a backlog of the same answers writes
more with the larger batch. Recorded as the simulator served them."""

from __future__ import annotations

import random
from dataclasses import replace

from proxy.control.hold import hold_loses, hold_pays, price_hold
from proxy.control.planner import Observed, Prediction, Twin, continued, replay
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate

GPU, MODEL = "a100-40gb", "llama-3.1-8b"
# graphs up to 160; conservativeness 0.3 and answers sent with max_tokens 768 (an output budget): the
# engine admits past the graphs
ARGS = {"model_path": "m", "schedule_conservativeness": 0.3, "sim_gpu": GPU, "sim_model": MODEL,
        "cuda_graph_max_bs_decode": 160}  # fmt: skip


def _priced(every_s: float, count: int = 900):
    rng = random.Random(7)
    sent = [Observed(arrived=i * every_s, prompt_tokens=rng.randint(200, 600), output_tokens=rng.randint(100, 400),
                     max_tokens=768) for i in range(count)]  # fmt: skip
    twin = Twin(GPU, MODEL)
    specs = [RequestSpec(arrival=o.arrived, prompt_len=o.prompt_tokens, max_new_tokens=o.max_tokens,
                         output_len=o.output_tokens) for o in sent]  # fmt: skip
    res = simulate(twin.config(ARGS), specs)
    served = [replace(o, finished=r.finish_time) for o, r in zip(sent, res.requests, strict=True)]
    loaded = continued(replay(served[-300:], served), 600.0)
    current = twin.predict(ARGS, loaded)
    return current, price_hold(twin, ARGS, loaded, current, 0.03)


def test_near_its_capacity_the_worker_held_at_its_graphs_answers_sooner():
    current, price = _priced(every_s=1 / 8)
    assert current.peak_running > 160
    assert price is not None and price.at == 160 and price.pays and not price.loses, price
    assert (price.held.mean_answer_s or 0.0) < (current.mean_answer_s or 0.0)
    assert price.held.peak_running <= 160


def test_a_backlog_writes_more_with_the_larger_batch_and_is_not_held():
    current, price = _priced(every_s=0.001)
    assert price is not None and price.loses and not price.pays, price
    assert price.held.output_tok_per_s < current.output_tok_per_s


def test_a_worker_that_never_ran_past_its_graphs_is_not_priced():
    current, price = _priced(every_s=0.5, count=300)  # a request every half second: a small batch
    assert current.peak_running <= 160 and price is None


def _p(tok_per_s: float, answer_s: float | None, oom: str | None = None) -> Prediction:
    return Prediction(args={}, output_tok_per_s=tok_per_s, mean_queue_s=None, mean_answer_s=answer_s,
                      makespan_s=1.0, retractions=0, oom=oom)  # fmt: skip


def test_a_hold_pays_by_tokens_or_by_the_same_tokens_answered_sooner():
    now = _p(100.0, 10.0)
    assert hold_pays(_p(104.0, 10.0), now, 0.03)  # 4 % more tokens
    assert not hold_pays(_p(102.0, 10.0), now, 0.03)  # 2 %: inside the twin's noise
    assert hold_pays(_p(98.0, 9.0), now, 0.03)  # as many, 10 % sooner
    assert not hold_pays(_p(96.0, 9.0), now, 0.03)  # 4 % fewer
    assert not hold_pays(_p(100.0, None), now, 0.03)  # no answer times to compare
    # in a backlog (work waits throughout) throughput alone counts
    assert not hold_pays(_p(98.0, 9.0), now, 0.03, backlog=True) and hold_pays(_p(104.0, 9.0), now, 0.03, backlog=True)
    assert not hold_pays(_p(200.0, 5.0, oom="decode"), now, 0.03)  # the held replay died


def test_a_hold_loses_by_fewer_tokens_or_the_same_answered_later_and_between_says_neither():
    now = _p(100.0, 10.0)
    assert hold_loses(_p(96.0, 9.0), now, 0.03)  # 4 % fewer tokens, however soon
    assert hold_loses(_p(100.0, 10.5), now, 0.03)  # as many, 5 % later
    assert hold_loses(_p(200.0, 5.0, oom="decode"), now, 0.03)
    assert not hold_loses(_p(100.0, 10.5), now, 0.03, backlog=True) and hold_loses(
        _p(96.0, 9.0), now, 0.03, backlog=True
    )
    # inside the noise both ways: neither pays nor loses (the worker is left as it is)
    assert not hold_loses(_p(98.0, 10.1), now, 0.03) and not hold_pays(_p(98.0, 10.1), now, 0.03)
