"""Standing leases: how an ingress replica routes requests without asking the residency service
each time.

The first request for a model asks the residency service for a lease as this replica (its
`holder`): a standing lease, which every later request for the model here uses at once, counted
locally. The replica reports its in-flight counts per standing lease in batches (a few times a
second, and every couple of seconds regardless, as its sign of life), and gives a lease back once
nothing ran on it for `linger_s`. The residency service keeps counting a held standing lease as
busy, so it never evicts an instance this replica may be sending to; when an idle standing lease is
all that stands in a placement's way, it revokes it through `routes`, this replica's long poll, and
the lease comes back as soon as what runs on it has ended. The same poll says which leases are
gone (the instance died or was unloaded) and how many ready copies each model has: a busy model
with more copies than this replica holds leases on asks for one more, so the copies share the load.

Among the held leases of a model, a request goes to the instance this replica last sent the longest
beginning of its prompt to (its prefix cache likely holds it: router/serving/affinity.py), unless
that instance has more than `max_extra_in_flight` requests in flight beyond the least loaded one;
a request whose prefix is known nowhere goes to the least loaded.

Requests of keys with limits (rpm, tpm, max_concurrent) never take this path: those limits count
each request, so each asks for a lease of its own (router/serving/lease.py)."""

import asyncio
import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from deployments.wire.leases import Grant, Refusal, RoutesView, UsageReport
from router import metrics
from router.serving.affinity import Instance, PrefixHistory, choose, outcome
from router.serving.detached import send_detached


class LeaseSource(Protocol):
    """What the standing leases use of their replica's leases (router/serving/lease.py's Leases,
    which holds them): the residency service's handle, the prefix history every path notes, and
    giving a lease back."""

    @property
    def residency(self) -> Any: ...

    @property
    def affinity(self) -> PrefixHistory: ...

    def release(self, lease_id: str, used_tokens: int | None = None) -> None: ...


@dataclass(eq=False)
class Standing:
    """One standing lease as this replica sees it."""

    grant: Grant
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    revoked: bool = False  # asked back: no new requests; given back once in_flight is 0
    ended: bool = False  # given back, or gone at the residency service

    @property
    def lease_id(self) -> str:
        return self.grant.lease.lease_id

    @property
    def number(self) -> int:
        return self.grant.lease.number

    @property
    def instance(self) -> Instance:
        return instance_of(self.grant)


def instance_of(grant: Grant) -> Instance:
    """The incarnation a grant's lease is on, as the prefix history keys it."""
    return (grant.lease.node_id, grant.lease.loaded_at)


@dataclass(eq=False)
class _Ask:
    """One acquire for a model, shared by the requests that arrive while it is answered."""

    task: asyncio.Task
    waiters: int = 0


