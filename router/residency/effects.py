"""The controller's effects on a real Ray cluster: model-server actors started on the chosen node
and loaded, drained and killed; events logged (and, with issue 4's metrics, counted)."""

import asyncio
import hashlib
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from cluster.placement import actor_name, create_model_server, kill_model_server, new_incarnation
from deployments.manifest import ManifestEntry, model_location
from deployments.model_server import unwrap
from policy import InstanceRef, ModelSpec, Place
from policy.cluster_state import LoadFailureReason
from router.residency.controller import ClusterEvent, LoadError, LoadResult

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
        self.actors: dict[tuple[str, str], str] = {}  # (model, node) -> actor name of its current incarnation

    def now(self) -> float:
        return time.monotonic()

    def files_version(self, model: str) -> str | None:
        """Names, sizes and modification times of the model folder's files as this process sees
        them (the head's view; None for a hub model or a folder not here): a failed model whose
        files change is tried again at once."""
        entry = self.entries.get(model)
        if entry is None or entry.hub:
            return None
        folder = Path(model_location(entry, self.models_dir))
        try:
            stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())
        except OSError:
            return None
        return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]

    def actor_of(self, instance: InstanceRef) -> str | None:
        """The actor name of the instance's current incarnation."""
        return self.actors.get((instance.model, instance.node_id))

    async def start_instance(self, place: Place, spec: ModelSpec) -> LoadResult:
        ray_node_id = self.ray_node_ids.get(place.node_id)
        if ray_node_id is None:
            raise LoadError("error", f"node {place.node_id} is not known to Ray")
        options = dict(self.server_options, load_now=True)
        if spec.kind == "llm":
            options["engine_options"] = {
                "reserve_context_tokens": spec.reserve_context_tokens,
                "reserve_concurrency": spec.reserve_concurrency,
            }
        incarnation = new_incarnation()
        name = actor_name(place.model, place.node_id, incarnation)
        self.actors[(place.model, place.node_id)] = name
        handle = create_model_server(
            self.entries[place.model],
            place.node_id,
            ray_node_id=ray_node_id,
            models_dir=self.models_dir,
            options=options,
            incarnation=incarnation,
        )
        try:
            report: dict[str, Any] = await asyncio.wait_for(handle.load.remote(), self.load_timeout_s)
        except Exception as e:
            error = unwrap(e)
            reason = load_failure_reason(error.code, error.message)
            await kill_model_server(handle, drain_timeout_s=0, reason=f"failed to load: {error.message}")
            raise LoadError(reason, error.message) from e
        measured = report["weight_bytes"] + report["kv_bytes_reserved"]
        return LoadResult(bytes=max(place.bytes, measured), load_seconds=report["load_seconds"])

    def stop_instance(self, instance: InstanceRef, reason: str) -> Coroutine[Any, Any, None]:
        """Stop the instance's current incarnation. Its actor name is taken now, not when the stop
        runs: by then the model may be placed there again, as a new incarnation."""
        name = self.actors.pop((instance.model, instance.node_id), None)
        return self._stop(instance, name, reason)

    async def _stop(self, instance: InstanceRef, name: str | None, reason: str) -> None:
        if name is None:
            return
        log.info("stopping %s (%s): %s", instance, name, reason)
        try:
            await kill_model_server(name, drain_timeout_s=self.drain_timeout_s, reason=reason)
        except Exception:  # a node that died with it: nothing left to stop
            log.exception("stopping %s failed", instance)

    def publish(self, event: ClusterEvent) -> None:
        log.info("%s %s %s %s", event.kind, event.model or "", event.node_id or "", event.reason)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a metric must never fail a placement or a request
                log.exception("event listener failed on %s", event.kind)


# What an out-of-memory load failure says (MLX's allocators on Metal and CUDA, Python, Ray's memory
# monitor): only that failure earns evict-and-retry (policy rule P9).
_OUT_OF_MEMORY = ("out of memory", "outofmemory", "insufficient memory", "bad_alloc", "unable to allocate", "memoryerror", "running low on memory")


def load_failure_reason(code: str, message: str) -> LoadFailureReason:
    """not_found: no files. out_of_memory: the loader said so, or the server's process died while
    loading (on a Mac that is the kernel's out-of-memory kill: a SIGKILL without a word). bad_files:
    the engine raised while loading files that are there (truncated, unsupported architecture, a
    config that does not parse). error: anything else (a timeout, an internal failure)."""
    if code == "not_found":
        return "not_found"
    if code == "unavailable" or any(marker in message.lower() for marker in _OUT_OF_MEMORY):
        return "out_of_memory"
    return "bad_files" if code == "load_failed" else "error"
