"""One small actor per Ray node that measures that node's memory on request.

Why an actor per node: only a process on the node itself can read its unified memory (and, on a Mac, its
recommended working set from Metal). The agent is detached and named, so the router or the residency
controller, from any process, finds it again by name after a redeploy; it takes no CPU slot (num_cpus=0)
because placement is by memory, Orchard's job, not Ray's.

Node identity comes from Ray node labels (`ray start --labels` or `Cluster.add_node(labels=...)`); in Ray
2.60 `ray.nodes()` entries carry them under "Labels" (with Ray's own "ray.io/node-id" added), and inside a
process `ray.get_runtime_context().get_node_labels()` gives its own node's.
"""

import logging
import os
import shutil
import threading
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import psutil
import ray
from pydantic import Field
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.node_report import NodeReport, StoreReport, gib_to_bytes, read_report
from cluster.store import ENV_STORE, Store, default_root
from cluster.stored import CHUNK_BYTES as CHUNK, StoreError, StoreManifest
from cluster.stream import StreamBroken, StreamOffer, StreamServer, copy_folder
from deployments.wire.counting import CountOrder
from policy._frozen import Frozen
from policy.specs import DEVICE_KINDS, DeviceKind

log = logging.getLogger(__name__)

READ_AHEAD = 4  # chunks a copy through Ray calls keeps in flight (x CHUNK bytes in each node's object store)
OPEN_STREAM_S = 30.0  # the source agent's answer to open_stream

NAMESPACE = "orchard"
# The files an MLX loader reads from a Hub repo (mlx-lm's own download list, plus the other loaders' configs).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
AGENT_PREFIX = "orchard-agent:"
LABEL_NODE = "orchard.node"
LABEL_BUDGET = "orchard.budget_gib"
LABEL_DEVICE = "orchard.device"
LABEL_DISK_BUDGET = "orchard.disk_budget_gib"  # the most the node's model store may hold


class NodeIdentity(Frozen):
    """Who a Ray node is to Orchard, read from its labels."""

    node_id: str = Field(min_length=1)
    ray_node_id: str = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    budget_bytes: int | None = Field(default=None, gt=0)
    device: DeviceKind | None = None


def agent_name(node_id: str) -> str:
    return f"{AGENT_PREFIX}{node_id}"


def identity_from_labels(ray_node_id: str, labels: dict[str, str]) -> NodeIdentity:
    """Parse Orchard's labels. Without orchard.node the name is the Ray node id's first 8 characters, which
    is stable for the node's life but changes on restart: real clusters should name their nodes."""
    name = labels.get(LABEL_NODE) or ray_node_id[:8]
    budget = labels.get(LABEL_BUDGET)
    budget_bytes = None
    if budget not in (None, ""):
        try:
            budget_bytes = gib_to_bytes(float(budget))
        except ValueError as e:
            raise ValueError(f"node {name}: label {LABEL_BUDGET}={budget!r} is not a number") from e
        if budget_bytes <= 0:
            raise ValueError(f"node {name}: label {LABEL_BUDGET}={budget!r} must be positive")
    device = labels.get(LABEL_DEVICE) or None
    if device is not None and device not in DEVICE_KINDS:
        raise ValueError(f"node {name}: label {LABEL_DEVICE}={device!r} is not one of {DEVICE_KINDS}")
    return NodeIdentity(node_id=name, ray_node_id=ray_node_id, labels=dict(labels), budget_bytes=budget_bytes, device=device)


def alive_nodes() -> list[NodeIdentity]:
    """Alive Ray nodes with their Orchard identity, sorted by Ray node id. A node whose labels do not parse,
    or whose Orchard name another alive node already has, is skipped with a warning rather than taking
    the whole cluster view down."""
    seen: dict[str, NodeIdentity] = {}
    for entry in sorted(ray.nodes(), key=lambda e: e["NodeID"]):
        if not entry.get("Alive"):
            continue
        try:
            ident = identity_from_labels(entry["NodeID"], dict(entry.get("Labels") or {}))
        except ValueError as e:
            log.warning("skipping Ray node %s: %s", entry["NodeID"], e)
            continue
        if ident.node_id in seen:
            log.warning(
                "Ray nodes %s and %s are both named %r; using the first",
                seen[ident.node_id].ray_node_id,
                ident.ray_node_id,
                ident.node_id,
            )
            continue
        seen[ident.node_id] = ident
    return list(seen.values())


