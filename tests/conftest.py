import sys
from pathlib import Path

# Test helpers live in tests/support/ (builders, the policy oracle, cluster set-up), imported as `support.*`.
sys.path.insert(0, str(Path(__file__).parent))

import fcntl
import os
import shutil
from collections.abc import Iterator

import pytest

from cluster.environment import SERVE_ENV, session_token_env  # importing it does not import Ray

# Before any test module imports Ray (shared/ray/README.md pitfalls 1 and 2): test clusters run with
# Ray's token auth, as every Orchard cluster does, on a token made for this session (in the environment
# only, which every node and worker inherits: never written to a file), cluster_utils nodes on 127.0.0.1
# (Ray's servers then listen on loopback only), and Serve in Orchard's own mode. cluster.local's clusters
# get a token of their own (cluster/environment.py ray_env).
os.environ.update(session_token_env())
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
for _key, _value in SERVE_ENV.items():
    os.environ.setdefault(_key, _value)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The embedded model set, prepared once (idempotent: reruns reuse the folder)."""
    from deployments.models import prepare

    folder = Path(os.environ.get("ORCHARD_MODELS_DIR", ROOT / "models"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".prepare.lock", "w") as lock:  # `make test` runs two pytest workers: one builds, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        prepare(folder, log=lambda *_: None)
    return folder


@pytest.fixture(scope="module")
def broken_dir(models_dir, tmp_path_factory):
    """A copy of llama-10m whose weights are truncated (what a failed download leaves)."""
    folder = tmp_path_factory.mktemp("broken") / "broken-llama"
    shutil.copytree(models_dir / "llama-10m", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    return folder


# ---- the shared Ray cluster (tests/support/shared_cluster.py) --------------------------------------

SHARED_FIXTURE = "shared_ray"


def _module_of(item: pytest.Item) -> pytest.Module | None:
    return item.getparent(pytest.Module)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules marked `cluster` run first and one after another, and of those the ones that share
    the Ray cluster come first (in their usual order), so it is started once and gone before any module
    starts a cluster of its own. `make test` runs them in one pytest process and the other tests in a
    second one beside it (the Makefile), so there is one Ray cluster at a time."""
    shared = {_module_of(item) for item in items if SHARED_FIXTURE in getattr(item, "fixturenames", ())}
    cluster = {_module_of(item) for item in items if item.get_closest_marker("cluster")}
    for item in items:
        if _module_of(item) in shared and _module_of(item) not in cluster:
            raise pytest.UsageError(f"{item.nodeid} uses the shared Ray cluster: its module needs `pytestmark = pytest.mark.cluster`")
    order = {module: 0 if module in shared else 1 if module in cluster else 2 for module in {_module_of(item) for item in items}}
    items.sort(key=lambda item: order[_module_of(item)])  # stable: the usual order within each part


@pytest.fixture(scope="module")
def shared_ray(request: pytest.FixtureRequest) -> Iterator[str]:
    """The shared cluster's head (its Ray node id), reset after each module and shut down after the last."""
    from support.shared_cluster import SHARED

    request.config.add_cleanup(SHARED.shutdown)  # also on -x or Ctrl-C (idempotent)
    node = SHARED.acquire()
    yield node
    SHARED.reset()
    items = request.session.items
    mine = [i for i, item in enumerate(items) if _module_of(item) is request.node]
    if not any(SHARED_FIXTURE in getattr(item, "fixturenames", ()) for item in items[max(mine) + 1 :]):
        SHARED.shutdown()
