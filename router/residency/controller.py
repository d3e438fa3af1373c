"""The residency loop: the one owner of the cluster view and of every placement decision.

Shaped like llama-swap's scheduler. One asyncio loop; happenings in (a request or an operator
wants a model, a lease ends, a node reports or is lost, an instance dies, an effect finished:
`apply` takes them as typed events); decisions from policy/ (pure); effects out through a small
interface (start, stop, fetch, ask for a report, publish), each run as a task that reports its
outcome back as an event. State changes only in synchronous steps on the loop, so it needs no lock,
and time comes from the clock the loop is given, so tests drive it.

Every ask waits in its model's queue: requests (for a lease), operator loads (for a ready
instance, anywhere or on a named node). Every change decides each queued ask once, oldest first,
with the same policy call; an ask that busy instances keep out is a candidate for a swap (W1-W3:
`pick_swap` drains one for it). The lease book (leases.py) holds both kinds of lease; the
controller is never on the token path."""

import asyncio
from typing import Any

from deployments.manifest import ManifestEntry
from deployments.wire.failure import OrchardError
from deployments.wire.leases import LeaseRecord, RoutesView
from policy import ClusterState, InstanceRef, InstanceState, LoadFailure, ModelSpec, NodeState, Place, PolicyConfig, plan_copies, sweep
from policy.decisions import Decision
from policy.eviction import ready_copies
from policy.memory import gib, held_bytes, ours_bytes
from policy.transitions import apply_place, clear_failed, hold_measured, mark_failed, mark_loaded, remove_instance, set_in_flight, set_prefix_cache
from router.residency.asks import Ask, Asks
from router.residency.clock import Clock, MonotonicClock, Timer, until
from router.residency.demand import Demand
from router.residency.events import (
    CachesReported,
    ClusterEvent,
    EventKind,
    FetchDone,
    InstanceDied,
    LoadDone,
    LoadFailed,
    NodeLost,
    NodeReported,
    StopDone,
    StopReleased,
)
from router.residency.interface import Effects
from router.residency.leases import LeaseBook
from router.residency.log import EventLog
from router.residency.placements import Placements
from router.residency.removals import Removals
from router.residency.sites import Sites
from router.residency.spares import Spares
from router.residency.swaps import Swaps


