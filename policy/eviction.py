"""Which instances may be evicted, in what order each strategy gives them up, and the smallest set
that makes room. Ordering is where strategies differ; safety (protections) is the same for all."""

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from policy.caps import CapExcess
from policy.cluster_state import ClusterState, InstanceRef, InstanceState, RefKey
from policy.config import EvictionStrategy, PolicyConfig
from policy.decisions import Protection
from policy.memory import protected_for_s
from policy.specs import ModelKind, ModelSpec


class Candidate:
    """An instance seen as a possible victim in one decision (policy/snapshot.py makes one per
    instance, and keeps their keep values). Nothing changes it once made; it is a plain class
    rather than a frozen dataclass because a decision at scale makes a thousand, and a frozen one
    costs four times as much to build. Compared by identity. key: the instance as (node_id, model)."""

    __slots__ = ("key", "inst", "spec", "protection", "tier", "bytes")

    def __init__(self, key: RefKey, inst: InstanceState, spec: ModelSpec, protection: Protection | None) -> None:
        self.key = key
        self.inst = inst
        self.spec = spec
        self.protection = protection
        # Keep-warm instances are given up only when nothing else will do (rule E5).
        self.tier = 1 if spec.keep_warm else 0
        # What evicting it frees beyond what its node's caches give back first (rule X4): a ready
        # instance's kept prompt prefixes are counted with the node's reclaimable memory, so only
        # its `bytes` here; any other's go with it. Read often: a plain attribute reads faster
        # than a pydantic field.
        self.bytes = inst.bytes if inst.status == "ready" else inst.bytes + inst.prefix_cache_bytes

    @property
    def ref(self) -> InstanceRef:
        """Built when a decision names the instance (a victim, a blocker), not for every candidate."""
        return InstanceRef(node_id=self.key[0], model=self.key[1])

    @property
    def node_id(self) -> str:
        return self.key[0]


