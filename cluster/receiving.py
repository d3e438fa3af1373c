"""A copy coming into a store (cluster/store.py `Store.receive`): each file written at its offset as
its bytes arrive and hashed beside the receiving, one lane (a ring of buffers and a hash thread) per
thread that fills files, and every file's sha256 checked against the source's manifest."""

from __future__ import annotations

import errno
import hashlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from cluster.stored import CHUNK_BYTES, StoredFile, StoreError

# A stream is received into a ring of RECEIVE_DEPTH buffers of RECEIVE_BYTES: one being received into
# and written from while the hash thread reads the others. Small on purpose: on the 2-core VM a ring of
# 4 x 4 MiB made every write() and recv() copy dearer than one of 4 x 1 MiB (bench.fetch).
RECEIVE_BYTES = 1024 * 1024
RECEIVE_DEPTH = 4


class Receiving:
    """One `Store.receive`: its byte counts, its files' verdicts, and one lane per thread that fills
    files. A transport may fill several files at once, one per thread (cluster/stream.py's parallel
    connections); each thread gets a lane of its own on its first buffer.

    A lane is a ring of RECEIVE_DEPTH reusable buffers of RECEIVE_BYTES and a hash thread of its own:
    sha256 runs beside the receiving, in the order the bytes were written (hashlib releases the GIL on
    large buffers), so receiving and writing one piece overlaps hashing the last, and lanes side by
    side hash on as many cores as they have. No piece is allocated: the socket writes into the ring."""

    def __init__(self, folder: str, progress: Callable[[int], None]):
        self.folder = folder
        self.progress = progress
        self.done = 0
        self.received = 0
        self._lock = threading.Lock()  # counts, verdicts and lanes are shared by the filling threads
        self._lanes: dict[int, Lane] = {}
        self._open: list[IncomingFile] = []
        self._checks: list[IncomingFile] = []

    def __enter__(self) -> Receiving:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open:
            f.close()
        for lane in self._lanes.values():
            lane.close()

    def start(self, resumed: int) -> None:
        self.done = resumed
        self.progress(self.done)

    def opened(self, f: IncomingFile) -> None:
        with self._lock:
            self._open.append(f)

    def lane(self) -> Lane:
        """The calling thread's lane, made on its first use."""
        with self._lock:
            lane = self._lanes.get(threading.get_ident())
            if lane is None:
                lane = self._lanes[threading.get_ident()] = Lane(len(self._lanes))
            return lane

    def finished(self, f: IncomingFile) -> None:
        with self._lock:
            self._checks.append(f)

    def wrote(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.received += n
            self.progress(self.done)
        self.check(wait=False)

    def check(self, wait: bool) -> None:
        """Verify the files whose digest is known (all of them with `wait`); StoreError(checksum) for
        the first that differs from the manifest, which is removed."""
        while True:
            with self._lock:
                ready = [f for f in self._checks if wait or f.verdict_ready()]
                if not ready:
                    return
                self._checks.remove(ready[0])
            ready[0].verify()

    def verify_all(self) -> None:
        self.check(wait=True)


class Lane:
    """One filling thread's ring of receive buffers and its hash thread (see Receiving). A stream is
    received into the ring piece by piece as the socket gives them; each piece is written at once, and
    a buffer's bytes are hashed in one job once it is full or its file ends. A buffer is handed out
    again only once the job that read it is done; chunks that come as bytes (the Ray path) are hashed
    one job each, RECEIVE_DEPTH at most waiting."""

    def __init__(self, number: int):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"orchard-sha256-{number}")
        self._ring: list[bytearray] = []
        self._busy: list[Future | None] = []  # per buffer of the ring, the last job that reads it
        self._turn = -1
        self._batch: tuple = ()  # (sha, buffer, start, end): received bytes of the current buffer not yet given to the hash thread
        self._jobs: deque[Future] = deque()  # jobs hashing chunks that came as bytes

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def buffer(self) -> memoryview:
        """The next buffer of the ring, once no hash job reads it any more."""
        self._flush()
        if not self._ring:
            self._ring = [bytearray(RECEIVE_BYTES) for _ in range(RECEIVE_DEPTH)]
            self._busy = [None] * RECEIVE_DEPTH
        self._turn = (self._turn + 1) % RECEIVE_DEPTH
        if (reading := self._busy[self._turn]) is not None:
            reading.result()
        return memoryview(self._ring[self._turn])

    def hash_piece(self, sha, buffer: memoryview, start: int, end: int) -> None:
        """Bytes start:end of the current buffer, hashed with the rest of the buffer in one job (one
        call that releases the GIL once, not one per piece the socket gave)."""
        if self._batch and self._batch[0] is sha and self._batch[1] is buffer and self._batch[3] == start:
            start = self._batch[2]
        else:
            self._flush()
        self._batch = (sha, buffer, start, end)

    def _flush(self) -> None:
        if self._batch:
            sha, buffer, start, end = self._batch
            self._busy[self._turn] = self._pool.submit(sha.update, buffer[start:end])
            self._batch = ()

    def hash_chunk(self, sha, chunk: bytes) -> None:
        self._flush()
        while len(self._jobs) >= RECEIVE_DEPTH:
            self._jobs.popleft().result()
        self._jobs.append(self._pool.submit(sha.update, chunk))

    def digest(self, sha) -> Future:
        """The hex digest once every byte this lane gave the hash thread before is hashed."""
        self._flush()
        return self._pool.submit(sha.hexdigest)


