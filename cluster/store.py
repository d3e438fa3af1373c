"""A node's model store: complete model folders, each sealed by a manifest, and partial copies.

Layout under the store's root (the node's ORCHARD_STORE environment variable, as `ray start` got it:
Ray labels cannot hold a path; default ~/.cache/orchard/models):

    <root>/<folder>/...                      a complete model folder (the registry's `path`, or its name)
    <root>/<folder>/.orchard-manifest.json   files, sizes, sha256, source, revision; written last, atomically
    <root>/.partial/<folder>/...             a copy in progress (or cut off): never loaded, resumed later

A folder is complete when its manifest is there and every file it lists has its size. A folder that
was put in the store by hand (the prepared set on the head, weights copied with rsync) has no manifest
until `seal` hashes it. A copy is written under .partial, every file's sha256 checked against the
source's manifest, the manifest written, and the folder renamed into place in one step: a partial
copy never looks complete, and a crash leaves only a partial one, which the next copy resumes.

Plain files and hashlib only: the bytes come in through `receive` from a transport (cluster/stream.py:
a direct stream between node agents, or chunks read over Ray calls), which fills each IncomingFile;
the store writes them, hashes them as they arrive and seals what verifies."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from pydantic import Field

from policy._frozen import Frozen

ENV_STORE = "ORCHARD_STORE"
MANIFEST = ".orchard-manifest.json"
PARTIAL = ".partial"
KERNELS = ".kernels"  # MLX's compiled CUDA kernels, kept across model servers (deployments/model_server.py keep_kernels)
PREFIXES = ".prefixes"  # the block prefix cache's disk tier (deployments/engines/prefix_disk.py's DIR_NAME), with its own budget
CHUNK_BYTES = 8 * 1024 * 1024  # one read or write (a copy keeps a few in flight), never a whole file in memory
# A stream is received into a ring of RECEIVE_DEPTH buffers of RECEIVE_BYTES: one being received into
# and written from while the hash thread reads the others. Small on purpose: on the 2-core VM a ring of
# 4 x 4 MiB made every write() and recv() copy dearer than one of 4 x 1 MiB (bench.fetch).
RECEIVE_BYTES = 1024 * 1024
RECEIVE_DEPTH = 4


def default_root() -> Path:
    return Path.home() / ".cache" / "orchard" / "models"


class StoredFile(Frozen):
    path: str = Field(min_length=1)  # relative, POSIX
    size: int = Field(ge=0)
    sha256: str = Field(min_length=64, max_length=64)


class StoreManifest(Frozen):
    folder: str = Field(min_length=1)
    files: tuple[StoredFile, ...]
    source: str = ""  # "local" (sealed where it was), "peer:<node>", "hub:<repo>"
    revision: str | None = None
    sealed_at: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class StoreError(Exception):
    """code: not_found (no such folder or file), checksum (a copied file's sha256 differs), disk_full,
    bad_request (a path outside the folder)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses Ray as itself (the default would call __init__ with the message alone)
        return (StoreError, (self.code, self.message))


def _checked(folder: str) -> str:
    """A store folder name: relative, no '..', no hidden first component."""
    parts = PurePosixPath(folder).parts
    if not parts or PurePosixPath(folder).is_absolute() or any(p in ("..", "") or p.startswith(".") for p in parts):
        raise StoreError("bad_request", f"not a store folder: {folder!r}")
    return str(PurePosixPath(*parts))


def checked_file(path: str) -> str:
    """A file's path inside a folder: relative, no '..' (hidden names are fine: a loader's marker)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or any(p in ("..", "") for p in parts) or parts[-1].startswith(MANIFEST):
        raise StoreError("bad_request", f"not a file of a model folder: {path!r}")
    return str(PurePosixPath(*parts))


def sha256_of(path: Path, upto: int | None = None) -> str:
    h = hashlib.sha256()
    left = upto
    with path.open("rb") as f:
        while left is None or left > 0:
            block = f.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h.hexdigest()


def _files(folder: Path) -> Iterator[Path]:
    """A model folder's files: hidden files too (a loader's marker), but not the manifest nor what
    hidden folders hold (a download tool's cache, .git)."""
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not rel.name.startswith(MANIFEST) and not any(part.startswith(".") for part in rel.parts[:-1]):
            yield path


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Store:
    """`budget_bytes`: the most this store may hold (label orchard.disk_budget_gib); None: the disk's free
    space is the only limit."""

    def __init__(self, root: str | Path, budget_bytes: int | None = None):
        self.root = Path(root)
        self.budget_bytes = budget_bytes

    def used_bytes(self) -> int:
        """What the store's folders hold (.partial included); the prefix tier beside them has its own budget."""
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file() and p.relative_to(self.root).parts[0] not in (PREFIXES, KERNELS))

    def prefix_bytes(self) -> int:
        """What the block prefix cache's disk tier holds beside the store (its model servers keep it
        within its own budget: deployments/engines/prefix_disk.py)."""
        tier = self.root / PREFIXES
        return sum(p.stat().st_size for p in tier.glob("*/*.safetensors") if p.is_file()) if tier.is_dir() else 0

    def touch(self, folder: str) -> None:
        """Mark the folder used now (a model server loaded from it): the disk budget removes the least
        recently used folders first."""
        base = self.folder(folder)
        target = base / MANIFEST if (base / MANIFEST).exists() else base
        if target.exists():
            os.utime(target)

    def mark_unused(self, folder: str) -> None:
        """Mark the folder never used (a background copy): the disk budget removes it before any
        folder a model server loaded from, until one does (touch)."""
        target = self.folder(folder) / MANIFEST
        if target.exists():
            os.utime(target, (0, 0))

    def _last_used(self, folder: str) -> float:
        base = self.folder(folder)
        target = base / MANIFEST if (base / MANIFEST).exists() else base
        return target.stat().st_mtime

    def make_room(self, folder: str, total_bytes: int, keep: frozenset[str] = frozenset()) -> list[str]:
        """Before copying `folder` (total_bytes in all) in: remove stored folders, least recently used
        first, until it fits the budget and the disk; never `folder` itself nor one in `keep` (in
        use on this node, or being copied in). The removed folders; StoreError(disk_full) naming what
        stands in the way when removing every other folder would not be enough."""
        partial = self.root / PARTIAL / _checked(folder)
        have = sum(p.stat().st_size for p in _files(partial)) if partial.is_dir() else 0
        need = total_bytes - have
        removed: list[str] = []

        def short() -> int:
            over_budget = self.used_bytes() + need - self.budget_bytes if self.budget_bytes is not None else 0
            over_disk = need - shutil.disk_usage(self.root).free if self.root.is_dir() else 0
            return max(over_budget, over_disk)

        while short() > 0:
            inventory = self.inventory()
            stored = set(inventory["complete"]) | set(inventory["unsealed"])
            candidates = sorted((f for f in stored if f != folder and f not in keep), key=self._last_used)
            if not candidates:
                budget = f"the store's budget of {self.budget_bytes} bytes" if self.budget_bytes is not None else "the free disk"
                used = ", ".join(sorted(stored & keep)) or "nothing else"
                raise StoreError("disk_full", f"{folder} needs {short()} more bytes than {budget} allows at {self.root}; in use there: {used}")
            self.remove(candidates[0])
            removed.append(candidates[0])
        return removed

    def folder(self, folder: str) -> Path:
        return self.root / _checked(folder)

    def manifest(self, folder: str) -> StoreManifest | None:
        """The folder's manifest if the folder is complete (manifest there, every file at its size)."""
        base = self.folder(folder)
        try:
            manifest = StoreManifest.model_validate_json((base / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if manifest.folder != _checked(folder):  # a folder copied in by hand under another name: unsealed
            return None
        for f in manifest.files:
            try:
                if (base / f.path).stat().st_size != f.size:
                    return None
            except OSError:
                return None
        return manifest

    def seal(self, folder: str, source: str = "local") -> StoreManifest:
        """The manifest of a complete folder, hashing its files first if it has none (a folder put in
        the store by hand). StoreError(not_found) if the folder is not there or holds no files."""
        existing = self.manifest(folder)
        if existing is not None:
            return existing
        base = self.folder(folder)
        (base / MANIFEST).unlink(missing_ok=True)  # a stale or foreign one
        files = (
            [StoredFile(path=p.relative_to(base).as_posix(), size=p.stat().st_size, sha256=sha256_of(p)) for p in _files(base)]
            if base.is_dir()
            else []
        )
        if not files:
            raise StoreError("not_found", f"no model folder {folder} in the store at {self.root}")
        manifest = StoreManifest(folder=_checked(folder), files=tuple(files), source=source, sealed_at=time.time())
        _write_atomically(base / MANIFEST, manifest.model_dump_json())
        return manifest

    def served_manifest(self, folder: str) -> StoreManifest:
        """The manifest of a folder this store serves to a peer: a complete one, or one put in by hand,
        sealed now (a peer may read from any holder). StoreError(not_found) if there is none."""
        manifest = self.manifest(folder)
        if manifest is None and self.folder(folder).is_dir():
            manifest = self.seal(folder)
        if manifest is None:
            raise StoreError("not_found", f"{folder} is not in the store at {self.root}")
        return manifest

    def read(self, folder: str, path: str, offset: int, size: int) -> bytes:
        """`size` bytes (fewer at the end) of one file of a complete folder; only files its manifest
        lists."""
        manifest = self.served_manifest(folder)
        if path not in {f.path for f in manifest.files}:
            raise StoreError("not_found", f"{folder}/{path} is not in the store at {self.root}")
        with (self.folder(folder) / path).open("rb") as f:
            f.seek(offset)
            return f.read(min(size, CHUNK_BYTES))

    def inventory(self) -> dict:
        """{"root", "free_bytes", "budget_bytes", "used_bytes", "complete": {folder: bytes}, "unsealed":
        {...}, "partial": {...}}. A folder without a manifest counts as complete only once sealed;
        until then it is listed under "unsealed" (the holder seals it when a peer first asks for it).
        What is not a store folder (a manifest under a hidden directory) is left out."""
        complete: dict[str, int] = {}
        unsealed: dict[str, int] = {}
        partial: dict[str, int] = {}
        for manifest_path in sorted(self.root.glob(f"**/{MANIFEST}")) if self.root.is_dir() else ():
            folder = manifest_path.parent.relative_to(self.root).as_posix()
            if folder.startswith(PARTIAL):
                continue
            try:
                manifest = self.manifest(folder)
            except StoreError:  # not a store folder name
                continue
            if manifest is not None:
                complete[folder] = manifest.total_bytes
        for child in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if child.is_dir() and not child.name.startswith(".") and child.name not in complete and (child / "config.json").is_file():
                unsealed[child.name] = sum(p.stat().st_size for p in _files(child))
        partial_root = self.root / PARTIAL
        for manifest_path in sorted(partial_root.glob("**/*")) if partial_root.is_dir() else ():
            if manifest_path.is_file():
                folder = manifest_path.relative_to(partial_root).parts[0]
                partial[folder] = partial.get(folder, 0) + manifest_path.stat().st_size
        free = shutil.disk_usage(self.root).free if self.root.is_dir() else 0
        return {
            "root": str(self.root),
            "free_bytes": free,
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "complete": complete,
            "unsealed": unsealed,
            "partial": partial,
            "prefix_bytes": self.prefix_bytes(),
        }

    def copy_in(
        self,
        manifest: StoreManifest,
        read: Callable[[str, int], bytes],
        progress: Callable[[int], None] = lambda _: None,
    ) -> int:
        """Copy `manifest`'s folder in through `read(path, offset) -> bytes` (a chunk; b"" past the end),
        as `receive` does; the transport of chunks asked for one by one (Ray calls)."""

        def pull(files: list[IncomingFile]) -> None:
            for f in files:
                while f.missing:
                    chunk = read(f.path, f.offset)
                    if not chunk:
                        raise StoreError("not_found", f"the source ended {f.path} at {f.offset} of {f.expected.size} bytes")
                    f.write(chunk[: f.missing])

        return self.receive(manifest, pull, progress)

    def receive(
        self,
        manifest: StoreManifest,
        transfer: Callable[[list[IncomingFile]], None],
        progress: Callable[[int], None] = lambda _: None,
    ) -> int:
        """Copy `manifest`'s folder in: `transfer(files)` fills each IncomingFile from its offset (what an
        earlier copy left under .partial is resumed, not fetched again); returns the bytes received now.
        Every file's sha256, computed as its bytes arrive, is checked against the manifest's before the
        folder is sealed and renamed into place; a file that differs is removed (fetched again, whole)
        and StoreError(checksum) raised. `transfer` raising is passed on with the partial files kept (a
        caller resumes from another source). `progress(bytes)` after each write, counting resumed bytes
        as done."""
        folder = _checked(manifest.folder)
        partial = self.root / PARTIAL / folder
        partial.mkdir(parents=True, exist_ok=True)
        need = manifest.total_bytes
        free = shutil.disk_usage(self.root).free
        have = sum(p.stat().st_size for p in _files(partial))
        if need - have > free:
            raise StoreError("disk_full", f"{folder} needs {need - have} more bytes; {free} free in {self.root}")
        with _Receiving(folder, progress) as receiving:
            files = [IncomingFile(f, partial / checked_file(f.path), receiving) for f in manifest.files]
            receiving.start(sum(f.offset for f in files))
            transfer(files)
            for f in files:
                if f.missing:
                    raise StoreError("not_found", f"the source ended {f.path} at {f.offset} of {f.expected.size} bytes")
                f.finish()
            receiving.verify_all()
        sealed = manifest.model_copy(update={"sealed_at": time.time()})
        _write_atomically(partial / MANIFEST, sealed.model_dump_json())
        final = self.folder(folder)
        if final.exists():  # an unsealed or broken folder of the same name: the verified copy wins
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        return receiving.received

    def seal_partial(self, folder: str, source: str, revision: str | None = None) -> StoreManifest:
        """Seal a folder that a download tool filled under .partial (every file hashed), then rename it
        into place: for downloads, whose files carry no manifest to check them against."""
        folder = _checked(folder)
        partial = self.root / PARTIAL / folder
        files = [StoredFile(path=p.relative_to(partial).as_posix(), size=p.stat().st_size, sha256=sha256_of(p)) for p in _files(partial)]
        if not files:
            raise StoreError("not_found", f"the download of {folder} left no files")
        manifest = StoreManifest(folder=folder, files=tuple(files), source=source, revision=revision, sealed_at=time.time())
        _write_atomically(partial / MANIFEST, manifest.model_dump_json())
        final = self.folder(folder)
        if final.exists():
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        return manifest

    def remove(self, folder: str) -> bool:
        """Remove a stored folder (complete or partial); whether there was one."""
        found = False
        for path in (self.folder(folder), self.root / PARTIAL / _checked(folder)):
            if path.exists():
                shutil.rmtree(path)
                found = True
        return found


class _Receiving:
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
        self._lanes: dict[int, _Lane] = {}
        self._open: list[IncomingFile] = []
        self._checks: list[IncomingFile] = []

    def __enter__(self) -> _Receiving:
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

    def lane(self) -> _Lane:
        """The calling thread's lane, made on its first use."""
        with self._lock:
            lane = self._lanes.get(threading.get_ident())
            if lane is None:
                lane = self._lanes[threading.get_ident()] = _Lane(len(self._lanes))
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


class _Lane:
    """One filling thread's ring of receive buffers and its hash thread (see _Receiving). A stream is
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

    def __init__(self, expected: StoredFile, target: Path, receiving: _Receiving):
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
        self._lane: _Lane | None = None  # the lane that hashes this file's bytes, in order
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

    def _hasher(self) -> _Lane:
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
