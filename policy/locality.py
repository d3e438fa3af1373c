"""Where a model's weights are, and how long getting them to a node takes (rules L1-L3)."""

from policy.cluster_state import ClusterState, FetchSource, NodeState
from policy.config import PolicyConfig
from policy.specs import ModelSpec


def bandwidth(state: ClusterState, config: PolicyConfig, source: FetchSource) -> float:
    """Bytes per second from `source`: learned from finished transfers, else the config's figure."""
    learned = state.bandwidth_bytes_per_s.get(source)
    if learned is not None and learned > 0:
        return learned
    return float(config.peer_bandwidth_bytes_per_s if source == "peer" else config.hub_bandwidth_bytes_per_s)


def stored_anywhere(state: ClusterState) -> frozenset[str]:
    """Every model some alive node's store holds. A decision that asks fetch_source of many
    instances passes it in, so that each answer is a set lookup, not a walk over every node."""
    return frozenset().union(*(n.stored for n in state.nodes if n.alive))


def fetch_source(spec: ModelSpec, node: NodeState, state: ClusterState, stored: frozenset[str] | None = None) -> FetchSource | None:
    """How the weights would get to `node` (L1): None when nothing needs fetching (its store holds
    them, or no store holds them and the model is not a hub model: then where they are is not
    known to the policy, a folder at the same path on every node, and no node is nearer).

    stored: stored_anywhere(state), when the caller has it; `node` must then be one of the state's
    nodes (a node lacking the weights finds them on another node exactly when some alive store holds
    them)."""
    if spec.name in node.stored:
        return None
    if stored is not None:
        on_a_peer = spec.name in stored
    else:
        on_a_peer = any(n.alive and n.node_id != node.node_id and spec.name in n.stored for n in state.nodes)
    if on_a_peer:
        return "peer"
    return "hub" if spec.hub else None


def fetch_seconds(spec: ModelSpec, node: NodeState, state: ClusterState, config: PolicyConfig, stored: frozenset[str] | None = None) -> float:
    """Estimated seconds before the weights are on `node` (L1): 0, weight bytes / peer bandwidth, or
    weight bytes / hub bandwidth. stored: as for fetch_source."""
    source = fetch_source(spec, node, state, stored)
    return 0.0 if source is None else spec.weight_bytes / bandwidth(state, config, source)
