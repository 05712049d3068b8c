"""One worker's output budgets and what was seen under each (:mod:`proxy.request.continuation`).

A budget is kept per class and ``max_tokens`` asked (:data:`BudgetKey`): the ``max_tokens`` plain
requests of that kind are sent to the worker with. The fast tier sets it from what whole answers
wrote (:func:`proxy.control.fast_tier.output_budget`), and those come in only once an answer has
ended, all its parts. When the answers get longer than the budget, every one of them reaches it,
is continued at the back of the engine's queue and goes on part by part beside all the others:
none ends, so no new evidence arrives, while every answer takes several round trips through the
queue. So the relay also notes each answer
whose first part reached its budget, the moment it does (:meth:`OutputBudgets.note_reached`): the
budget's own overrun, read at the next look (:func:`proxy.control.fast_tier.budget_overrun`).
A budget lifted on it is set again only from answers that arrived after the lift
(:meth:`OutputBudgets.read_from`): the earlier, shorter ones no longer say what is written.
While the controller measures a budget it holds it back a while (:meth:`OutputBudgets.hold_back`):
the requests go as they went before it, the budget itself kept.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["BudgetKey", "OutputBudgets"]

BudgetKey = tuple[bool, int]  # (interactive class?, max_tokens asked)
_KEEP_REACHED = 512


class OutputBudgets:
    """The budgets of one worker by :data:`BudgetKey`, when each took its value, and the answers
    that reached it since."""

    __slots__ = ("_held", "_reached", "_read_from", "_set_at", "_tokens")

    def __init__(self) -> None:
        self._tokens: dict[BudgetKey, int] = {}
        self._held: dict[BudgetKey, int | None] = {}  # held back to this while measured (None: as asked)
        self._set_at: dict[BudgetKey, float] = {}
        self._read_from: dict[BudgetKey, float] = {}
        self._reached: dict[BudgetKey, deque[float]] = {}

    def get(self, key: BudgetKey) -> int | None:
        """The ``max_tokens`` such a request goes with (None: as asked)."""
        return self._tokens.get(key)

    def sent_with(self, key: BudgetKey) -> int | None:
        """The ``max_tokens`` such a request is sent with now: the budget, or what it is held back to."""
        return self._held[key] if key in self._held else self._tokens.get(key)

    def hold_back(self, key: BudgetKey, tokens: int | None) -> None:
        """Send such requests with ``tokens`` (None: as asked) until :meth:`release`, the budget kept."""
        self._held[key] = tokens

    def release(self, key: BudgetKey) -> None:
        """Send such requests at the budget again."""
        self._held.pop(key, None)

    def asked(self, *, interactive: bool) -> list[int]:
        """The ``max_tokens`` asked that the class has a budget for."""
        return [asked for (i, asked) in self._tokens if i is interactive]

    def items(self) -> Iterator[tuple[BudgetKey, int]]:
        return iter(sorted(self._tokens.items()))

    def set(self, key: BudgetKey, tokens: int | None, now: float) -> None:
        """The budget from now (None: lifted, and no longer held back); what reached the old one no
        longer counts."""
        if self._tokens.get(key) == tokens:
            return
        if tokens is None:
            self._tokens.pop(key, None)
            self._held.pop(key, None)
        else:
            self._tokens[key] = tokens
        self._set_at[key] = now
        self._reached.pop(key, None)

    def lift_as_overrun(self, key: BudgetKey, now: float) -> None:
        """Lift the budget because answers reach it: it is read again only from answers that arrive
        from now on."""
        self.set(key, None, now)
        self._read_from[key] = now

    def note_reached(self, key: BudgetKey, now: float) -> None:
        """An answer's first part, sent under the budget, reached it (it goes on in another part). Not
        counted while the budget is held back: what reaches the cap it is held back to (a moved
        budget's earlier one) says nothing of the budget's own."""
        if key in self._tokens and key not in self._held:
            self._reached.setdefault(key, deque(maxlen=_KEEP_REACHED)).append(now)

    def reached(self, key: BudgetKey, since: float = -math.inf) -> int:
        """The answers that reached the budget since it took its value, at ``since`` or later."""
        return sum(1 for t in self._reached.get(key, ()) if t >= since)

    def set_at(self, key: BudgetKey) -> float:
        """When the budget took its value (-inf: never set)."""
        return self._set_at.get(key, -math.inf)

    def read_from(self, key: BudgetKey) -> float:
        """The budget is read from answers that arrived at this time or later (-inf: all)."""
        return self._read_from.get(key, -math.inf)

    def read_from_of(self, *, interactive: bool) -> Callable[[int], float]:
        """:meth:`read_from` of the class, by the ``max_tokens`` asked."""
        return lambda asked: self.read_from((interactive, asked))
