"""An independent, brute-force reading of the residency rules, written from docs/residency.md
without reusing policy/ internals, so the property tests check the policy against the spec."""

from policy import ClusterState, InstanceRef, ModelSpec, NodeState, PolicyConfig

LASTING = {"pinned", "min_copies"}


def need_bytes(spec: ModelSpec, config: PolicyConfig) -> int:
    overhead = config.instance_overhead_bytes if spec.overhead_bytes is None else spec.overhead_bytes
    per_sequence = (
        spec.kv_bytes_per_token * spec.reserve_context_tokens
        + spec.kv_window_bytes_per_token * min(spec.reserve_context_tokens, spec.kv_window_tokens)
        + spec.kv_state_bytes
    )  # M1: windows hold at most their tokens, fixed-size state the same at any length
    return spec.weight_bytes + per_sequence * spec.reserve_concurrency + spec.activation_bytes + overhead


def device_on(spec: ModelSpec, node: NodeState):
    if spec.device is None:
        return node.devices[0]
    return spec.device if spec.device in node.devices else None


def eligible(state: ClusterState, spec: ModelSpec, node: NodeState) -> bool:
    return (
        node.alive
        and not node.draining
        and all(i.model != spec.name for i in node.instances)
        and (spec.allowed_nodes is None or node.node_id in spec.allowed_nodes)
        and all(node.labels.get(k) == v for k, v in spec.required_labels.items())
        and device_on(spec, node) is not None
    )


def protection(state: ClusterState, node: NodeState, model: str, now: float, config: PolicyConfig, waited: float = 0.0):
    inst = next(i for i in node.instances if i.model == model)
    spec = state.catalog[model]
    ready = sum(1 for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == "ready")
    if spec.pinned:
        return "pinned"
    if inst.status == "ready" and spec.min_copies > 0 and ready <= spec.min_copies:
        return "min_copies"
    if inst.status != "ready":
        return inst.status
    if inst.in_flight > 0:
        return "busy"
    young_for_s = young_for(inst, spec, config)
    if now - inst.loaded_at < young_for_s and waited < young_for_s:  # a request that waited as long is not held back
        return "young"
    return None


def young_for(inst, spec, config: PolicyConfig) -> float:
    """E3 as docs/residency.md words it: twice (residency_per_reload) the reload cost, the load
    measured, else the spec's estimate, else base + bytes / bandwidth, plus the kept prefixes'
    prefill; that at most max_residency_s; the whole at least min_residency_s."""
    if inst.load_seconds is not None:
        load = inst.load_seconds
    elif spec.load_seconds_estimate is not None:
        load = spec.load_seconds_estimate
    else:
        load = config.load_base_s + inst.bytes / config.load_bandwidth_bytes_per_s
    earned = config.residency_per_reload * (load + inst.prefix_reload_s)
    return max(config.min_residency_s, min(earned, config.max_residency_s))


def all_refs(state: ClusterState):
    return [(n, InstanceRef(node_id=n.node_id, model=i.model)) for n in state.nodes if n.alive for i in n.instances]


def evictable(state, now, config, *, passing_too=False, keep_warm_too=True, waited=0.0) -> set[InstanceRef]:
    out = set()
    for n, r in all_refs(state):
        p = protection(state, n, r.model, now, config, waited)
        if state.catalog[r.model].keep_warm and not keep_warm_too:
            continue
        if p is None or (passing_too and p not in LASTING):
            out.add(r)
    return out


