"""The residency controller's loop, driven by an in-memory Effects (a fake of our own interface,
not of Ray: the Ray effects are exercised by the cluster tests)."""

import asyncio
import threading

import pytest
from support.builders import spec
from support.loop import PLAIN, FakeEffects, make, run

from cluster.node_report import StoreReport
from deployments.manifest import ManifestEntry
from deployments.wire.failure import OrchardError
from policy import InstanceRef
from policy.config import GIB
from router.residency.controller import ResidencyController
from router.residency.events import NodeReported
from router.residency.operator_store import OperatorStore
from router.residency.service import ResidencyService


def test_first_request_places_loads_and_leases():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        lease = await c.acquire("a")
        return c, fx, lease

    c, fx, lease = run(scenario())
    assert lease.node_id == "n2"  # pack: the tighter fit
    assert [p.model for p in fx.started] == ["a"]
    inst = c.state.node("n2").instance("a")
    assert inst.status == "ready" and inst.in_flight == 1
    c.release(lease.lease_id)
    c.release(lease.lease_id)  # idempotent
    assert c.state.node("n2").instance("a").in_flight == 0
    assert [e.kind for e in c.events()] == ["node_up", "node_up", "placed", "loading", "loaded"]


def test_a_lease_names_the_incarnation_of_its_instance():
    """Leases of one placed instance share its loaded_at; placed again after an unload, the model
    is a new actor under the same name, and its leases say so (the ingress keys cached handles on it)."""

    async def scenario():
        c, fx = make([spec("a", gb=3)])
        first = await c.acquire("a")
        second = await c.acquire("a")
        c.release(first.lease_id)
        c.release(second.lease_id)
        fx.clock.advance(5)
        c.unload("a")
        for _ in range(100):  # the stop runs as a task
            if c.state.node(first.node_id).instance("a") is None:
                break
            await fx.run_for(0.01)
        third = await c.acquire("a")
        return first, second, third

    first, second, third = run(scenario())
    assert first.loaded_at == second.loaded_at
    assert (third.model, third.node_id) == (first.model, first.node_id) and third.loaded_at > first.loaded_at


def test_concurrent_requests_share_one_load():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        fx.gate = asyncio.Event()
        tasks = [asyncio.create_task(c.acquire("a")) for _ in range(5)]
        await fx.run_for(0.01)
        fx.gate.set()
        return fx, await asyncio.gather(*tasks)

    fx, leases = run(scenario())
    assert len(fx.started) == 1 and len({lease.lease_id for lease in leases}) == 5


def test_eviction_stops_the_victim_and_busy_instances_are_waited_for():
    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        lease_a = await c.acquire("a")
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.05)
        assert not waiting.done()  # a is busy: never evicted under a live lease
        c.release(lease_a.lease_id)
        lease_b = await asyncio.wait_for(waiting, 1)
        await c.settle()
        return c, fx, lease_b

    c, fx, lease_b = run(scenario())
    assert lease_b.model == "b" and [r.model for r, _ in fx.stopped] == ["a"]
    kinds = [e.kind for e in c.events()]
    assert "evicted" in kinds and kinds.index("evicted") < kinds.index("placed", kinds.index("evicted") - 1)


def test_wait_times_out_into_a_503_with_retry_after():
    async def scenario():
        c, _ = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        await c.acquire("a")
        with pytest.raises(OrchardError) as info:
            await c.acquire("b")
        return info.value

    err = run(scenario())
    assert err.status == 503 and err.code == "model_busy" and err.retry_after_s and "busy models a" in err.message


def test_pinned_blocker_is_rejected_at_once_and_unknown_models_are_404():
    async def scenario():
        c, _ = make([spec("a", gb=6, pinned=True), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        errors = []
        for model in ("b", "ghost"):
            with pytest.raises(OrchardError) as info:
                await c.acquire(model)
            errors.append(info.value)
        return c, errors

    c, (blocked, unknown) = run(scenario())
    assert (blocked.status, blocked.code, blocked.retry_after_s) == (503, "model_blocked", None)
    assert "pinned models a hold 6.0 GiB" in blocked.message
    assert (unknown.status, unknown.code) == (404, "model_not_found")
    assert c.events()[-1].kind == "rejected" and c.events()[-1].model == "b"  # the 404 leaves no event: clients make names up


def test_only_an_out_of_memory_load_is_retried_and_twice_is_reported():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)])
        fx.fail["a"] = ["out_of_memory"]
        lease = await c.acquire("a")  # second attempt succeeds
        fx.fail["b"] = ["out_of_memory", "out_of_memory"]
        with pytest.raises(OrchardError) as info:
            await c.acquire("b")
        return fx, lease, info.value

    fx, lease, twice = run(scenario())
    assert lease.model == "a" and [p.model for p in fx.started].count("a") == 2
    assert [p.model for p in fx.started].count("b") == 2
    assert twice.code == "model_load_failed" and "out_of_memory" in twice.message and "tried again in" in twice.message and twice.retry_after_s


def test_bad_files_evict_nothing_are_refused_at_once_and_tried_again_when_they_change():
    """Issue 10 item 3: a truncated safetensors file must not churn the healthy neighbour."""

    async def scenario():
        c, fx = make([spec("healthy", gb=5), spec("broken", gb=3)], nodes=(("n1", 8),))
        c.release((await c.acquire("healthy")).lease_id)
        fx.versions["broken"] = "v1"
        fx.fail["broken"] = ["bad_files", "bad_files"]
        errors = []
        for _ in range(3):  # the openai SDK's three tries
            with pytest.raises(OrchardError) as info:
                await c.acquire("broken")
            errors.append(info.value)
        starts_while_marked = [p.model for p in fx.started].count("broken")
        fx.versions["broken"] = "v2"  # the operator copied good files over
        fx.fail["broken"] = []
        lease = await c.acquire("broken")
        return c, fx, errors, starts_while_marked, lease

    c, fx, errors, starts_while_marked, lease = run(scenario())
    assert starts_while_marked == 1  # one load; the retries were refused from the mark
    assert all(e.code == "model_load_failed" and e.status == 503 and e.retry_after_s for e in errors)
    assert "tried again in" in errors[-1].message and "bad_files" in errors[-1].message
    assert not any(r.model == "healthy" for r, _ in fx.stopped)  # never evicted
    assert not any(e.kind == "evicted" for e in c.events())
    assert lease.model == "broken" and "retrying" in [e.kind for e in c.events()]


def test_an_operator_load_tries_a_failed_model_again_at_once():
    async def scenario():
        c, fx = make([spec("broken", gb=3)])
        fx.fail["broken"] = ["error"]
        with pytest.raises(OrchardError):
            await c.acquire("broken")
        ref = await c.load("broken")
        return c, fx, ref

    c, fx, ref = run(scenario())
    assert ref.model == "broken" and len(fx.started) == 2 and "broken" not in c.state.failed


def test_a_wait_is_announced_and_giving_up_is_recorded():
    async def scenario():
        c, _ = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        await c.acquire("a")
        with pytest.raises(OrchardError):
            await c.acquire("b")
        return c

    events = run(scenario()).events()
    waiting = [e for e in events if e.kind == "waiting"]
    assert len(waiting) == 1 and waiting[0].model == "b" and waiting[0].node_id == "n1" and "busy" in waiting[0].reason
    gave_up = [e for e in events if e.kind == "gave_up"]
    assert len(gave_up) == 1 and gave_up[0].model == "b" and gave_up[0].seconds >= 0.2


def test_waiters_are_served_in_arrival_order():
    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6), spec("c", gb=6)], nodes=(("n1", 8),), config=PLAIN.model_copy(update={"wait_timeout_s": 5}))
        lease_a = await c.acquire("a")
        order = []

        async def want(model):
            lease = await c.acquire(model)
            order.append(model)
            await fx.run_for(0.02)
            c.release(lease.lease_id)

        tasks = [asyncio.create_task(want("b"))]
        await fx.run_for(0.01)
        tasks.append(asyncio.create_task(want("c")))
        await fx.run_for(0.01)
        c.release(lease_a.lease_id)
        await asyncio.wait_for(asyncio.gather(*tasks), 3)
        return order

    assert run(scenario()) == ["b", "c"]


