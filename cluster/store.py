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

Plain files and hashlib only: the node agent (cluster/node_agent.py) moves the chunks over Ray."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from pydantic import Field

from policy._frozen import Frozen

ENV_STORE = "ORCHARD_STORE"
MANIFEST = ".orchard-manifest.json"
PARTIAL = ".partial"
CHUNK_BYTES = 8 * 1024 * 1024  # one read or write (a copy keeps a few in flight), never a whole file in memory


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


def _checked_file(path: str) -> str:
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
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.is_dir() else 0

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

    def read(self, folder: str, path: str, offset: int, size: int) -> bytes:
        """`size` bytes (fewer at the end) of one file of a complete folder; only files its manifest
        lists. A folder put in by hand is sealed first (a peer may read from any holder)."""
        manifest = self.manifest(folder)
        if manifest is None and self.folder(folder).is_dir():
            manifest = self.seal(folder)
        if manifest is None or path not in {f.path for f in manifest.files}:
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
        }

    def copy_in(
        self,
        manifest: StoreManifest,
        read: Callable[[str, int], bytes],
        progress: Callable[[int], None] = lambda _: None,
    ) -> int:
        """Copy `manifest`'s folder in through `read(path, offset) -> bytes` (a chunk; b"" past the end),
        resuming what an earlier copy left under .partial; returns the bytes read now. Every file's
        sha256 is checked before the folder is sealed and renamed into place. `read` raising is passed
        on with the partial files kept (a caller resumes from another source). `progress(bytes)`
        after each chunk, counting resumed bytes as done."""
        folder = _checked(manifest.folder)
        partial = self.root / PARTIAL / folder
        partial.mkdir(parents=True, exist_ok=True)
        need = manifest.total_bytes
        free = shutil.disk_usage(self.root).free
        have = sum(p.stat().st_size for p in _files(partial))
        if need - have > free:
            raise StoreError("disk_full", f"{folder} needs {need - have} more bytes; {free} free in {self.root}")
        copied, done = 0, 0
        for f in manifest.files:
            target = partial / _checked_file(f.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            start = target.stat().st_size if target.exists() else 0
            if start > f.size:
                target.unlink()
                start = 0
            h = hashlib.sha256()
            if start:
                with target.open("rb") as existing:
                    while block := existing.read(CHUNK_BYTES):
                        h.update(block)
            done += start
            progress(done)
            with target.open("ab") as out:
                offset = start
                while offset < f.size:
                    chunk = read(f.path, offset)
                    if not chunk:
                        raise StoreError("not_found", f"the source ended {f.path} at {offset} of {f.size} bytes")
                    try:
                        out.write(chunk)
                    except OSError as e:
                        raise StoreError("disk_full" if e.errno == 28 else "io_error", f"writing {f.path}: {e}") from e
                    h.update(chunk)
                    offset += len(chunk)
                    copied += len(chunk)
                    done += len(chunk)
                    progress(done)
            if h.hexdigest() != f.sha256:
                target.unlink()  # a bad file is fetched again, whole
                raise StoreError("checksum", f"{folder}/{f.path}: sha256 {h.hexdigest()[:12]}… is not the source's {f.sha256[:12]}…")
        sealed = manifest.model_copy(update={"sealed_at": time.time()})
        _write_atomically(partial / MANIFEST, sealed.model_dump_json())
        final = self.folder(folder)
        if final.exists():  # an unsealed or broken folder of the same name: the verified copy wins
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        return copied

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