def feasible_after(
    state: ClusterState,
    spec: ModelSpec,
    node_id: str,
    victims: set[InstanceRef],
    config: PolicyConfig,
    *,
    memory_only=False,
    shrink=False,
    settled=False,
) -> bool:
    """Would placing spec on node_id, after removing victims (and, with shrink, the kept prompt
    prefixes of the node's ready instances given back, X4), respect memory and every cap that
    counts the new instance? An instance holds its bytes and its prefix cache. settled: free memory
    is accounting's alone, the node's last report left out (what P5 and P8 ask)."""
    node = state.node(node_id)
    device = device_on(spec, node)
    gone = [i for i in node.instances if InstanceRef(node_id=node_id, model=i.model) in victims]
    kept = [i for i in node.instances if InstanceRef(node_id=node_id, model=i.model) not in victims]
    given_back = sum(i.prefix_cache_bytes for i in kept if shrink and i.status == "ready")
    freed = sum(i.bytes + i.prefix_cache_bytes for i in gone) + given_back
    accounted = node.usable_bytes - node.foreign_bytes - sum(i.bytes + i.prefix_cache_bytes for i in kept) - node.spare_bytes + given_back
    free = accounted if node.reported_headroom_bytes is None or settled else min(accounted, node.reported_headroom_bytes + freed)
    margin = config.safety_margin_bytes + int(config.safety_margin_fraction * node.usable_bytes)
    process_there = node.spare_bytes  # R1: a spare becomes the instance's process
    if free - (need_bytes(spec, config) - process_there) < margin:
        return False
    if memory_only:
        return True
    survivors = [(n, i) for n in state.nodes if n.alive for i in n.instances if InstanceRef(node_id=n.node_id, model=i.model) not in victims]
    kinds = [state.catalog[i.model].kind for _, i in survivors]
    on_node = [i for n, i in survivors if n.node_id == node_id]
    checks = [
        (config.max_instances, len(survivors)),
        (config.max_per_kind.get(spec.kind), kinds.count(spec.kind)),
        (config.node_max_instances.get(node_id, config.max_instances_per_node), len(on_node)),
        (config.max_per_device_per_node.get("total"), len(on_node)),
        (config.max_per_device_per_node.get(device), sum(1 for i in on_node if i.device == device)),
        (config.max_per_kind_per_node.get(spec.kind), sum(1 for i in on_node if state.catalog[i.model].kind == spec.kind)),
    ]
    return all(cap is None or count + 1 <= cap for cap, count in checks)


def expected_shrink(state: ClusterState, spec: ModelSpec, node_id: str, victims: set[InstanceRef], config: PolicyConfig) -> set[InstanceRef]:
    """X4: a placement on a node short of the memory as it is gives back the kept prompt prefixes of
    every ready instance there that holds some and is not a victim; any other gives back none."""
    if feasible_after(state, spec, node_id, set(), config, memory_only=True):
        return set()
    node = state.node(node_id)
    here = {InstanceRef(node_id=node_id, model=i.model) for i in node.instances if i.status == "ready" and i.prefix_cache_bytes}
    return here - victims


def backoff_s(failures: int, config: PolicyConfig) -> float:
    """P10: base x 2^(failures - 1), capped."""
    return min(config.failed_load_backoff_max_s, config.failed_load_backoff_s * 2 ** (failures - 1))


def backoff_left(state: ClusterState, model: str, now: float, config: PolicyConfig) -> float | None:
    """Seconds left of the model's failed-load back-off, or None when it is not marked or it passed."""
    mark = state.failed.get(model)
    if mark is None:
        return None
    left = mark.at + backoff_s(mark.failures, config) - now
    return left if left > 0 else None


def fetch_s(state: ClusterState, spec: ModelSpec, node: NodeState, config: PolicyConfig) -> float:
    """Rule L1 read from the spec: nothing to fetch if the node's store holds the model; a copy from
    a peer if another alive node's does; a download if it is a hub model; else nothing is known."""
    if spec.name in node.stored:
        return 0.0
    peers = [n for n in state.nodes if n.alive and n.node_id != node.node_id and spec.name in n.stored]
    if peers:
        rate = state.bandwidth_bytes_per_s.get("peer") or config.peer_bandwidth_bytes_per_s
    elif spec.hub:
        rate = state.bandwidth_bytes_per_s.get("hub") or config.hub_bandwidth_bytes_per_s
    else:
        return 0.0
    return spec.weight_bytes / rate
