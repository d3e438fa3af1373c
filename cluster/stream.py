"""The direct byte stream between node agents: a folder's files move from the store that holds them into
the store that copies them in over a few TCP connections at once, at the speed of the link.

The target's agent asks the source's agent to open a stream (NodeAgent.open_stream, a Ray actor call,
so Ray's token authenticates it). The source answers with a StreamOffer: the address it listens on (its
node's address as Ray knows it, an ephemeral port) and a one-time ticket (secrets.token_urlsafe). The
target splits the files it lacks into lanes (at most `copy_lanes()`, balanced by bytes, a file never
split) and opens one connection per lane; each sends a StreamRequest: the ticket, the folder, the
lane's files with the offset each partial copy reached, and how many lanes the copy opens. The source
looks every name up in its own manifest of that folder (a name never becomes a path the store did not
seal), answers a StreamReply listing those files as its manifest has them, then sends their bytes back
to back with sendfile: no framing, no round trip per chunk. The listener takes as many connections as
the first request said, each showing the ticket, and closes; it closes too STREAM_IDLE_S after it
opened without them, and a transfer that makes no progress for that long ends. A connection without
the ticket gets a refusal and nothing else.

Why lanes: the target hashes every byte as it arrives (cluster/receiving.py IncomingFile), on one hash
thread per lane, and one core hashes sha256 at 1.5-2 GB/s, less than a fast link or a loopback moves.
Lanes side by side use the cores a node has; a node with few cores gets one lane (copy_lanes).

When the stream cannot be opened (refused, unreachable: a firewall), `copy_folder` copies through the
Ray-call path instead and says so (`transport`)."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from cluster.receiving import IncomingFile
from cluster.store import Store
from cluster.stored import StoredFile, StoreError, StoreManifest, checked_file
from policy._frozen import Frozen

log = logging.getLogger(__name__)

STREAM_IDLE_S = 60.0  # a listener nobody showed the ticket to, or a transfer without progress, ends after this
HANDSHAKE_S = 5.0  # to send a request once connected: a silent connection does not hold the listener
CONNECT_S = 5.0  # a stream not connected by then is unavailable (a firewall dropping packets): Ray calls instead
READ_S = 120.0  # the target's wait for the next bytes, as the Ray path's per-chunk timeout
MAX_FRAME = 1 << 20  # a request or reply: a few hundred file names at most
MAX_LANES = 8  # connections one copy may open
ENV_LANES = "ORCHARD_COPY_LANES"  # a node's own choice of lanes for the copies it makes (1 to MAX_LANES)
_LENGTH = struct.Struct("!I")


def copy_lanes() -> int:
    """How many connections a copy into this node opens: ORCHARD_COPY_LANES if set, else one per two
    cores (a lane keeps about two busy: one receiving and writing, one hashing), 1 to 4."""
    value = os.environ.get(ENV_LANES, "")
    if value:
        try:
            lanes = int(value)
        except ValueError:
            lanes = 0
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"{ENV_LANES}={value!r}: a whole number from 1 to {MAX_LANES}")
        return lanes
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class StreamOffer(Frozen):
    """Where the source's stream of one folder listens, and the ticket it takes once."""

    host: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    ticket: str = Field(min_length=32)


class FileRange(Frozen):
    path: str = Field(min_length=1)
    offset: int = Field(ge=0)


class StreamRequest(Frozen):
    """One lane of a copy: its files, each from its offset; `lanes`: how many connections the copy
    opens with the ticket (the first request's count is the one the listener keeps to)."""

    ticket: str
    folder: str = Field(min_length=1)
    files: tuple[FileRange, ...]
    lanes: int = Field(default=1, ge=1, le=MAX_LANES)


class StreamReply(Frozen):
    """ok: `files` (the source's manifest entries of the files asked for) follow, in the order asked,
    each from its offset. Not ok: `code` (forbidden: not the ticket; not_found: a file the source does
    not hold; bad_request) and why; the connection closes."""

    ok: bool
    code: str = ""
    message: str = ""
    files: tuple[StoredFile, ...] = ()


