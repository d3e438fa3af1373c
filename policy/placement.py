"""ensure(): where a request for a model goes. Filter nodes by hard constraints, plan the cheapest
room on each, pick by a fixed preference; explain precisely when nothing works."""

from collections.abc import Mapping
from dataclasses import dataclass

from policy.caps import CapExcess, global_cap_excesses, node_cap_excesses
from policy.cluster_state import ClusterState, InstanceRef, InstanceState, NodeState
from policy.config import PolicyConfig
from policy.decisions import PASSING_PROTECTIONS, Blocker, Decision, LoadFailure, Place, Reject, Use, Wait
from policy.eviction import Candidate, Need, candidates, eviction_order_key, select_victims, set_cost
from policy.failures import NOT_RETRIED_BECAUSE, backoff_left, failed_load_backoff, failure_text, failures_after, load_failed, reject_marked
from policy.locality import fetch_seconds
from policy.memory import (
    estimated_load_seconds,
    ever_available_bytes,
    free_bytes,
    gib,
    margin_bytes,
    overhead_bytes,
    required_bytes,
)
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


@dataclass(frozen=True)
class NodeShortfall:
    """Why one eligible node cannot take the model, even after every eviction allowed."""

    node: NodeState
    memory_short_bytes: int
    unmet_caps: tuple[CapExcess, ...]
    blockers: tuple[Candidate, ...]


def _need_on(
    spec: ModelSpec,
    node: NodeState,
    device: DeviceKind,
    state: ClusterState,
    config: PolicyConfig,
    global_excesses: list[CapExcess],
) -> Need:
    memory = required_bytes(spec, config) + margin_bytes(node, config) - free_bytes(node)
    excesses = tuple(global_excesses) + tuple(node_cap_excesses(spec, node, device, state, config))
    return Need(node_id=node.node_id, memory_bytes=memory, excesses=excesses)


def _relevant(pool: list[Candidate], need: Need) -> list[Candidate]:
    """Candidates that can help this node: its own instances, and members of broken caps."""
    members: set[InstanceRef] = set()
    for e in need.excesses:
        members |= e.members
    return [c for c in pool if c.ref.node_id == need.node_id or c.ref in members]


def plan_placement(
    spec: ModelSpec,
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    passing_evictable: bool = False,
    oracle_keep_values: Mapping[InstanceRef, float] | None = None,
) -> tuple[Plan | None, list[NodeShortfall], list[NodeState]]:
    """Best plan over all eligible nodes, the shortfall of every eligible node that has none, and
    the eligible nodes. With passing_evictable, busy/loading/young instances count as evictable:
    that answers "would waiting help?"."""
    eligible = [
        n
        for n in state.nodes
        if n.alive and not n.draining and n.node_id not in exclude_nodes and n.instance(spec.name) is None and meets_constraints(spec, n)
    ]
    global_excesses = global_cap_excesses(spec, state, config)
    oracle = oracle_keep_values is not None
    allowed = {None} | (PASSING_PROTECTIONS if passing_evictable else set())
    everyone = candidates(state, now, config, oracle_keep_values)
    pool = [c for c in everyone if c.protection in allowed]
    by_node: dict[str, list[Candidate]] = {}
    for c in pool:
        by_node.setdefault(c.ref.node_id, []).append(c)
    # Victims elsewhere only ever help cluster-wide caps: sort those once, not once per node.
    global_members = frozenset().union(*(e.members for e in global_excesses))
    elsewhere = [c for c in pool if c.ref in global_members]

    def key_for(pressure: bool):
        return lambda c: eviction_order_key(c, config.eviction, spec.kind, pressure, oracle)

    elsewhere_sorted = {p: sorted(elsewhere, key=key_for(p)) for p in (False, True)} if elsewhere else {}

    plans: list[tuple[tuple, Plan]] = []
    shortfalls: list[NodeShortfall] = []
    for node in eligible:
        device = device_for(spec, node)
        assert device is not None
        need = _need_on(spec, node, device, state, config, global_excesses)
        pressure = need.memory_bytes > 0
        local = sorted(by_node.get(node.node_id, []), key=key_for(pressure))
        victims = select_victims(local, elsewhere_sorted.get(pressure, []), need, key_for(pressure))
        if victims is None:
            shortfalls.append(_shortfall(node, need, _relevant(pool, need), everyone))
            continue
        freed_here = sum(v.inst.bytes for v in victims if v.ref.node_id == node.node_id)
        free_after = free_bytes(node) + freed_here - required_bytes(spec, config)
        plan = Plan(node, device, victims, free_after)
        fetch_s = fetch_seconds(spec, node, state, config)  # L1: where the model is ready soonest
        if not victims:
            fit = free_after if config.fit_preference == "pack" else -free_after
            rank: tuple = (0, fetch_s, fit, node.node_id)
        else:
            rank = (1, *_evicting_rank(set_cost(victims, config.eviction, oracle), fetch_s, config, oracle), node.node_id)
        plans.append((rank, plan))
    best = min(plans, key=lambda p: p[0])[1] if plans else None
    return best, shortfalls, eligible


