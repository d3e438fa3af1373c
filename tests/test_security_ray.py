"""Issue 25 item 8: Ray with authentication, listening on loopback only, on the local cluster `make run`
starts (`python -m cluster.local start`, then a driver with `cluster.local env`, as the Makefile runs
`serve run`), with a small Serve app on it so Serve's proxy, direct-ingress ports and replicas listen too.

- Ray's token auth: the GCS and the dashboard refuse a call without the token or with a wrong one;
- every listener of the cluster's processes is on loopback, except the one Ray 2.60 binds to all
  interfaces whatever the settings (each Serve replica's inter-deployment gRPC server, `[::]:0` in
  ray/serve/_private/replica.py), and that one refuses a call without the token before it unpickles
  anything: a pickle that would create a file does not;
- the token is in no log, no output, no command line and no process environment."""

import ipaddress
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from cluster import environment, local, ports

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

ROOT = Path(__file__).resolve().parent.parent

APP = """
import sys
import ray
from ray import serve

ray.init(log_to_driver=False)  # RAY_ADDRESS and the rest from `cluster.local env`

@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class Echo:
    async def __call__(self, request):
        return "ok"

serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
serve.run(Echo.bind(), name="echo", route_prefix="/")
"""


class _CreatesFile:
    """Unpickled, it creates `path`: what anyone could run on a replica without Ray's auth."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def demo():
    temp_root = Path(tempfile.mkdtemp(prefix="orch-sec-", dir="/tmp"))
    port, dashboard_port, http_port, ingress = (ports.free_port() for _ in range(4))
    args = [
        "--port",
        str(port),
        "--dashboard-port",
        str(dashboard_port),
        "--http-port",
        str(http_port),
        "--ingress-port",
        str(ingress),
        "--head-cpus",
        "1",
    ]
    cmd = [sys.executable, "-m", "cluster.local", "--dir", str(temp_root)]
    t0 = time.monotonic()
    try:
        up = subprocess.run(
            [*cmd, "start", "--nodes", "head:1,mac-1:1", *args, "--stores", str(temp_root / "stores")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        words = subprocess.run([*cmd, "env"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"} | dict(w.split("=", 1) for w in words)
        driver = subprocess.run([sys.executable, "-c", APP, str(http_port)], env=env, capture_output=True, text=True, timeout=180)
        assert driver.returncode == 0, driver.stdout + driver.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/", timeout=30) as r:
            assert r.read() == b"ok"
        print(f"local cluster with Serve up in {time.monotonic() - t0:.1f} s")
        yield {
            "temp_root": temp_root,
            "address": f"127.0.0.1:{port}",
            "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "token": environment.token_path(temp_root).read_text(),
            "outputs": [up.stdout, up.stderr, driver.stdout, driver.stderr, " ".join(words)],
        }
    finally:
        down = subprocess.run([*cmd, "stop"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        shutil.rmtree(temp_root, ignore_errors=True)
        assert down.returncode == 0, down.stdout + down.stderr


def _processes(temp_root: Path) -> dict[int, psutil.Process]:
    state = local.read_state(temp_root)
    procs, _ = local._members(temp_root, [n["pid"] for n in state["nodes"]])
    return procs


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _listeners(procs: dict[int, psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP listener of these processes."""
    out = []
    for pid, p in procs.items():
        try:
            name = " ".join(p.cmdline())[:60] or p.name()
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        out += [(pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token is not None else []


def test_gcs_and_dashboard_need_the_token(demo):
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(demo["address"]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        for token in (None, "0" * 64, demo["token"][:-1]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=_metadata(token), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=_metadata(demo["token"]), timeout=10)
        assert reply.cluster_id
    for token in (None, "0" * 64):
        request = urllib.request.Request(demo["dashboard"] + "/api/v0/nodes", headers=dict(_metadata(token)))
        with pytest.raises(urllib.error.HTTPError) as refused_http:
            urllib.request.urlopen(request, timeout=30)
        assert refused_http.value.code in (401, 403)  # no token, a wrong one
    request = urllib.request.Request(demo["dashboard"] + "/api/v0/nodes", headers={"Authorization": f"Bearer {demo['token']}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert len(json.load(r)["data"]["result"]["result"]) == 2


def test_everything_listens_on_loopback_but_replica_grpc_which_needs_the_token(demo, tmp_path):
    from ray.serve.generated import serve_pb2

    procs = _processes(demo["temp_root"])
    listeners = _listeners(procs)
    ports = {port for *_, port in listeners}
    assert int(demo["address"].rsplit(":", 1)[1]) in ports and int(demo["dashboard"].rsplit(":", 1)[1]) in ports
    assert len(listeners) >= 20, listeners  # GCS, 2 raylets x2, agents, dashboard, proxy, replicas, workers
    replicas = {pid for pid, p in procs.items() if "ServeReplica" in " ".join(p.cmdline())}
    assert len(replicas) == 2
    wide = [entry for entry in listeners if not _is_loopback(entry[2])]
    # The one exception: each replica's inter-deployment gRPC server, bound to [::]:0 by Ray Serve itself
    assert sorted(pid for pid, *_ in wide) == sorted(replicas), wide
    assert all(ip in ("::", "0.0.0.0") for _, _, ip, _ in wide), wide
    marker = tmp_path / "ran"
    request = serve_pb2.ASGIRequest(pickled_request_metadata=pickle.dumps(_CreatesFile(marker)))
    for _, _, _, port in wide:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                "/ray.serve.ASGIService/HandleRequest",
                request_serializer=serve_pb2.ASGIRequest.SerializeToString,
                response_deserializer=serve_pb2.ASGIResponse.FromString,
            )
            for token in (None, "0" * 64):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, metadata=_metadata(token), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    assert not marker.exists(), "a replica unpickled a request that had no token"


def test_the_token_is_in_no_log_output_command_line_or_environment(demo):
    token = demo["token"]
    temp_root = demo["temp_root"]
    token_file = environment.token_path(temp_root)
    assert len(token) == 64 and token_file.stat().st_mode & 0o777 == 0o600
    assert "RAY_AUTH_TOKEN_PATH=" + str(token_file) in demo["outputs"][0]  # `connect with:` names the file
    assert not any(token in text for text in demo["outputs"])
    files = [p for p in temp_root.rglob("*") if p.is_file() and not p.is_symlink() and p != token_file and "stores" not in p.parts]
    assert len([p for p in files if p.suffix in (".log", ".out", ".err")]) >= 10
    assert not [p for p in files if token.encode() in p.read_bytes()]
    seen = 0
    for p in _processes(temp_root).values():
        try:
            cmdline, environ = " ".join(p.cmdline()), p.environ()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        assert token not in cmdline and token not in " ".join(environ.values())
        if environ:  # empty for a process that is exiting
            assert "RAY_AUTH_TOKEN" not in environ and environ.get("RAY_AUTH_TOKEN_PATH") == str(token_file), cmdline
            seen += 1
    assert seen >= 10
