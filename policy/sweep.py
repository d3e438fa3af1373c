"""sweep(): what to unload without any request asking: idle timeouts, draining and dead nodes."""

from policy.cluster_state import ClusterState, InstanceRef
from policy.config import PolicyConfig
from policy.decisions import Unload
from policy.eviction import ready_copies


def idle_ttl(model: str, state: ClusterState, config: PolicyConfig) -> float | None:
    """Seconds idle before unload; None: never (pinned and keep-warm models, or no TTL configured)."""
    spec = state.catalog[model]
    if spec.pinned or spec.keep_warm:
        return None
    return spec.idle_ttl_s if spec.idle_ttl_s is not None else config.default_idle_ttl_s


def sweep(state: ClusterState, now: float, config: PolicyConfig) -> tuple[Unload, ...]:
    """Rules S1-S4 in docs/residency.md. Never touches an instance with requests in flight."""
    unloads: list[Unload] = []
    idle: list[tuple[float, InstanceRef]] = []
    for node in state.nodes:
        for inst in node.instances:
            ref = InstanceRef(node_id=node.node_id, model=inst.model)
            if not node.alive:
                unloads.append(Unload(instance=ref, reason="node_dead"))
                continue
            if inst.status != "ready" or inst.in_flight > 0:
                continue
            if node.draining:
                unloads.append(Unload(instance=ref, reason="draining"))
                continue
            ttl = idle_ttl(inst.model, state, config)
            if ttl is not None and now - inst.last_used >= ttl:
                idle.append((inst.last_used, ref))
    # Longest idle first; an idle unload never takes a model below its min_copies.
    remaining = ready_copies(state)
    for unload in unloads:
        if unload.reason == "draining":
            remaining[unload.instance.model] -= 1
    for _, ref in sorted(idle, key=lambda p: (p[0], p[1].node_id, p[1].model)):
        if remaining[ref.model] > state.catalog[ref.model].min_copies:
            remaining[ref.model] -= 1
            unloads.append(Unload(instance=ref, reason="idle"))
    return tuple(unloads)
