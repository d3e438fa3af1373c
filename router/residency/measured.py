"""Reservations from the model as loaded (docs/residency.md, M1): once an instance has loaded, the
registry's figures for its model are replaced by what its engine measured (deployments/engines/
measure.py), kept per model and weights, so every later placement of it, a reload included,
reserves what it really holds instead of the folder's estimate."""

from deployments.wire.measured import MeasuredMemory
from policy import ModelSpec


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


class Measurements:
    """What each model's engine measured, by model and weights (a load of other weights under the
    same name measures again), and the catalog entries they make."""

    def __init__(self) -> None:
        self._by_model: dict[str, MeasuredMemory] = {}

    def record(self, catalog: dict[str, ModelSpec], model: str, measured: MeasuredMemory) -> dict[str, ModelSpec]:
        """The catalog with `model` reserving what was measured (the same catalog when nothing changed)."""
        known = self._by_model.get(model)
        spec = catalog.get(model)
        if spec is None or (known is not None and known == measured):
            return catalog
        self._by_model[model] = measured
        return catalog | {model: measured_spec(spec, measured)}

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