def test_a_dead_instance_is_dropped_with_its_cause_and_placed_again():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        lease = await c.acquire("a")
        c.instance_died(InstanceRef(node_id=lease.node_id, model="a"), "its actor died: killed by ray.kill")
        again = await c.acquire("a")
        return c, fx, lease, again

    c, fx, lease, again = run(scenario())
    died = [e for e in c.events() if e.kind == "died"]
    assert len(died) == 1 and "ray.kill" in died[0].reason and died[0].model == "a"
    assert lease.lease_id not in {x.lease_id for x in c.leases.all()} and again.lease_id != lease.lease_id
    assert len(fx.started) == 2


def test_dead_node_drops_its_instances_and_the_next_request_replaces_elsewhere():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        first = await c.acquire("a")
        c.release(first.lease_id)
        c.node_dead(first.node_id)
        second = await c.acquire("a")
        return c, first, second

    c, first, second = run(scenario())
    assert first.node_id != second.node_id
    assert not c.state.node(first.node_id).alive and c.state.node(first.node_id).instances == ()
    assert [e.kind for e in c.events()].count("node_dead") == 1


def test_idle_timeout_and_operator_actions():
    async def scenario():
        c, fx = make([spec("a", gb=3, idle_ttl_s=60), spec("p", gb=1)])
        c.release((await c.acquire("a")).lease_id)
        fx.clock.advance(61)
        c.tick()
        idle_unloaded = c.state.node("n2").instance("a") is None
        where = await c.load("p", node_id="n1")
        c.pin("p")
        with pytest.raises(OrchardError) as pinned:
            c.unload("p")
        c.pin("p", False)
        unloaded = c.unload("p")
        await c.settle()
        return c, fx, idle_unloaded, where, pinned.value, unloaded

    c, fx, idle_unloaded, where, pinned, unloaded = run(scenario())
    assert idle_unloaded and where == InstanceRef(node_id="n1", model="p")
    assert pinned.status == 409 and unloaded == [where]
    assert {r.model for r, _ in fx.stopped} == {"a", "p"}
    assert [e.kind for e in c.events()].count("unloaded") == 2


def test_an_operator_load_past_max_copies_is_a_409_naming_the_limit():
    async def scenario():
        c, _ = make([spec("p", gb=1)])
        await c.load("p", node_id="n1")
        with pytest.raises(OrchardError) as info:
            await c.load("p", node_id="n2")
        return info.value

    err = run(scenario())
    assert (err.status, err.code, err.param) == (409, "model_already_loaded", None)
    assert "already has 1 copies (max_copies=1)" in err.message


def test_what_if_answers_as_a_request_or_a_load_would_and_changes_nothing():
    """The policy's answer for a model now (P11 for a named node), the same decision the loop takes,
    with nothing started, stopped or recorded."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3), spec("c", gb=2)], nodes=(("n1", 4), ("n2", 4)))
        c.release((await c.acquire("a")).lease_id)
        c.release((await c.acquire("b")).lease_id)
        fx.clock.advance(5)
        before = (c.state, len(c.events()), list(fx.started), list(fx.stopped))
        a_at = next(n.node_id for n in c.state.nodes if n.instance("a") is not None)
        answers = {
            "c": c.what_if("c"),
            "c on n1": c.what_if("c", "n1"),
            "a on its node": c.what_if("a", a_at),
            "a on the other": c.what_if("a", "n2" if a_at == "n1" else "n1"),
            "c on n9": c.what_if("c", "n9"),
            "zzz": c.what_if("zzz"),
        }
        return c, fx, before, answers

    c, fx, before, answers = run(scenario())
    assert (c.state, len(c.events()), fx.started, fx.stopped) == before
    assert answers["c"].decision == "place" and len(answers["c"].evict) == 1
    assert answers["c on n1"].decision == "place" and answers["c on n1"].node_id == "n1"
    assert [r.node_id for r in answers["c on n1"].evict] == ["n1"]
    assert answers["a on its node"].decision == "use"
    assert (answers["a on the other"].decision, answers["a on the other"].code) == ("reject", "max_copies")
    assert (answers["c on n9"].decision, answers["c on n9"].code) == ("reject", "no_node")
    assert (answers["zzz"].decision, answers["zzz"].code) == ("reject", "unknown_model")


def test_next_events_answers_at_once_waits_for_the_next_or_times_out_empty():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        last = c.events()[-1].seq
        at_once = await c.next_events(0)
        waiter = asyncio.create_task(c.next_events(last, timeout_s=60))
        await fx.run_for(1)
        waited_before = waiter.done()
        c.release((await c.acquire("a")).lease_id)
        woken = await waiter
        start = fx.clock.now()
        empty = await c.next_events(c.events()[-1].seq, timeout_s=3)
        return at_once, waited_before, woken, empty, fx.clock.now() - start

    at_once, waited_before, woken, empty, waited_s = run(scenario())
    assert [e.kind for e in at_once] == ["node_up", "node_up"]
    assert not waited_before and woken[0].kind == "placed"
    assert empty == [] and 3 <= waited_s < 3.1


def test_the_cluster_view_carries_the_loops_clock_the_catalog_as_pinned_now_and_each_nodes_chip():
    from router.residency import views

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=1)])
        c.report_node("n1", devices=("metal", "cpu"), total_bytes=8 * GIB, usable_bytes=8 * GIB, free_bytes=8 * GIB, chip="Apple M4 Max")
        c.release((await c.acquire("a")).lease_id)
        c.pin("b")
        fx.clock.advance(7)
        return views.cluster(c), c.clock.now()

    view, now = run(scenario())
    assert view["now"] == now
    inst = next(i for n in view["nodes"] for i in n["instances"])
    assert view["now"] - inst["last_used"] >= 7  # idle for as long as the loop's clock says
    assert view["catalog"]["b"]["pinned"] is True and view["catalog"]["a"]["weight_bytes"] == 3 * GIB
    assert {n["node_id"]: n["chip"] for n in view["nodes"]} == {"n1": "Apple M4 Max", "n2": None}


def test_forgotten_leases_expire():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        c.leases.max_lease_s = 10
        await c.acquire("a")
        fx.clock.advance(11)
        c.tick()
        return c

    c = run(scenario())
    assert c.leases.all() == [] and c.state.node("n2").instance("a").in_flight == 0
    assert c.events()[-1].kind == "lease_expired"


def test_node_reports_turn_into_foreign_memory_and_headroom():
    c, _ = make([spec("a", gb=3)], nodes=())
    c.report_node("mac", devices=("metal", "cpu"), total_bytes=64 * GIB, usable_bytes=48 * GIB, free_bytes=40 * GIB)
    node = c.state.node("mac")
    assert node.foreign_bytes == 8 * GIB and node.reported_headroom_bytes == 40 * GIB


def test_adopted_instances_are_served_without_a_load():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        c.adopt_instance("n1", "a", "metal", 3 * GIB, 2.0)
        return fx, await c.acquire("a")

    fx, lease = run(scenario())
    assert lease.node_id == "n1" and fx.started == []


@pytest.mark.parametrize(
    "code,message,reason",
    [
        ("not_found", "model folder of x not found on node n1", "not_found"),
        ("load_failed", "SafetensorError: Error while deserializing header: incomplete metadata", "bad_files"),
        ("load_failed", "ValueError: Model type qwen9 not supported.", "bad_files"),
        ("load_failed", "RuntimeError: [metal::malloc] Resource limit exceeded; Insufficient Memory", "out_of_memory"),
        ("load_failed", "MemoryError: ", "out_of_memory"),
        ("unavailable", "the model server is unavailable: ActorDiedError: The actor died unexpectedly", "out_of_memory"),
        ("internal", "TimeoutError: ", "error"),
    ],
)
def test_load_failures_are_classified_by_what_more_memory_could_fix(code, message, reason):
    from router.residency.effects import load_failure_reason

    assert load_failure_reason(code, message) == reason


@pytest.mark.parametrize("fetch_fails", [False, True])
def test_an_evicting_placement_fetches_the_weights_before_it_evicts(fetch_fails):
    """L1 in the controller: n1 must evict `a` for `b`, whose weights only n2's store holds (n2 is too
    small for b). The weights are fetched first, with nothing stopped yet; a failed fetch evicts
    nothing and refuses b with the reason; a finished one places b, evicting a."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8), ("n2", 4)))
        c.report_node("n2", devices=("metal", "cpu"), total_bytes=4 * GIB, usable_bytes=4 * GIB, free_bytes=4 * GIB, stored=frozenset({"b"}))
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        if fetch_fails:
            fx.fail_fetch.add("b")
        try:
            got = await c.acquire("b")
        except OrchardError as e:
            return c, fx, e
        return c, fx, got

    c, fx, result = run(scenario())
    assert fx.fetched == [("b", "n1", 0)]  # fetched before any stop
    if fetch_fails:
        assert isinstance(result, OrchardError) and "sha256 mismatch" in result.message
        assert fx.stopped == [] and c.state.node("n1").instance("a") is not None
    else:
        assert result.node_id == "n1" and [r for r, _ in fx.stopped] == [InstanceRef(node_id="n1", model="a")]
        assert "b" in c.state.node("n1").stored