class ResidencyController:
    def __init__(
        self,
        catalog: dict[str, ModelSpec],
        config: PolicyConfig,
        effects: Effects,
        *,
        entries: dict[str, ManifestEntry] | None = None,
        clock: Clock | None = None,
        max_events: int = 2000,
        max_lease_s: float = 3600.0,
        holder_timeout_s: float = 15.0,
        revoke_grace_s: float = 2.0,
    ):
        self.config = config
        self.effects = effects
        self.clock: Clock = clock or MonotonicClock()
        self.state = ClusterState(catalog=dict(catalog))
        self.sites = Sites(entries or {})  # where things are on the real cluster: Ray ids, stores, actors
        self.demand = Demand(config.demand_half_life_s)  # requests per model, decayed (L4)
        self.leases = LeaseBook(max_lease_s=max_lease_s, holder_timeout_s=holder_timeout_s)
        self.placements = Placements(self)  # placements that wait for stops to exit and the room to show (X1)
        # How long a request under contention "fail", or an operator's load on a node, may wait for
        # standing leases in its way to be given back before it is refused.
        self.revoke_grace_s = revoke_grace_s
        self.log = EventLog(max_events)
        self.asks = Asks(self)  # one queue of asks per model, and the decision for each (asks.py)
        self.swaps = Swaps(self)  # instances drained for a model kept out (W1-W3, swaps.py)
        self._failed_files: dict[str, str | None] = {}  # model marked failed -> its files' version then
        self.removals = Removals(self)  # store folders an operator removes (X3) or that left for room
        self.spares = Spares(self)  # model-server processes started ahead of demand (R1, spares.py)
        self._tasks: set[asyncio.Task] = set()
        self._redecide_soon = False
        self._timer: tuple[float, Timer] | None = None

    # ---- happenings in --------------------------------------------------------------------------
    def apply(
        self, event: NodeReported | CachesReported | NodeLost | InstanceDied | LoadDone | LoadFailed | StopReleased | StopDone | FetchDone
    ) -> None:
        if isinstance(event, NodeReported):
            self._node_reported(event)
        elif isinstance(event, CachesReported):
            self._caches_reported(event)
        elif isinstance(event, NodeLost):
            self._node_lost(event)
        elif isinstance(event, InstanceDied):
            self._drop(event.instance, "died", event.cause, f"died: {event.cause}")
        elif isinstance(event, LoadDone):
            self.placements.load_done(event)
        elif isinstance(event, LoadFailed):
            self.placements.load_failed(event)
        elif isinstance(event, StopReleased):
            self.placements.stop_released(event)
        elif isinstance(event, StopDone):
            self.placements.stop_done(event)
        else:
            self.placements.fetch_done(event)
        self._wake()

    def report_node(self, node_id: str, **fields: Any) -> None:
        self.apply(NodeReported(node_id=node_id, **fields))

    def node_dead(self, node_id: str, reason: str = "node stopped reporting") -> None:
        self.apply(NodeLost(node_id=node_id, reason=reason))

    def instance_died(self, ref: InstanceRef, cause: str) -> None:
        self.apply(InstanceDied(instance=ref, cause=cause))

    def _node_reported(self, r: NodeReported) -> None:
        """Memory that is neither free nor held by our instances is someone else's (foreign); the
        measured free memory, less what placements waiting to load there reserved, is the headroom."""
        old = self.state.node(r.node_id)
        instances = old.instances if old is not None and old.alive else ()
        spare = old.spare_bytes if old is not None and old.alive else 0  # R1: ours, not foreign
        waiting = self.placements.awaiting_bytes(r.node_id)
        exiting = self.placements.exiting_bytes(r.node_id)  # X1: released processes not yet exited
        ours = sum(held_bytes(i) for i in instances) + spare + exiting - waiting  # kept prompt prefixes included (X4): not foreign
        if r.ours_bytes is not None and instances:  # what was ours when the report was asked for: what it measured beside
            ours = r.ours_bytes
        self.sites.reported(r.node_id, r.ray_node_id, r.store, self.clock.now() if r.asked_at is None else r.asked_at, r.chip)
        room, copying = (self.sites.room(r.node_id), bool(r.store.fetching)) if r.store is not None else (None, False)
        self.placements.reported(r.node_id, self.clock.now() if r.asked_at is None else r.asked_at, r.free_bytes, room, copying)
        stored = r.stored if r.stored is not None or r.store is None else self.sites.stored(r.store)
        node = NodeState(
            node_id=r.node_id,
            labels=r.labels,
            devices=r.devices,
            total_bytes=r.total_bytes,
            usable_bytes=min(r.usable_bytes, r.total_bytes),
            foreign_bytes=max(0, r.usable_bytes - r.free_bytes - ours),
            reported_headroom_bytes=r.free_bytes - waiting,
            instances=instances,
            alive=True,
            draining=old.draining if old is not None else False,
            stored=stored if stored is not None else old.stored if old is not None else frozenset(),
            spare_bytes=spare,
        )
        nodes = tuple(n for n in self.state.nodes if n.node_id != r.node_id) + (node,)
        self.state = self.state.model_copy(update={"nodes": tuple(sorted(nodes, key=lambda n: n.node_id))})
        if old is None or not old.alive:
            self._record("node_up", node_id=r.node_id, bytes=r.usable_bytes, reason=f"{gib(r.usable_bytes)} usable")
        self.placements.check(r.node_id)

    def _caches_reported(self, r: CachesReported) -> None:
        """X4: what each ready instance's kept prompt prefixes hold now is part of its footprint. An
        instance being asked to give them back is left as the placement counted it (0) until that
        ends; one whose last shrink freed nothing it was counted for reads 0 for `exit_wait_s`, so its
        cache is other processes' memory (the next report puts it in foreign) and the next decision
        evicts instead of asking it again."""
        node = self.state.node(r.node_id)
        if node is None or not node.alive:
            return
        for model, nbytes in r.prefix_cache_bytes.items():
            ref = InstanceRef(node_id=r.node_id, model=model)
            inst = node.instance(model)
            if inst is None or inst.status != "ready" or self.placements.shrinking(ref):
                continue
            self.state = set_prefix_cache(self.state, ref, 0 if self.placements.unshrinkable(ref) else nbytes, r.prefix_reload_s.get(model))
        for model, measured in r.measured.items():  # M1: measured once idle after its load; reserved by from then on
            catalog = self.placements.measurements.record(self.state.catalog, model, measured)
            if catalog is not self.state.catalog:
                self.state = self.state.model_copy(update={"catalog": catalog})
            self.state = hold_measured(self.state, InstanceRef(node_id=r.node_id, model=model), measured.reserved_bytes)

    def _node_lost(self, lost: NodeLost) -> None:
        """Drop the node's instances and leases; requests for its models are placed elsewhere."""
        node = self.state.node(lost.node_id)
        if node is None or not node.alive:
            return
        for inst in node.instances:
            cause = "node_suspect" if lost.suspect else "node_dead"
            self._record("unloaded", model=inst.model, node_id=lost.node_id, reason=cause.replace("_", " "), bytes=inst.bytes, cause=cause)
            self.leases.end_on(InstanceRef(node_id=lost.node_id, model=inst.model))
            self.swaps.drains.pop(InstanceRef(node_id=lost.node_id, model=inst.model), None)
        self.spares.gone(lost.node_id)
        gone = node.model_copy(update={"alive": False, "instances": (), "spare_bytes": 0})
        self.state = self.state.model_copy(update={"nodes": tuple(gone if n.node_id == lost.node_id else n for n in self.state.nodes)})
        self._record("node_suspect" if lost.suspect else "node_dead", node_id=lost.node_id, reason=lost.reason)
        self.placements.check(lost.node_id)  # placements waiting for room there load nothing now

    def adopt_instance(self, node_id: str, model: str, device: Any, nbytes: int, load_seconds: float | None = None, actor: str | None = None) -> None:
        """A running instance found after a restart (its actor outlived the old controller)."""
        node = self.state.node(node_id)
        if node is None or model not in self.state.catalog or node.instance(model) is not None:
            return
        if actor is not None:
            self.sites.actors[(model, node_id)] = actor
        place = Place(model=model, node_id=node_id, device=device, bytes=nbytes, reason="adopted")
        now = self.clock.now()
        self.state = mark_loaded(apply_place(self.state, place, now), InstanceRef(node_id=node_id, model=model), now, load_seconds or 0.0)
        self._record("loaded", model=model, node_id=node_id, bytes=nbytes, reason="adopted a running instance")

    # ---- asks -----------------------------------------------------------------------------------
    async def acquire(self, model: str, holder: str | None = None, avoid: tuple[str, float] | None = None) -> LeaseRecord:
        """A lease on a ready instance of `model`, placing (and evicting, or draining) as the policy
        decides and waiting while it says so; OrchardError with the policy's reason otherwise. With
        a `holder`, a standing lease for that ingress replica. `avoid` (node, loaded_at): the
        incarnation this request just left as gone; it is not granted again while it lasts."""
        now = self.clock.now()
        if holder is not None:
            self.leases.seen(holder, now)
        elif model in self.state.catalog:  # a holder counts its requests itself (report_usage)
            self.demand.add(model, 1, now)
        return await self._enqueue(Ask(model=model, started=now, future=self._future(), holder=holder, avoid=avoid))

    async def load(self, model: str, node_id: str | None = None) -> InstanceRef:
        """Operator load: where the policy says, or on `node_id` (an extra copy there, within
        max_copies). Returns once the instance is ready. A model marked failed is tried again."""
        self._spec(model)
        for key in [k for k in self.placements.for_requests if k[0] == model]:  # the operator waits for these now
            del self.placements.for_requests[key]
        if model in self.state.failed:
            self.state = clear_failed(self.state, model)
            self._failed_files.pop(model, None)
            self._record("retrying", model=model, reason="an operator loads it")
        return await self._enqueue(Ask(model=model, started=self.clock.now(), future=self._future(), operator=True, node_id=node_id))

    def what_if(self, model: str, node_id: str | None = None) -> Decision:
        """What a request for `model` (or an operator's load of it on `node_id`) would be answered now,
        decided as an ask is, without doing any of it."""
        return self.asks.what_if(model, node_id, self.clock.now())

    async def _enqueue(self, ask: Ask) -> Any:
        self.asks.add(ask)
        self._redecide()
        try:
            return await ask.future
        finally:
            if self.asks.left(ask):  # cancelled (client gone) while waiting, the last for its model: what
                self.placements.cancel_for_requests(ask.model)  # was started for requests alone stops,
                self.swaps.stop_for(ask.model)  # and a drain for it goes back to serving

    def _redecide(self) -> None:
        """Decide every queued ask once against the current state; then finish the drains that
        ended and start the swap the blocked asks earn (W1-W3)."""
        self._redecide_soon = False
        now = self.clock.now()
        self.swaps.finish()
        self.asks.decide_all(now)
        self.swaps.maybe_swap(self.asks.blocked(), now)

    # ---- leases ---------------------------------------------------------------------------------
    def release(self, lease_id: str) -> None:
        """End a lease (stream finished, failed, or the client went away; a holder gave its standing
        lease back). Idempotent."""
        lease = self.leases.end(lease_id)
        if lease is not None:
            self._count(InstanceRef(node_id=lease.node_id, model=lease.model), self.clock.now())
            self._wake()

    def report_usage(self, holder: str, in_flight: dict[str, int], started: dict[str, int] | None = None) -> None:
        """A holder's requests in flight per standing lease, and those it started per model since its
        last report (the demand L4 counts)."""
        now = self.clock.now()
        for model, n in (started or {}).items():
            if model in self.state.catalog and n > 0:
                self.demand.add(model, n, now)
        touched, idle = self.leases.report(holder, in_flight, now)
        for ref in touched:
            self._count(ref, now)
        if idle:  # a placement waiting on it may revoke it, a drain may end
            self._wake()

    async def routes(self, holder: str, version: int = -1, timeout_s: float = 10.0) -> RoutesView:
        """A holder's long poll: answers at once when `version` is not the current one, else when it
        changes or after `timeout_s` (on the loop's clock)."""
        self.leases.seen(holder, self.clock.now())
        if version == self.leases.version:
            await until(self.clock, self.leases.change(), timeout_s)
        self.leases.seen(holder, self.clock.now())
        return self.leases.view(holder, ready_copies(self.state))

    def _count(self, ref: InstanceRef, now: float) -> None:
        if self._instance(ref) is not None:
            self.state = set_in_flight(self.state, ref, self.leases.in_flight(ref), now)

    # ---- ticks and operator actions -------------------------------------------------------------
    def tick(self) -> None:
        """Periodic: expire forgotten leases, unload idle / drained / dead instances, start copies
        and spare processes (R1)."""
        now = self.clock.now()
        for lease, why in self.leases.expired(now):
            self._count(InstanceRef(node_id=lease.node_id, model=lease.model), now)
            self._record("lease_expired", model=lease.model, node_id=lease.node_id, reason=why)
        for unload in sweep(self.state, now, self.config):
            if unload.reason == "node_dead":
                self.node_dead(unload.instance.node_id)
            else:
                self._drop(unload.instance, "unloaded", unload.reason, unload.reason, cause=unload.reason)
        for place in plan_copies(self.state, now, self.config):
            self.placements.begin(place)
        self.placements.background_copies(now, self.demand.snapshot(now))
        self.spares.plan()
        self._wake()

    async def pull(self, model: str, node_id: str) -> None:
        """An operator's pull: the model's weights into the node's store, without loading it, on the
        same copy path as every other copy; OrchardError when the copy fails (fetch_failed says why)."""
        await self.placements.copy(model, node_id, "pull")

    def unload(self, model: str) -> list[InstanceRef]:
        """Operator unload of every copy (the effects drain requests in flight before they stop);
        pinned models must be unpinned first."""
        if self._spec(model).pinned:
            raise OrchardError("model_pinned", f"model {model} is pinned: unpin it first")
        refs = [InstanceRef(node_id=n.node_id, model=model) for n in self.state.nodes if n.alive and n.instance(model) is not None]
        for ref in refs:
            self._drop(ref, "unloaded", "unloaded by the operator", "unloaded by the operator", cause="operator")
        return refs

    def pin(self, model: str, pinned: bool = True) -> ModelSpec:
        spec = self._spec(model).model_copy(update={"pinned": pinned})
        self.state = self.state.model_copy(update={"catalog": {**self.state.catalog, model: spec}})
        self._record("pinned" if pinned else "unpinned", model=model)
        self._wake()
        return spec

    def held_bytes(self, node_id: str) -> int:
        """What our instances on the node hold or are loading (those waiting for room hold nothing
        yet), and the processes that released their model's memory but have not exited (X1)."""
        node = self.state.node(node_id)
        placements = self.placements
        return (ours_bytes(node) if node is not None else 0) - placements.awaiting_bytes(node_id) + placements.exiting_bytes(node_id)

    def restore(self, events: list[ClusterEvent], pins: dict[str, bool]) -> None:
        """What a previous controller left in the operator's store: its event log (numbering goes on
        after it) and the operator's pins and unpins (applied over the registry, quietly)."""
        self.log.restore(events)
        catalog = dict(self.state.catalog)
        for model, pinned in pins.items():
            if model in catalog:
                catalog[model] = catalog[model].model_copy(update={"pinned": pinned})
        self.state = self.state.model_copy(update={"catalog": catalog})

    # ---- views ----------------------------------------------------------------------------------
    def events(self, since: int = 0) -> list[ClusterEvent]:
        return self.log.since(since)

    async def next_events(self, since: int, timeout_s: float = 10.0) -> list[ClusterEvent]:
        """A watcher's long poll: the events after `since`, at once when there are any, else when the
        next is recorded or after `timeout_s` (empty)."""
        if not self.log.has_after(since):
            await until(self.clock, self.log.recorded, timeout_s)
        return self.events(since)

    @property
    def epoch(self) -> str:
        return self.leases.epoch

    @property
    def acquires(self) -> int:
        return self.leases.granted

    def mark_failed(self, failure: LoadFailure) -> None:
        """P10: the model is refused for a back-off; its files' version now is what a change is seen against."""
        self.state = mark_failed(self.state, failure, self.clock.now())
        self._failed_files[failure.model] = self.effects.files_version(failure.model)

    def _retry_if_files_changed(self, model: str) -> None:
        """A model marked failed whose files changed since (fixed, copied again) is tried again now."""
        if model not in self.state.failed or model not in self._failed_files:
            return
        if self.effects.files_version(model) != self._failed_files[model]:
            del self._failed_files[model]
            self.state = clear_failed(self.state, model)
            self._record("retrying", model=model, reason="its files changed since it failed to load")

    def _drop(
        self, ref: InstanceRef, kind: EventKind | None, reason: str, stop_reason: str, cause: str | None = None, for_room: bool = False
    ) -> None:
        """Remove an instance and its leases from the state, record why (`kind`), and stop it
        (`for_room`: evicted for a placement, so its process may be the node's next spare, R1)."""
        inst = self._instance(ref)
        if inst is None:
            return
        self.state = remove_instance(self.state, ref)
        self.leases.end_on(ref)
        self.swaps.drains.pop(ref, None)
        if kind is not None:
            self._record(kind, model=ref.model, node_id=ref.node_id, bytes=inst.bytes, reason=reason, cause=cause)
        if not self.placements.cancel(ref):  # one still waiting for room runs nothing
            self.placements.stop(ref, stop_reason, inst.bytes, for_room)
        self._wake()

    # ---- plumbing -------------------------------------------------------------------------------
    def _spec(self, model: str) -> ModelSpec:
        spec = self.state.catalog.get(model)
        if spec is None:
            raise OrchardError("model_not_found", f"model {model!r} is not in the registry", "model")
        return spec

    def _instance(self, ref: InstanceRef) -> InstanceState | None:
        node = self.state.node(ref.node_id)
        return node.instance(ref.model) if node is not None else None

    def _record(self, kind: EventKind, **fields: Any) -> None:
        event = ClusterEvent(seq=self.log.next_seq(), at=self.clock.now(), kind=kind, **fields)
        self.log.write(event)
        self.effects.publish(event)
        if kind in _ROUTES_CHANGE:
            self.leases.changed()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _wake(self) -> None:
        """The state changed: decide the queued asks again, soon (the caller may be mid-change)."""
        if self.asks.queues or self.swaps.drains:
            if self._redecide_soon:
                return
            try:
                asyncio.get_running_loop().call_soon(self._redecide)
            except RuntimeError:  # no loop (a synchronous test driving the state): nothing waits
                return
            self._redecide_soon = True

    def _schedule(self, delay_s: float) -> None:
        """Decide again after `delay_s` on the loop's clock (what passes with time: a young blocker
        coming of age, a wait timing out); one timer, at the earliest time asked for."""
        when = self.clock.now() + max(0.0, delay_s)
        if self._timer is not None and self._timer[0] <= when:
            return
        if self._timer is not None:
            self._timer[1].cancel()
        self._timer = (when, self.clock.call_at(when, self._on_timer))

    def _on_timer(self) -> None:
        self._timer = None
        self._redecide()

    async def settle(self) -> None:
        """Wait for every started load and stop (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


# Events after which a holder's standing leases or the ready copies may differ.
_ROUTES_CHANGE: frozenset[str] = frozenset({"loaded", "evicted", "unloaded", "died", "node_dead", "node_suspect", "lease_expired", "draining"})
