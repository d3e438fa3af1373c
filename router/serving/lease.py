"""Leases on model instances, as one async context manager.

    async with leases.hold(model) as lease:
        ...                       # released on exit, on error and on cancellation
        lease.hand_off()          # ... unless a streaming response takes it over (it calls release)

Releasing is the one subtle part: a release sent from the request's own context would be cancelled
with the request when its client disconnects, so each is sent detached (router/serving/detached.py)."""

import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from cluster.ray_api import NAMESPACE
from deployments.wire.failure import OrchardError
from deployments.wire.leases import Grant, Refusal
from router.serving.affinity import PrefixHistory
from router.serving.detached import send_detached
from router.serving.standing import Standing, StandingLeases, instance_of

log = logging.getLogger("orchard.ingress")

# The x-ratelimit-* headers of the current request, filled from the residency service's answer (a
# grant or a 429) and written on the response by router/api's middleware, which sets a fresh dict
# per request (a mutable dict: the streaming response's task sees it through its copied context).
RATE_LIMIT_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("orchard_rate_limit_headers", default=None)


def note_rate_limit(headers: dict[str, str] | None) -> None:
    holder = RATE_LIMIT_HEADERS.get()
    if holder is not None and headers:
        holder.update(headers)


class Lease:
    """A granted lease: the instance (model, node, actor name, incarnation) and what the model is
    (kind, output-parsing config). `release()` is idempotent. With `standing`, this request's use
    of this replica's standing lease (router/serving/standing.py): releasing ends the use."""

    def __init__(self, owner: "Leases", grant: Grant, standing: Standing | None = None, asked: tuple = (None, 0), prefix: tuple[int, ...] = ()):
        self.owner = owner
        self.asked = asked  # (tenant, reserve_tokens): how it was asked for, to ask again (`move`)
        self.prefix = prefix  # the request's prefix keys (router/serving/affinity.py)
        self.handed_off = False
        self.moved = False  # its first instance went away before answering: it runs on another (once)
        self._take(grant, standing)

    def _take(self, grant: Grant, standing: Standing | None) -> None:
        self.standing = standing
        self.grant = grant
        self.lease_id: str = grant.lease.lease_id
        self.model: str = grant.lease.model
        self.node_id: str = grant.lease.node_id
        self.kind: str = grant.kind
        self.tool_parser: str | None = grant.tool_parser
        self.reasoning: Any = grant.reasoning
        self.released = False

    @property
    def label(self) -> str:
        return f"model {self.model} on {self.node_id}"

    def actor(self) -> Any:
        try:
            return self.owner.actor(self.grant)
        except OrchardError as e:
            self.report_unavailable(e.message)
            raise

    def report_unavailable(self, message: str) -> None:
        """Tell the residency service this instance's actor failed as dead or unreachable (it checks
        with Ray and drops a dead one at once, instead of at the next watch round)."""
        self.owner.send(self.owner.residency.report_unavailable, self.grant.actor_name, message)
        if self.standing is not None and self.owner.standing is not None:
            self.owner.standing.drop(self.standing)

    async def move(self, why: str) -> None:
        """This request's instance stopped or died before answering anything: end this lease (a
        standing one is dropped, so no later request uses it) and take a fresh one on the same model,
        asked for as this one was, that is not the incarnation it leaves (the residency service has
        been told, or is stopping it itself, and drops it on its own loop)."""
        log.info("%s: %s; moving the request to a fresh lease", self.label, why)
        self.moved = True
        if self.standing is not None and self.owner.standing is not None:
            self.owner.standing.drop(self.standing)
        self.release()
        tenant, reserve_tokens = self.asked
        fresh = await self.owner.acquire(self.model, tenant, reserve_tokens, avoid=(self.node_id, self.grant.lease.loaded_at), prefix=self.prefix)
        self._take(fresh.grant, fresh.standing)

    def hand_off(self) -> "Lease":
        """The caller's streaming response releases it from now on (the context exit does not)."""
        self.handed_off = True
        return self

    def release(self, used_tokens: int | None = None) -> None:
        """End the lease; `used_tokens` (prompt + completion, when known) corrects the key's token count."""
        if not self.released:
            self.released = True
            if self.standing is not None and self.owner.standing is not None:
                self.owner.standing.done(self.standing)
            else:
                self.owner.release(self.lease_id, used_tokens)


