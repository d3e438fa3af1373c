"""What the console reads from Ray itself, in the ingress's process: where the Ray dashboard is (to
link each instance to its actor there) and the actors' ids (the dashboard's links name actors by id,
the cluster view by name)."""

import asyncio
import logging
from urllib.parse import urlsplit

import ray

from cluster.ray_api import NAMESPACE, actor_id, dashboard_address

log = logging.getLogger("orchard.console")

_IDS: dict[str, str] = {}  # actor name -> id; a name placed again gets a new incarnation suffix, so a name keeps its id


def dashboard_url(configured: str | None, request_host: str | None) -> str | None:
    """The dashboard's base URL: the configured one (ray-config.yaml args.dashboard_url), else the
    address the dashboard records in the GCS, with an address that listens everywhere (0.0.0.0) read
    as the host the browser reached this page by. None when there is no dashboard."""
    if configured:
        return configured.rstrip("/")
    try:
        address = dashboard_address()
    except Exception as e:  # the GCS restarting: the page works without the links
        log.warning("the Ray dashboard's address is unavailable: %s: %s", type(e).__name__, e)
        return None
    if not address:
        return None
    if "://" not in address:
        address = "http://" + address
    parts = urlsplit(address)
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::", "") and request_host:
        host = urlsplit("//" + request_host).hostname or host
    return f"{parts.scheme}://{host}:{parts.port or 8265}"


def _actor_ids(names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        if name in _IDS:
            out[name] = _IDS[name]
            continue
        try:
            out[name] = _IDS[name] = actor_id(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # gone since the view was taken
            continue
    return out


async def actor_ids(names: list[str]) -> dict[str, str]:
    """Ray actor ids of the named model servers that are alive (GCS lookups, off the event loop)."""
    if all(n in _IDS for n in names):
        return {n: _IDS[n] for n in names}
    return await asyncio.to_thread(_actor_ids, names)
