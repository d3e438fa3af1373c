import sys
from pathlib import Path

# Test helpers live in tests/support/ (builders, the policy oracle, cluster set-up), imported as `support.*`.
sys.path.insert(0, str(Path(__file__).parent))

import os

import pytest

from cluster.local import SERVE_ENV  # stdlib only: importing it does not import Ray

# Before any test module imports Ray (shared/ray/README.md pitfalls 1 and 2): test clusters run
# without token auth, cluster_utils nodes on 127.0.0.1, and Serve in Orchard's own mode.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
for _key, _value in SERVE_ENV.items():
    os.environ.setdefault(_key, _value)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The embedded model set, prepared once (idempotent: reruns reuse the folder)."""
    from deployments.models import prepare

    folder = Path(os.environ.get("ORCHARD_MODELS_DIR", ROOT / "models"))
    prepare(folder, log=lambda *_: None)
    return folder
