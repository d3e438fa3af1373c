import sys
from pathlib import Path

# Test helpers (builders.py, oracles) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

import os

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The embedded model set, prepared once (idempotent: reruns reuse the folder)."""
    from deployments.models import prepare

    folder = Path(os.environ.get("ORCHARD_MODELS_DIR", ROOT / "models"))
    prepare(folder, log=lambda *_: None)
    return folder