def _evicting_rank(cost: tuple, fetch_s: float, config: PolicyConfig, oracle: bool) -> tuple:
    """L1 among evicting nodes. With the `cost` strategy both sides are seconds of loading: the set's
    keep value (expected reload seconds per second) over `idle_floor_s` is what the victims are
    expected to cost in reloads, the fetch what this request waits for the weights; the node with
    the least of both wins. Other strategies order sets in their own terms: fetch time breaks ties."""
    if config.eviction == "cost" and not oracle:
        return (cost[0], cost[1] * config.cost.idle_floor_s + fetch_s, *cost[2:])
    return (*cost, fetch_s)


def _shortfall(node: NodeState, need: Need, usable: list[Candidate], everyone: list[Candidate]) -> NodeShortfall:
    """What is still missing after every allowed eviction, and the protected instances behind it."""
    memory_short = need.memory_bytes - sum(c.inst.bytes for c in usable if c.ref.node_id == node.node_id)
    refs = {c.ref for c in usable}
    unmet = tuple(e for e in need.excesses if len(refs & e.members) < e.excess)
    blockers = tuple(
        c
        for c in everyone
        if c.protection is not None and ((memory_short > 0 and c.ref.node_id == node.node_id) or any(c.ref in e.members for e in unmet))
    )
    return NodeShortfall(node, max(0, memory_short), unmet, blockers)


def _need_text(spec: ModelSpec, config: PolicyConfig) -> str:
    return (
        f"model {spec.name} needs {gib(required_bytes(spec, config))} "
        f"(weights {gib(spec.weight_bytes)} + KV {gib(spec.kv_reserved_bytes)} + overhead {gib(overhead_bytes(spec, config))})"
    )


_PROTECTION_WORDS = {
    "pinned": "pinned models",
    "min_copies": "models at their min_copies",
    "busy": "busy models",
    "loading": "loading models",
    "draining": "draining models",
    "young": "models younger than min_residency_s",
}


def _shortfall_text(s: NodeShortfall) -> str:
    by_protection: dict[str, list[Candidate]] = {}
    for b in s.blockers:
        by_protection.setdefault(b.protection or "", []).append(b)
    held = "; ".join(
        f"{_PROTECTION_WORDS[prot]} {', '.join(b.ref.model if b.ref.node_id == s.node.node_id else str(b.ref) for b in bs)} "
        f"hold {gib(sum(b.inst.bytes for b in bs))}"
        for prot, bs in sorted(by_protection.items())
    )
    parts = [f"on {s.node.node_id}: {gib(free_bytes(s.node))} free of {gib(s.node.usable_bytes)} usable"]
    if s.memory_short_bytes > 0:
        parts.append(f"{gib(s.memory_short_bytes)} short after every allowed eviction")
    if held:
        parts.append(held)
    if s.unmet_caps:
        parts.append("cap " + ", ".join(e.label for e in s.unmet_caps) + " still exceeded")
    return ", ".join(parts)


def blockers_of(shortfalls: list[NodeShortfall]) -> tuple[Blocker, ...]:
    seen: dict[InstanceRef, Blocker] = {}
    for s in shortfalls:
        for c in s.blockers:
            assert c.protection is not None
            seen.setdefault(c.ref, Blocker(instance=c.ref, protection=c.protection, bytes=c.inst.bytes))
    return tuple(seen.values())


