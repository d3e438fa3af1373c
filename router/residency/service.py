"""The residency loop as a single-replica Serve deployment: a thin shell.

It puts together the loop (ResidencyController, on the replica's asyncio loop), its Ray effects,
its watcher (watcher.py: node reports, deaths, adoption of running model servers) and the
operator's store, and answers the ingress: leases (with the key limits of limits.py), operator
actions (which the operator's store keeps across restarts), and the views (views.py). The ingress
calls it for leases and cluster operations only, never per token. A refusal travels as a
`Refusal` (deployments/wire/leases.py), which the ingress raises again as the OrchardError it was."""

import asyncio
import logging
import uuid
from typing import Any

from ray import serve

from cluster.ray_api import on_head
from deployments.wire.counting import CountSite
from deployments.wire.failure import OrchardError
from deployments.wire.leases import Grant, Refusal, RoutesView, UsageReport
from policy import Decision, InstanceRef, PolicyConfig
from router import metrics
from router.residency import views
from router.residency.controller import ResidencyController
from router.residency.counting import count_site
from router.residency.effects import RayEffects
from router.residency.events import ClusterEvent
from router.residency.limits import Limiter, RateLimited, Tenant
from router.residency.measured import MeasurementStore
from router.residency.operator_store import OperatorStore
from router.residency.registry import from_config
from router.residency.sites import Sites
from router.residency.watcher import ClusterWatcher

log = logging.getLogger("orchard.residency")


