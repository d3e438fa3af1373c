"""Replays a trace against a simulated cluster through policy/ and counts what each strategy costs.

The simulation is event driven: arrivals, retries, loads finishing, requests finishing. Every
decision goes through the same pure functions and state transitions the controller uses."""

import bisect
import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.residency.traces import Request
from policy import ClusterState, InstanceRef, Place, PolicyConfig, Reject, Use, Wait, count_only_lru, ensure
from policy.config import GIB
from policy.locality import bandwidth, fetch_seconds
from policy.memory import estimated_load_seconds
from policy.transitions import apply_place, finish_request, mark_loaded, mark_stored, start_request
from router.residency.demand import Demand

Decider = Callable[[str, ClusterState, float, float], object]
# A background copier: (state, node id, demand per model now, the node's disk budget or None) -> the
# model whose weights to copy to that node next, or None (bench/residency/prefetch.py).
Prefetcher = Callable[[ClusterState, str, dict[str, float], int | None], str | None]

# Anything still waiting after this long is turned away, by every strategy alike.
WAIT_TIMEOUT_S = 60.0


@dataclass
class Tally:
    requests: int = 0
    hits: int = 0
    loads: int = 0
    reloads: int = 0
    bytes_reloaded: int = 0
    reload_seconds: float = 0.0
    utility_reloads: int = 0
    evictions: int = 0
    waited: int = 0
    rejected: int = 0
    unsafe_loads: int = 0
    served_overcommitted: int = 0
    start_delays: list[float] = field(default_factory=list)
    ready_delays: list[float] = field(default_factory=list)  # requests that waited for a load (fetch included)
    fetches: int = 0
    bytes_fetched: int = 0
    store_removals: int = 0  # stored folders removed to make room under a disk budget
    prefetches: int = 0  # background copies finished (a prefetcher's)
    bytes_prefetched: int = 0

    def row(self) -> dict:
        delays = sorted(self.start_delays)
        p95 = delays[int(0.95 * (len(delays) - 1))] if delays else 0.0
        return {
            "requests": self.requests,
            "hit_rate": round(self.hits / max(1, self.requests), 4),
            "loads": self.loads,
            "reloads": self.reloads,
            "gb_reloaded": round(self.bytes_reloaded / GIB, 1),
            "reload_s": round(self.reload_seconds, 1),
            "evictions": self.evictions,
            "waited": self.waited,
            "rejected": self.rejected,
            "utility_reloads": self.utility_reloads,
            "unsafe_loads": self.unsafe_loads,
            "served_overcommitted": self.served_overcommitted,
            "mean_start_delay_s": round(sum(delays) / max(1, len(delays)), 2),
            "p95_start_delay_s": round(p95, 2),
            "fetches": self.fetches,
            "gb_fetched": round(self.bytes_fetched / GIB, 1),
            "store_removals": self.store_removals,
            "prefetches": self.prefetches,
            "gb_prefetched": round(self.bytes_prefetched / GIB, 1),
            "mean_time_to_ready_s": round(sum(self.ready_delays) / max(1, len(self.ready_delays)), 2),
        }


def orchard(config: PolicyConfig) -> Decider:
    return lambda model, state, now, waited: ensure(model, state, now, config, waited_s=waited)


def locality_blind(config: PolicyConfig) -> Decider:
    """Orchard's policy shown no node store (every NodeState.stored empty): placement as before rule
    L1, while the simulation still charges the copies it causes."""

    def decide(model: str, state: ClusterState, now: float, waited: float) -> object:
        blind = state.model_copy(update={"nodes": tuple(n.model_copy(update={"stored": frozenset()}) for n in state.nodes)})
        return ensure(model, blind, now, config, waited_s=waited)

    return decide


def count_only(max_loaded_models: int) -> Decider:
    return lambda model, state, now, waited: count_only_lru(model, state, now, max_loaded_models)


