"""What a node's store holds, as its peers and transports see it: a folder's manifest (its files,
sizes and sha256), the error a store raises (which crosses Ray as itself), and the checks on folder
and file names that keep every path inside the store."""

import hashlib
from pathlib import Path, PurePosixPath

from pydantic import Field

from policy._frozen import Frozen

MANIFEST = ".orchard-manifest.json"
CHUNK_BYTES = 8 * 1024 * 1024  # one read or write (a copy keeps a few in flight), never a whole file in memory


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


def checked_folder(folder: str) -> str:
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


def checked_files(paths: list[str]) -> list[str]:
    """A folder's file paths, each checked, none twice and none a folder of another (a peer's
    manifest listing `a` and `a/b` could not be written)."""
    checked = [checked_file(p) for p in paths]
    folders = {str(parent) for p in checked for parent in PurePosixPath(p).parents}
    clash = next((p for p in checked if p in folders), None) or next((p for p in checked if checked.count(p) > 1), None)
    if clash is not None:
        raise StoreError("bad_request", f"a manifest lists {clash!r} twice, or as a file and a folder")
    return checked


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
