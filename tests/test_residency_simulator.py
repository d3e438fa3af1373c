"""The trace simulator's bookkeeping, on short traces (the full run is `make run`)."""

from bench.residency.catalog import NODES, ONE_MAC, empty_cluster, model_specs
from bench.residency.scale import time_one_decision
from bench.residency.simulate import belady, count_only, orchard, simulate
from bench.residency.traces import bursts, workday, zipf
from policy import PolicyConfig


def test_traces_are_deterministic_and_ordered():
    for make in (lambda: zipf(requests=300), lambda: bursts(hours=0.3), lambda: workday(hours=0.5)):
        a, b = make(), make()
        assert a == b and a
        assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:], strict=False))


def test_orchard_never_overcommits_and_every_request_is_accounted_for():
    trace = zipf(requests=600)
    config = PolicyConfig()
    for name in ("lru", "cost", "fewest"):
        tally = simulate(trace, empty_cluster(model_specs(), NODES), orchard(config.model_copy(update={"eviction": name})), config)
        row = tally.row()
        assert row["unsafe_loads"] == 0 and row["served_overcommitted"] == 0, name
        assert len(tally.start_delays) + tally.rejected == len(trace), name
        assert tally.loads >= len({r.model for r in trace}) - tally.rejected
        assert 0 < row["hit_rate"] < 1


def test_count_only_overcommits_a_small_mac_where_orchard_does_not():
    trace = workday(hours=1.5)
    config = PolicyConfig()
    old = simulate(trace, empty_cluster(model_specs(), ONE_MAC), count_only(2), config)
    new = simulate(trace, empty_cluster(model_specs(), ONE_MAC), orchard(config), config)
    assert old.unsafe_loads > 0 and old.served_overcommitted > 0
    assert new.unsafe_loads == 0 and new.served_overcommitted == 0


def test_belady_reference_runs_under_the_same_rules():
    trace = bursts(hours=0.3)
    config = PolicyConfig()
    tally = simulate(trace, empty_cluster(model_specs(), NODES), belady(config, trace), config)
    assert tally.unsafe_loads == 0 and len(tally.start_delays) + tally.rejected == len(trace)


def test_decision_at_scale_places_with_an_eviction():
    result = time_one_decision(nodes=20, models=200, runs=1)
    assert result["evicted"] >= 1 and result["instances"] > 100


def test_with_weights_on_one_node_the_locality_aware_policy_copies_less():
    """L1 in the simulator: weights start on the largest node only; copies are charged and counted.
    The policy that sees the stores copies fewer models (and fewer bytes) than the one shown none."""
    from bench.residency.catalog import with_stores
    from bench.residency.simulate import locality_blind

    trace, config = zipf(requests=1000), PolicyConfig()
    rows = {}
    for name, decide in (("aware", orchard(config)), ("blind", locality_blind(config))):
        tally = simulate(trace, with_stores(empty_cluster(model_specs(), NODES), "home"), decide, config)
        rows[name] = tally.row()
        assert tally.fetches > 0 and len(tally.ready_delays) > 0 and rows[name]["unsafe_loads"] == 0
    assert rows["aware"]["fetches"] < rows["blind"]["fetches"] and rows["aware"]["gb_fetched"] < rows["blind"]["gb_fetched"]


def test_with_the_weights_on_every_node_nothing_is_copied_and_ready_comes_sooner():
    """The locality table's floor: every store holds the whole catalog, so no placement copies, and
    time to ready is below that of the locality-blind policy that copies from one home node."""
    from bench.residency.catalog import with_stores
    from bench.residency.simulate import locality_blind

    trace, config = zipf(requests=1000), PolicyConfig()
    base = empty_cluster(model_specs(), NODES)
    floor = simulate(trace, with_stores(base, "everywhere"), orchard(config), config)
    blind = simulate(trace, with_stores(base, "home"), locality_blind(config), config)
    assert floor.fetches == 0 and blind.fetches > 0
    assert floor.row()["mean_time_to_ready_s"] < blind.row()["mean_time_to_ready_s"]


def test_background_copies_take_the_copies_off_the_requests_path():
    """Rule L4 in the simulator: with idle links copying the catalog ahead of demand, placements wait
    for fewer copies than without, and requests that wait for a load are ready sooner."""
    from bench.residency.catalog import with_stores
    from bench.residency.prefetch import shipped

    trace, config = bursts(hours=0.5), PolicyConfig(background_copies="catalog")
    state = with_stores(empty_cluster(model_specs(), NODES), "home")
    plain = simulate(trace, state, orchard(config), config)
    ahead = simulate(trace, state, orchard(config), config, prefetch=shipped(config))
    assert plain.prefetches == 0 and ahead.prefetches > 0
    assert ahead.fetches < plain.fetches
    assert ahead.row()["mean_time_to_ready_s"] < plain.row()["mean_time_to_ready_s"]
    assert ahead.row()["unsafe_loads"] == 0 and ahead.rejected == plain.rejected == 0


def test_a_store_over_its_disk_budget_removes_its_least_recently_used_unused_folder():
    """make_room: the oldest folder not loaded there and held elsewhere goes first; a loaded one, the
    one just fetched, and the cluster's last copy stay, even over budget."""
    from bench.residency.catalog import with_stores
    from bench.residency.simulate import make_room

    state = with_stores(empty_cluster(model_specs(), NODES), "home")
    home, other = state.nodes[0].node_id, state.nodes[1].node_id
    by_size = sorted(state.catalog, key=lambda m: state.catalog[m].weight_bytes)
    a, b, c = by_size[-1], by_size[-2], by_size[-3]  # three large models, all stored on home only
    nodes = tuple(n.model_copy(update={"stored": frozenset({a, b, c})}) if n.node_id == other else n for n in state.nodes)
    state = state.model_copy(update={"nodes": nodes})
    used = {(other, a): 1.0, (other, b): 2.0, (other, c): 3.0}  # a is the least recently used
    budget = state.catalog[b].weight_bytes + state.catalog[c].weight_bytes
    after, removed = make_room(state, other, c, budget, used)
    assert removed == 1 and after.node(other).stored == {b, c}
    # nothing removable: c is kept (just fetched), b is the last copy once home forgets it
    nodes = tuple(n.model_copy(update={"stored": n.stored - {b}}) if n.node_id == home else n for n in after.nodes)
    after, removed = make_room(after.model_copy(update={"nodes": nodes}), other, c, 0, used)
    assert removed == 0 and after.node(other).stored == {b, c}
