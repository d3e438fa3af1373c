"""Background copies for the residency simulator (issue 12's time-to-ready goal): rule L4
(policy/background.py) as Orchard runs it with `background_copies` on. The simulator's disks are
unlimited; only a node's disk budget limits its store."""

from bench.residency.simulate import Prefetcher
from policy import ClusterState, PolicyConfig, StoreRoom
from policy.background import background_copy_for

UNLIMITED_DISK = 1 << 62  # the simulator's disks: only a budget limits a store


def shipped(config: PolicyConfig) -> Prefetcher:
    """Rule L4: the most requested model the node lacks that fits in its store's room."""

    def choose(state: ClusterState, node_id: str, demand: dict[str, float], budget: int | None) -> str | None:
        node = state.node(node_id)
        assert node is not None
        used = sum(int(state.catalog[m].weight_bytes) for m in node.stored)
        copy = background_copy_for(state, config, node, demand, StoreRoom(free_bytes=UNLIMITED_DISK, used_bytes=used, budget_bytes=budget))
        return copy.model if copy is not None else None

    return choose