class Leases:
    """This ingress replica's side of the residency service: acquire, release, actor handles. With
    `holder` (this replica's name) and `linger_s` > 0, requests no key's limits count go through
    standing leases (router/serving/standing.py) instead of a lease each; among several held on a
    model, a request goes where its prompt's beginning went before (`affinity`, weighed against
    load by `max_extra_in_flight`: router/serving/affinity.py)."""

    def __init__(self, residency: Any, holder: str | None = None, linger_s: float = 0.0, max_extra_in_flight: int = 4):
        self.residency = residency
        self._handles: dict[tuple[str, str], tuple[float, Any]] = {}  # (model, node) -> (loaded_at, actor)
        self.affinity = PrefixHistory()  # what this replica sent to each instance, every path's requests
        self.standing = (
            StandingLeases(self, holder, linger_s, max_extra_in_flight=max_extra_in_flight) if holder is not None and linger_s > 0 else None
        )

    async def acquire(
        self,
        model: str,
        tenant: dict[str, Any] | None = None,
        reserve_tokens: int = 0,
        avoid: tuple[str, float] | None = None,
        prefix: tuple[int, ...] = (),
    ) -> Lease:
        """A lease on a ready instance of `model`, counted against `tenant`'s limits (a key's name,
        rpm, tpm, max_concurrent) with `reserve_tokens` held until it ends; or the residency
        service's OrchardError (a 429 when a limit says no). `avoid`: an incarnation this request
        just left, (node, loaded_at); it asks the residency service itself, not a standing lease.
        `prefix`: the request's prefix keys, which choose among standing leases and are noted as
        sent to the instance granted (a lease of its own goes where the residency service says)."""
        if tenant is None and self.standing is not None and avoid is None:
            standing = await self.standing.use(model, prefix)
            self.affinity.note(standing.instance, prefix)
            return Lease(self, standing.grant, standing, prefix=prefix)
        answer = await self.residency.acquire.remote(model, tenant, reserve_tokens, None, avoid)
        note_rate_limit(answer.ratelimit)
        if isinstance(answer, Refusal):
            raise answer.error()
        self.affinity.note(instance_of(answer), prefix)
        return Lease(self, answer, asked=(tenant, reserve_tokens), prefix=prefix)

    @contextlib.asynccontextmanager
    async def hold(
        self, model: str, tenant: dict[str, Any] | None = None, reserve_tokens: int = 0, prefix: tuple[int, ...] = ()
    ) -> AsyncIterator[Lease]:
        lease = await self.acquire(model, tenant, reserve_tokens, prefix=prefix)
        try:
            yield lease
        finally:
            if not lease.handed_off:
                lease.release()

    def release(self, lease_id: str, used_tokens: int | None = None) -> None:
        self.send(self.residency.release, lease_id, used_tokens)

    def send(self, method: Any, *args: Any) -> None:
        """Call a residency-service method detached from the request (see above)."""
        send_detached(method, *args)

    def actor(self, grant: Grant) -> Any:
        """The lease's model-server actor, by the actor name the lease carries. Handles are cached
        per instance incarnation (the lease's loaded_at): ray.get_actor is a blocking GCS call, and
        once per request it was a measurable share of the ingress's event loop at GPU token rates.
        An actor gone since the grant (evicted, died) is `model_unavailable`."""
        lease = grant.lease
        key = (lease.model, lease.node_id)
        cached = self._handles.get(key)
        if cached is not None and cached[0] == lease.loaded_at:
            return cached[1]
        try:
            handle = ray.get_actor(grant.actor_name or "", namespace=NAMESPACE)
        except ValueError as e:
            raise OrchardError("model_unavailable", f"model {lease.model} on {lease.node_id} is unavailable: {e}", retry_after_s=1) from None
        self._handles[key] = (lease.loaded_at, handle)
        return handle
