"""Node reports and agents: the measure arithmetic (pure), one agent per node on a real 3-node Ray cluster
(ray.cluster_utils), and the local launcher's start/status/stop.

Ray settings from ../shared/ray/README.md: token auth (conftest.py's session token) and 127.0.0.1 kept as
is, both set before ray is imported; a private RAY_TMPDIR; fast health checks so a removed node reads dead in ~1.5 s, not ~14 s."""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster import environment, local, ports
from cluster.node_agent import (
    NAMESPACE,
    NodeAgent,
    agent_name,
    alive_nodes,
    collect_reports,
    ensure_agents,
    get_agent,
    identity_from_labels,
)
from cluster.node_report import GIB, NodeReport, Readings, measure, probe, read_report

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def readings(device_info=None, total=32 * GIB, available=20 * GIB, limit=0, platform="linux", cpu="Test CPU"):
    return Readings(platform=platform, device_info=device_info or {}, ram_total=total, ram_available=available, mlx_memory_limit=limit, cpu_model=cpu)


MAC = {"architecture": "applegpu_g14d", "device_name": "Apple M2 Ultra", "memory_size": 64 * GIB, "max_recommended_working_set_size": 48 * GIB}
CUDA = {"architecture": "sm_90", "device_name": "NVIDIA H100", "total_memory": 80 * GIB, "free_memory": 70 * GIB}


# ---- pure arithmetic ---------------------------------------------------------------------------------


def test_mac_uses_recommended_working_set_and_available_ram():
    m = measure(None, readings(MAC, total=64 * GIB, available=40 * GIB, platform="darwin"))
    assert m.devices == ("metal", "cpu")
    assert m.chip == "Apple M2 Ultra"
    assert (m.total_bytes, m.usable_bytes, m.free_bytes, m.budget_bytes) == (64 * GIB, 48 * GIB, 40 * GIB, None)


def test_mac_budget_caps_usable_and_free_minus_orchard_use():
    m = measure(16 * GIB, readings(MAC, available=40 * GIB, platform="darwin"), used_by_orchard_bytes=5 * GIB)
    assert (m.total_bytes, m.usable_bytes, m.free_bytes, m.budget_bytes) == (64 * GIB, 16 * GIB, 11 * GIB, 16 * GIB)


def test_cuda_pool_is_the_accelerator_memory():
    m = measure(None, readings(CUDA, total=512 * GIB, available=400 * GIB))
    assert m.devices == ("cuda", "cpu")
    assert (m.total_bytes, m.usable_bytes, m.free_bytes) == (80 * GIB, 80 * GIB, 70 * GIB)
    b = measure(20 * GIB, readings(CUDA), used_by_orchard_bytes=4 * GIB)
    assert (b.usable_bytes, b.free_bytes) == (20 * GIB, 16 * GIB)


def test_linux_cpu_uses_psutil_and_mlx_memory_limit():
    m = measure(None, readings({}, total=24 * GIB, available=20 * GIB, limit=int(0.8 * 24 * GIB)))
    assert m.devices == ("cpu",)
    assert m.chip == "Test CPU"
    assert (m.total_bytes, m.usable_bytes, m.free_bytes) == (24 * GIB, int(0.8 * 24 * GIB), 20 * GIB)
    # No limit known (MLX missing): the whole RAM.
    assert measure(None, readings({}, total=24 * GIB, limit=0)).usable_bytes == 24 * GIB


def test_budget_on_a_shared_machine():
    # Three "nodes" on one 24 GiB machine each see all of it; the budget is what each may use.
    r = readings({}, total=24 * GIB, available=20 * GIB, limit=int(0.8 * 24 * GIB))
    assert (measure(6 * GIB, r).usable_bytes, measure(6 * GIB, r).free_bytes) == (6 * GIB, 6 * GIB)
    assert measure(6 * GIB, r, used_by_orchard_bytes=2 * GIB).free_bytes == 4 * GIB
    assert measure(6 * GIB, r, used_by_orchard_bytes=7 * GIB).free_bytes == 0  # over budget: nothing free
    # The machine itself is tighter than the budget: what is really available wins.
    tight = readings({}, total=24 * GIB, available=1 * GIB, limit=int(0.8 * 24 * GIB))
    assert measure(6 * GIB, tight).free_bytes == 1 * GIB
    # A budget larger than the machine cannot make usable exceed total.
    assert measure(64 * GIB, r).usable_bytes == int(0.8 * 24 * GIB)


