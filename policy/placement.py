"""ensure(): where a request for a model goes. Filter nodes by hard constraints, plan the cheapest
room on each, pick by a fixed preference; explain precisely when nothing works."""

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from operator import attrgetter, itemgetter
from typing import NamedTuple

from policy.caps import CapExcess, global_cap_excesses, node_cap_excesses, node_caps_set
from policy.cluster_state import ClusterState, InstanceRef, InstanceState, NodeState, RefKey
from policy.config import PolicyConfig
from policy.decisions import PASSING_PROTECTIONS, Blockers, Decision, LoadFailure, Place, Reject, Use, Wait
from policy.eviction import Candidate, Need, SortedAsRead, eviction_orders, select_victims, set_cost
from policy.failures import NOT_RETRIED_BECAUSE, backoff_left, failed_load_backoff, failure_text, failures_after, load_failed, reject_marked
from policy.memory import (
    estimated_load_seconds,
    gib,
    overhead_bytes,
    protected_for_s,
    required_bytes,
)
from policy.snapshot import Snapshot
from policy.specs import DeviceKind, ModelSpec


def device_for(spec: ModelSpec, node: NodeState) -> DeviceKind | None:
    """The device the model would run on here, or None if the node lacks the one it requires."""
    if spec.device is None:
        return node.devices[0]
    return spec.device if spec.device in node.devices else None


def meets_constraints(spec: ModelSpec, node: NodeState) -> bool:
    if spec.allowed_nodes is not None and node.node_id not in spec.allowed_nodes:
        return False
    if any(node.labels.get(k) != v for k, v in spec.required_labels.items()):
        return False
    return device_for(spec, node) is not None


@dataclass(frozen=True)
class Plan:
    node: NodeState
    device: DeviceKind
    victims: tuple[Candidate, ...]
    free_after: int
    # X4: the node's other ready instances whose kept prompt prefixes are given back first (when
    # the node is short of the room as it is), and the bytes they hold.
    shrink: tuple[Candidate, ...] = ()


class NodeShortfall(NamedTuple):
    """Why one eligible node cannot take the model, even after every eviction allowed. A named
    tuple, as eviction.Need is: a refusal makes one per eligible node."""

    node: NodeState
    memory_short_bytes: int
    unmet_caps: tuple[CapExcess, ...]
    # The protected instances behind it come in two parts: this node's own, and the protected
    # members of the unmet cluster-wide caps, one tuple shared by every node's shortfall (listing
    # them again per node was a decision's largest cost at scale). `span`: where this node's
    # instances would be in that tuple.
    own_blockers: tuple[Candidate, ...]
    cluster_blockers: tuple[Candidate, ...]
    span: tuple[int, int]

    @property
    def blockers(self) -> tuple[Candidate, ...]:
        """Every protected instance behind the shortfall, in the state's order."""
        start, end = self.span
        return self.cluster_blockers[:start] + self.own_blockers + self.cluster_blockers[end:]


def _eligible(spec: ModelSpec, state: ClusterState, exclude_nodes: frozenset[str], holding: frozenset[str] | None = None) -> list[NodeState]:
    """holding: the alive nodes with an instance of the model, when the caller has them."""
    if holding is None:
        holding = frozenset(n.node_id for n in state.nodes if n.alive for i in n.instances if i.model == spec.name)
    anywhere = spec.allowed_nodes is None and not spec.required_labels and spec.device is None  # meets every node's constraints
    return [
        n
        for n in state.nodes
        if n.alive and not n.draining and n.node_id not in exclude_nodes and n.node_id not in holding and (anywhere or meets_constraints(spec, n))
    ]


def _fits_as_is(need: Need) -> bool:
    return need.memory_bytes <= 0 and not need.excesses


