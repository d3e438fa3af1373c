"""The residency loop's event log: what happened, numbered, in order, with a bounded memory (GET
/v1/cluster/events reads it; the console streams it; a restarted controller goes on from the
operator's store's copy of it)."""

import asyncio
import itertools
from collections import deque

from deployments.wire.events import ClusterEvent


class EventLog:
    def __init__(self, max_events: int = 2000):
        self._events: deque[ClusterEvent] = deque(maxlen=max_events)
        self._seq = itertools.count(1)
        self.recorded = asyncio.Event()  # set (and replaced) by every event written: wakes a long poll

    def next_seq(self) -> int:
        return next(self._seq)

    def write(self, event: ClusterEvent) -> None:
        self._events.append(event)
        self.recorded.set()
        self.recorded = asyncio.Event()

    def since(self, seq: int = 0) -> list[ClusterEvent]:
        return [e for e in self._events if e.seq > seq]

    def has_after(self, seq: int) -> bool:
        return bool(self._events) and self._events[-1].seq > seq

    def restore(self, events: list[ClusterEvent]) -> None:
        """A previous controller's log: numbering goes on after it."""
        self._events.extend(events)
        if events:
            self._seq = itertools.count(max(e.seq for e in events) + 1)