def ready_copies(state: ClusterState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in state.nodes:
        if node.alive:
            for inst in node.instances:
                if inst.status == "ready":
                    counts[inst.model] = counts.get(inst.model, 0) + 1
    return counts


def protection_of(inst: InstanceState, spec: ModelSpec, copies: int, now: float, config: PolicyConfig, waited_s: float = 0.0) -> Protection | None:
    """Why this instance may not be evicted now, or None. Lasting reasons are named before passing
    ones; `young` lasts memory.protected_for_s after its load, and not against a request that has
    waited that long (E3)."""
    if spec.pinned:
        return "pinned"
    status = inst.status
    if status == "ready" and spec.min_copies > 0 and copies <= spec.min_copies:
        return "min_copies"
    if status == "loading":
        return "loading"
    if status == "draining":
        return "draining"
    if inst.in_flight > 0:
        return "busy"
    protected = protected_for_s(inst, spec, config)
    if now - inst.loaded_at < protected and waited_s < protected:
        return "young"
    return None


def keep_valuer(now: float, config: PolicyConfig) -> Callable[[InstanceState, ModelSpec, float], float]:
    """The `cost` strategy's estimate of what losing an instance costs: reload seconds on its node
    (the load, plus fetching the weights again when that node's store does not hold them, L2),
    times a weight for utility models, times an estimated reuse rate of 1 / (idle seconds + floor).
    (A frequency term, requests served / age, was tried in the simulator and reloaded more.)

    A function of (instance, spec, fetch seconds) at `now`, with the config's figures read once: a
    decision asks it of every instance it weighs, so memory.reload_seconds is written out in it
    (the same figure, tests/test_policy_scale.py checks it)."""
    utility_weight, idle_floor_s = config.cost.utility_weight, config.cost.idle_floor_s
    load_base_s, load_bandwidth = config.load_base_s, config.load_bandwidth_bytes_per_s

    def keep_value(inst: InstanceState, spec: ModelSpec, fetch_s: float) -> float:
        weight = utility_weight if spec.role == "utility" else 1.0
        idle_s = now - inst.last_used
        idle_s = idle_s if idle_s > 0.0 else 0.0  # max(0.0, idle_s), without the call's cost
        reload_s = inst.load_seconds
        if reload_s is None:
            reload_s = spec.load_seconds_estimate
            if reload_s is None:
                reload_s = load_base_s + inst.bytes / load_bandwidth  # memory.estimated_load_seconds
        return (reload_s + fetch_s) * weight / (idle_s + idle_floor_s)

    return keep_value


def eviction_orders(
    candidates: Iterable[Candidate], keep_values: Mapping[Candidate, float], strategy: EvictionStrategy, kind: ModelKind, oracle: bool
) -> tuple[dict[Candidate, tuple], dict[Candidate, tuple]]:
    """Sort keys by candidate, without memory pressure and under it: the first candidate is given
    up first. Tier (keep-warm) always comes first; the instance itself, (node_id, model), breaks
    ties: every key ends with it (SortedAsRead relies on that)."""
    relaxed: dict[Candidate, tuple] = {}
    pressed: dict[Candidate, tuple] = {}
    if oracle or strategy == "cost":
        for c in candidates:
            value = keep_values[c]
            relaxed[c] = (c.tier, value, c.key)
            nbytes = c.bytes
            pressed[c] = (c.tier, value / (nbytes if nbytes > 1 else 1), c.key)  # per byte freed (max(nbytes, 1))
    elif strategy == "lru":
        for c in candidates:
            relaxed[c] = pressed[c] = (c.tier, c.spec.kind != kind, c.inst.last_used, c.key)
    else:  # fewest: under pressure biggest first, which frees the most memory per eviction
        for c in candidates:
            relaxed[c] = (c.tier, 0, c.inst.last_used, c.key)
            pressed[c] = (c.tier, -c.bytes, c.inst.last_used, c.key)
    return relaxed, pressed


class Ordered(Protocol):
    """Candidates read by position, first to give up first."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Candidate: ...


class SortedAsRead:
    """Candidates in an eviction order (their keys from eviction_orders), sorted only as far as
    they are read: a heap hands out the next one when a position past those already sorted is
    asked for. select_victims reads the victims elsewhere from the front, rarely past the first
    few, and sorting every instance of a large cluster for that was a large part of a decision's
    cost. Every order's key ends with the instance, (node_id, model), so no two keys are equal, the
    positions read are those of the sorted keys, and the key names its candidate in `by_ref`."""

    __slots__ = ("_heap", "_sorted", "_len", "_by_ref")

    def __init__(self, keys: list[tuple], by_ref: Mapping[RefKey, Candidate]) -> None:
        heapq.heapify(keys)
        self._heap = keys
        self._sorted: list[Candidate] = []
        self._len = len(keys)
        self._by_ref = by_ref

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int, /) -> Candidate:
        done = self._sorted
        if not 0 <= index < self._len:
            raise IndexError(index)
        while len(done) <= index:
            done.append(self._by_ref[heapq.heappop(self._heap)[-1]])
        return done[index]


class Need(NamedTuple):
    """What must be freed for one node: bytes on that node, and members of each broken cap. A
    named tuple, not a frozen dataclass: a decision makes one per node, and a frozen dataclass
    costs three times as much to build."""

    node_id: str
    memory_bytes: int
    excesses: tuple[CapExcess, ...]

    def met_by(self, victims: Sequence[Candidate]) -> bool:
        freed = sum(v.bytes for v in victims if v.node_id == self.node_id)
        if freed < self.memory_bytes:
            return False
        keys = {v.key for v in victims}
        return all(len(keys & e.members) >= e.excess for e in self.excesses)


def select_victims(local: Sequence[Candidate], elsewhere: Ordered, need: Need, key: Callable[[Candidate], tuple]) -> tuple[Candidate, ...] | None:
    """Greedy in the strategy's order over the node's own candidates and (while a cluster-wide cap
    is still broken) candidates on other nodes (`elsewhere` may list this node's too: they are
    skipped there), taking only those that still help; then pruning any victim
    the rest already cover, most valuable first. None if even all of them fall short. The result is
    minimal: no single victim can be dropped (property-tested). Both inputs are sorted by `key`."""
    node_id, memory, excesses = need.node_id, need.memory_bytes, need.excesses
    chosen: list[Candidate] = []
    freed = 0
    missing = [e.excess for e in excesses]  # members each broken cap still lacks
    cluster_wide = [j for j, e in enumerate(excesses) if e.cluster_wide]
    li = ei = 0
    while freed < memory or any(m > 0 for m in missing):
        take_local = li < len(local)
        take_elsewhere = ei < len(elsewhere) and any(missing[j] > 0 for j in cluster_wide)
        if take_local and take_elsewhere:
            take_local = key(local[li]) <= key(elsewhere[ei])
        if take_local:
            c, li = local[li], li + 1
        elif take_elsewhere:
            c, ei = elsewhere[ei], ei + 1
            if c.key[0] == node_id:
                continue
        else:
            return None
        here = c.key[0] == node_id
        caps = [j for j, e in enumerate(excesses) if c.key in e.members]
        if not (here and freed < memory) and not any(missing[j] > 0 for j in caps):
            continue  # it would help nothing still missing
        chosen.append(c)
        if here:
            freed += c.bytes
        for j in caps:
            missing[j] -= 1
    if len(chosen) > 1:  # one victim is never redundant: without it the need was not met
        for c in reversed(list(chosen)):
            rest = [v for v in chosen if v is not c]
            if need.met_by(rest):
                chosen = rest
    return tuple(chosen)


def set_cost(victims: Sequence[Candidate], keep_values: Mapping[Candidate, float], strategy: EvictionStrategy, oracle: bool) -> tuple:
    """Compares eviction sets on different nodes: lower is cheaper to lose."""
    max_tier = max((v.tier for v in victims), default=0)
    nbytes = sum(v.bytes for v in victims)
    if oracle or strategy == "cost":
        return (max_tier, sum(keep_values[v] for v in victims), nbytes)
    if strategy == "lru":
        return (max_tier, max((v.inst.last_used for v in victims), default=0.0), len(victims), nbytes)
    return (max_tier, len(victims), nbytes)