class Copied(Frozen):
    """What `copy_folder` did: bytes received now, over which transport and how many of its connections
    (0: nothing was missing), and why not over the stream."""

    bytes: int = Field(ge=0)
    transport: Literal["tcp", "ray"]
    lanes: int = Field(default=1, ge=0)
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
    """One folder of a store served once, to the client that shows the ticket (on as many connections,
    its lanes, as its first request says), from threads of its own. `host` is the node's address (never
    a wildcard unless that is the node's address); the port is the kernel's choice.
    StoreError(not_found) at once if the store does not hold the folder."""

    def __init__(self, store: Store, folder: str, host: str, idle_s: float = STREAM_IDLE_S):
        self._manifest = store.served_manifest(folder)
        self._base = store.folder(folder)
        self._files = {f.path: f for f in self._manifest.files}
        self._idle_s = idle_s
        self._ticket = secrets.token_urlsafe(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=MAX_LANES)
        self.offer = StreamOffer(host=host, port=self._listener.getsockname()[1], ticket=self._ticket)
        self.closed = threading.Event()  # set once the listener is closed and every lane's transfer ended
        self.sent = 0  # bytes sent, over every lane
        self.lanes = 0  # connections that showed the ticket
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name=f"orchard-stream:{folder}", daemon=True).start()

    def _serve(self) -> None:
        deadline = time.monotonic() + self._idle_s
        lanes: list[threading.Thread] = []
        expected = 1  # connections with the ticket to take: the first request says how many
        try:
            while len(lanes) < expected and (left := deadline - time.monotonic()) > 0:
                self._listener.settimeout(left)
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    break
                request = self._handshake(conn, peer)
                if request is None:
                    conn.close()
                    continue
                expected = request.lanes if not lanes else expected
                if len(lanes) + 1 >= expected:
                    self._listener.close()  # the ticket is spent: nobody else connects
                lane = threading.Thread(target=self._lane, args=(conn, request), name=f"orchard-stream:{self._manifest.folder}#{len(lanes)}")
                lane.start()
                lanes.append(lane)
                self.lanes = len(lanes)
        except OSError as e:
            log.info("stream of %s stopped listening: %s", self._manifest.folder, e)
        finally:
            self._listener.close()
            for lane in lanes:
                lane.join()
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

    def _lane(self, conn: socket.socket, request: StreamRequest) -> None:
        with conn:
            try:
                self._send(conn, request)
            except OSError as e:  # the target went away mid-transfer, or made no progress for idle_s
                log.info("stream of %s ended: %s", self._manifest.folder, e)

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
                    sent = conn.sendfile(source, offset, f.size - offset)
                with self._lock:
                    self.sent += sent
        conn.shutdown(socket.SHUT_WR)


def split_lanes(files: list[IncomingFile], lanes: int) -> list[list[IncomingFile]]:
    """At most `lanes` groups of whole files, balanced by the bytes each lacks (the largest file first
    into the lightest group); each group keeps the files' own order. Empty groups are left out."""
    groups: list[list[IncomingFile]] = [[] for _ in range(max(1, min(lanes, len(files))))]
    load = [0] * len(groups)
    placed: dict[int, int] = {}
    for k, f in sorted(enumerate(files), key=lambda kf: -kf[1].missing):
        lightest = load.index(min(load))
        placed[k] = lightest
        load[lightest] += f.missing
    for k, f in enumerate(files):
        groups[placed[k]].append(f)
    return [g for g in groups if g]


def _open_lane(offer: StreamOffer, folder: str, files: list[IncomingFile], lanes: int) -> socket.socket:
    """One connection of the copy, its request answered: the socket, positioned at its files' bytes."""
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=CONNECT_S)
    except OSError as e:
        raise StreamUnavailable(f"no stream at {offer.host}:{offer.port}: {e}") from e
    try:
        try:
            conn.settimeout(READ_S)
            ranges = tuple(FileRange(path=f.path, offset=f.offset) for f in files)
            send_message(conn, StreamRequest(ticket=offer.ticket, folder=folder, files=ranges, lanes=lanes))
            reply = StreamReply.model_validate_json(recv_message(conn))
        except (OSError, ValueError) as e:
            raise StreamUnavailable(f"the stream at {offer.host}:{offer.port} gave no answer: {e}") from e
        if not reply.ok and reply.code == "not_found":
            raise StoreError("not_found", reply.message)
        if not reply.ok:
            raise StreamUnavailable(f"the stream at {offer.host}:{offer.port} refused: {reply.code}: {reply.message}")
        if [(s.path, s.size, s.sha256) for s in reply.files] != [(f.path, f.expected.size, f.expected.sha256) for f in files]:
            raise StoreError("not_found", f"the source holds another version of {folder}")
    except BaseException:
        conn.close()
        raise
    return conn


