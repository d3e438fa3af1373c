"""Carrying placements out: the weights fetched first when an eviction needs them (L1), the victims
stopped, the room waited for (X1), the model server started, and each outcome back to the loop as
an event (LoadDone, LoadFailed, StopDone, FetchDone).

Unload, then load (rule X1): placements wait for the room they were promised.

A placement on a node where instances are stopping (its victims, unloads), or where a stop could
not confirm its process gone, loads nothing until every such stop has released its model's memory
in its process (the model server's own measure, `Released`) or confirmed its exit, and a node
report asked for after that measures the free memory for it and every other placement waiting
there; at most `exit_wait_s`, then it fails (`no_room`) having loaded nothing. A released process
still holds what it measured until it exits: that is counted as ours on its node (what the node's
agent is told Orchard uses) until the exit is confirmed, so the report's room leaves it out. This
is what keeps an eviction from overcommitting a node while the victim's process exit runs beside
the new load. Part of the residency loop: it runs in the loop's steps and reads the loop's state."""

import asyncio
import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from cluster.node_report import FetchResult
from deployments.wire.failure import OrchardError
from policy import (
    ClusterState,
    InstanceRef,
    LoadFailure,
    LoadFailureReason,
    Place,
    StoreRoom,
    fetch_source,
    plan_background_copies,
    retry_after_failure,
)
from policy.memory import gib
from policy.transitions import apply_place, learn_bandwidth, mark_loaded, mark_stored, remove_instance
from router.residency.clock import Timer
from router.residency.events import FetchDone, LoadDone, LoadError, LoadFailed, NodeLost, NodeUnreachable, StopDone, StopReleased
from router.residency.interface import FetchOrder
from router.residency.measured import Measurements
from router.residency.parts import Loop


@dataclass(eq=False)
class _Pending:
    place: Place
    attempt: int
    after: set[int]  # the stops it waits for
    deadline: Timer
    ended_at: float | None = None  # when the last of them ended (released, or exited)
    asked_at: float = float("-inf")  # when it last asked for a report
    unconfirmed: int = 0  # its stops that ended without confirming the exit
    kept: int = 0  # the caches it counted on that were not given back (X4)
    credit: int = 0  # a spare it took while it waited (R1): its process is counted in the reports already
    timers: list[Timer] = field(default_factory=list)


