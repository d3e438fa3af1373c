"""The residency loop's effects on a real Ray cluster: a model's weights copied into a node's store
from a peer (cluster/stream.py, between the node agents) or downloaded from the Hub, model-server
actors started there and loaded, drained and killed, store folders removed; events logged and
handed to their listeners (metrics, the operator's store)."""

import asyncio
import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import ray

from cluster.model_servers import (
    actor_name,
    create_model_server,
    create_spare,
    kill_model_server,
    new_incarnation,
    parse_actor_name,
    parse_spare_name,
    spare_name,
)
from cluster.node_agent import get_agent
from cluster.node_report import FetchResult, StoreReport
from cluster.ray_api import NAMESPACE, actor_id, actor_record
from cluster.store import PREFIXES
from deployments.failures import unwrap
from deployments.manifest import ManifestEntry, model_location
from deployments.wire.failure import OrchardError
from deployments.wire.reports import MemoryReport, Released
from policy import InstanceRef
from policy.cluster_state import LoadFailureReason
from router.residency.events import ClusterEvent, LoadError, LoadResult, NodeUnreachable
from router.residency.interface import FetchOrder, StartOrder

log = logging.getLogger("orchard.residency")


class RayEffects:
    """Commands, each told everything it needs in its order and answering with what happened: it
    keeps no state of the cluster (the loop's `Sites` does) and decides nothing. The registry's
    entries and the settings below are configuration."""

    def __init__(
        self,
        entries: dict[str, ManifestEntry],
        models_dir: str,
        *,
        load_timeout_s: float = 600.0,
        drain_timeout_s: float = 30.0,
        server_options: dict | None = None,
        fetch_max_bytes_per_s: float | None = None,
        exit_timeout_s: float = 10.0,
    ):
        self.entries = entries
        self.fetch_max_bytes_per_s = fetch_max_bytes_per_s
        self.models_dir = models_dir
        self.load_timeout_s = load_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.exit_timeout_s = exit_timeout_s  # after a stop, how long its process may take to be gone
        self.report_wanted = asyncio.Event()  # the controller wants fresh node reports (the service's watcher waits on it)
        self._handles: dict[str, Any] = {}  # model servers' actor handles by name, for their memory reports (X4)
        self.listeners: list = []
        self.server_options = server_options or {}  # ModelServer options (coalescing)

    def want_report(self, node_id: str) -> None:
        """The controller waits for a report of `node_id` (X1): the watcher's next round starts now."""
        self.report_wanted.set()

    def new_actor_name(self, model: str, node_id: str) -> str:
        """The actor name of a new incarnation of the model on the node."""
        return actor_name(model, node_id, new_incarnation())

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

    async def start_instance(self, order: StartOrder) -> LoadResult:
        place, spec, entry = order.place, order.spec, order.entry
        if order.ray_node_id is None:
            raise NodeUnreachable(place.node_id, f"node {place.node_id} is not known to Ray")
        if entry is None:
            raise LoadError("not_found", f"model {place.model} has no registry entry")
        options = dict(self.server_options, load_now=True, known_memory=order.measured)
        scheduling = options.pop("llm_engine", None) or {}  # the LLM engines' own, not the server's
        if spec.kind in ("llm", "vlm"):  # its batch held to the reservation, its process limited by it
            options["engine_options"] = {"reserve_context_tokens": spec.reserve_context_tokens, "reserve_concurrency": spec.reserve_concurrency}
        if spec.kind == "llm":
            options["engine_options"] |= {**scheduling, **(entry.llm_engine or {})}  # the model's own over the app's
            if order.store_root is not None and not options["engine_options"].get("prefix_disk_dir"):  # the tier beside the node's store
                options["engine_options"]["prefix_disk_dir"] = str(Path(order.store_root) / PREFIXES)
        models_dir = order.root or self.models_dir
        started = time.monotonic()
        handle = await self._spare(order) if order.spare else None
        if handle is None and parse_spare_name(order.actor) == place.node_id:  # R1: a new process started as a spare, taking the model at once
            spare_options = {k: v for k, v in self.server_options.items() if k != "llm_engine"}
            handle = create_spare(
                place.node_id,
                ray_node_id=order.ray_node_id,
                incarnation=order.actor.rpartition("#")[2],
                models_dir=self.models_dir,
                options=spare_options,
            )
        if handle is not None:  # R1: the spare's process loads the weights; its log says which model
            # the task's name is what the dashboard shows of the model (the actor's row is the spare's)
            load = handle.take.options(name=f"take {entry.name}").remote(entry, models_dir, options.get("engine_options"), order.measured)
        else:  # a new process, named as the loop said
            named = parse_actor_name(order.actor)
            handle = create_model_server(
                entry,
                place.node_id,
                ray_node_id=order.ray_node_id,
                models_dir=models_dir,
                options=options,
                incarnation=named[2] if named is not None else None,
                name=None if named is not None else order.actor,
            )
            load = handle.load.remote()
        try:
            report: MemoryReport = await asyncio.wait_for(load, self.load_timeout_s)
        except Exception as e:
            if isinstance(e, ray.exceptions.ActorUnschedulableError):  # its node is gone (N1), not its files
                raise NodeUnreachable(place.node_id, f"Ray cannot start {order.actor} on {place.node_id}: {type(e).__name__}") from e
            error = unwrap(e)
            reason = load_failure_reason(error.code, error.message)
            await kill_model_server(handle, drain_timeout_s=0, reason=f"failed to load: {error.message}")
            raise LoadError(reason, error.message) from e
        if order.root is not None and entry.folder is not None and (agent := get_agent(place.node_id)) is not None:
            agent.touch.remote(entry.folder)  # the disk budget's recency
        # the whole start (the `loaded` event's seconds): the process's and engine's set-up too, not
        # only the weights' load the engine measured
        seconds = max(report.load_seconds, time.monotonic() - started)
        return LoadResult(bytes=max(place.bytes, report.held_bytes), load_seconds=seconds, measured=report.measured)

    async def _spare(self, order: StartOrder) -> Any:
        """The spare the order names, if its actor still answers (else None: a new process starts)."""
        try:
            handle = await asyncio.to_thread(ray.get_actor, order.actor, NAMESPACE)
            await asyncio.wait_for(handle.health.remote(), self.exit_timeout_s)
            return handle
        except Exception as e:
            log.warning("the spare %s for %s did not answer (%s): starting a new process", order.actor, order.place.model, type(e).__name__)
            with contextlib.suppress(Exception):
                await kill_model_server(order.actor, drain_timeout_s=0, reason="a spare that did not answer")
            return None

    def _spare_options(self) -> dict[str, Any]:
        """ModelServer's own options for a spare (R1): the LLM engines' come with the model it takes."""
        return {k: v for k, v in self.server_options.items() if k != "llm_engine"}

    def new_spare_name(self, node_id: str) -> str:
        return spare_name(node_id, new_incarnation())

    async def start_spare(self, node_id: str, ray_node_id: str | None, actor: str) -> int:
        """R1: a model server with no model, its imports done and its device set up while Ray
        creates it; its resident memory once it runs."""
        if ray_node_id is None:
            raise NodeUnreachable(node_id, f"node {node_id} is not known to Ray")
        options = self._spare_options()
        named = actor.rpartition("#")[2]
        handle = create_spare(node_id, ray_node_id=ray_node_id, incarnation=named, models_dir=self.models_dir, options=options)
        try:
            return int(await asyncio.wait_for(handle.process_bytes.remote(), self.load_timeout_s))
        except Exception as e:
            if isinstance(e, ray.exceptions.ActorUnschedulableError):
                raise NodeUnreachable(node_id, f"Ray cannot start {actor} on {node_id}") from e
            raise

    async def stop_spare(self, node_id: str, actor: str, reason: str) -> None:
        log.info("stopping the spare %s on %s: %s", actor, node_id, reason)
        with contextlib.suppress(Exception):  # a node that died with it: nothing left to stop
            await kill_model_server(actor, drain_timeout_s=0, reason=reason)

    async def fetch_weights(self, order: FetchOrder) -> FetchResult:
        """The weights into the node's store as the order says: copied from its first source that
        serves them (the agents' direct stream, cluster/stream.py), or downloaded from the Hub by the
        node's agent. How it ended comes back (never raises for a failed copy). Cancelled (nobody
        waits for it any more), it tells the agent to stop at its next chunk, keeping the partial
        files. Not bounded by the load timeout: a 40 GB download takes longer than any load and shows
        its progress; a stalled copy fails by its 120 s per-chunk timeout, a stalled download by the
        Hub client's own."""
        entry = order.entry
        if not order.needed or entry is None or entry.folder is None:
            return FetchResult(ok=True, source="stored")
        folder = entry.folder
        target = get_agent(order.node_id)
        if target is None:
            return FetchResult(ok=False, code="error", message=f"no node agent on {order.node_id}")
        if order.sources:
            source = get_agent(order.sources[0])
            if source is None:
                return FetchResult(ok=False, code="error", message=f"no node agent on {order.sources[0]} to copy {folder}")
            try:
                manifest = await source.manifest.remote(folder)
            except Exception as e:
                return FetchResult(ok=False, code="error", message=f"{order.sources[0]} could not describe {folder}: {unwrap(e).message}")
            speculative = order.background is not None
            call = target.fetch.remote(manifest, list(order.sources), self.fetch_max_bytes_per_s, list(order.keep), speculative)
        else:
            call = target.hub_fetch.remote(entry.path, folder, entry.weight_bytes, list(order.keep))
        try:
            return FetchResult.model_validate(await call)
        except asyncio.CancelledError:
            target.cancel_fetch.remote(folder)
            raise
        except Exception as e:  # the target's agent died (its node with it)
            return FetchResult(ok=False, code="error", message=unwrap(e).message)

    async def memory_reports(self, actors: list[str], timeout_s: float) -> dict[str, MemoryReport]:
        """Each actor's memory report, by actor name: what its kept prompt prefixes hold now and what
        prefilling them again would take (X4 and E3), and what its engine measured (M1, measured once
        idle); an actor that does not answer within timeout_s is left out."""
        self._handles = {name: self._handles[name] for name in actors if name in self._handles}  # only those still asked about

        async def one(name: str) -> tuple[str, MemoryReport | None]:
            try:
                handle = self._handles.get(name)
                if handle is None:
                    handle = self._handles[name] = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
                report: MemoryReport = await asyncio.wait_for(handle.memory.remote(), timeout_s)
                return name, report
            except Exception:  # gone, or busy past the timeout: its last figure stands
                self._handles.pop(name, None)
                return name, None

        return {name: held for name, held in await asyncio.gather(*(one(n) for n in actors)) if held is not None}

    async def shrink_caches(self, actors: list[str]) -> int:
        async def one(name: str) -> int:
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
                return int(await asyncio.wait_for(handle.shrink_prefix_cache.remote(0), self.exit_timeout_s))
            except Exception:  # gone, or busy past the timeout: it frees nothing now
                return 0

        return sum(await asyncio.gather(*(one(name) for name in actors)))

    async def store_report(self, node_id: str) -> StoreReport | None:
        agent = get_agent(node_id)
        if agent is None:
            return None
        try:
            return StoreReport.model_validate(await asyncio.wait_for(agent.store_report.remote(), 10.0))
        except Exception:  # no answer: the last report stands
            return None

    async def remove_files(self, node_id: str, folder: str) -> bool:
        agent = get_agent(node_id)
        if agent is None:
            raise OrchardError("node_not_found", f"no node agent on {node_id}", "node")
        result = await agent.remove.remote(folder)
        if not result["removed"] and result["reason"]:
            raise OrchardError("files_in_use", result["reason"], "node")
        return bool(result["removed"])

    async def release_instance(self, instance: InstanceRef, actor: str | None, reason: str) -> Released | None:
        """X1: drain the incarnation's requests (up to drain_timeout_s) and stop its engine, which
        drops its model and caches in its process; what that gave back and what the process still
        holds until it exits, as the model server measured them. None when it does not answer."""
        if actor is None:
            return None
        try:
            handle = await asyncio.to_thread(ray.get_actor, actor, NAMESPACE)
            await asyncio.wait_for(handle.drain.remote(self.drain_timeout_s), self.drain_timeout_s + self.exit_timeout_s)
            return Released.model_validate(await asyncio.wait_for(handle.stop.remote(reason), self.exit_timeout_s))
        except Exception as e:  # gone, or no answer in time: its exit decides
            log.info("%s (%s) did not release its memory: %s", instance, actor, type(e).__name__)
            return None

    async def spare_again(self, actor: str, max_models: int) -> int | None:
        """R1: the stopped model server `actor` becomes a spare again (ModelServer.recycle); what its
        process holds then, or None when it will not (or does not answer): the caller ends it."""
        try:
            handle = await asyncio.to_thread(ray.get_actor, actor, NAMESPACE)
            held: int | None = await asyncio.wait_for(handle.recycle.remote(max_models), self.exit_timeout_s)
        except Exception as e:
            log.info("%s did not become a spare again: %s", actor, type(e).__name__)
            return None
        return None if held is None else int(held)

    async def stop_instance(self, instance: InstanceRef, actor: str | None, reason: str) -> bool:
        """Stop the instance's incarnation `actor`; True once its process is gone (X1)."""
        if actor is None:
            return True  # no actor was started for it
        found = await asyncio.to_thread(live_actor, actor)
        log.info("stopping %s (%s): %s", instance, actor, reason)
        try:
            await kill_model_server(actor, drain_timeout_s=self.drain_timeout_s, reason=reason)
        except Exception:  # a node that died with it: nothing left to stop
            log.exception("stopping %s failed", instance)
        if found is None:  # gone before the stop began
            return True
        return await self._exited(instance.node_id, *found)

    async def _exited(self, node_id: str, actor_id: str, pid: int) -> bool:
        """Whether the stopped actor is gone within exit_timeout_s: Ray's actor table reads it DEAD
        and its node's agent no longer finds its worker process (a Mac frees the process's memory
        only once it has exited)."""
        agent = get_agent(node_id)
        deadline = time.monotonic() + self.exit_timeout_s
        while True:
            dead = await asyncio.to_thread(actor_dead, actor_id)
            try:
                running = dead and agent is not None and pid > 0 and await asyncio.wait_for(agent.process_alive.remote(pid), self.exit_timeout_s)
            except Exception:  # the agent died with its node: the process with it
                running = False
            if dead and not running:
                return True
            if time.monotonic() >= deadline:
                log.warning("%s on %s: %s after its stop", actor_id, node_id, "its process still runs" if dead else "Ray does not read it dead")
                return False
            await asyncio.sleep(0.05)

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


async def agent_answers(node_id: str, timeout_s: float) -> bool:
    """Whether the node's agent answers a call within `timeout_s` (a node whose raylet died is
    listed alive by Ray for a while; its agent no longer answers)."""
    agent = await asyncio.to_thread(get_agent, node_id)
    if agent is None:
        return False
    try:
        await asyncio.wait_for(agent.identity.remote(), timeout_s)
    except Exception:
        return False
    return True


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


def live_actor(name: str) -> tuple[str, int] | None:
    """(actor id, worker process id) of the live model server `name` (Ray's actor table, a GCS
    call); None when Ray lists no live actor by that name."""
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
    found = actor_id(handle)
    return found, int(actor_record(found).get("Pid") or 0)


def actor_dead(actor_id: str) -> bool:
    """Whether Ray's actor table reads the actor DEAD."""
    try:
        return actor_record(actor_id).get("State") == "DEAD"
    except Exception:  # the GCS unreachable for a moment: not confirmed
        return False