def belady(config: PolicyConfig, trace: list[Request]) -> Decider:
    """Offline reference: Orchard's safety rules, but victims ordered by the true next use.

    Keep value = reload seconds / seconds until the model is next asked for (0 if never again);
    under memory pressure it is taken per byte, so a large model not needed for long goes first."""
    arrivals: dict[str, list[float]] = defaultdict(list)
    for r in trace:
        arrivals[r.model].append(r.arrival)

    def keep_values(state: ClusterState, now: float) -> dict[InstanceRef, float]:
        values = {}
        for node in state.nodes:
            for inst in node.instances:
                times = arrivals.get(inst.model, [])
                i = bisect.bisect_right(times, now)
                reload = estimated_load_seconds(inst.bytes, config)
                values[InstanceRef(node_id=node.node_id, model=inst.model)] = reload / max(times[i] - now, 1e-3) if i < len(times) else 0.0
        return values

    return lambda model, state, now, waited: ensure(model, state, now, config, waited_s=waited, oracle_keep_values=keep_values(state, now))


def overcommitted(state: ClusterState, node_id: str) -> bool:
    node = state.node(node_id)
    assert node is not None
    return node.foreign_bytes + sum(i.bytes for i in node.instances) > node.usable_bytes


def make_room(state: ClusterState, node_id: str, keep: str, budget: int, last_used: dict[tuple[str, str], float]) -> tuple[ClusterState, int]:
    """A node's store over its disk budget removes its least recently used folders first: never one
    loaded or loading there, never `keep` (just fetched), never the cluster's last copy (this
    simulator has no hub to fetch it from again). Returns the state and how many it removed."""
    node = state.node(node_id)
    assert node is not None
    stored = set(node.stored)
    used = sum(int(state.catalog[m].weight_bytes) for m in stored)
    removed = 0
    in_use = {i.model for i in node.instances}
    for model in sorted(stored - in_use - {keep}, key=lambda m: (last_used.get((node_id, m), -1.0), m)):
        if used <= budget:
            break
        if not any(n.node_id != node_id and model in n.stored for n in state.nodes):
            continue
        stored.discard(model)
        used -= int(state.catalog[model].weight_bytes)
        removed += 1
    nodes = tuple(n.model_copy(update={"stored": frozenset(stored)}) if n.node_id == node_id else n for n in state.nodes)
    return state.model_copy(update={"nodes": nodes}), removed


