"""The controller's effects on a real Ray cluster: the model's weights copied into the chosen node's
store from a peer that holds them (cluster/store.py, through the node agents), model-server actors
started there and loaded, drained and killed; events logged and counted."""

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import ray

from cluster.model_servers import actor_name, create_model_server, kill_model_server, new_incarnation
from cluster.node_agent import get_agent
from cluster.ray_api import NAMESPACE, actor_id, actor_record
from deployments.manifest import ManifestEntry, model_location
from deployments.model_server import unwrap
from deployments.wire.failure import OrchardError
from deployments.wire.reports import MemoryReport
from policy import InstanceRef, ModelSpec, Place
from policy.cluster_state import LoadFailureReason
from router.residency.events import ClusterEvent, LoadError, LoadResult, NodeUnreachable

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
        fetch_max_bytes_per_s: float | None = None,
        exit_timeout_s: float = 10.0,
    ):
        self.entries = entries
        self.fetch_max_bytes_per_s = fetch_max_bytes_per_s
        self.models_dir = models_dir
        self.ray_node_ids: dict[str, str] = {}  # Orchard node id -> Ray node id, kept by the node watcher
        self.load_timeout_s = load_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.exit_timeout_s = exit_timeout_s  # after a stop, how long its process may take to be gone
        self.report_wanted = asyncio.Event()  # the controller wants fresh node reports (the service's watcher waits on it)
        self.listeners: list = []
        self.server_options = server_options or {}  # ModelServer options (coalescing)
        self.actors: dict[tuple[str, str], str] = {}  # (model, node) -> actor name of its current incarnation
        self.stores: dict[str, dict] = {}  # Orchard node id -> its store's last report (NodeReport.store)
        self.record: Callable[..., None] = lambda kind, **fields: None  # the controller's, for events while working

    def want_report(self, node_id: str) -> None:
        """The controller waits for a report of `node_id` (X1): the watcher's next round starts now."""
        self.report_wanted.set()

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
            raise NodeUnreachable(place.node_id, f"node {place.node_id} is not known to Ray")
        registered = self.entries[place.model]
        options = dict(self.server_options, load_now=True)
        scheduling = options.pop("llm_engine", None) or {}  # the LLM engines' own, not the server's
        if spec.kind == "llm":
            options["engine_options"] = {
                "reserve_context_tokens": spec.reserve_context_tokens,
                "reserve_concurrency": spec.reserve_concurrency,
                **scheduling,
                **(registered.llm_engine or {}),  # the model's own over the app's
            }
        entry, models_dir = await self._weights_on(place.node_id, registered)
        incarnation = new_incarnation()
        name = actor_name(place.model, place.node_id, incarnation)
        self.actors[(place.model, place.node_id)] = name
        handle = create_model_server(
            entry,
            place.node_id,
            ray_node_id=ray_node_id,
            models_dir=models_dir,
            options=options,
            incarnation=incarnation,
        )
        try:
            report: MemoryReport = await asyncio.wait_for(handle.load.remote(), self.load_timeout_s)
        except Exception as e:
            if isinstance(e, ray.exceptions.ActorUnschedulableError):  # its node is gone (N1), not its files
                raise NodeUnreachable(place.node_id, f"Ray cannot start {name} on {place.node_id}: {type(e).__name__}") from e
            error = unwrap(e)
            reason = load_failure_reason(error.code, error.message)
            await kill_model_server(handle, drain_timeout_s=0, reason=f"failed to load: {error.message}")
            raise LoadError(reason, error.message) from e
        if entry.folder is not None and models_dir != self.models_dir and (agent := get_agent(place.node_id)) is not None:
            agent.touch.remote(entry.folder)  # the disk budget's recency
        return LoadResult(bytes=max(place.bytes, report.held_bytes), load_seconds=report.load_seconds)

    async def _weights_on(self, node_id: str, entry: ManifestEntry) -> tuple[ManifestEntry, str]:
        """The entry and models folder the model server on `node_id` loads from: the folder in that
        node's store, after copying it in from a node whose store holds it if it lacks it. The
        registry's own path when no store holds it (every node has it at the same path, as before
        stores) and for hub models and absolute paths."""
        folder = store_folder(entry)
        mine = self.stores.get(node_id)
        if folder is None or mine is None:
            return entry, self.models_dir
        if not holds(mine, folder):
            holders = self.holders(folder, but=node_id)
            if holders:
                await self._copy(node_id, entry, folder, holders, mine["root"])
            elif entry.hub:
                await self._download(node_id, entry, folder)
            else:
                return entry, self.models_dir
        return entry.model_copy(update={"path": folder, "hub": False}), mine["root"]

    async def _download(self, node_id: str, entry: ManifestEntry, folder: str) -> None:
        """The weights of a hub model into `node_id`'s store, by that node's agent (L1's hub source)."""
        target = get_agent(node_id)
        if target is None:
            raise LoadError("error", f"no node agent on {node_id} to download {entry.path}")
        self.record("fetching", model=entry.name, node_id=node_id, bytes=entry.weight_bytes, reason=f"downloading {entry.path} from the Hub")
        call = target.hub_fetch.remote(entry.path, folder, entry.weight_bytes, self._in_use(node_id))
        await self._run_fetch(node_id, entry, call, target, folder, f"downloading {entry.path}", "hub")

    async def _run_fetch(self, node_id: str, entry: ManifestEntry, call: Any, target: Any, folder: str, what: str, source: str) -> None:
        """Wait for an agent's copy or download (`call`) into `node_id`'s store and record how it
        ended: `fetched` (bytes, seconds, MB/s) or `fetch_failed` and a LoadError. Cancelled (nobody
        waits for it any more), it tells the agent to stop at its next chunk, keeping the partial files.
        Not bounded by the load timeout: a 40 GB download takes longer than any load and shows its
        progress; a stalled copy fails by its 120 s per-chunk timeout, a stalled download by the Hub
        client's own."""
        started = time.monotonic()
        try:
            result = await call
        except asyncio.CancelledError:
            target.cancel_fetch.remote(folder)
            raise
        except Exception as e:  # the target's agent died (its node with it)
            result = {"ok": False, "code": "error", "message": unwrap(e).message}
        self._removed(node_id, entry, result.get("removed") or [])
        if not result["ok"]:
            self.record("fetch_failed", model=entry.name, node_id=node_id, reason=f"{result['code']}: {result['message']}")
            raise LoadError("error", f"{what} to {node_id} failed: {result['message']}")
        seconds = time.monotonic() - started
        rate = result["bytes"] / max(seconds, 1e-6) / 1e6
        origin = f"the Hub ({entry.path} at {result.get('revision') or '?'})" if source == "hub" else result["source"]
        reason = f"from {origin}: {result['bytes']} of {result['total_bytes']} bytes copied, {rate:.1f} MB/s"
        if result.get("source") == "stored":
            reason = "already in the store: a copy that had just finished"
        self.record("fetched", model=entry.name, node_id=node_id, bytes=result["bytes"], seconds=seconds, source=source, reason=reason)

    async def fetch_weights(self, model: str, node_id: str, background: str | None = None) -> None:
        """The weights into `node_id`'s store: the controller's fetch before an eviction (L1), an
        operator's pull, or with `background` (its reason) a background copy (L4): only from a node
        whose store holds them (never the Hub), removing nothing stored there (a copy that no longer
        fits fails with disk_full), and counted as least recently used until a model server loads
        from it. LoadError when the copy fails (it recorded fetch_failed)."""
        entry = self.entries[model]
        folder = store_folder(entry)
        mine = self.stores.get(node_id)
        if folder is None or mine is None or holds(mine, folder):
            return
        holders = self.holders(folder, but=node_id)
        if holders:
            keep = None if background is None else sorted({*mine.get("complete", {}), *mine.get("unsealed", {}), *self._in_use(node_id)})
            await self._copy(node_id, entry, folder, holders, mine["root"], keep=keep, why=background)
        elif entry.hub and background is None:
            await self._download(node_id, entry, folder)

    def _in_use(self, node_id: str) -> list[str]:
        """The store folders of the instances placed on `node_id` (loading or loaded): never removed
        to make room."""
        folders = {store_folder(self.entries[model]) for model, node in self.actors if node == node_id and model in self.entries}
        return sorted(f for f in folders if f is not None)

    def _removed(self, node_id: str, entry: ManifestEntry, folders: list[str]) -> None:
        for folder in folders:
            owner = next((e.name for e in self.entries.values() if e.folder == folder), None)
            self.record(
                "files_removed", model=owner, node_id=node_id, reason=f"{folder} removed from the store (disk budget) to make room for {entry.name}"
            )
            for key in ("complete", "unsealed"):
                self.stores.get(node_id, {}).get(key, {}).pop(folder, None)

    def fetch_progress(self, model: str, node_id: str) -> str | None:
        """The copy of the model's weights into `node_id`'s store as its agent last reported it, in words."""
        folder = store_folder(self.entries[model]) if model in self.entries else None
        p = self.stores.get(node_id, {}).get("fetching", {}).get(folder) if folder is not None else None
        if not p:
            return None
        total = p.get("total_bytes") or 0
        share = (
            f"{100 * p['done_bytes'] / total:.0f}% ({p['done_bytes'] / 1e6:.0f} of {total / 1e6:.0f} MB)"
            if total
            else f"{p['done_bytes'] / 1e6:.0f} MB"
        )
        eta = f", about {p['eta_s']:.0f} s left" if p.get("eta_s") is not None else ""
        return f"copying from {p.get('source') or '?'}: {share} at {p.get('bytes_per_s', 0) / 1e6:.1f} MB/s{eta}"

    def holders(self, folder: str, but: str | None = None) -> list[str]:
        """Nodes (known to Ray) whose store holds `folder`, by name; `but` left out."""
        return sorted(n for n, s in self.stores.items() if n != but and n in self.ray_node_ids and holds(s, folder))

    async def remove_files(self, node_id: str, folder: str) -> bool:
        agent = get_agent(node_id)
        if agent is None:
            raise OrchardError("node_not_found", f"no node agent on {node_id}", "node")
        result = await agent.remove.remote(folder)
        if not result["removed"] and result["reason"]:
            raise OrchardError("files_in_use", result["reason"], "node")
        if result["removed"] and node_id in self.stores:  # gone from the view now, not at the next report
            for key in ("complete", "unsealed", "partial"):
                self.stores[node_id].get(key, {}).pop(folder, None)
        return bool(result["removed"])

    async def _copy(
        self, node_id: str, entry: ManifestEntry, folder: str, holders: list[str], root: str, keep: list[str] | None = None, why: str | None = None
    ) -> str:
        """Copy `folder` into `node_id`'s store from the first of `holders` that serves it; `why`
        (a background copy's reason) makes it speculative and keeps every folder in `keep`."""
        target, source = get_agent(node_id), get_agent(holders[0])
        if target is None or source is None:
            raise LoadError("error", f"no node agent on {node_id if target is None else holders[0]} to copy {folder}")
        try:
            manifest = await source.manifest.remote(folder)
        except Exception as e:
            raise LoadError("error", f"{holders[0]} could not describe {folder}: {unwrap(e).message}") from e
        total = sum(f["size"] for f in manifest["files"])
        reason = f"copying {folder} from {', '.join(holders)}" + (f" ({why})" if why else "")
        self.record("fetching", model=entry.name, node_id=node_id, bytes=total, reason=reason)
        call = target.fetch.remote(manifest, holders, self.fetch_max_bytes_per_s, self._in_use(node_id) if keep is None else keep, why is not None)
        await self._run_fetch(node_id, entry, call, target, folder, f"copying {folder}", "peer")
        return root

    def stop_instance(self, instance: InstanceRef, reason: str) -> Coroutine[Any, Any, bool]:
        """Stop the instance's current incarnation; True once its process is gone (X1). Its actor
        name is taken now, not when the stop runs: by then the model may be placed there again, as
        a new incarnation."""
        name = self.actors.pop((instance.model, instance.node_id), None)
        return self._stop(instance, name, reason)

    async def _stop(self, instance: InstanceRef, name: str | None, reason: str) -> bool:
        if name is None:
            return True  # no actor was started for it
        found = await asyncio.to_thread(live_actor, name)
        log.info("stopping %s (%s): %s", instance, name, reason)
        try:
            await kill_model_server(name, drain_timeout_s=self.drain_timeout_s, reason=reason)
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


def store_folder(entry: ManifestEntry) -> str | None:
    """The folder name node stores keep the model under (None: stores do not keep it)."""
    return entry.folder


def holds(store: dict, folder: str) -> bool:
    """Whether a node's store report lists the folder as there (sealed or not yet)."""
    return folder in store.get("complete", {}) or folder in store.get("unsealed", {})
