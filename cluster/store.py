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
a direct stream between node agents, or chunks read over Ray calls), which fills each IncomingFile
(cluster/receiving.py); the store writes them, hashes them as they arrive and seals what verifies."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cluster.receiving import IncomingFile, Receiving
from cluster.stored import CHUNK_BYTES, MANIFEST, StoredFile, StoreError, StoreManifest, checked_files, checked_folder, sha256_of

ENV_STORE = "ORCHARD_STORE"
PARTIAL = ".partial"
KERNELS = ".kernels"  # MLX's compiled CUDA kernels, kept across model servers (deployments/spare.py keep_kernels)
PREFIXES = ".prefixes"  # the block prefix cache's disk tier (deployments/engines/prefix_disk.py's DIR_NAME), with its own budget


def default_root() -> Path:
    return Path.home() / ".cache" / "orchard" / "models"


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
        partial = self.root / PARTIAL / checked_folder(folder)
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
        return self.root / checked_folder(folder)

    def manifest(self, folder: str) -> StoreManifest | None:
        """The folder's manifest if the folder is complete (manifest there, every file at its size)."""
        base = self.folder(folder)
        try:
            manifest = StoreManifest.model_validate_json((base / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if manifest.folder != checked_folder(folder):  # a folder copied in by hand under another name: unsealed
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
        manifest = StoreManifest(folder=checked_folder(folder), files=tuple(files), source=source, sealed_at=time.time())
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
        folder = checked_folder(manifest.folder)
        paths = checked_files([f.path for f in manifest.files])
        partial = self.root / PARTIAL / folder
        partial.mkdir(parents=True, exist_ok=True)
        need = manifest.total_bytes
        free = shutil.disk_usage(self.root).free
        have = sum(p.stat().st_size for p in _files(partial))
        if need - have > free:
            raise StoreError("disk_full", f"{folder} needs {need - have} more bytes; {free} free in {self.root}")
        with Receiving(folder, progress) as receiving:
            files = [IncomingFile(f, partial / path, receiving) for f, path in zip(manifest.files, paths, strict=True)]
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
        folder = checked_folder(folder)
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
        for path in (self.folder(folder), self.root / PARTIAL / checked_folder(folder)):
            if path.exists():
                shutil.rmtree(path)
                found = True
        return found
