"""The residency loop's eyes on the Ray cluster: every `watch_period_s` (or at once when the loop
wants a report, X1) it keeps one node agent per alive node, turns their reports into NodeReported
events, marks a node that stops answering suspect (N1) and one Ray lists as dead as dead, drops
instances whose actor Ray no longer lists (with the cause Ray gives), and ticks the loop. It also
adopts the model servers a previous controller left running, and checks an actor the ingress saw
fail."""

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cluster.model_servers import death_cause, find_model_servers, kill_model_server, live_model_server_names, parse_actor_name, parse_spare_name
from cluster.node_agent import alive_nodes, collect_reports, ensure_agents
from deployments.wire.reports import HealthReport, MemoryReport
from policy import InstanceRef
from router.residency.controller import ResidencyController
from router.residency.effects import RayEffects, agent_answers
from router.residency.events import CachesReported, NodeLost

log = logging.getLogger("orchard.residency")


class ClusterWatcher:
    def __init__(self, controller: ResidencyController, effects: RayEffects, watch_period_s: float = 1.0, report_timeout_s: float = 2.0):
        self.controller = controller
        self.effects = effects
        self.sites = controller.sites
        self.watch_period_s = watch_period_s
        self.report_timeout_s = report_timeout_s
        self._missed: dict[str, int] = {}  # node -> reports in a row its agent did not answer
        self._agents: dict[str, Any] = {}  # the node agents found by the last round that found them all
        self._tasks: set[asyncio.Task] = set()

    def background(self, coro) -> None:
        """Run `coro` as a task held until it ends (stops of servers not adopted)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, each_round: Callable[[], None]) -> None:
        """A round every watch_period_s, or at once when the loop wants node reports (X1); then the
        loop's tick and `each_round`."""
        while True:
            try:  # a round every watch_period_s, or at once when the controller wants node reports (X1)
                await asyncio.wait_for(self.effects.report_wanted.wait(), self.watch_period_s)
            except TimeoutError:
                pass
            self.effects.report_wanted.clear()
            try:
                await self.observe_caches()
                await self.observe_nodes()
                await self.observe_instances()
                self.controller.tick()
                each_round()
            except Exception:  # a failed round must not end the watcher
                log.exception("node watch round failed")

    async def observe_nodes(self) -> None:
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
            self.controller.report_node(
                node_id,
                devices=report.devices,
                total_bytes=report.total_bytes,
                usable_bytes=report.usable_bytes,
                free_bytes=report.free_bytes,
                labels=report.labels,
                asked_at=asked,
                ray_node_id=report.ray_node_id,
                chip=report.chip,
                store=report.store,
                ours_bytes=used.get(node_id),
            )
        alive = {n.node_id for n in await asyncio.to_thread(alive_nodes)}
        for node in self.controller.state.nodes:
            if node.alive and node.node_id not in alive:
                self.controller.node_dead(node.node_id, "Ray lists the node as dead")
        if back:  # a suspect node answers again: the model servers it kept running are ours again
            await self.adopt_running_servers(only_nodes=frozenset(back))

    async def observe_caches(self) -> None:
        """X4: what the kept prompt prefixes of every ready LLM and VLM instance hold now (their memory
        reports), read before the node reports so that a node's foreign memory leaves them out; and
        M1: what an engine measured once idle after its load."""
        refs = {}
        for node in self.controller.state.nodes:
            for inst in node.instances if node.alive else ():
                ref = InstanceRef(node_id=node.node_id, model=inst.model)
                name = self.sites.actor_of(ref)
                if inst.status == "ready" and name is not None and self.controller.state.catalog[inst.model].kind in ("llm", "vlm"):
                    refs[name] = ref
        if not refs:
            return
        reports = await self.effects.memory_reports(list(refs), self.report_timeout_s / 2)
        for node_id in {refs[name].node_id for name in reports}:
            on_node = {refs[name].model: r for name, r in reports.items() if refs[name].node_id == node_id}
            self.controller.apply(
                CachesReported(
                    node_id=node_id,
                    prefix_cache_bytes={model: r.prefix_cache_bytes for model, r in on_node.items()},
                    prefix_reload_s={model: r.prefix_prefill_s for model, r in on_node.items()},
                    measured={model: r.measured for model, r in on_node.items() if r.measured is not None and not r.measured.provisional},
                )
            )

    async def observe_instances(self) -> None:
        """Ready instances whose actor Ray no longer lists (a detached actor's name is freed at its
        death: killed, out of memory, crashed) are dropped, with the cause Ray gives."""
        live = set(await asyncio.to_thread(live_model_server_names))
        for spare in list(self.controller.spares.ready.values()):  # R1: a spare that died is started again later
            if spare.actor not in live:
                self.controller.spares.died(spare.actor)
        for node in self.controller.state.nodes:
            for inst in node.instances if node.alive else ():
                ref = InstanceRef(node_id=node.node_id, model=inst.model)
                name = self.sites.actor_of(ref)
                if inst.status == "ready" and name is not None and name not in live:
                    cause = await asyncio.to_thread(death_cause, name)
                    self.controller.instance_died(ref, cause)

    async def report_unavailable(self, actor: str, message: str) -> None:
        """The ingress saw `actor` fail a call as dead or unreachable: drop its instance at once if
        Ray confirms the actor is gone (an unreachable one, e.g. a frozen node, is left to the node
        watcher and the ingress's inactivity timeout)."""
        ref = next((InstanceRef(node_id=node, model=model) for (model, node), name in self.sites.actors.items() if name == actor), None)
        if ref is None:  # not an instance this loop knows (stopped already, or another incarnation)
            return
        node_id = ref.node_id
        if actor not in await asyncio.to_thread(live_model_server_names):
            self.controller.instance_died(ref, await asyncio.to_thread(death_cause, actor, message))
        elif not await agent_answers(node_id, self.report_timeout_s / 2):  # Ray has not noticed yet: rule N1
            self.controller.apply(NodeLost(node_id=node_id, reason=f"{actor} failed ({message}) and the node's agent does not answer", suspect=True))

    async def adopt_running_servers(self, answer_within_s: float = 5.0, only_nodes: frozenset[str] | None = None) -> None:
        """Adopt the ready model servers an earlier controller left (one per model and node); stop
        the others (still loading for a controller that is gone, failed, a second copy, a model no
        longer in the registry), whose memory nobody would account for."""
        for name, handle in await asyncio.to_thread(find_model_servers):
            parsed = parse_actor_name(name)
            spare_on = parse_spare_name(name)  # R1: a spare, which may have taken a model
            node_id = parsed[1] if parsed is not None else spare_on
            node = self.controller.state.node(node_id) if node_id is not None else None
            if node_id is None or node is None or not node.alive or (only_nodes is not None and node_id not in only_nodes):
                continue  # not ours, or on a node that is gone
            if self.controller.spares.owns(name) or name in self.sites.actors.values():
                continue  # this loop's own spare, or an instance of its own
            model = parsed[0] if parsed is not None else None
            health: HealthReport | None
            memory: MemoryReport | None
            try:
                health = await asyncio.wait_for(handle.health.remote(), answer_within_s)
                memory = await asyncio.wait_for(handle.memory.remote(), answer_within_s)
            except Exception:
                health, memory = None, None
            if model is None and health is not None:
                model = health.model  # the model a spare took (none: a spare of a loop that is gone)
            if (
                health is not None
                and memory is not None
                and health.status == "ready"
                and model in self.controller.state.catalog
                and node.instance(model) is None
            ):
                self.controller.adopt_instance(node_id, model, node.devices[0], memory.held_bytes, memory.load_seconds, actor=name)
            else:
                log.info("stopping %s: not adopted (%s)", name, health.status if health is not None else "no answer")
                self.background(kill_model_server(name, 0.0, reason="not adopted by a restarted controller"))
