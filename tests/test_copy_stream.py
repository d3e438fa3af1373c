"""A copy over several connections at once (cluster/stream.py's lanes) on real sockets and files, no Ray:
the files split into lanes balanced by bytes, each lane on its own connection with the one ticket, the
listener closing once the copy's lanes are in; every file verified and sealed; one lane failing stops
the others at once (a source that goes silent on one lane does not hold the copy for READ_S), keeping
what each received for a resume (over one lane, as over three); a rate cap's step is called by one lane at a time; a bad byte in one
lane's file fails the copy and seals nothing."""

import json
import os
import socket
import threading
import time
from typing import Any

import pytest
from support.stores import no_ray, same, source_store

import cluster.receiving
from cluster.store import PARTIAL, Store
from cluster.stored import StoreError
from cluster.stream import (
    MAX_LANES,
    StreamBroken,
    StreamOffer,
    StreamReply,
    StreamRequest,
    StreamServer,
    copy_folder,
    copy_lanes,
    recv_message,
    send_message,
    split_lanes,
)

SIZES = (300_000, 260_000, 200_000, 131_072, 70_000, 0)


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch):
    """64 KiB receive buffers: files of a few hundred KB take several, as a model's take many."""
    monkeypatch.setattr(cluster.receiving, "RECEIVE_BYTES", 64 * 1024)


class _Sized:
    def __init__(self, name: str, missing: int):
        self.path, self.missing = name, missing


def test_files_split_into_lanes_balanced_by_bytes_each_lane_in_the_files_order():
    files: list[Any] = [_Sized(f"f{i}", size) for i, size in enumerate((64, 64, 64, 64, 64, 64, 64, 64, 2))]
    groups = split_lanes(files, 4)
    assert len(groups) == 4 and sorted(sum(f.missing for f in g) for g in groups) == [128, 128, 128, 130]
    assert all([files.index(f) for f in g] == sorted(files.index(f) for f in g) for g in groups)
    assert sorted(f.path for g in groups for f in g) == sorted(f.path for f in files)
    assert [[f.path for f in g] for g in split_lanes(files[:2], 8)] == [["f0"], ["f1"]]  # never more lanes than files
    three: list[Any] = [_Sized("big", 1000), _Sized("a", 10), _Sized("b", 10)]
    one = split_lanes(three, 2)
    assert [[f.path for f in g] for g in one] == [["big"], ["a", "b"]]


def test_a_folder_copies_over_several_lanes_verified_and_sealed_and_the_listener_closes(tmp_path):
    source = source_store(tmp_path, SIZES)
    manifest = source.served_manifest("m")
    server = StreamServer(source, "m", "127.0.0.1")
    target = Store(tmp_path / "b")
    seen: list[int] = []
    copied = copy_folder(target, manifest, server.offer, no_ray, progress=seen.append, lanes=4)
    assert copied.transport == "tcp" and copied.lanes == 4 and copied.bytes == manifest.total_bytes
    assert seen[-1] == manifest.total_bytes and seen == sorted(seen)
    assert target.manifest("m") is not None and not (tmp_path / "b" / PARTIAL / "m").exists() and same(source, target)
    assert server.closed.wait(5) and server.sent == manifest.total_bytes and server.lanes == 4
    with pytest.raises(ConnectionRefusedError):  # the copy's lanes are in: the listener is gone
        socket.create_connection((server.offer.host, server.offer.port), timeout=5)


def test_the_node_chooses_its_lanes_and_a_bad_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ORCHARD_COPY_LANES", "3")
    assert copy_lanes() == 3
    monkeypatch.delenv("ORCHARD_COPY_LANES")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert copy_lanes() == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert copy_lanes() == 1  # a lane keeps two cores busy: a 2-core node copies over one
    for bad in ("0", "x", str(MAX_LANES + 1)):
        monkeypatch.setenv("ORCHARD_COPY_LANES", bad)
        with pytest.raises(ValueError, match="ORCHARD_COPY_LANES"):
            copy_lanes()


