"""Builders of the embedded model set, one module per model, all offline.

Each module exposes `NAME`, `KIND` and `build(dest: Path) -> ManifestEntry`, which writes a folder
that the kind's real loader opens (`mlx_lm.load(path)`, `mlx_embeddings.load(path)`, ...). Builders
are idempotent: a finished folder carries a `.orchard-ready` marker with the builder's VERSION, and
a second call returns at once."""

import json
import shutil
from pathlib import Path

MARKER = ".orchard-ready"


def is_ready(dest: Path, version: str) -> bool:
    marker = Path(dest) / MARKER
    return marker.exists() and json.loads(marker.read_text()).get("version") == version


def mark_ready(dest: Path, version: str) -> None:
    (Path(dest) / MARKER).write_text(json.dumps({"version": version}) + "\n")


def fresh_dir(dest: Path) -> Path:
    """Empty `dest` (a half-built folder from an interrupted run is discarded)."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return dest