def simulate(
    trace: list[Request],
    state: ClusterState,
    decide: Decider,
    config: PolicyConfig,
    disk_budget: dict[str, int] | None = None,
    prefetch: Prefetcher | None = None,
) -> Tally:
    """`disk_budget`: bytes each node's store may hold (make_room keeps it); None: no budget.
    `prefetch`: background copies, one at a time per node over its link at the peer bandwidth; a
    copy a placement waits for takes the link first (the background one resumes after it), or
    finishes the background copy of the same model. A store over its budget removes its least
    recently used folders first, and, as Orchard's does (rule L4), a background copy not loaded
    since it arrived before any other."""
    tally = Tally(requests=len(trace))
    last_used: dict[tuple[str, str], float] = {}  # (node, model) -> when its stored folder was last used
    events: list[tuple[float, int, str, Any]] = []  # payload by kind: ask i, loaded (ref, s), done (i, ref)
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for i, r in enumerate(trace):
        push(r.arrival, "ask", i)
    joined: dict[InstanceRef, list[int]] = defaultdict(list)  # requests waiting for a load
    ever_loaded: set[str] = set()
    waited_once: set[int] = set()
    demand = Demand(config.demand_half_life_s)  # requests per model, as the controller counts them (L4)
    copying: dict[str, tuple[str, float, int]] = {}  # node -> (model, when its background copy ends, generation)
    generation = 0

    def kick(now: float) -> None:
        """Start a background copy on every node whose link is idle, as the prefetcher picks."""
        nonlocal generation
        if prefetch is None:
            return
        wanted = demand.snapshot(now)
        for node in state.nodes:
            if node.node_id in copying or not node.alive:
                continue
            model = prefetch(state, node.node_id, wanted, None if disk_budget is None else disk_budget[node.node_id])
            if model is None or model in node.stored:
                continue
            generation += 1
            end = now + state.catalog[model].weight_bytes / bandwidth(state, config, "peer")
            copying[node.node_id] = (model, end, generation)
            push(end, "prefetched", (node.node_id, model, generation))

    def store(node_id: str, model: str, now: float) -> None:
        """The weights are on the node's disk from now on; room made under a budget, least recently used first."""
        nonlocal state
        state = mark_stored(state, node_id, model)
        last_used[(node_id, model)] = now
        if disk_budget is not None:
            state, removed = make_room(state, node_id, model, disk_budget[node_id], last_used)
            tally.store_removals += removed

    def start(i: int, ref: InstanceRef, now: float) -> None:
        nonlocal state
        state = start_request(state, ref, now)
        last_used[(ref.node_id, ref.model)] = now
        if overcommitted(state, ref.node_id):
            tally.served_overcommitted += 1
        tally.start_delays.append(now - trace[i].arrival)
        push(now + trace[i].duration, "done", (i, ref))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "ask":
            i = payload
            r = trace[i]
            waited = now - r.arrival
            if waited == 0:
                demand.add(r.model, 1.0, now)
            d = decide(r.model, state, now, waited)
            if isinstance(d, Use):
                if waited == 0:
                    tally.hits += 1
                start(i, d.instance, now)
            elif isinstance(d, Place):
                tally.evictions += len(d.evict)
                state = apply_place(state, d, now)
                ref = InstanceRef(node_id=d.node_id, model=d.model)
                load_s = estimated_load_seconds(d.bytes, config)
                node = state.node(d.node_id)
                assert node is not None
                fetch_s = fetch_seconds(state.catalog[d.model], node, state, config)  # the weights' real way there
                if fetch_s > 0:
                    tally.fetches += 1  # a copy this placement waits for
                    tally.bytes_fetched += state.catalog[d.model].weight_bytes
                    background = copying.pop(d.node_id, None)
                    if background is not None and background[0] == d.model:  # it finishes that copy
                        fetch_s = max(0.0, background[1] - now)
                    elif background is not None:  # it takes the link; the background copy resumes after
                        generation += 1
                        copying[d.node_id] = (background[0], background[1] + fetch_s, generation)
                        push(background[1] + fetch_s, "prefetched", (d.node_id, background[0], generation))
                    store(d.node_id, d.model, now)
                load_s += fetch_s
                tally.loads += 1
                if d.model in ever_loaded:
                    tally.reloads += 1
                    tally.bytes_reloaded += d.bytes
                    tally.reload_seconds += load_s
                    if state.catalog[d.model].role == "utility":
                        tally.utility_reloads += 1
                ever_loaded.add(d.model)
                if overcommitted(state, d.node_id):
                    tally.unsafe_loads += 1
                joined[ref].append(i)
                push(now + load_s, "loaded", (ref, load_s))
            elif isinstance(d, Wait) and d.code == "loading":
                ref = next(
                    InstanceRef(node_id=n.node_id, model=r.model)
                    for n in state.nodes
                    if (x := n.instance(r.model)) is not None and x.status == "loading"
                )
                joined[ref].append(i)
            elif isinstance(d, Wait) and waited < WAIT_TIMEOUT_S:
                if i not in waited_once:
                    waited_once.add(i)
                    tally.waited += 1
                push(now + d.retry_after_s, "ask", i)
            else:
                assert isinstance(d, (Reject, Wait))
                tally.rejected += 1
        elif kind == "prefetched":
            node_id, model, gen = payload
            if copying.get(node_id, (None, 0.0, -1))[2] == gen:
                del copying[node_id]
                tally.prefetches += 1
                tally.bytes_prefetched += state.catalog[model].weight_bytes
                store(node_id, model, now)
                last_used[(node_id, model)] = -1.0  # speculative: the first to go until a load uses it
        elif kind == "loaded":
            ref, load_s = payload
            state = mark_loaded(state, ref, now, load_s)
            for i in joined.pop(ref, []):
                tally.ready_delays.append(now - trace[i].arrival)
                start(i, ref, now)
        else:
            i, ref = payload
            state = finish_request(state, ref, now)
        kick(now)
    return tally
