"""The controller's effects on a real Ray cluster: model-server actors started on the chosen node
and loaded, drained and killed; events logged (and, with issue 4's metrics, counted)."""

import asyncio
import logging
import time

import ray

from cluster.placement import actor_name, create_model_server, kill_model_server
from deployments.manifest import ManifestEntry
from deployments.model_server import unwrap
from policy import InstanceRef, ModelSpec, Place
from router.controller import ClusterEvent, LoadError, LoadResult

log = logging.getLogger("orchard.residency")


class RayEffects:
    def __init__(
        self,
        entries: dict[str, ManifestEntry],
        models_dir: str,
        *,
        load_timeout_s: float = 600.0,
        drain_timeout_s: float = 30.0,
        server_options: dict | None = None,
    ):
        self.entries = entries
        self.models_dir = models_dir
        self.ray_node_ids: dict[str, str] = {}  # Orchard node id -> Ray node id, kept by the node watcher
        self.load_timeout_s = load_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.listeners: list = []
        self.server_options = server_options or {}  # ModelServer options (coalescing)

    def now(self) -> float:
        return time.monotonic()

    async def start_instance(self, place: Place, spec: ModelSpec) -> LoadResult:
        ray_node_id = self.ray_node_ids.get(place.node_id)
        if ray_node_id is None:
            raise LoadError("error", f"node {place.node_id} is not known to Ray")
        options = dict(self.server_options)
        if spec.kind == "llm":
            options["engine_options"] = {
                "reserve_context_tokens": spec.reserve_context_tokens,
                "reserve_concurrency": spec.reserve_concurrency,
            }
        name = actor_name(place.model, place.node_id)
        try:
            handle = create_model_server(
                self.entries[place.model], place.node_id, ray_node_id=ray_node_id, models_dir=self.models_dir, options=options
            )
        except ValueError:  # a server of that name runs already (left by an earlier controller): reuse it
            handle = ray.get_actor(name, namespace="orchard")
        try:
            report = await asyncio.wait_for(handle.load.remote(), self.load_timeout_s)
        except Exception as e:
            error = unwrap(e)
            await kill_model_server(handle, drain_timeout_s=0)
            reason = "not_found" if error.code == "not_found" else "out_of_memory" if "memory" in error.message.lower() else "error"
            raise LoadError(reason, error.message) from e
        measured = report["weight_bytes"] + report["kv_bytes_reserved"]
        return LoadResult(bytes=max(place.bytes, measured), load_seconds=report["load_seconds"])

    async def stop_instance(self, instance: InstanceRef, reason: str) -> None:
        log.info("stopping %s: %s", instance, reason)
        try:
            await kill_model_server(actor_name(instance.model, instance.node_id), drain_timeout_s=self.drain_timeout_s)
        except Exception:  # a node that died with it: nothing left to stop
            log.exception("stopping %s failed", instance)

    def publish(self, event: ClusterEvent) -> None:
        log.info("%s %s %s %s", event.kind, event.model or "", event.node_id or "", event.reason)
        for listener in self.listeners:
            listener(event)
