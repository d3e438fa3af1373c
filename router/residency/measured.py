"""Reservations from the model as loaded (docs/residency.md, M1): once an instance has loaded, the
registry's figures for its model are replaced by what its engine measured (deployments/engines/
measure.py), kept per model and weights, so every later placement of it, a reload included,
reserves what it really holds instead of the folder's estimate.

The measurements outlive the controller (`MeasurementStore`): each is written to Ray's GCS
key-value store (namespace "orchard", where the operator's pins and loads are kept: operator_store.py)
as `<app>/measured/<model>`, and a restarted controller takes them back (`Measurements.attach`) for
the models whose registry entry still describes the same weights and reservation: the folder's
weight bytes and KV bytes per token as the engine's folder estimate saw them, the same reserved
context and concurrency. Anything else (other weights under the name, a new reservation) is
estimated again until its next load measures it."""

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.experimental import internal_kv

from cluster.ray_api import NAMESPACE
from deployments.wire.measured import MeasuredMemory
from policy import ModelSpec

log = logging.getLogger("orchard.residency")


def measured_spec(spec: ModelSpec, measured: MeasuredMemory) -> ModelSpec:
    """`spec` with the memory its engine measured: resident weights, the cache per layer kind (a
    window holding up to W - 1 + a prefill chunk), a step's activations at the reserved context."""
    cache = measured.cache
    return spec.model_copy(
        update={
            "weight_bytes": measured.weight_bytes,
            "kv_bytes_per_token": cache.full_bytes_per_token,
            "kv_window_bytes_per_token": cache.window_bytes_per_token,
            "kv_window_tokens": cache.window_tokens + measured.prefill_chunk - 1 if cache.window_tokens else 0,
            "kv_state_bytes": cache.state_bytes,
            "activation_bytes": measured.activation_bytes,
        }
    )


def describes(spec: ModelSpec, measured: MeasuredMemory) -> bool:
    """Whether a registry entry (its folder's figures, before any load) is of the weights and the
    reservation `measured` was taken of: the same weight bytes and KV bytes per token as the
    engine's folder estimate, the same reserved context and concurrency."""
    estimated = measured.estimated_cache
    return (
        estimated is not None
        and measured.estimated_weight_bytes == spec.weight_bytes
        and estimated.full_bytes_per_token == spec.kv_bytes_per_token
        and measured.reserve_context_tokens == spec.reserve_context_tokens
        and measured.reserve_concurrency == spec.reserve_concurrency
    )


class MeasurementStore:
    """Measurements in Ray's GCS key-value store (module docstring): one small write a measurement
    that changed, read once when a controller starts."""

    def __init__(self, app: str = "orchard", kv: Any = internal_kv):
        self.prefix = f"{app}/measured/"
        self.kv = kv  # Ray's internal_kv functions

    def put(self, model: str, measured: MeasuredMemory) -> None:
        try:
            self.kv._internal_kv_put(self.prefix + model, measured.model_dump_json(), overwrite=True, namespace=NAMESPACE)
        except Exception:  # the GCS unreachable for a moment: the figure in memory still holds
            log.exception("could not store the measurement of %s", model)

    def all(self) -> dict[str, MeasuredMemory]:
        found: dict[str, MeasuredMemory] = {}
        for key in self.kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            raw = self.kv._internal_kv_get(key, namespace=NAMESPACE)
            try:
                found[key.decode()[len(self.prefix) :]] = MeasuredMemory.model_validate(json.loads(raw))
            except (TypeError, ValueError) as e:  # gone since the listing, or of another version: measured again
                log.warning("stored measurement %s not used: %s", key, e)
        return found


class Measurements:
    """What each model's engine measured, by model and weights (a load of other weights under the
    same name measures again), and the catalog entries they make; kept in a MeasurementStore once
    `attach`ed to one."""

    def __init__(self) -> None:
        self._by_model: dict[str, MeasuredMemory] = {}
        self._store: MeasurementStore | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-measured")  # one: writes in order

    def attach(self, store: MeasurementStore, catalog: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        """Keep measurements in `store` from now on, and return `catalog` with what it held for each
        model whose entry still `describes` the measured weights and reservation (blocking: GCS reads)."""
        self._store = store
        taken = {model: m for model, m in store.all().items() if model in catalog and describes(catalog[model], m)}
        self._by_model.update(taken)
        return catalog | {model: measured_spec(catalog[model], m) for model, m in taken.items()}

    def record(self, catalog: dict[str, ModelSpec], model: str, measured: MeasuredMemory) -> dict[str, ModelSpec]:
        """The catalog with `model` reserving what was measured (the same catalog when nothing changed)."""
        known = self._by_model.get(model)
        spec = catalog.get(model)
        if spec is None or measured.provisional or (known is not None and known == measured):  # a provisional one: not measured yet
            return catalog
        self._by_model[model] = measured
        if self._store is not None:  # off the event loop, in the order measured
            self._writer.submit(self._store.put, model, measured)
        return catalog | {model: measured_spec(spec, measured)}

    def flush(self) -> None:
        """Wait for the writes started so far (tests, a stopping service)."""
        self._writer.submit(lambda: None).result()

    def get(self, model: str) -> MeasuredMemory | None:
        return self._by_model.get(model)


def side_by_side(measured: MeasuredMemory | None) -> dict[str, dict[str, int | dict[str, int]]] | None:
    """An instance's memory as its folder estimated it and as its engine measured it (/v1/cluster,
    the console); None before its model was measured."""
    if measured is None:
        return None
    return {
        "estimated": {"weight_bytes": measured.estimated_weight_bytes, "kv_reserved_bytes": measured.estimated_kv_reserved_bytes},
        "measured": {
            "weight_bytes": measured.weight_bytes,
            "kv_reserved_bytes": measured.kv_reserved_bytes,
            "activation_bytes": measured.activation_bytes,
            "limit_bytes": measured.limit_bytes,
            "layers": dict(measured.cache.layers),
        },
    }
