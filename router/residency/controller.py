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
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from deployments.wire.failure import OrchardError
from deployments.wire.leases import LeaseRecord, RoutesView
from policy import (
    ClusterState,
    InstanceRef,
    InstanceState,
    LoadFailure,
    ModelSpec,
    NodeState,
    Place,
    PolicyConfig,
    Reject,
    Use,
    Wait,
    ensure,
    plan_copies,
    sweep,
)
from policy.decisions import Decision
from policy.eviction import ready_copies
from policy.failures import reject_marked
from policy.memory import gib
from policy.on_node import place_on
from policy.swap import Drain, SwapAsk, pick_swap
from policy.transitions import (
    apply_place,
    clear_failed,
    learn_bandwidth,
    mark_draining,
    mark_failed,
    mark_loaded,
    mark_stored,
    mark_unstored,
    remove_instance,
    set_in_flight,
)
from router.residency.clock import Clock, MonotonicClock, Timer
from router.residency.demand import Demand
from router.residency.events import (
    ClusterEvent,
    EventKind,
    FetchDone,
    InstanceDied,
    LoadDone,
    LoadError,
    LoadFailed,
    LoadResult,
    NodeLost,
    NodeReported,
    StopDone,
)
from router.residency.leases import LeaseBook
from router.residency.placements import Placements

__all__ = ["ClusterEvent", "Effects", "LoadError", "LoadResult", "ResidencyController"]


class Effects(Protocol):
    async def start_instance(self, place: Place, spec: ModelSpec) -> LoadResult: ...

    async def stop_instance(self, instance: InstanceRef, reason: str) -> bool:
        """Stop the instance's current incarnation; True once no process of it runs any more."""
        ...

    def want_report(self, node_id: str) -> None:
        """Ask the node for a fresh memory report soon: it arrives as `NodeReported`."""
        ...

    async def fetch_weights(self, model: str, node_id: str, background: str | None = None) -> None:
        """Put the model's weights in the node's store, raising LoadError when that fails; with
        `background` (its reason), a background copy that removes nothing stored there (L4)."""
        ...

    def fetch_progress(self, model: str, node_id: str) -> str | None: ...

    def publish(self, event: ClusterEvent) -> None: ...

    def files_version(self, model: str) -> str | None:
        """Something that changes when the model's files do (sizes and times), None if unknown."""
        ...


@dataclass(eq=False)
class _Ask:
    """A request (for a lease) or an operator's load (for a ready instance) in its model's queue."""

    model: str
    started: float
    future: asyncio.Future
    holder: str | None = None  # an ingress replica asking for a standing lease
    operator: bool = False
    node_id: str | None = None  # an operator's load on this node
    avoid: tuple[str, float] | None = None  # (node, loaded_at): an incarnation the request just left
    announced: bool = False  # its `waiting` event is recorded
    placed: bool = False  # an operator's load on a node: its placement was started
    busy_blocked: bool = field(default=False)  # its last decision: busy instances keep it out


