"""The residency controller: the one owner of the cluster view and of every placement decision.

Shaped like llama-swap's scheduler: one asyncio loop, events in (a request wants a model, a lease
ends, a load finishes or fails, a node reports or dies, a sweep tick, an operator's load / unload /
pin), decisions from policy/ (pure), side effects out through a small `Effects` interface (start an
instance on a node, drain and stop one, publish an event). State is touched only on that loop, so
it needs no lock. Unit tests drive it with an in-memory Effects; the Ray one lives beside it.

The controller is never on the token path: `acquire` returns a lease naming the instance, the
ingress streams straight from it, and `release` ends the lease.

Nor need it be on every request's path: a lease acquired with a `holder` (an ingress replica) is a
standing lease, which that replica routes many requests through without asking again. It counts as
busy while held, with the in-flight count its holder reports in batches (`report_usage`), so the
policy's rule that a busy instance is never evicted holds exactly: an instance is idle only once
every lease on it has ended. The holder gives a standing lease back after a linger with nothing in
flight, when `routes` (its long poll of this controller) says the lease is revoked, or never, if it
stops reporting (the lease then expires). A standing lease is revoked when an idle one is all that
stands between a waiting request and a placement (`_revoke_idle`)."""

import asyncio
import itertools
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field

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
    fetch_source,
    plan_copies,
    retry_after_failure,
    sweep,
)
from policy._frozen import Frozen
from policy.cluster_state import LoadFailureReason
from policy.decisions import Blocker, Decision
from policy.eviction import ready_copies
from policy.failures import reject_marked
from policy.memory import gib
from policy.placement import blockers_of, place_from_plan, plan_placement
from policy.specs import DeviceKind
from policy.transitions import (
    apply_place,
    clear_failed,
    learn_bandwidth,
    mark_failed,
    mark_loaded,
    mark_stored,
    mark_unstored,
    remove_instance,
    set_in_flight,
)
from router.errors import OrchardError
from router.residency.demand import Demand

EventKind = Literal[
    "placed",
    "loaded",
    "load_failed",
    "retrying",
    "evicted",
    "stopped",
    "loading",
    "unloaded",
    "died",
    "rejected",
    "waiting",
    "gave_up",
    "node_up",
    "node_dead",
    "pinned",
    "unpinned",
    "lease_expired",
    "fetching",
    "fetched",
    "fetch_failed",
    "files_removed",
    "cancelled",
]


class ClusterEvent(Frozen):
    """One line of the placement / eviction / rejection log (GET /v1/cluster/events)."""

    seq: int
    at: float
    kind: EventKind
    model: str | None = None
    node_id: str | None = None
    reason: str = ""
    bytes: int | None = None
    seconds: float | None = None


@dataclass(eq=False)
class _Waiter:
    """A request waiting in its model's queue."""

    model: str
    started: float
    future: "asyncio.Future[Lease]"
    announced: bool = False  # its `waiting` event is recorded
    holder: str | None = None  # an ingress replica asking for a standing lease


class Lease(Frozen):
    lease_id: str
    model: str
    node_id: str
    acquired_at: float
    # When this instance was placed (or adopted): a model placed again on the same node is a new
    # actor under the same name, so callers key cached actor handles by (model, node, loaded_at).
    loaded_at: float
    # The ingress replica that routes requests through this lease until it gives it back (a
    # standing lease); None: one request's lease.
    holder: str | None = None


class LoadResult(Frozen):
    bytes: int = Field(ge=0)  # measured: weights + KV reservation + overhead
    load_seconds: float = Field(ge=0)


class LoadError(Exception):
    """A start_instance that did not end in a loaded instance."""

    def __init__(self, reason: LoadFailureReason, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class NoRoom(Exception):
    """A placement whose node never showed the room for it: the instances stopping there did not
    all exit, or no node report taken after they had exited showed the memory free, in time."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Effects(Protocol):
    def now(self) -> float: ...

    async def start_instance(self, place: Place, spec: ModelSpec) -> LoadResult: ...

    async def stop_instance(self, instance: InstanceRef, reason: str) -> bool:
        """Stop the instance's current incarnation; True once no process of it runs any more (it
        exited, or none was started), False when its exit could not be confirmed."""
        ...

    def want_report(self, node_id: str) -> None:
        """Ask the node for a fresh memory report soon: it arrives as `report_node`."""
        ...

    async def fetch_weights(self, model: str, node_id: str) -> None:
        """Put the model's weights in the node's store (L1), raising LoadError when that fails."""
        ...

    def publish(self, event: ClusterEvent) -> None: ...

    def files_version(self, model: str) -> str | None:
        """Something that changes when the model's files do (sizes and times), None if unknown."""
        ...