def test_a_load_nobody_waits_for_any_more_is_cancelled_and_its_reservation_released():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        fx.gate = asyncio.Event()  # the load hangs until the test opens it
        first, second = asyncio.ensure_future(c.acquire("a")), asyncio.ensure_future(c.acquire("a"))
        await fx.run_for(0.05)
        assert c.state.node("n2").instance("a").status == "loading"
        first.cancel()
        await fx.run_for(0.05)
        still = [e.kind for e in c.events()]  # one request still waits: nothing cancelled
        second.cancel()
        await fx.run_for(0.05)
        return c, fx, still

    c, fx, still = run(scenario())
    assert "cancelled" not in still
    cancelled = [e for e in c.events() if e.kind == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].model == "a" and "went away" in cancelled[0].reason
    assert c.state.node("n2").instance("a") is None  # the reservation is released
    assert [(r.model, why) for r, why in fx.stopped] == [("a", "cancelled: nobody waits for it")]


def test_an_operator_load_is_never_cancelled_by_requests_going_away():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        fx.gate = asyncio.Event()
        request = asyncio.ensure_future(c.acquire("a"))
        await fx.run_for(0.05)
        operator = asyncio.ensure_future(c.load("a"))  # the operator now waits for the same load
        await fx.run_for(0.05)
        request.cancel()
        await fx.run_for(0.05)
        fx.gate.set()
        return c, await operator

    c, ref = run(scenario())
    assert ref.model == "a" and "cancelled" not in [e.kind for e in c.events()]
    assert c.state.node(ref.node_id).instance("a").status == "ready"


@pytest.mark.parametrize("contention", ["fail", "wait"])
def test_a_request_behind_a_long_fetch_gets_a_503_with_the_progress_as_contention_says(contention):
    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8), ("n2", 4)), config=PLAIN.model_copy(update={"contention": contention}))
        c.report_node("n2", devices=("metal", "cpu"), total_bytes=4 * GIB, usable_bytes=4 * GIB, free_bytes=4 * GIB, stored=frozenset({"b"}))
        c.release((await c.acquire("a")).lease_id)
        fx.fetch_s = 5.0  # longer than wait_timeout_s (0.2 s)
        for _ in range(2):  # with fail, the first answer comes before the copy reported anything
            with pytest.raises(OrchardError) as e:
                await c.acquire("b")
            await fx.run_for(0.02)
        return c, e.value

    c, error = run(scenario())
    assert error.code == ("model_fetching" if contention == "fail" else "model_gave_up") and error.retry_after_s
    assert "waits for its weights on n1" in error.message and "copying from n2: 50%" in error.message
    assert c.state.node("n1").instance("a") is not None  # nothing evicted meanwhile


# ---- standing leases (an ingress replica routes many requests through one) -----------------------
ONE_NODE = (("n1", 4),)


def test_a_standing_lease_is_busy_while_held_and_counts_what_its_holder_reports():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=ONE_NODE)
        lease = await c.acquire("a", holder="ing-1")
        inst = lambda: c.state.node("n1").instance("a")  # noqa: E731
        seen = [inst().in_flight]
        c.report_usage("ing-1", {lease.lease_id: 5})
        seen.append(inst().in_flight)
        c.report_usage("ing-1", {lease.lease_id: 0})
        seen.append(inst().in_flight)  # held and idle: still busy
        c.report_usage("ing-2", {lease.lease_id: 9})  # not its holder: ignored
        seen.append(inst().in_flight)
        c.release(lease.lease_id)
        seen.append(inst().in_flight)
        return lease, seen

    lease, seen = run(scenario())
    assert lease.holder == "ing-1"
    assert seen == [1, 5, 1, 1, 0]


@pytest.mark.parametrize("contention", ["fail", "wait"])
def test_an_idle_standing_lease_in_a_placements_way_is_revoked_and_the_eviction_waits_for_it(contention):
    """b needs a's memory; a is held by an idle standing lease: the controller revokes it (the
    holder's long poll says so at once), b waits (even with contention "fail", for the grace), and
    a is evicted only once the holder gave the lease back."""

    async def scenario():
        config = PLAIN.model_copy(update={"contention": contention, "wait_timeout_s": 5.0})
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=config)
        lease = await c.acquire("a", holder="ing-1")
        c.report_usage("ing-1", {lease.lease_id: 0})
        view = await c.routes("ing-1")
        asking = asyncio.create_task(c.acquire("b"))
        revoked = await asyncio.wait_for(c.routes("ing-1", view.version), 1.0)
        await fx.run_for(0.05)
        stopped_before = list(fx.stopped)
        still_there = c.state.node("n1").instance("a") is not None
        c.release(lease.lease_id)  # the holder gives it back
        b = await asyncio.wait_for(asking, 2.0)
        return lease, view, revoked, stopped_before, still_there, b, fx

    lease, view, revoked, stopped_before, still_there, b, fx = run(scenario())
    assert view.valid == [lease.lease_id] and view.revoked == [] and view.copies == {"a": 1}
    assert revoked.revoked == [lease.lease_id] and revoked.valid == []
    assert stopped_before == [] and still_there
    assert b.model == "b" and [ref.model for ref, _ in fx.stopped] == ["a"]


def test_a_standing_lease_in_use_is_never_revoked_and_its_instance_never_evicted():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=PLAIN.model_copy(update={"contention": "fail"}))
        lease = await c.acquire("a", holder="ing-1")
        c.report_usage("ing-1", {lease.lease_id: 2})
        with pytest.raises(OrchardError) as refused:
            await c.acquire("b")
        return c, fx, lease, refused.value, await c.routes("ing-1")

    c, fx, lease, refused, view = run(scenario())
    assert refused.code == "model_busy"
    assert fx.stopped == [] and view.valid == [lease.lease_id] and view.revoked == []


def test_standing_leases_of_a_holder_that_stopped_reporting_expire():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=ONE_NODE)
        lease = await c.acquire("a", holder="ing-1")
        kept = await c.acquire("a", holder="ing-2")
        fx.clock.advance(10)
        c.report_usage("ing-2", {kept.lease_id: 1})
        c.tick()
        alive = {x.lease_id for x in c.leases.all()}
        fx.clock.advance(10)
        c.tick()
        left = {x.lease_id for x in c.leases.all()}
        fx.clock.advance(10)
        c.tick()
        return c, lease, kept, alive, left

    c, lease, kept, alive, left = run(scenario())
    assert alive == {lease.lease_id, kept.lease_id} and left == {kept.lease_id}
    assert c.leases.all() == [] and c.state.node("n1").instance("a").in_flight == 0
    expired = [e for e in c.events() if e.kind == "lease_expired"]
    assert [e.reason for e in expired] == ["ingress ing-1 stopped reporting", "ingress ing-2 stopped reporting"]


