"""Today's anchor, kept as a reference: a count-only, memory-blind LRU.

This is what Lemonade's max_loaded_models (slots per model type, LRU per type, busy models waited
for) and Ray Serve's model multiplexing (N models per replica, LRU) do. It never looks at memory,
so it may place a model where it does not fit; the simulator and the scenario tests count those
placements as unsafe. Orchard's ensure() must never do that."""

from policy.cluster_state import ClusterState, InstanceRef
from policy.config import PolicyConfig
from policy.decisions import Place, Reject, Use, Wait
from policy.memory import required_bytes
from policy.placement import device_for, meets_constraints


def count_only_lru(model: str, state: ClusterState, now: float, max_loaded_models: int, *, per_kind: bool = True) -> Use | Place | Wait | Reject:
    """max_loaded_models slots per node (per kind when per_kind, else shared by all kinds); -1: unlimited."""
    spec = state.catalog.get(model)
    if spec is None:
        return Reject(model=model, code="unknown_model", message=f"model {model!r} is not in the registry")
    for node in state.nodes:
        inst = node.instance(model) if node.alive else None
        if inst is not None and inst.status == "ready":
            return Use(instance=InstanceRef(node_id=node.node_id, model=model))
        if inst is not None:
            return Wait(model=model, code="loading", message=f"{model} is loading", retry_after_s=1.0)
    nodes = [n for n in state.nodes if n.alive and not n.draining and meets_constraints(spec, n)]
    if not nodes:
        return Reject(model=model, code="no_eligible_node", message=f"no node for {model}")

    def slot_holders(node_id: str) -> list:
        node = state.node(node_id)
        assert node is not None
        return [i for i in node.instances if not per_kind or state.catalog[i.model].kind == spec.kind]

    nbytes = required_bytes(spec, PolicyConfig())
    with_slot = [n for n in nodes if max_loaded_models < 0 or len(slot_holders(n.node_id)) < max_loaded_models]
    if with_slot:
        node = min(with_slot, key=lambda n: (len(n.instances), n.node_id))
        device = device_for(spec, node)
        assert device is not None
        return Place(model=model, node_id=node.node_id, device=device, bytes=nbytes, reason="free slot")
    victims = []
    for n in nodes:
        idle = [i for i in slot_holders(n.node_id) if i.status == "ready" and i.in_flight == 0 and not state.catalog[i.model].pinned]
        if idle:
            victims.append((min(i.last_used for i in idle), n, min(idle, key=lambda i: i.last_used)))
    if not victims:
        return Wait(model=model, code="busy", message="every slot holder is busy", retry_after_s=1.0)
    _, node, victim = min(victims, key=lambda v: (v[0], v[1].node_id))
    device = device_for(spec, node)
    assert device is not None
    return Place(
        model=model,
        node_id=node.node_id,
        device=device,
        bytes=nbytes,
        evict=(InstanceRef(node_id=node.node_id, model=victim.model),),
        reason="least recently used slot",
    )
