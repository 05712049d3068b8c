"""A clock a test sets by hand: ``clock()`` reads ``clock.now``; the test moves it."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