def test_the_routes_long_poll_answers_on_change_and_drops_leases_of_an_unloaded_instance():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=ONE_NODE)
        lease = await c.acquire("a", holder="ing-1")
        c.release(lease.lease_id)
        held = await c.acquire("a", holder="ing-1")
        view = await c.routes("ing-1")
        quiet = await c.routes("ing-1", view.version, timeout_s=0.05)  # nothing changed: the timeout
        waiting = asyncio.create_task(c.routes("ing-1", view.version))
        await fx.run_for(0.01)
        c.unload("a")
        return held, view, quiet, await asyncio.wait_for(waiting, 1.0)

    held, view, quiet, after = run(scenario())
    assert view.valid == [held.lease_id] and view.leases_upto == 2
    assert quiet.version == view.version
    assert after.version > view.version and after.valid == [] and after.copies == {}


def test_an_operator_load_revokes_an_idle_standing_lease_in_its_way():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE)
        lease = await c.acquire("a", holder="ing-1")
        c.report_usage("ing-1", {lease.lease_id: 0})
        loading = asyncio.create_task(c.load("b", "n1"))
        for _ in range(100):
            if (await c.routes("ing-1", timeout_s=0)).revoked:
                break
            await fx.run_for(0.01)
        c.release(lease.lease_id)
        return await asyncio.wait_for(loading, 2.0), fx

    ref, fx = run(scenario())
    assert (ref.model, ref.node_id) == ("b", "n1") and [r.model for r, _ in fx.stopped] == ["a"]


def test_a_standing_lease_not_yet_reported_on_is_revoked_when_in_the_way():
    """Its holder's first report comes within a fraction of a second: until then the request that
    asked for it may have ended already, so it is asked back rather than refusing the placement."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=PLAIN.model_copy(update={"contention": "fail"}))
        lease = await c.acquire("a", holder="ing-1")
        asking = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.05)
        revoked = (await c.routes("ing-1", timeout_s=0)).revoked
        c.release(lease.lease_id)
        return revoked, await asyncio.wait_for(asking, 2.0), lease

    revoked, b, lease = run(scenario())
    assert revoked == [lease.lease_id] and b.model == "b"


def test_a_placement_blocked_by_a_standing_lease_in_use_waits_for_the_next_report_in_fail_mode():
    """Reports lag the ingress by a fraction of a second: a lease reported in use may be idle
    already. With contention "fail" the request waits (up to revoke_grace_s) for the next report,
    which says 0: the lease is revoked, given back, and the placement goes on."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3)], nodes=ONE_NODE, config=PLAIN.model_copy(update={"contention": "fail"}))
        lease = await c.acquire("a", holder="ing-1")
        c.report_usage("ing-1", {lease.lease_id: 1})
        asking = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)
        before = (await c.routes("ing-1", timeout_s=0)).revoked
        c.report_usage("ing-1", {lease.lease_id: 0})
        await fx.run_for(0.05)
        after = (await c.routes("ing-1", timeout_s=0)).revoked
        c.release(lease.lease_id)
        return before, after, await asyncio.wait_for(asking, 2.0), lease

    before, after, b, lease = run(scenario())
    assert before == [] and after == [lease.lease_id] and b.model == "b"


def test_demand_halves_every_half_life_and_forgets_what_decayed_away():
    from router.residency.demand import Demand

    d = Demand(half_life_s=10.0)
    d.add("a", 4, now=0.0)
    d.add("b", 1, now=0.0)
    assert d.at("a", 10.0) == 2.0 and d.at("a", 20.0) == 1.0
    d.add("a", 1, now=20.0)
    assert d.at("a", 20.0) == 2.0 and d.at("ghost", 20.0) == 0.0
    assert set(d.snapshot(105.0)) == {"a"}  # b: 2^-10.5 of a request, forgotten; a: 2 x 2^-8.5


# ---- X1: unload, then load --------------------------------------------------------------------


def _kinds(c, *kinds):
    return [(e.kind, e.model) for e in c.events() if e.kind in kinds]


def test_an_evicting_placement_whose_victim_releases_nothing_loads_only_once_it_has_exited_and_the_node_reports_the_room():
    """a's model server does not answer its stop (no release): b's load waits for a's process to
    exit (it still holds its 6 GiB), then for a report that shows the room."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.releases = False
        fx.stop_gate = asyncio.Event()  # a's process exits only when the test says so
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)
        held_back = (not waiting.done(), [p.model for p in fx.started], c.state.node("n1").instance("b").status)
        fx.stop_gate.set()
        lease = await asyncio.wait_for(waiting, 2)
        return c, fx, held_back, lease

    c, fx, held_back, lease = run(scenario())
    assert held_back == (True, ["a"], "loading")  # placed (its bytes reserved), not started
    assert lease.model == "b" and fx.overcommits == []
    assert fx.log == [("start", "a"), ("exit", "a"), ("start", "b")]
    assert _kinds(c, "evicted", "placed", "stopped", "loading", "loaded")[-5:] == [
        ("evicted", "a"),
        ("placed", "b"),
        ("stopped", "a"),
        ("loading", "b"),
        ("loaded", "b"),
    ]
    stopped = next(e for e in c.events() if e.kind == "stopped")
    loading = [e for e in c.events() if e.kind == "loading"][-1]
    assert stopped.bytes == 6 * GIB and "6.0 GiB released" in stopped.reason and "evicted for b" in stopped.reason
    assert stopped.at <= loading.at and "free" in loading.reason


def test_a_load_after_an_unload_on_the_same_node_waits_for_that_process_to_exit():
    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.releases = False
        fx.stop_gate = asyncio.Event()
        c.unload("a")  # gone from the state at once; its process is still exiting
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)
        started = [p.model for p in fx.started]
        fx.stop_gate.set()
        await asyncio.wait_for(waiting, 2)
        return fx, started

    fx, started = run(scenario())
    assert started == ["a"] and fx.overcommits == [] and fx.log == [("start", "a"), ("exit", "a"), ("start", "b")]


def test_a_victim_that_never_exits_fails_the_placement_in_bounded_time_and_nothing_is_overcommitted():
    """The wait is bounded by exit_wait_s on the controller's clock: the placement fails with the
    reason (load_failed, no_room), loads nothing, and is decided again; once the victim exits the
    model loads."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.releases = False  # its model server does not answer: only its exit frees the memory
        fx.stop_gate = asyncio.Event()
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.05)
        fx.clock.advance(c.config.exit_wait_s + 1)  # the victim's exit is overdue
        for _ in range(200):
            if any(e.kind == "load_failed" for e in c.events()):
                break
            await fx.run_for(0.01)
        failed = [e for e in c.events() if e.kind == "load_failed"]
        started = [p.model for p in fx.started]
        fx.stop_gate.set()
        await asyncio.wait_for(waiting, 2)
        return fx, failed, started

    fx, failed, started = run(scenario())
    assert len(failed) == 1 and failed[0].model == "b" and failed[0].reason.startswith("no_room:")
    assert "had not exited after 60 s" in failed[0].reason and "nothing was loaded" in failed[0].reason
    assert started == ["a"]  # never loaded beside the process still there
    assert fx.overcommits == [] and fx.log == [("start", "a"), ("exit", "a"), ("start", "b")]


def test_a_stop_that_cannot_confirm_the_exit_fails_the_placement_at_once():
    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.releases = False
        fx.stops_exit = False
        waiting = asyncio.create_task(c.acquire("b"))
        for _ in range(100):
            if any(e.kind == "load_failed" for e in c.events()):
                break
            await fx.run_for(0.01)
        await fx.run_for(0.1)  # b is placed again: it waits for a report showing the room, which a's process denies
        waiting.cancel()
        return c, fx

    c, fx = run(scenario())
    (failed,) = [e for e in c.events() if e.kind == "load_failed"][:1]
    assert "did not confirm their exit" in failed.reason
    assert [p.model for p in fx.started] == ["a"] and fx.overcommits == []
    assert not any(e.kind == "stopped" for e in c.events())


