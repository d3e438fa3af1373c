"""One decision's reads of a ClusterState, each worked out once.

ensure() asks the same questions of one state for every node it weighs, and may plan twice (the
second time to learn whether waiting would help, P8): how much is free on a node, how many ready
copies a model has, whether some store holds its weights, every instance seen as a possible
victim. Asked again each time, they were most of what a decision cost at 100 nodes x 1,000 models
(bench/residency/scale.py). A Snapshot lives for one call; the policy keeps nothing between calls."""

from collections.abc import Iterable, Mapping
from functools import cached_property

from policy.cluster_state import ClusterState, InstanceRef, NodeState, RefKey
from policy.config import PolicyConfig
from policy.decisions import Protection
from policy.eviction import Candidate, keep_valuer, ready_copies
from policy.locality import bandwidth, stored_anywhere
from policy.memory import margin_bytes, protected_for_s
from policy.specs import ModelSpec


class Snapshot:
    """`state` at `now` under `config`, for a request that has waited `waited_s`; nodes are asked about
    by the state's own NodeState objects. oracle_keep_values: replaces every keep value (the
    simulator's offline reference)."""

    def __init__(
        self,
        state: ClusterState,
        now: float,
        config: PolicyConfig,
        oracle_keep_values: Mapping[InstanceRef, float] | None = None,
        waited_s: float = 0.0,
        settled: bool = False,
    ) -> None:
        self.state = state
        # settled: free memory is our accounting's alone, as it will be once the memory in transit
        # (a process still exiting, a load awaiting its room: what a report may still show held) has
        # settled (P5, P8)
        self.settled = settled
        self._oracle_keep_values = oracle_keep_values
        self.now = now
        self.config = config
        self.waited_s = waited_s  # how long the request being decided has waited: a young instance yields to one as old as its protection (E3)
        self.oracle: dict[RefKey, float] | None = (
            None if oracle_keep_values is None else {(r.node_id, r.model): v for r, v in oracle_keep_values.items()}
        )
        self._free: dict[str, int] = {}
        self._ours: dict[str, int] = {}
        self._reclaimable: dict[str, int] = {}
        self._keep_values: dict[Candidate, float] = {}

    def ours(self, node: NodeState) -> int:
        """memory.ours_bytes, once per node."""
        found = self._ours.get(node.node_id)
        if found is None:
            found = self._ours[node.node_id] = sum([i.bytes + i.prefix_cache_bytes for i in node.instances]) + node.spare_bytes
        return found

    def reclaimable(self, node: NodeState) -> int:
        """memory.reclaimable_bytes, once per node."""
        found = self._reclaimable.get(node.node_id)
        if found is None:
            found = self._reclaimable[node.node_id] = sum([i.prefix_cache_bytes for i in node.instances if i.status == "ready"])
        return found

    def free(self, node: NodeState) -> int:
        """memory.free_bytes, once per node (written out with ours(): the same figure,
        tests/test_policy_scale.py checks it)."""
        found = self._free.get(node.node_id)
        if found is None:
            found = node.usable_bytes - node.foreign_bytes - self.ours(node)
            headroom = node.reported_headroom_bytes
            if headroom is not None and headroom < found and not self.settled:
                found = headroom
            self._free[node.node_id] = found
        return found

    def once_settled(self) -> "Snapshot":
        """The same reads with free memory as our accounting gives it (`settled`)."""
        return Snapshot(self.state, self.now, self.config, self._oracle_keep_values, self.waited_s, settled=True)

    def ever_available(self, node: NodeState) -> int:
        """memory.ever_available_bytes, from the figures above."""
        return self.free(node) + self.ours(node) - margin_bytes(node, self.config)

    @cached_property
    def nodes(self) -> dict[str, NodeState]:
        return {n.node_id: n for n in self.state.nodes}

    @cached_property
    def stored(self) -> frozenset[str]:
        """Models some alive node's store holds: asked only when an instance's own store lacks them."""
        return stored_anywhere(self.state)

    @cached_property
    def ready_copies(self) -> dict[str, int]:
        """Asked only for models with min_copies."""
        return ready_copies(self.state)

    @cached_property
    def bandwidths(self) -> tuple[float, float]:
        """locality.bandwidth from a peer and from the Hub."""
        return bandwidth(self.state, self.config, "peer"), bandwidth(self.state, self.config, "hub")

    def fetch_seconds(self, spec: ModelSpec, node: NodeState) -> float:
        """locality.fetch_seconds for one of the state's nodes, written out with the snapshot's
        stored set and bandwidths: a decision asks it of every instance it weighs (the same figure:
        tests/test_policy_scale.py checks it)."""
        name = spec.name
        if name in node.stored:
            return 0.0
        if name in self.stored:  # on a peer: a node lacking the weights finds them on another
            return spec.weight_bytes / self.bandwidths[0]
        return spec.weight_bytes / self.bandwidths[1] if spec.hub else 0.0

    def keep_values(self, by_node: Mapping[str, Iterable[Candidate]]) -> dict[Candidate, float]:
        """Keep values (E3, or the oracle's) by candidate, these among them (by node): each worked
        out once, and only for candidates an eviction order weighs."""
        values, oracle = self._keep_values, self.oracle
        if oracle is not None:
            for candidates in by_node.values():
                for c in candidates:
                    if c not in values:
                        values[c] = oracle.get(c.key, 0.0)
            return values
        keep_value, fetch_seconds = keep_valuer(self.now, self.config), self.fetch_seconds
        for node_id, candidates in by_node.items():
            node = self.nodes[node_id]
            for c in candidates:
                if c not in values:
                    values[c] = keep_value(c.inst, c.spec, fetch_seconds(c.spec, node))
        return values

    @cached_property
    def candidates_by_node(self) -> dict[str, tuple[Candidate, ...]]:
        """Every instance on an alive node, with its protection, by node in the state's order, each
        node's instances in its order. The protection is eviction.protection_of written out (a
        decision asks it of every instance; the same answer, tests/test_policy_scale.py checks it)."""
        now, config, catalog, waited_s = self.now, self.config, self.state.catalog, self.waited_s
        by_node = {}
        for node in self.state.nodes:
            if not node.alive:
                continue
            node_id, found = node.node_id, []
            for inst in node.instances:
                model = inst.model
                spec = catalog[model]
                status = inst.status
                protection: Protection | None
                if spec.pinned:
                    protection = "pinned"
                elif status == "ready" and spec.min_copies > 0 and self.ready_copies.get(model, 0) <= spec.min_copies:
                    protection = "min_copies"
                elif status != "ready":
                    protection = status  # loading or draining
                elif inst.in_flight > 0:
                    protection = "busy"
                elif now - inst.loaded_at < (protected := protected_for_s(inst, spec, config)) and waited_s < protected:
                    protection = "young"
                else:
                    protection = None
                found.append(Candidate((node_id, model), inst, spec, protection))
            by_node[node_id] = tuple(found)
        return by_node
