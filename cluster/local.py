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
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from cluster import prometheus
from cluster.store import ENV_STORE
from policy._frozen import Frozen
from policy.specs import DEVICE_KINDS

ROOT = Path(__file__).resolve().parent.parent
RAY_CONFIG = ROOT / "ray-config.yaml"
STATE_FILE = "orchard-local.json"
TOKEN_FILE = "auth_token"  # Ray's auth token for this cluster, in its temp dir
LOOPBACK = "127.0.0.1"
MIB = 1 << 20
# The longest socket path Ray puts under its temp dir (the dashboard's TaskEventsHead module, a 7-digit pid)
# and the AF_UNIX limit Ray checks it against (validate_socket_filepath).
_SOCKET_TAIL = "/ray/session_2000-01-01_00-00-00_000000_1234567/sockets/dash_TaskEventsHead"
_SOCKET_MAX = 103 if sys.platform == "darwin" else 107


def default_temp_root(checkout: Path = ROOT) -> Path:
    """This checkout's RAY_TMPDIR: /tmp/orchard-<first 8 hex of the sha256 of its resolved path>, one per
    checkout and 21 characters whatever the checkout's path. Ray puts AF_UNIX sockets under
    <temp dir>/ray/session_<date>_<pid>/sockets/, and those may not pass 107 bytes (103 on macOS): a temp dir
    inside a checkout deeper than ~30 characters killed the head's dashboard at start. /tmp on macOS too, not
    $TMPDIR (/var/folders/..., ~50 characters there)."""
    digest = hashlib.sha256(str(Path(checkout).resolve()).encode()).hexdigest()[:8]
    return Path("/tmp") / f"orchard-{digest}"


DEFAULT_DIR = default_temp_root()


def _absolute(temp_root: Path) -> Path:
    """temp_root made absolute without resolving symlinks (macOS's /tmp would become /private/tmp, 8 bytes
    of the socket-path budget), the one spelling used for RAY_TMPDIR, the state file and `stop`'s marker."""
    return Path(os.path.abspath(temp_root))


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


def token_path(temp_root: Path = DEFAULT_DIR) -> Path:
    return _absolute(temp_root) / TOKEN_FILE


def ensure_token(temp_root: Path) -> Path:
    """This cluster's Ray auth token file, made once (64 hex digits from `secrets`, mode 0600) and reused by
    every later start from the same temp dir, so drivers and the dashboard keep working across restarts.
    A file that is not a plain file of this user's with mode 0600 is replaced, and a temp dir that another
    user owns is refused (/tmp/orchard-<hash> is a predictable name)."""
    temp_root = _absolute(temp_root)
    temp_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if temp_root.stat().st_uid != os.getuid():
        raise RuntimeError(f"{temp_root} belongs to another user: pass a --dir of your own")
    path = temp_root / TOKEN_FILE
    try:
        st = os.lstat(path)
        if (st.st_mode & 0o170777) == 0o100600 and st.st_uid == os.getuid() and st.st_size > 0:
            return path
    except FileNotFoundError:
        pass
    tmp = temp_root / f".{TOKEN_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    tmp.replace(path)
    return path


# Where each node's ingress replica serves the API itself (Serve's direct ingress): the first port of
# Ray's direct-ingress range, so the URL a user is given, http://<a Mac>:8000/v1, is the path without
# the proxy's hop. Serve's proxy, which direct ingress keeps on the head, listens on ray-config.yaml's
# http_options port (8100).
INGRESS_PORT = 8000


def ingress_ports(first: int) -> dict[str, str]:
    """Serve's direct-ingress range from `first`, as wide as Ray's default (1,000 ports)."""
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 1000)}


