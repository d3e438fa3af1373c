"""M1: a model reserves what its folder says before its first load, and what its engine measured
once it has loaded, a reload included (the residency loop driven by tests/support/loop.py's
in-memory effects; the engine's own measurement: tests/test_memory_matrix.py)."""

from support.builders import spec
from support.loop import PLAIN, make, run

from deployments.wire.measured import CacheShape, MeasuredMemory
from policy.config import GIB
from policy.memory import required_bytes
from router.residency.measured import measured_spec

MIB = 2**20


def gemma_like() -> MeasuredMemory:
    """One global layer of 1 KiB a token, five sliding layers (window 1024) of 5 KiB, some state."""
    cache = CacheShape(
        full_bytes_per_token=1024, window_bytes_per_token=5120, window_tokens=1024, state_bytes=3 * MIB, layers={"full": 1, "window": 5}
    )
    return MeasuredMemory(
        weight_bytes=2 * GIB, cache=cache, activation_bytes=300 * MIB, prefill_chunk=512, reserve_context_tokens=8192, reserve_concurrency=2
    )


def test_m1_a_loaded_model_reserves_what_its_engine_measured_from_then_on_a_reload_included():
    estimated = spec("a", gb=3, kv_bytes_per_token=6 * 1024, reserve_context_tokens=8192, reserve_concurrency=2)
    measured = gemma_like()

    async def scenario():
        c, fx = make([estimated], nodes=(("n1", 16),))
        fx.measured["a"] = measured
        lease = await c.acquire("a")
        first = fx.started[-1].bytes
        c.release(lease.lease_id)
        after_load = c.state.catalog["a"]
        c.unload("a")
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        return first, after_load, fx.started[-1].bytes

    first, after_load, second = run(scenario())
    assert first == required_bytes(estimated, PLAIN)  # before any load: the folder's figures
    assert after_load == measured_spec(estimated, measured)
    # the window holds 1024 + 511 tokens while prefilling, not 8192; the state once per sequence
    kv = 2 * (1024 * 8192 + 5120 * (1024 + 511) + 3 * MIB)
    assert after_load.kv_reserved_bytes == kv == measured.kv_reserved_bytes
    assert second == 2 * GIB + kv + 300 * MIB < first  # the reload reserves what was measured, not the estimate


def test_m1_a_measurement_made_once_idle_after_the_load_reaches_the_catalog_through_the_memory_reports():
    """A served engine measures its activations once idle (measure_idle_s): its load reports a
    provisional measurement, which nothing reserves by nor hands to the next load; the full one
    comes with a later memory report (CachesReported) and is reserved by from then on."""
    from router.residency.events import CachesReported

    estimated = spec("a", gb=3, kv_bytes_per_token=6 * 1024, reserve_context_tokens=8192, reserve_concurrency=2)
    measured = gemma_like().model_copy(update={"activation_bytes": 2 * GIB})  # more than the estimate's overhead
    provisional = measured.model_copy(update={"activation_bytes": 0, "provisional": True})

    async def scenario():
        c, fx = make([estimated], nodes=(("n1", 16),))
        fx.measured["a"] = provisional
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        after_load, known_after_load = c.state.catalog["a"], c.placements.measurements.get("a")
        held_after_load = c.state.node("n1").instance("a").bytes
        c.apply(CachesReported(node_id="n1", measured={"a": measured}))
        return (
            after_load,
            known_after_load,
            held_after_load,
            c.state.catalog["a"],
            c.placements.measurements.get("a"),
            c.state.node("n1").instance("a").bytes,
        )

    after_load, known_after_load, held_after_load, after_report, known, held = run(scenario())
    assert after_load == estimated and known_after_load is None  # a provisional measurement is no measurement
    assert held_after_load == required_bytes(estimated, PLAIN)  # the instance counted as its placement reserved
    assert after_report == measured_spec(estimated, measured) and known == measured  # the next load is given it (StartOrder.measured)
    assert held == measured.reserved_bytes > held_after_load  # ... and the instance holds what was measured from now on


