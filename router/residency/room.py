"""Unload, then load (rule X1): placements that wait for the room they were promised.

A placement on a node where instances are stopping (its victims, unloads), or where a stop could
not confirm its process gone, loads nothing until every such stop has confirmed its exit and a
node report asked for after that measures the free memory for it and every other placement
waiting there; at most `exit_wait_s`, then it fails (`no_room`) having loaded nothing. A Mac frees
a process's memory only once it has exited, so this is what keeps an eviction from overcommitting
a node. Part of the residency loop: it runs in the loop's steps and reads the loop's state."""

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policy import InstanceRef, Place
from policy.memory import gib
from router.residency.clock import Timer
from router.residency.events import LoadFailed, StopDone

if TYPE_CHECKING:
    from router.residency.controller import ResidencyController


@dataclass(eq=False)
class _Pending:
    place: Place
    attempt: int
    after: set[int]  # the stops it waits for
    deadline: Timer
    ended_at: float | None = None  # when the last of them ended
    asked_at: float = float("-inf")  # when it last asked for a report
    unconfirmed: int = 0  # its stops that ended without confirming the exit
    timers: list[Timer] = field(default_factory=list)


class Room:
    def __init__(self, loop: "ResidencyController"):
        self.loop = loop
        self._ids = itertools.count(1)
        self._stops: dict[int, InstanceRef] = {}  # stops under way
        self._pending: dict[InstanceRef, _Pending] = {}
        self._reports: dict[str, tuple[float, int]] = {}  # node -> (when its latest report was asked for, free bytes)
        # node -> when a stop there ended without confirming its process gone: until a report asked
        # for after that shows the room, every load there waits for one.
        self._unsure: dict[str, float] = {}

    def stopping(self, ref: InstanceRef) -> int:
        stop_id = next(self._ids)
        self._stops[stop_id] = ref
        return stop_id

    def place(self, place: Place, attempt: int) -> None:
        """Load now, or once the room is there."""
        node_id = place.node_id
        after = {i for i, ref in self._stops.items() if ref.node_id == node_id}
        if not after and node_id not in self._unsure:
            self.loop.start_load(place, attempt, "")
            return
        ref = InstanceRef(node_id=node_id, model=place.model)
        clock = self.loop.clock
        deadline = clock.call_at(clock.now() + self.loop.config.exit_wait_s, lambda: self._timed_out(ref))
        self._pending[ref] = _Pending(place=place, attempt=attempt, after=after, deadline=deadline)
        self.check(node_id)

    def cancel(self, ref: InstanceRef) -> bool:
        """The placement left the state while it waited (unloaded, cancelled): True when it was
        waiting, so nothing was started for it."""
        pending = self._pending.pop(ref, None)
        if pending is None:
            return False
        self._forget(pending)
        return True

    def awaiting_bytes(self, node_id: str) -> int:
        return sum(p.place.bytes for ref, p in self._pending.items() if ref.node_id == node_id)

    def reported(self, node_id: str, asked_at: float, free_bytes: int) -> None:
        self._reports[node_id] = (asked_at, free_bytes)

    def stop_done(self, done: StopDone) -> None:
        self._stops.pop(done.stop_id, None)
        node_id = done.instance.node_id
        now = self.loop.clock.now()
        if done.gone:
            released = f"{gib(done.bytes)} released" if done.bytes is not None else "its memory released"
            self.loop._record(
                "stopped", model=done.instance.model, node_id=node_id, bytes=done.bytes, reason=f"its process exited, {released} ({done.reason})"
            )
        else:  # its memory may still be held: loads there wait for a report that shows the room
            self._unsure[node_id] = now
            self.loop.effects.want_report(node_id)
            for p in self._pending.values():
                if done.stop_id in p.after:
                    p.unconfirmed += 1
        self.check(node_id)

    def check(self, node_id: str) -> None:
        """Start every placement on the node whose room is there now."""
        for ref, p in list(self._pending.items()):
            if ref.node_id == node_id and ref in self._pending:
                self._check(ref, p)

    def _check(self, ref: InstanceRef, p: _Pending) -> None:
        loop, now = self.loop, self.loop.clock.now()
        inst = loop._instance(ref)
        if inst is None or inst.status != "loading":  # unloaded, or its node died, while it waited
            self.cancel(ref)
            return
        if p.unconfirmed:
            self._fail(ref, p, f"{p.unconfirmed} of the instances stopping on {ref.node_id} (and the victims) did not confirm their exit")
            return
        if p.after & self._stops.keys():
            return
        if p.ended_at is None:
            p.ended_at = now
        asked, free = self._reports.get(ref.node_id, (float("-inf"), 0))
        need = self.awaiting_bytes(ref.node_id)
        if asked >= p.ended_at and free >= need:
            self._unsure.pop(ref.node_id, None)
            del self._pending[ref]
            self._forget(p)
            loop.start_load(p.place, p.attempt, f"after the stops on {ref.node_id} its report measured {gib(free)} free, {gib(need)} to load")
            return
        poll = loop.config.retry_poll_s
        if now - p.asked_at >= poll:  # no report since the stops ended, or one short of room: measure again
            p.asked_at = now
            loop.effects.want_report(ref.node_id)
            p.timers.append(loop.clock.call_at(now + poll, lambda: self.check(ref.node_id)))

    def _timed_out(self, ref: InstanceRef) -> None:
        p = self._pending.get(ref)
        if p is None:
            return
        wait = self.loop.config.exit_wait_s
        running = p.after & self._stops.keys()
        if running:
            message = f"{len(running)} instance(s) stopping for it had not exited after {wait:.0f} s"
        else:
            asked, free = self._reports.get(ref.node_id, (float("-inf"), 0))
            seen = f"its last report measured {gib(free)} free" if p.ended_at is not None and asked >= p.ended_at else "no report came"
            message = f"{ref.node_id} did not show {gib(self.awaiting_bytes(ref.node_id))} free within {wait:.0f} s: {seen}"
        self._fail(ref, p, message)
        self.loop._wake()

    def _fail(self, ref: InstanceRef, p: _Pending, message: str) -> None:
        del self._pending[ref]
        self._forget(p)
        self.loop.apply(LoadFailed(place=p.place, attempt=p.attempt, reason="no_room", message=message))

    def _forget(self, p: _Pending) -> None:
        p.deadline.cancel()
        for timer in p.timers:
            timer.cancel()
