"""A local multi-node Ray cluster on one machine, for the demo (`make run`) and tests.

    python -m cluster.local start --nodes "head:6,mac-1:3,mac-2:2"   # name:budget_gib[:device], head first
    python -m cluster.local status
    python -m cluster.local stop
    python -m cluster.local tmpdir    # this checkout's RAY_TMPDIR (where its state file, logs and token are)
    env $(python -m cluster.local env) serve run ray-config.yaml   # a driver: what it must have set

Each node is one `ray start --block` process (in a session of its own, so a Ctrl-C at the shell does not
reach it), recorded with its pid in <dir>/orchard-local.json; `stop` lists those processes, their descendants
and any process whose command line names this cluster's temp dir, SIGTERMs the `ray start` processes and
SIGKILLs what is left after a grace period. It never runs `ray stop`, which would kill every Ray on the
machine.

Why each setting (see docs/cluster.md): all nodes of one machine report the whole machine's RAM, so each
declares a budget label; Ray's token auth on every node and driver (RAY_AUTH_MODE=token, the token made
once per temp dir in <dir>/auth_token, mode 0600, and named by RAY_AUTH_TOKEN_PATH: never printed, never on
a command line); every node at 127.0.0.1, which makes Ray's own servers (GCS, raylet, object manager,
workers, agents, dashboard) listen on loopback only (any other node IP and they listen on all interfaces),
kept as given by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and, for `ray start` itself, _NODE_MAIN; a small
object store (Ray would reserve 30% of RAM per node); a RAY_TMPDIR of its own per checkout, short whatever
the checkout's path (default_temp_root), so nothing lands in /tmp/ray and Ray's socket paths fit; every
port chosen free, because other Ray instances may run on the same machine; and no start while something
listens on Serve's HTTP port (a second proxy would share it silently).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from cluster import prometheus
from cluster.environment import (
    DEFAULT_DIR,
    INGRESS_PORT,
    ROOT,
    TOKEN_FILE,
    absolute_root,
    check_temp_root,
    driver_env,
    ensure_token,
    ingress_ports,
    ray_env,
)
from cluster.ports import check_http_port, check_ingress_port, free_ports, port_open, serve_http_address
from cluster.store import ENV_STORE
from policy._frozen import Frozen
from policy.specs import DEVICE_KINDS

STATE_FILE = "orchard-local.json"
LOOPBACK = "127.0.0.1"
MIB = 1 << 20


class LocalNode(Frozen):
    name: str = Field(min_length=1)
    budget_gib: float | None = Field(default=None, gt=0)
    device: str | None = None

    def labels(self) -> dict[str, str]:
        from cluster.node_agent import LABEL_BUDGET, LABEL_DEVICE, LABEL_NODE  # imports Ray: not at module import

        out = {LABEL_NODE: self.name}
        if self.budget_gib is not None:
            out[LABEL_BUDGET] = f"{self.budget_gib:g}"
        if self.device is not None:
            out[LABEL_DEVICE] = self.device
        return out


def parse_nodes(spec: str) -> list[LocalNode]:
    """'head:6,mac-1:3,mac-2:2:cpu' -> nodes; the first is the head. Budget and device are optional."""
    from cluster.ray_api import validate_labels

    nodes = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) > 3:
            raise ValueError(f"node {part!r}: expected name[:budget_gib[:device]]")
        name = fields[0]
        budget = float(fields[1]) if len(fields) > 1 and fields[1] else None
        device = fields[2] if len(fields) > 2 and fields[2] else None
        if device is not None and device not in DEVICE_KINDS:
            raise ValueError(f"node {name}: device {device!r} is not one of {DEVICE_KINDS}")
        node = LocalNode(name=name, budget_gib=budget, device=device)
        validate_labels(node.labels())
        nodes.append(node)
    names = [n.name for n in nodes]
    if not nodes or len(names) != len(set(names)):
        raise ValueError(f"need at least one node and unique names, got {names}")
    return nodes


def default_ip() -> str:
    """Every node's IP: 127.0.0.1, the one address for which Ray's servers listen on loopback only."""
    return LOOPBACK


# `ray start`, run as `python -c _NODE_MAIN start ...`, with two of Ray's settings changed in that process
# only. With RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (which keeps 127.0.0.1 as given everywhere else) Ray
# refuses to start a worker node ("Multi-node Ray clusters are not supported on Windows and OSX"), and with
# it 1, `ray start` rewrites --node-ip-address=127.0.0.1 and --address=127.0.0.1:<port> to the machine's LAN
# address, whereupon the GCS, raylet, object manager, agents and every worker listen on all interfaces.
# So: cluster mode on for `ray start`'s own check, loopback addresses kept as given; the processes it
# starts inherit RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0. Fails loudly if Ray renames either.
_NODE_MAIN = (
    "import sys\n"
    "from ray._private import ray_constants, services\n"
    "assert hasattr(ray_constants, 'ENABLE_RAY_CLUSTER') and hasattr(services, 'resolve_ip_for_localhost')\n"
    "ray_constants.ENABLE_RAY_CLUSTER = True\n"
    "services.resolve_ip_for_localhost = lambda host: host\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "sys.exit(main())\n"
)


def _ray_cli(temp_root: Path) -> list[str]:
    """The command that runs `ray` (through _NODE_MAIN): this interpreter. Ray builds shell command lines
    from its install path unquoted (the head's ray_client_server is started through `bash -c` and died with
    exit 127) and sets LD_PRELOAD to its jemalloc, which ld.so splits at spaces: from a checkout whose path
    holds whitespace (a Mac's "~/Code/My Projects/orchard"), the venv is reached through <temp_root>/venv, a
    link without one, and Ray's processes all run from there (the raylet starts workers with the
    interpreter it got)."""
    python = sys.executable
    if any(c.isspace() for c in sys.prefix) and sys.prefix != sys.base_prefix:
        alias = temp_root / "venv"
        if not (alias.is_symlink() and os.readlink(alias) == sys.prefix):
            alias.unlink(missing_ok=True)
            alias.symlink_to(sys.prefix, target_is_directory=True)
        python = str(alias / "bin" / Path(sys.executable).name)
    return [python, "-c", _NODE_MAIN]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_node_process(pid: int) -> bool:
    """pid is alive and still a `ray start --block` (not a reused pid)."""
    import psutil

    try:
        cmd = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "start" in cmd and "--block" in cmd


def read_state(temp_root: Path = DEFAULT_DIR) -> dict | None:
    path = absolute_root(temp_root) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _connect(state: dict):
    """Connect this process to the cluster as a driver (for status and the start check). main() puts
    driver_env in the environment before anything imports Ray; a caller that imported it earlier gets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 applied here too (Ray reads it at import), so the loopback address
    is not rewritten."""
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update({k: v for k, v in ray_env(Path(state["temp_root"])).items() if k.startswith("RAY_")})
    import ray
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    # What the environment now says, for a process that imported Ray before (Ray reads these once; the
    # last two as Ray's own _enable_token_auth does)
    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    if not ray.is_initialized():
        ray.init(address=state["address"], log_to_driver=False, configure_logging=False)
    return ray


def start(
    nodes: list[LocalNode],
    *,
    temp_root: Path = DEFAULT_DIR,
    port: int = 6379,
    dashboard: bool = True,
    dashboard_port: int = 8265,
    http_port: int | None = None,
    ingress_port: int = INGRESS_PORT,
    head_cpus: int = 2,
    worker_cpus: int = 1,
    object_store_mib: int = 80,
    timeout_s: float = 120.0,
    prometheus_port: int | None = None,
    stores: Path | None = None,
    head_store: Path | None = None,
    log=print,
) -> dict:
    """Start the head and one worker per further node, wait until all are alive, and return the state
    (also written to <temp_root>/orchard-local.json). On failure, stops whatever it started. Refuses before
    starting anything when this temp root's cluster runs, a port is taken (the GCS's, the dashboard's, or
    Serve's HTTP port: ray-config.yaml's http_options, http_port overriding its port, or the first port
    of the nodes' ingress replicas, `ingress_port`), or temp_root is too
    long for Ray's socket paths. `stores`: each node's model store is <stores>/<name> (its
    ORCHARD_STORE), the head's `head_store` if given (the demo: the prepared models folder, so only
    the head holds the set and the others copy what is placed on them)."""
    temp_root = absolute_root(temp_root)
    check_temp_root(temp_root)
    old = read_state(temp_root)
    if old and any(_is_node_process(n["pid"]) for n in old["nodes"]):
        raise RuntimeError(f"a local cluster from {temp_root} is running ({old['address']}); stop it first")
    ip = default_ip()
    if port_open(ip, port):
        raise RuntimeError(f"port {ip}:{port} is taken (another Ray?); pass --port")
    if dashboard and port_open("127.0.0.1", dashboard_port):
        raise RuntimeError(f"dashboard port 127.0.0.1:{dashboard_port} is taken; pass --dashboard-port or --no-dashboard")
    http_host, config_port = serve_http_address()
    http_port = config_port if http_port is None else http_port
    check_http_port(http_host, http_port)
    check_ingress_port(http_host, ingress_port)
    ensure_token(temp_root)
    (temp_root / "logs").mkdir(parents=True, exist_ok=True)
    env = ray_env(temp_root) | ingress_ports(ingress_port)
    address = f"{ip}:{port}"
    state: dict[str, Any] = {
        "address": address,
        "ip": ip,
        "temp_root": str(temp_root),
        "dashboard": f"http://127.0.0.1:{dashboard_port}" if dashboard else None,
        "nodes": [],
    }
    ray_cli = _ray_cli(temp_root)
    common = ["--block", "--disable-usage-stats", f"--node-ip-address={ip}", f"--object-store-memory={object_store_mib * MIB}"]

    # every port this cluster's nodes are given or Serve will take (its proxy, the ingress replicas'
    # first ports): none twice
    chosen = {port, dashboard_port, http_port, *range(ingress_port, ingress_port + len(nodes) + 1)}

    def spawn(node: LocalNode, args: list[str]) -> None:
        """Start one node and wait until `ray start` says it is up. One at a time: nodes starting together
        in one session dir can pick the same plasma socket name and one raylet dies with "bind: Address
        already in use" (seen here)."""
        labels = ",".join(f"{k}={v}" for k, v in node.labels().items())
        logfile = temp_root / "logs" / f"{node.name}.log"
        offset = logfile.stat().st_size if logfile.exists() else 0
        cmd = ray_cli + ["start", *args, *common, f"--labels={labels}"]
        # Fresh free ports per node: the default 52365 for the dashboard agent would collide between nodes.
        agent, metrics = free_ports(ip, 2, avoid=chosen)
        chosen.update((agent, metrics))
        cmd += [f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}"]
        node_env = dict(env)
        store = (head_store if node is nodes[0] and head_store is not None else stores / node.name) if stores is not None else None
        if store is not None:
            store.mkdir(parents=True, exist_ok=True)
            node_env[ENV_STORE] = str(store.resolve())
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(cmd, env=node_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        state["nodes"].append({**node.model_dump(), "pid": proc.pid, "log": str(logfile), "store": node_env.get(ENV_STORE)})
        _write_state(temp_root, state)
        while True:
            with open(logfile, "rb") as f:
                f.seek(offset)
                if b"Ray runtime started" in f.read():
                    return
            _check_started(state, deadline)
            time.sleep(0.2)

    started = time.monotonic()
    deadline = started + timeout_s
    try:
        head, workers = nodes[0], nodes[1:]
        (client_server,) = free_ports(ip, 1, avoid=chosen)
        chosen.add(client_server)
        head_args = ["--head", f"--port={port}", f"--num-cpus={head_cpus}", f"--ray-client-server-port={client_server}"]
        if dashboard:
            head_args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        else:
            head_args += ["--include-dashboard=false"]
        spawn(head, head_args)
        for node in workers:
            spawn(node, [f"--address={address}", f"--num-cpus={worker_cpus}"])
        from cluster.node_agent import LABEL_NODE

        ray = _connect(state)
        want = {n.name for n in nodes}
        while True:
            alive = {e["Labels"].get(LABEL_NODE) for e in ray.nodes() if e["Alive"]}
            if want <= alive:
                break
            _check_started(state, deadline)
            time.sleep(0.3)
        ray.shutdown()
    except BaseException:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()  # before the GCS goes, or the driver waits 60 s and aborts
        log(f"start failed after {time.monotonic() - started:.1f} s; logs in {temp_root / 'logs'}")
        stop(temp_root, log=lambda *_: None)
        raise
    state["started_s"] = round(time.monotonic() - started, 1)
    _write_state(temp_root, state)
    log(f"Orchard local cluster up in {state['started_s']} s: {len(nodes)} nodes at {address}")
    if dashboard:
        log(f"dashboard: {state['dashboard']}")
    log(f"connect with: env RAY_ADDRESS={address} {' '.join(f'{k}={v}' for k, v in driver_env(temp_root).items())} <command>")
    log(f"Ray's auth token (the dashboard asks for it): {temp_root / TOKEN_FILE}")
    shown = "127.0.0.1" if http_host in ("0.0.0.0", "") else http_host
    log(
        f"once Orchard is served: http://{shown}:{ingress_port}/v1, and every other node's ingress replica on the next free port"
        f" (Serve's direct ingress; GET /v1/cluster lists them as ingress); the head's Serve proxy: http://{shown}:{http_port}/v1"
    )
    if prometheus_port is not None:
        try:
            prometheus.start(temp_root / "ray" / "prom_metrics_service_discovery.json", temp_root / "prometheus", port=prometheus_port)
            log(f"prometheus: http://127.0.0.1:{prometheus_port} (every node's Ray metrics, Orchard's ray_orchard_* among them)")
        except RuntimeError as e:  # metrics are a help, not a reason to refuse the cluster
            log(f"prometheus not started: {e}")
    return state


def _check_started(state: dict, deadline: float) -> None:
    for n in state["nodes"]:
        if not _alive(n["pid"]) or _reaped(n["pid"]):
            tail = Path(n["log"]).read_text(errors="replace")[-2000:] if Path(n["log"]).exists() else ""
            raise RuntimeError(f"node {n['name']} exited during start:\n{tail}")
    if time.monotonic() > deadline:
        raise TimeoutError("nodes did not all come up in time")


def _reaped(pid: int) -> bool:
    """True if pid is our exited child (a zombie until waited for)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def _write_state(temp_root: Path, state: dict) -> None:
    tmp = temp_root / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(temp_root / STATE_FILE)


def _members(temp_root: Path, leaders: list[int]) -> tuple[dict, set[int]]:
    """This cluster's processes, and which of them are drivers: each node's `ray start` process and its
    descendants (raylet, GCS, agents, and workers, which Ray puts in sessions of their own and renames
    `ray::...`), plus orphans whose command line points into this cluster's Ray session dirs
    (<temp_root>/ray/session_*: only Ray's own processes name those, and the directory is ours), plus
    the drivers started for it: other processes with RAY_TMPDIR=<temp_root> in their environment, as
    `make run` starts `serve run` (left alone, one went on running after `make stop`; `ray start`
    hands the cluster's own processes that environment too). Never this process or its ancestors (a
    shell or wrapper whose command line mentions the directory)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for pid in leaders:
        try:
            leader = psutil.Process(pid)
            for p in [leader, *leader.children(recursive=True)]:
                found[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    marker = str(temp_root / "ray" / "session_")
    ours: list[psutil.Process] = []  # RAY_TMPDIR names this cluster
    for p in psutil.process_iter(["cmdline", "environ"]):  # a field it may not read comes back None
        if any(marker in a for a in (p.info["cmdline"] or [])):
            found.setdefault(p.pid, p)
        elif (p.info["environ"] or {}).get("RAY_TMPDIR") == str(temp_root):
            ours.append(p)
    drivers = {p.pid: p for p in ours if p.pid not in found}
    found.update(drivers)
    me = psutil.Process()
    for p in [me, *me.parents()]:
        found.pop(p.pid, None)
    return found, set(drivers) & set(found)


def _gone(p) -> bool:
    """Exited: no such process, or a zombie its own parent has yet to reap (a driver is not ours to wait on)."""
    import psutil

    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop(temp_root: Path = DEFAULT_DIR, *, grace_s: float = 10.0, log=print) -> int:
    """Stop what `start` started: SIGTERM each node's `ray start --block` process (it tears down its raylet,
    GCS and agents; the workers follow their raylet), wait up to grace_s, then SIGKILL whatever of those
    processes (listed before signalling) is left. Returns how many processes there were."""
    import psutil

    temp_root = absolute_root(temp_root)
    if prometheus.stop(temp_root / "prometheus"):
        log("stopped prometheus")
    state = read_state(temp_root)
    leaders = [n["pid"] for n in reversed(state["nodes"])] if state else []
    procs, drivers = _members(temp_root, leaders)
    # Drivers first, while their cluster is still up, as Ctrl-C would stop them (`serve run` then shuts
    # its app down and exits). One that ignores SIGINT (started in the background) is killed after
    # 3 s: its cluster is going, it holds no state, and a SIGTERM makes Ray's driver abort with a
    # stack dump. Then the nodes.
    for pid in drivers:
        try:
            procs[pid].send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            pass
    until = time.monotonic() + min(grace_s, 3.0)
    while drivers and time.monotonic() < until and not all(_gone(procs[pid]) for pid in drivers):
        time.sleep(0.1)
    for pid in drivers:
        if not _gone(procs[pid]):
            try:
                procs[pid].kill()
            except psutil.NoSuchProcess:
                pass
    for pid in leaders:
        try:
            os.kill(pid, signal.SIGTERM)  # `ray start --block` then stops its own processes
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(procs.values())
    while alive and time.monotonic() < deadline:
        for pid in leaders:
            _reaped(pid)
        _, alive = psutil.wait_procs(alive, timeout=0.2)
        alive = [p for p in alive if not (p.pid in drivers and _gone(p))]
    if alive and os.environ.get("ORCHARD_LOCAL_DEBUG"):
        log("SIGKILL: " + ", ".join(f"{p.pid}:{_name(p)}" for p in alive))
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for pid in leaders:
        _reaped(pid)
    if state:
        (temp_root / STATE_FILE).unlink(missing_ok=True)
    if state or procs:
        log(f"stopped {len(leaders)} node(s), {len(procs)} process(es), {len(alive)} of them with SIGKILL")
    else:
        log(f"no local cluster in {temp_root}")
    return len(procs)


def _name(p) -> str:
    try:
        return p.name()
    except Exception:
        return "?"


def status(temp_root: Path = DEFAULT_DIR) -> list[dict]:
    """Nodes as Ray sees them: Orchard name, Ray node id, alive, labels, CPUs."""
    state = read_state(temp_root)
    if not state:
        raise RuntimeError(f"no local cluster in {temp_root}")
    if not _is_node_process(state["nodes"][0]["pid"]):
        raise RuntimeError(f"the local cluster in {temp_root} is not running (its head is gone); run stop")
    from cluster.node_agent import LABEL_NODE

    ray = _connect(state)
    try:
        rows = [
            {
                "node": e["Labels"].get(LABEL_NODE, e["NodeID"][:8]),
                "ray_node_id": e["NodeID"],
                "alive": e["Alive"],
                "cpus": e["Resources"].get("CPU", 0),
                "labels": {k: v for k, v in e["Labels"].items() if not k.startswith("ray.io/")},
            }
            for e in ray.nodes()
        ]
    finally:
        ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"RAY_TMPDIR of this cluster (default for this checkout: {DEFAULT_DIR})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--nodes", default="head:6,mac-1:3,mac-2:2", help="name:budget_gib[:device],... (head first)")
    s.add_argument("--port", type=int, default=6379)
    s.add_argument("--dashboard-port", type=int, default=8265)
    s.add_argument("--no-dashboard", action="store_true")
    s.add_argument("--prometheus-port", type=int, default=None, help="also start Prometheus there, scraping every node (make run: 9090)")
    s.add_argument("--http-port", type=int, default=None, help="Serve's HTTP port to check is free (default: ray-config.yaml's)")
    s.add_argument(
        "--ingress-port", type=int, default=INGRESS_PORT, help=f"where the nodes' ingress replicas serve, from the head's (default {INGRESS_PORT})"
    )
    s.add_argument("--head-cpus", type=int, default=2)
    s.add_argument("--worker-cpus", type=int, default=1)
    s.add_argument("--object-store-mib", type=int, default=80)
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument(
        "--stores", type=Path, default=ROOT / ".stores", help="each node's model store is STORES/<name> (default: .stores/ in the checkout)"
    )
    s.add_argument("--head-store", type=Path, default=None, help="the head's store instead (make run: the prepared models/ folder)")
    sub.add_parser("stop")
    sub.add_parser("status")
    sub.add_parser("address", help="print the address drivers connect to (RAY_ADDRESS)")
    sub.add_parser("tmpdir", help="print this cluster's temp dir (RAY_TMPDIR, where its state file and logs are)")
    sub.add_parser("env", help="print what a driver must set, RAY_ADDRESS included, as NAME=value words for `env` (no secret)")
    a = ap.parse_args(argv)
    # Before anything imports Ray (parse_nodes does), which reads some of these once
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(driver_env(a.dir))
    if a.cmd == "start":
        try:
            nodes = parse_nodes(a.nodes)
        except ValueError as e:
            print(f"cluster.local start: {e}", file=sys.stderr)
            return 2
        try:
            state = start(
                nodes,
                temp_root=a.dir,
                port=a.port,
                dashboard=not a.no_dashboard,
                dashboard_port=a.dashboard_port,
                http_port=a.http_port,
                ingress_port=a.ingress_port,
                head_cpus=a.head_cpus,
                worker_cpus=a.worker_cpus,
                object_store_mib=a.object_store_mib,
                timeout_s=a.timeout,
                prometheus_port=a.prometheus_port,
                stores=a.stores,
                head_store=a.head_store,
            )
        except RuntimeError as e:  # a port taken, a dir too long, a node that did not come up: said, not a traceback
            print(f"cluster.local start: {e}", file=sys.stderr)
            return 1
        print(state["address"])
    elif a.cmd == "stop":
        stop(a.dir)
    elif a.cmd == "tmpdir":
        print(absolute_root(a.dir))
    elif a.cmd == "address":
        running = read_state(a.dir)
        if running is None:
            print("no local cluster is running", file=sys.stderr)
            return 1
        print(running["address"])
    elif a.cmd == "env":
        running = read_state(a.dir)
        if running is None:
            print("no local cluster is running", file=sys.stderr)
            return 1
        print(" ".join(f"{k}={v}" for k, v in {"RAY_ADDRESS": running["address"], **driver_env(a.dir)}.items()))
    else:
        for row in status(a.dir):
            labels = ",".join(f"{k}={v}" for k, v in sorted(row["labels"].items()))
            print(f"{row['node']:<12} {'alive' if row['alive'] else 'dead ':<6} cpus={row['cpus']:g} {row['ray_node_id'][:12]} {labels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
