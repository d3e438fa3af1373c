"""Pure state updates: how a decision or a happening changes the snapshot. The controller and the
simulator both apply them, so the policy is always judged against the state it would really see."""

from policy.cluster_state import ClusterState, InstanceRef, InstanceState, NodeState
from policy.decisions import Place


def _replace_node(state: ClusterState, node: NodeState) -> ClusterState:
    return state.model_copy(update={"nodes": tuple(node if n.node_id == node.node_id else n for n in state.nodes)})


def _node(state: ClusterState, node_id: str) -> NodeState:
    node = state.node(node_id)
    if node is None:
        raise KeyError(f"no node {node_id}")
    return node


def _set_instances(state: ClusterState, node: NodeState, instances: tuple[InstanceState, ...]) -> ClusterState:
    """Replace a node's instances. The node's last reported headroom moves by what our instances
    took or gave back, so it stays a projection of "now" until the next report replaces it."""
    update: dict[str, object] = {"instances": instances}
    if node.reported_headroom_bytes is not None:
        delta = sum(i.bytes for i in node.instances) - sum(i.bytes for i in instances)
        update["reported_headroom_bytes"] = node.reported_headroom_bytes + delta
    return _replace_node(state, node.model_copy(update=update))


def _update_instance(state: ClusterState, ref: InstanceRef, **changes: object) -> ClusterState:
    node = _node(state, ref.node_id)
    if node.instance(ref.model) is None:
        raise KeyError(f"no instance {ref}")
    return _set_instances(state, node, tuple(i.model_copy(update=changes) if i.model == ref.model else i for i in node.instances))


def remove_instance(state: ClusterState, ref: InstanceRef) -> ClusterState:
    node = _node(state, ref.node_id)
    return _set_instances(state, node, tuple(i for i in node.instances if i.model != ref.model))


def apply_place(state: ClusterState, place: Place, now: float) -> ClusterState:
    """Evict the victims and add the new instance as loading, holding its planned bytes."""
    for ref in place.evict:
        state = remove_instance(state, ref)
    node = _node(state, place.node_id)
    if node.instance(place.model) is not None:
        raise ValueError(f"{place.model} is already on {place.node_id}")
    new = InstanceState(
        model=place.model, device=place.device, bytes=place.bytes, status="loading", last_used=now, loaded_at=now
    )
    return _set_instances(state, node, node.instances + (new,))


def mark_loaded(
    state: ClusterState, ref: InstanceRef, now: float, load_seconds: float, measured_bytes: int | None = None
) -> ClusterState:
    changes: dict[str, object] = {"status": "ready", "loaded_at": now, "load_seconds": load_seconds}
    if measured_bytes is not None:
        changes["bytes"] = measured_bytes
    return _update_instance(state, ref, **changes)


def start_request(state: ClusterState, ref: InstanceRef, now: float) -> ClusterState:
    inst = _node(state, ref.node_id).instance(ref.model)
    assert inst is not None
    return _update_instance(state, ref, in_flight=inst.in_flight + 1, last_used=now)


def finish_request(state: ClusterState, ref: InstanceRef, now: float) -> ClusterState:
    inst = _node(state, ref.node_id).instance(ref.model)
    assert inst is not None
    return _update_instance(state, ref, in_flight=max(0, inst.in_flight - 1), last_used=now)
