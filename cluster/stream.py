"""The direct byte stream between node agents: a folder's files move from the store that holds them into
the store that copies them in over one TCP connection, at the speed of the link.

The target's agent asks the source's agent to open a stream (NodeAgent.open_stream, a Ray actor call,
so Ray's token authenticates it). The source answers with a StreamOffer: the address it listens on (its
node's address as Ray knows it, an ephemeral port) and a one-time ticket (secrets.token_urlsafe). The
target connects and sends a StreamRequest: the ticket, the folder, each file it lacks with the offset its
partial copy reached. The source looks every name up in its own manifest of that folder (a name never
becomes a path the store did not seal), answers a StreamReply listing those files as its manifest has
them, then sends their bytes back to back with sendfile: no framing, no round trip per chunk. The
listener takes one connection that shows the ticket and closes; it closes too STREAM_IDLE_S after it
opened without one, and a transfer that makes no progress for that long ends. A connection without the
ticket gets a refusal and nothing else.

The target hashes the bytes as they arrive (cluster/store.py IncomingFile). When the stream cannot be
opened (refused, unreachable: a firewall), `copy_folder` copies through the Ray-call path instead and
says so (`transport`)."""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from cluster.store import IncomingFile, Store, StoredFile, StoreError, StoreManifest, checked_file
from policy._frozen import Frozen

log = logging.getLogger(__name__)

STREAM_IDLE_S = 60.0  # a listener nobody showed the ticket to, or a transfer without progress, ends after this
HANDSHAKE_S = 5.0  # to send a request once connected: a silent connection does not hold the listener
CONNECT_S = 5.0  # a stream not connected by then is unavailable (a firewall dropping packets): Ray calls instead
READ_S = 120.0  # the target's wait for the next bytes, as the Ray path's per-chunk timeout
MAX_FRAME = 1 << 20  # a request or reply: a few hundred file names at most
_LENGTH = struct.Struct("!I")


class StreamOffer(Frozen):
    """Where the source's stream of one folder listens, and the ticket it takes once."""

    host: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    ticket: str = Field(min_length=32)


class FileRange(Frozen):
    path: str = Field(min_length=1)
    offset: int = Field(ge=0)


class StreamRequest(Frozen):
    ticket: str
    folder: str = Field(min_length=1)
    files: tuple[FileRange, ...]


class StreamReply(Frozen):
    """ok: `files` (the source's manifest entries of the files asked for) follow, in the order asked,
    each from its offset. Not ok: `code` (forbidden: not the ticket; not_found: a file the source does
    not hold; bad_request) and why; the connection closes."""

    ok: bool
    code: str = ""
    message: str = ""
    files: tuple[StoredFile, ...] = ()


class Copied(Frozen):
    """What `copy_folder` did: bytes received now, over which transport, and why not over the stream."""

    bytes: int = Field(ge=0)
    transport: Literal["tcp", "ray"]
    fallback: str = ""


class StreamUnavailable(Exception):
    """The stream could not be opened (refused, unreachable, the ticket refused): nothing was received
    over it, and the Ray-call path is the way."""


class StreamBroken(ConnectionError):
    """The stream ended before every byte was in (the source went away, or sent nothing for READ_S):
    what was received is written, for the next source to resume from."""


def send_message(conn: socket.socket, message: Frozen) -> None:
    data = message.model_dump_json().encode()
    conn.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exactly(conn: socket.socket, view: memoryview) -> int:
    """Fill `view` from the socket; fewer bytes only when the peer closed."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            break
        got += n
    return got


def recv_message(conn: socket.socket) -> bytes:
    head = bytearray(_LENGTH.size)
    if _recv_exactly(conn, memoryview(head)) < len(head):
        raise ConnectionError("closed before a message")
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME:
        raise ValueError(f"a message of {length} bytes")
    body = bytearray(length)
    if _recv_exactly(conn, memoryview(body)) < length:
        raise ConnectionError("closed inside a message")
    return bytes(body)


class StreamServer:
    """One folder of a store served once, to the client that shows the ticket, from a thread of its own.
    `host` is the node's address (never a wildcard unless that is the node's address); the port is
    the kernel's choice. StoreError(not_found) at once if the store does not hold the folder."""

    def __init__(self, store: Store, folder: str, host: str, idle_s: float = STREAM_IDLE_S):
        self._manifest = store.served_manifest(folder)
        self._base = store.folder(folder)
        self._files = {f.path: f for f in self._manifest.files}
        self._idle_s = idle_s
        self._ticket = secrets.token_urlsafe(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=4)
        self.offer = StreamOffer(host=host, port=self._listener.getsockname()[1], ticket=self._ticket)
        self.closed = threading.Event()  # set once the listener is closed and the transfer, if any, ended
        self.sent = 0  # bytes sent
        threading.Thread(target=self._serve, name=f"orchard-stream:{folder}", daemon=True).start()

    def _serve(self) -> None:
        deadline = time.monotonic() + self._idle_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                self._listener.settimeout(left)
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    break
                with conn:
                    request = self._handshake(conn, peer)
                    if request is None:
                        continue
                    self._listener.close()  # the ticket is spent: nobody else connects
                    self._send(conn, request)
                    break
        except OSError as e:  # the target went away mid-transfer, or made no progress for idle_s
            log.info("stream of %s ended: %s", self._manifest.folder, e)
        finally:
            self._listener.close()
            self.closed.set()

    def _handshake(self, conn: socket.socket, peer) -> StreamRequest | None:
        """The request if it shows the ticket for this folder; otherwise a refusal (or nothing, to a
        connection that sends no request) and None."""
        conn.settimeout(min(HANDSHAKE_S, self._idle_s))
        try:
            request = StreamRequest.model_validate_json(recv_message(conn))
        except (OSError, ValueError) as e:
            log.warning("stream of %s: %s sent no request (%s)", self._manifest.folder, peer, e)
            return None
        if not hmac.compare_digest(request.ticket.encode(), self._ticket.encode()) or request.folder != self._manifest.folder:
            log.warning("stream of %s: %s showed no valid ticket", self._manifest.folder, peer)
            try:
                send_message(conn, StreamReply(ok=False, code="forbidden", message="not this stream's ticket"))
            except OSError:
                pass
            return None
        return request

    def _send(self, conn: socket.socket, request: StreamRequest) -> None:
        wanted: list[tuple[StoredFile, int]] = []
        for r in request.files:
            f = self._files.get(r.path)  # names from this store's manifest only
            if f is None or r.offset > f.size:
                why = "not a file of" if f is None else f"offset {r.offset} is past the end of"
                send_message(conn, StreamReply(ok=False, code="not_found", message=f"{r.path!r}: {why} {self._manifest.folder} here"))
                return
            wanted.append((f, r.offset))
        send_message(conn, StreamReply(ok=True, files=tuple(f for f, _ in wanted)))
        conn.settimeout(self._idle_s)  # sendfile gives up after this long without progress
        for f, offset in wanted:
            if offset < f.size:
                with (self._base / checked_file(f.path)).open("rb") as source:
                    self.sent += conn.sendfile(source, offset, f.size - offset)
        conn.shutdown(socket.SHUT_WR)