class ResidencyController:
    def __init__(
        self,
        catalog: dict[str, ModelSpec],
        config: PolicyConfig,
        effects: Effects,
        *,
        max_events: int = 2000,
        max_lease_s: float = 3600.0,
        holder_timeout_s: float = 15.0,
        revoke_grace_s: float = 2.0,
    ):
        self.config = config
        self.effects = effects
        self.state = ClusterState(catalog=dict(catalog))
        self.demand = Demand(config.demand_half_life_s)  # requests per model, decayed (L4)
        self.max_lease_s = max_lease_s
        # A holder that neither reports nor polls for this long is gone: its standing leases end.
        self.holder_timeout_s = holder_timeout_s
        # How long a request under contention "fail", or an operator's load on a node, may wait for
        # standing leases in its way to be given back before it is refused (an idle one comes back
        # within milliseconds of being revoked; one in use once its holder reports it idle).
        self.revoke_grace_s = revoke_grace_s
        self._holders: dict[str, float] = {}  # holder -> when it last reported or polled
        self._reported: dict[str, int] = {}  # standing lease -> the in-flight count its holder reported
        self._revoked: set[str] = set()  # standing leases asked back, not yet given back
        self._heard: set[str] = set()  # standing leases their holder has reported on since the grant
        self._routes_version = 0  # bumped whenever what `routes` answers may have changed
        self._routes_changed = asyncio.Event()
        self.acquires = 0  # leases granted (standing and per request): what routing saved is visible
        # This controller's incarnation: a holder's standing leases from an earlier one (the service
        # restarted) are unknown here, and `routes` says so by another epoch.
        self.epoch = uuid.uuid4().hex[:12]
        self._events: deque[ClusterEvent] = deque(maxlen=max_events)
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._lease_number = 0  # the last lease granted
        self._leases: dict[str, Lease] = {}
        self._failed_files: dict[str, str | None] = {}  # model marked failed -> its files' version then
        self._prefetches: set[tuple[str, str]] = set()  # (model, node): weights being fetched before an eviction
        # Loads and fetches started for requests alone, by (model, node): cancelled when all those requests
        # have gone away (and no operator load waits for them): {(model, node): task}
        self._for_requests: dict[tuple[str, str], asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._waiters: dict[str, deque[_Waiter]] = {}
        self._drain_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        # Unload, then load (rule X1): stops still running, by node (their processes may hold memory
        # until they exit); placed instances whose load waits for them and for a node report that
        # shows the room, with their bytes; per node, when its latest report was asked for and the
        # free memory it measured.
        self._stopping: dict[str, set[asyncio.Task]] = {}
        self._awaiting_room: dict[InstanceRef, int] = {}
        self._reports: dict[str, tuple[float, int]] = {}
        # node -> when a stop there ended without confirming its process gone: until a report asked
        # for after that shows the room, every load there waits for one.
        self._unsure: dict[str, float] = {}
        # (model, node) whose files an operator is removing from that node's store (rule X3).
        self._removing: set[tuple[str, str]] = set()

    # ---- events in --------------------------------------------------------------------------
    def report_node(
        self,
        node_id: str,
        *,
        devices: tuple[DeviceKind, ...],
        total_bytes: int,
        usable_bytes: int,
        free_bytes: int,
        labels: dict[str, str] | None = None,
        stored: frozenset[str] | None = None,
        asked_at: float | None = None,
    ) -> None:
        """A node agent's measurement. Memory that is neither free nor held by our instances is
        someone else's (foreign); the measured free memory, less what placements waiting to load
        there have reserved (they hold nothing yet), becomes the node's reported headroom.
        `stored`: the catalog models whose weights its store holds (None: as before). `asked_at`:
        when the report was asked for (this controller's clock; default now): a load waiting for
        room trusts only a report asked for after the stops it waits for had ended (X1)."""
        old = self.state.node(node_id)
        instances = old.instances if old is not None and old.alive else ()
        waiting = self._awaiting_bytes(node_id)
        ours = sum(i.bytes for i in instances) - waiting
        self._reports[node_id] = (self.effects.now() if asked_at is None else asked_at, free_bytes)
        node = NodeState(
            node_id=node_id,
            labels=labels or {},
            devices=devices,
            total_bytes=total_bytes,
            usable_bytes=min(usable_bytes, total_bytes),
            foreign_bytes=max(0, usable_bytes - free_bytes - ours),
            reported_headroom_bytes=free_bytes - waiting,
            instances=instances,
            alive=True,
            draining=old.draining if old is not None else False,
            stored=stored if stored is not None else old.stored if old is not None else frozenset(),
        )
        nodes = tuple(n for n in self.state.nodes if n.node_id != node_id) + (node,)
        self.state = self.state.model_copy(update={"nodes": tuple(sorted(nodes, key=lambda n: n.node_id))})
        if old is None or not old.alive:
            self._record("node_up", node_id=node_id, bytes=usable_bytes, reason=f"{gib(usable_bytes)} usable")
        self._wake()

    def node_dead(self, node_id: str, reason: str = "node stopped reporting") -> None:
        """Drop a dead node's instances and leases; requests for its models re-place elsewhere."""
        node = self.state.node(node_id)
        if node is None or not node.alive:
            return
        for inst in node.instances:
            self._record("unloaded", model=inst.model, node_id=node_id, reason="node dead", bytes=inst.bytes)
        for lease_id, lease in list(self._leases.items()):
            if lease.node_id == node_id:
                self._forget_lease(lease_id)
        dead = node.model_copy(update={"alive": False, "instances": ()})
        self.state = self.state.model_copy(update={"nodes": tuple(dead if n.node_id == node_id else n for n in self.state.nodes)})
        self._record("node_dead", node_id=node_id, reason=reason)
        self._wake()

    def instance_died(self, ref: InstanceRef, cause: str) -> None:
        """An instance's actor is gone (killed, out of memory, crashed): drop it and its leases with
        a `died` event naming the cause; the next request for the model places it again."""
        self._drop(ref, "died", cause, f"died: {cause}")

    def adopt_instance(self, node_id: str, model: str, device: DeviceKind, nbytes: int, load_seconds: float | None = None) -> None:
        """A running instance found after a restart (its actor outlived the old controller)."""
        node = self.state.node(node_id)
        if node is None or model not in self.state.catalog or node.instance(model) is not None:
            return
        place = Place(model=model, node_id=node_id, device=device, bytes=nbytes, reason="adopted")
        now = self.effects.now()
        self.state = mark_loaded(apply_place(self.state, place, now), InstanceRef(node_id=node_id, model=model), now, load_seconds or 0.0)
        self._record("loaded", model=model, node_id=node_id, bytes=nbytes, reason="adopted a running instance")

    # ---- requests -----------------------------------------------------------------------------
    async def acquire(self, model: str, holder: str | None = None) -> Lease:
        """A lease on a ready instance of `model`, placing (and evicting) as the policy decides and
        waiting while it says so. Raises OrchardError with the policy's reason otherwise. With a
        `holder`, a standing lease that ingress replica keeps for many requests (see the top).

        The request joins its model's queue of waiters; every state change (a load finished or
        failed, a lease ended, a node reported, an instance died) drains the queues, each waiter
        decided once per change in arrival order, so the oldest request is served first and no
        waiter polls the policy in a loop of its own."""
        waiter = _Waiter(model=model, started=self.effects.now(), future=asyncio.get_running_loop().create_future(), holder=holder)
        if holder is not None:
            self._holders[holder] = waiter.started
        elif model in self.state.catalog:  # a holder counts its requests itself (report_usage)
            self.demand.add(model, 1, waiter.started)
        self._waiters.setdefault(model, deque()).append(waiter)
        self._drain()
        try:
            return await waiter.future
        finally:
            queue = self._waiters.get(model)
            if queue is not None and waiter in queue:  # cancelled (client gone) while waiting
                queue.remove(waiter)
                if not queue:
                    del self._waiters[model]
                    self._cancel_unwaited(model)

    def _cancel_unwaited(self, model: str) -> None:
        """The last request waiting for `model` went away: cancel what was started only for requests
        (a load, or a fetch before an eviction); operator loads and pulls and copies the policy
        started itself (C1, C2) are never cancelled this way."""
        for (m, node_id), task in list(self._for_requests.items()):
            if m == model and not task.done():
                self._record("cancelled", model=model, node_id=node_id, reason="every request that asked for it went away")
                task.cancel()

    def _drain(self) -> None:
        """Decide every waiting request once against the current state (see `acquire`)."""
        self._drain_scheduled = False
        now = self.effects.now()
        for model in list(self._waiters):
            queue = self._waiters[model]
            for waiter in list(queue):
                if waiter.future.done():
                    queue.remove(waiter)
                    continue
                if self._decide(waiter, now):
                    queue.remove(waiter)
            if not queue:
                del self._waiters[model]

    def _decide(self, waiter: "_Waiter", now: float) -> bool:
        """One policy decision for one waiter; True when it is answered (a lease or an error)."""
        model = waiter.model
        self._retry_if_files_changed(model)
        for _ in range(3):  # a Place is applied to the state at once: decide again on the new state
            decision = ensure(model, self.state, now, self.config, waited_s=now - waiter.started, exclude_nodes=self._removing_on(model))
            if not isinstance(decision, Place):
                break
            if not self._begin_place(decision, for_requests=True):
                return self._waiting_for_fetch(waiter, decision, now)
        if isinstance(decision, Use):
            inst = self._instance(decision.instance.node_id, model)
            assert inst is not None  # a Use names an instance the state holds
            self._lease_number = next(self._lease_ids)
            lease = Lease(
                lease_id=f"L{self._lease_number}",
                model=model,
                node_id=decision.instance.node_id,
                acquired_at=now,
                loaded_at=inst.loaded_at,
                holder=waiter.holder,
            )
            self._leases[lease.lease_id] = lease
            if lease.holder is not None:
                self._reported[lease.lease_id] = 1  # the request that asked for it
            self._count_in_flight(decision.instance, now)
            self.acquires += 1
            waiter.future.set_result(lease)
            return True
        if self._waits_for_revoked(decision, waiter.started, now):
            self._schedule_drain(self.config.retry_poll_s)
            return False
        if isinstance(decision, Wait):
            if decision.code == "busy" and not waiter.announced:
                waiter.announced = True
                blocker = decision.blockers[0].instance.node_id if decision.blockers else None
                self._record("waiting", model=model, node_id=blocker, reason=decision.message)
            self._schedule_drain(decision.retry_after_s)
            return False
        if isinstance(decision, Place):  # still placing after three rounds: wait for the loads
            return False
        assert isinstance(decision, Reject)
        if self._removing_on(model):  # X3: refused only while its files leave a node: decide again after
            self._schedule_drain(self.config.retry_poll_s)
            return False
        if decision.code == "unknown_model":
            pass  # a 404, not a placement decision: names a client made up stay out of the log and the metrics
        elif waiter.announced:
            self._record(
                "gave_up", model=model, reason=f"after waiting {now - waiter.started:.1f} s: {decision.message}", seconds=now - waiter.started
            )
        else:
            self._record("rejected", model=model, reason=decision.message)
        waiter.future.set_exception(_error_for(decision))
        return True

    def _waiting_for_fetch(self, waiter: "_Waiter", place: Place, now: float) -> bool:
        """A request whose placement waits for the weights to arrive first: as `contention` says, a
        503 at once (`fail`) or a wait up to wait_timeout_s (`wait`), the copy's progress in the
        message either way. True when answered."""
        progress = self.effects.fetch_progress(place.model, place.node_id) if hasattr(self.effects, "fetch_progress") else None
        what = f"model {place.model} waits for its weights on {place.node_id} before placing it ({place.reason})"
        message = f"{what}: {progress}" if progress else what
        waited = now - waiter.started
        if self.config.contention == "wait" and waited < self.config.wait_timeout_s:
            self._schedule_drain(self.config.retry_poll_s)  # to see the timeout pass
            return False
        if self.config.contention == "wait":
            self._record("gave_up", model=place.model, node_id=place.node_id, reason=f"after waiting {waited:.1f} s: {message}", seconds=waited)
            waiter.future.set_exception(
                OrchardError("model_gave_up", f"gave up after waiting {waited:.0f} s: {message}", retry_after_s=self.config.retry_poll_s)
            )
        else:
            waiter.future.set_exception(OrchardError("model_fetching", message, retry_after_s=self.config.retry_poll_s))
        return True

    def _schedule_drain(self, delay_s: float) -> None:
        """Drain again after `delay_s` (a timer for what passes with time: a young blocker coming of
        age, a wait timing out); one timer, at the earliest time asked for."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay_s)
        if self._timer is not None and self._timer.when() <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._drain()

    def release(self, lease_id: str) -> None:
        """End a lease (stream finished, failed, or the client went away; a holder gave its standing
        lease back). Idempotent."""
        lease = self._leases.pop(lease_id, None)
        self._reported.pop(lease_id, None)
        self._heard.discard(lease_id)
        if lease is None:
            return
        if lease_id in self._revoked:
            self._revoked.discard(lease_id)
            self._routes_update()
        self._count_in_flight(InstanceRef(node_id=lease.node_id, model=lease.model), self.effects.now())
        self._wake()

    # ---- standing leases ----------------------------------------------------------------------
    def report_usage(self, holder: str, in_flight: dict[str, int], started: dict[str, int] | None = None) -> None:
        """A holder's requests in flight per standing lease (sent in batches, a few times a second,
        and at least every few seconds as a sign of life), and the requests it started per model
        since its last report (the demand L4 counts). Unknown leases are ignored: `routes` tells
        the holder they are gone."""
        now = self.effects.now()
        self._holders[holder] = now
        for model, n in (started or {}).items():
            if model in self.state.catalog and n > 0:
                self.demand.add(model, n, now)
        touched = set()
        idle_now = False
        for lease_id, n in in_flight.items():
            lease = self._leases.get(lease_id)
            if lease is None or lease.holder != holder:
                continue
            self._heard.add(lease_id)
            if self._reported.get(lease_id) == n:
                continue
            self._reported[lease_id] = max(0, int(n))
            idle_now = idle_now or n == 0
            touched.add(InstanceRef(node_id=lease.node_id, model=lease.model))
        for ref in touched:
            self._count_in_flight(ref, now)
        if idle_now:  # a placement waiting on it may revoke it now
            self._wake()

    async def routes(self, holder: str, version: int = -1, timeout_s: float = 10.0) -> dict:
        """A holder's long poll: answers at once when `version` is not the current one, else when it
        changes or after `timeout_s`. {version, valid: its standing leases still good, revoked: those
        asked back (finish what runs on them, then release), copies: ready instances per model,
        leases_upto: the last lease number granted when this answer was made, epoch: this
        controller's incarnation}."""
        self._holders[holder] = self.effects.now()
        if version == self._routes_version:
            changed = self._routes_changed
            try:
                await asyncio.wait_for(changed.wait(), timeout=timeout_s)
            except TimeoutError:
                pass
        self._holders[holder] = self.effects.now()
        mine = [lease_id for lease_id, lease in self._leases.items() if lease.holder == holder]
        return {
            "version": self._routes_version,
            "valid": [lease_id for lease_id in mine if lease_id not in self._revoked],
            "revoked": [lease_id for lease_id in mine if lease_id in self._revoked],
            "copies": ready_copies(self.state),
            "epoch": self.epoch,
            "leases_upto": self._lease_number,  # a lease of the holder's after this is not in `valid` yet
        }

    def _waits_for_revoked(self, decision: Decision, started: float, now: float) -> bool:
        """Revoke the idle standing leases that keep the decision's blockers busy; True when a refusal
        should wait for them instead (contention "fail", within revoke_grace_s of the request)."""
        revoking = isinstance(decision, Wait | Reject) and decision.code == "busy" and self._revoke_idle(decision.blockers)
        return revoking and isinstance(decision, Reject) and now - started < self.revoke_grace_s

    def _revoke_idle(self, blockers: tuple[Blocker, ...]) -> bool:
        """Ask back the standing leases that keep a blocking instance busy while idle (their holders
        report nothing in flight, or have not reported since the grant: its request may have ended
        already; a lease asked back while in use comes back once that use ends). True when a blocker
        is held by standing leases alone: one in use may be idle by the next report (a fraction of a
        second behind), which decides again."""
        pending = False
        for blocker in blockers:
            if blocker.protection != "busy":
                continue
            ref = blocker.instance
            on_it = [lease for lease in self._leases.values() if lease.node_id == ref.node_id and lease.model == ref.model]
            if not on_it or any(lease.holder is None for lease in on_it):
                continue  # a request's own lease: busy indeed
            idle = [
                lease.lease_id
                for lease in on_it
                if lease.lease_id not in self._revoked and (self._reported.get(lease.lease_id, 1) == 0 or lease.lease_id not in self._heard)
            ]
            if idle:
                self._revoked.update(idle)
                self._routes_update()
            pending = True
        return pending

    def _count_in_flight(self, ref: InstanceRef, now: float) -> None:
        """The instance's in-flight count from its leases: one per request's lease, and what each
        standing lease's holder reported (at least one while it is held)."""
        inst = self._instance(ref.node_id, ref.model)
        if inst is None:
            return
        n = 0
        for lease in self._leases.values():
            if lease.node_id == ref.node_id and lease.model == ref.model:
                n += 1 if lease.holder is None else max(1, self._reported.get(lease.lease_id, 1))
        self.state = set_in_flight(self.state, ref, n, now)

    def _routes_update(self) -> None:
        """What `routes` answers may have changed: wake the holders' long polls."""
        self._routes_version += 1
        self._routes_changed.set()
        self._routes_changed = asyncio.Event()

    def _expire_holders(self, now: float) -> None:
        """Standing leases of a holder that stopped reporting and polling (its replica died) end."""
        for holder, seen in list(self._holders.items()):
            if now - seen <= self.holder_timeout_s:
                continue
            del self._holders[holder]
            for lease_id, lease in list(self._leases.items()):
                if lease.holder == holder:
                    self.release(lease_id)
                    self._record("lease_expired", model=lease.model, node_id=lease.node_id, reason=f"ingress {holder} stopped reporting")

    # ---- ticks and operator actions -----------------------------------------------------------
    def tick(self) -> None:
        """Periodic: expire forgotten leases, unload idle / drained / dead instances, start copies."""
        now = self.effects.now()
        self._expire_holders(now)
        for lease_id, lease in list(self._leases.items()):
            if lease.holder is None and now - lease.acquired_at > self.max_lease_s:
                self.release(lease_id)
                self._record("lease_expired", model=lease.model, node_id=lease.node_id, reason=f"held over {self.max_lease_s:.0f} s")
        for unload in sweep(self.state, now, self.config):
            if unload.reason == "node_dead":
                self.node_dead(unload.instance.node_id)
            else:
                self._unload(unload.instance, unload.reason)
        for place in plan_copies(self.state, now, self.config):
            self._begin_place(place)

    async def load(self, model: str, node_id: str | None = None) -> InstanceRef:
        """Operator load: where the policy says, or on `node_id` (an extra copy there when the model
        is elsewhere, within max_copies). Returns once the instance is ready. A model marked failed
        is tried again at once (the operator asked)."""
        spec = self._spec(model)
        started = self.effects.now()
        for key in [k for k in self._for_requests if k[0] == model]:  # the operator waits for these now
            del self._for_requests[key]
        if model in self.state.failed:
            self.state = clear_failed(self.state, model)
            self._failed_files.pop(model, None)
            self._record("retrying", model=model, reason="an operator loads it")
        if node_id is not None:
            await self._place_on(spec, node_id)
        while True:
            for n in self.state.nodes:
                inst = n.instance(model) if n.alive and node_id in (None, n.node_id) else None
                if inst is not None and inst.status == "ready":
                    return InstanceRef(node_id=n.node_id, model=model)
            mark = self.state.failed.get(model)
            if mark is not None and mark.at >= started:
                raise _error_for(reject_marked(mark, self.effects.now(), self.config))
            if node_id is not None:
                if self._instance(node_id, model) is None and (model, node_id) not in self._prefetches:
                    if not self._fetched_for(model, node_id):
                        raise OrchardError("model_unloaded", f"model {model} left {node_id} before it was ready")
                    await self._place_on(spec, node_id)  # its weights arrived: place it now
                await self._wait_for_change(self.config.retry_poll_s)
                continue
            now = self.effects.now()
            decision = ensure(model, self.state, now, self.config, waited_s=now - started, exclude_nodes=self._removing_on(model))
            if self._waits_for_revoked(decision, started, now):
                await self._wait_for_change(self.config.retry_poll_s)
            elif isinstance(decision, Place):
                if not self._begin_place(decision):
                    await self._wait_for_change(self.config.retry_poll_s)
            elif isinstance(decision, Reject) and self._removing_on(model):  # X3: its files leave a node now
                await self._wait_for_change(self.config.retry_poll_s)
            elif isinstance(decision, Reject):
                self._record("rejected", model=model, reason=decision.message)
                raise _error_for(decision)
            elif isinstance(decision, Wait):
                await self._wait_for_change(decision.retry_after_s)

    async def _place_on(self, spec: ModelSpec, node_id: str) -> None:
        started = self.effects.now()
        while True:
            node = self.state.node(node_id)
            if node is None or not node.alive:
                raise OrchardError("node_not_found", f"no alive node {node_id!r}")
            if node.instance(spec.name) is not None:
                return
            if (spec.name, node_id) in self._removing:
                raise OrchardError("files_in_use", f"the files of {spec.name} are being removed from {node_id}'s store: load it there after", "node")
            if self._copies(spec.name) >= spec.max_copies:
                raise OrchardError(
                    "model_already_loaded",
                    f"model {spec.name} already has {self._copies(spec.name)} copies (max_copies={spec.max_copies}): unload it first",
                )
            others = frozenset(n.node_id for n in self.state.nodes if n.node_id != node_id)
            plan, shortfalls, eligible = plan_placement(spec, self.state, self.effects.now(), self.config, exclude_nodes=others)
            if plan is not None or not self._revoke_idle(blockers_of(shortfalls)) or self.effects.now() - started >= self.revoke_grace_s:
                break
            await self._wait_for_change(self.config.retry_poll_s)  # idle standing leases in the way come back
        if plan is None:
            why = "its constraints exclude it" if not eligible else "it does not fit even after every allowed eviction, or a cap forbids it"
            self._record("rejected", model=spec.name, node_id=node_id, reason=why)
            raise OrchardError("model_blocked", f"cannot place model {spec.name} on {node_id}: {why}")
        self._begin_place(place_from_plan(spec, plan, self.config))

    def unload(self, model: str) -> list[InstanceRef]:
        """Operator unload of every copy. A copy with requests in flight drains first (the Effects
        drain before they stop); pinned models must be unpinned first."""
        spec = self._spec(model)
        if spec.pinned:
            raise OrchardError("model_pinned", f"model {model} is pinned: unpin it first")
        refs = [InstanceRef(node_id=n.node_id, model=model) for n in self.state.nodes if n.alive and n.instance(model) is not None]
        for ref in refs:
            self._unload(ref, "unloaded by the operator")
        return refs

    def begin_removing(self, node_id: str, models: frozenset[str]) -> None:
        """An operator removes a folder from `node_id`'s store that `models` load from (X3): refused
        (409 files_in_use) while one of them is on the node (loading, waiting to load, or loaded),
        its weights are being copied there, or the folder is already being removed; else no
        placement chooses that node for them until `end_removing`. Checked and marked in one step
        of the loop, so no placement can start between the check and the removal."""
        node = self.state.node(node_id)
        on_node = sorted(i.model for i in node.instances if i.model in models) if node is not None else []
        if on_node:
            loading = [m for m in on_node if self._instance(node_id, m).status == "loading"]  # type: ignore[union-attr]  # on_node lists instances there
            what = "is loading" if loading else "is"
            raise OrchardError(
                "files_in_use",
                f"{', '.join(on_node)} {what if len(on_node) == 1 else 'are'} on {node_id} from these files"
                + (" (a placement in progress)" if loading else "")
                + ": unload first",
                "node",
            )
        copying = sorted(m for m, n in self._prefetches if n == node_id and m in models)
        if copying:
            raise OrchardError("files_in_use", f"the weights of {', '.join(copying)} are being copied to {node_id} for a placement", "node")
        if any((m, node_id) in self._removing for m in models):
            raise OrchardError("files_in_use", f"these files are already being removed from {node_id}", "node")
        self._removing.update((m, node_id) for m in models)

    def end_removing(self, node_id: str, models: frozenset[str], removed: bool) -> None:
        """The removal `begin_removing` allowed has ended: the node's store no longer holds the
        models' weights when it `removed` them, and placements may choose the node again."""
        self._removing.difference_update((m, node_id) for m in models)
        node = self.state.node(node_id)
        if removed and node is not None:
            self.state = mark_unstored(self.state, node_id, models)
        self._wake()

    def _removing_on(self, model: str) -> frozenset[str]:
        """The nodes from whose store `model`'s files are being removed (X3)."""
        return frozenset(n for m, n in self._removing if m == model)

    def held_bytes(self, node_id: str) -> int:
        """What our instances on the node hold or are loading: those waiting for room to start
        hold nothing yet (what the node's agent is told Orchard uses there)."""
        node = self.state.node(node_id)
        return (sum(i.bytes for i in node.instances) if node is not None else 0) - self._awaiting_bytes(node_id)

    def _awaiting_bytes(self, node_id: str) -> int:
        return sum(n for ref, n in self._awaiting_room.items() if ref.node_id == node_id)

    def pin(self, model: str, pinned: bool = True) -> ModelSpec:
        spec = self._spec(model).model_copy(update={"pinned": pinned})
        self.state = self.state.model_copy(update={"catalog": {**self.state.catalog, model: spec}})
        self._record("pinned" if pinned else "unpinned", model=model)
        self._wake()
        return spec

    def restore(self, events: list[ClusterEvent], pins: dict[str, bool]) -> None:
        """What a previous controller left in the operator's store: its event log (numbering goes on
        after it) and the operator's pins and unpins (applied over the registry, quietly: their
        events are in that log already)."""
        self._events.extend(events)
        if events:
            self._seq = itertools.count(max(e.seq for e in events) + 1)
        catalog = dict(self.state.catalog)
        for model, pinned in pins.items():
            if model in catalog:
                catalog[model] = catalog[model].model_copy(update={"pinned": pinned})
        self.state = self.state.model_copy(update={"catalog": catalog})

    # ---- views --------------------------------------------------------------------------------
    def events(self, since: int = 0) -> list[ClusterEvent]:
        return [e for e in self._events if e.seq > since]

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    # ---- effects out --------------------------------------------------------------------------
    def _fetched_for(self, model: str, node_id: str) -> bool:
        """Whether a fetch before placing `model` on `node_id` finished (and the placement is due)."""
        node = self.state.node(node_id)
        return node is not None and model in node.stored and model not in self.state.failed

    def _begin_place(self, place: Place, *, for_requests: bool = False) -> bool:
        """Apply the decision to the state now (so the next decision sees it), then carry it out;
        True when placed. A placement that evicts, on a node whose store lacks the weights, fetches
        them first and places nothing yet (False): a fetch that fails has evicted nothing, and the
        next decision, once the weights are there, may find a better node (L1). Nor is a model
        placed on a node its files are being removed from (X3)."""
        spec = self.state.catalog[place.model]
        node = self.state.node(place.node_id)
        if (place.model, place.node_id) in self._removing:
            return False
        if place.evict and node is not None and fetch_source(spec, node, self.state) is not None:
            self._prefetch(place.model, place.node_id, for_requests)
            return False
        task = self._carry_out(place, 1, f"to place {place.model}: {place.reason}", f"evicted for {place.model}")
        if for_requests:
            self._track(place.model, place.node_id, task)
        return True

    def _carry_out(self, place: Place, attempt: int, evicted: str, stop_reason: str) -> asyncio.Task:
        """Unload, then load (X1): stop the victims, apply the placement to the state (its bytes
        reserved, the victims' counted free for the next decision), and start the load, which waits
        for every victim and every other stop on its node to exit before it begins."""
        after = set(self._stopping.get(place.node_id, ()))
        for victim in place.evict:
            inst = self._instance(victim.node_id, victim.model)
            nbytes = inst.bytes if inst else None
            self._record("evicted", model=victim.model, node_id=victim.node_id, bytes=nbytes, reason=evicted)
            after.add(self._stop(victim, stop_reason, nbytes))
        self.state = apply_place(self.state, place, self.effects.now())
        self._record("placed", model=place.model, node_id=place.node_id, bytes=place.bytes, reason=place.reason)
        return self._spawn(self._load(place, attempt, tuple(after)))

    def _track(self, model: str, node_id: str, task: asyncio.Task) -> None:
        key = (model, node_id)
        self._for_requests[key] = task
        task.add_done_callback(lambda t: self._for_requests.pop(key, None) if self._for_requests.get(key) is t else None)

    def _prefetch(self, model: str, node_id: str, for_requests: bool = False) -> None:
        if (model, node_id) in self._prefetches:
            return
        self._prefetches.add((model, node_id))
        task = self._spawn(self._run_prefetch(model, node_id))
        if for_requests:
            self._track(model, node_id, task)

    async def _run_prefetch(self, model: str, node_id: str) -> None:
        try:
            await self.effects.fetch_weights(model, node_id)
        except asyncio.CancelledError:  # nobody waits for it (the event is recorded): nothing to undo
            pass
        except Exception as e:  # the fetch recorded why (fetch_failed); the model is refused for a back-off (P10)
            reason, message = (e.reason, e.message) if isinstance(e, LoadError) else ("error", f"{type(e).__name__}: {e}")
            failure = LoadFailure(model=model, node_id=node_id, reason=reason, message=message)
            self.state = mark_failed(self.state, failure, self.effects.now())
            self._failed_files[model] = self.effects.files_version(model)
        else:
            node = self.state.node(node_id)
            if node is not None and model not in node.stored:  # the effect did not report a "fetched" (stored already)
                self.state = mark_stored(self.state, node_id, model)
        finally:
            self._prefetches.discard((model, node_id))
            self._wake()

    async def _load(self, place: Place, attempt: int, after: tuple[asyncio.Task, ...] = ()) -> None:
        ref = InstanceRef(node_id=place.node_id, model=place.model)
        spec = self.state.catalog[place.model]
        started = False
        try:
            why = ""
            if after or place.node_id in self._unsure:
                self._awaiting_room[ref] = place.bytes
                try:
                    why = await self._await_room(place, after)
                finally:
                    self._awaiting_room.pop(ref, None)
                if not why:  # unloaded, or its node died, while it waited: nothing was started
                    return
            started = True
            self._record("loading", model=place.model, node_id=place.node_id, bytes=place.bytes, reason=why)
            result = await self.effects.start_instance(place, spec)
        except asyncio.CancelledError:  # nobody waits for it (the event is recorded): release its reservation
            node = self.state.node(place.node_id)
            if node is not None and node.instance(place.model) is not None:
                self.state = remove_instance(self.state, ref)
            self._stop(ref, "cancelled: nobody waits for it", None, announce=started)
            self._wake()
            return
        except NoRoom as e:
            self._no_room(place, ref, e.message)
            return
        except LoadError as e:
            self._load_failed(place, ref, e.reason, e.message, attempt)
            return
        except Exception as e:  # an effect that broke must not leave the model "loading" forever
            self._load_failed(place, ref, "error", f"{type(e).__name__}: {e}", attempt)
            return
        node = self.state.node(place.node_id)
        if node is None or not node.alive or node.instance(place.model) is None:
            self._stop(ref, "its node died or it was unloaded while loading", result.bytes)
            return
        self.state = mark_loaded(self.state, ref, self.effects.now(), result.load_seconds, result.bytes)
        self._record("loaded", model=place.model, node_id=place.node_id, bytes=result.bytes, seconds=result.load_seconds)
        self._wake()

    async def _await_room(self, place: Place, after: tuple[asyncio.Task, ...]) -> str:
        """Wait until every stop in `after` has confirmed its process gone and a report of the node,
        asked for after that, measures free memory for this placement and every other one waiting
        there (X1); at most `exit_wait_s`. Returns why it may load now (for the `loading` event),
        or "" when the placement left the state meanwhile. NoRoom when the wait fails."""
        node_id = place.node_id
        deadline = self.effects.now() + self.config.exit_wait_s
        ended_at: float | None = None
        while True:
            node = self.state.node(node_id)
            inst = node.instance(place.model) if node is not None and node.alive else None
            if inst is None or inst.status != "loading":
                return ""
            running = [t for t in after if not t.done()]
            failed = [t for t in after if t.done() and (t.cancelled() or t.exception() is not None or not t.result())]
            if failed:
                raise NoRoom(f"{len(failed)} of the instances stopping on {node_id} (and the victims) did not confirm their exit")
            if not running:
                if ended_at is None:
                    ended_at = self.effects.now()
                    self.effects.want_report(node_id)
                asked, free = self._reports.get(node_id, (float("-inf"), 0))
                need = self._awaiting_bytes(node_id)
                if asked >= ended_at and free >= need:
                    self._unsure.pop(node_id, None)
                    return f"after the stops on {node_id} its report measured {gib(free)} free, {gib(need)} to load"
            now = self.effects.now()
            if now >= deadline:
                if running:
                    raise NoRoom(f"{len(running)} instance(s) stopping for it had not exited after {self.config.exit_wait_s:.0f} s")
                asked, free = self._reports.get(node_id, (float("-inf"), 0))
                seen = f"its last report measured {gib(free)} free" if ended_at is not None and asked >= ended_at else "no report came"
                raise NoRoom(f"{node_id} did not show {gib(self._awaiting_bytes(node_id))} free within {self.config.exit_wait_s:.0f} s: {seen}")
            if ended_at is not None and self._reports.get(node_id, (float("-inf"), 0))[0] >= ended_at:
                self.effects.want_report(node_id)  # a report after the stops, short of room: measure again
            await self._wait_for_change(min(self.config.retry_poll_s, max(0.0, deadline - now)))

    def _no_room(self, place: Place, ref: InstanceRef, message: str) -> None:
        """X1: a placement whose node never showed the room loads nothing: its reservation goes,
        the model is not marked failed (its files are not at fault), and the requests waiting for
        it decide again against the node's latest report."""
        self._record("load_failed", model=place.model, node_id=place.node_id, reason=f"no_room: {message}; nothing was loaded")
        if self._instance(place.node_id, place.model) is not None:
            self.state = remove_instance(self.state, ref)
        self._wake()

    def _load_failed(self, place: Place, ref: InstanceRef, reason: str, message: str, attempt: int) -> None:
        self._record("load_failed", model=place.model, node_id=place.node_id, reason=f"{reason}: {message}")
        node = self.state.node(place.node_id)
        if node is not None and node.instance(place.model) is not None:
            self.state = remove_instance(self.state, ref)
        self._stop(ref, "failed to load", None)
        failure = LoadFailure(model=place.model, node_id=place.node_id, reason=reason, message=message, attempt=attempt)
        now = self.effects.now()
        retry = retry_after_failure(failure, self.state, now, self.config)
        if isinstance(retry, Place) and (retry.model, retry.node_id) not in self._removing:
            self._carry_out(retry, attempt + 1, f"retrying {place.model}: {retry.reason}", f"evicted to retry {place.model}")
        else:  # P9/P10: not retried, nothing evicted; requests are refused until the back-off ends
            self.state = mark_failed(self.state, failure, now)
            self._failed_files[place.model] = self.effects.files_version(place.model)
        self._wake()

    def _retry_if_files_changed(self, model: str) -> None:
        """A model marked failed whose files changed since (fixed, copied again) is tried again now."""
        if model not in self.state.failed or model not in self._failed_files:
            return
        if self.effects.files_version(model) != self._failed_files[model]:
            del self._failed_files[model]
            self.state = clear_failed(self.state, model)
            self._record("retrying", model=model, reason="its files changed since it failed to load")

    def _unload(self, ref: InstanceRef, reason: str) -> None:
        self._drop(ref, "unloaded", reason, reason)

    def _drop(self, ref: InstanceRef, kind: EventKind, reason: str, stop_reason: str) -> None:
        """Remove an instance and its leases from the state, record why, and stop its actor."""
        node = self.state.node(ref.node_id)
        inst = node.instance(ref.model) if node is not None else None
        if inst is None:
            return
        self.state = remove_instance(self.state, ref)
        for lease_id, lease in list(self._leases.items()):
            if lease.node_id == ref.node_id and lease.model == ref.model:
                self._forget_lease(lease_id)
        self._record(kind, model=ref.model, node_id=ref.node_id, bytes=inst.bytes, reason=reason)
        self._stop(ref, stop_reason, inst.bytes, announce=ref not in self._awaiting_room)  # one still waiting for room runs nothing
        self._wake()

    def _stop(self, ref: InstanceRef, reason: str, nbytes: int | None, *, announce: bool = True) -> asyncio.Task:
        """Stop the instance's process (the effect takes its incarnation now), tracked as stopping
        on its node until it has exited: loads placed there meanwhile wait for it (X1). Its exit is
        a `stopped` event with the bytes it released (`announce`: a process may have run)."""
        stopping = self.effects.stop_instance(ref, reason)
        task = self._spawn(self._run_stop(ref, stopping, reason, nbytes if announce else None, announce))
        self._stopping.setdefault(ref.node_id, set()).add(task)

        def done(t: asyncio.Task, node_id: str = ref.node_id) -> None:
            on_node = self._stopping.get(node_id)
            if on_node is not None:
                on_node.discard(t)
                if not on_node:
                    del self._stopping[node_id]

        task.add_done_callback(done)
        return task

    async def _run_stop(self, ref: InstanceRef, stopping, reason: str, nbytes: int | None, announce: bool) -> bool:
        try:
            gone = bool(await stopping)
        except Exception as e:  # an effect that broke: the exit is not confirmed
            gone = False
            reason = f"{reason}; stopping it failed: {type(e).__name__}: {e}"
        if not gone:  # its memory may still be held: loads there wait for a report that shows the room
            self._unsure[ref.node_id] = self.effects.now()
            self.effects.want_report(ref.node_id)
        if gone and announce:
            released = f"{gib(nbytes)} released" if nbytes is not None else "its memory released"
            self._record("stopped", model=ref.model, node_id=ref.node_id, bytes=nbytes, reason=f"its process exited, {released} ({reason})")
        self._wake()
        return gone

    # ---- plumbing -----------------------------------------------------------------------------
    def _forget_lease(self, lease_id: str) -> None:
        """Drop a lease whose instance is gone (no in-flight count to update)."""
        self._leases.pop(lease_id, None)
        self._reported.pop(lease_id, None)
        self._revoked.discard(lease_id)
        self._heard.discard(lease_id)

    def _spec(self, model: str) -> ModelSpec:
        spec = self.state.catalog.get(model)
        if spec is None:
            raise OrchardError("model_not_found", f"model {model!r} is not in the registry", "model")
        return spec

    def _copies(self, model: str) -> int:
        return sum(1 for n in self.state.nodes if n.alive and n.instance(model) is not None)

    def _instance(self, node_id: str, model: str) -> InstanceState | None:
        node = self.state.node(node_id)
        return node.instance(model) if node is not None else None

    def record(self, kind: EventKind, **fields) -> None:
        """An event an effect reports while it works (a copy of weights starting, ending, failing).
        A finished copy teaches the peer bandwidth (L3) and puts the weights in the node's store
        at once, before its next report says so. `source` ("peer" or "hub") says where from."""
        source = fields.pop("source", "peer")
        self._record(kind, **fields)
        model, node_id, nbytes, seconds = fields.get("model"), fields.get("node_id"), fields.get("bytes"), fields.get("seconds")
        if kind == "fetched" and model in self.state.catalog and node_id is not None and self.state.node(node_id) is not None:
            self.state = mark_stored(self.state, node_id, model)
            if nbytes and seconds:
                self.state = learn_bandwidth(self.state, source, nbytes / seconds)

    def _record(self, kind: EventKind, **fields) -> None:
        event = ClusterEvent(seq=next(self._seq), at=self.effects.now(), kind=kind, **fields)
        self._events.append(event)
        self.effects.publish(event)
        if kind in _ROUTES_CHANGE:
            self._routes_update()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wake(self) -> None:
        """The state changed: operator loads waiting on `_changed` look again, and the waiters'
        queues are drained (soon, on the loop: callers may be in the middle of a change)."""
        self._changed.set()
        self._changed = asyncio.Event()
        if self._waiters and not self._drain_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self._drain)
            except RuntimeError:  # no loop (a synchronous test driving the state): nothing waits
                return
            self._drain_scheduled = True

    async def _wait_for_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)
        except TimeoutError:
            pass

    async def settle(self) -> None:
        """Wait for every started load and stop (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _error_for(reject: Reject) -> OrchardError:
    if reject.code == "unknown_model":
        return OrchardError("model_not_found", reject.message, "model")
    return OrchardError(f"model_{reject.code}", reject.message, retry_after_s=reject.retry_after_s)


# Events after which a holder's standing leases or the ready copies may differ.
_ROUTES_CHANGE: frozenset[str] = frozenset({"loaded", "evicted", "unloaded", "died", "node_dead", "lease_expired"})
