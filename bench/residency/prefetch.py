"""Background copies for the residency simulator (issue 12's time-to-ready goal): an experiment, not
a rule of policy/ yet.

`most_requested` copies to a node, one model at a time while its link is idle, the most requested
model (requests counted with a 30-minute half-life) that the node lacks, that could be loaded there
at all, and that another node's store holds. Under a disk budget it copies only what fits in the
free space plus the folders it may displace: unused ones, held by another node too, and less
requested than the one it copies."""

from bench.residency.simulate import Prefetcher
from policy import ClusterState, PolicyConfig


def most_requested(config: PolicyConfig, whole_catalog: bool = False, displace_ratio: float = 1.0) -> Prefetcher:
    def choose(state: ClusterState, node_id: str, demand: dict[str, float], budget: int | None) -> str | None:
        node = state.node(node_id)
        assert node is not None
        in_use = {i.model for i in node.instances}
        elsewhere = {m for n in state.nodes if n.node_id != node_id and n.alive for m in n.stored}
        used = sum(int(state.catalog[m].weight_bytes) for m in node.stored)
        names = state.catalog if whole_catalog else demand
        for model in sorted(names, key=lambda m: (-demand.get(m, 0.0), state.catalog[m].weight_bytes, m)):
            spec = state.catalog[model]
            if model in node.stored or model not in elsewhere:
                continue
            if spec.weight_bytes + config.instance_overhead_bytes > node.usable_bytes:
                continue  # never loadable here
            if budget is None:
                return model
            room = (
                budget
                - used
                + sum(
                    int(state.catalog[m].weight_bytes)
                    for m in node.stored - in_use
                    if m in elsewhere and demand.get(m, 0.0) * displace_ratio < demand.get(model, 0.0)
                )
            )
            if spec.weight_bytes <= room:
                return model
        return None

    return choose
