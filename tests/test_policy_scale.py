"""One decision stays cheap as the cluster grows (issue 26): its work grows with the number of
instances, not with instances x nodes. Work is counted as Python function calls into the policy,
a figure the load of a shared machine does not change; bench/residency/scale.py measures the time."""

import sys

import pytest

from bench.residency.scale import NOW, scenarios
from policy import ensure


def calls_of_one_decision(nodes: int, scenario: str) -> int:
    state, model, config, expected = scenarios(nodes, models=400)[scenario]
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        decision = ensure(model, state, NOW, config)
    finally:
        sys.setprofile(previous)
    assert expected(decision), decision
    return calls


@pytest.mark.parametrize("scenario", ["place-fit", "place-evict", "contention"])
def test_twice_the_nodes_is_about_twice_the_work_of_a_decision(scenario):
    """25 -> 50 nodes (about 250 -> 500 instances): linear work doubles, per-node work over every
    instance (a scan of every node for each candidate, every blocker listed again for every node)
    more than triples."""
    small, large = calls_of_one_decision(25, scenario), calls_of_one_decision(50, scenario)
    assert large / small < 2.6, (small, large)


# The decision's hot loops write out a few of the policy's figures instead of calling them; these
# check that the written-out figure is the same one, on the scale benchmark's instances and on
# instances with a measured load time or a spec's estimate.


def _instances_with_specs():
    from policy import InstanceState

    state, _, _, _ = scenarios(20, models=200)["place-evict"]
    for node in state.nodes:
        for inst in node.instances:
            spec = state.catalog[inst.model]
            yield node, inst, spec
            yield node, InstanceState(**(inst.model_dump() | {"load_seconds": 7.5})), spec
            yield node, inst, spec.model_copy(update={"load_seconds_estimate": 3.0, "role": "primary"})
            yield node, InstanceState(**(inst.model_dump() | {"last_used": NOW + 5})), spec  # used after `now`: idle 0


def test_the_keep_value_written_out_is_the_one_from_reload_seconds():
    from policy import PolicyConfig
    from policy.eviction import keep_valuer
    from policy.memory import reload_seconds

    config = PolicyConfig()
    keep_value = keep_valuer(NOW, config)
    for _, inst, spec in _instances_with_specs():
        weight = config.cost.utility_weight if spec.role == "utility" else 1.0
        expected = (reload_seconds(inst, spec, config) + 2.0) * weight / (max(0.0, NOW - inst.last_used) + config.cost.idle_floor_s)
        assert keep_value(inst, spec, 2.0) == expected


def test_the_snapshots_fetch_seconds_is_localitys():
    from policy import ClusterState, PolicyConfig
    from policy.locality import fetch_seconds
    from policy.snapshot import Snapshot

    state, _, _, _ = scenarios(20, models=200)["place-evict"]
    names = sorted(state.catalog)
    nodes = tuple(
        n.model_copy(update={"stored": frozenset(names[i::7]), "alive": i % 5 != 0}) for i, n in enumerate(state.nodes)
    )  # some stores hold some models, on nodes alive and dead
    catalog = {name: s.model_copy(update={"hub": i % 3 == 0}) for i, (name, s) in enumerate(state.catalog.items())}
    for learned in ({}, {"peer": 3e8, "hub": 2e7}):
        varied = ClusterState(nodes=nodes, catalog=catalog, bandwidth_bytes_per_s=learned)
        snap, config = Snapshot(varied, NOW, PolicyConfig()), PolicyConfig()
        for node in varied.nodes:
            for spec in catalog.values():
                assert snap.fetch_seconds(spec, node) == fetch_seconds(spec, node, varied, config), (node.node_id, spec.name)


def test_candidates_sorted_as_read_come_in_the_sorted_order():
    from policy import PolicyConfig
    from policy.eviction import SortedAsRead, eviction_orders
    from policy.snapshot import Snapshot

    state, model, _, _ = scenarios(20, models=200)["place-evict"]
    for strategy in ("cost", "lru", "fewest"):
        snap = Snapshot(state, NOW, PolicyConfig(eviction=strategy))
        candidates = [c for cs in snap.candidates_by_node.values() for c in cs]
        values = snap.keep_values(snap.candidates_by_node)
        for order in eviction_orders(candidates, values, strategy, state.catalog[model].kind, False):
            read = SortedAsRead(list(order.values()), {c.key: c for c in candidates})
            assert len(read) == len(candidates)
            assert [read[i] for i in range(len(read))] == sorted(candidates, key=order.__getitem__)
            with pytest.raises(IndexError):
                read[len(read)]


