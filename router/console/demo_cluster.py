"""A cluster like `make run`'s for the screenshot tools: cluster.local's nodes (the head's store is the
prepared models folder, the others' empty), the Ray dashboard, and ray-config.yaml's app served on it,
on free ports and a temp dir of its own so that it runs beside a `make run`; everything it started is
stopped when the block ends. Also the headless Chromium both tools drive (Debian's `chromium`, through
Playwright, never a browser Playwright downloads)."""

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from cluster import environment, local, ports

ROOT = Path(__file__).resolve().parent.parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MAKE_RUN_NODES = "head:1.5,mac-1:0.8,mac-2:0.6"  # the Makefile's NODES


@dataclass
class Demo:
    base: str  # the Serve proxy's URL
    dashboard: str  # the Ray dashboard's URL
    temp_root: Path

    def ray_token(self) -> str:
        """Ray's token for this cluster (the dashboard asks for it); read from its 0600 file, never printed."""
        return Path(environment.ray_env(self.temp_root)["RAY_AUTH_TOKEN_PATH"]).read_text().strip()

    def post(self, path: str, body: dict | None = None) -> dict[str, Any]:
        r = requests.post(self.base + path, json=body or {}, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text}")
        return r.json()

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        r = requests.get(self.base + path, params=params, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path}: {r.status_code} {r.text}")
        return r.json()

    def when_placeable(self, model: str, node: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The what-if answer for loading `model` on `node`, once it is a placement (young instances
        stand in the way for min_residency_s after a load)."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.get("/v1/cluster/what-if", model=model, node=node)
            if answer["decision"]["decision"] == "place" or time.monotonic() > deadline:
                return answer
            time.sleep(0.5)


def chromium() -> str:
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"no {CHROMIUM}: apt-get install chromium (Debian; the Makefile's APT_PACKAGES) to take screenshots")
    return CHROMIUM


@contextlib.contextmanager
def demo(models_dir: Path, nodes: str = MAKE_RUN_NODES) -> Iterator[Demo]:
    """`make run`'s cluster and app on free ports (Ray's token auth on, as there), stopped at the end."""
    temp_root = Path(tempfile.mkdtemp(prefix="orch-shot-", dir="/tmp"))
    dashboard_port, http_port = ports.free_port(), ports.free_port()
    state = local.start(
        local.parse_nodes(nodes),
        temp_root=temp_root,
        port=ports.free_port(),
        dashboard_port=dashboard_port,
        http_port=http_port,
        ingress_port=ports.free_port(),
        stores=temp_root / "stores",
        head_store=models_dir,
    )
    try:
        os.environ.update(environment.ray_env(temp_root))
        import ray
        from ray import serve

        from router.api.builder import build_app

        ray.init(address=state["address"], log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="EveryNode")
        (app,) = yaml.safe_load((ROOT / "ray-config.yaml").read_text())["applications"]  # what `make run` serves
        serve.run(build_app(app["args"] | {"models_dir": str(models_dir), "watch_period_s": 0.5}), name="orchard", route_prefix="/")
        yield Demo(base=f"http://127.0.0.1:{http_port}", dashboard=f"http://127.0.0.1:{dashboard_port}", temp_root=temp_root)
        serve.shutdown()
    except Exception as e:  # said before the cluster goes: Ray aborts a driver whose GCS is gone
        print(f"failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        local.stop(temp_root)
        shutil.rmtree(temp_root, ignore_errors=True)
