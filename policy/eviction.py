"""Which instances may be evicted, in what order each strategy gives them up, and the smallest set
that makes room. Ordering is where strategies differ; safety (protections) is the same for all."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policy.caps import CapExcess
from policy.cluster_state import ClusterState, InstanceRef, InstanceState
from policy.config import EvictionStrategy, PolicyConfig
from policy.decisions import Protection
from policy.locality import fetch_seconds
from policy.memory import reload_seconds
from policy.specs import ModelKind, ModelSpec


@dataclass(frozen=True)
class Candidate:
    """An instance seen as a possible victim."""

    ref: InstanceRef
    inst: InstanceState
    spec: ModelSpec
    protection: Protection | None
    keep_value: float

    @property
    def tier(self) -> int:
        """Keep-warm instances are given up only when nothing else will do (rule E5)."""
        return 1 if self.spec.keep_warm else 0


def ready_copies(state: ClusterState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in state.nodes:
        if node.alive:
            for inst in node.instances:
                if inst.status == "ready":
                    counts[inst.model] = counts.get(inst.model, 0) + 1
    return counts


def protection_of(inst: InstanceState, spec: ModelSpec, copies: int, now: float, config: PolicyConfig) -> Protection | None:
    """Why this instance may not be evicted now, or None. Lasting reasons are named before passing ones."""
    if spec.pinned:
        return "pinned"
    if inst.status == "ready" and spec.min_copies > 0 and copies <= spec.min_copies:
        return "min_copies"
    if inst.status == "loading":
        return "loading"
    if inst.status == "draining":
        return "draining"
    if inst.in_flight > 0:
        return "busy"
    if now - inst.loaded_at < config.min_residency_s:
        return "young"
    return None


def keep_value(inst: InstanceState, spec: ModelSpec, now: float, config: PolicyConfig, fetch_s: float = 0.0) -> float:
    """The `cost` strategy's estimate of what losing an instance costs: reload seconds on its node
    (the load, plus fetching the weights again when that node's store does not hold them, L2),
    times a weight for utility models, times an estimated reuse rate of 1 / (idle seconds + floor).
    (A frequency term, requests served / age, was tried in the simulator and reloaded more.)"""
    weight = config.cost.utility_weight if spec.role == "utility" else 1.0
    idle_s = max(0.0, now - inst.last_used)
    return (reload_seconds(inst, spec, config) + fetch_s) * weight / (idle_s + config.cost.idle_floor_s)


def candidates(
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    oracle_keep_values: Mapping[InstanceRef, float] | None = None,
) -> list[Candidate]:
    """Every instance on an alive node, with its protection and keep value."""
    copies = ready_copies(state)
    found = []
    for node in state.nodes:
        if not node.alive:
            continue
        for inst in node.instances:
            spec = state.catalog[inst.model]
            ref = InstanceRef(node_id=node.node_id, model=inst.model)
            if oracle_keep_values is not None:
                value = oracle_keep_values.get(ref, 0.0)
            else:
                value = keep_value(inst, spec, now, config, fetch_seconds(spec, node, state, config))
            found.append(Candidate(ref, inst, spec, protection_of(inst, spec, copies.get(inst.model, 0), now, config), value))
    return found


def eviction_order_key(c: Candidate, strategy: EvictionStrategy, kind: ModelKind, memory_pressure: bool, oracle: bool) -> tuple:
    """Sort key: the first candidate is given up first. Tier (keep-warm) always comes first."""
    tie = (c.ref.node_id, c.ref.model)
    if oracle or strategy == "cost":
        value = c.keep_value / max(c.inst.bytes, 1) if memory_pressure else c.keep_value
        return (c.tier, value, *tie)
    if strategy == "lru":
        return (c.tier, c.spec.kind != kind, c.inst.last_used, *tie)
    # fewest: biggest first frees the most memory per eviction
    return (c.tier, -c.inst.bytes if memory_pressure else 0, c.inst.last_used, *tie)


@dataclass(frozen=True)
class Need:
    """What must be freed for one node: bytes on that node, and members of each broken cap."""

    node_id: str
    memory_bytes: int
    excesses: tuple[CapExcess, ...]

    def met_by(self, victims: Sequence[Candidate]) -> bool:
        freed = sum(v.inst.bytes for v in victims if v.ref.node_id == self.node_id)
        if freed < self.memory_bytes:
            return False
        refs = {v.ref for v in victims}
        return all(len(refs & e.members) >= e.excess for e in self.excesses)


def select_victims(
    local: Sequence[Candidate], elsewhere: Sequence[Candidate], need: Need, key: Callable[[Candidate], tuple]
) -> tuple[Candidate, ...] | None:
    """Greedy in the strategy's order over the node's own candidates and (while a cluster-wide cap
    is still broken) candidates on other nodes (`elsewhere` may list this node's too: they are
    skipped there), taking only those that still help; then pruning any victim
    the rest already cover, most valuable first. None if even all of them fall short. The result is
    minimal: no single victim can be dropped (property-tested). Both inputs are sorted by `key`."""
    chosen: list[Candidate] = []
    freed = 0
    counts = [0] * len(need.excesses)

    def met() -> bool:
        return freed >= need.memory_bytes and all(n >= e.excess for n, e in zip(counts, need.excesses, strict=True))

    def cluster_caps_open() -> bool:
        return any(e.cluster_wide and n < e.excess for n, e in zip(counts, need.excesses, strict=True))

    li = ei = 0
    while not met():
        take_local = li < len(local)
        take_elsewhere = ei < len(elsewhere) and cluster_caps_open()
        if take_local and take_elsewhere:
            take_local = key(local[li]) <= key(elsewhere[ei])
        if take_local:
            c, li = local[li], li + 1
        elif take_elsewhere:
            c, ei = elsewhere[ei], ei + 1
            if c.ref.node_id == need.node_id:
                continue
        else:
            return None
        frees_memory = c.ref.node_id == need.node_id and freed < need.memory_bytes
        fills = [j for j, e in enumerate(need.excesses) if counts[j] < e.excess and c.ref in e.members]
        if not frees_memory and not fills:
            continue
        chosen.append(c)
        if c.ref.node_id == need.node_id:
            freed += c.inst.bytes
        for j, e in enumerate(need.excesses):
            if c.ref in e.members:
                counts[j] += 1
    for c in reversed(list(chosen)):
        rest = [v for v in chosen if v is not c]
        if need.met_by(rest):
            chosen = rest
    return tuple(chosen)


def set_cost(victims: Sequence[Candidate], strategy: EvictionStrategy, oracle: bool) -> tuple:
    """Compares eviction sets on different nodes: lower is cheaper to lose."""
    max_tier = max((v.tier for v in victims), default=0)
    nbytes = sum(v.inst.bytes for v in victims)
    if oracle or strategy == "cost":
        return (max_tier, sum(v.keep_value for v in victims), nbytes)
    if strategy == "lru":
        return (max_tier, max((v.inst.last_used for v in victims), default=0.0), len(victims), nbytes)
    return (max_tier, len(victims), nbytes)
