"""The residency loop's time: `now()` and timers, from one object the loop is given.

The controller never reads the clock or arms a timer any other way, so its tests drive time with a
`ManualClock` (advance it; the timers that come due run, in order) instead of sleeping."""

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` on the loop once `now()` reaches `when`."""
        ...


class MonotonicClock:
    """Wall time: `time.monotonic()`, timers on the running asyncio loop."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), callback)


class _ManualTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Time that moves only when told (`advance`): for tests of the loop."""

    def __init__(self, start: float = 1000.0):
        self.t = start
        self._timers: list[tuple[float, int, _ManualTimer, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, running every timer that comes due on the way, at its own time."""
        end = self.t + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, callback = heapq.heappop(self._timers)
            self.t = max(self.t, when)
            if not timer.cancelled:
                callback()
        self.t = end


async def until(clock: "Clock", event: asyncio.Event, timeout_s: float) -> None:
    """Wait for `event`, at most `timeout_s` on `clock`."""
    done = asyncio.get_running_loop().create_future()

    def fire(*_: object) -> None:
        if not done.done():
            done.set_result(None)

    timer = clock.call_at(clock.now() + timeout_s, fire)
    waiter = asyncio.get_running_loop().create_task(event.wait())
    waiter.add_done_callback(fire)
    try:
        await done
    finally:
        timer.cancel()
        waiter.cancel()
