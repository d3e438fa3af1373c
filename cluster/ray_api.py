"""The one place Orchard reaches past Ray's public API, and the namespace its actors live in.

Ray 2.60 has no public call for these: an actor's id from its handle, one actor's row of the GCS
actor table (state, worker pid, death cause) without the dashboard's state API, the head node's
resource name, the dashboard's address, and the GCS key-value store with a timeout (stored
Responses, router/protocols/responses/store.py). When Ray moves one, this module is what changes.
(cluster/local.py's launcher patches two of Ray's private constants inside the `ray start` process
it spawns; that shim says why.)"""

from typing import Any

# Every Orchard actor (model servers, node agents) and the operator's GCS keys live in this namespace.
NAMESPACE = "orchard"


def head_node_resource() -> str:
    """The custom resource only the head node offers (to pin the residency service there)."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    return HEAD_NODE_RESOURCE_NAME


def on_head() -> dict[str, Any]:
    """Ray actor options that put an actor on the head node (a worker node that dies must not take
    the cluster view, or the one ingress of a single-ingress app, with it)."""
    return {"num_cpus": 0, "resources": {head_node_resource(): 0.001}}


def actor_id(handle: Any) -> str:
    """The hex id of the actor behind a handle: an actor placed again under the same name is a new id."""
    return handle._actor_id.hex()


def actor_record(actor_id_hex: str) -> dict[str, Any]:
    """The GCS actor table's row of one actor (State, Pid, Name, DeathCause, EndTime ...); {} if none."""
    from ray._private import state

    return state.actors(actor_id=actor_id_hex) or {}


def all_actor_records() -> dict[str, dict[str, Any]]:
    """Every row of the GCS actor table, by actor id."""
    from ray._private import state

    return state.actors()


def serve_controller() -> Any:
    """Ray Serve's controller actor (its name and namespace are Serve's private constants)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def validate_labels(labels: dict[str, str]) -> None:
    """Ray's own check of node labels (raises ValueError as Ray would at `ray start`)."""
    from ray._private.label_utils import validate_node_label_syntax

    validate_node_label_syntax(labels)


def dashboard_address(timeout_s: float = 2.0) -> str | None:
    """host:port where the Ray dashboard serves, as its head process records it in the GCS (Ray's
    `webui:url` key), or None when the cluster runs without a dashboard."""
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    value = internal_kv_get_gcs_client().internal_kv_get(b"webui:url", b"dashboard", timeout=timeout_s)
    return value.decode() if value else None


def _gcs() -> Any:
    """The connected worker's GCS client, the one Ray's internal_kv uses."""
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    return internal_kv_get_gcs_client()


def kv_get(key: str, timeout_s: float) -> bytes | None:
    """One value of Ray's GCS key-value store (Orchard's namespace), or None."""
    return _gcs().internal_kv_get(key.encode(), NAMESPACE.encode(), timeout=timeout_s)


def kv_put(key: str, value: bytes, timeout_s: float) -> None:
    _gcs().internal_kv_put(key.encode(), value, True, NAMESPACE.encode(), timeout=timeout_s)


def kv_delete(key: str, timeout_s: float) -> None:
    _gcs().internal_kv_del(key.encode(), False, NAMESPACE.encode(), timeout=timeout_s)


def kv_keys(prefix: str, timeout_s: float) -> list[str]:
    """The keys under `prefix` in Orchard's namespace."""
    return [k.decode() for k in _gcs().internal_kv_keys(prefix.encode(), NAMESPACE.encode(), timeout=timeout_s)]