def test_device_override_and_bad_inputs():
    assert measure(None, readings({}), device_override="cuda").devices == ("cuda", "cpu")
    assert measure(None, readings(MAC), device_override="cpu").devices == ("cpu",)
    with pytest.raises(ValueError):
        measure(0, readings({}))
    with pytest.raises(ValueError):
        measure(None, readings({}), used_by_orchard_bytes=-1)


def test_identity_from_labels():
    rid = "ab12cd34ef" + "0" * 46
    i = identity_from_labels(rid, {"ray.io/node-id": rid})
    assert (i.node_id, i.budget_bytes, i.device) == ("ab12cd34", None, None)
    i = identity_from_labels(rid, {"orchard.node": "mac-2", "orchard.budget_gib": "1.5", "orchard.device": "metal"})
    assert (i.node_id, i.budget_bytes, i.device) == ("mac-2", int(1.5 * GIB), "metal")
    for bad in ({"orchard.budget_gib": "lots"}, {"orchard.budget_gib": "-1"}, {"orchard.device": "tpu"}):
        with pytest.raises(ValueError):
            identity_from_labels(rid, bad)


def test_report_becomes_policy_node_state():
    rep = read_report(
        "mac-1",
        "f" * 56,
        {"orchard.node": "mac-1"},
        3 * GIB,
        used_by_orchard_bytes=GIB,
        readings=readings({}, total=24 * GIB, limit=int(0.8 * 24 * GIB)),
    )
    assert NodeReport.model_validate(rep.model_dump(mode="json")) == rep  # crosses Ray as a dict
    st = rep.node_state()
    assert (st.node_id, st.usable_bytes, st.reported_headroom_bytes, st.devices) == ("mac-1", 3 * GIB, 2 * GIB, ("cpu",))


def test_probe_reads_this_machine():
    r = probe()
    m = measure(None, r)
    assert 0 < m.free_bytes <= m.total_bytes and 0 < m.usable_bytes <= m.total_bytes
    assert m.chip and m.chip != "unknown"


def test_parse_local_nodes():
    nodes = local.parse_nodes("head:6,mac-1:3, mac-2:2:cpu,plain")
    assert [n.name for n in nodes] == ["head", "mac-1", "mac-2", "plain"]
    assert nodes[2].labels() == {"orchard.node": "mac-2", "orchard.budget_gib": "2", "orchard.device": "cpu"}
    assert nodes[3].labels() == {"orchard.node": "plain"}
    for bad in ("a:1,a:2", "bad name:1", "x:1:tpu", ""):
        with pytest.raises(ValueError):
            local.parse_nodes(bad)


# ---- the local launcher (ray start processes) -----------------------------------------------------------


