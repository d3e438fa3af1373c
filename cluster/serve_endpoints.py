"""Where a client reaches the API: the address Serve's HTTP servers bind (http_options.host: the
proxy's and, under Serve's direct ingress, each ingress replica's own port alike), the nodes' host
names a client may use, and the HTTP address each ingress replica serves itself under direct ingress
(RAY_SERVE_ENABLE_DIRECT_INGRESS, cluster/environment.py's SERVE_ENV), without the proxy's hop. Read from
the Serve controller (its HTTP options; its instance details, the same record the dashboard's
`GET /api/serve/applications/` shows: target groups, and the replicas' nodes) and Ray's node table."""

import asyncio
import logging
import socket
from typing import Any

import ray

from cluster.node_agent import alive_nodes
from cluster.ray_api import serve_controller

log = logging.getLogger(__name__)


def direct_urls(details: dict[str, Any], app: str, http_host: str, names: dict[str, str]) -> list[dict[str, str]]:
    """[{node_id, url}] of `app`'s direct-ingress HTTP targets in `details` (a ServeInstanceDetails
    dict), by Orchard node name (`names`: Ray node id -> name, of the alive nodes: a replica on any
    other node is gone or going). A replica listens on http_options' host: that host, unless it
    listens on every address (then the node's own IP)."""
    replicas = {
        r["actor_name"]: names[r["node_id"]]
        for d in details.get("applications", {}).get(app, {}).get("deployments", {}).values()
        for r in d.get("replicas", [])
        if r.get("actor_name") and r.get("node_id") in names
    }
    out = []
    for group in details.get("target_groups", []):
        if group.get("protocol") != "HTTP" or group.get("app_name") != app:
            continue
        for t in group.get("targets", []):
            if t.get("name") not in replicas:  # a proxy's target (no replica serves directly yet)
                continue
            host = t["ip"] if http_host in ("0.0.0.0", "", "::") else http_host
            out.append({"node_id": replicas[t["name"]], "url": f"http://{host}:{t['port']}"})
    return sorted(out, key=lambda e: e["node_id"])


async def direct_ingress(app: str) -> list[dict[str, str]]:
    """The direct addresses of `app`'s ingress replicas now ([] when direct ingress is off, or when
    Serve cannot say: the cluster view must not fail for want of this list, as while a node dies)."""
    try:
        controller = serve_controller()
        details = await controller.get_serve_instance_details.remote()
        names = {n.ray_node_id: n.node_id for n in await asyncio.to_thread(alive_nodes)}
    except Exception as e:  # the controller restarting, or a replica's record half gone
        log.warning("Serve's instance details are unavailable: %s: %s", type(e).__name__, e)
        return []
    host = (details.get("http_options") or {}).get("host", "127.0.0.1")
    return direct_urls(details, app, host, names)


def serve_http_host() -> str | None:
    """The host the running Serve instance's HTTP servers bind (the proxy and every replica's direct
    ingress take it from the same http_options), or None when no Serve controller runs (then
    `serve.run` starts one on Serve's default, 127.0.0.1)."""
    if not ray.is_initialized():
        return None
    try:
        controller = serve_controller()
    except ValueError:
        return None
    options: Any = ray.get(controller.get_http_config.remote())  # Serve's HTTPOptions
    return str(options.host)


def node_host_names() -> frozenset[str]:
    """The host names of this machine and of the cluster's alive nodes (as Ray reports them), each
    with and without mDNS's `.local`: the names a client of a cluster of Macs reaches them by."""
    names = {socket.gethostname()}
    if ray.is_initialized():
        try:
            names |= {n["NodeManagerHostname"] for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerHostname")}
        except Exception as e:  # the GCS restarting: this machine's name still serves
            log.warning("Ray's node table is unavailable: %s: %s", type(e).__name__, e)
    out: set[str] = set()
    for name in names:
        bare = name.lower().rstrip(".").removesuffix(".local")
        out |= {bare, f"{bare}.local"}
    return frozenset(out)
