"""What the end-to-end modules share to set up a local Ray cluster and talk to Orchard over HTTP."""

import hashlib
import time

import requests

from cluster.ports import free_port

MIB = 1024**2
# Ray notices a dead node in ~1.5 s instead of ~14 s (shared/ray/README.md)
HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


def node_args(name: str, budget_gib: float, cpus: int) -> dict:
    """cluster_utils node arguments: Orchard's node name and memory budget as labels, a small object store."""
    return {"num_cpus": cpus, "labels": {"orchard.node": name, "orchard.budget_gib": str(budget_gib)}, "object_store_memory": 80 * MIB}


def key_entry(name: str, key: str, role: str = "user", **limits) -> dict:
    """An `api_keys` entry for `key`, given by its SHA-256 as ray-config.yaml may (models, rpm, ... in `limits`)."""
    return {"name": name, "role": role, "key_sha256": hashlib.sha256(key.encode()).hexdigest(), **limits}


def serve_orchard(args: dict) -> str:
    """Orchard (`build_app(args)`) served by Serve on a free loopback port of the connected cluster; its base URL."""
    from ray import serve

    from router.api.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="orchard", route_prefix="/")
    return f"http://127.0.0.1:{port}"


class Http:
    """requests with a base URL, for the cluster routes the openai client does not know. It sends an
    Authorization header as the openai SDK does (a placeholder when the app has no keys): a POST
    without one or a JSON body is refused as a possible cross-site request (router/api/guard.py)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None):
        self.base = base
        self.headers = headers or {"Authorization": "Bearer unused"}

    def get(self, path: str, **kw):
        return requests.get(self.base + path, timeout=120, headers=self.headers, **kw)

    def post(self, path: str, **kw):
        return requests.post(self.base + path, timeout=120, headers=self.headers, **kw)

    def delete(self, path: str, **kw):
        return requests.delete(self.base + path, timeout=120, headers=self.headers, **kw)


def wait_for(condition, timeout_s: float, what: str):
    """The first truthy value of `condition()`, polled every 0.3 s; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
