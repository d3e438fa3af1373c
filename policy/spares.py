"""Spare model-server processes (rule R1 in docs/residency.md): which nodes should start one, and
which should stop theirs.

A swap on a Mac costs the new model's weights and a process around them (Python, MLX and the
engine's imports, the device's set-up: seconds; on CUDA, kernels compiled again). A spare is that
process started ahead of demand: the next placement on its node loads its weights into it. Its
memory is ours (`NodeState.spare_bytes`, in `ours_bytes`), and a placement there needs that much
less (`memory.spare_credit`), since the spare becomes its process. Only a node with room for it
beyond the margin keeps one: a node short of memory runs without."""

from policy.cluster_state import ClusterState, NodeState
from policy.config import PolicyConfig
from policy.memory import free_bytes, margin_bytes, ours_bytes


def spare_wanted(node: NodeState, config: PolicyConfig, starting: bool = False) -> bool:
    """R1: an alive node that is not draining, with spares on, no spare (nor one `starting`), and
    room for one (config.spare_bytes) beyond its margin."""
    if not _may_keep_one(node, config) or starting:
        return False
    return free_bytes(node) - margin_bytes(node, config) >= config.spare_bytes


def _may_keep_one(node: NodeState, config: PolicyConfig) -> bool:
    """R1: spares are on, and the node is alive, not draining and has no spare."""
    return config.spares_per_node >= 1 and node.alive and not node.draining and not node.spare_bytes


def spare_short(node: NodeState, config: PolicyConfig) -> bool:
    """R1: a node whose spare must stop: it is dead or draining, spares are off, or the node is below
    its margin with the spare counted (memory grew elsewhere since it started)."""
    if not node.spare_bytes:
        return False
    return config.spares_per_node < 1 or not node.alive or node.draining or free_bytes(node) < margin_bytes(node, config)


def spare_again(node: NodeState, config: PolicyConfig, held_bytes: int, new_spare_bytes: int = 0) -> bool:
    """R1: whether a model server that gave back its model's memory (X1) and still holds `held_bytes`
    becomes the node's spare instead of exiting: spares are on, more than one model per process is
    allowed, the node is alive, not draining and has no spare (none starting either), the process
    holds at most `spare_growth_max` x what a new spare measured there (`new_spare_bytes`; the
    estimate `spare_bytes` before one has), and our accounting has room for it beyond the margin."""
    if not _may_keep_one(node, config) or config.process_models_max < 2:
        return False
    if held_bytes > config.spare_growth_max * (new_spare_bytes or config.spare_bytes):
        return False
    return node.usable_bytes - node.foreign_bytes - ours_bytes(node) - held_bytes >= margin_bytes(node, config)


def plan_spares(state: ClusterState, config: PolicyConfig, starting: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(nodes to start a spare on, nodes whose spare must stop), by node id; `starting`: nodes whose
    spare is being started."""
    start = tuple(n.node_id for n in state.nodes if spare_wanted(n, config, n.node_id in starting))
    stop = tuple(n.node_id for n in state.nodes if spare_short(n, config))
    return start, stop