# Ray Serve's throughput mode: user code on the replica's own event loop (no thread hop per call)
# and gRPC between Serve actors. Measured through the full path: llama-10m at 16 streams 0.79x ->
# 0.86x of the in-process engine (docs/serve-benchmark.md). Direct ingress: each ingress replica
# also serves HTTP itself, on the first free port from INGRESS_PORT (one per replica on a host), so
# a client there skips the proxy's hop (docs/cluster.md, docs/serve-path.md); in this mode Serve
# runs one proxy, on the head, on http_options' port. A replica that stops keeps serving for 2 s
# (Serve's default, 30 s, is for load balancers that deregister targets; raise it behind one). Read
# by every Serve process at import, so it must be in the environment of every node (Macs: export
# them all before `ray start`).
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    **ingress_ports(INGRESS_PORT),
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def driver_env(temp_root: Path) -> dict[str, str]:
    """What a driver of this cluster (`serve run`, a script) must have set, besides RAY_ADDRESS: printed by
    `python -m cluster.local env`. The token is named by its file, never given."""
    temp_root = _absolute(temp_root)
    return {
        "RAY_TMPDIR": str(temp_root),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(temp_root / TOKEN_FILE),
        # Ray rewrites a loopback address (a node's, the GCS's in RAY_ADDRESS) to the machine's LAN address
        # unless this is 0, and its servers then listen on all interfaces (ray._private.services
        # .resolve_ip_for_localhost); "0" is Ray's own default on macOS.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


def session_token_env() -> dict[str, str]:
    """Ray's token auth for a cluster that lives as long as this process and its children (tests and
    benchmarks: ray.cluster_utils or a local ray.init), for os.environ before Ray is imported:
    RAY_AUTH_MODE=token and a fresh token in RAY_AUTH_TOKEN (which Ray prefers to any token file), inherited
    by every node and worker; never written to a file."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def ray_env(temp_root: Path) -> dict[str, str]:
    """The environment every node and every driver of this cluster must share."""
    env = dict(os.environ)
    env.pop("RAY_AUTH_TOKEN", None)  # Ray prefers it to RAY_AUTH_TOKEN_PATH: an inherited one would win
    env.update(driver_env(temp_root))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # `ray start --block` drains a node for up to 30 s on SIGTERM (for Serve on Kubernetes); a local demo
    # has nothing to migrate, so stop at once.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    env.update(SERVE_ENV)
    return env


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


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `ip` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _port_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5):
            return True
    except OSError:
        return False


def serve_http_address(config: Path = RAY_CONFIG) -> tuple[str, int]:
    """(host, port) of the Serve proxy as the config's http_options give them; Serve's defaults
    (127.0.0.1, 8000) for what it leaves out or when there is no such file."""
    import yaml

    options = ((yaml.safe_load(config.read_text()) or {}).get("http_options") or {}) if config.exists() else {}
    return str(options.get("host", "127.0.0.1")), int(options.get("port", 8000))


def port_holder(host: str, port: int) -> str | None:
    """None if nothing accepts connections on host:port; else who listens there, as far as psutil can tell:
    "pid 123 (python3: python3 -m http.server)" for each listener, or just "another process" when it cannot
    see (psutil.net_connections needs root on macOS; other users' pids are hidden on Linux)."""
    import psutil

    probe = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if not _port_open(probe, port):
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        conns = []
    pids = sorted({c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})
    holders = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            name = p.name()
            try:
                cmd = " ".join(" ".join(p.cmdline()).split())  # process titles (Ray's) pad with spaces
            except (psutil.AccessDenied, psutil.ZombieProcess):
                cmd = ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            holders.append(f"pid {pid}")
            continue
        holders.append(f"pid {pid} ({name}: {cmd[:200]})" if cmd else f"pid {pid} ({name})")
    return ", ".join(holders) or "another process"


def _refuse_taken(host: str, port: int, what: str, why: str) -> None:
    holder = port_holder(host, port)
    if holder is not None:
        raise RuntimeError(f"{what} {host}:{port} is taken by {holder}: {why}")


def check_http_port(host: str, port: int) -> None:
    """Refuse (RuntimeError) when something already listens on Serve's HTTP port: a second Serve proxy binds
    it too (with port reuse), and the two unrelated clusters then share its connections silently."""
    why = "a second Serve proxy would share it silently; stop that process, or serve on another port and pass it as --http-port"
    _refuse_taken(host, port, "Serve's HTTP port", why)


def check_ingress_port(host: str, port: int) -> None:
    """Refuse (RuntimeError) when something already listens on the head's ingress port: its replica would
    take the next free one, and the URL users are given would reach that other process."""
    why = "the head's ingress replica would serve on another port and its URL would reach that process; stop it, or pass another --ingress-port"
    _refuse_taken(host, port, "the ingress port", why)


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
    path = _absolute(temp_root) / STATE_FILE
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
    temp_root = _absolute(temp_root)
    if len(str(temp_root).encode()) + len(_SOCKET_TAIL) > _SOCKET_MAX:
        raise RuntimeError(
            f"temp dir {temp_root} is too long: Ray's socket paths under it would pass the AF_UNIX limit of "
            f"{_SOCKET_MAX} bytes; pass a --dir of at most {_SOCKET_MAX - len(_SOCKET_TAIL)} characters (default: {DEFAULT_DIR})"
        )
    old = read_state(temp_root)
    if old and any(_is_node_process(n["pid"]) for n in old["nodes"]):
        raise RuntimeError(f"a local cluster from {temp_root} is running ({old['address']}); stop it first")
    ip = default_ip()
    if _port_open(ip, port):
        raise RuntimeError(f"port {ip}:{port} is taken (another Ray?); pass --port")
    if dashboard and _port_open("127.0.0.1", dashboard_port):
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

    def spawn(node: LocalNode, args: list[str]) -> None:
        """Start one node and wait until `ray start` says it is up. One at a time: nodes starting together
        in one session dir can pick the same plasma socket name and one raylet dies with "bind: Address
        already in use" (seen here)."""
        labels = ",".join(f"{k}={v}" for k, v in node.labels().items())
        logfile = temp_root / "logs" / f"{node.name}.log"
        offset = logfile.stat().st_size if logfile.exists() else 0
        cmd = ray_cli + ["start", *args, *common, f"--labels={labels}"]
        # Fresh free ports per node: the default 52365 for the dashboard agent would collide between nodes.
        cmd += [f"--dashboard-agent-listen-port={free_port(ip)}", f"--metrics-export-port={free_port(ip)}"]
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
        head_args = ["--head", f"--port={port}", f"--num-cpus={head_cpus}", f"--ray-client-server-port={free_port(ip)}"]
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

    temp_root = _absolute(temp_root)
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
        print(_absolute(a.dir))
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
