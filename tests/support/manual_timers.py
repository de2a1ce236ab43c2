"""Stands in for `loop.call_later`: a callback runs only when the test fires it.

    timers = ManualTimers()
    thing = RedisBatch(..., call_later=timers.call_later)
    ...
    assert timers.armed == [0.01]   # one callback waiting, due in 10 ms
    timers.fire()                   # run every armed callback now
"""

from __future__ import annotations

from collections.abc import Callable


class ManualTimer:
    def __init__(self, delay: float, callback: Callable[[], None]) -> None:
        self.delay = delay
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    def __init__(self) -> None:
        self._timers: list[ManualTimer] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> ManualTimer:
        timer = ManualTimer(delay, callback)
        self._timers.append(timer)
        return timer

    @property
    def armed(self) -> list[float]:
        """The delays of the callbacks not yet fired nor cancelled."""
        return [t.delay for t in self._timers if not t.cancelled]

    def fire(self) -> int:
        """Run every armed callback (in the order armed); returns how many ran."""
        due, self._timers = [t for t in self._timers if not t.cancelled], []
        for timer in due:
            timer.callback()
        return len(due)
