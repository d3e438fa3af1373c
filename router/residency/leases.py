"""The lease book: every lease on every instance, of both kinds, behind one protocol.

A lease names a ready instance and counts as work on it: the policy never evicts an instance with
a lease on it (E2), so an instance is idle only once its last lease has ended.

- A request's lease (no `holder`) is one request: it counts one until the request releases it,
  or until `max_lease_s` passes (a lost release).
- A standing lease (`holder`: an ingress replica) routes many requests without asking again
  (router/serving/standing.py). It counts what its holder last reported in flight on it, at least
  one while held. The holder reports a few times a second and at least every few seconds; one that
  neither reports nor polls for `holder_timeout_s` is gone, and its leases end. A standing lease is
  revoked (asked back) when it stands in a placement's way or its instance drains; the holder
  learns it from `routes`, its long poll, sends nothing new to it and gives it back once what runs
  on it has ended.

The book reads no clock: the loop passes `now`."""

import asyncio
import itertools
import uuid
from collections.abc import Iterable, Iterator

from deployments.wire.leases import LeaseRecord, RoutesView
from policy import InstanceRef


class LeaseBook:
    def __init__(self, *, max_lease_s: float = 3600.0, holder_timeout_s: float = 15.0):
        self.max_lease_s = max_lease_s
        self.holder_timeout_s = holder_timeout_s
        # This book's incarnation: a holder's standing leases from an earlier one (the service
        # restarted) are unknown here, and `view` says so by another epoch.
        self.epoch = uuid.uuid4().hex[:12]
        self.granted = 0  # leases granted, both kinds: what standing leases save is visible
        self._numbers = itertools.count(1)
        self._last = 0  # the number of the last lease granted
        self._leases: dict[str, LeaseRecord] = {}
        # the same leases by instance, (node_id, model) -> lease id -> lease: a request's lease is
        # granted and ended on the hot path, and its instance's work is counted at each
        self._by_instance: dict[tuple[str, str], dict[str, LeaseRecord]] = {}
        self._reported: dict[str, int] = {}  # standing lease -> in flight, as its holder last said
        self._heard: set[str] = set()  # standing leases their holder reported on since the grant
        self._revoked: set[str] = set()  # standing leases asked back, not yet given back
        self._holders: dict[str, float] = {}  # holder -> when it last reported or polled
        self.version = 0  # bumped whenever what `view` answers may have changed
        self._changed = asyncio.Event()

    # ---- granting and ending ----------------------------------------------------------------
    def grant(self, ref: InstanceRef, loaded_at: float, holder: str | None, now: float) -> LeaseRecord:
        self._last = next(self._numbers)
        lease = LeaseRecord(lease_id=f"L{self._last}", model=ref.model, node_id=ref.node_id, acquired_at=now, loaded_at=loaded_at, holder=holder)
        self._leases[lease.lease_id] = lease
        self._by_instance.setdefault((lease.node_id, lease.model), {})[lease.lease_id] = lease
        if holder is not None:
            self._reported[lease.lease_id] = 1  # the request that asked for it
            self._holders[holder] = now
        self.granted += 1
        return lease

    def end(self, lease_id: str) -> LeaseRecord | None:
        """End a lease (released, given back, expired); None when it had ended already."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            key = (lease.node_id, lease.model)
            on = self._by_instance[key]
            del on[lease_id]
            if not on:
                del self._by_instance[key]
        self._reported.pop(lease_id, None)
        self._heard.discard(lease_id)
        if lease_id in self._revoked:
            self._revoked.discard(lease_id)
            self.changed()
        return lease

    def end_on(self, ref: InstanceRef) -> None:
        """The instance is gone: its leases end with it (their holders learn it from `view`)."""
        for lease in self.on(ref):
            self.end(lease.lease_id)

    def on(self, ref: InstanceRef) -> list[LeaseRecord]:
        return self._on((ref.node_id, ref.model))

    def _on(self, key: tuple[str, str]) -> list[LeaseRecord]:
        return list(self._by_instance.get(key, {}).values())

    def all(self) -> list[LeaseRecord]:
        return list(self._leases.values())

    def in_flight(self, ref: InstanceRef) -> int:
        """The instance's work: one per request's lease, what each standing lease's holder reported
        (at least one while it is held)."""
        return sum(1 if lease.holder is None else max(1, self._reported.get(lease.lease_id, 1)) for lease in self.on(ref))

    # ---- the holders' side ------------------------------------------------------------------
    def report(self, holder: str, in_flight: dict[str, int], now: float) -> tuple[set[InstanceRef], bool]:
        """A holder's in-flight counts per standing lease: the instances whose count changed, and
        whether one of its leases went idle. Leases it does not hold are ignored (`view` tells it)."""
        self._holders[holder] = now
        touched: set[InstanceRef] = set()
        idle = False
        for lease_id, n in in_flight.items():
            lease = self._leases.get(lease_id)
            if lease is None or lease.holder != holder:
                continue
            self._heard.add(lease_id)
            if self._reported.get(lease_id) == n:
                continue
            self._reported[lease_id] = max(0, int(n))
            idle = idle or n == 0
            touched.add(InstanceRef(node_id=lease.node_id, model=lease.model))
        return touched, idle

    def seen(self, holder: str, now: float) -> None:
        self._holders[holder] = now

    def revoke_idle(self, ref: InstanceRef) -> bool:
        """Ask back the standing leases that keep `ref` busy while idle (their holder reports
        nothing in flight, or has not reported since the grant). True when standing leases alone
        hold it: one in use may be idle by the next report, so the caller decides again then."""
        return self._revoke_idle(self.on(ref))

    def revoke_idle_each(self, instances: Iterable[tuple[str, str]]) -> Iterator[bool]:
        """revoke_idle of each instance, (node_id, model), in order, as it is read: the book is
        read through the index by instance (a refusal at scale names a thousand busy instances)."""
        return (self._revoke_idle(self._on(key)) for key in instances)

    def _revoke_idle(self, on: list[LeaseRecord]) -> bool:
        if not on or any(lease.holder is None for lease in on):
            return False  # a request's own lease: busy indeed
        idle = [
            lease.lease_id
            for lease in on
            if lease.lease_id not in self._revoked and (self._reported.get(lease.lease_id, 1) == 0 or lease.lease_id not in self._heard)
        ]
        if idle:
            self._revoked.update(idle)
            self.changed()
        return True

    def revoke_all(self, ref: InstanceRef) -> None:
        """The instance drains: every standing lease on it is asked back (no new requests go to it)."""
        ids = {lease.lease_id for lease in self.on(ref) if lease.holder is not None} - self._revoked
        if ids:
            self._revoked.update(ids)
            self.changed()

    def expired(self, now: float) -> list[tuple[LeaseRecord, str]]:
        """End the leases that outlived their use: every standing lease of a holder silent for
        holder_timeout_s, and requests' leases held over max_lease_s; each with why."""
        out: list[tuple[LeaseRecord, str]] = []
        for holder, seen in list(self._holders.items()):
            if now - seen > self.holder_timeout_s:
                del self._holders[holder]
                out += [(lease, f"ingress {holder} stopped reporting") for lease in self.all() if lease.holder == holder]
        out += [
            (lease, f"held over {self.max_lease_s:.0f} s")
            for lease in self.all()
            if lease.holder is None and now - lease.acquired_at > self.max_lease_s
        ]
        for lease, _ in out:
            self.end(lease.lease_id)
        return out

    # ---- the long poll ------------------------------------------------------------------------
    def changed(self) -> None:
        """What `view` answers may have changed: wake the holders' long polls."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def change(self) -> asyncio.Event:
        """The event the next `changed` sets."""
        return self._changed

    def view(self, holder: str, copies: dict[str, int]) -> RoutesView:
        mine = [lease_id for lease_id, lease in self._leases.items() if lease.holder == holder]
        return RoutesView(
            version=self.version,
            valid=[lease_id for lease_id in mine if lease_id not in self._revoked],
            revoked=[lease_id for lease_id in mine if lease_id in self._revoked],
            copies=copies,
            epoch=self.epoch,
            leases_upto=self._last,
        )
