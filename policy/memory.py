"""Memory arithmetic: what a model needs, what a node has free, and how we say it in messages."""

from policy.cluster_state import InstanceState, NodeState
from policy.config import GIB, PolicyConfig
from policy.specs import ModelSpec


def overhead_bytes(spec: ModelSpec, config: PolicyConfig) -> int:
    return config.instance_overhead_bytes if spec.overhead_bytes is None else spec.overhead_bytes


def required_bytes(spec: ModelSpec, config: PolicyConfig) -> int:
    """Weights + KV reservation + a step's activations + per-instance overhead: what a new
    instance will hold (M1)."""
    return spec.weight_bytes + spec.kv_reserved_bytes + spec.activation_bytes + overhead_bytes(spec, config)


def margin_bytes(node: NodeState, config: PolicyConfig) -> int:
    """Headroom that must stay free on the node after any placement."""
    return config.safety_margin_bytes + int(config.safety_margin_fraction * node.usable_bytes)


def held_bytes(inst: InstanceState) -> int:
    """What the instance holds on its node: `bytes` and its kept prompt prefixes."""
    return inst.bytes + inst.prefix_cache_bytes


def ours_bytes(node: NodeState) -> int:
    """What our instances hold on the node, and its spare process (R1)."""
    return sum(held_bytes(i) for i in node.instances) + node.spare_bytes


def spare_credit(node: NodeState) -> int:
    """R1: what a placement on the node needs less because its process is there already (the
    node's spare becomes it): the spare's bytes. What a process holds beside its model is the same
    whether it started as a spare or not; the instance's overhead estimates it for both."""
    return node.spare_bytes


def reclaimable_bytes(node: NodeState) -> int:
    """What the node's ready instances would give back of their kept prompt prefixes (rule X4)."""
    return sum(i.prefix_cache_bytes for i in node.instances if i.status == "ready")


def free_bytes(node: NodeState) -> int:
    """Free memory, the more pessimistic of our own accounting and the node's last report.

    Accounting alone misses memory that grew since a report; a report alone misses a load that
    started after it. Either may be negative when the node is overcommitted.
    """
    accounted = node.usable_bytes - node.foreign_bytes - ours_bytes(node)
    if node.reported_headroom_bytes is None:
        return accounted
    return min(accounted, node.reported_headroom_bytes)


def ever_available_bytes(node: NodeState, config: PolicyConfig, free: int | None = None) -> int:
    """What the node could give a model if every one of our instances on it were gone.
    free: free_bytes(node), when the caller has it."""
    return (free_bytes(node) if free is None else free) + ours_bytes(node) - margin_bytes(node, config)


def estimated_load_seconds(nbytes: int, config: PolicyConfig) -> float:
    return config.load_base_s + nbytes / config.load_bandwidth_bytes_per_s


def reload_seconds(inst: InstanceState, spec: ModelSpec, config: PolicyConfig) -> float:
    """What losing this instance costs in load time: measured if we have it, else estimated."""
    if inst.load_seconds is not None:
        return inst.load_seconds
    if spec.load_seconds_estimate is not None:
        return spec.load_seconds_estimate
    return estimated_load_seconds(inst.bytes, config)


def protected_for_s(inst: InstanceState, spec: ModelSpec, config: PolicyConfig) -> float:
    """E3: how long after its load the instance may not be evicted: residency_per_reload x its reload
    cost (the load, measured or estimated, plus the prefill its kept prefixes would cost again), at
    most max_residency_s; at least min_residency_s (the operator's fixed floor wins)."""
    cost = config.residency_per_reload * (reload_seconds(inst, spec, config) + inst.prefix_reload_s)
    return max(config.min_residency_s, min(config.max_residency_s, cost))


def gib(nbytes: int | float) -> str:
    """Human figure for messages: '12.0 GiB'."""
    return f"{nbytes / GIB:.1f} GiB"