# On the head node: a worker node that dies must not take the cluster view with it.
ON_HEAD = on_head()


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options=ON_HEAD)
class ResidencyService:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        models: list[dict],
        policy: dict,
        models_dir: str,
        watch_period_s: float = 1.0,
        server_options: dict | None = None,
        fetch_max_bytes_per_s: float | None = None,
        report_timeout_s: float = 2.0,
    ):
        catalog, entries = from_config(models, models_dir, (server_options or {}).get("llm_engine"))  # kv_bits shrinks the reservation
        self.effects = RayEffects(entries, models_dir, server_options=server_options, fetch_max_bytes_per_s=fetch_max_bytes_per_s)
        self.effects.listeners.append(metrics.on_event)
        self.controller = ResidencyController(catalog, PolicyConfig.model_validate(policy), self.effects, entries=entries)
        self.store = OperatorStore()
        self.limiter = Limiter()
        self._tickets: dict[str, str] = {}  # lease id -> the limiter's ticket
        self.controller.restore(await asyncio.to_thread(self.store.events), await asyncio.to_thread(self.store.pins))
        measured = await asyncio.to_thread(self.controller.placements.measurements.attach, MeasurementStore(), self.controller.state.catalog)
        self.controller.state = self.controller.state.model_copy(update={"catalog": measured})  # M1: what earlier loads measured
        self.effects.listeners.append(self.store.on_event)
        self._event_counts: dict[tuple[str, str, str], int] = {}  # (kind, model, node) -> events since start
        self.effects.listeners.append(self._count_event)
        self._orphans: set[asyncio.Task] = set()
        self.watcher = ClusterWatcher(self.controller, self.effects, watch_period_s, report_timeout_s)
        await self.watcher.observe_nodes()
        await self.watcher.adopt_running_servers()
        await self._resume_operator_loads()
        self._watching = asyncio.get_running_loop().create_task(self.watcher.run(self._each_round))

    def _each_round(self) -> None:
        self._reap_tickets()
        metrics.on_nodes(self.controller.state.nodes)

    async def report_unavailable(self, actor: str, message: str) -> None:
        """The ingress saw `actor` fail a call as dead or unreachable (ClusterWatcher.report_unavailable)."""
        await self.watcher.report_unavailable(actor, message)

    @property
    def sites(self) -> Sites:
        return self.controller.sites

    def _background(self, coro) -> None:
        """Run `coro` as a task this service holds until it ends (stops of orphans, resumed loads)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _resume_operator_loads(self) -> None:
        """Models an operator loaded stay loaded across controller restarts: load again what adoption
        did not bring back (in the background; a failure is an event like any load's)."""
        loaded = {i.model for n in self.controller.state.nodes if n.alive for i in n.instances}
        for model, node_id in (await asyncio.to_thread(self.store.loads)).items():
            if model in self.controller.state.catalog and model not in loaded:
                self._background(self._quiet_load(model, node_id))
        alive = {n.node_id for n in self.controller.state.nodes if n.alive}
        for model, node in await asyncio.to_thread(self.store.pulls):  # pulls a restart cut short go on
            if model in self.effects.entries and node in alive:
                self._background(self._pull(node, self.effects.entries[model]))

    async def _quiet_load(self, model: str, node_id: str | None) -> None:
        try:
            await self.controller.load(model, node_id)
        except Exception as e:
            log.warning("resuming the operator's load of %s failed: %s", model, e)

    # ---- what the ingress calls ----------------------------------------------------------------
    async def acquire(
        self,
        model: str,
        tenant: dict[str, Any] | None = None,
        reserve_tokens: int = 0,
        holder: str | None = None,
        avoid: tuple[str, float] | None = None,
    ) -> Grant | Refusal:
        """A lease on `model`, counted against the key's limits when `tenant` names some
        (router/residency/limits.py); with `holder` (an ingress replica, for requests no limit
        counts), a standing lease it routes many requests through. `avoid`: see the controller."""
        who = Tenant.model_validate(tenant) if tenant else None
        if who is not None:
            holder = None  # a key's limits count every request: each has a lease of its own
        ticket = uuid.uuid4().hex
        granted = False
        clock = self.controller.clock
        asked = clock.now()
        try:
            if who is not None:
                self.limiter.admit(who, ticket, reserve_tokens, clock.now())
            lease = await self.controller.acquire(model, holder, avoid)
            granted = True
            metrics.on_queue_wait(model, clock.now() - asked)
        except OrchardError as e:
            if isinstance(e, RateLimited):
                metrics.on_limit(e.limit, who.name if who else "")
            return Refusal.of(e, self.limiter.headers(who, clock.now()) if who else None)
        finally:
            if not granted:  # refused, failed or cancelled (the client left while it waited)
                self.limiter.finish(ticket, 0, clock.now())
        self._tickets[lease.lease_id] = ticket
        entry = self.effects.entries[model]
        return Grant(
            lease=lease,
            kind=entry.kind,
            tool_parser=entry.tool_parser,
            reasoning=entry.reasoning,
            actor_name=self.sites.actor_of(InstanceRef(node_id=lease.node_id, model=model)),
            epoch=self.controller.epoch,
            ratelimit=self.limiter.headers(who, clock.now()) if who else {},
        )

    async def count_site(self, model: str, tenant: dict[str, Any] | None = None) -> CountSite | Refusal:
        """Where `model`'s prompts can be counted now (router/residency/counting.py), asking the
        loop for nothing: a count never places, loads or evicts. A key's count is one request of its
        rpm (and is refused past its max_concurrent) but holds no tokens: it runs no model."""
        who = Tenant.model_validate(tenant) if tenant else None
        now = self.controller.clock.now()
        try:
            if who is not None:
                ticket = uuid.uuid4().hex
                self.limiter.admit(who, ticket, 0, now)
                self.limiter.finish(ticket, 0, now)
            return count_site(model, self.effects.entries, self.controller.state, self.sites, self.effects.models_dir)
        except OrchardError as e:
            if isinstance(e, RateLimited):
                metrics.on_limit(e.limit, who.name if who else "")
            return Refusal.of(e, self.limiter.headers(who, now) if who else None)

    async def release(self, lease_id: str, used_tokens: int | None = None) -> None:
        ticket = self._tickets.pop(lease_id, None)
        if ticket is not None:
            self.limiter.finish(ticket, used_tokens, self.controller.clock.now())
        self.controller.release(lease_id)

    async def report_usage(self, report: UsageReport) -> None:
        """An ingress replica's requests in flight per standing lease, and those it started per model."""
        self.controller.report_usage(report.holder, report.in_flight, report.started)

    async def routes(self, holder: str, version: int = -1) -> RoutesView:
        """An ingress replica's long poll for its standing leases (ResidencyController.routes)."""
        return await self.controller.routes(holder, version)

    def _reap_tickets(self) -> None:
        """Leases the controller ended itself (expired, their instance gone) free their key's count."""
        live = {lease.lease_id for lease in self.controller.leases.all()}
        for lease_id in [lid for lid in self._tickets if lid not in live]:
            self.limiter.finish(self._tickets.pop(lease_id), None, self.controller.clock.now())

    async def load(self, model: str, node_id: str | None = None) -> dict[str, Any] | Refusal:
        try:
            ref = await self.controller.load(model, node_id)
        except OrchardError as e:
            return Refusal.of(e)
        await self.store.add_load(model, node_id)  # started in the step the load ended (X2)
        return {"model": ref.model, "node_id": ref.node_id, "status": "loaded"}

    async def unload(self, model: str) -> dict[str, Any] | Refusal:
        try:
            refs = self.controller.unload(model)
        except OrchardError as e:
            return Refusal.of(e)
        await self.store.drop_load(model)  # started in the step of the change (X2)
        return {"model": model, "unloaded_from": [r.node_id for r in refs]}

    async def pin(self, model: str, pinned: bool) -> dict[str, Any] | Refusal:
        try:
            spec = self.controller.pin(model, pinned)
        except OrchardError as e:
            return Refusal.of(e)
        await self.store.set_pin(model, pinned)  # started in the step of the change (X2)
        return {"model": model, "pinned": spec.pinned}

    async def pull(self, model: str, nodes: list[str] | None = None) -> dict[str, Any] | Refusal:
        """Copy the model's folder into these nodes' stores (default: every alive node), without
        loading it; returns at once, the copies go on (GET /v1/models/<m> shows them)."""
        try:
            entry = self._entry(model)
            alive = [n.node_id for n in self.controller.state.nodes if n.alive]
            for node_id in nodes or ():
                if node_id not in alive:
                    raise OrchardError("node_not_found", f"no alive node {node_id}", "nodes")
            folder = entry.folder
            if folder is None:
                raise OrchardError("files_not_stored", f"model {model} is not kept in node stores (its path is absolute)", "model")
            if not self.sites.holders(model) and not entry.hub:
                raise OrchardError("files_not_stored", f"no node's store holds {folder} to copy from", "model")
        except OrchardError as e:
            return Refusal.of(e)
        out = {}
        for node_id in nodes or alive:
            if self.sites.holds(node_id, model):
                out[node_id] = "stored"
            else:
                out[node_id] = "fetching"
                await asyncio.to_thread(self.store.add_pull, model, node_id)  # a restarted controller goes on with it
                self._background(self._pull(node_id, entry))
        return {"model": model, "nodes": out}

    async def _pull(self, node_id: str, entry: Any) -> None:
        try:
            await self.controller.pull(entry.name, node_id)
        except OrchardError as e:  # recorded as fetch_failed by the copy itself when it got that far
            log.info("pull of %s to %s: %s", entry.name, node_id, e.message)
        finally:
            await asyncio.to_thread(self.store.drop_pull, entry.name, node_id)

    async def delete_files(self, model: str, node_id: str, force: bool = False) -> dict[str, Any] | Refusal:
        """Remove the model's folder from one node's store: not while a model using that folder is
        on the node (loading, waiting to load or loaded) or being copied in, and no placement
        chooses that node for those models until the removal has ended (X3); not the cluster's last
        stored copy unless `force`."""
        try:
            self._entry(model)
            removed = await self.controller.removals.remove(model, node_id, force)
        except OrchardError as e:
            return Refusal.of(e)
        return {"model": model, "node_id": node_id, "removed": removed}

    def _entry(self, model: str) -> Any:
        entry = self.effects.entries.get(model)
        if entry is None:
            raise OrchardError("model_not_found", f"The model '{model}' does not exist", "model")
        return entry

    async def models(self) -> list[dict[str, Any]]:
        return views.models(self.controller)

    async def what_if(self, model: str, node_id: str | None = None) -> Decision:
        """The policy's answer for `model` now (anywhere, or loaded on `node_id`), carried out nowhere."""
        return self.controller.what_if(model, node_id)

    async def cluster(self) -> dict[str, Any]:
        return views.cluster(self.controller)

    def _count_event(self, event: ClusterEvent) -> None:
        key = (event.kind, event.model or "", event.node_id or "")
        self._event_counts[key] = self._event_counts.get(key, 0) + 1

    async def event_counts(self) -> list[tuple[str, str, str, int]]:
        """Events by (kind, model, node) since this controller started: /metrics' counters."""
        return [(*key, n) for key, n in sorted(self._event_counts.items())]

    async def events(self, since: int = 0) -> list[dict[str, Any]]:
        return [e.model_dump() for e in self.controller.events(since)]

    async def next_events(self, since: int, timeout_s: float = 10.0) -> list[ClusterEvent]:
        """The events after `since` as soon as there are any (a long poll of at most `timeout_s`):
        what a live view of the event log streams."""
        return await self.controller.next_events(since, min(timeout_s, 30.0))