class ResidencyController:
    def __init__(
        self,
        catalog: dict[str, ModelSpec],
        config: PolicyConfig,
        effects: Effects,
        *,
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
        self.demand = Demand(config.demand_half_life_s)  # requests per model, decayed (L4)
        self.leases = LeaseBook(max_lease_s=max_lease_s, holder_timeout_s=holder_timeout_s)
        self.placements = Placements(self)  # placements that wait for stops to exit and the room to show (X1)
        # How long a request under contention "fail", or an operator's load on a node, may wait for
        # standing leases in its way to be given back before it is refused.
        self.revoke_grace_s = revoke_grace_s
        self._events: deque[ClusterEvent] = deque(maxlen=max_events)
        self._recorded = asyncio.Event()  # set (and replaced) by every event recorded: wakes next_events
        self._seq = itertools.count(1)
        self._asks: dict[str, deque[_Ask]] = {}
        self._failed_files: dict[str, str | None] = {}  # model marked failed -> its files' version then
        self._removing: set[tuple[str, str]] = set()  # (model, node) whose files an operator removes (X3)
        self._drains: dict[InstanceRef, str] = {}  # instance draining for a swap -> the model it makes room for
        self._swaps: deque[tuple[float, str]] = deque()  # when and where each swap of the last minute started (W2)
        self._tasks: set[asyncio.Task] = set()
        self._redecide_soon = False
        self._timer: tuple[float, Timer] | None = None

    # ---- happenings in --------------------------------------------------------------------------
    def apply(self, event: NodeReported | NodeLost | InstanceDied | LoadDone | LoadFailed | StopDone | FetchDone) -> None:
        if isinstance(event, NodeReported):
            self._node_reported(event)
        elif isinstance(event, NodeLost):
            self._node_lost(event)
        elif isinstance(event, InstanceDied):
            self._drop(event.instance, "died", event.cause, f"died: {event.cause}")
        elif isinstance(event, LoadDone):
            self.placements.load_done(event)
        elif isinstance(event, LoadFailed):
            self.placements.load_failed(event)
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
        waiting = self.placements.awaiting_bytes(r.node_id)
        ours = sum(i.bytes for i in instances) - waiting
        self.placements.reported(r.node_id, self.clock.now() if r.asked_at is None else r.asked_at, r.free_bytes, r.store_room, r.store_copying)
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
            stored=r.stored if r.stored is not None else old.stored if old is not None else frozenset(),
        )
        nodes = tuple(n for n in self.state.nodes if n.node_id != r.node_id) + (node,)
        self.state = self.state.model_copy(update={"nodes": tuple(sorted(nodes, key=lambda n: n.node_id))})
        if old is None or not old.alive:
            self._record("node_up", node_id=r.node_id, bytes=r.usable_bytes, reason=f"{gib(r.usable_bytes)} usable")
        self.placements.check(r.node_id)

    def _node_lost(self, lost: NodeLost) -> None:
        """Drop the node's instances and leases; requests for its models are placed elsewhere."""
        node = self.state.node(lost.node_id)
        if node is None or not node.alive:
            return
        for inst in node.instances:
            cause = "node_suspect" if lost.suspect else "node_dead"
            self._record("unloaded", model=inst.model, node_id=lost.node_id, reason=cause.replace("_", " "), bytes=inst.bytes, cause=cause)
            self.leases.end_on(InstanceRef(node_id=lost.node_id, model=inst.model))
            self._drains.pop(InstanceRef(node_id=lost.node_id, model=inst.model), None)
        gone = node.model_copy(update={"alive": False, "instances": ()})
        self.state = self.state.model_copy(update={"nodes": tuple(gone if n.node_id == lost.node_id else n for n in self.state.nodes)})
        self._record("node_suspect" if lost.suspect else "node_dead", node_id=lost.node_id, reason=lost.reason)
        self.placements.check(lost.node_id)  # placements waiting for room there load nothing now

    def adopt_instance(self, node_id: str, model: str, device: Any, nbytes: int, load_seconds: float | None = None) -> None:
        """A running instance found after a restart (its actor outlived the old controller)."""
        node = self.state.node(node_id)
        if node is None or model not in self.state.catalog or node.instance(model) is not None:
            return
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
        return await self._enqueue(_Ask(model=model, started=now, future=self._future(), holder=holder, avoid=avoid))

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
        return await self._enqueue(_Ask(model=model, started=self.clock.now(), future=self._future(), operator=True, node_id=node_id))

    async def _enqueue(self, ask: _Ask) -> Any:
        self._asks.setdefault(ask.model, deque()).append(ask)
        self._redecide()
        try:
            return await ask.future
        finally:
            queue = self._asks.get(ask.model)
            if queue is not None and ask in queue:  # cancelled (client gone) while waiting
                queue.remove(ask)
                if not queue:
                    del self._asks[ask.model]
                    self._cancel_unwaited(ask.model)

    def _cancel_unwaited(self, model: str) -> None:
        """The last ask for `model` went away: cancel what was started for requests alone (a load,
        a fetch before an eviction), and a drain for it goes back to serving."""
        for (m, node_id), task in list(self.placements.for_requests.items()):
            if m != model:
                continue
            del self.placements.for_requests[(m, node_id)]
            self._record("cancelled", model=model, node_id=node_id, reason="every request that asked for it went away")
            if task is not None:
                task.cancel()
            else:  # still waiting for room: nothing runs yet
                self.placements.cancel(InstanceRef(node_id=node_id, model=model))
        for ref, asker in list(self._drains.items()):
            if asker == model and self._instance(ref) is not None:
                del self._drains[ref]
                self.state = mark_draining(self.state, ref, False)
                self._record("cancelled", model=ref.model, node_id=ref.node_id, reason=f"draining stopped: no request for {model} waits any more")

    def _redecide(self) -> None:
        """Decide every queued ask once against the current state, oldest first in each queue; then
        finish the drains that ended and start the swap the blocked asks earn (W1-W3)."""
        self._redecide_soon = False
        now = self.clock.now()
        self._finish_drains()
        for model in list(self._asks):
            queue = self._asks[model]
            for ask in list(queue):
                if ask.future.done() or self._decide(ask, now):
                    queue.remove(ask)
            if not queue:
                del self._asks[model]
        self._maybe_swap(now)

    def _decide(self, ask: _Ask, now: float) -> bool:
        """One decision for one ask; True when it is answered (a lease, an instance or an error)."""
        try:
            return self._decide_on_node(ask, now) if ask.node_id is not None else self._decide_anywhere(ask, now)
        except OrchardError as e:
            ask.future.set_exception(e)
            return True

    def _decide_anywhere(self, ask: _Ask, now: float) -> bool:
        model = ask.model
        ask.busy_blocked = False
        self._retry_if_files_changed(model)
        for _ in range(3):  # a Place is applied to the state at once: decide again on the new state
            decision = ensure(model, self.state, now, self.config, waited_s=now - ask.started, exclude_nodes=self._removing_on(model))
            if not isinstance(decision, Place):
                break
            if not self.placements.begin(decision, for_requests=not ask.operator):
                return self._waiting_for_fetch(ask, decision, now)
        if isinstance(decision, Use):
            return self._use(ask, decision.instance, now)
        if self._waits_for_revoked(decision, ask.started, now):
            self._schedule(self.config.retry_poll_s)
            return False
        if isinstance(decision, Wait):
            ask.busy_blocked = decision.code == "busy"
            if ask.busy_blocked and not ask.announced:
                ask.announced = True
                blocker = decision.blockers[0].instance.node_id if decision.blockers else None
                self._record("waiting", model=model, node_id=blocker, reason=decision.message)
            self._schedule(min(decision.retry_after_s, self.config.swap_after_s) if ask.busy_blocked else decision.retry_after_s)
            return False
        if isinstance(decision, Place):  # still placing after three rounds: wait for the loads
            return False
        assert isinstance(decision, Reject)
        if self._removing_on(model):  # X3: refused only while its files leave a node: decide again after
            self._schedule(self.config.retry_poll_s)
            return False
        if decision.code == "unknown_model":
            pass  # a 404, not a placement decision: names a client made up stay out of the log
        elif ask.announced:
            waited = now - ask.started
            self._record("gave_up", model=model, reason=f"after waiting {waited:.1f} s: {decision.message}", seconds=waited)
        else:
            self._record("rejected", model=model, reason=decision.message)
        raise _error_for(decision)

    def _use(self, ask: _Ask, ref: InstanceRef, now: float) -> bool:
        inst = self._instance(ref)
        assert inst is not None  # a Use names an instance the state holds
        if ask.operator:
            ask.future.set_result(ref)
            return True
        if ask.avoid == (ref.node_id, inst.loaded_at) and now - ask.started < self.revoke_grace_s:
            self._schedule(self.config.retry_poll_s)  # its death is being confirmed: another decision then
            return False
        lease = self.leases.grant(ref, inst.loaded_at, ask.holder, now)
        self._count(ref, now)
        ask.future.set_result(lease)
        return True

    def _decide_on_node(self, ask: _Ask, now: float) -> bool:
        """An operator's load on one node (P11): an extra copy there, within max_copies."""
        model, node_id = ask.model, ask.node_id
        assert node_id is not None
        decision = place_on(model, node_id, self.state, now, self.config)
        if isinstance(decision, Use):
            ask.future.set_result(decision.instance)
            return True
        if isinstance(decision, Wait) or (model, node_id) in self.placements.prefetches:
            return False  # loading there (its LoadDone decides again), or its weights arrive first
        if isinstance(decision, Reject) and decision.code in ("unknown_model", "no_node"):
            raise _error_for(decision)
        mark = self.state.failed.get(model)
        if mark is not None and mark.at >= ask.started:
            raise _error_for(reject_marked(mark, now, self.config))
        node = self.state.node(node_id)
        if ask.placed and node is not None and model not in node.stored:
            raise OrchardError("model_unloaded", f"model {model} left {node_id} before it was ready")
        if (model, node_id) in self._removing:
            raise OrchardError("files_in_use", f"the files of {model} are being removed from {node_id}'s store: load it there after", "node")
        if isinstance(decision, Place):
            ask.placed = self.placements.begin(decision)
            return False
        assert isinstance(decision, Reject)
        revoking = any(self.leases.revoke_idle(b.instance) for b in decision.blockers if b.protection == "busy")
        if decision.code == "blocked" and revoking and now - ask.started < self.revoke_grace_s:
            self._schedule(self.config.retry_poll_s)  # idle standing leases in the way come back
            return False
        if decision.code == "blocked":
            self._record("rejected", model=model, node_id=node_id, reason=decision.message)
        raise _error_for(decision)

    def what_if(self, model: str, node_id: str | None = None) -> Decision:
        """What a request for `model` (or an operator's load of it on `node_id`) would be answered now,
        decided as `_decide` decides, without doing any of it."""
        now = self.clock.now()
        if node_id is not None:
            return place_on(model, node_id, self.state, now, self.config)
        return ensure(model, self.state, now, self.config, exclude_nodes=self._removing_on(model))

    def _waiting_for_fetch(self, ask: _Ask, place: Place, now: float) -> bool:
        """A request whose placement waits for the weights to arrive first: as `contention` says, a
        503 at once (`fail`) or a wait up to wait_timeout_s (`wait`), the copy's progress in the
        message either way. True when answered."""
        if ask.operator:
            return False
        progress = self.effects.fetch_progress(place.model, place.node_id)
        what = f"model {place.model} waits for its weights on {place.node_id} before placing it ({place.reason})"
        message = f"{what}: {progress}" if progress else what
        waited = now - ask.started
        if self.config.contention == "wait" and waited < self.config.wait_timeout_s:
            self._schedule(self.config.retry_poll_s)  # to see the timeout pass
            return False
        if self.config.contention == "wait":
            self._record("gave_up", model=place.model, node_id=place.node_id, reason=f"after waiting {waited:.1f} s: {message}", seconds=waited)
            raise OrchardError("model_gave_up", f"gave up after waiting {waited:.0f} s: {message}", retry_after_s=self.config.retry_poll_s)
        raise OrchardError("model_fetching", message, retry_after_s=self.config.retry_poll_s)

    def _waits_for_revoked(self, decision: Decision, started: float, now: float) -> bool:
        """Revoke the idle standing leases that keep the decision's busy blockers busy; True when a
        refusal should wait for them instead (contention "fail", within revoke_grace_s)."""
        if not isinstance(decision, Wait | Reject) or decision.code != "busy":
            return False
        pending = [self.leases.revoke_idle(b.instance) for b in decision.blockers if b.protection == "busy"]
        return any(pending) and isinstance(decision, Reject) and now - started < self.revoke_grace_s

    # ---- swaps (W1-W3) --------------------------------------------------------------------------
    def _maybe_swap(self, now: float) -> None:
        asks = [
            SwapAsk(model=model, waiting=len(blocked), waited_s=now - min(a.started for a in blocked))
            for model, queue in self._asks.items()
            if (blocked := [a for a in queue if a.busy_blocked and not a.future.done()])
        ]
        while self._swaps and now - self._swaps[0][0] > 60.0:
            self._swaps.popleft()
        draining_for = frozenset(self._drains.values())
        spent = Counter(node for _, node in self._swaps)
        drain = pick_swap(asks, self.state, now, self.config, swaps_last_minute=spent, draining_for=draining_for) if asks else None
        if drain is not None:
            self._start_drain(drain, now)

    def _start_drain(self, drain: Drain, now: float) -> None:
        self._swaps.append((now, drain.node_id))
        for ref in drain.instances:
            self.state = mark_draining(self.state, ref)
            self._drains[ref] = drain.model
            self.leases.revoke_all(ref)
            inst = self._instance(ref)
            self._record("draining", model=ref.model, node_id=ref.node_id, bytes=inst.bytes if inst else None, reason=drain.reason)
        self._finish_drains()

    def _finish_drains(self) -> None:
        """A draining instance with nothing left in flight is evicted for the model it drained for."""
        for ref, asker in list(self._drains.items()):
            inst = self._instance(ref)
            if inst is None or inst.status != "draining":
                del self._drains[ref]
            elif inst.in_flight == 0:
                del self._drains[ref]
                self._drop(ref, "evicted", f"drained for {asker}", f"evicted for {asker}", cause="swap")

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
            await self._until(self.leases.change(), timeout_s)
        self.leases.seen(holder, self.clock.now())
        return self.leases.view(holder, ready_copies(self.state))

    def _count(self, ref: InstanceRef, now: float) -> None:
        if self._instance(ref) is not None:
            self.state = set_in_flight(self.state, ref, self.leases.in_flight(ref), now)

    # ---- ticks and operator actions -------------------------------------------------------------
    def tick(self) -> None:
        """Periodic: expire forgotten leases, unload idle / drained / dead instances, start copies."""
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

    def begin_removing(self, node_id: str, models: frozenset[str]) -> None:
        """An operator removes a folder from `node_id`'s store that `models` load from (X3): refused
        (409 files_in_use) while one of them is on the node, its weights are being copied there, or
        the folder is already being removed; else no placement chooses that node for them until
        `end_removing`. Checked and marked in one step of the loop."""
        node = self.state.node(node_id)
        on_node = sorted(i.model for i in node.instances if i.model in models) if node is not None else []
        if on_node:
            loading = [m for m in on_node if node is not None and (i := node.instance(m)) is not None and i.status == "loading"]
            what = "is loading" if loading else "is"
            raise OrchardError(
                "files_in_use",
                f"{', '.join(on_node)} {what if len(on_node) == 1 else 'are'} on {node_id} from these files"
                + (" (a placement in progress)" if loading else "")
                + ": unload first",
                "node",
            )
        copying = sorted(m for m, n in self.placements.prefetches if n == node_id and m in models)
        if copying:
            raise OrchardError("files_in_use", f"the weights of {', '.join(copying)} are being copied to {node_id} for a placement", "node")
        if any((m, node_id) in self._removing for m in models):
            raise OrchardError("files_in_use", f"these files are already being removed from {node_id}", "node")
        self._removing.update((m, node_id) for m in models)

    def end_removing(self, node_id: str, models: frozenset[str], removed: bool) -> None:
        self._removing.difference_update((m, node_id) for m in models)
        if removed and self.state.node(node_id) is not None:
            self.state = mark_unstored(self.state, node_id, models)
        self._wake()

    def _removing_on(self, model: str) -> frozenset[str]:
        return frozenset(n for m, n in self._removing if m == model)

    def held_bytes(self, node_id: str) -> int:
        """What our instances on the node hold or are loading (those waiting for room hold nothing yet)."""
        node = self.state.node(node_id)
        return (sum(i.bytes for i in node.instances) if node is not None else 0) - self.placements.awaiting_bytes(node_id)

    def restore(self, events: list[ClusterEvent], pins: dict[str, bool]) -> None:
        """What a previous controller left in the operator's store: its event log (numbering goes on
        after it) and the operator's pins and unpins (applied over the registry, quietly)."""
        self._events.extend(events)
        if events:
            self._seq = itertools.count(max(e.seq for e in events) + 1)
        catalog = dict(self.state.catalog)
        for model, pinned in pins.items():
            if model in catalog:
                catalog[model] = catalog[model].model_copy(update={"pinned": pinned})
        self.state = self.state.model_copy(update={"catalog": catalog})

    # ---- views ----------------------------------------------------------------------------------
    def events(self, since: int = 0) -> list[ClusterEvent]:
        return [e for e in self._events if e.seq > since]

    async def next_events(self, since: int, timeout_s: float = 10.0) -> list[ClusterEvent]:
        """A watcher's long poll: the events after `since`, at once when there are any, else when the
        next is recorded or after `timeout_s` (empty)."""
        if not self._events or self._events[-1].seq <= since:
            await self._until(self._recorded, timeout_s)
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

    def _drop(self, ref: InstanceRef, kind: EventKind | None, reason: str, stop_reason: str, cause: str | None = None) -> None:
        """Remove an instance and its leases from the state, record why (`kind`), and stop it."""
        inst = self._instance(ref)
        if inst is None:
            return
        self.state = remove_instance(self.state, ref)
        self.leases.end_on(ref)
        self._drains.pop(ref, None)
        if kind is not None:
            self._record(kind, model=ref.model, node_id=ref.node_id, bytes=inst.bytes, reason=reason, cause=cause)
        if not self.placements.cancel(ref):  # one still waiting for room runs nothing
            self.placements.stop(ref, stop_reason, inst.bytes)
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

    def record(self, kind: EventKind, **fields: Any) -> None:
        """An event an effect reports while it works (a copy starting, ending, failing). A finished
        copy teaches the bandwidth (L3) and puts the weights in the node's store at once.
        `source` ("peer" or "hub") says where from."""
        source = fields.pop("source", "peer")
        self._record(kind, **fields, cause=source if kind == "fetched" else None)
        model, node_id, nbytes, seconds = fields.get("model"), fields.get("node_id"), fields.get("bytes"), fields.get("seconds")
        if kind == "fetched" and model in self.state.catalog and node_id is not None and self.state.node(node_id) is not None:
            self.state = mark_stored(self.state, node_id, model)
            if nbytes and seconds:
                self.state = learn_bandwidth(self.state, source, nbytes / seconds)

    def _record(self, kind: EventKind, **fields: Any) -> None:
        event = ClusterEvent(seq=next(self._seq), at=self.clock.now(), kind=kind, **fields)
        self._events.append(event)
        self.effects.publish(event)
        self._recorded.set()
        self._recorded = asyncio.Event()
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
        if self._asks or self._drains:
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

    async def _until(self, event: asyncio.Event, timeout_s: float) -> None:
        """Wait for `event`, at most `timeout_s` on the loop's clock."""
        done = self._future()

        def fire(*_: object) -> None:
            if not done.done():
                done.set_result(None)

        timer = self.clock.call_at(self.clock.now() + timeout_s, fire)
        waiter = asyncio.get_running_loop().create_task(event.wait())
        waiter.add_done_callback(fire)
        try:
            await done
        finally:
            timer.cancel()
            waiter.cancel()

    async def settle(self) -> None:
        """Wait for every started load and stop (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _error_for(reject: Reject) -> OrchardError:
    if reject.code == "unknown_model":
        return OrchardError("model_not_found", reject.message, "model")
    if reject.code == "no_node":
        return OrchardError("node_not_found", reject.message)
    if reject.code == "max_copies":
        return OrchardError("model_already_loaded", reject.message)
    return OrchardError(f"model_{reject.code}", reject.message, retry_after_s=reject.retry_after_s)


# Events after which a holder's standing leases or the ready copies may differ.
_ROUTES_CHANGE: frozenset[str] = frozenset({"loaded", "evicted", "unloaded", "died", "node_dead", "node_suspect", "lease_expired", "draining"})
