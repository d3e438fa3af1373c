"""Creating, finding and removing model-server actors.

Each loaded model instance is a detached, named Ray actor ("orchard:<model>@<node_id>#<incarnation>",
namespace "orchard") pinned to one node by a hard node affinity: Apple GPUs are not a Ray resource, so
the node is Orchard's policy's choice, not Ray's. Detached, so a router redeploy does not kill loaded
models, and named, so a new router finds them again (find_model_servers). Every placement is a new
incarnation with a name of its own: a model placed again on a node right after it left never
reaches the actor that is still stopping under the old name. A spare (rule R1: a model server
started ahead of demand, "orchard:@<node_id>#<incarnation>") keeps its name when it takes a model:
the residency service knows which model each actor holds, and `health()` says it."""

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from cluster.ray_api import NAMESPACE, all_actor_records
from deployments.manifest import ManifestEntry
from deployments.model_server import model_server_options, remote_model_server
from deployments.wire.reports import HealthReport

PREFIX = "orchard:"


def actor_name(model: str, node_id: str, incarnation: str | None = None) -> str:
    return f"{PREFIX}{model}@{node_id}" + (f"#{incarnation}" if incarnation else "")


def new_incarnation() -> str:
    return uuid.uuid4().hex[:8]


def spare_name(node_id: str, incarnation: str) -> str:
    """A spare's actor name (rule R1): no model in it, since the spare learns its model later; the
    name stays when it takes one (Ray cannot rename an actor), and the residency service knows which."""
    return f"{PREFIX}@{node_id}#{incarnation}"


def parse_spare_name(name: str) -> str | None:
    """The node of a spare's actor name (`spare_name`); None for another name."""
    if not name.startswith(PREFIX + "@"):
        return None
    node_id, hashed, incarnation = name[len(PREFIX) + 1 :].partition("#")
    return node_id if node_id and hashed and incarnation else None


def parse_actor_name(name: str) -> tuple[str, str, str | None] | None:
    """(model, node_id, incarnation) of a model server's actor name; None for another name (a
    spare's too: `parse_spare_name`)."""
    if not name.startswith(PREFIX):
        return None
    rest, _, incarnation = name[len(PREFIX) :].partition("#")
    model, at, node_id = rest.rpartition("@")
    if not at or not model or not node_id:
        return None
    return model, node_id, incarnation or None


def _entry(model: ManifestEntry | dict | tuple[str, str, str]) -> ManifestEntry:
    """A manifest entry, or (kind, name, path) for a folder outside any manifest (path absolute)."""
    if isinstance(model, ManifestEntry):
        return model
    if isinstance(model, dict):
        return ManifestEntry.model_validate(model)
    kind, name, path = model
    return ManifestEntry(name=name, kind=kind, path=str(path), weight_bytes=0, weights="real", architecture="unknown", source=str(path))


def create_model_server(
    model: ManifestEntry | dict | tuple[str, str, str],
    node_id: str,
    *,
    ray_node_id: str,
    models_dir: str | Path | None = None,
    options: dict[str, Any] | None = None,
    ray_options: dict[str, Any] | None = None,
    incarnation: str | None = None,
    name: str | None = None,
) -> ActorHandle:
    """Start the model server of `model` on the Ray node `ray_node_id` (hard affinity), named after
    Orchard's `node_id`. The engine is not loaded yet: call `load`. `models_dir` is where the
    entry's relative path lives on that node; `options` go to ModelServer (engine_options,
    coalesce_tokens, coalesce_ms); `ray_options` override the actor options (max_concurrency,
    runtime_env, ...). `name`: the actor's name when it is not the model's own (a spare's that died
    before it took the model, R1). Raises ValueError if that name is taken (the model already runs there)."""
    entry = _entry(model)
    if not Path(entry.path).is_absolute() and models_dir is None:
        raise ValueError(f"{entry.name}: give models_dir for the relative path {entry.path!r}")
    opts = model_server_options(ray_node_id=ray_node_id, name=name or actor_name(entry.name, node_id, incarnation), namespace=NAMESPACE)
    opts.update(ray_options or {})
    return remote_model_server().options(**opts).remote(entry, str(models_dir or "/"), node_id, **(options or {}))


def create_spare(
    node_id: str, *, ray_node_id: str, incarnation: str, models_dir: str | Path = "/", options: dict[str, Any] | None = None
) -> ActorHandle:
    """Start a spare model server on the Ray node (rule R1): imports done and device set up during
    its creation, no model; `take` gives it one. `options`: ModelServer's (coalescing)."""
    opts = model_server_options(ray_node_id=ray_node_id, name=spare_name(node_id, incarnation), namespace=NAMESPACE)
    return remote_model_server().options(**opts).remote(None, str(models_dir), node_id, **(options or {}))