def _fill(conn: socket.socket, files: list[IncomingFile], step: Callable[[int], None], stop: threading.Event) -> None:
    """Receive one lane's files from its connection, each piece written as it comes (while the cache
    holds it) into the lane's ring; returns early, quietly, once `stop` is set (another lane failed)."""
    for f in files:
        while f.missing:
            if stop.is_set():
                return
            view = f.buffer()
            got = 0
            while got < len(view):
                try:
                    n = conn.recv_into(view[got:])
                except OSError as e:
                    raise StreamBroken(f"the stream broke at {f.path} byte {f.offset} of {f.expected.size}: {e}") from e
                if not n:
                    raise StreamBroken(f"the source closed the stream at {f.path} byte {f.offset} of {f.expected.size}")
                f.commit(n)
                got += n
            step(got)


def receive_stream(
    offer: StreamOffer, folder: str, files: list[IncomingFile], step: Callable[[int], None] = lambda _: None, lanes: int | None = None
) -> int:
    """Fill `files` (those with bytes missing, each from its offset) from the stream `offer` names, over
    `lanes` connections at once (copy_lanes() by default). `step(n)` after every buffer of n bytes (and
    once with 0 before the first), from one lane at a time: it may wait (a rate cap, which then holds
    for the lanes together) or raise (a cancelled copy), which stops every lane. StreamUnavailable when
    nothing could be received (refused, unreachable, the ticket refused); StoreError(not_found) when the
    source lacks a file or holds another version of it; StreamBroken when the stream ends early. On any
    error the first one is raised once every lane has stopped, what each received kept for a resume.
    Returns the connections it used (0 when nothing was missing)."""
    wanted = [f for f in files if f.missing]
    if not wanted:
        return 0
    groups = split_lanes(wanted, lanes or copy_lanes())
    conns: list[socket.socket] = []
    try:
        for group in groups:
            conns.append(_open_lane(offer, folder, group, len(groups)))
        step(0)
        if len(groups) == 1:
            _fill(conns[0], groups[0], step, threading.Event())
        else:
            _fill_lanes(conns, groups, step)
        return len(groups)
    finally:
        for conn in conns:
            conn.close()


def _fill_lanes(conns: list[socket.socket], groups: list[list[IncomingFile]], step: Callable[[int], None]) -> None:
    one_at_a_time = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def paced(n: int) -> None:
        with one_at_a_time:
            if not stop.is_set():
                step(n)

    def lane(conn: socket.socket, group: list[IncomingFile]) -> None:
        try:
            _fill(conn, group, paced, stop)
        except BaseException as e:
            with one_at_a_time:
                if not stop.is_set():  # the first failure is the one to report; the rest follow from it
                    errors.append(e)
                    stop.set()
            for other in conns:  # a lane blocked in recv wakes now
                try:
                    other.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    threads = [threading.Thread(target=lane, args=(c, g), name=f"orchard-copy#{k}") for k, (c, g) in enumerate(zip(conns, groups, strict=True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def copy_folder(
    store: Store,
    manifest: StoreManifest,
    offer: StreamOffer | None,
    read: Callable[[str, int], bytes],
    step: Callable[[int], None] = lambda _: None,
    progress: Callable[[int], None] = lambda _: None,
    fallback: str = "",
    lanes: int | None = None,
) -> Copied:
    """Copy `manifest`'s folder into `store` over the stream `offer` names, or, when it cannot be opened
    (or there is no offer: `fallback` says why), through `read(path, offset)` (Ray calls to the same
    source). `lanes`: the stream's connections at most (copy_lanes() by default). Errors as Store.receive and receive_stream raise them, StreamUnavailable excepted."""
    if offer is not None:
        used = [0]

        def transfer(files: list[IncomingFile]) -> None:
            used[0] = receive_stream(offer, manifest.folder, files, step, lanes)

        try:
            copied = store.receive(manifest, transfer, progress)
            return Copied(bytes=copied, transport="tcp", lanes=used[0])
        except StreamUnavailable as e:
            fallback = str(e)
            log.warning("copying %s through Ray calls: %s", manifest.folder, fallback)
    return Copied(bytes=store.copy_in(manifest, read, progress), transport="ray", fallback=fallback or "no stream offered")