def _varied_state():
    """The benchmark's instances with every protection: pinned and min_copies models, loading,
    draining, busy and young instances; some nodes with a reported headroom, some dead."""
    from policy import ClusterState

    state, _, _, _ = scenarios(20, models=200)["place-evict"]
    catalog = {
        name: s.model_copy(update={"pinned": i % 11 == 0, "min_copies": 1 if i % 7 == 0 else 0, "max_copies": 2})
        for i, (name, s) in enumerate(state.catalog.items())
    }
    nodes = []
    for n, node in enumerate(state.nodes):
        instances = []
        for i, inst in enumerate(node.instances):
            change = [{}, {"status": "loading"}, {"status": "draining"}, {"in_flight": 2}, {"loaded_at": NOW - 3.0}, {"in_flight": 0}][(n + i) % 6]
            instances.append(inst.model_copy(update=change))
        headroom = [None, 0, 5 * 1024**3, 100 * 1024**3][n % 4]
        nodes.append(node.model_copy(update={"instances": tuple(instances), "reported_headroom_bytes": headroom, "alive": n % 9 != 4}))
    return ClusterState(nodes=tuple(nodes), catalog=catalog)


def test_the_snapshots_protection_is_protection_of():
    from policy import PolicyConfig
    from policy.eviction import protection_of, ready_copies
    from policy.snapshot import Snapshot

    state, config = _varied_state(), PolicyConfig()
    copies = ready_copies(state)
    snap = Snapshot(state, NOW, config)
    seen = set()
    for node in state.nodes:
        candidates = snap.candidates_by_node.get(node.node_id)
        if not node.alive:
            assert candidates is None
            continue
        assert [c.inst for c in candidates] == list(node.instances)
        for c in candidates:
            spec = state.catalog[c.inst.model]
            expected = protection_of(c.inst, spec, copies.get(spec.name, 0) if spec.min_copies > 0 else 0, NOW, config)
            assert c.protection == expected, (node.node_id, c.inst)
            seen.add(expected)
    assert seen == {None, "pinned", "min_copies", "loading", "draining", "busy", "young"}


def test_the_snapshots_free_memory_is_memorys():
    from policy import PolicyConfig
    from policy.memory import ever_available_bytes, free_bytes
    from policy.snapshot import Snapshot

    state, config = _varied_state(), PolicyConfig()
    snap = Snapshot(state, NOW, config)
    for node in state.nodes:
        assert snap.free(node) == free_bytes(node)
        assert snap.ever_available(node) == ever_available_bytes(node, config)


def test_a_refusal_at_scale_names_its_blockers_as_columns_that_read_as_blockers():
    """The contention scenario's Wait names every busy instance: as columns, read back one by one
    as Blocker values, in the state's order, and the same after a trip through JSON."""
    from policy import Blocker, InstanceRef, Wait
    from policy.decisions import Blockers

    state, model, config, _ = scenarios(20, models=200)["contention"]
    decision = ensure(model, state, NOW, config)
    assert isinstance(decision, Wait) and decision.code == "busy"
    expected = [
        Blocker(instance=InstanceRef(node_id=node.node_id, model=inst.model), protection="busy", bytes=inst.bytes)
        for node in state.nodes
        for inst in node.instances
    ]
    assert len(decision.blockers) == len(expected) and list(decision.blockers) == expected
    assert decision.blockers[3] == expected[3]
    assert decision.blockers.keys_of("busy") == [(b.instance.node_id, b.instance.model) for b in expected]
    assert decision.blockers.keys_of("young") == []
    assert Wait.model_validate_json(decision.model_dump_json()) == decision
    assert Blockers.model_validate(expected) == decision.blockers  # written as rows, read as columns
    with pytest.raises(ValueError, match="one entry per blocker"):
        Blockers(node_ids=("n1",), models=(), protections=(), bytes=())
