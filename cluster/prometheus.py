"""A Prometheus server that scrapes every Ray node's metrics (Orchard's `ray_orchard_*` series among
them) through the service-discovery file Ray writes in its temp dir, so the dashboard's Metrics
page and a user's queries have data. Debian's `prometheus` package (the Makefile installs it); on a
Mac, `brew install prometheus`.

    python -m cluster.prometheus start --sd-file /tmp/orchard-<hash>/ray/prom_metrics_service_discovery.json
    python -m cluster.prometheus stop --dir /tmp/orchard-<hash>/prometheus
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

CONFIG = """global:
  scrape_interval: {interval}s
  evaluation_interval: {interval}s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ["{sd_file}"]
        refresh_interval: {interval}s
"""


def binary() -> str | None:
    return shutil.which("prometheus")


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start(sd_file: Path, folder: Path, *, host: str = "127.0.0.1", port: int = 9090, interval_s: int = 5, timeout_s: float = 30.0) -> int:
    """Start Prometheus (config, data and pid under `folder`) and wait until it answers; its pid.
    RuntimeError when the binary is missing or the port is taken."""
    exe = binary()
    if exe is None:
        raise RuntimeError("no prometheus binary on PATH (Debian: apt-get install prometheus; macOS: brew install prometheus)")
    if _listening(host, port):
        raise RuntimeError(f"port {host}:{port} is taken: pass another port for Prometheus")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(CONFIG.format(interval=interval_s, sd_file=sd_file))
    log = open(folder / "prometheus.log", "ab")  # noqa: SIM115 (the server keeps it)
    process = subprocess.Popen(
        [exe, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={host}:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    (folder / "prometheus.json").write_text(json.dumps({"pid": process.pid, "url": f"http://{host}:{port}"}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}: see {folder / 'prometheus.log'}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return process.pid
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"prometheus did not answer on {host}:{port} within {timeout_s:.0f} s")


def stop(folder: Path) -> bool:
    """Stop the Prometheus started under `folder`; whether one was running."""
    state = folder / "prometheus.json"
    if not state.exists():
        return False
    pid = json.loads(state.read_text())["pid"]
    state.unlink()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def query(url: str, expr: str) -> list[dict]:
    """The result vector of an instant query."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        return json.loads(r.read())["data"]["result"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prometheus over a Ray cluster's metrics")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--sd-file", type=Path, required=True)
    s.add_argument("--dir", type=Path, required=True)
    s.add_argument("--port", type=int, default=9090)
    t = sub.add_parser("stop")
    t.add_argument("--dir", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "start":
        try:
            start(a.sd_file, a.dir, port=a.port)
        except RuntimeError as e:
            print(f"cluster.prometheus start: {e}", file=sys.stderr)
            return 1
        print(f"prometheus: http://127.0.0.1:{a.port}")
    else:
        stop(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
