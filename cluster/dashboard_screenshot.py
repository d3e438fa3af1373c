"""A screenshot of the Ray dashboard's Actors view with Orchard's model servers in it, for README.

    python -m cluster.dashboard_screenshot [--out docs/img/dashboard-actors.png]

Starts a local 2-node cluster of its own (free ports, a temp dir of its own), serves Orchard on it,
loads two models, unloads one (so a DEAD row shows how an unloaded instance ended), then asks
headless Chromium (Debian's `chromium`) for a PNG of the Actors view, and stops everything it started.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from cluster import local

ROOT = Path(__file__).resolve().parent.parent


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no chromium on PATH: apt-get install chromium (Debian) to take the screenshot")


def screenshot(url: str, out: Path, *, width: int = 1600, height: int = 1500, wait_ms: int = 15000) -> None:
    """A PNG of `url` from headless Chromium, after `wait_ms` of (virtual) time for the page's scripts."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                _chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def _ok(response: requests.Response) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.url}: {response.status_code} {response.text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard-actors.png")
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    args = parser.parse_args(argv)
    _chromium()  # fail before starting anything
    temp_root = Path(tempfile.mkdtemp(prefix="orch-shot-", dir="/tmp"))
    dashboard_port, http_port = local.free_port(), local.free_port()
    state = local.start(
        local.parse_nodes("head:1.5,mac-1:0.8"), temp_root=temp_root, port=local.free_port(), dashboard_port=dashboard_port, http_port=http_port
    )
    try:
        os.environ.update(local.ray_env(temp_root))
        import ray
        from ray import serve

        from router.api.builder import build_app

        ray.init(address=state["address"], log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        (app,) = yaml.safe_load((ROOT / "ray-config.yaml").read_text())["applications"]  # what `make run` serves
        serve.run(build_app(app["args"] | {"models_dir": str(args.models_dir), "watch_period_s": 0.5}), name="orchard", route_prefix="/")
        base = f"http://127.0.0.1:{http_port}"
        for model, node in (("llama-10m", "mac-1"), ("all-minilm-l6-v2", "head"), ("smollm2-135m-instruct", "head")):
            _ok(requests.post(f"{base}/v1/models/{model}/load", json={"node": node}, timeout=300))
        _ok(requests.post(f"{base}/v1/models/all-minilm-l6-v2/unload", json={}, timeout=60))
        time.sleep(3)  # the unloaded server ends itself; the dashboard polls the GCS
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(f"http://127.0.0.1:{dashboard_port}/#/actors", args.out)
        print(f"wrote {args.out}")
        serve.shutdown()
    except Exception as e:  # said before the cluster goes: Ray aborts a driver whose GCS is gone
        print(f"failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        local.stop(temp_root)
        shutil.rmtree(temp_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
