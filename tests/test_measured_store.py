"""M1: measurements outlive the residency service: kept in Ray's GCS key-value store and taken back
by a restarted controller while the registry still describes what was measured (Ray's real KV, in
the shared test cluster)."""

import pytest
from support.builders import spec
from test_measured_reservations import gemma_like

from deployments.wire.measured import CacheShape
from policy.config import GIB
from router.residency.measured import measured_spec

pytestmark = pytest.mark.cluster  # uses the shared Ray cluster: one worker runs these in turn (conftest.py)


def test_m1_measurements_outlive_the_controller_in_rays_key_value_store(shared_ray):
    from router.residency.measured import Measurements, MeasurementStore

    estimated = spec("a", gb=3, kv_bytes_per_token=6 * 1024, reserve_context_tokens=8192, reserve_concurrency=2)
    measured = gemma_like().model_copy(
        update={"weights_hash": "w1", "estimated_weight_bytes": 3 * GIB, "estimated_cache": CacheShape(full_bytes_per_token=6 * 1024)}
    )
    catalog = {"a": estimated, "b": spec("b", gb=1)}
    first = Measurements()
    assert first.attach(MeasurementStore(), catalog) == catalog  # nothing measured yet: the folders' figures
    first.record(catalog, "a", measured)
    first.flush()

    # a restarted controller: what the last one measured, before any load
    again = Measurements()
    adopted = again.attach(MeasurementStore(), catalog)
    assert adopted["a"] == measured_spec(estimated, measured) and adopted["b"] == catalog["b"]
    assert again.get("a") == measured
    # ... only while the registry describes the weights and reservation it was measured with
    for changed in ({"weight_bytes": 4 * GIB}, {"kv_bytes_per_token": 8 * 1024}, {"reserve_context_tokens": 4096}, {"reserve_concurrency": 4}):
        other = {"a": estimated.model_copy(update=changed)}
        assert Measurements().attach(MeasurementStore(), other) == other, changed
    assert Measurements().attach(MeasurementStore(app="another-app"), catalog) == catalog  # each app its own
