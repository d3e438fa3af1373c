"""Ports on this machine: a free one, whether one is open and who holds it, and the checks that refuse a
start when Serve's HTTP port or the head's ingress port is already taken."""

import socket
from pathlib import Path

from cluster.environment import RAY_CONFIG


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `ip` now (the OS's choice)."""
    return free_ports(ip, 1)[0]


def free_ports(ip: str, count: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct TCP ports nothing listens on at `ip` now, none of them in `avoid`: each held
    open until all are chosen (one free_port after another may return the same port twice: two of
    a node's Ray components were once given one port, and its start failed)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)  # an avoided one stays open too, so it is not chosen again
            s.bind((ip, 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def port_open(ip: str, port: int) -> bool:
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
    if not port_open(probe, port):
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
