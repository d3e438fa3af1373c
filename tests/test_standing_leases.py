"""The ingress's side of standing leases (router/serving/standing.py) against the real residency
controller, in one event loop. The residency service's Serve handle is replaced by `Direct`, which
calls the controller's methods as the service's own would (a unit test of the ingress's
bookkeeping; the cluster tests run it through Serve and Ray)."""

import asyncio

from support.builders import spec
from support.loop import PLAIN, make

from deployments.wire.leases import Grant, UsageReport
from router.serving.lease import Leases


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class Direct:
    """The service methods StandingLeases and Leases call, straight on the controller."""

    def __init__(self, controller):
        self.c = controller

        async def acquire(model, tenant=None, reserve_tokens=0, holder=None, avoid=None):
            lease = await self.c.acquire(model, holder, avoid)
            return Grant(lease=lease, kind="llm", actor_name=f"orchard:{model}@{lease.node_id}#1", epoch=self.c.epoch)

        async def release(lease_id, used_tokens=None):
            self.c.release(lease_id)

        async def report_usage(report: UsageReport):
            self.c.report_usage(report.holder, report.in_flight, report.started)

        async def routes(holder, version=-1):
            return await self.c.routes(holder, version, timeout_s=0.2)

        self.acquire, self.release = _Method(acquire), _Method(release)
        self.report_usage, self.routes = _Method(report_usage), _Method(routes)


async def settle(s: float = 0.05):
    await asyncio.sleep(s)


def test_requests_share_one_lease_and_it_goes_back_after_the_linger():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 4),), real_clock=True)
        leases = Leases(Direct(c), holder="ing-1", linger_s=0.3)
        first = await leases.acquire("a")
        second = await leases.acquire("a")  # while the first runs
        shared = first.lease_id == second.lease_id and c.acquires == 1
        await settle(0.4)  # a report round: the count reaches the controller
        counted = c.state.node("n1").instance("a").in_flight
        first.release()
        second.release()
        await settle(0.9)  # the linger passes
        return shared, counted, c.leases.all(), leases.standing

    shared, counted, left, standing = asyncio.run(scenario())
    assert shared and counted == 2
    assert left == [] and standing.held == {}


def test_the_requests_a_holder_starts_are_the_models_demand_and_keyed_ones_count_at_the_lease():
    """Rule L4's demand: requests through a standing lease are counted by the holder and reported in
    its batches; a request with a lease of its own (a key's limits) is counted when it asks."""

    async def scenario():
        c, fx = make([spec("a", gb=1), spec("b", gb=1)], nodes=(("n1", 4),), real_clock=True)
        leases = Leases(Direct(c), holder="ing-1", linger_s=5.0)
        for _ in range(3):
            (await leases.acquire("a")).release()
        await settle(0.4)  # a report round
        before_own = c.demand.at("a", fx.now())
        own = await c.acquire("b")  # no holder: a lease of its own
        c.release(own.lease_id)
        await settle(0.4)
        return before_own, c.demand.snapshot(fx.now())

    reported, demand = asyncio.run(scenario())
    assert 2.99 < reported <= 3.0 and 2.99 < demand["a"] <= 3.0  # reported once, not again in later rounds
    assert 0.99 < demand["b"] <= 1.0


def test_a_lease_in_use_is_kept_and_once_idle_it_is_revoked_and_given_back_for_the_placement():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=(("n1", 4),), config=PLAIN.model_copy(update={"wait_timeout_s": 5.0}), real_clock=True)
        leases = Leases(Direct(c), holder="ing-1", linger_s=30.0)
        running = await leases.acquire("a")
        await settle(0.4)
        other = asyncio.create_task(c.acquire("b"))  # needs a's memory: a is busy, so it waits
        await settle(0.4)
        held_while_running = [x.lease_id for x in c.leases.all()]
        running.release()  # idle now: the next report says 0, the controller revokes, the lease goes back
        b = await asyncio.wait_for(other, 2.0)
        return held_while_running, running.lease_id, b, fx

    held, lease_id, b, fx = asyncio.run(scenario())
    assert held == [lease_id]  # in use: never taken away, the eviction waited
    assert b.model == "b" and [r.model for r, _ in fx.stopped] == ["a"]


def test_a_lease_whose_instance_went_away_is_forgotten_and_the_next_request_asks_again():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 4),), real_clock=True)
        leases = Leases(Direct(c), holder="ing-1", linger_s=30.0)
        one = await leases.acquire("a")
        one.release()
        await settle(0.1)
        c.unload("a")
        await settle(0.5)  # the long poll answers: the lease is gone
        forgotten = leases.standing.held == {}
        again = await leases.acquire("a")
        return forgotten, one.lease_id, again.lease_id, c.acquires

    forgotten, first, second, acquires = asyncio.run(scenario())
    assert forgotten and first != second and acquires == 2


def test_a_busy_model_with_a_second_copy_gets_a_lease_on_it_too():
    async def scenario():
        c, fx = make([spec("a", gb=3, max_copies=2)], nodes=(("n1", 4), ("n2", 4)), real_clock=True)
        leases = Leases(Direct(c), holder="ing-1", linger_s=30.0)
        first = await leases.acquire("a")
        await c.load("a", "n2" if first.node_id == "n1" else "n1")  # an operator adds a copy
        await settle(0.5)  # the long poll says there are two
        second = await leases.acquire("a")  # the first is busy: one more lease, on the other copy
        return first.node_id, second.node_id, c.acquires

    one, two, acquires = asyncio.run(scenario())
    assert one != two and acquires == 2


def test_leases_of_an_earlier_controller_are_forgotten_when_a_new_one_answers():
    """The residency service restarted: its new controller knows none of the replica's standing
    leases (another epoch), so the replica forgets them and asks the new one."""

    async def scenario():
        old, _ = make([spec("a", gb=3)], nodes=(("n1", 4),), real_clock=True)
        leases = Leases(Direct(old), holder="ing-1", linger_s=30.0)
        (await leases.acquire("a")).release()
        new, _ = make([spec("a", gb=3)], nodes=(("n1", 4),), real_clock=True)
        leases.residency = leases.standing.residency = Direct(new)
        await settle(0.5)  # the long poll now reaches the new controller
        forgotten = leases.standing.held == {}
        again = await leases.acquire("a")
        return forgotten, again.grant.epoch == new.epoch, new.acquires

    forgotten, fresh, acquires = asyncio.run(scenario())
    assert forgotten and fresh and acquires == 1