class _Fetch:
    """One copy into this node's store; every caller asking for the same folder waits on it."""

    def __init__(self, manifest: StoreManifest, sources: list[str]):
        self.manifest = manifest
        self.sources = sources
        self.started = time.time()
        self.done_bytes = 0
        self.source: str | None = None
        self.finished = threading.Event()
        self.result: dict = {}
        self.callers = 1  # fetch calls waiting on this copy
        self.cancels = 0  # ... of which this many asked to cancel it
        self.cancelled = threading.Event()
        self.total_override: int | None = None  # a download's size, known from the Hub before its manifest

    def progress(self) -> dict:
        elapsed = max(1e-6, time.time() - self.started)
        total = self.total_override if self.total_override is not None else self.manifest.total_bytes
        rate = self.done_bytes / elapsed
        return {
            "done_bytes": self.done_bytes,
            "total_bytes": total,
            "source": self.source,
            "bytes_per_s": round(rate),
            "eta_s": round((total - self.done_bytes) / rate, 1) if rate > 0 else None,
        }


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    """Measures its own node and keeps its model store (cluster/store.py): it serves its complete
    folders to peers over a direct stream (cluster/stream.py; in chunks over Ray calls where the stream
    cannot be opened), and copies a folder in from peers' agents. It reads identity from its node's
    labels, so a report always describes the node the agent actually runs on."""

    def __init__(self) -> None:
        ctx = ray.get_runtime_context()
        self._ident = identity_from_labels(ctx.get_node_id(), dict(ctx.get_node_labels()))  # type: ignore[arg-type]  # str values (Ray's annotation says lists)
        disk = self._ident.labels.get(LABEL_DISK_BUDGET)
        budget = gib_to_bytes(float(disk)) if disk else None
        self.store = Store(Path(os.environ.get(ENV_STORE) or default_root()).expanduser(), budget)  # ORCHARD_STORE: the raylet's environment
        self._address = ray.util.get_node_ip_address()  # the node's address as Ray knows it: streams listen there
        self._lock = threading.Lock()
        self._fetches: dict[str, _Fetch] = {}
        self._tokenizers: Any = None  # deployments.engines.prompt_tokens.Tokenizers, made at the first count

    def identity(self) -> dict:
        return self._ident.model_dump()

    def report(self, used_by_orchard_bytes: int = 0) -> dict:
        """A NodeReport measured now, as a dict (plain data crosses process boundaries cheaply and without
        the caller importing this module's classes). used_by_orchard_bytes: what Orchard's instances on
        this node hold, as the caller knows it; it only matters under a declared budget."""
        i = self._ident
        report = read_report(
            i.node_id,
            i.ray_node_id,
            i.labels,
            i.budget_bytes,
            used_by_orchard_bytes=used_by_orchard_bytes,
            device_override=i.device,
        )
        # validated, not put in as the dict it is: a dict in the typed field made pydantic warn on every dump
        return report.model_copy(update={"store": StoreReport.model_validate(self.store_report())}).model_dump(mode="json")

    def store_report(self) -> dict:
        with self._lock:
            fetching = {folder: f.progress() for folder, f in self._fetches.items()}
        return self.store.inventory() | {"fetching": fetching}

    def process_alive(self, pid: int) -> bool:
        """Whether process `pid` still runs on this node: a stopped model server's memory is free only
        once its worker process has exited (the residency controller waits for that, rule X1)."""
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def count_tokens(self, order: CountOrder) -> int:
        """The prompt tokens of `order`'s request by the tokenizer in its folder on this node, with
        no weights loaded (Anthropic's count_tokens for a model no instance of which is ready). Here
        because the agent runs on every node and next to the node's store, where the folder is; it
        keeps the few tokenizers last used (prompt_tokens.Tokenizers). OrchardError:
        files_not_stored when the folder holds no tokenizer here, invalid_request for what the chat
        template refuses."""
        from deployments.engines.prompt_tokens import Tokenizers  # MLX and mlx-lm only in an agent that counts

        with self._lock:
            if self._tokenizers is None:
                self._tokenizers = Tokenizers()
        return self._tokenizers.count(order.model, order.folder, order.request)

    # ---- the source side -------------------------------------------------------------------------
    def manifest(self, folder: str) -> dict:
        """The manifest of a folder this store holds, sealing it first if it came in by hand."""
        return self.store.seal(folder).model_dump(mode="json")

    def read_chunk(self, folder: str, path: str, offset: int) -> bytes:
        return self.store.read(folder, path, offset, CHUNK)

    def open_stream(self, folder: str) -> StreamOffer:
        """A stream of `folder`'s files for one peer: the address it listens on and its one-time ticket
        (this call, authenticated by Ray's token, is how the peer gets it). StoreError(not_found) if
        this store does not hold the folder."""
        return StreamServer(self.store, folder, self._address).offer

    def remove(self, folder: str) -> dict:
        """Remove a stored folder (and its partial copy) unless a copy of it is running now."""
        with self._lock:
            if folder in self._fetches:
                return {"removed": False, "reason": f"{folder} is being copied in"}
            return {"removed": self.store.remove(folder), "reason": ""}

    # ---- the copying side ------------------------------------------------------------------------
    def cancel_fetch(self, folder: str) -> bool:
        """One caller of `fetch` no longer wants the copy: once every caller said so, it stops at its
        next chunk, its partial files kept for a later copy to resume. Whether it was stopped."""
        with self._lock:
            flight = self._fetches.get(folder)
            if flight is None:
                return False
            flight.cancels += 1
            if flight.cancels >= flight.callers:
                flight.cancelled.set()
            return flight.cancelled.is_set()

    def fetch(
        self,
        manifest: dict,
        sources: list[str],
        max_bytes_per_s: float | None = None,
        keep: list[str] | None = None,
        speculative: bool = False,
        lanes: int | None = None,
    ) -> dict:
        """Copy `manifest`'s folder into this store from the first source node (Orchard names) whose
        agent serves it to the end, resuming from the partial files after a source fails. Callers for
        the same folder share one copy. `speculative` (a background copy, rule L4): the folder counts
        as the least recently used one until a model server loads from it. `lanes`: the stream's
        connections at most (this node's cluster.stream.copy_lanes() by default). Returns {"ok": True,
        "bytes", "seconds", "source", "transport", "lanes"} or {"ok": False, "code", "message"}; never
        raises."""
        wanted = StoreManifest.model_validate(manifest)
        existing = self.store.manifest(wanted.folder)
        if existing is not None and existing.files == wanted.files:  # asked from a view older than the last copy
            return {"ok": True, "bytes": 0, "total_bytes": wanted.total_bytes, "seconds": 0.0, "source": "stored", "removed": []}
        with self._lock:
            flight = self._fetches.get(wanted.folder)
            owner = flight is None
            if flight is None:
                flight = self._fetches[wanted.folder] = _Fetch(wanted, list(sources))
            else:
                flight.callers += 1
        if not owner:
            flight.finished.wait()
            return flight.result
        try:
            flight.result = self._with_room(flight, keep, lambda: self._copy(flight, max_bytes_per_s, lanes))
            if speculative and flight.result["ok"]:
                self.store.mark_unused(wanted.folder)
        except Exception as e:  # an I/O error outside the copy's own handling (a store folder that cannot be made)
            flight.result = {"ok": False, "code": "io_error", "message": f"copying {wanted.folder}: {type(e).__name__}: {e}", "removed": []}
        finally:
            with self._lock:
                del self._fetches[wanted.folder]
            flight.finished.set()
        return flight.result

    def hub_fetch(self, repo_id: str, folder: str, total_bytes: int = 0, keep: list[str] | None = None) -> dict:
        """Download a Hub model into this store through huggingface_hub (HF_ENDPOINT, HF_TOKEN and
        HF_HUB_OFFLINE as this node's environment sets them), only the files an MLX loader reads, into
        .partial/<folder> (huggingface_hub resumes its own partial files there); then every file is
        hashed, the manifest written and the folder renamed into place. Callers for the same folder
        share one download. Returns as `fetch` does; never raises."""
        with self._lock:
            flight = self._fetches.get(folder)
            owner = flight is None
            if flight is None:
                placeholder = StoreManifest(folder=folder, files=(), source=f"hub:{repo_id}")
                flight = self._fetches[folder] = _Fetch(placeholder, [f"hub:{repo_id}"])
                flight.source = "hub"
        if not owner:
            flight.finished.wait()
            return flight.result
        try:
            flight.result = self._with_room(flight, keep, lambda: self._download(flight, repo_id, folder), total_bytes)
        finally:
            with self._lock:
                del self._fetches[folder]
            flight.finished.set()
        return flight.result

    def _with_room(self, flight: _Fetch, keep: list[str] | None, work, total_bytes: int | None = None) -> dict:
        """Make room under the disk budget first (least recently used folders not in `keep` nor being
        copied in go), then run the copy; the result names what was removed."""
        with self._lock:
            busy = frozenset(self._fetches) | frozenset(keep or ())
        total = flight.manifest.total_bytes if total_bytes is None else total_bytes
        try:
            removed = self.store.make_room(flight.manifest.folder, total, busy)
        except StoreError as e:
            return {"ok": False, "code": e.code, "message": e.message, "removed": []}
        return work() | {"removed": removed}

    def touch(self, folder: str) -> None:
        """A model server loaded from this folder now (the disk budget's recency)."""
        try:
            self.store.touch(folder)
        except StoreError:
            pass

    def _download(self, flight: _Fetch, repo_id: str, folder: str) -> dict:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.utils import HfHubHTTPError

        partial = self.store.root / ".partial" / folder
        done = threading.Event()

        def watch() -> None:  # huggingface_hub reports no bytes to us: measure the folder as it grows
            while not done.wait(0.5):
                flight.done_bytes = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file()) if partial.is_dir() else 0

        try:
            info = HfApi().model_info(repo_id, files_metadata=True)
            wanted = [s for s in info.siblings or () if any(fnmatch(s.rfilename, pattern) for pattern in HUB_PATTERNS)]
            total = sum(s.size or 0 for s in wanted)
            flight.manifest = flight.manifest.model_copy(update={"revision": info.sha})
            flight.total_override = total
            free = shutil.disk_usage(self.store.root if self.store.root.exists() else self.store.root.parent).free
            if total > free:
                return {"ok": False, "code": "disk_full", "message": f"{repo_id} needs {total} bytes; {free} free in {self.store.root}"}
            partial.mkdir(parents=True, exist_ok=True)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                snapshot_download(repo_id, revision=info.sha, local_dir=partial, allow_patterns=list(HUB_PATTERNS))
            finally:
                done.set()
            manifest = self.store.seal_partial(folder, source=f"hub:{repo_id}", revision=info.sha)
        except OSError as e:
            return {"ok": False, "code": "disk_full" if e.errno == 28 else "io_error", "message": f"downloading {repo_id}: {e}"}
        except (HfHubHTTPError, StoreError, ValueError) as e:
            return {"ok": False, "code": "hub_error", "message": f"downloading {repo_id} from the Hub failed: {e}"}
        except Exception as e:  # the Hub unreachable (httpx errors), offline mode, ...
            return {"ok": False, "code": "hub_error", "message": f"downloading {repo_id} from the Hub failed: {type(e).__name__}: {e}"}
        return {
            "ok": True,
            "bytes": manifest.total_bytes,
            "total_bytes": manifest.total_bytes,
            "seconds": time.time() - flight.started,
            "source": "hub",
            "revision": info.sha,
        }

    def _copy(self, flight: _Fetch, max_bytes_per_s: float | None = None, lanes: int | None = None) -> dict:
        """From each source in turn until one serves the folder to the end: over its direct stream, or
        through Ray calls to its agent when the stream cannot be opened; a source that fails is left
        for the next one, which resumes from the partial files."""
        folder = flight.manifest.folder
        sizes = {f.path: f.size for f in flight.manifest.files}
        tried: list[str] = []
        paced = [time.monotonic()]

        def step(n: int) -> None:
            """Between buffers: stop if nobody waits for the copy; keep to the operator's cap on copies
            (AppArgs.fetch_max_bytes_per_s)."""
            if flight.cancelled.is_set():
                raise StoreError("cancelled", f"the copy of {folder} was cancelled: nobody waits for it")
            if max_bytes_per_s and n:
                flight.cancelled.wait(max(0.0, n / max_bytes_per_s - (time.monotonic() - paced[0])))
            paced[0] = time.monotonic()

        def progress(done: int) -> None:
            flight.done_bytes = done

        for node in flight.sources:
            source = get_agent(node)
            if source is None:
                tried.append(f"{node}: no agent")
                continue
            flight.source = node
            inflight: dict[tuple[str, int], ray.ObjectRef] = {}  # chunks asked for ahead of the one being written

            def read(path: str, offset: int, source=source, inflight=inflight) -> bytes:
                step(0)
                for k in range(READ_AHEAD):  # keep READ_AHEAD chunks in flight: transfer overlaps writing and hashing
                    at = offset + k * CHUNK
                    if at < sizes[path] and (path, at) not in inflight:
                        inflight[(path, at)] = source.read_chunk.remote(folder, path, at)
                chunk = ray.get(inflight.pop((path, offset)), timeout=120)
                step(len(chunk))
                return chunk

            offer: StreamOffer | None = None
            why = ""
            try:
                offer = ray.get(source.open_stream.remote(folder), timeout=OPEN_STREAM_S)
            except StoreError as e:
                tried.append(f"{node}: {e.message}")  # that source lacks it; try the next
                continue
            except (ray.exceptions.RayError, TimeoutError) as e:  # Ray calls are the way, if any is
                why = f"open_stream: {type(e).__name__}"
            try:
                copied = copy_folder(self.store, flight.manifest, offer, read, step, progress, why, lanes)
            except StoreError as e:
                if e.code in ("checksum", "disk_full", "io_error", "bad_request", "cancelled"):
                    return {"ok": False, "code": e.code, "message": e.message}
                tried.append(f"{node}: {e.message}")  # not_found: that source lacks it; try the next
                continue
            except (ray.exceptions.RayError, TimeoutError, StreamBroken) as e:  # the source died or stalled: resume elsewhere
                tried.append(f"{node}: {type(e).__name__}: {e}")
                continue
            result = {
                "ok": True,
                "bytes": copied.bytes,
                "total_bytes": flight.manifest.total_bytes,
                "seconds": time.time() - flight.started,
                "source": node,
                "transport": copied.transport,
                "lanes": copied.lanes,
            }
            return result | ({"fallback": copied.fallback} if copied.transport == "ray" else {})
        return {"ok": False, "code": "source_gone", "message": f"no source could serve {folder} ({'; '.join(tried) or 'no sources'})"}

    def __repr__(self) -> str:
        return f"NodeAgent({self._ident.node_id})"