def find_model_servers() -> list[tuple[str, ActorHandle]]:
    """Live model servers, (name, handle) sorted by name. Works without the dashboard (GCS call)."""
    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != NAMESPACE or not actor["name"].startswith(PREFIX):
            continue
        try:
            found.append((actor["name"], ray.get_actor(actor["name"], namespace=NAMESPACE)))
        except ValueError:  # died between the listing and the lookup
            continue
    return sorted(found, key=lambda pair: pair[0])


def find_model_server(model: str, node_id: str) -> ActorHandle:
    """The live incarnation of `model` on `node_id` (ValueError if none): for tools and tests that
    know the model and the node, not the incarnation."""
    names = live_model_server_names()
    for name in names:
        parsed = parse_actor_name(name)
        if parsed is not None and parsed[:2] == (model, node_id):
            return ray.get_actor(name, namespace=NAMESPACE)
    for name in names:  # a spare that took the model (R1) keeps its own name: ask it
        if parse_spare_name(name) == node_id:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                health = HealthReport.model_validate(ray.get(handle.health.remote(), timeout=10))
                if health.model == model:
                    return handle
            except Exception:  # gone, or busy past the timeout
                continue
    raise ValueError(f"no live model server for {model} on {node_id}")


def live_model_server_names() -> list[str]:
    """Names of the model servers Ray lists as alive (one GCS call; a dead detached actor's name is
    gone from the list)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX)]


def death_cause(name: str, seen: str | None = None) -> str:
    """Why the actor `name` ended, as Ray records it (the GCS's actor table: no dashboard needed),
    else what the caller saw, else that Ray lists it no more."""
    try:
        from google.protobuf.json_format import MessageToDict

        ended = [a for a in all_actor_records().values() if a.get("Name") == name and a.get("State") == "DEAD"]
    except Exception:
        ended = []
    for actor in sorted(ended, key=lambda a: a.get("EndTime") or 0, reverse=True):
        cause = MessageToDict(actor["DeathCause"]) if actor.get("DeathCause") is not None else {}
        for context in cause.values():
            message = context.get("errorMessage") if isinstance(context, dict) else None
            if message:
                return f"its actor died: {message.strip()[:500]}"
    return f"its actor died: {seen}" if seen else f"its actor {name} is gone (Ray lists it no more)"


def _name_taken(name: str) -> bool:
    return any(a["namespace"] == NAMESPACE and a["name"] == name for a in ray.util.list_named_actors(all_namespaces=True))


async def _ask(ref: ray.ObjectRef, timeout_s: float) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


async def kill_model_server(
    server: ActorHandle | str,
    drain_timeout_s: float = 30.0,
    *,
    reason: str = "stopped",
    stop_timeout_s: float = 10.0,
    free_timeout_s: float = 10.0,
) -> int | None:
    """Drain (wait up to drain_timeout_s for running requests), stop the engine (streams still
    running end with engine_stopped instead of a dead actor), then let the actor end itself with
    `reason` in its log (ray.actor.exit_actor: the dashboard reads an intended exit, not a kill),
    with ray.kill(no_restart=True) only when it does not, and wait until the name is free.
    Returns how many requests still ran at the end; None if the server was already gone. Async:
    the router calls it from its event loop and a drain takes seconds."""
    name = server if isinstance(server, str) else None
    if isinstance(server, str):
        try:
            handle = ray.get_actor(server, namespace=NAMESPACE)
        except ValueError:
            return None
    else:
        handle = server
    left = None
    try:
        if name is None:
            name = (await _ask(handle.health.remote(), stop_timeout_s)).actor_name
        left = await _ask(handle.drain.remote(drain_timeout_s), drain_timeout_s + stop_timeout_s)
        await _ask(handle.stop.remote(reason), stop_timeout_s)
        await _ask(handle.exit.remote(reason), stop_timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        if left is None:
            return None  # died on its own; a detached actor's name frees itself
    except (TimeoutError, ray.exceptions.RayTaskError):
        pass  # hung or failing: kill it anyway
    if not name or not await _name_freed(name, free_timeout_s / 2):  # it did not end itself
        ray.kill(handle, no_restart=True)
        if name:
            await _name_freed(name, free_timeout_s / 2)
    return left


async def _name_freed(name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _name_taken(name):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
