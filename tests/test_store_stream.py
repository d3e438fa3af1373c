"""The direct stream between node agents (cluster/stream.py) on real sockets and files, no Ray: a folder
streams into a store hashed as it arrives and sealed; a connection without the ticket gets nothing and
leaves the stream to the one with it; names outside the source's manifest are refused; the listener is
on the address it was given only, and closes after its transfer or when nobody came; a byte changed
at the source fails the copy and seals nothing; a port that refuses falls back to the Ray-call path and
says so. A cut-off copy resuming from its offsets, over one lane or several: test_copy_stream.py."""

import socket

import pytest
from support.stores import no_ray, same, source_store

import cluster.receiving
from cluster.store import PARTIAL, Store
from cluster.stored import MANIFEST, StoreError
from cluster.stream import (
    FileRange,
    StreamOffer,
    StreamReply,
    StreamRequest,
    StreamServer,
    copy_folder,
    recv_message,
    send_message,
)

SIZES = (300_000, 70_000, 0, 131_072)


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch):
    """64 KiB receive buffers: files of a few hundred KB take several, as a model's take many."""
    monkeypatch.setattr(cluster.receiving, "RECEIVE_BYTES", 64 * 1024)


def _ask(offer: StreamOffer, request: StreamRequest) -> tuple[StreamReply, bytes]:
    """A raw client: the reply, and every byte sent after it."""
    with socket.create_connection((offer.host, offer.port), timeout=5) as conn:
        send_message(conn, request)
        reply = StreamReply.model_validate_json(recv_message(conn))
        rest = b""
        while chunk := conn.recv(1 << 16):
            rest += chunk
    return reply, rest


def test_a_folder_streams_into_a_store_verified_and_sealed_and_the_listener_closes(tmp_path):
    source = source_store(tmp_path, SIZES, nested=1)
    manifest = source.served_manifest("m")
    server = StreamServer(source, "m", "127.0.0.1")
    target = Store(tmp_path / "b")
    seen: list[int] = []
    copied = copy_folder(target, manifest, server.offer, no_ray, progress=seen.append)
    assert copied.transport == "tcp" and copied.bytes == manifest.total_bytes == server.sent
    assert seen[-1] == manifest.total_bytes and seen == sorted(seen)
    assert target.manifest("m") is not None and not (tmp_path / "b" / PARTIAL / "m").exists() and same(source, target)
    assert server.closed.wait(5)
    with pytest.raises(ConnectionRefusedError):  # one transfer per ticket: the listener is gone
        socket.create_connection((server.offer.host, server.offer.port), timeout=5)


def test_a_connection_without_the_ticket_gets_nothing_and_the_stream_waits_for_the_ticket(tmp_path):
    source = source_store(tmp_path, SIZES, nested=1)
    server = StreamServer(source, "m", "127.0.0.1")
    everything = (FileRange(path="f0.bin", offset=0),)
    last = server.offer.ticket[-1]
    one_off = server.offer.ticket[:-1] + ("B" if last == "A" else "A")  # never the ticket itself (one in 64 ends in A)
    for ticket, folder in (("x" * 43, "m"), (one_off, "m"), (server.offer.ticket, "other")):
        reply, rest = _ask(server.offer, StreamRequest(ticket=ticket, folder=folder, files=everything))
        assert not reply.ok and reply.code == "forbidden" and rest == b""
    with socket.create_connection((server.offer.host, server.offer.port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a request at all: closed without an answer
        try:
            answer = conn.recv(100)
        except ConnectionResetError:  # closed with the request unread
            answer = b""
        assert answer == b""
    assert server.sent == 0 and not server.closed.is_set()
    target = Store(tmp_path / "b")
    assert copy_folder(target, source.served_manifest("m"), server.offer, no_ray).transport == "tcp" and same(source, target)


@pytest.mark.parametrize("name", ["../../../etc/passwd", "sub/../f0.bin", "/etc/passwd", MANIFEST, "extra.bin", ".git/config"])
def test_names_outside_the_sources_manifest_are_refused(tmp_path, name):
    source = source_store(tmp_path, SIZES, nested=1)
    source.seal("m")
    (tmp_path / "a" / "m" / "extra.bin").write_bytes(b"written after sealing")
    (tmp_path / "a" / "m" / ".git").mkdir()
    (tmp_path / "a" / "m" / ".git" / "config").write_text("a download tool's")
    server = StreamServer(source, "m", "127.0.0.1")
    reply, rest = _ask(server.offer, StreamRequest(ticket=server.offer.ticket, folder="m", files=(FileRange(path=name, offset=0),)))
    assert not reply.ok and reply.code == "not_found" and rest == b"" and server.sent == 0


def test_the_listener_is_on_its_address_only_and_closes_when_nobody_comes(tmp_path):
    source = source_store(tmp_path, SIZES, nested=1)
    server = StreamServer(source, "m", "127.0.0.1", idle_s=0.1)
    with pytest.raises(ConnectionRefusedError):  # not on every interface: another loopback address finds nothing
        socket.create_connection(("127.0.0.2", server.offer.port), timeout=5)
    assert server.closed.wait(5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.offer.host, server.offer.port), timeout=5)
    with pytest.raises(StoreError) as e:  # a folder the store does not hold gets no stream
        StreamServer(source, "absent", "127.0.0.1")
    assert e.value.code == "not_found"


def test_a_byte_changed_at_the_source_fails_the_copy_and_nothing_is_sealed(tmp_path):
    source = source_store(tmp_path, SIZES, nested=1)
    manifest = source.seal("m")
    path = tmp_path / "a" / "m" / "f0.bin"
    data = bytearray(path.read_bytes())
    data[200_000] ^= 1  # same size: the source's manifest still lists it
    path.write_bytes(bytes(data))
    target = Store(tmp_path / "b")
    with pytest.raises(StoreError) as e:
        copy_folder(target, manifest, StreamServer(source, "m", "127.0.0.1").offer, no_ray)
    assert e.value.code == "checksum" and "f0.bin" in e.value.message
    assert target.manifest("m") is None and not (tmp_path / "b" / "m").exists()
    assert not (tmp_path / "b" / PARTIAL / "m" / "f0.bin").exists()  # the bad file is fetched again, whole
    assert not (tmp_path / "b" / PARTIAL / "m" / MANIFEST).exists()


def test_a_port_that_refuses_falls_back_to_the_ray_path_and_says_so(tmp_path):
    source = source_store(tmp_path, SIZES, nested=1)
    manifest = source.served_manifest("m")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: a firewall's refusal
    offer = StreamOffer(host="127.0.0.1", port=port, ticket="t" * 43)
    target = Store(tmp_path / "b")
    copied = copy_folder(target, manifest, offer, lambda path, offset: source.read("m", path, offset, 50_000))
    assert copied.transport == "ray" and "refused" in copied.fallback and copied.bytes == manifest.total_bytes
    assert target.manifest("m") is not None and same(source, target)