class IncomingFile:
    """One file of a copy: written under .partial from `offset` on, hashed as its bytes arrive and
    verified against the manifest's sha256 once its last byte is in. A transport fills it with
    `write(chunk)`, or without a copy with `buffer()` (receive into it) and `commit(n)` for each piece
    of that buffer the socket gives, in order; one thread at a time fills a file, several files may be
    filled at once from threads of their own."""

    def __init__(self, expected: StoredFile, target: Path, receiving: Receiving):
        self.expected = expected
        self._target = target
        self._receiving = receiving
        have = target.stat().st_size if target.exists() else 0
        if have > expected.size:  # not a prefix of this file: fetched again, whole
            target.unlink()
            have = 0
        self.offset = have
        self._sha = hashlib.sha256()
        self._out: BinaryIO | None = None
        self._digest: Future | None = None
        self._lane: Lane | None = None  # the lane that hashes this file's bytes, in order
        self._buffer = memoryview(b"")  # the last buffer handed out, and how much of it is received
        self._filled = 0

    @property
    def path(self) -> str:
        return self.expected.path

    @property
    def missing(self) -> int:
        return self.expected.size - self.offset

    def _opened(self) -> BinaryIO:
        if self._out is None:
            self._target.parent.mkdir(parents=True, exist_ok=True)
            if self.offset:  # resumed: the bytes an earlier copy wrote are hashed first, read back once
                with self._target.open("rb") as existing:
                    while block := existing.read(CHUNK_BYTES):
                        self._sha.update(block)
            self._out = self._target.open("ab", buffering=0)
            self._receiving.opened(self)
        return self._out

    def _hasher(self) -> Lane:
        if self._lane is None:
            self._lane = self._receiving.lane()
        return self._lane

    def buffer(self) -> memoryview:
        """A buffer to receive this file's next bytes into, at most `missing`: receive into it in order,
        `commit(n)` after each piece."""
        self._opened()
        self._buffer = self._hasher().buffer()[: self.missing]
        self._filled = 0
        return self._buffer

    def commit(self, n: int) -> None:
        """The next `n` bytes of the buffer are received: written now, hashed soon after."""
        start, self._filled = self._filled, self._filled + n
        self._write(self._buffer[start : self._filled])
        self._hasher().hash_piece(self._sha, self._buffer, start, self._filled)
        self._advance(n)

    def write(self, chunk: bytes) -> None:
        self._write(chunk)
        self._hasher().hash_chunk(self._sha, chunk)
        self._advance(len(chunk))

    def _write(self, data: bytes | memoryview) -> None:
        if len(data) > self.missing:
            raise StoreError("bad_request", f"{self.path}: {len(data)} bytes more than the {self.missing} missing")
        out = self._opened()
        view = memoryview(data)
        try:
            written = 0
            while written < len(view):  # an unbuffered write may take part of it
                written += out.write(view[written:]) or 0
        except OSError as e:
            raise StoreError("disk_full" if e.errno == errno.ENOSPC else "io_error", f"writing {self.path}: {e}") from e

    def _advance(self, n: int) -> None:
        self.offset += n
        if not self.missing:
            self.finish()
        self._receiving.wrote(n)

    def finish(self) -> None:
        """Every byte is in: closed, and its digest asked of the hash thread that hashed it (once)."""
        if self._digest is None:
            self._opened()
            self.close()
            self._digest = self._hasher().digest(self._sha)
            self._receiving.finished(self)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()

    def verdict_ready(self) -> bool:
        return self._digest is not None and self._digest.done()

    def verify(self) -> None:
        assert self._digest is not None
        got = self._digest.result()
        if got != self.expected.sha256:
            self._target.unlink(missing_ok=True)  # a bad file is fetched again, whole
            folder = self._receiving.folder
            raise StoreError("checksum", f"{folder}/{self.path}: sha256 {got[:12]}… is not the source's {self.expected.sha256[:12]}…")
