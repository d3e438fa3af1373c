"""The residency controller as a single-replica Serve deployment.

It owns the ResidencyController (one asyncio loop: the replica's) and a watcher that, every
`watch_period_s`, keeps one node agent per alive node, turns their memory reports into node
events, marks nodes Ray no longer lists as dead, and ticks the controller (idle unloads, copies,
forgotten leases). On start it adopts model servers that outlived a previous controller. The
ingress calls it for leases and cluster operations only, never per token. A refusal travels as a
`Refusal` (deployments/wire/leases.py), which the ingress raises again as the OrchardError it was."""

import asyncio
import logging
import uuid
from typing import Any

from ray import serve

from cluster.model_servers import death_cause, find_model_servers, kill_model_server, live_model_server_names, parse_actor_name
from cluster.node_agent import alive_nodes, collect_reports, ensure_agents
from cluster.ray_api import on_head
from deployments.wire.failure import OrchardError
from deployments.wire.leases import Grant, Refusal, RoutesView, UsageReport
from deployments.wire.reports import HealthReport, MemoryReport
from policy import Decision, InstanceRef, PolicyConfig, StoreRoom
from policy.failures import backoff_left
from router import metrics
from router.residency.controller import ResidencyController
from router.residency.effects import RayEffects, agent_answers, holds, store_folder
from router.residency.events import ClusterEvent, NodeLost
from router.residency.limits import Limiter, RateLimited, Tenant
from router.residency.operator_store import OperatorStore
from router.residency.registry import from_config

log = logging.getLogger("orchard.residency")


