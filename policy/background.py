"""plan_background_copies(): weights copied into node stores before any placement asks for them
(rule L4), so a later placement there (a new copy, a move after an eviction, a node's death) waits
for no copy."""

from collections.abc import Mapping

from pydantic import Field

from policy._frozen import Frozen
from policy.cluster_state import ClusterState, NodeState
from policy.config import PolicyConfig
from policy.memory import margin_bytes, required_bytes
from policy.placement import meets_constraints
from policy.specs import ModelSpec


class StoreRoom(Frozen):
    """What a node's model store reported about its disk."""

    free_bytes: int = Field(ge=0)  # the disk's free space
    used_bytes: int = Field(ge=0)  # what the store's folders take
    budget_bytes: int | None = Field(default=None, gt=0)  # the most it may take (orchard.disk_budget_gib)

    def room(self, config: PolicyConfig) -> int:
        """Bytes a background copy may still add: what background_copy_budget_share of the budget
        leaves, within the free disk less background_copy_disk_reserve_bytes. Nothing is ever
        removed to make it."""
        room = self.free_bytes - int(config.background_copy_disk_reserve_bytes)
        if self.budget_bytes is not None:
            room = min(room, int(config.background_copy_budget_share * self.budget_bytes) - self.used_bytes)
        return max(0, room)


class BackgroundCopy(Frozen):
    model: str
    node_id: str
    demand: float  # its decayed request count when chosen


def background_copy_for(
    state: ClusterState,
    config: PolicyConfig,
    node: NodeState,
    demand: Mapping[str, float],
    room: StoreRoom,
    not_now: frozenset[tuple[str, str]] = frozenset(),
) -> BackgroundCopy | None:
    """The model `node` should copy in next (L4), or None; never a (model, node) in `not_now`."""
    holders = {m for n in state.nodes if n.alive and n.node_id != node.node_id for m in n.stored}
    space = room.room(config)
    wanted = sorted((m for m in demand if demand[m] >= config.background_copy_min_demand), key=lambda m: (-demand[m], _weight(state, m), m))
    if config.background_copies == "catalog":
        asked = set(wanted)
        wanted += sorted((m for m in state.catalog if m not in asked), key=lambda m: (_weight(state, m), m))
    for model in wanted:
        spec = state.catalog.get(model)
        if spec is None or model in node.stored or model not in holders or (model, node.node_id) in not_now:
            continue
        if not _could_load(spec, node, config) or spec.weight_bytes > space:
            continue
        return BackgroundCopy(model=model, node_id=node.node_id, demand=demand.get(model, 0.0))
    return None


def plan_background_copies(
    state: ClusterState,
    config: PolicyConfig,
    demand: Mapping[str, float],
    rooms: Mapping[str, StoreRoom],
    copying: frozenset[str] = frozenset(),
    not_now: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[BackgroundCopy, ...]:
    """Rule L4 in docs/residency.md: with `background_copies` on, every alive node that is not
    draining, reports its store (`rooms`) and has no copy coming in (`copying`: node ids) gets at
    most one copy: the most requested model (by `demand`, decayed request counts; at least
    background_copy_min_demand; ties: the smaller, then the name), then with "catalog" the rest of
    the catalog, smallest first; the first that its store lacks, another alive node's store holds,
    that could ever be loaded there (constraints, device, usable memory), whose weights fit in the
    store's room, and that is not in `not_now` ((model, node) pairs whose last background copy
    failed within background_copy_retry_s)."""
    if config.background_copies == "off":
        return ()
    copies = []
    for node in sorted(state.nodes, key=lambda n: n.node_id):
        room = rooms.get(node.node_id)
        if not node.alive or node.draining or room is None or node.node_id in copying:
            continue
        copy = background_copy_for(state, config, node, demand, room, not_now)
        if copy is not None:
            copies.append(copy)
    return tuple(copies)


def _weight(state: ClusterState, model: str) -> int:
    spec = state.catalog.get(model)
    return int(spec.weight_bytes) if spec is not None else 0


def _could_load(spec: ModelSpec, node: NodeState, config: PolicyConfig) -> bool:
    """Whether the model could ever be placed on the node, all else evicted (its safety margin kept)."""
    return meets_constraints(spec, node) and required_bytes(spec, config) <= node.usable_bytes - margin_bytes(node, config)
