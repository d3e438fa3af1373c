"""Stores on disk for the copy tests (test_store_stream, test_copy_stream): a source store holding one
folder of random files, the Ray-call path a direct-stream test must never take, and the check that a
copy landed every file whole."""

import hashlib
import os
from pathlib import Path

from cluster.store import Store


def source_store(tmp_path: Path, sizes: tuple[int, ...], nested: int | None = None) -> Store:
    """Store `a` holding folder `m`: files f0.bin ... of these sizes (file `nested` inside sub/) and a config.json."""
    base = tmp_path / "a" / "m"
    (base / "sub").mkdir(parents=True)
    for i, size in enumerate(sizes):
        (base / ("sub" if i == nested else "") / f"f{i}.bin").write_bytes(os.urandom(size))
    (base / "config.json").write_text("{}")
    return Store(tmp_path / "a")


def no_ray(path: str, offset: int) -> bytes:
    raise AssertionError("the Ray-call path was used")


def same(source: Store, target: Store, folder: str = "m") -> bool:
    """Every file of the source's manifest is in the target, whole: its hash is the manifest's and the source's."""
    manifest = source.manifest(folder)
    assert manifest is not None
    return all(
        hashlib.sha256((target.folder(folder) / f.path).read_bytes()).hexdigest()
        == f.sha256
        == hashlib.sha256((source.folder(folder) / f.path).read_bytes()).hexdigest()
        for f in manifest.files
    )