def test_a_lane_count_over_the_limit_is_refused_without_an_answer(tmp_path):
    server = StreamServer(source_store(tmp_path, SIZES), "m", "127.0.0.1")
    request = StreamRequest(ticket=server.offer.ticket, folder="m", files=()).model_dump(mode="json") | {"lanes": MAX_LANES + 1}
    with socket.create_connection((server.offer.host, server.offer.port), timeout=5) as conn:
        body = json.dumps(request).encode()
        conn.sendall(len(body).to_bytes(4, "big") + body)
        assert conn.recv(100) == b""
    assert server.sent == 0 and not server.closed.is_set()


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_cut_off_copy_stops_every_lane_and_resumes_from_their_offsets(tmp_path, lanes):
    source = source_store(tmp_path, SIZES)
    manifest = source.served_manifest("m")
    target = Store(tmp_path / "b")
    received = [0]

    def cut(n: int) -> None:  # the copy stops after ~300 KB, as a cancelled one does between buffers
        received[0] += n
        if received[0] > 300_000:
            raise StoreError("cancelled", "cut off")

    with pytest.raises(StoreError) as e:
        copy_folder(target, manifest, StreamServer(source, "m", "127.0.0.1").offer, no_ray, step=cut, lanes=lanes)
    assert e.value.code == "cancelled"  # the first failure, not the broken connections that followed it
    kept = target.inventory()["partial"]["m"]
    assert 300_000 < kept < manifest.total_bytes and target.manifest("m") is None
    server = StreamServer(source, "m", "127.0.0.1")
    copied = copy_folder(target, manifest, server.offer, no_ray, lanes=lanes)
    assert copied.bytes == manifest.total_bytes - kept  # only what the first copy's lanes had not written
    assert server.closed.wait(5) and server.sent == copied.bytes
    assert target.manifest("m") is not None and same(source, target)


def test_steps_come_from_one_lane_at_a_time(tmp_path):
    """A rate cap waits inside step: called by lanes at once, each would wait for itself and the cap
    would hold per lane, not for the copy."""
    source = source_store(tmp_path, SIZES)
    inside = threading.Lock()
    overlaps, calls = [0], [0]
    pause = threading.Event()

    def capped(n: int) -> None:
        if not inside.acquire(blocking=False):
            overlaps[0] += 1
            return
        try:
            calls[0] += 1
            pause.wait(0.002)  # what a rate cap does between buffers
        finally:
            inside.release()

    copied = copy_folder(
        Store(tmp_path / "b"), source.served_manifest("m"), StreamServer(source, "m", "127.0.0.1").offer, no_ray, step=capped, lanes=4
    )
    assert copied.lanes == 4 and calls[0] > 10 and overlaps[0] == 0


def test_a_bad_byte_in_one_lanes_file_fails_the_copy_and_nothing_is_sealed(tmp_path):
    source = source_store(tmp_path, SIZES)
    manifest = source.seal("m")
    path = tmp_path / "a" / "m" / "f2.bin"
    data = bytearray(path.read_bytes())
    data[100_000] ^= 1  # same size: the source's manifest still lists it
    path.write_bytes(bytes(data))
    target = Store(tmp_path / "b")
    with pytest.raises(StoreError) as e:
        copy_folder(target, manifest, StreamServer(source, "m", "127.0.0.1").offer, no_ray, lanes=4)
    assert e.value.code == "checksum" and "f2.bin" in e.value.message
    assert target.manifest("m") is None and not (tmp_path / "b" / "m").exists()
    assert not (tmp_path / "b" / PARTIAL / "m" / "f2.bin").exists()  # the bad file is fetched again, whole


def test_a_lane_whose_source_breaks_off_ends_the_copy_at_once_while_the_others_are_silent(tmp_path):
    """A source that answers every lane, sends half a file on one and closes it, and sends nothing on
    the others (their connections open): the copy ends with StreamBroken now, not after READ_S."""
    source = source_store(tmp_path, SIZES)
    manifest = source.served_manifest("m")
    listener = socket.create_server(("127.0.0.1", 0))
    offer = StreamOffer(host="127.0.0.1", port=listener.getsockname()[1], ticket="t" * 43)
    held: list[socket.socket] = []
    done = threading.Event()

    def serve() -> None:
        lanes, first = 1, b""
        while len(held) < lanes:
            conn, _ = listener.accept()
            request = StreamRequest.model_validate_json(recv_message(conn))
            lanes = request.lanes
            files = tuple(f for r in request.files for f in manifest.files if f.path == r.path)
            send_message(conn, StreamReply(ok=True, files=files))
            first = first or (source.folder("m") / files[0].path).read_bytes()[: files[0].size // 2]
            held.append(conn)
        held[0].sendall(first)
        held[0].close()
        done.wait(30)
        for conn in held[1:]:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    target = Store(tmp_path / "b")
    started = time.monotonic()
    try:
        with pytest.raises(StreamBroken):
            copy_folder(target, manifest, offer, no_ray, lanes=3)
    finally:
        done.set()
        listener.close()
    assert time.monotonic() - started < 10
    assert target.manifest("m") is None