def _retry_after(shortfall_blockers: tuple[Blocker, ...], state: ClusterState, now: float, config: PolicyConfig) -> float:
    """Soonest a passing protection may end: a young instance's remaining age, else the poll period."""
    waits = [config.retry_poll_s]
    for b in shortfall_blockers:
        if b.protection == "young":
            node = state.node(b.instance.node_id)
            inst = node.instance(b.instance.model) if node else None
            if inst is not None:
                waits.append(max(0.1, config.min_residency_s - (now - inst.loaded_at)))
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

    ready = [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == "ready"]
    if ready:
        node, _ = min(ready, key=lambda p: (p[1].in_flight, p[0].node_id))
        return Use(instance=InstanceRef(node_id=node.node_id, model=model))

    loading = [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == "loading"]
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

    plan, shortfalls, eligible = plan_placement(spec, state, now, config, exclude_nodes=exclude_nodes, oracle_keep_values=oracle_keep_values)
    if plan is not None:
        return place_from_plan(spec, plan, config)
    draining = [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == "draining"]
    if draining:  # W1: drained for a swap, it is gone once what runs on it has ended: wait for that
        return _behind_drain(model, draining[0][0], draining[0][1], waited_s, config)
    return _refuse(spec, state, now, config, shortfalls, eligible, waited_s, exclude_nodes)


def _behind_drain(model: str, node: NodeState, inst: InstanceState, waited_s: float, config: PolicyConfig) -> Wait | Reject:
    """P3 for a draining copy with no other place for the model: wait, as P8 waits for busy instances."""
    message = f"model {model} is draining on {node.node_id} to make room for another (a swap, W1); it is placed again once it has left"
    blockers = (Blocker(instance=InstanceRef(node_id=node.node_id, model=model), protection="draining", bytes=inst.bytes),)
    if config.contention == "wait" and waited_s < config.wait_timeout_s:
        return Wait(model=model, code="busy", message=message, blockers=blockers, retry_after_s=config.retry_poll_s)
    return Reject(model=model, code="busy", message=message, blockers=blockers, retry_after_s=config.retry_poll_s)


def place_from_plan(spec: ModelSpec, plan: Plan, config: PolicyConfig) -> Place:
    reason = "fits without eviction" if not plan.victims else "evicting " + ", ".join(str(v.ref) for v in plan.victims)
    return Place(
        model=spec.name,
        node_id=plan.node.node_id,
        device=plan.device,
        bytes=required_bytes(spec, config),
        evict=tuple(v.ref for v in plan.victims),
        reason=reason,
    )


def _refuse(
    spec: ModelSpec,
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    shortfalls: list[NodeShortfall],
    eligible: list[NodeState],
    waited_s: float,
    exclude_nodes: frozenset[str],
) -> Wait | Reject:
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
    capacities = {n.node_id: ever_available_bytes(n, config) for n in eligible}
    if all(need > capacities[n.node_id] for n in eligible):
        largest = max(eligible, key=lambda n: capacities[n.node_id])
        return Reject(
            model=spec.name,
            code="too_large",
            message=f"{_need_text(spec, config)}; the largest eligible node, {largest.node_id}, can give at most "
            f"{gib(max(0, capacities[largest.node_id]))} after its safety margin",
        )

    waiting_plan, _, _ = plan_placement(spec, state, now, config, exclude_nodes=exclude_nodes, passing_evictable=True)
    ordered = sorted(shortfalls, key=lambda s: -capacities[s.node.node_id])
    detail = "; ".join(_shortfall_text(s) for s in ordered[:3])
    if len(ordered) > 3:
        detail += f"; and {len(ordered) - 3} more nodes"
    blockers = blockers_of(shortfalls)
    if waiting_plan is None:
        return Reject(
            model=spec.name,
            code="blocked",
            message=f"cannot place: {_need_text(spec, config)}; {detail}",
            blockers=blockers,
        )
    retry_after = _retry_after(blockers, state, now, config)
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
        more = tuple(c for c in candidates(state, now, config) if c.ref.node_id == node.node_id and c.protection is None)
        need = _need_on(spec, node, device, state, config, global_cap_excesses(spec, state, config))
        if more and need.met_by(more):
            return Place(
                model=spec.name,
                node_id=node.node_id,
                device=device,
                bytes=required_bytes(spec, config),
                evict=tuple(c.ref for c in more),
                reason="retrying after running out of memory, evicting every evictable instance",
            )
    decision = ensure(failure.model, state, now, config, exclude_nodes=frozenset({failure.node_id}))
    if isinstance(decision, Place):
        return decision
    return refuse("no other placement is possible now")