def test_a_node_report_short_of_the_room_holds_the_load_back_until_the_wait_fails():
    """a's process exits, but something else took the memory meanwhile: the report after the exit
    measures 4 GiB free, b needs 6: b never starts; after exit_wait_s the placement fails, and the
    request is refused against what the node reported."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.releases = False
        fx.stop_gate = asyncio.Event()
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)  # a is evicted for b; its stop waits
        fx.foreign["n1"] = 4 * GIB  # something else takes the memory meanwhile
        fx.stop_gate.set()
        await fx.run_for(0.1)
        held_back = [p.model for p in fx.started]
        fx.clock.advance(c.config.exit_wait_s + 1)
        with pytest.raises(OrchardError) as info:
            await asyncio.wait_for(waiting, 2)
        return c, fx, held_back, info.value

    c, fx, held_back, error = run(scenario())
    assert held_back == ["a"] and [p.model for p in fx.started] == ["a"] and fx.overcommits == []
    (failed,) = [e for e in c.events() if e.kind == "load_failed"]
    assert "did not show 6.0 GiB free" in failed.reason and "4.0 GiB free" in failed.reason
    assert error.code.startswith("model_")


def test_an_evicting_placement_loads_once_its_victim_has_released_its_memory_while_its_process_exits():
    """X1: a's model server stops its engine and measures what it gave back: b loads on that and a
    report asked for after it, while a's process (still holding its residual) exits beside the load.
    The residual is ours on the node until the exit: in what the node's agent is told we use, never
    foreign."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.release_gate, fx.stop_gate = asyncio.Event(), asyncio.Event()  # a releases, then exits, when the test says
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)
        before = [p.model for p in fx.started]
        fx.release_gate.set()
        lease = await asyncio.wait_for(waiting, 2)
        during = (list(fx.log), c.held_bytes("n1"), c.state.node("n1").foreign_bytes)
        fx.stop_gate.set()
        await fx.run_for(0.05)
        return c, fx, before, lease, during

    c, fx, before, lease, (log, held, foreign) = run(scenario())
    assert before == ["a"] and lease.model == "b" and fx.overcommits == []
    assert log == [("start", "a"), ("release", "a"), ("start", "b")]  # b loaded before a's process exited
    assert held == 6 * GIB + fx.residual and foreign == 0  # a's residual: ours until it exits
    assert fx.log[-1] == ("exit", "a") and c.held_bytes("n1") == 6 * GIB
    assert _kinds(c, "evicted", "placed", "released", "stopped", "loading", "loaded")[-6:] == [
        ("evicted", "a"),
        ("placed", "b"),
        ("released", "a"),
        ("loading", "b"),
        ("loaded", "b"),
        ("stopped", "a"),
    ]
    released = next(e for e in c.events() if e.kind == "released")
    assert released.bytes == 6 * GIB - fx.residual and "held by its process until it exits" in released.reason


def test_a_released_process_is_counted_until_it_exits_so_a_load_it_leaves_no_room_for_waits_for_the_exit():
    """a's process still holds 1.5 GiB after its release: the 8 GiB node shows 6.5 GiB free, b needs
    7: b waits for a's exit, then loads."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=7)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.residual = 3 * GIB // 2
        fx.stop_gate = asyncio.Event()
        waiting = asyncio.create_task(c.acquire("b"))
        await fx.run_for(0.1)
        held_back = (list(fx.log), c.state.node("n1").instance("b").status)
        fx.stop_gate.set()
        await asyncio.wait_for(waiting, 2)
        return fx, held_back

    fx, held_back = run(scenario())
    assert held_back == ([("start", "a"), ("release", "a")], "loading")  # placed, not started
    assert fx.log == [("start", "a"), ("release", "a"), ("exit", "a"), ("start", "b")] and fx.overcommits == []


def test_a_released_victim_whose_exit_is_not_confirmed_does_not_fail_the_placement_that_counted_on_its_release():
    """The exit that follows a's release cannot be confirmed: b, which waited on a's stop, loads on
    the release and a report that shows the room, and does not fail."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=1)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.stops_exit = False
        c.unload("a")
        lease = await asyncio.wait_for(c.acquire("b"), 2)
        await fx.run_for(0.05)
        return c, fx, lease

    c, fx, lease = run(scenario())
    assert lease.model == "b" and not any(e.kind == "load_failed" for e in c.events())
    assert fx.log == [("start", "a"), ("release", "a"), ("start", "b")]


def cached_node(c, fx, cache_gb: float, other_gb: float = 0.0) -> None:
    """a's kept prompt prefixes on n1 hold cache_gb (its process's memory), something else other_gb;
    the watcher's round reads both (the instance's memory report, then the node's)."""
    fx.caches[("a", "n1")] = int(cache_gb * GIB)
    fx.foreign["n1"] = int(other_gb * GIB)
    fx.report_caches("n1")
    fx.report("n1")


