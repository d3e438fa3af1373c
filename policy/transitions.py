"""Pure state updates: how a decision or a happening changes the snapshot. The controller and the
simulator both apply them, so the policy is always judged against the state it would really see."""

from policy.cluster_state import ClusterState, FailedLoad, FetchSource, InstanceRef, InstanceState, NodeState
from policy.decisions import LoadFailure, Place
from policy.memory import held_bytes


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
        delta = sum(held_bytes(i) for i in node.instances) - sum(held_bytes(i) for i in instances)
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
    """Evict the victims, count the caches it shrinks as given back (X4), and add the new instance
    as loading, holding its planned bytes."""
    for ref in place.evict:
        state = remove_instance(state, ref)
    for ref in place.shrink:
        state = set_prefix_cache(state, ref, 0)
    node = _node(state, place.node_id)
    if node.instance(place.model) is not None:
        raise ValueError(f"{place.model} is already on {place.node_id}")
    new = InstanceState(model=place.model, device=place.device, bytes=place.bytes, status="loading", last_used=now, loaded_at=now)
    if node.spare_bytes:  # R1: the node's spare process becomes this instance's; its bytes are in place.bytes now
        headroom = node.reported_headroom_bytes
        taken = node.spare_bytes  # measured as used already: not taken again
        node = node.model_copy(update={"spare_bytes": 0, "reported_headroom_bytes": None if headroom is None else headroom + taken})
    return _set_instances(state, node, node.instances + (new,))


def set_spare(state: ClusterState, node_id: str, nbytes: int) -> ClusterState:
    """The node's spare process (R1) is ready and holds `nbytes`, or (0) it is gone."""
    node = state.node(node_id)
    if node is None or node.spare_bytes == nbytes:
        return state
    return _replace_node(state, node.model_copy(update={"spare_bytes": nbytes}))


def set_prefix_cache(state: ClusterState, ref: InstanceRef, nbytes: int, reload_s: float | None = None) -> ClusterState:
    """What the instance's kept prompt prefixes hold now (its memory report, or 0 once given back),
    and (`reload_s`) what prefilling them again would take (E3; with 0 bytes, 0). An instance the
    state no longer holds is left alone."""
    node = state.node(ref.node_id)
    inst = node.instance(ref.model) if node is not None else None
    if inst is None:
        return state
    seconds = 0.0 if nbytes == 0 else (inst.prefix_reload_s if reload_s is None else reload_s)
    if inst.prefix_cache_bytes == nbytes and inst.prefix_reload_s == seconds:
        return state
    return _update_instance(state, ref, prefix_cache_bytes=nbytes, prefix_reload_s=seconds)


def mark_loaded(state: ClusterState, ref: InstanceRef, now: float, load_seconds: float, measured_bytes: int | None = None) -> ClusterState:
    """The instance is ready. A load that succeeded also clears the model's failed mark (P10)."""
    changes: dict[str, object] = {"status": "ready", "loaded_at": now, "load_seconds": load_seconds}
    if measured_bytes is not None:
        changes["bytes"] = measured_bytes
    return clear_failed(_update_instance(state, ref, **changes), ref.model)


def hold_measured(state: ClusterState, ref: InstanceRef, nbytes: int) -> ClusterState:
    """A ready instance's engine measured what it holds (M1, once idle after its load): it is
    counted at least at that from now on, as a load that measured gives (`mark_loaded`)."""
    node = state.node(ref.node_id)
    inst = node.instance(ref.model) if node is not None else None
    if inst is None or inst.status != "ready" or inst.bytes >= nbytes:
        return state
    return _update_instance(state, ref, bytes=nbytes)


def mark_failed(state: ClusterState, failure: LoadFailure, now: float) -> ClusterState:
    """Rule P10: record a failed load that is not retried (retry_after_failure answered Reject).
    A model already marked counts one more consecutive failure, which doubles its back-off; the
    mark names this failure's node, reason and message. `state` should no longer hold the failed
    instance (remove_instance first)."""
    previous = state.failed.get(failure.model)
    mark = FailedLoad(
        model=failure.model,
        node_id=failure.node_id,
        reason=failure.reason,
        message=failure.message,
        at=now,
        failures=1 if previous is None else previous.failures + 1,
    )
    return state.model_copy(update={"failed": {**state.failed, failure.model: mark}})


def clear_failed(state: ClusterState, model: str) -> ClusterState:
    """Rule P10: forget a model's failed mark (a load succeeded, its files changed, or an operator
    loads it). A model that is not marked leaves the state as it is."""
    if model not in state.failed:
        return state
    return state.model_copy(update={"failed": {k: v for k, v in state.failed.items() if k != model}})


def start_request(state: ClusterState, ref: InstanceRef, now: float) -> ClusterState:
    inst = _node(state, ref.node_id).instance(ref.model)
    assert inst is not None
    return _update_instance(state, ref, in_flight=inst.in_flight + 1, last_used=now)


def finish_request(state: ClusterState, ref: InstanceRef, now: float) -> ClusterState:
    inst = _node(state, ref.node_id).instance(ref.model)
    assert inst is not None
    return _update_instance(state, ref, in_flight=max(0, inst.in_flight - 1), last_used=now)


def set_in_flight(state: ClusterState, ref: InstanceRef, in_flight: int, now: float | None = None) -> ClusterState:
    """The instance's requests in flight, as counted from its leases (a standing lease counts what
    its ingress reports, at least one); `now` marks it used (last_used) when given."""
    changes: dict[str, object] = {"in_flight": max(0, in_flight)}
    if now is not None:
        changes["last_used"] = now
    return _update_instance(state, ref, **changes)


def mark_stored(state: ClusterState, node_id: str, model: str) -> ClusterState:
    """The model's weights are now in the node's store (a fetch finished; L1)."""
    node = _node(state, node_id)
    return _replace_node(state, node.model_copy(update={"stored": node.stored | {model}}))


def mark_unstored(state: ClusterState, node_id: str, models: frozenset[str]) -> ClusterState:
    """The models' weights left the node's store (an operator removed their folder)."""
    node = _node(state, node_id)
    return _replace_node(state, node.model_copy(update={"stored": node.stored - models}))


def learn_bandwidth(state: ClusterState, source: FetchSource, bytes_per_s: float) -> ClusterState:
    """A finished transfer's rate, blended half and half into what was learned before (L3)."""
    old = state.bandwidth_bytes_per_s.get(source)
    blended = bytes_per_s if old is None else (old + bytes_per_s) / 2
    return state.model_copy(update={"bandwidth_bytes_per_s": state.bandwidth_bytes_per_s | {source: blended}})


def mark_draining(state: ClusterState, ref: InstanceRef, draining: bool = True) -> ClusterState:
    """A ready instance drains for a swap (W1): no request is sent to it (P2 uses ready ones only)
    and it is not evicted by another decision meanwhile; `draining=False` makes it ready again."""
    return _update_instance(state, ref, status="draining" if draining else "ready")