def _background(coro: Any) -> asyncio.Task:
    """A task in an empty context: Serve cancels what a request's context starts with the request
    (router/serving/detached.py), and these outlive the request that happened to start them."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class StandingLeases:
    def __init__(
        self,
        leases: LeaseSource,
        holder: str,
        linger_s: float,
        report_every_s: float = 0.25,
        heartbeat_s: float = 2.0,
        max_extra_in_flight: int = 4,
    ):
        self.leases = leases
        self.residency = leases.residency
        self.holder = holder
        self.linger_s = linger_s
        self.report_every_s = report_every_s
        self.heartbeat_s = heartbeat_s
        self.max_extra_in_flight = max_extra_in_flight  # prefix affinity's bound (module doc)
        self.held: dict[str, list[Standing]] = {}  # model -> its standing leases here
        self.copies: dict[str, int] = {}  # model -> ready copies in the cluster (from `routes`)
        self._asking: dict[str, _Ask] = {}
        self._asked_at_copies: dict[str, int] = {}  # model -> copies when this replica last asked for one more
        self._version = -1
        self._reported: dict[str, int] | None = None
        self._started: dict[str, int] = {}  # model -> requests started since the last report
        self._reported_at = 0.0
        self._tasks: list[asyncio.Task] = []

    # ---- the requests' side --------------------------------------------------------------------
    async def use(self, model: str, prefix: tuple[int, ...] = ()) -> Standing:
        """A standing lease on a ready instance of `model`, counted as one more request on it (end it
        with `done`); raises the residency service's OrchardError when there is none to be had.
        `prefix`: the request's prefix keys (router/serving/affinity.py), to send it where its
        prompt's beginning went before."""
        self._start()
        standing = self._pick(model, prefix)
        if standing is None or self._wants_another(model):
            try:
                standing = await self._ask(model)
            except Exception:
                standing = self._pick(model, prefix)  # one more copy was not to be had: use what is held
                if standing is None:
                    raise
        if prefix:
            self._count(model, standing, prefix)
        standing.in_flight += 1
        self._started[model] = self._started.get(model, 0) + 1
        return standing

    def done(self, standing: Standing) -> None:
        """One request on `standing` ended."""
        standing.in_flight = max(0, standing.in_flight - 1)
        if standing.in_flight == 0:
            standing.idle_since = time.monotonic()
            if standing.revoked:
                self._give_back(standing)

    def drop(self, standing: Standing) -> None:
        """The lease's instance failed (dead or unreachable): later requests ask again."""
        self._give_back(standing)

    def _usable(self, model: str) -> list[Standing]:
        return [s for s in self.held.get(model, ()) if not s.revoked and not s.ended]

    def _pick(self, model: str, prefix: tuple[int, ...] = ()) -> Standing | None:
        usable = self._usable(model)
        if not usable:
            return None
        history = self.leases.affinity
        matches = [history.match(s.instance, prefix) for s in usable] if prefix else [0] * len(usable)
        return usable[choose([s.in_flight for s in usable], matches, self.max_extra_in_flight)]

    def _count(self, model: str, standing: Standing, prefix: tuple[int, ...]) -> None:
        """The affinity metric: whether the request went where its longest known prefix is."""
        history = self.leases.affinity
        longest = max((history.match(s.instance, prefix) for s in self._usable(model)), default=0)
        metrics.on_affinity(model, outcome(history.match(standing.instance, prefix), longest))

    def _wants_another(self, model: str) -> bool:
        """Whether a busy model (every lease held on it has requests in flight) has a ready copy
        this replica holds no lease on (asked once per change in the number of copies)."""
        copies = self.copies.get(model, 0)
        usable = self._usable(model)
        if not usable or min(s.in_flight for s in usable) == 0 or copies <= len(usable) or self._asked_at_copies.get(model) == copies:
            return False
        self._asked_at_copies[model] = copies
        return True

    async def _ask(self, model: str) -> Standing:
        ask = self._asking.get(model)
        if ask is None:
            ask = self._asking[model] = _Ask(_background(self._acquire(model)))
            ask.task.add_done_callback(lambda _t: self._asking.pop(model, None) if self._asking.get(model) is ask else None)
        ask.waiters += 1
        try:
            return await asyncio.shield(ask.task)
        finally:
            ask.waiters -= 1
            if ask.waiters == 0 and not ask.task.done():  # every request that asked went away
                ask.task.cancel()

    async def _acquire(self, model: str) -> Standing:
        grant = await self.residency.acquire.remote(model, None, 0, self.holder)
        if isinstance(grant, Refusal):
            raise grant.error()
        mine = instance_of(grant)
        for s in self.held.get(model, ()):
            if not s.ended and not s.revoked and s.instance == mine:
                self.leases.release(grant.lease.lease_id)  # a second lease on an instance already held
                return s
        standing = Standing(grant)
        self.held.setdefault(model, []).append(standing)
        return standing

    # ---- giving back, reporting, the long poll --------------------------------------------------
    def _give_back(self, standing: Standing) -> None:
        if standing.ended:
            return
        standing.ended = True
        self._forget(standing)
        self.leases.release(standing.lease_id)

    def _all(self) -> list[Standing]:
        """Every standing lease held here (a copy: giving back changes `held`)."""
        return [s for held in self.held.values() for s in held]

    def _forget(self, standing: Standing) -> None:
        model = standing.grant.lease.model
        held = [s for s in self.held.get(model, ()) if s is not standing]
        if held:
            self.held[model] = held
        else:
            self.held.pop(model, None)

    def _start(self) -> None:
        if not self._tasks:
            self._tasks = [_background(self._report()), _background(self._poll())]

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.report_every_s)
            with contextlib.suppress(Exception):  # a round that failed must not end the reports
                self.report_round(time.monotonic())

    def report_round(self, now: float) -> None:
        """Give back what lingered idle long enough; send the in-flight counts when they changed
        (or every heartbeat_s, so the residency service knows this replica is alive), with the
        requests started per model since the last report (the demand rule L4 counts)."""
        for s in self._all():
            if s.in_flight == 0 and now - s.idle_since >= self.linger_s:
                self._give_back(s)
        counts = {s.lease_id: s.in_flight for s in self._all()}
        if (
            counts != self._reported or self._started or (counts and now - self._reported_at >= self.heartbeat_s)
        ):  # nothing held: nothing to keep alive
            started, self._started = self._started, {}
            self._reported, self._reported_at = counts, now
            send_detached(self.residency.report_usage, UsageReport(holder=self.holder, in_flight=counts, started=started))

    async def _poll(self) -> None:
        while True:
            try:
                view = await self.residency.routes.remote(self.holder, self._version)
            except Exception:  # the residency service restarts: its answer will say what is valid
                self._version = -1
                await asyncio.sleep(1.0)
                continue
            self.apply(view)

    def apply(self, view: RoutesView) -> None:
        """The residency service's answer to the long poll: revoked leases are given back once idle;
        leases it no longer knows (granted before its answer was made, or by an earlier incarnation
        of it: another epoch) are forgotten."""
        self._version = view.version
        self.copies = view.copies
        valid, revoked = set(view.valid), set(view.revoked)
        for s in self._all():
            if s.grant.epoch != view.epoch:
                s.ended = True
                self._forget(s)
            elif s.lease_id in revoked:
                s.revoked = True
                if s.in_flight == 0:
                    self._give_back(s)
            elif s.lease_id not in valid and s.number <= view.leases_upto:
                s.ended = True
                self._forget(s)

    def close(self) -> None:
        """The replica shuts down: every standing lease goes back."""
        for task in self._tasks:
            task.cancel()
        for s in self._all():
            self._give_back(s)