def _run_local(cwd: Path, *args: str, timeout: float = 120, python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python -m cluster.local ...` run from the checkout at cwd (its own code: `-m` puts cwd first on sys.path)."""
    cmd = [python, "-m", "cluster.local", *args]
    return subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _checkout_at_a_long_path(tmp_path: Path, length: int = 130) -> Path:
    """What `python -m cluster.local` reads of a checkout (its packages and ray-config.yaml), copied from this
    working tree, uncommitted changes included, to a folder whose path is at least `length` characters and holds a
    space, as a Mac's /Users/<name>/Developer/My Projects/... clone would be."""
    dest = tmp_path / "My Projects" / ("orchard-" + "x" * max(8, length - len(str(tmp_path)) - 21))
    dest.mkdir(parents=True)
    for name in ("cluster", "policy"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "ray-config.yaml", dest)
    return dest


def _venv_at(dest: Path) -> Path:
    """This venv as pip would have made it at dest: its packages (linked), its interpreter, and a `ray`
    script that starts with pip's preamble for an interpreter path holding a space (/bin/sh execs the
    quoted path)."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(Path(sys.prefix) / "pyvenv.cfg", dest)
    (dest / "lib").symlink_to(Path(sys.prefix) / "lib", target_is_directory=True)
    (dest / "bin" / "python").symlink_to(sys.executable)
    body = (Path(sys.prefix) / "bin" / "ray").read_text().split("\n", 1)[1]
    preamble = f"#!/bin/sh\n'''exec' \"{dest}/bin/python\" \"$0\" \"$@\"\n' '''\n"
    (dest / "bin" / "ray").write_text(preamble + body)
    (dest / "bin" / "ray").chmod(0o755)
    return dest


def test_local_launcher_start_status_stop_from_a_long_path(tmp_path):
    """issue 10 item 9: from a checkout at a 120+ character path, `start` with the dashboard (whose MetricsHead
    socket was the first to pass the AF_UNIX limit), `status`, a refused second `start`, `stop`; all with the
    default temp dir, which must be this checkout's own short one. The path holds a space and so does the
    venv's (a fresh clone's `make run` from such a path lost its head: Ray starts its client server through
    `bash -c` with its install path unquoted). Runs before the cluster_utils fixture so the two clusters
    never share the two cores."""
    checkout = _checkout_at_a_long_path(tmp_path)
    assert len(str(checkout)) >= 120 and " " in str(checkout)
    python = str(_venv_at(tmp_path / "My Projects" / "a venv") / "bin" / "python")
    ip = local.default_ip()
    port, dashboard_port, http_port = ports.free_port(ip), ports.free_port("127.0.0.1"), ports.free_port("127.0.0.1")
    ingress = ports.free_port("127.0.0.1")
    port_args = ["--port", str(port), "--dashboard-port", str(dashboard_port), "--http-port", str(http_port), "--ingress-port", str(ingress)]
    temp_root: Path | None = None
    pids: list[int] = []
    t0 = time.monotonic()
    try:
        up = _run_local(checkout, "start", "--nodes", "head:2,mac-1:1", *port_args, "--head-cpus", "1", python=python)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"{ip}:{port}" in up.stdout
        t_up = time.monotonic() - t0
        # The clone's own code ran, with a temp dir of its own, short, and outside the checkout.
        temp_root = environment.default_temp_root(checkout)
        assert _run_local(checkout, "tmpdir").stdout.strip() == str(temp_root) and len(str(temp_root)) <= 24
        assert not (checkout / ".ray").exists()
        state = local.read_state(temp_root)
        pids = [n["pid"] for n in state["nodes"]]
        assert all(local._alive(p) for p in pids)
        # a driver started for this cluster (as `make run` starts `serve run`): `stop` ends it too
        driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, "RAY_TMPDIR": str(temp_root)})
        sockets = temp_root / "ray" / "session_latest" / "sockets"
        assert (sockets / "dash_MetricsHead").exists(), sorted(p.name for p in sockets.iterdir())
        token = environment.token_path(temp_root).read_text()  # the dashboard wants Ray's token too
        nodes_api = urllib.request.Request(f"http://127.0.0.1:{dashboard_port}/api/v0/nodes", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(nodes_api, timeout=30) as r:
            assert json.load(r)["result"], "the dashboard's state API answers"
        assert _run_local(checkout, "address").stdout.strip() == f"{ip}:{port}"
        st = _run_local(checkout, "status")
        assert st.returncode == 0, st.stdout + st.stderr
        lines = {line.split()[0]: line for line in st.stdout.splitlines() if line.strip()}
        assert "alive" in lines["head"] and "orchard.budget_gib=2" in lines["head"]
        assert "alive" in lines["mac-1"] and "orchard.budget_gib=1" in lines["mac-1"]
        again = _run_local(checkout, "start", "--nodes", "head:2", *port_args)
        assert again.returncode != 0 and "running" in again.stderr
    finally:
        down = _run_local(checkout, "stop")
        if down.returncode == 0 and temp_root is not None:
            shutil.rmtree(temp_root, ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped 2 node(s)" in down.stdout
    assert driver.wait(timeout=10) is not None  # ended by `stop` (reaped here: this test is its parent)
    assert not any(local._alive(p) for p in pids)
    assert local._members(temp_root, []) == ({}, set())  # no process of the cluster, no driver
    print(f"local launcher from a {len(str(checkout))}-character path: up in {t_up:.1f} s, all {time.monotonic() - t0:.1f} s")


def test_start_refuses_a_taken_http_port(tmp_path, monkeypatch):
    """issue 10 item 8: a second Orchard on Serve's HTTP port would share it silently, so `start` refuses,
    naming the port and who listens there, before it starts anything. The same for the port the head's
    ingress replica serves on (the URL users are given): its replica would take the next one, and that
    URL would reach the other process. (And a --dir too long for Ray's socket paths is refused up front
    too.)"""
    short = Path(tempfile.mkdtemp(prefix="orch-http-", dir="/tmp"))
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            http_port = listener.getsockname()[1]
            free = ports.free_port("127.0.0.1")
            kwargs = {"port": ports.free_port(local.default_ip()), "dashboard": False, "http_port": http_port, "ingress_port": free, "timeout_s": 5}
            with pytest.raises(RuntimeError, match=rf"HTTP port 127\.0\.0\.1:{http_port} is taken by pid {os.getpid()} \("):
                local.start(local.parse_nodes("head:1"), temp_root=short / "t", **kwargs)
            assert not (short / "t").exists(), "nothing was started or written"
            taken_ingress = kwargs | {"http_port": free, "ingress_port": http_port}
            with pytest.raises(RuntimeError, match=rf"ingress port 127\.0\.0\.1:{http_port} is taken by pid {os.getpid()} \("):
                local.start(local.parse_nodes("head:1"), temp_root=short / "t", **taken_ingress)
            assert not (short / "t").exists(), "nothing was started or written"
            # Where psutil may not list sockets (macOS without root), the message still names the port.
            import psutil

            def denied(*_a, **_k):
                raise psutil.AccessDenied()

            monkeypatch.setattr(psutil, "net_connections", denied)
            with pytest.raises(RuntimeError, match=rf"HTTP port 127\.0\.0\.1:{http_port} is taken by another process"):
                local.start(local.parse_nodes("head:1"), temp_root=short / "t", **kwargs)
        assert ports.port_holder("127.0.0.1", http_port) is None
        with pytest.raises(RuntimeError, match="is too long"):
            local.start(local.parse_nodes("head:1"), temp_root=tmp_path / ("x" * 40), **kwargs)
        assert not (short / "t").exists() and not (tmp_path / ("x" * 40)).exists()
    finally:
        shutil.rmtree(short, ignore_errors=True)
    # The port checked by default: the Serve config's http_options, Serve's defaults for what it leaves out.
    (tmp_path / "config.yaml").write_text("http_options: {host: 0.0.0.0, port: 9123}\n")
    assert ports.serve_http_address(tmp_path / "config.yaml") == ("0.0.0.0", 9123)
    assert ports.serve_http_address(tmp_path / "missing.yaml") == ("127.0.0.1", 8000)


# ---- agents on a real 3-node cluster ---------------------------------------------------------------------

BUDGETS = {"head": 6, "mac-1": 3, "mac-2": 2}


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="orch-nodes-", dir="/tmp")
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp  # else Ray writes /tmp/ray/ray_current_cluster
    t0 = time.monotonic()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "labels": {"orchard.node": "head", "orchard.budget_gib": "6"},
            "include_dashboard": False,
            "object_store_memory": 80 * MIB,
            "_system_config": {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    workers = {}
    try:
        for name in ("mac-1", "mac-2"):
            workers[name] = c.add_node(
                num_cpus=1,
                labels={"orchard.node": name, "orchard.budget_gib": str(BUDGETS[name])},
                object_store_memory=80 * MIB,
            )
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        print(f"3-node cluster up in {time.monotonic() - t0:.1f} s")
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmpdir


def _ray_ids() -> dict[str, str]:
    return {e["Labels"]["orchard.node"]: e["NodeID"] for e in ray.nodes() if e["Alive"]}


def test_one_agent_per_node_reports_its_budget(cluster):
    t0 = time.monotonic()
    agents = ensure_agents()
    started_s = time.monotonic() - t0
    assert set(agents) == set(BUDGETS)
    ids = _ray_ids()
    reports = collect_reports(agents)
    assert set(reports) == set(BUDGETS)
    for name, rep in reports.items():
        budget = BUDGETS[name] * GIB
        assert rep.node_id == name and rep.ray_node_id == ids[name]
        assert rep.labels["orchard.node"] == name
        assert rep.budget_bytes == budget and rep.usable_bytes == budget
        assert 0 < rep.free_bytes <= budget
        assert rep.devices == ("cpu",)
        assert abs(rep.reported_at - time.time()) < 60
    # What Orchard's instances use on a node comes off its free memory.
    assert collect_reports(agents, {"mac-1": 2 * GIB})["mac-1"].free_bytes <= 1 * GIB
    print(f"ensure_agents (3 new agents): {started_s:.2f} s")


def test_agents_are_found_again_by_name(cluster):
    first = ensure_agents()
    t0 = time.monotonic()
    second = ensure_agents()
    assert time.monotonic() - t0 < 5
    for name, h in first.items():
        assert second[name]._actor_id == h._actor_id
        found = ray.get_actor(agent_name(name), namespace=NAMESPACE)
        assert found._actor_id == h._actor_id
        assert ray.get(found.identity.remote())["node_id"] == name


def test_ensure_agents_from_inside_a_ray_worker(cluster):
    """Serve replicas are Ray workers: the helper must work there, not only in the driver."""

    @ray.remote(num_cpus=0)
    def names_from_worker():
        from cluster.node_agent import ensure_agents

        return sorted(ensure_agents())

    assert ray.get(names_from_worker.remote(), timeout=60) == sorted(BUDGETS)


def test_dead_agent_is_replaced(cluster):
    old = ensure_agents()["mac-1"]
    ray.kill(old, no_restart=True)
    new = ensure_agents()["mac-1"]
    assert new._actor_id != old._actor_id
    assert collect_reports({"mac-1": new})["mac-1"].usable_bytes == 3 * GIB


def test_removed_node_drops_out(cluster):
    """A crash, not a polite exit: the node's processes are SIGKILLed and only the fast health checks tell
    the GCS it is gone."""
    c, workers = cluster
    before = ensure_agents()
    gone = _ray_ids()["mac-2"]
    t0 = time.monotonic()
    c.remove_node(workers["mac-2"], allow_graceful=False)
    while "mac-2" in {n.node_id for n in alive_nodes()}:
        assert time.monotonic() - t0 < 30, "mac-2 still alive in ray.nodes()"
        time.sleep(0.2)
    dead_after_s = time.monotonic() - t0
    agents = ensure_agents()
    assert set(agents) == {"head", "mac-1"}
    assert gone not in {r.ray_node_id for r in collect_reports(agents).values()}
    # Handles taken before the crash: the dead node is left out of the reports instead of failing them.
    t1 = time.monotonic()
    assert set(collect_reports(before, timeout_s=10)) == {"head", "mac-1"}
    stale_s = time.monotonic() - t1
    # The detached agent died with its node and freed its name.
    while get_agent("mac-2") is not None:
        assert time.monotonic() - t0 < 30, "mac-2's agent name still taken"
        time.sleep(0.2)
    print(f"crashed node read dead after {dead_after_s:.1f} s; reports with a stale handle took {stale_s:.1f} s")


def test_agent_class_is_zero_cpu():
    # Agents must not take Ray CPU slots: placement is by memory, and a 1-CPU node must still get one.
    assert NodeAgent._default_options.get("num_cpus") == 0
