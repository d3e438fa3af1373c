"""Property-based tests: random clusters, configs and requests; every decision is checked against
the brute-force oracle of the spec (tests/support/policy_oracle.py)."""

import os

from hypothesis import HealthCheck, given, settings, strategies as st
from support.policy_oracle import (
    all_refs,
    backoff_left,
    backoff_s,
    device_on,
    eligible,
    evictable,
    expected_shrink,
    feasible_after,
    fetch_s,
    need_bytes,
    protection,
)

from policy import (
    ClusterState,
    FailedLoad,
    InstanceRef,
    InstanceState,
    LoadFailure,
    ModelSpec,
    NodeState,
    Place,
    PolicyConfig,
    Reject,
    StoreRoom,
    Use,
    Wait,
    clear_failed,
    ensure,
    plan_background_copies,
    plan_copies,
    retry_after_failure,
    sweep,
)
from policy.config import GIB, MIB
from policy.transitions import apply_place, remove_instance

NOW = 10_000.0
SIZES_GIB = [0.25, 0.5, 1, 2, 4, 8, 12, 20, 40]
KINDS = ["llm", "vlm", "embedding", "rerank", "stt", "tts"]
REASONS = ["not_found", "bad_files", "out_of_memory", "error"]


@st.composite
def specs(draw, name, pressure=False):
    return ModelSpec(
        name=name,
        kind=draw(st.sampled_from(KINDS)),
        weight_bytes=int(draw(st.sampled_from(SIZES_GIB)) * GIB),
        kv_bytes_per_token=draw(st.sampled_from([0, 16 * 1024, 128 * 1024])),
        kv_window_bytes_per_token=draw(st.sampled_from([0, 0, 64 * 1024])),  # M1: sliding windows, fixed state, activations
        kv_window_tokens=draw(st.sampled_from([1024, 4096])),
        kv_state_bytes=draw(st.sampled_from([0, 0, 64 * 1024**2])),
        activation_bytes=draw(st.sampled_from([0, 0, 512 * 1024**2])),
        reserve_context_tokens=draw(st.sampled_from([0, 2048, 8192])),
        reserve_concurrency=draw(st.integers(1, 4)),
        overhead_bytes=draw(st.sampled_from([None, 0, 256 * 1024**2])),
        role=draw(st.sampled_from(["primary", "utility"])),
        pinned=draw(st.sampled_from([False] * (12 if pressure else 5) + [True])),
        keep_warm=draw(st.sampled_from([False] * 4 + [True])),
        idle_ttl_s=draw(st.sampled_from([None, 60.0, 600.0])),
        allowed_nodes=None if pressure else draw(st.sampled_from([None] * 5 + [frozenset({"n0", "n1"})])),
        required_labels={} if pressure else draw(st.sampled_from([{}] * 5 + [{"chip": "m2"}])),
        device=None if pressure else draw(st.sampled_from([None] * 6 + ["cpu", "metal", "cuda"])),
        min_copies=draw(st.sampled_from([0] * (8 if pressure else 3) + [1])),
        max_copies=2,
        hub=draw(st.sampled_from([False, False, True])),
    )