def _start_agent(ident: NodeIdentity):
    return NodeAgent.options(  # type: ignore[attr-defined]  # @ray.remote made it an ActorClass; mypy keeps the class
        name=agent_name(ident.node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,  # two callers racing end up with the same agent
        max_concurrency=8,  # a thread pool: reports and chunk reads go on during a copy
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ident.ray_node_id, soft=False),
    ).remote()


def get_agent(node_id: str):
    """The named agent of a node, or None if there is none."""
    try:
        return ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
    except ValueError:
        return None


def ensure_agents(timeout_s: float = 30.0) -> dict[str, "ray.actor.ActorHandle"]:
    """One agent per alive node, started where missing; returns {Orchard node name: handle}.

    Every agent answers `identity()` before this returns, so a returned handle is live and on the right
    node. An agent found by name but dead, unresponsive or on another Ray node (the node restarted under
    the same Orchard name) is killed and started again. Call it from the driver or a Serve replica
    (anywhere ray is initialised); it is idempotent and costs one round trip per agent when all exist.
    """
    if not ray.is_initialized():
        raise RuntimeError("ensure_agents needs a connected Ray (ray.init or a Ray worker)")
    deadline = time.monotonic() + timeout_s
    nodes = alive_nodes()
    handles = {n.node_id: get_agent(n.node_id) or _start_agent(n) for n in nodes}
    pending = {n.node_id: handles[n.node_id].identity.remote() for n in nodes}
    restarted: set[str] = set()
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
        by_ref = {ref: node_id for node_id, ref in pending.items()}
        for ref in ready:
            node_id = by_ref[ref]
            want = next(n for n in nodes if n.node_id == node_id)
            try:
                got = ray.get(ref).get("ray_node_id")
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:
                got = f"unreachable ({type(e).__name__})"
            if got == want.ray_node_id:
                del pending[node_id]
                continue
            if node_id in restarted:
                raise RuntimeError(f"agent for node {node_id} is {got}, expected Ray node {want.ray_node_id}")
            log.warning("agent for %s is %s, not on Ray node %s: restarting it", node_id, got, want.ray_node_id)
            restarted.add(node_id)
            ray.kill(handles[node_id], no_restart=True)
            handles[node_id] = _restart(want, deadline)
            pending[node_id] = handles[node_id].identity.remote()
        if pending and time.monotonic() >= deadline:
            raise TimeoutError(f"node agents did not answer within {timeout_s} s: {sorted(pending)}")
    return handles


def _restart(ident: NodeIdentity, deadline: float):
    """After ray.kill the name is freed asynchronously; get_if_exists could return the dying actor, so wait
    until the name is gone first."""
    while get_agent(ident.node_id) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return _start_agent(ident)


def collect_reports(agents: dict, used_by_orchard_bytes: dict[str, int] | None = None, timeout_s: float = 10.0) -> dict[str, NodeReport]:
    """Ask every agent at once; nodes that do not answer in time (or died) are left out, which the caller
    reads as 'no report from that node now'."""
    used = used_by_orchard_bytes or {}
    refs = {node_id: h.report.remote(used.get(node_id, 0)) for node_id, h in agents.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    out: dict[str, NodeReport] = {}
    for node_id, ref in refs.items():
        if ref not in ready_set:
            continue
        try:
            out[node_id] = NodeReport.model_validate(ray.get(ref))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:
            log.warning("no report from node %s: %s", node_id, type(e).__name__)
    return out
