"""A plan's reason in words, written from its verdict (:mod:`proxy.control.verdict`) alone.

The journal and the console say why the planner restarted a worker or did not: the figures the
verdict weighed (the gain and what it accrues over, the restart's cost, the twin's error, the waiting
saved and added) in one sentence for each :class:`~proxy.control.verdict.Why`. Nothing here decides.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.control.economics import ERROR_LOOKS, PlanSettings
from proxy.control.twin import Prediction
from proxy.control.verdict import Verdict, Why
from proxy.control.waiting import WaitingPlan

__all__ = ["explain"]


def _accrual(accrues_s: float, settings: PlanSettings) -> str:
    """Why a throughput gain accrues over less than the horizon, for the plan's reason ("": the horizon)."""
    if accrues_s >= settings.horizon_s:
        return ""
    return f" (of the {settings.horizon_s:g} s horizon: the work waiting is gone by then)"


def _moved(args: Mapping[str, object], to: Prediction) -> str:
    moved = [f"{k} {args.get(k)} -> {v}" for k, v in to.args.items() if args.get(k) != v]
    return ", ".join(moved + [f"{k} {v} -> unset" for k, v in args.items() if k not in to.args])


def _waiting_reason(v: Verdict, waiting: WaitingPlan, args: Mapping[str, object], settings: PlanSettings) -> str:
    quicker, saved, paid, utilization = waiting.quicker, waiting.saved_s, waiting.cost_s, waiting.utilization
    assert v.current.mean_answer_s is not None and quicker.mean_answer_s is not None
    return (
        f"{_moved(args, quicker)}: the same tokens answered sooner (mean answer {v.current.mean_answer_s:.1f} -> "
        f"{quicker.mean_answer_s:.1f} s), {saved:.0f} request-seconds of waiting saved over "
        f"{settings.horizon_s:g} s{waiting.over_looks} {'>' if saved > paid else '<='} {paid:.0f} the restart adds"
        + ("" if utilization is None else f" (the worker {utilization:.0%} busy: the outage's queue drains slowly)")
        + _held_up(settings)
    )


def explain(v: Verdict, args: Mapping[str, object], settings: PlanSettings, earlier_errors: int = 0) -> str:
    """The plan's reason, in words, from its verdict; ``earlier_errors``: how many earlier looks the
    twin's error is read over."""
    if v.why is Why.WAITING_PAYS:
        assert v.waiting is not None
        return _waiting_reason(v, v.waiting, args, settings)
    gain, accrual = f"{v.gain:+.1%}", f"{round(v.accrues_s, 1):g} s{_accrual(v.accrues_s, settings)}"
    if v.why is Why.NO_BETTER:
        reason = "no candidate beats the current arguments on the recent workload"
    elif v.why is Why.UNTRUSTED:
        looks = min(ERROR_LOOKS, earlier_errors + (v.now_error is not None))
        reason = (
            f"predicted gain {gain} would pay a restart, but the twin misses what the worker did on the same "
            f"requests by {v.error or 0.0:.1%}"
            + (f" (the median of its last {looks} looks; {v.now_error or 0.0:.1%} on this one)" if looks > 1 else "")
            + ": no restart on it"
        )
    elif v.why is Why.NOTHING_WAITS:
        reason = (
            f"predicted gain {gain}, but nothing waits for the worker: a throughput gain accrues only while work waits"
        )
    elif v.why is Why.DOES_NOT_PAY:
        reason = f"predicted gain {gain} x {accrual} = {v.gain_tokens:.0f} tokens does not pay a restart ({v.cost_tokens:.0f} tokens)"
    else:
        note = ""
        if v.roomier_behind is not None:
            note = (
                f" (with the band's larger KV pool, which the twin puts {v.roomier_behind:+.1%} on these requests: "
                "inside what it cannot tell)"
            )
        if v.paying_looks > 1:
            note += (
                f" (its mean over {v.paying_looks} looks that say a restart pays; {v.this_look_gain:+.1%} on this one)"
            )
        reason = (
            f"{_moved(args, v.best)}: predicted gain {gain} ({v.base:.0f} -> {v.weighed:.0f} tok/s) x {accrual} = "
            f"{v.gain_tokens:.0f} tokens > restart cost {v.cost_tokens:.0f} tokens{note}"
        )
    if v.peer is not None:
        p = v.peer
        reason += (f"; the gain measured on {', '.join(p.peers)}, which run these arguments: {p.peers_rate:.0f} tok/s "
                   f"against {p.own_rate:.0f} here, with work waiting for it {p.own_busy:.0%} of the time")  # fmt: skip
    if v.waiting is not None:
        reason += f"; waiting: {v.waiting.saved_s:.0f} request-seconds saved{v.waiting.over_looks} <= {v.waiting.cost_s:.0f} the restart adds"
        if v.waiting.utilization is not None:
            reason += f" (the worker {v.waiting.utilization:.0%} busy)"
        reason += _held_up(settings)
    return reason


def _held_up(settings: PlanSettings) -> str:
    """What a waiting-basis reason adds of the requests held for the worker in the proxy's queue."""
    if settings.queued < 1:
        return ""
    return f" ({settings.queued:.0f} waiting for it in the proxy's queue among those it holds up)"