class _Planner:
    """Placing one model on one snapshot: what every node's plan shares (the victims allowed, the
    cluster-wide caps, the victims' order) is worked out once, the victims only once some node
    has to evict. With passing_evictable, busy/loading/young instances count as evictable: that
    answers "would waiting help?"."""

    def __init__(self, spec: ModelSpec, snap: Snapshot, passing_evictable: bool, global_excesses: tuple[CapExcess, ...] | None = None) -> None:
        self.spec = spec
        self.snap = snap
        self.config = snap.config
        self.required = required_bytes(spec, snap.config)
        self.global_excesses = tuple(global_cap_excesses(spec, snap.state, snap.config)) if global_excesses is None else global_excesses
        self.oracle = snap.oracle is not None
        self.node_caps = node_caps_set(spec, snap.config)
        # L1 among evicting nodes weighs the victims' keep value in seconds (see _evicting_rank).
        self.idle_floor_s = snap.config.cost.idle_floor_s if snap.config.eviction == "cost" and not self.oracle else None
        self.allowed = {None} | (PASSING_PROTECTIONS if passing_evictable else set())
        self._elsewhere: dict[bool, SortedAsRead] = {}
        self._caps_only: tuple[tuple[Candidate, ...] | None] | None = None  # (victims,) once known
        self._costs: dict[tuple[Candidate, ...], tuple] = {}
        self.margin_bytes, self.margin_fraction = snap.config.safety_margin_bytes, snap.config.safety_margin_fraction

    def need(self, node: NodeState, device: DeviceKind) -> Need:
        # memory.margin_bytes; a spare process there becomes the new instance's (R1)
        memory = self.required - self.credit(node) + self.margin_bytes + int(self.margin_fraction * node.usable_bytes) - self.snap.free(node)
        excesses = self.global_excesses
        if self.node_caps:
            excesses += tuple(node_cap_excesses(self.spec, node, device, self.snap.state, self.config))
        return Need(node.node_id, memory, excesses)

    def credit(self, node: NodeState) -> int:
        """memory.spare_credit (R1)."""
        return node.spare_bytes

    def reclaimed(self, node: NodeState, need: Need) -> Need:
        """X4: a node short of the room as it is counts what its ready instances' kept prompt
        prefixes hold as room: they are given back before anything is evicted there."""
        if need.memory_bytes <= 0:
            return need
        reclaimable = self.snap.reclaimable(node)
        return need._replace(memory_bytes=need.memory_bytes - reclaimable) if reclaimable else need

    def shrink(self, node: NodeState, victims: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
        """The instances whose caches a plan on the node short as it is gives back: its ready ones
        with kept prompt prefixes, less its victims (whose caches go with them)."""
        return tuple(
            c
            for c in self.snap.candidates_by_node.get(node.node_id, ())
            if c.inst.prefix_cache_bytes and c.inst.status == "ready" and c not in victims
        )

    @cached_property
    def pool(self) -> dict[str, tuple[Candidate, ...]]:
        """The candidates that may be evicted, by node."""
        allowed = self.allowed
        found = {node_id: [c for c in cs if c.protection in allowed] for node_id, cs in self.snap.candidates_by_node.items()}
        return {node_id: tuple(cs) for node_id, cs in found.items() if cs}

    @cached_property
    def keep_values(self) -> Mapping[Candidate, float]:
        """The pool's keep values: only the `cost` strategy (and the oracle) order by them."""
        if self.config.eviction != "cost" and not self.oracle:
            return {}
        return self.snap.keep_values(self.pool)

    @cached_property
    def _orders(self) -> tuple[dict[Candidate, tuple], dict[Candidate, tuple]]:
        pool = (c for cs in self.pool.values() for c in cs)
        return eviction_orders(pool, self.keep_values, self.config.eviction, self.spec.kind, self.oracle)

    def order(self, pressure: bool) -> Callable[[Candidate], tuple]:
        """The strategy's order of the pool (E3-E5), without memory pressure or under it."""
        return self._orders[pressure].__getitem__

    def elsewhere(self, pressure: bool) -> SortedAsRead:
        """Victims elsewhere only ever help cluster-wide caps: ordered once, not once per node, and
        only as far as some node reads them."""
        found = self._elsewhere.get(pressure)
        if found is None:
            order = self._orders[pressure]
            keys = list(order.values()) if self._caps_count_everything else [order[c] for c in self._cap_members]
            found = self._elsewhere[pressure] = SortedAsRead(keys, self._by_ref)
        return found

    @cached_property
    def _by_ref(self) -> dict[RefKey, Candidate]:
        return {c.key: c for cs in self.pool.values() for c in cs}

    @cached_property
    def _caps_count_everything(self) -> bool:
        """Whether a cluster-wide cap counts every instance on an alive node (max_instances does):
        then the whole pool are its members, and asking each candidate is not needed."""
        alive = sum(len(cs) for cs in self.snap.candidates_by_node.values())
        return any(len(e.members) == alive for e in self.global_excesses)

    @cached_property
    def _cap_members(self) -> list[Candidate]:
        """The pool's members of cluster-wide caps."""
        members = frozenset().union(*(e.members for e in self.global_excesses))
        return [c for cs in self.pool.values() for c in cs if c.key in members] if members else []

    def victims(self, need: Need) -> tuple[Candidate, ...] | None:
        if _fits_as_is(need):
            return ()  # no candidate need be weighed
        pressure = need.memory_bytes > 0
        if not pressure and len(need.excesses) == len(self.global_excesses):
            # Only cluster-wide caps to relieve: the victims are the first members of those caps in
            # the order, wherever they are, so every such node gets the same set (computed once).
            if self._caps_only is None:
                self._caps_only = (self._select(need, pressure),)
            return self._caps_only[0]
        return self._select(need, pressure)

    def _select(self, need: Need, pressure: bool) -> tuple[Candidate, ...] | None:
        key = self.order(pressure)
        local = sorted(self.pool.get(need.node_id, ()), key=key)
        return select_victims(local, self.elsewhere(pressure), need, key)

    def rank(self, node: NodeState, victims: tuple[Candidate, ...], shrinks: bool) -> tuple[tuple, int]:
        """The node's place in the preference (lowest first), and what its plan leaves free."""
        node_id = node.node_id
        freed_here = sum(v.bytes for v in victims if v.key[0] == node_id) + (self.snap.reclaimable(node) if shrinks else 0)
        free_after = self.snap.free(node) + freed_here - self.required + self.credit(node)
        fetch_s = self.snap.fetch_seconds(self.spec, node)  # L1: where the model is ready soonest
        if not victims:
            fit = free_after if self.config.fit_preference == "pack" else -free_after
            return (0, fetch_s, fit, node_id), free_after
        cost = self._costs.get(victims)
        if cost is None:
            cost = self._costs[victims] = set_cost(victims, self.keep_values, self.config.eviction, self.oracle)
        return (1, *_evicting_rank(cost, fetch_s, self.idle_floor_s), node_id), free_after

    def best(self, eligible: list[NodeState]) -> tuple[Plan | None, list[NodeShortfall]]:
        """The best plan over the eligible nodes; when there is none, every node's shortfall. A node
        that fits as it is beats any that must give back kept prompt prefixes (X4), which beats any
        that evicts (P7): then no later kind of plan is made."""
        needs = []
        for node in eligible:
            device = device_for(self.spec, node)
            assert device is not None
            needs.append((node, device, self.need(node, device)))
        options: list[tuple[NodeState, DeviceKind, tuple[Candidate, ...], bool]] = [
            (node, device, (), False) for node, device, need in needs if _fits_as_is(need)
        ]
        short: list[tuple[NodeState, Need]] = []
        if not options:
            reclaimed = [(node, device, self.reclaimed(node, need), need.memory_bytes > 0) for node, device, need in needs]
            options = [(node, device, (), True) for node, device, need, shrinks in reclaimed if shrinks and _fits_as_is(need)]
            if not options:
                for node, device, need, shrinks in reclaimed:
                    victims = self.victims(need)
                    if victims is None:
                        short.append((node, need))
                    else:
                        options.append((node, device, victims, shrinks))
        if not options:
            return None, [self.shortfall(node, need) for node, need in short]
        ranked = [(*self.rank(node, victims, shrinks), node, device, victims, shrinks) for node, device, victims, shrinks in options]
        _, free_after, node, device, victims, shrinks = min(ranked, key=lambda r: r[0])
        return Plan(node, device, victims, free_after, self.shrink(node, victims) if shrinks else ()), []

    def any_plan(self, eligible: list[NodeState]) -> bool:
        """Whether some eligible node has a plan. Which one does not matter here, so no victims are
        chosen: select_victims finds a set exactly when all the allowed candidates together do."""
        for node in eligible:
            device = device_for(self.spec, node)
            assert device is not None
            memory_short, unmet = self.short(node, self.reclaimed(node, self.need(node, device)))
            if memory_short <= 0 and not unmet:
                return True
        return False

    @cached_property
    def _alive_instances(self) -> int:
        return sum(len(cs) for cs in self.snap.candidates_by_node.values())

    def _counts_everything(self, e: CapExcess) -> bool:
        """Whether the cap counts every instance on an alive node (max_instances does): its members
        are a subset of those, so as many is all of them."""
        return len(e.members) == self._alive_instances

    @cached_property
    def unmet_cluster_caps(self) -> tuple[CapExcess, ...]:
        """Cluster-wide caps the pool cannot relieve: the same for every node."""
        if not self.global_excesses:
            return ()
        pooled = sum(len(cs) for cs in self.pool.values())
        if all(self._counts_everything(e) for e in self.global_excesses):
            return tuple(e for e in self.global_excesses if pooled < e.excess)  # the pool are all members
        keys = {c.key for cs in self.pool.values() for c in cs}
        return tuple(e for e in self.global_excesses if (pooled if self._counts_everything(e) else len(keys & e.members)) < e.excess)

    @cached_property
    def _unmet_cluster_members(self) -> frozenset[RefKey] | None:
        """The members of the unmet cluster-wide caps, or None when they are every instance."""
        unmet = self.unmet_cluster_caps
        if any(self._counts_everything(e) for e in unmet):
            return None
        return frozenset().union(*(e.members for e in unmet))

    @cached_property
    def cluster_blockers(self) -> tuple[tuple[Candidate, ...], dict[str, tuple[int, int]]]:
        """The protected members of the unmet cluster-wide caps in the state's order, and where
        each node's instances are in that tuple."""
        found: list[Candidate] = []
        spans: dict[str, tuple[int, int]] = {}
        if self.unmet_cluster_caps:
            members = self._unmet_cluster_members
            for node_id, cs in self.snap.candidates_by_node.items():
                start = len(found)
                if members is None:
                    found.extend([c for c in cs if c.protection is not None])
                else:
                    found.extend([c for c in cs if c.protection is not None and c.key in members])
                spans[node_id] = (start, len(found))
        return tuple(found), spans

    def short(self, node: NodeState, need: Need) -> tuple[int, tuple[CapExcess, ...]]:
        """The memory and the caps still short after every allowed eviction. Only this node's
        evictions relieve its memory and its own caps."""
        own_pool = self.pool.get(node.node_id, ())
        memory_short = need.memory_bytes - sum([c.bytes for c in own_pool])
        node_caps = need.excesses[len(self.global_excesses) :]
        if not node_caps:
            return memory_short, self.unmet_cluster_caps
        own_keys = {c.key for c in own_pool}
        return memory_short, self.unmet_cluster_caps + tuple(e for e in node_caps if len(own_keys & e.members) < e.excess)

    def shortfall(self, node: NodeState, need: Need) -> NodeShortfall:
        """What is still missing after every allowed eviction, and the protected instances behind it:
        all of the node's protected instances when memory is short, else the members of the caps
        still exceeded."""
        memory_short, unmet = self.short(node, need)
        protected = [c for c in self.snap.candidates_by_node.get(node.node_id, ()) if c.protection is not None]
        if memory_short > 0 or not protected:
            own = tuple(protected)
        else:
            members = self._unmet_cluster_members if self.unmet_cluster_caps else frozenset()
            node_unmet = unmet[len(self.unmet_cluster_caps) :]
            if members is None:  # a cap still exceeded counts every instance
                own = tuple(protected)
            else:
                own = tuple(c for c in protected if c.key in members or any(c.key in e.members for e in node_unmet))
        cluster, spans = self.cluster_blockers
        return NodeShortfall(node, max(0, memory_short), unmet, own, cluster, spans.get(node.node_id, (0, 0)))


def plan_placement(
    spec: ModelSpec,
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    passing_evictable: bool = False,
    oracle_keep_values: Mapping[InstanceRef, float] | None = None,
    waited_s: float = 0.0,
) -> tuple[Plan | None, list[NodeShortfall], list[NodeState]]:
    """Best plan over all eligible nodes; when there is none, the shortfall of every eligible node
    (empty when a plan was found); and the eligible nodes. With passing_evictable, busy/loading/young
    instances count as evictable: that answers "would waiting help?"."""
    eligible = _eligible(spec, state, exclude_nodes)
    plan, shortfalls = _Planner(spec, Snapshot(state, now, config, oracle_keep_values, waited_s), passing_evictable).best(eligible)
    return plan, shortfalls, eligible


def _evicting_rank(cost: tuple, fetch_s: float, idle_floor_s: float | None) -> tuple:
    """L1 among evicting nodes. With the `cost` strategy both sides are seconds of loading: the set's
    keep value (expected reload seconds per second) over `idle_floor_s` is what the victims are
    expected to cost in reloads, the fetch what this request waits for the weights; the node with
    the least of both wins. Other strategies order sets in their own terms: fetch time breaks ties.
    idle_floor_s: the config's, under the `cost` strategy without the oracle; None otherwise."""
    if idle_floor_s is not None:
        return (cost[0], cost[1] * idle_floor_s + fetch_s, *cost[2:])
    return (*cost, fetch_s)


def _need_text(spec: ModelSpec, config: PolicyConfig) -> str:
    return (
        f"model {spec.name} needs {gib(required_bytes(spec, config))} "
        f"(weights {gib(spec.weight_bytes)} + KV {gib(spec.kv_reserved_bytes)}"
        + (f" + activations {gib(spec.activation_bytes)}" if spec.activation_bytes else "")
        + f" + overhead {gib(overhead_bytes(spec, config))})"
    )


# A refusal's message names at most this many instances per protection, then how many more (its
# `blockers` data lists every one): at a thousand busy instances the message was ~56 KB, in every
# event and 503 body.
NAMED_PER_PROTECTION = 8

_PROTECTION_WORDS = {
    "pinned": "pinned models",
    "min_copies": "models at their min_copies",
    "busy": "busy models",
    "loading": "loading models",
    "draining": "draining models",
    "young": "models loaded too recently to be evicted (E3: about twice their reload time)",
}


class _ClusterNames:
    """The shared cluster-wide blockers of a refusal's shortfalls (NodeShortfall.cluster_blockers),
    named as _shortfall_text names them, by protection: worked out once for the three shortfalls a
    refusal describes, each of which names every one of them (at scale, a thousand names three
    times was a large part of a refusal's cost). A node's own instances are a span of that tuple,
    replaced by its own blockers, so every other blocker is on another node: named model@node."""

    def __init__(self, cluster: tuple[Candidate, ...]) -> None:
        # protection -> (positions in the tuple, names, running sums of bytes from 0)
        self.groups: dict[str, tuple[Sequence[int], list[str], list[int]]] = {}
        protections = [c.protection or "" for c in cluster]
        names = [f"{c.key[1]}@{c.key[0]}" for c in cluster]  # str(InstanceRef), without building one
        sizes = [c.bytes for c in cluster]
        kinds = set(protections)
        if len(kinds) == 1:  # the usual case: every one of them busy, say
            self.groups[protections[0]] = (range(len(cluster)), names, list(accumulate(sizes, initial=0)))
            return
        for prot in kinds:
            positions = [i for i, p in enumerate(protections) if p == prot]
            self.groups[prot] = (positions, [names[i] for i in positions], list(accumulate((sizes[i] for i in positions), initial=0)))

    def held(self, s: NodeShortfall) -> dict[str, tuple[list[str], int]]:
        """By protection, the names of s.blockers (its own by model alone) and the bytes they hold."""
        start, end = s.span
        own_names: dict[str, list[str]] = {}
        own_bytes: dict[str, int] = {}
        for b in s.own_blockers:
            mark = b.protection or ""
            own_names.setdefault(mark, []).append(b.key[1])
            own_bytes[mark] = own_bytes.get(mark, 0) + b.bytes
        found: dict[str, tuple[list[str], int]] = {}
        for prot in self.groups.keys() | own_names.keys():
            positions, names, sums = self.groups.get(prot, ((), [], [0]))
            before, after = bisect_left(positions, start), bisect_left(positions, end)
            mine = own_names.get(prot, [])
            if before or mine or after < len(positions):
                found[prot] = (names[:before] + mine + names[after:], sums[before] + own_bytes.get(prot, 0) + sums[-1] - sums[after])
        return found


def _shortfall_text(s: NodeShortfall, free: int, reclaimable: int, cluster_names: _ClusterNames) -> str:
    held = "; ".join(
        f"{_PROTECTION_WORDS[prot]} {_some(names)} hold {gib(nbytes)}" for prot, (names, nbytes) in sorted(cluster_names.held(s).items())
    )
    here = s.node.node_id
    kept = f" (and {gib(reclaimable)} of kept prompt prefixes, given back first)" if reclaimable else ""
    parts = [f"on {here}: {gib(free)} free{kept} of {gib(s.node.usable_bytes)} usable"]
    if s.memory_short_bytes > 0:
        parts.append(f"{gib(s.memory_short_bytes)} short after every allowed eviction")
    if held:
        parts.append(held)
    if s.unmet_caps:
        parts.append("cap " + ", ".join(e.label for e in s.unmet_caps) + " still exceeded")
    return ", ".join(parts)


def _some(names: list[str]) -> str:
    """The first NAMED_PER_PROTECTION names, then how many more."""
    if len(names) <= NAMED_PER_PROTECTION:
        return ", ".join(names)
    return f"{', '.join(names[:NAMED_PER_PROTECTION])} and {len(names) - NAMED_PER_PROTECTION} more"


def blockers_of(shortfalls: list[NodeShortfall]) -> Blockers:
    """Every protected instance the shortfalls name, once, in the order they first name it."""
    seen: dict[RefKey, Candidate] = {}
    taken: list[tuple[Candidate, ...]] = []
    for s in shortfalls:
        if any(s.cluster_blockers is t for t in taken):
            named = s.own_blockers  # what else it names is in a cluster-wide tuple already taken
        else:
            named = s.blockers
            taken.append(s.cluster_blockers)
        for c in named:
            seen.setdefault(c.key, c)
    found = seen.values()
    return Blockers(
        node_ids=tuple(map(itemgetter(0), seen)),
        models=tuple(map(itemgetter(1), seen)),
        protections=tuple(map(attrgetter("protection"), found)),  # every blocker is protected: None fails here
        bytes=tuple(map(attrgetter("bytes"), found)),
    )


def _retry_after(blockers: Blockers, snap: Snapshot) -> float:
    """Soonest a passing protection may end: a young instance's remaining age, else the poll period."""
    config = snap.config
    waits = [config.retry_poll_s]
    for node_id, model, protection in zip(blockers.node_ids, blockers.models, blockers.protections, strict=True):
        if protection == "young":
            node = snap.nodes.get(node_id)
            inst = node.instance(model) if node else None
            if inst is not None:
                protected = protected_for_s(inst, snap.state.catalog[model], config)  # until it comes of age, or this request has waited as long
                waits.append(max(0.1, protected - max(snap.now - inst.loaded_at, snap.waited_s)))
    return min(waits)


def ensure(
    model: str,
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    *,
    waited_s: float = 0.0,
    exclude_nodes: frozenset[str] = frozenset(),
    oracle_keep_values: Mapping[InstanceRef, float] | None = None,
) -> Decision:
    """Decide what to do with a request for `model` (rules P1-P8 and P10 in docs/residency.md).

    waited_s: how long this request has already waited (the caller keeps the clock).
    oracle_keep_values: replaces the strategy's ordering by known keep values (the simulator's
    offline reference); None in production.
    """
    spec = state.catalog.get(model)
    if spec is None:
        return Reject(model=model, code="unknown_model", message=f"model {model!r} is not in the registry")

    copies = [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model]
    ready = [(n, i) for n, i in copies if i.status == "ready"]
    if ready:
        node, _ = min(ready, key=lambda p: (p[1].in_flight, p[0].node_id))
        return Use(instance=InstanceRef(node_id=node.node_id, model=model))

    loading = [(n, i) for n, i in copies if i.status == "loading"]
    if loading:
        node, inst = loading[0]
        expected = spec.load_seconds_estimate or estimated_load_seconds(inst.bytes, config)
        return Wait(
            model=model,
            code="loading",
            message=f"model {model} is loading on {node.node_id}",
            retry_after_s=max(0.1, min(config.retry_poll_s, expected - (now - inst.loaded_at))),
        )

    # P10: a model marked failed is refused at once while its back-off lasts: no placement, no
    # eviction. Once it has passed, one new attempt is placed as usual.
    mark = state.failed.get(model)
    if mark is not None and backoff_left(mark, now, config) > 0:
        return reject_marked(mark, now, config)

    planner = _Planner(spec, Snapshot(state, now, config, oracle_keep_values, waited_s), passing_evictable=False)
    eligible = _eligible(spec, state, exclude_nodes, frozenset(n.node_id for n, _ in copies))
    plan, shortfalls = planner.best(eligible)
    if plan is not None:
        return place_from_plan(spec, plan, config)
    draining = [(n, i) for n, i in copies if i.status == "draining"]
    if draining:  # W1: drained for a swap, it is gone once what runs on it has ended: wait for that
        return _behind_drain(model, draining[0][0], draining[0][1], waited_s, config)
    return _refuse(planner, shortfalls, eligible, waited_s)


def _behind_drain(model: str, node: NodeState, inst: InstanceState, waited_s: float, config: PolicyConfig) -> Wait | Reject:
    """P3 for a draining copy with no other place for the model: wait, as P8 waits for busy instances."""
    message = f"model {model} is draining on {node.node_id} to make room for another (a swap, W1); it is placed again once it has left"
    blockers = Blockers(node_ids=(node.node_id,), models=(model,), protections=("draining",), bytes=(inst.bytes,))
    if config.contention == "wait" and waited_s < config.wait_timeout_s:
        return Wait(model=model, code="busy", message=message, blockers=blockers, retry_after_s=config.retry_poll_s)
    return Reject(model=model, code="busy", message=message, blockers=blockers, retry_after_s=config.retry_poll_s)


def place_from_plan(spec: ModelSpec, plan: Plan, config: PolicyConfig) -> Place:
    if plan.victims:
        reason = "evicting " + ", ".join(str(v.ref) for v in plan.victims)
    else:
        reason = "fits after giving back kept prompt prefixes" if plan.shrink else "fits without eviction"
    if plan.shrink:
        reason += f" ({_shrink_text(plan.shrink)})" if not plan.victims else f", after giving back kept prompt prefixes ({_shrink_text(plan.shrink)})"
    return Place(
        model=spec.name,
        node_id=plan.node.node_id,
        device=plan.device,
        bytes=required_bytes(spec, config),
        evict=tuple(v.ref for v in plan.victims),
        shrink=tuple(c.ref for c in plan.shrink),
        reason=reason,
    )


def _shrink_text(shrink: Sequence[Candidate]) -> str:
    return f"{gib(sum(c.inst.prefix_cache_bytes for c in shrink))} held by " + ", ".join(c.key[1] for c in shrink)


def _refuse(planner: _Planner, shortfalls: list[NodeShortfall], eligible: list[NodeState], waited_s: float) -> Wait | Reject:
    spec, snap, config = planner.spec, planner.snap, planner.config
    if not eligible:
        constraints = []
        if spec.allowed_nodes is not None:
            constraints.append(f"nodes {sorted(spec.allowed_nodes)}")
        if spec.required_labels:
            constraints.append(f"labels {spec.required_labels}")
        if spec.device is not None:
            constraints.append(f"device {spec.device}")
        return Reject(
            model=spec.name,
            code="no_eligible_node",
            message=f"no alive, non-draining node meets the constraints of model {spec.name}"
            + (f" ({'; '.join(constraints)})" if constraints else ""),
        )
    need = required_bytes(spec, config)
    # What could ever fit, and whether waiting helps, read our accounting alone: memory a report
    # still shows held by a process that is exiting, or set aside for a load awaiting its room, is
    # on its way back, so a model it leaves short waits for it rather than being refused (P5, P8).
    settled = snap.once_settled()
    capacities = {n.node_id: settled.ever_available(n) for n in eligible}
    if all(need > capacities[n.node_id] for n in eligible):
        largest = max(eligible, key=lambda n: capacities[n.node_id])
        return Reject(
            model=spec.name,
            code="too_large",
            message=f"{_need_text(spec, config)}; the largest eligible node, {largest.node_id}, can give at most "
            f"{gib(max(0, capacities[largest.node_id]))} after its safety margin",
        )

    # Would waiting help? Some plan exists once the passing protections end (which plan, whatever
    # the victims' order, does not matter here).
    waiting_helps = _Planner(spec, settled, passing_evictable=True, global_excesses=planner.global_excesses).any_plan(eligible)
    ordered = sorted(shortfalls, key=lambda s: -capacities[s.node.node_id])
    cluster_names = _ClusterNames(planner.cluster_blockers[0])
    detail = "; ".join(_shortfall_text(s, snap.free(s.node), snap.reclaimable(s.node), cluster_names) for s in ordered[:3])
    if len(ordered) > 3:
        detail += f"; and {len(ordered) - 3} more nodes"
    blockers = blockers_of(shortfalls)
    if not waiting_helps:
        return Reject(
            model=spec.name,
            code="blocked",
            message=f"cannot place: {_need_text(spec, config)}; {detail}",
            blockers=blockers,
        )
    retry_after = _retry_after(blockers, snap)
    message = f"model {spec.name} must wait for busy, loading or young instances: {_need_text(spec, config)}; {detail}"
    if config.contention == "wait" and waited_s < config.wait_timeout_s:
        return Wait(model=spec.name, code="busy", message=message, blockers=blockers, retry_after_s=retry_after)
    if config.contention == "wait":
        message = f"gave up after waiting {waited_s:.0f} s: " + message
    return Reject(model=spec.name, code="busy", message=message, blockers=blockers, retry_after_s=retry_after)


def retry_after_failure(failure: LoadFailure, state: ClusterState, now: float, config: PolicyConfig) -> Place | Reject:
    """Rule P9: only a first out-of-memory failure is retried, after evicting every evictable
    instance on the node where it failed (or, if that does not meet the need there, placed
    elsewhere by P4-P7). Any other reason, and any second failure, is `Reject` `load_failed` with
    no eviction and retry_after_s = the back-off the model is about to get (P10): the caller then
    records it with `transitions.mark_failed`. `state` no longer holds the failed instance."""
    spec = state.catalog.get(failure.model)
    if spec is None:
        return Reject(model=failure.model, code="unknown_model", message=f"model {failure.model!r} is not in the registry")
    backoff = failed_load_backoff(failures_after(state, failure.model), config)

    def refuse(why: str) -> Reject:
        said = f"loading model {failure.model} on {failure.node_id} failed ({failure_text(failure.reason, failure.message)}) and {why}"
        return load_failed(failure.model, said, f"in {backoff:.0f} s" if backoff > 0 else "on the next request", backoff if backoff > 0 else None)

    if failure.reason != "out_of_memory":
        return refuse(f"is not retried: {NOT_RETRIED_BECAUSE[failure.reason]}, and more memory cannot fix that")
    if failure.attempt >= 2:
        return refuse(f"is not retried again: {NOT_RETRIED_BECAUSE['out_of_memory']}")
    node = state.node(failure.node_id)
    if node is not None and node.alive and not node.draining and meets_constraints(spec, node):
        device = device_for(spec, node)
        assert device is not None
        planner = _Planner(spec, Snapshot(state, now, config), passing_evictable=False)
        more = tuple(c for c in planner.snap.candidates_by_node.get(node.node_id, ()) if c.protection is None)
        as_is = planner.need(node, device)
        need = planner.reclaimed(node, as_is)
        if more and need.met_by(more):
            shrink = planner.shrink(node, more) if as_is.memory_bytes > 0 else ()
            return Place(
                model=spec.name,
                node_id=node.node_id,
                device=device,
                bytes=required_bytes(spec, config),
                evict=tuple(c.ref for c in more),
                shrink=tuple(c.ref for c in shrink),
                reason="retrying after running out of memory, evicting every evictable instance"
                + (f", after giving back kept prompt prefixes ({_shrink_text(shrink)})" if shrink else ""),
            )
    decision = ensure(failure.model, state, now, config, exclude_nodes=frozenset({failure.node_id}))
    if isinstance(decision, Place):
        return decision
    return refuse("no other placement is possible now")