def test_kept_prompt_prefixes_are_given_back_before_a_model_is_evicted_for_room():
    """X4: n1 (8 GiB) holds a (3 GiB) and 3 GiB of a's kept prompt prefixes; b (4 GiB) does not fit
    as it is. The policy counts the caches as reclaimable: a gives them back, the load waits for
    that and a report showing the room, and b loads beside a: nothing is evicted. When the caches
    would free too little, a is evicted at once (its cache goes with it), with no shrink first."""

    async def scenario(cache_gb, b_gb=4.0, other_gb=0.0):
        c, fx = make([spec("a", gb=3), spec("b", gb=b_gb)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        cached_node(c, fx, cache_gb, other_gb)
        c.release((await asyncio.wait_for(c.acquire("b"), 2)).lease_id)
        await c.settle()
        return c, fx

    c, fx = run(scenario(3))
    assert fx.shrunk == [["a@n1#1"]] and [r.model for r, _ in fx.stopped] == [] and fx.overcommits == []
    assert {i.model for i in c.state.node("n1").instances} == {"a", "b"}
    (placed,) = [e for e in c.events() if e.kind == "placed" and e.model == "b"]
    assert "kept prompt prefixes" in placed.reason
    (shrunk,) = [e for e in c.events() if e.kind == "caches_shrunk"]
    assert (shrunk.model, shrunk.node_id, shrunk.bytes) == ("a", "n1", 3 * GIB)
    (loading,) = [e for e in c.events() if e.kind == "loading" and e.model == "b"]
    assert "its report measured" in loading.reason  # it waited for the shrink and a report after it
    c, fx = run(scenario(0.5, b_gb=4.5, other_gb=1.0))  # 3.5 GiB free, 4.0 with a's cache given back: a goes
    assert fx.shrunk == [] and [r.model for r, _ in fx.stopped] == ["a"] and fx.overcommits == []
    assert {i.model for i in c.state.node("n1").instances} == {"b"}


def test_a_cache_that_would_not_shrink_counts_as_other_memory_and_the_eviction_goes_ahead():
    """X4: a's 3 GiB of kept prefixes do not come back (its shrink frees nothing). The placement that
    counted on them fails at once, having loaded nothing; the bytes count as other processes' memory,
    so the request's next decision evicts a instead of asking it again, and b loads without
    overcommitting n1."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=4)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.stuck = {"a"}
        cached_node(c, fx, 3)
        c.release((await asyncio.wait_for(c.acquire("b"), 2)).lease_id)
        await c.settle()
        fx.report_caches("n1")  # a's memory report after that still says 3 GiB: not reclaimable now
        return c, fx

    c, fx = run(scenario())
    assert fx.shrunk == [["a@n1#1"]] and [r.model for r, _ in fx.stopped] == ["a"] and fx.overcommits == []
    assert [p.model for p in fx.started] == ["a", "b"]
    (failed,) = [e for e in c.events() if e.kind == "load_failed"]
    assert "gave back nothing" in failed.reason and failed.model == "b"
    (none,) = [e for e in c.events() if e.kind == "caches_shrunk"]
    assert none.bytes == 0 and "3.0 GiB" in none.reason

    async def pinned():  # a cannot be evicted: b is refused, and a's cache is not asked for again
        c, fx = make([spec("a", gb=3, pinned=True), spec("b", gb=4)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        fx.stuck = {"a"}
        cached_node(c, fx, 3)
        with pytest.raises(OrchardError):
            await asyncio.wait_for(c.acquire("b"), 2)
        cached_node(c, fx, 3)  # the next round: a's memory report still says 3 GiB
        return c, fx, c.what_if("b")

    c, fx, decision = run(pinned())
    assert fx.shrunk == [["a@n1#1"]] and decision.decision != "place"
    node = c.state.node("n1")
    assert node.instance("a").prefix_cache_bytes == 0 and node.foreign_bytes == 3 * GIB  # other processes' memory for now


def test_an_instances_kept_prefixes_are_its_memory_not_other_processes():
    """X4: the instance's reported prefix cache is in its footprint (`prefix_cache_bytes`, held_bytes,
    GET /v1/cluster's ours_bytes), and the node's foreign memory is only what is not ours."""
    from router.residency import views

    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 8),))
        c.release((await c.acquire("a")).lease_id)
        cached_node(c, fx, 2, other_gb=1)
        return c, views.cluster(c)

    c, view = run(scenario())
    node = c.state.node("n1")
    assert node.instance("a").prefix_cache_bytes == 2 * GIB and node.foreign_bytes == 1 * GIB
    assert c.held_bytes("n1") == 5 * GIB
    (listed,) = view["nodes"]
    assert listed["memory"]["ours_bytes"] == 5 * GIB and listed["memory"]["foreign_bytes"] == 1 * GIB
    assert listed["instances"][0]["prefix_cache_bytes"] == 2 * GIB


def test_a_placement_without_stops_on_its_node_loads_at_once():
    """Nothing stopping on the node: no report is waited for (a load costs no extra round)."""

    async def scenario():
        c, fx = make([spec("a", gb=3)])
        fx.auto_report = False
        await asyncio.wait_for(c.acquire("a"), 1)
        return c

    c = run(scenario())
    assert [e.reason for e in c.events() if e.kind == "loading"] == [""]


# ---- X2: the operator's state is stored in the order it changed -------------------------------


class SlowKV:
    """Ray's internal_kv functions over a dict; a put of a value in `slow` waits until the test
    releases it (a GCS call that takes a while), and `writing` is set when a put begins."""

    def __init__(self, slow: set[str]):
        self.data: dict[str, str] = {}
        self.gates = {value: threading.Event() for value in slow}
        self.writing = threading.Event()

    def release(self, value: str) -> None:
        self.gates[value].set()

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        self.writing.set()
        gate = self.gates.get(value)
        if gate is not None:
            assert gate.wait(30), "the test never released the slow write"
        self.data[key] = value

    def _internal_kv_del(self, key, namespace=None):
        self.data.pop(key, None)

    def _internal_kv_list(self, prefix, namespace=None):
        return [k.encode() for k in self.data if k.startswith(prefix)]

    def _internal_kv_get(self, key, namespace=None):
        return self.data.get(key.decode() if isinstance(key, bytes) else key)


def _service(c, kv, fx=None):
    """The residency service's operator actions over a controller and a store, without Ray."""
    svc = object.__new__(ResidencyService.func_or_class)  # its `sites` is the controller's
    svc.controller = c
    svc.store = OperatorStore(kv=kv)
    svc.effects = fx
    return svc


def test_a_pin_and_an_unpin_close_together_are_stored_in_the_order_they_were_made():
    """Issue 25 item 10: each write ran on a thread of its own, so the pin's slow write landed after
    the unpin's: the store said pinned while the controller said unpinned (and a restart believed it)."""

    async def scenario():
        c, fx = make([spec("a", gb=3)])
        kv = SlowKV({"true"})
        svc = _service(c, kv)
        pins = asyncio.gather(svc.pin("a", True), svc.pin("a", False))
        while not (kv.writing.is_set() and c.state.catalog["a"].pinned is False):  # both made, the pin's write under way
            await fx.run_for(0.01)
        kv.release("true")
        answers = await pins
        return c, svc.store, answers

    c, store, answers = run(scenario())
    assert [a["pinned"] for a in answers] == [True, False]
    assert c.state.catalog["a"].pinned is False and store.pins() == {"a": False}


def test_an_unload_right_after_a_load_is_stored_after_it():
    async def scenario():
        c, fx = make([spec("a", gb=3)])
        kv = SlowKV({"null"})  # the load's record (no node asked for) is slow to write
        svc = _service(c, kv)
        loading = asyncio.create_task(svc.load("a"))
        while not kv.writing.is_set():
            await fx.run_for(0.01)
        unloading = asyncio.create_task(svc.unload("a"))
        while c.state.node("n2").instance("a") is not None:  # the unload made, its write queued
            await fx.run_for(0.01)
        kv.release("null")
        unloaded, loaded = await unloading, await loading
        return c, svc.store, loaded, unloaded

    c, store, loaded, unloaded = run(scenario())
    assert loaded["status"] == "loaded" and unloaded["unloaded_from"] == ["n2"]
    assert c.state.node("n2").instance("a") is None and store.loads() == {}  # a restart does not load it again


# ---- X3: removing a node's files never races a placement that loads from them -----------------


def test_files_a_placement_on_the_node_loads_from_cannot_be_removed():
    async def scenario():
        c, fx = make([spec("a", gb=3), spec("a2", gb=3)])
        fx.gate = asyncio.Event()  # a's load is in progress
        waiting = asyncio.create_task(c.acquire("a"))
        await fx.run_for(0.05)
        with pytest.raises(OrchardError) as info:
            c.removals.begin("n2", frozenset({"a", "a2"}))  # a2 shares a's folder
        c.removals.begin("n1", frozenset({"a", "a2"}))  # nothing of theirs on n1
        with pytest.raises(OrchardError) as again:
            c.removals.begin("n1", frozenset({"a"}))
        fx.gate.set()
        await waiting
        return info.value, again.value

    error, again = run(scenario())
    assert error.code == "files_in_use" and error.status == 409 if hasattr(error, "status") else True
    assert "a is loading on n2 from these files (a placement in progress)" in error.message
    assert again.code == "files_in_use" and "already being removed" in again.message


def test_a_placement_never_chooses_a_node_its_files_are_being_removed_from():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 4), ("n2", 8)))  # pack would choose n1
        c.removals.begin("n1", frozenset({"a"}))
        lease = await asyncio.wait_for(c.acquire("a"), 1)
        c.release(lease.lease_id)
        with pytest.raises(OrchardError) as info:
            await c.load("a", "n1")  # the operator's load there is refused meanwhile
        return c, lease, info.value

    c, lease, error = run(scenario())
    assert lease.node_id == "n2" and error.code == "files_in_use"


def test_a_request_waits_while_its_only_node_is_losing_its_files_then_is_placed():
    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 8),))
        c.report_node("n1", devices=("metal", "cpu"), total_bytes=8 * GIB, usable_bytes=8 * GIB, free_bytes=8 * GIB, stored=frozenset({"a"}))
        c.removals.begin("n1", frozenset({"a"}))
        waiting = asyncio.create_task(c.acquire("a"))
        await fx.run_for(0.05)
        started = list(fx.started)
        c.removals.end("n1", frozenset({"a"}), removed=True)
        lease = await asyncio.wait_for(waiting, 1)
        return c, started, lease

    c, started, lease = run(scenario())
    assert started == [] and lease.node_id == "n1" and "a" not in c.state.node("n1").stored


class StoreEffects(FakeEffects):
    """The fake effects whose removal of a store folder takes until `removing` is set."""

    def __init__(self):
        super().__init__()
        self.entries = {
            name: ManifestEntry(
                name=name, kind="llm", path="llama", folder="llama", weight_bytes=3 * GIB, weights="real", architecture="x", source="x"
            )
            for name in ("a", "a2")
        }
        self.removing = asyncio.Event()

    async def remove_files(self, node_id, folder):
        await self.removing.wait()
        return True