class Placements:
    def __init__(self, loop: Loop):
        self.loop = loop
        self.measurements = Measurements()  # M1: what each model's engine measured after its load
        self.prefetches: set[tuple[str, str]] = set()  # (model, node): weights fetched before an eviction
        self._copies: dict[tuple[str, str], asyncio.Task] = {}  # background copies and pulls under way
        self._rooms: dict[str, StoreRoom] = {}  # node -> its store's disk, as last reported
        self._store_copying: set[str] = set()  # nodes whose store report shows a copy coming in
        self._settling: set[str] = set()  # nodes whose background copy ended since their last store report
        self._copy_failed: dict[tuple[str, str], float] = {}  # (model, node) -> when its background copy failed
        self.for_requests: dict[tuple[str, str], asyncio.Task | None] = {}  # loads and fetches only requests wait for
        self._ids = itertools.count(1)
        self._stops: dict[int, InstanceRef] = {}  # stops under way
        self._released: dict[int, int] = {}  # stops whose model server released its memory -> what its process holds until it exits
        self._pending: dict[InstanceRef, _Pending] = {}
        self._reports: dict[str, tuple[float, int]] = {}  # node -> (when its latest report was asked for, free bytes)
        # node -> when a stop there ended without confirming its process gone: until a report asked
        # for after that shows the room, every load there waits for one.
        self._unsure: dict[str, float] = {}
        self._shrinking: dict[int, InstanceRef] = {}  # caches being given back (X4), by id: loads wait for them as for stops
        self._unshrinkable: dict[InstanceRef, float] = {}  # instance -> when its shrink freed nothing it was counted for
        # (model, node) -> the spare its placement took (R1: its actor, and its start while that runs), until its load starts
        self.spare_for: dict[tuple[str, str], tuple[str, asyncio.Task | None]] = {}
        # (model, node) -> when its placement was decided, and the seconds its load's own copy took: a
        # reload costs the span in between less the copy (E3), the victims' releases (X1) and the start included
        self._placed_at: dict[tuple[str, str], tuple[float, float]] = {}

    # ---- caches given back before evictions (X4) ----------------------------------------------------
    def shrinking(self, ref: InstanceRef) -> bool:
        """Whether the instance is being asked to give its kept prompt prefixes back."""
        return ref in self._shrinking.values()

    def unshrinkable(self, ref: InstanceRef) -> bool:
        """Whether the instance's last shrink freed nothing it was counted for, within exit_wait_s:
        its cache is then not reclaimable (X4)."""
        at = self._unshrinkable.get(ref)
        if at is not None and self.loop.clock.now() - at >= self.loop.config.exit_wait_s:
            del self._unshrinkable[ref]
            at = None
        return at is not None

    def shrink(self, place: Place) -> None:
        """X4: ask the instances the placement names to give their kept prompt prefixes back; its load
        waits for each to end as for a stop (X1), then for a report that shows the room."""
        loop = self.loop
        for ref in place.shrink:
            inst = loop._instance(ref)
            counted = inst.prefix_cache_bytes if inst is not None else 0  # before apply_place counts it given back
            shrink_id = next(self._ids)
            self._shrinking[shrink_id] = ref
            loop._spawn(self._run_shrink(shrink_id, ref, loop.sites.actor_of(ref), counted, place.model))

    async def _run_shrink(self, shrink_id: int, ref: InstanceRef, actor: str | None, counted: int, model: str) -> None:
        loop = self.loop
        try:
            freed = await loop.effects.shrink_caches([actor]) if actor is not None else 0
        except Exception:  # an effect that broke frees nothing
            freed = 0
        self._shrinking.pop(shrink_id, None)
        if freed:
            loop._record(
                "caches_shrunk", model=ref.model, node_id=ref.node_id, bytes=freed, reason=f"{gib(freed)} of kept prompt prefixes, for {model}"
            )
        if counted and not freed:  # counted as given back, and nothing came back
            self._unshrinkable[ref] = loop.clock.now()  # not reclaimable for exit_wait_s: other processes' memory
            loop.state = _count_foreign(loop.state, ref.node_id, counted)
            loop._record(
                "caches_shrunk", model=ref.model, node_id=ref.node_id, bytes=0, reason=f"gave back none of {gib(counted)} of kept prompt prefixes"
            )
            for p in self._pending.values():  # their room is not coming: they fail now, and decide again
                if shrink_id in p.after:
                    p.kept += 1
        loop.effects.want_report(ref.node_id)
        self.check(ref.node_id)
        loop._wake()

    def exiting_bytes(self, node_id: str) -> int:
        """What the processes on the node that released their memory hold until they exit (X1):
        ours, not foreign, and not free."""
        return sum(n for i, n in self._released.items() if (ref := self._stops.get(i)) is not None and ref.node_id == node_id)

    def stopping(self, ref: InstanceRef) -> int:
        stop_id = next(self._ids)
        self._stops[stop_id] = ref
        return stop_id

    def place(self, place: Place, attempt: int) -> None:
        """Load now, or once the room is there."""
        node_id = place.node_id
        after = {i for i, ref in (*self._stops.items(), *self._shrinking.items()) if ref.node_id == node_id}
        if not after and node_id not in self._unsure:
            self.start_load(place, attempt, "")
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
        self._placed_at.pop((ref.model, ref.node_id), None)
        self._spare_unused(ref.model, ref.node_id, "its placement was cancelled")
        return True

    def _spare_unused(self, model: str, node_id: str, why: str) -> None:
        """A placement that took a spare (R1) ends before its load starts: the spare stops with it."""
        spare = self.spare_for.pop((model, node_id), None)
        if spare is not None:
            actor, started = spare
            if started is not None and not started.done():
                started.cancel()  # its start ends there (the spare leaves with it)
            self.loop._spawn(self.loop.effects.stop_spare(node_id, actor, why))

    def cancel_for_requests(self, model: str) -> None:
        """The last request for `model` went away: cancel what was started for requests alone (a
        load, a fetch before an eviction)."""
        loop = self.loop
        for (m, node_id), task in list(self.for_requests.items()):
            if m != model:
                continue
            del self.for_requests[(m, node_id)]
            loop._record("cancelled", model=model, node_id=node_id, reason="every request that asked for it went away")
            if task is not None:
                task.cancel()
            else:  # still waiting for room: nothing runs yet, and its reservation goes
                ref = InstanceRef(node_id=node_id, model=model)
                if self.cancel(ref) and loop._instance(ref) is not None:
                    loop.state = remove_instance(loop.state, ref)
                    loop._wake()

    def awaiting_bytes(self, node_id: str) -> int:
        return sum(p.place.bytes - p.credit for ref, p in self._pending.items() if ref.node_id == node_id)

    def offer_spare(self, node_id: str) -> bool:
        """R1: the node's spare became ready while a placement there waits for room without one (it
        was decided when the node had none): that placement takes it, so its load runs in a ready
        process instead of starting one, and it needs the spare's bytes less of a report (they are
        counted there already, as the process it becomes). True when one took it."""
        for ref, p in self._pending.items():
            if ref.node_id == node_id and (ref.model, node_id) not in self.spare_for and (claimed := self.loop.spares.claim(node_id)):
                self.spare_for[(ref.model, node_id)], p.credit = (claimed[0], None), claimed[1]
                self.check(node_id)
                return True
        return False

    def reported(self, node_id: str, asked_at: float, free_bytes: int, room: StoreRoom | None = None, copying: bool = False) -> None:
        self._reports[node_id] = (asked_at, free_bytes)
        if room is not None:
            self._rooms[node_id] = room
            self._store_copying.discard(node_id)
            if copying:
                self._store_copying.add(node_id)
            self._settling.discard(node_id)  # the report shows what the last background copy there left

    # ---- copies with no placement behind them: background (L4) and operators' pulls --------------
    def background_copies(self, now: float, demand: dict[str, float]) -> None:
        """L4: start the copies plan_background_copies picks for nodes with no copy coming in; one
        that fails is an event (fetch_failed) like any copy's, and is not tried on that node again
        for background_copy_retry_s."""
        config = self.loop.config
        if config.background_copies == "off":
            return
        self._copy_failed = {k: at for k, at in self._copy_failed.items() if now - at < config.background_copy_retry_s}
        busy = {n for _, n in self._copies} | self._settling | self._store_copying
        for copy in plan_background_copies(self.loop.state, config, demand, self._rooms, frozenset(busy), frozenset(self._copy_failed)):
            asked = (
                f"{copy.demand:.1f} requests, counted with a {config.demand_half_life_s / 60:g} min half-life" if copy.demand else "not asked for yet"
            )
            self._copies[(copy.model, copy.node_id)] = self.loop._spawn(
                self._fetch(copy.model, copy.node_id, "background", f"background copy, L4: {asked}")
            )

    async def copy(self, model: str, node_id: str, purpose: str) -> None:
        """A pull (or any copy a caller waits for): joins one already under way to the same node."""
        task = self._copies.get((model, node_id))
        if task is None:
            task = self._copies[(model, node_id)] = self.loop._spawn(self._fetch(model, node_id, "pull"))
        failure = await asyncio.shield(task)
        if failure is not None:
            raise OrchardError("fetch_failed", failure, retry_after_s=1)

    async def _fetch(
        self, model: str, node_id: str, purpose: Literal["placement", "background", "pull", "load"], background: str | None = None
    ) -> str | None:
        """The one copy path: the weights into the node's store, for a placement (L1, before its
        evictions; `load`: right before its load), in the background (L4, `background` its reason)
        or for an operator's pull; where from is the loop's choice (`Sites.fetch_order`), the events
        are written here, and the outcome goes back to the loop as FetchDone. Returns the failure's
        message, or None. A placement's fetch nobody waits for any more is cancelled (the event is
        recorded): nothing to undo."""
        loop = self.loop
        order = loop.sites.fetch_order(model, node_id, background)
        failure: LoadFailureReason | None = None
        message = ""
        try:
            if order.needed:
                loop._record("fetching", model=model, node_id=node_id, bytes=_weight_bytes(order), reason=_fetching_text(order))
            result = await loop.effects.fetch_weights(order)
            loop.removals.gone(node_id, result.removed, f"(disk budget) to make room for {model}")
            if not result.ok:
                loop._record("fetch_failed", model=model, node_id=node_id, reason=f"{result.code}: {result.message}")
                failure, message = "error", f"copying the weights of {model} to {node_id} failed: {result.message}"
            elif order.needed:
                self._fetched(order, result)
        except asyncio.CancelledError:
            if purpose != "placement":  # a load's own copy: the load is cancelled with it
                raise
            failure, message = "error", "cancelled"
        except LoadError as e:
            failure, message = e.reason, e.message
        except Exception as e:
            failure, message = "error", f"{type(e).__name__}: {e}"
        finally:
            if purpose != "load":
                (self.for_requests if purpose == "placement" else self._copies).pop((model, node_id), None)
        loop.apply(FetchDone(model=model, node_id=node_id, purpose=purpose, failure=failure, message=message))
        return message if failure is not None else None

    def _fetched(self, order: FetchOrder, result: FetchResult) -> None:
        """A copy that ended well: its event (how, how fast), and the bandwidth it taught (L3)."""
        source: Literal["peer", "hub"] = "hub" if result.source == "hub" else "peer"
        seconds = max(result.seconds, 1e-6)
        rate = result.bytes / seconds / 1e6
        if result.source == "stored":
            reason = "already in the store: a copy that had just finished"
        elif source == "hub":
            reason = f"from the Hub ({order.entry.path if order.entry else '?'} at {result.revision or '?'}): {result.bytes} bytes, {rate:.1f} MB/s"
        else:
            how = "a direct stream" if result.transport == "tcp" else f"Ray calls ({result.fallback or 'no stream'})"
            reason = f"from {result.source} over {how}: {result.bytes} of {result.total_bytes} bytes copied, {rate:.1f} MB/s"
        self.loop._record(
            "fetched", model=order.model, node_id=order.node_id, bytes=result.bytes, seconds=result.seconds, reason=reason, cause=source
        )
        if result.bytes and result.seconds and result.source != "stored":
            self.loop.state = learn_bandwidth(self.loop.state, source, result.bytes / seconds)
        if order.entry is not None and order.entry.folder is not None:  # there now, before the next report says so
            self.loop.sites.added(order.node_id, order.entry.folder, result.total_bytes or result.bytes, self.loop.clock.now())

    def stop_released(self, r: StopReleased) -> None:
        """X1: the stopping instance gave its model's memory back in its process; what its process
        still holds is ours until it exits, and placements waiting on the node need only a report
        that shows the room now."""
        if r.stop_id not in self._stops:
            return
        held, freed = r.released.held_bytes, r.released.freed_bytes
        self._released[r.stop_id] = held
        node_id = r.instance.node_id
        self.loop._record(
            "released",
            model=r.instance.model,
            node_id=node_id,
            bytes=freed,
            seconds=r.released.seconds,
            reason=f"its engine stopped: {gib(freed)} given back, {gib(held)} held by its process until it exits ({r.reason})",
        )
        self.check(node_id)

    def stop_done(self, done: StopDone) -> None:
        self._stops.pop(done.stop_id, None)
        had_released = self._released.pop(done.stop_id, None) is not None
        node_id = done.instance.node_id
        now = self.loop.clock.now()
        if done.gone:
            released = f"{gib(done.bytes)} released" if done.bytes is not None else "its memory released"
            ended = "its process is its node's spare now (R1)" if done.spare else "its process exited"
            self.loop._record("stopped", model=done.instance.model, node_id=node_id, bytes=done.bytes, reason=f"{ended}, {released} ({done.reason})")
        else:  # its memory may still be held: loads there wait for a report that shows the room
            self._unsure[node_id] = now
            self.loop.effects.want_report(node_id)
            for p in self._pending.values():
                if done.stop_id in p.after and not had_released:  # a released one's room was measured already
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
        if p.kept:
            self._fail(ref, p, f"{p.kept} of the instances on {ref.node_id} asked to give back their kept prompt prefixes gave back nothing")
            return
        if p.after & ((self._stops.keys() - self._released.keys()) | self._shrinking.keys()):
            return
        if p.ended_at is None:
            p.ended_at = now
        asked, free = self._reports.get(ref.node_id, (float("-inf"), 0))
        need = self.awaiting_bytes(ref.node_id)
        if asked >= p.ended_at and free >= need:
            self._unsure.pop(ref.node_id, None)
            del self._pending[ref]
            self._forget(p)
            self.start_load(p.place, p.attempt, f"after the stops on {ref.node_id} its report measured {gib(free)} free, {gib(need)} to load")
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
        running, shrinking = p.after & self._stops.keys(), p.after & self._shrinking.keys()
        if running:
            message = f"{len(running)} instance(s) stopping for it had not exited after {wait:.0f} s"
        elif shrinking:
            message = f"{len(shrinking)} instance(s) giving back kept prompt prefixes for it had not answered after {wait:.0f} s"
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

    def begin(self, place: Place, *, for_requests: bool = False) -> bool:
        """Apply the decision to the state now (so the next decision sees it), then carry it out;
        True when placed. A placement that evicts, on a node whose store lacks the weights, fetches
        them first and places nothing yet (False): a fetch that fails has evicted nothing (L1). Nor
        is a model placed on a node its files are being removed from (X3)."""
        node = self.loop.state.node(place.node_id)
        if (place.model, place.node_id) in self.loop.removals.pending:
            return False
        if place.evict and node is not None and fetch_source(self.loop.state.catalog[place.model], node, self.loop.state) is not None:
            if (place.model, place.node_id) not in self.prefetches:
                self.prefetches.add((place.model, place.node_id))
                task = self.loop._spawn(self._fetch(place.model, place.node_id, "placement"))
                if for_requests:
                    self.for_requests[(place.model, place.node_id)] = task
            return False
        self.carry_out(place, 1, f"to place {place.model}: {place.reason}", f"evicted for {place.model}", for_requests)
        return True

    def carry_out(self, place: Place, attempt: int, evicted: str, stop_reason: str, for_requests: bool = False) -> None:
        """Unload, then load (X1): stop the victims, ask the instances in `shrink` to give their kept
        prompt prefixes back (X4), apply the placement to the state (its bytes reserved, the
        victims' and the caches counted free), and load once every stop and shrink on its node has
        ended and a report shows the room (`room`)."""
        for victim in place.evict:
            inst = self.loop._instance(victim)
            cause = "retry" if attempt > 1 else "placement"
            self.loop._record("evicted", model=victim.model, node_id=victim.node_id, bytes=inst.bytes if inst else None, reason=evicted, cause=cause)
            self.loop._drop(victim, None, evicted, stop_reason, for_room=True)
        self.shrink(place)  # before apply_place counts the caches given back
        node = self.loop.state.node(place.node_id)
        spared = node is not None and node.spare_bytes > 0  # R1: the policy counted it as this placement's process
        self.loop.state = apply_place(self.loop.state, place, self.loop.clock.now())
        self._placed_at[(place.model, place.node_id)] = (self.loop.clock.now(), 0.0)
        spare = self.loop.spares.take(place.node_id) if spared else None
        if spare is not None:
            self.spare_for[(place.model, place.node_id)] = spare
        self.loop._record("placed", model=place.model, node_id=place.node_id, bytes=place.bytes, reason=place.reason)
        if for_requests:
            self.for_requests[(place.model, place.node_id)] = None
        self.place(place, attempt)

    def start_load(self, place: Place, attempt: int, why: str) -> None:
        """The room is there (`room`): start the model server."""
        self.loop._record("loading", model=place.model, node_id=place.node_id, bytes=place.bytes, reason=why)
        task = self.loop._spawn(self._run_load(place, attempt))
        if (place.model, place.node_id) in self.for_requests:
            self.for_requests[(place.model, place.node_id)] = task

    async def _run_load(self, place: Place, attempt: int) -> None:
        loop = self.loop
        spare, started = self.spare_for.pop((place.model, place.node_id), (None, None))
        try:
            if spare is None:  # R1: one ready since the placement was decided, or a victim's process about to be one
                spare = await loop.spares.claim_soon(place.node_id)
            # R1: with spares on, a new process is named as a spare too, so it may be one after its model
            new_name = loop.effects.new_spare_name if loop.config.spares_per_node else partial(loop.effects.new_actor_name, place.model)
            actor = spare or new_name(place.node_id)
            loop.sites.actors[(place.model, place.node_id)] = actor
            if started is not None:  # a spare still starting: sooner ready than a process started now
                await asyncio.wait({started})
            asked = loop.clock.now()
            fresh = await loop.effects.store_report(place.node_id)  # what the store holds now, not at the last report
            if fresh is not None:
                loop.sites.reported(place.node_id, None, fresh, asked)
            if loop.sites.fetch_order(place.model, place.node_id).needed:  # L1 with nothing evicted: the copy comes first
                copying = loop.clock.now()
                failed = await self._fetch(place.model, place.node_id, "load")
                at, copied = self._placed_at.get((place.model, place.node_id), (copying, 0.0))
                self._placed_at[(place.model, place.node_id)] = (at, copied + loop.clock.now() - copying)
                if failed is not None:
                    raise LoadError("error", failed)
            known = self.measurements.get(place.model)
            order = loop.sites.start_order(place, loop.state.catalog[place.model], actor, spare is not None, known)
            result = await loop.effects.start_instance(order)
        except asyncio.CancelledError:  # nobody waits for it (the event is recorded)
            self.loop.apply(LoadFailed(place=place, attempt=attempt, reason="cancelled", message="nobody waits for it"))
            return
        except LoadError as e:
            self.loop.apply(LoadFailed(place=place, attempt=attempt, reason=e.reason, message=e.message))
            return
        except NodeUnreachable as e:
            self.loop.apply(NodeLost(node_id=e.node_id, reason=e.message, suspect=True))
            self.loop.apply(LoadFailed(place=place, attempt=attempt, reason="node_lost", message=e.message))
            return
        except Exception as e:  # an effect that broke must not leave the model "loading" forever
            self.loop.apply(LoadFailed(place=place, attempt=attempt, reason="error", message=f"{type(e).__name__}: {e}"))
            return
        finally:
            self.for_requests.pop((place.model, place.node_id), None)
        if result.measured is not None:  # M1: from now on the model reserves what it was measured to hold
            catalog = self.measurements.record(self.loop.state.catalog, place.model, result.measured)
            self.loop.state = self.loop.state.model_copy(update={"catalog": catalog})
        self.loop.apply(LoadDone(place=place, bytes=result.bytes, load_seconds=result.load_seconds))

    def load_done(self, done: LoadDone) -> None:
        ref = InstanceRef(node_id=done.place.node_id, model=done.place.model)
        inst = self.loop._instance(ref)
        node = self.loop.state.node(ref.node_id)
        if node is None or not node.alive or inst is None:
            self.stop(ref, "its node died or it was unloaded while loading", done.bytes)
            return
        now = self.loop.clock.now()
        at, copied = self._placed_at.pop((ref.model, ref.node_id), (now, 0.0))
        swap_s = max(done.load_seconds, now - at - copied)  # what bringing it back costs (E3): releases, start, load
        self.loop.state = mark_loaded(self.loop.state, ref, now, swap_s, done.bytes)
        self.loop._record("loaded", model=ref.model, node_id=ref.node_id, bytes=done.bytes, seconds=done.load_seconds)
        self.loop.spares.plan()  # the next spare, where one was taken and there is room (R1)

    def load_failed(self, failed: LoadFailed) -> None:
        place = failed.place
        self._placed_at.pop((place.model, place.node_id), None)
        ref = InstanceRef(node_id=place.node_id, model=place.model)
        self.for_requests.pop((place.model, place.node_id), None)
        started = failed.reason != "no_room"  # a placement that never found room started nothing
        self._spare_unused(place.model, place.node_id, f"its placement ended before its load began ({failed.reason})")
        if failed.reason == "cancelled":
            pass
        elif failed.reason == "no_room":
            self.loop._record("load_failed", model=place.model, node_id=place.node_id, reason=f"no_room: {failed.message}; nothing was loaded")
        else:
            self.loop._record("load_failed", model=place.model, node_id=place.node_id, reason=f"{failed.reason}: {failed.message}")
        if self.loop._instance(ref) is not None:
            self.loop.state = remove_instance(self.loop.state, ref)
        if started:
            self.stop(ref, "cancelled: nobody waits for it" if failed.reason == "cancelled" else "failed to load", None)
        if failed.reason in ("no_room", "node_lost", "cancelled"):
            return  # not the files' fault: requests decide again against the latest state
        failure = LoadFailure(model=place.model, node_id=place.node_id, reason=failed.reason, message=failed.message, attempt=failed.attempt)
        now = self.loop.clock.now()
        retry = retry_after_failure(failure, self.loop.state, now, self.loop.config)
        if isinstance(retry, Place) and (retry.model, retry.node_id) not in self.loop.removals.pending:
            self.carry_out(retry, failed.attempt + 1, f"retrying {place.model}: {retry.reason}", f"evicted to retry {place.model}")
        else:  # P9/P10: not retried, nothing evicted; requests are refused until the back-off ends
            self.loop.mark_failed(failure)

    def fetch_done(self, done: FetchDone) -> None:
        if done.purpose == "background":
            self._settling.add(done.node_id)
            if done.failure is not None:
                self._copy_failed[(done.model, done.node_id)] = self.loop.clock.now()
        if done.purpose == "load":
            pass  # its load fails with it (LoadFailed), which decides what follows
        elif done.purpose == "placement":
            self.prefetches.discard((done.model, done.node_id))
            if done.failure is not None and done.message != "cancelled":  # the fetch recorded why (fetch_failed)
                self.loop.mark_failed(LoadFailure(model=done.model, node_id=done.node_id, reason=done.failure, message=done.message))
        if done.failure is None:
            node = self.loop.state.node(done.node_id)
            if node is not None and done.model not in node.stored:
                self.loop.state = mark_stored(self.loop.state, done.node_id, done.model)

    def stop(self, ref: InstanceRef, reason: str, nbytes: int | None, for_room: bool = False) -> None:
        """Stop the instance's process, tracked as stopping on its node until it has exited (X1), or
        (`for_room`: a placement's victim) until it is the node's spare (R1). Its actor is taken now,
        not when the stop runs: by then the model may be placed there again, as a new incarnation."""
        stop_id = self.stopping(ref)
        actor = self.loop.sites.actors.pop((ref.model, ref.node_id), None)
        self.loop._spawn(self._run_stop(stop_id, ref, actor, reason, nbytes, for_room))

    async def _run_stop(self, stop_id: int, ref: InstanceRef, actor: str | None, reason: str, nbytes: int | None, for_room: bool) -> None:
        try:  # X1: its memory first, then its process
            released = await self.loop.effects.release_instance(ref, actor, reason)
        except Exception:  # an effect that broke released nothing: the exit decides
            released = None
        if released is not None:
            self.loop.apply(StopReleased(stop_id=stop_id, instance=ref, released=released, reason=reason))
            if for_room and actor is not None and await self.loop.spares.recycle(ref.node_id, actor, released.held_bytes):  # R1: the next spare
                self.loop.apply(StopDone(stop_id=stop_id, instance=ref, gone=True, reason=reason, bytes=nbytes, spare=True))
                return
        try:
            gone = bool(await self.loop.effects.stop_instance(ref, actor, reason))
        except Exception as e:  # an effect that broke: the exit is not confirmed
            gone, reason = False, f"{reason}; stopping it failed: {type(e).__name__}: {e}"
        self.loop.apply(StopDone(stop_id=stop_id, instance=ref, gone=gone, reason=reason, bytes=nbytes))


def _count_foreign(state: ClusterState, node_id: str, nbytes: int) -> ClusterState:
    """Memory the state counted as given back that was not: other processes' until a report says
    otherwise (X4)."""
    node = state.node(node_id)
    if node is None or not node.alive:
        return state
    headroom = node.reported_headroom_bytes
    moved = node.model_copy(
        update={"foreign_bytes": node.foreign_bytes + nbytes, "reported_headroom_bytes": None if headroom is None else headroom - nbytes}
    )
    return state.model_copy(update={"nodes": tuple(moved if n.node_id == node_id else n for n in state.nodes)})


def _weight_bytes(order: FetchOrder) -> int | None:
    return order.entry.weight_bytes if order.entry is not None else None


def _fetching_text(order: FetchOrder) -> str:
    folder = order.entry.folder if order.entry is not None else order.model
    if not order.sources:
        return f"downloading {order.entry.path if order.entry else order.model} from the Hub"
    return f"copying {folder} from {', '.join(order.sources)}" + (f" ({order.background})" if order.background else "")
