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
