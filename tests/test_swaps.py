"""Rules W1-W3 (swaps) and N1 (a suspect node) on the residency loop, with the fake effects of
tests/support/loop.py and the loop's clock driven by the test; `pick_swap` alone, pure."""

import asyncio

import pytest
from support.builders import cluster, inst, node, spec
from support.loop import PLAIN, make

from deployments.wire.failure import OrchardError
from policy import InstanceRef
from policy.config import GIB
from policy.swap import SwapAsk, pick_swap
from router.residency.events import NodeReported, NodeUnreachable

SWAPPING = PLAIN.model_copy(update={"wait_timeout_s": 20.0, "swap_after_s": 1.0, "min_residency_s": 5.0, "retry_poll_s": 0.05})
ONE_NODE = (("n1", 4),)


def kinds(c):
    return [e.kind for e in c.events()]


def test_w1_a_model_kept_out_by_a_busy_instance_drains_it_and_is_swapped_in():
    """Under steady load `a` is never idle, so E2 alone would keep `b` out until its requests time
    out. After swap_after_s, `a` drains: no new request is granted on it, the one running finishes,
    then it is evicted for `b`, which is placed and served."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=SWAPPING)
        running = await c.acquire("a")
        await fx.run_for(6)  # a is older than min_residency_s
        b = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.5)
        before_swap_after = kinds(c).count("draining")
        await fx.run_for(1.0)
        draining = c.state.node("n1").instance("a").status
        late_a = asyncio.create_task(c.acquire("a"))  # a request for a while it drains waits
        await fx.run_for(0.5)
        granted_on_draining = late_a.done()
        c.release(running.lease_id)  # the running request finishes
        lease_b = await asyncio.wait_for(b, 5)
        late_a.cancel()
        return c, before_swap_after, draining, granted_on_draining, lease_b

    c, before, draining, granted_on_draining, lease_b = asyncio.run(scenario())
    assert before == 0 and draining == "draining" and not granted_on_draining
    assert lease_b.model == "b" and lease_b.node_id == "n1"
    events = c.events()
    evicted = next(e for e in events if e.kind == "evicted")
    assert evicted.model == "a" and evicted.reason == "drained for b"
    assert kinds(c).index("draining") < kinds(c).index("evicted") < kinds(c).index("loaded", kinds(c).index("evicted"))


def test_w1_a_drain_stops_when_no_request_waits_for_it_any_more():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=SWAPPING)
        running = await c.acquire("a")
        await fx.run_for(6)
        b = asyncio.create_task(c.acquire("b"))
        await fx.run_for(1.5)
        was = c.state.node("n1").instance("a").status
        b.cancel()
        await fx.run_for(0.1)
        again = await asyncio.wait_for(c.acquire("a"), 1)  # a serves again
        return c, was, running, again

    c, was, running, again = asyncio.run(scenario())
    assert was == "draining" and c.state.node("n1").instance("a").status == "ready"
    assert again.node_id == "n1" and "evicted" not in kinds(c)
    assert any(e.kind == "cancelled" and e.model == "a" for e in c.events())


@pytest.mark.parametrize("bound", ["young", "budget"])
def test_w2_no_drain_of_a_young_instance_nor_past_the_swap_budget(bound):
    config = SWAPPING.model_copy(update={"wait_timeout_s": 3.0, "min_residency_s": 60.0 if bound == "young" else 0.0})
    if bound == "budget":
        config = config.model_copy(update={"max_swaps_per_node_per_minute": 0})

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=config)
        await c.acquire("a")
        with pytest.raises(OrchardError) as refused:
            await c.acquire("b")
        return c, refused.value

    c, refused = asyncio.run(scenario())
    assert refused.code == "model_busy" and "draining" not in kinds(c) and "gave_up" in kinds(c)


def test_w1_a_standing_lease_on_a_draining_instance_is_revoked():
    """The holder learns from its long poll that it must send nothing new to the drained instance."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=SWAPPING)
        lease = await c.acquire("a", holder="ing-1")
        c.report_usage("ing-1", {lease.lease_id: 3})  # three requests run on it
        await fx.run_for(6)
        b = asyncio.create_task(c.acquire("b"))
        await fx.run_for(1.5)
        view = await c.routes("ing-1", timeout_s=0)
        c.report_usage("ing-1", {lease.lease_id: 0})
        c.release(lease.lease_id)  # the holder gives it back once idle
        got = await asyncio.wait_for(b, 5)
        return view, lease, got

    view, lease, got = asyncio.run(scenario())
    assert view.revoked == [lease.lease_id] and view.valid == []
    assert got.model == "b"