def receive_stream(offer: StreamOffer, folder: str, files: list[IncomingFile], step: Callable[[int], None] = lambda _: None) -> None:
    """Fill `files` (those with bytes missing, each from its offset) from the stream `offer` names.
    `step(n)` after every buffer of n bytes (and once with 0 before the first): it may wait (a rate
    cap) or raise (a cancelled copy). StreamUnavailable when nothing could be received (refused,
    unreachable, the ticket refused); StoreError(not_found) when the source lacks a file or holds
    another version of it; StreamBroken when the stream ends early."""
    wanted = [f for f in files if f.missing]
    if not wanted:
        return
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=CONNECT_S)
    except OSError as e:
        raise StreamUnavailable(f"no stream at {offer.host}:{offer.port}: {e}") from e
    with conn:
        try:
            conn.settimeout(READ_S)
            ranges = tuple(FileRange(path=f.path, offset=f.offset) for f in wanted)
            send_message(conn, StreamRequest(ticket=offer.ticket, folder=folder, files=ranges))
            reply = StreamReply.model_validate_json(recv_message(conn))
        except (OSError, ValueError) as e:
            raise StreamUnavailable(f"the stream at {offer.host}:{offer.port} gave no answer: {e}") from e
        if not reply.ok and reply.code == "not_found":
            raise StoreError("not_found", reply.message)
        if not reply.ok:
            raise StreamUnavailable(f"the stream at {offer.host}:{offer.port} refused: {reply.code}: {reply.message}")
        if [(s.path, s.size, s.sha256) for s in reply.files] != [(f.path, f.expected.size, f.expected.sha256) for f in wanted]:
            raise StoreError("not_found", f"the source holds another version of {folder}")
        step(0)
        for f in wanted:
            while f.missing:
                view = f.buffer()
                got = 0
                while got < len(view):  # each piece written as it comes, while the cache holds it
                    try:
                        n = conn.recv_into(view[got:])
                    except OSError as e:
                        raise StreamBroken(f"the stream broke at {f.path} byte {f.offset} of {f.expected.size}: {e}") from e
                    if not n:
                        raise StreamBroken(f"the source closed the stream at {f.path} byte {f.offset} of {f.expected.size}")
                    f.commit(n)
                    got += n
                step(got)


def copy_folder(
    store: Store,
    manifest: StoreManifest,
    offer: StreamOffer | None,
    read: Callable[[str, int], bytes],
    step: Callable[[int], None] = lambda _: None,
    progress: Callable[[int], None] = lambda _: None,
    fallback: str = "",
) -> Copied:
    """Copy `manifest`'s folder into `store` over the stream `offer` names, or, when it cannot be opened
    (or there is no offer: `fallback` says why), through `read(path, offset)` (Ray calls to the same
    source). Errors as Store.receive and receive_stream raise them, StreamUnavailable excepted."""
    if offer is not None:
        try:
            copied = store.receive(manifest, lambda files: receive_stream(offer, manifest.folder, files, step), progress)
            return Copied(bytes=copied, transport="tcp")
        except StreamUnavailable as e:
            fallback = str(e)
            log.warning("copying %s through Ray calls: %s", manifest.folder, fallback)
    return Copied(bytes=store.copy_in(manifest, read, progress), transport="ray", fallback=fallback or "no stream offered")
