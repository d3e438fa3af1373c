"""Resetting the TCP connection a request came on, for a response the server gives up on.

ASGI has no way to abort a connection: an app that stops in the middle of a response can only
return (or raise), and uvicorn, which serves each ingress replica's own port under Serve's direct
ingress, then calls `transport.close()`. That close flushes what uvicorn still buffers before it
closes the socket, so for a client that reads nothing it never happens: the connection, its
buffered bytes (megabytes of a stalled stream) and the kernel's send queue stay until the client
closes its socket (seen: a stream given up on after its write timeout, still ESTABLISHED with
2.8 MB queued 20 s later). So the socket is found among this process's descriptors by the
connection's two addresses (the ASGI scope's `client` and `server`) and reset: SO_LINGER 0 and a
shutdown, which makes the server's event loop fail the pending write and close the socket, and that
close sends a reset (the client's next read fails with ECONNRESET) instead of waiting on the client.
A request that reached this process through Serve's proxy has its socket in the proxy: nothing is
found, nothing is done."""

import os
import socket
import stat
import struct
from collections.abc import Iterator, Mapping
from typing import Any

_FDS = "/dev/fd"  # this process's descriptors (Linux and macOS)


def reset(scope: Mapping[str, Any]) -> bool:
    """Reset the TCP connection of `scope` if this process holds its socket; whether it did."""
    client, server = scope.get("client"), scope.get("server")
    if not client or not server:
        return False
    wanted = ((str(client[0]), int(client[1])), (str(server[0]), int(server[1])))
    for sock in _tcp_sockets():
        with sock:
            try:
                if (_address(sock.getpeername()), _address(sock.getsockname())) != wanted:
                    continue
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected, or gone meanwhile
                continue
            return True
    return False


def _address(address: Any) -> tuple[str, int]:
    return str(address[0]), int(address[1])


def _tcp_sockets() -> Iterator[socket.socket]:
    """A duplicate of each TCP socket this process holds (closing it leaves the original open)."""
    try:
        fds = [int(name) for name in os.listdir(_FDS)]
    except OSError:
        return
    for fd in fds:
        sock = _duplicate(fd)
        if sock is None:
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            yield sock
        else:
            sock.close()


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object over a duplicate of `fd`, or None when `fd` is not a socket (or is gone)."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