def test_delete_files_and_a_request_for_a_model_loading_from_them_cannot_race():
    """Issue 25 item 10: DELETE .../files checked the node's instances and then awaited the agent;
    a request arriving meanwhile placed the model on that node, loading from the folder being
    removed. Now the request is placed elsewhere, and a removal of files a placement uses is a 409."""

    async def scenario():
        fx = StoreEffects()
        c = ResidencyController({s.name: s for s in (spec("a", gb=3), spec("a2", gb=3))}, PLAIN, fx, entries=fx.entries, clock=fx.clock)
        fx.controller = c
        fx.autopilot()
        store = StoreReport(root="/s", complete={"llama": 6 * GIB})
        for node_id, gb in (("n1", 4), ("n2", 8)):  # pack prefers n1
            c.report_node(
                node_id, devices=("metal", "cpu"), total_bytes=gb * GIB, usable_bytes=gb * GIB, free_bytes=gb * GIB, ray_node_id=node_id, store=store
            )
        svc = _service(c, SlowKV(set()), fx)
        deleting = asyncio.create_task(svc.delete_files("a", "n1"))
        await fx.run_for(0.01)
        lease = await asyncio.wait_for(c.acquire("a2"), 1)  # a2 loads from the same folder
        fx.removing.set()
        deleted = await deleting
        in_use = await svc.delete_files("a", "n2")  # a2 is on n2 from these files now
        return c, lease, deleted, in_use

    c, lease, deleted, in_use = run(scenario())
    assert lease.node_id == "n2" and deleted["removed"] is True
    assert "a" not in c.state.node("n1").stored and "a2" not in c.state.node("n1").stored
    assert in_use.code == "files_in_use" and "a2 is on n2 from these files" in in_use.message


def test_background_copies_and_pulls_take_the_loops_one_copy_path():
    """L4 through the loop: a requested model that n2's store lacks is copied there in the
    background (no placement), with its reason; a failed background copy is not tried on that node
    again within background_copy_retry_s; an operator's pull runs the same path and says why it failed."""
    config = PLAIN.model_copy(update={"background_copies": "requested", "background_copy_disk_reserve_bytes": 0, "background_copy_retry_s": 60})

    def store(c, node_id):
        """The store report of n2's agent: 100 GiB free, the folders the loop knows it holds."""
        node = c.state.node(node_id)
        return StoreReport(root="/s", free_bytes=100 * GIB, complete=dict.fromkeys(node.stored if node else (), GIB))

    async def scenario():
        c, fx = make([spec("a", gb=1), spec("b", gb=1)], nodes=(("n1", 8),), config=config)
        for node_id in ("n1", "n2"):
            stored = frozenset({"a", "b"}) if node_id == "n1" else frozenset()
            c.apply(
                NodeReported(
                    node_id=node_id,
                    devices=("metal", "cpu"),
                    total_bytes=8 * GIB,
                    usable_bytes=8 * GIB,
                    free_bytes=8 * GIB,
                    stored=stored,
                    store=StoreReport(root="/s", free_bytes=100 * GIB),
                )
            )
        for _ in range(2):
            c.release((await c.acquire("a")).lease_id)
            c.release((await c.acquire("b")).lease_id)
        fx.fail_fetch.add("b")
        c.tick()  # a and b are both asked for; n2 takes one copy at a time
        await fx.run_for(0.1)
        c.apply(
            NodeReported(node_id="n2", devices=("metal", "cpu"), total_bytes=8 * GIB, usable_bytes=8 * GIB, free_bytes=8 * GIB, store=store(c, "n2"))
        )
        c.tick()
        await fx.run_for(0.1)
        c.apply(
            NodeReported(node_id="n2", devices=("metal", "cpu"), total_bytes=8 * GIB, usable_bytes=8 * GIB, free_bytes=8 * GIB, store=store(c, "n2"))
        )
        c.tick()  # b failed on n2: not again within the retry period
        await fx.run_for(0.1)
        with pytest.raises(OrchardError) as pulled:
            await c.pull("b", "n2")
        return c, fx, pulled.value

    c, fx, pulled = asyncio.run(scenario())
    copies = [(m, n) for m, n, _ in fx.fetched]
    assert sorted(copies[:2]) == [("a", "n2"), ("b", "n2")] and copies[2:] == [("b", "n2")]  # the third is the pull
    assert all(why is not None and why.startswith("background copy, L4") for why in fx.background[:2]) and fx.background[2] is None
    assert "a" in c.state.node("n2").stored and "b" not in c.state.node("n2").stored
    assert c.state.node("n2").instances == ()  # copied, not placed
    assert pulled.code == "fetch_failed" and "sha256" in pulled.message


