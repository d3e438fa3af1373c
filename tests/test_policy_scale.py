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
