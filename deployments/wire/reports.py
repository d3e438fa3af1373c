"""What a model server reports about itself to whoever placed it (the residency service, which
adopts and accounts for instances by them; an operator's tools): the memory it holds, after a load
and on asking (`MemoryReport`), and its health (`HealthReport`). Engines make the first and the
core of the second (deployments/engine.py); the model server adds what only it knows."""

from typing import Literal

from pydantic import Field

from deployments.wire.measured import MeasuredMemory
from policy._frozen import Frozen
from policy.specs import ModelKind

EngineStatus = Literal["loading", "ready", "stopped", "failed", "spare"]  # spare: a process with no model yet (rule R1)


class MemoryReport(Frozen):
    """What the engine holds, in bytes, for the node agent and the residency controller: its
    weights, KV cache (of the requests running now, kept for reuse, reserved), this process's MLX
    memory, and how long its load took (`ModelServer.load` and `ModelServer.memory` answer it)."""

    weight_bytes: int = Field(ge=0)
    kv_bytes_in_use: int = Field(default=0, ge=0)  # KV of the requests running now
    prefix_cache_bytes: int = Field(default=0, ge=0)  # KV kept for reuse by later requests
    # What prefilling the kept prefixes again would take at this engine's measured prefill rate (0
    # before any prefill): part of what evicting the instance costs (policy rule E3).
    prefix_prefill_s: float = Field(default=0.0, ge=0)
    kv_bytes_reserved: int = Field(default=0, ge=0)
    active_bytes: int = Field(default=0, ge=0)  # mx.get_active_memory() of this process
    peak_bytes: int = Field(default=0, ge=0)
    load_seconds: float = Field(default=0.0, ge=0)
    # What the engine measured after its load (an LLM's; deployments/engines/measure.py), beside the
    # folder's estimate of the same: the residency service reserves by it from then on.
    measured: MeasuredMemory | None = None

    @property
    def held_bytes(self) -> int:
        """What the instance holds for placement's accounting: its weights and its KV reservation
        (measured: and a prefill step's activations)."""
        if self.measured is not None:
            return self.measured.reserved_bytes
        return self.weight_bytes + self.kv_bytes_reserved


class Health(Frozen):
    """An engine's health: its status (and why, when it failed), kind, model and running requests."""

    status: EngineStatus
    kind: ModelKind
    model: str
    detail: str = ""
    running_requests: int = 0


class HealthReport(Health):
    """A model server's health (`ModelServer.health`): its engine's, plus the Orchard node it serves
    on, its calls in flight (streams included), its Ray actor name (None outside Ray) and, for an
    LLM, the admission settings it runs (`LLMEngine.scheduling`)."""

    node_id: str
    in_flight: int = Field(ge=0)
    actor_name: str | None = None
    scheduling: dict[str, bool | int | float | str | None] | None = None  # LLMEngineOptions fields


class Released(Frozen):
    """What a model server gave back when it stopped its engine (`ModelServer.stop`, rule X1): the
    model, its batch and caches dropped and MLX's buffer cache cleared, measured in its own process
    before and after. Until the process has exited it still holds `held_bytes`; the rest is free."""

    # what the process held of its node's memory before the release (spare.process_bytes: its resident
    # memory on a Mac or a CPU node, its device memory on CUDA) ...
    process_before_bytes: int = Field(ge=0)
    process_bytes: int = Field(ge=0)  # ... and after it
    mlx_bytes: int = Field(ge=0)  # MLX's active memory and buffer cache after it (0: all given back)
    seconds: float = Field(ge=0)  # what the release took

    @property
    def held_bytes(self) -> int:
        """What the process holds until it exits: `process_bytes`, or MLX's own count where that
        is more (device memory a resident figure may not show)."""
        return max(self.process_bytes, self.mlx_bytes)

    @property
    def freed_bytes(self) -> int:
        return max(0, self.process_before_bytes - self.process_bytes)