def _room(store: dict[str, Any]) -> StoreRoom:
    """A store report's disk, as rule L4 reads it."""
    return StoreRoom(
        free_bytes=max(0, store.get("free_bytes", 0)), used_bytes=max(0, store.get("used_bytes", 0)), budget_bytes=store.get("budget_bytes")
    )


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
        catalog, entries = from_config(models, models_dir)
        self.effects = RayEffects(entries, models_dir, server_options=server_options, fetch_max_bytes_per_s=fetch_max_bytes_per_s)
        self.effects.listeners.append(metrics.on_event)
        self.controller = ResidencyController(catalog, PolicyConfig.model_validate(policy), self.effects)
        self.effects.record = self.controller.record
        self.store = OperatorStore()
        self.limiter = Limiter()
        self._tickets: dict[str, str] = {}  # lease id -> the limiter's ticket
        self.controller.restore(await asyncio.to_thread(self.store.events), await asyncio.to_thread(self.store.pins))
        self.effects.listeners.append(self.store.on_event)
        self._event_counts: dict[tuple[str, str, str], int] = {}  # (kind, model, node) -> events since start
        self.effects.listeners.append(self._count_event)
        self.watch_period_s = watch_period_s
        self._orphans: set[asyncio.Task] = set()
        self._missed: dict[str, int] = {}  # node -> reports in a row its agent did not answer
        self._agents: dict[str, Any] = {}  # the node agents found by the last round that found them all
        self.report_timeout_s = report_timeout_s
        await self._observe_nodes()
        await self._adopt_running_servers()
        await self._resume_operator_loads()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    # ---- the watcher ---------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:  # a round every watch_period_s, or at once when the controller wants node reports (X1)
                await asyncio.wait_for(self.effects.report_wanted.wait(), self.watch_period_s)
            except TimeoutError:
                pass
            self.effects.report_wanted.clear()
            try:
                await self._observe_nodes()
                await self._observe_instances()
                self.controller.tick()
                self._reap_tickets()
                metrics.on_nodes(self.controller.state.nodes)
            except Exception:  # a failed round must not end the watcher
                log.exception("node watch round failed")

    async def _observe_nodes(self) -> None:
        try:
            # the first round waits for every agent to start; later ones do not wait for a node that stopped answering
            agents = self._agents = await asyncio.to_thread(ensure_agents, 2 * self.report_timeout_s if self._agents else 30.0)
        except TimeoutError:  # an agent that does not answer (its node may be gone): ask the others as before
            agents = self._agents
        asked = self.controller.clock.now()  # the reports measure after this (X1 trusts only those after a stop)
        used = {n.node_id: self.controller.held_bytes(n.node_id) for n in self.controller.state.nodes}
        reports = await asyncio.to_thread(collect_reports, agents, used, self.report_timeout_s)
        for node_id in agents.keys() - reports.keys():  # a node whose agent did not answer twice in a row is suspect (rule N1)
            self._missed[node_id] = self._missed.get(node_id, 0) + 1
            node = self.controller.state.node(node_id)
            if self._missed[node_id] >= 2 and node is not None and node.alive:
                self.controller.apply(
                    NodeLost(node_id=node_id, reason=f"its agent did not answer {self._missed[node_id]} reports in a row", suspect=True)
                )
        back = []
        for node_id, report in reports.items():
            self._missed.pop(node_id, None)
            node = self.controller.state.node(node_id)
            if node is not None and not node.alive:
                back.append(node_id)
            self.effects.ray_node_ids[node_id] = report.ray_node_id
            if report.store is not None:
                self.effects.stores[node_id] = report.store
            self.controller.report_node(
                node_id,
                devices=report.devices,
                total_bytes=report.total_bytes,
                usable_bytes=report.usable_bytes,
                free_bytes=report.free_bytes,
                labels=report.labels,
                stored=self._stored(report.store) if report.store is not None else None,
                asked_at=asked,
                store_room=_room(report.store) if report.store is not None else None,
                store_copying=bool(report.store.get("fetching")) if report.store is not None else False,
            )
        alive = {n.node_id for n in await asyncio.to_thread(alive_nodes)}
        for node in self.controller.state.nodes:
            if node.alive and node.node_id not in alive:
                self.controller.node_dead(node.node_id, "Ray lists the node as dead")
        if back:  # a suspect node answers again: the model servers it kept running are ours again
            await self._adopt_running_servers(only_nodes=frozenset(back))

    def _stored(self, store: dict) -> frozenset[str]:
        """The catalog models whose folder a store report lists (L1)."""
        return frozenset(name for name, entry in self.effects.entries.items() if (folder := store_folder(entry)) is not None and holds(store, folder))

    async def _observe_instances(self) -> None:
        """Ready instances whose actor Ray no longer lists (a detached actor's name is freed at its
        death: killed, out of memory, crashed) are dropped, with the cause Ray gives."""
        live = set(await asyncio.to_thread(live_model_server_names))
        for node in self.controller.state.nodes:
            for inst in node.instances if node.alive else ():
                ref = InstanceRef(node_id=node.node_id, model=inst.model)
                name = self.effects.actor_of(ref)
                if inst.status == "ready" and name is not None and name not in live:
                    cause = await asyncio.to_thread(death_cause, name)
                    self.controller.instance_died(ref, cause)

    async def report_unavailable(self, actor: str, message: str) -> None:
        """The ingress saw `actor` fail a call as dead or unreachable: drop its instance at once if
        Ray confirms the actor is gone (an unreachable one, e.g. a frozen node, is left to the node
        watcher and the ingress's inactivity timeout)."""
        parsed = parse_actor_name(actor)
        if parsed is None:
            return
        model, node_id, _ = parsed
        ref = InstanceRef(node_id=node_id, model=model)
        if self.effects.actor_of(ref) != actor:
            return
        if actor not in await asyncio.to_thread(live_model_server_names):
            self.controller.instance_died(ref, await asyncio.to_thread(death_cause, actor, message))
        elif not await agent_answers(node_id, self.report_timeout_s / 2):  # Ray has not noticed yet: rule N1
            self.controller.apply(NodeLost(node_id=node_id, reason=f"{actor} failed ({message}) and the node's agent does not answer", suspect=True))

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

    async def _adopt_running_servers(self, answer_within_s: float = 5.0, only_nodes: frozenset[str] | None = None) -> None:
        """Adopt the ready model servers an earlier controller left (one per model and node); stop
        the others (still loading for a controller that is gone, failed, a second copy, a model no
        longer in the registry), whose memory nobody would account for."""
        for name, handle in await asyncio.to_thread(find_model_servers):
            parsed = parse_actor_name(name)
            node = self.controller.state.node(parsed[1]) if parsed is not None else None
            if parsed is None or node is None or not node.alive or (only_nodes is not None and parsed[1] not in only_nodes):
                continue  # not ours, or on a node that is gone
            model, node_id, _ = parsed
            health: HealthReport | None
            memory: MemoryReport | None
            try:
                health = await asyncio.wait_for(handle.health.remote(), answer_within_s)
                memory = await asyncio.wait_for(handle.memory.remote(), answer_within_s)
            except Exception:
                health, memory = None, None
            if (
                health is not None
                and memory is not None
                and health.status == "ready"
                and model in self.controller.state.catalog
                and node.instance(model) is None
            ):
                self.effects.actors[(model, node_id)] = name
                self.controller.adopt_instance(node_id, model, node.devices[0], memory.held_bytes, memory.load_seconds)
            else:
                log.info("stopping %s: not adopted (%s)", name, health.status if health is not None else "no answer")
                self._background(kill_model_server(name, 0.0, reason="not adopted by a restarted controller"))

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
            actor_name=self.effects.actor_of(InstanceRef(node_id=lease.node_id, model=model)),
            epoch=self.controller.epoch,
            ratelimit=self.limiter.headers(who, clock.now()) if who else {},
        )

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
            folder = store_folder(entry)
            if folder is None:
                raise OrchardError("files_not_stored", f"model {model} is not kept in node stores (its path is absolute)", "model")
            if not self.effects.holders(folder) and not entry.hub:
                raise OrchardError("files_not_stored", f"no node's store holds {folder} to copy from", "model")
        except OrchardError as e:
            return Refusal.of(e)
        out = {}
        for node_id in nodes or alive:
            if holds(self.effects.stores.get(node_id, {}), folder):
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
            folder = store_folder(self._entry(model))
            store = self.effects.stores.get(node_id)
            if store is None:
                raise OrchardError("node_not_found", f"no store report from node {node_id}", "node")
            if folder is None or not (holds(store, folder) or folder in store.get("partial", {})):
                raise OrchardError("files_not_stored", f"node {node_id}'s store does not hold the files of {model}", "node")
            users = frozenset(name for name, entry in self.effects.entries.items() if store_folder(entry) == folder)
            self.controller.begin_removing(node_id, users)  # checked and marked in this step: no placement slips in
            removed = False
            try:
                if not force and not self.effects.entries[model].hub and holds(store, folder) and not self.effects.holders(folder, but=node_id):
                    raise OrchardError(
                        "last_stored_copy",
                        f"node {node_id} holds the cluster's last stored copy of {folder}: pass force=true to remove it anyway",
                        "force",
                    )
                removed = await self.effects.remove_files(node_id, folder)
            finally:
                self.controller.end_removing(node_id, users, removed)
        except OrchardError as e:
            return Refusal.of(e)
        self.controller.record("files_removed", model=model, node_id=node_id, reason=f"{folder} removed from the store by an operator")
        return {"model": model, "node_id": node_id, "removed": removed}

    def _entry(self, model: str) -> Any:
        entry = self.effects.entries.get(model)
        if entry is None:
            raise OrchardError("model_not_found", f"The model '{model}' does not exist", "model")
        return entry

    async def models(self) -> list[dict[str, Any]]:
        """Every registry model with its residency: loaded / loading / failed / available, where,
        bytes; a model marked failed (P10) says why and when it is tried again."""
        state = self.controller.state
        now = self.controller.clock.now()
        out = []
        for name, spec in sorted(state.catalog.items()):
            copies = [(n.node_id, i) for n in state.nodes if n.alive for i in n.instances if i.model == name]
            mark = state.failed.get(name)
            status = "loaded" if any(i.status == "ready" for _, i in copies) else "loading" if copies else "failed" if mark else "available"
            folder = store_folder(self.effects.entries[name])
            stores = self.effects.stores.items() if folder is not None else ()
            fetching = {node_id: s["fetching"][folder] for node_id, s in stores if folder in s.get("fetching", {})}
            if fetching and status != "loaded":
                status = "fetching"
            model = {
                "id": name,
                "kind": spec.kind,
                "status": status,
                "pinned": spec.pinned,
                "keep_warm": spec.keep_warm,
                "nodes": [node_id for node_id, _ in copies],
                "bytes": sum(i.bytes for _, i in copies) or None,
                "stored_on": sorted(node_id for node_id, s in stores if holds(s, folder)),  # type: ignore[arg-type]  # folder is set when stores is
                "fetching": fetching,  # node -> done_bytes, total_bytes, source, bytes_per_s, eta_s
                "demand": round(self.controller.demand.at(name, now), 2),  # requests, decayed (L4)
            }
            if mark is not None:
                model["failure"] = {
                    "node_id": mark.node_id,
                    "reason": mark.reason,
                    "message": mark.message,
                    "failures": mark.failures,
                    "retry_in_s": max(0.0, round(backoff_left(mark, now, self.controller.config), 1)),
                }
            out.append(model)
        return out

    async def what_if(self, model: str, node_id: str | None = None) -> Decision:
        """The policy's answer for `model` now (anywhere, or loaded on `node_id`), carried out nowhere."""
        return self.controller.what_if(model, node_id)

    async def cluster(self) -> dict[str, Any]:
        state = self.controller.state
        leases = self.controller.leases.all()
        return {
            "nodes": [
                {
                    "node_id": n.node_id,
                    "alive": n.alive,
                    "draining": n.draining,
                    "devices": list(n.devices),
                    "labels": n.labels,
                    "memory": {
                        "total_bytes": n.total_bytes,
                        "usable_bytes": n.usable_bytes,
                        "foreign_bytes": n.foreign_bytes,
                        "headroom_bytes": n.reported_headroom_bytes,
                        "ours_bytes": sum(i.bytes for i in n.instances),
                    },
                    "instances": [
                        i.model_dump()
                        | {
                            "leases": sum(1 for lease in leases if lease.node_id == n.node_id and lease.model == i.model),
                            "actor": self.effects.actor_of(InstanceRef(node_id=n.node_id, model=i.model)),
                        }
                        for i in n.instances
                    ],
                    "store": self.effects.stores.get(n.node_id),
                }
                for n in state.nodes
            ],
            "policy": self.controller.config.model_dump(mode="json"),
            "routing": {
                "leases_granted": self.controller.acquires,
                "standing_leases": sum(1 for lease in leases if lease.holder is not None),
                "request_leases": sum(1 for lease in leases if lease.holder is None),
            },
        }

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