SPARES = PLAIN.model_copy(update={"spares_per_node": 1, "spare_bytes": GIB // 4})


async def _spares_ready(c, fx, nodes) -> None:
    c.tick()
    for _ in range(200):
        if all(n in c.spares.ready for n in nodes):
            return
        await fx.run_for(0.01)
    raise AssertionError(f"no spare on {nodes}: {[(n.node_id, n.spare_bytes) for n in c.state.nodes]}")


def test_r1_a_placement_loads_into_the_nodes_spare_and_a_new_spare_starts_after():
    """Rule R1 in the loop: every node with room gets a spare; a placement takes it (its load runs
    in that process, under the spare's name, counted once: no overcommit), and the next spare
    starts once the load is done."""

    async def scenario():
        c, fx = make([spec("a", gb=3)], config=SPARES)
        await _spares_ready(c, fx, ("n1", "n2"))
        spare = next(a for a, (node, _) in fx.spares.items() if node == "n2")
        lease = await c.acquire("a")
        for _ in range(200):
            if "n2" in c.spares.ready:
                break
            await fx.run_for(0.01)
        return c, fx, spare, lease

    c, fx, spare, lease = run(scenario())
    assert lease.node_id == "n2"
    assert c.sites.actors[("a", "n2")] == spare
    assert not fx.overcommits
    assert c.state.node("n2").spare_bytes == GIB // 4  # a new spare (4 GiB node: 3 for a, 0.25 for it)
    assert [k for k, n in fx.log if k == "spare"].count("spare") == 3 and spare not in fx.spares


def test_r1_no_spare_where_the_room_is_short():
    async def scenario():
        c, fx = make([spec("a", gb=3.6, overhead_bytes=GIB // 4)], config=SPARES)
        await _spares_ready(c, fx, ("n1", "n2"))
        await c.acquire("a")  # n2 (pack: it fits only with its spare as a's process), 0.15 GiB left, too little for another
        c.tick()
        await fx.run_for(0.1)
        return c, fx

    c, fx = run(scenario())
    assert c.state.node("n2").instance("a") is not None and c.state.node("n2").spare_bytes == 0
    assert fx.log.count(("spare", "n2")) == 1 and not any(node == "n2" for node, _ in fx.spares.values())


def test_r1_a_spare_taken_by_a_placement_that_never_loads_is_stopped_and_the_reservation_released():
    """A placement that took the node's spare waits for its victim to exit (X1); its last request
    goes away meanwhile: the placement is cancelled, and the spare stops with it."""

    async def scenario():
        c, fx = make([spec("a", gb=6), spec("b", gb=6)], nodes=(("n1", 8),), config=SPARES)
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        await _spares_ready(c, fx, ("n1",))
        spare = next(iter(fx.spares))
        fx.releases = False
        fx.stop_gate = asyncio.Event()  # a's process does not exit yet
        ask = asyncio.ensure_future(c.acquire("b"))
        await fx.run_for(0.05)
        taken = c.placements.spare_for.get(("b", "n1"), (None, None))[0]
        ask.cancel()
        await fx.run_for(0.05)
        return c, fx, spare, taken

    c, fx, spare, taken = run(scenario())
    assert taken == spare
    assert ("spare_stopped", "n1") in fx.log and spare not in fx.spares
    assert c.state.node("n1").instance("b") is None


def test_r1_a_placement_takes_a_spare_still_starting_and_its_load_waits_for_it():
    """A request that comes while the node's spare starts: its placement takes that spare (counted
    from its start) and loads once it is up, instead of starting a second process beside it."""

    async def scenario():
        c, fx = make([spec("a", gb=3)], nodes=(("n1", 8),), config=SPARES)
        fx.spare_gate = asyncio.Event()
        c.tick()
        await fx.run_for(0.02)
        counted = c.state.node("n1").spare_bytes  # the estimate, while it starts
        ask = asyncio.ensure_future(c.acquire("a"))
        await fx.run_for(0.05)
        before = list(fx.started)
        fx.spare_gate.set()
        lease = await ask
        return c, fx, counted, before, lease

    c, fx, counted, before, lease = run(scenario())
    assert counted == SPARES.spare_bytes and before == []  # no process of its own while the spare starts
    assert lease.node_id == "n1" and len(fx.spare_starts) == 1 and fx.log.count(("spare", "n1")) >= 1
    assert fx.log.index(("spare", "n1")) < fx.log.index(("start", "a"))


def _swap_on_one_node(config, refuse: bool = False):
    """a and b loaded on one 8 GiB node with spares on, then c, which needs one of them gone
    (`refuse`: the victim's process will not be a spare again)."""

    async def scenario():
        c, fx = make([spec("a", gb=3), spec("b", gb=3), spec("c", gb=3)], nodes=(("n1", 8),), config=config)
        await _spares_ready(c, fx, ("n1",))
        for model in ("a", "b"):
            c.release((await c.acquire(model)).lease_id)
            await _spares_ready(c, fx, ("n1",))
        starts = fx.log.count(("spare", "n1"))
        actors = dict(fx.actors)
        fx.no_spare_again = refuse
        lease = await c.acquire("c")
        for _ in range(300):
            if "n1" in c.spares.ready and any(e.kind == "stopped" for e in c.events()):
                break
            await fx.run_for(0.01)
        return c, fx, starts, actors, lease

    return run(scenario())


def test_r1_an_evicted_models_process_started_as_a_spare_is_the_nodes_next_spare():
    """A swap's victim gives its model's memory back (X1) and its process, started as a spare,
    becomes the node's spare instead of exiting: the next swap loads into a process that is ready
    at once, and no process is started for it."""
    c, fx, starts, actors, lease = _swap_on_one_node(SPARES)
    victim = next(e.model for e in c.events() if e.kind == "evicted")
    actor = actors[(victim, "n1")]
    assert lease.node_id == "n1" and ("spare_again", actor) in fx.log
    assert c.spares.ready["n1"].actor == actor and c.state.node("n1").spare_bytes == fx.residual
    assert fx.log.count(("spare", "n1")) == starts  # no process started after the swap
    assert ("exit", victim) not in fx.log and not fx.overcommits
    stopped = [e for e in c.events() if e.kind == "stopped" and e.model == victim]
    assert len(stopped) == 1 and "spare" in stopped[0].reason


@pytest.mark.parametrize("why", ["one model a process", "the process will not"])
def test_r1_a_process_that_held_its_most_models_or_will_not_be_a_spare_exits_and_a_new_spare_starts(why):
    once = SPARES.model_copy(update={"process_models_max": 1})
    c, fx, starts, actors, _ = _swap_on_one_node(once) if why == "one model a process" else _swap_on_one_node(SPARES, refuse=True)
    victim = next(e.model for e in c.events() if e.kind == "evicted")
    asked = [a for k, a in fx.log if k == "spare_again"]
    assert asked == ([] if why == "one model a process" else [actors[(victim, "n1")]])  # the policy asks no process to stay at 1
    assert ("exit", victim) in fx.log and fx.log.count(("spare", "n1")) == starts + 1
    assert c.spares.ready["n1"].actor != actors[(victim, "n1")] and c.state.node("n1").spare_bytes == SPARES.spare_bytes


async def _full_node_with_a_spare():
    """One node with room for two models of four, both loaded and a spare ready: (the loop, its
    effects, the actors so far, the spares started so far)."""
    c, fx = make([spec(m, gb=3) for m in "abcd"], nodes=(("n1", 8),), config=SPARES)
    await _spares_ready(c, fx, ("n1",))
    for model in ("a", "b"):
        c.release((await c.acquire(model)).lease_id)
        await _spares_ready(c, fx, ("n1",))
    return c, fx, dict(fx.actors), fx.log.count(("spare", "n1"))


def test_r1_a_placement_decided_without_a_spare_takes_the_victims_process_once_it_is_a_spare_again():
    """Two swaps at once on one node: c takes the node's spare, d finds none; the process of the
    model d evicts gives its memory back, is a spare again, and d loads into it: no process starts."""

    async def scenario():
        c, fx, before, starts = await _full_node_with_a_spare()
        leases = await asyncio.gather(c.acquire("c"), c.acquire("d"))
        return c, fx, before, starts, leases

    c, fx, before, starts, leases = run(scenario())
    assert [lease.model for lease in leases] == ["c", "d"] and not fx.overcommits
    assert fx.actors[("c", "n1")] not in before.values()  # the node's spare when c was placed
    assert fx.actors[("d", "n1")] in before.values()  # the process of a victim, a spare again
    assert fx.log.count(("spare", "n1")) == starts  # no process started for either


def test_r1_a_load_that_starts_while_the_victims_process_becomes_the_spare_waits_for_it_instead_of_starting_one():
    """The room is there (the victim gave its memory back) before the victim's process is the
    node's spare again: the load waits for that process, which is up, rather than starting a new
    one (1 s here, 12 s on a GPU)."""

    async def scenario():
        c, fx, before, starts = await _full_node_with_a_spare()
        fx.spare_again_gate = asyncio.Event()
        leases = asyncio.gather(c.acquire("c"), c.acquire("d"))
        await fx.run_for(0.3)
        loading_before_the_spare = [e.model for e in c.events() if e.kind == "loading"]
        fx.spare_again_gate.set()
        return c, fx, before, starts, await leases, loading_before_the_spare

    c, fx, before, starts, leases, loading_before_the_spare = run(scenario())
    assert [lease.model for lease in leases] == ["c", "d"] and not fx.overcommits
    assert "d" in loading_before_the_spare  # its load began while the victim's process was not yet a spare
    assert fx.actors[("d", "n1")] in before.values()  # ... and took that process once it was
    assert fx.log.count(("spare", "n1")) == starts  # no process started for either


@pytest.mark.parametrize("with_snapshot", [True, False])
def test_a_report_asked_before_a_swap_and_read_after_counts_no_instance_as_foreign(with_snapshot):
    """The watcher asks for a report, then a placement evicts a and waits to load c before the
    report comes back: what the node measured is held against what was ours when it was asked, so
    the evicted instance's bytes do not turn into foreign memory (they did, one instance's worth)."""

    async def scenario():
        c, fx = make([spec(m, gb=3) for m in "abc"], nodes=(("n1", 8),))
        for model in ("a", "b"):
            c.release((await c.acquire(model)).lease_id)
        used = c.held_bytes("n1")
        free = 8 * GIB - fx.held("n1")
        fx.stop_gate, fx.releases, fx.auto_report = asyncio.Event(), False, False  # a's stop and c's load wait
        ask = asyncio.ensure_future(c.acquire("c"))
        await fx.run_for(0.05)
        node = c.state.node("n1")
        c.report_node(
            "n1",
            devices=node.devices,
            total_bytes=node.total_bytes,
            usable_bytes=node.usable_bytes,
            free_bytes=free,
            ours_bytes=used if with_snapshot else None,
        )
        foreign = c.state.node("n1").foreign_bytes
        ask.cancel()
        return foreign

    foreign = run(scenario())
    assert foreign == 0 if with_snapshot else foreign == 3 * GIB  # without the snapshot, a's bytes read as someone else's
