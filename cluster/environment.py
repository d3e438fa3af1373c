"""What every process of an Orchard Ray cluster must share, set in its environment before Ray is
imported: the temp dir (RAY_TMPDIR, short enough for Ray's socket paths), Ray's token auth (a token
file per local cluster, or a fresh token for a cluster that lives as long as its process), and Serve's
throughput mode with direct ingress (SERVE_ENV). Used by the local launcher (cluster/local.py), the
tests and the benchmarks; importing it does not import Ray."""

import hashlib
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAY_CONFIG = ROOT / "ray-config.yaml"
TOKEN_FILE = "auth_token"  # Ray's auth token for this cluster, in its temp dir
# The longest socket path Ray puts under its temp dir (the dashboard's TaskEventsHead module, a 7-digit pid)
# and the AF_UNIX limit Ray checks it against (validate_socket_filepath).
SOCKET_TAIL = "/ray/session_2000-01-01_00-00-00_000000_1234567/sockets/dash_TaskEventsHead"
SOCKET_MAX = 103 if sys.platform == "darwin" else 107


def default_temp_root(checkout: Path = ROOT) -> Path:
    """This checkout's RAY_TMPDIR: /tmp/orchard-<first 8 hex of the sha256 of its resolved path>, one per
    checkout and 21 characters whatever the checkout's path. Ray puts AF_UNIX sockets under
    <temp dir>/ray/session_<date>_<pid>/sockets/, and those may not pass 107 bytes (103 on macOS): a temp dir
    inside a checkout deeper than ~30 characters killed the head's dashboard at start. /tmp on macOS too, not
    $TMPDIR (/var/folders/..., ~50 characters there)."""
    digest = hashlib.sha256(str(Path(checkout).resolve()).encode()).hexdigest()[:8]
    return Path("/tmp") / f"orchard-{digest}"


DEFAULT_DIR = default_temp_root()


def absolute_root(temp_root: Path) -> Path:
    """temp_root made absolute without resolving symlinks (macOS's /tmp would become /private/tmp, 8 bytes
    of the socket-path budget), the one spelling used for RAY_TMPDIR, the state file and `stop`'s marker."""
    return Path(os.path.abspath(temp_root))


def token_path(temp_root: Path = DEFAULT_DIR) -> Path:
    return absolute_root(temp_root) / TOKEN_FILE


def ensure_token(temp_root: Path) -> Path:
    """This cluster's Ray auth token file, made once (64 hex digits from `secrets`, mode 0600) and reused by
    every later start from the same temp dir, so drivers and the dashboard keep working across restarts.
    A file that is not a plain file of this user's with mode 0600 is replaced, and a temp dir that another
    user owns is refused (/tmp/orchard-<hash> is a predictable name)."""
    temp_root = absolute_root(temp_root)
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
    temp_root = absolute_root(temp_root)
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


def check_temp_root(temp_root: Path) -> None:
    """Refuse (RuntimeError) a temp dir too long for Ray's socket paths under it."""
    temp_root = absolute_root(temp_root)
    if len(str(temp_root).encode()) + len(SOCKET_TAIL) > SOCKET_MAX:
        raise RuntimeError(
            f"temp dir {temp_root} is too long: Ray's socket paths under it would pass the AF_UNIX limit of "
            f"{SOCKET_MAX} bytes; pass a --dir of at most {SOCKET_MAX - len(SOCKET_TAIL)} characters (default: {DEFAULT_DIR})"
        )