@st.composite
def instances(draw, spec: ModelSpec, devices):
    device = spec.device if spec.device is not None else devices[0]
    last_used = draw(st.floats(NOW - 5000, NOW))
    return InstanceState(
        model=spec.name,
        device=device,
        bytes=spec.weight_bytes + draw(st.sampled_from([0, GIB // 4, GIB])),
        prefix_cache_bytes=draw(st.sampled_from([0, 0, 0, GIB // 2, 2 * GIB])),  # kept prompt prefixes (X4)
        status=draw(st.sampled_from(["ready"] * 6 + ["loading", "draining"])),
        in_flight=draw(st.sampled_from([0, 0, 0, 0, 1, 3])),
        last_used=last_used,
        loaded_at=last_used - draw(st.sampled_from([0.0, 5.0, 100.0, 3000.0])),
        load_seconds=draw(st.sampled_from([None, 2.0, 40.0])),
        prefix_reload_s=draw(st.sampled_from([0.0, 0.0, 3.0, 30.0])),  # the kept prefixes' prefill (E3)
    )


@st.composite
def clusters(draw, pressure=False):
    """pressure: every node up, no constraints, room for a few models each: where eviction happens."""
    catalog = [draw(specs(f"m{i}", pressure)) for i in range(draw(st.sampled_from([4, 6, 9, 12] if pressure else [1, 3, 5, 8, 12])))]
    nodes = []
    for n in range(draw(st.sampled_from([1, 2, 2, 3, 3, 4]))):
        devices = draw(st.sampled_from([("metal", "cpu")] * 3 + [("cpu",), ("cuda", "cpu")]))
        usable = int(draw(st.sampled_from([8, 16, 32, 64])) * GIB)
        # Under pressure m0 is never loaded: it is the model asked for.
        placeable = [s for s in catalog if (s.device is None or s.device in devices) and not (pressure and s.name == "m0")]
        held = (
            draw(st.lists(st.sampled_from(placeable), unique_by=lambda s: s.name, min_size=min(1, len(placeable)), max_size=5)) if placeable else []
        )
        nodes.append(
            NodeState(
                node_id=f"n{n}",
                labels=draw(st.sampled_from([{}, {"chip": "m2"}, {"chip": "m4"}])),
                devices=devices,
                total_bytes=usable + 8 * GIB,
                usable_bytes=usable,
                foreign_bytes=int(draw(st.sampled_from([0, 0, 1, 3])) * GIB),
                reported_headroom_bytes=draw(st.sampled_from([None, None, 2 * GIB, 20 * GIB])),
                instances=tuple(draw(instances(s, devices)) for s in held),
                alive=pressure or draw(st.sampled_from([True] * 11 + [False])),
                draining=not pressure and draw(st.sampled_from([False] * 11 + [True])),
                stored=frozenset(draw(st.lists(st.sampled_from([s.name for s in catalog]), max_size=3))),
                spare_bytes=draw(st.sampled_from([0, 0, 200 * MIB, GIB])),  # R1: a spare process, within an overhead or past it
            )
        )
    # Some models carry a failed-load mark (P10), within its back-off or past it.
    failed = {}
    for s in catalog:
        if draw(st.sampled_from([False] * 5 + [True])):
            failed[s.name] = FailedLoad(
                model=s.name,
                node_id=draw(st.sampled_from([n.node_id for n in nodes])),
                reason=draw(st.sampled_from(REASONS)),
                message=draw(st.sampled_from(["", "SafetensorError: incomplete metadata"])),
                at=NOW - draw(st.sampled_from([0.0, 1.0, 29.0, 31.0, 100.0, 700.0, 5000.0])),
                failures=draw(st.sampled_from([1, 1, 2, 3, 6, 40])),
            )
    learned = draw(st.sampled_from([{}, {}, {"peer": 1e8}, {"peer": 2e9, "hub": 1e7}]))  # L3
    return ClusterState(nodes=tuple(nodes), catalog={s.name: s for s in catalog}, failed=failed, bandwidth_bytes_per_s=learned)


def caps(pressure: bool):
    """Any cap, zero included; under pressure mostly none, and never zero."""
    return st.sampled_from([None, None, None, 1, 2, 4]) if pressure else st.sampled_from([None, None, 0, 1, 2, 3, 6])


def cap_dict(keys, pressure: bool):
    values = st.sampled_from([1, 2, 3]) if pressure else st.sampled_from([0, 1, 2, 3])
    return st.dictionaries(st.sampled_from(keys), values, max_size=2)


@st.composite
def configs(draw, pressure=False):
    return PolicyConfig(
        max_instances=draw(caps(pressure)),
        max_instances_per_node=draw(caps(pressure)),
        node_max_instances=draw(st.sampled_from([{}, {"n1": 1}])),
        max_per_kind=draw(cap_dict(KINDS, pressure)),
        max_per_kind_per_node=draw(cap_dict(KINDS, pressure)),
        max_per_device_per_node=draw(cap_dict(["metal", "cpu", "cuda", "total"], pressure)),
        safety_margin_bytes=draw(st.sampled_from([0, GIB // 2])),
        safety_margin_fraction=draw(st.sampled_from([0.0, 0.05])),
        eviction=draw(st.sampled_from(["lru", "cost", "fewest"])),
        fit_preference=draw(st.sampled_from(["pack", "spread"])),
        min_residency_s=draw(st.sampled_from([0.0, 0.0, 10.0] if pressure else [0.0, 10.0, 600.0])),
        residency_per_reload=draw(st.sampled_from([0.0, 2.0, 2.0, 10.0])),
        max_residency_s=draw(st.sampled_from([5.0, 60.0, 600.0])),
        contention=draw(st.sampled_from(["fail", "wait"])),
        wait_timeout_s=30.0,
        default_idle_ttl_s=draw(st.sampled_from([None, 300.0])),
        **draw(backoffs()),
    )


@st.composite
def backoffs(draw):
    base = draw(st.sampled_from([0.0, 5.0, 30.0, 30.0]))
    cap = draw(st.sampled_from([c for c in (0.0, 5.0, 60.0, 600.0) if c >= base]))
    return {"failed_load_backoff_s": base, "failed_load_backoff_max_s": cap}


@st.composite
def requests(draw, pressure=False):
    state = draw(clusters(pressure))
    held = {i.model for n in state.nodes for i in n.instances}
    absent = sorted(set(state.catalog) - held)
    if absent and (pressure or draw(st.sampled_from([True] * 4 + [False]))):
        model = draw(st.sampled_from(absent))  # mostly ask for what is not loaded: that is where policy acts
    else:
        model = draw(st.sampled_from(sorted(state.catalog) + ["unknown"]))
    return state, draw(configs(pressure)), model, draw(st.sampled_from([0.0, 10.0, 45.0]))


# 150 examples a property in `make test` (its 10-minute budget); `make test-all` runs 1500.
SETTINGS = settings(max_examples=int(os.environ.get("ORCHARD_PROPERTY_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def copies(state, model, status):
    return [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == status]


@SETTINGS
@given(st.one_of(requests(), requests(pressure=True)))
def test_every_decision_obeys_the_spec(request):
    state, config, model, waited = request
    decision = ensure(model, state, NOW, config, waited_s=waited)
    assert decision == ensure(model, state, NOW, config, waited_s=waited)  # D1: deterministic

    if model not in state.catalog:  # P1
        assert isinstance(decision, Reject) and decision.code == "unknown_model"
        return
    spec = state.catalog[model]
    ready, loading = copies(state, model, "ready"), copies(state, model, "loading")
    if ready:  # P2
        assert isinstance(decision, Use)
        chosen = next(i for n, i in ready if n.node_id == decision.instance.node_id)
        assert chosen.in_flight == min(i.in_flight for _, i in ready)
        return
    if loading:  # P3
        assert isinstance(decision, Wait) and decision.code == "loading"
        return
    left = backoff_left(state, model, NOW, config)
    if left is not None:  # P10: refused before any placement or eviction
        assert isinstance(decision, Reject) and decision.code == "load_failed" and not decision.blockers
        assert 0 < decision.retry_after_s <= backoff_s(state.failed[model].failures, config)
        assert decision.retry_after_s == left and state.failed[model].node_id in decision.message
        return

    nodes = [n for n in state.nodes if eligible(state, spec, n)]
    unprotected = evictable(state, NOW, config, waited=waited)
    fits_untouched = [n for n in nodes if feasible_after(state, spec, n.node_id, set(), config)]
    fits_by_shrinking = [n for n in nodes if feasible_after(state, spec, n.node_id, set(), config, shrink=True)]
    feasible_at_all = [n for n in nodes if feasible_after(state, spec, n.node_id, unprotected, config, shrink=True)]

    if isinstance(decision, Place):
        node = state.node(decision.node_id)
        assert eligible(state, spec, node)  # P4
        victims = set(decision.evict)
        assert len(victims) == len(decision.evict)
        for v in victims:  # E1-E4
            vnode = state.node(v.node_id)
            assert vnode.alive and protection(state, vnode, v.model, NOW, config, waited) is None
        assert decision.bytes == need_bytes(spec, config)
        shrinks = not feasible_after(state, spec, node.node_id, set(), config, memory_only=True)  # short as it is
        assert set(decision.shrink) == expected_shrink(state, spec, node.node_id, victims, config)  # X4
        assert len(set(decision.shrink)) == len(decision.shrink)
        assert feasible_after(state, spec, node.node_id, victims, config, shrink=shrinks)  # P5, P6
        for v in victims:  # E6: minimal
            assert not feasible_after(state, spec, node.node_id, victims - {v}, config, shrink=shrinks)
        for candidates in (fits_untouched, fits_by_shrinking):  # P7, then X4: kept prefixes before any eviction
            if candidates:
                assert not victims
                assert node.node_id in {n.node_id for n in candidates}
                soonest = min(fetch_s(state, spec, n, config) for n in candidates)  # L1
                assert fetch_s(state, spec, node, config) == soonest
                break
        if fits_untouched:
            assert not decision.shrink
        if any(state.catalog[v.model].keep_warm for v in victims):  # E5
            no_warm = evictable(state, NOW, config, keep_warm_too=False, waited=waited)
            assert not any(feasible_after(state, spec, n.node_id, no_warm, config, shrink=True) for n in nodes)
        return

    # Wait or Reject: nothing may be feasible with every unprotected instance gone (completeness).
    assert not feasible_at_all
    if any(i.model == model and i.status == "draining" for n in state.nodes if n.alive for i in n.instances):  # W1: wait for the drain
        if config.contention == "wait" and waited < config.wait_timeout_s:
            assert isinstance(decision, Wait) and decision.code == "busy" and decision.blockers[0].protection == "draining"
        else:
            assert isinstance(decision, Reject) and decision.code == "busy" and decision.retry_after_s
        return
    if not nodes:
        assert isinstance(decision, Reject) and decision.code == "no_eligible_node"
        return
    if isinstance(decision, Reject) and decision.code == "too_large":
        everything = {r for _, r in all_refs(state)}
        assert not any(feasible_after(state, spec, n.node_id, everything, config, memory_only=True, settled=True) for n in nodes)
        return
    passing = evictable(state, NOW, config, passing_too=True)
    waiting_helps = any(feasible_after(state, spec, n.node_id, passing, config, shrink=True, settled=True) for n in nodes)
    if waiting_helps:  # P8
        if config.contention == "wait" and waited < config.wait_timeout_s:
            assert isinstance(decision, Wait) and decision.code == "busy" and decision.retry_after_s > 0
        else:
            assert isinstance(decision, Reject) and decision.code == "busy" and decision.retry_after_s
    else:
        assert isinstance(decision, Reject) and decision.code == "blocked" and decision.retry_after_s is None
    assert decision.message


@SETTINGS
@given(clusters(), configs())
def test_sweep_unloads_exactly_the_expired_idle_instances(state, config):
    unloads = sweep(state, NOW, config)
    assert unloads == sweep(state, NOW, config)
    chosen = {(u.instance, u.reason) for u in unloads}
    assert len(chosen) == len(unloads)
    for node in state.nodes:
        for inst in node.instances:
            ref = InstanceRef(node_id=node.node_id, model=inst.model)
            reasons = {r for x, r in chosen if x == ref}
            if not node.alive:  # S4
                assert reasons == {"node_dead"}
                continue
            if inst.status != "ready" or inst.in_flight > 0:  # S2
                assert not reasons
                continue
            if node.draining:  # S4
                assert reasons == {"draining"}
                continue
            spec = state.catalog[inst.model]
            ttl = spec.idle_ttl_s if spec.idle_ttl_s is not None else config.default_idle_ttl_s
            expired = ttl is not None and not spec.pinned and not spec.keep_warm and NOW - inst.last_used >= ttl
            if not expired:  # S1, S2
                assert not reasons
    for model, spec in state.catalog.items():  # S3
        ready = [(n, i) for n in state.nodes if n.alive for i in n.instances if i.model == model and i.status == "ready"]
        idle_unloaded = sum(1 for x, r in chosen if x.model == model and r == "idle")
        drained = sum(1 for x, r in chosen if x.model == model and r == "draining")
        if idle_unloaded:
            assert len(ready) - drained - idle_unloaded >= spec.min_copies


@SETTINGS
@given(st.one_of(clusters(), clusters(pressure=True)), st.one_of(configs(), configs(pressure=True)))
def test_plan_copies_starts_only_valid_copies(state, config):
    places = plan_copies(state, NOW, config)
    assert places == plan_copies(state, NOW, config)
    assert len({p.model for p in places}) == len(places)
    work = state
    for place in places:
        spec = work.catalog[place.model]
        live = [i for n in work.nodes if n.alive for i in n.instances if i.model == spec.name and i.status in ("ready", "loading")]
        assert len(live) < spec.max_copies  # C3
        if len(live) >= spec.min_copies:  # C2: a scale-up, which must not evict
            assert live and all(i.status == "ready" and i.in_flight >= spec.reserve_concurrency for i in live)
            assert place.evict == () and place.shrink == ()  # nor costs other models their kept prefixes
        assert backoff_left(work, spec.name, NOW, config) is None  # P10: no copy within the back-off
        node = work.node(place.node_id)
        assert eligible(work, spec, node)
        for v in place.evict:
            assert protection(work, work.node(v.node_id), v.model, NOW, config) is None
        assert set(place.shrink) == expected_shrink(work, spec, node.node_id, set(place.evict), config)  # X4
        assert feasible_after(work, spec, node.node_id, set(place.evict), config, shrink=bool(place.shrink))
        work = apply_place(work, place, NOW)


@st.composite
def background_inputs(draw):
    """A cluster, demand over its catalog, store rooms and nodes with a copy coming in (rule L4)."""
    state = draw(st.one_of(clusters(), clusters(pressure=True)))
    config = draw(configs()).model_copy(
        update={
            "background_copies": draw(st.sampled_from(["requested", "catalog"])),
            "background_copy_min_demand": draw(st.sampled_from([0.5, 1.0, 3.0])),
            "background_copy_budget_share": draw(st.sampled_from([0.5, 1.0])),
            "background_copy_disk_reserve_bytes": draw(st.sampled_from([0, GIB, 4 * GIB])),
        }
    )
    names = sorted(state.catalog)
    demand = {m: draw(st.sampled_from([0.2, 1.0, 2.0, 2.0, 2.0, 5.0])) for m in names if draw(st.integers(0, 3)) > 0}
    ids = [n.node_id for n in state.nodes]
    rooms = {  # most nodes report a store, most with room for a model or two
        n.node_id: StoreRoom(
            free_bytes=draw(st.sampled_from([0, 1, 3, 9, 64, 1024])) * GIB,
            used_bytes=draw(st.sampled_from([0, 1, 4])) * GIB,
            budget_bytes=draw(st.sampled_from([None, None, 4 * GIB, 16 * GIB])),
        )
        for n in state.nodes
        if draw(st.integers(0, 4)) > 0
    }
    copying = frozenset(draw(st.lists(st.sampled_from(ids), unique=True, max_size=1))) if ids else frozenset()
    pairs = [(m, n) for m in names for n in ids]
    not_now = frozenset(draw(st.lists(st.sampled_from(pairs), unique=True, max_size=3))) if pairs else frozenset()
    return state, config, demand, rooms, copying, not_now


def background_candidates(state, config, node, demand, room, not_now) -> list[str]:
    """L4 by hand: every model the node may copy in now, best first."""

    def valid(name: str) -> bool:
        spec = state.catalog[name]
        held = any(n.alive and n.node_id != node.node_id and name in n.stored for n in state.nodes)
        constraints = (spec.allowed_nodes is None or node.node_id in spec.allowed_nodes) and all(
            node.labels.get(k) == v for k, v in spec.required_labels.items()
        )
        margin = config.safety_margin_bytes + int(config.safety_margin_fraction * node.usable_bytes)
        space = room.free_bytes - config.background_copy_disk_reserve_bytes
        if room.budget_bytes is not None:
            space = min(space, int(config.background_copy_budget_share * room.budget_bytes) - room.used_bytes)
        return (
            name not in node.stored
            and (name, node.node_id) not in not_now
            and held
            and constraints
            and device_on(spec, node) is not None
            and need_bytes(spec, config) <= node.usable_bytes - margin
            and spec.weight_bytes <= space
        )

    asked = sorted(
        (m for m, v in demand.items() if v >= config.background_copy_min_demand), key=lambda m: (-demand[m], state.catalog[m].weight_bytes, m)
    )
    rest = (
        sorted((m for m in state.catalog if m not in asked), key=lambda m: (state.catalog[m].weight_bytes, m))
        if config.background_copies == "catalog"
        else []
    )
    return [m for m in asked + rest if valid(m)]


@SETTINGS
@given(background_inputs())
def test_plan_background_copies_picks_the_best_valid_copy_per_idle_node(case):
    state, config, demand, rooms, copying, not_now = case
    copies = plan_background_copies(state, config, demand, rooms, copying, not_now)
    assert copies == plan_background_copies(state, config, demand, rooms, copying, not_now)  # D1
    chosen = {c.node_id: c.model for c in copies}
    assert len(chosen) == len(copies)  # at most one per node
    for node in state.nodes:
        idle = node.alive and not node.draining and node.node_id in rooms and node.node_id not in copying
        best = background_candidates(state, config, node, demand, rooms[node.node_id], not_now) if idle else []
        assert chosen.get(node.node_id) == (best[0] if best else None)
    off = config.model_copy(update={"background_copies": "off"})
    assert plan_background_copies(state, off, demand, rooms, copying, not_now) == ()


@st.composite
def load_failures(draw, pressure=False):
    """A request's state and config, and a failed load of one catalog model on one of the nodes
    (or on a node that has gone); the state no longer holds the failed instance."""
    state, config, model, _ = draw(requests(pressure))  # mostly a model that is not loaded
    if model not in state.catalog:
        model = draw(st.sampled_from(sorted(state.catalog)))
    for n in state.nodes:  # the failed instance is gone, and the model is loaded nowhere else
        if n.instance(model) is not None and draw(st.booleans()):
            state = remove_instance(state, InstanceRef(node_id=n.node_id, model=model))
    spec = state.catalog[model]
    # Often a node where evicting all it may evict makes room: where the evict-all retry can happen.
    roomy = [
        n.node_id
        for n in state.nodes
        if eligible(state, spec, n)
        and feasible_after(state, spec, n.node_id, {r for r in evictable(state, NOW, config) if r.node_id == n.node_id}, config, shrink=True)
    ]
    node_id = draw(st.sampled_from(roomy if roomy and draw(st.booleans()) else [n.node_id for n in state.nodes] * 4 + ["gone"]))
    node = state.node(node_id)
    if node is not None and node.instance(model) is not None:
        state = remove_instance(state, InstanceRef(node_id=node_id, model=model))
    failure = LoadFailure(
        model=model,
        node_id=node_id,
        reason=draw(st.sampled_from(REASONS + ["out_of_memory"] * 2)),
        message="boom",
        attempt=draw(st.sampled_from([1, 1, 2])),
    )
    return state, config, failure


@SETTINGS
@given(st.one_of(load_failures(), load_failures(pressure=True), load_failures(pressure=True)))
def test_retry_after_failure_evicts_only_for_a_first_out_of_memory(case):
    """P9: any failure but a first out-of-memory is refused with no eviction and the back-off its
    mark will get; a first out-of-memory is retried only by a placement the spec allows."""
    state, config, failure = case
    decision = retry_after_failure(failure, state, NOW, config)
    assert decision == retry_after_failure(failure, state, NOW, config)  # D1
    mark = state.failed.get(failure.model)
    backoff = backoff_s(1 if mark is None else mark.failures + 1, config)
    if failure.reason != "out_of_memory" or failure.attempt >= 2:
        assert isinstance(decision, Reject) and decision.code == "load_failed"  # a Reject evicts nothing
        assert decision.retry_after_s == (backoff if backoff > 0 else None)
        assert "not retried" in decision.message and failure.node_id in decision.message
        return
    if isinstance(decision, Reject):
        assert decision.code == "load_failed" and decision.retry_after_s == (backoff if backoff > 0 else None)
        return
    assert isinstance(decision, Place)
    spec = state.catalog[failure.model]
    node = state.node(decision.node_id)
    assert eligible(state, spec, node)
    for v in decision.evict:  # E1-E4 hold for the retry too
        assert protection(state, state.node(v.node_id), v.model, NOW, config) is None
    assert set(decision.shrink) == expected_shrink(state, spec, node.node_id, set(decision.evict), config)  # X4
    assert feasible_after(state, spec, node.node_id, set(decision.evict), config, shrink=bool(decision.shrink))  # P5, P6
    if decision.node_id == failure.node_id:  # evict-all on the failing node, and nowhere else
        here = {r for r in evictable(state, NOW, config) if r.node_id == failure.node_id}
        assert decision.evict and set(decision.evict) == here


@SETTINGS
@given(st.one_of(requests(), requests(pressure=True)), st.sampled_from([1, 2, 3, 5, 12]), st.floats(0.0, 0.999), st.sampled_from(REASONS))
def test_a_marked_model_within_its_backoff_is_never_placed(request, failures, elapsed_fraction, reason):
    """P10: while the back-off lasts, ensure never places (nor evicts for) a marked model and its
    Reject counts the back-off down; once it has passed, ensure answers as if it were not marked."""
    state, config, model, waited = request
    if model not in state.catalog:
        return
    config = config.model_copy(update={"failed_load_backoff_s": 30.0, "failed_load_backoff_max_s": 600.0})
    backoff = backoff_s(failures, config)
    at = NOW - elapsed_fraction * backoff
    mark = FailedLoad(model=model, node_id=state.nodes[0].node_id, reason=reason, at=at, failures=failures)
    marked = state.model_copy(update={"failed": {**state.failed, model: mark}})
    decision = ensure(model, marked, NOW, config, waited_s=waited)
    assert not isinstance(decision, Place)
    if isinstance(decision, Reject):
        assert decision.code == "load_failed" and 0 < decision.retry_after_s <= backoff
        assert abs(decision.retry_after_s - (at + backoff - NOW)) < 1e-6
    else:  # P2 and P3 come first: a ready copy is used, a load in progress waited for
        assert copies(state, model, "ready") or copies(state, model, "loading")
    after = at + backoff + 1e-3  # just past the back-off (clear of float rounding at the boundary)
    assert ensure(model, marked, after, config, waited_s=waited) == ensure(model, clear_failed(marked, model), after, config, waited_s=waited)