def test_w3_the_swap_goes_to_the_most_waiting_per_second_of_loading():
    """Two models wait behind busy ones: the one whose requests have waited more per second of
    loading the swap costs is swapped in; waiting alone (one old request) does not beat many."""
    s = cluster(
        [node("n1", 4, inst("a", 3, in_flight=2, loaded_at=0.0)), node("n2", 4, inst("c", 3, in_flight=1, loaded_at=0.0))],
        [spec("a", gb=3), spec("c", gb=3), spec("b", gb=3, load_seconds_estimate=2.0), spec("d", gb=3, load_seconds_estimate=2.0)],
    )
    asks = [SwapAsk(model="b", waiting=1, waited_s=8.0), SwapAsk(model="d", waiting=6, waited_s=3.0)]
    drain = pick_swap(asks, s, 100.0, SWAPPING, swaps_last_minute={})
    assert drain is not None and drain.model == "d" and len(drain.instances) == 1
    assert drain.instances[0].model in ("a", "c") and "6 request(s) for d" in drain.reason
    assert pick_swap([SwapAsk(model="b", waiting=1, waited_s=0.5)], s, 100.0, SWAPPING, swaps_last_minute={}) is None  # not waited long enough
    assert (
        pick_swap(
            asks, s, 100.0, SWAPPING, swaps_last_minute={"n1": SWAPPING.max_swaps_per_node_per_minute, "n2": SWAPPING.max_swaps_per_node_per_minute}
        )
        is None
    )
    assert pick_swap(asks, s, 100.0, SWAPPING.model_copy(update={"contention": "fail"}), swaps_last_minute={}) is None


def test_n1_a_node_ray_cannot_start_on_is_suspect_and_the_model_goes_elsewhere():
    """A start that fails because the node is unreachable does not mark the model failed: the node is
    suspect (its instances dropped, no placement there), the model is placed on another node at once,
    and the node is back once it reports again."""

    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 8), ("n2", 4)), config=SWAPPING)
        original = fx.start_instance

        async def start(order):
            if order.place.node_id == "n2":
                raise NodeUnreachable("n2", "Ray cannot start it on n2: ActorUnschedulableError")
            return await original(order)

        fx.start_instance = start
        lease = await asyncio.wait_for(c.acquire("a"), 5)
        suspect = c.state.node("n2").alive
        c.apply(NodeReported(node_id="n2", devices=("metal", "cpu"), total_bytes=4 * GIB, usable_bytes=4 * GIB, free_bytes=4 * GIB))
        return c, lease, suspect

    c, lease, suspect = asyncio.run(scenario())
    assert lease.node_id == "n1" and suspect is False and c.state.node("n2").alive
    assert "a" not in c.state.failed
    assert kinds(c).count("node_suspect") == 1 and kinds(c)[-1] == "node_up"


def test_n1_a_lost_node_drops_its_instances_and_leases_at_once():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 8), ("n2", 4)), config=SWAPPING)
        first = await c.acquire("a")
        from router.residency.events import NodeLost

        c.apply(NodeLost(node_id=first.node_id, reason="its agent does not answer", suspect=True))
        again = await asyncio.wait_for(c.acquire("a", avoid=(first.node_id, first.loaded_at)), 5)
        return c, first, again

    c, first, again = asyncio.run(scenario())
    assert again.node_id != first.node_id and first.lease_id not in {x.lease_id for x in c.leases.all()}
    assert InstanceRef(node_id=first.node_id, model="a") not in {
        InstanceRef(node_id=n.node_id, model=i.model) for n in c.state.nodes for i in n.instances
    }


def test_w2_one_swap_makes_room_for_one_model():
    """Two busy nodes, one waiting model: one drain, not one per node (each would cost a swap and
    bounce a model that had to be loaded back)."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("c", gb=3), spec("b", gb=3)], nodes=(("n1", 4), ("n2", 4)), config=SWAPPING)
        leases = [await c.acquire("a"), await c.acquire("c")]
        await fx.run_for(6)
        b = asyncio.create_task(c.acquire("b"))
        await fx.run_for(4)  # twice swap_after_s, the drain still under way
        drains = kinds(c).count("draining")
        for lease in leases:
            c.release(lease.lease_id)
        got = await asyncio.wait_for(b, 5)
        return c, drains, got

    c, drains, got = asyncio.run(scenario())
    assert drains == 1 and kinds(c).count("evicted") == 1 and got.model == "b"