def test_m1_the_same_measurement_again_leaves_the_catalog_as_it_was():
    from router.residency.measured import Measurements

    catalog = {"a": spec("a", gb=3)}
    m = Measurements()
    once = m.record(catalog, "a", gemma_like())
    assert once["a"].weight_bytes == 2 * GIB and m.record(once, "a", gemma_like()) is once
    assert m.record(once, "unknown", gemma_like()) is once  # a model the registry no longer lists


def test_m1_v1_cluster_shows_each_instances_estimate_beside_what_was_measured():
    from router.residency import views

    estimated = spec("a", gb=3, kv_bytes_per_token=6 * 1024, reserve_context_tokens=8192, reserve_concurrency=2)
    measured = gemma_like().model_copy(update={"estimated_weight_bytes": 3 * GIB, "estimated_cache": CacheShape(full_bytes_per_token=6 * 1024)})

    async def scenario():
        c, fx = make([estimated], nodes=(("n1", 16),))
        fx.measured["a"] = measured
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        return views.cluster(c)

    (instance,) = run(scenario())["nodes"][0]["instances"]
    assert instance["memory"]["estimated"] == {"weight_bytes": 3 * GIB, "kv_reserved_bytes": 2 * 6 * 1024 * 8192}
    assert instance["memory"]["measured"] == {
        "weight_bytes": 2 * GIB,
        "kv_reserved_bytes": measured.kv_reserved_bytes,
        "activation_bytes": 300 * MIB,
        "limit_bytes": measured.limit_bytes,
        "layers": {"full": 1, "window": 5},
    }


def test_m1_the_console_says_what_was_measured_beside_the_estimate():
    from router.console.view import ConsoleSettings, compose
    from router.residency import views

    estimated = spec("a", gb=3, kv_bytes_per_token=6 * 1024, reserve_context_tokens=8192, reserve_concurrency=2)
    measured = gemma_like().model_copy(update={"estimated_weight_bytes": 3 * GIB, "estimated_cache": CacheShape(full_bytes_per_token=6 * 1024)})

    async def scenario():
        c, fx = make([estimated], nodes=(("n1", 16),))
        fx.measured["a"] = measured
        lease = await c.acquire("a")
        c.release(lease.lease_id)
        return views.cluster(c), views.models(c)

    cluster, models = run(scenario())
    (instance,) = compose(cluster, models, ConsoleSettings(), now=cluster["now"]).instances
    assert instance.memory_words == (
        "measured: weights 2.0 GiB + KV 37 MiB + a step's activations 300 MiB (MLX limit 2.3 GiB); estimated: weights 3.0 GiB + KV 96 MiB"
    )


def test_m2_one_request_holds_at_most_one_share_of_the_kv_reservation():
    from deployments.engines.measure import refusal

    dense = MeasuredMemory(
        weight_bytes=GIB,
        cache=CacheShape(full_bytes_per_token=1024),
        activation_bytes=0,
        prefill_chunk=512,
        reserve_context_tokens=1000,
        reserve_concurrency=4,
    )
    # mlx-lm's buffers grow 256 tokens at a time: a share of 1,000 tokens holds 1,024, never 4 x 1,000
    # (a batch cache is as long as its longest row for every row)
    assert dense.longest_sequence() == 1024
    assert refusal(dense, 1023) is None and "at most 1023 prompt tokens a request" in (refusal(dense, 1024) or "")
    windows_only = dense.model_copy(update={"cache": CacheShape(window_bytes_per_token=1024, window_tokens=512, state_bytes=MIB)})
    assert windows_only.longest_sequence() >= 2**31  # a sliding window and fixed state hold the same at any length
    assert refusal(dense.model_copy(update={"reserve_context_tokens": 0}), 10**6) is None  # no KV reserved: nothing held to it
